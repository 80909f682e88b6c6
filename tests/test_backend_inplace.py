"""The unfused all-reduce + residual + RMSNorm path works in place, like SGLang's plain path.

SGLang 0.5.23 ``RMSNorm.forward_cuda`` with a residual (``sglang/srt/layers/layernorm.py``) calls
``fused_add_rmsnorm``, which adds into the residual it is given (FlashInfer 0.7.4
``flashinfer/norm/__init__.py``: "residual += input" in place). A backend that copied the residual
first paid one copy kernel per call that SGLang does not, ~123 times per verify step, on the plain
backends only (nccl, pcie_ipc, custom_ar), which biased the ranking ``tune`` makes. Here two gloo
ranks run the path on both norm kernels (torch, and a stand-in for FlashInfer's with its
documented contract) and check: the returned residual is the input's storage, no clone is made
beyond the all-reduce's own output, and the values equal a float64 add + RMSNorm of the summed
inputs, computed here from the input formulas.

The ranks are started by ``tests/rank_harness.py``; each runs ``_rank``.
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import rank_harness  # noqa: E402
import torch  # noqa: E402

from fastverify.backends import AllReduceBackend, BackendName, Capability  # noqa: E402

ROWS, HIDDEN, EPS, WORLD = 3, 8, 1e-6, 2
CASES = ("gloo-torch-float32", "gloo-torch-bfloat16", "gloo-flashinfer-bfloat16")


def x_value(rank: int, i: int, j: int) -> float:
    return (((rank + 2) * (2 * i + 3 * j + 1)) % 11 - 5) / 4  # quarters in [-1.25, 1.25]: exact in bf16


def residual_value(i: int, j: int) -> float:
    return ((5 * i + 3 * j) % 7 - 3) / 2


def weight_value(j: int) -> float:
    return 1 + (j % 4) / 8


def reference() -> tuple[list, list]:
    """(residual_out, normed) of the summed inputs, in float64 Python arithmetic."""
    res = [
        [sum(x_value(r, i, j) for r in range(WORLD)) + residual_value(i, j) for j in range(HIDDEN)] for i in range(ROWS)
    ]
    normed = []
    for row in res:
        inv = 1 / math.sqrt(sum(v * v for v in row) / HIDDEN + EPS)
        normed.append([v * inv * weight_value(j) for j, v in enumerate(row)])
    return res, normed


# --- worker ------------------------------------------------------------------------------------------


def _install_fi_norm_standin() -> list:
    """``flashinfer.norm.fused_add_rmsnorm`` with FlashInfer 0.7.4's contract (in place:
    ``residual += input``, then ``input = RMSNorm(residual) * weight``); records each call."""
    calls: list = []

    def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
        calls.append(tuple(input.shape))
        residual.add_(input)
        r = residual.double()
        input.copy_(r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.double())

    fi, norm = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.norm")
    norm.fused_add_rmsnorm = fused_add_rmsnorm
    fi.norm = norm
    sys.modules["flashinfer"], sys.modules["flashinfer.norm"] = fi, norm
    return calls


def _clones(fn) -> tuple[object, int]:
    """``fn()`` and the number of ``aten.clone`` calls it made."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.clone:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        out = fn()
    return out, Count.n


def _one_case(rank: int, case: str) -> dict:
    from fastverify.backends import make_backend

    _, norm, dtype_name = case.split("-")
    dtype = getattr(torch, dtype_name)
    x = torch.tensor([[x_value(rank, i, j) for j in range(HIDDEN)] for i in range(ROWS)], dtype=dtype)
    residual = torch.tensor([[residual_value(i, j) for j in range(HIDDEN)] for i in range(ROWS)], dtype=dtype)
    weight = torch.tensor([weight_value(j) for j in range(HIDDEN)], dtype=dtype)
    x_before, ptr = x.clone(), residual.data_ptr()
    with make_backend("gloo", None, device="cpu", dtype=dtype, max_numel=None, options={"norm": norm}) as be:
        _, plain_clones = _clones(lambda: be.all_reduce(x))  # the all-reduce's own out-of-place output
        (normed, res), clones = _clones(lambda: be.all_reduce_residual_rmsnorm(x, residual, weight, EPS))
        return {
            "same_storage": res.data_ptr() == ptr,
            "extra_clones": clones - plain_clones,
            "residual_after": residual.double().tolist(),
            "residual_out": res.double().tolist(),
            "normed": normed.double().tolist(),
            "dtypes": [str(normed.dtype), str(res.dtype)],
            "x_unchanged": bool(torch.equal(x, x_before)),
            "norm": be.norm.value,
        }


