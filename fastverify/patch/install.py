"""The patch applied inside every SGLang rank (from the plugin entry point or the import hook):
:func:`install` wraps the SGLang functions the chosen backend needs (:mod:`fastverify.patch.targets`
lists them, names as in SGLang 0.5.23) and, before CUDA-graph capture, builds each slot's backend
on SGLang's real TP group and prints the rank's one line (``fastverify patch [TP r]: ...``).

``FASTVERIFY_BACKEND`` holds one registry name (:class:`fastverify.registry.BackendName`) or
``auto``/``off``; ``FASTVERIFY_DEPLOYMENT`` names the deployment record (:mod:`fastverify.deploy`)
whose P2P facts and verify shapes the rank uses. A target that is missing or has other parameters
is skipped with ONE log line and left as it was. :func:`install` never raises; :func:`uninstall`
restores every original; installing twice is a no-op.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from fastverify.patch import (ENV_BACKEND, ENV_CUDA_MAX_CONNECTIONS, ENV_FLAG, ENV_PROFILE_VERIFY,
                              ENV_PROFILE_VERIFY_STEPS)
from fastverify.patch import capture_shapes as S
from fastverify.patch import counting as C
from fastverify.patch import rank as R
from fastverify.patch.paths import COUNTER
from fastverify.patch.rank_report import PatchReport
from fastverify.patch.targets import (MOD_AR_FUSIONS, MOD_DISTRIBUTED, MOD_LAYERNORM, MOD_MODEL_RUNNER,
                                      MOD_MOE_UTILS, MOD_PARALLEL_STATE, MOD_RUNTIME_CONTEXT, MOD_TP_WORKER,
                                      TARGET_ADD_NORM_ATTN, TARGET_ADD_NORM_FFN, TARGET_ALL_REDUCE,
                                      TARGET_CAPTURE_SHAPE, TARGET_FLASHINFER_AR, TARGET_FORWARD,
                                      TARGET_FUSED_NORM, TARGET_IN_PLACE, TARGET_PYNCCL_AR,
                                      TARGET_OUT_PLACE, TARGET_PRE_CAPTURE, TARGET_REPLAY, TARGET_VERIFY, TARGETS,
                                      Target)
from fastverify.patch.targets import check_signature as _check_signature
from fastverify.patch.targets import installed_targets as _installed
from fastverify.patch.targets import resolve as _resolve
from fastverify.patch.targets import unwrap_all as _unwrap_all
from fastverify.patch.targets import wrap as _wrap
from fastverify.patch.targets import ACCEPT_TARGETS
from fastverify.patch.verify import DRAIN_EVERY, VerifyTimer
from fastverify.patch.verify import _WallEvent  # noqa: F401 - re-exported for callers of install._WallEvent
from fastverify.patch.verify_trace import VerifyTrace
from fastverify.patch.verify_wrap import _make_accept_wrapper, _make_verify_wrapper
from fastverify.patch.slots import (FUSED_MAX_TOKENS, _SLOTS, _BackendSlot, _SlotUse, _abandoned, _add_norm,  # noqa: F401
                                    _close_quietly, _create_together, _disable, _dispatch, _fused,
                                    _group_coordinator, _make_add_norm_attn, _make_add_norm_ffn,
                                    _make_all_reduce, _max_rows_of, _slot_for, _slot_text,
                                    attach_add_norm_backend, attach_dispatch_backend)
from fastverify.patch.fused_slot import (FUSED_SGLANG_FALLBACK, _build_fused, _close_fused, _fused_groups,  # noqa: F401
                                         _fused_slot, _fusion_group, _fusion_group_why, _make_fused_norm,
                                         attach_fused_backend)
from fastverify.registry import BackendName, Reach, backend_info

log = logging.getLogger("fastverify.patch")

MOD_ADD_NORM = R.MOD_ADD_NORM
MODES = ("auto", "off")  # FASTVERIFY_BACKEND values that are not backends: SGLang's own choice / nothing
ADD_NORM_KEY = "add_norm"  # the b12x slot in the report (built=, skipped=); its targets are add_norm_ffn/_attn
ADD_NORM_TARGETS = (TARGET_ADD_NORM_FFN, TARGET_ADD_NORM_ATTN)
# The names the add-norm replacement needs from the module it wraps (fusions/allreduce.py imports them)
ADD_NORM_NAMES = ("RMSNorm", "UnreducedOutput")
CHECK_EPS = 1e-6

__all__ = ["ADD_NORM_KEY", "DRAIN_EVERY", "FUSED_MAX_TOKENS", "MOD_ADD_NORM", "MOD_AR_FUSIONS", "MOD_DISTRIBUTED",
           "MOD_LAYERNORM", "MOD_MODEL_RUNNER", "MOD_MOE_UTILS", "MOD_PARALLEL_STATE", "MOD_RUNTIME_CONTEXT",
           "MOD_TP_WORKER", "PatchReport", "TARGETS", "Target", "VerifyTimer", "VerifyTrace",
           "attach_add_norm_backend", "attach_dispatch_backend", "attach_fused_backend", "install", "installed",
           "uninstall"]


# --- state ------------------------------------------------------------------------------------------

_lock = threading.Lock()
_timer: VerifyTimer | None = None
_report: PatchReport | None = None
_record: Any = None  # the DeploymentRecord of this rank, or None
_rank_step_done = False
_line_due: str | None = None  # the TP rank whose line waits for SGLang's start-up checks


def _default_factory(slot: _BackendSlot, modules: Mapping[str, Any] | None = None) -> Callable[[Any, Any], Any]:
    """Build the slot's backend (gloo on CPU) from SGLang's coordinator and the record
    (:func:`rank.make_for_rank`). The workspace is sized from the record; without one, from the
    widest captured decode (the ``Probe`` of the step before capture), never from the first live
    batch."""

    def make(coordinator: Any, x: Any) -> Any:
        rows = int(x.shape[0]) if isinstance(x, S.Probe) else None
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


def _try_target(report: PatchReport, target: Target, modules: Mapping[str, Any] | None,
                make: Callable[[Any], Any]) -> None:
    why = _wrap_target(target, modules, make)
    if why is not None:
        _skip(report, target, why)
    else:
        report.applied.append(target.key)


# --- the rank step before CUDA-graph capture --------------------------------------------------------


def _unapply_use(report: PatchReport, use: _SlotUse, reason: str) -> None:
    """Take every target of ``use`` out of ``applied``; one ``skipped`` entry under its key."""
    for k in use.targets:
        if k in report.applied:
            report.applied.remove(k)
    report.skipped[use.key] = reason


def _prepare_slots(runner: Any, slots: list[_SlotUse], modules: Mapping[str, Any] | None) -> None:
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
        report.covers = S.covers(runner, modules)
    except Exception as err:  # never into the server
        report.covers = f"unknown ({type(err).__name__})"
    for use in slots:
        slot = use.slot
        if slot.disabled is not None or slot.factory is None or slot.backend is not None:
            continue
        try:
            hidden, device, dtype = S.runner_probe(runner)
            max_rows = S.max_rows(runner, modules, _record)
            reach = None
            if slot is _fused:
                reach = R.fused_norm_reach(modules, max_rows or 1, R.this_sm(), kind=slot.kind)
            elif slot is _add_norm:
                reach = R.add_norm_reach(modules, max_rows or 1, R.platform_sm(modules), kind=slot.kind)
            if reach is not None and not reach[0]:
                _unapply_use(report, use, reach[1])
                slot.disabled = reach[1]  # the same published config and GPU on every rank: no vote needed
                continue
            rows = [r for r in S.capture_rows(runner, modules) if max_rows is None or r <= max_rows]
            shapes = [(r, hidden) for r in rows] or ([(max_rows, hidden)] if max_rows else [])
            if slot is _fused:  # one backend per group the fused calls are owed to
                built, failed = _build_fused(modules, S.Probe((max_rows or 1, hidden), device, dtype), shapes)
                if built is None:
                    _unapply_use(report, use, f"backend not built: {failed}")
                else:
                    report.built[use.key] = built + (f" (not built on {failed})" if failed else "")
                continue
            coord = _group_coordinator(modules, use.use_attn)
            check = None
            if slot is _add_norm:
                attn = _group_coordinator(modules, True)
                slot.ranks = list(getattr(coord, "ranks", None) or [])
                slot.attn_is_tp = attn is coord or list(getattr(attn, "ranks", None) or []) == slot.ranks
                cap = _max_rows_of(slot)
                fits = [r for r, _ in shapes if r <= cap]
                if shapes and not fits:  # it would never take a step: say so, build nothing
                    why = (f"every captured verify step is wider than the {cap} rows {slot.kind.value} takes "
                           f"(smallest {min(r for r, _ in shapes)} rows): SGLang's all-reduce + norm runs them all")
                    _unapply_use(report, use, why)
                    slot.disabled = why
                    continue
                check = R.first_result_check(coord, max(fits) if fits else min(max_rows or 1, cap),
                                           hidden, device, dtype, eps=CHECK_EPS)
            be = _create_together(slot, coord, S.Probe((max_rows or 1, hidden), device, dtype), shapes, check)
            if be is None:
                _unapply_use(report, use, f"backend not built: {slot.disabled}")
            else:
                report.built[use.key] = _slot_text(slot)
        except Exception as err:  # never into the server; a failure before the votes is local and logged
            log.warning("fastverify patch: %s backend step before CUDA-graph capture failed (%s: %s)",
                        slot.kind.value, type(err).__name__, err)
            _unapply_use(report, use, f"{type(err).__name__}: {err}")
    global _line_due
    _line_due = R.tp_rank(tp_coord, runner)  # printed once SGLang's own start-up checks ran


def _after_start_up(runner: Any, slots: list[_SlotUse], modules: Mapping[str, Any] | None) -> None:
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
        if use.slot is not _fused or not any(k in report.applied for k in use.targets):
            continue
        ok, why = R.fused_norm_reach(modules, S.max_rows(runner, modules, _record) or 1, R.this_sm(), kind=_fused.kind)
        if not ok:
            _unapply_use(report, use, f"after SGLang's start-up checks: {why}")
            report.built.pop(use.key, None)
            _close_fused(why)
    tp, _line_due = _line_due, None
    R.emit(report.line(tp))


def _make_pre_capture(slots: list[_SlotUse], modules: Mapping[str, Any] | None) -> Callable[[Callable], Callable]:
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


def install(sglang_modules: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None,
            sglang_has_pcie_ipc: bool | None = None, timer: VerifyTimer | None = None) -> PatchReport:
    """Apply the patch in this process, as ``launch`` asked through the environment.

    Parameters
    ----------
    sglang_modules
        Module name → module for the targets (tests pass fakes); default: import them.
    environ
        Default ``os.environ``. Reads ``FASTVERIFY_PATCH`` (must be ``1``), ``FASTVERIFY_BACKEND``
        (a registry name, ``auto`` or ``off``), ``FASTVERIFY_DEPLOYMENT``, ``FASTVERIFY_PROFILE_VERIFY``,
        ``FASTVERIFY_CUDA_DEVICE_MAX_CONNECTIONS``.
    sglang_has_pcie_ipc
        Whether SGLang has its own PCIe IPC all-reduce (default: looked up).
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
            _install_backend(report, sglang_modules, sglang_has_pcie_ipc)
            _install_counting(report, sglang_modules)
            uses = (_SlotUse(_dispatch, False, TARGET_ALL_REDUCE.key, (TARGET_ALL_REDUCE.key,)),
                    _SlotUse(_fused, True, TARGET_FUSED_NORM.key, (TARGET_FUSED_NORM.key,)),
                    # built on the TP group: the attention input's owed sum is over TP, the FFN
                    # input's over attention TP, taken only when that is the TP group
                    _SlotUse(_add_norm, False, ADD_NORM_KEY, tuple(t.key for t in ADD_NORM_TARGETS)))
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
    from fastverify.deploy import record_from_environ
    from fastverify.errors import UserError

    try:
        _record = record_from_environ(dict(env))
    except UserError as err:
        _record = None
        report.skipped["deployment"] = str(err)


