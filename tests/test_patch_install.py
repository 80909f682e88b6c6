"""The in-rank patch against a fake SGLang whose targets have 0.5.23's names and signatures."""

import ast
import json
import logging
import os
import time
import types
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import PCIE_IPC_SWITCH

from fastverify.patch import install as I, slots as F, slots as S
from fastverify.patch.verify import WallEvent

ON = {"FASTVERIFY_PATCH": "1"}


def make_fake_sglang(world_size=2, *, norm_params=None, fusion_applies=True, sm=None, all_reduce=None):
    """``all_reduce(x)``: the TP group's sum (default: every rank holds the same partial, so the sum is
    ``world_size * x``). ``calls["sglang_kernel"]``: SGLang's fused method reduces in its own kernel
    (no ``GroupCoordinator.all_reduce``) instead of its fallback through the group."""
    calls = {"ar": 0, "orig_fused": 0, "gate": [], "orig_ffn": 0, "orig_attn": 0, "sglang_kernel": False}

    def _ar(x, n=world_size):
        calls["ar"] += 1
        return all_reduce(x) if all_reduce is not None else x * n

    ps = types.ModuleType(I.MOD_PARALLEL_STATE)

    class GroupCoordinator:  # what the patch reads of SGLang's (parallel_state.py, 0.5.23)
        def __init__(self):
            self.world_size, self.unique_name, self.device_group = world_size, "tp:0", None
            self.cpu_group, self.rank_in_group, self.ranks = None, 0, list(range(world_size))

        def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
            return _ar(input_, self.world_size)  # every rank of the group holds the same partial

    group = GroupCoordinator()
    ps.GroupCoordinator = GroupCoordinator
    ps.get_tp_group = ps.get_attn_tp_group = lambda: group

    def in_the_same_node_as(pg, source_rank=0):  # SGLang's is a shared-memory handshake (probe: the real one)
        import torch.distributed as tdist

        return [True] * tdist.get_world_size(pg)

    ps.in_the_same_node_as = in_the_same_node_as
    an = types.ModuleType(I.MOD_ADD_NORM)

    def flashinfer_ar_fusion_applies(batch_size):
        calls["gate"].append(batch_size)
        return fusion_applies

    an.flashinfer_ar_fusion_applies = flashinfer_ar_fusion_applies

    # SGLang's group functions all-reduce through the group's coordinator (communication_op.py,
    # moe/utils.py); the post-experts group is the TP group here (moe_dp 1)
    dist = types.ModuleType(I.MOD_DISTRIBUTED)
    dist.tensor_model_parallel_all_reduce = lambda x: ps.get_tp_group().all_reduce(x)
    dist.attention_tensor_model_parallel_all_reduce = lambda x: ps.get_attn_tp_group().all_reduce(x)
    moe = types.ModuleType(I.MOD_MOE_UTILS)
    moe.post_experts_reduction_group = lambda: group
    moe.deferred_post_experts_all_reduce = lambda x: moe.post_experts_reduction_group().all_reduce(x)

    ln = types.ModuleType(I.MOD_LAYERNORM)

    class RMSNorm(torch.nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, x, residual=None, post_residual_addition=None):
            if residual is not None:
                if post_residual_addition is not None:
                    residual = residual + post_residual_addition
                residual.add_(x)  # in place, like fused_add_rmsnorm
                x = residual
            out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight
            return (out, residual) if residual is not None else out

        # SGLang 0.5.23's CUDA path (layernorm.py _forward_with_allreduce_fusion): no residual or a
        # group of one: only the norm; else its fused kernel, or when that declines the group's
        # all-reduce + the norm into a fresh residual
        def forward_with_allreduce_fusion(self, x, residual=None, post_residual_addition=None, use_attn_tp_group=True):
            calls["orig_fused"] += 1
            owed = ps.get_attn_tp_group() if use_attn_tp_group else moe.post_experts_reduction_group()
            if residual is None or owed.world_size <= 1:
                return self.forward(x, residual, post_residual_addition)
            if post_residual_addition is not None:
                residual = residual + post_residual_addition
            if calls["sglang_kernel"]:
                x = x * owed.world_size  # its kernel's sum, without GroupCoordinator.all_reduce
            else:
                x = (
                    dist.attention_tensor_model_parallel_all_reduce
                    if use_attn_tp_group
                    else moe.deferred_post_experts_all_reduce
                )(x)
            return self.forward(x, residual.clone() if post_residual_addition is None else residual, None)

    if norm_params == "changed":

        def changed(self, hidden_states, residual=None):
            return self.forward(hidden_states, residual)

        RMSNorm.forward_with_allreduce_fusion = changed
    ln.RMSNorm = RMSNorm

    tw = types.ModuleType(I.MOD_TP_WORKER)

    class TpModelWorker:
        def forward_batch_generation(
            self,
            batch,
            forward_batch=None,
            pp_proxy_tensors=None,
            is_verify=False,
            skip_attn_backend_init=None,
            *,
            capture_hidden_mode=None,
            return_kv_loc_plan=False,
        ):
            return ("result", is_verify)

    tw.TpModelWorker = TpModelWorker

    mr = types.ModuleType(I.MOD_MODEL_RUNNER)

    class ModelRunner:  # 0.5.23: init_cuda_graphs(self, capture_decode_cuda_graph: bool = True)
        def __init__(self, hidden=8, width=4, pool=48, is_draft_worker=False):
            self.model_config = types.SimpleNamespace(hidden_size=hidden)
            self.dtype = torch.float32
            self.device, self.gpu_id = "cuda", 0
            self.req_to_token_pool = types.SimpleNamespace(size=pool)
            self.server_args = types.SimpleNamespace(cuda_graph_bs=None, cuda_graph_max_bs=None)
            self.is_draft_worker = is_draft_worker
            self.width = width

        def decode_num_tokens_per_req(self, *, num_draft_tokens=None):
            return self.width

        def init_cuda_graphs(self, capture_decode_cuda_graph: bool = True):
            calls.setdefault("captures", []).append(capture_decode_cuda_graph)
            calls.setdefault("events", []).append(("capture", capture_decode_cuda_graph))

    mr.ModelRunner = ModelRunner
    rc = types.ModuleType(I.MOD_RUNTIME_CONTEXT)
    graph_cfg = types.SimpleNamespace(
        cuda_graph_config=types.SimpleNamespace(decode=types.SimpleNamespace(bs=[1, 2, 4, 8, 16, 32, 64]))
    )
    rc.get_exec = lambda: types.SimpleNamespace(graph=graph_cfg)
    if sm is not None:  # SGLang's platform facts (runtime_context.get_platform, override_platform)
        rc.get_platform = lambda: types.SimpleNamespace(device_capability=sm)

    fu = types.ModuleType(I.MOD_AR_FUSIONS)  # layer_boundary/fusions/allreduce.py, 0.5.23 names

    class UnreducedOutput:  # layer_boundary/output.py: partial, group, reduce_to_dp_local, complete_sum
        def __init__(self, partial, group, reduce_to_dp_local=None, complete_sum=None):
            self.partial, self.group = partial, group
            self.reduce_to_dp_local, self.complete_sum = reduce_to_dp_local, complete_sum

    # SGLang's own candidates where its FlashInfer fusion does not apply (SM120): None, untouched
    def fused_ffn_input(plan, hidden_states, residual, forward_batch):
        calls["orig_ffn"] += 1
        return None

    def fused_attn_input(plan, owed, residual, forward_batch, post_residual_addition, *, fuses_quant, keep_bf16):
        calls["orig_attn"] += 1
        return None

    fu.RMSNorm, fu.UnreducedOutput = RMSNorm, UnreducedOutput
    fu.fused_ffn_input, fu.fused_attn_input = fused_ffn_input, fused_attn_input
    mods = {m.__name__: m for m in (ps, dist, moe, ln, tw, mr, rc, an, fu)}
    return mods, calls


@pytest.fixture(autouse=True)
def clean():
    I.uninstall()
    yield
    I.uninstall()


def test_inactive_without_flag():
    mods, _ = make_fake_sglang()
    orig = mods[I.MOD_LAYERNORM].RMSNorm.forward_with_allreduce_fusion
    rep = I.install(mods, environ={"FASTVERIFY_BACKEND": "fused"})
    assert not rep.active and rep.applied == []
    assert mods[I.MOD_LAYERNORM].RMSNorm.forward_with_allreduce_fusion is orig


def _expected(x, residual, ws=2, eps=1e-6):
    r = residual + x * ws
    return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps), r


