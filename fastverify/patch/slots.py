"""The in-rank patch's backend slots: one per reach (:class:`fastverify.registry.Reach`), and the
SGLang functions each one replaces.

* the dispatch slot: ``GroupCoordinator.all_reduce`` routed to a fastverify backend where SGLang
  lacks its own switch (``pcie_ipc`` on an SGLang without ``pcie_ipc_ar.py``); every call counted;
* the fused-norm slot: ``RMSNorm.forward_with_allreduce_fusion`` (``fused``), one backend per
  SGLang group (``FUSED_SLOT`` holds its kind and factory; its wrapper is at the end of this module);
* the add-norm slot: the layer boundary's ``fused_ffn_input`` / ``fused_attn_input`` candidates
  (``b12x``), offered the tensor before SGLang's own.

Every step that creates, disables or closes something collective is voted on SGLang's CPU group
(:func:`fastverify.patch.rank.gather_reasons`) so all TP ranks act together, and every call a
slot answers or declines is counted (:mod:`fastverify.patch.paths`). The facts behind each
replacement (SGLang 0.5.23 names and contracts) are in :mod:`fastverify.patch.install`'s docstring.

The fused-norm slot: SGLang's ``RMSNorm.forward_with_allreduce_fusion`` (``layers/layernorm.py``,
SGLang 0.5.23) with one fastverify backend per SGLang group.

SGLang calls it with ``use_attn_tp_group=True`` for the attention output (owed to the attention-TP
group) and ``False`` for the MoE output (owed to ``post_experts_reduction_group()``, which is the
MoE-EP or MoE-TP group, not TP, when ``moe_dp > 1``; ``layers/moe/utils.py``). Its own fused kernel
reduces over ``resolve_fusion_group(use_attn_tp_group=...)`` (``layers/flashinfer_comm_fusion.py``),
one workspace per group. The slot does the same: a backend is built on each such group (the rank
step before capture, every rank of the group voting on its CPU group) and used only for the calls
owed to that group, found by SGLang's own functions (:func:`_fusion_group`).

Every call the slot does not take runs SGLang's own method unchanged: no residual (SGLang then
only norms), a group of one, no backend for the group, or a shape the backend declines (above the
deployment record's rows SGLang's own fused kernel still covers up to 2,048 rows). A declined call
is counted as the backend's fallback (:data:`FUSED_SGLANG_FALLBACK`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastverify.patch import counting as C, rank as R
from fastverify.patch.paths import COUNTER
from fastverify.patch.targets import MOD_MOE_UTILS, MOD_PARALLEL_STATE
from fastverify.registry import BACKENDS, BackendInfo, BackendName, Reach, Role, backend_info

log = logging.getLogger("fastverify.patch")

FUSED_MAX_TOKENS = 2048  # SGLang's FUSE_ALLREDUCE_MAX_BATCH_SIZE: it never fuses more rows (add_norm.py)


@dataclass
class BackendSlot:
    """The rank's slot for one reach (:class:`fastverify.registry.Reach`): which registry backend
    fills it is set at install from ``FASTVERIFY_BACKEND`` (``kind``; before that the registry's
    first backend of that reach); built before capture or on the first eager call (or attached).
    Its limits (``max_rows``) are the registry entry's."""

    reach: Reach
    kind: BackendName = None  # type: ignore[assignment]
    backend: Any = None
    disabled: str | None = None
    checked: bool = False
    prepared: bool = False  # the rank step before CUDA-graph capture ran for it
    factory: Callable[[Any, Any], Any] | None = None  # (coordinator, tensor-or-probe) -> backend
    context: Any = None  # the ProbeContext it was built with
    ranks: list[int] | None = None  # global ranks of the group it was built on (add_norm: the TP group)
    group: Any = None  # fused: the GroupCoordinator its backend is built on and serves (one slot per group)
    attn_is_tp: bool = False  # add_norm: the attention-TP group is the TP group (no DP attention)


