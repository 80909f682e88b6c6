"""Run the synthetic verify forward on ``tp`` rank processes and return one :class:`RankEvents` per rank.

Process model: one fresh Python process per rank (``sys.executable -c`` calling
:func:`_worker_main`; no inherited CUDA or gloo state, as SGLang starts its scheduler ranks with
``spawn``). The environment passes through, so ``NCCL_*`` settings reach the ranks. The parent holds
the rendezvous ``TCPStore`` on 127.0.0.1 with a port the OS picks, so no port is guessed. The spec
goes to each rank as a JSON file and the result comes back as ``rank<r>.json`` in a temporary
directory; stderr goes to ``rank<r>.stderr`` there, and stdout is never parsed. A rank that exits
non-zero or outlives ``timeout_s`` ends the run: every rank's process group is stopped by the one
launcher's kill rule (:class:`fastverify.procs.RankGroup`: SIGTERM, then SIGKILL) and
:class:`~fastverify.errors.UserError` names the rank and the last line of its stderr.

Clocks
------
* CPU (gloo): each region is bracketed by ``time.perf_counter_ns()`` (``CLOCK_MONOTONIC`` on Linux,
  one clock for every process on the machine), so ranks line up without conversion. Wall time,
  labelled ``timing = "cpu_wall_clock"``: it is not GPU time.
* CUDA (NCCL): each region is bracketed by ``torch.cuda.Event(enable_timing=True)`` on the
  current stream. Before each timed forward the ranks synchronise (device sync, barrier, device
  sync), then record a base event on an idle GPU and read ``perf_counter_ns()``; an event's time is
  that host time plus its ``elapsed_time`` from the base event (ms → ns). ``timing = "cuda_events"``.
  Afterwards the forward is captured in a CUDA graph and replayed under ``torch.profiler``; the
  Chrome trace of each rank goes to ``trace_dir/verify-TP-<rank>.trace.json.gz`` (SGLang's
  ``-TP-<rank>`` naming, so :mod:`fastverify.trace.load` reads it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import orjson

# The CLI's bounds (fastverify/bounds.py), also enforced here for callers of run_live.
from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS, MAX_TIMEOUT_S
from fastverify.errors import UserError
from fastverify.events import EventClass, RankEvents, Step
from fastverify.live.config import ModelConfig, check_tp
from fastverify.procs import (
    RankGroup,
    child_env as _child_env,
    exit_reason as _exit_reason,
    failure_time as _failure_time,
    last_stderr_line as _last_stderr_line,
    rank_device,
    rank_workdir,
)

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
TRACE_REPLAYS = 3
"""Graph replays recorded in each rank's Chrome trace (after one profiler warm-up replay)."""


