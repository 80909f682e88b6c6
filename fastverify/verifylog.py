"""``fastverify profile --verify-log DIR [DIR2]``: the measured verify latency of a real server.

Reads the JSON lines the in-rank patch's verify timer writes (``fastverify launch
--profile-verify DIR``; :class:`fastverify.patch.verify.VerifyTimer`): one file
``verify-rank<R>.jsonl`` per rank, one record per verify forward,
``{"step", "verify_ms", "clock", "rank", "pid", "batch", "tokens", "accepted", "allreduce_paths"}``
(records written before ``batch``, ``tokens`` or ``accepted`` existed still load; what they lack is
unknown). ``accepted``: the accepted draft tokens of each request of the step (bonus token
excluded), so the accept length is ``mean(accepted) + 1`` tokens per request per verify.
Summarises per rank (steps, p50 and p90 of ``verify_ms``, clock) and over all ranks, and the load
pooled over ranks (the set and median of ``batch`` and ``tokens``); given a before and an after
folder, the measured change per rank and overall: ``p50_change_ms`` = after − before (ms) and
``change_pct`` = (after − before) / before × 100 of the p50, so a negative change is less time
(``p90_change_ms`` / ``p90_change_pct`` the same of the p90), and a warning when the two folders
ran different loads (the change then compares different work). ``allreduce_paths``
(per forward mode, which path each all-reduce took: :mod:`fastverify.patch.paths`) is summed per
mode and path over the records, per rank and over all ranks: ``verify: sglang.gloo 240 of 240
all-reduces, ranks 0-1``.

Every number here is measured, never predicted (``basis: "measured"``), and carries its clock:
``cuda_events`` times the GPU; ``cpu_wall_clock`` is host wall clock of a CPU server and is
labelled so, never as a GPU time. Percentiles are linear between closest ranks
(``numpy.percentile``'s default, the same as ``statistics.quantiles(method="inclusive")``).
"Overall" pools the records of every rank: in TP every rank times the same forwards.

The writer appends whole lines, so only a file's last line can be cut (a writer killed mid-write
on a full disk): a last line without its newline that does not decode is skipped and reported.
Any other line that does not decode is an error naming the file and line.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import re
from pathlib import Path

import msgspec
import numpy as np

from fastverify import __version__
from fastverify.bounds import (MAX_BATCH, MAX_COUNT, MAX_DRAFT_TOKENS, MAX_EVENT_US, MAX_VERIFY_TOKENS,
                               implausible_count)
from fastverify.errors import UserError, path_text, schema_error
from fastverify.inputs import read_bytes
from fastverify.procs import write_files

SCHEMA = "fastverify.verify_log"
SCHEMA_VERSION = 2
"""2: ``Change.change_pct`` (was ``p50_change_pct``), the load fields of :class:`LogSummary`."""
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
    "step": "0", "verify_ms": "1.25", "clock": '"cuda_events"', "rank": '"0"', "pid": "4242",
    "allreduce_paths": '{"verify": {"sglang.pynccl": 120}}', "batch": "4", "tokens": "16",
    "accepted": "[3, 0, 2, 1]",
}
"""An example value (JSON text) of every :class:`VerifyRecord` field, said in a schema error."""

_DECODER = msgspec.json.Decoder(VerifyRecord)


class RankSummary(msgspec.Struct, frozen=True):
    """Steps and percentiles (ms) of one rank, or of all ranks pooled (``rank`` ``"all"``)."""

    rank: str
    steps: int
    p50_ms: float
    p90_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float


class PathCount(msgspec.Struct, frozen=True):
    """All-reduces of one forward ``mode`` that took ``path``, summed over the records: ``count``
    over all ranks, ``per_rank`` rank → count; ``of`` all-reduces of that mode in all."""

    mode: str
    path: str
    count: int
    of: int
    per_rank: dict[str, int]


class LogSummary(msgspec.Struct, frozen=True):
    """One folder: its files, clock, per-rank and pooled summaries, what was skipped, and the
    all-reduce path counts (empty when the records carry none)."""

    dir: str
    files: list[str]
    clock: str
    clock_label: str
    ranks: list[RankSummary]
    overall: RankSummary
    torn_last_lines: list[str]
    paths: list[PathCount] = []
    counted_records: int = 0
    load_records: int = 0
    batch_values: list[int] = []
    batch_median: float | None = None
    tokens_values: list[int] = []
    tokens_median: float | None = None
    tokens_per_request: list[float] = []
    accept_records: int = 0
    accept_length_mean: float | None = None


class Change(msgspec.Struct, frozen=True):
    """The change of one rank (or ``"all"``), after vs before: ``*_change_ms`` = after − before
    (ms), ``change_pct`` = (after − before) / before × 100 of the p50 (negative: less time),
    ``p90_change_pct`` the same of the p90; None where before is 0."""

    rank: str
    before_p50_ms: float
    after_p50_ms: float
    p50_change_ms: float
    change_pct: float | None
    before_p90_ms: float
    after_p90_ms: float
    p90_change_ms: float
    p90_change_pct: float | None


class VerifyLogReport(msgspec.Struct, frozen=True, kw_only=True):
    """The document ``profile --verify-log`` writes (schema ``fastverify.verify_log`` v2)."""

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    fastverify_version: str
    created_utc: str
    basis: str = "measured"
    clock: str
    clock_label: str
    before: LogSummary
    after: LogSummary | None = None
    change: list[Change] = []
    warnings: list[str] = []


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
        example, :func:`fastverify.errors.schema_error`), a time outside [0, 1 hour] or not finite,
        a step, pid, batch (``MAX_BATCH``) or tokens (``MAX_VERIFY_TOKENS``) out of bounds, two
        files of one rank, or records of more than one clock.
    """
    d = Path(folder)
    if not d.is_dir():
        raise UserError(f"{d}: no such folder (give the --profile-verify DIR of `fastverify launch`)")
    files = sorted(d.glob(FILE_GLOB))
    if not files:
        raise UserError(f"{d}: no {FILE_GLOB} files (written by `fastverify launch --profile-verify {d}`)")
    if len(files) > MAX_RANK_FILES:
        raise UserError(f"{d}: {len(files):,} {FILE_GLOB} files, over the {MAX_RANK_FILES:,} ranks one folder may "
                        "hold (one file per rank); give the folder of one server run")
    file_ranks = {}
    for f in files:  # every name first: nothing is read from a folder with a name the timer never writes
        file_rank = f.name[len("verify-rank"):-len(".jsonl")]
        if not _RANK_NAME.fullmatch(file_rank):
            raise UserError(f"{f}: not a verify log name: the verify timer writes verify-rank<R>.jsonl, R a rank "
                            "number (up to 9 digits) or pid<N>")
        file_ranks[f] = file_rank
    from fastverify.inputs import check_regular

    for f in files:  # a FIFO, a device, a folder, a dangling link or a link loop: refused, never skipped
        check_regular(f, what="a verify log")
    records: dict[str, list[VerifyRecord]] = {}
    torn: list[str] = []
    clocks: dict[str, str] = {}
    for f in files:
        data = read_bytes(f, kind="json", what="a verify log")
        file_rank = file_ranks[f]
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
            if rec.rank != file_rank:
                raise UserError(f"{f}:{i}: a record of rank {rec.rank[:40]!r} in the file of rank {file_rank!r}; "
                                "each rank writes its own file")
            why = _bad_record(rec)
            if why is not None:
                raise UserError(f"{f}:{i}: {why}")
            bad = _bad_paths(rec.allreduce_paths)
            if bad:
                raise UserError(f"{f}:{i}: allreduce_paths: {bad}")
            if rec.step in steps:
                raise UserError(f"{f}:{i}: step {rec.step} again (also line {steps[rec.step]}): two server runs in one "
                                "folder? give each run its own --profile-verify folder")
            steps[rec.step] = i
            clocks.setdefault(rec.clock, f"{path_text(f.name)}:{i}")
            records.setdefault(rec.rank, []).append(rec)
            n += 1
        if n == 0:
            raise UserError(f"{f}: holds no verify records" + (" (only a cut last line)" if torn else ""))
    seen: dict[int, Path] = {}
    for f, rank in file_ranks.items():  # verify-rank0 and verify-rank00: one rank, two files
        if rank.isdigit():
            if int(rank) in seen:
                raise UserError(f"{f}: rank {int(rank)} again (also in {seen[int(rank)].name}); one file per rank")
            seen[int(rank)] = f
    if len(clocks) > 1:
        raise UserError(f"{d}: records of different clocks ({', '.join(f'{c} at {w}' for c, w in sorted(clocks.items()))}); "
                        "time one kind of run per folder")
    return {"records": records, "files": [path_text(f) for f in files], "torn": torn, "clock": next(iter(clocks))}


