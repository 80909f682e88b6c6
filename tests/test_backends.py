"""All-reduce backend interface: gloo on CPU with 2 real ranks, probes of the GPU backends on a
machine without CUDA, tolerances, registry order, and the fused backend's always-all-reduce
rule (with a stand-in for flashinfer.comm, since its kernels need GPUs).

Expected values are computed here in plain Python from the ranks' known inputs, never with
fastverify's reference function.

The ranks are started by ``tests/rank_harness.py``; each runs ``_rank`` with a scenario name.
"""

from __future__ import annotations

import math
import subprocess
import sys
import types
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402
import rank_harness  # noqa: E402
import torch  # noqa: E402

from fastverify.backends import (  # noqa: E402
    REGISTRY,
    TOLERANCE,
    AllReduceBackend,
    BackendName,
    BackendUnavailable,
    Capability,
    ProbeContext,
    backend_class,
    check_close,
    make_backend,
    probe,
    reference_residual_rmsnorm,
)
from fastverify.backends.flashinfer_fused import choose_oneshot  # noqa: E402
from fastverify.deploy import VerifyShapes  # noqa: E402
from fastverify.patch.rank import workspace_numel  # noqa: E402

ROWS, HIDDEN, EPS = 4, 8, 1e-6


# --- known inputs (the same formulas run in the workers and in the expectations) ---------------


def x_value(rank: int, i: int, j: int) -> float:
    return float(((rank + 1) * (3 * i + 5 * j + 1)) % 13 - 6) / 2  # multiples of 0.5: exact in bf16


def residual_value(i: int, j: int) -> float:
    return ((7 * i + 2 * j) % 5 - 2) / 4


def weight_value(j: int) -> float:
    return 1 + (j % 3) / 4


def make_inputs(rank: int, rows: int, dtype: torch.dtype):
    x = torch.tensor([[x_value(rank, i, j) for j in range(HIDDEN)] for i in range(rows)], dtype=dtype)
    residual = torch.tensor([[residual_value(i, j) for j in range(HIDDEN)] for i in range(rows)], dtype=dtype)
    weight = torch.tensor([weight_value(j) for j in range(HIDDEN)], dtype=dtype)
    return x, residual, weight


def expected(world: int, rows: int) -> tuple[list, list, list]:
    """(sum over ranks, residual_out, normed) in plain Python floats."""
    summed = [[sum(x_value(r, i, j) for r in range(world)) for j in range(HIDDEN)] for i in range(rows)]
    res = [[summed[i][j] + residual_value(i, j) for j in range(HIDDEN)] for i in range(rows)]
    normed = []
    for row in res:
        inv = 1 / math.sqrt(sum(v * v for v in row) / HIDDEN + EPS)
        normed.append([v * inv * weight_value(j) for j, v in enumerate(row)])
    return summed, res, normed


def max_rel(got: list, want: list) -> float:
    err = max(abs(g - w) for gr, wr in zip(got, want) for g, w in zip(gr, wr))
    return err / max(abs(w) for wr in want for w in wr)


# --- workers -----------------------------------------------------------------------------------


def _worker_gloo(rank: int, out: dict) -> None:
    import torch.distributed as dist

    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        x, residual, weight = make_inputs(rank, ROWS, dtype)
        x_before = x.clone()
        with make_backend("gloo", None, device="cpu", dtype=dtype, max_numel=None) as be:
            y = be.all_reduce(x)
            normed, res = be.all_reduce_residual_rmsnorm(x, residual, weight, EPS)
            out[name] = {
                "name": be.name.value,
                "all_reduce": y.float().tolist(),
                "normed": normed.float().tolist(),
                "residual_out": res.float().tolist(),
                "dtypes": [str(y.dtype), str(normed.dtype), str(res.dtype)],
                "x_unchanged": bool(torch.equal(x, x_before)),
                "same_storage": y.data_ptr() == x.data_ptr(),
                "paths": dict(be.path_counts),
            }
        out[name]["closed"] = be.closed
    # The other backends on this CPU gloo group: each raises BackendUnavailable with its reason.
    reasons = {}
    for name in ("nccl", "pcie_ipc", "fused", "custom_ar"):
        try:
            make_backend(name, None, device="cpu", dtype=torch.float32, max_numel=1024).close()
            reasons[name] = None
        except BackendUnavailable as err:
            reasons[name] = err.reason
    out["unavailable"] = reasons
    dist.barrier()


