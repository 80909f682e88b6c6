"""The patch applied inside every SGLang rank (from the plugin entry point or the import hook):
:func:`install` wraps the SGLang functions the chosen backend needs (:mod:`fastverify.patch.targets`
lists them, names as in SGLang 0.5.23) and, before CUDA-graph capture, builds each slot's backend
on SGLang's real TP group and prints the rank's one line (``fastverify patch [TP r]: ...``).

``FASTVERIFY_BACKEND`` holds one registry name (:class:`fastverify.registry.BackendName`) or
``auto``/``off``; ``FASTVERIFY_DEPLOYMENT`` names the deployment record (:mod:`fastverify.deploy`)
whose P2P facts and verify shapes the rank uses. A target that is missing or has other parameters
is skipped with ONE log line and left as it was. :func:`install` never raises; :func:`uninstall`
restores every original; installing twice is a no-op.

Also here, the parts only the installer uses:

* :class:`PatchReport`, what the patch did in one rank, and the one line each TP rank prints from it;
* what the rank step reads of SGLang's model runner before CUDA-graph capture (:func:`capture_rows`,
  :func:`covers`, :func:`verify_max_rows`, :func:`runner_probe`; names as in SGLang 0.5.23
  ``srt/runtime_context.py``, ``srt/model_executor/model_runner.py``);
* the wrappers through which the patch times SGLang's verify forwards
  (:func:`make_verify_wrapper`, with their load, :func:`verify_load`) and reads how many draft
  tokens each request accepted (:func:`make_accept_wrapper`).

Verify forwards: ``tp_worker.TpModelWorker.forward_batch_generation(..., is_verify=...)`` (SGLang
0.5.23) is wrapped; the verify forwards outside a CUDA-graph capture are timed
(:class:`fastverify.patch.verify.VerifyTimer`).

Accepted tokens (``accepted`` in a record): SGLang 0.5.23 computes each request's accept length
after the target's verify forward returns, in ``speculative/eagle_utils.py::eagle_sample`` (its
second result, ``accept_lens``: int32, shape ``(batch,)``, on the forward's device, the bonus
token included), called by ``speculative/eagle_worker_common.py::run_eagle_verify`` (EAGLE,
EAGLE-3, multi-layer EAGLE) and by ``speculative/ngram_worker.py::NGRAMWorker.forward_batch_generation``.
The patch wraps that name in both modules (:func:`make_accept_wrapper`) and hands
``accept_lens`` to :meth:`VerifyTimer.accept`, which attaches it to the step just timed.
``accepted`` is the accepted DRAFT tokens per request, ``accept_lens - 1`` (the bonus token
excluded), so a chain's accept length is ``mean(accepted) + 1``.
"""

from __future__ import annotations

import atexit
import importlib.util
import inspect
import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastverify.deploy import record_from_environ
from fastverify.errors import UserError
from fastverify.patch import counting as C, rank as R
from fastverify.patch.handoff import (
    ENV_BACKEND,
    ENV_CUDA_MAX_CONNECTIONS,
    ENV_FLAG,
    ENV_PROFILE_VERIFY,
    ENV_PROFILE_VERIFY_STEPS,
)
from fastverify.patch.paths import COUNTER
from fastverify.patch.slots import (
    ADD_NORM_SLOT,
    DISPATCH_SLOT,
    FUSED_GROUPS,
    FUSED_MAX_TOKENS,
    FUSED_SLOT,
    SLOTS,
    BackendSlot,
    SlotUse,
    _build_fused,
    _close_fused,
    _fusion_group_why,
    _group_coordinator,
    _make_add_norm_attn,
    _make_add_norm_ffn,
    _make_fused_norm,
    _max_rows_of,
    _slot_for,
    _slot_text,
    attach_add_norm_backend,
    attach_dispatch_backend,
    attach_fused_backend,
    create_together,
    make_all_reduce,
)
from fastverify.patch.targets import (
    ACCEPT_TARGETS,
    MOD_AR_FUSIONS,
    MOD_DISTRIBUTED,
    MOD_LAYERNORM,
    MOD_MODEL_RUNNER,
    MOD_MOE_UTILS,
    MOD_PARALLEL_STATE,
    MOD_RUNTIME_CONTEXT,
    MOD_TP_WORKER,
    TARGET_ADD_NORM_ATTN,
    TARGET_ADD_NORM_FFN,
    TARGET_ALL_REDUCE,
    TARGET_CAPTURE_SHAPE,
    TARGET_FLASHINFER_AR,
    TARGET_FORWARD,
    TARGET_FUSED_NORM,
    TARGET_IN_PLACE,
    TARGET_OUT_PLACE,
    TARGET_PRE_CAPTURE,
    TARGET_PYNCCL_AR,
    TARGET_REPLAY,
    TARGET_VERIFY,
    TARGETS,
    Target,
    check_signature as _check_signature,
    installed_targets as _installed,
    resolve as _resolve,
    unwrap_all as _unwrap_all,
    wrap as _wrap,
)
from fastverify.patch.verify import DRAIN_EVERY, VerifyTimer, VerifyTrace
from fastverify.registry import BackendName, Reach, backend_info

