"""``fastverify tune``: measure all-reduce backends and NCCL settings on the verify step's message
sizes, each trial in isolated rank processes (:mod:`fastverify.tune.sweep`), journaled for resume
(:mod:`fastverify.tune.journal`), ranked in a report (:mod:`fastverify.tune.report`).

The names below are imported lazily, so ``python -m fastverify.tune.worker`` starts without
importing the sweep (and torch) first.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TrialSpec": "fastverify.tune.trial",
    "TrialResult": "fastverify.tune.trial",
    "TrialStatus": "fastverify.tune.trial",
    "SizeResult": "fastverify.tune.trial",
    "Clock": "fastverify.tune.trial",
    "Op": "fastverify.tune.trial",
    "run_sweep": "fastverify.tune.sweep",
    "run_trial": "fastverify.tune.sweep",
    "read_journal": "fastverify.tune.journal",
    "fingerprint": "fastverify.tune.journal",
    "rank_candidates": "fastverify.tune.report",
    "print_report": "fastverify.tune.report",
    "plot_latency": "fastverify.tune.report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastverify.tune' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
