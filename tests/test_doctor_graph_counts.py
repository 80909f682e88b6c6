"""doctor's graph_counts and compiled_counts cases (fastverify/doctor/graph_counts.py): skipped with
the GPU reason on this box, and their core code driven on CPU through SGLang's real classes, with
stand-ins for the device pieces only (tests/data/doctor_graph_counts_cpu.py, in the SGLang venv)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fastverify import doctor
from fastverify.doctor import Status, graph_counts

REPO = Path(__file__).resolve().parents[1]
_SCRIPT = Path(__file__).parent / "data" / "doctor_graph_counts_cpu.py"


def _run_cpu(*cases: str) -> dict:
    py = os.environ.get("FASTVERIFY_SGLANG_PYTHON")
    if not py or not Path(py).is_file():
        pytest.skip("FASTVERIFY_SGLANG_PYTHON not set (make the SGLang venv with .ci/sglang-venv.sh)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    cp = subprocess.run(
        [py, str(_SCRIPT), *cases], check=False, capture_output=True, text=True, timeout=600, env=env, cwd=str(REPO)
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    return json.loads(next(ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT "))[7:])


@pytest.mark.parametrize(
    "name, fn",
    [("graph_counts", graph_counts.check_graph_counts), ("compiled_counts", graph_counts.check_compiled_counts)],
)
def test_graph_and_compiled_counts_are_gpu_cases_skipped_on_cpu_with_the_reason(monkeypatch, name, fn):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = {s.name: s for s in doctor.CHECKS}[name]
    assert spec.needs_gpu and not spec.quick and spec.fn is fn
    monkeypatch.setattr(doctor, "CHECKS", (spec,))
    (check,) = doctor.run_doctor(quick=False)
    assert check.name == name and check.status is Status.skipped and check.reason == doctor.NO_GPU


def test_graph_counts_on_sglangs_real_runners_count_warmups_and_each_replay_in_its_mode():
    """EAGLEDraftCudaGraphRunner, EAGLEDraftExtendCudaGraphRunner and PrefillCudaGraphRunner with
    SGLang's FullCudaGraphBackend capture forwards of 2, 3 and 5 counted all-reduces (CPU: the CUDA
    graph and the device module stood in); the warm-ups are 2 x 10 capture_warmup, one replay each
    adds 2 / 3 / 5 to draft / draft_extend / extend."""
    got = _run_cpu("graph")["graph"]
    assert {"FullCudaGraphBackend.capture_one", "FullCudaGraphBackend.replay"} <= set(got["wrapped"]), got
    assert got["warmup"] == {"capture_warmup": {"sglang.torch_distributed": 20}}, got
    assert got["replayed"] == {
        "draft": {"sglang.torch_distributed": 2},
        "draft_extend": {"sglang.torch_distributed": 3},
        "extend": {"sglang.torch_distributed": 5},
    }, got
    assert got["graph_replays"] == 3
    ok, line = graph_counts.graph_verdict(got, real_graph=False)
    assert ok, line
    assert "warm-ups 20 capture_warmup, replays counted draft 2, draft_extend 3, extend 5" in line
    # the stand-in graph replays no kernel: the tensors hold the two warm-ups and the eager capture
    assert got["values"] == {"eagle_draft": 6.0, "eagle_draft_extend": 9.0, "prefill": 15.0}


def test_graph_verdict_names_an_uncounted_replay_and_a_replay_that_ran_nothing():
    got = {
        "wrapped": ["FullCudaGraphBackend.capture_one"],
        "uncounted": {},
        "issued": {"eagle_draft": 2, "eagle_draft_extend": 3, "prefill": 5},
        "warmup": {"capture_warmup": {"sglang.unobserved": 20}},
        "replayed": {"draft": {"sglang.unobserved": 2}, "draft_extend": {"sglang.unobserved": 3}},
        "values": {"eagle_draft": 6.0, "eagle_draft_extend": 9.0, "prefill": 15.0},
    }
    ok, line = graph_counts.graph_verdict(got, real_graph=True)
    assert not ok and line.startswith("graph replays counted {'draft': 2, 'draft_extend': 3}, want"), line
    got["replayed"]["extend"] = {"sglang.unobserved": 5}
    assert graph_counts.graph_verdict(got, real_graph=True)[0]
    got["values"] = {"eagle_draft": 4.0, "eagle_draft_extend": 6.0, "prefill": 10.0}  # warm-ups only
    assert graph_counts.graph_verdict(got, real_graph=False)[0]
    ok, line = graph_counts.graph_verdict(got, real_graph=True)  # 3 x N wanted from real replays
    assert not ok and "a replay did not run the forward" in line, line


def test_compiled_counts_count_sglangs_compiled_op_once_per_call_on_the_path_it_ran():
    """Two gloo ranks, SGLang's real GroupCoordinator: a torch.compile'd forward emits SGLang's
    inplace_all_reduce op (no accelerated communicator: sglang.gloo) or, with a PyNccl stand-in,
    outplace_all_reduce(..., "auto") resolved to pynccl; one count per call, outputs 2 * 3 + 1."""
    got = {int(r): res for r, res in _run_cpu("compiled")["compiled"].items()}
    assert sorted(got) == [0, 1], got
    for res in got.values():
        assert "error" not in res, res
        assert res["plain"]["counts"] == [{"sglang.gloo": 1}] * 3, res
        assert res["pynccl"]["counts"] == [{"sglang.pynccl": 1}] * 3, res
        assert res["plain"]["outs"] == res["pynccl"]["outs"] == [[7.0]] * 3, res
    ok, line = graph_counts.compiled_verdict(got)
    assert ok and "one count per call (plain group sglang.gloo, pynccl group sglang.pynccl)" in line, line


def test_compiled_verdict_names_a_double_count():
    res = {"plain": {"counts": [{"sglang.gloo": 2}] * 3, "outs": [[7.0]] * 3, "method": None}}
    ok, line = graph_counts.compiled_verdict({0: res, 1: res})
    assert not ok and line.startswith("rank 0 plain group: the patch counted [{'sglang.gloo': 2}"), line
