"""Verify records carry their load, and ``profile --verify-log`` says when before and after ran
different loads.

* the patch's verify wrapper writes ``batch`` (requests) and ``tokens`` (rows verified = batch ×
  draft tokens per request) read off the batch object SGLang 0.5.23 hands
  ``TpModelWorker.forward_batch_generation`` (a ``ForwardBatch`` for EAGLE, the ``ScheduleBatch``
  for NGRAM), from ints and tensor shapes only, and null where it cannot read them;
* the reader takes old records without them, and refuses values past fastverify.bounds;
* the report warns when the two folders' batch/tokens differ, gives the change as
  ``change_pct`` = (after − before) / before × 100 (negative = less time) and says so once;
* a hand-written record of the wrong type is one line naming the field, the type and an example.

Expected numbers are worked out by hand in each test from the records it writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from conftest import run_fastverify

from fastverify.errors import UserError
from fastverify.patch.install import make_verify_wrapper
from fastverify.patch.verify import VerifyTimer, WallEvent


class _Shape:
    """A CUDA tensor's host side: ``shape`` is metadata; reading a value would sync the GPU, so
    every value read is noted (the patch swallows errors, so raising would hide it)."""

    reads: list[str] = []

    def __init__(self, *shape: int) -> None:
        self.shape = tuple(shape)

    def _sync(self, *_):
        _Shape.reads.append("a value read")
        raise RuntimeError("the verify path read a tensor's values (a GPU sync)")

    item = tolist = cpu = __int__ = __index__ = __len__ = __iter__ = _sync


def _original(
    self,
    batch,
    forward_batch=None,
    pp_proxy_tensors=None,
    is_verify=False,
    skip_attn_backend_init=None,
    *,
    capture_hidden_mode=None,
    return_kv_loc_plan=False,
):
    """SGLang 0.5.23's ``TpModelWorker.forward_batch_generation`` signature; the forward pads the
    batch afterwards (as CUDA-graph replay does), which the record must not see."""
    fb = forward_batch if forward_batch is not None else batch
    if isinstance(fb, SimpleNamespace):
        fb.batch_size = 16
    return "result"


def _records(tmp_path: Path, calls) -> list[dict]:
    timer = VerifyTimer(tmp_path, interval_s=0, event_factory=WallEvent, clock="cpu_wall_clock", rank=lambda: "0")
    wrapped = make_verify_wrapper(_original, timer)
    for args, kwargs in calls:
        assert wrapped(object(), *args, **kwargs) == "result"
    timer.drain()
    return [json.loads(ln) for ln in (tmp_path / "verify-rank0.jsonl").read_text().splitlines()]


def _forward_batch(bs: int, draft: int, *, input_ids=True):
    """A ``ForwardBatch`` of a target verify: ``batch_size`` an int, the flat draft tokens as
    ``input_ids`` (bs × draft rows), ``seq_lens`` one per request, ``spec_info.draft_token_num``."""
    fb = SimpleNamespace(batch_size=bs, seq_lens=_Shape(bs), spec_info=SimpleNamespace(draft_token_num=draft))
    if input_ids:
        fb.input_ids = _Shape(bs * draft)
    return fb


class _ScheduleBatch:
    """NGRAM's verify passes the ``ScheduleBatch`` itself: ``batch_size()`` is ``len(reqs)``."""

    def __init__(self, reqs: int, draft: int) -> None:
        self.reqs = [object()] * reqs
        self.input_ids = _Shape(reqs * draft)

    def batch_size(self) -> int:
        return len(self.reqs)


class _Broken:
    @property
    def batch_size(self):
        raise RuntimeError("a field SGLang renamed")


def test_the_wrapper_writes_batch_and_tokens_without_reading_a_tensor(tmp_path):
    _Shape.reads.clear()
    rows = _records(
        tmp_path,
        [
            ((), {"batch": None, "forward_batch": _forward_batch(3, 4), "is_verify": True}),  # EAGLE: 3 x 4 = 12
            ((_ScheduleBatch(2, 4),), {"is_verify": True}),  # NGRAM: 2 requests x 4 = 8
            ((None, _forward_batch(5, 2, input_ids=False), None, True), {}),  # no input_ids: 5 x 2 = 10
            ((), {"batch": None, "forward_batch": _Broken(), "is_verify": True}),  # unreadable: null, forward ran
            ((None, "fb"), {"is_verify": True}),  # not a batch at all: null
            ((None, _forward_batch(7, 4)), {}),  # not a verify forward: no record
        ],
    )
    assert [(r["step"], r["batch"], r["tokens"]) for r in rows] == [
        (0, 3, 12),
        (1, 2, 8),
        (2, 5, 10),
        (3, None, None),
        (4, None, None),
    ]
    assert all(r["clock"] == "cpu_wall_clock" and r["rank"] == "0" for r in rows)
    assert _Shape.reads == []


