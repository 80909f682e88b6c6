"""EAGLE-3 and EAGLE verify steps on a REAL SGLang 0.5.23 server on CPU, the patch in every rank.

Two halves:

* **The stand-in ops** (no server, torch only): the torch reference implementations of the CPU
  sgl-kernel ops EAGLE drafting needs (``tests/sglang_server/kernels/sgl_kernel/attention.py``:
  ``decode_attention_cpu``, ``extend_attention_cpu``; ``draft.py``: ``build_draft_decode_metadata_cpu``,
  ``assign_draft_cache_locs_contiguous_cpu``, ``build_tree_kernel_efficient_cpu``), each against a
  known answer (naive attention in float64, hand-worked trees); their argument lists against the
  calls in the SGLang 0.5.23 wheel's ``intel_amx_backend.py`` (needs ``FASTVERIFY_SGLANG_WHEEL``).
* **The servers** (``FASTVERIFY_SGLANG_PYTHON``): one ``sglang.Engine`` per algorithm started through
  ``fastverify launch`` (TP 2 over gloo, tiny random drafters built at test time,
  :mod:`tests.sglang_server.tiny_model`): EAGLE-3 chain (topk 1), EAGLE-3 tree (4 steps x topk 2,
  8 draft tokens) and EAGLE chain. Each answers requests (accept lengths from SGLang's meta info,
  printed, no claim on their values: random models), prints the patch line and the per-path
  all-reduce counts line in every rank, writes a verify record for every verify step of both ranks,
  which ``fastverify profile --verify-log`` reads. The EAGLE-3 runs also trace 4 verify steps
  (``--trace-verify-steps``): the all-reduces per forward mode (draft, verify, draft_extend) and
  their sizes, counted from the raw trace, the drafter's apart from the verify step's;
  ``fastverify report`` on a bundle of those traces; and ``fastverify profile --model <the tiny
  config> --tp 2 --device cpu`` against the server's verify all-reduce sequence.

What the CPU engine needs, and the SGLang CPU limitations behind it (file that imposes each):

* The drafter's attention: ``speculative_draft_attention_backend="intel_amx"``. The multi-step draft
  decode takes a backend from ``srt/speculative/draft_utils.py::DraftBackendFactory``'s table, where
  ``torch_native`` is missing ("EAGLE is not supported in decode attention backend torch_native")
  and ``intel_amx`` is the only CPU entry; it calls ``torch.ops.sgl_kernel.decode_attention_cpu`` /
  ``extend_attention_cpu`` and ``sgl_kernel.build_draft_decode_metadata_cpu``
  (``srt/layers/attention/intel_amx_backend.py``), which the stand-in provides.
* The target's attention stays ``torch_native`` (verify by :mod:`tests.sglang_server.shim`):
  ``--attention-backend intel_amx`` falls back to ``torch_native`` on a CPU without AMX
  (``srt/arg_groups/overrides.py::_attention_backend_platform_fallbacks``, via ``cpu_has_amx_support``
  in ``srt/utils/common.py``), which the draft backend setting bypasses. So the stand-in's
  ``tree_mask`` path of ``extend_attention_cpu`` (TARGET_VERIFY only) is tested here against a
  known answer, not by the servers.
* Float16: SGLang serves a float32 checkpoint as float16 (``srt/configs/model_config.py``, "we use
  float16 for float32 models"), so every all-reduce is ``[rows, 64]`` of 2-byte elements.
* The EAGLE-3 drafter reads 2 aux hidden states, not 3 (``tiny_model.EAGLE3_AUX_LAYER_IDS``): the
  default capture layers ``[2, L // 2, L - 3]`` (``srt/models/llama.py::set_eagle3_layers_to_capture``)
  do not exist in a 2-layer target.
* No CUDA graphs and no overlap scheduling on CPU (``srt/speculative/eagle_worker_v2.py::
  _capture_cuda_graphs`` returns on CPU; ``srt/arg_groups/speculative_hook.py::
  _disable_overlap_schedule_for_cpu``): every forward is eager and counted as it runs.
* The tree verify mask on CPU is the QLEN_ONLY ``[bs, n, n]`` one (``srt/speculative/eagle_utils.py::
  default_tree_mask_mode``), the layout the shim's verify reads.

Skipped, with the reason, when ``FASTVERIFY_SGLANG_PYTHON`` is not set (the server half) or torch is
not installed (the op half).
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import os
import re
import subprocess
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import sglang_python_or_skip

from tests.conftest import run_fastverify
from tests.sglang_server.harness import report_line
from tests.test_sglang_server import assert_accepted_is_sglangs

KERNEL_DIR = Path(__file__).resolve().parent / "sglang_server" / "kernels" / "sgl_kernel"
REPO = Path(__file__).resolve().parents[1]


# --- the stand-in ops, against known answers (no server) ---------------------------------------------


def _load(name: str):
    """``kernels/sgl_kernel/<name>.py`` alone (not the package: importing it registers ops)."""
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location(f"fvtest_standin_{name}", KERNEL_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def attn():
    return _load("attention")


@pytest.fixture(scope="module")
def draft():
    return _load("draft")


def _naive(q, keys, vals, allowed, scale, cap=0.0, sink=None):
    """Naive attention in float64: ``q [R, H, D]``, ``keys [K, H, D]``, ``vals [K, H, Dv]``
    (kv heads already expanded), ``allowed [R, K]``; a sink is one more logit per head in the
    softmax whose value is dropped."""
    import torch

    out = torch.zeros(q.shape[0], q.shape[1], vals.shape[-1], dtype=torch.float64)
    for h in range(q.shape[1]):
        s = q[:, h].double() @ keys[:, h].double().T * scale
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        s = s.masked_fill(~allowed, float("-inf"))
        if sink is not None:
            s = torch.cat([s, torch.full((s.shape[0], 1), float(sink[h]), dtype=torch.float64)], dim=1)
        p = torch.softmax(s, dim=-1)
        out[:, h] = p[:, : keys.shape[0]] @ vals[:, h].double()
    return out


def _kv_heads(x, heads):
    return x.repeat_interleave(heads // x.shape[1], dim=1)


H, HKV, D = 4, 2, 16  # GQA: 2 query heads per kv head
SLOTS, REQS, CTX = 128, 5, 40


def _pool():
    """A KV pool of ``SLOTS`` rows and a ``req_to_token`` whose entries are all distinct slots."""
    import torch

    g = torch.Generator().manual_seed(7)
    k_buf = torch.randn(SLOTS, HKV, D, generator=g)
    v_buf = torch.randn(SLOTS, HKV, D, generator=g)
    r2t = torch.randperm(SLOTS, generator=g)[: REQS * CTX // 2].reshape(REQS, CTX // 2).to(torch.int32)
    return g, k_buf, v_buf, torch.cat([r2t, torch.zeros(REQS, CTX - CTX // 2, dtype=torch.int32)], dim=1)


DECODE_CASES = {
    "plain": {},
    "window": {"window": 4},
    "logit_cap": {"cap": 0.7, "scale": 2.0},
    "sinks": {"sinks": True},
    "fp8_scales": {"k_scale": 0.5, "v_scale": 2.0},
    "float16": {"dtype": "float16"},
}


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_attention_cpu_against_naive_attention(attn, case):
    """decode: writes key/value at ``loc`` first, attends to the ``seq_lens[b]`` tokens of the row
    (the last ``W`` with a window), leaves each KV split's partial output and log-sum-exp in
    ``attn_logits``; 3 sequences of 5, 1 and 17 tokens over 8 splits (empty splits included)."""
    import torch

    c = DECODE_CASES[case]
    dtype = getattr(torch, c.get("dtype", "float32"))
    g, k_buf, v_buf, r2t = _pool()
    k_buf, v_buf = k_buf.to(dtype), v_buf.to(dtype)
    rpi = torch.tensor([3, 0, 4], dtype=torch.int64)
    seq = torch.tensor([5, 1, 17], dtype=torch.int64)
    loc = r2t[rpi, seq - 1].to(torch.int64)  # the current token's slot, as SGLang allocates it
    q = torch.randn(3, H, D, generator=g).to(dtype)
    key, value = torch.randn(3, HKV, D, generator=g).to(dtype), torch.randn(3, HKV, D, generator=g).to(dtype)
    sinks = torch.randn(H, generator=g) if c.get("sinks") else None
    scale, cap, window = c.get("scale", D**-0.5), c.get("cap", 0.0), c.get("window", 0)
    ks, vs = c.get("k_scale", 1.0), c.get("v_scale", 1.0)
    splits = 8
    logits = torch.full((3, H, splits, D + 1), float("nan"))
    out = torch.full((3, H, D), float("nan"), dtype=dtype)
    kb, vb = k_buf.clone(), v_buf.clone()
    attn.decode_attention_cpu(
        q, kb, vb, ks, vs, out, key, value, loc, logits, r2t, rpi, seq, scale, cap, False, window, None, sinks
    )
    assert torch.equal(kb[loc], key) and torch.equal(vb[loc], value)  # written in place at loc
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[loc] = False
    assert torch.equal(kb[untouched], k_buf[untouched])
    tol = {"atol": 2e-3, "rtol": 2e-3} if dtype == torch.float16 else {"atol": 1e-5, "rtol": 1e-5}
    for b in range(3):
        n = int(seq[b])
        lo = max(0, n - window) if window else 0
        idx = r2t[rpi[b], lo:n].to(torch.int64)
        keys, vals = _kv_heads(kb[idx].double() * ks, H), _kv_heads(vb[idx].double() * vs, H)
        want = _naive(q[b : b + 1], keys, vals, torch.ones(1, n - lo, dtype=torch.bool), scale, cap, sinks)[0]
        torch.testing.assert_close(out[b].double(), want, **tol)
        # the splits: their log-sum-exps combine to the whole row's
        s = torch.einsum("hd,khd->hk", q[b].double(), keys) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        lse = logits[b, :, :, D].double()
        size = -(-(n - lo) // splits)
        nonempty = sum(1 for j in range(splits) if j * size < n - lo)
        assert torch.isinf(lse[:, nonempty:]).all() and torch.isfinite(lse[:, :nonempty]).all(), (b, lse)
        torch.testing.assert_close(torch.logsumexp(lse, -1), torch.logsumexp(s, -1), **tol)


def _tree_masks(g, bs: int, n: int):
    """Random trees of ``n`` nodes (every node's parent comes before it), QLEN_ONLY ``[bs, n, n]``:
    row ``i`` True at ``i`` and its ancestors (the root included)."""
    import torch

    m = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        for i in range(n):
            m[b, i, i] = True
            if i:
                m[b, i] |= m[b, int(torch.randint(0, i, (1,), generator=g))]
    return m


EXTEND_CASES = {
    "causal": {},
    "tree_mask": {"tree": True},
    "non_causal": {"causal": False},
    "window": {"window": 3},
    "sinks_logit_cap": {"sinks": True, "cap": 0.5, "scale": 2.0},
    "fp8_scales": {"k_scale": 0.25, "v_scale": 3.0},
    "encoder_offset": {"encoder": True},
    "cross_attention": {"cross": True},
}


@pytest.mark.parametrize("case", sorted(EXTEND_CASES))
def test_extend_attention_cpu_against_naive_attention(attn, case):
    """extend: 3 sequences (prefix 0, 3 and 6 tokens; 4 new tokens each, packed at
    ``extend_start_loc``), new keys read from ``k_extend`` (the cache rows of the new tokens hold
    other values on purpose), prefix from the cache; the QLEN_ONLY tree mask, causal, non-causal,
    sliding window, sinks + soft cap, scales, an encoder offset and cross-attention."""
    import torch

    c = EXTEND_CASES[case]
    g, k_buf, v_buf, r2t = _pool()
    rpi = torch.tensor([2, 4, 1], dtype=torch.int64)
    prefix, new = [0, 3, 6], 4
    seq = torch.tensor([p + new for p in prefix], dtype=torch.int64)
    ext = torch.full((3,), new, dtype=torch.int32)
    start = torch.tensor([0, new, 2 * new], dtype=torch.int32)
    q = torch.randn(3 * new, H, D, generator=g)
    k_ext, v_ext = torch.randn(3 * new, HKV, D, generator=g), torch.randn(3 * new, HKV, D, generator=g)
    tree = _tree_masks(g, 3, new) if c.get("tree") else None
    enc = torch.tensor([2, 1, 3], dtype=torch.int64) if c.get("encoder") or c.get("cross") else None
    sinks = torch.randn(H, generator=g) if c.get("sinks") else None
    scale, cap, window = c.get("scale", D**-0.5), c.get("cap", 0.0), c.get("window", 0)
    ks, vs = c.get("k_scale", 1.0), c.get("v_scale", 1.0)
    causal, cross = c.get("causal", True), c.get("cross", False)
    out = torch.full((3 * new, H, D), float("nan"))
    attn.extend_attention_cpu(
        q,
        k_ext,
        v_ext,
        out,
        k_buf,
        v_buf,
        ks,
        vs,
        r2t,
        rpi,
        seq,
        ext,
        start,
        new,
        scale,
        cap,
        cross,
        window,
        enc,
        sinks,
        None if tree is None else tree.reshape(-1),
        causal,
    )
    for b in range(3):
        p, e0 = prefix[b], int(start[b])
        off = int(enc[b]) if enc is not None else 0
        if cross:
            idx = r2t[rpi[b], :off].to(torch.int64)
            keys, vals = k_buf[idx].double() * ks, v_buf[idx].double() * vs
            allowed = torch.ones(new, off, dtype=torch.bool)
        else:
            idx = r2t[rpi[b], off : off + p].to(torch.int64)
            keys = torch.cat([k_buf[idx].double() * ks, k_ext[e0 : e0 + new].double()])
            vals = torch.cat([v_buf[idx].double() * vs, v_ext[e0 : e0 + new].double()])
            allowed = torch.zeros(new, p + new, dtype=torch.bool)
            for i in range(new):
                for j in range(p + new):
                    if j < p:
                        ok = True
                    elif tree is not None:
                        ok = bool(tree[b, i, j - p])
                    else:
                        ok = (j - p <= i) or not causal
                    if window and (p + i) - j >= window:
                        ok = False
                    allowed[i, j] = ok
        want = _naive(q[e0 : e0 + new], _kv_heads(keys, H), _kv_heads(vals, H), allowed, scale, cap, sinks)
        torch.testing.assert_close(out[e0 : e0 + new].double(), want, atol=1e-5, rtol=1e-5)


def test_extend_tree_mask_needs_uniform_extend_lengths(attn):
    """As extend.cpp: the QLEN_ONLY mask is only defined when every sequence extends by
    ``max_len_extend`` (TARGET_VERIFY)."""
    import torch

    _, k_buf, v_buf, r2t = _pool()
    q, k = torch.randn(5, H, D), torch.randn(5, HKV, D)
    with pytest.raises(RuntimeError, match="uniform extend_seq_lens"):
        attn.extend_attention_cpu(
            q,
            k,
            k,
            torch.empty(5, H, D),
            k_buf,
            v_buf,
            1.0,
            1.0,
            r2t,
            torch.tensor([0, 1]),
            torch.tensor([3, 2]),
            torch.tensor([3, 2], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32),
            3,
            0.25,
            0.0,
            False,
            0,
            None,
            None,
            torch.ones(2 * 9, dtype=torch.bool),
            True,
        )


def test_build_draft_decode_metadata_cpu_known_answer(draft):
    """2 requests (prefix 3 and 5), topk 2, 3 steps: row ``b * topk + tk`` = prefix, then candidate
    ``tk``'s slots at ``seq_lens[b] + tk * steps``; the rest undefined (never a valid slot)."""
    import torch

    r2t = torch.arange(4 * 20, dtype=torch.int32).reshape(4, 20) + 1000  # slot = 1000 + 20 * row + column
    got = draft.build_draft_decode_metadata_cpu(r2t, torch.tensor([2, 0]), torch.tensor([3, 5]), 2, 3, 20)
    assert got.shape == (4, 20) and got.dtype == torch.int32
    want = {
        0: [1040, 1041, 1042, 1043, 1044, 1045],
        1: [1040, 1041, 1042, 1046, 1047, 1048],
        2: [1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007],
        3: [1000, 1001, 1002, 1003, 1004, 1008, 1009, 1010],
    }
    for row, values in want.items():
        assert got[row, : len(values)].tolist() == values, (row, got[row].tolist())
        assert (got[row, len(values) :] == draft.UNDEFINED_SLOT).all()


def test_assign_draft_cache_locs_contiguous_cpu_known_answer(draft):
    import torch

    r2t = torch.arange(3 * 16, dtype=torch.int32).reshape(3, 16)
    out = torch.full((2 * 2 * 3,), -1, dtype=torch.int64)
    draft.assign_draft_cache_locs_contiguous_cpu(torch.tensor([1, 2]), r2t, torch.tensor([4, 0]), out, 16, 2, 3)
    assert out.tolist() == [20, 21, 22, 23, 24, 25, 32, 33, 34, 35, 36, 37]


def test_build_tree_kernel_efficient_cpu_known_answer(draft):
    """topk 2, depth 3, 5 draft tokens. Candidates: step 0 tokens 0, 1 (children of the root);
    step 1 tokens 2, 3 (of token 0) and 4, 5 (of token 1); step 2 tokens 6, 7 (of token 3) and 8, 9
    (of token 4): ``parent_list = [-1, 0, 1, 3, 4]``. Selected ``[0, 1, 3, 6]`` → nodes 1..4 =
    tokens 0, 1, 3, 6: root → {1, 2}, 1 → {3}, 3 → {4}. Two requests (seq_len 7 and 2), both modes."""
    import torch

    n, bs = 5, 2
    parent = torch.tensor([[-1, 0, 1, 3, 4]] * bs)
    sel = torch.tensor([[0, 1, 3, 6]] * bs)
    seq = torch.tensor([7, 2])
    rows = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    for mode in (1, 0):
        size = bs * n * n if mode == 1 else int(seq.sum()) * n + bs * n * n
        mask = torch.ones(size, dtype=torch.bool)
        pos = torch.empty(bs * n, dtype=torch.int64)
        ri, nt, ns = (torch.full((bs, n), -1, dtype=torch.int64) for _ in range(3))
        draft.build_tree_kernel_efficient_cpu(parent, sel, seq, mask, pos, ri, nt, ns, 2, 3, n, mode)
        assert pos.tolist() == [7, 8, 8, 9, 10, 2, 3, 3, 4, 5]
        assert ri.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
        assert nt.tolist() == [[1, 3, -1, 4, -1]] * bs  # first child
        assert ns.tolist() == [[-1, 2, -1, -1, -1]] * bs  # next sibling
        if mode == 1:
            assert mask.reshape(bs, n, n).int().tolist() == [rows] * bs
        else:  # FULL_MASK: rows of width seq_len + n, prefix columns left as the caller filled them
            first = mask[: n * (7 + n)].reshape(n, 7 + n)
            second = mask[n * (7 + n) :].reshape(n, 2 + n)
            assert first[:, :7].all() and second[:, :2].all()
            assert first[:, 7:].int().tolist() == rows and second[:, 2:].int().tolist() == rows


def test_build_tree_kernel_efficient_cpu_refuses_bitpacking(draft):
    import torch

    with pytest.raises(RuntimeError, match="FULL_MASK"):
        draft.build_tree_kernel_efficient_cpu(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1),
            torch.ones(4),
            torch.empty(2),
            *(torch.empty(1, 2) for _ in range(3)),
            1,
            1,
            2,
            2,
        )


