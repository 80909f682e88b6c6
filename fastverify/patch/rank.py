"""What the patch does in a TP rank once SGLang's process groups exist.

The plugin runs at the top of SGLang's ``run_scheduler_process``, before the groups are made, so
every fact that depends on the group is gathered here, later, from SGLang's own
``GroupCoordinator`` (``sglang/srt/distributed/parallel_state.py``, 0.5.23), and from the
deployment record ``launch`` names in ``FASTVERIFY_DEPLOYMENT`` (:mod:`fastverify.deploy`):

* world size: ``coordinator.world_size``; the group's backend: ``device_group``;
* single node: SGLang's own ``in_the_same_node_as(coordinator.cpu_group, source_rank=0)`` (a
  shared-memory handshake over the gloo CPU group, the check SGLang's custom all-reduce uses);
* P2P: the record's :class:`fastverify.deploy.P2PFacts`, proven only by a check that exercises
  it (``P2PFacts.proven``); without a record P2P is unknown and P2P backends refuse, never guessed;
* workspace size: the record's :class:`fastverify.deploy.VerifyShapes` (largest captured batch ×
  draft tokens × hidden), the same product SGLang's ``PcieIpcCommunicator._ensure_workspace`` uses
  (``sglang/srt/distributed/device_communicators/pcie_ipc_ar.py``).

Every step that creates, disables or closes something collective is voted on SGLang's CPU (gloo)
group first (:func:`gather_reasons`), so all TP ranks act together: one rank closing a FlashInfer
workspace alone would wait in its destroy barriers, one rank leaving the fused kernel would leave
the others spinning in it.

Nothing here imports SGLang; the modules are looked up by name (tests pass fakes).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

from fastverify.deploy import DeploymentRecord
from fastverify.errors import shown
from fastverify.registry import BackendName, Role, backend_info, names, unreachable_reason

MOD_PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
MOD_ADD_NORM = "sglang.srt.layers.layer_boundary.residual.add_norm"
MOD_RUNTIME_CONTEXT = "sglang.srt.runtime_context"
MOD_FI_FUSION = "sglang.srt.layers.flashinfer_comm_fusion"  # resolve_fusion_group: the fused kernel's group


def module(name: str, modules: Mapping[str, Any] | None) -> Any:
    """``modules[name]`` when a mapping is given (tests), else the imported module; None when absent."""
    try:
        return modules[name] if modules is not None else importlib.import_module(name)
    except Exception:
        return None


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def is_compiling() -> bool:
    """Whether torch.compile is tracing this call."""
    try:
        import torch

        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


# --- facts from the coordinator and the record ------------------------------------------------------


def single_node(coordinator: Any, modules: Mapping[str, Any] | None) -> tuple[bool | None, str]:
    """(all ranks of the group on this host, how it was found), by SGLang's own
    ``in_the_same_node_as`` on the coordinator's CPU group. Collective on that group: every rank
    must call it at the same point. (None, why) when SGLang lacks the function or the group."""
    fn = getattr(module(MOD_PARALLEL_STATE, modules), "in_the_same_node_as", None)
    cpu_group = getattr(coordinator, "cpu_group", None)
    if not callable(fn) or cpu_group is None:
        return None, "single node unknown (no in_the_same_node_as or no CPU group in this SGLang)"
    flags = [bool(f) for f in fn(cpu_group, source_rank=0)]
    return all(flags), f"{sum(flags)} of {len(flags)} ranks on this host (SGLang in_the_same_node_as)"


def p2p_facts(record: DeploymentRecord | None) -> tuple[bool | None, str]:
    """(P2P ok, one-line note) from the deployment record; None (unknown) without a record or when
    the record's P2P status was not proven by a check that exercises it."""
    if record is None:
        return None, "P2P not proven: no deployment record (FASTVERIFY_DEPLOYMENT unset)"
    p = record.p2p
    if p.proven:
        return True, f"P2P proven by {p.source} (deployment record{': ' + p.note if p.note else ''})"
    if p.ok is False:
        return False, f"P2P fails ({p.source}{': ' + p.note if p.note else ''}, deployment record)"
    return None, f"P2P not proven (deployment record: source {p.source})"