def _install_backend(report: PatchReport, modules: Mapping[str, Any] | None, sglang_has_pcie_ipc: bool | None) -> None:
    """Wrap the targets of the slot ``FASTVERIFY_BACKEND`` names; none for ``auto``/``off``, an
    unknown name, or a backend SGLang switches on itself (its own all-reduce is then used)."""
    kind = None
    if report.backend not in MODES:
        try:
            kind = BackendName(report.backend)
        except ValueError:
            report.skipped["backend"] = (f"unknown FASTVERIFY_BACKEND {report.backend!r}; known: "
                                         f"{', '.join([b.value for b in BackendName] + list(MODES))}")
    info = backend_info(kind) if kind is not None else None
    has_switch = False
    if info is not None and info.reach is Reach.sglang_switch:
        has_switch = sglang_has_pcie_ipc if sglang_has_pcie_ipc is not None else \
            _has_module(info.sglang_switch_module or "", modules)
        if has_switch:
            report.skipped[TARGET_ALL_REDUCE.key] = (f"SGLang's own {info.name.value} all-reduce is used "
                                                     "(not patched)")
    slot = _slot_for(info, has_switch) if info is not None else None
    if slot is not None:
        slot.kind = info.name
        if slot.factory is None:
            slot.factory = _default_factory(slot, modules=modules)
        _install_slot(report, slot, modules)


