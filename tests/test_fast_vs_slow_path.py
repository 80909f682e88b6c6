"""The columnar fast path of the trace loader against its dict-based slow path, event for event.

``load_trace`` reads a well-formed trace through one typed msgspec decode (names and the used
``args`` keys decoded in that pass, :mod:`fastverify.trace.columns`); a trace the typed decode
rejects goes through plain JSON objects (``read_trace_json`` + ``_slow_ranks``), written
separately. Both must give the same rank tables. Here the slow path is forced on the same file
(the typed decoder is made to reject it) and every field of every rank is compared: the real
traces under ``../shared/traces``, the committed test traces, and generated documents.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import msgspec
import pytest
from conftest import assert_same_ranks
from hypothesis import given, settings, strategies as st
from test_loader_fuzz import SETTINGS, good_lists

from fastverify.errors import UserError
from fastverify.trace import load as L
from fastverify.trace.build import int_column

DATA = Path(__file__).resolve().parent / "data"


class _Rejecting:
    """Stands in for the typed decoder: rejects every document, as it rejects a malformed one."""

    def decode(self, raw):
        raise msgspec.ValidationError("forced slow path")


def _both(path: Path, monkeypatch) -> tuple[list, list]:
    fast = L.load_trace(path)
    with monkeypatch.context() as m:
        m.setattr(L, "TRACE_DECODER", _Rejecting())
        slow = L.load_trace(path)
    return fast, slow


# Timestamps past 2**43 µs (102 days of uptime) that a float64 cannot hold to the ns: the slow
# path parses them as floats and is 1 ns off by design, the fast path keeps the text (exact; its
# own test in test_trace_scenarios.py checks the values against the decimal text).
FLOAT_LIMITED = {"ns_fractions_uptime_102d.trace.json.gz"}


def _files() -> list[Path]:
    found = sorted(DATA.rglob("*.json.gz")) + sorted(DATA.rglob("*.json"))
    found = [p for p in found if p.name not in FLOAT_LIMITED]
    shared = Path(__file__).resolve().parents[2] / "shared" / "traces"
    if shared.is_dir():
        found += sorted(shared.rglob("*.json.gz"))
    return found


@pytest.mark.parametrize("path", _files(), ids=lambda p: p.name)
def test_real_traces_read_the_same_on_both_paths(path, monkeypatch):
    fast, slow = _both(path, monkeypatch)
    assert sum(len(r) for r in fast) > 0
    assert_same_ranks(fast, slow)


def test_the_real_traces_are_there():
    shared = Path(__file__).resolve().parents[2] / "shared" / "traces"
    if not shared.is_dir():
        pytest.skip("../shared not found beside the repo; the shared traces are needed")
    assert len([p for p in _files() if shared in p.parents]) >= 4


def _kernel(name: str, ts: float, ext: int, corr: int, **args) -> dict:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": 7,
        "ts": ts,
        "dur": 5.5,
        "args": {"stream": 7, "correlation": corr, "External id": ext, **args},
    }


def test_collective_args_and_launch_times_match(tmp_path, monkeypatch):
    """The keys the fast path decodes up front (message size from the kernel's own args, else its
    launching op's ``Input Dims``; the collective name; the launch's correlation) give the numbers
    the slow path reads from whole ``args`` dicts: 8,192 x 2 bytes, 3 x 4 x 4 bytes."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#1", "pid": 0, "tid": 1, "ts": 0, "dur": 1000},
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "record_param_comms",
            "pid": 0,
            "tid": 1,
            "ts": 10,
            "dur": 50,
            "args": {
                "External id": 2,
                "Collective name": "allreduce",
                "Input Dims": [[3, 4]],
                "Input type": ["float"],
                "Concrete Inputs": ["", ""],
            },
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": 0,
            "tid": 1,
            "ts": 20.25,
            "dur": 3,
            "args": {"correlation": 11},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": 0,
            "tid": 1,
            "ts": 30.5,
            "dur": 3,
            "args": {"correlation": 12},
        },
        _kernel(
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)",
            100.125,
            1,
            11,
            **{"In msg nelems": 8192, "dtype": "BFloat16", "Collective name": "allreduce"},
        ),
        _kernel("ncclDevKernel_Generic(x)", 200.0, 2, 12),
        _kernel("gemm", 300.0, 3, 13),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    fast, slow = _both(path, monkeypatch)
    assert_same_ranks(fast, slow)
    (r,) = fast
    assert sorted(r.msg_bytes.tolist()) == [-1, 3 * 4 * 4, 8192 * 2]
    assert r.start_ns.tolist() == [100_125, 200_000, 300_000]


