"""``fastverify tune``: measure all-reduce backends and NCCL settings on the verify step's message
sizes, each trial in isolated rank processes (:mod:`fastverify.tune.sweep`), journaled for resume
(:mod:`fastverify.tune.sweep`), ranked (:mod:`fastverify.tune.ranking`).

The package imports nothing itself, so ``python -m fastverify.tune.worker`` starts without
importing the sweep (and torch) first.
"""
