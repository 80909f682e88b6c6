"""One interface for every all-reduce backend, the registry, and the plain torch reference.

A backend does the verify step's tensor-parallel all-reduce, optionally fused with the residual
add + RMSNorm that follows it in every decoder layer. Lifecycle::

    cap = Backend.probe(ctx)               # once, cheap, no collective; hard requirements only
    with make_backend(name, group, device=..., dtype=..., max_numel=...) as be:
        be.prepare([(T, hidden)])           # before CUDA-graph capture
        if be.supports(x):                  # per call: size/shape bounds
            y = be.all_reduce(x)            # out-of-place, always returns
            normed, res = be.all_reduce_residual_rmsnorm(x, residual, weight, eps)

``probe`` never raises for a missing capability: it returns ``Capability(ok=False, reason)`` with a
one-line reason that names the fix. ``make_backend`` turns that into :class:`BackendUnavailable`.

The fused residual + RMSNorm path must always perform the all-reduce. SGLang's own fused path
returns ``None`` when the fused kernel declines and then runs the norm on the un-reduced tensor
(``../shared/research/sglang.md`` §4); here a backend that cannot fuse falls back to
``all_reduce`` + torch add + norm, never to the norm alone.
"""

from __future__ import annotations

import importlib
import os
import warnings
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Mapping, Sequence

import torch

from fastverify.errors import UserError
from fastverify.registry import BACKENDS, BackendInfo, BackendName, backend_info

Tensor = torch.Tensor
Shape = tuple[int, ...]


class BackendUnavailable(UserError):
    """A backend's probe failed. ``str(err)`` is the one-line reason, including the fix."""

    def __init__(self, name: BackendName | str, reason: str) -> None:
        self.name = BackendName(name)
        self.reason = reason
        super().__init__(f"all-reduce backend {self.name.value!r} unavailable: {reason}")


@dataclass(frozen=True)
class Capability:
    """Result of a probe. ``reason`` is one line; when ``ok`` is False it says what to fix."""

    ok: bool
    reason: str

    def __post_init__(self) -> None:
        if "\n" in self.reason:
            raise ValueError(f"Capability.reason must be one line, got {self.reason!r}")


OK = Capability(True, "ok")


def fail(reason: str) -> Capability:
    return Capability(False, reason)


# --- probe context ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeContext:
    """What a probe may look at. Built once per process by :meth:`detect`, or by hand in tests.

    Attributes
    ----------
    world_size : int
        Ranks in the group.
    device_type : str
        ``"cuda"`` or ``"cpu"``: where the tensors live.
    dtype : torch.dtype
        Element type of the all-reduced tensors.
    group_backend : str or None
        ``torch.distributed.get_backend(group)`` (``"nccl"``, ``"gloo"``), None without a group.
    sm : tuple[int, int] or None
        CUDA compute capability of this rank's GPU, None without CUDA.
    p2p_ok : bool or None
        True when every ordered GPU pair of the group passed the P2P read/write check
        (``fastverify.topo.p2p.check_p2p``); None when it was not run. Probes treat None as a
        failure for backends that need P2P: IPC kernels on a box with broken P2P hang.
    p2p_note : str
        One line saying which pair failed, or where the status came from.
    nvlink_full : bool or None
        True when every GPU pair is connected by NVLink (``nvidia-smi topo -m`` shows NV#).
    single_node : bool or None
        True when all ranks run on this host.
    """

    world_size: int
    device_type: str
    dtype: torch.dtype
    group_backend: str | None = None
    sm: tuple[int, int] | None = None
    p2p_ok: bool | None = None
    p2p_note: str = "P2P status not checked"
    nvlink_full: bool | None = None
    single_node: bool | None = None

    @classmethod
    def detect(
        cls,
        group: Any,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        p2p: Mapping[tuple[int, int], Any] | bool | None = None,
        nvlink_full: bool | None = None,
        single_node: bool | None = None,
    ) -> "ProbeContext":
        """Fill the context from the live process and ``group`` (a ProcessGroup, or None for
        the default group). ``p2p`` is ``check_p2p``'s result (pair -> object with ``.ok``, or
        pair -> bool), or one bool for all pairs; P2P is never tested here (it can hang)."""
        import torch.distributed as dist

        device = torch.device(device)
        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size(group)
            group_backend = str(dist.get_backend(group)).lower()
        else:
            world_size, group_backend = 1, None
        sm = None
        if device.type == "cuda" and torch.cuda.is_available():
            sm = tuple(torch.cuda.get_device_capability(device))
        p2p_ok, p2p_note = summarize_p2p(p2p)
        if single_node is None:
            single_node = _guess_single_node(world_size)
        return cls(world_size, device.type, dtype, group_backend, sm, p2p_ok, p2p_note, nvlink_full, single_node)


