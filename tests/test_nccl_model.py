"""NCCL's all-reduce cost model (fastverify/nccl/model.py) and its PCIe correction.

Expected values are literals: the worked numbers of ../shared/research/nccl.md §2.3 (computed there by
hand from NVIDIA/nccl src/graph/tuning.cc at 2.30.7) and cases worked out by hand below. The held-out
check parses the two measured 8x RTX 4090 tables and computes the errors here, from the rows and the
fitted predictions, without the benchmark's code.
"""

from __future__ import annotations

import importlib.util
import math
import re
import statistics
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from fastverify.errors import UserError
from fastverify.nccl import model as M
from fastverify.nccl.model import Algo, CorrectedModel, LinkType, ModelInputs, Prediction, Proto, Transport

REPO = Path(__file__).resolve().parent.parent
INPUTS = REPO.parent / "shared" / "inputs"
SHM_FILE = INPUTS / "allreduceperf-blog-chlc-rtx4090-p2pdisabled.txt"
P2P_FILE = INPUTS / "allreduceperf-blog-chlc-rtx4090-p2punlocked.txt"

R, T = Algo.RING, Algo.TREE
LL, LL128, S = Proto.LL, Proto.LL128, Proto.SIMPLE


def box8(**kw) -> ModelInputs:
    """nccl.md §2.3: 8 ranks, one node, PCI, Ampere/Ada index, graph 2 channels x 12 GB/s."""
    return ModelInputs(n_ranks=8, sm=89, bw_intra_gbps=12.0, n_channels=2, **kw)


# ------------------------------------------------------------------------------------------------
# NCCL's model: worked numbers of nccl.md §2.3
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("algo", "proto", "version", "expected_us"),
    [
        (R, LL, 23007, 20.6),  # 6.6 + 14 x 1.0
        (R, LL128, 23007, 49.0),  # 14 + 14 x 2.5
        (R, S, 23007, 88.2),  # 8.4 + 14 x 5.7
        (T, LL, 23007, 20.8),  # 6.8 + 14 x 1.0
        (T, LL128, 23007, 40.6),  # 14 + 14 x 1.9
        (T, S, 23007, 64.4),  # 8.4 + 14 x 4.0 (>= 2.23)
        (T, S, 22304, 64.4),
        (T, S, 22203, 392.0),  # 0 + 14 x 28 (2.19 .. 2.22)
        (T, S, 21903, 392.0),
        (T, S, 21805, 84.0),  # 0 + 14 x 6 (2.18, PCI row)
    ],
)
def test_latency_worked_numbers(algo, proto, version, expected_us):
    assert M.latency_us(algo, proto, box8(nccl_version=version)) == pytest.approx(expected_us, abs=1e-9)


def test_algbw_worked_numbers():
    i = box8()
    assert M.algbw_gbps(R, LL, i) == pytest.approx(6.857, abs=5e-4)  # min(87.7, 24/2) x 8/14
    assert M.algbw_gbps(R, S, i) == pytest.approx(13.714, abs=5e-4)  # 24 x 8/14
    assert M.algbw_gbps(T, LL, i) == pytest.approx(2.905, abs=5e-4)  # min(0.92x24, 2x24)/3.8 x 0.5
    assert M.algbw_gbps(T, S, i) == pytest.approx(11.04, abs=5e-4)  # 0.92 x 24 x 0.5
    assert M.algbw_gbps(R, LL128, i) == 0.0  # LL128 off on PCI by default
    # Before 2.21 Ring/LL used a quarter of busBw for all-reduce: 24/4 x 8/14.
    assert M.algbw_gbps(R, LL, box8(nccl_version=22005)) == pytest.approx(3.4286, abs=5e-4)


# nccl.md §2.3 table: hidden 7168 bf16, 4..64 tokens.
WORKED = [
    # bytes, Ring/LL, Ring/Simple, Tree/LL, Tree/Simple
    (57344, 29.0, 92.4, 49.0, 73.1),
    (114688, 37.3, 96.6, 86.6, 81.7),
    (229376, 54.1, 104.9, 178.7, 106.0),
    (458752, 87.5, 121.7, 415.6, 147.5),
    (917504, 154.4, 155.1, 810.3, 230.6),
]