def _install_fake_flashinfer(broken_rank: int | None, rank: int) -> list:
    """A stand-in for ``flashinfer.comm`` with the real parameter names; it records every call,
    and on ``broken_rank`` its fused path skips the all-reduce (a wrong fused result)."""
    import torch.distributed as dist

    calls: list = []
    comm = types.ModuleType("flashinfer.comm")

    class AllReduceFusionPattern:
        kAllReduce = 0
        kARResidualRMSNorm = 1

    class TRTLLMAllReduceFusionWorkspace:
        def __init__(self, group):
            self.group = group
            self.destroyed = False

        def destroy(self):
            self.destroyed = True
            calls.append(("destroy", {}))

    def create_allreduce_fusion_workspace(
        backend="auto", world_size=None, rank=None, max_token_num=None, hidden_dim=None, dtype=None, group=None
    ):
        calls.append(
            (
                "create",
                {
                    "backend": backend,
                    "world_size": world_size,
                    "max_token_num": max_token_num,
                    "hidden_dim": hidden_dim,
                },
            )
        )
        return TRTLLMAllReduceFusionWorkspace(group)

    def allreduce_fusion(
        input,
        workspace,
        pattern,
        launch_with_pdl=False,
        trigger_completion_at_end=True,
        output=None,
        residual_out=None,
        norm_out=None,
        residual_in=None,
        rms_gamma=None,
        rms_eps=1e-6,
        use_oneshot=None,
        fp32_acc=False,
    ):
        calls.append(
            (
                "fusion",
                {
                    "pattern": pattern,
                    "rows": input.shape[0],
                    "use_oneshot": use_oneshot,
                    "trigger_completion_at_end": trigger_completion_at_end,
                    "launch_with_pdl": launch_with_pdl,
                },
            )
        )
        reduced = input.clone()
        dist.all_reduce(reduced, group=workspace.group)
        if broken_rank == rank:
            reduced = input.clone()
        if pattern == AllReduceFusionPattern.kAllReduce:
            output.copy_(reduced)
            return output
        r = reduced.double() + residual_in.double()
        residual_out.copy_(r)
        norm_out.copy_(r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + rms_eps) * rms_gamma.double())
        return norm_out

    for obj in (
        AllReduceFusionPattern,
        TRTLLMAllReduceFusionWorkspace,
        create_allreduce_fusion_workspace,
        allreduce_fusion,
    ):
        setattr(comm, obj.__name__, obj)
    pkg = types.ModuleType("flashinfer")
    pkg.comm = comm
    pkg.__version__ = "0.7.4"
    sys.modules["flashinfer"] = pkg
    sys.modules["flashinfer.comm"] = comm
    return calls


def fused_cpu_context(world: int) -> ProbeContext:
    """What the tune worker passes (``tune/worker.py``), on a CPU group standing in for a GPU box."""
    return ProbeContext(
        world_size=world,
        device_type="cpu",
        dtype=torch.float32,
        group_backend="gloo",
        sm=(12, 0),
        p2p_ok=True,
        single_node=True,
    )