def test_fused_slot_without_a_backend_runs_sglangs_own_method_and_restores():
    """No backend for the group (none built yet, a CPU tensor): SGLang's own method runs, unchanged
    (one all-reduce with a residual, none without one), and uninstall restores it by identity."""
    mods, calls = make_fake_sglang()
    RMSNorm = mods[I.MOD_LAYERNORM].RMSNorm
    orig = RMSNorm.__dict__["forward_with_allreduce_fusion"]
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    assert rep.applied == ["fused_norm", "pre_capture"] and rep.skipped == {}
    norm = RMSNorm(8)
    x, res = torch.randn(4, 8), torch.randn(4, 8)
    res_before = res.clone()
    for use_attn in (True, False):
        out, new_res = norm.forward_with_allreduce_fusion(x, res, use_attn_tp_group=use_attn)
        want_out, want_res = _expected(x, res_before)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(new_res, want_res)
        assert torch.equal(res, res_before)  # a fresh residual; the caller's is untouched
    assert calls["ar"] == 2 and calls["orig_fused"] == 2
    post = torch.randn(4, 8)
    out, new_res = norm.forward_with_allreduce_fusion(x, res, post)
    torch.testing.assert_close(new_res, res_before + post + 2 * x)
    assert calls["ar"] == 3 and calls["orig_fused"] == 3
    # idempotent
    assert I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"}).applied == ["fused_norm", "pre_capture"]
    # the fused norm, the all-reduce counter (the fake has no other counting target), the rank step
    assert I.installed() == [
        "RMSNorm.forward_with_allreduce_fusion",
        "GroupCoordinator.all_reduce",
        "ModelRunner.init_cuda_graphs",
    ]
    assert I.uninstall() == 3
    assert RMSNorm.__dict__["forward_with_allreduce_fusion"] is orig


class FakeFused:
    def __init__(self, bad=False, supports=True, sum_of=2):
        self.bad, self.ok, self.calls, self.sum_of = bad, supports, 0, sum_of

    def supports(self, x):
        return self.ok

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps):
        self.calls += 1
        r = residual + x * self.sum_of + (1.0 if self.bad else 0.0)
        return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight, r


def _tp(mods):
    return mods[I.MOD_PARALLEL_STATE].get_tp_group()


def test_fused_backend_used_checked_and_disabled_on_mismatch(caplog):
    mods, calls = make_fake_sglang()
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    norm = mods[I.MOD_LAYERNORM].RMSNorm(8)
    x, res = torch.randn(4, 8), torch.randn(4, 8)
    good = FakeFused()
    I.attach_fused_backend(good, _tp(mods))
    out, r = norm.forward_with_allreduce_fusion(x, res)
    torch.testing.assert_close(r, _expected(x, res)[1])
    assert good.calls == 1 and calls["ar"] == 1  # the one startup comparison with the plain path
    norm.forward_with_allreduce_fusion(x, res)
    assert good.calls == 2 and calls["ar"] == 1 and calls["orig_fused"] == 0  # fused from then on
    # a wrong backend: disabled with one line, result still correct (SGLang's own method then)
    bad = FakeFused(bad=True)
    I.attach_fused_backend(bad, _tp(mods))
    with caplog.at_level(logging.WARNING, logger="fastverify.patch"):
        out, r = norm.forward_with_allreduce_fusion(x, res)
        out2, r2 = norm.forward_with_allreduce_fusion(x, res)
    torch.testing.assert_close(r, _expected(x, res)[1])
    torch.testing.assert_close(r2, _expected(x, res)[1])
    assert bad.calls == 1 and calls["orig_fused"] == 2
    assert len([m for m in caplog.messages if "disabled" in m]) == 1


def test_declined_call_runs_sglangs_own_fused_method_and_is_counted_as_such():
    """Item 7: a call the backend declines (a shape above the record's rows) runs SGLang's ORIGINAL
    forward_with_allreduce_fusion -- its own fused kernel, which covers up to 2,048 rows -- not a
    plain all-reduce + a separate norm; counted as the backend's fallback to SGLang's fusion, or,
    where SGLang's method all-reduces through the group, as the backend's plain fallback."""
    from fastverify.patch.paths import COUNTER

    mods, calls = make_fake_sglang()
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    norm = mods[I.MOD_LAYERNORM].RMSNorm(8)
    x, res = torch.randn(40, 8), torch.randn(40, 8)
    I.attach_fused_backend(FakeFused(supports=False), _tp(mods), checked=True)
    calls["sglang_kernel"] = True
    COUNTER.reset()
    out, r = norm.forward_with_allreduce_fusion(x, res)
    torch.testing.assert_close(r, _expected(x, res)[1])
    assert calls["orig_fused"] == 1 and calls["ar"] == 0  # SGLang's own kernel, no plain all-reduce
    assert COUNTER.snapshot() == {"other": {f"fastverify.FakeFused.{F.FUSED_SGLANG_FALLBACK}": 1}}
    calls["sglang_kernel"] = False  # SGLang's kernel declines too: its own all-reduce through the group
    out, r = norm.forward_with_allreduce_fusion(x, res)
    torch.testing.assert_close(r, _expected(x, res)[1])
    assert calls["orig_fused"] == 2 and calls["ar"] == 1
    assert COUNTER.snapshot() == {
        "other": {f"fastverify.FakeFused.{F.FUSED_SGLANG_FALLBACK}": 1, "fastverify.FakeFused.fallback": 1}
    }
    assert COUNTER.take_fallback() is None  # no mark left for a later, unrelated all-reduce


def test_no_residual_is_sglangs_own_norm_without_an_all_reduce():
    """Item 8: residual=None with a live, checked backend: SGLang only norms (layernorm.py); the
    replacement runs SGLang's method and all-reduces nothing."""
    mods, calls = make_fake_sglang()
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    norm = mods[I.MOD_LAYERNORM].RMSNorm(8)
    be = FakeFused()
    I.attach_fused_backend(be, _tp(mods), checked=True)
    x = torch.randn(4, 8)
    out = norm.forward_with_allreduce_fusion(x, None)
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert calls["ar"] == 0 and be.calls == 0 and calls["orig_fused"] == 1


def _two_group_sglang():
    """The fake SGLang with moe_dp 2 on 4 ranks: the attention-TP group is the TP group (4 ranks),
    the post-experts group another coordinator of 2 (SGLang's MoE-TP group, moe/utils.py)."""
    mods, calls = make_fake_sglang(4)
    ps = mods[I.MOD_PARALLEL_STATE]
    moe_group = ps.GroupCoordinator()
    moe_group.world_size, moe_group.unique_name, moe_group.ranks = 2, "moe_tp:0", [0, 1]
    mods[I.MOD_MOE_UTILS].post_experts_reduction_group = lambda: moe_group
    return mods, calls, ps.get_tp_group(), moe_group


def test_fused_slot_keeps_one_backend_per_group_and_uses_it_only_for_calls_owed_to_it():
    """Item 4: the attention output goes to the attention-TP group's backend, the MoE output to the
    post-experts group's; each sums over its own group (4 and 2 ranks here)."""
    mods, calls, tp, moe_group = _two_group_sglang()
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    norm = mods[I.MOD_LAYERNORM].RMSNorm(8)
    on_tp, on_moe = FakeFused(sum_of=4), FakeFused(sum_of=2)
    I.attach_fused_backend(on_tp, tp, checked=True)
    I.attach_fused_backend(on_moe, moe_group, checked=True)
    x, res = torch.randn(4, 8), torch.randn(4, 8)
    _, r = norm.forward_with_allreduce_fusion(x, res, use_attn_tp_group=True)
    torch.testing.assert_close(r, res + 4 * x)
    _, r = norm.forward_with_allreduce_fusion(x, res, use_attn_tp_group=False)
    torch.testing.assert_close(r, res + 2 * x)
    assert (on_tp.calls, on_moe.calls, calls["ar"], calls["orig_fused"]) == (1, 1, 0, 0)
    # a group without a backend: SGLang's own method, over that group
    I.uninstall()
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    I.attach_fused_backend(on_tp, tp, checked=True)
    _, r = norm.forward_with_allreduce_fusion(x, res, use_attn_tp_group=False)
    torch.testing.assert_close(r, res + 2 * x)
    assert on_tp.calls == 1 and calls["orig_fused"] == 1


