"""One sign, one field: every change fastverify prints or writes is new vs old,
``change_pct = (new - old) / old x 100``, so a negative change is less time, in tune's and topo's
JSON and text and in the verify-log report's JSON and text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli

TOPO = Path(__file__).resolve().parents[2] / "shared" / "inputs" / "topo-nccl-tests-307.txt"
BOX = ["--topology", str(TOPO), "--model", "kimi-k2.5", "--tp-size", "8", "--sm", "120", "--pcie-gen", "5"]


def _need_topology():
    if not TOPO.exists():
        pytest.skip(f"{TOPO} is absent (../shared holds the real topology inputs)")


def test_tune_and_topo_json_and_text_share_the_sign(capsys):
    _need_topology()
    rc, out, err = cli(["tune", "--predict", *BOX, "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    base = doc["baseline"]["allreduce_us_per_step"]
    for c in doc["candidates"]:
        if c.get("allreduce_us_per_step") is None:
            continue
        new = c["allreduce_us_per_step"]
        assert c["change_pct"] == pytest.approx((new - base) / base * 100, abs=0.06), c["name"]
        assert (c["change_pct"] < 0) == (new < base), c["name"]
    winner = next(c for c in doc["candidates"] if c["name"] == doc["winner"])
    assert winner["change_pct"] < 0
    rc, text, err = cli(["tune", "--predict", *BOX], capsys)
    assert f"{winner['change_pct']:+.1f} %" in text and "- = less time" in text
    rc, out, err = cli(["topo", *BOX, "--json"], capsys)
    advice = json.loads(out)["advice"]
    entry = next(a for a in advice if a["candidate"] == winner["name"])
    assert entry["change_pct"] == winner["change_pct"] and entry["too_close"] is None
    rc, text, err = cli(["topo", *BOX], capsys)
    assert f"{entry['rank']}. {winner['name']}: {winner['change_pct']:+.1f} % per verify step" in text


def _records(folder: Path, ms: float) -> None:
    folder.mkdir()
    for rank in (0, 1):
        lines = [
            json.dumps(
                {
                    "step": i,
                    "verify_ms": ms + i,
                    "clock": "cuda_events",
                    "rank": str(rank),
                    "pid": 7,
                    "allreduce_paths": None,
                    "batch": 2,
                    "tokens": 8,
                }
            )
            for i in range(5)
        ]
        (folder / f"verify-rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_verify_log_change_is_after_vs_before(tmp_path, capsys):
    # before: 20..24 ms (p50 22), after: 10..14 ms (p50 12): -10 ms, (12 - 22) / 22 = -45.45 %
    _records(tmp_path / "before", 20.0)
    _records(tmp_path / "after", 10.0)
    out_json = tmp_path / "report.json"
    rc, text, err = cli(
        ["profile", "--verify-log", str(tmp_path / "before"), str(tmp_path / "after"), "--output", str(out_json)],
        capsys,
    )
    assert rc == 0, err
    doc = json.loads(out_json.read_text())
    pooled = next(c for c in doc["change"] if c["rank"] == "all")
    assert pooled["p50_change_ms"] == pytest.approx(-10.0)
    assert pooled["change_pct"] == pytest.approx((12 - 22) / 22 * 100, abs=1e-3)
    assert "- = less time" in text and "-45.5" in text
    # and the other way round: slower after is positive
    rc, text, err = cli(
        [
            "profile",
            "--verify-log",
            str(tmp_path / "after"),
            str(tmp_path / "before"),
            "--output",
            str(tmp_path / "r2.json"),
        ],
        capsys,
    )
    pooled = next(c for c in json.loads((tmp_path / "r2.json").read_text())["change"] if c["rank"] == "all")
    assert pooled["change_pct"] == pytest.approx((22 - 12) / 12 * 100, abs=1e-3) and pooled["change_pct"] > 0