log = logging.getLogger("fastverify.patch")

MOD_ADD_NORM = R.MOD_ADD_NORM
MODES = ("auto", "off")  # FASTVERIFY_BACKEND values that are not backends: SGLang's own choice / nothing
ADD_NORM_KEY = "add_norm"  # the b12x slot in the report (built=, skipped=); its targets are add_norm_ffn/_attn
ADD_NORM_TARGETS = (TARGET_ADD_NORM_FFN, TARGET_ADD_NORM_ATTN)
# The names the add-norm replacement needs from the module it wraps (fusions/allreduce.py imports them)
ADD_NORM_NAMES = ("RMSNorm", "UnreducedOutput")
CHECK_EPS = 1e-6

__all__ = [
    "ADD_NORM_KEY",
    "DRAIN_EVERY",
    "FUSED_MAX_TOKENS",
    "MOD_ADD_NORM",
    "MOD_AR_FUSIONS",
    "MOD_DISTRIBUTED",
    "MOD_LAYERNORM",
    "MOD_MODEL_RUNNER",
    "MOD_MOE_UTILS",
    "MOD_PARALLEL_STATE",
    "MOD_RUNTIME_CONTEXT",
    "MOD_TP_WORKER",
    "PatchReport",
    "TARGETS",
    "Target",
    "VerifyTimer",
    "VerifyTrace",
    "Probe",
    "attach_add_norm_backend",
    "attach_dispatch_backend",
    "attach_fused_backend",
    "capture_rows",
    "covers",
    "install",
    "installed",
    "make_accept_wrapper",
    "make_verify_wrapper",
    "runner_probe",
    "uninstall",
    "verify_load",
    "verify_max_rows",
]


# --- the rank's report -----------------------------------------------------------------------------


@dataclass
class PatchReport:
    """What :func:`fastverify.patch.install.install` (and, later, the rank step before capture) did.

    Attributes
    ----------
    backend : str
        ``FASTVERIFY_BACKEND`` as given.
    applied : list[str]
        Target keys in effect.
    skipped : dict[str, str]
        Key → one-line reason (a target, ``backend``, ``deployment``, ``add_norm``, ...).
    settings : dict[str, str]
        Environment settings applied in-rank.
    built : dict[str, str]
        Slot → what was built (``"gloo: world 2, single node, P2P proven by p2p_check"``).
    counting, uncounted : list[str], dict[str, str]
        Counting targets in effect (:mod:`fastverify.patch.counting`), and those missing with why
        (their part of the path counts is then absent).
    covers : str
        What SGLang's captured graphs in this rank cover (``verify steps up to 48 requests x 6
        tokens (288 rows) in CUDA graphs``), set by the rank step.
    active : bool
        False when ``FASTVERIFY_PATCH`` is not ``1``.
    """

    backend: str
    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)
    built: dict[str, str] = field(default_factory=dict)
    active: bool = True
    counting: list[str] = field(default_factory=list)
    uncounted: dict[str, str] = field(default_factory=dict)
    covers: str = ""

    def line(self, tp: str | None = None) -> str:
        """One line: ``fastverify patch [TP r]: backend=... applied=... built=... skipped=k (why); ...``."""
        parts = [f"backend={self.backend}", "applied=" + (",".join(self.applied) or "none")]
        if self.built:
            parts.append("built=" + "; ".join(f"{k}={v}" for k, v in self.built.items()))
        if self.skipped:
            parts.append("skipped=" + "; ".join(f"{k} ({v})" for k, v in self.skipped.items()))
        if self.counting:
            parts.append("counting=" + ",".join(self.counting))
        if self.uncounted:
            parts.append("uncounted=" + "; ".join(f"{k} ({v})" for k, v in self.uncounted.items()))
        where = f" [TP {tp}]" if tp is not None else ""
        covers = f" covers: {self.covers}" if self.covers else ""
        return f"fastverify patch{where}: " + " ".join(parts) + covers


