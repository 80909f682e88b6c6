"""Merging traces (issue 12, item 5): traces that cannot be the ranks of one run are refused,
naming both files, unless ``profile --force`` (then merged with a warning)."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import assert_user_error, run_fastverify

from fastverify.errors import UserError
from fastverify.trace.load import load_traces

AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _write(path, rank, world, gpu, nccl="2.21.5", backend="nccl", ar_dur=10):
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 0, "dur": 5, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": AR, "pid": 0, "tid": 7, "ts": 10, "dur": ar_dur, "args": {"stream": 7}},
    ]
    doc = {
        "traceEvents": events,
        "deviceProperties": [{"id": 0, "name": gpu}],
        "distributedInfo": {"rank": rank, "world_size": world, "nccl_version": nccl, "backend": backend},
    }
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def test_b200_world8_and_a100_world128_are_refused_naming_both(tmp_path):
    """The issue's case. Before: merged into one 'world_size 128' profile with a straggler."""
    a = _write(tmp_path / "b200-TP-0.json.gz", 0, 8, "NVIDIA B200")
    b = _write(tmp_path / "a100-TP-1.json.gz", 1, 128, "NVIDIA A100-SXM4-80GB", ar_dur=40)
    with pytest.raises(UserError) as err:
        load_traces([a, b])
    line = str(err.value)
    assert "\n" not in line and str(a) in line and str(b) in line
    assert "world_size differs: 8" in line and "128" in line and "--force" in line


def test_different_gpu_models_same_world_are_refused(tmp_path):
    a = _write(tmp_path / "x-TP-0.json.gz", 0, 2, "NVIDIA H100 80GB HBM3")
    b = _write(tmp_path / "x-TP-1.json.gz", 1, 2, "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"GPU model \(deviceProperties\) differs: 'NVIDIA H100 80GB HBM3' in "):
        load_traces([a, b])


@pytest.mark.parametrize("kw, what", [({"nccl": "2.18.1"}, "nccl_version"), ({"backend": "gloo"}, "backend")])
def test_inconsistent_distributed_info_is_refused(tmp_path, kw, what):
    a = _write(tmp_path / "x-TP-0.json.gz", 0, 2, "NVIDIA L40S")
    b = _write(tmp_path / "x-TP-1.json.gz", 1, 2, "NVIDIA L40S", **kw)
    with pytest.raises(UserError, match=f"distributedInfo.{what} differs"):
        load_traces([a, b])


def test_one_run_still_merges(tmp_path):
    a = _write(tmp_path / "x-TP-0.json.gz", 0, 2, "NVIDIA L40S")
    b = _write(tmp_path / "x-TP-1.json.gz", 1, 2, "NVIDIA L40S", ar_dur=30)
    ranks = load_traces([a, b])
    assert [r.rank for r in ranks] == [0, 1] and "merge_conflict" not in ranks[0].meta


def test_cli_refuses_then_force_merges_with_a_warning(tmp_path):
    _write(tmp_path / "b200-TP-0.json.gz", 0, 8, "NVIDIA B200")
    _write(tmp_path / "a100-TP-1.json.gz", 1, 128, "NVIDIA A100-SXM4-80GB", ar_dur=40)
    args = ["profile", "--trace", "b200-TP-0.json.gz", "a100-TP-1.json.gz", "--output", "p.json", "--no-png", "--quiet"]
    proc = run_fastverify(args, cwd=tmp_path)
    assert_user_error(proc, "b200-TP-0.json.gz", "a100-TP-1.json.gz", "--force")
    assert not (tmp_path / "p.json").exists()
    forced = run_fastverify(args + ["--force"], cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    warnings = json.loads((tmp_path / "p.json").read_text())["warnings"]
    assert any("merged with --force although distributedInfo.world_size differs: 8" in w for w in warnings), warnings
