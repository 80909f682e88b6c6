"""Probe fastverify's in-rank patch against the REAL imported SGLang (run with the SGLang venv's python).

Not a pytest module: ``tests/test_patch_real_sglang.py`` runs it in a subprocess with the python of
the separate SGLang virtual environment (``.ci/sglang-venv.sh``) and asserts on the one JSON object
it prints as the LAST line of stdout. Everything that fails is reported with its real exception text
instead of raising, so a single run says what works against the real SGLang on this machine.

    python tests/sglang_patch_probe.py                 # the whole probe (spawns 2 gloo ranks)
    python tests/sglang_patch_probe.py --rank R --world W --port P --out FILE   # one rank (internal)

Parts:

``imports``      the SGLang modules the patch touches (and the ones the issue lists), ok or the error.
``static``       single process, no process group: install() with the fused backend / off / nccl /
                 pcie-ipc against the real modules, applied/skipped and why; uninstall() identity;
                 the verify timer against the real ``TpModelWorker.forward_batch_generation``
                 signature; the plugin entry point group the real SGLang loader reads.
``ranks``        W processes (gloo over TCP on 127.0.0.1) that build the real SGLang groups with
                 ``init_distributed_environment`` + ``initialize_model_parallel``, a real ``RMSNorm``,
                 and compare the patched ``forward_with_allreduce_fusion`` (and the unpatched one)
                 against a plain torch reference, counting the real all-reduces; then b12x at the
                 REAL layer boundary (``prepare._reduce_update_read`` / ``_run_entry`` with the
                 candidates ``fusions/allreduce.py`` binds) for SM89/SM90/SM100/SM120 described by
                 SGLang's ``override_platform``, the slot built from the real TP GroupCoordinator
                 (gloo standing in for b12x).
``gate``         SGLang's real ``flashinfer_ar_fusion_applies`` per described GPU (module reloaded),
                 the fused-norm and b12x reach, and the wrapped ``fused_ffn_input`` reaching
                 SGLang's own fusion where that gate holds.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

SGLANG_MODULES = (
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.distributed",
    "sglang.srt.layers.layernorm",
    "sglang.srt.layers.moe.utils",
    "sglang.srt.models.deepseek_v2",
    "sglang.srt.managers.tp_worker",
    "sglang.srt.plugins",
    "sglang.srt.layers.flashinfer_comm_fusion",
    "sglang.srt.server_args",
    "sglang.srt.entrypoints.engine",
)

HIDDEN = 64
TOKENS = 5


def _err(e: BaseException, limit: int = 600) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + " [...]"


def _quiet_logging() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


# --- imports ----------------------------------------------------------------------------------------


def probe_imports() -> dict:
    import importlib

    out = {}
    for name in SGLANG_MODULES:
        t0 = time.perf_counter()
        try:
            importlib.import_module(name)
            out[name] = {"ok": True, "s": round(time.perf_counter() - t0, 2)}
        except BaseException as e:  # noqa: BLE001 - report anything, SystemExit included
            out[name] = {"ok": False, "error": _err(e), "s": round(time.perf_counter() - t0, 2)}
    return out


# --- single-process checks --------------------------------------------------------------------------


def _originals() -> dict:
    """Target key -> the object in the class (or module, for a module-level target) __dict__ now."""
    import importlib

    from fastverify.patch import install as I

    out = {}
    for t in I.TARGETS:
        try:
            mod = importlib.import_module(t.module)
            owner = mod if t.cls is None else getattr(mod, t.cls)
            out[t.key] = owner.__dict__.get(t.attr)
        except Exception:
            out[t.key] = None
    return out


def _install_with(env: dict, **kw) -> dict:
    from fastverify.patch import install as I

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        before = _originals()
        rep = I.install(**kw)
        after_install = _originals()
        changed = sorted(k for k in before if before[k] is not after_install[k])
        n = I.uninstall()
        after = _originals()
        return {
            "env": env,
            "active": rep.active,
            "applied": list(rep.applied),
            "skipped": dict(rep.skipped),
            "changed_in_class_dict": changed,
            "uninstalled": n,
            "restored_identity": all(before[k] is after[k] for k in before),
        }
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _CountingTimer:
    def __init__(self):
        self.starts = 0
        self.stops = 0

    def start(self):
        self.starts += 1
        return object()

    def stop(self, ev):
        self.stops += 1

    def drain(self, *, wait=False):
        return 0


def probe_verify_timer() -> dict:
    from sglang.srt.managers.tp_worker import TpModelWorker

    from fastverify.patch import install as I

    out: dict = {}
    orig = TpModelWorker.__dict__["forward_batch_generation"]
    out["real_signature"] = str(inspect.signature(orig))
    timer = _CountingTimer()
    os.environ["FASTVERIFY_PATCH"] = "1"
    os.environ["FASTVERIFY_BACKEND"] = "nccl"
    try:
        rep = I.install(timer=timer)
        out["applied"] = list(rep.applied)
        out["skipped"] = dict(rep.skipped)
        wrapped = TpModelWorker.__dict__["forward_batch_generation"]
        out["wrapped"] = wrapped is not orig
        out["wrapper_signature"] = str(inspect.signature(wrapped))
        out["signature_preserved"] = inspect.signature(wrapped) == inspect.signature(orig)

        class _NotAWorker:  # the real body fails on it at once; only the wrapper's parsing matters
            pass

        def call(*args, **kw):
            s0 = timer.starts
            try:
                TpModelWorker.forward_batch_generation(_NotAWorker(), *args, **kw)
                err = None
            except Exception as e:  # the real SGLang body, reached through the wrapper
                err = _err(e)
            return {"timed": timer.starts - s0 == 1, "real_body_error": err}

        out["calls"] = {
            "is_verify_positional_true": call(None, None, None, True),
            "is_verify_keyword_true": call(None, is_verify=True),
            "is_verify_keyword_false": call(None, is_verify=False),
            "is_verify_default": call(None),
        }
        out["uninstalled"] = I.uninstall()
        out["restored_identity"] = TpModelWorker.__dict__["forward_batch_generation"] is orig
    finally:
        I.uninstall()
    return out


def probe_pre_capture() -> dict:
    """The pre-capture target on the real ``ModelRunner.init_cuda_graphs``: resolved, wrapped and
    restored by identity. No GPU here, so ``backend.prepare`` is NOT exercised against a real
    backend; the wrapper is called on a stand-in runner with a failing factory to show that the
    failure is logged and the real body is still reached."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    from fastverify.patch import install as I, slots as S

    out: dict = {
        "prepare_exercised": False,
        "prepare_note": "no GPU in this probe: backend.prepare(shapes) is not run against a real backend",
    }
    orig = ModelRunner.__dict__["init_cuda_graphs"]
    out["real_signature"] = str(inspect.signature(orig))
    os.environ["FASTVERIFY_PATCH"] = "1"
    os.environ["FASTVERIFY_BACKEND"] = "fused"
    try:
        rep = I.install()
        out["applied"] = list(rep.applied)
        out["skipped"] = dict(rep.skipped)
        wrapped = ModelRunner.__dict__["init_cuda_graphs"]
        out["wrapped"] = wrapped is not orig and getattr(wrapped, "__fastverify_original__", None) is orig
        out["signature_preserved"] = inspect.signature(wrapped) == inspect.signature(orig)

        def bad_factory(coordinator, x):
            raise RuntimeError("probe: no GPU")

        S.FUSED_SLOT.factory = bad_factory

        class _NotARunner:  # no model_config: creation fails first; the real body fails after
            pass

        try:
            ModelRunner.init_cuda_graphs(_NotARunner())
            out["real_body_error"] = None
        except Exception as e:
            out["real_body_error"] = _err(e)
        out["slot_after_failure"] = {
            "backend": S.FUSED_SLOT.backend is not None,
            "disabled": S.FUSED_SLOT.disabled,
            "prepared": S.FUSED_SLOT.prepared,
        }
        out["uninstalled"] = I.uninstall()
        out["restored_identity"] = ModelRunner.__dict__["init_cuda_graphs"] is orig
    finally:
        I.uninstall()
    return out


