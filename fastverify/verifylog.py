"""``fastverify profile --verify-log DIR [DIR2]``: the measured verify latency of a real server,
from the verify timer's records (:mod:`fastverify.verify_records` reads and checks them).

Summarises per rank (steps, p50 and p90 of ``verify_ms``, clock) and over all ranks, and the load
pooled over ranks (the set and median of ``batch`` and ``tokens``; the accept length
``mean(accepted) + 1`` tokens per request per verify); given a before and an after folder, the
change per rank and overall: ``p50_change_ms`` = after − before (ms) and ``change_pct`` = (after −
before) / before × 100 of the p50, so a negative change is less time (``p90_change_ms`` /
``p90_change_pct`` the same of the p90), and a warning when the two folders ran different loads.
``allreduce_paths`` (:mod:`fastverify.patch.paths`) is summed per mode and path, per rank and over
all ranks: ``verify: sglang.gloo 240 of 240 all-reduces, ranks 0-1``.

Every number is measured, never predicted (``basis: "measured"``), and carries its clock:
``cuda_events`` times the GPU; ``cpu_wall_clock`` is host wall clock of a CPU server, never labelled
a GPU time. Percentiles are linear between closest ranks (``numpy.percentile``'s
default, the same as ``statistics.quantiles(method="inclusive")``).
"Overall" pools the records of every rank: in TP every rank times the same forwards.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

import msgspec
import numpy as np

from fastverify import __version__
from fastverify.errors import UserError, path_text
from fastverify.outputs import write_files
from fastverify.patch.paths import MODES
from fastverify.verify_records import CLOCK_LABELS, VerifyRecord, read_log_dir

SCHEMA = "fastverify.verify_log"
SCHEMA_VERSION = 2
"""2: ``Change.change_pct`` (was ``p50_change_pct``), the load fields of :class:`LogSummary`."""


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


def _summary(rank: str, ms: np.ndarray) -> RankSummary:
    return RankSummary(
        rank=rank,
        steps=len(ms),
        p50_ms=_r(np.percentile(ms, 50)),
        p90_ms=_r(np.percentile(ms, 90)),
        mean_ms=_r(ms.mean()),
        min_ms=_r(ms.min()),
        max_ms=_r(ms.max()),
    )


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
    return LogSummary(
        dir=path_text(folder),
        files=got["files"],
        clock=clock,
        clock_label=CLOCK_LABELS.get(clock, f"clock {clock!r} (unknown to this fastverify)"),
        ranks=ranks,
        overall=_summary("all", np.concatenate(pooled)),
        torn_last_lines=got["torn"],
        paths=_path_counts(got["records"]),
        counted_records=sum(r.allreduce_paths is not None for rs in got["records"].values() for r in rs),
        **_load(got["records"]),
    )


def _load(records: dict[str, list[VerifyRecord]]) -> dict:
    """The load fields of :class:`LogSummary`, pooled over ranks: of the records carrying both
    ``batch`` and ``tokens``, how many, the sorted distinct values and the median of each, and
    the distinct tokens per request (``tokens / batch``, batch > 0; 3 decimals); and of the records
    carrying ``accepted``, how many and the mean accept length (``mean(accepted) + 1``, tokens per
    request per verify, pooled over requests, steps and ranks)."""
    acc = [a for rs in records.values() for r in rs if r.accepted for a in r.accepted]
    out = {
        "accept_records": sum(r.accepted is not None for rs in records.values() for r in rs),
        "accept_length_mean": _r(np.mean(acc) + 1.0) if acc else None,
    }
    pairs = [(r.batch, r.tokens) for rs in records.values() for r in rs if r.batch is not None and r.tokens is not None]
    if not pairs:
        return out
    batch = np.array([b for b, _ in pairs], dtype=np.float64)
    tokens = np.array([t for _, t in pairs], dtype=np.float64)
    return {
        **out,
        "load_records": len(pairs),
        "batch_values": sorted({b for b, _ in pairs}),
        "batch_median": _r(np.median(batch)),
        "tokens_values": sorted({t for _, t in pairs}),
        "tokens_median": _r(np.median(tokens)),
        "tokens_per_request": sorted({round(t / b, 3) for b, t in pairs if b > 0}),
    }


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
    return (
        f"batch {_values_text(s.batch_values)} (median {s.batch_median:g}), "
        f"{_values_text(s.tokens_values)} tokens (median {s.tokens_median:g}{per})"
    )


def _load_warning(b: LogSummary, a: LogSummary) -> str | None:
    """A warning when before and after ran different loads (another set or median of ``batch``
    or ``tokens``) or a folder's records do not say their load; None when the loads agree."""
    if b.load_records and a.load_records:
        same = (b.batch_values, b.batch_median, b.tokens_values, b.tokens_median) == (
            a.batch_values,
            a.batch_median,
            a.tokens_values,
            a.tokens_median,
        )
        return (
            None
            if same
            else (
                f"the load differs: before ran {load_text(b)}, after {load_text(a)}: "
                "the change compares different loads"
            )
        )
    missing = [label for label, s in (("before", b), ("after", a)) if not s.load_records]
    where = "either folder" if len(missing) == 2 else f"the {missing[0]} folder"
    return (
        f"the load is not recorded in {where} (records without batch and tokens: an older fastverify, a "
        "hand-written record, or a batch the patch could not read): the change may compare different loads"
    )


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
    order = {m: i for i, m in enumerate(MODES)}
    keys = sorted(per, key=lambda mp: (order.get(mp[0], len(order)), mp[0], -sum(per[mp].values()), mp[1]))
    return [
        PathCount(
            mode=m,
            path=p,
            count=sum(per[(m, p)].values()),
            of=totals[m],
            per_rank={r: per[(m, p)][r] for r in sorted(per[(m, p)], key=_rank_key)},
        )
        for m, p in keys
    ]