# --- what the rank step reads of SGLang's model runner ---------------------------------------------


@dataclass
class Probe:
    """What a factory reads of the first tensor (``shape[-1]``, ``device``, ``dtype``), without
    allocating one."""

    shape: tuple[int, ...]
    device: Any
    dtype: Any
    is_cuda: bool = True


def capture_batch_sizes(runner: Any, modules: Mapping[str, Any] | None) -> list[int]:
    """The decode batch sizes SGLang will capture, as far as they can be read before it does
    (0.5.23: ``get_exec().graph.cuda_graph_config.decode.bs``, clamped to the request pool as
    ``get_batch_sizes_to_capture`` does; older: ``server_args.cuda_graph_bs`` / ``cuda_graph_max_bs``)."""
    bs: list[int] = []
    try:
        bs = [
            int(b) for b in (R.module(MOD_RUNTIME_CONTEXT, modules).get_exec().graph.cuda_graph_config.decode.bs or [])
        ]
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


def tokens_per_request(runner: Any) -> int:
    """Rows a request takes in one decode/verify step: the runner's ``decode_num_tokens_per_req()``
    (SGLang 0.5.23: the draft tokens in speculative decoding), else 1."""
    try:
        fn = getattr(runner, "decode_num_tokens_per_req", None)
        return max(1, int(fn())) if callable(fn) else 1
    except Exception:
        return 1


def capture_rows(runner: Any, modules: Mapping[str, Any] | None) -> list[int]:
    """Rows of every captured decode/verify batch: batch size × tokens per request."""
    width = tokens_per_request(runner)
    return sorted({b * width for b in capture_batch_sizes(runner, modules)})


def covers(runner: Any, modules: Mapping[str, Any] | None) -> str:
    """What the captured graphs cover, from SGLang's own config in this rank:
    ``verify steps up to 48 requests x 6 tokens (288 rows)``, or that every step runs eagerly."""
    bs = capture_batch_sizes(runner, modules)
    width = tokens_per_request(runner)
    what = "verify steps" if width > 1 else "decode steps"
    if not bs:
        return f"{what} eager (no decode CUDA graph captured), {width} tokens a request"
    return f"{what} up to {max(bs)} requests x {width} tokens ({max(bs) * width} rows) in CUDA graphs"


def verify_max_rows(runner: Any, modules: Mapping[str, Any] | None, record: Any) -> int | None:
    """The widest verify all-reduce (rows): ``record``'s ``max_batch × draft_tokens`` (a
    :class:`~fastverify.deploy.DeploymentRecord`, or None), else SGLang's widest captured decode;
    None when neither is known."""
    if record is not None:
        return record.shapes.max_rows
    rows = capture_rows(runner, modules)
    return rows[-1] if rows else None


def runner_probe(runner: Any) -> tuple[int, Any, Any]:
    """(hidden, device, dtype) of the target model runner."""
    hidden = int(runner.model_config.hidden_size)
    dtype = getattr(runner, "dtype", None)
    device: Any = getattr(runner, "device", "cuda")
    try:
        import torch

        if torch.cuda.is_available() and str(device).startswith("cuda"):
            device = torch.device("cuda", torch.cuda.current_device())
        elif str(device) == "cuda" and isinstance(getattr(runner, "gpu_id", None), int):
            device = f"cuda:{runner.gpu_id}"
    except Exception:
        pass
    return hidden, device, dtype


# --- the verify wrappers ---------------------------------------------------------------------------


_BATCH_ARGS = ("forward_batch", "model_worker_batch", "batch")
"""Parameters of ``forward_batch_generation`` that may hold the verify batch, in the order read:
SGLang 0.5.23's EAGLE verify passes ``batch=None, forward_batch=<ForwardBatch>``; earlier
releases passed a ``ModelWorkerBatch`` (first parameter)."""


def _int(value: Any) -> int | None:
    """``value`` when it is a plain ``int`` >= 0 (never a tensor: ``int(t)`` of a CUDA tensor
    would sync the host), else None."""
    return value if type(value) is int and value >= 0 else None


def _rows(tensor: Any) -> int | None:
    """Rows of a 1-D tensor from its ``shape`` (host metadata: no sync), else None."""
    shape = getattr(tensor, "shape", None)
    return _int(shape[0]) if shape is not None and len(shape) == 1 else None


