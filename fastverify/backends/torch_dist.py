"""``torch.distributed.all_reduce`` as a backend: NCCL on GPUs, gloo on CPU.

The last resort of every fallback chain (it supports any shape) and the baseline every other
backend is measured against. Residual add + RMSNorm is the base class's unfused path, with the
``norm`` kernel every backend shares (:func:`fastverify.backends.base.choose_norm`): on a GPU,
FlashInfer's ``fused_add_rmsnorm`` where it imports, as for ``pcie_ipc``, so rankings compare
all-reduces, not norms.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastverify.backends.base import (
    OK,
    AllReduceBackend,
    BackendName,
    Capability,
    ProbeContext,
    Tensor,
    fail,
)


class TorchDistBackend(AllReduceBackend):
    """``dist.all_reduce(SUM)`` on a clone of the input.

    ``name`` follows the group's backend: :class:`NcclBackend` or :class:`GlooBackend`, each
    refusing a group of the other kind. ``max_numel`` is accepted and ignored: there is no
    workspace, every size is supported.
    """

    _expected: str  # the torch.distributed backend string this class runs on
    _device_type: str  # the tensors' device type it takes
    _device_rule: str  # the probe's words for that rule
    _device_fix: str  # what to use on another device

    def _setup(self) -> None:
        """Raises ``ValueError`` when ``group`` does not run this class's torch.distributed backend."""
        actual = str(dist.get_backend(self.group)).lower()
        if actual != self._expected:
            raise ValueError(
                f"{type(self).__name__} needs a {self._expected!r} process group, got {actual!r}; "
                f"build the backend named {actual!r} instead"
            )

    @classmethod
    def probe(cls, ctx: ProbeContext) -> Capability:
        if not (dist.is_available() and dist.is_initialized()):
            return fail("torch.distributed is not initialized; call init_process_group first")
        if ctx.group_backend != cls._expected:
            return fail(
                f"process group backend is {ctx.group_backend!r}, not {cls._expected!r}; "
                f"init the group with backend={cls._expected!r}"
            )
        if ctx.device_type != cls._device_type:
            return fail(f"{cls._device_rule}, device is {ctx.device_type!r}; use {cls._device_fix}")
        return OK

    def supports(self, x: Tensor) -> bool:
        # No workspace, no size bound: only the tensor's placement matters.
        return not self.closed and x.dtype == self.dtype and x.device.type == self.device.type

    def all_reduce(self, x: Tensor) -> Tensor:
        if x.device.type != self.device.type:
            raise ValueError(f"x is on {x.device}, backend {self.name.value!r} expects {self.device.type}")
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        self.path_counts["all_reduce"] += 1
        return out


class NcclBackend(TorchDistBackend):
    name = BackendName.nccl
    _expected = "nccl"
    _device_type, _device_rule, _device_fix = "cuda", "NCCL needs CUDA tensors", "gloo on CPU"


class GlooBackend(TorchDistBackend):
    """gloo on CPU tensors only: its CUDA all-reduce stages through host memory, so it is never a
    contender on GPUs."""

    name = BackendName.gloo
    _expected = "gloo"
    _device_type, _device_rule, _device_fix = "cpu", "gloo is used for CPU tensors only", "nccl"
