"""`fastverify topo`: the diagnosis on the real inputs in ../shared/inputs, values read off the files.

topo-nccl-tests-307.txt: GPUs 0-3 and 4-7 each share a PCIe switch (PIX), the two groups are SYS.
topo-blog-chlc-rtx4090.txt: every pair SYS (one GPU per NUMA node).
nccldebug-nccl-1027.txt: ring 0..7; 0->1, 2->3, 6->7 'P2P/direct pointer/read', 1->2, 5->6
'P2P/direct pointer', 3->4 'SHM/direct/direct'.
"""

from __future__ import annotations

import json
from itertools import combinations

import pytest

from conftest import assert_user_error, run_fastverify
from fastverify.nccl.logparse import parse_nccl_log
from fastverify.topo.diagnose import CALIBRATION, current_p2p_level, diagnose
from fastverify.topo.matrix import parse_nvidia_smi_topo

GROUP_A, GROUP_B = range(0, 4), range(4, 8)


@pytest.fixture(scope="module")
def inputs(shared_dir):
    d = shared_dir / "inputs"
    return {
        "307": parse_nvidia_smi_topo((d / "topo-nccl-tests-307.txt").read_text(), source="307"),
        "chlc": parse_nvidia_smi_topo((d / "topo-blog-chlc-rtx4090.txt").read_text(), source="chlc"),
        "1027": parse_nccl_log((d / "nccldebug-nccl-1027.txt").read_text(), source="1027"),
    }


def _transport(d, a, b):
    return next(p for p in d.pairs if (p.a, p.b) == (a, b))


def test_switch_pairs_p2p_cross_socket_shm_by_default(inputs):
    d = diagnose(inputs["307"], None, {})
    assert d.n_gpus == 8 and len(d.pairs) == 28
    for a, b in combinations(range(8), 2):
        same_switch = (a in GROUP_A) == (b in GROUP_A)
        p = _transport(d, a, b)
        assert p.link == ("PIX" if same_switch else "SYS")
        assert p.transport_now == ("P2P" if same_switch else "SHM"), (a, b)
        assert not p.seen
    assert d.p2p_level_now == "PXB" and d.p2p_level_recommended == "SYS"
    assert all(p.transport_recommended == "P2P" for p in d.pairs)
    assert any("16 pair(s) now on SHM would use P2P" in a for a in d.actions)  # 4 x 4 cross-switch pairs


def test_all_sys_box_needs_level_sys(inputs):
    d = diagnose(inputs["chlc"], None, {})
    assert {p.transport_now for p in d.pairs} == {"SHM"} and len(d.pairs) == 28
    assert d.p2p_level_recommended == "SYS"
    d2 = diagnose(inputs["chlc"], None, {"NCCL_P2P_LEVEL": "SYS"})
    assert {p.transport_now for p in d2.pairs} == {"P2P"}
    assert d2.p2p_level_recommended is None


def test_lower_case_level_is_ignored_by_nccl_and_reported(inputs):
    d = diagnose(inputs["chlc"], None, {"NCCL_P2P_LEVEL": "sys"})
    assert d.p2p_level_now == "PXB"  # NCCL's strcmp does not match 'sys'
    assert {p.transport_now for p in d.pairs} == {"SHM"}
    assert any(f.name == "NCCL_P2P_LEVEL" and f.severity.value == "error" for f in d.findings)
    assert any(a.startswith("fix NCCL_P2P_LEVEL='sys'") for a in d.actions)


