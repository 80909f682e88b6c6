"""Test-only torch reference implementations of sgl-kernel's CPU attention ops (never used by
fastverify): ``decode_attention_cpu`` and ``extend_attention_cpu``, which SGLang 0.5.23's
``intel_amx`` attention backend (``srt/layers/attention/intel_amx_backend.py``) calls as
``torch.ops.sgl_kernel.*``; the package ``__init__`` registers them there (:func:`register`).

Why they exist: EAGLE and EAGLE-3 need a draft attention backend from SGLang's multi-step draft
table (``srt/speculative/draft_utils.py::DraftBackendFactory``), whose only CPU entry is
``intel_amx``; the PyPI wheel has no CPU build of sgl-kernel, so its ops are not there.

Where the contract comes from, per argument:

* **argument order**: the positional calls in ``intel_amx_backend.py`` of the SGLang 0.5.23 wheel
  (``forward_decode`` 19 arguments, ``forward_extend`` 22), the only source for the scalar
  ``k_scale`` / ``v_scale`` after the buffers and the trailing ``is_causal``: no stored sgl-kernel
  source has that exact signature;
* **layouts and semantics**: sgl-kernel's CPU sources (``sgl-kernel/csrc/cpu/decode.cpp`` and
  ``extend.cpp`` of sgl-project/sglang, versions read through the code index that predate the two
  scalar scales and ``is_causal`` but carry ``is_cross_attn``, ``sliding_window_size``,
  ``encoder_lens``, ``sinks`` and the QLEN_ONLY ``tree_mask``), quoted on each function.

What the stand-ins deliberately accept that the C++ kernels refuse (so the tiny float32 test model
with 16-wide heads runs): any floating dtype (the kernels dispatch on
``AT_DISPATCH_REDUCED_FLOATING_TYPES``, bf16/fp16 only) and any head size (``extend.cpp`` checks a
multiple of 32, or of ``EXTEND_BLOCK_N``). Everything is computed in float32 and cast back.

Nothing is imported from the package, so a test can load this file alone.
"""

from __future__ import annotations

import torch

DECODE_SCHEMA = (
    "decode_attention_cpu(Tensor query, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale, float v_scale, "
    "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor(d!) attn_logits, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
    "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
)
EXTEND_SCHEMA = (
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
    "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
    "int max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, "
    "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"
)
CALLS: dict[str, int] = {"decode_attention_cpu": 0, "extend_attention_cpu": 0}


def _scores(q: torch.Tensor, k: torch.Tensor, sm_scale: float, logit_cap: float) -> torch.Tensor:
    """``[heads, rows, keys]`` scaled scores for ``q [rows, heads, d]`` and ``k [keys, heads, d]``
    (already expanded to the query heads); soft-capped as ``cap * tanh(s / cap)`` when
    ``logit_cap > 0`` (decode.cpp: ``logit_cap * tanh(x * (1 / logit_cap))`` on the scaled scores)."""
    s = torch.einsum("rhd,khd->hrk", q, k) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    return s


