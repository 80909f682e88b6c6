"""The in-rank patch against a fake SGLang whose targets have 0.5.23's names and signatures."""

import ast
import json
import logging
import os
import types
import zipfile
from pathlib import Path

import pytest
import torch

from fastverify.patch import install as I

ON = {"FASTVERIFY_PATCH": "1"}


def make_fake_sglang(world_size=2, *, norm_params=None):
    calls = {"ar": 0, "orig_fused": 0}

    def _ar(x):
        calls["ar"] += 1
        return x * world_size  # every rank holds the same partial: the sum is world_size * x

    ps = types.ModuleType(I.MOD_PARALLEL_STATE)

    class GroupCoordinator:
        def __init__(self):
            self.world_size, self.unique_name, self.device_group = world_size, "tp:0", None

        def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
            return _ar(input_)

    group = GroupCoordinator()
    ps.GroupCoordinator = GroupCoordinator
    ps.get_tp_group = ps.get_attn_tp_group = lambda: group

    dist = types.ModuleType(I.MOD_DISTRIBUTED)
    dist.tensor_model_parallel_all_reduce = _ar
    dist.attention_tensor_model_parallel_all_reduce = _ar
    moe = types.ModuleType(I.MOD_MOE_UTILS)
    moe.deferred_post_experts_all_reduce = _ar

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

        # SGLang 0.5.23's hazard (AITER branch): no all-reduce when the fused call declines.
        def forward_with_allreduce_fusion(self, x, residual=None, post_residual_addition=None,
                                          use_attn_tp_group=True):
            calls["orig_fused"] += 1
            return self.forward(x, residual, post_residual_addition)

    if norm_params == "changed":
        def changed(self, hidden_states, residual=None):
            return self.forward(hidden_states, residual)
        RMSNorm.forward_with_allreduce_fusion = changed
    ln.RMSNorm = RMSNorm

    tw = types.ModuleType(I.MOD_TP_WORKER)

    class TpModelWorker:
        def forward_batch_generation(self, batch, forward_batch=None, pp_proxy_tensors=None, is_verify=False,
                                     skip_attn_backend_init=None, *, capture_hidden_mode=None,
                                     return_kv_loc_plan=False):
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
    graph_cfg = types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(
        decode=types.SimpleNamespace(bs=[1, 2, 4, 8, 16, 32, 64])))
    rc.get_exec = lambda: types.SimpleNamespace(graph=graph_cfg)
    mods = {m.__name__: m for m in (ps, dist, moe, ln, tw, mr, rc)}
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


def test_fused_path_always_all_reduces_and_restores():
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
    assert calls["ar"] == 2 and calls["orig_fused"] == 0
    # residual None and post_residual_addition: still all-reduced
    norm.forward_with_allreduce_fusion(x, None)
    post = torch.randn(4, 8)
    out, new_res = norm.forward_with_allreduce_fusion(x, res, post)
    torch.testing.assert_close(new_res, res_before + post + 2 * x)
    assert calls["ar"] == 4
    # idempotent
    assert I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"}).applied == ["fused_norm", "pre_capture"]
    assert I.installed() == ["RMSNorm.forward_with_allreduce_fusion", "ModelRunner.init_cuda_graphs"]
    assert I.uninstall() == 2
    assert RMSNorm.__dict__["forward_with_allreduce_fusion"] is orig


class FakeFused:
    def __init__(self, bad=False, supports=True):
        self.bad, self.ok, self.calls = bad, supports, 0

    def supports(self, x):
        return self.ok

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps):
        self.calls += 1
        r = residual + x * 2 + (1.0 if self.bad else 0.0)
        return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight, r