def test_rank_step_builds_one_fused_backend_per_group(capsys):
    """Item 4: the rank step creates and prepares a backend on each group the fused calls are owed
    to (attention TP, then post-experts), each on its own coordinator, and the line names both."""
    mods, calls, tp, moe_group = _two_group_sglang()
    events = []

    def factory(coordinator, x):
        events.append(("create", coordinator.unique_name, coordinator.world_size))
        return FakePrepared(events)

    S.FUSED_SLOT.factory = factory
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    mods[I.MOD_MODEL_RUNNER].ModelRunner(hidden=8, width=4, pool=48).init_cuda_graphs()
    assert [e[:2] for e in events if e[0] == "create"] == [("create", "tp:0"), ("create", "moe_tp:0")]
    assert [s.group for s in F.FUSED_GROUPS] == [tp, moe_group]
    assert all(s.backend is not None for s in F.FUSED_GROUPS)
    assert rep.built["fused_norm"] == "tp:0: FakePrepared, moe_tp:0: FakePrepared", rep.built
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fastverify patch [TP 0]")][0]
    assert "built=fused_norm=tp:0: FakePrepared, moe_tp:0: FakePrepared" in line, line


def test_changed_signature_skipped_with_one_line(caplog):
    mods, calls = make_fake_sglang(norm_params="changed")
    before = mods[I.MOD_LAYERNORM].RMSNorm.__dict__["forward_with_allreduce_fusion"]
    with caplog.at_level(logging.WARNING, logger="fastverify.patch"):
        rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    assert rep.applied == ["pre_capture"] and "fused_norm" in rep.skipped  # pre_capture: the rank line
    assert len([m for m in caplog.messages if "skipped" in m]) == 1
    assert mods[I.MOD_LAYERNORM].RMSNorm.__dict__["forward_with_allreduce_fusion"] is before


def test_missing_targets_never_raise(caplog):
    mods, _ = make_fake_sglang()
    del mods[I.MOD_TP_WORKER]
    del mods[I.MOD_LAYERNORM].RMSNorm
    with caplog.at_level(logging.WARNING, logger="fastverify.patch"):
        rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused", "FASTVERIFY_PROFILE_VERIFY": "/tmp/x"})
        rep2 = I.install(None, environ={**ON, "FASTVERIFY_BACKEND": "pcie_ipc"}, sglang_switch_modules=frozenset())
    assert set(rep.skipped) == {"fused_norm", "verify_timer"} and rep.applied == ["pre_capture"]
    assert {"all_reduce", "pre_capture"} <= set(rep2.skipped)  # no SGLang importable here at all
    assert len([m for m in caplog.messages if "skipped" in m]) == 4


def test_dispatch_wrapped_only_without_sglang_pcie_ipc():
    mods, calls = make_fake_sglang()
    GC = mods[I.MOD_PARALLEL_STATE].GroupCoordinator
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "pcie_ipc"}, sglang_switch_modules=PCIE_IPC_SWITCH)
    assert rep.applied == ["pre_capture"] and "all_reduce" in rep.skipped
    assert I.installed() == ["GroupCoordinator.all_reduce", "ModelRunner.init_cuda_graphs"]  # counted, not routed
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "pcie_ipc"}, sglang_switch_modules=frozenset())
    assert rep.applied == ["all_reduce", "pre_capture"]
    g = GC()
    x = torch.ones(2, 4)
    assert torch.equal(g.all_reduce(x), x * 2) and calls["ar"] == 1  # no backend yet: SGLang's path

    class Be:
        n = 0

        def supports(self, t):
            return True

        def all_reduce(self, t):
            Be.n += 1
            return t * 2

    I.attach_dispatch_backend(Be())
    assert torch.equal(g.all_reduce(x), x * 2) and Be.n == 1 and calls["ar"] == 1


def test_cuda_max_connections_reapplied(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # what SGLang's launcher wrote
    mods, _ = make_fake_sglang()
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "auto", "FASTVERIFY_CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and rep.settings == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert rep.applied == ["pre_capture"]  # auto: SGLang's dispatch untouched; only the rank line


# --- before CUDA-graph capture --------------------------------------------------------------------


class FakePrepared:
    def __init__(self, log):
        self.log = log

    def supports(self, x):
        return True

    def prepare(self, shapes):
        self.log.append(("prepare", list(shapes)))


def _capture_setup(backend, fail=None):
    mods, calls = make_fake_sglang()
    events = calls.setdefault("events", [])  # one timeline: creation, prepare, the original
    MR = mods[I.MOD_MODEL_RUNNER].ModelRunner
    orig = MR.__dict__["init_cuda_graphs"]

    def factory(coordinator, x):
        events.append(("create", coordinator, tuple(x.shape), x.dtype))
        if fail == "create":
            raise RuntimeError("no workspace")
        return FakePrepared(events) if fail != "prepare" else BadPrepare(events)

    return mods, calls, events, MR, orig, factory


class BadPrepare(FakePrepared):
    closed = False

    def prepare(self, shapes):
        raise RuntimeError("prepare failed")

    def close(self):
        BadPrepare.closed = True


@pytest.mark.parametrize("backend,slot", [("fused", "FUSED_SLOT"), ("pcie_ipc", "DISPATCH_SLOT")])
def test_pre_capture_prepares_once_before_the_original(backend, slot):
    mods, calls, events, MR, orig, factory = _capture_setup(backend)
    getattr(S, slot).factory = factory
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": backend}, sglang_switch_modules=frozenset())
    assert "pre_capture" in rep.applied and rep.skipped == {}
    assert MR.__dict__["init_cuda_graphs"].__fastverify_original__ is orig
    runner = MR(hidden=8, width=4, pool=48)
    real = MR.__dict__["init_cuda_graphs"].__wrapped__
    assert real is orig
    runner.init_cuda_graphs(capture_decode_cuda_graph=False)
    # capture bs [1..64] clamped to the pool (48, added as SGLang does), x 4 tokens per request
    want = [(r, 8) for r in (4, 8, 16, 32, 64, 128, 192)]
    group = mods[I.MOD_PARALLEL_STATE].get_tp_group()
    assert events == [("create", group, (192, 8), torch.float32), ("prepare", want), ("capture", False)]
    assert calls["captures"] == [False]  # the original ran, after prepare, with its argument
    built = F.FUSED_GROUPS[0] if slot == "FUSED_SLOT" else getattr(S, slot)  # the fused slot: one per group
    assert built.backend is not None and built.group is (group if slot == "FUSED_SLOT" else None)
    runner.init_cuda_graphs()  # second call (e.g. the draft runner or a recapture): no second prepare
    MR(is_draft_worker=True).init_cuda_graphs()
    assert [e[0] for e in events] == ["create", "prepare", "capture", "capture", "capture"]
    assert calls["captures"] == [False, True, True]
    # idempotent install, and uninstall restores the original by identity
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": backend}, sglang_switch_modules=frozenset())
    assert I.installed().count("ModelRunner.init_cuda_graphs") == 1
    I.uninstall()
    assert MR.__dict__["init_cuda_graphs"] is orig and getattr(S, slot).prepared is False


def _record_file(tmp_path, *, max_batch=8, draft=4, hidden=16, p2p_ok=True, source="p2p_check"):
    from fastverify.deploy import BoxFingerprint, DeploymentRecord, P2PFacts, VerifyShapes, write_deployment

    rec = DeploymentRecord(
        backend="fused",
        shapes=VerifyShapes(max_batch, draft, hidden, "float32"),
        p2p=P2PFacts(p2p_ok, source, "all 2 ordered pairs passed", 2),
        box=BoxFingerprint("test GPU", (9, 0), 2, 2),
    )
    return str(write_deployment(tmp_path / "x.env", {}, rec)[1])  # tune's writer: x.env and x.deploy.json


def test_pre_capture_sizes_from_the_record_not_2048_rows(tmp_path):
    """Item 7: the workspace is the record's max_batch x draft_tokens x hidden (8 x 4 x 16), and
    only the captured shapes up to it are prepared -- not one batch, not 2048 rows."""
    mods, calls, events, MR, orig, factory = _capture_setup("fused")
    S.FUSED_SLOT.factory = factory
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused", "FASTVERIFY_DEPLOYMENT": _record_file(tmp_path)})
    MR(hidden=16, width=4, pool=48).init_cuda_graphs()
    # capture bs [1..64] + pool 48, x 4 tokens per request, up to the record's 32 rows
    assert events[0][2] == (32, 16) and events[1] == ("prepare", [(4, 16), (8, 16), (16, 16), (32, 16)])
    # SGLang's own fusion gate asked for the verify rows, before capture and after its start-up checks
    assert calls["gate"] == [32, 32]
    from fastverify.deploy import read_record
    from fastverify.patch import rank as R

    rec = read_record(tmp_path / "x.deploy.json")
    assert R.workspace_numel(rec, 16, 999) == 8 * 4 * 16 == 512
    with pytest.raises(ValueError, match="hidden size 16, this model has 32"):
        R.workspace_numel(rec, 32, None)
    with pytest.raises(ValueError, match="no deployment record and no captured batch sizes"):
        R.workspace_numel(None, 16, None)
    assert R.workspace_numel(None, 16, 192) == 192 * 16  # SGLang's widest captured decode without a record


def test_pre_capture_without_batch_sizes_or_record_prepares_nothing():
    mods, calls, events, MR, orig, factory = _capture_setup("fused")
    del mods[I.MOD_RUNTIME_CONTEXT]
    S.FUSED_SLOT.factory = factory
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    r = MR(hidden=16)
    del r.req_to_token_pool
    r.init_cuda_graphs()
    assert [e[0] for e in events] == ["create", "capture"]  # no shapes known: no prepare, no 2048-row guess
    # server_args.cuda_graph_bs (older SGLang) is read when the runtime context is absent
    I.uninstall()
    events.clear()
    S.FUSED_SLOT.factory = factory
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    r = MR(hidden=16, width=2, pool=100)
    r.server_args.cuda_graph_bs = [1, 3, 2000]
    r.init_cuda_graphs()
    assert events[-2] == ("prepare", [(2, 16), (6, 16), (200, 16)])  # 2000 > pool: the pool (100) instead


@pytest.mark.parametrize("fail", ["create", "prepare"])
def test_pre_capture_failure_disables_logged_not_raised(fail, caplog, capsys):
    mods, calls, events, MR, orig, factory = _capture_setup("fused", fail=fail)
    S.FUSED_SLOT.factory = factory
    BadPrepare.closed = False
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    with caplog.at_level(logging.WARNING, logger="fastverify.patch"):
        MR().init_cuda_graphs()
        MR().init_cuda_graphs()
    assert calls["captures"] == [True, True]  # the original still ran
    lines = [m for m in caplog.messages if "disabled on every TP rank" in m]
    assert len(lines) == 1, caplog.messages
    assert S.FUSED_SLOT.backend is None and S.FUSED_SLOT.disabled is not None  # agreed (one rank here): no lazy retry
    assert BadPrepare.closed is (fail == "prepare")  # every rank holds one after a failed prepare: closed
    err = capsys.readouterr().err.splitlines()
    assert len([ln for ln in err if ln.startswith("fastverify patch [TP 0]:")]) == 1, err
    # a runner that cannot even be read (no model_config): logged, never raised
    I.uninstall()
    caplog.clear()
    S.FUSED_SLOT.factory = factory
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    runner = MR()
    del runner.model_config
    with caplog.at_level(logging.WARNING, logger="fastverify.patch"):
        runner.init_cuda_graphs()
    assert len([m for m in caplog.messages if "before CUDA-graph capture failed" in m]) == 1


@pytest.mark.parametrize("backend", ["nccl", "off", "auto"])
def test_pre_capture_only_prints_for_other_backends(backend, capsys):
    mods, calls, events, MR, orig, factory = _capture_setup(backend)
    S.FUSED_SLOT.factory = S.DISPATCH_SLOT.factory = factory
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": backend})
    assert rep.applied == ["pre_capture"]
    MR().init_cuda_graphs()
    assert [e[0] for e in events] == ["capture"]  # nothing created, the original ran
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fastverify patch")]
    assert line.startswith(f"fastverify patch [TP 0]: backend={backend} applied=pre_capture"), line
    # nor for pcie_ipc where SGLang has its own PCIe IPC all-reduce (the patch creates no backend)
    I.uninstall()
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "pcie_ipc"}, sglang_switch_modules=PCIE_IPC_SWITCH)
    assert rep.applied == ["pre_capture"] and "all_reduce" in rep.skipped


