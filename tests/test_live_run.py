"""Live verify forward (fastverify.live.forward) and a real 2-rank gloo run (fastverify.live.runner).

Expected counts and sizes are derived here from the preset's JSON file and SGLang's collective
sequence (shared/research/sglang.md §2), not from the code under test.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fastverify.errors import UserError  # noqa: E402
from fastverify.events import EventClass  # noqa: E402
from fastverify.live.config import load_model_config  # noqa: E402
from fastverify.live.forward import TPVerifyModel, swiglu  # noqa: E402
from fastverify.live.runner import launch_ranks, run_live  # noqa: E402

TINY_JSON = json.loads((Path(__file__).resolve().parents[1] / "fastverify/live/presets/tiny.json").read_text())
TP, DRAFT, BATCH, ITERS, WARMUP = 2, 4, 2, 3, 1
T = BATCH * DRAFT
LAYERS = TINY_JSON["num_hidden_layers"]
HIDDEN = TINY_JSON["hidden_size"]


@pytest.fixture(scope="module")
def live():
    t0 = time.perf_counter()
    ranks = run_live(
        load_model_config("tiny"),
        tp=TP,
        draft_tokens=DRAFT,
        batch=BATCH,
        iters=ITERS,
        warmup=WARMUP,
        device="cpu",
        timeout_s=120,
    )
    return ranks, time.perf_counter() - t0


def by_step(r, step: int):
    return np.flatnonzero(r.step == step)


def test_ranks_and_wall_time(live):
    ranks, wall_s = live
    assert [r.rank for r in ranks] == [0, 1]
    assert all(r.origin == "live:gloo" for r in ranks)
    assert wall_s < 60, f"tiny on 2 gloo ranks took {wall_s:.1f} s"


def test_steps(live):
    for r in live[0]:
        assert [s.name for s in r.steps] == [f"verify#{i}" for i in range(ITERS)]
        for a, b in zip(r.steps, r.steps[1:]):
            assert a.end_ns <= b.start_ns  # in order, no overlap
        assert all(s.end_ns > s.start_ns for s in r.steps)
        assert (r.step >= 0).all()  # every event inside a step


def test_collective_counts_and_sizes(live):
    allreduce_bytes = T * HIDDEN * 2  # [T, hidden] bf16
    # Logits [T, vocab/tp] bf16 per rank (1024 is already a multiple of SGLang's vocab padding of 64).
    allgather_bytes = T * (TINY_JSON["vocab_size"] // TP) * 2
    for r in live[0]:
        names = np.array(r.names)[r.name_id]
        for s in range(ITERS):
            idx = by_step(r, s)
            ar = idx[names[idx] == "allreduce"]
            ag = idx[names[idx] == "allgather"]
            assert len(ar) == 1 + 2 * LAYERS  # embedding + (attention out, MLP out) per layer
            assert len(ag) == 1
            assert (r.cls[ar] == EventClass.ALLREDUCE.code).all()
            assert r.cls[ag[0]] == EventClass.OTHER_COMM.code
            assert (r.msg_bytes[ar] == allreduce_bytes).all()
            assert r.msg_bytes[ag[0]] == allgather_bytes
            comm = r.cls != EventClass.COMPUTE.code
            assert (r.msg_bytes[idx[~comm[idx]]] == -1).all()


def test_labels_and_compute_regions(live):
    dense = TINY_JSON["first_k_dense_replace"]
    want = ["embed", "embed.allreduce"]
    for i in range(LAYERS):
        want += [f"layer{i}.attn", f"layer{i}.attn_out.allreduce", f"layer{i}.mlp", f"layer{i}.mlp_out.allreduce"]
    want += ["lm_head", "logits.allgather"]
    for r in live[0]:
        names = np.array(r.names)[r.name_id]
        labels = np.array(r.label)
        for s in range(ITERS):
            idx = by_step(r, s)
            assert labels[idx].tolist() == want
            mlp = [names[k] for k in idx if labels[k].endswith(".mlp")]
            assert mlp == ["compute:mlp"] * dense + ["compute:moe"] * (LAYERS - dense)


def test_durations_and_order(live):
    for r in live[0]:
        assert (r.dur_ns > 0).all()
        order = np.argsort(r.start_ns, kind="stable")
        assert (order == np.arange(len(r))).all()
        end = r.start_ns + r.dur_ns
        assert (r.start_ns[1:] >= end[:-1]).all()  # one CPU thread of regions: back to back, no overlap


def test_one_clock_for_all_ranks(live):
    # A collective cannot finish on one rank before the other has entered it, so in a shared clock the
    # k-th collective's intervals on the two ranks overlap.
    r0, r1 = live[0]
    comm0 = np.flatnonzero(r0.cls != EventClass.COMPUTE.code)
    comm1 = np.flatnonzero(r1.cls != EventClass.COMPUTE.code)
    assert len(comm0) == len(comm1) == ITERS * (2 + 2 * LAYERS)
    s0, e0 = r0.start_ns[comm0], r0.start_ns[comm0] + r0.dur_ns[comm0]
    s1, e1 = r1.start_ns[comm1], r1.start_ns[comm1] + r1.dur_ns[comm1]
    assert ((s0 < e1) & (s1 < e0)).all()


def test_meta(live):
    for r in live[0]:
        m = r.meta
        assert m["timing"] == "cpu_wall_clock" and m["device"] == "cpu" and m["dist_backend"] == "gloo"
        assert (m["world_size"], m["model"], m["dtype"]) == (TP, "tiny", "bfloat16")
        assert (m["hidden_size"], m["num_layers"]) == (HIDDEN, LAYERS)
        assert (m["draft_tokens"], m["batch"], m["tokens"]) == (DRAFT, BATCH, T)
        assert (m["warmup"], m["iters"]) == (WARMUP, ITERS)
        # min(n_routed_experts, T × top-k) = min(16, 8 × 2)
        assert m["experts_allocated"] == min(TINY_JSON["n_routed_experts"], T * TINY_JSON["num_experts_per_tok"])


# ---- argument errors: no process starts ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(tp=3), "--tp 3 does not divide num_attention_heads = 4"),
        (dict(draft_tokens=0), "--draft-tokens must be an integer >= 1, got 0"),
        (dict(batch=2.5), "--batch must be an integer >= 1"),
        (dict(iters=0), "--iters must be an integer >= 1"),
        (dict(device="tpu"), "--device must be auto, cpu or cuda, got 'tpu'"),
        (dict(device="cpu", trace_dir="traces"), "a trace directory needs --device cuda"),
    ],
)
def test_bad_arguments(kwargs, words):
    args = dict(tp=2, draft_tokens=4, batch=2, device="cpu")
    args.update(kwargs)
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        run_live(load_model_config("tiny"), **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpus():
    with pytest.raises(UserError, match="--device cuda needs 2 GPUs for --tp 2, found 0"):
        run_live(load_model_config("tiny"), tp=2, draft_tokens=4, batch=2, device="cuda")


# ---- rank failures -------------------------------------------------------------------------------


def _argv(per_rank: dict[int, str]):
    return lambda rank: [sys.executable, "-c", per_rank[rank]]


def test_crashed_rank_is_named_and_others_killed(tmp_path):
    code = {
        0: "import time; time.sleep(60)",
        1: "import sys; print('warming up', file=sys.stderr); print('boom: disk on fire', file=sys.stderr); "
        "sys.exit(3)",
    }
    t0 = time.monotonic()
    with pytest.raises(UserError) as info:
        launch_ranks(_argv(code), 2, 60.0, str(tmp_path))
    assert str(info.value) == "live rank 1 failed (exit code 3): boom: disk on fire"
    assert time.monotonic() - t0 < 20  # rank 0 was killed, not waited for


def test_hung_rank_times_out(tmp_path):
    code = {
        0: "import sys, time; print('stuck in barrier', file=sys.stderr, flush=True); time.sleep(60)",
        1: "import time; time.sleep(60)",
    }
    with pytest.raises(UserError) as info:
        launch_ranks(_argv(code), 2, 1.5, str(tmp_path))
    assert str(info.value) == "live rank 0 did not finish within 1.5 s (last stderr line: stuck in barrier)"


def test_worker_exception_reaches_the_caller():
    # A config the loader would refuse (top-k above the expert count) fails inside the ranks.
    from dataclasses import replace

    bad = replace(load_model_config("tiny"), num_experts_per_tok=17)
    with pytest.raises(UserError, match=r"^live rank [01] failed \(exit code 1\): RuntimeError: .*"):
        run_live(bad, tp=2, draft_tokens=4, batch=2, iters=1, warmup=0, device="cpu", timeout_s=120)


# ---- the forward in process (tp = 1) ---------------------------------------------------------------


class ListRecorder:
    def __init__(self):
        self.regions = []

    def region(self, name, cls, label, msg_bytes):
        self.regions.append((name, cls, label, msg_bytes))
        import contextlib

        return contextlib.nullcontext()


def test_moe_plan_matches_a_per_token_loop():
    cfg = load_model_config("tiny")
    model = TPVerifyModel(cfg, tp=1, rank=0, batch=3, draft_tokens=4, dtype=torch.float32, seed=5)
    k, tokens = cfg.num_experts_per_tok, model.tokens
    for layer, (used, cap, token_index, pair_index, valid) in model.plans.items():
        ok = valid[:, 0] > 0
        # Every (token, choice) pair lands in exactly one row, and the row's token is the pair's token.
        assert sorted(pair_index[ok].tolist()) == list(range(tokens * k))
        assert (token_index[ok] == pair_index[ok] // k).all()
        # A token never visits the same expert twice.
        slots = torch.div(torch.arange(used * cap)[ok], cap, rounding_mode="floor")
        for t in range(tokens):
            assert len(set(slots[token_index[ok] == t].tolist())) == k
        x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(layer))
        shared = swiglu(x, model.shared_gate_up, model.shared_down)
        routed = model._moe(x, layer) - shared
        scores = (x @ model.router).sigmoid().topk(k, dim=-1).values
        w = (scores / scores.sum(-1, keepdim=True)).flatten()
        want = torch.zeros_like(x)
        for row in torch.nonzero(ok).flatten().tolist():
            t, e = int(token_index[row]), row // cap
            y = swiglu(x[t], model.experts_gate_up[e], model.experts_down[e])
            want[t] += w[int(pair_index[row])] * y
        torch.testing.assert_close(routed, want, rtol=1e-4, atol=1e-4)


def test_single_rank_forward_has_no_collectives(tmp_path):
    doc = {
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(doc))
    cfg = load_model_config(str(tmp_path))
    model = TPVerifyModel(cfg, tp=1, rank=0, batch=2, draft_tokens=3, context_tokens=16)
    rec = ListRecorder()
    out = model.forward(rec)
    assert out.shape == (6, 1024) and out.dtype == torch.bfloat16  # vocab padded to a multiple of 64
    assert torch.isfinite(out).all()
    assert [r[0] for r in rec.regions] == ["compute:embed"] + ["compute:attn", "compute:mlp"] * 3 + ["compute:lm_head"]


def test_kimi_k2_tp8_per_rank_shapes():
    # Checkpoint shapes ([out, in], moonshotai/Kimi-K2-Instruct safetensors): q_a_proj [1536, 7168],
    # q_b_proj [12288, 1536], kv_a_proj_with_mqa [576, 7168], kv_b_proj [16384, 512], o_proj [7168, 8192],
    # layer-0 gate/up [18432, 7168], experts.*.gate/up [2048, 7168], embed/lm_head [163840, 7168],
    # mlp.gate [384, 7168]. Column-parallel layers split "out" by 8, row-parallel ones split "in";
    # the model stores [in, out]. On the meta device nothing is allocated.
    m = TPVerifyModel(load_model_config("kimi-k2"), tp=8, rank=5, batch=32, draft_tokens=4, device="meta")
    assert m.q_a.shape == (7168, 1536)  # replicated
    assert m.q_b.shape == (1536, 12288 // 8)
    assert m.kv_a.shape == (7168, 576)  # replicated
    assert m.kv_b.shape == (512, 16384 // 8)
    assert m.o_proj.shape == (8192 // 8, 7168)
    assert m.dense_gate_up.shape == (7168, 2 * 18432 // 8) and m.dense_down.shape == (18432 // 8, 7168)
    assert m.router.shape == (7168, 384)
    assert m.experts_gate_up.shape == (384, 7168, 2 * 2048 // 8)  # T × top-k = 1024 reaches all 384
    assert m.experts_down.shape == (384, 2048 // 8, 7168)
    assert m.shared_gate_up.shape == (7168, 2 * 2048 // 8)
    assert m.embed.shape == (163840 // 8, 7168) and m.lm_head.shape == (7168, 163840 // 8)
    assert (m.allreduce_bytes, m.allgather_bytes) == (128 * 7168 * 2, 128 * 20480 * 2)
    assert 1 << 30 < m.weight_bytes() < 6 << 30  # "a few GB per rank"
    small = TPVerifyModel(load_model_config("kimi-k2"), tp=8, rank=0, batch=1, draft_tokens=4, device="meta")
    assert small.experts_gate_up.shape[0] == 4 * 8  # 4 tokens × top-8