def context_from_coordinator(
    coordinator: Any,
    *,
    device: Any,
    dtype: Any,
    record: DeploymentRecord | None,
    modules: Mapping[str, Any] | None = None,
) -> Any:
    """The :class:`fastverify.backends.ProbeContext` of this rank, from SGLang's
    ``GroupCoordinator`` (world size, device group backend, single node) and the record (P2P).
    Collective on the coordinator's CPU group (the single-node check)."""
    import torch
    import torch.distributed as dist

    from fastverify.backends import ProbeContext  # lazy: torch

    same_node, _ = single_node(coordinator, modules)  # the collective step first, on every rank
    device = torch.device(device)
    group = getattr(coordinator, "device_group", None)
    group_backend = None
    if group is not None and dist.is_available() and dist.is_initialized():
        group_backend = str(dist.get_backend(group)).lower()
    sm = None
    if device.type == "cuda" and torch.cuda.is_available():
        sm = tuple(torch.cuda.get_device_capability(device))
    p2p_ok, p2p_note = p2p_facts(record)
    return ProbeContext(
        world_size=int(coordinator.world_size),
        device_type=device.type,
        dtype=dtype,
        group_backend=group_backend,
        sm=sm,
        p2p_ok=p2p_ok,
        p2p_note=p2p_note,
        single_node=same_node,
    )


def backend_for_device(kind: BackendName | str, device_type: str) -> BackendName:
    """``kind`` on a GPU; on CPU the registry's CPU baseline (gloo), which stands in for every
    slot so the same creation, votes and line run on a GPU-less box."""
    if device_type == "cuda":
        return BackendName(kind)
    return names(role=Role.baseline, device="cpu")[0]


def workspace_numel(record: DeploymentRecord | None, hidden: int, rows: int | None) -> int:
    """Elements the workspace must hold: the record's ``max_batch × draft_tokens × hidden``; without
    a record, ``rows × hidden`` where ``rows`` is SGLang's widest captured decode (largest capture
    batch × tokens per request, as ``BaseRunner._widest_decode_rows`` derives it).

    Raises
    ------
    ValueError
        The record's hidden size is not the model's (the record is for another model), or neither a
        record nor ``rows`` is given.
    """
    if record is not None:
        if record.shapes.hidden != hidden:
            raise ValueError(
                f"the deployment record is for hidden size {record.shapes.hidden}, "
                f"this model has {hidden}; re-run `fastverify tune --write-env` for it"
            )
        return record.shapes.max_numel
    if not rows:
        raise ValueError("no deployment record and no captured batch sizes to size the workspace from")
    return int(rows) * hidden


def make_for_rank(
    kind: BackendName | str,
    coordinator: Any,
    x: Any,
    *,
    record: DeploymentRecord | None,
    rows: int | None = None,
    modules: Mapping[str, Any] | None = None,
) -> tuple[Any, Any]:
    """(backend, context) for this rank: context from the coordinator, the probe voted on the CPU
    group (so either every rank constructs, collectively, or none does), then ``make_backend``.

    ``x`` gives ``shape[-1]`` (hidden), ``device`` and ``dtype``. Raises
    :class:`fastverify.backends.BackendUnavailable` on every rank when any rank's probe fails.
    """
    from fastverify.backends import BackendUnavailable, make_backend, probe  # lazy: torch

    hidden = int(x.shape[-1])
    ctx, why = None, None
    import torch

    name = backend_for_device(kind, torch.device(x.device).type)
    try:
        ctx = context_from_coordinator(coordinator, device=x.device, dtype=x.dtype, record=record, modules=modules)
        cap = probe(name, ctx)
        why = None if cap.ok else cap.reason
        max_numel = workspace_numel(record, hidden, rows)
    except Exception as err:
        why = f"{type(err).__name__}: {err}"
    failed = first_reason(gather_reasons(coordinator, why))
    if failed is not None:
        raise BackendUnavailable(name, failed)
    from fastverify.backends.base import backend_class  # lazy: torch

    # a backend that votes across ranks while it builds (b12x) votes on SGLang's gloo CPU group;
    # one that can prepare its fused kernel alone (b12x) does: the slots call nothing else of it
    known = backend_class(name).option_names
    cpu = getattr(coordinator, "cpu_group", None)
    options = {"cpu_group": cpu} if cpu is not None and "cpu_group" in known else {}
    if "fused_only" in known:
        options["fused_only"] = True
    be = make_backend(
        name,
        getattr(coordinator, "device_group", None),
        device=x.device,
        dtype=x.dtype,
        max_numel=max_numel,
        hidden=hidden,
        options=options or None,
        context=ctx,
    )
    return be, ctx