def run_live(
    config: ModelConfig,
    *,
    tp: int,
    draft_tokens: int,
    batch: int,
    iters: int = 5,
    warmup: int = 2,
    device: str = "auto",
    timeout_s: float = 300.0,
    trace_dir: str | None = None,
    backend: str | None = None,
    dtype: str = "bfloat16",
) -> list[RankEvents]:
    """Time ``iters`` verify forwards of ``config`` on ``tp`` ranks (after ``warmup`` untimed ones).

    Parameters
    ----------
    config : ModelConfig
        From :func:`~fastverify.live.config.load_model_config`.
    tp : int
        Tensor-parallel ranks (processes); each uses one GPU on CUDA.
    draft_tokens, batch : int
        Tokens per request in verify (SGLang ``speculative_num_draft_tokens``, 1..64) and requests
        (1..4096); the forward runs ``T = batch × draft_tokens`` tokens.
    iters, warmup : int
        Timed forwards (one :class:`~fastverify.events.Step` each, named ``verify#<i>``) and
        untimed ones before them.
    device : {"auto", "cpu", "cuda"}
        ``"auto"`` is CUDA + NCCL when ``torch.cuda.device_count() >= tp``, else CPU + gloo.
    timeout_s : float
        Limit for the whole run, start-up included, in seconds, in (0, 86400].
    trace_dir : str | None
        CUDA only: where each rank writes ``verify-TP-<rank>.trace.json.gz``.
    backend : str | None
        All-reduce backend of the forward, a :class:`fastverify.registry.BackendName` value; each
        rank builds it with ``make_backend`` on the run's group (P2P from the real check,
        :func:`fastverify.topo.p2p.check_p2p`, for a backend that needs it). None: NCCL on CUDA,
        gloo on CPU.
    dtype : str
        torch dtype name of weights, activations and all-reduces (``bfloat16``, ``float16``,
        ``float32``).

    Returns
    -------
    list[RankEvents]
        One per rank, sorted by rank. Rows are op regions: compute (``EventClass.COMPUTE``, names
        ``compute:embed|attn|mlp|moe|lm_head``), all-reduces (``ALLREDUCE``, name ``allreduce``,
        ``msg_bytes = T × hidden × dtype size``; ``FUSED_ALLREDUCE`` for a fused all-reduce + RMSNorm
        backend) and the logits all-gather (``OTHER_COMM``, name ``allgather``,
        ``msg_bytes = T × vocab_padded / tp × dtype size``, the per-rank input); ``label``
        says where (``layer3.attn_out.allreduce``). Compute rows have ``msg_bytes = -1``. Times are
        ns in one clock shared by all ranks (see the module docstring). ``meta`` holds ``timing``,
        ``device``, ``dist_backend``, ``world_size``, ``model``, ``hidden_size``, ``num_layers``,
        ``draft_tokens``, ``batch``, ``tokens``, ``warmup``, ``iters``, ``dtype``,
        ``allreduce_backend``, ``allreduce_paths`` (the backend's ``path_counts``),
        ``experts_allocated`` and more.

    Raises
    ------
    UserError
        Bad arguments, a model that ``tp`` cannot split, a shape whose memory
        (:func:`~fastverify.live.config.rank_memory`, a lower bound) exceeds the host's available
        memory (CPU, all ranks) or a GPU's total (CUDA, per rank), a CUDA request without ``tp`` GPUs, an
        unknown backend or one that cannot run here (the probe's one-line reason), or a rank that
        crashed or timed out (the message names the rank and its last stderr line).
    """
    check_tp(config, tp)
    for flag, value, low in (("--draft-tokens", draft_tokens, 1), ("--batch", batch, 1),
                             ("--iters", iters, 1), ("--warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"{flag} must be an integer >= {low}, got {value!r}")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:  # also false for nan; inf and 1e300 overflow TCPStore's timedelta
        raise UserError(f"--timeout {timeout_s!r}: expected seconds in (0, {MAX_TIMEOUT_S:g}]")
    for flag, value, high in (("--draft-tokens", draft_tokens, MAX_DRAFT_TOKENS), ("--batch", batch, MAX_BATCH)):
        if value > high:
            raise UserError(f"{flag} {value}: expected at most {high}")

    import torch
    import torch.distributed as dist

    from fastverify.profile_record import DTYPES

    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    use_cuda = _pick_device(device, tp, torch)
    _check_memory(config, tp=tp, batch=batch, draft_tokens=draft_tokens, dtype=dtype, cuda=use_cuda, torch=torch)
    ar_backend = _pick_backend(backend, use_cuda, tp, dtype, torch)
    warnings: list[str] = []
    if trace_dir is not None and not use_cuda:
        if device == "cpu":
            raise UserError("a trace directory needs --device cuda: a CPU run has no CUDA graph to trace")
        warnings.append("trace_dir ignored: no CUDA run (fewer GPUs than --tp), so no CUDA graph to trace")
        logger.warning("%s", warnings[-1])
        trace_dir = None
    if trace_dir is not None:
        try:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create trace directory {trace_dir}: {err.strerror or err}") from None
    from fastverify.registry import BackendName, backend_info

    dist_backend = (BackendName.nccl if use_cuda else BackendName.gloo).value
    p2p_ok = p2p_note = None
    if use_cuda and tp > 1 and backend_info(ar_backend).needs_p2p:
        from fastverify.backends.base import summarize_p2p
        from fastverify.topo.p2p import check_p2p

        # IPC kernels hang without P2P; only the real read/write check proves it (cached per box).
        p2p_ok, p2p_note = summarize_p2p(check_p2p(pairs=[(a, b) for a in range(tp) for b in range(a + 1, tp)]))
    logger.info("live verify: model %s, tp %d, T = %d tokens, all-reduce %s over %s on %s",
                config.name, tp, batch * draft_tokens, ar_backend, dist_backend, "cuda" if use_cuda else "cpu")

    # The parent owns the store (port 0: the OS picks a free one), so ranks never race for a port.
    store = dist.TCPStore(_HOST, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    spec = {
        "config": asdict(config),
        "tp": tp,
        "draft_tokens": draft_tokens,
        "batch": batch,
        "iters": iters,
        "warmup": warmup,
        "cuda": use_cuda,
        "port": store.port,
        "timeout_s": float(timeout_s),
        "trace_dir": None if trace_dir is None else str(Path(trace_dir).resolve()),
        "threads": max(1, (os.cpu_count() or 1) // tp),
        "warnings": warnings,
        "dist_backend": dist_backend,
        "backend": ar_backend,
        "dtype": dtype,
        "p2p_ok": p2p_ok,
        "p2p_note": p2p_note,
    }
    try:
        with rank_workdir("fastverify-live-") as workdir:
            spec_path = Path(workdir) / "spec.json"
            spec_path.write_bytes(orjson.dumps(spec))
            try:
                _launch(_worker_argv(str(spec_path)), tp, timeout_s, workdir, _child_env())
            except UserError:
                # A backend a rank could not build: its probe's line, not "rank r failed".
                refused = sorted(Path(workdir).glob("rank*.unavailable"))
                if refused:
                    raise UserError(refused[0].read_text().strip()) from None
                raise
            return [_load_result(Path(workdir), r, dist_backend) for r in range(tp)]
    finally:
        del store


def _pick_backend(name: str | None, use_cuda: bool, tp: int, dtype: str, torch) -> str:
    """The all-reduce backend's registry name for this run; :class:`UserError` (one line) for an
    unknown name or a backend that cannot run on this run's device, with the probe's reason."""
    from fastverify.registry import BackendName, Role, backend_info

    if name is None:
        return (BackendName.nccl if use_cuda else BackendName.gloo).value
    try:
        info = backend_info(name)
    except ValueError as err:
        raise UserError(f"--backend: {err}") from None
    here = "cuda" if use_cuda else "cpu"
    if tp == 1 and info.role is not Role.baseline:
        raise UserError(f"--backend {info.name.value}: --tp 1 runs no all-reduce, so there is nothing for it to do; "
                        "use --tp >= 2")
    if info.device == here:
        return info.name.value
    if info.role is Role.baseline:
        # torch.distributed's probes need an initialised group; the reason is the device alone.
        other = next(b for b in (BackendName.nccl, BackendName.gloo) if backend_info(b).device == here)
        raise UserError(f"--backend {info.name.value}: runs on {info.device} tensors and this run is on {here}"
                        f"{'' if use_cuda else f' (fewer than {tp} GPUs, or --device cpu)'}; use --backend "
                        f"{other.value}")
    from fastverify.backends.base import ProbeContext, backend_class

    try:
        cls = backend_class(info.name)
    except ImportError as err:
        raise UserError(f"--backend {info.name.value}: its module {info.module} does not import ({err})") from None
    ctx = ProbeContext(world_size=tp, device_type=here, dtype=getattr(torch, dtype),
                       group_backend=(BackendName.nccl if use_cuda else BackendName.gloo).value, single_node=True)
    cap = cls.probe(ctx)
    raise UserError(f"--backend {info.name.value}: cannot run on {here}: "
                    f"{cap.reason if not cap.ok else 'needs ' + info.device + ' tensors'}")


def _available_bytes(cuda: bool, tp: int, torch) -> tuple[int, str] | None:
    """Memory the ranks can use and what it is: the smallest GPU's total on CUDA (one rank per GPU),
    else the host's ``MemAvailable`` (``/proc/meminfo``, shared by all ranks); None when unknown."""
    if cuda:
        return min(torch.cuda.get_device_properties(r).total_memory for r in range(tp)), "per GPU"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "of host memory available"
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(config: ModelConfig, *, tp: int, batch: int, draft_tokens: int, dtype: str, cuda: bool,
                  torch) -> None:
    """Refuse, before any rank starts, a shape whose lower-bound memory
    (:func:`fastverify.live.config.rank_memory`) exceeds what this machine has, naming the flags."""
    from fastverify.live.config import rank_memory
    from fastverify.live.forward import DEFAULT_CONTEXT_TOKENS

    have = _available_bytes(cuda, tp, torch)
    if have is None:
        return
    mem = rank_memory(config, tp=tp, batch=batch, draft_tokens=draft_tokens,
                      dtype_bytes=torch.empty((), dtype=getattr(torch, dtype)).element_size(),
                      context_tokens=DEFAULT_CONTEXT_TOKENS)
    need = mem.total if cuda else tp * mem.total  # CPU ranks share the host's memory
    if need > have[0]:
        gib = 2 ** 30
        who = f"each rank needs at least {mem.total / gib:.1f} GiB" if cuda else \
            f"{tp} ranks need at least {need / gib:.1f} GiB ({mem.total / gib:.1f} each)"
        raise UserError(f"--batch {batch} x --draft-tokens {draft_tokens} (T = {batch * draft_tokens} tokens) of "
                        f"{config.name} at --tp {tp}: {who} (weights and KV context {mem.setup / gib:.1f}, "
                        f"largest temporary {mem.transient / gib:.1f}); this machine has {have[0] / gib:.1f} GiB {have[1]}; "
                        "lower --batch or --draft-tokens")


def _pick_device(device: str, tp: int, torch) -> bool:
    """True for CUDA + NCCL, False for CPU + gloo."""
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cpu":
        return False
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and count < tp:
        raise UserError(f"--device cuda needs {tp} GPUs for --tp {tp}, found {count}")
    return count >= tp


# ---- parent side: start, watch, collect ---------------------------------------------------------

# A rank is a fresh interpreter running this module's _worker_main. It is started with ``-c`` rather
# than through multiprocessing's spawn, which re-imports the caller's ``__main__`` in every child (a
# script without an ``if __name__ == "__main__"`` guard would start ranks recursively), and which
# leaves a child's import-time errors on the parent's stderr instead of the rank's file.
_WORKER_CODE = "import sys; from fastverify.live.runner import _worker_main; _worker_main(sys.argv[1], int(sys.argv[2]))"


def _worker_argv(spec_path: str) -> Callable[[int], list[str]]:
    return lambda rank: [sys.executable, "-c", _WORKER_CODE, spec_path, str(rank)]


def _launch(argv: Callable[[int], list[str]], tp: int, timeout_s: float, workdir: str,
            env: dict[str, str] | None = None) -> None:
    """Start ``tp`` processes ``argv(rank)`` (stderr to ``workdir/rank<r>.stderr``) and wait for all to exit 0.

    The ranks run under :class:`fastverify.procs.RankGroup`, the one launcher and kill rule. On the
    first failure (the earliest by the time the rank recorded in ``rank<r>.failed``, else by when
    the exit was seen) or at the deadline, every rank's process group is stopped (SIGTERM, then
    SIGKILL) and a one-line :class:`UserError` names the rank, the reason and the last line of its
    stderr.
    """
    deadline = time.monotonic() + timeout_s
    with RankGroup(workdir, env=env) as ranks:
        ranks.start(argv(rank) for rank in range(tp))
        while True:
            seen_exit = ranks.poll()
            failed = [r for r in seen_exit if ranks.returncode(r) != 0]
            if failed:
                rank = min(failed, key=lambda r: (_failure_time(workdir, r, seen_exit[r]), r))
                raise UserError(f"live rank {rank} failed ({_exit_reason(ranks.returncode(rank))}): "
                                f"{_last_stderr_line(workdir, rank)}")
            if len(seen_exit) == tp:
                return
            if time.monotonic() >= deadline:
                rank = min(r for r in range(tp) if r not in seen_exit)
                raise UserError(f"live rank {rank} did not finish within {timeout_s:g} s "
                                f"(last stderr line: {_last_stderr_line(workdir, rank)})")
            time.sleep(0.02)


def _load_result(workdir: Path, rank: int, backend: str) -> RankEvents:
    path = workdir / f"rank{rank}.json"
    try:
        doc = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as err:
        raise UserError(f"live rank {rank} exited without a result ({path.name}: {err})") from None
    rows = [(name, EventClass(cls), start, dur, nbytes) for name, cls, start, dur, nbytes in doc["rows"]]
    steps = [Step(name, start, end) for name, start, end in doc["steps"]]
    return RankEvents.from_rows(rank, f"live:{backend}", rows, steps=steps, labels=doc["labels"], meta=doc["meta"])


# ---- rank side ------------------------------------------------------------------------------------


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


class _WallClockRecorder:
    """CPU: regions bracketed by ``perf_counter_ns``; rows ``[name, cls, start_ns, dur_ns, bytes]``."""

    def __init__(self) -> None:
        self.rows: list[list] = []
        self.labels: list[str] = []

    def region(self, name, cls, label, msg_bytes):
        return _WallRegion(self, name, cls, label, msg_bytes)


class _WallRegion:
    __slots__ = ("rec", "name", "cls", "label", "msg_bytes", "t0")

    def __init__(self, rec, name, cls, label, msg_bytes):
        self.rec, self.name, self.cls, self.label, self.msg_bytes = rec, name, cls, label, msg_bytes

    def __enter__(self):
        self.t0 = time.perf_counter_ns()

    def __exit__(self, *exc):
        t1 = time.perf_counter_ns()
        self.rec.rows.append([self.name, self.cls.value, self.t0, t1 - self.t0, self.msg_bytes])
        self.rec.labels.append(self.label)
        return False


class _CudaEventRecorder:
    """CUDA: regions bracketed by timing events on the current stream, resolved after a sync."""

    def __init__(self, torch) -> None:
        self.torch = torch
        self.pending: list[tuple] = []

    def region(self, name, cls, label, msg_bytes):
        return _CudaRegion(self, name, cls, label, msg_bytes)

    def event(self):
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def resolve(self, base_event, base_ns: int) -> tuple[list[list], list[str]]:
        """Rows in host ns: ``base_ns`` + elapsed ms since ``base_event`` × 1e6. Call after a device sync."""
        rows, labels = [], []
        for name, cls, label, nbytes, e0, e1 in self.pending:
            start = base_ns + round(base_event.elapsed_time(e0) * 1e6)
            rows.append([name, cls.value, start, round(e0.elapsed_time(e1) * 1e6), nbytes])
            labels.append(label)
        return rows, labels


class _CudaRegion:
    __slots__ = ("rec", "name", "cls", "label", "msg_bytes", "e0")

    def __init__(self, rec, name, cls, label, msg_bytes):
        self.rec, self.name, self.cls, self.label, self.msg_bytes = rec, name, cls, label, msg_bytes

    def __enter__(self):
        self.e0 = self.rec.event()

    def __exit__(self, *exc):
        self.rec.pending.append((self.name, self.cls, self.label, self.msg_bytes, self.e0, self.rec.event()))
        return False


def _make_allreduce(rank: int, spec: dict, device, dtype, tokens: int, hidden: int, workdir: Path, torch, dist):
    """Build the run's all-reduce backend on the default group, or None at ``tp == 1``.

    Every rank probes first and the ranks vote (a MAX all-reduce of a flag) before any of them
    constructs: construction is collective for the IPC backends, so one rank must never build it
    alone. A rank whose probe fails writes ``rank<r>.unavailable`` (its one-line reason, read by
    the parent) before the vote, so the file exists once any rank knows the run is off."""
    if spec["tp"] == 1:
        return None
    from fastverify.backends.base import ProbeContext, make_backend, probe

    ctx = ProbeContext.detect(None, device=device, dtype=dtype, p2p=spec["p2p_ok"], single_node=True)
    if spec["p2p_note"] and ctx.p2p_ok is not None:
        ctx = dataclasses.replace(ctx, p2p_note=spec["p2p_note"])
    cap = probe(spec["backend"], ctx)
    if not cap.ok:
        (workdir / f"rank{rank}.unavailable").write_text(
            f"--backend {spec['backend']}: unavailable on rank {rank}: {cap.reason}")
    flag = torch.tensor([0 if cap.ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()):
        raise UserError(f"--backend {spec['backend']}: unavailable on {'this' if not cap.ok else 'another'} rank")
    return make_backend(spec["backend"], None, device=device, dtype=dtype, max_numel=tokens * hidden,
                        hidden=hidden, context=ctx)


def _run_rank(rank: int, spec: dict, workdir: Path) -> dict:
    import torch
    import torch.distributed as dist

    from fastverify.live.forward import DEFAULT_CONTEXT_TOKENS, TPVerifyModel

    tp, cuda = spec["tp"], spec["cuda"]
    timeout = timedelta(seconds=spec["timeout_s"])
    device = rank_device(rank, cuda, spec["threads"])
    store = dist.TCPStore(_HOST, spec["port"], None, False, timeout=timeout)
    dist_backend = spec["dist_backend"]
    dist.init_process_group(dist_backend, store=store, rank=rank, world_size=tp, timeout=timeout)
    # No teardown on error: the process exits at once (os._exit), and destroying a communicator with
    # work in flight can block and hide the error behind the timeout.
    config = ModelConfig(**spec["config"])
    dtype = getattr(torch, spec["dtype"])
    tokens = spec["batch"] * spec["draft_tokens"]
    ar = _make_allreduce(rank, spec, device, dtype, tokens, config.hidden_size, workdir, torch, dist)
    if ar is not None:
        ar.prepare([(tokens, config.hidden_size)])  # before any forward, so before graph capture
    model = TPVerifyModel(config, tp=tp, rank=rank, batch=spec["batch"], draft_tokens=spec["draft_tokens"],
                          device=device, dtype=dtype, context_tokens=DEFAULT_CONTEXT_TOKENS, backend=ar)
    for _ in range(spec["warmup"]):
        model.forward()
    if cuda:
        torch.cuda.synchronize()
    rows, labels, steps = _time_forwards(model, spec["iters"], rank, cuda, torch, dist)
    meta = {
        "timing": "cuda_events" if cuda else "cpu_wall_clock",
        "device": torch.cuda.get_device_name(rank) if cuda else "cpu",
        "dist_backend": dist_backend,
        "allreduce_backend": spec["backend"],
        "world_size": tp,
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
    if cuda:
        meta["nccl_version"] = _nccl_version(torch)
        if spec["trace_dir"] is not None:
            meta["trace_file"] = _export_trace(model, rank, spec["trace_dir"], torch, dist)
    if ar is not None:
        meta["allreduce_paths"] = dict(ar.path_counts)
        ar.close()  # collective for the IPC backends: every rank reaches it, before the group goes
    dist.destroy_process_group()
    return {"rows": rows, "labels": labels, "steps": steps, "meta": meta}


def _time_forwards(model, iters: int, rank: int, cuda: bool, torch, dist) -> tuple[list[list], list[str], list[list]]:
    """Run ``iters`` timed forwards, each after a barrier. Returns rows ``[name, cls, start_ns, dur_ns,
    msg_bytes]``, their labels, and steps ``[name, start_ns, end_ns]`` (clocks: module docstring)."""
    rows: list[list] = []
    labels: list[str] = []
    steps: list[list] = []
    for i in range(iters):
        if cuda:
            torch.cuda.synchronize()
            dist.barrier(device_ids=[rank])
            torch.cuda.synchronize()
            rec = _CudaEventRecorder(torch)
            base_ns = time.perf_counter_ns()
            base = rec.event()
            model.forward(rec)
            end = rec.event()
            torch.cuda.synchronize()
            r, lab = rec.resolve(base, base_ns)
            step_end = base_ns + round(base.elapsed_time(end) * 1e6)
            steps.append([f"verify#{i}", base_ns, max(step_end, r[-1][2] + r[-1][3])])
        else:
            dist.barrier()
            rec = _WallClockRecorder()
            start = time.perf_counter_ns()
            model.forward(rec)
            steps.append([f"verify#{i}", start, time.perf_counter_ns()])
            r, lab = rec.rows, rec.labels
        rows += r
        labels += lab
    return rows, labels, steps


def _nccl_version(torch) -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - optional fact; torch built without NCCL raises
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _export_trace(model, rank: int, trace_dir: str, torch, dist) -> str:
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
    from fastverify.cudagraph import capture_cuda_graph

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