def _worker_fused(rank: int, out: dict, broken_rank: int | None) -> None:
    import torch.distributed as dist

    from fastverify.backends import ipc

    calls = _install_fake_flashinfer(broken_rank, rank)
    ipc.check_cuda = lambda ctx: None  # the one probe fact a CPU box cannot have
    dtype = torch.float32
    # Built as the tune worker, doctor and the patch build it: make_backend with hidden, no
    # options["hidden"]; the probe's library check runs through the ExternalCall table on the fake.
    # Workspace of 4 tokens x 8: (4, 8) and (2, 8) fit, (6, 8) exceeds it and must fall back.
    with make_backend(
        "fused",
        None,
        device="cpu",
        dtype=dtype,
        max_numel=4 * HIDDEN,
        hidden=HIDDEN,
        options={"self_check": True},
        context=fused_cpu_context(2),
    ) as be:
        be.prepare([(4, HIDDEN), (2, HIDDEN)])
        out["disabled_reason"] = be.disabled_reason
        results = {}
        for rows in (4, 2, 6):
            x, residual, weight = make_inputs(rank, rows, dtype)
            residual_before = residual.clone()
            normed, res = be.all_reduce_residual_rmsnorm(x, residual, weight, EPS)
            results[rows] = {
                "normed": normed.tolist(),
                "residual_out": res.tolist(),
                "all_reduce": be.all_reduce(x).tolist(),
                "residual_unchanged": bool(torch.equal(residual, residual_before)),
            }
        out["results"] = results
        out["paths"] = dict(be.path_counts)
    with make_backend(
        "fused",
        None,
        device="cpu",
        dtype=dtype,
        max_numel=4 * HIDDEN,
        hidden=HIDDEN,
        options={"oneshot": "twoshot", "self_check": False},
        context=fused_cpu_context(2),
    ) as be2:
        for rows in (4, 2):
            x, residual, weight = make_inputs(rank, rows, dtype)
            be2.all_reduce_residual_rmsnorm(x, residual, weight, EPS)
    out["calls"] = calls
    dist.barrier()


def _rank(rank: int, world: int, out_dir: Path, scenario: str) -> dict:
    """One gloo rank of ``run_ranks`` (tests/rank_harness.py)."""
    out: dict = {}
    if scenario == "gloo":
        _worker_gloo(rank, out)
    elif scenario == "fused":
        _worker_fused(rank, out, broken_rank=None)
    elif scenario == "fused_broken":
        _worker_fused(rank, out, broken_rank=1)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    return out


# --- launching ---------------------------------------------------------------------------------


def run_ranks(tmp_path: Path, scenario: str, world: int = 2, timeout_s: float = 120) -> list[dict]:
    return rank_harness.run_ranks(_rank, world, tmp_path, scenario, timeout_s=timeout_s).results()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory) -> list[dict]:
    return run_ranks(tmp_path_factory.mktemp("gloo"), "gloo")


# --- gloo: real 2-rank all-reduce ----------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_gloo_all_reduce_and_residual_rmsnorm(gloo_results, dtype_name):
    want_sum, want_res, want_norm = expected(2, ROWS)
    tol = {"float32": 1e-6, "bfloat16": 2**-7}[dtype_name]
    for rank, out in enumerate(gloo_results):
        got = out[dtype_name]
        assert got["name"] == "gloo"
        assert got["all_reduce"] == want_sum, f"rank {rank}: sums of multiples of 0.5 must be exact"
        assert got["residual_out"] == want_res  # exact: quarters, small
        assert max_rel(got["normed"], want_norm) <= tol
        assert got["dtypes"] == [f"torch.{dtype_name}"] * 3
        assert got["x_unchanged"] and not got["same_storage"], "all_reduce must be out-of-place"
        assert got["paths"] == {"all_reduce": 2, "unfused": 1}
        assert got["closed"]


def test_gloo_ranks_agree(gloo_results):
    a, b = gloo_results
    assert a["float32"] == b["float32"] and a["bfloat16"] == b["bfloat16"]


def test_gpu_backends_unavailable_on_cpu_group(gloo_results):
    for out in gloo_results:
        reasons = out["unavailable"]
        assert "not 'nccl'" in reasons["nccl"]
        for name in ("pcie_ipc", "fused", "custom_ar"):
            assert reasons[name] and "CUDA" in reasons[name] and "\n" not in reasons[name], (name, reasons[name])


# --- fused backend's control flow with a flashinfer stand-in -------------------------------------


