"""fastverify.analyze on hand-built event tables whose numbers are worked out on paper.

All times below are integer ns; expected values are in µs as the profile prints them.
"""

from __future__ import annotations

import pytest

from fastverify.analyze import analyze, analyze_rank, breakdown, by_message_size, by_position, match_collectives
from fastverify.events import EventClass, RankEvents, Step

A = EventClass.ALLREDUCE
F = EventClass.FUSED_ALLREDUCE
O = EventClass.OTHER_COMM
U = EventClass.UNKNOWN_COMM
M = EventClass.MEMORY
C = EventClass.COMPUTE

# Scenario 1, one rank (ns):
#   gemm_a   C [0, 10_000)
#   gemm_b   C [5_000, 15_000)        overlaps gemm_a (another stream): compute union [0, 15_000)
#   ar1      A [10_000, 20_000)       half overlapped by compute ([10_000, 15_000))
#   -- gap [20_000, 25_000)
#   copy     M [25_000, 27_000)
#   ar2      A [27_000, 31_000)       not overlapped
#   -- 1 ns gap
#   gemm_c   C [31_001, 40_000)
# window 40_000; busy 20_000 + 6_000 + 8_999 = 34_999; idle 5_001
# compute 15_000 + 8_999 = 23_999; all-reduce 10_000 + 4_000 = 14_000; memory 2_000
# exposed comm 5_000 + 4_000 = 9_000; overlap 5_000 / 14_000 = 35.714 %
# HTA: kernel_time 40, idle 5.001, compute 23.999, non-compute 40 - 23.999 - 5.001 = 11.0
SCENARIO_1 = [
    ("gemm_a", C, 0, 10_000, -1),
    ("gemm_b", C, 5_000, 10_000, -1),
    ("ar", A, 10_000, 10_000, 8192),
    ("copy", M, 25_000, 2_000, -1),
    ("ar", A, 27_000, 4_000, 8192),
    ("gemm_c", C, 31_001, 8_999, -1),
]


def rank_of(rows, rank=0, **kw) -> RankEvents:
    return RankEvents.from_rows(rank, f"test:{rank}", rows, **kw)


def test_scenario_1_split():
    r = rank_of(SCENARIO_1)
    b = breakdown(r.start_ns, r.dur_ns, r.cls)
    assert b["events"] == 6
    assert b["window_us"] == 40.0
    assert b["busy_us"] == 34.999
    assert b["idle_us"] == 5.001
    assert b["compute_us"] == 23.999
    assert b["allreduce_us"] == 14.0
    assert b["fused_allreduce_us"] == 0.0
    assert b["other_comm_us"] == 0.0
    assert b["memory_us"] == 2.0
    assert b["unknown_comm_us"] == 0.0
    assert b["exposed_comm_us"] == 9.0
    assert b["allreduce_exposed_us"] == 9.0
    assert b["other_exposed_us"] == 2.0  # busy - compute - exposed all-reduce: the memcpy
    assert b["comm_compute_overlap_pct"] == 35.714
    assert b["allreduce_kernel_sum_us"] == 14.0
    assert b["allreduce_count"] == 2
    assert b["counts"] == {
        "allreduce": 2,
        "fused_allreduce": 0,
        "other_comm": 0,
        "unknown_comm": 0,
        "memory": 1,
        "compute": 3,
        "ep_alltoall": 0,
    }
    assert b["ep_alltoall_us"] == 0.0
    assert b["hta"] == {
        "kernel_time_us": 40.0,
        "idle_us": 5.001,
        "compute_us": 23.999,
        "non_compute_us": 11.0,
        "comm_compute_overlap_pct": 35.714,
    }


def test_ep_alltoall_is_exposed_communication_and_matched_across_ranks():
    """Expert-parallel dispatch/combine (issue 12): communication, never compute; exposed where no
    compute runs; matched across ranks like any collective (rank 1 waited 30 µs for rank 0)."""
    E, C = EventClass.EP_ALLTOALL, EventClass.COMPUTE
    # rank 0: GEMM [0, 20) µs, dispatch [10, 30) µs (10 µs under the GEMM), combine [40, 50) µs
    r0 = rank_of(
        [
            ("gemm", C, 0, 20_000, -1),
            ("deep_ep::intranode::dispatch", E, 10_000, 20_000, 4096),
            ("deep_ep::intranode::combine", E, 40_000, 10_000, 4096),
        ]
    )
    r1 = rank_of(
        [
            ("gemm", C, 0, 20_000, -1),
            ("deep_ep::intranode::dispatch", E, 10_000, 50_000, 4096),
            ("deep_ep::intranode::combine", E, 70_000, 10_000, 4096),
        ],
        rank=1,
    )
    b = breakdown(r0.start_ns, r0.dur_ns, r0.cls)
    assert b["compute_us"] == 20.0 and b["ep_alltoall_us"] == 30.0 and b["allreduce_us"] == 0.0
    assert b["exposed_comm_us"] == 20.0 and b["comm_compute_overlap_pct"] == round(100 * 10 / 30, 3)
    m = match_collectives([r0, r1])
    assert m["matched"] == 2 and [c["kind"] for c in m["collectives"]] == ["ep_alltoall", "ep_alltoall"]
    assert m["per_rank"]["1"]["wait_us"] == 30.0 and m["per_rank"]["0"]["wait_us"] == 0.0


