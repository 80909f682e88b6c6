"""``fastverify compare BEFORE AFTER``: two ``launch --load`` runs of the same prompts, model and
server shapes, compared whole.

* Answers: AFTER's against BEFORE's (:func:`fastverify.proof.answers.judge`): k of K identical and
  the verdict; CHANGED exits 1.
* tok/s per stream (per request: output tokens after the first over the decode time) at every
  concurrency both ran: the mean of each run with a 95 % bootstrap interval over requests, and the
  change ``(after - before) / before x 100`` with its own interval (both runs resampled); the
  aggregate tok/s of the benchmark client beside it. Labelled measured, on the runs' clock.
* Verify ms p50/p90 per (requests, tokens) bucket that both runs served (the verify records), never
  pooled over different loads; ``change_pct`` = (after - before) / before x 100 (- = less time).
* Accept length (SGLang's ``completion_tokens / spec_verify_ct`` per answer): a drop of AFTER's mean
  below BEFORE's interval is flagged (a swap changes only numerics).

Bootstrap: :data:`RESAMPLES` resamples of the requests with replacement, percentile interval, a
fixed seed (the same report for the same runs).
"""

from __future__ import annotations

import math
import os
import sys
from collections import defaultdict
from pathlib import Path

import msgspec
import numpy as np

from fastverify.errors import UserError, path_text, printable, shown
from fastverify.proof.answers import CHANGED, AnswersVerdict, judge, tolerance
from fastverify.proof.record import LoadRun, read_run, server_difference
from fastverify.verify_records import CLOCK_LABELS, FILE_GLOB, read_log_dir
from fastverify.verifylog import change_pct

SCHEMA = "fastverify.compare"
SCHEMA_VERSION = 1
RESAMPLES = 2000
SEED = 0
MIN_BUCKET_STEPS = 3
"""Verify steps a bucket needs in each run to be compared (fewer: listed, not compared)."""
CLOCKS = {
    "cpu_server_wall_clock": "measured, CPU wall clock (a CPU server): NOT a GPU timing",
    "wall_clock": "measured, client wall clock",
}


class Interval(msgspec.Struct, frozen=True):
    """The mean of ``n`` values and its 95 % bootstrap interval ``[lo, hi]``."""

    mean: float
    lo: float
    hi: float
    n: int


class StreamChange(msgspec.Struct, frozen=True):
    """tok/s per stream at one ``concurrency``: each run's :class:`Interval`, the change (%) and its
    interval; the client's aggregate tok/s of each run and its change (%)."""

    concurrency: int
    before: Interval
    after: Interval
    change_pct: float | None
    change_lo: float
    change_hi: float
    aggregate_before: float
    aggregate_after: float
    aggregate_change_pct: float | None


class BucketChange(msgspec.Struct, frozen=True):
    """Verify ms of the steps of ``batch`` requests and ``tokens`` rows, pooled over TP ranks: steps,
    p50 and p90 of each run and their change (%); ``compared`` false when a run has fewer than
    :data:`MIN_BUCKET_STEPS` steps there (then the changes are None)."""

    batch: int
    tokens: int
    before_steps: int
    after_steps: int
    p50_before: float | None
    p50_after: float | None
    p90_before: float | None
    p90_after: float | None
    p50_change_pct: float | None
    p90_change_pct: float | None
    compared: bool


class AcceptChange(msgspec.Struct, frozen=True):
    """Accept length (tokens per verify step) over the answers of each run; ``dropped`` when AFTER's
    mean is below BEFORE's interval."""

    before: Interval | None
    after: Interval | None
    dropped: bool


class CompareReport(msgspec.Struct, frozen=True, kw_only=True):
    """The comparison (see the module docstring); ``closing`` is the one closing line."""

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    before: str
    after: str
    backend_before: str
    backend_after: str
    clock: str
    clock_label: str
    verify_clock: str | None
    answers: AnswersVerdict
    streams: list[StreamChange]
    buckets: list[BucketChange]
    accept: AcceptChange
    closing: str
    exit_code: int