def test_fused_always_all_reduces_and_passes_safe_flags(tmp_path):
    outs = run_ranks(tmp_path, "fused")
    for out in outs:
        assert out["disabled_reason"] is None
        for rows in ("4", "2", "6"):
            want_sum, want_res, want_norm = expected(2, int(rows))
            got = out["results"][rows]
            assert got["all_reduce"] == want_sum
            assert max_rel(got["residual_out"], want_res) <= 1e-6
            assert max_rel(got["normed"], want_norm) <= 1e-5
            # The fused kernel writes a new residual, and so does its fallback (6 rows), as SGLang's
            # does when the kernel declines; only the plain backends add into the residual given.
            assert got["residual_unchanged"], rows
        # (4, 8) and (2, 8) fit the 4-token workspace and run fused; (6, 8) falls back and still
        # all-reduces.
        assert out["paths"] == {"fused": 2, "fused_all_reduce": 2, "fallback": 1, "fallback_all_reduce": 1}
        fusion = [c for kind, c in out["calls"] if kind == "fusion"]
        assert all(c["trigger_completion_at_end"] is True and c["launch_with_pdl"] is False for c in fusion)
        assert all(isinstance(c["use_oneshot"], bool) for c in fusion)
        # twoshot mode: 4 tokens > 2 ranks -> two-shot; 2 tokens -> one-shot (two-shot needs T > W).
        assert [c["use_oneshot"] for c in fusion[-2:]] == [False, True]
        creates = [c for kind, c in out["calls"] if kind == "create"]
        assert creates[0] == {"backend": "trtllm", "world_size": 2, "max_token_num": 4, "hidden_dim": HIDDEN}
        assert [kind for kind, _ in out["calls"]].count("destroy") == 2
    assert outs[0]["calls"] == outs[1]["calls"], "every rank must issue the same fused calls"


def test_fused_self_check_disables_on_every_rank(tmp_path):
    outs = run_ranks(tmp_path, "fused_broken")  # rank 1's fused path skips the all-reduce
    for out in outs:
        assert out["disabled_reason"] and "differs" in out["disabled_reason"]
        for rows in ("4", "2", "6"):
            want_sum, want_res, want_norm = expected(2, int(rows))
            got = out["results"][rows]
            assert got["all_reduce"] == want_sum
            assert max_rel(got["normed"], want_norm) <= 1e-5
        assert out["paths"] == {"fallback": 3, "fallback_all_reduce": 3}


@pytest.mark.parametrize(
    "hidden,max_numel,fragment",
    [
        (None, 4 * HIDDEN, "needs the hidden size"),
        (HIDDEN + 2, 4 * HIDDEN, "not a multiple of 4"),  # fp32: 16-byte vectors of 4 elements
        (HIDDEN, HIDDEN - 4, "max_numel must be >= hidden"),
        (HIDDEN, None, "max_numel must be >= hidden"),
    ],
)
def test_fused_without_usable_hidden_is_unavailable_not_a_crash(hidden, max_numel, fragment, monkeypatch):
    """The tune worker, doctor and the patch skip a backend on BackendUnavailable; a ValueError
    made every rank exit 1. Nothing collective runs before the refusal."""
    from fastverify.backends import ipc

    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        monkeypatch.delitem(sys.modules, name)
    _install_fake_flashinfer(None, 0)
    monkeypatch.setattr(ipc, "check_cuda", lambda ctx: None)
    try:
        with pytest.raises(BackendUnavailable, match=fragment) as info:
            make_backend(
                "fused",
                None,
                device="cpu",
                dtype=torch.float32,
                max_numel=max_numel,
                hidden=hidden,
                context=fused_cpu_context(2),
            )
    finally:
        for name in ("flashinfer", "flashinfer.comm"):
            sys.modules.pop(name, None)
    assert info.value.name is BackendName.fused and "\n" not in str(info.value)


def test_fused_hidden_is_no_longer_an_option():
    from fastverify.backends.flashinfer_fused import FusedBackend

    assert "hidden" not in FusedBackend.option_names


# --- probes on this machine ------------------------------------------------------------------------