def _install_timer(report: PatchReport, env: Mapping[str, str], modules: Mapping[str, Any] | None,
                   timer: VerifyTimer | None) -> None:
    """With ``FASTVERIFY_PROFILE_VERIFY`` (or a given ``timer``): time the verify forwards (and
    trace ``FASTVERIFY_PROFILE_VERIFY_STEPS`` of them), drained at exit, with accepted tokens."""
    global _timer
    prof = env.get(ENV_PROFILE_VERIFY)
    if prof or timer is not None:
        t = timer or _timer or VerifyTimer(prof)
        n = env.get(ENV_PROFILE_VERIFY_STEPS, "")
        tr = VerifyTrace(prof, int(n)) if prof and n.isdigit() and int(n) > 0 else None
        _try_target(report, TARGET_VERIFY, modules, lambda orig: _make_verify_wrapper(orig, t, tr))
        if TARGET_VERIFY.key in report.applied and _timer is None:
            _timer = t
            atexit.register(lambda: t.drain(wait=True))
        if TARGET_VERIFY.key in report.applied:
            _install_accepted(t, modules)


def _install_accepted(timer: VerifyTimer, modules: Mapping[str, Any] | None) -> None:
    """Wrap SGLang's accept sampler where the verifying workers bind it, so the timer's records carry
    ``accepted`` (:func:`fastverify.patch.verify_wrap._make_accept_wrapper`); one info line per target
    not found (the records then go without it)."""
    for target in ACCEPT_TARGETS:
        why = _wrap_target(target, modules, lambda orig: _make_accept_wrapper(orig, timer))
        if why is None:
            timer.expect_accepted = True
        else:
            log.info("fastverify patch: accepted tokens not recorded through %s: %s", target.where, why)


