"""Test-only, pure-torch stand-in for the CPU build of ``sgl_kernel`` (never used by fastverify).

Why: SGLang 0.5.23's CPU mode (``SGLANG_USE_CPU_ENGINE=1``) imports ``*_cpu`` ops from
``sgl_kernel`` at module level, and PyPI ships only the CUDA build. A Llama model served with NGRAM
speculative decoding calls exactly the seven ops below; their contracts are taken from the Triton
kernels SGLang runs on GPUs for the same job, named on each function. EAGLE / EAGLE-3 drafting on
CPU needs six more, whose contracts come from sgl-kernel's own CPU sources: the three draft ops of
:mod:`.draft` (``build_draft_decode_metadata_cpu``, ``assign_draft_cache_locs_contiguous_cpu``,
``build_tree_kernel_efficient_cpu``) and the two attention ops of :mod:`.attention`
(``decode_attention_cpu``, ``extend_attention_cpu``) that SGLang's ``intel_amx`` attention backend
calls as ``torch.ops.sgl_kernel.*``. Any other op is importable (SGLang imports some at module
level, e.g. ``rotate_input_ids_cpu`` in ``kernels/ops/speculative/multi_layer_eagle.py``) but
raises when called, so an SGLang bump that needs more fails loudly instead of computing something
wrong.

Registered under ``torch.ops.sgl_kernel`` at import: only the two attention ops. Nothing else is,
on purpose: SGLang's CPU all-reduce then takes ``torch.distributed.all_reduce`` over gloo
(``distributed/parallel_state.py``: the ``shm_allreduce`` op is used only when
``is_shm_available``, which needs AMX support), and ``cpu_has_amx_support()`` is False (it checks
for ``torch.ops.sgl_kernel.convert_weight_packed``, ``srt/utils/common.py``), so no layer takes an
AMX path and ``--attention-backend intel_amx`` for the target still falls back to ``torch_native``
(``arg_groups/overrides.py::_attention_backend_platform_fallbacks``); only the draft runner, given
``speculative_draft_attention_backend="intel_amx"``, uses the attention ops.

Every call is counted in :data:`CALLS` (op name → calls; the draft and attention ops count in their
modules' ``CALLS``), so a test can see which ops ran.
"""

from __future__ import annotations

import ctypes
from collections import Counter

import torch

from . import attention as _attention, draft as _draft
from .draft import (  # noqa: F401
    assign_draft_cache_locs_contiguous_cpu,
    build_draft_decode_metadata_cpu,
    build_tree_kernel_efficient_cpu,
)

__version__ = "0.0.0+fastverify-test-standin"
CALLS: Counter = Counter()
IMPLEMENTED = (
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_extend_cache_locs_cpu",
    "verify_tree_greedy_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "reconstruct_indices_from_tree_mask",
    *_draft.CALLS,
    *_attention.CALLS,
)
_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")  # kept alive: the ops live as long as this object
_attention.register(_LIB)