def test_scenario_1_is_order_independent():
    shuffled = [SCENARIO_1[i] for i in (5, 2, 0, 4, 1, 3)]
    r = rank_of(shuffled)
    b = breakdown(r.start_ns, r.dur_ns, r.cls)
    assert (b["compute_us"], b["allreduce_us"], b["idle_us"], b["exposed_comm_us"]) == (23.999, 14.0, 5.001, 9.0)


# Scenario 2: fused all-reduce, an unknown collective-looking kernel and an all-gather.
#   fused  F [0, 4_000)
#   unk    U [4_000, 6_000)
#   ag     O [6_000, 9_000)      overlapped by compute on [7_000, 9_000)
#   gemm   C [7_000, 12_000)
# window 12, busy 12, idle 0, compute 5, all-reduce (fused included) 4, fused 4, other comm 3,
# unknown 2 (neither comm nor compute); comm = [0,4000)+[6000,9000) = 7_000, overlap 2_000:
# exposed 5, overlap 28.571 %; HTA non-compute 12 - 5 - 0 = 7.
def test_scenario_2_fused_unknown_other():
    r = rank_of(
        [
            ("fused", F, 0, 4_000, -1),
            ("unk", U, 4_000, 2_000, -1),
            ("ag", O, 6_000, 3_000, -1),
            ("gemm", C, 7_000, 5_000, -1),
        ]
    )
    b = breakdown(r.start_ns, r.dur_ns, r.cls)
    assert (b["window_us"], b["busy_us"], b["idle_us"]) == (12.0, 12.0, 0.0)
    assert b["compute_us"] == 5.0
    assert b["allreduce_us"] == 4.0
    assert b["fused_allreduce_us"] == 4.0
    assert b["other_comm_us"] == 3.0
    assert b["unknown_comm_us"] == 2.0
    assert b["exposed_comm_us"] == 5.0
    assert b["allreduce_exposed_us"] == 4.0
    assert b["comm_compute_overlap_pct"] == 28.571
    assert b["allreduce_count"] == 1
    assert b["hta"]["non_compute_us"] == 7.0


def test_no_comm_gives_no_overlap_pct():
    r = rank_of([("gemm", C, 0, 1_000, -1), ("gemm", C, 2_000, 1_000, -1)])
    b = breakdown(r.start_ns, r.dur_ns, r.cls)
    assert b["comm_compute_overlap_pct"] is None
    assert b["hta"]["comm_compute_overlap_pct"] is None
    assert (b["compute_us"], b["idle_us"], b["exposed_comm_us"]) == (2.0, 1.0, 0.0)


def test_nanosecond_precision_at_epoch_scale():
    """Events 1 ns apart are neither merged nor rounded away, also at epoch-ns timestamps
    (1.68e18 ns: a float64 there has a 256 ns step)."""
    t0 = 1_682_725_898_082_228_001
    r = rank_of(
        [
            ("k1", C, t0, 1_000, -1),
            ("k2", C, t0 + 1_001, 999, -1),
            ("ar", A, t0 + 2_000, 1, -1),
            ("k3", C, t0 + 2_002, 1, -1),
        ]
    )
    b = breakdown(r.start_ns, r.dur_ns, r.cls)
    # window [t0, t0+2003); busy 1000 + 999 + 1 + 1 = 2001; idle 1 ns + 1 ns
    assert b["window_us"] == 2.003
    assert b["busy_us"] == 2.001
    assert b["idle_us"] == 0.002
    assert b["compute_us"] == 2.0
    assert b["allreduce_us"] == 0.001
    assert b["exposed_comm_us"] == 0.001


def test_touching_intervals_merge_without_gap():
    r = rank_of([("k1", C, 0, 1_000, -1), ("k2", C, 1_000, 1_000, -1), ("k3", C, 500, 100, -1)])
    b = breakdown(r.start_ns, r.dur_ns, r.cls)
    assert (b["window_us"], b["compute_us"], b["idle_us"]) == (2.0, 2.0, 0.0)


