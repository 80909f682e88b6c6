"""Probes: a backend's hard requirements, checked before anything is built or communicated.

:class:`ProbeContext` holds the facts a probe may look at (world size, device, dtype, GPU, P2P,
NVLink, host); each ``check_*`` returns a failed :class:`Capability` whose one-line reason names
the fix, or None when satisfied, so a probe is the first failure of a list of checks
(:func:`first_failure`). World sizes, dtypes and GPU architectures come from the backend's registry
entry only (:func:`check_registry_limits`, :mod:`fastverify.registry`). Everything here is
re-exported by :mod:`fastverify.backends.base`, where the backends import it from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from fastverify.errors import UserError
from fastverify.registry import BackendInfo, BackendName, sm_text


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


def check_dtype(ctx: ProbeContext, allowed: Sequence[torch.dtype], why: str = "") -> Capability | None:
    if ctx.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        return fail(f"dtype {str(ctx.dtype).removeprefix('torch.')} unsupported, needs one of {names}{why}")
    return None


def check_single_node(ctx: ProbeContext) -> Capability | None:
    if ctx.single_node is None:
        return fail(
            "cannot tell whether all ranks share this host (CUDA IPC is intra-node); "
            "set LOCAL_WORLD_SIZE or pass single_node=True"
        )
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


def check_kernel_sm(ctx: ProbeContext, info: BackendInfo, why: str) -> Capability | None:
    """The GPU architectures of ``info``'s kernel (registry ``kernel_sm`` / ``kernel_sm_majors``;
    :meth:`BackendInfo.kernel_runs_on`); ``why`` names the source of the limit."""
    if info.kernel_sm is None and info.kernel_sm_majors is None:
        return None
    if ctx.sm is None:
        return fail("GPU compute capability unknown (no CUDA device); run on the GPU box")
    if info.kernel_runs_on(ctx.sm):
        return None
    want = (
        "/".join(sm_text(s) for s in info.kernel_sm)
        if info.kernel_sm is not None
        else f"SM major in {sorted(info.kernel_sm_majors or ())}"
    )
    return fail(f"GPU is {sm_text(ctx.sm)}, needs {want} ({why}); use pcie_ipc or nccl")


def check_registry_limits(ctx: ProbeContext, info: BackendInfo, sm_why: str = "") -> Capability | None:
    """Every hard limit the registry holds for ``info`` (:mod:`fastverify.registry`), in probe
    order: world size (``world_sizes``), dtype (``dtypes``, with ``dtype_gate`` as the source when
    set), GPU architecture (:func:`check_kernel_sm`, ``sm_why`` its source). The backends' probes
    read their limits only through this, so probe and registry cannot disagree."""
    dtype_why = f" ({info.dtype_gate})" if info.dtype_gate else ""
    return first_failure(
        check_world_size(ctx, info.world_sizes) if info.world_sizes is not None else None,
        check_dtype(ctx, tuple(getattr(torch, name) for name in info.dtypes), dtype_why),
        check_kernel_sm(ctx, info, sm_why),
    )
