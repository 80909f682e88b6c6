"""SGLang's custom all-reduce (the legacy ``CustomAllreduce`` class of
``sglang.srt.distributed.device_communicators.custom_all_reduce``, a port of vLLM's one).

Only where it can run (the registry's entry, from SGLang 0.5.23 ``custom_all_reduce.py`` and
``custom_all_reduce_utils.py``): world size 2, or 4/6/8 with every GPU pair on NVLink; SGLang
itself disables it for more than two PCIe-only GPUs ("not supported on more than two PCIe-only
GPUs"), and its kernel launches nothing at 4/8 ranks without full NVLink. It needs
working P2P (CUDA IPC buffers) and all ranks on one host. The all-reduce is out-of-place; residual
add + RMSNorm use the base class's path with the ``norm`` kernel every backend shares
(:func:`fastverify.backends.base.choose_norm`).

The class is used directly rather than through ``dispatch_custom_allreduce()``, which returns
``CustomAllReduceV2`` in newer SGLang (needs full NVLink, different methods). Importing SGLang
pulls in its whole runtime; the probe does that once.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed as dist

from fastverify.backends.base import (
    AllReduceBackend,
    BackendName,
    BackendUnavailable,
    Capability,
    ExternalCall,
    ProbeContext,
    Tensor,
    fail,
    library_status,
)
from fastverify.backends.ipc import element_size, ipc_requirements, new_gloo_group, whole_packs
from fastverify.registry import backend_info

MODULE = "sglang.srt.distributed.device_communicators.custom_all_reduce"
MIN_SGLANG = (0, 4)
INFO = backend_info(BackendName.custom_ar)
"""The registry entry: world sizes (``CustomAllreduce._SUPPORTED_WORLD_SIZES``), the ones that run
without full NVLink, and dtypes, as the probe checks them."""
DEFAULT_MAX_BYTES = 8 * 1024 * 1024  # CustomAllreduce._MAX_CAR_SIZE on CUDA

CUSTOM_ALLREDUCE = ExternalCall(MODULE, "CustomAllreduce", MODULE, ("group", "device", "max_size"), "class")
SHOULD_CUSTOM_AR = ExternalCall(MODULE, "CustomAllreduce.should_custom_ar", MODULE, ("inp",), "method")
CUSTOM_ALL_REDUCE = ExternalCall(MODULE, "CustomAllreduce.custom_all_reduce", MODULE, ("input",), "method")
CAPTURE = ExternalCall(MODULE, "CustomAllreduce.capture", MODULE, (), "method")
CLOSE = ExternalCall(MODULE, "CustomAllreduce.close", MODULE, (), "method")
EXTERNAL_CALLS = (CUSTOM_ALLREDUCE, SHOULD_CUSTOM_AR, CUSTOM_ALL_REDUCE, CAPTURE, CLOSE)


class SglangCustomArBackend(AllReduceBackend):
    """SGLang ``CustomAllreduce`` on the ranks of ``group``; collective construction.

    Options
    -------
    cpu_group : ProcessGroup
        gloo group over the same ranks; SGLang exchanges IPC handles with
        ``broadcast_object_list(device="cpu")``, which an NCCL group cannot carry. Built here
        (and destroyed by :meth:`close`) when omitted and ``group`` spans the default group.
    """

    name = BackendName.custom_ar
    option_names = frozenset({"cpu_group"})

    @classmethod
    def probe(cls, ctx: ProbeContext) -> Capability:
        bad = ipc_requirements(ctx, INFO, fabric=_check_fabric(ctx))
        if bad is not None:
            return bad
        lib = library_status("sglang", "sglang", MIN_SGLANG, EXTERNAL_CALLS)
        if not lib.ok:
            return lib
        try:
            from sglang.srt.distributed.device_communicators import custom_all_reduce_ops as ops
        except Exception as err:
            return fail(f"sglang custom all-reduce ops not importable ({type(err).__name__}); install sgl-kernel")
        if not getattr(ops, "IS_CUSTOM_AR_AVAILABLE", False):
            return fail("sglang reports its custom all-reduce kernels unavailable (sgl-kernel missing or not CUDA)")
        return lib

    def _setup(self) -> None:
        """Build (or take) the gloo CPU group and SGLang's ``CustomAllreduce`` (collective);
        on failure release what was built.

        Raises
        ------
        ValueError
            ``group`` is a strict subgroup and no ``cpu_group`` option was given.
        BackendUnavailable
            SGLang's ``CustomAllreduce`` disabled itself.
        """
        group, dtype, max_numel = self.group, self.dtype, self.max_numel
        self._own_cpu_group = False
        self._ca: Any = None
        try:
            cpu_group = self.options.get("cpu_group")
            if cpu_group is None:
                cpu_group = new_gloo_group(
                    group,
                    "group is a strict subgroup: new_group() is collective over the default group, so "
                    "pass options={'cpu_group': <gloo group built by all ranks>}",
                )
                self._own_cpu_group = True
            self._cpu_group = cpu_group
            max_bytes = DEFAULT_MAX_BYTES if max_numel is None else whole_packs(max_numel * element_size(dtype))
            self._ca = CUSTOM_ALLREDUCE.resolve()(
                **CUSTOM_ALLREDUCE.kwargs(group=cpu_group, device=self.device, max_size=max_bytes)
            )
            if self._ca.disabled:
                # SGLang decided on every rank the same way (world size, NVLink, P2P, kernels).
                raise BackendUnavailable(
                    self.name, "SGLang's CustomAllreduce disabled itself (its log says why: world size, NVLink or P2P)"
                )
        except BaseException:
            self._release()
            self._closed = True
            raise

    def supports(self, x: Tensor) -> bool:
        # SGLang's own test: 16-byte multiple, weakly contiguous, <= max_size, ws 2 or full NVLink.
        return super().supports(x) and bool(self._ca.should_custom_ar(**SHOULD_CUSTOM_AR.kwargs(inp=x)))

    def all_reduce(self, x: Tensor) -> Tensor:
        out = self._ca.custom_all_reduce(**CUSTOM_ALL_REDUCE.kwargs(input=x))
        if out is None:
            # SGLang returns None for "not handled"; never hand that on as a result.
            raise ValueError(
                f"SGLang custom all-reduce declined shape {tuple(x.shape)} {x.dtype}; check supports() first"
            )
        self.path_counts["all_reduce"] += 1
        return out

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Wrap a ``torch.cuda.graph`` capture: SGLang registers the graph's buffers on exit
        (collective). Only for a real capture: inside SGLang's ``capture()`` context but outside
        stream capture, ``custom_all_reduce`` returns zeros (graph warm-up allocation mimicry), so
        never call :meth:`all_reduce` eagerly inside it."""
        with self._ca.capture():
            yield

    def _release(self) -> None:
        """Free SGLang's IPC buffers and the gloo group built here. Collective; also run by a
        failed :meth:`_setup` on what it built."""
        try:
            if self._ca is not None:
                self._ca.close()
        finally:
            self._ca = None
            if self._own_cpu_group:
                dist.destroy_process_group(self._cpu_group)
                self._own_cpu_group = False


def _check_fabric(ctx: ProbeContext) -> Capability | None:
    """Full NVLink beyond the registry's ``world_sizes_without_nvlink`` (2: ``nvlink_gate``)."""
    plain = INFO.world_sizes_without_nvlink or ()
    if ctx.world_size in plain or ctx.nvlink_full:
        return None
    sizes = "/".join(map(str, plain))
    if ctx.nvlink_full is None:
        return fail(
            f"NVLink status unknown at world size {ctx.world_size}; SGLang's custom all-reduce needs "
            f"{sizes} GPUs or full NVLink: pass nvlink_full from nvidia-smi topo -m"
        )
    return fail(
        f"world size {ctx.world_size} without full NVLink: SGLang's custom all-reduce runs only on {sizes} "
        "PCIe GPUs or fully NVLinked GPUs; use pcie_ipc or nccl"
    )