def _ranks_text(ranks: list[str]) -> str:
    """``0-1`` for consecutive numeric ranks, else ``0, 2, 5``."""
    if ranks and all(r.isascii() and r.isdigit() for r in ranks):
        n = [int(r) for r in ranks]
        if n == list(range(n[0], n[0] + len(n))) and len(n) > 1:
            return f"{n[0]}-{n[-1]}"
    return ", ".join(ranks)


def change_pct(before: float, after: float) -> float | None:
    """``(after - before) / before x 100`` (- = less), 3 decimals; None when ``before`` is not
    positive (no change can be said of it)."""
    return round(100.0 * (after - before) / before, 3) if before > 0 else None


def _change(b: RankSummary, a: RankSummary) -> Change:
    pct = change_pct
    return Change(
        rank=b.rank,
        before_p50_ms=b.p50_ms,
        after_p50_ms=a.p50_ms,
        p50_change_ms=_r(a.p50_ms - b.p50_ms),
        change_pct=pct(b.p50_ms, a.p50_ms),
        before_p90_ms=b.p90_ms,
        after_p90_ms=a.p90_ms,
        p90_change_ms=_r(a.p90_ms - b.p90_ms),
        p90_change_pct=pct(b.p90_ms, a.p90_ms),
    )


def build_report(before: str | Path, after: str | Path | None = None) -> VerifyLogReport:
    """The summary of one folder, or of a before and an after folder with the change.

    Raises
    ------
    UserError
        As :func:`read_log_dir`, for either folder; before and after of different clocks.
    """
    b = summarise_dir(before)
    a = summarise_dir(after) if after is not None else None
    warnings = [
        f"{b.dir if s is b else s.dir}: skipped a cut last line {t} (a writer killed mid-write)"
        for s in (b, a)
        if s is not None
        for t in s.torn_last_lines
    ]
    change: list[Change] = []
    if after is not None and os.path.realpath(str(before)) == os.path.realpath(str(after)):
        raise UserError(f"{path_text(before)} is both the before and the after folder: give the two runs' folders")
    if a is not None:
        if a.clock != b.clock:
            raise UserError(
                f"{after}: records on clock {a.clock}, but {before} on {b.clock}; a before/after change needs one clock"
            )
        br, ar = {r.rank: r for r in b.ranks}, {r.rank: r for r in a.ranks}
        change = [_change(br[k], ar[k]) for k in sorted(br.keys() & ar.keys(), key=_rank_key)]
        only = sorted((br.keys() ^ ar.keys()), key=_rank_key)
        if only:
            warnings.append(f"rank(s) {', '.join(only)} in only one folder: no per-rank change for them")
        change.append(_change(b.overall, a.overall))
        load = _load_warning(b, a)
        if load is not None:
            warnings.append(load)
    return VerifyLogReport(
        fastverify_version=__version__,
        created_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        clock=b.clock,
        clock_label=b.clock_label,
        before=b,
        after=a,
        change=change,
        warnings=warnings,
    )