def verify_load(fb: Any) -> tuple[int | None, int | None]:
    """``(batch, tokens)`` of a verify forward's batch object, each None where it cannot be read.

    Parameters
    ----------
    fb : ForwardBatch, ModelWorkerBatch, ScheduleBatch or anything
        ``batch`` is ``fb.batch_size`` (an int field of ``ForwardBatch``; called where it is a
        method, ``ScheduleBatch.batch_size()`` = ``len(reqs)``), else ``fb.seq_lens.shape[0]``;
        ``tokens`` is ``fb.input_ids.shape[0]`` (the flat draft tokens of the verify:
        batch × ``spec_info.draft_token_num``), else ``batch * fb.spec_info.draft_token_num``.

    Never reads a tensor's values (no ``.item()``, ``.tolist()``: no GPU sync) and never raises.
    """
    try:
        size = getattr(fb, "batch_size", None)
        batch = _int(size() if callable(size) else size)
        if batch is None:
            batch = _rows(getattr(fb, "seq_lens", None))
        tokens = _rows(getattr(fb, "input_ids", None))
        if tokens is None and batch is not None:
            per = _int(getattr(getattr(fb, "spec_info", None), "draft_token_num", None))
            tokens = batch * per if per is not None else None
        return batch, tokens
    except Exception:  # a record without its load, never a broken forward
        return None, None


def make_verify_wrapper(original: Callable, timer: VerifyTimer, trace: VerifyTrace | None = None) -> Callable:
    """Wrap SGLang's ``forward_batch_generation``: a verify forward outside a CUDA-graph capture is
    timed by ``timer`` with its load (:func:`verify_load`, read before the forward), the all-reduce
    paths it took, and (``trace`` active) traced; anything else runs unchanged."""
    sig = inspect.signature(original)
    names = list(sig.parameters)
    pos = names.index("is_verify") - 1 if "is_verify" in names else -1  # minus self
    batch_pos = [(n, names.index(n) - 1) for n in _BATCH_ARGS if n in names]

    def load_of(args: tuple, kwargs: dict) -> tuple[int | None, int | None]:
        for name, i in batch_pos:
            fb = kwargs[name] if name in kwargs else (args[i] if 0 <= i < len(args) else None)
            if fb is not None:
                return verify_load(fb)
        return None, None

    def forward_batch_generation(self, *args, **kwargs):
        if "is_verify" in kwargs:
            is_verify = kwargs["is_verify"]
        else:
            is_verify = 0 <= pos < len(args) and args[pos]
        if not is_verify or R.is_capturing():
            return original(self, *args, **kwargs)
        batch, tokens = load_of(args, kwargs)  # before the forward, which may change the batch
        tracing = trace is not None and trace.active
        if tracing:
            trace.begin()
        start = timer.start()
        try:
            out = original(self, *args, **kwargs)
        finally:
            timer.stop(start, COUNTER.take(), batch=batch, tokens=tokens)
            if tracing:
                trace.end()
        return out

    return forward_batch_generation


def make_accept_wrapper(original: Callable, timer: VerifyTimer) -> Callable:
    """Wrap SGLang's ``eagle_sample(verify_input, batch, logits_output, ...)`` (as bound in
    ``speculative/eagle_worker_common.py`` and ``speculative/ngram_worker.py``): its result is
    unchanged; its ``accept_lens`` (second item) goes to :meth:`VerifyTimer.accept`. Never raises
    into the server; a failed read leaves the record without ``accepted``."""

    def eagle_sample(*args, **kwargs):
        out = original(*args, **kwargs)
        if timer._awaiting is not None and not R.is_capturing():
            try:
                timer.accept(out[1])
            except Exception as err:
                log.debug("fastverify patch: accepted tokens not read: %s: %s", type(err).__name__, err)
        return out

    return eagle_sample


# --- state ------------------------------------------------------------------------------------------

_lock = threading.Lock()
_timer: VerifyTimer | None = None
_report: PatchReport | None = None
_record: Any = None  # the DeploymentRecord of this rank, or None
_rank_step_done = False
_line_due: str | None = None  # the TP rank whose line waits for SGLang's start-up checks


def default_factory(slot: BackendSlot, modules: Mapping[str, Any] | None = None) -> Callable[[Any, Any], Any]:
    """Build the slot's backend (gloo on CPU) from SGLang's coordinator and the record
    (:func:`rank.make_for_rank`). The workspace is sized from the record; without one, from the
    widest captured decode (the ``Probe`` of the step before capture), never from the first live
    batch."""

    def make(coordinator: Any, x: Any) -> Any:
        rows = int(x.shape[0]) if isinstance(x, Probe) else None
        be, ctx = R.make_for_rank(slot.kind, coordinator, x, record=_record, rows=rows, modules=modules)
        slot.context = ctx
        return be

    return make