GOOD = dict(
    world_size=8,
    device_type="cuda",
    dtype=torch.bfloat16,
    group_backend="nccl",
    sm=(9, 0),
    p2p_ok=True,
    p2p_note="ok",
    nvlink_full=True,
    single_node=True,
)


def ctx(**over) -> ProbeContext:
    return ProbeContext(**{**GOOD, **over})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; the no-CUDA reason cannot show")
@pytest.mark.parametrize("name", ["pcie_ipc", "fused", "custom_ar"])
def test_gpu_probe_without_cuda(name):
    cap = probe(name, ctx())
    assert cap == Capability(False, cap.reason)
    assert "no CUDA" in cap.reason and "\n" not in cap.reason
    with pytest.raises(BackendUnavailable, match="no CUDA") as info:
        make_backend(name, None, device="cuda", dtype=torch.bfloat16, max_numel=1024, context=ctx())
    assert info.value.name == BackendName(name)


@pytest.mark.parametrize("name", ["pcie_ipc", "fused", "custom_ar"])
def test_gpu_probe_without_library(name, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    module = {"custom_ar": "sglang"}.get(name, "flashinfer")
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    cap = probe(name, ctx())
    assert not cap.ok and cap.reason.startswith(f"{module} not importable") and "pip install" in cap.reason


PROBE_CASES = [
    # (backend, context overrides, fragment of the reason)
    ("pcie_ipc", {"device_type": "cpu"}, "needs CUDA tensors"),
    ("pcie_ipc", {"world_size": 6}, "world size 6 unsupported"),
    ("pcie_ipc", {"dtype": torch.float32}, "dtype float32 unsupported"),
    ("pcie_ipc", {"single_node": False}, "intra-node only"),
    ("pcie_ipc", {"single_node": None}, "LOCAL_WORLD_SIZE"),
    ("pcie_ipc", {"p2p_ok": None}, "P2P status unknown"),
    ("pcie_ipc", {"p2p_ok": False, "p2p_note": "P2P failed for 1 pair(s), first GPU0->GPU3"}, "GPU0->GPU3"),
    ("fused", {"sm": (8, 9)}, "SM89"),
    ("fused", {"sm": (8, 0)}, "SM80"),
    ("fused", {"world_size": 12}, "world size 12 unsupported"),
    ("fused", {"p2p_ok": False}, "IPC kernels hang"),
    ("custom_ar", {"nvlink_full": False}, "without full NVLink"),
    ("custom_ar", {"nvlink_full": None}, "NVLink status unknown"),
    ("custom_ar", {"world_size": 16}, "world size 16 unsupported"),
]


@pytest.mark.parametrize("name,over,fragment", PROBE_CASES)
def test_probe_reasons(name, over, fragment, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cap = probe(name, ctx(**over))
    assert not cap.ok and fragment in cap.reason and "\n" not in cap.reason, cap


def test_custom_ar_two_pcie_gpus_pass_fabric_check(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "sglang", None)
    cap = probe("custom_ar", ctx(world_size=2, nvlink_full=False))
    assert cap.reason.startswith("sglang not importable")  # got past world size / NVLink / P2P


def test_torch_dist_probe_without_process_group():
    cap = probe("gloo", ProbeContext(world_size=1, device_type="cpu", dtype=torch.float32))
    assert not cap.ok and "init_process_group" in cap.reason


def test_capability_is_one_line():
    with pytest.raises(ValueError, match="one line"):
        Capability(False, "two\nlines")


def test_p2p_summary_from_pair_results():
    from fastverify.backends.base import summarize_p2p
    from fastverify.topo.p2p import P2PResult

    assert summarize_p2p(None) == (None, "P2P status not checked")
    ok, note = summarize_p2p({(0, 1): P2PResult(True, "ok"), (1, 0): P2PResult(True, "ok")})
    assert ok is True and "2 checked pairs" in note
    ok, note = summarize_p2p({(0, 1): P2PResult(True, "ok"), (1, 2): P2PResult(False, "mismatch"), (2, 1): False})
    assert ok is False and "2 pair(s), first GPU1->GPU2" in note


# --- tolerances ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_check_close_tolerance_edges(dtype):
    want = torch.tensor([[1.0, -2.0, 4.0]], dtype=torch.float64)
    tol = TOLERANCE[dtype]
    assert check_close(want.clone(), want, dtype) == (True, 0.0)
    ok, err = check_close(want + torch.tensor([[0, 0, 0.5 * tol * 4]], dtype=torch.float64), want, dtype)
    assert ok and err == pytest.approx(0.5 * tol, rel=1e-6)
    ok, err = check_close(want + torch.tensor([[0, 0, 2 * tol * 4]], dtype=torch.float64), want, dtype)
    assert not ok and err == pytest.approx(2 * tol, rel=1e-6)
    assert check_close(torch.tensor([[1.0, float("nan"), 4.0]]), want, dtype) == (False, math.inf)


def test_tolerance_values_documented():
    assert TOLERANCE[torch.bfloat16] == 4 * 2**-7
    assert TOLERANCE[torch.float16] == 4 * 2**-10
    assert TOLERANCE[torch.float32] == 1e-5


def test_bf16_rounding_passes_but_dropped_rank_fails():
    # 8 ranks summed in bf16 one step at a time (rounding after every add, as a ring does) then
    # add + RMSNorm in bf16 must pass; the same with one rank's contribution missing must fail.
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 256, generator=gen) for _ in range(8)]
    residual = torch.randn(16, 256, generator=gen)
    weight = 1 + 0.1 * torch.randn(256, generator=gen)
    want_norm, want_res = reference_residual_rmsnorm(xs, residual, weight, EPS)

    def bf16_pipeline(parts):
        acc = parts[0].bfloat16()
        for p in parts[1:]:
            acc = (acc + p.bfloat16()).bfloat16()
        r = (acc.float() + residual.bfloat16().float()).bfloat16().float()
        return (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * weight.bfloat16().float()).bfloat16(), r

    norm, res = bf16_pipeline(xs)
    assert check_close(norm, want_norm, torch.bfloat16)[0]
    assert check_close(res, want_res, torch.bfloat16)[0]
    norm7, res7 = bf16_pipeline(xs[:7])
    assert not check_close(res7, want_res, torch.bfloat16)[0]
    assert not check_close(norm7, want_norm, torch.bfloat16)[0]