@pytest.mark.parametrize(("nbytes", "ring_ll", "ring_simple", "tree_ll", "tree_simple"), WORKED)
def test_predicted_table_worked_numbers(nbytes, ring_ll, ring_simple, tree_ll, tree_simple):
    p = M.predict(nbytes, box8())
    assert set(p.times_us) == {(R, LL), (R, S), (T, LL), (T, S)}
    for key, want in (((R, LL), ring_ll), ((R, S), ring_simple), ((T, LL), tree_ll), ((T, S), tree_simple)):
        assert p.times_us[key] == pytest.approx(want, abs=0.051), key  # the notes round to 0.1 µs
    assert (p.algo, p.proto) == (R, LL)  # chosen for all five (917504 B: 154.4 vs 155.1)
    assert p.time_us == p.times_us[(R, LL)]


def test_blackwell_gen5_worked_numbers():
    i = M.inputs_for_pcie_box(8, gen=5, sm=120, p2p=True)
    assert (i.bw_intra_gbps, i.n_channels) == (24.0, 2)
    got = [M.predict(b, i).time_us for b, *_ in WORKED]
    assert got == pytest.approx([24.8, 29.0, 37.3, 54.1, 87.5], abs=0.051)


def test_graph_search_fallback_picks_simple_from_4_kb():
    # "Could not find a path ... falling back to simple order": bwIntra 0.1, 1 channel. Ring algBw
    # LL 0.05 x 8/14, Simple 0.1 x 8/14 GB/s: LL only below 67.6 / (1/28.57 - 1/57.14) = 3862 B.
    i = ModelInputs(n_ranks=8, sm=120, bw_intra_gbps=0.1, n_channels=1)
    assert M.predict(3800, i).proto is LL
    for nbytes in (3900, 32768, 65536, 262144, 1 << 20):
        p = M.predict(nbytes, i)
        assert (p.algo, p.proto) == (R, S), nbytes


# ------------------------------------------------------------------------------------------------
# Hand-computed n = 2 (graph 2 x 12 GB/s, busBw 24)
# ------------------------------------------------------------------------------------------------


def test_two_ranks_by_hand():
    i = ModelInputs(n_ranks=2, sm=89, bw_intra_gbps=12.0, n_channels=2)
    # Ring: 2 hops. LL: 6.6 + 2 x 1.0 = 8.6 µs, algBw min(87.7, 12) x 2/2 = 12 GB/s.
    # Simple: 8.4 + 2 x 5.7 = 19.8 µs, algBw 24 GB/s.
    # Tree: LL 6.8 + 2 = 8.8 µs, algBw 22.08/3.8/2 = 2.905; Simple 8.4 + 8 = 16.4 µs, algBw 11.04.
    p = M.predict(1_000_000, i)
    assert p.times_us[(R, LL)] == pytest.approx(8.6 + 1e6 / 12000, rel=1e-9)  # 91.93
    assert p.times_us[(R, S)] == pytest.approx(19.8 + 1e6 / 24000, rel=1e-9)  # 61.47
    # 1e6 >> 6 = 15625 -> log2 index 13: Tree factors LL 0.4, Simple 0.5
    assert p.times_us[(T, LL)] == pytest.approx(8.8 + 1e6 / (1000 * 22.08 / 3.8 / 2 * 0.4), rel=1e-9)
    assert p.times_us[(T, S)] == pytest.approx(16.4 + 1e6 / (1000 * 11.04 * 0.5), rel=1e-9)
    assert (p.algo, p.proto) == (R, S)
    p8 = M.predict(8, i)
    assert p8.time_us == pytest.approx(8.6 + 8 / 12000, rel=1e-9)
    assert (p8.algo, p8.proto) == (R, LL)
    # LL/Simple crossover: 8.6 + x/12000 = 19.8 + x/24000 -> x = 268800 B.
    assert M.predict(260_000, i).proto is LL
    assert M.predict(280_000, i).proto is S


def test_one_rank_is_free():
    p = M.predict(1 << 20, ModelInputs(n_ranks=1, sm=89, bw_intra_gbps=12.0, n_channels=1))
    assert (p.time_us, p.algo, p.proto) == (0.0, R, S)


def test_tree_correction_index():
    assert M.tree_correction_factor(LL, 63) == 1.0  # log2i(0) = -1: no factor
    assert M.tree_correction_factor(S, 64) == 0.9  # index 0
    assert M.tree_correction_factor(LL, 64 << 12) == 0.4  # index 12
    assert M.tree_correction_factor(S, (64 << 23) - 1) == 0.9  # index 22
    assert M.tree_correction_factor(S, 64 << 23) == 1.0  # index 23: not applied


