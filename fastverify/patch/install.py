"""The patch applied inside every SGLang rank (from the plugin entry point or the import hook).

Targets are found by feature detection, each checked with :mod:`inspect` before it is wrapped
(names as in SGLang 0.5.23):

``parallel_state.GroupCoordinator.all_reduce(self, input_)``
    wrapped only for ``--backend pcie-ipc`` on an SGLang without its own PCIe IPC all-reduce
    (``pcie_ipc_ar.py``); where SGLang has it, ``launch`` sets ``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE``
    and the dispatch is left alone.
``layernorm.RMSNorm.forward_with_allreduce_fusion(self, x, residual, post_residual_addition, use_attn_tp_group)``
    replaced for ``--backend fused``. Every fused all-reduce + residual + RMSNorm of the decoder
    layer goes through it (``layer_boundary/fusions/allreduce.py`` calls
    ``plan.norm.forward_with_allreduce_fusion``). The replacement ALWAYS all-reduces: it runs
    fastverify's fused backend when that takes the tensor, else the group's plain all-reduce
    followed by the norm -- never the norm alone (SGLang's AITER branch can still do that when the
    fused call returns None). It returns a fresh residual, as SGLang's FlashInfer wrapper does
    (``flashinfer_preserves_residual`` relies on it). The first fused result is checked against the
    plain path; on a mismatch the fused backend is disabled with one logged line.
``tp_worker.TpModelWorker.forward_batch_generation(..., is_verify=...)``
    wrapped for ``--profile-verify DIR``: a pair of events around each verify forward (CUDA events
    on the current stream, no host sync), drained every ``DRAIN_EVERY`` calls into
    ``DIR/verify-rank<R>.jsonl``.
``model_runner.ModelRunner.init_cuda_graphs(self, capture_decode_cuda_graph)``
    wrapped when the fused or the pcie-ipc target above was applied (never for ``nccl``/``off``/
    ``auto``). Every TP rank's ``TpModelWorker.init_cuda_graphs`` calls it once per model runner,
    eagerly, before ``capture_cuda_graphs``. Before the original runs (target runner only, once), the
    wrapper creates the backend through the same factory as the lazy path and calls
    ``backend.prepare(shapes)`` with the rows SGLang will capture (decode capture batch sizes ×
    ``decode_num_tokens_per_req()``; else the workspace's max), so workspaces exist before capture.
    Any failure is logged in one line and the backend is left to the lazy path; it never raises.

A target that is missing or has other parameters is skipped with ONE log line and left as it was.
:func:`install` never raises; :func:`uninstall` restores every original; installing twice is a
no-op.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastverify.patch import (ENV_BACKEND, ENV_CUDA_MAX_CONNECTIONS, ENV_FLAG, ENV_PROFILE_VERIFY,
                              ENV_PROFILE_VERIFY_STEPS)

log = logging.getLogger("fastverify.patch")

MOD_PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
MOD_DISTRIBUTED = "sglang.srt.distributed"
MOD_LAYERNORM = "sglang.srt.layers.layernorm"
MOD_MOE_UTILS = "sglang.srt.layers.moe.utils"
MOD_TP_WORKER = "sglang.srt.managers.tp_worker"
MOD_MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
MOD_RUNTIME_CONTEXT = "sglang.srt.runtime_context"

DRAIN_EVERY = 64
FUSED_MAX_TOKENS = 2048  # SGLang's FUSE_ALLREDUCE_MAX_BATCH_SIZE: workspaces are sized for it


@dataclass(frozen=True)
class Target:
    """One thing the patch may wrap: ``module.cls.attr`` whose parameters start with ``params``
    (and contain ``needs``)."""

    key: str
    module: str
    cls: str
    attr: str
    params: tuple[str, ...]
    needs: tuple[str, ...] = ()


TARGET_ALL_REDUCE = Target("all_reduce", MOD_PARALLEL_STATE, "GroupCoordinator", "all_reduce", ("self", "input_"))
TARGET_FUSED_NORM = Target("fused_norm", MOD_LAYERNORM, "RMSNorm", "forward_with_allreduce_fusion",
                           ("self", "x", "residual", "post_residual_addition", "use_attn_tp_group"))
TARGET_VERIFY = Target("verify_timer", MOD_TP_WORKER, "TpModelWorker", "forward_batch_generation",
                       ("self", "batch", "forward_batch"), needs=("is_verify",))
TARGET_PRE_CAPTURE = Target("pre_capture", MOD_MODEL_RUNNER, "ModelRunner", "init_cuda_graphs",
                            ("self", "capture_decode_cuda_graph"))
TARGETS = (TARGET_ALL_REDUCE, TARGET_FUSED_NORM, TARGET_VERIFY, TARGET_PRE_CAPTURE)


@dataclass
class PatchReport:
    """What :func:`install` did: ``applied`` target keys, ``skipped`` key → reason (also logged,
    one line each), ``settings`` applied in-rank, ``backend`` asked for."""

    backend: str
    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)
    active: bool = True

    def line(self) -> str:
        parts = [f"backend={self.backend}", "applied=" + (",".join(self.applied) or "none")]
        if self.skipped:
            parts.append("skipped=" + ",".join(self.skipped))
        return "fastverify patch: " + " ".join(parts)


# --- state ------------------------------------------------------------------------------------------

_lock = threading.Lock()
_installed: list[tuple[type, str, Any]] = []  # (owner, attr, original), in install order


@dataclass
class _BackendSlot:
    """A fastverify backend for one role, created lazily on the first eager CUDA call (or attached)."""

    kind: str  # fastverify BackendName value: "fused" / "pcie_ipc"
    backend: Any = None
    disabled: str | None = None
    checked: bool = False
    prepared: bool = False  # prepare() ran before CUDA-graph capture
    factory: Callable[[Any, Any], Any] | None = None  # (coordinator-or-None, tensor) -> backend


_fused = _BackendSlot("fused")
_dispatch = _BackendSlot("pcie_ipc")
_timer: "VerifyTimer | None" = None


def attach_fused_backend(backend: Any, *, checked: bool = False) -> None:
    """Use ``backend`` (an :class:`fastverify.backends.AllReduceBackend`) for the fused path.
    ``checked=True`` skips the first-result check against the plain path."""
    _fused.backend, _fused.disabled, _fused.checked = backend, None, checked


def attach_dispatch_backend(backend: Any) -> None:
    """Use ``backend`` for tensor-parallel all-reduces that it ``supports`` (``--backend pcie-ipc``
    on an SGLang without its own PCIe IPC path)."""
    _dispatch.backend, _dispatch.disabled = backend, None


def _disable(slot: _BackendSlot, reason: str) -> None:
    if slot.disabled is None:
        slot.disabled = reason
        log.warning("fastverify patch: %s backend disabled: %s; using the plain all-reduce", slot.kind, reason)


def _is_capturing() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def _is_compiling() -> bool:
    try:
        import torch

        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


def _max_numel(kind: str, hidden: int) -> int:
    env_max = os.environ.get("SGLANG_PCIE_IPC_MAX_NUMEL")
    if kind == "pcie_ipc" and env_max and env_max.isdigit():
        return int(env_max)
    return FUSED_MAX_TOKENS * hidden


def _default_factory(kind: str) -> Callable[[Any, Any], Any]:
    def make(coordinator: Any, x: Any) -> Any:
        from fastverify.backends import make_backend

        group = getattr(coordinator, "device_group", None)
        hidden = int(x.shape[-1])
        max_numel = _max_numel(kind, hidden)
        return make_backend(kind, group, device=x.device, dtype=x.dtype, max_numel=max_numel)

    return make


def _slot_backend(slot: _BackendSlot, coordinator: Any, x: Any) -> Any:
    """The slot's backend, creating it on the first eager call on a GPU tensor; None when there is
    none (disabled, not creatable now, CPU tensor)."""
    if slot.disabled is not None:
        return None
    if slot.backend is None:
        if slot.factory is None or not getattr(x, "is_cuda", False) or _is_capturing() or _is_compiling():
            return None
        try:
            slot.backend = slot.factory(coordinator, x)
        except Exception as err:
            _disable(slot, f"cannot create it ({type(err).__name__}: {err})")
            return None
    return slot.backend


# --- wrapping ---------------------------------------------------------------------------------------


def _check_signature(fn: Any, target: Target) -> str | None:
    """None when ``fn`` looks like the target, else what differs (one phrase)."""
    if not callable(fn):
        return "not callable"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "signature cannot be read"
    names = [p.name for p in sig.parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if tuple(names[: len(target.params)]) != target.params:
        return f"parameters ({', '.join(names)}) do not start with ({', '.join(target.params)})"
    for n in target.needs:
        if n not in sig.parameters:
            return f"has no parameter {n!r}"
    return None


def _resolve(target: Target, modules: Mapping[str, Any] | None) -> tuple[type | None, Any, str | None]:
    try:
        mod = modules[target.module] if modules is not None else importlib.import_module(target.module)
    except KeyError:
        return None, None, f"module {target.module} not given"
    except Exception as err:
        return None, None, f"cannot import {target.module} ({type(err).__name__}: {err})"
    cls = getattr(mod, target.cls, None)
    if not isinstance(cls, type):
        return None, None, f"{target.module} has no class {target.cls}"
    fn = cls.__dict__.get(target.attr)
    if fn is None:
        return None, None, f"{target.cls} defines no {target.attr}"
    return cls, fn, None


def _wrap(cls: type, attr: str, make: Callable[[Any], Any]) -> bool:
    """Replace ``cls.attr`` by ``make(original)``; False when it is already ours (idempotent)."""
    current = cls.__dict__[attr]
    if getattr(current, "__fastverify_original__", None) is not None:
        return False
    new = functools.wraps(current)(make(current))
    new.__fastverify_original__ = current
    setattr(cls, attr, new)
    _installed.append((cls, attr, current))
    return True


def _skip(report: PatchReport, target: Target, reason: str) -> None:
    report.skipped[target.key] = reason
    log.warning("fastverify patch: skipped %s.%s.%s: %s; SGLang's own code runs unchanged",
                target.module, target.cls, target.attr, reason)


def _try_target(report: PatchReport, target: Target, modules: Mapping[str, Any] | None,
                make: Callable[[Any], Any], extra_check: Callable[[], str | None] | None = None) -> None:
    try:
        cls, fn, why = _resolve(target, modules)
        if why is None:
            why = _check_signature(fn, target)
        if why is None and extra_check is not None:
            why = extra_check()
        if why is not None:
            _skip(report, target, why)
            return
        _wrap(cls, target.attr, make)
        report.applied.append(target.key)
    except Exception as err:  # never into the server
        _skip(report, target, f"{type(err).__name__}: {err}")


# --- the all-reduce dispatch ------------------------------------------------------------------------


def _make_all_reduce(original: Callable) -> Callable:
    def all_reduce(self, input_, *args, **kwargs):
        if not args and not kwargs and getattr(self, "world_size", 1) > 1 and getattr(self, "unique_name", "").startswith("tp"):
            be = _slot_backend(_dispatch, self, input_)
            if be is not None and be.supports(input_):
                return be.all_reduce(input_)
        return original(self, input_, *args, **kwargs)

    return all_reduce


# --- the fused all-reduce + residual + RMSNorm ------------------------------------------------------


def _group_all_reduces(modules: Mapping[str, Any] | None) -> tuple[Callable | None, Callable | None, str | None]:
    """(attention-TP all-reduce, post-experts all-reduce) as SGLang's fallback uses them."""
    def get(mod_name: str, name: str) -> Callable | None:
        try:
            mod = modules[mod_name] if modules is not None else importlib.import_module(mod_name)
        except Exception:
            return None
        fn = getattr(mod, name, None)
        return fn if callable(fn) else None

    attn = get(MOD_DISTRIBUTED, "attention_tensor_model_parallel_all_reduce")
    tp = get(MOD_DISTRIBUTED, "tensor_model_parallel_all_reduce")
    moe = get(MOD_MOE_UTILS, "deferred_post_experts_all_reduce") or tp
    if attn is None or moe is None:
        return None, None, (f"{MOD_DISTRIBUTED} lacks attention_tensor_model_parallel_all_reduce / "
                            "tensor_model_parallel_all_reduce")
    return attn, moe, None


