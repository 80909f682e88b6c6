"""The typed profile record (fastverify.profile.record): what `profile` writes is what `tune` reads.

Expected shapes are worked out here from the tiny preset's JSON file, never from the code under
test; the profiles are written by the real encoder (``build_profile`` + ``write_outputs``, or the
``fastverify profile`` command).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from conftest import assert_user_error, run_fastverify

from fastverify.errors import UserError
from fastverify.events import EventClass, RankEvents, Step
from fastverify.profile.build import build_profile, write_outputs
from fastverify.profile.record import SCHEMA_VERSION, LiveSource, Profile, Shapes, decode_profile, encode_profile
from fastverify.tune.workload import workload_from_profile

TINY = json.loads((Path(__file__).resolve().parents[1] / "fastverify/live/presets/tiny.json").read_text())
HIDDEN, LAYERS = TINY["hidden_size"], TINY["num_hidden_layers"]


def _ranks(msg_bytes: int, steps: int = 3, per_step: int = 5) -> list[RankEvents]:
    """Two ranks, ``steps`` steps of ``per_step`` all-reduces of ``msg_bytes`` each between compute."""
    out = []
    for rank in (0, 1):
        rows, marks, t = [], [], 1_000
        for s in range(steps):
            start = t
            for _ in range(per_step):
                rows.append(("gemm", EventClass.COMPUTE, t, 700, -1))
                rows.append(("ncclAllReduce", EventClass.ALLREDUCE, t + 700, 300 + 50 * rank, msg_bytes))
                t += 1_100
            marks.append(Step(f"verify#{s}", start, t))
            t += 500
        out.append(
            RankEvents.from_rows(
                rank, f"synthetic{rank}", rows, steps=marks, meta={"world_size": 2, "timing": "cuda_events"}
            )
        )
    return out


def _live_source(**over) -> dict:
    src = {
        "kind": "live",
        "model": "m",
        "tp": 2,
        "draft_tokens": 4,
        "batch": 2,
        "tokens": 8,
        "iters": 3,
        "warmup": 1,
        "device": "cuda",
        "dist_backend": "nccl",
        "backend": "nccl",
        "dtype": "float16",
        "hidden": 128,
    }
    src.update(over)
    return src


def _write(tmp_path: Path, profile: Profile, name: str = "p.json") -> Path:
    path = tmp_path / name
    write_outputs(profile, path, None)
    return path


def test_round_trip_through_the_one_encoder(tmp_path):
    shapes = Shapes(dtype="float16", hidden=128, tokens=8, draft_tokens=4, batch=2)
    prof = build_profile(_ranks(8 * 128 * 2), _live_source(), shapes)
    path = _write(tmp_path, prof)
    raw = path.read_bytes()
    back = decode_profile(raw, source=str(path))
    assert back == prof and encode_profile(back) == raw
    assert isinstance(back.source, LiveSource) and back.source.backend == "nccl"
    doc = json.loads(raw)
    # The trace loader recognises a profile (and skips it among traces) by its opening key.
    assert next(iter(doc)) == "schema" and doc["schema_version"] == SCHEMA_VERSION == 2
    assert doc["shapes"] == {"dtype": "float16", "hidden": 128, "tokens": 8, "draft_tokens": 4, "batch": 2}
    assert doc["ranks"][0]["top_kernels"][0]["class"] in ("compute", "allreduce")  # JSON key kept
    # A live GPU run nests the profile of its CUDA-graph replay traces in the same schema.
    nested = msgspec.structs.replace(
        prof, graph_replay=build_profile(_ranks(0), {"kind": "trace", "files": ["x"]}, shapes)
    )
    again = decode_profile(encode_profile(nested))
    assert again.graph_replay == nested.graph_replay and again.graph_replay.shapes == shapes


def test_tune_reads_hidden_and_dtype_recorded_not_derived(tmp_path):
    """fp16, hidden 128, 8 tokens: 2048 B per all-reduce. The old reader divided the bytes by
    tokens x 2 and could only ever answer bf16; a recorded fp32 profile of the same bytes has hidden
    64, which only the record can say."""
    for dtype, hidden in (("float16", 128), ("float32", 64)):
        shapes = Shapes(dtype=dtype, hidden=hidden, tokens=8, draft_tokens=4, batch=2)
        prof = build_profile(_ranks(2048), _live_source(dtype=dtype, hidden=hidden), shapes)
        w = workload_from_profile(_write(tmp_path, prof, f"{dtype}.json"))
        assert (w.dtype, w.hidden, w.tokens, w.tp) == (dtype, hidden, 8, 2)
        assert w.msg_sizes == ((2048, 5),)
        assert not any("assumed" in n for n in w.notes)


def test_trace_profile_records_no_shapes(tmp_path):
    prof = build_profile(_ranks(4096), {"kind": "trace", "files": ["a", "b"]})
    assert prof.shapes == Shapes()
    w = workload_from_profile(_write(tmp_path, prof))
    assert w.hidden is None and w.tokens is None and w.dtype == "bfloat16"
    assert any("dtype assumed" in n for n in w.notes)


def test_shapes_that_contradict_the_message_sizes_are_refused(tmp_path):
    shapes = Shapes(dtype="bfloat16", hidden=256, tokens=8, draft_tokens=4, batch=2)  # 4096 B, not 2048
    path = _write(tmp_path, build_profile(_ranks(2048), _live_source(dtype="bfloat16", hidden=256), shapes))
    with pytest.raises(UserError) as err:
        workload_from_profile(path)
    assert str(path) in str(err.value) and "4096 B" in str(err.value) and "\n" not in str(err.value)


def _good_doc(tmp_path) -> dict:
    shapes = Shapes(dtype="bfloat16", hidden=128, tokens=8, draft_tokens=4, batch=2)
    return json.loads(encode_profile(build_profile(_ranks(2048), _live_source(dtype="bfloat16"), shapes)))


@pytest.mark.parametrize(
    "mutate, words",
    [
        (
            lambda d: d["shapes"].update(hidden="big"),
            [
                'not a usable fastverify profile: field "shapes.hidden": expected an integer or null, got a string '
                '(e.g. "hidden": 7168)'
            ],
        ),
        (lambda d: d["shapes"].update(dtype="int8"), ["shapes.dtype"]),
        (lambda d: d.pop("summary"), ["summary"]),
        (lambda d: d["source"].update(kind="somewhere"), ["somewhere"]),
        (lambda d: d.update(schema_version=99), ["schema_version 99", "reads 1 or 2"]),
        (lambda d: d.update(schema="fastverify.other"), ["'schema' is not 'fastverify.profile'"]),
        # past fastverify/bounds.py: the field, its value and the bound are named
        (
            lambda d: d["allreduce_by_msg_size"][0].update(msg_bytes=10**15),
            ["allreduce_by_msg_size[0].msg_bytes = 1000000000000000", "1 TiB"],
        ),
        (lambda d: d["ranks"][0]["step_median"].update(window_us=-1.0), ["ranks[0].step_median.window_us = -1.0"]),
        (lambda d: d["source"].update(tp=0), ["source.tp = 0"]),
    ],
)
def test_bad_version_2_profiles_are_one_line_user_errors(tmp_path, mutate, words):
    doc = _good_doc(tmp_path)
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError) as err:
        workload_from_profile(path)
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg
    for w in words:
        assert w in msg


def test_truncated_profile_is_one_line_at_the_cli(tmp_path):
    raw = encode_profile(build_profile(_ranks(2048), {"kind": "trace", "files": ["a", "b"]}))
    (tmp_path / "cut.json").write_bytes(raw[: len(raw) // 2])
    proc = run_fastverify(["tune", "--profile", "cut.json", "--predict"], cwd=tmp_path)
    assert_user_error(proc, "cut.json", "not valid JSON")


def test_decode_profile_refuses_version_1():
    with pytest.raises(UserError, match="schema_version 1; this reads 2"):
        decode_profile(b'{"schema": "fastverify.profile", "schema_version": 1}', source="old.json")


def test_live_fp32_profile_gives_tune_the_real_hidden_and_dtype(tmp_path):
    """End to end on 2 gloo ranks: `profile --model tiny --dtype float32 --backend gloo`, then the
    workload. Bytes per all-reduce are T x hidden x 4; the old reader (bytes / (T x 2)) would have
    said hidden 2 x 256 and bf16."""
    proc = run_fastverify(
        [
            "profile",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--backend",
            "gloo",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--output",
            "p.json",
            "--no-png",
            "--quiet",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "p.json").read_text())
    tokens = 1 * 4  # the CLI's default batch x draft tokens
    assert doc["shapes"] == {"dtype": "float32", "hidden": HIDDEN, "tokens": tokens, "draft_tokens": 4, "batch": 1}
    assert doc["source"]["backend"] == "gloo" and doc["source"]["dtype"] == "float32"
    w = workload_from_profile(tmp_path / "p.json")
    assert (w.dtype, w.hidden, w.tokens) == ("float32", HIDDEN, tokens)
    assert w.msg_sizes == ((tokens * HIDDEN * 4, 1 + 2 * LAYERS),)
    msgspec.json.decode((tmp_path / "p.json").read_bytes(), type=Profile)  # strict decode of the real file
