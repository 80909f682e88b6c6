"""Rank a sweep's trials: a rich table, the best candidate per message size, and a latency PNG.

Every number keeps its clock: a sweep on CPU measures host wall-clock times of gloo all-reduces,
and the table title, column headers and the PNG say "CPU/gloo" and never "GPU". Results with
different clocks are never ranked together.

A trial ranks as its backend only when its path counts show the backend's own path took every
call (:func:`fastverify.tune.trial.fell_back`); one that fell back (to ``torch.distributed``) is
listed as ``fell_back`` with the counts, never ranked, never the winner.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fastverify.console import cell, say
from fastverify.errors import UserError
from fastverify.registry import Role, backend_info
from fastverify.tune.trial import Clock, NotRankedStatus, TrialResult, TrialSpec, TrialStatus, fell_back, path_counts
from fastverify.tune.verify_time import change_pct

CLOCK_LABEL = {
    Clock.CUDA_EVENTS: "GPU (CUDA events, CUDA-graph replay)",
    Clock.CPU_WALL_CLOCK: "CPU/gloo: CPU wall clock, not GPU time",
}
CLOCK_SHORT = {Clock.CUDA_EVENTS: "GPU", Clock.CPU_WALL_CLOCK: "CPU/gloo"}


@dataclass(frozen=True)
class Unranked:
    """An ``ok`` trial left out of the ranking: its measured ``result`` with its own ``status``
    and one-line ``reason``; every other attribute reads through to ``result``, so it is listed in
    :attr:`Ranking.not_ok` like a failed trial."""

    result: TrialResult
    status: NotRankedStatus
    reason: str

    def __getattr__(self, name: str):
        if name == "result":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.result, name)


def path_verdict(spec: TrialSpec, result: TrialResult) -> Unranked | None:
    """The :class:`Unranked` entry of an ``ok`` result whose backend did not take every call
    (:func:`fastverify.tune.trial.fell_back` on its path counts), None when it did. A result
    without path counts is :attr:`~NotRankedStatus.UNVERIFIED` unless its backend is the
    torch.distributed baseline (no other path: it is the fallback)."""
    counts = path_counts(result)
    if counts is None:
        try:
            baseline = backend_info(spec.backend).role is Role.baseline
        except ValueError:
            baseline = False
        if baseline:
            return None
        return Unranked(
            result,
            NotRankedStatus.UNVERIFIED,
            f"no path counts recorded: cannot show {spec.backend} took its own path; "
            f"run the trial again without --resume",
        )
    why = fell_back(spec, counts)
    return None if why is None else Unranked(result, NotRankedStatus.FELL_BACK, why)


@dataclass(frozen=True)
class Candidate:
    """An ``ok`` trial. ``vs_baseline_us`` = its ``step_us`` − the baseline's (negative: faster);
    ``speedup`` = baseline ``step_us`` / its ``step_us``. Both None without an ok baseline."""

    spec: TrialSpec
    result: TrialResult
    vs_baseline_us: float | None
    speedup: float | None

    @property
    def step_us(self) -> float:
        return self.result.step_us


@dataclass(frozen=True)
class BucketBest:
    """The fastest candidate at one message size (median µs per all-reduce call)."""

    numel: int
    msg_bytes: int
    count_per_step: int
    best: TrialSpec
    median_us: float
    baseline_us: float | None


@dataclass(frozen=True)
class Ranking:
    """A sweep's candidates, fastest verify-step all-reduce time first.

    ``mixed_step_us`` is Σ count × the best median per size: reachable only by choosing per size
    (NCCL's tuner plugin CSV, or a size-bounded IPC workspace falling back to NCCL), not with one
    env setting. ``not_ok`` holds the failed, skipped and wrong-result trials with their reasons,
    and, as :class:`Unranked`, the ok trials that fell back (or cannot show they did not).
    """

    clock: Clock | None
    candidates: tuple[Candidate, ...]
    buckets: tuple[BucketBest, ...]
    baseline: Candidate | None
    not_ok: tuple[tuple[TrialSpec, TrialResult | Unranked], ...]
    mixed_step_us: float | None
    notes: tuple[str, ...]

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


def rank_candidates(
    specs: Sequence[TrialSpec], results: Sequence[TrialResult], *, baseline_id: str | None = None
) -> Ranking:
    """Pair ``results`` with ``specs`` (by trial id) and rank the ok ones by ``step_us``; an ok
    trial whose backend fell back (:func:`path_verdict`) is not ranked, it joins ``not_ok``.

    Parameters
    ----------
    specs, results : sequences
        Every result needs its spec; specs without a result are ignored (not run yet).
    baseline_id : str or None
        The trial to compare against; default the spec marked ``baseline=True``.

    Raises
    ------
    ValueError
        A result without a spec, an unknown ``baseline_id``, or ok results with different clocks.
    """
    by_id = {s.trial_id: s for s in specs}
    for r in results:
        if r.trial_id not in by_id:
            raise ValueError(f"result {r.trial_id} has no spec in specs; pass the specs of the sweep")
    if baseline_id is None:
        baseline_id = next((s.trial_id for s in specs if s.baseline), None)
    elif baseline_id not in by_id:
        raise ValueError(f"baseline_id {baseline_id!r} is not one of the specs' trial ids")
    ok, unranked = [], {}
    for r in results:
        if r.status is TrialStatus.OK and r.step_us is not None:
            why = path_verdict(by_id[r.trial_id], r)
            if why is None:
                ok.append(r)
            else:
                unranked[r.trial_id] = why
    clocks = {r.clock for r in ok}
    if len(clocks) > 1:
        raise ValueError(f"results mix clocks {sorted(c.value for c in clocks)}; rank each sweep on its own")
    clock = next(iter(clocks), None) or next((r.clock for r in results if r.clock is not None), None)
    base = next((r for r in ok if r.trial_id == baseline_id), None)
    cands = []
    for r in sorted(ok, key=lambda r: (r.step_us, r.trial_id)):
        delta = None if base is None else r.step_us - base.step_us
        speed = None if base is None or r.step_us <= 0 else base.step_us / r.step_us
        cands.append(Candidate(by_id[r.trial_id], r, delta, speed))
    baseline = next((c for c in cands if c.result.trial_id == baseline_id), None)
    buckets = _buckets(cands, base)
    mixed = sum(b.count_per_step * b.median_us for b in buckets) if buckets else None
    notes = sorted({r.note for r in results if r.note})
    if baseline_id is None:
        notes.append("no baseline trial: nothing to compare against")
    elif base is None:
        notes.append(f"the baseline trial ({by_id[baseline_id].name}) did not finish ok: no comparison")
    not_ok = tuple(
        (by_id[r.trial_id], unranked.get(r.trial_id, r))
        for r in results
        if r.status is not TrialStatus.OK or r.trial_id in unranked
    )
    return Ranking(clock, tuple(cands), buckets, baseline, not_ok, mixed, tuple(notes))


def _buckets(cands: list[Candidate], base: TrialResult | None) -> tuple[BucketBest, ...]:
    best: dict[int, tuple[float, Candidate, object]] = {}
    for c in cands:
        for s in c.result.sizes:
            if s.median_us is not None and (s.msg_bytes not in best or s.median_us < best[s.msg_bytes][0]):
                best[s.msg_bytes] = (s.median_us, c, s)
    base_us = {s.msg_bytes: s.median_us for s in base.sizes} if base is not None else {}
    return tuple(
        BucketBest(s.numel, nbytes, s.count_per_step, c.spec, us, base_us.get(nbytes))
        for nbytes, (us, c, s) in sorted(best.items())
    )


def us_text(v: float | None) -> str:
    """µs with one decimal and thousands separators; ``-`` for None or non-finite."""
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:,.1f}"


def _ms(v: float | None) -> str:
    """µs shown as ms, 3 decimals (CPU wall-clock times: milliseconds, not 9-digit µs)."""
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v / 1e3:,.3f}"


def _unit(clock: Clock | None):
    """(unit name, formatter of a µs value): ms for CPU wall clock, µs for GPU timings."""
    return ("ms", _ms) if clock is Clock.CPU_WALL_CLOCK else ("µs", us_text)


def _change(c: Candidate, base: Candidate | None) -> str:
    """new vs baseline in percent, - = less time (:func:`fastverify.tune.verify_time.change_pct`)."""
    if c is base:
        return "baseline"
    if c.vs_baseline_us is None or base is None or not base.step_us:
        return "-"
    return change_pct(100.0 * c.vs_baseline_us / base.step_us)


def _bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def print_report(ranking: Ranking, console: Console | None = None, *, top: int = 20) -> None:
    """Print the ranked candidates, the best per message size and the failures. Times are µs for
    GPU timings and ms for CPU wall clock (gloo); a change is new vs baseline, - = less time."""
    console = console or Console()
    short = CLOCK_SHORT.get(ranking.clock, "?")
    label = CLOCK_LABEL.get(ranking.clock, "no timing")
    unit, fmt = _unit(ranking.clock)
    sizes = sorted({(s.msg_bytes, s.count_per_step) for c in ranking.candidates for s in c.result.sizes})
    # the title on a line of its own: a table title wraps at the (narrow) table's width
    say(console, f"all-reduce time per verify step, ranked ({label}); change = new vs baseline, - = less time")
    t = Table()
    t.add_column("#", justify="right")
    t.add_column("candidate")
    t.add_column(f"step {unit} ({short})", justify="right")
    t.add_column("change", justify="right", no_wrap=True)
    for nbytes, count in sizes:
        t.add_column(f"{_bytes(nbytes)} ×{count} {unit}", justify="right")
    t.add_column("max rel err", justify="right")
    for i, c in enumerate(ranking.candidates[:top], 1):
        per = {s.msg_bytes: s.median_us for s in c.result.sizes}
        errs = [s.max_rel_err for s in c.result.sizes if s.max_rel_err is not None]
        t.add_row(
            f"{i:d}",
            cell(c.spec.name),
            cell(fmt(c.step_us)),
            cell(_change(c, ranking.baseline)),
            *(cell(fmt(per.get(n))) for n, _ in sizes),
            f"{max(errs):.2g}" if errs else "-",
        )
    console.print(t)
    if ranking.buckets:
        b = Table(title=cell(f"best per message size ({short} median {unit} per call)"), title_justify="left")
        for col in ("size", "count/step", "best", f"{unit} ({short})", f"baseline {unit} ({short})"):
            b.add_column(col, justify="left" if col == "best" else "right")
        for k in ranking.buckets:
            b.add_row(
                cell(_bytes(k.msg_bytes)),
                cell(k.count_per_step),
                cell(k.best.name),
                cell(fmt(k.median_us)),
                cell(fmt(k.baseline_us)),
            )
        console.print(b)
        if ranking.mixed_step_us is not None and len({k.best.trial_id for k in ranking.buckets}) >= 2:
            # one size, or one candidate best at every size: there is no per-size choice to make
            say(
                console,
                f"best per size combined: {fmt(ranking.mixed_step_us)} {unit} per step ({short}); "
                f"needs a per-size choice (NCCL tuner plugin CSV or a size-bounded workspace)",
            )
    if ranking.not_ok:
        f = Table(title="not ranked", title_justify="left")
        for col in ("candidate", "status", "reason"):
            f.add_column(col)
        for spec, r in ranking.not_ok:
            f.add_row(cell(spec.name), cell(r.status.value), cell(r.reason))
        console.print(f)
    for note in ranking.notes:
        say(console, f"note: {note}")


def plot_format(path: str | Path, flag: str = "--png") -> str:
    """The image format matplotlib writes ``path`` in: its suffix (``png`` when it has none),
    checked against ``FigureCanvasBase.get_supported_filetypes()`` of the installed matplotlib.

    Raises
    ------
    UserError
        ``<flag> <path>: matplotlib cannot write .<ext> files (it writes eps, jpeg, ...)``.
    """
    from matplotlib.figure import Figure

    ext = Path(path).suffix[1:].lower() or "png"
    supported = Figure().canvas.get_supported_filetypes()
    if ext not in supported:
        raise UserError(
            f"{flag} {path}: matplotlib cannot write .{ext} files (it writes {', '.join(sorted(supported))})"
        )
    return ext


def plot_latency(ranking: Ranking, path: str | Path, *, top: int = 12) -> Path:
    """An image (PNG unless ``path``'s suffix names another format matplotlib writes:
    :func:`plot_format`) of median latency (p90 as the bar's top) against message size, one line
    per candidate (the ``top`` fastest plus the baseline); log-log axes; the title names the clock.
    Written atomically (a temporary file in the same folder, then renamed). Returns the path.

    Raises
    ------
    UserError
        An unsupported format, or the file cannot be written.
    """
    import os
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fmt = plot_format(path)
    shown = list(ranking.candidates[:top])
    if ranking.baseline is not None and ranking.baseline not in shown:
        shown.append(ranking.baseline)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    try:
        for c in shown:
            pts = sorted((s.msg_bytes, s.median_us, s.p90_us) for s in c.result.sizes if s.median_us is not None)
            if not pts:
                continue
            xs, med, p90 = zip(*pts)
            up = [max(0.0, (p or m) - m) for m, p in zip(med, p90)]
            style = dict(linestyle="--", color="black") if c is ranking.baseline else {}
            name = c.spec.name + (" (baseline)" if c is ranking.baseline else "")
            ax.errorbar(xs, med, yerr=[[0] * len(up), up], marker="o", capsize=3, label=name[:60], **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        short = CLOCK_SHORT.get(ranking.clock, "?")
        ax.set_ylabel(f"median µs per all-reduce ({short}; bar to p90)")
        ax.set_title(f"all-reduce latency per candidate: {CLOCK_LABEL.get(ranking.clock, 'no timing')}")
        ax.grid(True, which="both", alpha=0.3)
        if shown:
            ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp.{fmt}", dir=path.parent)
            os.close(fd)
            fig.savefig(tmp, dpi=110, format=fmt)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
            os.replace(tmp, path)
            tmp = None
        except OSError as err:
            raise UserError(f"--png {path}: cannot write ({err.strerror or err})") from None
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
    finally:
        plt.close(fig)
    return path