def _not_a_record(where: str, err: Exception) -> UserError:
    """The one line for a line that does not decode: a field of the wrong type, missing or
    unknown names the field, the expected type and an example (:func:`fastverify.errors.schema_error`);
    a line that is not JSON says msgspec's reason."""
    if isinstance(err, msgspec.ValidationError):
        return schema_error(where, err, RECORD_EXAMPLES)
    return UserError(f"{where}: not a verify record ({' '.join(str(err).split())})")


MAX_VERIFY_MS = MAX_EVENT_US / 1000.0
"""Longest verify forward (ms) a record may hold: :data:`fastverify.bounds.MAX_EVENT_US`, one hour."""
MAX_PID = 2**31 - 1
"""Largest process id (``pid_t`` is a 32-bit int; Linux's own limit is 2**22)."""
_CLOCK = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _bad_record(rec: VerifyRecord) -> str | None:
    """Why a decoded record's numbers or clock are not what the verify timer writes, or None:
    ``verify_ms`` finite in ``[0, 1 hour]`` (1.7e308 ms is refused, never summed to inf), ``step``
    a count, ``pid`` a process id, ``clock`` a short name, ``batch`` in ``[0, MAX_BATCH]`` and
    ``tokens`` in ``[0, MAX_VERIFY_TOKENS]`` (or null)."""
    ms = rec.verify_ms
    if not (math.isfinite(ms) and 0.0 <= ms <= MAX_VERIFY_MS):
        return (f"verify_ms {ms!r} is not a verify time (outside [0, {MAX_VERIFY_MS:.0f}] ms, "
                "i.e. 0 to 1 hour)")
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
    for name, value, upper, what in (("batch", rec.batch, MAX_BATCH, "requests in one verify forward"),
                                     ("tokens", rec.tokens, MAX_VERIFY_TOKENS, "rows one verify forward verifies")):
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
            return (f"accepted {a!r} is not a count of accepted draft tokens (outside [0, "
                    f"{min(MAX_DRAFT_TOKENS, max(per - 1, 0))}] for {per} tokens per request)")
    return None


