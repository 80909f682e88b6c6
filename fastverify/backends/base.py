"""One interface for every all-reduce backend (:class:`AllReduceBackend`), the norm kernel after a
plain all-reduce (:class:`NormKernel`), and the registry's classes. Lifecycle::

    cap = Backend.probe(ctx)               # once, cheap, no collective; hard requirements only
    with make_backend(name, group, device=..., dtype=..., max_numel=...) as be:
        be.prepare([(T, hidden)])           # before CUDA-graph capture
        if be.supports(x):                  # per call: size/shape bounds
            y = be.all_reduce(x)            # out-of-place, always returns
            normed, res = be.all_reduce_residual_rmsnorm(x, residual, weight, eps)

``probe`` never raises for a missing capability: it returns ``Capability(ok=False, reason)``, one
line naming the fix; ``make_backend`` raises that as :class:`BackendUnavailable`. The probe checks
(:mod:`fastverify.backends.probing`) are re-exported here. Also here: the settings every backend is built with (:class:`BackendSettings`)
and the plain torch result every backend is checked against (:func:`reference_residual_rmsnorm`,
:func:`check_close`).

External library calls (FlashInfer, SGLang) are :class:`ExternalCall` records the signature test
checks, and every GPU backend's probe ends with the import / version check here.
"""

from __future__ import annotations

import importlib
import warnings
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch

from fastverify.backends.probing import (
    OK,
    BackendUnavailable,
    Capability,
    ProbeContext,
    check_cuda,
    check_dtype,
    check_kernel_sm,
    check_p2p,
    check_registry_limits,
    check_single_node,
    check_world_size,
    fail,
    first_failure,
    summarize_p2p,
)
from fastverify.registry import BACKENDS, LOSSLESS_TOLERANCE, BackendInfo, BackendName, backend_info