def test_fused_backend_used_checked_and_disabled_on_mismatch(caplog):
    mods, calls = make_fake_sglang()
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    norm = mods[I.MOD_LAYERNORM].RMSNorm(8)
    x, res = torch.randn(4, 8), torch.randn(4, 8)
    good = FakeFused()
    I.attach_fused_backend(good)
    out, r = norm.forward_with_allreduce_fusion(x, res)
    torch.testing.assert_close(r, _expected(x, res)[1])
    assert good.calls == 1 and calls["ar"] == 1  # the one startup comparison with the plain path
    norm.forward_with_allreduce_fusion(x, res)
    assert good.calls == 2 and calls["ar"] == 1  # fused from then on
    # a backend that does not take the shape: plain all-reduce + norm
    I.attach_fused_backend(FakeFused(supports=False), checked=True)
    norm.forward_with_allreduce_fusion(x, res)
    assert calls["ar"] == 2
    # a wrong backend: disabled with one line, result still correct
    bad = FakeFused(bad=True)
    I.attach_fused_backend(bad)
    with caplog.at_level(logging.WARNING, logger="fastverify.patch"):
        out, r = norm.forward_with_allreduce_fusion(x, res)
        norm.forward_with_allreduce_fusion(x, res)
    torch.testing.assert_close(r, _expected(x, res)[1])
    assert bad.calls == 1
    assert len([m for m in caplog.messages if "disabled" in m]) == 1


def test_changed_signature_skipped_with_one_line(caplog):
    mods, calls = make_fake_sglang(norm_params="changed")
    before = mods[I.MOD_LAYERNORM].RMSNorm.__dict__["forward_with_allreduce_fusion"]
    with caplog.at_level(logging.WARNING, logger="fastverify.patch"):
        rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    assert rep.applied == [] and "fused_norm" in rep.skipped
    assert len([m for m in caplog.messages if "skipped" in m]) == 1
    assert mods[I.MOD_LAYERNORM].RMSNorm.__dict__["forward_with_allreduce_fusion"] is before


def test_missing_targets_never_raise(caplog):
    mods, _ = make_fake_sglang()
    del mods[I.MOD_TP_WORKER]
    del mods[I.MOD_LAYERNORM].RMSNorm
    with caplog.at_level(logging.WARNING, logger="fastverify.patch"):
        rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused", "FASTVERIFY_PROFILE_VERIFY": "/tmp/x"})
        rep2 = I.install(None, environ={**ON, "FASTVERIFY_BACKEND": "pcie-ipc"}, sglang_has_pcie_ipc=False)
    assert set(rep.skipped) == {"fused_norm", "verify_timer"} and rep.applied == []
    assert "all_reduce" in rep2.skipped  # no SGLang importable here at all
    assert len([m for m in caplog.messages if "skipped" in m]) == 3


def test_dispatch_wrapped_only_without_sglang_pcie_ipc():
    mods, calls = make_fake_sglang()
    GC = mods[I.MOD_PARALLEL_STATE].GroupCoordinator
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "pcie-ipc"}, sglang_has_pcie_ipc=True)
    assert rep.applied == [] and "all_reduce" in rep.skipped and I.installed() == []
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "pcie-ipc"}, sglang_has_pcie_ipc=False)
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
    assert rep.applied == []  # auto: SGLang's dispatch untouched


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


@pytest.mark.parametrize("backend,slot", [("fused", "_fused"), ("pcie-ipc", "_dispatch")])
def test_pre_capture_prepares_once_before_the_original(backend, slot):
    mods, calls, events, MR, orig, factory = _capture_setup(backend)
    getattr(I, slot).factory = factory
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": backend}, sglang_has_pcie_ipc=False)
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
    assert getattr(I, slot).backend is not None
    runner.init_cuda_graphs()  # second call (e.g. the draft runner or a recapture): no second prepare
    MR(is_draft_worker=True).init_cuda_graphs()
    assert [e[0] for e in events] == ["create", "prepare", "capture", "capture", "capture"]
    assert calls["captures"] == [False, True, True]
    # idempotent install, and uninstall restores the original by identity
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": backend}, sglang_has_pcie_ipc=False)
    assert I.installed().count("ModelRunner.init_cuda_graphs") == 1
    I.uninstall()
    assert MR.__dict__["init_cuda_graphs"] is orig and getattr(I, slot).prepared is False