_PATH = re.compile(r"(sglang|fastverify)\.[A-Za-z0-9_.]{1,64}")


def _bad_paths(paths: dict[str, dict[str, int]] | None) -> str | None:
    """Why a record's ``allreduce_paths`` is not one the patch writes (a mode of
    :data:`fastverify.patch.paths.MODES` or ``capture_warmup``; a path ``sglang.<method>`` /
    ``fastverify.<backend>[.fallback]``; counts in ``[0, MAX_COUNT]``), or None."""
    from fastverify.patch.paths import MODES, WARMUP

    for mode, counts in (paths or {}).items():
        if mode not in MODES and mode != WARMUP:
            return f"unknown forward mode {mode[:40]!r} (known: {', '.join([*MODES, WARMUP])})"
        for path, n in counts.items():
            if not _PATH.fullmatch(path):
                return f"{mode}: {path[:40]!r} is not a path (sglang.<method> or fastverify.<backend>[.fallback])"
            if implausible_count(n, what="all-reduce count") is not None:
                return f"{mode}.{path}={n!r} is not a count in [0, {MAX_COUNT:g}]"
    return None


def _summary(rank: str, ms: np.ndarray) -> RankSummary:
    return RankSummary(rank=rank, steps=len(ms), p50_ms=_r(np.percentile(ms, 50)), p90_ms=_r(np.percentile(ms, 90)),
                       mean_ms=_r(ms.mean()), min_ms=_r(ms.min()), max_ms=_r(ms.max()))