@pytest.mark.parametrize("env, level", [
    ({}, "PXB"), ({"NCCL_P2P_LEVEL": "PHB"}, "PHB"), ({"NCCL_P2P_LEVEL": "4"}, "SYS"),
    ({"NCCL_P2P_LEVEL": "2"}, "PXB"), ({"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "SYS"}, "LOC"),
    ({"NCCL_P2P_LEVEL": "Sys"}, "PXB"),
])
def test_current_level(env, level):
    assert current_p2p_level(env)[0] == level


def test_p2p_disabled_puts_switch_pairs_on_shm(inputs):
    d = diagnose(inputs["307"], None, {"NCCL_P2P_DISABLE": "1"})
    assert {p.transport_now for p in d.pairs} == {"SHM"}


def test_log_transports_are_reported_as_seen(inputs):
    d = diagnose(None, inputs["1027"], {})
    got = {(p.a, p.b): p.transport_now for p in d.pairs}
    assert got == {(0, 1): "P2P", (1, 2): "P2P", (2, 3): "P2P", (3, 4): "SHM", (5, 6): "P2P", (6, 7): "P2P"}
    assert all(p.seen for p in d.pairs)
    assert any("3-4" in a for a in d.actions)


def test_driver_without_p2p_blocks_ipc_allreduce(inputs):
    t = inputs["307"]
    pairs = [(a, b) for a in range(8) for b in range(8) if a != b]
    no_p2p = type(t)(gpus=t.gpus, links=t.links, p2p_read={k: False for k in pairs},
                     p2p_write={k: False for k in pairs}, source="nvml-like")
    d = diagnose(no_p2p, None, {})
    assert d.pcie_ipc_allreduce["possible"] is False
    assert d.p2p_level_recommended is None  # no level helps pairs the driver refuses
    assert {p.transport_now for p in d.pairs} == {"SHM"}
    yes_p2p = type(t)(gpus=t.gpus, links=t.links, p2p_read={k: True for k in pairs},
                      p2p_write={k: True for k in pairs}, source="nvml-like")
    assert diagnose(yes_p2p, None, {}).pcie_ipc_allreduce["possible"] is True
    assert diagnose(t, None, {}).pcie_ipc_allreduce["possible"] is None  # offline text: unknown


def test_predictions_are_labelled_and_sized_from_the_verify_shape(inputs):
    d = diagnose(inputs["307"], None, {}, hidden=7168, draft_tokens=4, batches=(1, 8))
    assert [(p.tokens, p.msg_bytes) for p in d.predictions] == [(4, 57344), (32, 458752)]
    assert all(p.label == "predicted" for p in d.predictions)
    assert "predicted" in d.prediction_note
    # P2P calibration has the higher bandwidth scale, so the recommended (all-P2P) ring is not slower
    assert all(p.recommended_us <= p.now_us for p in d.predictions)


def test_embedded_calibration_matches_a_fresh_fit(shared_dir):
    from fastverify.nccl import model as M
    from fastverify.nccl.perftable import parse_all_reduce_perf

    files = {M.Transport.SHM: "allreduceperf-blog-chlc-rtx4090-p2pdisabled.txt",
             M.Transport.P2P: "allreduceperf-blog-chlc-rtx4090-p2punlocked.txt"}
    for transport, name in files.items():
        table = parse_all_reduce_perf((shared_dir / "inputs" / name).read_text(), source=name)
        rows = [r for r in table.rows if M.CALIBRATION_MIN_BYTES <= r.size_bytes <= M.CALIBRATION_MAX_BYTES]
        fitted = M.fit(rows, M.inputs_for_pcie_box(8, gen=4, width=16, sm=89, p2p=transport is M.Transport.P2P))
        emb = CALIBRATION[transport]
        assert fitted.extra_hop_latency_us == pytest.approx(emb.extra_hop_latency_us, rel=1e-9)
        for proto in (M.Proto.LL, M.Proto.SIMPLE):
            assert fitted.bw_scale[proto] == pytest.approx(emb.bw_scale[proto], rel=1e-9)


# --- the command line -------------------------------------------------------------------------


def test_cli_json_on_real_inputs(shared_dir, tmp_path):
    d = shared_dir / "inputs"
    proc = run_fastverify(["topo", "--nvidia-smi", str(d / "topo-nccl-tests-307.txt"), "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["p2p_level_recommended"] == "SYS"
    assert sum(p["transport_now"] == "SHM" for p in doc["pairs"]) == 16
    assert all(p["label"] == "predicted" for p in doc["predictions"])


def test_cli_without_gpu_or_input_points_at_offline_options(tmp_path):
    proc = run_fastverify(["topo"], cwd=tmp_path)
    assert_user_error(proc, "--nvidia-smi", "--nccl-log")


def test_cli_malformed_topology(tmp_path):
    (tmp_path / "t.txt").write_text("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tPIX\n")
    assert_user_error(run_fastverify(["topo", "--nvidia-smi", "t.txt"], cwd=tmp_path), "t.txt")


def test_cli_truncated_log(shared_dir, tmp_path):
    text = (shared_dir / "inputs" / "nccldebug-nccl-1027.txt").read_text()
    (tmp_path / "cut.log").write_text(text[: len(text) // 2 + 7])
    assert_user_error(run_fastverify(["topo", "--nccl-log", "cut.log"], cwd=tmp_path), "cut.log", "truncated")


def test_cli_log_without_nccl_lines(tmp_path):
    (tmp_path / "x.log").write_text("hello\nworld\n")
    assert_user_error(run_fastverify(["topo", "--nccl-log", "x.log"], cwd=tmp_path), "x.log")


@pytest.mark.parametrize("setting, words", [
    ("NCCL_PROTOCOL=LL", ["NCCL_PROTOCOL", "NCCL_PROTO"]),
    ("NCCL_P2P_LEVEL=sys", ["NCCL_P2P_LEVEL", "SYS"]),
    ("NCCL_NTHREADS=1000", ["NCCL_NTHREADS", "1000"]),
    ("NCCL_MAX_NCHANNELS=99", ["NCCL_MAX_NCHANNELS", "99"]),
    ("NCCL_PROTO", ["NAME=VALUE"]),
])
def test_cli_rejects_bad_settings(shared_dir, tmp_path, setting, words):
    d = shared_dir / "inputs"
    proc = run_fastverify(["topo", "--nvidia-smi", str(d / "topo-blog-chlc-rtx4090.txt"), "--set", setting],
                          cwd=tmp_path)
    assert_user_error(proc, *words)


def test_cli_set_changes_the_diagnosis(shared_dir, tmp_path):
    d = shared_dir / "inputs"
    proc = run_fastverify(["topo", "--nvidia-smi", str(d / "topo-blog-chlc-rtx4090.txt"), "--set",
                           "NCCL_P2P_LEVEL=SYS", "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["p2p_level_now"] == "SYS" and doc["p2p_level_recommended"] is None
    assert {p["transport_now"] for p in doc["pairs"]} == {"P2P"}


def test_log_paths_show_switch_pairs_without_p2p(inputs, shared_dir):
    """nccldebug-nccl-tests-307.txt: NCCL lists GPU/0-ce000..d1000 (ranks 4-7, one PCIe switch, PIX in
    the matrix) as 4/24.0/PHB to each other: it found no P2P and routed them through the CPU."""
    log = parse_nccl_log((shared_dir / "inputs" / "nccldebug-nccl-tests-307.txt").read_text(), source="307log")
    d = diagnose(inputs["307"], log, {})
    for a, b in combinations(GROUP_B, 2):
        p = _transport(d, a, b)
        assert (p.link, p.nccl_path, p.hw_p2p, p.transport_now) == ("PIX", "PHB", False, "SHM"), (a, b)
    for a, b in combinations(GROUP_A, 2):  # not in the log: still predicted from the matrix
        assert _transport(d, a, b).transport_now == "P2P"
    assert any("6 pair(s) cannot use P2P" in a for a in d.actions)


def test_log_env_is_what_nccl_ran_with(inputs):
    import dataclasses

    log = dataclasses.replace(inputs["1027"], env={"NCCL_P2P_LEVEL": "SYS"})
    d = diagnose(None, log, {})
    assert d.p2p_level_now == "SYS" and d.p2p_level_now_source == "NCCL_P2P_LEVEL=SYS"


def test_p2p_disable_action(inputs):
    d = diagnose(inputs["chlc"], None, {"NCCL_P2P_DISABLE": "1"})
    assert any(a.startswith("NCCL_P2P_DISABLE=1 turns P2P off") for a in d.actions)
    assert not any("NCCL_P2P_LEVEL=SYS:" in a for a in d.actions)


def test_nvlink_box_gets_no_pcie_prediction():
    text = "\tGPU0\tGPU1\nGPU0\t X \tNV12\nGPU1\tNV12\t X \n"
    d = diagnose(parse_nvidia_smi_topo(text, source="nv"), None, {})
    assert d.predictions == [] and "NVLink" in d.prediction_note


def test_log_without_pairs_is_an_error(tmp_path):
    (tmp_path / "x.log").write_text("host0:1:2 [0] NCCL INFO NCCL version 2.27.5+cuda12.9\n")
    assert_user_error(run_fastverify(["topo", "--nccl-log", "x.log"], cwd=tmp_path), "x.log", "no GPU pairs")


def test_cli_bounds(shared_dir, tmp_path):
    t = str(shared_dir / "inputs" / "topo-blog-chlc-rtx4090.txt")
    assert_user_error(run_fastverify(["topo", "--nvidia-smi", t, "--sm", "999"], cwd=tmp_path), "--sm", "999")
    assert_user_error(run_fastverify(["topo", "--nvidia-smi", t, "--batch", "100000000"], cwd=tmp_path), "--batch")