@dataclass(frozen=True)
class SlotUse:
    """A slot as the rank step sees it: built on the attention-TP group (``use_attn``) or the TP
    group; ``key`` names it in the line (``built=``); ``targets`` are the keys it serves."""

    slot: BackendSlot
    use_attn: bool
    key: str
    targets: tuple[str, ...]


def _first_of(*reaches: Reach) -> BackendName:
    return next(b.name for b in BACKENDS if b.reach in reaches)


FUSED_SLOT = BackendSlot(Reach.patch_fused_norm, _first_of(Reach.patch_fused_norm))
DISPATCH_SLOT = BackendSlot(Reach.patch_dispatch, _first_of(Reach.patch_dispatch, Reach.sglang_switch))
ADD_NORM_SLOT = BackendSlot(Reach.patch_add_norm, _first_of(Reach.patch_add_norm))
SLOTS = (FUSED_SLOT, DISPATCH_SLOT, ADD_NORM_SLOT)


def _max_rows_of(slot: BackendSlot) -> int:
    """The registry's row limit of the slot's backend (b12x: 36, FlashInfer ``_oneshot_preparation.py``);
    0 without one."""
    return backend_info(slot.kind).max_rows or 0


def _slot_for(info: BackendInfo, has_switch: bool) -> BackendSlot | None:
    """The slot a backend fills, by its reach: SGLang's own switch needs none where this SGLang has
    it (else the patch routes the dispatch itself); native and CPU stand-ins none."""
    if info.reach is Reach.sglang_switch:
        return None if has_switch else DISPATCH_SLOT
    return next((s for s in SLOTS if s.reach is info.reach), None)


_abandoned: list[Any] = []  # built on some ranks only: never closed (closing them alone would hang)


def attach_dispatch_backend(backend: Any) -> None:
    """Use ``backend`` for tensor-parallel all-reduces that it ``supports`` (``pcie_ipc`` on an
    SGLang without its own PCIe IPC path)."""
    DISPATCH_SLOT.backend, DISPATCH_SLOT.disabled = backend, None


def attach_add_norm_backend(backend: Any, *, ranks: list[int], attn_is_tp: bool = True) -> None:
    """Use ``backend`` for the layer boundary's add-norm (the b12x slot), built on the group of
    global ``ranks``; taken as checked (the rank step's first-result check is for built ones)."""
    ADD_NORM_SLOT.backend, ADD_NORM_SLOT.disabled, ADD_NORM_SLOT.checked = backend, None, True
    ADD_NORM_SLOT.ranks, ADD_NORM_SLOT.attn_is_tp = list(ranks), attn_is_tp


def _disable(slot: BackendSlot, reason: str) -> None:
    if slot.disabled is None:
        slot.disabled = reason
        log.warning(
            "fastverify patch: %s backend disabled on every TP rank: %s; using the plain all-reduce",
            slot.kind.value,
            reason,
        )


def close_quietly(be: Any) -> None:
    try:
        close = getattr(be, "close", None)
        if callable(close):
            close()
    except Exception as err:
        log.warning("fastverify patch: closing the backend failed (%s: %s)", type(err).__name__, err)


