"""Run the synthetic verify forward on ``tp`` rank processes and return one :class:`RankEvents` per rank.

Process model: one fresh Python process per rank (:mod:`fastverify.live.worker`; no inherited CUDA
or gloo state, as SGLang starts its scheduler ranks with ``spawn``). The environment passes through,
so ``NCCL_*`` settings reach the ranks. The parent holds the rendezvous ``TCPStore`` on 127.0.0.1
with a port the OS picks, so no port is guessed. The spec goes to each rank as a JSON file and the
result comes back as ``rank<r>.json`` in a temporary directory; stderr goes to ``rank<r>.stderr``
there, and stdout is never parsed. A rank that exits non-zero or outlives ``timeout_s`` ends the
run: every rank's process group is stopped by the one launcher's kill rule
(:class:`fastverify.procs.RankGroup`: SIGTERM, then SIGKILL) and :class:`~fastverify.errors.UserError`
names the rank and the last line of its stderr. While the parent waits it reads each rank's
``rank<r>.progress`` (one line per stage) and prints progress lines on stderr
(:mod:`fastverify.progress`). The checks before any rank starts are in :mod:`fastverify.live.preflight`,
the clocks in :mod:`fastverify.live.clocks`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import orjson

from fastverify.errors import UserError
from fastverify.events import EventClass, RankEvents, Step
from fastverify.live.config import ModelConfig
from fastverify.live.preflight import CpuEstimate, LivePlan, bytes_text, check_p2p_for, check_run_args, plan_run
from fastverify.live.worker import HOST, worker_argv
from fastverify.procs import RankGroup, child_env, exit_reason, failure_time, last_stderr_line, rank_workdir
from fastverify.progress import Progress, default_after_s, say

logger = logging.getLogger(__name__)


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
    progress: bool = True,
) -> list[RankEvents]:
    """Time ``iters`` verify forwards of ``config`` on ``tp`` ranks (after ``warmup`` untimed ones).

    ``config`` comes from :func:`~fastverify.live.config.load_model_config`; each rank uses one GPU
    on CUDA. ``draft_tokens`` (SGLang ``speculative_num_draft_tokens``, 1..64) × ``batch``
    (requests, 1..4096) = ``T`` tokens per forward. Each timed forward is one
    :class:`~fastverify.events.Step` ``verify#<i>``. ``device``: ``"auto"`` is CUDA + NCCL when
    ``torch.cuda.device_count() >= tp``, else CPU + gloo, said at once in one ``fastverify:`` line
    (unless ``progress`` is False) with why and the CPU run's estimate
    (:func:`~fastverify.live.preflight.estimate_cpu_run`), warning when it is over ``timeout_s``;
    ``"cpu"`` says its estimate only in that last case. ``timeout_s``: the whole run, start-up
    included, in (0, 86400] s. ``trace_dir`` (CUDA only): where each rank writes
    ``verify-TP-<rank>.trace.json.gz``. ``backend``: a :class:`fastverify.registry.BackendName`
    value, built by each rank with ``make_backend`` (P2P from the real check for a backend that
    needs it); None: NCCL on CUDA, gloo on CPU. ``dtype``: torch dtype name of weights,
    activations and all-reduces. ``progress``: progress lines on stderr (ranks started, weights
    built, forwards done with the time left; :class:`fastverify.progress.Progress`), read from
    the ranks' ``rank<r>.progress`` files; False (``--quiet``): nothing on stderr but errors.

    Returns
    -------
    list[RankEvents]
        One per rank, sorted by rank. Rows are op regions in ns of one clock shared by all ranks:
        compute (``compute:embed|attn|mlp|moe|lm_head``, ``msg_bytes = -1``), all-reduces
        (``allreduce``, ``msg_bytes = T × hidden × dtype size``; ``FUSED_ALLREDUCE`` for a fused
        all-reduce + RMSNorm backend) and the logits all-gather (``OTHER_COMM``, ``allgather``,
        ``msg_bytes = T × vocab_padded / tp × dtype size``); ``label`` says where
        (``layer3.attn_out.allreduce``). ``meta``: ``timing``, ``device``, the shapes, backends and more.

    Raises
    ------
    UserError
        Bad arguments, a model ``tp`` cannot split, a shape over the memory this machine has, a CUDA
        request without ``tp`` GPUs, an unknown backend or one that cannot run here (all before any
        rank starts: :mod:`fastverify.live.preflight`), or a rank that crashed or timed out (naming
        the rank, how far the run got and the rank's last stderr line).
    """
    job_start = time.monotonic()
    check_run_args(
        config, tp=tp, draft_tokens=draft_tokens, batch=batch, iters=iters, warmup=warmup, timeout_s=timeout_s
    )
    import torch
    import torch.distributed as dist

    plan = plan_run(
        config,
        tp=tp,
        draft_tokens=draft_tokens,
        batch=batch,
        iters=iters,
        warmup=warmup,
        device=device,
        backend=backend,
        dtype=dtype,
        torch=torch,
    )
    warnings: list[str] = []
    trace_dir = _trace_dir_for(trace_dir, plan.cuda, device, warnings)
    plan = check_p2p_for(plan, tp)
    if plan.estimate is not None and progress:  # after every refusal (each is one line alone), before any rank starts
        _say_cpu_run(plan, config.name, timeout_s)
    logger.info(
        "live verify: model %s, tp %d, T = %d tokens, all-reduce %s over %s on %s",
        config.name,
        tp,
        batch * draft_tokens,
        plan.backend,
        plan.dist_backend,
        "cuda" if plan.cuda else "cpu",
    )

    # The parent owns the store (port 0: the OS picks a free one), so ranks never race for a port.
    store = dist.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    spec = {
        "config": asdict(config),
        "tp": tp,
        "draft_tokens": draft_tokens,
        "batch": batch,
        "iters": iters,
        "warmup": warmup,
        "cuda": plan.cuda,
        "port": store.port,
        "timeout_s": float(timeout_s),
        "trace_dir": None if trace_dir is None else str(Path(trace_dir).resolve()),
        "threads": max(1, (os.cpu_count() or 1) // tp),
        "warnings": warnings,
        "dist_backend": plan.dist_backend,
        "backend": plan.backend,
        "dtype": dtype,
        "p2p_ok": plan.p2p_ok,
        "p2p_note": plan.p2p_note,
    }
    try:
        return _run_ranks(spec, progress=progress, job_start=job_start, estimate=plan.estimate)
    finally:
        del store


def _trace_dir_for(trace_dir: str | None, cuda: bool, device: str, warnings: list[str]) -> str | None:
    """The run's trace directory, created; None on CPU, where ``--device auto`` adds a warning to
    ``warnings`` and an explicit ``--device cpu`` is refused (a CPU run has no CUDA graph)."""
    if trace_dir is not None and not cuda:
        if device == "cpu":
            raise UserError("a trace directory needs --device cuda: a CPU run has no CUDA graph to trace")
        warnings.append("trace_dir ignored: no CUDA run (fewer GPUs than --tp), so no CUDA graph to trace")
        logger.warning("%s", warnings[-1])
        return None
    if trace_dir is not None:
        try:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create trace directory {trace_dir}: {err.strerror or err}") from None
    return trace_dir


def _say_cpu_run(plan: LivePlan, model: str, timeout_s: float) -> None:
    """The one ``fastverify:`` line of a CPU run: always after a ``--device auto`` fallback (why, and
    the estimate), else only when the estimate is over ``timeout_s``."""
    estimate = plan.estimate
    late = (
        f"; that is over --timeout {timeout_s:g} s, so raise --timeout or the run will be stopped"
        if estimate.seconds > timeout_s
        else ""
    )
    if plan.fallback:
        say(f"live run on CPU + gloo, not CUDA: {plan.fallback}; {estimate.describe(model)}{late}")
    elif late:
        say(f"live run on CPU: {estimate.describe(model)}{late}")


def _run_ranks(spec: dict, *, progress: bool, job_start: float, estimate: CpuEstimate | None) -> list[RankEvents]:
    """Start the ranks on ``spec`` in a fresh run folder, watch them and read their results."""
    tp = spec["tp"]
    with rank_workdir("fastverify-live-") as workdir:
        spec_path = Path(workdir) / "spec.json"
        spec_path.write_bytes(orjson.dumps(spec))
        watch = LiveWatch(
            workdir,
            tp,
            warmup=spec["warmup"],
            iters=spec["iters"],
            enabled=progress,
            job_start=job_start,
            estimate=estimate,
        )
        try:
            launch_ranks(worker_argv(str(spec_path)), tp, spec["timeout_s"], workdir, child_env(), watch=watch)
        except UserError:
            # A backend a rank could not build: its probe's line, not "rank r failed".
            refused = sorted(Path(workdir).glob("rank*.unavailable"))
            if refused:
                raise UserError(refused[0].read_text().strip()) from None
            raise
        return [_load_result(Path(workdir), r, spec["dist_backend"]) for r in range(tp)]


def launch_ranks(
    argv: Callable[[int], list[str]],
    tp: int,
    timeout_s: float,
    workdir: str,
    env: dict[str, str] | None = None,
    watch: LiveWatch | None = None,
) -> None:
    """Start ``tp`` processes ``argv(rank)`` (stderr to ``workdir/rank<r>.stderr``) and wait for all to exit 0.

    The ranks run under :class:`fastverify.procs.RankGroup`, the one launcher and kill rule. On the
    first failure (the earliest by the time the rank recorded in ``rank<r>.failed``, else by when
    the exit was seen) or at the deadline, every rank's process group is stopped (SIGTERM, then
    SIGKILL) and a one-line :class:`UserError` names the rank, the reason and the last line of its
    stderr (and, with a ``watch``, how far the run had got). While it waits it calls
    ``watch.poll()`` (progress lines) every :data:`_WATCH_EVERY_S` seconds.
    """
    deadline = time.monotonic() + timeout_s
    next_watch = 0.0
    with RankGroup(workdir, env=env) as ranks:
        ranks.start(argv(rank) for rank in range(tp))
        while True:
            seen_exit = ranks.poll()
            failed = [r for r in seen_exit if ranks.returncode(r) != 0]
            if failed:
                rank = min(failed, key=lambda r: (failure_time(workdir, r, seen_exit[r]), r))
                raise UserError(
                    f"live rank {rank} failed ({exit_reason(ranks.returncode(rank))}): "
                    f"{last_stderr_line(workdir, rank)}"
                )
            if len(seen_exit) == tp:
                if watch is not None:
                    watch.poll()  # the last forward's line
                return
            now = time.monotonic()
            if watch is not None and now >= next_watch:
                watch.poll()
                next_watch = now + _WATCH_EVERY_S
            if now >= deadline:
                rank = min(r for r in range(tp) if r not in seen_exit)
                got = "" if watch is None else f"{watch.reached()}; "
                raise UserError(
                    f"live rank {rank} did not finish within {timeout_s:g} s "
                    f"({got}last stderr line: {last_stderr_line(workdir, rank)})"
                )
            time.sleep(0.02)


_WATCH_EVERY_S = 0.25
"""Seconds between two reads of the ranks' progress files by the waiting parent."""


