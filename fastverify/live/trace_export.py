"""The CUDA trace of a live rank: its verify forward captured in a CUDA graph and replayed under
``torch.profiler``, written as ``<trace_dir>/verify-TP-<rank>.trace.json.gz`` (SGLang's
``-TP-<rank>`` naming, so :mod:`fastverify.trace.load` reads it).
"""

from __future__ import annotations

from pathlib import Path

from fastverify.cudagraph import capture_cuda_graph

TRACE_REPLAYS = 3
"""Graph replays recorded in each rank's Chrome trace (after one profiler warm-up replay)."""


def export_trace(model, rank: int, trace_dir: str, torch, dist) -> str:
    """Capture one forward in a CUDA graph, replay it under ``torch.profiler`` and write a gzipped
    Chrome trace ``verify-TP-<rank>.trace.json.gz``. Returns its path.

    The graph mirrors SGLang's verify path (``DecodeCudaGraphRunner`` replays TARGET_VERIFY), so the
    trace shows what a served verify step looks like: kernels tied to one ``cudaGraphLaunch``, NCCL
    kernels without ``record_param_comms``. Each replay is one ``ProfilerStep#<n>`` (a schedule is
    needed for the profiler to emit those markers).
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    init_graphs = getattr(getattr(torch.profiler, "_utils", None), "_init_for_cuda_graphs", None)
    if init_graphs is not None:
        # Graphs captured before the profiler's first use may be missing from traces (pytorch PR #100441).
        init_graphs()
    graph, _ = capture_cuda_graph(model.forward, warmup=2)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    path = Path(trace_dir) / f"verify-TP-{rank}.trace.json.gz"
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=0, warmup=1, active=TRACE_REPLAYS, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
    ) as prof:
        for _ in range(1 + TRACE_REPLAYS):
            graph.replay()
            torch.cuda.synchronize()
            prof.step()
    del graph
    return str(path)