# --- the add-norm slot: what it may take, and its first result ---------------------------------------


def plain_rmsnorm(norm: Any, rmsnorm_cls: Any, x: Any) -> tuple[Any, float] | None:
    """(weight, eps) when ``norm`` is exactly SGLang's ``RMSNorm`` computing what the fused kernel
    does -- ``residual + x``, then ``* rsqrt(mean(.**2) + eps) * weight`` -- else None. Excluded,
    as they change that arithmetic (``layers/layernorm.py`` 0.5.23 ``RMSNorm.__init__`` /
    ``forward_native``): subclasses (GemmaRMSNorm's ``1 + weight`` is another class), a variance
    over part of the row, ``cast_x_before_out_mul``, an fp32 residual, an overridden output dtype,
    aiter's padding, a fused FP8 input quant (``fuse_input_quant``), and a weight not in the input's
    dtype/device (b12x takes ``(hidden,)`` in the input dtype, FlashInfer
    ``experimental/b12x/comm/pcie/pcie_oneshot.py``).

    Parameters
    ----------
    norm : torch.nn.Module or None
        The stage's norm (``plan.norm``).
    rmsnorm_cls : type or None
        SGLang's ``RMSNorm`` class (as the wrapped module imported it).
    x : Tensor
        ``(T, hidden)``, the partial sum the kernel would reduce.

    Returns
    -------
    (weight, eps) : tuple[Tensor, float] or None
        ``weight`` is ``(hidden,)`` in ``x.dtype`` on ``x.device``; None when the kernel would not
        compute what SGLang's norm does.
    """
    if rmsnorm_cls is None or type(norm) is not rmsnorm_cls:
        return None
    if (
        getattr(norm, "variance_size_override", None) is not None
        or getattr(norm, "cast_x_before_out_mul", False)
        or getattr(norm, "fp32_residual", False)
        or getattr(norm, "override_orig_dtype", None) is not None
        or getattr(norm, "x_pad_to_multiple", 0)
        or vars(norm).get("_quant_linear") is not None
    ):
        return None
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    w = getattr(w, "data", w)
    if w is None or eps is None or w.dtype != x.dtype or w.device != x.device or tuple(w.shape) != (x.shape[-1],):
        return None
    return w, float(eps)


def first_result_check(
    coordinator: Any, rows: int, hidden: int, device: Any, dtype: Any, *, eps: float = 1e-6
) -> Callable[[Any], str | None]:
    """A fused slot's first-result check, run in the rank step on every rank (so every live
    call does exactly one all-reduce): seeded inputs, ``rows`` x ``hidden``, the backend's fused
    result against SGLang's own plain path -- the coordinator's ``all_reduce`` -- + the fp32 add +
    RMSNorm (:func:`fastverify.backends.add_rmsnorm`), compared with
    :func:`fastverify.backends.check_close` at the dtype's tolerance.

    Parameters
    ----------
    coordinator
        SGLang's ``GroupCoordinator`` the backend was built on (``all_reduce``, ``rank_in_group``).
    rows, hidden : int
        Shape of the check (a prepared shape, so the fused kernel itself runs).
    device, dtype
        Where and in what dtype the backend runs.
    eps : float
        RMSNorm epsilon.

    Returns
    -------
    callable
        ``check(backend) -> None`` when both outputs agree, else a one-line reason. Collective
        (one all-reduce of the plain path, one of the backend): every rank calls it together.
    """

    def check(be: Any) -> str | None:
        import torch

        from fastverify.backends import add_rmsnorm, check_close  # lazy: torch

        rank = int(getattr(coordinator, "rank_in_group", 0) or 0)
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(9100 + rank))
        residual = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(9000))
        weight = 1.0 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(9001))
        x, residual, weight = (t.to(device=device, dtype=dtype) for t in (x, residual, weight))
        want = add_rmsnorm(coordinator.all_reduce(x.clone()), residual, weight, eps)  # may work in place
        got = be.all_reduce_residual_rmsnorm(x, residual, weight, eps)
        errs = [check_close(g, w.float(), dtype) for g, w in zip(got, want)]
        if all(ok for ok, _ in errs):
            return None
        return f"first result differs from the plain path (max error {max(e for _, e in errs):.3g})"

    return check


