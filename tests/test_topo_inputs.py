"""Every file in ../shared/inputs through `fastverify topo` gives exit 0 and a report of what it holds
(issue 11, Done-when bullet 2). The option is chosen from the file's content, so a file added to the
folder later is covered too; the values checked below were read off the files by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHARED, run_fastverify

INPUTS = SHARED / "inputs"


def _files() -> list[Path]:
    return sorted(p for p in INPUTS.iterdir() if p.is_file()) if INPUTS.is_dir() else []


def _option(path: Path) -> str:
    """The topo option for a file, from what it holds (not its name)."""
    text = path.read_text(errors="replace")
    if "NCCL INFO" in text and " busbw" not in text:
        return "--nccl-log"
    if "busbw" in text and "size" in text:
        return "--perf-table"
    if "GPU0" in text:
        return "--nvidia-smi"
    raise AssertionError(f"{path.name}: not an nvidia-smi topo -m text, an NCCL log or an all_reduce_perf table")


# What each known file holds, read off it by hand: (n_gpus, facts in the terminal report).
KNOWN = {
    "allreduceperf-blog-chlc-rtx4090-p2pdisabled.txt": (
        8,
        [
            "25 sizes 8-134,217,728 B, 8 ranks on NVIDIA GeForce RTX 4090, float sum",
            "38.83 µs at the smallest",
            "16253 µs at the largest",
            "peak busBw 15.04 GB/s at 33,554,432 B",
            "average busBw 4.85265 GB/s",
        ],
    ),
    "allreduceperf-blog-chlc-rtx4090-p2punlocked.txt": (
        8,
        [
            "25 sizes 8-134,217,728 B, 8 ranks",
            "38.82 µs at the smallest",
            "11382 µs at the largest",
            "peak busBw 20.64 GB/s at 134,217,728 B",
            "average busBw 6.11168 GB/s",
        ],
    ),
    # ring 0..7: 3->4 SHM, the other hops P2P
    "nccldebug-nccl-1027.txt": (8, ["│ 3-4 │", "SHM", "seen in log", "0-1 1-2 2-3 5-6 6-7"]),
    # GRAPH path dump: GPUs 4-7 (ce000, cf000, d0000, d1000) PHB to each other
    "nccldebug-nccl-tests-307.txt": (4, ["4-5 4-6 4-7 5-6 5-7 6-7", "PHB"]),
    # pcie_ipc first at its point, but its range reaches NCCL's: too close to call
    "topo-blog-chlc-rtx4090.txt": (
        8,
        [
            "SYS",
            "best level: SYS",
            "2. NCCL_P2P_LEVEL=SYS",
            "1. pcie_ipc (FlashInfer PCIe IPC all-reduce): too close to call: measure",
        ],
    ),
    "topo-nccl-tests-307.txt": (
        8,
        [
            "PIX",
            "SYS",
            "best level: SYS",
            "2. NCCL_P2P_LEVEL=SYS",
            "1. pcie_ipc (FlashInfer PCIe IPC all-reduce): too close to call: measure",
        ],
    ),
}


@pytest.mark.skipif(not INPUTS.is_dir(), reason=f"{INPUTS} not found (../shared beside the repo)")
@pytest.mark.parametrize("path", _files(), ids=lambda p: p.name)
def test_every_shared_input_gives_a_report(path: Path, tmp_path):
    opt = _option(path)
    proc = run_fastverify(["topo", opt, str(path)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr == ""
    out = " ".join(proc.stdout.split())  # the report wraps long lines at spaces
    assert f"from {path}" in out
    js = run_fastverify(["topo", opt, str(path), "--json"], cwd=tmp_path)
    assert js.returncode == 0, js.stderr
    d = json.loads(js.stdout)
    if opt == "--perf-table":
        assert d["perf_table"]["rows"] > 0 and d["measured"], d
        assert d["measured"][0]["label"] == "measured"
    else:
        assert d["pairs"], d
    if path.name in KNOWN:
        n, facts = KNOWN[path.name]
        assert d["n_gpus"] == n
        for fact in facts:
            assert fact in out, (fact, proc.stdout)


@pytest.mark.skipif(not INPUTS.is_dir(), reason=f"{INPUTS} not found (../shared beside the repo)")
def test_the_folder_holds_the_known_files():
    # a missing file would quietly shrink the parametrised test above
    assert set(KNOWN) <= {p.name for p in _files()}