def _skip(report: PatchReport, target: Target, reason: str) -> None:
    report.skipped[target.key] = reason
    log.warning("fastverify patch: skipped %s: %s; SGLang's own code runs unchanged", target.where, reason)


def _wrap_target(target: Target, modules: Mapping[str, Any] | None, make: Callable[[Any], Any]) -> str | None:
    """Resolve ``target``, check its signature and wrap it with ``make``; None when wrapped, else
    why not (one phrase). Never raises."""
    try:
        cls, fn, why = _resolve(target, modules)
        why = why or _check_signature(fn, target)
        if why is None:
            _wrap(cls, target.attr, make)
        return why
    except Exception as err:  # never into the server
        return f"{type(err).__name__}: {err}"


def _try_target(
    report: PatchReport, target: Target, modules: Mapping[str, Any] | None, make: Callable[[Any], Any]
) -> None:
    why = _wrap_target(target, modules, make)
    if why is not None:
        _skip(report, target, why)
    else:
        report.applied.append(target.key)


# --- the rank step before CUDA-graph capture --------------------------------------------------------


def _unapply_use(report: PatchReport, use: SlotUse, reason: str) -> None:
    """Take every target of ``use`` out of ``applied``; one ``skipped`` entry under its key."""
    for k in use.targets:
        if k in report.applied:
            report.applied.remove(k)
    report.skipped[use.key] = reason


def _prepare_slots(runner: Any, slots: list[SlotUse], modules: Mapping[str, Any] | None) -> None:
    """The rank step (target runner, once): decide whether SGLang reaches each slot's target,
    build and prepare the backend on every rank or none (the b12x slot: and check its first
    result), and print this rank's line."""
    global _rank_step_done
    if getattr(runner, "is_draft_worker", False) or _rank_step_done:
        return  # the target runner's hidden size sizes the workspaces
    _rank_step_done = True
    report = _report or PatchReport(backend="?")
    tp_coord = _group_coordinator(modules, False)
    try:
        report.covers = covers(runner, modules)
    except Exception as err:  # never into the server
        report.covers = f"unknown ({type(err).__name__})"
    for use in slots:
        slot = use.slot
        if slot.disabled is not None or slot.factory is None or slot.backend is not None:
            continue
        try:
            hidden, device, dtype = runner_probe(runner)
            max_rows = verify_max_rows(runner, modules, _record)
            reach = None
            if slot is FUSED_SLOT:
                reach = R.fused_norm_reach(modules, max_rows or 1, R.this_sm(), kind=slot.kind)
            elif slot is ADD_NORM_SLOT:
                reach = R.add_norm_reach(modules, max_rows or 1, R.platform_sm(modules), kind=slot.kind)
            if reach is not None and not reach[0]:
                _unapply_use(report, use, reach[1])
                slot.disabled = reach[1]  # the same published config and GPU on every rank: no vote needed
                continue
            rows = [r for r in capture_rows(runner, modules) if max_rows is None or r <= max_rows]
            shapes = [(r, hidden) for r in rows] or ([(max_rows, hidden)] if max_rows else [])
            if slot is FUSED_SLOT:  # one backend per group the fused calls are owed to
                built, failed = _build_fused(modules, Probe((max_rows or 1, hidden), device, dtype), shapes)
                if built is None:
                    _unapply_use(report, use, f"backend not built: {failed}")
                else:
                    report.built[use.key] = built + (f" (not built on {failed})" if failed else "")
                continue
            coord = _group_coordinator(modules, use.use_attn)
            check = None
            if slot is ADD_NORM_SLOT:
                attn = _group_coordinator(modules, True)
                slot.ranks = list(getattr(coord, "ranks", None) or [])
                slot.attn_is_tp = attn is coord or list(getattr(attn, "ranks", None) or []) == slot.ranks
                cap = _max_rows_of(slot)
                fits = [r for r, _ in shapes if r <= cap]
                if shapes and not fits:  # it would never take a step: say so, build nothing
                    why = (
                        f"every captured verify step is wider than the {cap} rows {slot.kind.value} takes "
                        f"(smallest {min(r for r, _ in shapes)} rows): SGLang's all-reduce + norm runs them all"
                    )
                    _unapply_use(report, use, why)
                    slot.disabled = why
                    continue
                check = R.first_result_check(
                    coord, max(fits) if fits else min(max_rows or 1, cap), hidden, device, dtype, eps=CHECK_EPS
                )
            be = create_together(slot, coord, Probe((max_rows or 1, hidden), device, dtype), shapes, check)
            if be is None:
                _unapply_use(report, use, f"backend not built: {slot.disabled}")
            else:
                report.built[use.key] = _slot_text(slot)
        except Exception as err:  # never into the server; a failure before the votes is local and logged
            log.warning(
                "fastverify patch: %s backend step before CUDA-graph capture failed (%s: %s)",
                slot.kind.value,
                type(err).__name__,
                err,
            )
            _unapply_use(report, use, f"{type(err).__name__}: {err}")
    global _line_due
    _line_due = R.tp_rank(tp_coord, runner)  # printed once SGLang's own start-up checks ran


