"""Test-only torch stand-ins for the CPU ``sgl_kernel`` ops SGLang 0.5.23 calls for EAGLE /
EAGLE-3 drafting on CPU (never used by fastverify), re-exported by the package ``__init__``:

* ``build_draft_decode_metadata_cpu``: ``IntelAMXMultiStepDraftBackend.init_forward_metadata``
  (``srt/layers/attention/intel_amx_backend.py``) builds the per-candidate ``req_to_token`` of the
  multi-step draft decode with it;
* ``assign_draft_cache_locs_contiguous_cpu``: the draft's KV slots
  (``kernels/ops/speculative/cache_locs.py::assign_draft_cache_locs_contiguous_func``);
* ``build_tree_kernel_efficient_cpu``: the verify tree of the draft tokens
  (``kernels/ops/speculative/spec_tree.py``; mask, positions, retrieve links).

Contracts: the docstrings of sgl-kernel's CPU source, ``sgl-kernel/csrc/cpu/speculative_decoding.cpp``
of sgl-project/sglang (read through the code index; shapes and dtypes as stated there), and the call
sites named above. Nothing is imported from the package, so a test can load this file alone.
"""

from __future__ import annotations

import warnings

import torch

CALLS: dict[str, int] = {
    "build_draft_decode_metadata_cpu": 0,
    "assign_draft_cache_locs_contiguous_cpu": 0,
    "build_tree_kernel_efficient_cpu": 0,
}
UNDEFINED_SLOT = torch.iinfo(torch.int32).max
"""What :func:`build_draft_decode_metadata_cpu` leaves past each row's defined entries (the kernel
leaves ``at::empty`` memory there): an index no KV buffer has, so a read of it raises."""


def build_draft_decode_metadata_cpu(
    req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len
) -> torch.Tensor:
    """The ``req_to_token`` of a multi-step draft decode, one row per (request, candidate).

    ``req_to_token [max_reqs, pool_len]`` int32, ``req_pool_indices`` / ``seq_lens [num_seqs]``
    (int32 or int64; ``seq_lens`` the committed prefix). Returns a new ``[num_seqs * topk,
    pool_len]`` tensor of ``req_to_token``'s dtype whose row ``b * topk + tk`` holds request ``b``'s
    prefix ``req_to_token[rpi[b], :seq_lens[b]]`` followed by candidate ``tk``'s ``num_steps`` draft
    slots, which ``assign_draft_cache_locs_contiguous`` laid out at ``seq_lens[b] + tk * num_steps``:
    ``row[seq_lens[b] + s] = req_to_token[rpi[b], seq_lens[b] + tk * num_steps + s]``. Only the
    first ``seq_lens[b] + num_steps`` entries of a row are defined (the rest: :data:`UNDEFINED_SLOT`).
    The draft backend pairs it with ``req_pool_indices = arange(num_seqs * topk)`` and ``seq_lens =
    seq_lens.repeat_interleave(topk) + step + 1`` for decode step ``step``."""
    CALLS["build_draft_decode_metadata_cpu"] += 1
    if req_to_token.dim() != 2 or int(req_to_token.shape[1]) != int(pool_len):
        raise RuntimeError(
            f"build_draft_decode_metadata_cpu: req_to_token {tuple(req_to_token.shape)}, pool_len {pool_len}"
        )
    topk, num_steps = int(topk), int(num_steps)
    num_seqs = int(req_pool_indices.numel())
    if int(seq_lens.numel()) != num_seqs:
        raise RuntimeError("build_draft_decode_metadata_cpu: seq_lens and req_pool_indices differ in length")
    out = torch.full((num_seqs * topk, int(pool_len)), UNDEFINED_SLOT, dtype=req_to_token.dtype)
    for b, (row, sl) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        src = req_to_token[int(row)]
        for tk in range(topk):
            dst = out[b * topk + tk]
            dst[:sl] = src[:sl]
            dst[sl : sl + num_steps] = src[sl + tk * num_steps : sl + tk * num_steps + num_steps]
    return out


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
) -> None:
    """``out_cache_loc[i * topk * num_steps : (i + 1) * topk * num_steps] =
    req_to_token[req_pool_indices[i], seq_lens[i] : seq_lens[i] + topk * num_steps]`` (the draft KV
    slots the allocator reserved; ``out_cache_loc`` int64 of exactly ``bs * topk * num_steps``). In
    place."""
    CALLS["assign_draft_cache_locs_contiguous_cpu"] += 1
    width = int(topk) * int(num_steps)
    if int(out_cache_loc.numel()) != int(req_pool_indices.numel()) * width:
        raise RuntimeError(
            f"assign_draft_cache_locs_contiguous_cpu: out_cache_loc has {out_cache_loc.numel()} "
            f"entries, want {int(req_pool_indices.numel()) * width}"
        )
    for i, (row, sl) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * width : (i + 1) * width] = req_to_token[int(row), sl : sl + width].to(out_cache_loc.dtype)


