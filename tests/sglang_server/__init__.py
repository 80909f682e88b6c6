"""Test-only scaffolding that lets a REAL SGLang 0.5.23 server run on a CPU-only box (issue 10).

Nothing here is part of fastverify and the product never imports it. It exists because SGLang's CPU
mode needs pieces PyPI does not ship or that its CPU attention lacks:

* ``kernels/sgl_kernel``: a pure-torch stand-in for the seven CPU ``sgl_kernel`` ops a Llama model
  with NGRAM speculative decoding calls, and the six more EAGLE / EAGLE-3 drafting needs (the
  ``intel_amx`` draft attention backend's ``decode_attention_cpu`` / ``extend_attention_cpu``,
  registered under ``torch.ops.sgl_kernel``, and the draft's metadata, cache-slot and tree ops)
  (:mod:`kernels.sgl_kernel`); any other op raises.
* :mod:`tests.sglang_server.shim`: a general SGLang plugin that gives the ``torch_native``
  attention backend the TARGET_VERIFY mode it lacks (the prefix plus the batch's tree mask, by
  SDPA), records the environment and verify forwards each TP worker sees, and can deliberately
  break a patch target.
* :mod:`tests.sglang_server.tiny_model`: a tiny random Llama with its own byte-level BPE tokenizer,
  and tiny random EAGLE-3 / EAGLE drafters for it, built at test time, no model hub.
* :mod:`tests.sglang_server.engine`: the engine script ``fastverify launch`` runs.
* :mod:`tests.sglang_server.harness`: how the tests start it and read what it left.
"""