def test_unknown_backend_name_is_skipped():
    mods, _ = make_fake_sglang()
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "pcie-ipc"})
    assert "unknown FASTVERIFY_BACKEND 'pcie-ipc'" in rep.skipped["backend"] and "pcie_ipc" in rep.skipped["backend"]
    assert rep.applied == ["pre_capture"]


def test_fused_norm_not_claimed_where_sglang_never_calls_it(capsys):
    """Item 4: SGLang's gate (flashinfer_ar_fusion_applies) says no (SM89/SM120): fused_norm is moved
    to skipped with the reason, and no backend (workspace) is built for a path nobody calls."""
    mods, calls, events, MR, orig, factory = _capture_setup("fused")
    mods[I.MOD_ADD_NORM].flashinfer_ar_fusion_applies = lambda bs: calls["gate"].append(bs) or False
    S.FUSED_SLOT.factory = factory
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    MR(hidden=8, width=4, pool=48).init_cuda_graphs()
    assert "fused_norm" not in rep.applied and "flashinfer_ar_fusion_applies(192) is False" in rep.skipped["fused_norm"]
    assert [e[0] for e in events] == ["capture"] and calls["gate"] == [192]
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fastverify patch [TP 0]")][0]
    assert "applied=pre_capture " in line and "skipped=fused_norm (SGLang never calls" in line, line


def test_fused_norm_reach_without_the_gate_uses_the_registry():
    from fastverify.patch import rank as R

    assert R.fused_norm_reach({}, 4, (12, 0))[0] is False  # no gate function: registry, SM120 not called
    assert "SM90/SM100" in R.fused_norm_reach({}, 4, (8, 9))[1]
    assert R.fused_norm_reach({}, 4, (9, 0))[0] is True
    assert R.fused_norm_reach({}, 4, None)[0] is False  # neither: not claimed


def test_pre_capture_signature_matches_real_source(tmp_path):
    z = _wheel_tree(tmp_path)
    pos, kw = _method_params(
        z.read("sglang/srt/model_executor/model_runner.py").decode(), "ModelRunner", "init_cuda_graphs"
    )
    assert pos == ["self", "capture_decode_cuda_graph"] and kw == []
    tw = z.read("sglang/srt/managers/tp_worker.py").decode()
    assert "self.model_runner.init_cuda_graphs(" in tw  # every TP rank, once per runner, before capture
    assert "def decode_num_tokens_per_req(" in z.read("sglang/srt/model_executor/model_runner.py").decode()
    assert (
        "get_exec().graph.cuda_graph_config.decode.bs"
        in z.read("sglang/srt/model_executor/runner/base_cuda_graph_runner.py").decode()
    )


class FakeEvent:
    clock = 0

    def __init__(self):
        self.t, self.recorded = None, False

    def record(self):
        FakeEvent.clock += 5
        self.t = FakeEvent.clock

    def query(self):
        return self.t is not None and self.t < 1000  # events >= 1000 "still running on the GPU"

    def elapsed_time(self, end):
        return float(end.t - self.t)


