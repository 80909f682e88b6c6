"""One rank of a live run: a fresh Python process that joins the run's process group, builds its
shard of the verify model, times the forwards and writes its result for the parent.

The parent (:func:`fastverify.live.runner.run_live`) starts ``tp`` of them with :func:`worker_argv`,
passes the run's spec as ``spec.json`` and reads back, in the same folder, ``rank<r>.json`` (rows,
labels, steps, meta), ``rank<r>.progress`` (one line per stage, :func:`_mark`), and on failure
``rank<r>.failed`` (the monotonic ns of the failure) or ``rank<r>.unavailable`` (a backend's
one-line refusal). torch is imported inside the rank's ``try``, so even its import error becomes
the rank's traceback and exit 1.

The CUDA trace of a live rank: its verify forward's CUDA graph replayed under ``torch.profiler``,
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

import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import orjson

from fastverify.cudagraph import capture_cuda_graph
from fastverify.errors import UserError
from fastverify.live.clocks import capture_forward_graphs, time_forwards
from fastverify.live.config import DEFAULT_CONTEXT_TOKENS, ModelConfig
from fastverify.procs import rank_device

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


HOST = "127.0.0.1"
"""Where the parent's rendezvous ``TCPStore`` listens."""

# A rank is a fresh interpreter running _worker_main. It is started with ``-c`` rather than through
# multiprocessing's spawn, which re-imports the caller's ``__main__`` in every child (a script
# without an ``if __name__ == "__main__"`` guard would start ranks recursively), and which leaves a
# child's import-time errors on the parent's stderr instead of the rank's file.
_WORKER_CODE = (
    "import sys; from fastverify.live.worker import _worker_main; _worker_main(sys.argv[1], int(sys.argv[2]))"
)


def worker_argv(spec_path: str) -> Callable[[int], list[str]]:
    """The command line of rank ``r``, as a function of ``r``, for the spec at ``spec_path``."""
    return lambda rank: [sys.executable, "-c", _WORKER_CODE, spec_path, str(rank)]


def _worker_main(spec_path: str, rank: int) -> None:
    """Entry of a rank process: run it, write ``rank<r>.json`` next to the spec; on any error print
    the traceback to stderr (the rank's file), record the failure time and exit 1."""
    workdir = Path(spec_path).parent
    try:
        spec = orjson.loads(Path(spec_path).read_bytes())
        result = _run_rank(rank, spec, workdir)
        tmp = workdir / f"rank{rank}.json.tmp"
        tmp.write_bytes(orjson.dumps(result))
        os.replace(tmp, workdir / f"rank{rank}.json")
    except BaseException:  # noqa: BLE001 - report everything, KeyboardInterrupt included, to the parent
        (workdir / f"rank{rank}.failed").write_text(str(time.monotonic_ns()))
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _mark(workdir: Path, rank: int, stage: str) -> None:
    """Append one line ``stage`` to ``rank<r>.progress`` (read by the parent's watch).
    One ``write`` of a short line per stage, so a reader sees whole lines or none of the new one."""
    with open(workdir / f"rank{rank}.progress", "a", encoding="utf-8") as f:
        f.write(stage + "\n")


def _run_rank(rank: int, spec: dict, workdir: Path) -> dict:
    """Join the group, build the model, run the warm-up and timed forwards (and on CUDA the trace
    of the captured forward graph; a trace that fails leaves ``trace_error`` in the meta), leave
    the group. Returns ``{"rows", "labels", "steps", "meta"}`` (clocks:
    :mod:`fastverify.live.clocks`)."""
    import torch
    import torch.distributed as dist

    from fastverify.live.forward import TPVerifyModel  # lazy: torch

    device = _join_group(rank, spec, workdir, dist)
    # No teardown on error: the process exits at once (os._exit), and destroying a communicator with
    # work in flight can block and hide the error behind the timeout.
    config = ModelConfig(**spec["config"])
    dtype = getattr(torch, spec["dtype"])
    tokens = spec["batch"] * spec["draft_tokens"]
    ar = _make_allreduce(rank, spec, device, dtype, tokens, config.hidden_size, workdir, torch, dist)
    if ar is not None:
        ar.prepare([(tokens, config.hidden_size)])  # before any forward, so before graph capture
    model = TPVerifyModel(
        config,
        tp=spec["tp"],
        rank=rank,
        batch=spec["batch"],
        draft_tokens=spec["draft_tokens"],
        device=device,
        dtype=dtype,
        context_tokens=DEFAULT_CONTEXT_TOKENS,
        backend=ar,
    )
    _mark(workdir, rank, f"built {model.weight_bytes()}")
    rows, labels, steps, figures, graphs = _run_forwards(model, rank, spec, workdir, torch, dist)
    meta = _rank_meta(model, config, spec, rank, torch)
    meta.update(figures)
    if spec["cuda"]:
        meta["nccl_version"] = _nccl_version(torch)
        if spec["trace_dir"] is not None:
            _mark(workdir, rank, "trace")
            meta.update(_trace(graphs, rank, spec["trace_dir"], torch, dist))
    del graphs
    if ar is not None:
        meta["allreduce_paths"] = dict(ar.path_counts)
        ar.close()  # collective for the IPC backends: every rank reaches it, before the group goes
    dist.destroy_process_group()
    return {"rows": rows, "labels": labels, "steps": steps, "meta": meta}