# Steps over scenario 1: s0 = [0, 20_000) holds gemm_a, gemm_b, ar1; s1 = [25_000, 50_000) the rest.
#   s0: window 20, compute 15, all-reduce 10, exposed 5, idle 0, overlap 50 %
#   s1: window [25_000, 40_000) = 15, compute 8.999, all-reduce 4, memory 2, busy 14.999, idle 0.001
def test_steps_and_per_step_split():
    steps = [Step("s0", 0, 20_000), Step("s1", 25_000, 50_000)]
    r = rank_of(SCENARIO_1, steps=steps)
    assert r.step.tolist() == [0, 0, 0, 1, 1, 1]
    out = analyze_rank(r)
    s0, s1 = out["steps"]
    assert (s0["name"], s0["index"], s0["events"], s0["gpu_start_us"]) == ("s0", 0, 3, 0.0)
    assert (s0["window_us"], s0["compute_us"], s0["allreduce_us"], s0["exposed_comm_us"], s0["idle_us"]) == (
        20.0,
        15.0,
        10.0,
        5.0,
        0.0,
    )
    assert s0["comm_compute_overlap_pct"] == 50.0
    assert (s1["name"], s1["events"], s1["gpu_start_us"]) == ("s1", 3, 25.0)
    assert (s1["window_us"], s1["compute_us"], s1["allreduce_us"], s1["memory_us"], s1["busy_us"], s1["idle_us"]) == (
        15.0,
        8.999,
        4.0,
        2.0,
        14.999,
        0.001,
    )
    med = out["step_median"]
    assert med["steps"] == 2
    assert med["window_us"] == 17.5
    assert med["allreduce_us"] == 7.0
    assert med["allreduce_count"] == 1.0
    assert out["outside_steps_events"] == 0
    # the whole-rank numbers are unchanged by the steps
    assert (out["window_us"], out["compute_us"], out["idle_us"]) == (40.0, 23.999, 5.001)


def test_events_outside_steps_are_counted():
    steps = [Step("only", 0, 20_000)]
    r = rank_of(SCENARIO_1, steps=steps)
    out = analyze_rank(r)
    assert [s["name"] for s in out["steps"]] == ["only"]
    assert out["outside_steps_events"] == 3


def test_step_boundaries_are_half_open():
    steps = [Step("a", 0, 1_000), Step("b", 1_000, 2_000)]
    r = rank_of([("k", C, 999, 1, -1), ("k", C, 1_000, 1, -1), ("k", C, 2_000, 1, -1)], steps=steps)
    assert r.step.tolist() == [0, 1, -1]


# Two ranks; collectives matched by position (ns):
#            #0 AR     #1 all-gather   #2 AR
#   rank 0   10_000    5_000           4_000
#   rank 1    3_000    8_000           9_000
#   transfer  3_000    5_000           4_000   (sum 12)
#   wait r0   7_000    0               0       (7)        all-reduce wait 7
#   wait r1   0        3_000           5_000   (8)        all-reduce wait 5
#   shortest  rank 1   rank 0          rank 0  -> straggler rank 0 (2 of 3)
def two_ranks():
    r0 = rank_of(
        [
            ("ar", A, 0, 10_000, 8192),
            ("gemm", C, 10_000, 1_000, -1),
            ("ag", O, 20_000, 5_000, 1024),
            ("ar", A, 30_000, 4_000, 8192),
        ],
        rank=0,
    )
    r1 = rank_of(
        [
            ("ar", A, 7_000, 3_000, 8192),
            ("ag", O, 17_000, 8_000, 1024),
            ("gemm", C, 25_000, 1_000, -1),
            ("ar", A, 25_000, 9_000, 8192),
        ],
        rank=1,
    )
    return r0, r1


def test_transfer_wait_straggler():
    m = match_collectives(list(two_ranks()))
    assert m["matched"] == 3
    assert m["warnings"] == []
    assert [c["transfer_us"] for c in m["collectives"]] == [3.0, 5.0, 4.0]
    assert [c["straggler_rank"] for c in m["collectives"]] == [1, 0, 0]
    assert [c["kind"] for c in m["collectives"]] == ["allreduce", "other_comm", "allreduce"]
    assert m["collectives"][0]["duration_us"] == {"0": 10.0, "1": 3.0}
    assert m["collectives"][1]["msg_bytes"] == 1024
    assert m["per_rank"]["0"] == {
        "wait_us": 7.0,
        "transfer_us": 12.0,
        "allreduce_wait_us": 7.0,
        "allreduce_transfer_us": 7.0,
        "straggler_count": 2,
    }
    assert m["per_rank"]["1"] == {
        "wait_us": 8.0,
        "transfer_us": 12.0,
        "allreduce_wait_us": 5.0,
        "allreduce_transfer_us": 7.0,
        "straggler_count": 1,
    }
    assert m["straggler_rank"] == 0