def create_together(
    slot: BackendSlot,
    coordinator: Any,
    x: Any,
    shapes: list[tuple[int, int]],
    check: Callable[[Any], str | None] | None = None,
) -> Any:
    """Create (and prepare, when ``shapes``; then ``check``, when given) the slot's backend on every
    TP rank or on none: each step's outcome is exchanged on the CPU group before the next. A failed
    creation is not closed (the ranks without a backend cannot join its collective destroy); a
    failed prepare or check is closed on every rank. ``check(backend)`` returns None or why the
    backend is wrong (it may raise); it passing sets ``slot.checked``. Returns the backend or None
    (then the slot is disabled everywhere)."""
    be, why = None, None
    try:
        be = slot.factory(coordinator, x)
    except Exception as err:
        why = f"cannot create it ({type(err).__name__}: {err})"
    failed = R.first_reason(R.gather_reasons(coordinator, why))
    if failed is not None:
        if be is not None:
            _abandoned.append(be)
        _disable(slot, failed)
        return None
    if shapes:
        try:
            prep = getattr(be, "prepare", None)
            if callable(prep):
                prep(shapes)
            # a backend that catches its own failure and disables itself (b12x, fused) would
            # otherwise run its torch fallback under its own name: that is a failed prepare
            swallowed = getattr(be, "disabled_reason", None)
            if swallowed:
                why = f"prepare failed ({swallowed})"
        except Exception as err:
            why = f"prepare failed ({type(err).__name__}: {err})"
        failed = R.first_reason(R.gather_reasons(coordinator, why))
        if failed is not None:
            close_quietly(be)  # every rank holds one: closed together
            _disable(slot, failed)
            return None
        slot.prepared = True
    if check is not None:
        try:
            why = check(be)
        except Exception as err:
            why = f"first result check failed ({type(err).__name__}: {err})"
        failed = R.first_reason(R.gather_reasons(coordinator, why))
        if failed is not None:
            close_quietly(be)
            _disable(slot, failed)
            return None
        slot.checked = True
    slot.backend = be
    return be


def _slot_backend(slot: BackendSlot, coordinator: Any, x: Any) -> Any:
    """The slot's backend, created (voted) on the first eager call on a GPU tensor when the step
    before capture did not; None when there is none (disabled, not creatable now, CPU tensor)."""
    if slot.disabled is not None:
        return None
    if slot.backend is None:
        if slot.factory is None or not getattr(x, "is_cuda", False) or R.is_capturing() or R.is_compiling():
            return None
        return create_together(slot, coordinator, x, [])
    return slot.backend


def _fallbacks(be: Any) -> int:
    """Calls the backend itself counted as fallbacks so far (its ``path_counts`` keys naming one)."""
    counts = getattr(be, "path_counts", None) or {}
    return sum(n for k, n in counts.items() if "fallback" in k)


def _mark_fallback(be: Any) -> None:
    """The slot declined: the next all-reduce of this thread is its fallback (not while tracing)."""
    if not R.is_compiling():
        COUNTER.mark_fallback(_be_name(be))


def _count_taken(be: Any, fallbacks_before: int) -> None:
    """Count a call a slot's backend answered: its kernel, or its own internal fallback (the backend
    returned a result through ``dist.all_reduce``: ``fastverify.<name>.fallback``); nothing while
    torch.compile traces."""
    if R.is_compiling():
        return
    fell = _fallbacks(be) > fallbacks_before
    COUNTER.count(f"fastverify.{_be_name(be)}{'.fallback' if fell else ''}", capturing=R.is_capturing())


def _be_name(be: Any) -> str:
    """The backend's registry name (``be.name``), else its class name."""
    name = getattr(be, "name", None)
    return str(getattr(name, "value", name or type(be).__name__))


def make_all_reduce(original: Callable, modules: Mapping[str, Any] | None = None) -> Callable:
    """``GroupCoordinator.all_reduce``: the dispatch slot first (when one is configured: a TP
    group, a tensor it ``supports``), then SGLang's own path; every call counted
    (:mod:`fastverify.patch.paths`): ``fastverify.<backend>``, its ``.fallback`` when it declined,
    or the method SGLang ran."""

    def all_reduce(self, input_, *args, **kwargs):
        # under torch.compile tracing SGLang defers its own choice to the op it emits: nothing to
        # route or count here (and no lock or thread-local inside a traced region)
        if args or kwargs or getattr(self, "world_size", 1) <= 1 or R.is_compiling():
            return original(self, input_, *args, **kwargs)
        if (DISPATCH_SLOT.factory is not None or DISPATCH_SLOT.backend is not None) and getattr(
            self, "unique_name", ""
        ).startswith("tp"):
            be = _slot_backend(DISPATCH_SLOT, self, input_)
            if be is not None:
                if be.supports(input_):
                    before = _fallbacks(be)
                    out = be.all_reduce(input_)
                    _count_taken(be, before)
                    return out
                _mark_fallback(be)
        return C.counted(original, self, input_, modules)

    return all_reduce