def _find(sel: list[int], token_idx: int) -> int:
    """The node (0-based, into ``selected_index[b]``) holding ``token_idx``; -1 when absent."""
    try:
        return sel.index(token_idx)
    except ValueError:
        return -1


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
) -> None:
    """The EAGLE verify tree of each request's ``n = draft_token_num`` tokens (node 0 the bonus
    token, node ``i >= 1`` the draft token ``selected_index[b, i - 1]``). In place.

    ``parent_list [bs, topk * (depth - 1) + 1]`` (``[bs, 0]`` when ``depth == 1``),
    ``selected_index [bs, n - 1]``, ``verified_seq_len [bs]`` (one index dtype, int32 or int64);
    ``positions [bs * n]``; ``retrive_*`` ``[bs, n]``, ``retrive_next_*`` pre-filled with -1.

    * A node's parent: ``selected_index[b, i - 1] // topk`` is its parent's slot in
      ``parent_list[b]``; slot 0 is the root (node 0), otherwise the parent is the node whose
      ``selected_index`` equals ``parent_list[b, slot]`` (node = that index + 1). Walking
      ``i = n - 1 .. 1``, each node becomes its parent's first child and the previous first child
      its next sibling (so siblings run in increasing order); ``retrive_index[b, i] = b * n + i``.
    * ``positions[b * n + i] = verified_seq_len[b] + depth of node i`` (its ancestor count, at
      most ``depth``).
    * ``tree_mask``: ``tree_mask_mode`` 1 (QLEN_ONLY, SGLang's CPU default, ``eagle_utils.py::
      default_tree_mask_mode``): ``[bs * n * n]``, row ``i`` of request ``b`` True at the root, at
      ``i`` and at each ancestor, False elsewhere (the whole row is written). Mode 0 (FULL_MASK):
      ``[sum(seq_len) * n + bs * n * n]``, request ``b``'s rows of width ``seq_len_b + n`` start at
      ``b * n * n + sum(seq_len_<b) * n``; only the ``n`` tree columns after the ``seq_len_b``
      prefix columns are written (the caller fills the prefix with True). Mode 2 (bit-packed) has
      no CPU producer and is refused, as by the kernel.
    * A malformed tree (a parent not among the selected tokens) warns and skips that node, as the
      kernel does."""
    CALLS["build_tree_kernel_efficient_cpu"] += 1
    mode = int(getattr(tree_mask_mode, "value", tree_mask_mode))
    if mode not in (0, 1):
        raise RuntimeError(
            f"build_tree_kernel_efficient_cpu: only FULL_MASK (0) and QLEN_ONLY (1) are supported, got {mode}"
        )
    n, topk, depth = int(draft_token_num), int(topk), int(depth)
    bs = int(verified_seq_len.numel())
    parents = parent_list.tolist()
    sels = selected_index.tolist()
    seq = [int(x) for x in verified_seq_len.tolist()]
    mask = tree_mask.reshape(-1)
    pos, ri = positions.reshape(-1), retrive_index.reshape(-1)
    nt, ns = retrive_next_token.reshape(-1), retrive_next_sibling.reshape(-1)
    full_base = 0
    for b in range(bs):
        off, sel, par, sl = b * n, sels[b], parents[b], seq[b]
        pos[off] = sl
        ri[off] = off
        for i in range(n - 1, 0, -1):
            ri[off + i] = off + i
            slot = sel[i - 1] // topk
            parent = 0
            if slot > 0:
                found = _find(sel, par[slot])
                if found < 0:
                    warnings.warn(f"build_tree_kernel_efficient_cpu: invalid eagle tree, parent of node {i} not found")
                    continue
                parent = found + 1
            first = int(nt[off + parent])
            nt[off + parent] = i
            if first != -1:
                ns[off + i] = first
        for tid in range(n):
            if mode == 1:
                row = (off + tid) * n
            else:
                row = full_base + b * n * n + (sl + n) * tid + sl
            mask[row] = True
            mask[row + 1 : row + n] = False
            if tid == 0:
                continue
            depth_i, cur = 0, tid - 1
            while depth_i < depth:
                depth_i += 1
                mask[row + cur + 1] = True
                slot = sel[cur] // topk
                if slot == 0:
                    break
                cur = _find(sel, par[slot])
                if cur < 0:
                    warnings.warn(
                        f"build_tree_kernel_efficient_cpu: invalid eagle tree, ancestor of node {tid} not found"
                    )
                    break
            pos[off + tid] = depth_i + sl
        if mode == 0:
            full_base += sl * n