def summarize_p2p(p2p: Mapping[tuple[int, int], Any] | bool | None) -> tuple[bool | None, str]:
    """Collapse a per-pair P2P result into (all ok, one-line note)."""
    if p2p is None:
        return None, "P2P status not checked"
    if isinstance(p2p, bool):
        return p2p, "P2P status given by the caller"
    bad = sorted(pair for pair, r in p2p.items() if not getattr(r, "ok", r))
    if bad:
        i, j = bad[0]
        return False, f"P2P failed for {len(bad)} pair(s), first GPU{i}->GPU{j}"
    if not p2p:
        return None, "P2P status empty"
    return True, f"P2P ok for all {len(p2p)} checked pairs"


def _guess_single_node(world_size: int) -> bool | None:
    # torchrun sets LOCAL_WORLD_SIZE; fastverify's tune workers rendezvous on 127.0.0.1 only.
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.isdigit():
        return int(local) == world_size
    if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost", "::1"):
        return True
    return None


# Shared hard-requirement checks. Each returns a failed Capability, or None when satisfied, so a
# probe is a list of checks whose first failure is the one-line reason.


def first_failure(*checks: Capability | None) -> Capability | None:
    return next((c for c in checks if c is not None), None)


def check_cuda(ctx: ProbeContext) -> Capability | None:
    if ctx.device_type != "cuda":
        return fail(f"needs CUDA tensors, device is {ctx.device_type!r}; run on a GPU or use gloo")
    if not torch.cuda.is_available():
        return fail("no CUDA device visible to torch (CPU-only torch or no GPU); use nccl/gloo")
    return None


def check_world_size(ctx: ProbeContext, allowed: Sequence[int]) -> Capability | None:
    if ctx.world_size not in allowed:
        return fail(f"world size {ctx.world_size} unsupported, needs one of {sorted(allowed)}; use nccl")
    return None


def check_dtype(ctx: ProbeContext, allowed: Sequence[torch.dtype]) -> Capability | None:
    if ctx.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        return fail(f"dtype {str(ctx.dtype).removeprefix('torch.')} unsupported, needs one of {names}")
    return None


def check_single_node(ctx: ProbeContext) -> Capability | None:
    if ctx.single_node is None:
        return fail("cannot tell whether all ranks share this host (CUDA IPC is intra-node); "
                    "set LOCAL_WORLD_SIZE or pass single_node=True")
    if not ctx.single_node:
        return fail("ranks span several hosts and CUDA IPC is intra-node only; use nccl")
    return None


def check_p2p(ctx: ProbeContext) -> Capability | None:
    # IPC kernels spin without timeouts: on a box where P2P is broken they hang instead of
    # erroring, so an unknown status counts as a failure.
    if ctx.p2p_ok is None:
        return fail("P2P status unknown; run the P2P check (fastverify.topo.p2p.check_p2p) and pass it in")
    if not ctx.p2p_ok:
        return fail(f"{ctx.p2p_note}; IPC kernels hang without working P2P: fix P2P (ACS/IOMMU) or use nccl")
    return None


def check_sm(ctx: ProbeContext, majors: Sequence[int], why: str) -> Capability | None:
    if ctx.sm is None:
        return fail("GPU compute capability unknown (no CUDA device); run on the GPU box")
    if ctx.sm[0] not in majors:
        return fail(f"GPU is SM{ctx.sm[0]}{ctx.sm[1]}, needs SM major in {sorted(majors)} ({why}); use pcie_ipc or nccl")
    return None


# --- the interface ----------------------------------------------------------------------------