def _amx_calls(wheel: str) -> dict[str, int]:
    """Positional arguments of the op calls in the wheel's ``intel_amx_backend.py`` (SGLang 0.5.23)."""
    with zipfile.ZipFile(wheel) as z:
        src = z.read("sglang/srt/layers/attention/intel_amx_backend.py").decode()
    out = {}
    for node in ast.walk(ast.parse(src)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("decode_attention_fwd", "extend_attention_fwd", "build_draft_decode_metadata")
        ):
            assert not node.keywords, ast.unparse(node)
            out[node.func.attr] = [ast.unparse(a) for a in node.args]
    return out


def test_schemas_take_sglangs_intel_amx_calls(attn, draft):
    """The registered schemas against the calls SGLang 0.5.23 makes (argument count and the
    positions the stand-in reads by name), then one call through ``torch.ops`` with exactly those
    positional arguments (a private namespace: this process's ``sgl_kernel`` stays untouched)."""
    import inspect

    import torch

    wheel = os.environ.get("FASTVERIFY_SGLANG_WHEEL")
    if not wheel or not Path(wheel).is_file():
        pytest.skip("set FASTVERIFY_SGLANG_WHEEL to the sglang 0.5.23 wheel to read intel_amx_backend.py")
    calls = _amx_calls(wheel)
    decode = [p.split()[-1] for p in attn.DECODE_SCHEMA.split("(", 1)[1].rsplit(")", 2)[0].split(", ")]
    extend = [p.split()[-1] for p in attn.EXTEND_SCHEMA.split("(", 1)[1].rsplit(")", 2)[0].split(", ")]
    assert len(calls["decode_attention_fwd"]) == len(decode) == 19, calls["decode_attention_fwd"]
    assert len(calls["extend_attention_fwd"]) == len(extend) == 22, calls["extend_attention_fwd"]
    for ours, theirs in ((decode, calls["decode_attention_fwd"]), (extend, calls["extend_attention_fwd"])):
        named = dict(zip(ours, theirs))
        assert named["k_scale"] == "key_scale" and named["v_scale"] == "value_scale", named
        assert named["sm_scale"] == "layer.scaling" and named["logit_cap"] == "layer.logit_cap", named
        assert named["sliding_window_size"] == "layer.sliding_window_size + 1", named
        assert named["encoder_lens"] == "forward_batch.encoder_lens" and named["sinks"] == "sinks", named
    assert dict(zip(extend, calls["extend_attention_fwd"]))["tree_mask"] == "tree_mask"
    assert calls["extend_attention_fwd"][-1] == "is_causal"
    assert (
        len(calls["build_draft_decode_metadata"])
        == len(inspect.signature(draft.build_draft_decode_metadata_cpu).parameters)
        == 6
    )
    ns = f"fvtest_sglk_{os.getpid()}"
    lib = torch.library.Library(ns, "DEF")
    attn.register(lib)
    ops = getattr(torch.ops, ns)
    _, k_buf, v_buf, r2t = _pool()
    q = torch.randn(1, H, D)
    out = torch.empty(1, H, D)
    ops.decode_attention_cpu(
        q,
        k_buf,
        v_buf,
        1.0,
        1.0,
        out,
        None,
        None,
        torch.tensor([0]),
        torch.zeros(1, H, 8, D + 1),
        r2t,
        torch.tensor([0]),
        torch.tensor([3]),
        0.25,
        0.0,
        False,
        0,
        None,
        None,
    )
    assert torch.isfinite(out).all()
    o2 = torch.empty(2, H, D)
    ops.extend_attention_cpu(
        q.repeat(2, 1, 1),
        torch.randn(2, HKV, D),
        torch.randn(2, HKV, D),
        o2,
        k_buf,
        v_buf,
        1.0,
        1.0,
        r2t,
        torch.tensor([1]),
        torch.tensor([5]),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        2,
        0.25,
        0.0,
        False,
        0,
        None,
        None,
        torch.ones(4, dtype=torch.bool),
        True,
    )
    assert torch.isfinite(o2).all()


