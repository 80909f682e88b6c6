"""Plausibility bounds (issue 12, item 4): values no real trace or sweep can hold are refused with
one line naming the value, instead of a traceback or an absurd number printed as if measured.

Bounds (fastverify/bounds.py): a message <= 1 TiB, a time in [0, 1 hour], counts <= 1e9.
"""

from __future__ import annotations

import gzip
import io
import json

import pytest
from conftest import assert_user_error, run_fastverify
from rich.console import Console

from fastverify.bounds import MAX_EVENT_US, MAX_MSG_BYTES, implausible_count, implausible_time_us
from fastverify.errors import UserError
from fastverify.trace.load import load_trace
from fastverify.tune.ranking import print_report, rank_candidates
from fastverify.tune.sweep import Journal, fingerprint, read_journal
from fastverify.tune.trial import SizeResult, TrialResult, TrialSpec

AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _write(path, events, **top):
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events, **top}).encode()))
    return path


def _kernel(name, ts, dur, **args):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": 7,
        "ts": ts,
        "dur": dur,
        "args": {"stream": 7, **args},
    }


def _op_and_kernel(dims, dtype="c10::BFloat16"):
    """A record_param_comms op and the all-reduce kernel it launched (External id 5)."""
    return [
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "record_param_comms",
            "pid": 0,
            "tid": 1,
            "ts": 0,
            "dur": 20,
            "args": {"External id": 5, "Collective name": "allreduce", "Input Dims": [dims], "Input type": [dtype]},
        },
        _kernel(AR, 1, 10, **{"External id": 5}),
        _kernel("gemm", 20, 5),
    ]


# --- the bounds themselves ---------------------------------------------------------------------


def test_bound_values():
    assert MAX_MSG_BYTES == 2**40 and MAX_EVENT_US == 3.6e9
    assert implausible_time_us(0) is None and implausible_time_us(3.6e9) is None
    for bad in (-1000, -0.001, 3.6e9 + 1, 1.7e308, float("inf"), float("nan"), True, "12"):
        assert implausible_time_us(bad), bad
    assert implausible_count(10**9) is None and implausible_count(10**9 + 1)
    assert implausible_count(-1) and implausible_count(1.5) and implausible_count(False)


# --- trace: message sizes and durations --------------------------------------------------------


def test_inf_in_input_dims_is_one_line_naming_it(tmp_path):
    """Before: OverflowError (int(float('inf'))) out of trace/load.py _msg_bytes."""
    path = tmp_path / "t.json"
    text = json.dumps({"traceEvents": _op_and_kernel([1, 7168])}).replace("[1, 7168]", "[Infinity, 7168]")
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load_trace(path)
    line = str(err.value)
    assert "\n" not in line and "t.json" in line and "inf" in line and "Input Dims" in line