def _wait_rows(path, n, timeout=5.0):
    """The JSON lines at ``path`` once it holds ``n`` (the writer thread appends them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            break
        time.sleep(0.01)
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_verify_timer_writes_json_lines_without_sync(tmp_path):
    mods, _ = make_fake_sglang()
    timer = I.VerifyTimer(tmp_path, every=2, event_factory=FakeEvent, clock="test", rank=lambda: "3")
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "off"}, timer=timer)
    assert rep.applied == ["pre_capture", "verify_timer"]
    w = mods[I.MOD_TP_WORKER].TpModelWorker()
    assert w.forward_batch_generation(None, "fb") == ("result", False)
    assert timer.steps == 0  # not a verify forward
    assert w.forward_batch_generation(None, "fb", None, True) == ("result", True)  # positional is_verify
    assert w.forward_batch_generation(None, forward_batch="fb", is_verify=True) == ("result", True)
    rows = _wait_rows(tmp_path / "verify-rank3.jsonl", 2)  # written by the timer's writer thread, not the forward
    assert [r["step"] for r in rows] == [0, 1] and all(r["verify_ms"] == 5.0 for r in rows)
    assert rows[0]["clock"] == "test" and rows[0]["rank"] == "3"
    FakeEvent.clock = 2000  # the GPU has not finished these: not read yet, kept for later
    w.forward_batch_generation(None, "fb", is_verify=True)
    w.forward_batch_generation(None, "fb", is_verify=True)
    assert len(timer.pending) == 2 and timer.written == 2
    FakeEvent.clock = 0


def test_verify_trace_of_n_steps(tmp_path):
    """FASTVERIFY_PROFILE_VERIFY_STEPS=2: a torch.profiler trace of the next 2 verify forwards, each in a
    step[TARGET_VERIFY #i] span, written once the 2nd ends (CPU here, so only host events)."""
    import gzip

    mods, _ = make_fake_sglang()
    env = {
        **ON,
        "FASTVERIFY_BACKEND": "off",
        "FASTVERIFY_PROFILE_VERIFY": str(tmp_path),
        "FASTVERIFY_PROFILE_VERIFY_STEPS": "2",
    }
    timer = I.VerifyTimer(tmp_path, every=100, event_factory=WallEvent, clock="cpu_wall_clock", rank=lambda: "1")
    rep = I.install(mods, environ=env, timer=timer)
    assert rep.applied == ["pre_capture", "verify_timer"]
    w = mods[I.MOD_TP_WORKER].TpModelWorker()
    w.forward_batch_generation(None, "fb", is_verify=True)
    assert not list(tmp_path.glob("verify-TP-*.trace.json.gz"))  # written when the 2nd traced step ends
    w.forward_batch_generation(None, "fb", is_verify=True)
    w.forward_batch_generation(None, "fb", is_verify=True)  # after the trace: timed, not traced
    (path,) = tmp_path.glob("verify-TP-*.trace.json.gz")  # TP rank, or pid<N> without torch.distributed
    doc = json.loads(gzip.decompress(path.read_bytes()))
    spans = sorted(e["name"] for e in doc["traceEvents"] if str(e.get("name", "")).startswith("step[TARGET_VERIFY"))
    assert spans == ["step[TARGET_VERIFY #0]", "step[TARGET_VERIFY #1]"]
    assert timer.steps == 3


def test_cpu_timer_default(tmp_path):
    t = I.VerifyTimer(tmp_path, every=1, event_factory=WallEvent, clock="cpu_wall_clock", rank=lambda: "0")
    t.stop(t.start())
    (row,) = _wait_rows(tmp_path / "verify-rank0.jsonl", 1)
    assert row["clock"] == "cpu_wall_clock" and row["verify_ms"] >= 0 and row["step"] == 0 and row["rank"] == "0"


def test_plugin_entry_point_is_gated(monkeypatch):
    """SGLang calls ``plugin()`` in every process that loads its plugins: without
    ``FASTVERIFY_PATCH=1`` it must wrap nothing; with it, it installs (the fake SGLang's modules
    are importable, as the real ones are in a server)."""
    import sys

    from fastverify.patch import plugin

    mods, calls = make_fake_sglang()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    RMSNorm = mods[I.MOD_LAYERNORM].RMSNorm
    orig = RMSNorm.__dict__["forward_with_allreduce_fusion"]
    reports = []  # what each install() the plugin made returned
    real_install = I.install
    monkeypatch.setattr(I, "install", lambda *a, **k: reports.append(real_install(*a, **k)) or reports[-1])
    monkeypatch.setenv("FASTVERIFY_BACKEND", "fused")
    for flag in (None, "0", "true", "yes"):  # only "1" opens the gate
        if flag is None:
            monkeypatch.delenv("FASTVERIFY_PATCH", raising=False)
        else:
            monkeypatch.setenv("FASTVERIFY_PATCH", flag)
        plugin()
        assert I.installed() == [] and reports == [], flag  # install() never ran
        assert RMSNorm.__dict__["forward_with_allreduce_fusion"] is orig
    monkeypatch.setenv("FASTVERIFY_PATCH", "1")
    plugin()
    # the fused norm, the all-reduce counter (the fake has no out/in-place halves to count) and the
    # pre-capture hook: the three targets the fake SGLang has
    assert I.installed() == [
        "RMSNorm.forward_with_allreduce_fusion",
        "GroupCoordinator.all_reduce",
        "ModelRunner.init_cuda_graphs",
    ]
    (report,) = reports
    assert report.active and report.backend == "fused" and report.applied == ["fused_norm", "pre_capture"]
    assert RMSNorm.__dict__["forward_with_allreduce_fusion"] is not orig
    out, _ = RMSNorm(8).forward_with_allreduce_fusion(torch.ones(2, 8), torch.zeros(2, 8))
    assert calls["ar"] == 1 and calls["orig_fused"] == 1  # no backend built yet: SGLang's own method


# --- the real SGLang 0.5.23 source (ast only, nothing imported) --------------------------------------


def _wheel_tree(tmp_path):
    whl = os.environ.get("FASTVERIFY_SGLANG_WHEEL")
    if not whl or not Path(whl).is_file():
        pytest.skip("FASTVERIFY_SGLANG_WHEEL not set: cannot check the targets against real SGLang source")
    return zipfile.ZipFile(whl)


def _method_params(source, cls, attr):
    """(positional, keyword-only) parameter names of ``cls.attr`` (a top-level def when cls is None)."""
    tree = ast.parse(source)
    if cls is None:
        for item in tree.body:
            if isinstance(item, ast.FunctionDef) and item.name == attr:
                return [p.arg for p in item.args.posonlyargs + item.args.args], [p.arg for p in item.args.kwonlyargs]
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == attr:
                    a = item.args
                    return [p.arg for p in a.posonlyargs + a.args], [p.arg for p in a.kwonlyargs]
    return None


def test_targets_exist_in_real_sglang_source(tmp_path):
    z = _wheel_tree(tmp_path)
    for t in I.TARGETS:
        path = t.module.replace(".", "/") + ".py"
        found = _method_params(z.read(path).decode(), t.cls, t.attr)
        assert found is not None, f"{t.cls}.{t.attr} not in {path}"
        pos, kw = found
        assert tuple(pos[: len(t.params)]) == t.params, (t.key, pos)
        assert all(n in pos + kw for n in t.needs), (t.key, pos, kw)
    # the functions the fused replacement finds the owed group with (fused_slot._fusion_group): SGLang's
    # resolve_fusion_group(use_attn_tp_group=...) -> (world, rank, coordinator), post_experts_reduction_group()
    fi = z.read("sglang/srt/layers/flashinfer_comm_fusion.py").decode()
    assert _method_params(fi, None, "resolve_fusion_group") == ([], ["use_attn_tp_group"])
    assert "return group.world_size, group.rank_in_group, group" in fi
    assert _method_params(z.read("sglang/srt/layers/moe/utils.py").decode(), None, "post_experts_reduction_group") == (
        [],
        [],
    )
    # how SGLang's layer boundary calls the norm: the MoE output only when owed to that very group
    fus = z.read("sglang/srt/layers/layer_boundary/fusions/allreduce.py").decode()
    assert "plan.norm.forward_with_allreduce_fusion(" in fus
    assert "or owed.group is not post_experts_reduction_group()" in fus
    assert "hidden_states, residual, use_attn_tp_group=False" in fus
    # SGLang's method without a residual only norms (the replacement then runs it unchanged)
    ln = z.read("sglang/srt/layers/layernorm.py").decode()
    body = ln.split("def _forward_with_allreduce_fusion(")[1].split("\ndef ")[0]
    assert "    if residual is not None:\n" in body and body.rstrip().endswith(
        "return norm_module.forward(x, residual, post_residual_addition)"
    )
    # the add-norm targets are module attributes looked up when the model is built (not imported by
    # name anywhere else), and called by the boundary before its own all-reduce + norm
    assert "partial(fused_ffn_input, plan)" in fus and "partial(\n            fused_attn_input," in fus
    assert "from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm" in fus
    assert "UnreducedOutput" in fus
    for name, text in ((n, z.read(n).decode()) for n in z.namelist() if n.endswith(".py")):
        if name != "sglang/srt/layers/layer_boundary/fusions/allreduce.py":
            assert "import fused_ffn_input" not in text and "fused_attn_input," not in text, name
    prep = z.read("sglang/srt/layers/layer_boundary/prepare.py").decode()
    assert "for fused in fusions:\n        result = fused(hidden_states, residual, forward_batch)" in prep
    assert "for fused in carried_fusions:" in prep
    ps = z.read("sglang/srt/distributed/parallel_state.py").decode()
    assert "def get_attn_tp_group(" in ps and "def get_tp_group(" in ps
    assert "sglang/srt/distributed/device_communicators/pcie_ipc_ar.py" in z.namelist()
    eng = z.read("sglang/srt/entrypoints/engine.py").decode()
    assert 'os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"' in eng
    assert '"NCCL_CUMEM_ENABLE" not in os.environ' in eng
    plug = z.read("sglang/srt/plugins/__init__.py").decode()
    assert 'GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"' in plug and "SGLANG_PLUGINS" in plug
    assert "load_plugins()" in z.read("sglang/srt/managers/scheduler.py").decode()


# --- two real gloo ranks: facts from the coordinator, votes on its CPU group ----------------------


class _Closable:
    def __init__(self, log, *, bad_prepare=False):
        self.log, self.bad_prepare = log, bad_prepare

    def supports(self, x):
        return True

    def prepare(self, shapes):
        self.log.append("prepare")
        if self.bad_prepare:
            raise RuntimeError("prepare failed on this rank")

    def close(self):
        self.log.append("close")


def _vote_worker(rank, world, port, record_path, q):
    """One TP rank (spawned): a real 2-rank gloo group stands in for SGLang's device and CPU groups."""
    import datetime

    import torch.distributed as dist

    out = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=30),
        )

        def real_ar(x):  # SGLang's plain all-reduce, for real on the gloo group
            y = x.clone()
            dist.all_reduce(y, group=dist.group.WORLD)
            return y

        mods, calls = make_fake_sglang(world, all_reduce=real_ar)
        MR = mods[I.MOD_MODEL_RUNNER].ModelRunner
        coord = mods[I.MOD_PARALLEL_STATE].get_tp_group()
        coord.device_group = coord.cpu_group = dist.group.WORLD
        coord.rank_in_group = rank
        env = {**ON, "FASTVERIFY_BACKEND": "fused", "FASTVERIFY_DEPLOYMENT": record_path}

        def run(case):
            log = []
            I.uninstall()
            if case != "real":

                def factory(c, x):
                    if case == "create" and rank == 1:
                        raise RuntimeError("no workspace on this rank")
                    return _Closable(log, bad_prepare=(case == "prepare" and rank == 1))

                S.FUSED_SLOT.factory = factory
            rep = I.install(mods, environ=env)
            r = MR(hidden=16, width=4, pool=48)
            r.dtype, r.device = torch.float32, "cpu"
            r.init_cuda_graphs()
            slot = F.group_slot(coord)  # the fused slot of the TP group (attention TP = post-experts here)
            res = {
                "log": log,
                "disabled": slot.disabled,
                "built": slot.backend is not None,
                "applied": list(rep.applied),
                "skipped": dict(rep.skipped),
            }
            if case == "real" and slot.backend is not None:
                ctx = getattr(slot, "context", None)
                res["ctx"] = ctx and [
                    ctx.world_size,
                    ctx.device_type,
                    ctx.group_backend,
                    ctx.single_node,
                    ctx.p2p_ok,
                    ctx.p2p_note,
                ]
                be = slot.backend
                res["backend"] = [be.name.value, be.max_numel, be.hidden]
                # the fused replacement on the gloo backend: first check voted, result right
                norm = mods[I.MOD_LAYERNORM].RMSNorm(16)
                x = torch.full((4, 16), float(rank + 1))
                resid = torch.ones(4, 16)
                _, new_res = norm.forward_with_allreduce_fusion(x, resid)
                res["sum_ok"] = bool(torch.equal(new_res, torch.full((4, 16), 1.0 + 3.0)))  # 1 + (1 + 2)
                res["checked"] = slot.checked
            if case == "check":  # the first result is wrong on rank 1 only
                I.uninstall()
                I.install(mods, environ=env)
                be = FakeFused(bad=(rank == 1))
                I.attach_fused_backend(be, coord)
                norm = mods[I.MOD_LAYERNORM].RMSNorm(16)
                calls["ar"] = 0
                x = torch.full((4, 16), 0.5)  # the same on both ranks: FakeFused's "x * 2" is the true sum
                resid = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
                norm.forward_with_allreduce_fusion(x, resid)
                norm.forward_with_allreduce_fusion(x, resid)
                res = {
                    "disabled": F.group_slot(coord).disabled,
                    "fused_calls": be.calls,
                    "plain_calls": calls["ar"],
                    "sglang_calls": calls["orig_fused"],
                }
            return res

        for case in ("real", "create", "prepare", "check"):
            out[case] = run(case)
        I.uninstall()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback

        out["error"] = traceback.format_exc()
    q.put((rank, out))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import multiprocessing as mp
    import socket

    record = _record_file(tmp_path_factory.mktemp("rec"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_vote_worker, args=(r, 2, port, record, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            r, out = q.get(timeout=120)  # a rank stuck in a one-sided collective never answers
            got[r] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        assert "error" not in got[r], got[r]["error"]
    return got


def test_two_ranks_backend_built_from_the_coordinator(two_ranks):
    """Item 3: the context comes from the coordinator (world 2, its gloo group, single node from
    in_the_same_node_as on its CPU group) and P2P from the record; on CPU the gloo backend is built,
    sized from the record (8 x 4 x 16), and the fused replacement runs on it, first check voted."""
    for r in (0, 1):
        g = two_ranks[r]["real"]
        assert g["built"] and g["disabled"] is None and "fused_norm" in g["applied"], g
        assert g["ctx"][:5] == [2, "cpu", "gloo", True, True], g["ctx"]
        assert g["ctx"][5].startswith("P2P proven by p2p_check (deployment record"), g["ctx"]
        assert g["backend"] == ["gloo", 512, 16]
        assert g["sum_ok"] and g["checked"]


def test_two_ranks_failed_creation_disables_both_and_closes_neither(two_ranks):
    """Item 8: creation fails on rank 1 only: both ranks end disabled (voted on the CPU group),
    rank 0's backend is not closed alone (FlashInfer's destroy barriers would wait for rank 1)."""
    for r in (0, 1):
        c = two_ranks[r]["create"]
        assert not c["built"] and c["disabled"].startswith("TP 1: cannot create it"), c
        assert "close" not in c["log"] and "fused_norm" in c["skipped"], c


def test_two_ranks_failed_prepare_closes_both(two_ranks):
    for r in (0, 1):
        c = two_ranks[r]["prepare"]
        assert not c["built"] and c["disabled"].startswith("TP 1: prepare failed"), c
        assert c["log"] == ["prepare", "close"], c  # every rank holds one: all close together


def test_two_ranks_first_check_mismatch_disables_both(two_ranks):
    """Item 8: the first fused result is wrong on rank 1 only: both ranks leave the fused kernel
    together; SGLang's own method then runs both calls on both ranks."""
    for r in (0, 1):
        c = two_ranks[r]["check"]
        assert c["disabled"] and c["disabled"].startswith("TP 1: first result differs"), c
        # plain all-reduces: the check's and SGLang's own method's on the first call, SGLang's on the second
        assert c["fused_calls"] == 1 and c["plain_calls"] == 3 and c["sglang_calls"] == 2, c


def test_context_from_coordinator_for_a_gpu_backend_passes_p2p_and_node_checks(tmp_path):
    """The GPU probe's P2P and single-node checks pass on the facts from the coordinator and the
    record (the CUDA check itself cannot pass here); without a record P2P stays unknown."""
    import datetime

    import torch.distributed as dist

    from fastverify.backends.base import check_p2p, check_single_node
    from fastverify.deploy import read_record
    from fastverify.patch import rank as R

    with socket_port() as port:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
        )
    try:
        mods, _ = make_fake_sglang(1)
        coord = mods[I.MOD_PARALLEL_STATE].get_tp_group()
        coord.device_group = coord.cpu_group = dist.group.WORLD
        rec = read_record(_record_file(tmp_path))
        ctx = R.context_from_coordinator(coord, device="cuda", dtype=torch.bfloat16, record=rec, modules=mods)
        assert (ctx.world_size, ctx.device_type, ctx.group_backend, ctx.single_node, ctx.p2p_ok) == (
            1,
            "cuda",
            "gloo",
            True,
            True,
        )
        assert check_p2p(ctx) is None and check_single_node(ctx) is None
        ctx = R.context_from_coordinator(coord, device="cuda", dtype=torch.bfloat16, record=None, modules=mods)
        assert ctx.p2p_ok is None and "no deployment record" in check_p2p(ctx).reason + ctx.p2p_note
        nvml = read_record(_record_file(tmp_path, source="nvml"))  # the driver's word is not a proof
        assert (
            R.context_from_coordinator(coord, device="cpu", dtype=torch.float32, record=nvml, modules=mods).p2p_ok
            is None
        )
        del mods[I.MOD_PARALLEL_STATE].in_the_same_node_as  # an SGLang without it: unknown, not guessed
        assert (
            R.context_from_coordinator(coord, device="cpu", dtype=torch.float32, record=rec, modules=mods).single_node
            is None
        )
    finally:
        dist.destroy_process_group()


class socket_port:
    def __enter__(self):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc):
        return False


# --- b12x: the layer boundary's add-norm (issue 9, What to build 4) -------------------------------


class FakeB12x:
    """Stands in for B12xFusedBackend in one process: the fake group's sum (every rank holds the same
    partial, so the sum is world_size * x), then add + RMSNorm; counts its calls and prepares."""

    def __init__(self, log=None, *, bad=False, ws=2):
        self.log, self.bad, self.ws, self.calls, self.closed = log if log is not None else [], bad, ws, 0, False

    def supports(self, x):
        return x.dtype == torch.float32

    def prepare(self, shapes):
        self.log.append(("prepare", list(shapes)))

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps):
        self.calls += 1
        r = residual + x * self.ws + (1.0 if self.bad else 0.0)
        return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight, r

    def close(self):
        self.closed = True
        self.log.append(("close",))