# --- the servers --------------------------------------------------------------------------------------

PROMPTS = ["one two three four five six seven", "the quick brown fox jumps over the lazy dog. the quick"]
MAX_NEW = 16
LINGER_S = 3.0  # > the verify timer's 1 s flush interval, before SGLang SIGKILLs the workers
RECORD_TOLERANCE = 2  # records a rank may lack on a loaded box (as tests/test_sglang_server.py)
TRACE_STEPS = 4  # verify steps traced: 3 draft stages and so 2 complete cycles inside the trace
START_TIMEOUT_S = 600.0  # one server run (start-up ~20-120 s on two cores, answers, linger, shutdown)
HIDDEN = 64
ELEM_BYTES = 2  # float16 (module docstring)
TARGET_AR = 1 + 2 * 2
"""All-reduces of one target forward at TP 2: VocabParallelEmbedding, then o_proj and down_proj
(RowParallelLinear) in each of the 2 layers; the logits are gathered."""
DRAFT_AR = 1 + 2 * 1
"""All-reduces of one drafter forward: the target's embedding it shares (VocabParallelEmbedding,
``eagle_worker_v2.py::init_lm_head``), then o_proj and down_proj of its one layer; ``fc`` is a plain
``nn.Linear`` (replicated, no collective), ``lm_head`` is gathered."""