def test_nccl_tree_is_not_monotonic_at_correction_steps():
    # NCCL's own quirk, kept on purpose: Tree/LL's factor rises 0.4 -> 0.5 at 64 << 14 bytes.
    i = box8(algos={T}, protos={LL})
    below, at = M.predict((64 << 14) - 1, i).time_us, M.predict(64 << 14, i).time_us
    assert at < below


# ------------------------------------------------------------------------------------------------
# Enabled algorithms and protocols
# ------------------------------------------------------------------------------------------------


def test_default_protocols():
    assert M.default_protos(LinkType.PCI, 89) == {LL, S}
    assert M.default_protos(LinkType.PCI, 90) == {LL, S}
    assert M.default_protos(LinkType.NVLINK, 80, 22005) == {LL, LL128, S}
    assert M.default_protos(LinkType.NVLINK, 89, 22603) == {LL, S}  # <= 2.26 whitelist: 70/80/90 (+100/120)
    assert M.default_protos(LinkType.NVLINK, 89, 22703) == {LL, LL128, S}
    assert M.default_protos(LinkType.NVLINK, 120, 22403) == {LL, S}
    assert M.default_protos(LinkType.NVLINK, 120, 22501) == {LL, LL128, S}


@settings(max_examples=200, deadline=None)
@given(
    nbytes=st.integers(0, 1 << 31),
    n=st.integers(2, 16),
    sm=st.sampled_from([70, 80, 86, 89, 90, 100, 120]),
    gen=st.sampled_from([3, 4, 5]),
)
def test_ll128_never_chosen_on_pci_by_default(nbytes, n, sm, gen):
    p = M.predict(nbytes, M.inputs_for_pcie_box(n, gen=gen, sm=sm, p2p=True))
    assert p.proto is not LL128
    assert all(proto is not LL128 for _, proto in p.times_us)


def test_ll128_listed_in_nccl_proto_is_used():
    p = M.predict(1 << 22, box8(protos={LL, LL128, S}))
    assert (R, LL128) in p.times_us and (T, LL128) in p.times_us
    assert p.times_us[(R, LL128)] == pytest.approx(49.0 + (1 << 22) / (1000 * 22.08 * 8 / 14), rel=1e-9)


@settings(max_examples=150, deadline=None)
@given(nbytes=st.integers(0, 1 << 30), n=st.integers(2, 16), bw=st.floats(0.1, 60), nch=st.integers(1, 16))
def test_nccl_proto_simple_forces_simple(nbytes, n, bw, nch):
    i = ModelInputs(n_ranks=n, sm=89, bw_intra_gbps=bw, n_channels=nch, protos={S})
    p = M.predict(nbytes, i)
    assert p.proto is S and {proto for _, proto in p.times_us} == {S}
    i = ModelInputs(n_ranks=n, sm=89, bw_intra_gbps=bw, n_channels=nch, algos={T})
    assert M.predict(nbytes, i).algo is T


def test_nothing_enabled_is_rejected():
    with pytest.raises(ValueError, match="No algorithm/protocol available"):
        box8(protos=set())
    with pytest.raises(ValueError, match="no algorithm/protocol left"):
        box8(algos=set())


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_ranks=0),
        dict(sm=8.9),
        dict(bw_intra_gbps=0.0),
        dict(bw_intra_gbps=float("nan")),
        dict(n_channels=0),
        dict(n_channels=65),
        dict(nccl_version=2234),
        dict(protos={"LL129"}),
        dict(link="NVSWITCH"),
    ],
)
def test_bad_inputs_name_the_field(kw):
    base = dict(n_ranks=8, sm=89, bw_intra_gbps=12.0, n_channels=2)
    with pytest.raises(ValueError, match="ModelInputs"):
        ModelInputs(**{**base, **kw})


def test_bad_nbytes():
    for bad in (-1, 1.5, "8", True):
        with pytest.raises(ValueError, match="nbytes"):
            M.predict(bad, box8())


# ------------------------------------------------------------------------------------------------
# Graph derivation for a PCIe box
# ------------------------------------------------------------------------------------------------