def _rank(rank: int, world: int, out_dir: Path) -> dict:
    """One gloo rank of ``ranks`` (tests/rank_harness.py, teardown ``exit``: no process-group
    teardown, which can abort a rank whose peer left first)."""
    fi_calls = _install_fi_norm_standin()
    out = {case: _one_case(rank, case) for case in CASES}
    out["fi_calls"] = fi_calls
    return out


# --- the test -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("inplace")
    return rank_harness.run_ranks(_rank, WORLD, out, timeout_s=120, teardown="exit").results()


@pytest.mark.parametrize("case", CASES)
def test_unfused_path_updates_the_residual_in_place(ranks, case):
    want_res, want_norm = reference()
    dtype_name = case.split("-")[2]
    for rank, out in enumerate(ranks):
        got = out[case]
        assert got["norm"] == case.split("-")[1]
        assert got["same_storage"], f"rank {rank}: the returned residual must be the input tensor"
        assert got["extra_clones"] == 0, f"rank {rank}: {got['extra_clones']} clone(s) beyond the all-reduce's"
        assert got["residual_after"] == want_res, f"rank {rank}: the input residual holds the sum"
        assert got["residual_out"] == want_res  # quarters and halves, small: exact in bf16 too
        err = max(abs(g - w) for gr, wr in zip(got["normed"], want_norm) for g, w in zip(gr, wr))
        scale = max(abs(w) for wr in want_norm for w in wr)
        assert err / scale <= {"float32": 1e-6, "bfloat16": 2**-7}[dtype_name], (rank, err / scale)
        assert got["dtypes"] == [f"torch.{dtype_name}"] * 2
        assert got["x_unchanged"]


def test_the_flashinfer_kernel_ran_once_per_flashinfer_case(ranks):
    n = sum(c.split("-")[1] == "flashinfer" for c in CASES)
    assert [out["fi_calls"] for out in ranks] == [[[ROWS, HIDDEN]] * n] * WORLD


class Twice(AllReduceBackend):
    """A one-process stand-in backend: 'all-reduce' doubles the input, and counts its calls."""

    name = BackendName.gloo
    calls = 0

    @classmethod
    def probe(cls, ctx):
        return Capability(True, "stand-in")

    def all_reduce(self, x):
        Twice.calls += 1
        return x * 2


def test_a_strided_residual_is_refused_before_the_all_reduce():
    with Twice(None, device="cpu", dtype=torch.float32, max_numel=None, options={"norm": "torch"}) as be:
        strided = torch.zeros(HIDDEN, 2).t()  # (2, HIDDEN), not contiguous
        with pytest.raises(ValueError, match="residual must be contiguous"):
            be.all_reduce_residual_rmsnorm(torch.ones(2, HIDDEN), strided, torch.ones(HIDDEN), EPS)
        assert Twice.calls == 0 and be.path_counts == {}
        residual = torch.tensor([[0.5] * HIDDEN, [-1.0] * HIDDEN])
        normed, res = be.all_reduce_residual_rmsnorm(torch.ones(2, HIDDEN), residual, torch.ones(HIDDEN), 0.0)
        assert res is residual and residual.tolist() == [[2.5] * HIDDEN, [1.0] * HIDDEN]
        assert normed.tolist() == [[1.0] * HIDDEN] * 2  # a constant row normalizes to ones


def test_add_rmsnorm_stays_out_of_place():
    """The patch's first-result checks run the plain path with ``add_rmsnorm`` and then the backend
    on the same residual, so the reference helper must leave its inputs alone."""
    from fastverify.backends import add_rmsnorm

    reduced, residual = torch.full((1, 4), 3.0), torch.full((1, 4), 1.0)
    normed, res = add_rmsnorm(reduced, residual, torch.ones(4), 0.0)
    assert residual.tolist() == [[1.0] * 4] and reduced.tolist() == [[3.0] * 4]
    assert res.tolist() == [[4.0] * 4] and normed.tolist() == [[1.0] * 4]