class AllReduceBackend(ABC):
    """Base class of every all-reduce backend.

    Parameters
    ----------
    group : ProcessGroup or None
        The tensor-parallel group (None: the default group). Not owned: ``close`` never destroys it.
    device : torch.device or str
        This rank's device; inputs must live there.
    dtype : torch.dtype
        Element type of the inputs (bf16/fp16 for the GPU kernels).
    max_numel : int or None
        Largest ``x.numel()`` the backend must handle; sizes IPC workspaces. None: unbounded
        (only backends without a workspace accept it).
    hidden : int or None
        Hidden size (the last dimension of every input), where the caller knows it: the fused
        backends size their workspaces in rows of it. None: not known.
    options : Mapping[str, Any] or None
        Backend-specific settings; unknown keys raise ``ValueError``. Every backend also takes
        ``norm`` (:data:`NORM_OPTION`): the residual add + RMSNorm kernel of the unfused path,
        ``"flashinfer"``, ``"torch"`` or ``"auto"``/absent (:func:`choose_norm`).

    Attributes
    ----------
    norm : NormKernel
        The kernel that adds the residual and normalizes after a plain all-reduce
        (:meth:`residual_rmsnorm`), fixed at construction.
    path_counts : collections.Counter[str]
        How many calls took each internal path (e.g. ``"fused"``, ``"fallback"``); every call is
        recorded, so a silent fallback shows up in reports.
    """

    name: BackendName  # set by each subclass (a property where it depends on the group)
    option_names: frozenset[str] = frozenset()

    def __init__(
        self,
        group: Any,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        max_numel: int | None,
        hidden: int | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        if max_numel is not None and (not isinstance(max_numel, int) or max_numel <= 0):
            raise ValueError(f"max_numel must be a positive int or None, got {max_numel!r}")
        if hidden is not None and (not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0):
            raise ValueError(f"hidden must be a positive int or None, got {hidden!r}")
        options = dict(options or {})
        allowed = self.option_names | COMMON_OPTIONS
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(
                f"unknown option(s) {sorted(unknown)} for backend {self.name.value!r}; "
                f"allowed: {sorted(allowed)}"
            )
        self.group = group
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_numel = max_numel
        self.hidden = hidden
        self.options = options
        self.path_counts: Counter[str] = Counter()
        self._closed = True  # until construction is through: nothing to release yet
        # One mechanism for every backend, so a sweep compares all-reduces on one norm kernel.
        self.norm = resolve_norm(options.get(NORM_OPTION), self.device, dtype, backend=self.name)
        self._fi_norm = FUSED_ADD_RMSNORM.resolve() if self.norm is NormKernel.FLASHINFER else None
        self._closed = False

    # -- capability -----------------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def probe(cls, ctx: ProbeContext) -> Capability:
        """Hard requirements (library and version, world size, dtype, GPU arch, P2P), checked
        once before construction. Never raises for a missing capability, never communicates."""

    def supports(self, x: Tensor) -> bool:
        """Whether ``all_reduce(x)`` can run on this backend now (per call, cheap, no sync).
        The default checks dtype, device, 2-D shape and ``max_numel``."""
        return (
            not self._closed
            and x.dtype == self.dtype
            and x.device.type == self.device.type
            and x.dim() == 2
            and (self.max_numel is None or x.numel() <= self.max_numel)
        )

    # -- collectives ----------------------------------------------------------------------------

    @abstractmethod
    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum ``x`` over the group, out-of-place.

        Parameters
        ----------
        x : Tensor
            Shape ``(T, hidden)``, ``self.dtype``, on ``self.device``, contiguous. Not modified.

        Returns
        -------
        Tensor
            New tensor, same shape/dtype/device as ``x``: the elementwise sum over all ranks.
        """

    def all_reduce_residual_rmsnorm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """All-reduce ``x``, add ``residual``, RMSNorm the sum.

        Parameters
        ----------
        x : Tensor
            Shape ``(T, hidden)``, this rank's partial output, not modified.
        residual : Tensor
            Shape ``(T, hidden)``, same dtype/device as ``x``, not modified.
        weight : Tensor
            Shape ``(hidden,)``, the RMSNorm gamma, same dtype/device.
        eps : float
            RMSNorm epsilon.

        Returns
        -------
        (normed, residual_out) : tuple[Tensor, Tensor]
            ``residual_out = residual + all_reduce(x)`` and
            ``normed = residual_out / sqrt(mean(residual_out**2, -1) + eps) * weight``, both new
            ``(T, hidden)`` tensors in ``x.dtype``; the add and the norm are computed in fp32.
        """
        _check_norm_args(x, residual, weight)
        self.path_counts["unfused"] += 1
        return self.residual_rmsnorm(self.all_reduce(x), residual, weight, eps)

    def residual_rmsnorm(
        self, reduced: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """Residual add + RMSNorm of an already reduced tensor with this backend's :attr:`norm`
        kernel: the step after a plain all-reduce, the same kernel for every backend given the
        same ``norm`` option.

        Parameters
        ----------
        reduced : Tensor
            ``(T, hidden)``, contiguous, the all-reduce's own output: the FlashInfer kernel
            overwrites it with the result (in place), so pass nothing the caller still reads.
        residual : Tensor
            ``(T, hidden)``, not modified. weight : ``(hidden,)``. eps : RMSNorm epsilon.

        Returns
        -------
        (normed, residual_out) : tuple[Tensor, Tensor]
            As :meth:`all_reduce_residual_rmsnorm`, in ``reduced.dtype``.
        """
        if self._fi_norm is None:
            return add_rmsnorm(reduced, residual, weight, eps)
        residual_out = residual.clone(memory_format=torch.contiguous_format)
        # In place (flashinfer/norm/__init__.py): residual_out += reduced, then
        # reduced = RMSNorm(residual_out) * weight. PDL off: the all-reduce kernels before it do not
        # take part in programmatic dependent launch.
        self._fi_norm(
            **FUSED_ADD_RMSNORM.kwargs(input=reduced, residual=residual_out, weight=weight, eps=eps, enable_pdl=False)
        )
        return reduced, residual_out

    # -- lifetime -------------------------------------------------------------------------------

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Hook run before CUDA-graph capture with the shapes that will be captured
        (allocate/register buffers, tune). Collective: every rank must call it. Default: nothing."""

    def close(self) -> None:
        """Release buffers. Idempotent; collective for IPC backends (every rank must call it)."""
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "AllReduceBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Never tear anything down here: IPC/collective teardown at GC time deadlocks when ranks
        # collect at different moments (STYLE.md §6 rule 16).
        if not getattr(self, "_closed", True):
            warnings.warn(f"{type(self).__name__} was not closed; call close()", ResourceWarning, stacklevel=2)


def _check_norm_args(x: Tensor, residual: Tensor, weight: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (T, hidden), got shape {tuple(x.shape)}")
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} must be (hidden,) = ({x.shape[-1]},)")
    if residual.dtype != x.dtype or weight.dtype != x.dtype:
        raise TypeError(
            f"x, residual, weight dtypes must match, got {x.dtype}, {residual.dtype}, {weight.dtype}"
        )


def add_rmsnorm(reduced: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Torch residual add + RMSNorm on an already reduced tensor, in fp32, results in
    ``reduced.dtype``. The norm reads the rounded ``residual_out`` as the next layer will.
    Returns new ``(normed, residual_out)`` tensors of shape ``reduced.shape``."""
    residual_out = (reduced.float() + residual.float()).to(reduced.dtype)
    r = residual_out.float()
    normed = r * torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return normed.to(reduced.dtype), residual_out


# --- reference and comparison -----------------------------------------------------------------


def reference_residual_rmsnorm(
    xs: Sequence[Tensor], residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """The plain torch result every backend is checked against, computed in fp32 on one process.

    Parameters
    ----------
    xs : sequence of Tensor
        One ``(T, hidden)`` tensor per rank (the inputs of the all-reduce), any float dtype.
    residual : Tensor
        ``(T, hidden)``; weight : ``(hidden,)``; eps : RMSNorm epsilon.

    Returns
    -------
    (normed, residual_out) : tuple[Tensor, Tensor]
        fp32 CPU tensors, ``(T, hidden)`` each; no rounding to the input dtype anywhere.
    """
    if not xs:
        raise ValueError("xs must hold one tensor per rank, got an empty sequence")
    total = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x in xs:
        if x.shape != xs[0].shape:
            raise ValueError(f"all xs must have one shape, got {tuple(x.shape)} and {tuple(xs[0].shape)}")
        total += x.detach().float().cpu()
    r = total + residual.detach().float().cpu()
    normed = r * torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.detach().float().cpu()
    return normed, r


# Normwise relative tolerance per dtype: max|got - want| / max|want| must not exceed it.
# Normwise, not elementwise: a near-zero element produced by cancellation has no meaningful
# elementwise relative error. The bound is 4 machine epsilons (bf16 2**-7, fp16 2**-10), enough for
# an 8-rank reduction in a different order plus the rounding of the inputs and of the output, and
# still far below the error of a dropped rank (~1/sqrt(world_size)) or a skipped all-reduce (~1).
# fp32 gets 1e-5 because different summation orders of thousands of terms exceed 4 eps (4.8e-7).
TOLERANCE: dict[torch.dtype, float] = {
    torch.bfloat16: 4 * 2.0**-7,  # 0.03125
    torch.float16: 4 * 2.0**-10,  # 0.00391
    torch.float32: 1e-5,
    torch.float64: 1e-12,
}


def check_close(got: Tensor, want: Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """Compare a backend's output with the reference.

    Parameters
    ----------
    got : Tensor
        The backend's output, any device/dtype.
    want : Tensor
        The reference (fp32), same shape.
    dtype : torch.dtype
        The dtype the backend ran in; picks the tolerance from :data:`TOLERANCE`.

    Returns
    -------
    (ok, max_rel_err) : tuple[bool, float]
        ``max_rel_err = max|got - want| / max|want|`` (inf when ``got`` has NaN/Inf, or when
        ``want`` is all zeros and ``got`` is not); ``ok`` when it is within the tolerance.
    """
    if dtype not in TOLERANCE:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {[str(d) for d in TOLERANCE]}")
    if tuple(got.shape) != tuple(want.shape):
        raise ValueError(f"shape mismatch: got {tuple(got.shape)}, want {tuple(want.shape)}")
    g = got.detach().double().cpu()
    w = want.detach().double().cpu()
    if not torch.isfinite(g).all():
        return False, float("inf")
    err = (g - w).abs().max().item() if g.numel() else 0.0
    scale = w.abs().max().item() if w.numel() else 0.0
    rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
    return rel <= TOLERANCE[dtype], rel


# --- external APIs: called through a table the signature test checks ---------------------------


@dataclass(frozen=True)
class ExternalCall:
    """One function, class or constant of an external library that a backend uses, with the
    parameter names the backend passes. Backends build their keyword arguments through
    :meth:`kwargs`, which refuses names missing from ``params``; ``tests/test_backend_signatures.py``
    checks ``params`` against the real signatures. So code, table and library cannot drift apart.

    Attributes
    ----------
    public : str
        Module the backend imports the name from (``"flashinfer.comm"``).
    qualname : str
        Dotted path inside ``public``: ``"allreduce_fusion"``, ``"PcieIpcAllReduceWorkspace.tune"``.
    defined_in : str
        Module whose source defines it (``"flashinfer.comm.allreduce"``), for reading the
        source without importing the library.
    params : tuple[str, ...]
        Keyword names the backend passes (all arguments are passed by keyword).
    kind : str
        ``"function"``, ``"class"`` (params checked against ``__init__``), ``"method"`` or
        ``"attribute"`` (a constant; params empty).
    """

    public: str
    qualname: str
    defined_in: str
    params: tuple[str, ...] = ()
    kind: str = "function"

    def resolve(self) -> Any:
        """Import ``public`` and return the object (``ImportError``/``AttributeError`` if absent)."""
        obj: Any = importlib.import_module(self.public)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def kwargs(self, **kw: Any) -> dict[str, Any]:
        unknown = sorted(set(kw) - set(self.params))
        assert not unknown, f"{self.qualname}: {unknown} not in its ExternalCall table entry"
        return kw


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def library_status(
    module: str, dist_name: str, min_version: tuple[int, ...], needed: Sequence[ExternalCall]
) -> Capability:
    """Whether ``module`` imports, is at least ``min_version`` and has every name in ``needed``.
    Importing is the test (a broken CUDA/JIT install fails here, not mid-collective)."""
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # ImportError, or a library failing inside its own import
        return fail(
            f"{module} not importable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            f"pip install '{dist_name}>={'.'.join(map(str, min_version))}'"
        )
    version = str(getattr(mod, "__version__", "") or "")
    if not version:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version(dist_name)
        except Exception:
            version = "0"
    if _version_tuple(version) < min_version:
        return fail(
            f"{dist_name} {version} is older than {'.'.join(map(str, min_version))}; "
            f"pip install -U '{dist_name}>={'.'.join(map(str, min_version))}'"
        )
    for call in needed:
        try:
            call.resolve()
        except Exception as err:
            return fail(
                f"{dist_name} {version} lacks {call.public}.{call.qualname} ({type(err).__name__}); "
                f"install a version that has it"
            )
    return Capability(True, f"{dist_name} {version}")


# --- the norm after the all-reduce -----------------------------------------------------------
# Why one mechanism: a backend that adds + normalizes with FlashInfer's one fused kernel while
# another uses ~13 fp32 torch kernels wins by the norm, not the all-reduce, and a verify step
# multiplies the difference by ~123 calls (issue 9, item 6).


class NormKernel(StrEnum):
    """The residual add + RMSNorm that follows a plain all-reduce."""

    FLASHINFER = "flashinfer"  # flashinfer.norm.fused_add_rmsnorm: one kernel, in place
    TORCH = "torch"  # add_rmsnorm: fp32 torch ops


NORM_OPTION = "norm"
"""The option every backend takes: ``"flashinfer"``, ``"torch"`` or ``"auto"`` (absent)."""
NORM_AUTO = "auto"
COMMON_OPTIONS = frozenset({NORM_OPTION})
"""Options every backend accepts on top of its own ``option_names``."""
NORM_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes of FlashInfer's CUDA ``fused_add_rmsnorm`` (``DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16`` in its
``data/csrc/norm.cu``: fp16 and bf16)."""

# residual += input; input = RMSNorm(residual) * weight, both in place (flashinfer/norm/__init__.py).
FUSED_ADD_RMSNORM = ExternalCall(
    "flashinfer.norm", "fused_add_rmsnorm", "flashinfer.norm",
    ("input", "residual", "weight", "eps", "enable_pdl"),
)


def _fi_norm_error() -> str | None:
    try:
        FUSED_ADD_RMSNORM.resolve()
    except Exception as err:  # ImportError, or FlashInfer failing inside its own import
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def choose_norm(device: torch.device | str, dtype: torch.dtype) -> NormKernel:
    """The norm kernel for ``norm="auto"``: FlashInfer's ``fused_add_rmsnorm`` when ``device``
    is CUDA, ``dtype`` is bf16/fp16 and ``flashinfer.norm`` imports; else torch.

    It depends only on the process and the tensors, never on the backend, so every backend (and
    every trial of a sweep: the tune worker resolves it once per trial) gets the same answer.
    Importing FlashInfer takes ~2.5 s the first time; on CPU nothing is imported.
    """
    if torch.device(device).type != "cuda" or dtype not in NORM_DTYPES:
        return NormKernel.TORCH
    return NormKernel.TORCH if _fi_norm_error() else NormKernel.FLASHINFER


def resolve_norm(
    value: Any, device: torch.device | str, dtype: torch.dtype, *, backend: BackendName | str | None = None
) -> NormKernel:
    """The :class:`NormKernel` for a ``norm`` option value.

    Raises
    ------
    ValueError
        ``value`` is not ``"flashinfer"``, ``"torch"``, ``"auto"`` or None.
    BackendUnavailable
        ``"flashinfer"`` asked for (with ``backend`` named) but ``flashinfer.norm`` does not
        import, or ``dtype`` is not bf16/fp16.
    """
    if value is None or value == NORM_AUTO:
        return choose_norm(device, dtype)
    try:
        kernel = NormKernel(value)
    except ValueError:
        raise ValueError(f"option norm must be one of {[k.value for k in NormKernel] + [NORM_AUTO]}, "
                         f"got {value!r}") from None
    if kernel is NormKernel.FLASHINFER:
        why = _fi_norm_error()
        if why is None and dtype not in NORM_DTYPES:
            why = f"dtype {str(dtype).removeprefix('torch.')} unsupported, needs bfloat16 or float16"
        if why is not None:
            reason = f"norm 'flashinfer' asked for, but flashinfer.norm.fused_add_rmsnorm is unusable ({why})"
            if backend is None:
                raise ValueError(reason)
            raise BackendUnavailable(backend, reason + "; use norm 'torch'")
    return kernel


# --- registry ---------------------------------------------------------------------------------
# The facts live in fastverify.registry (torch-free); this section only imports the classes.


def _load(info: BackendInfo) -> type["AllReduceBackend"]:
    cls = getattr(importlib.import_module(info.module), info.qualname)
    assert issubclass(cls, AllReduceBackend) and cls.name == info.name, info
    return cls


REGISTRY: tuple[BackendInfo, ...] = BACKENDS
"""The registry entries (``fastverify.registry.BACKENDS``), in preference order."""


def backend_class(name: BackendName | str) -> type[AllReduceBackend]:
    """The class registered for ``name``; ``ValueError`` naming the known backends otherwise.
    Imported only when asked for, so a missing GPU library never breaks ``import fastverify.backends``."""
    return _load(backend_info(name))


def probe(name: BackendName | str, ctx: ProbeContext) -> Capability:
    """``backend_class(name).probe(ctx)``, with any unexpected error turned into ok=False."""
    cls = backend_class(name)
    try:
        return cls.probe(ctx)
    except Exception as err:  # a probe bug must not take the sweep down; report it as the reason
        return fail(f"probe raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")


def make_backend(
    name: BackendName | str,
    group: Any,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    max_numel: int | None,
    hidden: int | None = None,
    options: Mapping[str, Any] | None = None,
    context: ProbeContext | None = None,
) -> AllReduceBackend:
    """Probe, then construct backend ``name`` on ``group``.

    ``context`` defaults to :meth:`ProbeContext.detect` (P2P unknown, so P2P-dependent backends
    fail their probe: pass a context carrying ``p2p_ok`` from the topology check).

    Raises
    ------
    BackendUnavailable
        When the probe fails; ``reason`` is the probe's one line.
    ValueError
        For an unknown name or bad options.
    """
    cls = backend_class(name)
    ctx = context or ProbeContext.detect(group, device=device, dtype=dtype)
    cap = probe(name, ctx)
    if not cap.ok:
        raise BackendUnavailable(name, cap.reason)
    return cls(group, device=device, dtype=dtype, max_numel=max_numel, hidden=hidden, options=options)


class BackendChain(AllReduceBackend):
    """Runs each call on the first backend whose ``supports`` is True (the fallback order is the
    list order, data not code). The last backend should be torch.distributed, which supports
    everything; ``path_counts`` records which backend ran every call."""

    def __init__(self, backends: Sequence[AllReduceBackend]) -> None:
        if not backends:
            raise ValueError("BackendChain needs at least one backend")
        first = backends[0]
        self.backends = list(backends)
        super().__init__(first.group, device=first.device, dtype=first.dtype, max_numel=None)

    @property
    def name(self) -> BackendName:  # type: ignore[override]
        return self.backends[0].name

    @classmethod
    def probe(cls, ctx: ProbeContext) -> Capability:
        return OK

    def _pick(self, x: Tensor) -> AllReduceBackend:
        for be in self.backends:
            if be.supports(x):
                self.path_counts[be.name.value] += 1
                return be
        raise ValueError(
            f"no backend in {[b.name.value for b in self.backends]} supports shape {tuple(x.shape)} "
            f"dtype {x.dtype}; end the chain with a torch.distributed backend"
        )

    def supports(self, x: Tensor) -> bool:
        return any(be.supports(x) for be in self.backends)

    def all_reduce(self, x: Tensor) -> Tensor:
        return self._pick(x).all_reduce(x)

    def all_reduce_residual_rmsnorm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        return self._pick(x).all_reduce_residual_rmsnorm(x, residual, weight, eps)

    def prepare(self, shapes: Sequence[Shape]) -> None:
        for be in self.backends:
            be.prepare(shapes)

    def close(self) -> None:
        for be in self.backends:
            be.close()
        super().close()