def _r(x) -> float:
    return round(float(x), 6)


def _rank_key(rank: str):
    return (0, int(rank), "") if rank.isascii() and rank.isdigit() else (1, 0, rank)


def summarise_dir(folder: str | Path) -> LogSummary:
    """:func:`read_log_dir` summarised per rank (sorted numerically) and pooled (``"all"``)."""
    got = read_log_dir(folder)
    ranks = []
    pooled = []
    for rank in sorted(got["records"], key=_rank_key):
        ms = np.array([r.verify_ms for r in got["records"][rank]], dtype=np.float64)
        ranks.append(_summary(rank, ms))
        pooled.append(ms)
    clock = got["clock"]
    return LogSummary(dir=path_text(folder), files=got["files"], clock=clock,
                      clock_label=CLOCK_LABELS.get(clock, f"clock {clock!r} (unknown to this fastverify)"),
                      ranks=ranks, overall=_summary("all", np.concatenate(pooled)), torn_last_lines=got["torn"],
                      paths=_path_counts(got["records"]),
                      counted_records=sum(r.allreduce_paths is not None for rs in got["records"].values() for r in rs),
                      **_load(got["records"]))


def _load(records: dict[str, list[VerifyRecord]]) -> dict:
    """The load fields of :class:`LogSummary`, pooled over ranks: of the records carrying both
    ``batch`` and ``tokens``, how many, the sorted distinct values and the median of each, and
    the distinct tokens per request (``tokens / batch``, batch > 0; 3 decimals); and of the records
    carrying ``accepted``, how many and the mean accept length (``mean(accepted) + 1``, tokens per
    request per verify, pooled over requests, steps and ranks)."""
    acc = [a for rs in records.values() for r in rs if r.accepted for a in r.accepted]
    out = {"accept_records": sum(r.accepted is not None for rs in records.values() for r in rs),
           "accept_length_mean": _r(np.mean(acc) + 1.0) if acc else None}
    pairs = [(r.batch, r.tokens) for rs in records.values() for r in rs if r.batch is not None and r.tokens is not None]
    if not pairs:
        return out
    batch = np.array([b for b, _ in pairs], dtype=np.float64)
    tokens = np.array([t for _, t in pairs], dtype=np.float64)
    return {**out, "load_records": len(pairs), "batch_values": sorted({b for b, _ in pairs}),
            "batch_median": _r(np.median(batch)), "tokens_values": sorted({t for _, t in pairs}),
            "tokens_median": _r(np.median(tokens)),
            "tokens_per_request": sorted({round(t / b, 3) for b, t in pairs if b > 0})}


def _values_text(values: list) -> str:
    """``4``, ``1-4`` (consecutive integers), ``1, 4, 8`` (up to 4), else ``1-64 (9 values)``."""
    v = [f"{x:g}" for x in values]
    if len(v) == 1:
        return v[0]
    if all(float(x).is_integer() for x in values) and values == list(range(int(values[0]), int(values[-1]) + 1)):
        return f"{v[0]}-{v[-1]}"
    return ", ".join(v) if len(v) <= 4 else f"{v[0]}-{v[-1]} ({len(v)} values)"


def load_text(s: LogSummary) -> str:
    """``batch 1-4 (median 2), 4-16 tokens (median 8; 4 tokens/request)``; ``not recorded`` when
    no record carries ``batch`` and ``tokens``."""
    if not s.load_records:
        return "not recorded"
    per = f"; {_values_text(s.tokens_per_request)} tokens/request" if s.tokens_per_request else ""
    return (f"batch {_values_text(s.batch_values)} (median {s.batch_median:g}), "
            f"{_values_text(s.tokens_values)} tokens (median {s.tokens_median:g}{per})")