def test_analyze_adds_wait_and_transfer_per_rank():
    out = analyze(list(two_ranks()))
    r0, r1 = out["ranks"]
    # all-reduce kernel time 14 and 12; wait 7 and 5 -> transfer 7 and 7
    assert (r0["allreduce_kernel_sum_us"], r0["allreduce_wait_us"], r0["allreduce_transfer_us"]) == (14.0, 7.0, 7.0)
    assert (r1["allreduce_kernel_sum_us"], r1["allreduce_wait_us"], r1["allreduce_transfer_us"]) == (12.0, 5.0, 7.0)
    assert out["cross_rank"]["straggler_rank"] == 0


def test_one_rank_has_no_cross_rank_split():
    (r0, _) = two_ranks()
    m = match_collectives([r0])
    assert (m["matched"], m["straggler_rank"], m["per_rank"]) == (0, None, {})
    assert m["warnings"]
    out = analyze([r0])
    assert out["ranks"][0]["allreduce_wait_us"] is None


def test_mismatched_collectives_warn():
    r0, r1 = two_ranks()
    short = rank_of([("ar", A, 0, 3_000, 8192), ("ar", A, 5_000, 2_000, 8192)], rank=1)
    m = match_collectives([r0, short])
    assert m["matched"] == 2
    assert any("different collective counts" in w for w in m["warnings"])
    assert any("different kinds" in w for w in m["warnings"])  # #1 is an all-gather on rank 0


# Message sizes over two ranks:
#   8192 B: 11 all-reduces of 10, 20, ..., 110 µs  -> median 60, p90 100, min 10, max 110, sum 660
#   1024 B: rank 0 1 and 2 µs, rank 1 4 µs          -> count 3, median 2, min 1, max 4, sum 7
#   unknown: 5 and 7 µs                              -> msg_bytes None, count 2, median 6, sum 12
# An all-gather (other comm) is not an all-reduce and is left out.
def test_by_message_size():
    rows0 = [("ar", A, i * 200_000, (i + 1) * 10_000, 8192) for i in range(6)]
    rows0 += [("ar", A, 2_000_000, 1_000, 1024), ("ar", A, 2_100_000, 2_000, 1024), ("fused", F, 2_200_000, 5_000, -1)]
    rows0 += [("ag", O, 2_300_000, 50_000, 8192)]
    rows1 = [("ar", A, i * 200_000, (i + 7) * 10_000, 8192) for i in range(5)]
    rows1 += [("ar", A, 2_000_000, 4_000, 1024), ("ar", A, 2_200_000, 7_000, -1)]
    out = {row["msg_bytes"]: row for row in by_message_size([rank_of(rows0, 0), rank_of(rows1, 1)])}
    assert set(out) == {8192, 1024, None}
    big = out[8192]
    assert (big["count"], big["median_us"], big["p90_us"], big["min_us"], big["max_us"], big["sum_us"]) == (
        11,
        60.0,
        100.0,
        10.0,
        110.0,
        660.0,
    )
    small = out[1024]
    assert (small["count"], small["median_us"], small["min_us"], small["max_us"], small["sum_us"]) == (
        3,
        2.0,
        1.0,
        4.0,
        7.0,
    )
    unknown = out[None]
    assert (unknown["count"], unknown["median_us"], unknown["min_us"], unknown["max_us"], unknown["sum_us"]) == (
        2,
        6.0,
        5.0,
        7.0,
        12.0,
    )


# Per-layer view: two steps, each with two all-reduces (positions 0 and 1):
#   step 0: 10, 4 µs; step 1: 6, 2 µs  -> position 0 median 8, position 1 median 3
def test_by_position():
    steps = [Step("s0", 0, 100_000), Step("s1", 100_000, 200_000)]
    rows = [
        ("ar", A, 0, 10_000, 8192),
        ("gemm", C, 10_000, 5_000, -1),
        ("ar", A, 20_000, 4_000, 8192),
        ("ar", A, 100_000, 6_000, 8192),
        ("ar", A, 110_000, 2_000, 4096),
    ]
    r = rank_of(rows, steps=steps, labels=["embed", "", "layer0.attn", "embed", "layer0.attn"])
    out = by_position([r])
    assert [(p["position"], p["count"], p["median_us"], p["label"], p["msg_bytes"]) for p in out] == [
        (0, 2, 8.0, "embed", 8192),
        (1, 2, 3.0, "layer0.attn", None),  # two different sizes at position 1
    ]


def test_from_rows_rejects_ragged_labels():
    with pytest.raises(ValueError):
        RankEvents.from_rows(0, "x", [("k", C, 0, 1, -1)], labels=["a", "b"])
