"""nccl-tests ``all_reduce_perf`` table parser: the two real 8× RTX 4090 tables and hand-written
snippets of every other layout (MPI prefixes, NCCL log lines inside the table, ``N/A`` checks,
pre-2020 rows without root, ``-I 1`` columns, truncation).

The expected numbers below were read off ``../shared/inputs/allreduceperf-*.txt`` by eye and typed in.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fastverify.errors import UserError
from fastverify.nccl.perftable import (
    PerfRow,
    PerfTable,
    algbw_from_time,
    busbw_from_time,
    parse_all_reduce_perf,
)

INPUTS = Path(__file__).resolve().parents[2] / "shared" / "inputs"
SHM_FILE = "allreduceperf-blog-chlc-rtx4090-p2pdisabled.txt"
P2P_FILE = "allreduceperf-blog-chlc-rtx4090-p2punlocked.txt"

# (size B, out-of-place time µs), every row, as printed.
SHM_OOP = [
    (8, 38.83),
    (16, 38.73),
    (32, 41.85),
    (64, 42.55),
    (128, 42.42),
    (256, 42.44),
    (512, 42.58),
    (1024, 44.04),
    (2048, 42.91),
    (4096, 43.18),
    (8192, 44.02),
    (16384, 43.10),
    (32768, 44.18),
    (65536, 45.66),
    (131072, 67.27),
    (262144, 124.8),
    (524288, 196.9),
    (1048576, 222.8),
    (2097152, 373.4),
    (4194304, 580.8),
    (8388608, 1041.8),
    (16777216, 1972.8),
    (33554432, 3905.6),
    (67108864, 7907.1),
    (134217728, 16253.0),
]
P2P_OOP = [
    (8, 38.82),
    (16, 38.31),
    (32, 38.57),
    (64, 40.71),
    (128, 40.51),
    (256, 41.63),
    (512, 41.67),
    (1024, 41.70),
    (2048, 41.74),
    (4096, 42.35),
    (8192, 42.14),
    (16384, 43.19),
    (32768, 42.17),
    (65536, 47.58),
    (131072, 72.03),
    (262144, 119.7),
    (524288, 166.6),
    (1048576, 216.1),
    (2097152, 321.5),
    (4194304, 478.7),
    (8388608, 798.6),
    (16777216, 1472.8),
    (33554432, 2870.3),
    (67108864, 5705.0),
    (134217728, 11382.0),
]


def _read(name: str) -> str:
    path = INPUTS / name
    if not path.is_file():
        pytest.skip(f"{path} not found (../shared/inputs beside the repo)")
    return path.read_text()


@pytest.fixture(scope="module")
def shm() -> PerfTable:
    return parse_all_reduce_perf(_read(SHM_FILE), source=SHM_FILE)


@pytest.fixture(scope="module")
def p2p() -> PerfTable:
    return parse_all_reduce_perf(_read(P2P_FILE), source=P2P_FILE)


# --------------------------------------------------------------------------------------------
# Real files


@pytest.mark.parametrize("fixture, expected", [("shm", SHM_OOP), ("p2p", P2P_OOP)])
def test_real_tables_every_row(request, fixture, expected):
    t = request.getfixturevalue(fixture)
    assert [(r.size_bytes, r.oop_time_us) for r in t.rows] == expected
    assert t.problems == ()
    assert t.n_ranks == 8
    assert t.devices == ("NVIDIA GeForce RTX 4090",) * 8
    for r in t.rows:
        assert (r.dtype, r.redop, r.root) == ("float", "sum", -1)
        assert r.count == r.size_bytes // 4
        assert r.oop_wrong == 0 and r.ip_wrong == 0
        assert r.oop_error is None


def test_real_tables_header_footer(shm, p2p):
    assert shm.avg_busbw_gbps == pytest.approx(4.85265)
    assert p2p.avg_busbw_gbps == pytest.approx(6.11168)
    for t in (shm, p2p):
        assert t.header["nThread"] == "1"
        assert t.header["nGpus"] == "8"
        assert t.header["maxBytes"] == "134217728"
        assert t.header["step"] == "2(factor)"
        assert t.header["warmup iters"] == "5"
        assert t.header["iters"] == "20"
        assert t.header["agg iters"] == "1"
        assert t.header["graph"] == "0"
        assert t.header["Out of bounds values"] == "0 OK"


def test_real_tables_selected_cells(shm, p2p):
    # size: (oop time, oop busbw, ip time, ip busbw)
    shm_cells = {
        8: (38.83, 0.00, 40.43, 0.00),
        131072: (67.27, 3.41, 54.86, 4.18),
        262144: (124.8, 3.68, 121.1, 3.79),
        33554432: (3905.6, 15.04, 3919.0, 14.98),
        134217728: (16253.0, 14.45, 16227.0, 14.47),
    }
    p2p_cells = {
        8: (38.82, 0.00, 38.16, 0.00),
        1048576: (216.1, 8.49, 217.2, 8.45),
        67108864: (5705.0, 20.59, 5695.6, 20.62),
        134217728: (11382.0, 20.64, 11380.0, 20.64),
    }
    for t, cells in ((shm, shm_cells), (p2p, p2p_cells)):
        for size, (ot, ob, it, ib) in cells.items():
            r = t.row(size)
            assert (r.oop_time_us, r.oop_busbw_gbps, r.ip_time_us, r.ip_busbw_gbps) == (ot, ob, it, ib)
    assert shm.row(1048576).oop_algbw_gbps == 4.71
    with pytest.raises(KeyError, match="no row of 3 B"):
        shm.row(3)


@pytest.mark.parametrize("fixture", ["shm", "p2p"])
def test_busbw_column_matches_formula(request, fixture):
    t = request.getfixturevalue(fixture)
    for r in t.rows:
        for time_us, algbw, busbw in (
            (r.oop_time_us, r.oop_algbw_gbps, r.oop_busbw_gbps),
            (r.ip_time_us, r.ip_algbw_gbps, r.ip_busbw_gbps),
        ):
            # columns are rounded to 2 decimals; the time itself to 4-5 significant digits
            assert algbw_from_time(r.size_bytes, time_us) == pytest.approx(algbw, abs=0.006, rel=1e-3)
            assert busbw_from_time(r.size_bytes, time_us, t.n_ranks) == pytest.approx(busbw, abs=0.006, rel=1e-3)


def test_busbw_formula_values():
    # 1 MB in 100 µs = 10 GB/s algBw; busBw = 10 · 2·7/8 = 17.5 on 8 ranks, = algBw on 2 ranks
    assert algbw_from_time(1_000_000, 100.0) == pytest.approx(10.0)
    assert busbw_from_time(1_000_000, 100.0, 8) == pytest.approx(17.5)
    assert busbw_from_time(1_000_000, 100.0, 2) == pytest.approx(10.0)
    assert busbw_from_time(1_000_000, 100.0, 1) == 0.0
    for bad in ((8, 0.0, 8), (8, -1.0, 8), (-8, 1.0, 8), (8, 1.0, 0)):
        with pytest.raises(ValueError):
            busbw_from_time(*bad)


# --------------------------------------------------------------------------------------------
# Hand-written layouts

NEW_HEADER = """\
# nccl-tests version 2.17.6 nccl-headers=22705 nccl-library=22705
# Collective test starting: all_reduce_perf
# nThread 1 nGpus 1 minBytes 8 maxBytes 1024 step: 2(factor) warmup iters: 1 iters: 20 agg iters: 1 validation: 0 graph: 0 unalign: 0
#
# Using devices
#  Rank  0 Group  0 Pid  40001 on      host0 device  0 [0000:01:00] NVIDIA GeForce RTX 4090
#  Rank  1 Group  0 Pid  40002 on      host0 device  1 [0000:25:00] NVIDIA GeForce RTX 4090
#
#                                                              out-of-place                       in-place          
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong 
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)         
"""
NEW_FOOTER = """\
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.0123 
#
# Collective test concluded: all_reduce_perf
"""


def test_new_header_pci_busid_and_na_wrong():
    text = (
        NEW_HEADER
        + (
            "           8             2     float     sum      -1    12.51    0.00    0.00     N/A    12.40    0.00    0.00     N/A\n"
            "        1024           256  bfloat16     sum      -1    13.02    0.08    0.08     N/A    12.99    0.08    0.08     N/A\n"
        )
        + NEW_FOOTER
    )
    t = parse_all_reduce_perf(text)
    assert t.n_ranks == 2
    assert t.devices == ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090")
    assert t.header["nccl-tests version"] == "2.17.6"
    assert t.header["nccl-library"] == "22705"
    assert t.header["unalign"] == "0"
    assert t.header["validation"] == "0"
    assert t.header["Collective test starting"] == "all_reduce_perf"
    assert t.avg_busbw_gbps == pytest.approx(0.0123)
    assert [r.oop_wrong for r in t.rows] == [None, None]
    assert [r.ip_wrong for r in t.rows] == [None, None]
    assert t.rows[1] == PerfRow(
        1024, 256, "bfloat16", "sum", -1, 13.02, 0.08, 0.08, None, 12.99, 0.08, 0.08, None, line=t.rows[1].line
    )


def test_wrong_count_in_g_format():
    text = NEW_HEADER + (
        "     4194304       1048576     float     sum      -1    580.8    7.22   12.64  1e+06    592.0    7.09   12.40      3\n"
    )
    (r,) = parse_all_reduce_perf(text).rows
    assert (r.oop_wrong, r.ip_wrong) == (1_000_000, 3)


def test_n_ranks_from_header_without_rank_lines():
    text = (
        "# nThread 2 nGpus 4 minBytes 8 maxBytes 8 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0\n"
        "           8             2     float     sum      -1    38.83    0.00    0.00      0    40.43    0.00    0.00      0\n"
    )
    t = parse_all_reduce_perf(text)
    assert t.n_ranks == 8 and t.devices == () and t.avg_busbw_gbps is None


def test_old_format_no_root_error_column():
    # nccl-tests before the root column (2019): ``error`` holds the max abs error as %5.0le
    text = """\