def _boundary(fusions, ar, norm, x, residual):
    """What layer_boundary/prepare.py _reduce_update_read does with its bound candidates: the first
    non-None result, else its own all-reduce + the norm's residual add."""
    for fused in fusions:
        out = fused(x, residual, None)
        if out is not None:
            return out
    return norm(ar(x), residual.clone())


def test_b12x_hooks_the_layer_boundary_and_uninstall_restores():
    """Before: b12x was reported skipped and nothing at the layer boundary was wrapped."""
    mods, calls = make_fake_sglang(sm=(12, 0))
    fu = mods[I.MOD_AR_FUSIONS]
    orig = (fu.__dict__["fused_ffn_input"], fu.__dict__["fused_attn_input"])
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "b12x"})
    assert rep.applied == ["add_norm_ffn", "add_norm_attn", "pre_capture"] and rep.skipped == {}, rep
    assert fu.fused_ffn_input is not orig[0] and fu.fused_ffn_input.__wrapped__ is orig[0]
    assert fu.fused_attn_input.__fastverify_original__ is orig[1]
    assert I.installed() == [
        "allreduce.fused_ffn_input",
        "allreduce.fused_attn_input",
        "GroupCoordinator.all_reduce",
        "ModelRunner.init_cuda_graphs",
    ]
    # nothing built yet: both candidates are SGLang's own (None here, as on SM120)
    norm = mods[I.MOD_LAYERNORM].RMSNorm(8)
    plan = types.SimpleNamespace(norm=norm, fusions=None)
    x, res = torch.randn(4, 8), torch.randn(4, 8)
    assert fu.fused_ffn_input(plan, x, res, None) is None and calls["orig_ffn"] == 1
    assert I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "b12x"}).applied == rep.applied  # idempotent
    assert I.uninstall() == 4
    assert (fu.__dict__["fused_ffn_input"], fu.__dict__["fused_attn_input"]) == orig