@dataclass(frozen=True)
class ExternalCall:
    """One function, class or constant of an external library that a backend uses, with the
    parameter names the backend passes. Backends build their keyword arguments through
    :meth:`kwargs`, which refuses names missing from ``params``; the test suite's signature test
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


Tensor = torch.Tensor
Shape = tuple[int, ...]

__all__ = [  # the names the backend modules and the rest of the package import from here
    "OK",
    "TOLERANCE",
    "AllReduceBackend",
    "BackendName",
    "BackendSettings",
    "BackendUnavailable",
    "Capability",
    "ExternalCall",
    "FUSED_ADD_RMSNORM",
    "NormKernel",
    "ProbeContext",
    "REGISTRY",
    "Shape",
    "Tensor",
    "add_rmsnorm",
    "backend_class",
    "check_close",
    "check_cuda",
    "check_dtype",
    "check_kernel_sm",
    "check_p2p",
    "check_registry_limits",
    "check_single_node",
    "check_world_size",
    "choose_norm",
    "fail",
    "first_failure",
    "library_status",
    "make_backend",
    "probe",
    "reference_residual_rmsnorm",
    "resolve_norm",
    "result_tolerance",
    "summarize_p2p",
]


# --- the settings every backend is built with, written once -----------------------------------


@dataclass(frozen=True, kw_only=True)
class BackendSettings:
    """How a backend is built: device, element type, sizes, backend-specific options.

    Parameters
    ----------
    device : torch.device or str
        This rank's device; inputs must live there. Stored as a :class:`torch.device`.
    dtype : torch.dtype
        Element type of the inputs (bf16/fp16 for the GPU kernels).
    max_numel : int or None
        Largest ``x.numel()`` (elements) the backend must handle; sizes IPC workspaces. None:
        unbounded (only backends without a workspace accept it). Required: no default.
    hidden : int or None
        Hidden size (elements, the last dimension of every input), where the caller knows it: the
        fused backends size their workspaces in rows of it. None: not known.
    options : Mapping[str, Any] or None
        Backend-specific settings, checked by the backend class (unknown keys raise
        ``ValueError`` there). Every backend also takes ``norm``
        (:data:`NORM_OPTION`). Stored as a read-only copy.

    Raises
    ------
    ValueError
        ``max_numel`` or ``hidden`` is not a positive int or None.
    """

    device: torch.device
    dtype: torch.dtype
    max_numel: int | None
    hidden: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        max_numel, hidden = self.max_numel, self.hidden
        if max_numel is not None and (not isinstance(max_numel, int) or max_numel <= 0):
            raise ValueError(f"max_numel must be a positive int or None, got {max_numel!r}")
        if hidden is not None and (not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0):
            raise ValueError(f"hidden must be a positive int or None, got {hidden!r}")
        object.__setattr__(self, "device", torch.device(self.device))
        object.__setattr__(self, "options", MappingProxyType(dict(self.options or {})))

    @classmethod
    def of(cls, settings: "BackendSettings | None", fields: Mapping[str, Any]) -> "BackendSettings":
        """The one adapter from keyword calls: ``settings`` itself, or a record built from
        ``fields`` (``device=``, ``dtype=``, ``max_numel=``, ``hidden=``, ``options=``).

        Raises
        ------
        TypeError
            Both or neither given, ``settings`` is not a :class:`BackendSettings`, or ``fields``
            lacks a required field or names an unknown one.
        ValueError
            As the constructor.
        """
        if settings is None:
            return cls(**fields)
        if fields:
            raise TypeError(f"pass a BackendSettings or its fields as keywords, not both (got also {sorted(fields)})")
        if not isinstance(settings, cls):
            raise TypeError(f"settings must be a BackendSettings, got {type(settings).__name__}")
        return settings


# --- the plain torch result every backend is checked against, and the comparison with it ------


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


TOLERANCE: dict[torch.dtype, float] = {getattr(torch, name): tol for name, tol in LOSSLESS_TOLERANCE.items()}
"""The lossless tolerance per dtype (:data:`fastverify.registry.LOSSLESS_TOLERANCE`, where the
bound is explained), keyed by torch dtype."""


def result_tolerance(name: BackendName | str, dtype: torch.dtype, world_size: int) -> float:
    """The normwise relative tolerance of backend ``name``'s result in ``dtype`` on ``world_size``
    ranks: its registry entry's own (:attr:`fastverify.registry.BackendInfo.tolerance`, a lossy
    backend), else the lossless one of :data:`TOLERANCE`. ``ValueError`` for a dtype with neither."""
    derive = backend_info(name).tolerance
    if derive is not None:
        return derive(str(dtype).removeprefix("torch."), world_size)
    if dtype not in TOLERANCE:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {[str(d) for d in TOLERANCE]}")
    return TOLERANCE[dtype]


def check_close(got: Tensor, want: Tensor, dtype: torch.dtype, *, tolerance: float | None = None) -> tuple[bool, float]:
    """Compare a backend's output with the reference.

    Parameters
    ----------
    got : Tensor
        The backend's output, any device/dtype.
    want : Tensor
        The reference (fp32), same shape.
    dtype : torch.dtype
        The dtype the backend ran in; picks the tolerance from :data:`TOLERANCE`.
    tolerance : float or None
        The tolerance instead, where the backend is lossy (:func:`result_tolerance`).

    Returns
    -------
    (ok, max_rel_err) : tuple[bool, float]
        ``max_rel_err = max|got - want| / max|want|`` (inf when ``got`` has NaN/Inf, or when
        ``want`` is all zeros and ``got`` is not); ``ok`` when it is within the tolerance.
    """
    if tolerance is None and dtype not in TOLERANCE:
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
    return rel <= (TOLERANCE[dtype] if tolerance is None else tolerance), rel


# --- the interface ----------------------------------------------------------------------------


class AllReduceBackend(ABC):
    """Base class of every all-reduce backend: the verify step's tensor-parallel all-reduce,
    optionally fused with the residual add + RMSNorm that follows it in every decoder layer.

    Parameters
    ----------
    group : ProcessGroup or None
        The tensor-parallel group (None: the default group). Not owned: ``close`` never destroys it.
    settings : BackendSettings, optional
        Device, dtype, ``max_numel``, ``hidden`` and ``options`` (:class:`BackendSettings`, where
        each is documented); or pass those as keywords instead (:meth:`BackendSettings.of`). Every
        backend takes the ``norm`` option (:data:`NORM_OPTION`): the residual add + RMSNorm kernel
        of the unfused path, ``"flashinfer"``, ``"torch"`` or ``"auto"``/absent (:func:`choose_norm`).
        A subclass declares its own option names in ``option_names`` and builds its resources in
        :meth:`_setup`, never in ``__init__``.

    Raises
    ------
    ValueError
        Bad ``max_numel``/``hidden`` or an option outside ``option_names`` and ``norm``.
    TypeError
        Both ``settings`` and keyword fields, or a missing field.
    BackendUnavailable
        ``norm="flashinfer"`` that cannot run, or whatever the subclass's :meth:`_setup` raises.

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

    def __init__(self, group: Any, settings: BackendSettings | None = None, **fields: Any) -> None:
        settings = BackendSettings.of(settings, fields)
        options = dict(settings.options)
        allowed = self.option_names | COMMON_OPTIONS
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(
                f"unknown option(s) {sorted(unknown)} for backend {self.name.value!r}; allowed: {sorted(allowed)}"
            )
        self.settings = settings
        self.group = group
        self.device = settings.device
        self.dtype = settings.dtype
        self.max_numel = settings.max_numel
        self.hidden = settings.hidden
        self.options = options
        self.path_counts: Counter[str] = Counter()
        self._closed = True  # until construction is through: nothing to release yet
        # One mechanism for every backend, so a sweep compares all-reduces on one norm kernel.
        self.norm = resolve_norm(options.get(NORM_OPTION), self.device, self.dtype, backend=self.name)
        self._fi_norm = FUSED_ADD_RMSNORM.resolve() if self.norm is NormKernel.FLASHINFER else None
        self._closed = False
        try:
            self._setup()
        except BaseException:
            self._closed = True  # a failed setup leaves nothing for close() to release
            raise

    def _setup(self) -> None:
        """Build this backend's resources from the attributes set by ``__init__`` (``group``,
        ``device``, ``dtype``, ``max_numel``, ``hidden``, ``options``). Collective where the
        backend's construction is. Raises :class:`BackendUnavailable` (the same on every rank)
        for a setting the backend cannot take. Default: nothing to build."""

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

        This base implementation (the unfused path of every plain all-reduce backend) works in
        place like SGLang's own plain path: SGLang 0.5.23 ``RMSNorm.forward_cuda`` with a residual
        (``sglang/srt/layers/layernorm.py``) calls ``fused_add_rmsnorm``, which adds into the
        residual it was given. So no copy of ``residual`` is made on any call; a caller that
        still needs the old residual copies it itself, before (and outside any timing of) the
        call. Fused backends override this and leave ``residual`` untouched.

        Every backend's version always performs the all-reduce: where a fused kernel declines it
        falls back to ``all_reduce`` + add + norm, never to the norm alone (SGLang 0.5.23's
        ``flashinfer_allreduce_residual_rmsnorm``, ``sglang/srt/layers/flashinfer_comm_fusion.py``,
        returns ``(None, None)`` then and leaves the all-reduce to its caller).

        Parameters
        ----------
        x : Tensor
            Shape ``(T, hidden)``, this rank's partial output, not modified.
        residual : Tensor
            Shape ``(T, hidden)``, same dtype/device as ``x``, contiguous. Overwritten here with
            ``residual + all_reduce(x)`` (rounded to its dtype).
        weight : Tensor
            Shape ``(hidden,)``, the RMSNorm gamma, same dtype/device.
        eps : float
            RMSNorm epsilon.

        Returns
        -------
        (normed, residual_out) : tuple[Tensor, Tensor]
            ``residual_out = residual + all_reduce(x)`` and
            ``normed = residual_out / sqrt(mean(residual_out**2, -1) + eps) * weight``, ``(T, hidden)``
            in ``x.dtype``; the add and the norm are computed in fp32. ``residual_out`` *is*
            ``residual`` (same storage); ``normed`` is a tensor the caller did not pass.

        Raises
        ------
        ValueError
            Shapes that do not match, or a non-contiguous ``residual`` (an in-place update of a
            contiguous copy would be lost), before any collective.
        TypeError
            Dtypes that differ.
        """
        _check_norm_args(x, residual, weight)
        _check_inplace_residual(residual)
        self.path_counts["unfused"] += 1
        return self.residual_rmsnorm(self.all_reduce(x), residual, weight, eps)

    def residual_rmsnorm(self, reduced: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """Residual add + RMSNorm of an already reduced tensor with this backend's :attr:`norm`
        kernel: the step after a plain all-reduce, the same kernel for every backend given the
        same ``norm`` option.

        Parameters
        ----------
        reduced : Tensor
            ``(T, hidden)``, contiguous, the all-reduce's own output: the FlashInfer kernel
            overwrites it with the result (in place), so pass nothing the caller still reads.
        residual : Tensor
            ``(T, hidden)``, contiguous; updated in place to ``residual + reduced``, on both
            kernels (no copy: see :meth:`all_reduce_residual_rmsnorm`). weight : ``(hidden,)``.
            eps : RMSNorm epsilon.

        Returns
        -------
        (normed, residual) : tuple[Tensor, Tensor]
            As :meth:`all_reduce_residual_rmsnorm`, in ``reduced.dtype``; the second is the
            ``residual`` passed in.
        """
        _check_inplace_residual(residual)
        if self._fi_norm is None:
            return _add_rmsnorm_inplace(reduced, residual, weight, eps)
        # In place (flashinfer/norm/__init__.py): residual += reduced, then
        # reduced = RMSNorm(residual) * weight. PDL off: the all-reduce kernels before it do not
        # take part in programmatic dependent launch.
        self._fi_norm(
            **FUSED_ADD_RMSNORM.kwargs(input=reduced, residual=residual, weight=weight, eps=eps, enable_pdl=False)
        )
        return reduced, residual

    def _residual_rmsnorm_copy(
        self, reduced: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """:meth:`residual_rmsnorm` into a contiguous copy of ``residual``: the unfused path of a
        fused backend, whose kernel leaves ``residual`` unwritten, so the method's contract is the
        kernel's on every path; SGLang 0.5.23 copies likewise when its fused kernel declines
        (``_forward_with_allreduce_fusion`` in ``sglang/srt/layers/layernorm.py``:
        ``residual.clone()``). Returns new ``(normed, residual_out)``, ``(T, hidden)``."""
        fresh = residual.clone(memory_format=torch.contiguous_format)
        return self.residual_rmsnorm(reduced, fresh, weight, eps)

    # -- lifetime -------------------------------------------------------------------------------

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Hook run before CUDA-graph capture with the shapes that will be captured
        (allocate/register buffers, tune). Collective: every rank must call it. Default: nothing."""

    def close(self) -> None:
        """Release buffers (:meth:`_release`) once; idempotent. Collective for IPC backends
        (every rank must call it). The backend counts as closed even when the release raises."""
        if self._closed:
            return
        try:
            self._release()
        finally:
            self._closed = True

    def _release(self) -> None:
        """Free what :meth:`_setup` built; run once, by :meth:`close`. Default: nothing."""

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "AllReduceBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Never tear anything down here: IPC/collective teardown at GC time deadlocks when ranks
        # collect at different moments.
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
        raise TypeError(f"x, residual, weight dtypes must match, got {x.dtype}, {residual.dtype}, {weight.dtype}")