def _group_coordinator(modules: Mapping[str, Any] | None, use_attn_tp_group: bool) -> Any:
    try:
        mod = R.module(MOD_PARALLEL_STATE, modules)
        getter = getattr(mod, "get_attn_tp_group" if use_attn_tp_group else "get_tp_group", None) or getattr(
            mod, "get_tp_group"
        )
        return getter()
    except Exception:
        return None


def _slot_text(slot: BackendSlot) -> str:
    """The backend of ``slot`` as the rank's line says it: name (world, group backend, node, P2P)."""
    be, ctx = slot.backend, slot.context
    name = getattr(getattr(be, "name", None), "value", type(be).__name__)
    if ctx is None:
        return str(name)
    node = {True: "single node", False: "several nodes", None: "node unknown"}[ctx.single_node]
    return f"{name} (world {ctx.world_size}, {ctx.group_backend}, {node}, {ctx.p2p_note})"


def _b12x_add_norm(plan: Any, x: Any, residual: Any, rmsnorm_cls: Any) -> Any:
    """``(normed, residual_out)`` from the b12x slot, or None (nothing touched, no collective
    started: the caller runs SGLang's own candidate). Every condition is the same on every TP rank
    (slot state voted at the rank step, shapes, dtypes, the model's norm), so all ranks agree.
    Counted (:mod:`fastverify.patch.paths`): ``fastverify.b12x`` when taken; declined by a live
    slot, the boundary's next all-reduce is counted as its fallback."""
    slot = ADD_NORM_SLOT
    be = slot.backend
    if be is None or slot.disabled is not None or not slot.checked or residual is None:
        return None
    before = _fallbacks(be)
    out = _b12x_take(be, plan, x, residual, rmsnorm_cls)
    if out is None:
        _mark_fallback(be)
    else:
        _count_taken(be, before)
    return out


def _b12x_take(be: Any, plan: Any, x: Any, residual: Any, rmsnorm_cls: Any) -> Any:
    """The b12x result when every condition holds (see :func:`_b12x_add_norm`), else None."""
    dim = getattr(x, "dim", None)
    if dim is None or dim() != 2 or not 0 < int(x.shape[0]) <= _max_rows_of(ADD_NORM_SLOT):
        return None  # above the registry's max_rows the kernel refuses: SGLang's all-reduce + norm
    if tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype or R.is_compiling():
        return None
    got = R.plain_rmsnorm(getattr(plan, "norm", None), rmsnorm_cls, x)
    if got is None or not be.supports(x):
        return None
    if _is_stand_in(be):  # the CPU stand-in adds in place; the b12x kernel leaves the caller's residual alone
        residual = residual.clone()
    # Past this point an error is raised, not swallowed: the other ranks are in the collective.
    return be.all_reduce_residual_rmsnorm(x, residual, got[0], got[1])


def _is_stand_in(be: Any) -> bool:
    """A baseline backend (gloo on CPU) standing in for a slot's kernel (registry role)."""
    try:
        return backend_info(_be_name(be)).role is Role.baseline
    except ValueError:
        return False


def _same_group(group: Any) -> bool:
    ranks = getattr(group, "ranks", None)
    return ranks is not None and ADD_NORM_SLOT.ranks is not None and list(ranks) == ADD_NORM_SLOT.ranks


