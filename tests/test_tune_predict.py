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
from fastverify.nccl.catalogue import Severity, validate_setting
from fastverify.nccl.version import NcclVersion
from fastverify.topo.diagnose import CALIBRATION
from fastverify.topo.matrix import parse_nvidia_smi_topo
from fastverify.tune.predict import (
    DEFAULT_ACCEPT_LENGTH,
    rank_nccl_settings,
    tuner_choices,
    verify_reduction,
)
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
    inputs = M.inputs_for_pcie_box(workload.tp, gen=4, width=16, sm=89, p2p=transport is M.Transport.P2P,
                                   version=version, algos=algos, protos=protos)
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
    assert base.allreduce_us == pytest.approx(
        _expected_us(kimi, M.Transport.SHM, {M.Algo.RING, M.Algo.TREE}, None))
    assert base.vs_baseline_pct == 0.0


def test_the_winner_follows_from_the_models_own_numbers(ranked, kimi):
    # Recompute every candidate from its settings with the model, independently of the ranking.
    def recomputed(c):
        transport = M.Transport(c.transport)
        proto = c.settings.get("NCCL_PROTO")
        algo = c.settings.get("NCCL_ALGO")
        protos = None if proto is None else {M.Proto.LL if proto.endswith("ll") else M.Proto.SIMPLE}
        algos = {M.Algo.RING, M.Algo.TREE} if algo is None else {M.Algo.RING if algo.endswith("ring") else M.Algo.TREE}
        return _expected_us(kimi, transport, algos, protos)

    for c in ranked:
        assert c.allreduce_us == pytest.approx(recomputed(c))
    best = ranked[0]
    assert best.allreduce_us == pytest.approx(min(recomputed(c) for c in ranked))
    # On this box the model prefers P2P over SHM at 57 KB, so the winner sets the P2P level that
    # moves the SYS pairs to P2P; checked from the two calibrated numbers, not assumed.
    shm = _expected_us(kimi, M.Transport.SHM, {M.Algo.RING, M.Algo.TREE}, None)
    p2p = _expected_us(kimi, M.Transport.P2P, {M.Algo.RING, M.Algo.TREE}, None)
    if p2p < shm:
        assert best.settings.get("NCCL_P2P_LEVEL") == "SYS" and best.transport == "P2P"
        assert best.p2p_pairs == best.pairs == 28
        assert best.vs_baseline_pct == pytest.approx(100 * (shm - p2p) / shm)
        assert any("driver allows it" in n for n in best.notes)  # unknown P2P support is said


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
        _expected_us(kimi, M.Transport.P2P, {M.Algo.RING, M.Algo.TREE}, {M.Proto.SIMPLE}))
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
    assert r["accept_length"] == DEFAULT_ACCEPT_LENGTH and r["t_rest_us"] == 0.0
    assert r["tok_s_baseline"] == pytest.approx(3.0 / 6000e-6)
    assert r["tok_s_predicted"] == pytest.approx(3.0 / 4500e-6)


def test_measured_verify_applies_the_predicted_ratio_to_the_measured_all_reduce():
    w = Workload(msg_sizes=((1024, 10),), tp=8, compute_us=5000.0, verify_us=30000.0, allreduce_us=24000.0,
                 clock="trace", accept_length=3.5)
    r = verify_reduction(w, 2000.0, 500.0)  # predicted: all-reduce time / 4
    assert r["verify_baseline_us"] == 30000.0 and r["verify_baseline_basis"].startswith("measured")
    assert r["verify_predicted_us"] == pytest.approx(30000.0 - 24000.0 * 0.75)
    assert r["accept_length"] == 3.5 and r["accept_length_source"] == "from the profile"


def test_tok_s_fixes_t_rest_as_in_the_plan():
    # plan §1.4: 82 tok/s, A = 3, verify 30 ms -> t_rest = 6.6 ms
    w = Workload(msg_sizes=((57344, 123),), tp=8, compute_us=5400.0, verify_us=30000.0, allreduce_us=24600.0,
                 clock="cuda_events")
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
    assert all(r.channels >= 1 and r.algorithm in ("ring", "tree") and r.protocol in ("ll", "simple")
               for r in rows)
    # each row's choice is the lowest corrected time at its lower size
    inputs = ranked[0].inputs
    model = CALIBRATION[M.Transport(ranked[0].transport)]
    for r in rows:
        times = model.times_us(max(r.min_bytes, 1), inputs)
        best = min(times.values())
        assert times[(M.Algo(r.algorithm.capitalize()), M.Proto("LL" if r.protocol == "ll" else "Simple"))] == best