def _install_slot(report: PatchReport, slot: _BackendSlot, modules: Mapping[str, Any] | None) -> None:
    """Wrap the targets of ``slot``'s reach (none of it depends on which backend fills it)."""
    if slot is _dispatch:
        _try_target(report, TARGET_ALL_REDUCE, modules, lambda orig: _make_all_reduce(orig, modules))
    elif slot is _fused:
        why = _fusion_group_why(modules)
        if why is not None:
            _skip(report, TARGET_FUSED_NORM, why)
        else:
            _try_target(report, TARGET_FUSED_NORM, modules, _make_fused_norm(modules))
    elif slot is _add_norm:
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
    todo = [] if TARGET_ALL_REDUCE.key in report.applied else [  # the dispatch wrapper counts too
        (TARGET_ALL_REDUCE, lambda orig: _make_all_reduce(orig, modules))]
    todo += [(TARGET_OUT_PLACE, C.make_out_place), (TARGET_IN_PLACE, C.make_in_place),
             (TARGET_FLASHINFER_AR, C.make_flashinfer), (TARGET_PYNCCL_AR, C.make_pynccl),
             (TARGET_FORWARD, C.make_forward)]
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
        import importlib.util

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
        for slot in _SLOTS:
            slot.backend, slot.disabled, slot.checked, slot.factory, slot.context = None, None, False, None, None
            slot.prepared, slot.ranks, slot.attn_is_tp = False, None, False
        _fused_groups.clear()
        if _timer is not None:
            try:
                _timer.drain(wait=True)
            except Exception:
                pass
        _timer, _report, _record, _rank_step_done = None, None, None, False
        _line_due = None
        COUNTER.reset()
    return n
