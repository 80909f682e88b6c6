"""FlashInfer's PCIe IPC all-reduce (``flashinfer.comm.PcieIpcAllReduceWorkspace``, FlashInfer
>= 0.7). The residual add + RMSNorm after it is the base class's, with the ``norm`` kernel every
backend shares (:func:`fastverify.backends.base.choose_norm`), so rankings compare all-reduces.

Why: on 8 PCIe GPUs without NVLink it takes 5-15 us where NCCL takes ~205 us at 12 KiB
(SGLang 0.5.23 ``sglang/srt/distributed/device_communicators/pcie_ipc_ar.py`` docstring).

Hard requirements (:meth:`PcieIpcBackend.probe`): CUDA, the registry's world sizes (2/4/8) and
dtypes (bf16 only: FlashInfer's kernels also take fp16, but SGLang 0.5.23 builds its workspace in
bf16 and sends it nothing else, ``should_pcie_ipc_ar`` in
``sglang/srt/distributed/device_communicators/pcie_ipc_ar.py``), all ranks on one host, working
P2P between every GPU pair (``cudaIpcOpenMemHandle`` with lazy peer access;
the kernels spin on peer flags with no timeout, so broken P2P hangs rather than errors), and
flashinfer >= 0.7 with the class. No GPU-architecture limit (plain PTX loads/stores).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from fastverify.backends.base import (
    FUSED_ADD_RMSNORM,
    AllReduceBackend,
    BackendName,
    Capability,
    ExternalCall,
    ProbeContext,
    Shape,
    Tensor,
)
from fastverify.backends.ipc import flashinfer_status, ipc_requirements
from fastverify.registry import backend_info

INFO = backend_info(BackendName.pcie_ipc)
"""The registry entry: world sizes and dtypes the probe checks (bf16 only: SGLang's own gate)."""
MIN_FLASHINFER = (0, 7)
PACK_ELEMS = 8  # kernels move 16-byte packs: max_numel must be a multiple of 16 B / 2 B

# Every FlashInfer name this module touches, with the keywords it passes (checked against the
# real signatures by the signature test).
WORKSPACE = ExternalCall(
    "flashinfer.comm",
    "PcieIpcAllReduceWorkspace",
    "flashinfer.comm.pcie_ipc_ar",
    ("group", "max_numel", "dtype", "max_blocks", "profile", "tune_batches", "tune_cache"),
    "class",
)
WS_SUPPORTS = ExternalCall(
    "flashinfer.comm", "PcieIpcAllReduceWorkspace.supports", "flashinfer.comm.pcie_ipc_ar", ("inp",), "method"
)
WS_ALL_REDUCE = ExternalCall(
    "flashinfer.comm", "PcieIpcAllReduceWorkspace.all_reduce", "flashinfer.comm.pcie_ipc_ar", ("inp", "out"), "method"
)
WS_TUNE = ExternalCall(
    "flashinfer.comm",
    "PcieIpcAllReduceWorkspace.tune",
    "flashinfer.comm.pcie_ipc_ar",
    ("hiddens", "dtype", "tune_group"),
    "method",
)
WS_PREPARE = ExternalCall(
    "flashinfer.comm", "PcieIpcAllReduceWorkspace.prepare", "flashinfer.comm.pcie_ipc_ar", ("shapes", "dtype"), "method"
)
WS_DESTROY = ExternalCall(
    "flashinfer.comm", "PcieIpcAllReduceWorkspace.destroy", "flashinfer.comm.pcie_ipc_ar", (), "method"
)
WS_REBIND_STREAM = ExternalCall(
    "flashinfer.comm", "PcieIpcAllReduceWorkspace.rebind_stream", "flashinfer.comm.pcie_ipc_ar", (), "method"
)
# The norm kernel lives in base (one for all backends); listed here too for the signature checks.
EXTERNAL_CALLS = (
    WORKSPACE,
    WS_SUPPORTS,
    WS_ALL_REDUCE,
    WS_TUNE,
    WS_PREPARE,
    WS_DESTROY,
    WS_REBIND_STREAM,
    FUSED_ADD_RMSNORM,
)


def _config_key(x: Tensor) -> tuple[int, int]:
    """``(numel, hidden)``: FlashInfer's key for a resolved launch configuration, less the dtype
    (one per workspace here): ``(inp.numel(), inp.shape[-1], inp.dtype)`` in
    ``PcieIpcAllReduceWorkspace.tuned_launch_config`` (FlashInfer 0.7.4
    ``flashinfer/comm/pcie_ipc_ar.py``)."""
    return int(x.numel()), int(x.shape[-1])


class PcieIpcBackend(AllReduceBackend):
    """FlashInfer PCIe IPC all-reduce on ``group``; collective construction (all ranks).

    Collective contract (FlashInfer's class docstring): every rank issues the same calls with the
    same shapes in the same order; one workspace per CUDA stream; :meth:`prepare` every CUDA-graph
    capture shape, after ``tune()``, before capture.

    ``max_numel`` is fixed at construction; :meth:`supports` is False above it and the chain falls
    back to NCCL. Size it to the verify step, ``max_batch × draft_tokens × hidden``
    (:attr:`fastverify.deploy.VerifyShapes.max_numel`, SGLang's ``SGLANG_PCIE_IPC_MAX_NUMEL``
    default), not to prefill: the epoch double buffer places its halves ``world_size × max_numel``
    elements apart, and SGLang measured a +66 % TTFT with a prefill-sized workspace (TPOT 21.1 ->
    13.6 ms decode-sized, TP8, SM120). Prefill all-reduces are large and bandwidth-bound, where
    NCCL is fine.

    A shape's launch configuration is resolved collectively on first use (a host read-back), then
    cached until the next ``tune()``; under capture an unresolved shape raises
    (``tuned_launch_config`` in ``flashinfer/comm/pcie_ipc_ar.py``). So under capture
    :meth:`supports` is False for a shape not in :attr:`resolved`, and the caller's own path
    captures it instead: a graph of some other shape (an EAGLE draft, a prefill) never raises.

    Attributes
    ----------
    prepared : dict[tuple[int, int], IpcLaunchConfig or None]
        FlashInfer's answer of the last :meth:`prepare`, per ``(rows, hidden)``.
    resolved : set[tuple[int, int]]
        ``(numel, hidden)`` of every shape FlashInfer holds a configuration for: prepared ones
        (not None) and those an eager :meth:`all_reduce` ran since the last ``tune()``. The same
        on every rank (every rank makes the same calls).

    Options
    -------
    max_blocks : int
        FlashInfer's bound on blocks per launch (sizes barrier slots); default FlashInfer's.
    profile : str
        Force FlashInfer's fabric label (``"rootcplx"``/``"pcieswitch"``) instead of probing.
    tune_cache : str
        Tune-result file (FlashInfer default: ``FLASHINFER_AUTOTUNE_DIR``).
    tune_batches : sequence of int
        Row counts to tune (default: a ladder derived from ``max_numel``).
    tune : bool
        Run FlashInfer's ``tune()`` in :meth:`prepare` (default True: the untuned seed policy is
        up to 2x slower; vLLM makes tuning mandatory). Needs clocks pinned for stable winners.
    tune_group : ProcessGroup
        gloo group spanning the same ranks, for tuning; required when ``group`` is a strict
        subgroup (FlashInfer cannot build one collectively then).
    norm : str
        As for every backend (:class:`~fastverify.backends.base.AllReduceBackend`): default
        ``"auto"``, FlashInfer's ``fused_add_rmsnorm`` on CUDA bf16/fp16 when it imports.
    """

    name = BackendName.pcie_ipc
    option_names = frozenset({"max_blocks", "profile", "tune_cache", "tune_batches", "tune", "tune_group"})

    @classmethod
    def probe(cls, ctx: ProbeContext) -> Capability:
        bad = ipc_requirements(ctx, INFO)
        # The import is last: it is the slow check (~2.5 s for flashinfer).
        return bad if bad is not None else flashinfer_status(MIN_FLASHINFER, EXTERNAL_CALLS)

    def _setup(self) -> None:
        """Check the sizes and the device, then build FlashInfer's workspace (collective).

        Raises
        ------
        ValueError
            ``max_numel`` is None or not a multiple of :data:`PACK_ELEMS` elements, or ``device``
            is not the current CUDA device.
        """
        group, dtype, max_numel = self.group, self.dtype, self.max_numel
        if max_numel is None or max_numel % PACK_ELEMS:
            raise ValueError(
                f"max_numel must be a positive multiple of {PACK_ELEMS} for the PCIe IPC workspace, got "
                f"{max_numel!r}; size it to the verify step: max_batch x draft_tokens x hidden"
            )
        if self.device.type != "cuda" or self.device.index not in (None, torch.cuda.current_device()):
            # FlashInfer binds the workspace to torch.cuda.current_device().
            raise ValueError(
                f"device {self.device} must be the current CUDA device ({torch.cuda.current_device()}); "
                f"call torch.cuda.set_device first"
            )
        ws_kwargs: dict[str, Any] = {"group": group, "max_numel": max_numel, "dtype": dtype}
        for key in ("max_blocks", "profile", "tune_batches", "tune_cache"):
            if key in self.options:
                ws_kwargs[key] = self.options[key]
        # On failure the base class marks this closed: FlashInfer failed on every rank jointly.
        self._ws = WORKSPACE.resolve()(**WORKSPACE.kwargs(**ws_kwargs))
        # The stream the workspace last ran on, as FlashInfer binds it (None: unbound). Kept here
        # rather than read from the workspace's private ``_stream``.
        self._bound: Any = None
        self.prepared: dict[tuple[int, int], Any] = {}
        self.resolved: set[tuple[int, int]] = set()

    def supports(self, x: Tensor) -> bool:
        """FlashInfer's answer (contiguity, capacity, the minimum payload ``numel >= 8 *
        world_size``); under CUDA-graph capture also that FlashInfer has resolved the shape's
        launch configuration (:attr:`resolved`), since it raises for any other there. Every input
        is a pure function of shape and dtype, or of calls every rank made, so every rank agrees."""
        if not (super().supports(x) and bool(self._ws.supports(**WS_SUPPORTS.kwargs(inp=x)))):
            return False
        return not torch.cuda.is_current_stream_capturing() or _config_key(x) in self.resolved

    def all_reduce(self, x: Tensor) -> Tensor:
        self._follow_stream()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self._ws.all_reduce(**WS_ALL_REDUCE.kwargs(inp=x, out=out))
        if not torch.cuda.is_current_stream_capturing():
            self.resolved.add(_config_key(x))  # an eager call resolved and cached it
        self.path_counts["all_reduce"] += 1
        return out

    def _follow_stream(self) -> None:
        """Move FlashInfer's stream binding to the current stream when it changed, after ordering
        the new stream behind the old one.

        FlashInfer binds the workspace to the first stream that runs it and raises "already bound
        ... use one workspace per stream" on any other (``_check_stream`` in
        ``flashinfer/comm/pcie_ipc_ar.py``, ``bind_stream`` in
        ``flashinfer/comm/pcie_ipc_collectives/_lifecycle.py``). A CUDA-graph warm-up runs on a
        side stream after eager calls on the default stream (the tune worker through
        :func:`fastverify.cudagraph.capture_cuda_graph`, SGLang's capture likewise), so the
        binding moves as SGLang's adapter moves it
        (``pcie_ipc_all_reduce`` in ``sglang/srt/distributed/device_communicators/pcie_ipc_ar.py``).
        ``rebind_stream()`` is the caller's assertion that earlier work is ordered before later
        work, hence the wait. Two streams issuing calls at the same time stay unsupported: that
        is a race, not a stream change.

        During stream capture nothing is touched: FlashInfer exempts capture from the binding,
        and a wait on an event recorded outside the capture would break it. Capture starts
        with a device synchronize (``torch.cuda.graph``), which orders it behind the warm-up.
        """
        if torch.cuda.is_current_stream_capturing():
            return
        current = torch.cuda.current_stream(self.device)
        if self._bound is not None and current != self._bound:
            # What makes rebind_stream() true: every workspace call queued on the old stream
            # runs before anything this stream queues from now on.
            current.wait_stream(self._bound)
            self._ws.rebind_stream()
            self.path_counts["stream_rebind"] += 1
        self._bound = current

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Tune (unless ``tune=False``) for the hidden sizes in ``shapes``, then resolve every
        ``(rows, hidden)`` shape so CUDA-graph capture touches no host collective. Collective;
        every rank passes the same list. Shapes the kernels cannot take map to None in
        :attr:`prepared` and fall back at call time; the others join :attr:`resolved` (which a
        tune empties first, as it empties FlashInfer's cache)."""
        if any(len(s) != 2 for s in shapes):
            raise ValueError(f"shapes must be (rows, hidden) pairs, got {list(shapes)}")
        shapes2 = [(int(s[0]), int(s[1])) for s in shapes]
        if self.options.get("tune", True) and shapes2:
            tune_kwargs: dict[str, Any] = {"hiddens": sorted({h for _, h in shapes2}), "dtype": self.dtype}
            if "tune_group" in self.options:
                tune_kwargs["tune_group"] = self.options["tune_group"]
            self.resolved = set()  # tune() empties FlashInfer's cache of resolved configurations
            self._ws.tune(**WS_TUNE.kwargs(**tune_kwargs))
        self.prepared = dict(self._ws.prepare(**WS_PREPARE.kwargs(shapes=shapes2, dtype=self.dtype)))
        self.resolved |= {(r * h, h) for (r, h), config in self.prepared.items() if config is not None}
        # tune() moves FlashInfer's binding itself (synchronize, then rebind_stream). After a
        # synchronize nothing is pending, so unbinding is true whatever stream comes next.
        torch.cuda.synchronize(self.device)
        self._ws.rebind_stream()
        self._bound = None

    def _release(self) -> None:
        """Destroy the workspace. Collective: every rank's :meth:`close` runs it."""
        self._ws.destroy()