@dataclass(frozen=True)
class Algo:
    name: str
    algorithm: str
    drafter: str  # tiny_model flag: eagle3 / eagle
    steps: int
    topk: int
    draft_tokens: int
    trace: bool

    @property
    def engine(self) -> dict:
        return {
            "speculative_algorithm": self.algorithm,
            "speculative_num_steps": self.steps,
            "speculative_eagle_topk": self.topk,
            "speculative_num_draft_tokens": self.draft_tokens,
            "speculative_draft_attention_backend": "intel_amx",
        }

    @property
    def draft_forwards(self) -> int:
        """Drafter forwards in one draft stage: the first step's tokens come from the draft_extend
        before it (``eagle_worker_v2.py``), so ``steps - 1`` decode forwards."""
        return self.steps - 1


ALGOS = {
    a.name: a
    for a in (
        Algo("eagle3_chain", "EAGLE3", "eagle3", 3, 1, 4, True),
        Algo("eagle3_tree", "EAGLE3", "eagle3", 4, 2, 8, True),
        Algo("eagle_chain", "EAGLE", "eagle", 3, 1, 4, False),
    )
}
TRACED = [n for n, a in ALGOS.items() if a.trace]


def _report(request, line: str) -> None:
    report_line(request, "sglang eagle", line)