def test_new_and_old_records_load(tmp_path):
    from fastverify.verify_records import read_log_dir

    _records(tmp_path, [((), {"batch": None, "forward_batch": _forward_batch(3, 4), "is_verify": True})])
    with (tmp_path / "verify-rank0.jsonl").open("a") as f:  # a record of a fastverify before the load fields
        f.write(json.dumps({"step": 1, "verify_ms": 1.0, "clock": "cpu_wall_clock", "rank": "0", "pid": 1}) + "\n")
    recs = read_log_dir(tmp_path)["records"]["0"]
    assert [(r.batch, r.tokens) for r in recs] == [(3, 12), (None, None)]


def test_every_record_field_has_an_example():
    from fastverify.verify_records import RECORD_EXAMPLES, VerifyRecord

    assert set(RECORD_EXAMPLES) == {f.name for f in msgspec.structs.fields(VerifyRecord)}
    for name, text in RECORD_EXAMPLES.items():
        msgspec.json.decode(text)  # each example is JSON


# --- the report -------------------------------------------------------------------------------------


def _log(folder: Path, rank: str, rows: list[tuple[float, int | None, int | None]]) -> Path:
    """``verify-rank<rank>.jsonl`` with one record per (verify_ms, batch, tokens); a None load
    leaves the fields out, as a record of an older fastverify."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (ms, batch, tokens) in enumerate(rows):
        rec = {"step": i, "verify_ms": ms, "clock": "cpu_wall_clock", "rank": rank, "pid": 100 + int(rank)}
        if batch is not None:
            rec.update(batch=batch, tokens=tokens)
        lines.append(json.dumps(rec))
    (folder / f"verify-rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _both_ranks(folder: Path, rows) -> Path:
    for rank in ("0", "1"):
        _log(folder, rank, rows)
    return folder


# Before: batches 1, 2, 3, 4 of 4 draft tokens each (tokens 4, 8, 12, 16) on both ranks, so pooled
# 8 records, median batch (2 + 3) / 2 = 2.5, median tokens (8 + 12) / 2 = 10; the batches are
# consecutive (said 1-4), the tokens are not (listed). After: batch 8 (32 tokens) in every record.
BEFORE = [(2.0, b, 4 * b) for b in (1, 2, 3, 4)]
AFTER_OTHER_LOAD = [(1.5, 8, 32)] * 4


def test_different_loads_are_warned_and_each_side_summarised(tmp_path):
    from fastverify.verifylog import build_report, encode_report, format_report

    rep = build_report(_both_ranks(tmp_path / "b", BEFORE), _both_ranks(tmp_path / "a", AFTER_OTHER_LOAD))
    want = (
        "the load differs: before ran batch 1-4 (median 2.5), 4, 8, 12, 16 tokens (median 10; 4 tokens/request), "
        "after batch 8 (median 8), 32 tokens (median 32; 4 tokens/request): the change compares different loads"
    )
    assert rep.warnings == [want]
    doc = json.loads(encode_report(rep))
    b, a = doc["before"], doc["after"]
    assert (b["load_records"], b["batch_values"], b["batch_median"]) == (8, [1, 2, 3, 4], 2.5)
    assert (b["tokens_values"], b["tokens_median"], b["tokens_per_request"]) == ([4, 8, 12, 16], 10.0, [4.0])
    assert (a["load_records"], a["batch_values"], a["batch_median"], a["tokens_values"]) == (8, [8], 8.0, [32])
    text = format_report(rep).splitlines()
    assert (
        "load: batch 1-4 (median 2.5), 4, 8, 12, 16 tokens (median 10; 4 tokens/request), from 8 of 8 records"
    ) in text
    assert "load: batch 8 (median 8), 32 tokens (median 32; 4 tokens/request), from 8 of 8 records" in text
    assert f"! {want}" in text


def test_the_same_load_is_not_warned(tmp_path):
    from fastverify.verifylog import build_report

    faster = [(ms / 2, b, t) for ms, b, t in BEFORE]  # the same batches, in another order of time
    rep = build_report(_both_ranks(tmp_path / "b", BEFORE), _both_ranks(tmp_path / "a", faster[::-1]))
    assert rep.warnings == []


@pytest.mark.parametrize("old_side, where", [("after", "the after folder"), ("both", "either folder")])
def test_a_side_without_the_load_is_warned(tmp_path, old_side, where):
    from fastverify.verifylog import build_report, format_report

    old = [(ms, None, None) for ms, _, _ in BEFORE]
    rep = build_report(
        _both_ranks(tmp_path / "b", old if old_side == "both" else BEFORE), _both_ranks(tmp_path / "a", old)
    )
    assert rep.warnings == [
        f"the load is not recorded in {where} (records without batch and tokens: an older "
        "fastverify, a hand-written record, or a batch the patch could not read): the change "
        "may compare different loads"
    ]
    assert rep.after.load_records == 0 and rep.after.batch_values == [] and rep.after.batch_median is None
    assert "load: not recorded (records without batch and tokens)" in format_report(rep).splitlines()


def test_change_pct_is_negative_when_after_is_faster_in_json_and_text(tmp_path):
    """Every before record 2.0 ms, every after 1.5 ms: p50 and p90 both go 2.0 -> 1.5, a change of
    -0.5 ms, (1.5 - 2.0) / 2.0 x 100 = -25 %."""
    out = tmp_path / "out" / "vl.json"
    _both_ranks(tmp_path / "b", BEFORE)
    _both_ranks(tmp_path / "a", [(1.5, b, t) for _, b, t in BEFORE])
    proc = run_fastverify(["profile", "--verify-log", "b", "a", "--output", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == 2 and doc["warnings"] == []
    assert [c["rank"] for c in doc["change"]] == ["0", "1", "all"]
    for c in doc["change"]:
        got = (c["p50_change_ms"], c["change_pct"], c["p90_change_ms"], c["p90_change_pct"])
        assert got == (-0.5, -25.0, -0.5, -25.0)
        assert "p50_change_pct" not in c
    lines = proc.stdout.splitlines()
    notes = [ln for ln in lines if ln.startswith("# change:")]
    assert notes == [
        "# change: after vs before, ms = after - before, % = (after - before) / before x 100; - = less time (faster)"
    ]
    row = next(ln for ln in lines if ln.split()[:1] == ["all"] and "->" in ln)
    assert row.split() == ["all", "2.000", "->", "1.500", "-25.0", "2.000", "->", "1.500", "-25.0"]


# --- records the patch cannot write ------------------------------------------------------------------


def _one(tmp_path: Path, **fields) -> Path:
    rec = {"step": 0, "verify_ms": 1.5, "clock": "cpu_wall_clock", "rank": "0", "pid": 1, **fields}
    d = tmp_path / "log"
    d.mkdir(exist_ok=True)
    (d / "verify-rank0.jsonl").write_text(json.dumps(rec) + "\n")
    return d


@pytest.mark.parametrize(
    "fields, said",
    [
        ({"rank": 0}, 'field "rank": expected a string, got an integer (e.g. "rank": "0")'),
        ({"batch": "4", "tokens": 16}, 'field "batch": expected an integer or null, got a string (e.g. "batch": 4)'),
        ({"tokens": 1.5}, 'field "tokens": expected an integer or null, got a number (e.g. "tokens": 16)'),
        ({"pid": None}, 'field "pid": expected an integer, got null (e.g. "pid": 4242)'),
        (
            {"load": 4},
            'field "load": unknown (the fields are step, verify_ms, clock, rank, pid, allreduce_paths, '
            "batch, tokens, accepted)",
        ),
        # past fastverify.bounds: MAX_BATCH = 4096 requests, MAX_VERIFY_TOKENS = 4096 x 64 = 262144 rows
        (
            {"batch": 4097, "tokens": 4097},
            "batch 4097 is not a count of requests in one verify forward (outside [0, 4096])",
        ),
        (
            {"batch": 4, "tokens": 262145},
            "tokens 262145 is not a count of rows one verify forward verifies (outside [0, 262144])",
        ),
        ({"batch": -1, "tokens": 4}, "batch -1 is not a count of requests in one verify forward (outside [0, 4096])"),
    ],
)
def test_a_hand_written_record_is_one_line_naming_the_field(tmp_path, fields, said):
    from fastverify.verifylog import build_report

    d = _one(tmp_path, **fields)
    with pytest.raises(UserError) as err:
        build_report(d)
    assert str(err.value) == f"{d / 'verify-rank0.jsonl'}:1: {said}"


def test_the_rank_error_at_the_command_line(tmp_path):
    _one(tmp_path, rank=0)
    proc = run_fastverify(["profile", "--verify-log", "log", "--quiet"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        'fastverify: error: log/verify-rank0.jsonl:1: field "rank": expected a string, '
        'got an integer (e.g. "rank": "0")\n'
    )


def test_records_the_timer_cannot_write_are_refused(tmp_path):
    """A clock the timer never writes, fewer tokens than requests, and a step twice in one file (two
    runs in one folder) are each one line naming the file and line."""
    import json as _json

    from fastverify.errors import UserError
    from fastverify.verifylog import build_report

    def folder(name, recs):
        d = tmp_path / name
        d.mkdir()
        (d / "verify-rank0.jsonl").write_text("".join(_json.dumps(r) + "\n" for r in recs))
        return d

    base = {"step": 0, "verify_ms": 1.0, "clock": "cuda_events", "rank": "0", "pid": 1, "allreduce_paths": None}
    cases = [
        ("clock", [dict(base, clock="wall")], "clock 'wall' is not one the verify timer writes"),
        ("load", [dict(base, batch=8, tokens=4)], "tokens 4 < batch 8"),
        ("twice", [base, dict(base, verify_ms=2.0)], "step 0 again (also line 1)"),
    ]
    for name, recs, words in cases:
        with pytest.raises(UserError) as err:
            build_report(folder(name, recs))
        assert words in str(err.value) and "verify-rank0.jsonl:" in str(err.value), str(err.value)