def _spans(start: torch.Tensor, end: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, offset into the packed array) per request; offset = sum of earlier lengths."""
    out, off = [], 0
    for s, e in zip(start.tolist(), end.tolist()):
        out.append((int(s), int(e), off))
        off += int(e) - int(s)
    return out


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[off_i : off_i + len_i]``,
    ``off_i`` the sum of the earlier requests' lengths (Triton ``assign_req_to_token_pool``,
    ``srt/mem_cache/allocation.py``). In place."""
    CALLS["assign_req_to_token_pool_cpu"] += 1
    for row, (s, e, off) in zip(req_pool_indices.tolist(), _spans(start_offset, end_offset)):
        req_to_token[int(row), s:e] = out_cache_loc[off : off + e - s].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """The reverse gather: ``out_cache_loc[off_i : off_i + len_i] = req_to_token[req_pool_indices[i],
    start[i]:end[i]]`` (Triton ``assign_extend_cache_locs``, ``kernels/ops/speculative/cache_locs.py``)."""
    CALLS["assign_extend_cache_locs_cpu"] += 1
    for row, (s, e, off) in zip(req_pool_indices.tolist(), _spans(start_offset, end_offset)):
        out_cache_loc[off : off + e - s] = req_to_token[int(row), s:e].to(out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For every buffer ``b`` (base address ``data_ptrs[b]``, row size ``strides[b]`` bytes) copy
    row ``src_loc[i]`` to row ``tgt_loc[i]``; all rows are read before any is written, so an
    overlapping (in-place) move is safe (Triton ``copy_all_layer_kv_cache_tiled``,
    ``kernels/ops/kvcache/cache_move.py``)."""
    CALLS["copy_all_layer_kv_cache_cpu"] += 1
    src, tgt = src_loc.tolist(), tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(int(base) + int(s) * int(stride), int(stride)) for s in src]
        for t, data in zip(tgt, rows):
            ctypes.memmove(int(base) + int(t) * int(stride), data, int(stride))


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """``bonus_tokens[i] = accept_tokens.flat[accept_stride * i + accept_lens[i] - 1]`` (the last
    accepted slot; Triton ``fill_bonus_tokens``, ``kernels/ops/speculative/eagle.py``)."""
    CALLS["fill_bonus_tokens_cpu"] += 1
    flat = accept_tokens.reshape(-1)
    idx = torch.arange(accept_lens.numel(), dtype=torch.int64) * int(accept_stride) + accept_lens.to(torch.int64) - 1
    bonus_tokens.copy_(flat[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """Pack the cache locations of the accepted tokens: the k-th entry of ``accept_index`` that is
    not -1 (row-major) gives ``accept_out_cache_loc[k] = out_cache_loc[that entry]`` (Triton
    ``fill_accept_out_cache_loc``, ``kernels/ops/speculative/eagle.py``)."""
    CALLS["fill_accept_out_cache_loc_cpu"] += 1
    idx = accept_index.reshape(-1)
    idx = idx[idx != -1].to(torch.int64)
    accept_out_cache_loc[: idx.numel()] = out_cache_loc[idx].to(accept_out_cache_loc.dtype)


def verify_tree_greedy_cpu(
    *,
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
) -> None:
    """Greedy tree verification, per request ``b`` (Triton ``verify_tree_greedy_kernel_triton``,
    ``kernels/ops/speculative/spec_tree.py``): start at the root (``retrive_index[b, 0]``); at each
    of the ``accept_index.shape[1] - 1`` levels walk the first child and its siblings for a draft
    token equal to the target's prediction at the last accepted node; accept it (write the target
    token into ``predicts`` at the last accepted flat index, append the node's retrieve index to
    ``accept_index``) or stop. Finally ``accept_token_num[b]`` = accepted drafts and ``predicts``
    at the last accepted index = the target's token there (the bonus). In place."""
    CALLS["verify_tree_greedy_cpu"] += 1
    n_spec, n_draft = accept_index.shape[1], candidates.shape[1]
    tp = target_predict.reshape(-1).tolist()
    pred = predicts.reshape(-1)
    ri, nt, ns, cand = (t.tolist() for t in (retrive_index, retrive_next_token, retrive_next_sibling, candidates))
    for b in range(candidates.shape[0]):
        last = ri[b][0]
        accept_index[b, 0] = last
        n_acc, cur = 0, 0
        for _ in range(1, n_spec):
            cur = nt[b][cur]
            target = tp[last]
            found = False
            for _ in range(n_draft):
                if cur == -1:
                    break
                if cand[b][cur] == target:
                    pred[last] = target
                    n_acc += 1
                    accept_index[b, n_acc] = ri[b][cur]
                    last = ri[b][cur]
                    found = True
                    break
                cur = ns[b][cur]
            if not found:
                break
        accept_token_num[b] = n_acc
        pred[last] = tp[last]


def _reconstruct(
    tree_mask,
    verified_seq_len,
    positions,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    batch_size,
    draft_token_num,
) -> None:
    CALLS["reconstruct_indices_from_tree_mask"] += 1
    bs, n = int(batch_size), int(draft_token_num)
    m = tree_mask.reshape(-1)[: bs * n * n].reshape(bs, n, n).to(torch.bool)
    i = torch.arange(n).view(n, 1)
    j = torch.arange(n).view(1, n)
    anc = m & (j < i)  # anc[b, i, j]: j is a strict ancestor of i
    pos = anc.sum(-1).to(torch.int64) + verified_seq_len[:bs].to(torch.int64).view(bs, 1)
    positions.reshape(-1)[: bs * n].copy_(pos.reshape(-1).to(positions.dtype))
    idx = torch.arange(bs).view(bs, 1) * n + torch.arange(n).view(1, n)
    retrieve_index.reshape(-1)[: bs * n].copy_(idx.reshape(-1).to(retrieve_index.dtype))
    cols = torch.arange(n).view(1, 1, n).expand(bs, n, n)
    parent = torch.where(anc, cols, torch.full_like(cols, -1)).amax(-1)  # [bs, n]
    # first child of t: the smallest k > t with t an ancestor of k
    child = torch.where(anc.transpose(1, 2), cols, torch.full_like(cols, n)).amin(-1)
    child = torch.where(child == n, torch.full_like(child, -1), child)
    retrieve_next_token.reshape(-1)[: bs * n].copy_(child.reshape(-1).to(retrieve_next_token.dtype))
    same = (parent.view(bs, 1, n) == parent.view(bs, n, 1)) & (j > i)  # same[b, t, k]: k > t, same parent
    sib = torch.where(same, cols, torch.full_like(cols, n)).amin(-1)
    sib = torch.where((sib == n) | (parent < 0), torch.full_like(sib, -1), sib)
    retrieve_next_sibling.reshape(-1)[: bs * n].copy_(sib.reshape(-1).to(retrieve_next_sibling.dtype))


def _missing(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel stand-in (tests/sglang_server): op {name!r} is not implemented; this SGLang needs more "
            f"than the {len(IMPLEMENTED)} CPU ops the test server was written for ({', '.join(IMPLEMENTED)})"
        )

    op.__name__ = name
    return op


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