def test_inf_in_input_dims_through_the_cli(tmp_path):
    text = json.dumps({"traceEvents": _op_and_kernel([1, 7168])}).replace("[1, 7168]", "[Infinity, 7168]")
    (tmp_path / "t.json").write_text(text)
    proc = run_fastverify(["profile", "--trace", "t.json", "--output", "p.json", "--no-png", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, "t.json", "inf")
    assert not (tmp_path / "p.json").exists()


def test_petabyte_message_is_refused_naming_the_value(tmp_path):
    """1e15 bytes (5e14 bf16 elements): before, loaded as a 1e15-byte all-reduce (tune printed
    4.9e11 µs per step from it)."""
    path = _write(tmp_path / "t.json.gz", _op_and_kernel([500_000_000_000_000, 1]))
    with pytest.raises(UserError) as err:
        load_trace(path)
    assert "1e+15 bytes" in str(err.value) and "1 TiB" in str(err.value) and "t.json.gz" in str(err.value)


def test_in_msg_nelems_past_a_tebibyte_is_refused(tmp_path):
    path = _write(
        tmp_path / "t.json.gz",
        [_kernel(AR, 0, 10, **{"In msg nelems": 2**40, "dtype": "Float"}), _kernel("gemm", 20, 5)],
    )
    with pytest.raises(UserError, match=r"In msg nelems' = 1099511627776 \(Float\) is 4\.4e\+12 bytes"):
        load_trace(path)


def test_a_tebibyte_exactly_is_still_a_size(tmp_path):
    """The bound itself is allowed: 2**39 bf16 elements = 2**40 bytes."""
    (r,) = load_trace(_write(tmp_path / "t.json.gz", _op_and_kernel([2**39])))
    assert sorted(r.msg_bytes.tolist()) == [-1, 2**40]


def test_kernel_longer_than_an_hour_is_refused(tmp_path):
    """Before: counted (with a 'last over 10 s' warning) into every sum of the profile."""
    path = _write(tmp_path / "t.json.gz", [_kernel("gemm", 0, 5), _kernel(AR, 10, 4e9)])
    with pytest.raises(UserError) as err:
        load_trace(path)
    assert "4e+09 µs" in str(err.value) and "1 hour" in str(err.value) and "ncclDevKernel_AllReduce" in str(err.value)


def test_an_hour_exactly_still_loads(tmp_path):
    (r,) = load_trace(_write(tmp_path / "t.json.gz", [_kernel("gemm", 0, 3.6e9)]))
    assert r.dur_ns.tolist() == [3_600_000_000_000]


# --- tune journal and report -------------------------------------------------------------------


def _spec(**kw) -> TrialSpec:
    base = dict(
        backend="gloo",
        env={"NCCL_PROTO": "LL"},
        world_size=2,
        device="cpu",
        dtype="bfloat16",
        hidden=64,
        sizes=((64, 2),),
        warmup=1,
        iters=3,
    )
    base.update(kw)
    return TrialSpec(**base)


def _result(spec, step_us, median=10.0, msg_bytes=128, count=2):
    return TrialResult(
        spec.trial_id,
        "ok",
        "",
        (SizeResult(64, msg_bytes, count, median, median, 0.0),),
        step_us,
        "cpu_wall_clock",
        1.0,
        2.0,
    )


@pytest.mark.parametrize(
    "field, kw, shown",
    [
        ("step_us", {"step_us": -1000.0}, "-1000.0"),
        ("step_us", {"step_us": 1.7e308}, "1.7e+308"),
        ("median_us", {"step_us": 20.0, "median": -5.0}, "-5.0"),
        ("msg_bytes", {"step_us": 20.0, "msg_bytes": 10**15}, "1000000000000000"),
        ("count_per_step", {"step_us": 20.0, "count": 10**12}, "1000000000000"),
    ],
)
def test_journal_record_out_of_bounds_is_corrupt_naming_the_value(tmp_path, field, kw, shown):
    """Before: read back as is; `tune --resume` then died with a TypeError in tune/ranking.py
    (step_us -1000) or ranked 1.7e308 µs as a measured time."""
    spec = _spec()
    path = tmp_path / "j.jsonl"
    with Journal.open(path, fingerprint=fingerprint([spec]), resume=False) as j:
        j.append(spec, _result(spec, **kw))
    with pytest.raises(UserError) as err:
        read_journal(path)
    line = str(err.value)
    assert "\n" not in line and "line 2 is corrupt" in line and field in line and shown in line


def test_report_prints_a_zero_time_candidate_without_a_speedup():
    """step_us 0 is inside the bounds; its speedup is undefined (None). Before: print_report
    formatted None with :.2f (TypeError)."""
    base, fast = _spec(baseline=True), _spec(env={"NCCL_PROTO": "Simple"})
    ranking = rank_candidates([base, fast], [_result(base, 20.0), _result(fast, 0.0, median=0.0)])
    assert ranking.candidates[0].speedup is None and ranking.candidates[0].vs_baseline_us == -20.0
    out = io.StringIO()
    print_report(ranking, Console(file=out, width=200))
    assert "-100.0 %" in out.getvalue()