def encode_report(report: VerifyLogReport) -> bytes:
    """Indented JSON, keys in field order, newline-terminated."""
    return msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n"


def write_report(report: VerifyLogReport, path: Path) -> None:
    """Write atomically through the one writer (:func:`fastverify.outputs.write_files`: a temporary
    file in the target folder, renamed when complete, over a placeholder of
    :func:`fastverify.profile.build.default_output` or the user's file; a symlink is refused).

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
            out.append(
                "all-reduce paths, counted in each rank (per forward mode; verify = the target's verify "
                "forwards, draft / draft_extend = the drafter's):"
            )
            for pc in s.paths:
                per = ", ".join(f"TP {r} {n}" for r, n in pc.per_rank.items())
                out.append(
                    f"  {pc.mode}: {pc.path}: {pc.count} of {pc.of} {pc.mode} all-reduces, ranks "
                    f"{_ranks_text(list(pc.per_rank))} ({per})"
                )
        elif s.counted_records:
            out.append(
                f"all-reduce paths: {s.counted_records} record(s) carry allreduce_paths, all of them empty "
                "(no all-reduce counted)"
            )
        else:
            out.append("all-reduce paths: not counted (records without allreduce_paths)")
        of = (
            f", from {s.load_records} of {s.overall.steps} records"
            if s.load_records
            else " (records without batch and tokens)"
        )
        out.append(f"load: {load_text(s)}{of}")
        if s.accept_length_mean is not None:
            out.append(
                f"accept length: {s.accept_length_mean:.3f} tokens per request per verify (mean accepted "
                f"draft tokens + 1, from {s.accept_records} of {s.overall.steps} records)"
            )
    if report.change:
        out.append("## measured change (after - before)")
        out.append(
            "# change: after vs before, ms = after - before, % = (after - before) / before x 100; "
            "- = less time (faster)"
        )
        out.append(f"{'rank':>6} {'p50 ms':>22} {'p50 %':>8} {'p90 ms':>22} {'p90 %':>8}")
        for c in report.change:

            def pct(v):
                return "-" if v is None else f"{v:+.1f}"

            out.append(
                f"{c.rank:>6} {c.before_p50_ms:>9.3f} -> {c.after_p50_ms:<9.3f} {pct(c.change_pct):>8} "
                f"{c.before_p90_ms:>9.3f} -> {c.after_p90_ms:<9.3f} {pct(c.p90_change_pct):>8}"
            )
        b, a = report.before, report.after
        if a is not None and b.accept_length_mean is not None and a.accept_length_mean is not None:
            out.append(
                f"accept length: {b.accept_length_mean:.3f} -> {a.accept_length_mean:.3f} tokens per request "
                "per verify (tok/s per stream = accept length / cycle time)"
            )
    out += [f"! {w}" for w in report.warnings]
    return "\n".join(out) + "\n"