def _load_warning(b: LogSummary, a: LogSummary) -> str | None:
    """A warning when before and after ran different loads (another set or median of ``batch``
    or ``tokens``) or a folder's records do not say their load; None when the loads agree."""
    if b.load_records and a.load_records:
        same = (b.batch_values, b.batch_median, b.tokens_values, b.tokens_median) == \
               (a.batch_values, a.batch_median, a.tokens_values, a.tokens_median)
        return None if same else (f"the load differs: before ran {load_text(b)}, after {load_text(a)}: "
                                  "the change compares different loads")
    missing = [label for label, s in (("before", b), ("after", a)) if not s.load_records]
    where = "either folder" if len(missing) == 2 else f"the {missing[0]} folder"
    return (f"the load is not recorded in {where} (records without batch and tokens: an older fastverify, a "
            "hand-written record, or a batch the patch could not read): the change may compare different loads")


def _path_counts(records: dict[str, list[VerifyRecord]]) -> list[PathCount]:
    """Per (mode, path): the count over every rank's records, per rank, and of how many."""
    per: dict[tuple[str, str], dict[str, int]] = {}
    for rank, recs in records.items():
        for rec in recs:
            for mode, counts in (rec.allreduce_paths or {}).items():
                for path, n in counts.items():
                    slot = per.setdefault((mode, path), {})
                    slot[rank] = slot.get(rank, 0) + n
    totals: dict[str, int] = {}
    for (mode, _), by_rank in per.items():
        totals[mode] = totals.get(mode, 0) + sum(by_rank.values())
    from fastverify.patch.paths import MODES

    order = {m: i for i, m in enumerate(MODES)}
    keys = sorted(per, key=lambda mp: (order.get(mp[0], len(order)), mp[0], -sum(per[mp].values()), mp[1]))
    return [PathCount(mode=m, path=p, count=sum(per[(m, p)].values()), of=totals[m],
                      per_rank={r: per[(m, p)][r] for r in sorted(per[(m, p)], key=_rank_key)}) for m, p in keys]


def _ranks_text(ranks: list[str]) -> str:
    """``0-1`` for consecutive numeric ranks, else ``0, 2, 5``."""
    if ranks and all(r.isascii() and r.isdigit() for r in ranks):
        n = [int(r) for r in ranks]
        if n == list(range(n[0], n[0] + len(n))) and len(n) > 1:
            return f"{n[0]}-{n[-1]}"
    return ", ".join(ranks)


def _change(b: RankSummary, a: RankSummary) -> Change:
    def pct(before: float, after: float) -> float | None:
        return round(100.0 * (after - before) / before, 3) if before > 0 else None

    return Change(rank=b.rank, before_p50_ms=b.p50_ms, after_p50_ms=a.p50_ms, p50_change_ms=_r(a.p50_ms - b.p50_ms),
                  change_pct=pct(b.p50_ms, a.p50_ms), before_p90_ms=b.p90_ms, after_p90_ms=a.p90_ms,
                  p90_change_ms=_r(a.p90_ms - b.p90_ms), p90_change_pct=pct(b.p90_ms, a.p90_ms))


def build_report(before: str | Path, after: str | Path | None = None) -> VerifyLogReport:
    """The summary of one folder, or of a before and an after folder with the change.

    Raises
    ------
    UserError
        As :func:`read_log_dir`, for either folder; before and after of different clocks.
    """
    b = summarise_dir(before)
    a = summarise_dir(after) if after is not None else None
    warnings = [f"{b.dir if s is b else s.dir}: skipped a cut last line {t} (a writer killed mid-write)"
                for s in (b, a) if s is not None for t in s.torn_last_lines]
    change: list[Change] = []
    if after is not None and os.path.realpath(str(before)) == os.path.realpath(str(after)):
        raise UserError(f"{path_text(before)} is both the before and the after folder: give the two runs' folders")
    if a is not None:
        if a.clock != b.clock:
            raise UserError(f"{after}: records on clock {a.clock}, but {before} on {b.clock}; "
                            "a before/after change needs one clock")
        br, ar = {r.rank: r for r in b.ranks}, {r.rank: r for r in a.ranks}
        change = [_change(br[k], ar[k]) for k in sorted(br.keys() & ar.keys(), key=_rank_key)]
        only = sorted((br.keys() ^ ar.keys()), key=_rank_key)
        if only:
            warnings.append(f"rank(s) {', '.join(only)} in only one folder: no per-rank change for them")
        change.append(_change(b.overall, a.overall))
        load = _load_warning(b, a)
        if load is not None:
            warnings.append(load)
    return VerifyLogReport(fastverify_version=__version__,
                           created_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                           clock=b.clock, clock_label=b.clock_label, before=b, after=a, change=change,
                           warnings=warnings)