def test_inputs_for_pcie_box_derivation():
    g = lambda **kw: (lambda i: (i.bw_intra_gbps, i.n_channels))(M.inputs_for_pcie_box(8, **kw))  # noqa: E731
    assert g(gen=4, sm=89, p2p=True) == (12.0, 2)  # ladder 20 (1 ch) ... 12 (2 ch = 24 = link): nccl.md §2.3
    assert g(gen=4, sm=89, p2p=False, cpu_link_bw_gbps=16.0) == (12.0, 2)  # all-SYS AMD: 15 (1 ch), 12 (2 ch)
    assert g(gen=3, sm=80, p2p=True) == (12.0, 1)  # Gen3 x16 = 12 GB/s: one channel at 12
    assert g(gen=5, sm=90, p2p=True) == (24.0, 2)  # sm90 ladder: 40, 30, 24 x 2 = 48
    assert g(gen=5, sm=120, p2p=False) == (24.0, 2)
    # The GRAPH line wins when given.
    assert g(gen=4, sm=89, p2p=True, graph_bw_intra_gbps=15.0, graph_n_channels=1) == (15.0, 1)
    i = M.inputs_for_pcie_box(8, gen=4, sm=89, p2p=False)
    assert i.transport is Transport.SHM and i.link is LinkType.PCI and i.protos == {LL, S}
    with pytest.raises(ValueError, match="both or neither"):
        M.inputs_for_pcie_box(8, gen=4, sm=89, p2p=True, graph_bw_intra_gbps=12.0)
    with pytest.raises(ValueError, match="gen"):
        M.inputs_for_pcie_box(8, gen=7, sm=89, p2p=True)


# ------------------------------------------------------------------------------------------------
# Monotonic in size, and always labelled predicted
# ------------------------------------------------------------------------------------------------

SIZES = st.integers(0, 1 << 31)


@settings(max_examples=300, deadline=None)
@given(a=SIZES, b=SIZES, n=st.integers(2, 16), gen=st.sampled_from([3, 4, 5]), sm=st.sampled_from([80, 89, 90, 120]))
def test_default_pcie_prediction_is_monotonic_in_size(a, b, n, gen, sm):
    lo, hi = sorted((a, b))
    i = M.inputs_for_pcie_box(n, gen=gen, sm=sm, p2p=True)
    assert M.predict(lo, i).time_us <= M.predict(hi, i).time_us


@settings(max_examples=300, deadline=None)
@given(
    a=SIZES,
    b=SIZES,
    n=st.integers(2, 16),
    bw=st.floats(0.1, 60),
    nch=st.integers(1, 32),
    protos=st.sets(st.sampled_from(list(Proto)), min_size=1),
    delta=st.floats(-0.5, 10),
    b_ll=st.floats(0.05, 3),
    b_s=st.floats(0.05, 3),
)
def test_ring_times_monotonic_raw_and_corrected(a, b, n, bw, nch, protos, delta, b_ll, b_s):
    lo, hi = sorted((a, b))
    i = ModelInputs(n_ranks=n, sm=89, bw_intra_gbps=bw, n_channels=nch, algos={R}, protos=protos)
    assert M.predict(lo, i).time_us <= M.predict(hi, i).time_us
    c = CorrectedModel(delta, {LL: b_ll, S: b_s})
    t_lo, t_hi = c.times_us(lo, i), c.times_us(hi, i)
    assert all(t_lo[k] <= t_hi[k] for k in t_lo)  # every pair; NCCL's pick itself can jump (see below)


@settings(max_examples=200, deadline=None)
@given(
    nbytes=SIZES,
    n=st.integers(1, 16),
    bw=st.floats(0.1, 60),
    nch=st.integers(1, 32),
    algos=st.sets(st.sampled_from(list(Algo)), min_size=1),
    protos=st.sets(st.sampled_from(list(Proto)), min_size=1),
    link=st.sampled_from(list(LinkType)),
    version=st.sampled_from([21805, 22203, 22304, 23007]),
)
def test_every_prediction_is_labelled_predicted(nbytes, n, bw, nch, algos, protos, link, version):
    i = ModelInputs(
        n_ranks=n,
        sm=89,
        bw_intra_gbps=bw,
        n_channels=nch,
        algos=algos,
        protos=protos,
        link=link,
        nccl_version=version,
        transport=Transport.P2P,
    )
    corrected = CorrectedModel(1.4, {LL: 0.55, S: 0.63}, fitted_on=Transport.SHM)
    for p in (M.predict(nbytes, i), corrected.predict(nbytes, i)):
        assert p.predicted is True and p.label == "predicted"
        assert p.time_us >= 0 and p.times_us[(p.algo, p.proto)] == p.time_us
        assert "predicted" in str(p)


def test_prediction_cannot_be_unlabelled():
    with pytest.raises(ValueError, match="predicted"):
        Prediction(nbytes=8, time_us=1.0, algo=R, proto=LL, times_us={(R, LL): 1.0}, predicted=False)
    with pytest.raises(ValueError, match="predicted"):
        Prediction(nbytes=8, time_us=1.0, algo=R, proto=LL, times_us={(R, LL): 1.0}, label="measured")


