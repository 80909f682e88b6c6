"""What the CUDA IPC backends (``pcie_ipc``, ``b12x``, ``fused``, ``custom_ar``) share: the hard
requirements their probes check before the slow library import, workspace byte sizes, the
``torch.distributed`` fallback all-reduce, and the gloo group SGLang-style handle exchanges need.

Their kernels map peer GPU buffers and spin on peer flags with no timeout, so each needs CUDA,
all ranks on one host and working P2P on top of its registry limits (:func:`ipc_requirements`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from fastverify.backends.base import ExternalCall, library_status
from fastverify.backends.probing import (
    Capability,
    ProbeContext,
    check_cuda,
    check_p2p,
    check_registry_limits,
    check_single_node,
    first_failure,
)
from fastverify.registry import BackendInfo

PACK_BYTES = 16  # the IPC kernels move 16-byte packs


def ipc_requirements(
    ctx: ProbeContext, info: BackendInfo, sm_why: str = "", *, fabric: Capability | None = None
) -> Capability | None:
    """The first failed hard requirement of an IPC backend, in probe order: CUDA, the registry's
    limits of ``info`` (``sm_why`` names the source of its GPU-architecture gate), the backend's
    own ``fabric`` check (None: none), one host, working P2P. None when all hold."""
    return first_failure(
        check_cuda(ctx),
        check_registry_limits(ctx, info, sm_why),
        fabric,
        check_single_node(ctx),
        check_p2p(ctx),
    )


def flashinfer_status(min_version: tuple[int, ...], needed: Sequence[ExternalCall]) -> Capability:
    """:func:`~fastverify.backends.base.library_status` of ``flashinfer`` (distribution
    ``flashinfer-python``): imports, is at least ``min_version`` and has every name in ``needed``."""
    return library_status("flashinfer", "flashinfer-python", min_version, needed)


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def whole_packs(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of :data:`PACK_BYTES` packs."""
    return -(-nbytes // PACK_BYTES) * PACK_BYTES


def torch_all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``torch.distributed.all_reduce`` (sum) of a contiguous copy of ``x`` on ``group``: the
    fallback of a backend whose kernel does not take ``x``. ``x`` is not modified."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def new_gloo_group(group: Any, subgroup_error: str) -> Any:
    """A new gloo group over the ranks of ``group`` (None: the default group).

    ``new_group`` is collective over the default group, so only a group spanning it gets one;
    for a strict subgroup this raises ``ValueError(subgroup_error)`` on every rank alike.
    """
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if len(ranks) != dist.get_world_size():
        raise ValueError(subgroup_error)
    return dist.new_group(ranks=ranks, backend="gloo")
