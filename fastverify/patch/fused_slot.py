"""The fused-norm slot: SGLang's ``RMSNorm.forward_with_allreduce_fusion`` (``layers/layernorm.py``,
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

from collections.abc import Callable, Mapping
from typing import Any

from fastverify.patch import rank as R
from fastverify.patch.paths import COUNTER
from fastverify.patch.slots import (
    FUSED_MAX_TOKENS,
    FUSED_SLOT,
    BackendSlot,
    _be_name,
    _count_taken,
    _disable,
    _fallbacks,
    _slot_backend,
    _slot_text,
    close_quietly,
    create_together,
)
from fastverify.patch.targets import MOD_MOE_UTILS, MOD_PARALLEL_STATE
from fastverify.registry import Reach

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