def _make_add_norm_ffn(names: Mapping[str, Any]) -> Callable[[Callable], Callable]:
    """The FFN input's candidate (attention output's sum over attention TP + add + norm).
    ``names``: the wrapped module's namespace (its ``RMSNorm``, imported from ``layernorm.py``)."""
    rmsnorm_cls = names.get("RMSNorm")

    def make(original: Callable) -> Callable:
        def fused_ffn_input(plan, hidden_states, residual, forward_batch, *args, **kwargs):
            if not args and not kwargs and ADD_NORM_SLOT.attn_is_tp:
                out = _b12x_add_norm(plan, hidden_states, residual, rmsnorm_cls)
                if out is not None:
                    return out
            return original(plan, hidden_states, residual, forward_batch, *args, **kwargs)

        return fused_ffn_input

    return make


def _make_add_norm_attn(names: Mapping[str, Any]) -> Callable[[Callable], Callable]:
    """The attention input's candidate (the previous FFN's carried ``UnreducedOutput`` + add + norm).
    ``names``: the wrapped module's namespace (its ``RMSNorm`` and ``UnreducedOutput``)."""
    rmsnorm_cls, unreduced = names.get("RMSNorm"), names.get("UnreducedOutput")

    def make(original: Callable) -> Callable:
        def fused_attn_input(plan, owed, residual, forward_batch, post_residual_addition, *args, **kwargs):
            # SGLang's own declines a post-residual addition too ("the kernel does not add it")
            if (
                not args
                and post_residual_addition is None
                and not kwargs.get("fuses_quant")
                and set(kwargs) <= {"fuses_quant", "keep_bf16"}
                and unreduced is not None
                and type(owed) is unreduced
                and getattr(owed, "reduce_to_dp_local", None) is None
                and getattr(owed, "complete_sum", None) is None
                and _same_group(getattr(owed, "group", None))
            ):
                out = _b12x_add_norm(plan, owed.partial, residual, rmsnorm_cls)
                if out is not None:
                    return out
            return original(plan, owed, residual, forward_batch, post_residual_addition, *args, **kwargs)

        return fused_attn_input

    return make


FUSED_GROUPS: list[BackendSlot] = []  # the fused slot's backends, one per SGLang group (``group``)
FUSED_SGLANG_FALLBACK = "sglang_fusion.fallback"
"""Path suffix (``fastverify.<backend>.sglang_fusion.fallback``): the fused slot declined and SGLang's
own ``forward_with_allreduce_fusion`` reduced the tensor without a ``GroupCoordinator.all_reduce``
(its FlashInfer fused kernel). Where SGLang's method all-reduces through the group instead, that
all-reduce is counted ``fastverify.<backend>.fallback``."""


def group_slot(group: Any) -> BackendSlot:
    """The fused slot's slot for SGLang's ``group`` (a ``GroupCoordinator``, matched by identity as
    SGLang matches the owed group, ``fusions/allreduce.py``), made on first use with the fused
    slot's kind and factory."""
    slot = next((s for s in FUSED_GROUPS if s.group is group), None)
    if slot is None:
        slot = BackendSlot(Reach.patch_fused_norm, group=group)
        FUSED_GROUPS.append(slot)
    slot.kind, slot.factory = FUSED_SLOT.kind, FUSED_SLOT.factory  # as install set them
    return slot


def attach_fused_backend(backend: Any, group: Any, *, checked: bool = False) -> None:
    """Use ``backend`` (an :class:`fastverify.backends.AllReduceBackend` built on ``group``, SGLang's
    ``GroupCoordinator``) for the fused calls owed to that group only. ``checked=True`` skips the
    first-result check against the plain path."""
    slot = group_slot(group)
    slot.backend, slot.disabled, slot.checked = backend, None, checked
    FUSED_SLOT.disabled = None


