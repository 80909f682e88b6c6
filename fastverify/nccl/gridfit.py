"""The least-squares search behind :func:`fastverify.nccl.model.fit`: one per-hop latency δ (µs)
and one bandwidth factor β per protocol, minimising the sum of squared log errors of the
predicted times, on a deterministic coarse-to-fine grid (numpy only). For a fixed δ the loss
separates per protocol, so each β is a 1-D search.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping

import numpy as np


def search(lat: np.ndarray, hops: np.ndarray, xfer: np.ndarray, log_t: np.ndarray,
           groups: Mapping[Hashable, np.ndarray], fitted: set) -> tuple[float, float, dict]:
    """``(loss, δ, {group: log β})`` minimising ``Σ (log(lat + δ·hops + xfer/β_g) − log_t)²``.

    Per row: ``lat`` the model latency (µs), ``hops`` its hop count, ``xfer`` the transfer time at
    β = 1 (µs), ``log_t`` the log of the measured time. ``groups`` maps each protocol to the mask
    of its rows; a group outside ``fitted`` keeps log β = 0 (β = 1). δ stays above
    −0.95·min(lat/hops) (every latency positive) and −5, at most 50; β in [0.01, 20].
    """
    # δ lower bound keeps every latency positive.
    d_lo, d_hi = max(-0.95 * float(np.min(lat / hops)), -5.0), 50.0
    b_lo, b_hi = math.log(0.01), math.log(20.0)  # log β range
    d_grid = np.linspace(d_lo, d_hi, 201)
    best: tuple[float, float, dict] | None = None
    b_span = {p: (b_lo, b_hi) if p in fitted else (0.0, 0.0) for p in groups}
    for _level in range(5):  # coarse to fine; each level zooms on the best point
        lb = {p: np.linspace(*b_span[p], 161 if p in fitted else 1) for p in groups}
        total = np.zeros(len(d_grid))
        arg_b: dict = {}
        for p, m in groups.items():
            # pred[d, k, i] = lat_i + d·hops_i + xfer_i / β_k
            fixed = (lat[m] + d_grid[:, None] * hops[m])[:, None, :]  # [d, 1, i]
            pred = fixed + xfer[m][None, None, :] / np.exp(lb[p])[None, :, None]  # [d, k, i]
            with np.errstate(invalid="ignore", divide="ignore"):
                err = np.where(pred > 0, np.log(np.maximum(pred, 1e-300)) - log_t[m], np.inf)
            loss = np.sum(err**2, axis=2)  # [d, k]
            k = np.argmin(loss, axis=1)
            arg_b[p] = lb[p][k]
            total += loss[np.arange(len(d_grid)), k]
        j = int(np.argmin(total))
        best = (float(total[j]), float(d_grid[j]), {p: float(arg_b[p][j]) for p in groups})
        d_step = d_grid[1] - d_grid[0]
        d_grid = np.linspace(max(d_lo, best[1] - 2 * d_step), min(d_hi, best[1] + 2 * d_step), 41)
        for p in fitted:
            step = lb[p][1] - lb[p][0]
            b_span[p] = (max(b_lo, best[2][p] - 2 * step), min(b_hi, best[2][p] + 2 * step))
    assert best is not None
    return best
