"""The sweep journal: an append-only JSONL file, one record per finished trial, durable at once.

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
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from fastverify.bounds import (
    MAX_COUNT,
    MAX_MSG_BYTES,
    MIN_TIME_US,
    implausible_count,
    implausible_time_us,
    implausible_work_us,
)
from fastverify.errors import UserError
from fastverify.inputs import read_bytes
from fastverify.output_paths import check_folder
from fastverify.tune.trial import TrialResult, TrialSpec

logger = logging.getLogger(__name__)

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