def probe_plugin_group() -> dict:
    from importlib.metadata import entry_points

    import sglang.srt.plugins as P

    from fastverify.patch.handoff import PLUGIN_GROUP, PLUGIN_NAME

    out: dict = {"fastverify_group": PLUGIN_GROUP}
    out["sglang_general_group"] = getattr(P, "GENERAL_PLUGINS_GROUP", None)
    names = [n for n, v in vars(P).items() if callable(v) and getattr(v, "__module__", "") == P.__name__]
    out["loader_functions"] = sorted(names)
    try:
        src = inspect.getsource(P)
        out["loader_reads_general_group"] = "GENERAL_PLUGINS_GROUP" in src and "entry_points(group=" in src
        # which function loads the general group, and with what
        calls = [ln.strip() for ln in src.splitlines() if "GENERAL_PLUGINS_GROUP" in ln and "=" not in ln.split("(")[0]]
        out["general_group_uses"] = calls[:5]
    except Exception as e:
        out["source_error"] = _err(e)
    eps = entry_points(group=PLUGIN_GROUP)
    mine = [e for e in eps if e.name == PLUGIN_NAME]
    out["fastverify_entry_point"] = mine[0].value if mine else None
    if mine:
        try:
            fn = mine[0].load()
            out["entry_point_loads"] = f"{fn.__module__}.{fn.__qualname__}"
        except Exception as e:
            out["entry_point_loads"] = None
            out["entry_point_error"] = _err(e)
    # who calls the loader in the real SGLang (source search of the installed package)
    try:
        import sglang

        root = os.path.dirname(sglang.__file__)
        callers = []
        for dp, _, fs in os.walk(root):
            for f in fs:
                if f.endswith(".py") and "plugins" not in dp:
                    p = os.path.join(dp, f)
                    try:
                        with open(p, encoding="utf-8") as fh:
                            txt = fh.read()
                    except Exception:
                        continue
                    if "load_plugins(" in txt or "load_general_plugins(" in txt:
                        callers.append(os.path.relpath(p, root))
        out["loader_callers"] = sorted(callers)[:20]
    except Exception as e:
        out["loader_callers_error"] = _err(e)
    # SGLang's loader really calling our plugin (it is gated: with FASTVERIFY_PATCH unset it is a no-op)
    loader = None
    for cand in ("load_plugins_by_group",):
        loader = getattr(P, cand, None)
    if loader is not None:
        try:
            os.environ.pop("FASTVERIFY_PATCH", None)
            got = loader(P.GENERAL_PLUGINS_GROUP)
            out["sglang_loader_found"] = sorted(got)
            if PLUGIN_NAME in got:
                fn = got[PLUGIN_NAME][0]
                out["sglang_loader_callable"] = f"{fn.__module__}.{fn.__qualname__}"
        except Exception as e:
            out["sglang_loader_error"] = _err(e)
    return out


