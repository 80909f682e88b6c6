"""``tune`` output a person can read: the decision and its evidence in a few lines (the rest behind
``--explain``), settings never cut in the table, CPU wall-clock tables in ms, and one sign for a
change: new vs baseline, negative = less time (``change_pct`` in the JSON)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import SHARED, cli

TOPO_307 = SHARED / "inputs" / "topo-nccl-tests-307.txt"
SEED = [
    "tune",
    "--predict",
    "--topology",
    str(TOPO_307),
    "--model",
    "kimi-k2",
    "--tp",
    "8",
    "--sm",
    "120",
    "--pcie-gen",
    "5",
    "--tok-s",
    "82",
    "--accept-length",
    "3",
]
needs_topo = pytest.mark.skipif(not TOPO_307.is_file(), reason="../shared/inputs is absent on this machine")


def _seed(capsys, *extra) -> list[str]:
    rc, out, err = cli(SEED + list(extra), capsys)
    assert rc == 0, err
    return out.splitlines()


def _table_rows(lines: list[str]) -> list[list[str]]:
    """The table's body rows, split into cells (a row's continuation lines included)."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in lines if line.startswith("│")]


def _settings_of(doc) -> set[str]:
    """Every ``NAME=value`` the document's candidates set (a setting, whole)."""
    return {f"{k}={v}" for c in doc["candidates"] for k, v in c["settings"].items()}


def _keys(obj) -> set[str]:
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in _keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in _keys(v)}
    return set()


@needs_topo
def test_the_seed_command_prints_the_decision_in_twenty_lines(capsys):
    lines = _seed(capsys)
    assert len(lines) <= 20, "\n".join(lines)
    assert lines[0] == "# box: SM 120 (--sm), PCIe Gen 5 (--pcie-gen), 8 GPUs (topology)"
    assert lines[1].startswith("# model kimi-k2, tp 8") and str(TOPO_307) in lines[1] and "NCCL" in lines[1]
    assert "change = new vs baseline, - = less time" in "\n".join(lines)
    rows = _table_rows(lines)
    ranked = [r for r in rows if r[0].isdigit()]
    # the top candidates with their labels (one fewer per unranked backend: 5 - 1): pcie_ipc first at
    # its point, the cost model's NCCL_P2P_LEVEL=SYS next, the baseline among them; b12x (no published
    # data) listed, never ranked
    assert [r[0] for r in ranked] == ["1", "2", "3", "4"] and ranked[0][1] == "pcie_ipc"
    assert ranked[1][1] == "NCCL_P2P_LEVEL=SYS"
    assert all(r[2] == "predicted" for r in ranked)
    assert any(r[4] == "baseline" for r in ranked)
    unranked = [r for r in rows if r[0] == "-"]
    assert [r[1] for r in unranked] == ["b12x (no published data)"]
    assert all(r[3] == "-" and r[4] == "-" for r in unranked)
    assert any(ln.startswith("per size: 57 KB too close to call: measure") for ln in lines)
    assert any(ln.startswith("pcie_ipc: too close to call: measure (its predicted range ") for ln in lines)
    winner = [ln for ln in lines if ln.startswith("winner: ")]
    assert len(winner) == 1 and winner[0].startswith("winner: NCCL_P2P_LEVEL=SYS: all-reduce per verify step ")
    assert "(predicted)" in winner[0] and re.search(r", -\d+\.\d %", winner[0])
    verify = next(ln for ln in lines if ln.startswith("verify step: "))
    assert "(predicted)" in verify and "upper bound" in verify
    tok = next(ln for ln in lines if ln.startswith("tok/s per stream"))
    assert "82.0 (measured-by-user) ->" in tok and "(predicted;" in tok
    # the winner needs no P2P and the backend is unknown: the next step is to measure on the box
    nxt = [ln for ln in lines if ln.startswith("next: ")]
    assert nxt == ["next: measure on the box: `fastverify tune --model kimi-k2 --tp 8 --write-env`"]
    assert lines[-1].endswith(": --explain shows them") and "2 backends ruled out" in lines[-1]
    # the derivations are not in these lines
    assert not any(ln.startswith(("# evidence", "# note", "# not a candidate")) for ln in lines)


