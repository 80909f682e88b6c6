"""The verify timer's records (``fastverify launch --profile-verify DIR``;
:class:`fastverify.patch.verify.VerifyTimer`), read and checked: one file ``verify-rank<R>.jsonl``
per rank, one record per verify forward,
``{"step", "verify_ms", "clock", "rank", "pid", "batch", "tokens", "accepted", "allreduce_paths"}``
(records written before ``batch``, ``tokens`` or ``accepted`` existed still load; what they lack is
unknown). ``accepted``: the accepted draft tokens of each request of the step (bonus token
excluded). :mod:`fastverify.verifylog` summarises them.

The writer appends whole lines, so only a file's last line can be cut (a writer killed mid-write
on a full disk): a last line without its newline that does not decode is skipped and reported.
Any other line that does not decode is an error naming the file and line.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import msgspec

from fastverify.bounds import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_DRAFT_TOKENS,
    MAX_EVENT_US,
    MAX_VERIFY_TOKENS,
    MIN_TIME_US,
    duplicate_json_key,
    implausible_count,
)
from fastverify.errors import UserError, one_line, path_text, schema_error
from fastverify.inputs import check_regular, read_bytes
from fastverify.patch.paths import MODES, WARMUP

FILE_GLOB = "verify-rank*.jsonl"
MAX_RANK_FILES = 4096
"""Most ``verify-rank*.jsonl`` files one folder may hold: one file per rank process of one server,
and 4096 is far above any TP (or TP x DP) group SGLang runs (the largest NVLink domain, GB200
NVL72, is 72 GPUs); a folder with more is not one server's logs (10,000 files are refused before
any is read)."""
_RANK_NAME = re.compile(r"[0-9]{1,9}|pid[0-9]{1,10}")
"""The ``<R>`` of ``verify-rank<R>.jsonl`` the timer writes (:func:`fastverify.patch.verify._default_rank`):
``dist.get_rank()`` or ``pid<os.getpid()>``; ASCII digits only (``"²".isdigit()`` is true, ``int("²")`` fails)."""

CLOCK_LABELS = {
    "cuda_events": "GPU time (CUDA events around each verify forward)",
    "cpu_wall_clock": "CPU wall clock (host perf_counter on a CPU server): NOT GPU time",
}


class VerifyRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One line of ``verify-rank<R>.jsonl``: the verify forward number ``step`` of process ``pid``
    (from 0), its time ``verify_ms`` (ms) on ``clock``, the ``rank`` that wrote it, and its load:
    ``batch`` requests and ``tokens`` rows verified (batch × draft tokens per request); None in a
    record of an older fastverify or where the patch could not read them."""

    step: int
    verify_ms: float
    clock: str
    rank: str
    pid: int
    allreduce_paths: dict[str, dict[str, int]] | None = None
    batch: int | None = None
    tokens: int | None = None
    accepted: list[int] | None = None


RECORD_EXAMPLES = {
    "step": "0",
    "verify_ms": "1.25",
    "clock": '"cuda_events"',
    "rank": '"0"',
    "pid": "4242",
    "allreduce_paths": '{"verify": {"sglang.pynccl": 120}}',
    "batch": "4",
    "tokens": "16",
    "accepted": "[3, 0, 2, 1]",
}
"""An example value (JSON text) of every :class:`VerifyRecord` field, said in a schema error."""

_DECODER = msgspec.json.Decoder(VerifyRecord)


def read_log_dir(folder: str | Path) -> dict:
    """Read every ``verify-rank*.jsonl`` in ``folder``.

    Returns
    -------
    dict
        ``{"records": {rank: [VerifyRecord, ...]}, "files": [path, ...], "torn": ["name:line", ...],
        "clock": str}``, ranks as the records name them.

    Raises
    ------
    UserError
        No such folder, no ``verify-rank*.jsonl`` in it, more than :data:`MAX_RANK_FILES` of them,
        a name whose ``<R>`` is not a rank the timer writes, a file that is not a regular file or
        cannot be read (a FIFO, a device, a folder, a dangling link, a link loop: refused, never
        skipped) or holds no record, a line that is not a record (except a cut last line), a
        record of another rank than its file's (a field of the wrong type: the field, the type and an
        example, :func:`fastverify.errors.schema_error`), a time outside [1 µs, 1 hour] or not finite,
        a step, pid, batch (``MAX_BATCH``) or tokens (``MAX_VERIFY_TOKENS``) out of bounds, two
        files of one rank, or records of more than one clock.
    """
    d = Path(folder)
    file_ranks = _log_files(d)
    records: dict[str, list[VerifyRecord]] = {}
    torn: list[str] = []
    clocks: dict[str, str] = {}
    for f, file_rank in file_ranks.items():
        _read_file(f, file_rank, records, torn, clocks)
    seen: dict[int, Path] = {}
    for f, rank in file_ranks.items():  # verify-rank0 and verify-rank00: one rank, two files
        if rank.isdigit():
            if int(rank) in seen:
                raise UserError(f"{f}: rank {int(rank)} again (also in {seen[int(rank)].name}); one file per rank")
            seen[int(rank)] = f
    if len(clocks) > 1:
        raise UserError(
            f"{d}: records of different clocks ({', '.join(f'{c} at {w}' for c, w in sorted(clocks.items()))}); "
            "time one kind of run per folder"
        )
    return {"records": records, "files": [path_text(f) for f in file_ranks], "torn": torn, "clock": next(iter(clocks))}