@pytest.fixture(scope="module")
def sglang_python() -> str:
    return sglang_python_or_skip()


@pytest.fixture(scope="module")
def models(sglang_python, tmp_path_factory, request) -> dict[str, Path]:
    """The tiny target and both drafters, built once (one process)."""
    out = tmp_path_factory.mktemp("eagle-models")
    paths = {"target": out / "target", "eagle3": out / "eagle3", "eagle": out / "eagle"}
    t0 = time.perf_counter()
    cp = subprocess.run(
        [
            sglang_python,
            "-m",
            "tests.sglang_server.tiny_model",
            str(paths["target"]),
            "--eagle3",
            str(paths["eagle3"]),
            "--eagle",
            str(paths["eagle"]),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=str(REPO),
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    _report(request, f"tiny target + EAGLE-3 and EAGLE drafters built in {time.perf_counter() - t0:.1f} s")
    return paths


@dataclass
class Served:
    algo: Algo
    run: object  # tests.sglang_server.harness.Run
    prof: Path

    @property
    def recs(self) -> dict[int, list[dict]]:
        return self.run.verify_records(self.prof)


@pytest.fixture(scope="module")
def serve(sglang_python, models, tmp_path_factory, request):
    """``serve(name)``: the finished run of algorithm ``name``, started on first use and kept for
    the module (one server start per algorithm, each bounded by ``START_TIMEOUT_S`` with its
    whole process tree killed after it)."""
    from tests.sglang_server.harness import launch_engine

    done: dict[str, Served] = {}

    def get(name: str) -> Served:
        if name in done:
            return done[name]
        a = ALGOS[name]
        work = tmp_path_factory.mktemp(name)
        prof = work / "prof"
        run = launch_engine(
            sglang_python,
            work / "run",
            models["target"],
            env_file=None,
            prof=prof,
            trace_steps=TRACE_STEPS if a.trace else 0,
            prompts=PROMPTS,
            max_new_tokens=MAX_NEW,
            linger_s=LINGER_S,
            timeout=START_TIMEOUT_S,
            engine=dict(a.engine, speculative_draft_model_path=str(models[a.drafter])),
            engine_drop=["speculative_ngram_max_bfs_breadth"],
        )
        if run.rc != 0 or not run.result.get("requests"):
            pytest.fail(f"the launched {a.algorithm} engine failed:\n{run.tail()}")
        done[name] = s = Served(a, run, prof)
        stats, recs = run.stats(), s.recs
        reqs = run.result["requests"]
        _report(
            request,
            f"launch -> Engine TP 2 {a.algorithm} (steps {a.steps}, topk {a.topk}, {a.draft_tokens} "
            f"draft tokens): wall {run.wall_s:.1f} s, start-up {run.result['startup_s']:.1f} s, "
            f"{len(reqs)} requests (latency s {[r['latency_s'] for r in reqs]}; accept length "
            f"{[round(r['spec_accept_length'] or 0, 3) for r in reqs]}, correct drafts "
            f"{[r['spec_num_correct_drafts'] for r in reqs]} of {[r['spec_num_proposed_drafts'] for r in reqs]}"
            f"), SGLang verify steps {run.result['verify_ct_total']}; per rank verify forwards / records: "
            + ", ".join(f"TP {r}: {stats.get(r, {}).get('verify_forwards')} / {len(recs.get(r, []))}" for r in (0, 1)),
        )
        return s

    return get


@pytest.fixture(params=sorted(ALGOS))
def served(request, serve) -> Served:
    return serve(request.param)


@pytest.fixture(params=TRACED)
def traced(request, serve) -> Served:
    return serve(request.param)


def test_engine_answers_requests_with_accept_lengths(served):
    reqs = served.run.result["requests"]
    k = served.algo.draft_tokens
    assert len(reqs) == len(PROMPTS)
    for r in reqs:
        assert r["completion_tokens"] == MAX_NEW and r["text"], r  # ignore_eos: the full length
        assert r["spec_verify_ct"] and 0 < r["spec_verify_ct"] <= MAX_NEW, r  # speculative decoding verified
        # SGLang's meta info carries the accept figures (tokenizer_manager.py); their values are a
        # random drafter's, so only their form is checked
        assert isinstance(r["spec_accept_length"], float) and r["spec_accept_length"] > 0, r
        assert r["spec_num_proposed_drafts"] == r["spec_verify_ct"] * (k - 1), r
        assert 0 <= r["spec_num_correct_drafts"] <= r["spec_num_proposed_drafts"], r


def test_patch_line_in_every_tp_rank(served):
    lines = served.run.patch_lines()
    assert sorted(lines) == [0, 1], served.run.tail()
    for rest in lines.values():
        fields = dict(p.split("=", 1) for p in rest.split() if "=" in p)
        assert set(fields["applied"].split(",")) == {"pre_capture", "verify_timer"}, rest
        assert "skipped=" not in rest and "uncounted=" not in rest, rest
        # what this rank's graphs cover, from SGLang's own config: the draft tokens of this algorithm
        assert f" {served.algo.draft_tokens} tokens" in rest.split(" covers: ", 1)[1], rest


def test_paths_line_counts_the_drafter_apart_in_every_tp_rank(served):
    """Printed after the first verify forward: everything before it (the target's prefill, the
    drafter's prefill, one draft stage, the verify), each mode apart."""
    a = served.algo
    lines = served.run.paths_lines()
    assert sorted(lines) == [0, 1], served.run.tail()
    for rest in lines.values():
        parts = dict(p.split(": ", 1) for p in rest.split("; "))
        assert parts["verify"] == f"sglang.gloo {TARGET_AR} of {TARGET_AR}", rest
        d = a.draft_forwards * DRAFT_AR
        assert parts["draft"] == f"sglang.gloo {d} of {d}", rest
        assert parts["draft_extend"] == f"sglang.gloo {DRAFT_AR} of {DRAFT_AR}", rest  # the drafter's prefill
        assert parts["extend"] == f"sglang.gloo {TARGET_AR} of {TARGET_AR}", rest  # the target's prefill


def test_verify_records_for_every_verify_step_of_both_ranks(served):
    run = served.run
    steps = run.result["verify_ct_total"]  # SGLang's own count (requests run one after the other)
    stats, recs = run.stats(), served.recs
    assert sorted(stats) == [0, 1] and sorted(recs) == [0, 1], (sorted(stats), sorted(recs))
    for rank in (0, 1):
        assert stats[rank]["verify_forwards"] == steps, (rank, stats[rank]["verify_forwards"], steps)
        got = recs[rank]
        assert steps - RECORD_TOLERANCE <= len(got) <= steps, (rank, len(got), steps)
        assert [r["step"] for r in got] == list(range(len(got))), rank
        for r in got:
            assert str(r["rank"]) == str(rank) and r["pid"] == stats[rank]["pid"], r
            assert r["clock"] == "cpu_wall_clock" and r["verify_ms"] > 0, r
            # the load and each request's accepted draft tokens (SGLang's eagle_sample accept_lens - 1):
            # their form here, their values against SGLang's own per-request counts below
            assert type(r["batch"]) is int and r["batch"] >= 1 and r["tokens"] >= r["batch"], r
            assert (
                type(r.get("accepted")) is list
                and len(r["accepted"]) == r["batch"]
                and all(type(a) is int and 0 <= a < r["tokens"] // r["batch"] for a in r["accepted"])
            ), r
        # and their values are SGLang's own (meta_info of the same run), request by request
        assert assert_accepted_is_sglangs(run.result["requests"], got) >= len(PROMPTS) - 1, rank


def test_records_carry_the_drafters_all_reduces_apart(served):
    """Each record: its verify forward's all-reduces, the draft stage before it, and the
    draft_extend forwards since the last record (the previous verify's, the drafter's prefill for a
    request's first step); the prefills' in a request's first record."""
    a = served.algo
    recs = served.recs
    for rank in (0, 1):
        extend = draft_extend = 0
        for r in recs[rank]:
            paths = r["allreduce_paths"]
            assert paths["verify"] == {"sglang.gloo": TARGET_AR}, (rank, r)
            assert paths["draft"] == {"sglang.gloo": a.draft_forwards * DRAFT_AR}, (rank, r)
            assert set(paths) <= {"verify", "draft", "draft_extend", "extend"}, (rank, r)
            de = paths["draft_extend"]["sglang.gloo"]
            assert de >= DRAFT_AR and de % DRAFT_AR == 0, (rank, r)
            draft_extend += de
            extend += paths.get("extend", {}).get("sglang.gloo", 0)
        assert extend == TARGET_AR * len(PROMPTS), (rank, extend)  # one prefill per request
        if len(recs[rank]) == served.run.result["verify_ct_total"]:
            # one draft_extend per verify and per request's prefill; the very last verify's is after
            # the last record
            assert draft_extend == DRAFT_AR * (len(recs[rank]) + len(PROMPTS) - 1), (rank, draft_extend)


def test_drafter_ran_on_the_standin_ops(served):
    """The drafter's attention ran on the stand-in ops (their calls counted in each worker), and
    the target's verify saw the algorithm's mask: causal for a chain, a tree for topk > 1."""
    for st in served.run.stats().values():
        rank, calls = st["rank"], st["standin_calls"]
        for op in (
            "decode_attention_cpu",
            "extend_attention_cpu",
            "build_draft_decode_metadata_cpu",
            "assign_draft_cache_locs_contiguous_cpu",
            "build_tree_kernel_efficient_cpu",
            "verify_tree_greedy_cpu",
        ):
            assert calls.get(op, 0) > 0, (rank, op, calls)
        if served.algo.topk == 1:
            assert st["non_causal_masks"] == 0, st.get("non_causal_example")
        else:
            assert st["non_causal_masks"] == st["verify_forwards"] > 0, st


def test_verify_log_summary_reads_the_records(served, tmp_path):
    recs = served.recs
    cp = run_fastverify(["profile", "--verify-log", str(served.prof)], cwd=tmp_path, timeout=120)
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    out = cp.stdout
    assert "NOT GPU time" in out, out
    n = {r: len(recs[r]) for r in (0, 1)}
    for rank in (0, 1):
        assert re.search(rf"^\s+{rank}\s+{n[rank]}\s", out, re.MULTILINE), (rank, n, out)
    v0, v1 = (TARGET_AR * n[r] for r in (0, 1))
    assert f"verify: sglang.gloo: {v0 + v1} of {v0 + v1} verify all-reduces, ranks 0-1 (TP 0 {v0}, TP 1 {v1})" in out, (
        out
    )
    d0, d1 = (served.algo.draft_forwards * DRAFT_AR * n[r] for r in (0, 1))
    assert f"draft: sglang.gloo: {d0 + d1} of {d0 + d1} draft all-reduces, ranks 0-1 (TP 0 {d0}, TP 1 {d1})" in out, out
    assert re.search(
        r"^\s+draft_extend: sglang\.gloo: \d+ of \d+ draft_extend all-reduces, ranks 0-1", out, re.MULTILINE
    ), out


# --- the EAGLE-3 traces: all-reduces per forward mode ------------------------------------------------


def _trace_events(path: Path) -> list[dict]:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)["traceEvents"]


def _trace_files(s: Served) -> list[Path]:
    files = [s.prof / f"verify-TP-{r}.trace.json.gz" for r in (0, 1)]
    for f in files:
        assert f.is_file(), sorted(p.name for p in s.prof.iterdir())
    return files


def _modes_per_cycle(ev: list[dict]) -> list[dict[str, list[tuple[tuple[int, ...], str]]]]:
    """Independent count from the raw trace: each ``gloo:all_reduce`` (with its ``Input Dims`` and
    ``Input type``) in the forward mode of the span holding its start: SGLang's stage spans
    ``draft`` / ``draft_extend`` (``speculative/spec_utils.py::spec_stage_span``), else its
    ``step[VERIFY ...]`` span, else ``outside``; grouped into cycles from one ``draft`` stage start
    to the next (complete cycles only)."""
    xs = [e for e in ev if e.get("ph") == "X"]
    spans = sorted(
        (
            (e["ts"], e["ts"] + e["dur"], e["name"])
            for e in xs
            if e["name"] in ("draft", "draft_extend") or str(e["name"]).startswith("step[VERIFY")
        ),
        key=lambda s: s[0],
    )
    starts = [s for s, _, n in spans if n == "draft"]
    cycles = [{"draft": [], "verify": [], "draft_extend": [], "outside": []} for _ in range(len(starts) - 1)]
    for e in xs:
        if e["name"] != "gloo:all_reduce":
            continue
        t = e["ts"]
        k = sum(1 for s in starts if s <= t) - 1
        if not 0 <= k < len(cycles):
            continue
        mode = next(("verify" if n.startswith("step[") else n for s, end, n in spans if s <= t <= end), "outside")
        cycles[k][mode].append((tuple(e["args"]["Input Dims"][0]), e["args"]["Input type"][0]))
    return cycles


def test_trace_all_reduces_per_forward_mode_and_size(traced):
    """Per complete cycle of each rank's trace: the verify forward's ``TARGET_AR`` all-reduces of
    ``[draft_tokens, 64]``; the drafter's, apart: ``(steps - 1) x DRAFT_AR`` of ``[topk, 64]`` in the
    draft stage and ``DRAFT_AR`` of ``[draft_tokens, 64]`` in draft_extend (EAGLE v2 re-runs the
    drafter over every verified slot); none outside a forward. float16 throughout. Also: each of the
    ``TRACE_STEPS`` fastverify ``step[TARGET_VERIFY #i]`` spans holds exactly ``TARGET_AR``."""
    a = traced.algo
    for path in _trace_files(traced):
        ev = _trace_events(path)
        cycles = _modes_per_cycle(ev)
        assert len(cycles) == TRACE_STEPS - 2, (path, len(cycles))
        for c in cycles:
            assert c["verify"] == [((a.draft_tokens, HIDDEN), "c10::Half")] * TARGET_AR, (path, c)
            assert c["draft"] == [((a.topk, HIDDEN), "c10::Half")] * (a.draft_forwards * DRAFT_AR), (path, c)
            assert c["draft_extend"] == [((a.draft_tokens, HIDDEN), "c10::Half")] * DRAFT_AR, (path, c)
            assert c["outside"] == [], (path, c)
        steps = sorted(
            (e for e in ev if str(e.get("name", "")).startswith("step[TARGET_VERIFY") and e.get("ph") == "X"),
            key=lambda e: e["ts"],
        )
        ars = [e["ts"] for e in ev if e.get("name") == "gloo:all_reduce" and e.get("ph") == "X"]
        assert [sum(1 for t in ars if s["ts"] <= t <= s["ts"] + s["dur"]) for s in steps] == [TARGET_AR] * TRACE_STEPS
        assert not any(e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") for e in ev), path  # CPU only


def _bundle(tmp: Path, traces: list[Path]) -> Path:
    """A bundle as ``collect`` writes it (tests/test_cycle_report.py's ``make_bundle``), the
    server's traces its only part."""
    from fastverify.bundle import PART_NAMES, Manifest, Part, write_bundle

    arcs = tuple(f"server/traces/{p.name}" for p in traces)
    parts = tuple(
        Part(n, "ok", None, arcs) if n == "server_trace" else Part(n, "skipped", "not in this test") for n in PART_NAMES
    )
    out = tmp / "bundle.tar.gz"
    write_bundle(
        out,
        Manifest(
            created_utc="2026-12-01T00:00:00Z",
            fastverify_version="test",
            host={"hostname": "cpu"},
            budget_s=600.0,
            elapsed_s=1.0,
            parts=parts,
        ),
        dict(zip(arcs, traces)),
    )
    return out


@pytest.fixture
def eagle3_report(serve, tmp_path) -> dict:
    s = serve("eagle3_chain")
    path = _bundle(tmp_path, _trace_files(s))
    rp = run_fastverify(["report", str(path), "--json"], cwd=tmp_path, timeout=120)
    assert rp.returncode == 0, rp.stdout[-2000:] + rp.stderr[-3000:]
    text = run_fastverify(["report", str(path)], cwd=tmp_path, timeout=120)
    assert text.returncode == 0 and "NOT GPU timings" in text.stdout, text.stdout[-3000:]
    return json.loads(rp.stdout)


def test_report_splits_the_eagle3_servers_cycles_at_draft_stages(eagle3_report):
    split = eagle3_report["cycles"]
    assert split is not None, eagle3_report["notes"]
    assert split["anchor"] == "draft stage" and split["clock"] == "cpu_trace", split
    assert sorted(r["rank"] for r in split["ranks"]) == [0, 1]
    assert eagle3_report["verify_msg_bytes"] == ALGOS["eagle3_chain"].draft_tokens * HIDDEN * ELEM_BYTES


def test_report_shows_draft_verify_and_draft_extend_modes(eagle3_report):
    a = ALGOS["eagle3_chain"]
    modes = eagle3_report["modes_mean_us"]
    assert {"draft", "verify", "draft_extend"} <= set(modes), sorted(modes)
    assert modes["verify"]["forwards"] == 1 and modes["verify"]["allreduce_count"] == TARGET_AR, modes["verify"]
    assert modes["draft"]["forwards"] == 1 and modes["draft"]["allreduce_count"] == a.draft_forwards * DRAFT_AR
    assert modes["draft_extend"]["forwards"] == 1 and modes["draft_extend"]["allreduce_count"] == DRAFT_AR


def test_live_profile_gives_the_servers_verify_all_reduce_sequence(traced, tmp_path, request):
    """``fastverify profile --model <the tiny target's config.json> --tp 2 --device cpu``, batch 1
    and this algorithm's draft tokens, float16 as the server: the same verify all-reduces, in order
    and size, as each verify step of the server's trace."""
    a = traced.algo
    config = _target_of(traced) / "config.json"
    out = tmp_path / "live.json"
    t0 = time.perf_counter()
    cp = run_fastverify(
        [
            "profile",
            "--model",
            str(config),
            "--tp",
            "2",
            "--device",
            "cpu",
            "--dtype",
            "float16",
            "--batch",
            "1",
            "--draft-tokens",
            str(a.draft_tokens),
            "--output",
            str(out),
            "--no-png",
            "--quiet",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-3000:]
    live = json.loads(out.read_text())
    live_seq = [r["msg_bytes"] for r in sorted(live["allreduce_by_position"], key=lambda r: r["position"])]
    per_step = {r["rank"]: [s["allreduce_count"] for s in r["steps"]] for r in live["ranks"]}
    server = []
    for path in _trace_files(traced):
        ev = _trace_events(path)
        steps = [e for e in ev if str(e.get("name", "")).startswith("step[VERIFY") and e.get("ph") == "X"]
        for s in steps:
            dims = [
                e["args"]["Input Dims"][0]
                for e in sorted(ev, key=lambda e: e.get("ts", 0))
                if e.get("name") == "gloo:all_reduce"
                and e.get("ph") == "X"
                and s["ts"] <= e["ts"] <= s["ts"] + s["dur"]
            ]
            server.append([d[0] * d[1] * ELEM_BYTES for d in dims])
    _report(
        request,
        f"{a.name}: live profile ({time.perf_counter() - t0:.1f} s) verify all-reduce bytes by position "
        f"{live_seq}, per step {per_step}; server verify steps {server[:2]}... ({len(server)} steps, "
        f"both ranks)",
    )
    assert per_step == {0: [TARGET_AR] * live["source"]["iters"], 1: [TARGET_AR] * live["source"]["iters"]}, per_step
    assert live_seq == [a.draft_tokens * HIDDEN * ELEM_BYTES] * TARGET_AR, live_seq
    assert server and all(s == live_seq for s in server), server
    labels = [r["label"] for r in sorted(live["allreduce_by_position"], key=lambda r: r["position"])]
    assert labels == ["embed.allreduce"] + [f"layer{i}.{w}_out.allreduce" for i in (0, 1) for w in ("attn", "mlp")]


def _target_of(s: Served) -> Path:
    return Path(json.loads((s.run.work / "engine.json").read_text())["model"])