def test_b12x_without_the_layer_boundary_is_skipped():
    """An SGLang without fusions/allreduce.py (older) or without the names the replacement needs."""
    mods, _ = make_fake_sglang(sm=(12, 0))
    del mods[I.MOD_AR_FUSIONS].UnreducedOutput
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "b12x"})
    assert rep.applied == ["pre_capture"] and "has no UnreducedOutput" in rep.skipped["add_norm_ffn"]
    I.uninstall()
    mods, _ = make_fake_sglang(sm=(12, 0))
    del mods[I.MOD_AR_FUSIONS]
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "b12x"})
    assert rep.applied == ["pre_capture"] and "not given" in rep.skipped["add_norm_attn"]


def _b12x_rank_step(tmp_path, sm, *, bad=False):
    mods, calls = make_fake_sglang(sm=sm, fusion_applies=False)  # SGLang's own fusion gate: False
    events = []

    def factory(coordinator, x):
        events.append(("create", tuple(x.shape)))
        be = FakeB12x(events, bad=bad)
        events.append(be)
        return be

    S.ADD_NORM_SLOT.factory = factory
    rep = I.install(
        mods, environ={**ON, "FASTVERIFY_BACKEND": "b12x", "FASTVERIFY_DEPLOYMENT": _record_file(tmp_path, hidden=8)}
    )
    runner = mods[I.MOD_MODEL_RUNNER].ModelRunner(hidden=8, width=4, pool=48)
    runner.device = "cpu"
    runner.init_cuda_graphs()
    return mods, calls, events, rep


def test_b12x_rank_step_on_sm120_builds_prepares_and_checks(tmp_path, capsys):
    mods, calls, events, rep = _b12x_rank_step(tmp_path, (12, 0))
    be = S.ADD_NORM_SLOT.backend
    assert isinstance(be, FakeB12x) and S.ADD_NORM_SLOT.checked and S.ADD_NORM_SLOT.disabled is None
    # sized from the record (8 x 4 rows), the captured shapes up to it prepared, then the one check
    assert events[0] == ("create", (32, 8)) and events[2] == ("prepare", [(4, 8), (8, 8), (16, 8), (32, 8)])
    assert be.calls == 1 and calls["ar"] == 1  # the first-result check: b12x vs the coordinator's all-reduce
    assert S.ADD_NORM_SLOT.ranks == [0, 1] and S.ADD_NORM_SLOT.attn_is_tp
    assert rep.applied == ["add_norm_ffn", "add_norm_attn", "pre_capture"] and "add_norm" in rep.built
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fastverify patch [TP 0]")][0]
    assert "applied=add_norm_ffn,add_norm_attn,pre_capture built=add_norm=" in line, line


@pytest.mark.parametrize(
    "sm,why",
    [
        ((9, 0), "SGLang's own FlashInfer all-reduce fusion owns"),
        ((10, 0), "SGLang's own FlashInfer all-reduce fusion owns"),
        ((8, 9), "b12x runs only on SM120/SM121 (FlashInfer b12x is_supported); this GPU is SM89"),
        ((12, 2), "b12x runs only on SM120/SM121"),
    ],
)
def test_b12x_rank_step_stays_out_of_the_way_elsewhere(tmp_path, capsys, sm, why):
    mods, calls, events, rep = _b12x_rank_step(tmp_path, sm)
    assert events == [] and S.ADD_NORM_SLOT.backend is None and why in S.ADD_NORM_SLOT.disabled
    assert rep.applied == ["pre_capture"] and why in rep.skipped["add_norm"]
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fastverify patch [TP 0]")][0]
    assert "skipped=add_norm (" in line
    # the wrapped candidates call SGLang's own, every time
    fu, norm = mods[I.MOD_AR_FUSIONS], mods[I.MOD_LAYERNORM].RMSNorm(8)
    assert fu.fused_ffn_input(types.SimpleNamespace(norm=norm), torch.randn(4, 8), torch.randn(4, 8), None) is None
    assert calls["orig_ffn"] == 1


def test_b12x_reach_follows_sglangs_own_gate():
    """Where SGLang's flashinfer_ar_fusion_applies holds, its fusion owns the boundary even on a GPU
    b12x could run on; where it does not and the GPU is SM120/121, b12x takes it."""
    from fastverify.patch import rank as R

    mods, _ = make_fake_sglang(fusion_applies=True)
    assert R.add_norm_reach(mods, 32, (12, 0)) == (
        False,
        "SGLang's own FlashInfer all-reduce fusion owns the "
        "layer boundary here (flashinfer_ar_fusion_applies(32) holds; "
        "this GPU is SM120); b12x stays out of the way",
    )
    mods, _ = make_fake_sglang(fusion_applies=False)
    assert R.add_norm_reach(mods, 32, (12, 1))[0] is True
    assert R.add_norm_reach(mods, 32, None)[0] is False
    assert R.platform_sm(make_fake_sglang(sm=(12, 1))[0]) == (12, 1)


def test_b12x_first_check_mismatch_disables_and_closes(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="fastverify.patch"):
        mods, calls, events, rep = _b12x_rank_step(tmp_path, (12, 0), bad=True)
    assert S.ADD_NORM_SLOT.backend is None and S.ADD_NORM_SLOT.disabled.startswith("first result differs")
    assert events[-1] == ("close",) and "add_norm" in rep.skipped and rep.applied == ["pre_capture"]
    fu, norm = mods[I.MOD_AR_FUSIONS], mods[I.MOD_LAYERNORM].RMSNorm(8)
    assert fu.fused_ffn_input(types.SimpleNamespace(norm=norm), torch.randn(4, 8), torch.randn(4, 8), None) is None