def _after_start_up(runner: Any, slots: list[SlotUse], modules: Mapping[str, Any] | None) -> None:
    """After SGLang's ``init_cuda_graphs`` (its warm-up ran the FlashInfer workspace preflight,
    ``base_runner.py::_pre_initialize_flashinfer_allreduce_workspace``, which votes across TP and
    can turn the fusion off): the fused slot's reach is asked again, and where SGLang will no
    longer call ``forward_with_allreduce_fusion`` the slot is taken out of ``applied`` (closed on
    every rank: SGLang's vote gave all of them the same answer). Then the rank's line."""
    global _line_due
    if _line_due is None:
        return
    report = _report or PatchReport(backend="?")
    for use in slots:
        if use.slot is not FUSED_SLOT or not any(k in report.applied for k in use.targets):
            continue
        ok, why = R.fused_norm_reach(
            modules, verify_max_rows(runner, modules, _record) or 1, R.this_sm(), kind=FUSED_SLOT.kind
        )
        if not ok:
            _unapply_use(report, use, f"after SGLang's start-up checks: {why}")
            report.built.pop(use.key, None)
            _close_fused(why)
    tp, _line_due = _line_due, None
    R.emit(report.line(tp))


def _make_pre_capture(slots: list[SlotUse], modules: Mapping[str, Any] | None) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def init_cuda_graphs(self, *args, **kwargs):
            try:
                C.wrap_graph_backends(modules)  # a graph backend defined after install: counted too
                _prepare_slots(self, slots, modules)
            except Exception as err:  # never into the server
                log.warning("fastverify patch: pre-capture step failed (%s: %s)", type(err).__name__, err)
            try:
                return original(self, *args, **kwargs)
            finally:
                try:
                    _after_start_up(self, slots, modules)
                except Exception as err:  # never into the server
                    log.warning("fastverify patch: post-capture step failed (%s: %s)", type(err).__name__, err)

        return init_cuda_graphs

    return make


# --- install / uninstall ----------------------------------------------------------------------------


def install(
    sglang_modules: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    sglang_switch_modules: Collection[str] | None = None,
    timer: VerifyTimer | None = None,
) -> PatchReport:
    """Apply the patch in this process, as ``launch`` asked through the environment.

    Parameters
    ----------
    sglang_modules
        Module name → module for the targets (tests pass fakes); default: import them.
    environ
        Default ``os.environ``. Reads ``FASTVERIFY_PATCH`` (must be ``1``), ``FASTVERIFY_BACKEND``
        (a registry name, ``auto`` or ``off``), ``FASTVERIFY_DEPLOYMENT``, ``FASTVERIFY_PROFILE_VERIFY``,
        ``FASTVERIFY_CUDA_DEVICE_MAX_CONNECTIONS``.
    sglang_switch_modules
        The registry's ``sglang_switch_module`` names this SGLang has (tests pass them); default:
        the chosen backend's switch module looked up in ``sglang_modules`` or imported.
    timer
        The verify timer to use (tests); default one writing to ``FASTVERIFY_PROFILE_VERIFY``.

    Returns
    -------
    PatchReport
        The same object the rank step completes (reach, build) and prints before capture.

    Never raises; every skipped target is logged in one line and listed in the report.
    """
    global _report, _rank_step_done
    env = os.environ if environ is None else environ
    report = PatchReport(backend=env.get(ENV_BACKEND, "auto"))
    if env.get(ENV_FLAG) != "1":
        report.active = False
        return report
    with _lock:
        _report, _rank_step_done = report, False
        try:
            _apply_settings(report, env)
            _install_backend(report, sglang_modules, sglang_switch_modules)
            _install_counting(report, sglang_modules)
            uses = (
                SlotUse(DISPATCH_SLOT, False, TARGET_ALL_REDUCE.key, (TARGET_ALL_REDUCE.key,)),
                SlotUse(FUSED_SLOT, True, TARGET_FUSED_NORM.key, (TARGET_FUSED_NORM.key,)),
                # built on the TP group: the attention input's owed sum is over TP, the FFN
                # input's over attention TP, taken only when that is the TP group
                SlotUse(ADD_NORM_SLOT, False, ADD_NORM_KEY, tuple(t.key for t in ADD_NORM_TARGETS)),
            )
            slots = [u for u in uses if any(k in report.applied for k in u.targets) and u.slot.factory is not None]
            # Always: the rank step prints the line, and builds the slots when there are any.
            _try_target(report, TARGET_PRE_CAPTURE, sglang_modules, _make_pre_capture(slots, sglang_modules))
            _install_timer(report, env, sglang_modules, timer)
        except Exception as err:  # never into the server
            log.warning("fastverify patch: stopped early (%s: %s)", type(err).__name__, err)
    log.debug(report.line())  # the rank is not known yet; the rank step prints the line that counts
    return report