def _resampled_means(values: list[float], rng: np.random.Generator) -> np.ndarray:
    """The means of :data:`RESAMPLES` resamples of ``values`` with replacement."""
    x = np.asarray(values, dtype=np.float64)
    return rng.choice(x, size=(RESAMPLES, len(x)), replace=True).mean(axis=1)


def bootstrap_interval(values: list[float], rng: np.random.Generator) -> Interval | None:
    """The mean of ``values`` and its 95 % percentile bootstrap interval (:data:`RESAMPLES`
    resamples with replacement); None for no values."""
    if not values:
        return None
    lo, hi = np.percentile(_resampled_means(values, rng), [2.5, 97.5])
    return Interval(round(float(np.mean(values)), 6), round(float(lo), 6), round(float(hi), 6), len(values))


def _change_interval(b: list[float], a: list[float], rng: np.random.Generator) -> tuple[float, float]:
    mb, ma = _resampled_means(b, rng), _resampled_means(a, rng)
    lo, hi = np.percentile((ma - mb) / mb * 100.0, [2.5, 97.5])
    return round(float(lo), 3), round(float(hi), 3)


def _streams(before: LoadRun, after: LoadRun, rng: np.random.Generator) -> list[StreamChange]:
    out = []
    after_by = {t.concurrency: t for t in after.throughput}
    for tb in before.throughput:
        ta = after_by.get(tb.concurrency)
        if ta is None or not tb.per_stream_tok_s or not ta.per_stream_tok_s:
            continue
        ib, ia = bootstrap_interval(tb.per_stream_tok_s, rng), bootstrap_interval(ta.per_stream_tok_s, rng)
        lo, hi = _change_interval(tb.per_stream_tok_s, ta.per_stream_tok_s, rng)
        out.append(
            StreamChange(
                tb.concurrency,
                ib,
                ia,
                change_pct(ib.mean, ia.mean),
                lo,
                hi,
                round(tb.output_tok_s, 3),
                round(ta.output_tok_s, 3),
                change_pct(tb.output_tok_s, ta.output_tok_s),
            )
        )
    return out


def _by_bucket(folder: str) -> tuple[dict[tuple[int, int], list[float]], str | None]:
    """Verify ms per (batch, tokens), pooled over ranks, and the records' clock; empty when the
    folder has no verify records."""
    if not any(Path(folder).glob(FILE_GLOB)):
        return {}, None
    got = read_log_dir(folder)
    out: dict[tuple[int, int], list[float]] = defaultdict(list)
    for rs in got["records"].values():
        for r in rs:
            if r.batch is not None and r.tokens is not None:
                out[(r.batch, r.tokens)].append(r.verify_ms)
    return out, got["clock"]


def _buckets(before: str, after: str) -> tuple[list[BucketChange], str | None]:
    b, clock_b = _by_bucket(before)
    a, clock_a = _by_bucket(after)
    if clock_b and clock_a and clock_b != clock_a:
        raise UserError(f"{before} timed verify steps with {clock_b}, {after} with {clock_a}: not comparable")
    out = []
    for key in sorted(set(b) & set(a)):
        xb, xa = np.asarray(b[key]), np.asarray(a[key])
        ok = len(xb) >= MIN_BUCKET_STEPS and len(xa) >= MIN_BUCKET_STEPS
        p = [round(float(np.percentile(x, q)), 6) for x in (xb, xa) for q in (50, 90)]
        out.append(
            BucketChange(
                key[0],
                key[1],
                len(xb),
                len(xa),
                p[0],
                p[2],
                p[1],
                p[3],
                change_pct(p[0], p[2]) if ok else None,
                change_pct(p[1], p[3]) if ok else None,
                ok,
            )
        )
    return out, clock_b or clock_a


def _accept(before: LoadRun, after: LoadRun, rng: np.random.Generator) -> AcceptChange:
    ib = bootstrap_interval([x.accept_length for x in before.answers if x.accept_length is not None], rng)
    ia = bootstrap_interval([x.accept_length for x in after.answers if x.accept_length is not None], rng)
    return AcceptChange(ib, ia, bool(ib and ia and ia.mean < ib.lo))