def test_pre_capture_falls_back_to_workspace_max_without_batch_sizes():
    mods, calls, events, MR, orig, factory = _capture_setup("fused")
    del mods[I.MOD_RUNTIME_CONTEXT]
    I._fused.factory = factory
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    r = MR(hidden=16)
    del r.req_to_token_pool
    r.init_cuda_graphs()
    assert events[-2:] == [("prepare", [(I.FUSED_MAX_TOKENS, 16)]), ("capture", True)]
    # server_args.cuda_graph_bs (older SGLang) is read when the runtime context is absent
    I.uninstall()
    events.clear()
    I._fused.factory = factory
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    r = MR(hidden=16, width=2, pool=100)
    r.server_args.cuda_graph_bs = [1, 3, 2000]
    r.init_cuda_graphs()
    assert events[-2] == ("prepare", [(2, 16), (6, 16), (200, 16)])  # 2000 > pool: the pool (100) instead


@pytest.mark.parametrize("fail", ["create", "prepare"])
def test_pre_capture_failure_logged_not_raised(fail, caplog):
    mods, calls, events, MR, orig, factory = _capture_setup("fused", fail=fail)
    I._fused.factory = factory
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    with caplog.at_level(logging.WARNING, logger="fastverify.patch"):
        MR().init_cuda_graphs()
        MR().init_cuda_graphs()
    assert calls["captures"] == [True, True]  # the original still ran
    lines = [m for m in caplog.messages if "not prepared before CUDA-graph capture" in m]
    assert len(lines) == 1, caplog.messages
    # left to the lazy path: no backend, not disabled
    assert I._fused.backend is None and I._fused.disabled is None
    if fail == "prepare":
        assert BadPrepare.closed
    # a runner that cannot even be read (no model_config): logged, never raised
    I.uninstall()
    caplog.clear()
    I._fused.factory = factory
    I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "fused"})
    runner = MR()
    del runner.model_config
    with caplog.at_level(logging.WARNING, logger="fastverify.patch"):
        runner.init_cuda_graphs()
    assert len([m for m in caplog.messages if "not prepared" in m]) == 1


@pytest.mark.parametrize("backend", ["nccl", "off", "auto"])
def test_pre_capture_not_installed_for_other_backends(backend):
    mods, calls, events, MR, orig, factory = _capture_setup(backend)
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": backend})
    assert "pre_capture" not in rep.applied and MR.__dict__["init_cuda_graphs"] is orig
    # nor for pcie-ipc where SGLang has its own PCIe IPC all-reduce (the patch creates no backend)
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "pcie-ipc"}, sglang_has_pcie_ipc=True)
    assert "pre_capture" not in rep.applied and MR.__dict__["init_cuda_graphs"] is orig


def test_pre_capture_signature_matches_real_source(tmp_path):
    z = _wheel_tree(tmp_path)
    pos, kw = _method_params(z.read("sglang/srt/model_executor/model_runner.py").decode(), "ModelRunner",
                             "init_cuda_graphs")
    assert pos == ["self", "capture_decode_cuda_graph"] and kw == []
    tw = z.read("sglang/srt/managers/tp_worker.py").decode()
    assert "self.model_runner.init_cuda_graphs(" in tw  # every TP rank, once per runner, before capture
    assert "def decode_num_tokens_per_req(" in z.read("sglang/srt/model_executor/model_runner.py").decode()
    assert "get_exec().graph.cuda_graph_config.decode.bs" in z.read(
        "sglang/srt/model_executor/runner/base_cuda_graph_runner.py").decode()


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