def test_b12x_candidates_take_only_what_the_kernel_computes():
    """The FFN and attention candidates hand b12x exactly the batches its kernel computes as SGLang's
    path would (1..36 rows, SGLang's RMSNorm, the TP group, no post addition, no fused quant); every
    other batch goes to SGLang's own candidate (None here, as on SM120), then the boundary's own
    all-reduce + norm: one all-reduce per call either way."""
    mods, calls = make_fake_sglang(sm=(12, 0))
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "b12x"})
    fu, ln, ps = mods[I.MOD_AR_FUSIONS], mods[I.MOD_LAYERNORM], mods[I.MOD_PARALLEL_STATE]
    be = FakeB12x()
    I.attach_add_norm_backend(be, ranks=[0, 1])
    norm = ln.RMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    plan = types.SimpleNamespace(norm=norm, fusions=None)
    ffn = [lambda x, r, fb: fu.fused_ffn_input(plan, x, r, fb)]

    def run(rows, via, **kw):
        x, res = torch.randn(rows, 8), torch.randn(rows, 8)
        keep = res.clone()
        n0, ar0 = be.calls, calls["ar"]
        out, new_res = _boundary(kw.get("fusions", ffn), calls_ar, kw.get("norm", norm), x, res)
        want_out, want_res = _expected(x, keep)
        torch.testing.assert_close(new_res, want_res)
        torch.testing.assert_close(out, want_out * norm.weight)
        assert torch.equal(res, keep)  # the caller's residual untouched, a fresh one returned
        assert (be.calls - n0, calls["ar"] - ar0) == ((1, 0) if via == "b12x" else (0, 1)), (rows, via)

    calls_ar = mods[I.MOD_DISTRIBUTED].tensor_model_parallel_all_reduce
    for rows in (1, 4, 36):
        run(rows, "b12x")
    for rows in (37, 64):  # above the kernel's 36 rows: SGLang's all-reduce + norm
        run(rows, "sglang")
    assert calls["orig_ffn"] == 2

    # not SGLang's plain RMSNorm: a subclass (another formula), a weight in another dtype
    class Sub(ln.RMSNorm):
        pass

    sub = Sub(8)
    with torch.no_grad():
        sub.weight.copy_(norm.weight)
    x = torch.randn(4, 8)
    assert fu.fused_ffn_input(types.SimpleNamespace(norm=sub), x, torch.randn(4, 8), None) is None
    half = ln.RMSNorm(8)
    half.weight.data = half.weight.data.half()
    assert fu.fused_ffn_input(types.SimpleNamespace(norm=half), x, torch.randn(4, 8), None) is None
    assert be.calls == 3
    # the attention input: the carried UnreducedOutput over the TP group
    U, tp = fu.UnreducedOutput, ps.get_tp_group()
    r = torch.randn(4, 8)
    out = fu.fused_attn_input(plan, U(x, tp), r, None, None, fuses_quant=False, keep_bf16=False)
    torch.testing.assert_close(out[1], r + 2 * x)
    assert be.calls == 4
    other = types.SimpleNamespace(ranks=[0, 2])
    for owed, post, quant in (
        (U(x, other), None, False),
        (U(x, tp), torch.ones(4, 8), False),
        (U(x, tp), None, True),
        (U(x, tp, complete_sum=lambda t: t), None, False),
        (x, None, False),
    ):
        assert fu.fused_attn_input(plan, owed, r, None, post, fuses_quant=quant, keep_bf16=False) is None
    assert be.calls == 4 and calls["orig_attn"] == 5
    # attention TP is not the TP group (DP attention): the FFN input is SGLang's
    S.ADD_NORM_SLOT.attn_is_tp = False
    assert fu.fused_ffn_input(plan, x, r, None) is None and be.calls == 4
    S.ADD_NORM_SLOT.attn_is_tp = True
    S.ADD_NORM_SLOT.disabled = "voted off"
    assert fu.fused_ffn_input(plan, x, r, None) is None and be.calls == 4


# --- b12x: a fallback never passes for b12x ---------------------------------------------------------------


class _SwallowingB12x(FakeB12x):
    """As B12xFusedBackend.prepare does on a failed plan: it catches the error, sets
    ``disabled_reason`` and would then answer every call with torch.distributed + RMSNorm."""

    disabled_reason = None

    def prepare(self, shapes):
        super().prepare(shapes)
        self.disabled_reason = "b12x preparation failed (plan: stride mismatch); using torch.distributed + RMSNorm"


def test_b12x_prepare_that_disables_itself_is_a_failed_prepare_not_built(tmp_path, capsys):
    mods, _ = make_fake_sglang(sm=(12, 0), fusion_applies=False)
    made = []
    S.ADD_NORM_SLOT.factory = lambda coordinator, x: made.append(_SwallowingB12x()) or made[-1]
    rep = I.install(
        mods, environ={**ON, "FASTVERIFY_BACKEND": "b12x", "FASTVERIFY_DEPLOYMENT": _record_file(tmp_path, hidden=8)}
    )
    runner = mods[I.MOD_MODEL_RUNNER].ModelRunner(hidden=8, width=4, pool=48)
    runner.device = "cpu"
    runner.init_cuda_graphs()
    assert S.ADD_NORM_SLOT.backend is None and made and made[0].closed  # closed on every rank, not used
    assert "add_norm" not in rep.built and "prepare failed (b12x preparation failed (plan" in rep.skipped["add_norm"]
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fastverify patch [TP 0]")][0]
    assert "built=add_norm" not in line and "skipped=add_norm (backend not built: prepare failed (b12x" in line, line


def test_b12x_not_built_where_every_captured_verify_step_is_wider_than_it_takes(tmp_path, capsys):
    # 40 draft tokens a request (a wide tree): even batch 1 is 40 rows > 36, so b12x would never run
    mods, _ = make_fake_sglang(sm=(12, 0), fusion_applies=False)
    made = []
    S.ADD_NORM_SLOT.factory = lambda coordinator, x: made.append(FakeB12x()) or made[-1]
    rep = I.install(
        mods,
        environ={
            **ON,
            "FASTVERIFY_BACKEND": "b12x",
            "FASTVERIFY_DEPLOYMENT": _record_file(tmp_path, max_batch=2, draft=40, hidden=8),
        },
    )
    runner = mods[I.MOD_MODEL_RUNNER].ModelRunner(hidden=8, width=40, pool=48)
    runner.device = "cpu"
    runner.init_cuda_graphs()
    assert made == [] and S.ADD_NORM_SLOT.backend is None
    assert "wider than the 36 rows b12x takes (smallest 40 rows)" in rep.skipped["add_norm"], rep.skipped
    assert "built=add_norm" not in capsys.readouterr().err


def test_fused_norm_not_claimed_when_sglangs_preflight_turns_the_fusion_off(capsys):
    """SGLang's gate holds before capture; its warm-up inside init_cuda_graphs (the workspace
    preflight, base_runner._pre_initialize_flashinfer_allreduce_workspace) then marks the fusion
    unavailable: the line, printed after SGLang's start-up, must not say applied=fused_norm."""
    mods, calls, events, MR, orig, factory = _capture_setup("fused")
    state = {"preflight_ok": True}
    mods[I.MOD_ADD_NORM].flashinfer_ar_fusion_applies = lambda bs: state["preflight_ok"]

    def init_cuda_graphs(self, capture_decode_cuda_graph=True):
        orig(self, capture_decode_cuda_graph)
        state["preflight_ok"] = False  # "Skipping allreduce fusion": the unavailable flag is set

    MR.init_cuda_graphs = init_cuda_graphs
    S.FUSED_SLOT.factory = factory
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    MR(hidden=8, width=4, pool=48).init_cuda_graphs()
    assert "fused_norm" not in rep.applied and "fused_norm" not in rep.built
    assert rep.skipped["fused_norm"].startswith("after SGLang's start-up checks: SGLang never calls"), rep.skipped
    assert S.FUSED_SLOT.backend is None and S.FUSED_SLOT.disabled is not None
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fastverify patch [TP 0]")]
    assert len(lines) == 1 and "applied=pre_capture " in lines[0] and "built=" not in lines[0], lines


def test_rank_line_says_what_the_captured_graphs_cover(capsys):
    # the fake runner captures bs 1..64, clamped to its request pool of 48 (SGLang's rule), x 4 tokens
    mods, calls, events, MR, orig, factory = _capture_setup("fused")
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "nccl"})
    MR(hidden=8, width=4, pool=48).init_cuda_graphs()
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fastverify patch [TP 0]")][0]
    assert line.endswith(" covers: verify steps up to 48 requests x 4 tokens (192 rows) in CUDA graphs"), line