@needs_topo
def test_explain_shows_the_evidence_and_the_backends_ruled_out(capsys):
    lines = _seed(capsys, "--explain")
    text = " ".join(" ".join(lines).split())
    assert "# evidence (candidate 1): P2P kernel model: 7.5 µs latency" in text
    assert "range: the point x/÷ its misses on 9 published boxes" in text
    assert "# per size 57,344 B x 123: pcie_ipc 13.9 µs (" in text  # 7.5 + 7 x 57,344 / 63,000
    assert "# not a candidate: fused: SGLang calls it only on SM90/SM100; this box is SM120" in text
    assert "disagree" in text and "range µs" in text
    assert len([r for r in _table_rows(lines) if r[0].isdigit()]) == 9  # every ranked candidate (8 NCCL, pcie_ipc)


@needs_topo
@pytest.mark.parametrize("explain", [[], ["--explain"]])
def test_no_setting_is_cut_in_the_table(capsys, explain):
    rc, out, _ = cli(SEED + ["--json"], capsys)
    whole = _settings_of(json.loads(out))
    assert "NCCL_PROTO=allreduce:simple" in whole
    lines = _seed(capsys, *explain)
    cells = [r[1] for r in _table_rows(lines)]
    tokens = [t for cell in cells for t in cell.split() if "NCCL_" in t]
    assert tokens, cells
    for t in tokens:
        assert re.fullmatch(r"NCCL_[A-Z0-9_]+=\S+", t) and t in whole, t
    # one setting per line: a cell holds at most one
    assert all(cell.count("NCCL_") <= 1 for cell in cells)


@needs_topo
def test_change_pct_is_new_vs_baseline_in_the_json(capsys):
    rc, out, _ = cli(SEED + ["--json"], capsys)
    assert rc == 0
    doc = json.loads(out)
    assert doc["schema_version"] == 2 and "vs_baseline_pct" not in _keys(doc)
    base_us = doc["baseline"]["allreduce_us_per_step"]
    win = next(c for c in doc["candidates"] if c["name"] == doc["winner"])
    assert win["backend"] == "nccl" and win["settings"] == {"NCCL_P2P_LEVEL": "SYS"}
    assert win["allreduce_us_per_step"] < base_us
    assert win["change_pct"] < 0  # faster: less time
    assert win["change_pct"] == pytest.approx((win["allreduce_us_per_step"] - base_us) / base_us * 100, abs=0.01)
    assert doc["baseline"]["change_pct"] == 0.0
    for c in doc["candidates"]:
        t = c["allreduce_us_per_step"]
        if t is None:
            assert c["change_pct"] is None
        else:
            assert c["change_pct"] == pytest.approx((t - base_us) / base_us * 100, abs=0.01)
            assert (c["change_pct"] > 0) == (t > base_us)
    assert doc["notes"] is not None and any("disagree" in n for c in doc["candidates"] for n in c["notes"])


@needs_topo
def test_the_user_figures_keep_their_label_in_the_short_output(capsys):
    lines = _seed(capsys, "--verify-ms", "30", "--allreduce-ms", "25")
    assert len(lines) <= 20, "\n".join(lines)
    text = " ".join(" ".join(lines).split())
    assert "25,000.0 µs (measured-by-user) ->" in text and "30.000 ms (measured-by-user) ->" in text
    assert "(upper bound)" in text and "measured-by-user" in text.split("┃")[-1]


def test_cpu_measure_table_is_in_ms(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(
        ["tune", "--model", "tiny", "--tp", "2", "--top", "0", "--iters", "2", "--warmup", "0", "--journal", "j.jsonl"],
        capsys,
    )
    assert rc == 0, err
    title = next(ln for ln in out.splitlines() if ln.startswith("all-reduce time per verify step, ranked"))
    assert "CPU wall clock, not GPU time" in title
    table = [ln for ln in out.splitlines() if ln[:1] in "┃│"]
    assert any("step ms (CPU/gloo)" in ln for ln in table) and not any("µs" in ln for ln in table)
    numbers = [float(n.replace(",", "")) for ln in table for n in re.findall(r"\d[\d,]*\.\d+", ln)]
    assert numbers and all(n < 1_000_000 for n in numbers)
    # a value in ms has 3 decimals
    row = next(ln for ln in table if "current environment" in ln)
    assert re.search(r"│ +\d[\d,]*\.\d{3} │ +baseline │", row)