def _fusion_group_why(modules: Mapping[str, Any] | None) -> str | None:
    """None when this SGLang names the group its fused kernel reduces over (:func:`_fusion_group`),
    else why the fused slot cannot be installed (one phrase)."""
    if callable(getattr(R.module(R.MOD_FI_FUSION, modules), "resolve_fusion_group", None)):
        return None
    if callable(getattr(R.module(MOD_PARALLEL_STATE, modules), "get_attn_tp_group", None)) and callable(
        getattr(R.module(MOD_MOE_UTILS, modules), "post_experts_reduction_group", None)
    ):
        return None
    return (
        f"{R.MOD_FI_FUSION} lacks resolve_fusion_group and {MOD_MOE_UTILS} lacks "
        "post_experts_reduction_group: the group of the fused all-reduce is unknown"
    )


def _fusion_group(modules: Mapping[str, Any] | None, use_attn_tp_group: bool) -> Any:
    """The ``GroupCoordinator`` SGLang's own fused kernel reduces over for this call, by SGLang's
    own functions: ``resolve_fusion_group(use_attn_tp_group=...)`` (``flashinfer_comm_fusion.py``,
    0.5.23: the attention-TP group, else ``post_experts_reduction_group()``: TP where EP and MoE-TP
    merge, else MoE-EP, else MoE-TP, ``layers/moe/utils.py``); without it ``get_attn_tp_group()`` /
    ``post_experts_reduction_group()``. None when neither answers."""
    try:
        fn = getattr(R.module(R.MOD_FI_FUSION, modules), "resolve_fusion_group", None)
        if callable(fn):
            return fn(use_attn_tp_group=use_attn_tp_group)[2]
        if use_attn_tp_group:
            return R.module(MOD_PARALLEL_STATE, modules).get_attn_tp_group()
        return R.module(MOD_MOE_UTILS, modules).post_experts_reduction_group()
    except Exception:
        return None


def _make_fused_norm(modules: Mapping[str, Any] | None) -> Callable[[Callable], Callable]:
    """``RMSNorm.forward_with_allreduce_fusion``: the backend of the group the call is owed to
    (:func:`_fusion_group`) when it takes the tensor; otherwise SGLang's own method. A call a live
    backend declined is counted as its fallback (:data:`FUSED_SGLANG_FALLBACK`)."""

    def make(original: Callable) -> Callable:
        def forward_with_allreduce_fusion(self, x, residual=None, post_residual_addition=None, use_attn_tp_group=True):
            out, declined = _fused_take(self, x, residual, post_residual_addition, use_attn_tp_group, modules)
            if out is not None:
                return out
            if declined is None or R.is_compiling():
                return original(self, x, residual, post_residual_addition, use_attn_tp_group)
            COUNTER.mark_fallback(_be_name(declined))  # taken by SGLang's own all-reduce, if it runs one
            out = original(self, x, residual, post_residual_addition, use_attn_tp_group)
            if COUNTER.take_fallback() is not None:  # none ran: SGLang's fused kernel reduced it
                COUNTER.count(f"fastverify.{_be_name(declined)}.{FUSED_SGLANG_FALLBACK}", capturing=R.is_capturing())
            return out

        return forward_with_allreduce_fusion

    return make