def test_verify_timer_writes_json_lines_without_sync(tmp_path):
    mods, _ = make_fake_sglang()
    timer = I.VerifyTimer(tmp_path, every=2, event_factory=FakeEvent, clock="test", rank=lambda: "3")
    rep = I.install(mods, environ={**ON, "FASTVERIFY_BACKEND": "off"}, timer=timer)
    assert rep.applied == ["verify_timer"]
    w = mods[I.MOD_TP_WORKER].TpModelWorker()
    assert w.forward_batch_generation(None, "fb") == ("result", False)
    assert timer.steps == 0  # not a verify forward
    assert w.forward_batch_generation(None, "fb", None, True) == ("result", True)  # positional is_verify
    assert w.forward_batch_generation(None, forward_batch="fb", is_verify=True) == ("result", True)
    rows = [json.loads(l) for l in (tmp_path / "verify-rank3.jsonl").read_text().splitlines()]
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
    env = {**ON, "FASTVERIFY_BACKEND": "off", "FASTVERIFY_PROFILE_VERIFY": str(tmp_path),
           "FASTVERIFY_PROFILE_VERIFY_STEPS": "2"}
    timer = I.VerifyTimer(tmp_path, every=100, event_factory=I._WallEvent, clock="cpu_wall_clock", rank=lambda: "1")
    rep = I.install(mods, environ=env, timer=timer)
    assert rep.applied == ["verify_timer"]
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
    t = I.VerifyTimer(tmp_path, every=1, event_factory=I._WallEvent, clock="cpu_wall_clock", rank=lambda: "0")
    t.stop(t.start())
    row = json.loads((tmp_path / "verify-rank0.jsonl").read_text())
    assert row["clock"] == "cpu_wall_clock" and row["verify_ms"] >= 0


def test_plugin_entry_point_is_gated(monkeypatch):
    from fastverify.patch import plugin

    monkeypatch.delenv("FASTVERIFY_PATCH", raising=False)
    plugin()  # nothing, no import of SGLang
    monkeypatch.setenv("FASTVERIFY_PATCH", "1")
    monkeypatch.setenv("FASTVERIFY_BACKEND", "fused")
    plugin()  # no SGLang here: skips with a log line, never raises


# --- the real SGLang 0.5.23 source (ast only, nothing imported) --------------------------------------

def _wheel_tree(tmp_path):
    whl = os.environ.get("FASTVERIFY_SGLANG_WHEEL")
    if not whl or not Path(whl).is_file():
        pytest.skip("FASTVERIFY_SGLANG_WHEEL not set: cannot check the targets against real SGLang source")
    return zipfile.ZipFile(whl)


def _method_params(source, cls, attr):
    tree = ast.parse(source)
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
    # the helpers the fused replacement calls, and how SGLang's layer boundary calls the norm
    dist = z.read("sglang/srt/distributed/communication_op.py").decode()
    assert "def attention_tensor_model_parallel_all_reduce(input_" in dist
    assert "def tensor_model_parallel_all_reduce(input_" in dist
    assert "def deferred_post_experts_all_reduce(hidden_states" in z.read("sglang/srt/layers/moe/utils.py").decode()
    assert "from sglang.srt.distributed.communication_op import *" in z.read("sglang/srt/distributed/__init__.py").decode()
    fus = z.read("sglang/srt/layers/layer_boundary/fusions/allreduce.py").decode()
    assert "plan.norm.forward_with_allreduce_fusion(" in fus
    ps = z.read("sglang/srt/distributed/parallel_state.py").decode()
    assert "def get_attn_tp_group(" in ps and "def get_tp_group(" in ps
    assert "sglang/srt/distributed/device_communicators/pcie_ipc_ar.py" in z.namelist()
    eng = z.read("sglang/srt/entrypoints/engine.py").decode()
    assert 'os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"' in eng
    assert '"NCCL_CUMEM_ENABLE" not in os.environ' in eng
    plug = z.read("sglang/srt/plugins/__init__.py").decode()
    assert 'GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"' in plug and "SGLANG_PLUGINS" in plug
    assert "load_plugins()" in z.read("sglang/srt/managers/scheduler.py").decode()