def _expand_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[n, heads_kv, d]`` → ``[n, num_heads, d]``: query head ``h`` reads kv head
    ``h // (num_heads / heads_kv)`` (the kernels' ``head_kv_id = head_id / num_groups``)."""
    groups = num_heads // x.shape[1]
    if groups * x.shape[1] != num_heads:
        raise RuntimeError(f"num_heads {num_heads} is not a multiple of the kv heads {x.shape[1]}")
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _attend(s: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the allowed keys of ``s [heads, rows, keys]`` times ``v [keys, heads, dv]``
    → ``[rows, heads, dv]``; a sink adds ``exp(sinks[h] - max)`` to each row's denominator only
    (extend.cpp: ``s_prime += exp(sinks[head_id] - m_prime)``)."""
    s = s.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.float().view(-1, 1, 1))
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sinks.float().view(-1, 1, 1) - m)
    return torch.einsum("hrk,khd->rhd", p / den, v)


def decode_attention_cpu(
    query,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    output,
    key,
    value,
    loc,
    attn_logits,
    req_to_token,
    req_pool_indices,
    seq_lens,
    sm_scale,
    logit_cap,
    is_cross_attn,
    sliding_window_size,
    encoder_lens,
    sinks,
) -> None:
    """One query token per sequence against its cached keys (sgl-kernel ``decode.cpp``). In place.

    Shapes: ``query [num_seqs, H, D]``; ``k_buffer [max_tokens, Hkv, D]``, ``v_buffer
    [max_tokens, Hkv, Dv]``; ``output [num_seqs, H, Dv]``; ``key`` / ``value`` ``[num_seqs, Hkv, D]``
    or None; ``loc [num_seqs]`` int64; ``attn_logits [num_seqs, H, num_kv_splits, Dv + 1]`` float32;
    ``req_to_token [max_reqs, max_context_len]`` int32/int64; ``req_pool_indices``, ``seq_lens``
    ``[num_seqs]`` int64.

    1. When ``key`` is given (``value`` too), it is written into the cache first:
       ``k_buffer[loc[i]] = key[i]``, ``v_buffer[loc[i]] = value[i]`` (``decode_set_kv_buffer``);
       SGLang's backend passes None after writing an fp8 cache itself.
    2. Sequence ``b`` attends to the ``L`` tokens ``req_to_token[req_pool_indices[b], off : off + L]``
       with ``L = seq_lens[b]`` and ``off = encoder_lens[b]`` if given (else 0), or, for
       ``is_cross_attn``, ``L = encoder_lens[b]`` and ``off = 0``. With ``sliding_window_size = W
       > 0`` only the last ``W`` of them (decode.cpp: ``kv_offset = seq_len_kv - W``; here added to
       ``off``). SGLang passes ``layer.sliding_window_size + 1``, so 0 means no window.
    3. Scores ``q.k * sm_scale * k_scale`` (soft-capped by ``logit_cap > 0``), values times
       ``v_scale``: the scalars dequantise an fp8 cache as it is read (1.0 otherwise, SGLang's
       ``layer.k_scale_float or 1.0``); query head ``h`` reads kv head ``h // (H / Hkv)``.
    4. Split-KV, as the kernel: the ``L`` keys cut into ``num_kv_splits = attn_logits.shape[2]``
       chunks of ``ceil(L / splits)``; chunk ``j`` leaves its normalised partial output in
       ``attn_logits[b, h, j, :Dv]`` and its log-sum-exp in ``attn_logits[b, h, j, Dv]`` (-inf and
       zeros for an empty chunk); ``output`` is their log-sum-exp-weighted sum (with a sink's
       ``exp(sinks[h] - max)`` added to the denominator)."""
    CALLS["decode_attention_cpu"] += 1
    if key is not None:
        if value is None:
            raise RuntimeError("decode_attention_cpu: key and value should have values at the same time")
        if loc.numel() != seq_lens.numel():
            raise RuntimeError("decode_attention_cpu: loc must hold one slot per sequence")
        idx = loc.to(torch.int64)
        k_buffer[idx] = key.to(k_buffer.dtype)
        v_buffer[idx] = value.to(v_buffer.dtype)
    num_seqs, num_heads = int(seq_lens.numel()), int(query.shape[1])
    dv = int(v_buffer.shape[-1])
    splits = int(attn_logits.shape[2])
    if tuple(attn_logits.shape) != (num_seqs, num_heads, splits, dv + 1) or attn_logits.dtype != torch.float32:
        raise RuntimeError(
            f"decode_attention_cpu: attn_logits {tuple(attn_logits.shape)} {attn_logits.dtype}, want "
            f"({num_seqs}, {num_heads}, splits, {dv + 1}) float32"
        )
    rows = req_to_token[req_pool_indices.to(torch.int64)]
    for b in range(num_seqs):
        enc = int(encoder_lens[b]) if encoder_lens is not None else 0
        length, off = (enc, 0) if is_cross_attn else (int(seq_lens[b]), enc)
        if sliding_window_size > 0 and length > sliding_window_size:
            off, length = off + length - sliding_window_size, sliding_window_size
        idx = rows[b, off : off + length].to(torch.int64)
        k = _expand_heads(k_buffer[idx].float() * k_scale, num_heads)
        v = _expand_heads(v_buffer[idx].float() * v_scale, num_heads)
        s = _scores(query[b : b + 1].float(), k, sm_scale, logit_cap)[:, 0]  # [H, L]
        size = -(-length // splits) if length else 0
        lse = torch.full((num_heads, splits), float("-inf"))
        part = torch.zeros((num_heads, splits, dv))
        for j in range(splits):
            lo, hi = j * size, min(j * size + size, length)
            if hi <= lo:
                continue
            sj = s[:, lo:hi]
            mj = sj.amax(-1, keepdim=True)
            pj = torch.exp(sj - mj)
            den = pj.sum(-1, keepdim=True)
            part[:, j] = torch.einsum("hk,khd->hd", pj / den, v[lo:hi])
            lse[:, j] = (mj + torch.log(den)).squeeze(-1)
        attn_logits[b, :, :, :dv] = part
        attn_logits[b, :, :, dv] = lse
        m = lse.amax(-1, keepdim=True)
        if sinks is not None:
            m = torch.maximum(m, sinks.float().view(-1, 1))
        w = torch.exp(lse - m)  # [H, splits]; 0 for empty chunks
        den = w.sum(-1, keepdim=True)
        if sinks is not None:
            den = den + torch.exp(sinks.float().view(-1, 1) - m)
        output[b] = (torch.einsum("hs,hsd->hd", w, part) / den).to(output.dtype)


def extend_attention_cpu(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_seq_lens,
    extend_start_loc,
    max_len_extend,
    sm_scale,
    logit_cap,
    is_cross_attn,
    sliding_window_size,
    encoder_lens,
    sinks,
    tree_mask,
    is_causal,
) -> None:
    """New tokens of each sequence against its cached prefix and against each other (sgl-kernel
    ``extend.cpp``). In place: ``o_extend``.

    Shapes: ``q_extend [num_tokens, H, D]``, ``k_extend`` / ``v_extend [num_tokens, Hkv, D|Dv]``
    (None only for cross-attention), ``o_extend [num_tokens, H, Dv]``; the buffers and indices as in
    :func:`decode_attention_cpu`; ``seq_lens`` (prefix + extend, int64), ``extend_seq_lens``,
    ``extend_start_loc`` ``[num_seqs]``; ``tree_mask`` None or a flat bool
    ``[num_seqs * max_len_extend * max_len_extend]``.

    Sequence ``b``: ``E = extend_seq_lens[b]`` queries at rows ``start = extend_start_loc[b]``
    onwards, ``P = seq_lens[b] - E`` prefix tokens.

    * Stage 1, the prefix: keys ``req_to_token[req_pool_indices[b], off : off + P]`` of the cache
      (``off = encoder_lens[b]`` if given), all visible; for ``is_cross_attn`` the ``encoder_lens[b]``
      encoder tokens at offset 0 instead, and no stage 2.
    * Stage 2, the new tokens: keys ``k_extend[start : start + E]`` (read from the argument, not the
      cache). Visible: with a ``tree_mask``, exactly ``tree_mask[b, i, j]`` (QLEN_ONLY layout, row =
      query draft token, column = key draft token, ``E == max_len_extend`` for every sequence:
      extend.cpp's "[NOTE] 5", the mask replaces the causal one; SGLang passes it only for a
      TARGET_VERIFY tree, ``spec_info.tree_topk != 1``); else ``j <= i`` when ``is_causal`` (the
      0.5.23 call passes False for cross- and encoder-only attention), else all.
    * ``sliding_window_size = W > 0``: query ``i`` (absolute position ``P + i``) sees only keys at
      positions ``> P + i - W``, in both stages (extend.cpp's two window fills).
    * ``k_scale`` / ``v_scale`` multiply the cached (stage 1) keys and values; ``logit_cap`` is
      applied as in decode. (The stored extend.cpp versions take ``logit_cap`` but never pass it to
      the kernel; SGLang's Llama passes 0, so the tests cannot tell.) Sinks as in decode."""
    CALLS["extend_attention_cpu"] += 1
    if not is_cross_attn and (k_extend is None or v_extend is None):
        raise RuntimeError("extend_attention_cpu: k_extend and v_extend are required for non-cross attention")
    num_heads = int(q_extend.shape[1])
    rows = req_to_token[req_pool_indices.to(torch.int64)]
    n = int(max_len_extend)
    for b in range(int(seq_lens.numel())):
        e, start = int(extend_seq_lens[b]), int(extend_start_loc[b])
        p = int(seq_lens[b]) - e
        if p < 0:
            raise RuntimeError("extend_attention_cpu: prefix len < 0!")
        if e == 0:
            continue
        enc = int(encoder_lens[b]) if encoder_lens is not None else 0
        q = q_extend[start : start + e].float()
        if is_cross_attn:
            idx = rows[b, :enc].to(torch.int64)
            keys, vals = k_buffer[idx].float() * k_scale, v_buffer[idx].float() * v_scale
            allowed = torch.ones(e, enc, dtype=torch.bool)
        else:
            idx = rows[b, enc : enc + p].to(torch.int64)
            keys = torch.cat([k_buffer[idx].float() * k_scale, k_extend[start : start + e].float()])
            vals = torch.cat([v_buffer[idx].float() * v_scale, v_extend[start : start + e].float()])
            if tree_mask is not None:
                if e != n:
                    raise RuntimeError(
                        f"extend_attention_cpu: tree_mask requires uniform extend_seq_lens, got {e} vs {n}"
                    )
                new = tree_mask.reshape(-1)[b * n * n : (b + 1) * n * n].reshape(n, n).to(torch.bool)
            elif is_causal:
                new = torch.ones(e, e, dtype=torch.bool).tril()
            else:
                new = torch.ones(e, e, dtype=torch.bool)
            allowed = torch.cat([torch.ones(e, p, dtype=torch.bool), new], dim=1)
            if sliding_window_size > 0:
                qpos = (p + torch.arange(e)).view(e, 1)
                kpos = torch.arange(p + e).view(1, p + e)
                allowed &= kpos > qpos - sliding_window_size
        k = _expand_heads(keys, num_heads)
        v = _expand_heads(vals, num_heads)
        out = _attend(_scores(q, k, sm_scale, logit_cap), allowed, v, sinks)
        o_extend[start : start + e] = out.to(o_extend.dtype)


def register(lib: torch.library.Library) -> None:
    """Define both ops in ``lib`` (namespace ``sgl_kernel``) with the schemas above and bind these
    implementations for CPU tensors."""
    for schema, fn in ((DECODE_SCHEMA, decode_attention_cpu), (EXTEND_SCHEMA, extend_attention_cpu)):
        lib.define(schema)
        lib.impl(fn.__name__, fn, "CPU")