def _check_inplace_residual(residual: Tensor) -> None:
    if not residual.is_contiguous():
        raise ValueError(f"residual must be contiguous (it is updated in place), got strides {residual.stride()}")


def add_rmsnorm(reduced: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Torch residual add + RMSNorm on an already reduced tensor, in fp32, results in
    ``reduced.dtype``: the out-of-place reference of the plain path, for checks that must run the
    backend on the same ``residual`` afterwards. Neither input is modified. The norm reads the
    rounded ``residual_out`` as the next layer will. Returns new ``(normed, residual_out)``
    tensors of shape ``reduced.shape``."""
    residual_out = (reduced.float() + residual.float()).to(reduced.dtype)
    r = residual_out.float()
    normed = r * torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return normed.to(reduced.dtype), residual_out


def _add_rmsnorm_inplace(reduced: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """:func:`add_rmsnorm` with the sum written into ``residual`` (the torch kernel of
    :meth:`AllReduceBackend.residual_rmsnorm`). ``add_`` on bf16/fp16 adds in fp32 and rounds once,
    as ``add_rmsnorm``'s ``(a.float() + b.float()).to(dtype)`` does. Returns ``(normed, residual)``."""
    residual.add_(reduced)
    r = residual.float()
    normed = r * torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return normed.to(reduced.dtype), residual


# --- the norm after the all-reduce -----------------------------------------------------------
# Why one mechanism: a backend that adds + normalizes with FlashInfer's one fused kernel while
# another uses ~13 fp32 torch kernels wins by the norm, not the all-reduce, and a verify step
# multiplies the difference by ~123 calls.


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
    "flashinfer.norm",
    "fused_add_rmsnorm",
    "flashinfer.norm",
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
        raise ValueError(
            f"option norm must be one of {[k.value for k in NormKernel] + [NORM_AUTO]}, got {value!r}"
        ) from None
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
    settings: BackendSettings | None = None,
    *,
    context: ProbeContext | None = None,
    **fields: Any,
) -> AllReduceBackend:
    """Probe, then construct backend ``name`` on ``group``.

    ``settings`` is a :class:`BackendSettings`, or its fields are passed as keywords
    (``device=``, ``dtype=``, ``max_numel=``, ``hidden=``, ``options=``). ``context`` defaults to
    :meth:`ProbeContext.detect` (P2P unknown, so P2P-dependent backends fail their probe: pass a
    context carrying ``p2p_ok`` from the topology check).

    Raises
    ------
    BackendUnavailable
        When the probe fails; ``reason`` is the probe's one line.
    ValueError
        For an unknown name or bad options.
    TypeError
        Both ``settings`` and keyword fields, or a missing field.
    """
    cls = backend_class(name)
    settings = BackendSettings.of(settings, fields)
    ctx = context or ProbeContext.detect(group, device=settings.device, dtype=settings.dtype)
    cap = probe(name, ctx)
    if not cap.ok:
        raise BackendUnavailable(name, cap.reason)
    return cls(group, settings)
