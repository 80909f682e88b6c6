"""Run tuning trials, each in a fresh set of rank processes, with a timeout, a journal and resume.

Per trial the parent opens a ``TCPStore`` on 127.0.0.1 (OS-chosen port), writes the spec as JSON
into a temporary directory and starts ``world_size`` processes ``python -m fastverify.tune.worker
SPEC RANK`` (stdout discarded, stderr to ``rank<r>.stderr``, results back as ``rank<r>.json``)
through :class:`fastverify.procs.RankGroup`, the one launcher (the pattern of
:mod:`fastverify.live.runner`): each rank in its own session and process group, SIGKILLed by Linux
when the parent dies, so a ``kill -9`` of the sweep leaves no ranks behind. A trial runs in three
phases, each with its own limit (:class:`TrialLimits`); a rank that exits non-zero, or a phase
past its limit, ends the trial: every rank's group is stopped (SIGTERM, then SIGKILL after a
grace period), the trial is recorded as ``failed`` with a one-line reason naming the phase and
each unfinished rank's last stage, and the sweep goes on. The trial's ``env`` is set over the
parent's own environment, then its ``server_env`` (what SGLang's start-up sets,
:mod:`fastverify.tune.server_env`) over that, and both are applied again by the worker before it
imports torch; each result records the environment the ranks ran with.

The sweep's trial progress on stderr (:class:`TrialProgress`): a rich bar on a terminal, plain ``fastverify:`` lines with
a heartbeat elsewhere (CI, a log file), and a line for every trial that does not end ``ok``.

The sweep journal: an append-only JSONL file, one record per finished trial, durable at once.

Layout: line 1 is the header ``{"kind": "header", "schema_version", "fingerprint", "config",
"trial_ids", "created_unix_s"}``; every further line is ``{"kind": "trial", "spec": {...},
"result": {...}}`` (:meth:`TrialSpec.to_dict` / :meth:`TrialResult.to_dict`). Each record is
written with one ``write`` of the whole line, then ``flush()`` and ``os.fsync()``, so after a
``kill -9`` (or power loss) only the last line can be incomplete. Reading drops such a torn last
line and says so (:attr:`JournalContents.torn_bytes`, and a log warning); a resumed sweep cuts it
off before appending. A bad line anywhere else is corruption and a :class:`UserError`.

The fingerprint identifies the sweep (its trial ids and config, :func:`fingerprint`); resuming a
journal written by a different sweep is refused with a one-line :class:`UserError`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson

from fastverify.bounds import (
    MAX_COUNT,
    MAX_MSG_BYTES,
    MIN_TIME_US,
    duplicate_json_key,
    implausible_count,
    implausible_time_us,
    implausible_work_us,
)
from fastverify.console import say as say_line
from fastverify.errors import UserError
from fastverify.inputs import read_bytes
from fastverify.outputs import check_folder

# Shared rank-process helpers of the live runner (private there; see the module docstring).
from fastverify.procs import (
    RankGroup,
    child_env as _child_env,
    exit_reason as _exit_reason,
    failure_time as _failure_time,
    last_stderr_line as _last_stderr_line,
    rank_workdir,
)
from fastverify.progress import Progress as Lines, default_after_s, say
from fastverify.tune.server_env import recorded_environment
from fastverify.tune.trial import (
    DTYPE_BYTES,
    Clock,
    Device,
    NotRankedStatus,
    SizeResult,
    TrialResult,
    TrialSpec,
    TrialStatus,
    fell_back,
    path_counts,
    path_meta,
)
from fastverify.tune.worker import BUILT_MARK, HOST, READY_MARK

JOURNAL_SCHEMA_VERSION = 2
# 2: trial ids include the norm kernel every backend of the sweep shares (TrialSpec.norm); a version-1
# journal's ids cannot match, so it is refused with the start-over message instead of 'corrupt'.


def fingerprint(trials: Sequence[TrialSpec], config: Mapping[str, Any] | None = None) -> str:
    """A stable hash of a sweep: the sorted trial ids plus ``config`` (JSON-able: workload, box…)."""
    doc = {"trials": sorted(t.trial_id for t in trials), "config": dict(config or {})}
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


@dataclass(frozen=True)
class JournalRecord:
    spec: TrialSpec
    result: TrialResult


@dataclass(frozen=True)
class JournalContents:
    """What :func:`read_journal` found.

    ``header`` is None for an empty file (or one whose only line is a torn header). ``good_bytes``
    is the length of the valid prefix; ``torn_bytes`` the length of a dropped torn last line (0: none).
    """

    header: dict | None
    records: tuple[JournalRecord, ...]
    good_bytes: int
    torn_bytes: int

    @property
    def fingerprint(self) -> str | None:
        return None if self.header is None else self.header.get("fingerprint")

    def by_id(self) -> dict[str, JournalRecord]:
        return {r.result.trial_id: r for r in self.records}


def read_journal(path: str | Path) -> JournalContents:
    """Read a journal, tolerating a torn last line (dropped, logged, counted in ``torn_bytes``).

    Raises
    ------
    UserError
        The file cannot be read (not a regular file, over 512 MiB), is not a fastverify tune
        journal, or has a bad line before the last (a time below ``MIN_TIME_US``, a value past
        :mod:`fastverify.bounds`).
    """
    path = Path(path)
    raw = read_bytes(path, kind="json", what="journal")  # a FIFO, a device, a file over 512 MiB: refused
    lines = raw.split(b"\n")
    # A complete file ends with "\n", so the last piece is b"". Anything else there is a torn line.
    pieces = [(ln, True) for ln in lines[:-1]] + ([(lines[-1], False)] if lines[-1] else [])
    header: dict | None = None
    records: list[JournalRecord] = []
    offset = 0
    for i, (line, complete) in enumerate(pieces):
        is_last = i == len(pieces) - 1
        try:
            doc = _parse(line, complete)
            if i == 0:
                header = _check_header(doc, path)
            else:
                records.append(_record(doc))
        except (ValueError, TypeError, KeyError, AttributeError, orjson.JSONDecodeError) as err:
            if not is_last or complete:  # only a last line without its newline can be a torn write
                raise UserError(
                    f"journal {path} line {i + 1} is corrupt ({_one_line(err)}); "
                    f"move the file away to start the sweep over"
                ) from None
            logger.warning(
                "journal %s: dropped a torn last line (%d bytes, line %d), left by an "
                "interrupted write; that trial runs again",
                path,
                len(raw) - offset,
                i + 1,
            )
            return JournalContents(header, tuple(records), offset, len(raw) - offset)
        offset += len(line) + (1 if complete else 0)
    return JournalContents(header, tuple(records), offset, 0)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _parse(line: bytes, complete: bool) -> dict:
    if not complete:
        raise ValueError("line has no end (torn write)")
    doc = orjson.loads(line)
    if not isinstance(doc, dict):
        raise ValueError("record is not a JSON object")
    if (key := duplicate_json_key(line)) is not None:  # a hand edit: which value holds is not known
        raise ValueError(f"the key {key[:80]!r} is given twice")
    return doc


def _check_header(doc: dict, path: Path) -> dict:
    if doc.get("kind") != "header" or "fingerprint" not in doc:
        raise UserError(
            f"{path} is not a fastverify tune journal (first line is not its header); pass another --journal path"
        )
    if doc.get("schema_version") != JOURNAL_SCHEMA_VERSION:
        raise UserError(
            f"journal {path} has schema_version {doc.get('schema_version')!r}, this fastverify "
            f"reads {JOURNAL_SCHEMA_VERSION}; start the sweep over without --resume"
        )
    return doc


def _record(doc: dict) -> JournalRecord:
    if doc.get("kind") != "trial":
        raise ValueError(f"unknown record kind {doc.get('kind')!r}")
    spec = TrialSpec.from_dict(doc["spec"])
    result = TrialResult.from_dict(doc["result"])
    # Times are compared, summed and divided later: refuse now anything that is not a plausible
    # measurement (fastverify.bounds: a time of work in [MIN_TIME_US, 1 hour] µs, a size <= 1 TiB,
    # counts <= 1e9; a step of no work, 0 µs, only where no size was timed).
    for size in result.sizes:
        for name in ("median_us", "p90_us"):
            v = getattr(size, name)
            if v is not None and (why := implausible_work_us(v)):
                raise ValueError(f"{name} {why}")
        for name, upper in (("numel", MAX_MSG_BYTES), ("msg_bytes", MAX_MSG_BYTES), ("count_per_step", MAX_COUNT)):
            if why := implausible_count(getattr(size, name), upper=upper, what=name):
                raise ValueError(f"{name} {why}")
    step = result.step_us
    if step is not None and (
        why := implausible_time_us(step) or (0 < step < MIN_TIME_US and implausible_work_us(step))
    ):
        raise ValueError(f"step_us {why}")
    if result.trial_id != spec.trial_id:
        raise ValueError(f"result trial id {result.trial_id!r} differs from its spec's {spec.trial_id!r}")
    return JournalRecord(spec, result)


class Journal:
    """An open journal for appending. Make it with :meth:`open`; use as a context manager.

    Attributes
    ----------
    path : Path
    done : dict[str, JournalRecord]
        Trials already journaled (by id) when it was opened with ``resume=True``; else empty.
    torn_bytes : int
        Bytes of a torn last line cut off when resuming (0: none).
    """

    def __init__(self, path: Path, fh, done: dict[str, JournalRecord], torn_bytes: int) -> None:
        self.path = path
        self._fh = fh
        self.done = done
        self.torn_bytes = torn_bytes

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        fingerprint: str,
        resume: bool,
        config: Mapping[str, Any] | None = None,
        trial_ids: Sequence[str] = (),
    ) -> Journal:
        """Open ``path`` for a sweep with ``fingerprint``.

        ``resume=True``: keep the records of an existing journal of the same sweep (a torn last
        line is cut off first); a missing or empty file starts a new journal. ``resume=False``: an
        existing non-empty file is kept as ``<path>.bak`` (replacing an older backup) and a new
        journal begins.

        Raises
        ------
        UserError
            ``resume=True`` on a journal of another sweep (fingerprint mismatch) or a corrupt one;
            the path cannot be written.
        """
        path = Path(path)
        done: dict[str, JournalRecord] = {}
        torn = 0
        exists = path.exists() and path.stat().st_size > 0
        if exists and resume:
            contents = read_journal(path)
            if contents.header is not None:
                if contents.fingerprint != fingerprint:
                    raise UserError(
                        f"journal {path} belongs to a different sweep (fingerprint "
                        f"{contents.fingerprint}, this sweep {fingerprint}): resume with the "
                        f"same trials and settings, or run without --resume to start over"
                    )
                done = contents.by_id()
                torn = contents.torn_bytes
                if torn:
                    _truncate(path, contents.good_bytes)
                return cls(path, _open_append(path), done, torn)
            torn = contents.torn_bytes  # only a torn header: nothing to keep, start over below
        elif exists:
            backup = path.with_name(path.name + ".bak")
            os.replace(path, backup)
            logger.warning(
                "journal %s existed; kept it as %s and started a new one (use --resume to continue it)", path, backup
            )
        check_folder(path, "journal")  # "afile/j.jsonl": afile is a file (mkdir would say "File exists")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create the journal's folder {path.parent}: {err.strerror or err}") from None
        journal = cls(path, _open_append(path, truncate=True), done, torn)
        journal._write(
            {
                "kind": "header",
                "schema_version": JOURNAL_SCHEMA_VERSION,
                "fingerprint": fingerprint,
                "config": dict(config or {}),
                "trial_ids": list(trial_ids),
                "created_unix_s": time.time(),
            }
        )
        _fsync_dir(path.parent)
        return journal

    def append(self, spec: TrialSpec, result: TrialResult) -> None:
        """Write one finished trial and make it durable (flush + fsync) before returning."""
        if spec.trial_id != result.trial_id:
            raise ValueError(f"result trial id {result.trial_id!r} does not match spec {spec.trial_id!r}")
        self._write({"kind": "trial", "spec": spec.to_dict(), "result": result.to_dict()})

    def _write(self, doc: dict) -> None:
        if self._fh is None:
            raise ValueError(f"journal {self.path} is closed")
        self._fh.write(orjson.dumps(doc) + b"\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_append(path: Path, truncate: bool = False):
    try:
        return open(path, "wb" if truncate else "ab")
    except OSError as err:
        raise UserError(f"cannot write journal {path}: {err.strerror or err}") from None


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(size)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(folder: Path) -> None:
    """Make the journal's directory entry durable too (a new file can vanish on power loss without it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