def comparable(before: LoadRun, after: LoadRun) -> None:
    """Refuse two runs of different prompts, tokens per answer, models or server shapes (one line
    naming the first difference)."""
    if before.prompts_digest != after.prompts_digest:
        raise UserError(
            f"the runs asked different prompts ({before.prompts_source} vs {after.prompts_source}): not comparable"
        )
    if before.max_new_tokens != after.max_new_tokens:
        raise UserError(
            f"the runs asked {before.max_new_tokens} vs {after.max_new_tokens} tokens per answer: not comparable"
        )
    if (diff := server_difference(before.server, after.server)) is not None:
        k, b, a = diff
        raise UserError(f"the runs' servers differ: {k} {b!r} vs {a!r}: not comparable")
    for k in ("dtype", "model_path"):  # what the servers said of themselves
        b, a = before.server_info.get(k), after.server_info.get(k)
        if b is not None and a is not None and b != a:
            raise UserError(f"the servers said {k} {b!r} vs {a!r}: not comparable")


def _closing(after: LoadRun, streams: list[StreamChange], buckets: list[BucketChange], v: AnswersVerdict) -> str:
    parts = []
    best = max(
        (x for x in buckets if x.p50_change_pct is not None),
        key=lambda x: min(x.before_steps, x.after_steps),
        default=None,
    )
    if best is not None:
        parts.append(
            f"verify step {best.p50_change_pct:+.0f} % ({best.batch} x {best.tokens // max(best.batch, 1)} tokens, p50)"
        )
    one = next((s for s in streams if s.concurrency == 1), streams[0] if streams else None)
    if one is not None:
        parts.append(
            f"tok/s per stream {one.before.mean:.1f} -> {one.after.mean:.1f} ({one.change_pct:+.0f} %, "
            f"95 % CI {one.change_lo:+.0f}..{one.change_hi:+.0f} %, concurrency {one.concurrency})"
        )
    answers = (
        f"CHANGED answers ({v.identical}/{v.total} with identical tokens): do not deploy"
        if v.verdict == CHANGED
        else f"{v.verdict} ({v.identical}/{v.total})"
    )
    return f"{after.backend or 'auto'}: " + ", ".join([*parts, answers])


