"""Where a speculative cycle's time goes, from per-rank traces and the evidence of one bundle.

- :mod:`fastverify.cycle.split`: per TP rank and per forward mode (draft, verify, draft-extend,
  extend), compute, all-reduce transfer and wait, other communication and GPU idle by cause.
- :mod:`fastverify.cycle.flags`: anomaly flags, each with the evidence behind it, and the answer
  "removable by a faster all-reduce vs not".
- :mod:`fastverify.cycle.command`: ``fastverify report BUNDLE``.
"""