logger = logging.getLogger(__name__)

WORKER_MODULE = "fastverify.tune.worker"
DEFAULT_STARTUP_TIMEOUT_S = 180.0
DEFAULT_BUILD_TIMEOUT_S = 900.0
"""Seconds for a trial's build phase. Generous on purpose: a first-use nvcc build of a FlashInfer
JIT module takes minutes (not measured here: no GPU in CI), and ``tune()`` times a ladder of batch
sizes per hidden size; every rank waits on the same build (FlashInfer locks its JIT cache)."""
BUILD_HANG = "hung while building/JIT-compiling the backend"
_STAGE_PREFIX = "fastverify-tune rank "
CPU_NOTE = (
    "CPU/gloo: host wall-clock times of gloo all-reduces, not GPU times; gloo ignores NCCL_* "
    "settings, so trials that differ only in NCCL settings measure the same thing"
)


@dataclass(frozen=True)
class TrialLimits:
    """The three wall-clock limits of one trial, in seconds. The doctor and ``tune`` share them
    through :func:`run_trial`.

    Attributes
    ----------
    measure_s : float
        From the moment every rank is built until every rank has exited (hung IPC kernels spin
        forever).
    startup_s : float
        From starting the processes until every rank has joined the process group (interpreter,
        torch, CUDA and NCCL start-up, which varies a lot between machines).
    build_s : float
        From the moment every rank is up until every rank has built (made the backend, prepared
        and tuned it, called it once per size). FlashInfer JIT-compiles with nvcc on first use
        (the PCIe IPC module in the workspace constructor, ``trtllm_comm`` at its first call),
        which takes minutes; later runs load the cached build. A hang here is reported as
        :data:`BUILD_HANG`.

    Raises
    ------
    UserError
        A limit that is not a number > 0.
    """

    measure_s: float
    startup_s: float = DEFAULT_STARTUP_TIMEOUT_S
    build_s: float = DEFAULT_BUILD_TIMEOUT_S

    def __post_init__(self) -> None:
        for what, value in (
            ("trial timeout", self.measure_s),
            ("start-up timeout", self.startup_s),
            ("build timeout", self.build_s),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UserError(f"the {what} must be > 0 seconds, got {value!r}")

    @property
    def total_s(self) -> float:
        """All three together: the ranks' store and process-group timeout."""
        return float(self.measure_s + self.startup_s + self.build_s)


def run_sweep(
    trials: Sequence[TrialSpec],
    *,
    journal_path: str | Path,
    timeout_s: float,
    resume: bool = False,
    progress: bool = False,
    config: Mapping[str, Any] | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    build_timeout_s: float = DEFAULT_BUILD_TIMEOUT_S,
) -> list[TrialResult]:
    """Run every trial not yet journaled, one after another, each in fresh rank processes.

    Parameters
    ----------
    trials : sequence of TrialSpec
        Distinct trials (by ``trial_id``), run in this order.
    journal_path : str or Path
        The JSONL journal; each finished trial is appended and
        fsynced before the next one starts.
    timeout_s : float
        Per-trial measurement limit in seconds, counted from the moment every rank has built its
        backend; past it the trial's ranks are killed and it is recorded as ``failed``
        (``"timeout after N s; still running: rank R: <its last stage>"``).
    resume : bool
        Keep the trials already in the journal (same sweep: same trials and ``config``) and run
        only the others. False: an existing journal is kept as ``<journal>.bak`` and all trials run.
    progress : bool
        Show progress on stderr: trial i/N, elapsed and time left, as a rich bar on a terminal
        and as plain ``fastverify:`` lines elsewhere (CI, a log file); see
        :class:`TrialProgress`.
    config : Mapping or None
        JSON-able description of the sweep (workload, box fingerprint…), part of the journal's
        fingerprint.
    startup_timeout_s : float
        Limit in seconds from starting a trial's processes until all have joined the process group
        (``"start-up timeout after N s ..."`` past it).
    build_timeout_s : float
        Limit in seconds from then until every rank has built, prepared (tuned) and once called its
        backend (``"build timeout after N s (hung while building/JIT-compiling the backend); still
        building: rank R: <its last stage>"`` past it). Default :data:`DEFAULT_BUILD_TIMEOUT_S`.

    Returns
    -------
    list[TrialResult]
        One per trial, in the order of ``trials``; journaled ones come from the journal.

    Raises
    ------
    UserError
        A bad timeout, or a journal that cannot be used (:meth:`Journal.open`).
    ValueError, TypeError
        ``trials`` is not a sequence of distinct :class:`TrialSpec`, or its trials ask for
        different ``norm`` kernels (one sweep compares all-reduces on one norm).
    """
    trials = list(trials)
    ids = _trial_ids(trials)
    limits = TrialLimits(measure_s=timeout_s, startup_s=startup_timeout_s, build_s=build_timeout_s)
    fp = fingerprint(trials, config)
    with Journal.open(journal_path, fingerprint=fp, resume=resume, config=config, trial_ids=ids) as journal:
        done = {i: rec.result for i, rec in journal.done.items()}
        todo = [t for t in trials if t.trial_id not in done]
        if done:
            logger.info("resuming %s: %d of %d trials already done", journal.path, len(trials) - len(todo), len(trials))
        with TrialProgress(progress, len(todo)) as bar:
            for t in todo:
                bar.start(t)
                result = run_trial(
                    t, timeout_s=limits.measure_s, startup_timeout_s=limits.startup_s, build_timeout_s=limits.build_s
                )
                journal.append(t, result)
                done[t.trial_id] = result
                bar.finish(t, result)
    return [done[i] for i in ids]


def _trial_ids(trials: list) -> list[str]:
    """The trials' ids, in order, once each is known to be a :class:`TrialSpec`, distinct, and on
    the sweep's one norm kernel (the errors of :func:`run_sweep`)."""
    for t in trials:
        if not isinstance(t, TrialSpec):
            raise TypeError(f"trials must hold TrialSpec objects, got {type(t).__name__}")
    ids = [t.trial_id for t in trials]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"trials holds trial {dup} twice; each trial must be distinct")
    norms = sorted({t.norm for t in trials})
    if len(norms) > 1:
        raise ValueError(
            f"trials ask for norm kernels {norms}; every trial of one sweep must use the same "
            f"TrialSpec.norm, so backends are compared on the same residual + RMSNorm"
        )
    return ids


