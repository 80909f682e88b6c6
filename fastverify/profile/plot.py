"""The profile PNG: per-rank stacked bars and all-reduce latency against message size.

Drawn on a bare :class:`matplotlib.figure.Figure` with the Agg canvas: the same figure as through
``pyplot``, without importing pyplot and its backend machinery (about 100 ms of a trace job).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _import_matplotlib():
    """Import matplotlib for drawing on the Agg canvas directly. ``MPLBACKEND`` names a backend for
    pyplot, which this module never uses; matplotlib still validates it at import and raises
    ``ValueError`` for an unknown name, so it is set aside for that import and put back."""
    if "matplotlib" in sys.modules:
        return
    saved = os.environ.pop("MPLBACKEND", None)
    try:
        import matplotlib  # noqa: F401
    finally:
        if saved is not None:
            os.environ["MPLBACKEND"] = saved


_import_matplotlib()

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402


def _bytes_label(x: float, _pos=None) -> str:
    """A message size in bytes as ``512 B``, ``56 KiB``, ``1.5 MiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} B"


def _us_label(y: float, _pos=None) -> str:
    """A latency in µs, as a plain number (``25``, ``0.5``, ``1200``)."""
    return f"{y:.3g}"


def _decades(rows: list[dict]) -> float:
    """How many powers of ten the plotted latencies span (minor ticks are labelled below one)."""
    import math

    ys = [v for r in rows for v in (r["median_us"], r["p90_us"]) if v > 0]
    return math.log10(max(ys) / min(ys)) if ys else 0.0


def bar_segments(rank: dict) -> dict[str, float]:
    """Split one rank's window (µs) into parts that add up to it: compute, all-reduce transfer,
    all-reduce wait, other (memory / other communication not under compute), idle.

    All-reduce time not overlapped by compute is split into transfer and wait in the proportion
    measured across ranks (``allreduce_wait_us`` / ``allreduce_kernel_sum_us``); with one rank the
    split is unknown and all of it is shown as transfer + wait together ("all-reduce").
    """
    ar = rank["allreduce_exposed_us"]
    wait = rank.get("allreduce_wait_us")
    total = rank["allreduce_kernel_sum_us"]
    frac = (wait / total) if (wait is not None and total) else None
    seg = {"compute": rank["compute_us"]}
    if frac is None:
        seg["all-reduce"] = ar
    else:
        seg["all-reduce transfer"] = ar * (1.0 - frac)
        seg["all-reduce wait"] = ar * frac
    seg["other (memory, other comm)"] = rank["other_exposed_us"]
    seg["idle"] = rank["idle_us"]
    return seg


COLOURS = {
    "compute": "#4c72b0",
    "all-reduce": "#dd8452",
    "all-reduce transfer": "#dd8452",
    "all-reduce wait": "#c44e52",
    "other (memory, other comm)": "#8c8c8c",
    "idle": "#e5e5e5",
}


def plot_profile(profile: dict, path: Path) -> None:
    """Render ``profile`` to a PNG at ``path``."""
    ranks = profile["ranks"]
    clock = profile["timing"]["clock"]
    height = max(3.5, 0.5 * len(ranks) + 2.5)
    fig = Figure(figsize=(13, height))
    FigureCanvasAgg(fig)
    # Fixed margins in inches instead of tight_layout, which lays the figure out by drawing it once
    # more (about 50 ms of a 0.1 s drawing): room for "TP rank N", the titles, the legend below.
    ax1, ax2 = fig.subplots(
        1,
        2,
        gridspec_kw={
            "left": 1.0 / 13,
            "right": 1 - 0.25 / 13,
            "wspace": 0.22,
            "top": 1 - 0.75 / height,
            "bottom": 1.25 / height,
        },
    )
    labels = [f"TP rank {r['rank']}" for r in ranks]
    lefts = [0.0] * len(ranks)
    seen: set[str] = set()
    for r_i, r in enumerate(ranks):
        for name, val in bar_segments(r).items():
            ax1.barh(
                r_i,
                val / 1000.0,
                left=lefts[r_i] / 1000.0,
                color=COLOURS[name],
                label=name if name not in seen else None,
            )
            seen.add(name)
            lefts[r_i] += val
    ax1.set_yticks(range(len(ranks)), labels)
    ax1.invert_yaxis()
    ax1.set_xlabel("time in the profiled window (ms)")
    ax1.set_title("Where each rank's time goes")
    box = ax1.get_position()  # below the x label: 0.5 in under the axes, in figure coordinates
    ax1.legend(
        loc="upper center",
        bbox_to_anchor=((box.x0 + box.x1) / 2, box.y0 - 0.5 / height),
        bbox_transform=fig.transFigure,
        ncol=3,
        fontsize=8,
        frameon=False,
    )

    rows = [r for r in profile["allreduce_by_msg_size"] if r["msg_bytes"]]
    if rows:
        x = [r["msg_bytes"] for r in rows]
        ax2.plot(x, [r["median_us"] for r in rows], "o-", label="median")
        ax2.plot(x, [r["p90_us"] for r in rows], "x--", label="p90")
        # Log axes with plain-text tick labels: the measured sizes as B/KiB/MiB, µs as numbers.
        # matplotlib's default 10^x labels go through mathtext, ~50 ms of a drawing.
        ax2.set_xscale("log", base=2)
        ticks = x if len(x) <= 8 else [x[round(i * (len(x) - 1) / 7)] for i in range(8)]
        ax2.set_xticks(ticks, [_bytes_label(v) for v in ticks])  # at the measured sizes
        ax2.xaxis.set_minor_formatter(NullFormatter())
        if any(r["p90_us"] > 0 for r in rows):  # log scale needs a positive value
            ax2.set_yscale("log")
            ax2.yaxis.set_major_formatter(FuncFormatter(_us_label))
            ax2.yaxis.set_minor_formatter(FuncFormatter(_us_label) if _decades(rows) < 1 else NullFormatter())
        ax2.legend(fontsize=8)
    else:
        ax2.text(
            0.5,
            0.5,
            "no all-reduce with a known message size\n(none in the data, or CUDA-graph replays, which carry no shapes)",
            ha="center",
            va="center",
            transform=ax2.transAxes,
        )
    ax2.set_xlabel("message size (bytes)")
    ax2.set_ylabel("all-reduce latency (µs)")
    ax2.set_title("All-reduce latency vs message size")
    note = {
        "cpu_wall_clock": "CPU wall clock over gloo - NOT GPU timings",
        "cpu_trace": "CPU-only traces, host clock over gloo - NOT GPU timings",
    }.get(clock, f"clock: {clock}")
    fig.suptitle(f"fastverify profile ({note})", fontsize=10)
    # zlib level 1 instead of PIL's 6: the same pixels, a 5 % larger file, 4 ms less of the drawing
    fig.savefig(path, dpi=110, format="png", pil_kwargs={"compress_level": 1})