def _trace(graphs, rank: int, trace_dir: str, torch, dist) -> dict:
    """``{"trace_file": path}``, or ``{"trace_error": one line}`` when the export raised: the trace
    is evidence beside the measured forwards, never a reason to lose them."""
    try:
        return {"trace_file": export_trace(graphs.whole, rank, trace_dir, torch, dist)}
    except TraceFailed as err:  # every replay ran: the ranks are still in step
        return {"trace_error": str(err)}


def _join_group(rank: int, spec: dict, workdir: Path, dist):
    """Join the default process group through the parent's store; returns this rank's device."""
    timeout = timedelta(seconds=spec["timeout_s"])
    device = rank_device(rank, spec["cuda"], spec["threads"])
    store = dist.TCPStore(HOST, spec["port"], None, False, timeout=timeout)
    dist.init_process_group(spec["dist_backend"], store=store, rank=rank, world_size=spec["tp"], timeout=timeout)
    _mark(workdir, rank, "up")
    return device


def _make_allreduce(rank: int, spec: dict, device, dtype, tokens: int, hidden: int, workdir: Path, torch, dist):
    """Build the run's all-reduce backend on the default group, or None at ``tp == 1``.

    Every rank probes first and the ranks vote (a MAX all-reduce of a flag) before any of them
    constructs: construction is collective for the IPC backends, so one rank must never build it
    alone. A rank whose probe fails writes ``rank<r>.unavailable`` (its one-line reason, read by
    the parent) before the vote, so the file exists once any rank knows the run is off."""
    if spec["tp"] == 1:
        return None
    from fastverify.backends.base import ProbeContext, make_backend, probe  # lazy: torch

    ctx = ProbeContext.detect(None, device=device, dtype=dtype, p2p=spec["p2p_ok"], single_node=True)
    if spec["p2p_note"] and ctx.p2p_ok is not None:
        ctx = dataclasses.replace(ctx, p2p_note=spec["p2p_note"])
    cap = probe(spec["backend"], ctx)
    if not cap.ok:
        (workdir / f"rank{rank}.unavailable").write_text(
            f"--backend {spec['backend']}: unavailable on rank {rank}: {cap.reason}"
        )
    flag = torch.tensor([0 if cap.ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()):
        raise UserError(f"--backend {spec['backend']}: unavailable on {'this' if not cap.ok else 'another'} rank")
    return make_backend(
        spec["backend"], None, device=device, dtype=dtype, max_numel=tokens * hidden, hidden=hidden, context=ctx
    )


def _run_forwards(model, rank: int, spec: dict, workdir: Path, torch, dist) -> tuple[list, list, list, dict, object]:
    """``warmup`` untimed eager forwards, then on CUDA the capture of the forward's graphs
    (:func:`~fastverify.live.clocks.capture_forward_graphs`), then ``iters`` timed ones: rows,
    labels, steps and figures of :func:`~fastverify.live.clocks.time_forwards`, and the graphs
    (None on CPU). Rank 0 alone marks each forward done: the ranks run in lockstep."""
    warmup, cuda = spec["warmup"], spec["cuda"]

    def forward_done(k: int) -> None:
        if rank == 0:
            _mark(workdir, rank, f"forward {k}")

    for k in range(warmup):
        model.forward()
        forward_done(k + 1)
    graphs = None
    if cuda:
        torch.cuda.synchronize()
        graphs = capture_forward_graphs(model, torch)
    timed = time_forwards(
        model, spec["iters"], rank, cuda, torch, dist, done=lambda i: forward_done(warmup + i + 1), graphs=graphs
    )
    return (*timed, graphs)


def _rank_meta(model, config: ModelConfig, spec: dict, rank: int, torch) -> dict:
    """The facts of this rank's run that go into its :class:`~fastverify.events.RankEvents` meta."""
    cuda = spec["cuda"]
    return {
        "timing": "cuda_events" if cuda else "cpu_wall_clock",
        "device": torch.cuda.get_device_name(rank) if cuda else "cpu",
        "dist_backend": spec["dist_backend"],
        "allreduce_backend": spec["backend"],
        "world_size": spec["tp"],
        "model": config.name,
        "model_source": config.source,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "draft_tokens": spec["draft_tokens"],
        "batch": spec["batch"],
        "tokens": model.tokens,
        "warmup": spec["warmup"],
        "iters": spec["iters"],
        "dtype": spec["dtype"],
        "experts_allocated": model.experts_allocated,
        "experts_used_max": max(model.experts_used, default=0),
        "context_tokens": model.context_tokens,
        "allreduce_bytes": model.allreduce_bytes,
        "allgather_bytes": model.allgather_bytes,
        "weight_bytes_per_rank": model.weight_bytes(),
        "torch_version": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "warnings": list(spec["warnings"]),
    }


def _nccl_version(torch) -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - optional fact; torch built without NCCL raises
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