# ------------------------------------------------------------------------------------------------
# The correction
# ------------------------------------------------------------------------------------------------


class _Row:
    def __init__(self, size_bytes, oop_time_us):
        self.size_bytes, self.oop_time_us = size_bytes, oop_time_us


CAL_SIZES = [8 << k for k in range(20)]  # 8 B .. 4 MiB, like the tables


def test_corrected_model_by_hand():
    i = box8()
    c = CorrectedModel(1.5, {LL: 0.5, S: 0.7})
    t = c.times_us(57344, i)
    assert t[(R, LL)] == pytest.approx(20.6 + 14 * 1.5 + 57344 / (1000 * 6.857142857 * 0.5), rel=1e-6)
    assert t[(R, S)] == pytest.approx(88.2 + 14 * 1.5 + 57344 / (1000 * 13.71428571 * 0.7), rel=1e-6)
    assert c.bw_scale[LL128] == 0.7  # no data for LL128: Simple's factor
    p = c.predict(57344, i)
    assert (p.algo, p.proto) == (R, LL)  # NCCL's own pick, not the corrected minimum


def test_corrected_pick_follows_nccl_even_when_slower():
    # On the 4090 box the fitted bandwidths make Simple faster than LL from ~450 KB, but NCCL's own
    # model keeps LL to ~927 KB: the predicted time of what NCCL runs drops at its switch.
    i = M.inputs_for_pcie_box(8, gen=4, sm=89, p2p=False)
    c = CorrectedModel(1.43, {LL: 0.547, S: 0.626})
    before, after = c.predict(917504, i), c.predict(950000, i)
    assert before.proto is LL and after.proto is S
    assert before.times_us[(R, S)] < before.time_us
    assert after.time_us < before.time_us


def test_fit_recovers_known_parameters():
    i = M.inputs_for_pcie_box(8, gen=4, sm=89, p2p=False)
    truth = CorrectedModel(1.5, {LL: 0.5, S: 0.7})
    rows = [_Row(s, truth.predict(s, i).time_us) for s in CAL_SIZES]
    got = M.fit(rows, i)
    assert got.extra_hop_latency_us == pytest.approx(1.5, rel=1e-3)
    assert got.bw_scale[LL] == pytest.approx(0.5, rel=1e-3)
    assert got.bw_scale[S] == pytest.approx(0.7, rel=1e-3)
    assert got.fitted_protos == {LL, S} and got.fitted_on is Transport.SHM and got.n_rows == 20
    assert got.fit_rms_log_error < 1e-3


def test_fit_leaves_unseen_protocol_unfitted():
    i = M.inputs_for_pcie_box(8, gen=4, sm=89, p2p=True)
    truth = CorrectedModel(2.0, {LL: 0.6, S: 0.6})
    rows = [_Row(s, truth.predict(s, i).time_us) for s in CAL_SIZES[:15]]  # <= 128 KiB: LL only
    got = M.fit(rows, i)
    assert got.fitted_protos == {LL} and got.bw_scale[S] == 1.0
    assert got.extra_hop_latency_us == pytest.approx(2.0, rel=1e-3)


def test_fit_ignores_bandwidth_of_latency_bound_protocol():
    i = M.inputs_for_pcie_box(8, gen=4, sm=89, p2p=True)
    rows = [_Row(s, 40.0 + s / 1e9) for s in (8, 16, 32, 64, 128)]  # flat: LL rows, no bandwidth signal
    got = M.fit(rows, i)
    assert got.fitted_protos == frozenset() and got.bw_scale[LL] == 1.0
    assert 20.6 + 14 * got.extra_hop_latency_us == pytest.approx(40.0, abs=0.01)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 1 << 26), st.floats(0.5, 1e5)), min_size=4, max_size=25),
    n=st.integers(2, 16),
)
def test_fit_is_total_on_any_positive_rows(rows, n):
    i = M.inputs_for_pcie_box(n, gen=4, sm=89, p2p=True)
    got = M.fit([_Row(s, t) for s, t in rows], i)
    assert math.isfinite(got.extra_hop_latency_us) and math.isfinite(got.fit_rms_log_error)
    assert all(math.isfinite(v) and v > 0 for v in got.bw_scale.values())
    assert got.predict(1 << 20, i).time_us >= 0


