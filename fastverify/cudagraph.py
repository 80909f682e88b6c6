"""CUDA-graph capture as the live runner, the tune worker and the doctor all do it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def capture_cuda_graph(fn: Callable[[], Any], *, warmup: int = 2, calls: int = 1):
    """Warm ``fn`` up ``warmup`` times on a side stream (as the ``torch.cuda.graph`` docs require,
    so that lazy allocations and kernel selection happen outside the capture), then capture
    ``calls`` consecutive calls in one graph on the current device.

    Returns ``(graph, out)``: the ``torch.cuda.CUDAGraph`` and the output of the last captured call,
    whose memory the graph's replays overwrite. CUDA only.

    Streams: the side stream waits for the current one before the warm-up and the current one
    waits for the side stream after it, and capture begins with a device synchronize
    (``torch.cuda.graph``). So ``fn`` runs on three streams in turn (current, side, capture),
    never at once; a backend bound to one stream must follow these changes (FlashInfer's PCIe IPC
    workspace: :meth:`fastverify.backends.flashinfer_pcie_ipc.PcieIpcBackend.all_reduce`).
    """
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph, out