def _apply_settings(report: PatchReport, env: Mapping[str, str]) -> None:
    """``CUDA_DEVICE_MAX_CONNECTIONS`` restored in this process, and this rank's deployment record
    read (a bad one is skipped in the report, never raised)."""
    global _record
    cdmc = env.get(ENV_CUDA_MAX_CONNECTIONS)
    if cdmc:
        # SGLang's launcher wrote 8; the ranks have not created a CUDA context yet.
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = cdmc
        report.settings["CUDA_DEVICE_MAX_CONNECTIONS"] = cdmc
    try:
        _record = record_from_environ(dict(env))
    except UserError as err:
        _record = None
        report.skipped["deployment"] = str(err)


def _install_backend(
    report: PatchReport, modules: Mapping[str, Any] | None, switch_modules: Collection[str] | None
) -> None:
    """Wrap the targets of the slot ``FASTVERIFY_BACKEND`` names; none for ``auto``/``off``, an
    unknown name, or a backend SGLang switches on itself (its own all-reduce is then used)."""
    kind = None
    if report.backend not in MODES:
        try:
            kind = BackendName(report.backend)
        except ValueError:
            report.skipped["backend"] = (
                f"unknown FASTVERIFY_BACKEND {report.backend!r}; known: "
                f"{', '.join([b.value for b in BackendName] + list(MODES))}"
            )
    info = backend_info(kind) if kind is not None else None
    has_switch = False
    if info is not None and info.reach is Reach.sglang_switch:
        module = info.sglang_switch_module or ""
        has_switch = module in switch_modules if switch_modules is not None else _has_module(module, modules)
        if has_switch:
            report.skipped[TARGET_ALL_REDUCE.key] = f"SGLang's own {info.name.value} all-reduce is used (not patched)"
    slot = _slot_for(info, has_switch) if info is not None else None
    if slot is not None:
        slot.kind = info.name
        if slot.factory is None:
            slot.factory = default_factory(slot, modules=modules)
        _install_slot(report, slot, modules)


def _install_timer(
    report: PatchReport, env: Mapping[str, str], modules: Mapping[str, Any] | None, timer: VerifyTimer | None
) -> None:
    """With ``FASTVERIFY_PROFILE_VERIFY`` (or a given ``timer``): time the verify forwards (and
    trace ``FASTVERIFY_PROFILE_VERIFY_STEPS`` of them), drained at exit, with accepted tokens."""
    global _timer
    prof = env.get(ENV_PROFILE_VERIFY)
    if prof or timer is not None:
        t = timer or _timer or VerifyTimer(prof)
        n = env.get(ENV_PROFILE_VERIFY_STEPS, "")
        tr = VerifyTrace(prof, int(n)) if prof and n.isdigit() and int(n) > 0 else None
        _try_target(report, TARGET_VERIFY, modules, lambda orig: make_verify_wrapper(orig, t, tr))
        if TARGET_VERIFY.key in report.applied and _timer is None:
            _timer = t
            atexit.register(lambda: t.drain(wait=True))
        if TARGET_VERIFY.key in report.applied:
            _install_accepted(t, modules)


