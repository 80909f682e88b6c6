"""The live verify forward with an all-reduce backend (`profile --model ... --backend NAME`).

Counts and sizes are derived here from the tiny preset's JSON file and SGLang's collective order
(one embedding all-reduce, then attention and MLP of every layer: shared/research/sglang.md §2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import assert_user_error, run_fastverify, subprocess_env  # noqa: E402

from fastverify.backends import TOLERANCE, check_close  # noqa: E402
from fastverify.events import EventClass  # noqa: E402

HERE = Path(__file__).resolve().parent
TINY = json.loads((HERE.parent / "fastverify/live/presets/tiny.json").read_text())
HIDDEN, LAYERS = TINY["hidden_size"], TINY["num_hidden_layers"]
PER_STEP = 1 + 2 * LAYERS


def test_profile_tiny_backend_gloo_records_backend_hidden_dtype(tmp_path):
    iters, warmup, batch, draft = 3, 1, 2, 4
    proc = run_fastverify(
        [
            "profile",
            "--model",
            "tiny",
            "--backend",
            "gloo",
            "--device",
            "cpu",
            "--batch",
            str(batch),
            "--draft-tokens",
            str(draft),
            "--iters",
            str(iters),
            "--warmup",
            str(warmup),
            "--output",
            "p.json",
            "--no-png",
            "--quiet",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "p.json").read_text())
    T = batch * draft
    # The same collective sequence as the forward without a backend: 1 + 2 x layers all-reduces of
    # T x hidden x 2 B (bf16) per step, on each of the 2 ranks.
    assert doc["allreduce_by_msg_size"][0]["msg_bytes"] == T * HIDDEN * 2
    assert [r["msg_bytes"] for r in doc["allreduce_by_msg_size"]] == [T * HIDDEN * 2]
    assert doc["allreduce_by_msg_size"][0]["count"] == 2 * iters * PER_STEP
    assert all(r["step_median"]["allreduce_count"] == PER_STEP for r in doc["ranks"])
    assert doc["source"]["backend"] == "gloo" and doc["source"]["dist_backend"] == "gloo"
    # CPU has no CUDA graphs: the eager forward was timed, and the record and its clock note say so.
    assert doc["source"]["timed_forward"] == "eager" and doc["source"]["graph_forward_us"] is None
    assert doc["timing"]["note"].endswith("; timed: the eager forward (no CUDA graphs on CPU)")
    assert doc["shapes"] == {"dtype": "bfloat16", "hidden": HIDDEN, "tokens": T, "draft_tokens": draft, "batch": batch}
    for r in doc["ranks"]:
        # Every all-reduce of every forward (warm-up included) went through the backend.
        assert r["meta"]["allreduce_backend"] == "gloo" and r["meta"]["timed_forward"] == "eager"
        assert r["meta"]["allreduce_paths"] == {"all_reduce": (warmup + iters) * PER_STEP}


@pytest.fixture(scope="module")
def forwards(tmp_path_factory):
    """Both ranks of tests/live_backend_probe.py: logits with and without a backend, fp32 and bf16."""
    import torch.distributed as dist

    out = tmp_path_factory.mktemp("fwd")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "live_backend_probe.py"), str(r), str(store.port), str(out / f"rank{r}.pt")],
            env=subprocess_env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    del store
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_with_the_gloo_backend_equals_plain_all_reduce(forwards, dtype):
    for res in forwards:
        assert torch.equal(res[f"gloo_{dtype}"], res[f"plain_{dtype}"])  # same sums, same order on gloo
        assert res[f"gloo_{dtype}_fused_norm"] is False
        assert res[f"gloo_{dtype}_paths"] == {"all_reduce": PER_STEP}
        ar = [r for r in res[f"gloo_{dtype}_regions"] if r[1] != EventClass.COMPUTE.value]
        assert [r[1] for r in ar] == [EventClass.ALLREDUCE.value] * PER_STEP + [EventClass.OTHER_COMM.value]
    assert torch.equal(forwards[0][f"gloo_{dtype}"], forwards[1][f"gloo_{dtype}"])  # gathered logits agree


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_fused_norm_backend_takes_every_add_norm_boundary(forwards, dtype):
    """A backend of role fused_norm gets all_reduce_residual_rmsnorm at the 2 x layers boundaries
    (attention out, MLP out) and a plain all-reduce for the embedding, and the result is the
    plain forward's within the dtype's tolerance."""
    for res in forwards:
        assert res[f"fused_{dtype}_fused_norm"] is True
        # The base class's fused call counts "unfused" and runs all_reduce: 2L + the embedding's 1.
        assert res[f"fused_{dtype}_paths"] == {"unfused": 2 * LAYERS, "all_reduce": PER_STEP}
        comm = [r for r in res[f"fused_{dtype}_regions"] if r[1] != EventClass.COMPUTE.value]
        assert [r[1] for r in comm] == (
            [EventClass.ALLREDUCE.value]
            + [EventClass.FUSED_ALLREDUCE.value] * 2 * LAYERS
            + [EventClass.OTHER_COMM.value]
        )
        assert comm[1][2] == "layer0.attn_out.allreduce" and comm[-2][2] == f"layer{LAYERS - 1}.mlp_out.allreduce"
        ok, err = check_close(res[f"fused_{dtype}"], res[f"plain_{dtype}"].float(), getattr(torch, dtype))
        assert ok, (err, TOLERANCE[getattr(torch, dtype)])


@pytest.mark.parametrize(
    "backend, words",
    [
        ("bogus", ["unknown all-reduce backend 'bogus'", "pcie_ipc"]),
        ("pcie-ipc", ["unknown all-reduce backend 'pcie-ipc'"]),
        ("nccl", ["--backend nccl", "use --backend gloo"]),
        ("pcie_ipc", ["--backend pcie_ipc", "needs CUDA tensors"]),
        ("fused", ["--backend fused", "needs CUDA tensors"]),
        ("custom_ar", ["--backend custom_ar", "needs CUDA tensors"]),
    ],
)
def test_backends_that_cannot_run_here_are_one_line(tmp_path, backend, words):
    proc = run_fastverify(
        ["profile", "--model", "tiny", "--device", "cpu", "--backend", backend, "--output", "p.json", "--quiet"],
        cwd=tmp_path,
    )
    assert_user_error(proc, *words)
    assert not (tmp_path / "p.json").exists()


def test_backend_with_trace_is_refused(tmp_path):
    proc = run_fastverify(["profile", "--trace", "t.json", "--backend", "gloo", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, "--backend applies only to a live run")


def test_a_non_baseline_backend_at_tp_1_is_refused_before_any_rank_starts():
    from fastverify.errors import UserError
    from fastverify.live.config import load_model_config
    from fastverify.live.runner import run_live

    with pytest.raises(UserError, match="--tp 1 runs no all-reduce"):
        run_live(load_model_config("tiny"), tp=1, draft_tokens=4, batch=1, device="cpu", backend="pcie_ipc")


def _cuda_backends():
    from fastverify.registry import BACKENDS

    return [b.name.value for b in BACKENDS if b.device == "cuda"]


@pytest.mark.parametrize("backend", _cuda_backends())
def test_every_cuda_backend_in_the_registry_is_refused_on_cpu(tmp_path, backend):
    proc = run_fastverify(
        ["profile", "--model", "tiny", "--device", "cpu", "--backend", backend, "--output", "p.json", "--quiet"],
        cwd=tmp_path,
    )
    assert_user_error(proc, f"--backend {backend}")
    assert not (tmp_path / "p.json").exists()