def build_report(
    before_dir: str | Path, after_dir: str | Path, *, logprob_tol: float | None = None, allow_incomplete: bool = False
) -> CompareReport:
    """Compare the runs in two folders (see the module docstring).

    Raises
    ------
    UserError
        A folder without a complete run (``allow_incomplete`` admits incomplete ones), runs that are
        not comparable (:func:`comparable`), verify records of two clocks.
    """
    if os.path.realpath(before_dir) == os.path.realpath(after_dir):
        raise UserError(f"BEFORE and AFTER are the same folder ({path_text(before_dir)}): compare two runs")
    before = read_run(before_dir, flag="BEFORE", allow_incomplete=allow_incomplete)
    after = read_run(after_dir, flag="AFTER", allow_incomplete=allow_incomplete)
    comparable(before, after)
    if before.clock != after.clock:
        raise UserError(f"BEFORE ran on {before.clock}, AFTER on {after.clock}: not comparable")
    n = min(len(before.answers), len(after.answers))
    tol, basis = tolerance(before.dtype, logprob_tol)
    verdict = judge(before.answers[:n], after.answers[:n], tol, basis)
    rng = np.random.default_rng(SEED)
    streams = _streams(before, after, rng)
    buckets, vclock = _buckets(str(before_dir), str(after_dir))
    return CompareReport(
        before=path_text(before_dir),
        after=path_text(after_dir),
        backend_before=before.backend,
        backend_after=after.backend,
        clock=before.clock,
        clock_label=CLOCKS.get(before.clock, f"measured, clock {before.clock}"),
        verify_clock=vclock,
        answers=verdict,
        streams=streams,
        buckets=buckets,
        accept=_accept(before, after, rng),
        closing=_closing(after, streams, buckets, verdict),
        exit_code=1 if verdict.verdict == CHANGED else 0,
    )


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def format_report(r: CompareReport) -> str:
    """The text: the verify table per bucket, tok/s, accept length, answers, the closing line."""
    lines = [
        f"# before {r.before} ({r.backend_before or 'auto'}), after {r.after} ({r.backend_after or 'auto'})",
        f"# every time: {r.clock_label}; change = (after - before) / before x 100",
    ]
    if r.buckets:
        vlabel = CLOCK_LABELS.get(r.verify_clock or "", r.verify_clock or "")
        lines.append(f"verify ms per bucket both runs served ({vlabel}); - = less time")
        lines.append(
            f"  {'requests x tokens':>17}  {'steps':>11}  {'p50 ms':>21} {'p50 %':>7}  {'p90 ms':>21} {'p90 %':>7}"
        )
        for b in r.buckets:
            lines.append(
                f"  {f'{b.batch} x {b.tokens}':>17}  {f'{b.before_steps} / {b.after_steps}':>11}  "
                f"{_f(b.p50_before) + ' -> ' + _f(b.p50_after):>21} {_f(b.p50_change_pct, '{:+.1f}'):>7}  "
                f"{_f(b.p90_before) + ' -> ' + _f(b.p90_after):>21} {_f(b.p90_change_pct, '{:+.1f}'):>7}"
                + ("" if b.compared else f"  (under {MIN_BUCKET_STEPS} steps: not compared)")
            )
    else:
        lines.append("verify ms: no bucket served by both runs (no verify records with their load)")
    for s in r.streams:
        lines.append(
            f"tok/s per stream at concurrency {s.concurrency}: {s.before.mean:.2f} "
            f"[{s.before.lo:.2f}, {s.before.hi:.2f}] -> {s.after.mean:.2f} [{s.after.lo:.2f}, {s.after.hi:.2f}] "
            f"(95 % CI over {s.before.n} / {s.after.n} requests), {_f(s.change_pct, '{:+.1f}')} % "
            f"[{s.change_lo:+.1f}, {s.change_hi:+.1f}]; aggregate {s.aggregate_before:.2f} -> "
            f"{s.aggregate_after:.2f} tok/s ({_f(s.aggregate_change_pct, '{:+.1f}')} %)"
        )
    if not r.streams:
        lines.append("tok/s: no concurrency measured by both runs")
    a = r.accept
    if a.before is not None and a.after is not None:
        flag = "  DROPPED below the baseline's interval: a swap changes only numerics" if a.dropped else ""
        lines.append(
            f"accept length: {a.before.mean:.3f} [{a.before.lo:.3f}, {a.before.hi:.3f}] -> {a.after.mean:.3f} "
            f"[{a.after.lo:.3f}, {a.after.hi:.3f}] tokens per verify step{flag}"
        )
    else:
        lines.append("accept length: not reported by the server (no speculative decoding?)")
    lines.append(f"answers: {r.answers.line()}")
    for p in r.answers.prompts:
        if p.status != "same":
            lines.append(f"  {p.id}: {p.status}: {p.why}")
    lines.append(r.closing)
    return "".join(shown(line) + "\n" for line in lines)  # runs' names, prompt ids, answers: one escaped line each


def print_comparison(
    before: str | Path,
    after: str | Path,
    *,
    as_json: bool = False,
    logprob_tol: float | None = None,
    allow_incomplete: bool = False,
) -> int:
    """Build the report and print it (text, or JSON) on stdout; its exit code (1 when CHANGED).

    Raises
    ------
    UserError
        As :func:`build_report`.
    StdoutError, AttributeError
        A full stdout, a closed one (``None.write``): :func:`fastverify.errors.print_guarded` says
        either in one line.
    """
    report = build_report(before, after, logprob_tol=logprob_tol, allow_incomplete=allow_incomplete)
    text = (
        msgspec.json.format(msgspec.json.encode(report).decode(), indent=1) + "\n"
        if as_json
        else printable(format_report(report))
    )
    sys.stdout.write(text)  # a closed (None) or full stdout: print_guarded's one line
    sys.stdout.flush()
    return report.exit_code


def run(args) -> int:
    """``fastverify compare``."""
    return print_comparison(
        args.before, args.after, as_json=args.json, logprob_tol=args.logprob_tol, allow_incomplete=args.allow_incomplete
    )