HEARTBEAT_S = 5.0
"""Longest a live run's progress stays silent once it has begun printing (s)."""


class LiveWatch:
    """The parent's view of a live run's progress, read from the ranks' ``rank<r>.progress`` files.

    A rank appends one line per stage (``up`` once it has joined the process group, ``built
    <bytes>`` once its weights are allocated; rank 0 also ``forward <k>`` after its k-th forward,
    warm-up ones first, and ``trace`` before the CUDA trace export). :meth:`poll` turns new lines
    into :class:`~fastverify.progress.Progress` lines; :meth:`reached` says how far the run got,
    for a timeout message."""

    def __init__(
        self,
        workdir: str | Path,
        tp: int,
        *,
        warmup: int,
        iters: int,
        enabled: bool = True,
        job_start: float | None = None,
        estimate: CpuEstimate | None = None,
        stream=None,
    ) -> None:
        self.workdir = Path(workdir)
        self.stream = stream  # the lines' stream (None: stderr)
        self.tp, self.warmup, self.iters = tp, warmup, iters
        self.enabled = enabled
        self.job_start = time.monotonic() if job_start is None else job_start
        self.estimate = estimate
        self._sizes = [-1] * tp
        self.stages: list[list[str]] = [[] for _ in range(tp)]
        self.up = self.built = self.forwards = 0
        self.weight_bytes = 0
        self.tracing = False
        # Ranks start and build side by side: no time left from the first one's pace.
        self._up = Progress(
            "live run: ranks started", tp, enabled=enabled, job_start=self.job_start, eta=False, stream=stream
        )
        self._built = Progress(
            "live run: weights built", tp, enabled=enabled, job_start=self.job_start, eta=False, stream=stream
        )
        self._fwd: Progress | None = None
        self._last_line: float | None = None

    def _read(self) -> None:
        for rank in range(self.tp):
            path = self.workdir / f"rank{rank}.progress"
            try:
                size = path.stat().st_size
                if size == self._sizes[rank]:
                    continue
                text = path.read_text(errors="replace")
            except OSError:
                continue
            self._sizes[rank] = size
            self.stages[rank] = text.split("\n")[:-1]  # complete lines only

    def _count(self) -> tuple[int, int, int]:
        """Ranks up, ranks built, and rank 0's forwards done, from the files as they are now."""
        self._read()
        up = sum("up" in lines for lines in self.stages)
        built_lines = [next((ln for ln in lines if ln.startswith("built ")), None) for lines in self.stages]
        built = sum(b is not None for b in built_lines)
        if built and not self.weight_bytes:
            self.weight_bytes = int(next(b for b in built_lines if b is not None).split()[1])
        forwards = max((int(ln.split()[1]) for ln in self.stages[0] if ln.startswith("forward ")), default=0)
        self.tracing = "trace" in self.stages[0]
        return up, built, forwards

    def poll(self) -> None:
        """Read the progress files and print the lines that are due; with nothing new for
        :data:`HEARTBEAT_S`, one line saying what is running (a CPU forward of a large model takes
        15 s and more, and no command may stay silent for over 10 s)."""
        up, built, forwards = self._count()
        printed = False
        if up > self.up:
            self.up = up
            printed |= self._up.update(up)
        if built > self.built:
            self.built = built
            printed |= self._built.update(built, f"{bytes_text(self.weight_bytes)} per rank")
        if built == self.tp and self._fwd is None:
            # The forwards begin once every rank is built: the time left comes from their own rate.
            self._fwd = Progress(
                "live run: forwards",
                self.warmup + self.iters,
                enabled=self.enabled,
                job_start=self.job_start,
                stream=self.stream,
            )
        if forwards > self.forwards and self._fwd is not None:
            self.forwards = forwards
            printed |= self._fwd.update(forwards, self._which(forwards))
        now = time.monotonic()
        if printed or self._last_line is None:
            self._last_line = now
        elif self.enabled and now - self._last_line >= HEARTBEAT_S and now - self.job_start >= default_after_s():
            self._last_line = now
            say(
                f"live run: {self._running(up, built, forwards)}, {now - self.job_start:.1f} s elapsed",
                stream=self.stream,
            )

    def _running(self, up: int, built: int, forwards: int) -> str:
        if up < self.tp:
            return f"starting ranks ({up}/{self.tp} up)"
        if built < self.tp:
            return f"building weights ({built}/{self.tp} ranks done)"
        if forwards < self.warmup + self.iters:
            return f"forward {forwards + 1}/{self.warmup + self.iters} running ({self._which(forwards + 1)})"
        return "exporting the CUDA trace" if self.tracing else "collecting the ranks' results"

    def _which(self, k: int) -> str:
        return f"warm-up {k}/{self.warmup}" if k <= self.warmup else f"timed {k - self.warmup}/{self.iters}"

    def reached(self) -> str:
        """How far the run got, e.g. ``"reached: 2/2 ranks started, 2/2 built, forward 3/7 (timed
        1/5)"``, plus the CPU estimate when there is one (for a timeout message)."""
        up, built, forwards = self._count()
        parts = [f"{up}/{self.tp} ranks started"]
        if up:
            parts.append(f"{built}/{self.tp} built")
        if built == self.tp:
            parts.append(
                f"forward {forwards}/{self.warmup + self.iters}" + (f" ({self._which(forwards)})" if forwards else "")
            )
        if self.tracing:
            parts.append("exporting the CUDA trace")
        est = "" if self.estimate is None else f"; estimated {self.estimate.seconds:.0f} s for the whole run"
        return "reached: " + ", ".join(parts) + est


def _load_result(workdir: Path, rank: int, backend: str) -> RankEvents:
    path = workdir / f"rank{rank}.json"
    try:
        doc = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as err:
        raise UserError(f"live rank {rank} exited without a result ({path.name}: {err})") from None
    rows = [(name, EventClass(cls), start, dur, nbytes) for name, cls, start, dur, nbytes in doc["rows"]]
    steps = [Step(name, start, end) for name, start, end in doc["steps"]]
    return RankEvents.from_rows(rank, f"live:{backend}", rows, steps=steps, labels=doc["labels"], meta=doc["meta"])
