"""`fastverify topo` and `fastverify tune --predict` give one advice: for the same box and workload
their first recommendation (candidate, backend, settings) and its change are the same, on real
inputs from ../shared/inputs; topo's "what to do" names the ranked options in order; without a
topology topo still diagnoses and says in one line why there is no ranking.

The change is recomputed here from each document's own µs figures, (new - old) / old, so the test
holds whichever name tune's JSON gives its percentage field.
"""

from __future__ import annotations

import json

import pytest
from conftest import SHARED, cli

INPUTS = SHARED / "inputs"
pytestmark = pytest.mark.skipif(not INPUTS.is_dir(), reason=f"{INPUTS} not found (../shared beside the repo)")

SEED = "topo-nccl-tests-307.txt"

# (topology, extra flags, --sm, --pcie-gen): the seed box, a second box, and the seed box with its NCCL log
CASES = [
    (SEED, [], 120, 5),
    ("topo-blog-chlc-rtx4090.txt", [], 89, 4),
    (SEED, ["--nccl-log", "nccldebug-nccl-tests-307.txt"], 89, 4),
]


def _flags(topology: str, extra: list[str], sm: int, gen: int) -> list[str]:
    out = [
        "--topology",
        INPUTS / topology,
        "--model",
        "kimi-k2",
        "--tp",
        "8",
        "--draft-tokens",
        "4",
        "--batch",
        "1",
        "--sm",
        str(sm),
        "--pcie-gen",
        str(gen),
    ]
    for i in range(0, len(extra), 2):
        out += [extra[i], INPUTS / extra[i + 1]]
    return out


def _tune_first(doc: dict) -> tuple[dict, float]:
    """tune's first candidate and its change (%) from its own µs figures."""
    first = doc["candidates"][0]
    base = doc["baseline"]["allreduce_us_per_step"]
    return first, 100.0 * (first["allreduce_us_per_step"] - base) / base


@pytest.mark.parametrize("topology,extra,sm,gen", CASES, ids=["seed-sm120", "chlc-rtx4090-sm89", "seed-with-log"])
def test_topo_and_tune_recommend_the_same_first_option(topology, extra, sm, gen, capsys):
    flags = _flags(topology, extra, sm, gen)
    rc, out, err = cli(["topo", *flags, "--json"], capsys)
    assert rc == 0, err
    topo = json.loads(out)
    rc, out, err = cli(["tune", "--predict", *flags, "--json"], capsys)
    assert rc == 0, err
    tune = json.loads(out)
    first, change = _tune_first(tune)
    advice = topo["advice"]
    assert advice[0]["rank"] == 1
    assert (advice[0]["candidate"], advice[0]["backend"], advice[0]["settings"]) == (
        first["name"],
        first["backend"],
        first["settings"],
    )
    assert advice[0]["allreduce_us"] == pytest.approx(first["allreduce_us_per_step"], rel=1e-6)
    base = next(a for a in advice if a["is_baseline"])
    assert base["allreduce_us"] == pytest.approx(tune["baseline"]["allreduce_us_per_step"], rel=1e-6)
    # topo's own change, and its sign: new - old over old, negative = less time
    assert advice[0]["change_pct"] == pytest.approx(change, abs=0.01)
    assert advice[0]["change_pct"] == pytest.approx(
        100.0 * (advice[0]["allreduce_us"] - base["allreduce_us"]) / base["allreduce_us"], abs=0.01
    )
    # the whole ranked order agrees, not only the first
    tune_order = [(c["backend"], c["settings"]) for c in tune["candidates"] if c["candidate"] is not None]
    assert [(a["backend"], a["settings"]) for a in advice if a["rank"] is not None] == tune_order


