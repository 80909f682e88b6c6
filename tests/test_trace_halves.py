"""Reading one trace file in two halves at once (fastverify.trace.load) gives exactly what
reading it whole gives, or declines and the file is read whole.

The whole-file read is the reference: every test compares ``load_trace(path, halves=True)`` with
``load_trace(path)`` field for field. The cut is placed by hand at every place the cut search can
land (every ``}`` ``,`` ``{``), including inside strings, inside nested arrays and in other
top-level arrays, and the test also checks whether the halves were used or declined, so a cut
that the verification should refuse cannot pass as a silent whole-file read, and the other way
round.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import time
from pathlib import Path

import pytest
from conftest import DATA, SHARED, alive, assert_same_ranks, children

from fastverify.trace import load as L

CUTS = re.compile(rb"\}[ \t\r\n]*,[ \t\r\n]*\{")


@pytest.fixture
def spy(monkeypatch):
    """Halves for any size, and a record of what each read_in_halves call answered."""
    answers: list = []
    real = L.read_in_halves

    def recording(*a, **k):
        got = real(*a, **k)
        answers.append(got is not None)
        return got

    monkeypatch.setattr(L, "read_in_halves", recording)
    monkeypatch.setattr(L, "halves_pay", lambda raw: True)
    return answers


def _at(monkeypatch, raw: bytes, m: re.Match) -> None:
    monkeypatch.setattr(L, "cut_points", lambda text, share=None: (m.start() + 1, m.end() - 1))


def _write(tmp_path: Path, doc, name: str = "t.json", indent=None) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(doc, indent=indent))
    return p


def _kernel(i: int, **extra) -> dict:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)" if i % 3 == 0 else "gemm",
        "pid": 0,
        "tid": 7,
        "ts": 100.0 + 10 * i + 0.125,
        "dur": 5.5,
        "args": {
            "stream": 7,
            "correlation": 1000 + i,
            "External id": i,
            **(
                {"In msg nelems": 4096 * (i + 1), "dtype": "BFloat16", "Collective name": "allreduce"}
                if i % 3 == 0
                else {}
            ),
        },
        **extra,
    }


def _events(n: int) -> list[dict]:
    out = [{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#7", "pid": 0, "tid": 1, "ts": 0, "dur": 10_000}]
    for i in range(n):
        out.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": 0,
                "tid": 1,
                "ts": 50.0 + 10 * i,
                "dur": 2,
                "args": {"correlation": 1000 + i},
            }
        )
        out.append(
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "record_param_comms",
                "pid": 0,
                "tid": 1,
                "ts": 49.0 + 10 * i,
                "dur": 3,
                "args": {
                    "External id": i,
                    "Collective name": "allreduce",
                    "Input Dims": [[i + 1, 8]],
                    "Input type": ["float"],
                },
            }
        )
        out.append(_kernel(i))
        out.append({"ph": "f", "cat": "ac2g", "name": "launch", "id": i, "pid": 0, "tid": 7, "ts": 100.0 + 10 * i})
    return out


def _every_cut(path: Path, monkeypatch, spy) -> list[bool]:
    """load_trace with halves at every cut the search could choose; each must equal the whole read."""
    whole = L.load_trace(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    used = []
    for m in CUTS.finditer(raw):
        _at(monkeypatch, raw, m)
        spy.clear()
        assert_same_ranks(L.load_trace(path, halves=True), whole)
        assert len(spy) == 1
        used.append(spy[0])
    return used


def test_every_cut_of_a_plain_trace_reads_the_same(tmp_path, monkeypatch, spy):
    """Kineto's layout (indented, one event per line): every cut between two events is used,
    and the cuts inside an event's args (``Input Dims`` lists are arrays of arrays, not
    objects) do not arise; the step, all-reduce sizes (from the kernel's own args) and launch
    times come out as whole."""
    path = _write(
        tmp_path,
        {
            "schemaVersion": 1,
            "distributedInfo": {"rank": 0, "world_size": 2},
            "traceEvents": _events(6),
            "traceName": "x",
        },
        indent=1,
    )
    used = _every_cut(path, monkeypatch, spy)
    n_events = 1 + 6 * 4
    assert used == [True] * (n_events - 1)
    (r,) = L.load_trace(path, halves=True)
    assert r.meta["world_size"] == 2 and r.steps[0].name == "ProfilerStep#7"
    assert sorted(b for b in r.msg_bytes.tolist() if b > 0) == [4096 * 1 * 2, 4096 * 4 * 2]


def _text(before: str, events: list[dict], after: str) -> tuple[str, set[int]]:
    """A trace's text written here, and where each event but the last ends (the offset of its
    closing ``}``): the only places a cut may be used."""
    text = "{" + before + '"traceEvents": ['
    ends = set()
    for i, e in enumerate(events):
        text += ("" if i == 0 else ", ") + json.dumps(e)
        if i < len(events) - 1:
            ends.add(len(text) - 1)
    return text + "]" + after + "}", ends


def test_cuts_inside_strings_nested_arrays_and_other_keys_are_declined(tmp_path, monkeypatch, spy):
    """Cut candidates planted where a cut must not be used: a name holding ``"},{"``, an args
    list of objects, ``deviceProperties`` (a top-level array of objects) before and after
    ``traceEvents``. Exactly the cuts between two events are used; every other is declined, and
    every read equals the whole read."""
    events = _events(4)
    events[3]["name"] = 'gemm"},{"ph":"X"'  # text that looks like an event boundary, in a string
    events[3]["args"] = {"blocks": [{"x": 1}, {"x": 2}], "stream": 7}
    devices = '"deviceProperties": [{"id": 0, "name": "H200"}, {"id": 1, "name": "H200"}]'
    for before, after in ((devices + ", ", ""), ("", ", " + devices)):
        text, ends = _text(before, events, after)
        path = tmp_path / "t.json"
        path.write_text(text)
        raw = text.encode()
        whole = L.load_trace(path)
        assert whole[0].meta["gpu_name"] == "H200"
        cuts = list(CUTS.finditer(raw))
        # the events', the one in the name (json.dumps writes it as \"},{\"), the args list's, the devices'
        assert len(cuts) == len(ends) + 3
        for m in cuts:
            _at(monkeypatch, raw, m)
            spy.clear()
            assert_same_ranks(L.load_trace(path, halves=True), whole)
            assert spy == [m.start() in ends], raw[m.start() - 30 : m.end() + 30]


def test_a_second_trace_events_key_or_a_bare_array_is_read_whole(tmp_path, monkeypatch, spy):
    """Two ``traceEvents`` keys (the parser keeps the last): a cut in the first array is declined
    (the second part's own array is replaced by the later key), a cut in the second is used, and
    every read equals the whole read (the second array's events). A bare event array (no
    ``traceEvents`` key at all) is never cut."""
    text = '{"traceEvents": %s, "traceEvents": %s}' % (json.dumps(_events(3)), json.dumps(_events(5)))
    path = tmp_path / "dup.json"
    path.write_text(text)
    second = text.rindex('"traceEvents"')
    assert _every_cut(path, monkeypatch, spy) == [m.start() > second for m in CUTS.finditer(text.encode())]
    assert len(L.load_trace(path)[0]) == 5
    bare = _write(tmp_path, _events(3), "bare.json")
    assert set(_every_cut(bare, monkeypatch, spy)) == {False}


def test_a_top_level_key_on_both_sides_of_the_cut_is_read_whole(tmp_path, monkeypatch, spy):
    """``distributedInfo`` before ``traceEvents`` and again, as null, after it: the parser keeps
    the last (null, so no rank or world size from it); a cut between them is declined, since the
    halves cannot say which came last."""
    text, _ = _text('"distributedInfo": {"rank": 1, "world_size": 2}, ', _events(4), ', "distributedInfo": null')
    path = tmp_path / "t.json"
    path.write_text(text)
    (whole,) = L.load_trace(path)
    assert whole.meta["world_size"] is None and whole.rank == 0
    assert set(_every_cut(path, monkeypatch, spy)) == {False}
    # the same key once, after the events: the halves are used
    text, _ = _text("", _events(4), ', "distributedInfo": {"rank": 1, "world_size": 2}')
    path.write_text(text)
    assert all(_every_cut(path, monkeypatch, spy))
    assert L.load_trace(path, halves=True)[0].rank == 1


def test_merged_sglang_file_with_labels_on_one_side_of_the_cut(tmp_path, monkeypatch, spy):
    """A SGLang merged file (pids "[TPnn] ..."): whichever side of the cut holds the labelled GPU
    events, both ranks come out as whole; a plain file whose launches (not kernels) carry labels
    is read as the whole reader reads it (no labels), or the halves decline."""
    events = []
    for rank in (0, 1):
        for e in _events(3):
            e = dict(e, pid=f"[TP0{rank}] 1234")
            events.append(e)
    path = _write(tmp_path, {"traceEvents": events}, indent=1)
    assert all(_every_cut(path, monkeypatch, spy))
    assert [r.rank for r in L.load_trace(path)] == [0, 1]
    # only the runtime calls labelled: the whole reader files the kernels under one rank
    odd = [dict(e, pid="[TP01] 9") if e["cat"] == "cuda_runtime" else e for e in _events(4)]
    path2 = _write(tmp_path, {"traceEvents": odd}, "odd.json", indent=1)
    _every_cut(path2, monkeypatch, spy)


def test_a_half_without_kernels_labels_launches_only_as_the_whole_file_does(tmp_path, monkeypatch, spy):
    """A plain file (kernels without pid labels) whose launches carry "[TP01]" pids, launches
    first: a half holding launches and no kernel would label them by pid, which the whole reader
    does not (its kernels decide); such a cut is declined, and the kernels keep their launch
    times, which put them in the step (they start after it ends, their launches inside it)."""
    n = 6
    events = [{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#1", "pid": 0, "tid": 1, "ts": 0, "dur": 1000}]
    events += [
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": "[TP01] 9",
            "tid": 1,
            "ts": 50.0 + i,
            "dur": 1,
            "args": {"correlation": 1000 + i},
        }
        for i in range(n)
    ]
    events += [dict(_kernel(i), ts=2000.0 + 10 * i) for i in range(n)]
    text, ends = _text("", events, "")
    path = tmp_path / "t.json"
    path.write_text(text)
    raw = text.encode()
    (whole,) = L.load_trace(path)
    assert whole.step.tolist() == [0] * n
    first_launch, first_kernel = text.index('"cat": "cuda_runtime"'), text.index('"cat": "kernel"')
    for m in CUTS.finditer(raw):
        _at(monkeypatch, raw, m)
        spy.clear()
        assert_same_ranks(L.load_trace(path, halves=True), [whole])
        assert spy == [not first_launch < m.start() < first_kernel], raw[m.start() - 30 : m.end() + 30]


def _real_files() -> list[Path]:
    found = sorted(DATA.rglob("*.json.gz"))
    if (SHARED / "traces").is_dir():
        found += sorted((SHARED / "traces").rglob("*.json.gz"))
    return found


@pytest.mark.parametrize("path", _real_files(), ids=lambda p: p.name)
def test_real_traces_read_the_same_in_halves(path, monkeypatch, spy):
    """Every committed and shared real trace, cut where the reader cuts it (55 % of the text to
    the worker): the same rank tables as the whole read, and the halves were used."""
    whole = L.load_trace(path)
    got = L.load_trace(path, halves=True)
    assert_same_ranks(got, whole)
    assert spy == [True]


def test_the_shared_traces_are_there():
    if not (SHARED / "traces").is_dir():
        pytest.skip("../shared not found beside the repo; the shared traces are needed")
    assert len([p for p in _real_files() if "shared" in p.parts]) >= 4


def test_the_cut_is_past_the_first_share_and_between_objects():
    raw = b'{"traceEvents": [' + b", ".join(b'{"a": %d}' % i for i in range(100)) + b"]}"
    end, start = L.cut_points(raw, share=0.5)
    assert len(raw) // 2 <= end - 1 < start and raw[end - 1 : end] == b"}" and raw[start : start + 1] == b"{"
    assert raw[end:start] == b", "
    assert L.cut_points(b'{"traceEvents": [{"a": 1}]}') is None


def test_the_worker_is_reaped_and_a_dead_worker_means_a_whole_read(tmp_path, monkeypatch, spy):
    """No process of the read outlives it; a worker that dies before answering (killed, out of
    memory) makes the halves decline, and the file is read whole."""

    def new_children():  # other tests may have left helpers of their own running
        return [c for c in children(os.getpid()) if alive(c) and c not in before]

    path = _write(tmp_path, {"traceEvents": _events(8)}, indent=1)
    whole = L.load_trace(path)
    before = set(children(os.getpid()))
    assert_same_ranks(L.load_trace(path, halves=True), whole)
    assert spy == [True]
    deadline = time.monotonic() + 5  # it answered and is exiting; a thread reaps it
    while new_children() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not new_children()
    spy.clear()
    monkeypatch.setattr(L, "quiet_child_signals", lambda: os._exit(9))  # the worker dies at its start
    assert_same_ranks(L.load_trace(path, halves=True), whole)
    assert spy == [False]
    assert not new_children()


def test_halves_need_the_size_two_cores_and_fork(monkeypatch):
    monkeypatch.setattr(L, "usable_cores", lambda: 2)
    assert L.halves_pay(b" " * L.SPLIT_MIN_BYTES)
    assert not L.halves_pay(b" " * (L.SPLIT_MIN_BYTES - 1))
    monkeypatch.setattr(L, "usable_cores", lambda: 1)
    assert not L.halves_pay(b" " * L.SPLIT_MIN_BYTES)


def test_the_loader_reads_one_big_file_in_halves_unless_jobs_1_or_told_not_to(monkeypatch, tmp_path):
    """load_traces of one file: halves by default, none with --jobs 1 (one process) or halves=False."""
    seen = []

    class Read(Exception):
        """Raised by the stand-in reader once it has seen how it was asked to read."""

    def read_trace(path, halves=False):
        seen.append(halves)
        raise Read

    monkeypatch.setattr(L, "read_trace", read_trace)
    path = _write(tmp_path, {"traceEvents": _events(1)})
    for workers, halves in ((None, True), (1, True), (None, False)):
        with pytest.raises(Read):
            L.load_traces([path], workers=workers, halves=halves)
    assert seen == [True, False, False]


def test_the_command_line_leaves_the_second_core_to_the_painter(monkeypatch, tmp_path):
    """`profile --trace` reads in halves without a PNG, and on one core when the painter draws one."""
    from fastverify import cli
    from fastverify.procs import usable_cores

    if usable_cores() < 2:
        pytest.skip("the painter runs only with two or more cores")
    seen = []
    real = L.load_traces

    def spy_load(*a, **k):
        seen.append(k.get("halves"))
        return real(*a, **k)

    monkeypatch.setattr(L, "load_traces", spy_load)
    path = _write(tmp_path, {"traceEvents": _events(4)})
    assert cli.main(["profile", "--trace", str(path), "--output", str(tmp_path / "a.json"), "--no-png", "--quiet"]) == 0
    assert cli.main(["profile", "--trace", str(path), "--output", str(tmp_path / "b.json"), "--quiet"]) == 0
    assert seen == [True, False]
    assert (tmp_path / "b.png").stat().st_size > 0
