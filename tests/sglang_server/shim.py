"""Test-only SGLang general plugin for the CPU test server (never imported by fastverify).

Why it exists:

* SGLang 0.5.23's ``torch_native`` attention backend (``layers/attention/torch_native_backend.py``)
  has no TARGET_VERIFY mode: ``forward`` sends a verify batch to ``forward_extend``, which reads
  ``extend_prefix_lens`` / ``extend_seq_lens`` that a verify batch does not carry. Verify is an
  extend of ``draft_token_num`` tokens after the ``seq_lens`` already verified (NGRAM allocates
  their cache slots at ``[seq_lens, seq_lens + draft_token_num)``, ``speculative/ngram_worker.py``,
  which the shim checks in ``req_to_token``), each draft token attending to the whole prefix and
  to the draft nodes the batch's tree mask allows (``spec_info.custom_mask[b, i, j]``: node ``j``
  is an ancestor of ``i``; itself always). The shim computes exactly that with SDPA per request.
  For a chain draft the mask is the causal one; NGRAM pads short matches with nodes that see only
  the root, so even at ``speculative_ngram_max_bfs_breadth=1`` the mask is often not causal (the
  shim counts those in ``non_causal_masks``) and a plain causal extend would be wrong.
  NGRAM reaches the same verify forward as EAGLE: ``TpModelWorker.forward_batch_generation(...,
  is_verify=True)`` (``ngram_worker.py``), which the fastverify patch times. EAGLE / EAGLE-3 on CPU
  verify here too: their target keeps ``torch_native`` (``--attention-backend intel_amx`` falls back
  to it without AMX, ``arg_groups/overrides.py``; only the drafter gets ``intel_amx``), and their
  CPU tree mask is the same QLEN_ONLY ``[bs, n, n]`` one (``speculative/eagle_utils.py::
  default_tree_mask_mode``), causal for a chain (topk 1), a tree for topk > 1.
* The tests need to see, from inside each TP worker, the environment it got, its pid, the calls of
  each ``sgl_kernel`` stand-in op so far (``standin_calls``), and how many verify forwards it ran,
  and when (``verify_t``: ``time.time()`` at each one's first layer, the
  same clock as the test's): each worker rewrites ``$FVTEST_STATS_DIR/stats-rank<R>.json`` (write
  then ``os.replace``, so a reader sees a whole file) after every verify forward, so a SIGKILL loses
  nothing already counted and the file is the count at the moment of the kill.
* ``FVTEST_BREAK_TARGET=verify_timer`` replaces ``TpModelWorker.forward_batch_generation`` with a
  pass-through of another signature before fastverify's plugin runs (entry points are loaded in
  ``sys.path`` order and this one lies on ``PYTHONPATH``), so the patch must skip that target.

* ``FVTEST_STANDIN_MAX_ROWS=N`` attaches to fastverify's dispatch slot a backend stand-in that
  all-reduces over SGLang's TP device group (gloo here) and takes only tensors of at most ``N`` rows,
  so the path counts must show every wider all-reduce as that backend's fallback.

* ``FVTEST_BROKEN=drop5|scale|ulp`` attaches to the dispatch slot a broken all-reduce (every TP
  all-reduce, any rows): ``drop5`` returns TP rank 0's partial sum alone on every fifth call (the
  peers' parts dropped; the same tensor on every rank, unlike each rank's own unreduced part), ``scale``
  returns the sum times 1.01 (every all-reduce but the vocab-parallel embedding's: scaling all of them
  scales the whole residual stream, which the next RMSNorm removes, so the answers barely move:
  0.002 nats of margin, measured on the CPU server), ``ulp`` moves every element of the sum one float step up (what a
  different summation order does); every rank breaks the same calls, so the ranks stay in step.
  ``compare`` and ``launch --baseline`` must call the first two CHANGED and not the third.

Loaded through the entry point ``fastverify_test_shim`` in group ``sglang.srt.plugins`` of a
``.dist-info`` that :func:`tests.sglang_server.harness.write_shim_site` writes at test time.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV_STATS = "FVTEST_STATS_DIR"
ENV_BREAK = "FVTEST_BREAK_TARGET"
ENV_STANDIN = "FVTEST_STANDIN_MAX_ROWS"
ENV_BROKEN = "FVTEST_BROKEN"
PLUGIN_NAME = "fastverify_test_shim"
ENV_PREFIXES = ("NCCL_", "SGLANG_", "FASTVERIFY_", "CUDA_DEVICE_MAX_CONNECTIONS", "PYTHONPATH")

KVWriteLoc = None  # sglang.srt.mem_cache.memory_pool.KVWriteLoc, bound by plugin()
_stats: dict = {"verify_forwards": 0, "non_causal_masks": 0, "checked_slots": 0, "verify_t": []}
_lock = threading.Lock()


def _rank() -> int | None:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else None
    except Exception:
        return None


def _standin_calls() -> dict[str, int]:
    """Calls so far of each op of the ``sgl_kernel`` stand-in in this worker (its ``CALLS`` and
    those of its ``draft`` / ``attention`` modules); empty when it was never imported."""
    import sys

    out: dict[str, int] = {}
    for name in ("sgl_kernel", "sgl_kernel.draft", "sgl_kernel.attention"):
        calls = getattr(sys.modules.get(name), "CALLS", None) or {}
        out.update({k: int(v) for k, v in calls.items() if v})
    return out


def _write_stats() -> None:
    out = os.environ.get(ENV_STATS)
    if not out:
        return
    rank = _rank()
    data = dict(
        _stats,
        pid=os.getpid(),
        rank=rank,
        standin_calls=_standin_calls(),
        env={k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
    )
    path = os.path.join(out, f"stats-rank{rank}.json")
    tmp = path + f".{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _verify_attention(original):
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        fb = forward_batch
        if not fb.forward_mode.is_target_verify():
            return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        bs = int(fb.req_pool_indices.shape[0])
        n = int(q.shape[0]) // bs
        rows = self.req_to_token_pool.req_to_token
        prefix = [int(x) for x in fb.seq_lens.tolist()]
        pools = [int(x) for x in fb.req_pool_indices.tolist()]
        mask = getattr(fb.spec_info, "custom_mask", None)
        if mask is None or mask.numel() < bs * n * n:
            raise RuntimeError("verify shim: the verify batch carries no [bs, n, n] tree mask")
        tree = mask.reshape(-1)[: bs * n * n].reshape(bs, n, n).to(torch.bool) | torch.eye(n, dtype=torch.bool)
        if layer.layer_id == 0:
            with _lock:
                _stats["verify_forwards"] += 1
                _stats["verify_t"].append(time.time())  # wall clock (the test's clock) at this forward
                causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
                bad = (tree != causal).flatten(1).any(1)
                _stats["non_causal_masks"] += int(bad.sum())
                if bad.any() and "non_causal_example" not in _stats:
                    _stats["non_causal_example"] = tree[int(bad.nonzero()[0, 0])].int().tolist()
                for b, (r, s) in enumerate(zip(pools, prefix)):
                    if not torch.equal(rows[r, s : s + n], fb.out_cache_loc[b * n : (b + 1) * n].to(rows.dtype)):
                        raise RuntimeError(
                            "verify shim: the draft's cache slots are not at [seq_lens, seq_lens + draft_token_num)"
                        )
                    _stats["checked_slots"] += n
                _write_stats()
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(fb.out_cache_loc, self.swa_out_cache_loc), k, v)
        kc = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        vc = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        for b, (r, s) in enumerate(zip(pools, prefix)):
            locs = rows[r, : s + n]
            keys, vals = kc[locs].movedim(0, 1), vc[locs].movedim(0, 1)  # [heads_kv, s + n, d]
            qb = q_[b * n : (b + 1) * n].movedim(0, 1)  # [heads_q, n, d]
            allowed = torch.cat([torch.ones(n, s, dtype=torch.bool), tree[b]], dim=1)  # prefix + tree
            out = sdpa(
                qb.unsqueeze(0),
                keys.unsqueeze(0).to(qb.dtype),
                vals.unsqueeze(0).to(qb.dtype),
                attn_mask=allowed,
                scale=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            )
            o_[b * n : (b + 1) * n] = out.squeeze(0).movedim(0, 1)
        return o

    return forward_extend


class RowCapStandIn:
    """A dispatch-slot backend for the test server: ``torch.distributed.all_reduce`` on SGLang's TP
    device group for ``[rows, hidden]`` tensors of at most ``max_rows`` rows; it declines wider ones
    (``supports`` False), as a kernel with a bounded workspace does."""

    def __init__(self, max_rows: int) -> None:
        from collections import Counter

        from fastverify.registry import BackendName

        self.name = BackendName.gloo
        self.max_rows = max_rows
        self.path_counts: Counter[str] = Counter()

    def supports(self, x) -> bool:
        return x.dim() == 2 and int(x.shape[0]) <= self.max_rows

    def all_reduce(self, x):
        import torch.distributed as dist
        from sglang.srt.distributed.parallel_state import get_tp_group

        dist.all_reduce(x, group=get_tp_group().device_group)
        self.path_counts["all_reduce"] += 1
        return x


def _in_embedding() -> bool:
    """Whether the caller is a ``VocabParallelEmbedding`` forward (SGLang's embedding all-reduce)."""
    import sys

    f = sys._getframe(1)
    while f is not None:
        if type(f.f_locals.get("self")).__name__ == "VocabParallelEmbedding":
            return True
        f = f.f_back
    return False


class BrokenBackend(RowCapStandIn):
    """A dispatch-slot backend whose result is wrong in one of three ways (``FVTEST_BROKEN``)."""

    def __init__(self, how: str) -> None:
        super().__init__(1 << 30)
        if how not in ("drop5", "scale", "ulp"):
            raise ValueError(f"FVTEST_BROKEN={how!r}: expected drop5, scale or ulp")
        self.how = how
        self.calls = 0

    def all_reduce(self, x):
        import torch

        self.calls += 1
        if self.how == "drop5" and self.calls % 5 == 0:
            # the peers' partial sums dropped, the same way on every rank: each rank's own partial
            # would differ per rank, the ranks would sample different tokens and fall out of step
            import torch.distributed as dist
            from sglang.srt.distributed.parallel_state import get_tp_group

            group = get_tp_group()
            dist.broadcast(x, src=group.ranks[0], group=group.device_group)
            return x
        x = super().all_reduce(x)
        if self.how == "scale" and not _in_embedding():
            x.mul_(1.01)
        elif self.how == "ulp":
            x.copy_(torch.nextafter(x, torch.full_like(x, float("inf"))))
        return x


def plugin() -> None:
    """SGLang general-plugin entry point (runs in the launcher, every scheduler and the detokenizer)."""
    from sglang.srt.layers.attention import torch_native_backend as tnb

    global KVWriteLoc
    KVWriteLoc = tnb.KVWriteLoc

    cls = tnb.TorchNativeAttnBackend
    if not getattr(cls.forward_extend, "__fvtest_shim__", False):
        new = _verify_attention(cls.forward_extend)
        new.__fvtest_shim__ = True
        cls.forward_extend = new
    if os.environ.get(ENV_STANDIN):
        from fastverify.patch.install import attach_dispatch_backend

        attach_dispatch_backend(RowCapStandIn(int(os.environ[ENV_STANDIN])))
    if os.environ.get(ENV_BROKEN):
        from fastverify.patch.install import attach_dispatch_backend

        attach_dispatch_backend(BrokenBackend(os.environ[ENV_BROKEN]))
    if os.environ.get(ENV_BREAK) == "verify_timer":
        from sglang.srt.managers import tp_worker

        original = tp_worker.TpModelWorker.forward_batch_generation

        def forward_batch_generation(self, *args, **kwargs):  # no functools.wraps: another signature
            return original(self, *args, **kwargs)

        tp_worker.TpModelWorker.forward_batch_generation = forward_batch_generation