def test_check_close_bad_input():
    with pytest.raises(ValueError, match="shape mismatch"):
        check_close(torch.zeros(2, 3), torch.zeros(3, 2), torch.float32)
    with pytest.raises(ValueError, match="no tolerance"):
        check_close(torch.zeros(2), torch.zeros(2), torch.int32)
    assert check_close(torch.zeros(2), torch.zeros(2), torch.float32) == (True, 0.0)
    assert check_close(torch.ones(2), torch.zeros(2), torch.float32) == (False, math.inf)


def test_reference_against_hand_arithmetic():
    xs = [make_inputs(r, ROWS, torch.float32)[0] for r in range(3)]
    _, residual, weight = make_inputs(0, ROWS, torch.float32)
    normed, res = reference_residual_rmsnorm(xs, residual, weight, EPS)
    want_sum, want_res, want_norm = expected(3, ROWS)
    assert res.dtype == torch.float32 and res.tolist() == want_res
    assert max_rel(normed.tolist(), want_norm) <= 1e-6
    with pytest.raises(ValueError, match="one tensor per rank"):
        reference_residual_rmsnorm([], residual, weight, EPS)


# --- registry and interface ------------------------------------------------------------------------


def test_registry_order_and_coverage():
    names = [spec.name for spec in REGISTRY]
    assert names == [
        BackendName.pcie_ipc,
        BackendName.b12x,
        BackendName.fused,
        BackendName.custom_ar,
        BackendName.nccl,
        BackendName.gloo,
    ]
    assert sorted(names) == sorted(BackendName), "every backend registered exactly once"
    for spec in REGISTRY:
        cls = backend_class(spec.name)
        assert issubclass(cls, AllReduceBackend) and cls.name == spec.name
        assert (cls.__module__, cls.__qualname__) == (spec.module, spec.qualname)
    assert [spec.module for spec in REGISTRY[-2:]] == ["fastverify.backends.torch_dist"] * 2  # last resort
    with pytest.raises(ValueError, match="known:"):
        backend_class("mpi")