@settings(max_examples=400, **SETTINGS)
@given(good_lists, st.booleans())
def test_generated_traces_read_the_same_on_both_paths(tmp_path_factory, events, gz):
    data = json.dumps({"traceEvents": events}).encode()
    path = tmp_path_factory.mktemp("fs") / ("t.json.gz" if gz else "t.json")
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    mp = pytest.MonkeyPatch()
    try:
        try:
            fast = L.load_trace(path)
        except UserError as e:
            fast = ("error", str(e))
        mp.setattr(L, "TRACE_DECODER", _Rejecting())
        try:
            slow = L.load_trace(path)
        except UserError as e:
            slow = ("error", str(e))
    finally:
        mp.undo()
    if isinstance(fast, tuple) or isinstance(slow, tuple):
        assert fast == slow
    else:
        assert_same_ranks(fast, slow)


@given(
    st.lists(
        st.integers(min_value=-(2**64), max_value=2**64)
        | st.none()
        | st.booleans()
        | st.floats(allow_nan=False)
        | st.text(max_size=2),
        max_size=20,
    )
)
@settings(max_examples=300, deadline=None, derandomize=True)
def test_int_column_is_the_per_value_rule(values):
    """The stream column's vectorised path equals its per-value rule: an int within ±2**62
    stays, anything else (bool, None, float, text, a wider int) is -1."""
    want = [v if type(v) is int and abs(v) < 2**62 else -1 for v in values]
    assert int_column(values).tolist() == want
    assert int_column([v for v in values if type(v) is int]).tolist() == [
        w for v, w in zip(values, want) if type(v) is int
    ]


@given(
    st.text(max_size=12)
    | st.sampled_from(
        [
            "ProfilerStep#3",
            "profilerstep#3",
            "NCCL:all_reduce",
            "x nccl:y",
            "step[DECODE bs=1]",
            "Step[x",
            "execute_context_1",
            "record_param_comms",
            "c10d::allreduce_",
            "sgl_kernel::shm_allreduce",
            "gemm",
        ]
    )
)
@settings(max_examples=300, deadline=None, derandomize=True)
def test_host_keep_is_exactly_the_comm_and_step_rules(name):
    """The one search that keeps host ops is the comm-op test or a step pattern, nothing else."""
    want = L.looks_comm_op(name) or any(r.match(name) for r in L.STEP_RES)
    assert bool(L.HOST_KEEP.search(name)) == want


@pytest.mark.parametrize("corr", [[], {"x": 1}, "7", 7.5])
def test_a_graph_launch_with_a_non_int_correlation_reads_on_both_paths(tmp_path, monkeypatch, corr):
    """A ``cudaGraphLaunch`` whose ``correlation`` is not an int (a list, an object, text) carries no
    id: both paths read the trace, and the all-reduce kernel (correlation 5) is not taken as
    replayed inside that graph."""
    events = [
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaGraphLaunch",
            "pid": 1,
            "tid": 1,
            "ts": 1,
            "dur": 2,
            "args": {"correlation": corr},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
            "pid": 0,
            "tid": 7,
            "ts": 3,
            "dur": 5,
            "args": {"correlation": 5, "stream": 7},
        },
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    fast, slow = _both(path, monkeypatch)
    assert_same_ranks(fast, slow)
    assert len(fast) == 1