def _group_coordinator(modules: Mapping[str, Any] | None, use_attn_tp_group: bool) -> Any:
    try:
        mod = modules[MOD_PARALLEL_STATE] if modules is not None else importlib.import_module(MOD_PARALLEL_STATE)
        getter = getattr(mod, "get_attn_tp_group" if use_attn_tp_group else "get_tp_group", None) \
            or getattr(mod, "get_tp_group")
        return getter()
    except Exception:
        return None


def _make_fused_norm(attn_ar: Callable, moe_ar: Callable, modules: Mapping[str, Any] | None) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def forward_with_allreduce_fusion(self, x, residual=None, post_residual_addition=None,
                                          use_attn_tp_group=True):
            if residual is not None and post_residual_addition is not None:
                residual = residual + post_residual_addition  # fresh tensor; the caller's is untouched
            if residual is not None:
                weight = getattr(self, "weight", None)
                eps = getattr(self, "variance_epsilon", None)
                be = None
                if weight is not None and eps is not None and x.dim() == 2 and x.shape[0] <= FUSED_MAX_TOKENS:
                    be = _slot_backend(_fused, _group_coordinator(modules, use_attn_tp_group), x)
                if be is not None and be.supports(x):
                    out = _run_fused(be, x, residual, weight, eps, attn_ar if use_attn_tp_group else moe_ar, self)
                    if out is not None:
                        return out
            reduced = (attn_ar if use_attn_tp_group else moe_ar)(x)
            if residual is None:
                return self.forward(reduced)
            if post_residual_addition is None:
                residual = residual.clone()  # a fresh residual, as SGLang's fused wrapper returns
            return self.forward(reduced, residual, None)

        return forward_with_allreduce_fusion

    return make


