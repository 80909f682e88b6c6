"""Cost-model ranking of NCCL settings for a verify workload, and the verify / tok/s arithmetic.

Orderings are checked against the model's own per-setting numbers, recomputed here from
fastverify.nccl.model + diagnose.CALIBRATION, never against hard-coded winners.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fastverify.errors import UserError
from fastverify.live.config import load_model_config
from fastverify.nccl import model as M
from fastverify.nccl.checks import Severity, validate_setting
from fastverify.nccl.version import NcclVersion
from fastverify.topo.diagnose import CALIBRATION
from fastverify.topo.matrix import parse_nvidia_smi_topo
from fastverify.tune.predict import rank_nccl_settings, tuner_choices
from fastverify.tune.verify_time import DEFAULT_ACCEPT_LENGTH, verify_reduction
from fastverify.tune.workload import Workload, workload_from_model


@pytest.fixture(scope="module")
def topo_307(shared_dir) -> Path:
    return shared_dir / "inputs" / "topo-nccl-tests-307.txt"


@pytest.fixture(scope="module")
def kimi() -> Workload:
    return workload_from_model(load_model_config("kimi-k2"), tp=8, draft_tokens=4, batch=1)


@pytest.fixture(scope="module")
def ranked(kimi, topo_307):
    return rank_nccl_settings(kimi, topo_307, env={})


def _expected_us(workload, transport, algos, protos, version=M.DEFAULT_NCCL_VERSION):
    inputs = M.inputs_for_pcie_box(
        workload.tp,
        gen=4,
        width=16,
        sm=89,
        p2p=transport is M.Transport.P2P,
        version=version,
        algos=algos,
        protos=protos,
    )
    return sum(c * CALIBRATION[transport].predict(b, inputs).time_us for b, c in workload.msg_sizes)


def test_sorted_by_predicted_time_and_labelled(ranked):
    times = [c.allreduce_us for c in ranked]
    assert times == sorted(times)
    assert all(c.label == "predicted" for c in ranked)
    assert all(s.label == "predicted" for c in ranked for s in c.per_size)
    assert sum(c.is_baseline for c in ranked) == 1


def test_baseline_is_the_current_environment(ranked, kimi):
    base = next(c for c in ranked if c.is_baseline)
    assert dict(base.settings) == {}
    assert base.p2p_level == "PXB"  # NCCL's default with nothing set
    # PIX pairs inside each NUMA half are P2P, SYS pairs across are SHM -> the ring is SHM-paced.
    assert base.transport == "SHM" and base.pairs == 28 and base.p2p_pairs == 12
    assert base.allreduce_us == pytest.approx(_expected_us(kimi, M.Transport.SHM, {M.Algo.RING, M.Algo.TREE}, None))
    assert base.vs_baseline_pct == 0.0


def test_the_winner_follows_from_the_models_own_numbers(ranked, kimi):
    """The winner on the nccl-tests#307 box worked out by hand from the model's published inputs:
    NCCL 2.30.7's tuning.cc constants (PCI row), the ring graph NCCL's search gives a PCIe Gen4 x16
    GPU, and the PCIe correction fitted on the 8x RTX 4090 tables (δ per hop, β for LL). Every time
    here is predicted, µs."""
    n, hops = 8, 2 * (8 - 1)  # TP 8; a one-node all-reduce takes 2(n-1) = 14 steps (Ring and Tree)
    nbytes, count = 4 * 7168 * 2, 1 + 2 * 61  # 4 draft tokens x hidden 7168 x bf16; kimi-k2's 61 layers
    assert kimi.msg_sizes == ((nbytes, count),) == ((57344, 123),)
    ch, bw = 2, 12.0  # Gen4 x16 = 24 GB/s per GPU: the ring search settles on 2 channels x 12 GB/s
    bus = ch * bw
    # NCCL's own table at 57,344 B: it runs the smallest (transport-blind, so on SHM and P2P alike).
    ring_ll = 6.6 + hops * 1.0 + nbytes / (1000 * min(87.7, 0.5 * bus) * n / hops)  # 20.6 + 8.36 = 28.96
    ring_simple = 8.4 + hops * 5.7 + nbytes / (1000 * bus * n / hops)  # 88.2 + 4.18 = 92.38
    tree_bus = min(0.92 * bus, ch * 24.0)  # 22.08 GB/s; treeCorrectionFactor[.][log2(57344 >> 6) = 9]
    tree_ll = 6.8 + hops * 1.0 + nbytes / (1000 * min(tree_bus / 3.8, 87.7) / 2 * 0.7)  # 20.8 + 28.2 = 49.0
    tree_simple = 8.4 + hops * 4.0 + nbytes / (1000 * tree_bus / 2 * 0.6)  # 64.4 + 8.66 = 73.06
    assert min(ring_ll, ring_simple, tree_ll, tree_simple) == ring_ll == pytest.approx(28.963, abs=1e-3)

    # The correction on the pair NCCL runs: lat + δ·hops, LL bandwidth × β_LL (fitted numbers, pinned here).
    fit = {
        M.Transport.SHM: (1.427508763214285, 0.5471045232094344),
        M.Transport.P2P: (1.363210043928571, 0.5870247488345354),
    }
    for transport, (delta, beta) in fit.items():
        assert (CALIBRATION[transport].extra_hop_latency_us, CALIBRATION[transport].bw_scale[M.Proto.LL]) == (
            delta,
            beta,
        )

    def corrected_ring_ll(delta, beta):
        return 6.6 + hops * (1.0 + delta) + nbytes / (1000 * beta * min(87.7, 0.5 * bus) * n / hops)

    shm = corrected_ring_ll(*fit[M.Transport.SHM])  # 40.585 + 15.285 = 55.870 per call
    p2p = corrected_ring_ll(*fit[M.Transport.P2P])  # 39.685 + 14.246 = 53.931 per call
    assert (shm, p2p) == (pytest.approx(55.8704, abs=1e-3), pytest.approx(53.9308, abs=1e-3))

    # P2P for the 16 SYS pairs is faster: the winner is NCCL_P2P_LEVEL=SYS, ahead of the SHM baseline.
    best, runner_up = ranked[0], ranked[1]
    assert dict(best.settings) == {"NCCL_P2P_LEVEL": "SYS"} and best.transport == "P2P" and best.label == "predicted"
    assert best.p2p_pairs == best.pairs == 28
    assert best.allreduce_us == pytest.approx(count * p2p)  # 6,633.5 µs per verify step, predicted
    assert runner_up.is_baseline and runner_up.allreduce_us == pytest.approx(count * shm)  # 6,872.1 µs, predicted
    assert best.vs_baseline_pct == pytest.approx(100 * (shm - p2p) / shm) == pytest.approx(3.4717, abs=1e-3)
    assert any("driver allows it" in note for note in best.notes)  # unknown P2P support is said


def test_phb_is_not_a_candidate_when_it_moves_no_pair(ranked):
    # PIX and SYS pairs only: PHB changes nothing against the default PXB.
    assert not any(c.settings.get("NCCL_P2P_LEVEL") == "PHB" for c in ranked)


def test_every_candidate_setting_passes_the_catalogue(ranked):
    for c in ranked:
        for k, v in c.settings.items():
            assert validate_setting(k, v, None).severity is not Severity.ERROR, (k, v)


def test_no_two_candidates_predict_the_same_behaviour(ranked):
    keys = [(c.transport, c.p2p_pairs, c.per_size) for c in ranked]
    assert len(keys) == len(set(keys))


def test_grammar_follows_the_nccl_version(kimi, topo_307):
    new = rank_nccl_settings(kimi, topo_307, env={}, nccl_version="2.27.3")
    old = rank_nccl_settings(kimi, topo_307, env={}, nccl_version=NcclVersion.of(2, 21, 5))
    new_algos = {c.settings["NCCL_ALGO"] for c in new if "NCCL_ALGO" in c.settings}
    old_algos = {c.settings["NCCL_ALGO"] for c in old if "NCCL_ALGO" in c.settings}
    assert new_algos and all(v.startswith("allreduce:") for v in new_algos)
    assert old_algos and all(":" not in v for v in old_algos)
    for c in old:
        for k, v in c.settings.items():
            assert validate_setting(k, v, NcclVersion.of(2, 21, 5)).severity is not Severity.ERROR


def test_current_environment_is_respected(kimi, topo_307):
    ranked = rank_nccl_settings(kimi, topo_307, env={"NCCL_P2P_LEVEL": "SYS", "NCCL_PROTO": "Simple"})
    base = next(c for c in ranked if c.is_baseline)
    assert base.transport == "P2P" and base.p2p_level == "SYS"
    assert base.allreduce_us == pytest.approx(
        _expected_us(kimi, M.Transport.P2P, {M.Algo.RING, M.Algo.TREE}, {M.Proto.SIMPLE})
    )
    # the level is already SYS: no candidate sets it again; PHB would move the SYS pairs back to SHM
    assert not any(c.settings.get("NCCL_P2P_LEVEL") == "SYS" for c in ranked)
    assert all(c.transport == "SHM" for c in ranked if c.settings.get("NCCL_P2P_LEVEL") == "PHB")


def test_profile_workload_and_a_subset_of_gpus(topo_307):
    w = Workload(msg_sizes=((5_114_880, 37), (5_455_872, 36)), tp=4, source="t")
    ranked = rank_nccl_settings(w, topo_307, env={})
    base = next(c for c in ranked if c.is_baseline)
    # GPUs 0-3 share one PCIe switch (PIX): all P2P already, no level candidate.
    assert base.transport == "P2P" and base.pairs == 6
    assert not any("NCCL_P2P_LEVEL" in c.settings for c in ranked)


def test_errors(kimi, topo_307, tmp_path):
    with pytest.raises(UserError, match="only 8 GPU"):
        rank_nccl_settings(Workload(msg_sizes=((1024, 1),), tp=16), topo_307, env={})
    bad = tmp_path / "t.txt"
    bad.write_text("nothing here\n")
    with pytest.raises(UserError, match="GPU0"):
        rank_nccl_settings(kimi, bad, env={})
    with pytest.raises(UserError, match="cannot read topology"):
        rank_nccl_settings(kimi, tmp_path / "missing.txt", env={})


def test_accepts_a_parsed_topology(kimi, topo_307, ranked):
    topo = parse_nvidia_smi_topo(topo_307.read_text(), source="x")
    again = rank_nccl_settings(kimi, topo, env={})
    assert [c.name for c in again] == [c.name for c in ranked]


# --- verify_reduction ------------------------------------------------------------------------------


def test_model_workload_reduction_is_all_reduce_only_upper_bound(kimi):
    r = verify_reduction(kimi, 6000.0, 4500.0)
    assert r["label"] == "predicted"
    assert r["verify_baseline_us"] == 6000.0 and r["verify_predicted_us"] == 4500.0
    assert r["verify_reduction_pct"] == pytest.approx(25.0)
    assert "upper bound" in r["verify_baseline_basis"]
    # no --tok-s and no cycle time: t_rest is unknown, so there is no tok/s at all (not an upper bound)
    assert r["accept_length"] == DEFAULT_ACCEPT_LENGTH and r["t_rest_us"] is None
    assert r["tok_s_baseline"] is None and r["tok_s_predicted"] is None
    assert "no tok/s" in r["t_rest_basis"] and "--tok-s" in r["t_rest_basis"]
    # with a measured rate the all-reduce-only verify gives t_rest = A / tok_s - 6 ms
    r = verify_reduction(kimi, 6000.0, 4500.0, tok_s=400.0)
    assert r["t_rest_us"] == pytest.approx(3.0 / 400.0 * 1e6 - 6000.0)  # 1,500 us
    assert r["tok_s_predicted"] == pytest.approx(3.0 / (1500e-6 + 4500e-6))  # 500 tok/s


def test_measured_verify_applies_the_predicted_ratio_to_the_measured_all_reduce():
    w = Workload(
        msg_sizes=((1024, 10),),
        tp=8,
        compute_us=5000.0,
        verify_us=30000.0,
        allreduce_us=24000.0,
        clock="trace",
        accept_length=3.5,
    )
    r = verify_reduction(w, 2000.0, 500.0)  # predicted: all-reduce time / 4
    assert r["verify_baseline_us"] == 30000.0 and r["verify_baseline_basis"].startswith("measured")
    assert r["verify_predicted_us"] == pytest.approx(30000.0 - 24000.0 * 0.75)
    assert r["accept_length"] == 3.5 and r["accept_length_source"] == "from the profile"


def test_tok_s_fixes_t_rest_as_in_the_plan():
    # plan §1.4: 82 tok/s, A = 3, verify 30 ms -> t_rest = 6.6 ms
    w = Workload(
        msg_sizes=((57344, 123),), tp=8, compute_us=5400.0, verify_us=30000.0, allreduce_us=24600.0, clock="cuda_events"
    )
    r = verify_reduction(w, 24600.0, 18000.0, accept_length=3.0, tok_s=82.0)
    assert r["t_rest_us"] == pytest.approx(3.0 / 82.0 * 1e6 - 30000.0)
    assert r["tok_s_baseline"] == pytest.approx(82.0)
    assert r["tok_s_predicted"] == pytest.approx(3.0 / ((r["t_rest_us"] + r["verify_predicted_us"]) * 1e-6))
    assert r["tok_s_predicted"] > 82.0


def test_cpu_wall_clock_times_are_not_used():
    w = Workload(msg_sizes=((1024, 10),), tp=2, compute_us=1e6, verify_us=2e6, clock="cpu_wall_clock")
    r = verify_reduction(w, 100.0, 50.0)
    assert r["verify_baseline_us"] == 100.0 and any("not GPU timings" in n for n in r["notes"])


@pytest.mark.parametrize("kw", [{"accept_length": 0.5}, {"tok_s": -1.0}, {"tok_s": 1e9}])
def test_bad_accept_length_or_tok_s(kimi, kw):
    with pytest.raises(UserError):
        verify_reduction(kimi, 6000.0, 4500.0, **kw)


# --- tuner table ---------------------------------------------------------------------------------------


def test_tuner_choices_cover_every_size_with_explicit_channels(ranked):
    rows = tuner_choices(ranked[0])
    assert rows[0].min_bytes == 0 and rows[-1].max_bytes == 2**63 - 1
    for a, b in zip(rows, rows[1:]):
        assert b.min_bytes == a.max_bytes + 1
    assert all(r.channels >= 1 and r.algorithm in ("ring", "tree") and r.protocol in ("ll", "simple") for r in rows)
    # each row's choice is the lowest corrected time at its lower size
    inputs = ranked[0].inputs
    model = CALIBRATION[M.Transport(ranked[0].transport)]
    for r in rows:
        times = model.times_us(max(r.min_bytes, 1), inputs)
        best = min(times.values())
        assert times[(M.Algo(r.algorithm.capitalize()), M.Proto("LL" if r.protocol == "ll" else "Simple"))] == best