def test_seed_box_text_calls_pcie_ipc_too_close_and_names_the_p2p_level(capsys):
    """pcie_ipc's point (the P2P kernel model: 7.5 us + 7 x 57,344 B / 63 GB/s = 13.87 us, x 123
    all-reduces = 1,706.2 us per step, -71.2 % against 5,932.0) is listed first, but its range
    reaches NCCL's, so it is too close to call; NCCL_P2P_LEVEL=SYS at -2.9 % is the decided option."""
    rc, out, err = cli(
        ["topo", "--topology", INPUTS / SEED, "--sm", "120", "--pcie-gen", "5", "--model", "kimi-k2", "--tp", "8"],
        capsys,
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("# box: SM 120 (--sm), PCIe Gen 5 (--pcie-gen)")
    text = " ".join(out.split())
    todo = text[text.index("what to do:") : text.index("GPU pairs")]
    assert 123 * (7.5 + 7 * 57344 / 63000) == pytest.approx(1706.2, abs=0.05)
    assert "1. pcie_ipc (FlashInfer PCIe IPC all-reduce): too close to call: measure (its predicted range " in todo
    assert "reaches NCCL_P2P_LEVEL=SYS's " in todo
    assert "at its point -71.2 %, predicted by the P2P kernel model (its misses on 9 published boxes)" in todo
    assert "2. NCCL_P2P_LEVEL=SYS: -2.9 % per verify step (5.757 ms vs 5.932 ms now)" in todo
    assert "123 all-reduces per verify step" in todo  # Kimi-K2: 1 embedding + 2 x 61 layers
    assert "within the model's error" in todo
    assert "unknown from this input: driver P2P" in todo and "ACS/IOMMU" in todo
    # the old advice that made NCCL_P2P_LEVEL=SYS the thing to do is gone
    assert "try NCCL_P2P_LEVEL=SYS" not in text
    assert "best level: SYS (option 2 of the ranking below, -2.9 %)" in text


def test_without_model_the_figures_are_per_all_reduce(capsys):
    # --batch 1: one verify size, 1 x 4 x 7168 x 2 = 57,344 B; no counts per step
    rc, out, err = cli(
        ["topo", "--topology", INPUTS / SEED, "--sm", "120", "--pcie-gen", "5", "--batch", "1", "--json"], capsys
    )
    assert rc == 0, err
    doc = json.loads(out)
    # first pcie_ipc at the kernel model's point, too close to call; then NCCL's P2P level
    ipc, level = doc["advice"][0], doc["advice"][1]
    assert ipc["backend"] == "pcie_ipc" and ipc["rank"] == 1
    assert ipc["too_close"].startswith("pcie_ipc: too close to call: measure (its predicted range ")
    assert level["backend"] == "nccl" and level["settings"] == {"NCCL_P2P_LEVEL": "SYS"} and level["too_close"] is None
    # one all-reduce of 57,344 B, not a step: 1 x the per-call time
    assert ipc["allreduce_us"] == pytest.approx(7.5 + 7 * 57344 / 63000, abs=1e-3)
    assert all(a["per_verify_step"] is False for a in doc["advice"])
    assert level["allreduce_us"] < level["baseline_us"]
    assert any(
        "counts per verify step are unknown without --model" in n and "57,344 B" in n for n in doc["advice_notes"]
    )


def test_only_an_nccl_log_gives_a_diagnosis_and_one_line_why_no_ranking(capsys):
    rc, out, err = cli(["topo", "--nccl-log", INPUTS / "nccldebug-nccl-1027.txt"], capsys)
    assert rc == 0, err
    assert out.splitlines()[0].startswith("# box:")
    assert "GPU pairs" in out and "3-4" in out  # the diagnosis: the log's SHM hop
    why = [line for line in out.splitlines() if "no ranking of options" in line]
    assert len(why) == 1 and "topology is unknown" in why[0]
    rc, out, err = cli(["topo", "--nccl-log", INPUTS / "nccldebug-nccl-1027.txt", "--json"], capsys)
    doc = json.loads(out)
    assert doc["advice"] is None and len(doc["advice_notes"]) == 1
    assert doc["pairs"]


def test_several_batches_with_a_model_is_one_line_exit_2(capsys):
    from conftest import one_line_error

    rc, out, err = cli(["topo", "--topology", INPUTS / SEED, "--model", "kimi-k2", "--batch", "1", "2"], capsys)
    one_line_error(rc, out, err, "--batch 1 2", "one batch size")
    rc, out, err = cli(["topo", "--topology", INPUTS / SEED, "--tp", "16"], capsys)
    one_line_error(rc, out, err, "--tp 16", "8 GPUs")