def _fused_take(
    norm: Any, x: Any, residual: Any, post: Any, use_attn_tp_group: bool, modules: Mapping[str, Any] | None
) -> tuple[Any, Any]:
    """``(result, None)`` when the owed group's backend took the call; ``(None, backend)`` when a live
    backend declined it; ``(None, None)`` when none applies (no residual -- SGLang then only norms,
    ``layernorm.py`` -- a group of one, no backend for the group, the slot off)."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if residual is None or weight is None or eps is None or FUSED_SLOT.disabled is not None or x.dim() != 2:
        return None, None
    coord = _fusion_group(modules, use_attn_tp_group)
    if coord is None or int(getattr(coord, "world_size", 1) or 1) <= 1:
        return None, None
    slot = group_slot(coord)
    be = _slot_backend(slot, coord, x)
    if be is None:
        return None, None
    if x.shape[0] > FUSED_MAX_TOKENS or not be.supports(x):
        return None, be
    if post is not None:
        residual = residual + post  # fresh tensor; the caller's is untouched
    before = _fallbacks(be)
    out = _run_fused(slot, be, coord, x, residual, weight, eps)
    if out is None:
        return None, be
    _count_taken(be, before)
    return out, None


def _run_fused(slot: BackendSlot, be: Any, coordinator: Any, x: Any, residual: Any, weight: Any, eps: float) -> Any:
    """The fused result of ``slot``'s backend, or None to run SGLang's own method.

    The first eager call runs the plain path (the group's ``all_reduce`` + add + RMSNorm) and the
    fused one on every rank of the group, compares them and votes on its CPU group: any rank's
    mismatch or error disables this group's backend on all of them. Inside a graph capture before
    that check, None. After the check an error is raised, not swallowed: a one-rank fallback would
    leave the other ranks inside the collective kernel."""
    w = weight.data if hasattr(weight, "data") else weight
    if slot.checked:
        return be.all_reduce_residual_rmsnorm(x, residual, w, float(eps))
    if R.is_capturing():
        return None
    from fastverify.backends import add_rmsnorm, check_close  # lazy: torch

    want = add_rmsnorm(coordinator.all_reduce(x.clone()), residual, w, float(eps))  # the plain path first
    out, why = None, None
    try:
        out = be.all_reduce_residual_rmsnorm(x, residual, w, float(eps))
        ok0, err0 = check_close(out[0], want[0], x.dtype)
        ok1, err1 = check_close(out[1], want[1], x.dtype)
        if not (ok0 and ok1):
            why = f"first result differs from the plain path (max error {max(err0, err1):.3g})"
    except Exception as err:
        why = f"{type(err).__name__}: {err}"
    failed = R.first_reason(R.gather_reasons(coordinator, why))
    if failed is not None:
        _disable(slot, failed)
        return None
    slot.checked = True
    return out


def _fused_groups_of(modules: Mapping[str, Any] | None) -> list[Any]:
    """The distinct groups (by identity) of more than one rank that SGLang's fused kernel reduces
    over in this rank: the attention-TP call's, then the post-experts call's (:func:`_fusion_group`).
    The same order on every rank, so each group's votes meet."""
    out: list[Any] = []
    for use_attn in (True, False):
        g = _fusion_group(modules, use_attn)
        if g is not None and int(getattr(g, "world_size", 1) or 1) > 1 and all(g is not o for o in out):
            out.append(g)
    return out


def _build_fused(
    modules: Mapping[str, Any] | None, probe: Any, shapes: list[tuple[int, int]]
) -> tuple[str | None, str]:
    """The rank step of the fused slot: one backend per group (:func:`_fused_groups_of`), created
    and prepared on that group and voted on its CPU group. Returns (what was built, for the line;
    None when nothing was: the slot is then off) and the groups that failed (``""`` when none)."""
    built, failed = [], []
    for g in _fused_groups_of(modules):
        slot = group_slot(g)
        if slot.backend is None and slot.disabled is None:
            FUSED_SLOT.context = None
            create_together(slot, g, probe, shapes)
            slot.context = FUSED_SLOT.context  # the default factory records the context on the fused slot
        name = getattr(g, "unique_name", None) or f"ranks {getattr(g, 'ranks', '?')}"
        if slot.backend is None:
            failed.append(f"{name}: {slot.disabled}")
        else:
            built.append(f"{name}: {_slot_text(slot)}")
    why = "; ".join(failed)
    if not built:
        FUSED_SLOT.disabled = why or "no group of more than one rank to reduce over"
        return None, FUSED_SLOT.disabled
    return ", ".join(built), why


def _close_fused(why: str) -> None:
    """Turn the fused slot off: every group's backend closed (every rank of each group gets the same
    answer from SGLang, so they close together), no backend left."""
    for slot in FUSED_GROUPS:
        if slot.backend is not None:
            close_quietly(slot.backend)
            slot.backend = None
    _disable(FUSED_SLOT, why)