# nThread 1 nGpus 4 minBytes 8 maxBytes 64 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
#
# Using devices
#   Rank  0 Pid  12345 on      host0 device  0 [0x3b] Tesla V100-PCIE-16GB
#
#                                                     out-of-place                       in-place
#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2   float     sum    13.44    0.00    0.00  1e-07    13.38    0.00    0.00  0e+00
          64            16   float     sum    13.85    0.00    0.01  2e-07    13.70    0.00    0.01  N/A
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.00312 
"""
    t = parse_all_reduce_perf(text)
    assert [r.size_bytes for r in t.rows] == [8, 64]
    r0, r1 = t.rows
    assert r0.root is None and r0.oop_wrong is None and r0.ip_wrong is None
    assert (r0.oop_time_us, r0.ip_time_us) == (13.44, 13.38)
    assert (r0.oop_error, r0.ip_error) == (1e-07, 0.0)
    assert (r1.oop_error, r1.ip_error) == (2e-07, None)
    assert t.n_ranks == 4  # one rank line of the 4 the header counts (an excerpt): nThread × nGpus wins


def test_rows_without_any_header_are_guessed_by_width():
    text = (
        "           8             2     float     sum      -1    38.83    0.00    0.00      0    40.43    0.00    0.00      0\n"
        "           8             2   float     sum    13.44    0.00    0.00  1e-07    13.38    0.00    0.00  1e-07\n"
    )
    a, b = parse_all_reduce_perf(text).rows
    assert a.root == -1 and a.oop_wrong == 0
    assert b.root is None and b.oop_error == 1e-07


@pytest.mark.parametrize("prefix", ["[0] ", "[1,0]<stdout>:", "0: "])
def test_mpi_prefixes(prefix):
    body = (
        NEW_HEADER
        + (
            "           8             2     float     sum      -1    38.83    0.00    0.00      0    40.43    0.00    0.00      0\n"
            "          16             4     float     sum      -1    38.73    0.00    0.00      0    38.59    0.00    0.00      0\n"
        )
        + NEW_FOOTER
    )
    text = "".join(prefix + line + "\n" for line in body.splitlines())
    t = parse_all_reduce_perf(text)
    assert [(r.size_bytes, r.oop_time_us, r.ip_time_us) for r in t.rows] == [(8, 38.83, 40.43), (16, 38.73, 38.59)]
    assert t.n_ranks == 2 and t.avg_busbw_gbps == pytest.approx(0.0123)
    assert t.problems == ()


def test_nccl_log_lines_between_and_inside_rows():
    # Lines between rows (other ranks, with a timestamped WARN) and, as printed by NCCL >= 2.22 that
    # connects at the first collective, log lines that start right after a row's first columns.
    text = (
        NEW_HEADER
        + (
            "           8             2     float     sum      -1host0:13313:13988 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM\n"
            "host0:13313:13989 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/CUMEM\n"
            "host0:13313:13988 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 1\n"
            "    38.83    0.00    0.00      0host0:13313:13988 [0] NCCL INFO AllReduce: 8 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..0}\n"
            "    40.43    0.00    0.00      0\n"
            "[2025-02-07 10:00:00] host0:13313:13990 [1] transport.cc:123 NCCL WARN something odd\n"
            "[1,1]<stdout>:host0:13314:13991 [1] NCCL INFO comm 0x55d0 rank 1 nRanks 2 nNodes 1 localRanks 2 localRank 1 MNNVL 0\n"
            "          16             4     float     sum      -1    38.73    0.00    0.00      0    38.59    0.00    0.00    N/A\n"
        )
        + NEW_FOOTER
    )
    t = parse_all_reduce_perf(text)
    assert t.problems == ()
    assert [(r.size_bytes, r.root, r.oop_time_us, r.oop_wrong, r.ip_time_us, r.ip_wrong) for r in t.rows] == [
        (8, -1, 38.83, 0, 40.43, 0),
        (16, -1, 38.73, 0, 38.59, None),
    ]
    assert t.rows[0].line == 12  # where the split row starts


def test_per_iteration_columns_and_timestamp():
    text = (
        "#       size         count      type   redop    root     time   algbw   busbw  #wrong    i_min    i_max    i_p99    i_cv%     time   algbw   busbw  #wrong    i_min    i_max    i_p99    i_cv%           timestamp\n"
        "           8             2     float     sum      -1    12.51    0.00    0.00       0    11.90    14.20    14.10     3.20    12.40    0.00    0.00       0    11.80    13.90    13.80     2.90 2025-02-07 10:00:00\n"
    )
    (r,) = parse_all_reduce_perf(text).rows
    assert (r.oop_time_us, r.ip_time_us, r.oop_wrong) == (12.51, 12.40, 0)


def test_truncated_last_row_is_dropped_and_reported():
    text = NEW_HEADER + (
        "           8             2     float     sum      -1    38.83    0.00    0.00      0    40.43    0.00    0.00      0\n"
        "          16             4     float     sum      -1    38.73    0.00    0.0"
    )
    t = parse_all_reduce_perf(text, source="run.txt")
    assert [r.size_bytes for r in t.rows] == [8]
    assert len(t.problems) == 1
    assert t.problems[0].startswith("line 13: data row dropped (cut off at the end of the text)")


def test_only_a_truncated_row_is_a_user_error():
    text = NEW_HEADER + "           8             2     float     sum      -1    38.8"
    with pytest.raises(UserError) as ei:
        parse_all_reduce_perf(text, source="cut.txt")
    msg = str(ei.value)
    assert msg.startswith("cut.txt: line 12: data row dropped") and "\n" not in msg


@pytest.mark.parametrize(
    "text, line",
    [
        ("", 1),
        ("hello\nworld\n", 2),
        (NEW_HEADER + NEW_FOOTER, 10),  # the column header line
    ],
)
def test_no_rows_is_a_user_error(text, line):
    with pytest.raises(UserError) as ei:
        parse_all_reduce_perf(text, source="x.txt")
    msg = str(ei.value)
    assert msg.startswith(f"x.txt: line {line}:") and "no all_reduce_perf data rows" in msg
    assert "\n" not in msg


def test_real_file_cut_mid_row():
    text = _read(SHM_FILE)
    cut = text.index("   4194304       1048576") + 50  # inside the 4 MiB row
    t = parse_all_reduce_perf(text[:cut], source=SHM_FILE)
    assert t.sizes == tuple(s for s, _ in SHM_OOP[:19])
    assert len(t.problems) == 1 and "cut off" in t.problems[0]
    assert t.avg_busbw_gbps is None


# --------------------------------------------------------------------------------------------
# Never anything but UserError


def _returns_or_user_error(text: str) -> None:
    try:
        t = parse_all_reduce_perf(text, source="fuzz")
    except UserError as e:
        assert "\n" not in str(e)
    else:
        assert t.rows


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_fuzz_arbitrary_text(text):
    _returns_or_user_error(text)


_ROWISH = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "#",
                "N/A",
                "-1",
                "float",
                "sum",
                "1e+06",
                "nan",
                "inf",
                "[0]",
                "host0:1:2 [0] NCCL INFO x",
                "size count type redop root time algbw busbw #wrong",
                "0x",
                "9" * 5000,
                "\t",
                "\n",
            ]
        ),
        st.integers(-(10**40), 10**40).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(str),
    ),
    max_size=40,
).map(" ".join)


@settings(max_examples=300, deadline=None)
@given(_ROWISH)
def test_fuzz_row_like_text(text):
    _returns_or_user_error(text)


@pytest.mark.parametrize("name", [SHM_FILE, P2P_FILE])
def test_every_truncation_of_real_files(name):
    text = _read(name)
    for n in range(0, len(text) + 1, 7):
        _returns_or_user_error(text[:n])


@pytest.mark.parametrize(
    "line",
    [
        "NCCL " + "a" * 1_000_000,
        "#" + " " * 1_000_000 + "x",
        "#  Rank  0" + " " * 500_000 + "x",
        "           8             2     float     sum      -1" + "a" * 1_000_000 + ":1:2 [0] NCCL INFO x",
        "1 " * 500_000,
    ],
)
def test_long_lines_stay_fast(line):
    import time

    t0 = time.perf_counter()
    _returns_or_user_error(line + "\n")
    assert time.perf_counter() - t0 < 2.0


def test_other_text_glued_to_a_log_line_does_not_join_the_next_row():
    text = NEW_HEADER + (
        "Warning: something happenedhost0:1:2 [0] NCCL INFO Connected all rings\n"
        "           8             2     float     sum      -1    38.83    0.00    0.00      0    40.43    0.00    0.00      0\n"
    )
    t = parse_all_reduce_perf(text)
    assert [(r.size_bytes, r.oop_time_us) for r in t.rows] == [(8, 38.83)] and t.problems == ()


# --------------------------------------------------------------------------------------------
# Issue 11: MPI tags glued inside a row, measured time per size


# The first ten rows of allreduceperf-blog-chlc-rtx4090-p2pdisabled.txt, as typed in by hand:
# (size, count, out-of-place time/algbw/busbw, in-place time/algbw/busbw)
SHM_FIRST_TEN = [
    (8, 2, "38.83", "0.00", "0.00", "40.43", "0.00", "0.00"),
    (16, 4, "38.73", "0.00", "0.00", "38.59", "0.00", "0.00"),
    (32, 8, "41.85", "0.00", "0.00", "42.55", "0.00", "0.00"),
    (64, 16, "42.55", "0.00", "0.00", "42.65", "0.00", "0.00"),
    (128, 32, "42.42", "0.00", "0.01", "42.88", "0.00", "0.01"),
    (256, 64, "42.44", "0.01", "0.01", "42.53", "0.01", "0.01"),
    (512, 128, "42.58", "0.01", "0.02", "42.68", "0.01", "0.02"),
    (1024, 256, "44.04", "0.02", "0.04", "42.39", "0.02", "0.04"),
    (2048, 512, "42.91", "0.05", "0.08", "42.61", "0.05", "0.08"),
    (4096, 1024, "43.18", "0.09", "0.17", "42.69", "0.10", "0.17"),
]


@pytest.mark.parametrize("tag", ["[0] ", "[1,0]<stdout>:", "[0]"])
def test_mpi_tag_glued_inside_rows(tag):
    """mpirun tags every chunk nccl-tests writes (the row is printed in three pieces), so the tag lands
    after the root column and after the first half's #wrong: ``-1[0]``, ``0[0]``. Before issue 11
    the parser read 0 of these 10 rows (UserError: no complete data row)."""
    lines = [tag + line for line in NEW_HEADER.splitlines()]
    for size, count, ot, oa, ob, it, ia, ib in SHM_FIRST_TEN:
        lines.append(
            f"{tag}{size:>12}  {count:>12}     float     sum      -1{tag}{ot:>8} {oa:>7} {ob:>7}      0"
            f"{tag}{it:>8} {ia:>7} {ib:>7}      0"
        )
    t = parse_all_reduce_perf("\n".join(lines) + "\n", source="mpi.txt")
    assert len(t.rows) == 10 and t.problems == ()
    assert [(r.size_bytes, r.count, r.oop_time_us, r.ip_time_us) for r in t.rows] == [
        (s, c, float(ot), float(it)) for s, c, ot, _, _, it, _, _ in SHM_FIRST_TEN
    ]
    assert t.rows[9].oop_busbw_gbps == 0.17 and t.rows[9].ip_algbw_gbps == 0.10
    assert all(r.root == -1 and r.oop_wrong == 0 and r.ip_wrong == 0 for r in t.rows)


def test_time_us_exact_rows_of_the_real_tables(shm, p2p):
    for size, t in SHM_OOP:
        assert shm.time_us(size) == t
    for size, t in P2P_OOP:
        assert p2p.time_us(size) == t
    # in-place column, read off the p2pdisabled file: 65536 -> 45.28, 131072 -> 54.86, 134217728 -> 16227
    assert shm.time_us(65536, in_place=True) == 45.28
    assert shm.time_us(131072, in_place=True) == 54.86
    assert shm.time_us(134217728, in_place=True) == 16227.0


def test_time_us_interpolates_in_log_log_between_neighbours(shm):
    # 57344 B (Kimi-K2 verify, 4 tokens x 7168 x 2 B) lies between the 32768 B (44.18 µs) and
    # 65536 B (45.66 µs) rows: log2(57344/32768) = log2(1.75) of the way in log-log.
    import math

    f = math.log2(1.75)
    want = 44.18 * (45.66 / 44.18) ** f
    assert shm.time_us(57344) == pytest.approx(want, rel=1e-12)
    assert 45.36 < want < 45.38  # worked by hand: 44.18 * 1.0335^0.807 = 45.37
    # halfway in log(size) between 131072 (67.27) and 262144 (124.8): the geometric mean
    assert shm.time_us(185364) == pytest.approx(math.sqrt(67.27 * 124.8), rel=1e-4)


def test_time_us_outside_the_measured_range_is_none(shm):
    assert shm.time_us(7) is None and shm.time_us(0) is None
    assert shm.time_us(134217729) is None
    with pytest.raises(ValueError):
        shm.time_us(-1)
    with pytest.raises(ValueError):
        shm.time_us(1.5)  # type: ignore[arg-type]


def test_summary_of_the_real_tables(shm, p2p):
    s = shm.summary()
    assert (s["rows"], s["min_bytes"], s["max_bytes"], s["n_ranks"]) == (25, 8, 134217728, 8)
    assert s["devices"] == ["NVIDIA GeForce RTX 4090"] and s["dtypes"] == ["float"] and s["redops"] == ["sum"]
    assert (s["time_us_at_min"], s["time_us_at_max"]) == (38.83, 16253.0)
    assert (s["peak_busbw_gbps"], s["peak_busbw_bytes"]) == (15.04, 33554432)
    assert s["avg_busbw_gbps"] == 4.85265 and s["graph"] == "0" and s["label"] == "measured"
    s = p2p.summary()
    assert (s["time_us_at_min"], s["time_us_at_max"], s["peak_busbw_gbps"], s["peak_busbw_bytes"]) == (
        38.82,
        11382.0,
        20.64,
        134217728,
    )
    assert s["avg_busbw_gbps"] == 6.11168