def test_fit_rejects_bad_rows():
    i = box8()
    with pytest.raises(UserError, match="at least 4"):
        M.fit([_Row(8, 40.0)] * 3, i)
    with pytest.raises(UserError, match="row 1"):
        M.fit([_Row(8, 40.0), _Row(16, 0.0), _Row(32, 41.0), _Row(64, 42.0)], i)
    with pytest.raises(UserError, match="PerfRow"):
        M.fit([object()] * 4, i)


# ------------------------------------------------------------------------------------------------
# Held-out error on the measured tables (never judged on the fit data)
# ------------------------------------------------------------------------------------------------


def _table_rows(path: Path):
    from fastverify.nccl.perftable import parse_all_reduce_perf

    return [r for r in parse_all_reduce_perf(path.read_text()).rows if 8 <= r.size_bytes <= 4 << 20]


@pytest.fixture(scope="module")
def tables():
    if not (SHM_FILE.is_file() and P2P_FILE.is_file()):
        pytest.skip(f"{INPUTS} lacks the 8x RTX 4090 all_reduce_perf tables")
    return {Transport.SHM: _table_rows(SHM_FILE), Transport.P2P: _table_rows(P2P_FILE)}


def test_tables_are_what_the_files_say(tables):
    shm, p2p = tables[Transport.SHM], tables[Transport.P2P]
    assert [r.size_bytes for r in shm] == CAL_SIZES == [r.size_bytes for r in p2p]
    assert (shm[0].oop_time_us, shm[-1].oop_time_us) == (38.83, 580.8)
    assert (p2p[0].oop_time_us, p2p[-1].oop_time_us) == (38.82, 478.7)


@pytest.mark.parametrize(("fit_on", "test_on"), [(Transport.SHM, Transport.P2P), (Transport.P2P, Transport.SHM)])
def test_held_out_error(tables, fit_on, test_on):
    """Fit on one transport, judge on the other.

    Bound 10 % on the median |error|: half the issue's 20 % aim, about twice the gap between the two
    tables themselves (one table's measured times predict the other's with a 4.2-4.4 % median error),
    and about 1.5x what the fit reaches (4.7 % and 6.6 %). A correction that lost the shape of the
    curve (floor, LL slope, Simple slope, NCCL's LL -> Simple switch) would exceed it; run-to-run noise
    of a fixed table cannot (the data are fixed and the fit is deterministic). The max bound 30 % covers
    the bandwidth difference between transports that the correction deliberately does not model
    (4 MiB: +25 % SHM -> P2P).
    """
    box = dict(gen=4, width=16, sm=89)
    fit_inputs = M.inputs_for_pcie_box(8, **box, p2p=fit_on is Transport.P2P)
    test_inputs = M.inputs_for_pcie_box(8, **box, p2p=test_on is Transport.P2P)
    corrected = M.fit(tables[fit_on], fit_inputs)
    err, raw_err = [], []
    for r in tables[test_on]:
        p = corrected.predict(r.size_bytes, test_inputs)
        q = M.predict(r.size_bytes, test_inputs)
        assert p.label == q.label == "predicted"
        err.append(abs(p.time_us - r.oop_time_us) / r.oop_time_us)
        raw_err.append(abs(q.time_us - r.oop_time_us) / r.oop_time_us)
    assert statistics.median(err) < 0.10
    assert max(err) < 0.30
    # NCCL's raw model stays visibly wrong on this box (about -47 % to -51 % at the median).
    assert statistics.median(raw_err) > 0.40
    # The fitted extra latency per hop is physical: 1-2 µs over NCCL's 1.0 µs LL PCI hop.
    assert 0.5 < corrected.extra_hop_latency_us < 3.0


def test_bench_prints_median_error_lines(tables, capsys):
    spec = importlib.util.spec_from_file_location("_bench_model", REPO / "benchmarks" / "bench_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    rc = mod.main(["--shared", str(INPUTS.parent)])
    out = capsys.readouterr().out
    assert rc == 0
    for direction in ("fit SHM -> test P2P", "fit P2P -> test SHM"):
        m = re.search(rf"^{direction}: median error (\d+\.\d) %$", out, re.M)
        assert m and float(m.group(1)) <= 20.0
    assert len(re.findall(r"^NCCL raw model on (SHM|P2P) \(nothing fitted\): median error \d+\.\d %$", out, re.M)) == 2
    assert "#        (B)      (us)" in out  # units row


def test_bench_fails_clearly_without_inputs(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("_bench_model2", REPO / "benchmarks" / "bench_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    assert mod.main(["--shared", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks" in err[0] and str(tmp_path) in err[0]