def _log_files(d: Path) -> dict[Path, str]:
    """The ``verify-rank*.jsonl`` files of folder ``d``, sorted, each with its ``<R>``; every name is
    checked before any file is opened, then every file is checked to be a regular file."""
    if not d.is_dir():
        what = f"a file, not a folder (give its folder, {d.parent})" if d.exists() else "no such folder"
        raise UserError(f"{d}: {what} (give the --profile-verify DIR of `fastverify launch`)")
    files = sorted(d.glob(FILE_GLOB))
    if not files:
        raise UserError(f"{d}: no {FILE_GLOB} files (written by `fastverify launch --profile-verify {d}`)")
    if len(files) > MAX_RANK_FILES:
        raise UserError(
            f"{d}: {len(files):,} {FILE_GLOB} files, over the {MAX_RANK_FILES:,} ranks one folder may "
            "hold (one file per rank); give the folder of one server run"
        )
    file_ranks = {}
    for f in files:  # every name first: nothing is read from a folder with a name the timer never writes
        file_rank = f.name[len("verify-rank") : -len(".jsonl")]
        if not _RANK_NAME.fullmatch(file_rank):
            raise UserError(
                f"{f}: not a verify log name: the verify timer writes verify-rank<R>.jsonl, R a rank "
                "number (up to 9 digits) or pid<N>"
            )
        file_ranks[f] = file_rank
    for f in files:  # a FIFO, a device, a folder, a dangling link or a link loop: refused, never skipped
        check_regular(f, what="a verify log")
    return file_ranks


def _read_file(
    f: Path, file_rank: str, records: dict[str, list[VerifyRecord]], torn: list[str], clocks: dict[str, str]
) -> None:
    """Add the records of the file ``f`` of rank ``file_rank`` to ``records`` (by rank), a cut last
    line to ``torn`` and each clock's first ``name:line`` to ``clocks``."""
    data = read_bytes(f, kind="json", what="a verify log")
    lines = data.split(b"\n")
    n = 0
    steps: dict[int, int] = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = _DECODER.decode(line)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
            if i == len(lines) and not data.endswith(b"\n"):  # the cut last line of a killed writer
                torn.append(f"{path_text(f.name)}:{i}")
                continue
            raise _not_a_record(f"{f}:{i}", e) from None
        if line.count(b":") > _keys_decoded(rec) and (key := duplicate_json_key(line)) is not None:
            raise UserError(
                f"{f}:{i}: the key {one_line(repr(key), 80)} is given twice in one record; a record "
                "the verify timer writes gives each key once"
            )
        _check_record(rec, f"{f}:{i}", file_rank)
        if rec.step in steps:
            raise UserError(
                f"{f}:{i}: step {rec.step} again (also line {steps[rec.step]}): two server runs in one "
                "folder? give each run its own --profile-verify folder"
            )
        steps[rec.step] = i
        clocks.setdefault(rec.clock, f"{path_text(f.name)}:{i}")
        records.setdefault(rec.rank, []).append(rec)
        n += 1
    if n == 0:
        raise UserError(f"{f}: holds no verify records" + (" (only a cut last line)" if torn else ""))


def _keys_decoded(rec: VerifyRecord) -> int:
    """The distinct keys of ``rec``'s line that a value other than null came from (``allreduce_paths``'
    own included). Each key of a JSON text has one ``:`` after it outside strings, so a line with no
    more ``:`` than this has no key given twice, and the stdlib parse that finds one (about ten
    times msgspec's decode of the line) runs only for a line with more: a null value, a ``:`` in a
    string, or a key given twice."""
    values = msgspec.structs.astuple(rec)
    paths = rec.allreduce_paths
    return len(values) - values.count(None) + (len(paths) + sum(map(len, paths.values())) if paths else 0)


def _check_record(rec: VerifyRecord, where: str, file_rank: str) -> None:
    """Refuse a decoded record of another rank than its file's, or one the timer never writes."""
    if rec.rank != file_rank:
        raise UserError(
            f"{where}: a record of rank {rec.rank[:40]!r} in the file of rank {file_rank!r}; "
            "each rank writes its own file"
        )
    why = _bad_record(rec)
    if why is not None:
        raise UserError(f"{where}: {why}")
    bad = _bad_paths(rec.allreduce_paths)
    if bad:
        raise UserError(f"{where}: allreduce_paths: {bad}")


def _not_a_record(where: str, err: Exception) -> UserError:
    """The one line for a line that does not decode: a field of the wrong type, missing or
    unknown names the field, the expected type and an example (:func:`fastverify.errors.schema_error`);
    a line that is not JSON says msgspec's reason."""
    if isinstance(err, msgspec.ValidationError):
        return schema_error(where, err, RECORD_EXAMPLES)
    return UserError(f"{where}: not a verify record ({' '.join(str(err).split())})")