# --- votes ------------------------------------------------------------------------------------------


def gather_reasons(coordinator: Any, why: str | None) -> list[str | None]:
    """Every rank's failure reason (None: ok), in group rank order, exchanged on the coordinator's
    CPU (gloo) group with ``torch.distributed.all_gather_object``. Collective: every rank of the
    group calls it at the same point. A coordinator without a CPU group (or of size 1) gives
    ``[why]``."""
    cpu_group = getattr(coordinator, "cpu_group", None)
    world = int(getattr(coordinator, "world_size", 1) or 1)
    if cpu_group is None or world <= 1:
        return [why]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, why, group=cpu_group)
    return out


def first_reason(reasons: list[str | None]) -> str | None:
    """``"TP r: reason"`` of the first failing rank (all failing ranks counted), None when all ok."""
    bad = [(r, why) for r, why in enumerate(reasons) if why is not None]
    if not bad:
        return None
    r, why = bad[0]
    more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
    return f"TP {r}: {why}{more}" if len(reasons) > 1 else why


# --- does SGLang reach the fused-norm target? -------------------------------------------------------


def fused_norm_reach(
    modules: Mapping[str, Any] | None,
    rows: int,
    sm: tuple[int, int] | None,
    sglang_version: str | None = None,
    kind: BackendName = BackendName.fused,
) -> tuple[bool, str]:
    """Whether SGLang calls ``RMSNorm.forward_with_allreduce_fusion`` for a ``rows``-row verify
    all-reduce, and why (one line).

    SGLang's own rule first: ``flashinfer_ar_fusion_applies(rows)``
    (``sglang/srt/layers/layer_boundary/residual/add_norm.py``, 0.5.23: SM90 or SM100, FlashInfer,
    a FlashInfer fusion backend selected, no DP attention, no CuTe DSL fusion, the workspace
    preflight passed, 0 < rows <= 2048), evaluated in the rank with the published config. Where
    SGLang has no such function, the registry's SM gate (``sglang_sm_majors``) with this GPU's
    capability; with neither, not claimed.
    """
    fn = getattr(module(MOD_ADD_NORM, modules), "flashinfer_ar_fusion_applies", None)
    if callable(fn):
        try:
            if fn(rows):
                return True, f"SGLang's flashinfer_ar_fusion_applies({rows}) holds"
            return False, (
                f"SGLang never calls RMSNorm.forward_with_allreduce_fusion here: "
                f"flashinfer_ar_fusion_applies({rows}) is False (SM90/SM100, FlashInfer, "
                f"--enable-flashinfer-allreduce-fusion, no DP attention; {_sm_text(sm)})"
            )
        except Exception as err:
            return False, f"SGLang's flashinfer_ar_fusion_applies could not be evaluated ({type(err).__name__}: {err})"
    if sm is None:
        return False, "cannot tell whether SGLang calls forward_with_allreduce_fusion (no gate found, GPU unknown)"
    why = unreachable_reason(backend_info(kind), sm=sm, world_size=None, p2p_ok=True, sglang_version=sglang_version)
    return (why is None), (why or "registry: SGLang calls it on this GPU")