def probe_static() -> dict:
    from fastverify.patch import install as I, targets as T

    out: dict = {}
    out["targets_found"] = {}
    for t in I.TARGETS:
        cls, fn, why = T.resolve(t, None)
        if why is None:
            why = T.check_signature(fn, t)
        out["targets_found"][t.key] = {
            "ok": why is None,
            "why": why,
            "signature": str(inspect.signature(fn)) if fn is not None else None,
        }
    out["pcie_ipc_ar_module"] = (
        importlib.util.find_spec("sglang.srt.distributed.device_communicators.pcie_ipc_ar") is not None
    )
    with tempfile.TemporaryDirectory() as d:
        out["fused"] = _install_with({"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "fused"})
        out["fused_profile"] = _install_with(
            {"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "fused", "FASTVERIFY_PROFILE_VERIFY": d}
        )
        out["off"] = _install_with({"FASTVERIFY_PATCH": "0", "FASTVERIFY_BACKEND": "fused"})
        out["nccl"] = _install_with({"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "nccl"})
        out["b12x"] = _install_with({"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "b12x"})
        out["pcie_ipc"] = _install_with({"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "pcie_ipc"})
        out["pcie_ipc_without_sglang_ipc"] = _install_with(
            {"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "pcie_ipc"}, sglang_switch_modules=frozenset()
        )
        # install twice is a no-op; uninstall restores once
        os.environ.update({"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "fused"})
        try:
            before = _originals()
            I.install()
            mid = _originals()
            I.install()
            twice = _originals()
            n_changed = sum(1 for k in before if before[k] is not mid[k])
            out["install_twice_noop"] = (
                all(mid[k] is twice[k] for k in mid) and n_changed == 8 and len(I.installed()) == n_changed + 6
            )  # fused_norm, pre_capture, 6 counting + capture/replay on 3 graph backends
            I.uninstall()
            out["install_twice_restored"] = all(before[k] is _originals()[k] for k in before)
        finally:
            I.uninstall()
    out["verify_timer"] = probe_verify_timer()
    out["pre_capture"] = probe_pre_capture()
    out["plugin"] = probe_plugin_group()
    out["sizing"] = probe_sizing()
    return out


def write_record(path: str, *, max_batch: int = 8, draft: int = 4, hidden: int = HIDDEN) -> str:
    """A deployment record as ``tune`` writes it (beside its env file, ``path`` ending in
    ``.deploy.json``): P2P proven by the real check, the verify shapes."""
    from fastverify.deploy import BoxFingerprint, DeploymentRecord, P2PFacts, VerifyShapes, write_deployment

    rec = DeploymentRecord(
        backend="pcie_ipc",
        shapes=VerifyShapes(max_batch, draft, hidden, "float32"),
        p2p=P2PFacts(True, "p2p_check", "all 2 ordered pairs passed", 2),
        box=BoxFingerprint("probe", (12, 0), 2, 2),
    )
    return str(write_deployment(path.removesuffix(".deploy.json") + ".env", {}, rec)[1])


def probe_sizing() -> dict:
    """SGLang's own PCIe IPC workspace sizing (``PcieIpcCommunicator._ensure_workspace``, the path
    ``BaseRunner._pre_initialize_pcie_ipc_workspace`` takes with ``max_rows`` = widest captured decode)
    against fastverify's (:func:`fastverify.patch.rank.workspace_numel` from the record). Only the
    FlashInfer workspace class is replaced, by a recorder: no GPU here."""
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar as P

    from fastverify.deploy import read_record
    from fastverify.patch import rank as R

    rows = []
    saved = os.environ.pop("SGLANG_PCIE_IPC_MAX_NUMEL", None)
    try:
        with tempfile.TemporaryDirectory() as d:
            for max_batch, draft, hidden in ((8, 4, 7168), (9, 4, 6144), (1, 1, 64), (48, 3, 4096)):
                seen = {}

                class Recorder:
                    def __init__(self, **kw):
                        seen.update(kw)

                comm = P.PcieIpcCommunicator.__new__(P.PcieIpcCommunicator)
                comm.disabled, comm.max_numel, comm._workspace, comm._bound_stream = False, 0, None, None
                comm._cpu_group, comm._max_rows, comm._group, comm._device = None, max_batch * draft, None, "cpu"
                comm._world_size, comm._workspace_cls, comm._build_failed = 2, Recorder, False
                comm._tune = lambda hidden: None  # autotuning needs a GPU; not part of the sizing
                import torch

                built = comm._ensure_workspace(torch.empty((1, hidden), dtype=torch.bfloat16))
                rec = read_record(
                    write_record(
                        os.path.join(d, f"r{max_batch}.deploy.json"), max_batch=max_batch, draft=draft, hidden=hidden
                    )
                )
                rows.append(
                    {
                        "max_batch": max_batch,
                        "draft": draft,
                        "hidden": hidden,
                        "built": built,
                        "sglang_max_numel": comm.max_numel,
                        "sglang_kw_max_numel": seen.get("max_numel"),
                        "sglang_tune_batches": list(seen.get("tune_batches") or ()),
                        "fastverify_max_numel": R.workspace_numel(rec, hidden, None),
                    }
                )
    finally:
        if saved is not None:
            os.environ["SGLANG_PCIE_IPC_MAX_NUMEL"] = saved
    return {"rows": rows}


def probe_gate() -> dict:
    """SGLang's real ``flashinfer_ar_fusion_applies`` for described GPUs. ``add_norm`` computes its SM
    flags at import from ``get_platform()`` and ``is_cuda()``; it is re-executed (importlib.reload)
    under SGLang's own ``override_platform(is_sm90=, is_sm100=)`` with ``torch.cuda.is_available``
    answering True (no GPU here), and evaluated with a published config selecting a FlashInfer fusion
    backend (``override_server_args(flashinfer_allreduce_fusion_backend="trtllm")``). Compared with
    fastverify's in-rank reach (which calls the same function) and the registry's SM gate."""
    import importlib

    import sglang.srt.layers.layer_boundary.residual.add_norm as an
    import torch
    from sglang.srt.runtime_context import get_context, override_platform
    from sglang.srt.utils import common as C

    from fastverify.patch import rank as R
    from fastverify.registry import BackendName, backend_info, unreachable_reason

    rows = []
    real_avail = torch.cuda.is_available
    for sm in ((8, 9), (9, 0), (10, 0), (12, 0)):
        torch.cuda.is_available = lambda: True
        C.is_cuda.cache_clear()
        C.is_flashinfer_available.cache_clear()
        try:
            with override_platform(is_sm90=(sm[0] == 9), is_sm100=(sm[0] == 10)):
                importlib.reload(an)
        finally:
            torch.cuda.is_available = real_avail
            C.is_cuda.cache_clear()
            C.is_flashinfer_available.cache_clear()
        o = get_context().override_server_args(flashinfer_allreduce_fusion_backend="trtllm")
        o.install()
        try:
            reach, why = R.fused_norm_reach(None, 32, sm)
            b12x = b12x_gate(sm) if sm != (12, 0) else {}
            with override_platform(device_capability=sm):
                seen_sm = R.platform_sm(None)
                b_reach, b_why = R.add_norm_reach(None, 32, seen_sm)
            b12x.update(platform_sm=list(seen_sm or ()), reach=b_reach, why=b_why)
            rows.append(
                {
                    "sm": list(sm),
                    "b12x": b12x,
                    "sglang_applies_32": bool(an.flashinfer_ar_fusion_applies(32)),
                    "sglang_applies_4096": bool(an.flashinfer_ar_fusion_applies(4096)),
                    "module_flags": [an._is_sm90_supported, an._is_sm100_supported],
                    "fastverify_reach": reach,
                    "fastverify_why": why,
                    "registry_reachable": unreachable_reason(
                        backend_info(BackendName.fused), sm=sm, world_size=2, p2p_ok=True
                    )
                    is None,
                }
            )
        finally:
            o.restore()
    importlib.reload(an)  # back to this machine's own facts
    return {"rows": rows}


def b12x_gate(sm) -> dict:
    """``FASTVERIFY_BACKEND=b12x`` on a described GPU other than SM120 (``override_platform``), with
    ``add_norm`` reloaded for it: the real rank step (wrapped ``ModelRunner.init_cuda_graphs`` on a
    stand-in runner) keeps the b12x slot out, and the wrapped ``fused_ffn_input`` still reaches
    SGLang's own fusion (``plan.norm.forward_with_allreduce_fusion``, recorded) where SGLang's gate
    holds (SM90/SM100), nothing where it does not (SM89)."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.layers.layer_boundary.fusions import allreduce as A
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import override_platform

    from fastverify.patch import install as I, slots as S

    saved = {k: os.environ.get(k) for k in ("FASTVERIFY_PATCH", "FASTVERIFY_BACKEND")}
    os.environ.update({"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "b12x"})
    out: dict = {}
    try:
        with override_platform(device_capability=sm):
            rep = I.install()
            try:
                ModelRunner.init_cuda_graphs(_StandInRunner())
            except Exception as e:
                out["real_body_error"] = _err(e, 120)
        out.update(
            applied=list(rep.applied),
            skipped=dict(rep.skipped),
            built=dict(rep.built),
            disabled=S.ADD_NORM_SLOT.disabled,
            hook_installed=A.fused_ffn_input is not A.fused_ffn_input.__wrapped__
            if hasattr(A.fused_ffn_input, "__wrapped__")
            else False,
        )
        seen = []
        norm = RMSNorm(HIDDEN)
        norm.forward_with_allreduce_fusion = lambda x, r, use_attn_tp_group=True: seen.append(x.shape[0]) or ("own", r)
        x, r = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
        got = A.fused_ffn_input(
            SimpleNamespace(norm=norm, fusions=None), x, r, SimpleNamespace(forward_mode=ForwardMode.DECODE)
        )
        out["sglang_own_fusion_called"] = seen == [4] and got is not None and got[0] == "own"
        out["returned_none"] = got is None
    finally:
        I.uninstall()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


# --- multi-rank checks ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_inputs(world: int, dtype):
    import torch

    g = torch.Generator().manual_seed(1234)
    xs = [torch.randn(TOKENS, HIDDEN, generator=g).to(dtype) for _ in range(world)]
    residual = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)
    post = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)
    weight = (1.0 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    return xs, residual, post, weight


def _reference(xs, residual, post, weight, eps):
    """Plain torch: the all-reduced input (summed in rank order, in the input dtype, as gloo does for
    two ranks), plus the residual (to which SGLang first adds the post addition, in the input dtype),
    RMSNorm in fp32; returns (out, new_residual)."""
    import torch

    reduced = xs[0].clone()
    for x in xs[1:]:
        reduced = reduced + x
    h = reduced.float()
    if residual is not None:
        if post is not None:
            residual = residual + post
        h = h + residual.float()
    new_res = h.to(reduced.dtype) if residual is not None else None
    out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(reduced.dtype)
    return out, new_res


def _maxerr(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def _initialize_model_parallel(ps, res: dict, step) -> None:
    """SGLang's ``initialize_model_parallel(backend="gloo")`` at the published widths."""
    try:
        ps.initialize_model_parallel(backend="gloo")
        res["initialize_model_parallel"] = "as is"
    except Exception as e:
        # SGLang 0.5.23 on a CPU-only machine: init_model_parallel_group defaults use_pynccl to
        # True (not NPU/XPU/mooncake) and PyNcclCommunicator wants a CUDA device. Record the real
        # error, then build the same groups with only that default changed.
        res["initialize_model_parallel"] = "use_pynccl=False"
        res["initialize_model_parallel_error"] = _err(e)
        real_init_group = ps.init_model_parallel_group

        def no_pynccl(*a, **k):
            k["use_pynccl"] = False
            return real_init_group(*a, **k)

        ps.init_model_parallel_group = no_pynccl
        step("initialize_model_parallel(gloo, use_pynccl=False)", lambda: ps.initialize_model_parallel(backend="gloo"))
        ps.init_model_parallel_group = real_init_group


def run_rank(rank: int, world: int, port: int, out_path: str) -> None:
    res: dict = {"rank": rank, "world": world, "steps": []}
    record = os.environ.get("FASTVERIFY_PROBE_RECORD", "")

    def step(name, fn):
        try:
            v = fn()
            res["steps"].append({"step": name, "ok": True})
            return v
        except BaseException as e:  # noqa: BLE001
            res["steps"].append({"step": name, "ok": False, "error": _err(e), "trace": traceback.format_exc()[-1500:]})
            raise

    try:
        import sglang.srt.distributed.parallel_state as ps
        import torch
        import torch.distributed as dist
        from sglang.srt.layers.layernorm import RMSNorm
        from sglang.srt.runtime_context import get_parallel

        def init():
            ps.init_distributed_environment(
                world_size=world,
                rank=rank,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=rank,
                backend="gloo",
            )
            return torch.distributed.get_backend()

        res["world_backend"] = step("init_distributed_environment(gloo)", init)

        def widths():
            # what publishing a ServerArgs would write for --tp-size W: configured leaves and the
            # derived widths (attention TP and MoE TP span the whole TP group)
            get_parallel().override_permanently(
                tp_size=world,
                pp_size=1,
                moe_dp_size=1,
                attn_dp_size=1,
                attn_cp_size=1,
                shared_experts_tp_size=None,
                moe_ep_size=1,
                attn_dcp_size=1,
                attn_tp_size=world,
                moe_tp_size=world,
                tp_rank=rank,
                pp_rank=0,
                attn_tp_rank=rank,
                attn_cp_rank=0,
                attn_dp_rank=0,
                moe_ep_rank=0,
                moe_tp_rank=rank,
                moe_dp_rank=0,
            )
            return {n: getattr(get_parallel(), n, None) for n in ("tp_size", "attn_tp_size", "moe_tp_size")}

        res["parallel_widths"] = step("get_parallel().override_permanently(widths)", widths)
        _initialize_model_parallel(ps, res, step)
        tp, atp = ps.get_tp_group(), ps.get_attn_tp_group()
        res["groups"] = {
            "tp": [tp.unique_name, tp.world_size, tp.rank_in_group],
            "attn_tp": [atp.unique_name, atp.world_size, atp.rank_in_group],
            "attn_tp_is_tp": atp is tp,
        }
        try:
            res["groups"]["moe_tp"] = ps.get_moe_tp_group().unique_name
        except Exception as e:
            res["groups"]["moe_tp"] = _err(e)

        # count the real collectives: torch.distributed.all_reduce (what GroupCoordinator.all_reduce
        # calls for CPU tensors), and GroupCoordinator.all_reduce per group (instance attribute, so
        # the class -- a patch target under pcie-ipc -- stays untouched)
        counts = {"dist_all_reduce": 0, "gc_all_reduce": {}}
        real_dist_ar = dist.all_reduce

        def counting_dist_ar(*a, **k):
            counts["dist_all_reduce"] += 1
            return real_dist_ar(*a, **k)

        dist.all_reduce = counting_dist_ar
        seen = set()
        for g in (tp, atp, ps.get_moe_tp_group() if hasattr(ps, "get_moe_tp_group") else None):
            if g is None or id(g) in seen:
                continue
            seen.add(id(g))
            real = g.all_reduce
            counts["gc_all_reduce"][g.unique_name] = 0

            def counting(input_, _real=real, _name=g.unique_name):
                counts["gc_all_reduce"][_name] += 1
                return _real(input_)

            g.all_reduce = counting

        def total_gc():
            return sum(counts["gc_all_reduce"].values())

        from fastverify.patch import install as I

        cases = [  # (name, use residual, use post, use_attn_tp_group)
            ("residual", True, False, True),
            ("residual+post", True, True, True),
            ("residual_moe_group", True, False, False),
            ("no_residual", False, False, True),
        ]

        def run_cases(label: str, dtype, tol: float) -> list:
            rows = []
            xs, residual, post, weight = _rank_inputs(world, dtype)
            norm = RMSNorm(HIDDEN, eps=1e-6)
            with torch.no_grad():
                norm.weight.copy_(weight.float() if norm.weight.dtype == torch.float32 else weight)
            for name, use_res, use_post, attn in cases:
                row: dict = {"impl": label, "dtype": str(dtype).replace("torch.", ""), "case": name}
                x = xs[rank].clone()
                r_in = residual.clone() if use_res else None
                p_in = post.clone() if use_post else None
                r_keep = r_in.clone() if r_in is not None else None
                d0, g0 = counts["dist_all_reduce"], total_gc()
                try:
                    outp = norm.forward_with_allreduce_fusion(x, r_in, p_in, use_attn_tp_group=attn)
                except Exception as e:
                    row["error"] = _err(e)
                    row["where"] = traceback.format_exc(limit=-3).splitlines()[-4:-1]
                    rows.append(row)
                    continue
                row["dist_all_reduces"] = counts["dist_all_reduce"] - d0
                row["group_all_reduces"] = total_gc() - g0
                out, new_res = outp if isinstance(outp, tuple) else (outp, None)
                want_out, want_res = _reference(xs, r_keep, p_in, norm.weight.detach(), 1e-6)
                row["out_err"] = _maxerr(out, want_out)
                # what a norm WITHOUT the all-reduce would give (to tell a missed all-reduce apart)
                no_ar_out, _ = _reference([xs[rank]], r_keep, p_in, norm.weight.detach(), 1e-6)
                row["out_err_if_not_reduced"] = _maxerr(out, no_ar_out)
                row["out_ok"] = row["out_err"] <= tol
                if use_res:
                    row["res_err"] = _maxerr(new_res, want_res) if new_res is not None else None
                    row["res_ok"] = new_res is not None and row["res_err"] <= tol
                    row["residual_fresh"] = new_res is not None and new_res.data_ptr() != r_in.data_ptr()
                    row["input_residual_untouched"] = bool(torch.equal(r_in, r_keep))
                row["tol"] = tol
                rows.append(row)
            return rows

        os.environ.update({"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "fused"})
        res["cases"] = []
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 6.25e-2)):
            res["cases"] += step(f"unpatched {dtype}", lambda: run_cases("sglang", dtype, tol))
        orig = RMSNorm.__dict__["forward_with_allreduce_fusion"]
        rep = step("install(fused)", lambda: I.install())
        res["install"] = {"applied": list(rep.applied), "skipped": dict(rep.skipped)}
        res["patched_in_place"] = RMSNorm.__dict__["forward_with_allreduce_fusion"] is not orig
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 6.25e-2)):
            res["cases"] += step(f"patched {dtype}", lambda: run_cases("fastverify", dtype, tol))
        res["fused_rank_step"] = step("rank step (fused)", lambda: rank_step(I, ps))
        res["uninstalled"] = I.uninstall()
        res["restored_identity"] = RMSNorm.__dict__["forward_with_allreduce_fusion"] is orig
        res["forward_method"] = getattr(getattr(RMSNorm(HIDDEN), "_forward_method", None), "__name__", None)
        dist.all_reduce = real_dist_ar
        for g in (tp, atp):  # the real class method again (the counting instance attributes go)
            g.__dict__.pop("all_reduce", None)
        os.environ.update({"FASTVERIFY_BACKEND": "pcie_ipc", "FASTVERIFY_DEPLOYMENT": record})
        res["dispatch"] = step(
            "rank step (pcie_ipc dispatch, gloo stand-in)",
            lambda: rank_step(I, ps, sglang_switch_modules=frozenset(), all_reduce=True),
        )
        I.uninstall()
        os.environ.update({"FASTVERIFY_BACKEND": "b12x", "FASTVERIFY_DEPLOYMENT": record})
        res["b12x"] = step("b12x at the layer boundary (gloo stand-in)", lambda: b12x_boundary(I, ps, rank))
        I.uninstall()
        try:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
        except Exception as e:
            res["teardown_error"] = _err(e)
    except BaseException as e:  # noqa: BLE001
        res.setdefault("error", _err(e))
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(res, f, default=str)


class _StandInRunner:
    """What the rank step reads of SGLang's ModelRunner (0.5.23 names): no model is loaded here."""

    def __init__(self) -> None:
        import torch

        self.model_config = type("MC", (), {"hidden_size": HIDDEN})()
        self.dtype, self.device, self.gpu_id, self.is_draft_worker = torch.float32, "cpu", 0, False
        self.server_args = type("SA", (), {"cuda_graph_bs": None, "cuda_graph_max_bs": None})()

    def decode_num_tokens_per_req(self, *, num_draft_tokens=None):
        return 4


def rank_step(I, ps, *, sglang_switch_modules=None, all_reduce=False) -> dict:
    """install() as in a rank, then the REAL ``ModelRunner.init_cuda_graphs`` (wrapped) on a stand-in
    runner: the rank step builds the slot backend from the real TP GroupCoordinator and prints the
    line; the real body then fails on the stand-in (no model), which is recorded."""
    import torch
    import torch.distributed as dist
    from sglang.srt.model_executor.model_runner import ModelRunner

    from fastverify.patch import slots as F, slots as S

    out: dict = {}
    rep = I.install(sglang_switch_modules=sglang_switch_modules)
    out["install_applied"] = list(rep.applied)
    try:
        ModelRunner.init_cuda_graphs(_StandInRunner())
        out["real_body_error"] = None
    except Exception as e:
        out["real_body_error"] = _err(e, 200)
    out["applied"], out["skipped"], out["built"] = list(rep.applied), dict(rep.skipped), dict(rep.built)
    slot = S.DISPATCH_SLOT if all_reduce else (F.FUSED_GROUPS or [S.FUSED_SLOT])[0]
    ctx = slot.context
    if ctx is not None:
        out["context"] = {
            "world_size": ctx.world_size,
            "device_type": ctx.device_type,
            "group_backend": ctx.group_backend,
            "single_node": ctx.single_node,
            "p2p_ok": ctx.p2p_ok,
            "p2p_note": ctx.p2p_note,
        }
    be = slot.backend
    tp = ps.get_tp_group()
    if be is not None:
        out["backend"] = {
            "name": be.name.value,
            "max_numel": be.max_numel,
            "hidden": be.hidden,
            "on_tp_device_group": be.group is tp.device_group,
        }
    out["disabled"] = slot.disabled
    if all_reduce and be is not None:
        calls0 = dict(be.path_counts)
        x = torch.full((4, HIDDEN), float(dist.get_rank() + 1))
        y = type(tp).all_reduce(tp, x)  # the class method: fastverify's dispatch
        out["all_reduce_ok"] = bool(torch.equal(y, torch.full((4, HIDDEN), 3.0)))
        out["via_backend"] = be.path_counts.get("all_reduce", 0) - calls0.get("all_reduce", 0)
    return out


B12X_SMS = ((8, 9), (9, 0), (10, 0), (12, 0))
B12X_ROWS = (1, 4, 36, 37, 64)  # the kernel's limit is 36 rows (_oneshot_preparation.py)


def b12x_boundary(I, ps, rank: int) -> dict:
    """The b12x slot at SGLang's REAL layer boundary, on the real 2-rank gloo TP group.

    For each described GPU (SGLang's ``override_platform(device_capability=...)``, what the patch's
    reach reads): install(b12x), then the real ``ModelRunner.init_cuda_graphs`` (wrapped) runs the
    rank step on a stand-in runner -- on SM120 it builds the slot from the real TP
    ``GroupCoordinator`` (gloo on CPU standing in for b12x, the same creation, prepare, first-result
    check and votes). Then SGLang's own ``prepare._reduce_update_read`` (FFN input) and
    ``prepare._run_entry`` (attention input, a carried ``UnreducedOutput``) run with the candidates
    ``ffn_input_fusions`` / ``attn_input_fusions`` bind -- once as a model built before the patch
    (SGLang's own: the reference), once after -- counting ``torch.distributed.all_reduce`` calls."""
    from functools import partial
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from sglang.srt.layers.layer_boundary import prepare as P
    from sglang.srt.layers.layer_boundary.fusions import allreduce as A
    from sglang.srt.layers.layer_boundary.layout import SumGroup
    from sglang.srt.layers.layer_boundary.output import UnreducedOutput
    from sglang.srt.layers.layer_boundary.residual.add_norm import NORM_QUANT_READOUT, NORM_READOUT
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import override_platform

    from fastverify.patch import slots as S

    count = {"n": 0}
    real_ar = dist.all_reduce

    def counting(*a, **k):
        count["n"] += 1
        return real_ar(*a, **k)

    dist.all_reduce = counting
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE)
    tp = ps.get_tp_group()
    out: dict = {"sms": []}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(77)
            norm = RMSNorm(HIDDEN, eps=1e-6)
            with torch.no_grad():
                norm.weight.copy_(1.0 + 0.1 * torch.randn(HIDDEN, generator=g))
            norm = norm.to(dtype)
            plan = SimpleNamespace(norm=norm, fusions=None)
            own = {
                "ffn": tuple(f.run for f in A.ffn_input_fusions(plan)),
                "attn": A.attn_input_fusions(plan, NORM_QUANT_READOUT),
            }

            def boundary(path, cands, x, res):
                if path == "ffn":
                    return P._reduce_update_read(
                        x,
                        res,
                        fb,
                        norm,
                        gathers_residual=False,
                        fusions=cands,
                        group=SumGroup.ATTN_TP,
                        read=NORM_READOUT,
                    )
                step = partial(P._update_read, pre_move=None, enters_stack=False, read=NORM_READOUT)
                return P._run_entry(
                    UnreducedOutput(partial=x, group=tp),
                    res,
                    fb,
                    norm,
                    step=step,
                    is_plain_add=True,
                    carried_fusions=cands,
                    read=NORM_READOUT,
                )

            for sm in B12X_SMS:
                row: dict = {"sm": list(sm), "dtype": str(dtype).replace("torch.", ""), "cases": []}
                I.uninstall()
                runner = _StandInRunner()
                runner.dtype = dtype
                with override_platform(device_capability=sm):
                    rep = I.install()
                    row["install_applied"] = list(rep.applied)
                    try:
                        ModelRunner.init_cuda_graphs(runner)
                    except Exception as e:  # the real body, after the rank step, on the stand-in
                        row["real_body_error"] = _err(e, 120)
                slot = S.ADD_NORM_SLOT
                be = slot.backend
                row.update(
                    applied=list(rep.applied),
                    skipped=dict(rep.skipped),
                    built=dict(rep.built),
                    disabled=slot.disabled,
                    checked=slot.checked,
                    ranks=slot.ranks,
                    attn_is_tp=slot.attn_is_tp,
                    backend=be.name.value if be is not None else None,
                    on_tp_device_group=be is not None and be.group is tp.device_group,
                )
                patched = {
                    "ffn": tuple(f.run for f in A.ffn_input_fusions(plan)),  # a model built now
                    "attn": A.attn_input_fusions(plan, NORM_QUANT_READOUT),
                }
                for rows in B12X_ROWS if sm == (12, 0) else (4, 37):
                    for path in ("ffn", "attn"):
                        gx = torch.Generator().manual_seed(1000 + rows)
                        xs = [torch.randn(rows, HIDDEN, generator=gx).to(dtype) for _ in range(2)]
                        res0 = torch.randn(rows, HIDDEN, generator=gx).to(dtype)
                        c: dict = {"rows": rows, "path": path}
                        n0 = count["n"]
                        want = boundary(path, own[path], xs[rank].clone(), res0.clone())
                        c["ref_all_reduces"] = count["n"] - n0
                        res_in = res0.clone()
                        used0 = dict(be.path_counts) if be is not None else {}
                        n0 = count["n"]
                        got = boundary(path, patched[path], xs[rank].clone(), res_in)
                        c["all_reduces"] = count["n"] - n0
                        c["via_backend"] = sum(be.path_counts.values()) - sum(used0.values()) if be is not None else 0
                        c["out_equal"] = bool(torch.equal(got[0], want[0]))
                        c["res_equal"] = bool(torch.equal(got[1], want[1]))
                        c["out_err"], c["res_err"] = _maxerr(got[0], want[0]), _maxerr(got[1], want[1])
                        # independent of SGLang: the sum of both ranks' inputs + residual, normed
                        ref_out, ref_res = _reference(xs, res0, None, norm.weight.detach(), 1e-6)
                        c["ref_out_err"], c["ref_res_err"] = _maxerr(want[0], ref_out), _maxerr(want[1], ref_res)
                        c["input_residual_untouched"] = bool(torch.equal(res_in, res0))
                        c["residual_fresh"] = got[1].data_ptr() != res_in.data_ptr()
                        row["cases"].append(c)
                out["sms"].append(row)
                I.uninstall()
    finally:
        dist.all_reduce = real_ar
    return out


FUSED_GROUP_ROWS = 4


def run_fused_groups_rank(rank: int, world: int, port: int, out_path: str) -> None:
    """The fused slot on SGLang's REAL groups with MoE data parallelism: ``world`` gloo ranks at
    TP ``world``, moe_dp 2 (so MoE TP is ``world // 2``): the attention output is owed to the
    attention-TP group (every rank), the MoE output to ``post_experts_reduction_group()`` (the
    MoE-TP group of ``world // 2`` ranks; SGLang 0.5.23 ``layers/moe/utils.py``). SGLang's fusion
    gate needs SM90/SM100 and FlashInfer, so it is stood in for (``flashinfer_ar_fusion_applies``
    true up to 2,048 rows); everything else is SGLang's: the groups, ``resolve_fusion_group``, the
    real ``ModelRunner.init_cuda_graphs`` (wrapped: the rank step builds the gloo stand-in per group)
    and the real ``RMSNorm``. Each rank's input is ``rank + 1``, so a sum names the ranks it spans."""
    res: dict = {"rank": rank, "world": world, "steps": []}

    def step(name, fn):
        try:
            v = fn()
            res["steps"].append({"step": name, "ok": True})
            return v
        except BaseException as e:  # noqa: BLE001
            res["steps"].append({"step": name, "ok": False, "error": _err(e)})
            raise

    try:
        import sglang.srt.distributed.parallel_state as ps
        import sglang.srt.layers.layer_boundary.residual.add_norm as add_norm
        import torch
        from sglang.srt.layers.flashinfer_comm_fusion import resolve_fusion_group
        from sglang.srt.layers.layernorm import RMSNorm
        from sglang.srt.layers.moe.utils import post_experts_reduction_group
        from sglang.srt.runtime_context import get_parallel

        ps.init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        moe_tp = world // 2
        get_parallel().override_permanently(
            tp_size=world,
            pp_size=1,
            moe_dp_size=2,
            attn_dp_size=1,
            attn_cp_size=1,
            shared_experts_tp_size=None,
            moe_ep_size=1,
            attn_dcp_size=1,
            attn_tp_size=world,
            moe_tp_size=moe_tp,
            tp_rank=rank,
            pp_rank=0,
            attn_tp_rank=rank,
            attn_cp_rank=0,
            attn_dp_rank=0,
            moe_ep_rank=0,
            moe_tp_rank=rank % moe_tp,
            moe_dp_rank=rank // moe_tp,
        )
        _initialize_model_parallel(ps, res, step)
        attn, moe = resolve_fusion_group(use_attn_tp_group=True)[2], post_experts_reduction_group()
        res["groups"] = {
            "attn": list(attn.ranks),
            "moe": list(moe.ranks),
            "moe_is_tp": moe is ps.get_tp_group(),
            "resolve_moe_is_post_experts": resolve_fusion_group(use_attn_tp_group=False)[2] is moe,
        }
        add_norm.flashinfer_ar_fusion_applies = lambda batch_size: 0 < batch_size <= 2048  # the SM90 gate
        from sglang.srt.model_executor.model_runner import ModelRunner

        from fastverify.patch import install as I, slots as F
        from fastverify.patch.paths import COUNTER

        os.environ.update(
            {
                "FASTVERIFY_PATCH": "1",
                "FASTVERIFY_BACKEND": "fused",
                "FASTVERIFY_DEPLOYMENT": os.environ.get("FASTVERIFY_PROBE_RECORD", ""),
            }
        )
        rep = step("install(fused)", lambda: I.install())
        try:
            ModelRunner.init_cuda_graphs(_StandInRunner())
        except Exception as e:  # the real body fails on the stand-in runner, after the rank step
            res["real_body_error"] = _err(e, 200)
        res["applied"], res["built"], res["skipped"] = list(rep.applied), dict(rep.built), dict(rep.skipped)
        res["backends"] = [{"ranks": list(s.group.ranks), "built": s.backend is not None} for s in F.FUSED_GROUPS]
        norm = RMSNorm(HIDDEN, eps=1e-6)
        x = torch.full((FUSED_GROUP_ROWS, HIDDEN), float(rank + 1))
        residual = torch.zeros(FUSED_GROUP_ROWS, HIDDEN)
        COUNTER.reset()
        res["sums"] = {}
        for name, use_attn in (("attn", True), ("moe", False)):  # attention first, as a layer runs
            out = norm.forward_with_allreduce_fusion(x.clone(), residual.clone(), use_attn_tp_group=use_attn)
            reduced = out[1] - residual  # the fresh residual: residual + the sum
            res["sums"][name] = sorted({float(v) for v in reduced.flatten()})
        res["paths"] = COUNTER.snapshot()
        I.uninstall()
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    except BaseException as e:  # noqa: BLE001
        res.setdefault("error", _err(e))
        res["trace"] = traceback.format_exc()[-2000:]
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(res, f, default=str)


def probe_ranks(world: int, timeout: float, mode: str = "rank") -> dict:
    port = _free_port()
    with tempfile.TemporaryDirectory() as d:
        procs, outs = [], []
        for r in range(world):
            out = os.path.join(d, f"rank{r}.json")
            outs.append(out)
            env = dict(
                os.environ,
                FASTVERIFY_PATCH="1",
                FASTVERIFY_BACKEND="fused",
                FASTVERIFY_PROBE_RECORD=write_record(os.path.join(d, "probe.deploy.json")),
            )
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        f"--{mode}",
                        str(r),
                        "--world",
                        str(world),
                        "--port",
                        str(port),
                        "--out",
                        out,
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = []
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                o, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                o, _ = p.communicate()
                o = (o or "") + "\n[probe: rank timed out]"
            logs.append(
                {
                    "rc": p.returncode,
                    "tail": (o or "")[-1500:],
                    "lines": [ln for ln in (o or "").splitlines() if ln.startswith("fastverify patch [TP")],
                }
            )
        ranks = []
        for r, out in enumerate(outs):
            try:
                with open(out, encoding="utf-8") as f:
                    ranks.append(json.load(f))
            except Exception as e:
                ranks.append({"rank": r, "error": f"no result ({_err(e)})", "log": logs[r]})
        for r, lg in enumerate(logs):
            ranks[r]["rc"] = lg["rc"]
            ranks[r]["lines"] = lg["lines"]
            if lg["rc"] != 0 or "error" in ranks[r]:
                ranks[r]["log_tail"] = lg["tail"]
    return {"world": world, "ranks": ranks}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int)
    ap.add_argument("--fused-groups-rank", type=int)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int)
    ap.add_argument("--out")
    ap.add_argument("--rank-timeout", type=float, default=240.0)
    a = ap.parse_args()
    _quiet_logging()
    if a.rank is not None:
        run_rank(a.rank, a.world, a.port, a.out)
        return 0
    if a.fused_groups_rank is not None:
        run_fused_groups_rank(a.fused_groups_rank, a.world, a.port, a.out)
        return 0
    t0 = time.perf_counter()
    result: dict = {"python": sys.executable}
    try:
        import importlib.metadata as md

        result["versions"] = {p: md.version(p) for p in ("sglang", "torch")}
    except Exception as e:
        result["versions_error"] = _err(e)
    try:
        import torch

        result["cuda_available"] = torch.cuda.is_available()
    except Exception as e:
        result["torch_error"] = _err(e)
    result["imports"] = probe_imports()
    try:
        result["static"] = probe_static()
    except BaseException as e:  # noqa: BLE001
        result["static_error"] = _err(e)
        result["static_trace"] = traceback.format_exc()[-2000:]
    try:
        result["gate"] = probe_gate()
    except BaseException as e:  # noqa: BLE001
        result["gate_error"] = _err(e)
        result["gate_trace"] = traceback.format_exc()[-2000:]
    try:
        result["ranks"] = probe_ranks(a.world, a.rank_timeout)
    except BaseException as e:  # noqa: BLE001
        result["ranks_error"] = _err(e)
    try:
        result["fused_groups"] = probe_ranks(4, a.rank_timeout, mode="fused-groups-rank")
    except BaseException as e:  # noqa: BLE001
        result["fused_groups_error"] = _err(e)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    sys.stdout.flush()
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