def _run_fused(be: Any, x: Any, residual: Any, weight: Any, eps: float, plain_ar: Callable, norm: Any) -> Any:
    """The fused result, or None to fall back (after disabling the backend on a mismatch/error).
    Always collective-consistent: on the first call every rank runs both paths."""
    try:
        w = weight.data if hasattr(weight, "data") else weight
        out = be.all_reduce_residual_rmsnorm(x, residual, w, float(eps))
        if not _fused.checked:
            _fused.checked = True
            from fastverify.backends import add_rmsnorm, check_close

            want = add_rmsnorm(plain_ar(x.clone()), residual, w, float(eps))
            ok0, err0 = check_close(out[0], want[0], x.dtype)
            ok1, err1 = check_close(out[1], want[1], x.dtype)
            if not (ok0 and ok1):
                _disable(_fused, f"first result differs from the plain path (max error {max(err0, err1):.3g})")
                return None
        return out
    except Exception as err:
        _disable(_fused, f"{type(err).__name__}: {err}")
        return None


# --- the verify timer -------------------------------------------------------------------------------


class _WallEvent:
    """CPU stand-in for ``torch.cuda.Event`` (no GPU): wall clock, always complete."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0

    def record(self) -> None:
        self.t = time.perf_counter_ns()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_WallEvent") -> float:
        return (end.t - self.t) / 1e6


def _default_event_factory() -> tuple[Callable[[], Any], str]:
    try:
        import torch

        if torch.cuda.is_available():
            return (lambda: torch.cuda.Event(enable_timing=True)), "cuda_events"
    except Exception:
        pass
    return _WallEvent, "cpu_wall_clock"


def _default_rank() -> str:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:
        pass
    return f"pid{os.getpid()}"


class VerifyTimer:
    """Events around each verify forward; :meth:`drain` writes the finished ones as JSON lines
    (``{"step", "verify_ms", "clock", "rank", "pid"}``) to ``out_dir/verify-rank<R>.jsonl``.
    Recording never waits for the GPU; draining reads only events whose ``query()`` is True."""

    def __init__(self, out_dir: str | Path, *, every: int = DRAIN_EVERY,
                 event_factory: Callable[[], Any] | None = None, clock: str | None = None,
                 rank: Callable[[], str] = _default_rank) -> None:
        self.out_dir = Path(out_dir)
        self.every = max(1, int(every))
        if event_factory is None:
            event_factory, default_clock = _default_event_factory()
            clock = clock or default_clock
        self.event_factory = event_factory
        self.clock = clock or "unknown"
        self.rank = rank
        self.pending: list[tuple[int, Any, Any]] = []
        self.steps = 0
        self.written = 0
        self._path: Path | None = None

    def start(self) -> Any:
        ev = self.event_factory()
        ev.record()
        return ev

    def stop(self, start_ev: Any) -> None:
        end = self.event_factory()
        end.record()
        self.pending.append((self.steps, start_ev, end))
        self.steps += 1
        if len(self.pending) >= self.every:
            self.drain()

    def drain(self, *, wait: bool = False) -> int:
        """Write finished events; ``wait=True`` (at exit) synchronizes on the last ones."""
        done, keep = [], []
        for item in self.pending:
            _, s, e = item
            if wait and hasattr(e, "synchronize"):
                try:
                    e.synchronize()
                except Exception:
                    pass
            (done if e.query() else keep).append(item)
        self.pending = keep
        if not done:
            return 0
        try:
            if self._path is None:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                self._path = self.out_dir / f"verify-rank{self.rank()}.jsonl"
            rank, pid = self.rank(), os.getpid()
            with open(self._path, "a", encoding="utf-8") as f:
                for step, s, e in done:
                    f.write(json.dumps({"step": step, "verify_ms": round(float(s.elapsed_time(e)), 6),
                                        "clock": self.clock, "rank": rank, "pid": pid}) + "\n")
        except Exception as err:
            log.warning("fastverify patch: verify timings not written to %s: %s", self.out_dir, err)
            return 0
        self.written += len(done)
        return len(done)


class VerifyTrace:
    """A torch.profiler trace of the next ``steps`` verify forwards of this rank, each inside a
    ``step[TARGET_VERIFY #i]`` span (the form ``fastverify profile --trace`` splits steps on),
    written to ``out_dir/verify-TP-<rank>.trace.json.gz`` when the last one ends. Profiling costs
    time, so the timings in the JSON lines of those steps are not representative; it stops itself."""

    def __init__(self, out_dir: str | Path, steps: int, *, rank: Callable[[], str] = _default_rank) -> None:
        self.out_dir = Path(out_dir)
        self.steps = int(steps)
        self.rank = rank
        self.done = 0
        self._prof: Any = None
        self._span: Any = None
        self.path: Path | None = None

    @property
    def active(self) -> bool:
        return self.done < self.steps

    def begin(self) -> None:
        if not self.active:
            return
        try:
            import torch

            if self._prof is None:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                self._prof = torch.profiler.profile(activities=acts)
                self._prof.__enter__()
            self._span = torch.profiler.record_function(f"step[TARGET_VERIFY #{self.done}]")
            self._span.__enter__()
        except Exception as err:  # profiling must never break serving
            log.warning("fastverify patch: verify trace not started: %s", err)
            self.steps = 0

    def end(self) -> None:
        if self._span is None:
            return
        try:
            self._span.__exit__(None, None, None)
            self._span = None
            self.done += 1
            if self.done >= self.steps:
                self._prof.__exit__(None, None, None)
                self.out_dir.mkdir(parents=True, exist_ok=True)
                self.path = self.out_dir / f"verify-TP-{self.rank()}.trace.json.gz"
                self._prof.export_chrome_trace(str(self.path))
                self._prof = None
                log.info("fastverify patch: wrote a trace of %d verify steps to %s", self.done, self.path)
        except Exception as err:
            log.warning("fastverify patch: verify trace not written: %s", err)
            self.steps = 0


def _make_verify_wrapper(original: Callable, timer: VerifyTimer, trace: VerifyTrace | None = None) -> Callable:
    sig = inspect.signature(original)
    names = list(sig.parameters)
    pos = names.index("is_verify") - 1 if "is_verify" in names else -1  # minus self

    def forward_batch_generation(self, *args, **kwargs):
        if "is_verify" in kwargs:
            is_verify = kwargs["is_verify"]
        else:
            is_verify = 0 <= pos < len(args) and args[pos]
        if not is_verify or _is_capturing():
            return original(self, *args, **kwargs)
        tracing = trace is not None and trace.active
        if tracing:
            trace.begin()
        start = timer.start()
        try:
            out = original(self, *args, **kwargs)
        finally:
            timer.stop(start)
            if tracing:
                trace.end()
        return out

    return forward_batch_generation


# --- before CUDA-graph capture ---------------------------------------------------------------------


@dataclass
class _Probe:
    """What a factory reads of the first tensor (``shape[-1]``, ``device``, ``dtype``), without
    allocating one."""

    shape: tuple[int, ...]
    device: Any
    dtype: Any
    is_cuda: bool = True


def _capture_batch_sizes(runner: Any, modules: Mapping[str, Any] | None) -> list[int]:
    """The decode batch sizes SGLang will capture, as far as they can be read before it does
    (0.5.23: ``get_exec().graph.cuda_graph_config.decode.bs``, clamped to the request pool as
    ``get_batch_sizes_to_capture`` does; older: ``server_args.cuda_graph_bs`` / ``cuda_graph_max_bs``)."""
    bs: list[int] = []
    try:
        mod = modules[MOD_RUNTIME_CONTEXT] if modules is not None else importlib.import_module(MOD_RUNTIME_CONTEXT)
        bs = [int(b) for b in (mod.get_exec().graph.cuda_graph_config.decode.bs or [])]
    except Exception:
        bs = []
    if not bs:
        sa = getattr(runner, "server_args", None)
        got = getattr(sa, "cuda_graph_bs", None)
        if got:
            bs = [int(b) for b in got]
        elif isinstance(getattr(sa, "cuda_graph_max_bs", None), int):
            bs = [int(sa.cuda_graph_max_bs)]
    pool = getattr(getattr(runner, "req_to_token_pool", None), "size", None)
    if bs and isinstance(pool, int) and pool > 0:
        bs = [b for b in bs if b <= pool] + ([pool] if max(bs) > pool else [])
    return sorted({b for b in bs if b > 0})


def _capture_shapes(runner: Any, hidden: int, kind: str, modules: Mapping[str, Any] | None) -> list[tuple[int, int]]:
    """(rows, hidden) for every captured decode/verify batch: batch size × tokens per request, up
    to what the workspace holds; the workspace's max when the batch sizes cannot be read."""
    max_rows = max(1, _max_numel(kind, hidden) // hidden)
    width = 1
    try:
        fn = getattr(runner, "decode_num_tokens_per_req", None)
        if callable(fn):
            width = max(1, int(fn()))
    except Exception:
        width = 1
    rows = sorted({b * width for b in _capture_batch_sizes(runner, modules) if b * width <= max_rows})
    return [(r, hidden) for r in rows] or [(max_rows, hidden)]


def _runner_probe(runner: Any) -> tuple[int, Any, Any]:
    """(hidden, device, dtype) of the target model runner."""
    hidden = int(runner.model_config.hidden_size)
    dtype = getattr(runner, "dtype", None)
    device: Any = getattr(runner, "device", "cuda")
    try:
        import torch

        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(getattr(runner, "gpu_id", None), int):
            device = f"{device}:{runner.gpu_id}"
    except Exception:
        pass
    return hidden, device, dtype


def _prepare_slots(runner: Any, slots: list[tuple[_BackendSlot, bool]], modules: Mapping[str, Any] | None) -> None:
    """Create and prepare each slot's backend before capture; on any failure one log line, and the
    slot is left to the lazy path (backend None, not disabled). Never raises."""
    if getattr(runner, "is_draft_worker", False):
        return  # the target runner's hidden size sizes the workspaces
    for slot, use_attn in slots:
        if slot.prepared or slot.disabled is not None or slot.factory is None:
            continue
        slot.prepared = True  # once, even when it fails
        created = False
        try:
            hidden, device, dtype = _runner_probe(runner)
            shapes = _capture_shapes(runner, hidden, slot.kind, modules)
            if slot.backend is None:
                coord = _group_coordinator(modules, use_attn)
                slot.backend = slot.factory(coord, _Probe((shapes[-1][0], hidden), device, dtype))
                created = True
            prep = getattr(slot.backend, "prepare", None)
            if callable(prep):
                prep(shapes)
            log.info("fastverify patch: %s backend prepared before CUDA-graph capture for %d shapes (max %s)",
                     slot.kind, len(shapes), shapes[-1])
        except Exception as err:
            if created:
                try:
                    close = getattr(slot.backend, "close", None)
                    if callable(close):
                        close()
                except Exception:
                    pass
                slot.backend = None
            log.warning("fastverify patch: %s backend not prepared before CUDA-graph capture (%s: %s); "
                        "it is created on the first eager call instead", slot.kind, type(err).__name__, err)


def _make_pre_capture(slots: list[tuple[_BackendSlot, bool]], modules: Mapping[str, Any] | None) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def init_cuda_graphs(self, *args, **kwargs):
            try:
                _prepare_slots(self, slots, modules)
            except Exception as err:  # never into the server
                log.warning("fastverify patch: pre-capture step failed (%s: %s)", type(err).__name__, err)
            return original(self, *args, **kwargs)

        return init_cuda_graphs

    return make


# --- install / uninstall ----------------------------------------------------------------------------


def install(sglang_modules: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None,
            sglang_has_pcie_ipc: bool | None = None, timer: VerifyTimer | None = None) -> PatchReport:
    """Apply the patch in this process, as ``launch`` asked through the environment.

    Parameters
    ----------
    sglang_modules
        Module name → module for the targets (tests pass fakes); default: import them.
    environ
        Default ``os.environ``. Reads ``FASTVERIFY_PATCH`` (must be ``1``), ``FASTVERIFY_BACKEND``,
        ``FASTVERIFY_PROFILE_VERIFY``, ``FASTVERIFY_CUDA_DEVICE_MAX_CONNECTIONS``.
    sglang_has_pcie_ipc
        Whether SGLang has its own PCIe IPC all-reduce (default: looked up).
    timer
        The verify timer to use (tests); default one writing to ``FASTVERIFY_PROFILE_VERIFY``.

    Never raises; every skipped target is logged in one line and listed in the report.
    """
    global _timer
    env = os.environ if environ is None else environ
    report = PatchReport(backend=env.get(ENV_BACKEND, "auto"))
    if env.get(ENV_FLAG) != "1":
        report.active = False
        return report
    with _lock:
        try:
            cdmc = env.get(ENV_CUDA_MAX_CONNECTIONS)
            if cdmc:
                # SGLang's launcher wrote 8; the ranks have not created a CUDA context yet.
                os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = cdmc
                report.settings["CUDA_DEVICE_MAX_CONNECTIONS"] = cdmc

            if report.backend == "pcie-ipc":
                has = sglang_has_pcie_ipc
                if has is None:
                    has = _has_module("sglang.srt.distributed.device_communicators.pcie_ipc_ar", sglang_modules)
                if has:
                    report.skipped[TARGET_ALL_REDUCE.key] = "SGLang's own PCIe IPC all-reduce is used (not patched)"
                else:
                    if _dispatch.factory is None:
                        _dispatch.factory = _default_factory("pcie_ipc")
                    _try_target(report, TARGET_ALL_REDUCE, sglang_modules, _make_all_reduce)

            if report.backend == "fused":
                attn_ar, moe_ar, why = _group_all_reduces(sglang_modules)
                if why is not None:
                    _skip(report, TARGET_FUSED_NORM, why)
                else:
                    if _fused.factory is None:
                        _fused.factory = _default_factory("fused")
                    _try_target(report, TARGET_FUSED_NORM, sglang_modules,
                                _make_fused_norm(attn_ar, moe_ar, sglang_modules))

            slots = [(slot, use_attn) for slot, use_attn, key in
                     ((_dispatch, False, TARGET_ALL_REDUCE.key), (_fused, True, TARGET_FUSED_NORM.key))
                     if key in report.applied and slot.factory is not None]
            if slots:
                _try_target(report, TARGET_PRE_CAPTURE, sglang_modules, _make_pre_capture(slots, sglang_modules))

            prof = env.get(ENV_PROFILE_VERIFY)
            if prof or timer is not None:
                t = timer or _timer or VerifyTimer(prof)
                n = env.get(ENV_PROFILE_VERIFY_STEPS, "")
                tr = VerifyTrace(prof, int(n)) if prof and n.isdigit() and int(n) > 0 else None
                _try_target(report, TARGET_VERIFY, sglang_modules, lambda orig: _make_verify_wrapper(orig, t, tr))
                if TARGET_VERIFY.key in report.applied and _timer is None:
                    _timer = t
                    atexit.register(lambda: t.drain(wait=True))
        except Exception as err:  # never into the server
            log.warning("fastverify patch: stopped early (%s: %s)", type(err).__name__, err)
    log.info(report.line())
    return report


def _has_module(name: str, modules: Mapping[str, Any] | None) -> bool:
    if modules is not None:
        return name in modules
    try:
        import importlib.util

        return importlib.util.find_spec(name) is not None
    except Exception:
        return False


def installed() -> list[str]:
    """``Class.attr`` of every wrapped target, in install order."""
    return [f"{cls.__name__}.{attr}" for cls, attr, _ in _installed]


def uninstall() -> int:
    """Restore every original (latest first) and forget attached backends; returns how many."""
    global _timer
    with _lock:
        n = 0
        while _installed:
            cls, attr, original = _installed.pop()
            setattr(cls, attr, original)
            n += 1
        for slot in (_fused, _dispatch):
            slot.backend, slot.disabled, slot.checked, slot.factory = None, None, False, None
            slot.prepared = False
        if _timer is not None:
            try:
                _timer.drain(wait=True)
            except Exception:
                pass
        _timer = None
    return n
