"""The cycle split PNG of ``fastverify report --png``: one stacked bar per forward mode (compute,
all-reduce transfer, all-reduce wait, other, GPU idle), ms per cycle, mean over TP ranks."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fastverify.errors import UserError

_PARTS = (("compute_us", "compute", "#4C72B0"), ("transfer_us", "all-reduce transfer", "#DD8452"),
          ("wait_us", "all-reduce wait", "#C44E52"), ("unmatched_us", "all-reduce (unmatched)", "#937860"),
          ("other_comm_us", "other comm", "#8172B3"), ("memory_us", "memory", "#64B5CD"),
          ("idle_us", "GPU idle", "#BBBBBB"))


def plot_cycle(doc: dict, path: Path) -> None:
    """Draw the report document's mode split to ``path`` (atomic: a temporary file, then rename).

    Raises
    ------
    UserError
        The file cannot be written.
    """
    from fastverify.plot import Figure, FigureCanvasAgg

    means = doc["modes_mean_us"]
    modes = list(means) + ["between forwards"]
    between = sum(r["between_idle_us"] for r in doc["cycles"]["ranks"]) / max(len(doc["cycles"]["ranks"]), 1)
    fig = Figure(figsize=(9, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bottom = [0.0] * len(modes)
    for key, label, color in _PARTS:
        vals = [means[m][key] / 1000 for m in modes[:-1]] + [between / 1000 if key == "idle_us" else 0.0]
        ax.bar(modes, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per cycle")
    ans = doc.get("answer") or {}
    ax.set_title(f"speculative cycle {ans.get('cycle_ms', 0):.3f} ms: removable by a faster all-reduce "
                 f"{ans.get('removable_ms', 0):.3f} ms (clock: {doc['cycles']['clock']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp.png", dir=path.parent)
        os.close(fd)
        try:
            fig.savefig(tmp, format="png", dpi=110)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        raise UserError(f"{path}: cannot write the PNG ({e.strerror or e})") from None
