"""Verify records carry the accepted draft tokens of each request (``accepted``).

SGLang 0.5.23 computes the accept lengths after the target's verify forward, in
``eagle_sample`` (bonus token included); the patch wraps that name where the verifying workers
bind it and hands its second result to the timer, which writes ``accepted = accept_lens - 1``
into the step's record. Each test drives the real timer and wrappers with stand-ins for SGLang
and for a CUDA copy, and works its expected values out from the accept lengths it passes.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from fastverify.errors import UserError
from fastverify.patch import install as I
from fastverify.patch.install import make_accept_wrapper, make_verify_wrapper
from fastverify.patch.targets import MOD_EAGLE_COMMON, MOD_NGRAM_WORKER
from fastverify.patch.verify import VerifyTimer, WallEvent
from fastverify.verifylog import build_report, format_report


def _timer(path: Path, **kw) -> VerifyTimer:
    t = VerifyTimer(path, interval_s=0, event_factory=WallEvent, clock="cpu_wall_clock", rank=lambda: "0", **kw)
    t.expect_accepted = True  # as the patch sets it once the sampler is wrapped
    return t


def _rows(path: Path) -> list[dict]:
    f = path / "verify-rank0.jsonl"
    return [json.loads(ln) for ln in f.read_text().splitlines()] if f.exists() else []


def _target(self, batch, forward_batch=None, pp_proxy_tensors=None, is_verify=False):
    """``TpModelWorker.forward_batch_generation``'s signature (SGLang 0.5.23)."""
    return "logits"


def _sampler(accept_lens):
    """``eagle_sample(verify_input, batch, logits_output, ...)`` -> (predict, accept_lens, accept_index)."""

    def eagle_sample(verify_input, batch, logits_output, grammar_mask=None):
        return "predict", accept_lens, "index"

    return eagle_sample


class _Batch:
    """NGRAM's ``ScheduleBatch``: ``batch_size()`` requests, ``input_ids`` rows (host shape only)."""

    def __init__(self, reqs: int, draft: int) -> None:
        self.reqs = [object()] * reqs
        self.input_ids = torch.zeros(reqs * draft, dtype=torch.int64)

    def batch_size(self) -> int:
        return len(self.reqs)


def test_cpu_accept_lens_become_accepted_draft_tokens(tmp_path):
    """NGRAM's order: the target's verify forward, then eagle_sample on its logits. accept_lens
    [3, 1, 4] (bonus included) -> accepted [2, 0, 3]; one value per request of the batch of 3."""
    t = _timer(tmp_path)
    target = make_verify_wrapper(_target, t)
    lens = [torch.tensor([3, 1, 4], dtype=torch.int32), torch.tensor([1, 1, 2], dtype=torch.int32)]
    for acc in lens:
        b = _Batch(3, 4)
        assert target(object(), b, is_verify=True) == "logits"
        out = make_accept_wrapper(_sampler(acc), t)("vi", b, "logits")
        assert out == ("predict", acc, "index")  # the result is SGLang's, unchanged
    t.drain()
    rows = _rows(tmp_path)
    assert [r["accepted"] for r in rows] == [[2, 0, 3], [0, 0, 1]]
    assert [(r["batch"], r["tokens"]) for r in rows] == [(3, 12), (3, 12)]
    rep = build_report(tmp_path)  # the reader takes them; accept length = mean(accepted) + 1 = 6/6 + 1
    assert rep.before.accept_records == 2 and rep.before.accept_length_mean == pytest.approx(2.0)
    assert "accept length: 2.000 tokens per request per verify" in format_report(rep)


def test_a_record_waits_for_its_accept_lens(tmp_path):
    """On the CPU the step's events are complete at once, but its line waits for accept()."""
    t = _timer(tmp_path)
    t.stop(t.start(), batch=2, tokens=8)
    assert len(t.pending) == 1 and not t._lines
    t.accept([4, 2])
    t.drain()
    assert [r["accepted"] for r in _rows(tmp_path)] == [[3, 1]]


class _Gpu:
    """A GPU event still running until ``done``; a synchronize would be a host sync."""

    def __init__(self) -> None:
        self.done = False

    def record(self):
        pass

    def query(self):
        return self.done

    def synchronize(self):
        raise AssertionError("the verify path synchronized")


class _CudaLens:
    """A CUDA tensor's host side: reading its values would sync the GPU."""

    def __init__(self, n: int) -> None:
        self.shape = (n,)

    def tolist(self):
        raise AssertionError("read a CUDA tensor's values on the verify path")


