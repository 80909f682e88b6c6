"""Workloads for the tuner: from a model's shapes and from a real ``fastverify profile`` JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_fastverify

from fastverify.errors import UserError
from fastverify.live.config import load_model_config
from fastverify.tune.workload import UNKNOWN_SIZE_MESSAGE, Workload, workload_from_model, workload_from_profile


def test_kimi_k2_tp8_four_draft_tokens_batch_one():
    config = load_model_config("kimi-k2")
    w = workload_from_model(config, tp=8, draft_tokens=4, batch=1)
    # Derived here from the preset: one embedding all-reduce, then attention + MLP per layer,
    # each of T x hidden bf16 elements.
    expected_count = 1 + 2 * config.num_layers
    expected_bytes = 1 * 4 * config.hidden_size * 2
    assert expected_count == 123 and expected_bytes == 57_344  # the plan's numbers for this preset
    assert w.msg_sizes == ((expected_bytes, expected_count),)
    assert w.allreduce_count == 123
    assert (w.tp, w.tokens, w.hidden, w.dtype) == (8, 4, config.hidden_size, "bfloat16")
    assert w.compute_us is None and w.verify_us is None and w.clock is None
    # The logits all-gather is kept apart: per-rank input T x (padded vocab / tp) x 2 bytes.
    assert w.allgather_bytes == 4 * (config.vocab_padded // 8) * 2


def test_batch_scales_the_message_not_the_count():
    config = load_model_config("kimi-k2")
    w = workload_from_model(config, tp=8, draft_tokens=4, batch=32)
    assert w.msg_sizes == ((32 * 4 * config.hidden_size * 2, 123),)


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"tp": 1, "draft_tokens": 4, "batch": 1}, "--tp 1"),
        ({"tp": 0, "draft_tokens": 4, "batch": 1}, "--tp"),
        ({"tp": 8, "draft_tokens": 0, "batch": 1}, "--draft-tokens"),
        ({"tp": 8, "draft_tokens": 4, "batch": True}, "--batch"),
        ({"tp": 3, "draft_tokens": 4, "batch": 1}, "--tp 3 does not divide"),
    ],
)
def test_bad_model_arguments_are_user_errors(kw, needle):
    with pytest.raises(UserError, match=needle.replace("-", r"\-")):
        workload_from_model(load_model_config("kimi-k2"), **kw)


@pytest.fixture(scope="module")
def eager_profile(tmp_path_factory, shared_dir) -> Path:
    """A real profile JSON written by `fastverify profile` from the TraceLens eager trace."""
    out = tmp_path_factory.mktemp("profile") / "eager.json"
    trace = shared_dir / "traces" / "TraceLens" / "eager_trace.json.gz"
    proc = run_fastverify(["profile", "--trace", str(trace), "--output", str(out)], cwd=out.parent)
    assert proc.returncode == 0, proc.stderr
    return out


def test_workload_from_a_real_profile(eager_profile):
    w = workload_from_profile(eager_profile)
    doc = json.loads(eager_profile.read_text())
    assert w.msg_sizes == ((5_114_880, 37), (5_455_872, 36))
    assert w.allreduce_count == 73
    assert w.tp == doc["world_size"] == 8
    sm = doc["ranks"][0]["step_median"]
    assert w.compute_us == pytest.approx(sm["compute_us"])
    assert w.verify_us == pytest.approx(sm["window_us"])
    assert w.allreduce_us == pytest.approx(sm["allreduce_us"])
    assert w.clock == "trace" and w.measured_on_gpu
    assert str(eager_profile) in w.source


def _write(tmp_path: Path, doc) -> Path:
    p = tmp_path / "p.json"
    p.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return p


def _minimal(**over) -> dict:
    doc = {
        "schema": "fastverify.profile",
        "schema_version": 1,
        "world_size": 2,
        "source": {"kind": "live", "tp": 2, "tokens": 8, "model": "tiny"},
        "timing": {"clock": "cuda_events"},
        "ranks": [
            {
                "rank": r,
                "step_median": {
                    "steps": 4,
                    "allreduce_count": 5,
                    "compute_us": 100.0,
                    "window_us": 300.0,
                    "allreduce_us": 150.0,
                },
            }
            for r in (0, 1)
        ],
        "allreduce_by_msg_size": [{"msg_bytes": 8 * 64 * 2, "count": 40}],
    }
    doc.update(over)
    return doc


def test_version_1_live_profile_loads_without_hidden_or_dtype(tmp_path):
    """A version-1 file still loads: per-step counts as before, tokens from its source, but no
    hidden size (version 1 did not record one; 1024 B / 8 tokens is not re-derived into 64)."""
    w = workload_from_profile(_write(tmp_path, _minimal()))
    # 40 all-reduces over 2 ranks x 4 steps = 5 per step.
    assert w.msg_sizes == ((1024, 5),)
    assert (w.tokens, w.hidden, w.tp) == (8, None, 2)
    assert w.dtype == "bfloat16" and any("dtype assumed" in n and "version 1" in n for n in w.notes)
    assert any("re-run `fastverify profile`" in n for n in w.notes)
    assert w.verify_us == 300.0 and w.compute_us == 100.0


def test_unknown_size_names_the_file_and_the_way_out(tmp_path):
    p = _write(tmp_path, _minimal(allreduce_by_msg_size=[{"msg_bytes": None, "count": 40}]))
    with pytest.raises(UserError) as err:
        workload_from_profile(p)
    assert str(p) in str(err.value) and UNKNOWN_SIZE_MESSAGE in str(err.value)


@pytest.mark.parametrize(
    "content",
    [
        "not json {",
        json.dumps([1, 2]),
        json.dumps({"schema": "something.else"}),
        json.dumps({**_minimal(), "schema_version": 99}),
        json.dumps({**_minimal(), "ranks": []}),
        json.dumps({**_minimal(), "ranks": [{"rank": 0}]}),
        json.dumps({k: v for k, v in _minimal().items() if k != "allreduce_by_msg_size"}),
        json.dumps({**_minimal(), "allreduce_by_msg_size": [{"msg_bytes": "big", "count": 1}]}),
        # past fastverify/bounds.py: a message over 1 TiB, a negative time, no rank
        json.dumps({**_minimal(), "allreduce_by_msg_size": [{"msg_bytes": 10**15, "count": 40}]}),
        json.dumps({**_minimal(), "world_size": 0}),
        json.dumps({**_minimal(), "world_size": 1}),
    ],
)
def test_bad_profiles_are_one_line_user_errors(tmp_path, content):
    p = _write(tmp_path, content)
    with pytest.raises(UserError) as err:
        workload_from_profile(p)
    assert str(p) in str(err.value) and "\n" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="cannot read profile"):
        workload_from_profile(tmp_path / "nope.json")


def test_profile_without_allreduces(tmp_path):
    doc = _minimal()
    for r in doc["ranks"]:
        r["step_median"]["allreduce_count"] = 0
    with pytest.raises(UserError, match="no all-reduce"):
        workload_from_profile(_write(tmp_path, doc))


def test_cpu_wall_clock_is_flagged(tmp_path):
    w = workload_from_profile(_write(tmp_path, _minimal(timing={"clock": "cpu_wall_clock"})))
    assert not w.measured_on_gpu
    assert any("not GPU timings" in n for n in w.notes)


def test_workload_is_frozen_and_sorted():
    w = Workload(msg_sizes=((200, 1), (100, 2)), tp=2)
    assert w.msg_sizes == ((100, 2), (200, 1))
    with pytest.raises(AttributeError):
        w.tp = 4  # type: ignore[misc]
    with pytest.raises(ValueError):
        Workload(msg_sizes=((100, 0),), tp=2)