def run_trial(
    spec: TrialSpec,
    *,
    timeout_s: float,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    build_timeout_s: float = DEFAULT_BUILD_TIMEOUT_S,
) -> TrialResult:
    """Run one trial in ``spec.world_size`` fresh rank processes (limits as in :func:`run_sweep`
    and :class:`TrialLimits`); never raises for a trial that crashes, hangs, is unavailable or
    computes a wrong result: that is the returned status.

    Raises
    ------
    UserError
        A limit that is not > 0.
    """
    import torch
    import torch.distributed as dist

    limits = TrialLimits(measure_s=timeout_s, startup_s=startup_timeout_s, build_s=build_timeout_s)
    started = time.time()
    note = CPU_NOTE if spec.device is Device.CPU else ""
    if spec.device is Device.CUDA:  # (skipped before any rank runs: no environment to record)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < spec.world_size:
            return _result(
                spec, TrialStatus.SKIPPED, f"needs {spec.world_size} GPUs, found {count}", started, note=note
            )
    limit_s = limits.total_s  # for the store and the process group's collectives
    store = dist.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=limit_s), wait_for_workers=False)
    try:
        with rank_workdir("fastverify-tune-") as workdir:
            doc = {
                "trial": spec.to_dict(),
                "port": store.port,
                "timeout_s": limit_s,
                "workdir": workdir,
                "threads": max(1, (os.cpu_count() or 1) // spec.world_size),
            }
            spec_path = Path(workdir) / "spec.json"
            spec_path.write_bytes(orjson.dumps(doc))
            env = _child_env()
            env.update(spec.run_env)
            recorded = recorded_environment(env, *spec.run_env)
            failure = launch_trial(str(spec_path), spec.world_size, limits, workdir, env)
            if failure:
                return replace(_result(spec, TrialStatus.FAILED, failure, started, note=note), environment=recorded)
            return replace(collect_trial(spec, Path(workdir), started, note), environment=recorded)
    finally:
        del store


def launch_trial(spec_path: str, world: int, limits: TrialLimits, workdir: str, env: dict[str, str]) -> str:
    """Start the ranks and wait: ``""`` when all exit 0, else the one-line failure reason. The
    ranks run under :class:`fastverify.procs.RankGroup` (the one launcher): at the end every rank's
    whole process group is stopped by its kill rule (SIGTERM, then SIGKILL)."""
    phase = 0  # index into phases: the ranks' marker files move it on
    phases = (  # (marker every rank writes when the phase is over, limit, reason past the limit)
        (READY_MARK, limits.startup_s, f"start-up timeout after {limits.startup_s:g} s; still running"),
        (BUILT_MARK, limits.build_s, f"build timeout after {limits.build_s:g} s ({BUILD_HANG}); still building"),
        (None, limits.measure_s, f"timeout after {limits.measure_s:g} s; still running"),
    )
    deadline = time.monotonic() + phases[0][1]

    def marked(rank: int, mark: str) -> bool:
        return os.path.exists(os.path.join(workdir, f"rank{rank}.{mark}"))

    with RankGroup(workdir, env=env) as ranks:
        ranks.start([sys.executable, "-m", WORKER_MODULE, spec_path, str(rank)] for rank in range(world))
        while True:
            seen_exit = ranks.poll()
            failed = [r for r in seen_exit if ranks.returncode(r) != 0]
            if failed:
                rank = min(failed, key=lambda r: _blame_key(workdir, r, seen_exit[r]))
                return (
                    f"rank {rank} crashed ({_exit_reason(ranks.returncode(rank))}): "
                    f"{_stage_text(_last_stderr_line(workdir, rank))}"
                )
            if len(seen_exit) == world:
                return ""
            mark = phases[phase][0]
            while mark is not None and all(marked(r, mark) for r in range(world)):
                phase += 1
                mark, deadline = phases[phase][0], time.monotonic() + phases[phase][1]
            if time.monotonic() >= deadline:
                # Name the ranks that have not finished this phase: the ones the others wait on.
                late = [r for r in range(world) if r not in seen_exit and not (mark and marked(r, mark))]
                late = late or [r for r in range(world) if r not in seen_exit]
                where = ", ".join(f"rank {r}: {_stage_text(_last_stderr_line(workdir, r))}" for r in late)
                return f"{phases[phase][2]}: {where}"
            time.sleep(0.02)


def _blame_key(workdir: str, rank: int, seen_ns: int) -> tuple[bool, int, int]:
    """Order failed ranks by how likely each is the cause. A rank that died abruptly (signal,
    segfault, ``os._exit``: no ``rank<r>.failed``) comes first, since the others then fail through
    the worker's error handler with "connection closed" errors; then the earliest recorded failure."""
    handled = os.path.exists(os.path.join(workdir, f"rank{rank}.failed"))
    return handled, _failure_time(workdir, rank, seen_ns), rank


def _stage_text(line: str) -> str:
    """``fastverify-tune rank 1: numel 64: timing`` → ``numel 64: timing``."""
    if line.startswith(_STAGE_PREFIX):
        return line.split(": ", 1)[-1]
    return line


def collect_trial(spec: TrialSpec, workdir: Path, started: float, note: str) -> TrialResult:
    docs = []
    for rank in range(spec.world_size):
        path = workdir / f"rank{rank}.json"
        try:
            docs.append(orjson.loads(path.read_bytes()))
        except (OSError, orjson.JSONDecodeError) as err:
            return _result(
                spec,
                TrialStatus.FAILED,
                f"rank {rank} exited without a result ({path.name}: {getattr(err, 'strerror', None) or err})",
                started,
                note=note,
            )
    clock = Clock(docs[0]["clock"])
    meta = {k: v for k, v in docs[0]["meta"].items() if isinstance(v, (str, int, float, bool, type(None)))}
    meta.update(path_meta(spec, docs))
    for status in ("skipped", "wrong_result"):
        hit = [d for d in docs if d["status"] == status]
        if hit:
            reason = next((d["reason"] for d in hit if "another rank" not in d["reason"]), hit[0]["reason"])
            sizes = _sizes(spec, docs) if status == "wrong_result" else ()
            return _result(spec, TrialStatus(status), reason, started, sizes=sizes, clock=clock, note=note, meta=meta)
    sizes = _sizes(spec, docs)
    bad = next(
        (
            (s, why)
            for s in sizes
            for name in ("median_us", "p90_us")
            if getattr(s, name) is not None and (why := implausible_work_us(getattr(s, name)))
        ),
        None,
    )
    if bad is not None:  # a clock that read 0 (or 1e-300) is no measurement: never ranked or divided by
        return _result(
            spec,
            TrialStatus.FAILED,
            f"numel {bad[0].numel}: the ranks' time {bad[1]}",
            started,
            sizes=sizes,
            clock=clock,
            note=note,
            meta=meta,
        )
    step_us = sum(s.count_per_step * s.median_us for s in sizes)
    return _result(spec, TrialStatus.OK, "", started, sizes=sizes, step_us=step_us, clock=clock, note=note, meta=meta)


def _sizes(spec: TrialSpec, docs: list[dict]) -> tuple[SizeResult, ...]:
    """Per size: for each iteration the slowest rank, then median and p90 over iterations (µs)."""
    import numpy as np

    out = []
    counts = dict(spec.sizes)
    per_rank = [{s["numel"]: s for s in d["sizes"]} for d in docs]
    for numel, _ in spec.sizes:
        rows = [r[numel] for r in per_rank if numel in r]
        if len(rows) < len(per_rank):
            break
        errs = [r["max_rel_err"] for r in rows if r["max_rel_err"] is not None]
        median = p90 = None
        lengths = {len(r["times_ns"]) for r in rows}
        if len(lengths) == 1 and lengths != {0}:
            slowest = np.max(np.array([r["times_ns"] for r in rows], dtype=np.float64), axis=0) / 1e3
            median, p90 = float(np.median(slowest)), float(np.percentile(slowest, 90))
        out.append(
            SizeResult(
                numel=numel,
                msg_bytes=numel * DTYPE_BYTES[spec.dtype],
                count_per_step=counts[numel],
                median_us=median,
                p90_us=p90,
                max_rel_err=max(errs) if errs else None,
            )
        )
    return tuple(out)


def _result(
    spec: TrialSpec,
    status: TrialStatus,
    reason: str,
    started: float,
    *,
    sizes=(),
    step_us=None,
    clock=None,
    note="",
    meta=None,
) -> TrialResult:
    return TrialResult(
        trial_id=spec.trial_id,
        status=status,
        reason=reason,
        sizes=tuple(sizes),
        step_us=step_us,
        clock=clock,
        started_unix_s=started,
        finished_unix_s=time.time(),
        note=note,
        worker_meta=tuple((meta or {}).items()),
    )


# --- progress on stderr -----------------------------------------------------------------------------------

HEARTBEAT_S = 5.0
"""Longest a sweep's plain progress lines stay silent while a trial runs (s)."""


class TrialProgress:
    """Trial progress on stderr, or nothing when disabled.

    On a terminal: a rich bar, ``tune ━━━━━━ 3/8 0:01:12 ETA 0:02:05 <trial name>`` (trials done
    of all, elapsed, rich's estimate of the time left, the running trial). Anywhere else (CI, a
    log file, ``2>&1 | tee``), where a bar shows nothing until it ends: plain lines from
    :class:`fastverify.progress.Progress`, e.g. ``fastverify: tune: trials 2/8 (running nccl
    NCCL_PROTO=LL), 12.3 s elapsed, about 36.9 s left`` when a trial starts (none in the first
    2 s, at most one a second) and one when the last has finished. A trial that does not end
    ``ok`` is reported either way: a rich line on the terminal, a ``fastverify:`` line elsewhere.

    Parameters
    ----------
    enabled : bool
        False (or no trials): nothing at all.
    total : int
        Trials to run.
    console : rich.console.Console or None
        Where the bar goes and whether that is a terminal (``Console.is_terminal``); None: a
        console on stderr.
    """

    def __init__(self, enabled: bool, total: int, *, console=None) -> None:
        self.enabled = enabled and total > 0
        self.total = total
        self._console = console
        self._bar = None
        self._lines = None  # fastverify.progress.Progress when stderr is not a terminal
        self._done = 0
        self._running: tuple[TrialSpec | None, float] = (None, 0.0)
        self._last_line = float("-inf")
        self._stop = None

    def __enter__(self) -> TrialProgress:
        if self.enabled:
            from rich.console import Console

            console = self._console or Console(stderr=True)
            if console.is_terminal:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )

                self._bar = Progress(
                    TextColumn("[bold]tune[/]"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    TextColumn("ETA"),
                    TimeRemainingColumn(),
                    TextColumn("{task.description}"),
                    console=console,
                    transient=False,
                )
                self._bar.__enter__()
                self._task = self._bar.add_task("", total=self.total)
            else:
                self._lines = Lines("tune: trials", self.total, stream=console.file)
                self._stop = threading.Event()
                self._beat = threading.Thread(target=self._heartbeat, name="fastverify-tune-progress", daemon=True)
                self._beat.start()
        return self

    def _heartbeat(self) -> None:
        """Plain-lines mode: with no line for :data:`HEARTBEAT_S` (a trial can build kernels for
        minutes), say which trial runs and for how long."""
        while not self._stop.wait(0.5):
            now = time.monotonic()
            spec, since = self._running
            if spec is None or now - self._last_line < HEARTBEAT_S or self._lines.elapsed() < default_after_s():
                continue
            self._last_line = now
            say(
                f"tune: trial {self._done + 1}/{self.total} running {spec.name} for {now - since:.0f} s, "
                f"{self._lines.elapsed():.1f} s elapsed",
                stream=self._lines.stream,
            )

    def start(self, spec: TrialSpec) -> None:
        self._running = (spec, time.monotonic())
        if self._bar is not None:
            self._bar.update(self._task, description=spec.name)
        elif self._lines is not None and self._lines.update(self._done, f"running {spec.name}"):
            self._last_line = time.monotonic()

    def finish(self, spec: TrialSpec, result: TrialResult) -> None:
        if not self.enabled:
            return
        self._done += 1
        self._running = (None, 0.0)
        status, reason = result.status.value, result.reason
        counts = path_counts(result) if result.ok else None
        if counts is not None and (why := fell_back(spec, counts)) is not None:
            # measured, but not as its backend: said like a failure
            status, reason = NotRankedStatus.FELL_BACK.value, why
        if self._bar is not None:
            if status != TrialStatus.OK.value:
                say_line(self._bar.console, f"{spec.name}: {status} {reason}", "yellow")
            self._bar.advance(self._task)
            return
        if self._lines is None:
            return
        if status != TrialStatus.OK.value:
            say(
                f"tune: trial {self._done}/{self.total} {spec.name}: {status}{f' ({reason})' if reason else ''}",
                stream=self._lines.stream,
            )
        if self._done == self.total:
            self._lines.update(self._done, "all run")

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._stop.set()
            self._beat.join()
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