def _install_accepted(timer: VerifyTimer, modules: Mapping[str, Any] | None) -> None:
    """Wrap SGLang's accept sampler where the verifying workers bind it, so the timer's records carry
    ``accepted`` (:func:`make_accept_wrapper`); one info line per target
    not found (the records then go without it)."""
    for target in ACCEPT_TARGETS:
        why = _wrap_target(target, modules, lambda orig: make_accept_wrapper(orig, timer))
        if why is None:
            timer.expect_accepted = True
        else:
            log.info("fastverify patch: accepted tokens not recorded through %s: %s", target.where, why)


def _install_slot(report: PatchReport, slot: BackendSlot, modules: Mapping[str, Any] | None) -> None:
    """Wrap the targets of ``slot``'s reach (none of it depends on which backend fills it)."""
    if slot is DISPATCH_SLOT:
        _try_target(report, TARGET_ALL_REDUCE, modules, lambda orig: make_all_reduce(orig, modules))
    elif slot is FUSED_SLOT:
        why = _fusion_group_why(modules)
        if why is not None:
            _skip(report, TARGET_FUSED_NORM, why)
        else:
            _try_target(report, TARGET_FUSED_NORM, modules, _make_fused_norm(modules))
    elif slot is ADD_NORM_SLOT:
        mod = R.module(MOD_AR_FUSIONS, modules)
        lacks = [n for n in ADD_NORM_NAMES if mod is not None and n not in vars(mod)]
        if lacks:
            for t in ADD_NORM_TARGETS:
                _skip(report, t, f"{MOD_AR_FUSIONS} has no {', '.join(lacks)}")
        else:
            names = vars(mod) if mod is not None else {}
            _try_target(report, TARGET_ADD_NORM_FFN, modules, _make_add_norm_ffn(names))
            _try_target(report, TARGET_ADD_NORM_ATTN, modules, _make_add_norm_attn(names))


def _install_counting(report: PatchReport, modules: Mapping[str, Any] | None) -> None:
    """The all-reduce wrapper (dispatch slot + count) and the counting targets
    (:mod:`fastverify.patch.counting`); the rank's paths line after its first verify forward."""
    todo = (
        []
        if TARGET_ALL_REDUCE.key in report.applied
        else [  # the dispatch wrapper counts too
            (TARGET_ALL_REDUCE, lambda orig: make_all_reduce(orig, modules))
        ]
    )
    todo += [
        (TARGET_OUT_PLACE, C.make_out_place),
        (TARGET_IN_PLACE, C.make_in_place),
        (TARGET_FLASHINFER_AR, C.make_flashinfer),
        (TARGET_PYNCCL_AR, C.make_pynccl),
        (TARGET_FORWARD, C.make_forward),
    ]
    for target, make in todo:
        key = "count_all_reduce" if target is TARGET_ALL_REDUCE else target.key
        why = _wrap_target(target, modules, make)
        if why is None:
            report.counting.append(key)
        else:
            report.uncounted[key] = why
    graphs, why = C.wrap_graph_backends(modules)  # by rule: every backend class that captures/replays
    for t in (TARGET_CAPTURE_SHAPE, TARGET_REPLAY):
        if any(g.endswith(f".{t.attr}") for g in graphs):
            report.counting.append(t.key)
        else:
            report.uncounted[t.key] = why or f"no subclass of {t.cls} defines {t.attr}"
    backend = report.backend if report.backend in {b.value for b in BackendName} else None

    def line(counts: dict) -> None:
        R.emit(C.paths_line(R.tp_rank(_group_coordinator(modules, False)), counts, backend))

    C.on_first_verify(line)


def _has_module(name: str, modules: Mapping[str, Any] | None) -> bool:
    if modules is not None:
        return name in modules
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:
        return False


def installed() -> list[str]:
    """``Class.attr`` (``module.attr`` for a module-level target, the module's last name) of every
    wrapped target, in install order."""
    return [f"{owner.__name__.rsplit('.', 1)[-1]}.{attr}" for owner, attr, _ in _installed]


def uninstall() -> int:
    """Restore every original (latest first) and forget attached backends; returns how many."""
    global _timer, _report, _record, _rank_step_done, _line_due
    with _lock:
        n = _unwrap_all()
        for slot in SLOTS:
            slot.backend, slot.disabled, slot.checked, slot.factory, slot.context = None, None, False, None, None
            slot.prepared, slot.ranks, slot.attn_is_tp = False, None, False
        FUSED_GROUPS.clear()
        if _timer is not None:
            try:
                _timer.drain(wait=True)
            except Exception:
                pass
        _timer, _report, _record, _rank_step_done = None, None, None, False
        _line_due = None
        COUNTER.reset()
    return n