MAX_VERIFY_MS = MAX_EVENT_US / 1000.0
"""Longest verify forward (ms) a record may hold: :data:`fastverify.bounds.MAX_EVENT_US`, one hour."""
MIN_VERIFY_MS = MIN_TIME_US / 1000.0
"""Shortest verify forward (ms) a record may hold: :data:`fastverify.bounds.MIN_TIME_US`, 1 µs (a
0 or 1e-300 ms record would print p50 0.000 ms and a -100 % change)."""
MAX_PID = 2**31 - 1
"""Largest process id (``pid_t`` is a 32-bit int; Linux's own limit is 2**22)."""
_CLOCK = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _bad_record(rec: VerifyRecord) -> str | None:
    """Why a decoded record's numbers or clock are not what the verify timer writes, or None:
    ``verify_ms`` finite in ``[MIN_VERIFY_MS, 1 hour]`` (1.7e308 ms is refused, never summed to
    inf; 0 and 1e-300 ms, less than any measured work takes, too), ``step``
    a count, ``pid`` a process id, ``clock`` a short name, ``batch`` in ``[0, MAX_BATCH]`` and
    ``tokens`` in ``[0, MAX_VERIFY_TOKENS]`` (or null)."""
    ms = rec.verify_ms
    if not (math.isfinite(ms) and MIN_VERIFY_MS <= ms <= MAX_VERIFY_MS):
        return (
            f"verify_ms {ms!r} is not a verify time (outside [{MIN_VERIFY_MS:g}, {MAX_VERIFY_MS:.0f}] ms, "
            "i.e. 1 µs to 1 hour)"
        )
    why = implausible_count(rec.step, what="step")
    if why is not None:
        return f"step {why}"
    why = implausible_count(rec.pid, upper=MAX_PID, what="pid")
    if why is not None:
        return f"pid {why}"
    if not _CLOCK.fullmatch(rec.clock):
        return f"clock {rec.clock[:40]!r} is not a clock name (letters, digits, _ . -, up to 64)"
    if rec.clock not in CLOCK_LABELS:
        return f"clock {rec.clock!r} is not one the verify timer writes ({', '.join(CLOCK_LABELS)})"
    if rec.batch is not None and rec.tokens is not None and rec.tokens < rec.batch:
        return f"tokens {rec.tokens} < batch {rec.batch}: a verify forward checks at least one token per request"
    for name, value, upper, what in (
        ("batch", rec.batch, MAX_BATCH, "requests in one verify forward"),
        ("tokens", rec.tokens, MAX_VERIFY_TOKENS, "rows one verify forward verifies"),
    ):
        if value is not None and implausible_count(value, upper=upper, what=name) is not None:
            return f"{name} {value!r} is not a count of {what} (outside [0, {upper}])"
    return _bad_accepted(rec)


def _bad_accepted(rec: VerifyRecord) -> str | None:
    """Why ``accepted`` is not what the timer writes, or None: one count per request (``batch``
    of them, when known), each in ``[0, MAX_DRAFT_TOKENS]`` and below the draft tokens per request
    (``tokens / batch``; a request accepts at most all its drafts but the root)."""
    acc = rec.accepted
    if acc is None:
        return None
    if len(acc) > MAX_BATCH or (rec.batch is not None and len(acc) != rec.batch):
        return f"accepted has {len(acc)} values, not one per request (batch {rec.batch})"
    per = rec.tokens // rec.batch if rec.batch and rec.tokens is not None else MAX_DRAFT_TOKENS + 1
    for a in acc:
        if implausible_count(a, upper=min(MAX_DRAFT_TOKENS, max(per - 1, 0)), what="accepted") is not None:
            return (
                f"accepted {a!r} is not a count of accepted draft tokens (outside [0, "
                f"{min(MAX_DRAFT_TOKENS, max(per - 1, 0))}] for {per} tokens per request)"
            )
    return None


_PATH = re.compile(r"(sglang|fastverify)\.[A-Za-z0-9_.]{1,64}")


def _bad_paths(paths: dict[str, dict[str, int]] | None) -> str | None:
    """Why a record's ``allreduce_paths`` is not one the patch writes (a mode of
    :data:`fastverify.patch.paths.MODES` or ``capture_warmup``; a path ``sglang.<method>`` /
    ``fastverify.<backend>[.fallback]``; counts in ``[0, MAX_COUNT]``), or None."""
    for mode, counts in (paths or {}).items():
        if mode not in MODES and mode != WARMUP:
            return f"unknown forward mode {mode[:40]!r} (known: {', '.join([*MODES, WARMUP])})"
        for path, n in counts.items():
            if not _PATH.fullmatch(path):
                return f"{mode}: {path[:40]!r} is not a path (sglang.<method> or fastverify.<backend>[.fallback])"
            if implausible_count(n, what="all-reduce count") is not None:
                return f"{mode}.{path}={n!r} is not a count in [0, {MAX_COUNT:g}]"
    return None