def test_cuda_copy_is_read_only_once_its_event_completed(tmp_path):
    """The CUDA path: a non_blocking copy into pinned memory and an event after it (the stand-in
    below); the record is written only when that event's query() is True, never by a sync."""
    ready = _Gpu()
    copies = []

    def copy(lens):
        copies.append(lens)
        return [5, 1, 1, 2], ready  # the pinned buffer's values once the copy is done

    t = _timer(tmp_path, copy=copy)
    t.stop(t.start(), batch=4, tokens=24)
    t.accept(_CudaLens(4))
    assert len(copies) == 1 and len(t.pending) == 1  # copy started, not read
    t.drain()
    assert _rows(tmp_path) == []
    ready.done = True
    t.drain()
    assert [r["accepted"] for r in _rows(tmp_path)] == [[4, 0, 0, 1]]


def test_a_worker_that_samples_elsewhere_loses_nothing(tmp_path):
    """No accept() after a step (a worker whose accept lengths come another way): the next step
    writes the first without accepted and stops waiting; every step is written."""
    t = _timer(tmp_path)
    for _ in range(3):
        t.stop(t.start(), batch=1, tokens=4)
    t.drain()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and not any("accepted" in r for r in rows)
    assert t.expect_accepted is False


def test_exit_writes_the_last_step_without_waiting(tmp_path):
    t = _timer(tmp_path)
    t.stop(t.start(), batch=1, tokens=4)
    assert t.drain() == 0  # still waiting for accept()
    assert t.drain(wait=True) == 1 and "accepted" not in _rows(tmp_path)[0]


def test_sampler_without_a_timed_step_is_ignored(tmp_path):
    """eagle_sample with no verify step waiting (e.g. a step the timer skipped) records nothing."""
    t = _timer(tmp_path)
    make_accept_wrapper(_sampler([2, 2]), t)("vi", None, "logits")
    t.drain(wait=True)
    assert _rows(tmp_path) == []


def test_install_wraps_the_sampler_in_both_worker_modules(tmp_path):
    tw = types.ModuleType(I.MOD_TP_WORKER)
    tw.TpModelWorker = type("TpModelWorker", (), {"forward_batch_generation": _target})
    eagle, ngram = types.ModuleType(MOD_EAGLE_COMMON), types.ModuleType(MOD_NGRAM_WORKER)
    original = _sampler([3])
    eagle.eagle_sample = ngram.eagle_sample = original  # both bind SGLang's one function by name
    mods = {I.MOD_TP_WORKER: tw, MOD_EAGLE_COMMON: eagle, MOD_NGRAM_WORKER: ngram}
    t = VerifyTimer(tmp_path, interval_s=0, event_factory=WallEvent, clock="cpu_wall_clock", rank=lambda: "0")
    try:
        rep = I.install(mods, environ={"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "off"}, timer=t)
        assert "verify_timer" in rep.applied and t.expect_accepted
        assert eagle.eagle_sample is not original and ngram.eagle_sample is not original
        tw.TpModelWorker().forward_batch_generation(_Batch(1, 4), is_verify=True)
        ngram.eagle_sample("vi", None, "logits")
        t.drain()
        assert _rows(tmp_path)[0]["accepted"] == [2]
    finally:
        I.uninstall()
    assert eagle.eagle_sample is original and ngram.eagle_sample is original


def _write(tmp_path: Path, **fields) -> Path:
    rec = {"step": 0, "verify_ms": 1.0, "clock": "cpu_wall_clock", "rank": "0", "pid": 1, "batch": 2, "tokens": 8}
    rec.update(fields)
    (tmp_path / "verify-rank0.jsonl").write_text(json.dumps(rec) + "\n")
    return tmp_path


@pytest.mark.parametrize(
    "fields, said",
    [
        ({"accepted": [1]}, "accepted has 1 values, not one per request (batch 2)"),
        # 8 rows / 2 requests = 4 draft tokens a request: at most 3 accepted
        ({"accepted": [1, 4]}, "accepted 4 is not a count of accepted draft tokens (outside [0, 3] for 4 tokens"),
        ({"accepted": [-1, 0]}, "accepted -1 is not a count"),
        (
            {"accepted": "2"},
            'field "accepted": expected an array or null, got a string (e.g. "accepted": [3, 0, 2, 1])',
        ),
    ],
)
def test_reader_refuses_accepted_the_timer_never_writes(tmp_path, fields, said):
    d = _write(tmp_path, **fields)
    with pytest.raises(UserError) as err:
        build_report(d)
    assert said in str(err.value)


def test_old_records_without_accepted_still_load(tmp_path):
    rep = build_report(_write(tmp_path))
    assert rep.before.accept_records == 0 and rep.before.accept_length_mean is None