def encode_report(report: VerifyLogReport) -> bytes:
    """Indented JSON, keys in field order, newline-terminated."""
    return msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"


def write_report(report: VerifyLogReport, path: Path) -> None:
    """Write atomically through the one writer (:func:`fastverify.procs.write_files`: a temporary
    file in the target folder, renamed when complete, over a placeholder of
    :func:`fastverify.profile.default_output` or the user's file; a symlink is refused).

    Raises
    ------
    UserError
        The folder cannot be created or written, or ``path`` is a symlink or not a regular file.
    """
    write_files([(Path(path), lambda tmp: tmp.write_bytes(encode_report(report)))])


def format_report(report: VerifyLogReport) -> str:
    """The terminal table: per rank and the load of each folder, then the change (when there is
    an after folder) with one note of its sign, then the warnings (``! ...``, one line each)."""
    out = [f"# fastverify verify log: measured, {report.clock_label}"]
    for label, s in (("before" if report.after else "verify log", report.before), ("after", report.after)):
        if s is None:
            continue
        out.append(f"## {label}: {s.dir}")
        out.append(f"{'rank':>6} {'steps':>7} {'p50 ms':>10} {'p90 ms':>10} {'mean ms':>10}")
        for r in [*s.ranks, s.overall]:
            out.append(f"{r.rank:>6} {r.steps:>7} {r.p50_ms:>10.3f} {r.p90_ms:>10.3f} {r.mean_ms:>10.3f}")
        if s.paths:
            out.append("all-reduce paths, counted in each rank (per forward mode; verify = the target's verify "
                       "forwards, draft / draft_extend = the drafter's):")
            for pc in s.paths:
                per = ", ".join(f"TP {r} {n}" for r, n in pc.per_rank.items())
                out.append(f"  {pc.mode}: {pc.path}: {pc.count} of {pc.of} {pc.mode} all-reduces, ranks "
                           f"{_ranks_text(list(pc.per_rank))} ({per})")
        elif s.counted_records:
            out.append(f"all-reduce paths: {s.counted_records} record(s) carry allreduce_paths, all of them empty "
                       "(no all-reduce counted)")
        else:
            out.append("all-reduce paths: not counted (records without allreduce_paths)")
        of = f", from {s.load_records} of {s.overall.steps} records" if s.load_records else \
            " (records without batch and tokens)"
        out.append(f"load: {load_text(s)}{of}")
        if s.accept_length_mean is not None:
            out.append(f"accept length: {s.accept_length_mean:.3f} tokens per request per verify (mean accepted "
                       f"draft tokens + 1, from {s.accept_records} of {s.overall.steps} records)")
    if report.change:
        out.append("## measured change (after - before)")
        out.append("# change: after vs before, ms = after - before, % = (after - before) / before x 100; "
                   "- = less time (faster)")
        out.append(f"{'rank':>6} {'p50 ms':>22} {'p50 %':>8} {'p90 ms':>22} {'p90 %':>8}")
        for c in report.change:
            def pct(v):
                return "-" if v is None else f"{v:+.1f}"
            out.append(f"{c.rank:>6} {c.before_p50_ms:>9.3f} -> {c.after_p50_ms:<9.3f} {pct(c.change_pct):>8} "
                       f"{c.before_p90_ms:>9.3f} -> {c.after_p90_ms:<9.3f} {pct(c.p90_change_pct):>8}")
        b, a = report.before, report.after
        if a is not None and b.accept_length_mean is not None and a.accept_length_mean is not None:
            out.append(f"accept length: {b.accept_length_mean:.3f} -> {a.accept_length_mean:.3f} tokens per request "
                       "per verify (tok/s per stream = accept length / cycle time)")
    out += [f"! {w}" for w in report.warnings]
    return "\n".join(out) + "\n"
