"""The CUDA trace of a live rank: its verify forward's CUDA graph replayed under ``torch.profiler``,
written as ``<trace_dir>/verify-TP-<rank>.trace.json.gz`` (SGLang's ``-TP-<rank>`` naming, so
:mod:`fastverify.trace.load` reads it).

The trace is evidence beside the timed forwards (:mod:`fastverify.live.clocks`), never a reason to
lose them: a profiler that fails to start, step or write is reported and the replays still run,
the same number on every rank, since each replay holds the forward's collectives and a rank that
stopped replaying would leave the others waiting in them. No empty profiler session is opened
before the capture (PyTorch's ``torch.profiler._utils._init_for_cuda_graphs``): one is reported to
leave CUPTI recording no kernels on CUDA 13 with torch 2.13 (lightseekorg/tokenspeed pull request
1348); a trace with no kernels is caught where the traces are read.
"""

from __future__ import annotations

from pathlib import Path

from fastverify.cudagraph import capture_cuda_graph

TRACE_REPLAYS = 3
"""Graph replays recorded in each rank's Chrome trace (after one profiler warm-up replay)."""


class TraceFailed(RuntimeError):
    """The profiler failed on this rank; the message is one line saying at which step and why."""


def export_trace(graph, rank: int, trace_dir: str, torch, dist) -> str:
    """Replay ``graph`` (the whole verify forward, captured by
    :func:`~fastverify.live.clocks.capture_forward_graphs`; a model, with ``forward`` and no
    ``replay``, is captured here first) ``1 + TRACE_REPLAYS`` times under
    ``torch.profiler`` and write a gzipped Chrome trace ``verify-TP-<rank>.trace.json.gz``. Returns
    its path.

    The graph mirrors SGLang's verify path (``DecodeCudaGraphRunner`` replays TARGET_VERIFY), so the
    trace shows what a served verify step looks like: kernels tied to one ``cudaGraphLaunch``, NCCL
    kernels without ``record_param_comms``. Each replay is one ``ProfilerStep#<n>`` (a schedule is
    needed for the profiler to emit those markers).

    Raises
    ------
    TraceFailed
        The profiler could not start, step or write the trace (after every replay ran).
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    if not hasattr(graph, "replay"):
        graph, _ = capture_cuda_graph(graph.forward, warmup=2)  # the output stays in the graph's pool
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    path = Path(trace_dir) / f"verify-TP-{rank}.trace.json.gz"
    failed: list[str] = []

    def guard(stage: str, fn, always: bool = False) -> None:
        if failed and not always:
            return
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - any profiler/CUPTI error: the replays go on
            failed.append(f"profiler {stage} failed: {' '.join(f'{type(err).__name__}: {err}'.split())}")

    prof = None

    def start() -> None:
        nonlocal prof
        p = profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            schedule=schedule(wait=0, warmup=1, active=TRACE_REPLAYS, repeat=1),
            on_trace_ready=lambda pr: pr.export_chrome_trace(str(path)),
        )
        p.__enter__()
        prof = p

    guard("start", start)
    for _ in range(1 + TRACE_REPLAYS):
        graph.replay()
        torch.cuda.synchronize()
        if prof is not None:
            guard("step", prof.step)
    if prof is not None:
        guard("stop", lambda: prof.__exit__(None, None, None), always=True)  # stop CUPTI even after a failure
    if failed:
        raise TraceFailed(failed[0][:300])
    return str(path)
