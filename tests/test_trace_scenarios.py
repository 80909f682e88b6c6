"""The hand-made traces in tests/data (written by tests/data/make_data.py; the expected numbers
are worked out there, next to each event list)."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from conftest import DATA, length, read_raw_trace

from fastverify.errors import UserError
from fastverify.events import EventClass
from fastverify.trace.load import load_trace, load_traces

GRAPH = DATA / "cuda_graph_replay" / "graph_replay-TP-0.trace.json.gz"
MERGED_DISTINCT = DATA / "merged_sglang" / "merged-distinct-ids.trace.json.gz"
MERGED_SHARED = DATA / "merged_sglang" / "merged-shared-ids.trace.json.gz"
BIGINT = DATA / "bigint" / "comms_id_over_64_bits.trace.json.gz"
NS = DATA / "ns_timestamps" / "ns_fractions.trace.json.gz"
NS_102D = DATA / "ns_timestamps" / "ns_fractions_uptime_102d.trace.json.gz"


def run_profile(paths, out_dir) -> dict:
    from fastverify.cli import main

    out = out_dir / "profile.json"
    assert main(["profile", "--trace", *map(str, paths), "--output", str(out), "--no-png", "--quiet"]) == 0
    return json.loads(out.read_text())


# --- CUDA-graph replay ------------------------------------------------------------------------


def test_graph_replay_steps_are_graph_launches(tmp_path):
    prof = run_profile([GRAPH], tmp_path)
    (r,) = prof["ranks"]
    assert r["meta"]["step_source"] == "graph_launch"
    assert [s["name"] for s in r["steps"]] == ["graph_launch#0", "graph_launch#1", "graph_launch#2"]
    for step, d in zip(r["steps"], (12.5, 13.0, 14.25)):
        assert step["events"] == 3
        assert step["allreduce_count"] == 1
        assert step["allreduce_us"] == d
        assert step["compute_us"] == 13.0
        assert step["window_us"] == 14.0 + d
        assert step["idle_us"] == 1.0
        assert step["exposed_comm_us"] == d
    assert r["outside_steps_events"] == 0
    assert r["events"] == 9  # the python_function event is skipped
    assert (r["allreduce_us"], r["compute_us"], r["window_us"], r["idle_us"]) == (39.75, 39.0, 228.25, 149.5)
    assert r["step_median"]["allreduce_us"] == 13.0


def test_graph_replay_allreduce_found_by_name_size_unknown(tmp_path):
    prof = run_profile([GRAPH], tmp_path)
    assert prof["summary"]["allreduce_count"] == 3
    assert prof["allreduce_by_msg_size"] == [
        {
            "msg_bytes": None,
            "count": 3,
            "median_us": 13.0,
            "p90_us": pytest.approx(14.0),
            "min_us": 12.5,
            "max_us": 14.25,
            "sum_us": 39.75,
        }
    ]
    pos = prof["allreduce_by_position"]
    assert [(p["position"], p["count"], p["median_us"], p["msg_bytes"]) for p in pos] == [(0, 3, 13.0, None)]
    assert prof["ranks"][0]["unknown_comm_kernels"] == []


# --- SGLang merged file -----------------------------------------------------------------------


def test_merged_file_splits_into_ranks(tmp_path):
    prof = run_profile([MERGED_DISTINCT], tmp_path)
    assert [r["rank"] for r in prof["ranks"]] == [0, 1]
    for r in prof["ranks"]:
        assert r["meta"]["rank_source"] == "pid label (merged file)"
        assert r["allreduce_count"] == 3
        assert r["counts"]["compute"] == 6
        assert len(r["steps"]) == 3 and r["outside_steps_events"] == 0
    assert prof["ranks"][0]["allreduce_kernel_sum_us"] == 20.0
    assert prof["ranks"][1]["allreduce_kernel_sum_us"] == 14.0
    assert prof["allreduce_by_msg_size"][0]["msg_bytes"] == 8192
    assert prof["allreduce_by_msg_size"][0]["count"] == 6
    cr = prof["cross_rank"]
    assert cr["matched"] == 3
    assert [c["transfer_us"] for c in cr["collectives"]] == [3.0, 4.0, 2.0]
    assert (cr["per_rank"]["0"]["wait_us"], cr["per_rank"]["1"]["wait_us"]) == (11.0, 5.0)
    assert cr["straggler_rank"] == 1


def test_merged_file_ranks_keep_their_own_steps_and_launch_times():
    """In a merged file the two processes reuse correlation and External ids and have their own
    step annotations; each rank's steps and launch times must come from its own events."""
    ranks = {r.rank: r for r in load_trace(MERGED_SHARED)}
    assert sorted(ranks) == [0, 1]
    for rank, shift in ((0, 0), (1, 80)):
        r = ranks[rank]
        assert [(s.start_ns, s.end_ns) for s in r.steps] == [
            ((100 + 200 * k + shift) * 1000, (200 + 200 * k + shift) * 1000) for k in range(3)
        ], rank
        # every kernel of step k was launched inside that rank's step k
        assert sorted(r.step.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2], rank
        ar = r.cls == EventClass.ALLREDUCE.code
        assert r.msg_bytes[ar].tolist() == [8192, 8192, 8192], rank


# --- integers wider than 64 bits --------------------------------------------------------------


def test_bigint_args_load(tmp_path):
    (r,) = load_trace(BIGINT)
    assert r.rank == 3
    ar = r.cls == EventClass.ALLREDUCE.code
    assert r.dur_ns[ar].tolist() == [30_000]
    assert r.msg_bytes[ar].tolist() == [1024 * 4]  # record_param_comms: 1024 Float
    prof = run_profile([BIGINT], tmp_path)
    assert (prof["ranks"][0]["allreduce_us"], prof["ranks"][0]["compute_us"]) == (30.0, 20.0)


# --- ns-fractional timestamps -----------------------------------------------------------------


@pytest.mark.parametrize("path", [NS, NS_102D], ids=["ts~4.9e12us", "ts~9.5e12us_uptime_over_102_days"])
def test_ns_fraction_timestamps_are_exact(path):
    raw = read_raw_trace(path)
    kernels = sorted((e for e in raw["traceEvents"] if e["cat"] == "kernel"), key=lambda e: e["ts"])
    want_start = [int(e["ts"] * 1000) for e in kernels]
    want_dur = [int(e["dur"] * 1000) for e in kernels]
    (r,) = load_trace(path)
    assert r.start_ns.tolist() == want_start
    assert r.dur_ns.tolist() == want_dur
    ivs = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    assert length(ivs) == Decimal("2.004")
    from fastverify.analyze import breakdown

    b = breakdown(r.start_ns, r.dur_ns, r.cls)
    assert (b["window_us"], b["busy_us"], b["idle_us"], b["compute_us"], b["allreduce_us"]) == (
        2.005,
        2.004,
        0.001,
        2.001,
        0.003,
    )


def test_folder_of_handmade_traces_needs_distinct_ranks():
    # cuda_graph_replay (rank 0 from distributedInfo) and bigint (rank 3) load side by side; their
    # world sizes differ (2 and 4), so only with force (issue 12: not one run otherwise)
    with pytest.raises(UserError, match="world_size differs"):
        load_traces([GRAPH, BIGINT])
    ranks = load_traces([GRAPH, BIGINT], force=True)
    assert [r.rank for r in ranks] == [0, 3]