def test_importing_backends_does_not_import_gpu_libraries():
    code = (
        "import sys, fastverify.backends as b; [b.backend_class(s.name) for s in b.REGISTRY]; "
        "print(sorted(m for m in ('flashinfer', 'sglang') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


class Scale(AllReduceBackend):
    """In-process fake: 'all-reduce' = multiply by a factor, up to a size bound."""

    name = BackendName.gloo
    option_names = frozenset({"factor"})

    @classmethod
    def probe(cls, ctx):
        return Capability(True, "fake")

    def all_reduce(self, x):
        return x * self.options["factor"]


def fake(factor: float, max_numel: int | None) -> Scale:
    return Scale(None, device="cpu", dtype=torch.float32, max_numel=max_numel, options={"factor": factor})


def test_default_residual_rmsnorm_uses_the_backends_all_reduce():
    with fake(2.0, None) as be:
        x = torch.tensor([[1.0, 2.0]])
        normed, res = be.all_reduce_residual_rmsnorm(x, torch.tensor([[1.0, 0.0]]), torch.tensor([1.0, 2.0]), 0.0)
        assert res.tolist() == [[3.0, 4.0]]
        rms = math.sqrt((9 + 16) / 2)
        assert normed[0].tolist() == pytest.approx([3 / rms, 8 / rms])
        with pytest.raises(ValueError, match="residual shape"):
            be.all_reduce_residual_rmsnorm(x, torch.zeros(2, 2), torch.ones(2), 0.0)
        with pytest.raises(ValueError, match="weight shape"):
            be.all_reduce_residual_rmsnorm(x, torch.zeros(1, 2), torch.ones(3), 0.0)


def test_interface_validation_and_lifetime():
    with pytest.raises(ValueError, match="unknown option"):
        Scale(None, device="cpu", dtype=torch.float32, max_numel=None, options={"bogus": 1})
    with pytest.raises(ValueError, match="max_numel"):
        fake(1.0, 0)
    be = fake(1.0, 8)
    assert be.supports(torch.ones(2, 4)) and not be.supports(torch.ones(3, 4))
    assert not be.supports(torch.ones(8)) and not be.supports(torch.ones(2, 2, dtype=torch.float64))
    with pytest.warns(ResourceWarning, match="not closed"):
        be.__del__()
    be.close()
    be.close()  # idempotent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        be.__del__()  # closed: silent
    assert not be.supports(torch.ones(2, 4))


def test_sizing_helpers():
    # the workspace a rank builds: the record's verify step, else SGLang's widest captured decode
    record = types.SimpleNamespace(shapes=VerifyShapes(32, 4, 7168))
    assert workspace_numel(record, 7168, None) == 32 * 4 * 7168
    assert workspace_numel(None, 7168, 36) == 36 * 7168
    with pytest.raises(ValueError, match="draft_tokens"):
        VerifyShapes(1, 0, 7168)
    # TP8, hidden 7168, bf16: one-shot up to 192 tokens (FlashInfer's 42 MiB threshold).
    assert choose_oneshot(192, 7168, 2, 8) and not choose_oneshot(193, 7168, 2, 8)
    assert choose_oneshot(8, 7168, 2, 8, "twoshot")  # two-shot needs tokens > world size
    assert not choose_oneshot(9, 7168, 2, 8, "twoshot")
    assert choose_oneshot(128, 7168, 2, 16) and not choose_oneshot(129, 7168, 2, 16)
    with pytest.raises(ValueError, match="oneshot mode"):
        choose_oneshot(100, 7168, 2, 8, "sometimes")
