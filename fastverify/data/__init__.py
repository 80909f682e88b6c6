"""Data files shipped with fastverify (read through :mod:`importlib.resources`).

* ``published_allreduce.json``: published all-reduce measurements on PCIe boxes, one record per
  source table, each with its link; read by :mod:`fastverify.tune.backend_model`.
* ``prompts.jsonl``: the answer phase's default prompts (``{"id", "prompt"}`` a line), written for
  fastverify; read by :mod:`fastverify.proof.answers`.
"""