def add_norm_reach(
    modules: Mapping[str, Any] | None, rows: int, sm: tuple[int, int] | None, kind: BackendName = BackendName.b12x
) -> tuple[bool, str]:
    """Whether the b12x slot takes the layer boundary's reduce + add + RMSNorm on this GPU, and why
    (one line). Same answer on every TP rank (the published config, one kind of GPU), so no vote.

    * SGLang's own FlashInfer fusion owns the boundary wherever it applies:
      ``flashinfer_ar_fusion_applies(rows)`` (``layer_boundary/residual/add_norm.py``, 0.5.23) true,
      or the GPU is one SGLang gates it to (registry ``fused.sglang_sm_majors``: SM90/SM100); the
      slot stays out of the way and the wrapped candidates call SGLang's own.
    * Otherwise the b12x kernel must run here: registry ``b12x.kernel_sm`` (SM120/SM121, FlashInfer
      ``experimental/b12x/_lib/gating.py`` ``is_b12x``).
    """
    fn = getattr(module(MOD_ADD_NORM, modules), "flashinfer_ar_fusion_applies", None)
    owns = False
    if callable(fn):
        try:
            owns = bool(fn(rows))
        except Exception:
            owns = False
    sglang_majors = backend_info(BackendName.fused).sglang_sm_majors or ()
    if owns or (sm is not None and sm[0] in sglang_majors):
        gate = (
            f"flashinfer_ar_fusion_applies({rows}) holds"
            if owns
            else "/".join(f"SM{m}0" for m in sglang_majors) + " is where it runs"
        )
        return False, (
            f"SGLang's own FlashInfer all-reduce fusion owns the layer boundary here ({gate}; "
            f"{_sm_text(sm)}); {kind.value} stays out of the way"
        )
    info = backend_info(kind)
    n = info.name.value
    want = "/".join(f"SM{a}{b}" for a, b in info.kernel_sm or ())
    if sm is None:
        return False, f"GPU compute capability unknown; {n} runs only on {want}"
    if not info.kernel_runs_on(sm):
        return False, f"{n} runs only on {want} (FlashInfer {n} is_supported); {_sm_text(sm)}"
    return True, (
        f"{_sm_text(sm)}: SGLang's FlashInfer fusion does not apply, the layer boundary's "
        f"add-norm candidates take {n} up to {info.max_rows} rows"
    )


def platform_sm(modules: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """This GPU's (major, minor) as SGLang sees it: ``get_platform().device_capability``
    (``sglang/srt/runtime_context.py``, 0.5.23; what its own SM gates read, and what
    ``override_platform(device_capability=...)`` sets), else torch's (:func:`this_sm`)."""
    try:
        got = module(MOD_RUNTIME_CONTEXT, modules).get_platform().device_capability
        if isinstance(got, tuple) and len(got) == 2 and all(isinstance(v, int) for v in got):
            return got
    except Exception:
        pass
    return this_sm()


def _sm_text(sm: tuple[int, int] | None) -> str:
    return "this GPU is SM unknown" if sm is None else f"this GPU is SM{sm[0]}{sm[1]}"


def this_sm() -> tuple[int, int] | None:
    """This rank's CUDA compute capability, None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            return tuple(torch.cuda.get_device_capability())
    except Exception:
        pass
    return None


def tp_rank(coordinator: Any, runner: Any = None) -> str:
    """This rank's index in the TP group (``rank_in_group``), else the runner's ``tp_rank``, else ``?``."""
    for v in (getattr(coordinator, "rank_in_group", None), getattr(runner, "tp_rank", None)):
        if isinstance(v, int):
            return str(v)
    return "?"


def emit(line: str) -> None:
    """Write the rank's one line to stderr, which SGLang's scheduler process shares with its own
    log output (its logger may be set above INFO; this line must be seen)."""
    try:
        sys.stderr.write(shown(line, limit=None) + "\n")
        sys.stderr.flush()
    except Exception:
        pass
