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

from fastverify.nccl.debuglog import parse_nccl_log
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


@pytest.mark.parametrize(
    "env, level",
    [
        ({}, "PXB"),
        ({"NCCL_P2P_LEVEL": "PHB"}, "PHB"),
        ({"NCCL_P2P_LEVEL": "4"}, "SYS"),
        ({"NCCL_P2P_LEVEL": "2"}, "PXB"),
        ({"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "SYS"}, "LOC"),
        ({"NCCL_P2P_LEVEL": "Sys"}, "PXB"),
    ],
)
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
    no_p2p = type(t)(
        gpus=t.gpus,
        links=t.links,
        p2p_read={k: False for k in pairs},
        p2p_write={k: False for k in pairs},
        source="nvml-like",
    )
    d = diagnose(no_p2p, None, {})
    assert d.pcie_ipc_allreduce["possible"] is False
    assert d.p2p_level_recommended is None  # no level helps pairs the driver refuses
    assert {p.transport_now for p in d.pairs} == {"SHM"}
    yes_p2p = type(t)(
        gpus=t.gpus,
        links=t.links,
        p2p_read={k: True for k in pairs},
        p2p_write={k: True for k in pairs},
        source="nvml-like",
    )
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

    files = {
        M.Transport.SHM: "allreduceperf-blog-chlc-rtx4090-p2pdisabled.txt",
        M.Transport.P2P: "allreduceperf-blog-chlc-rtx4090-p2punlocked.txt",
    }
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


@pytest.mark.parametrize(
    "setting, words",
    [
        ("NCCL_PROTOCOL=LL", ["NCCL_PROTOCOL", "NCCL_PROTO"]),
        ("NCCL_P2P_LEVEL=sys", ["NCCL_P2P_LEVEL", "SYS"]),
        ("NCCL_NTHREADS=1000", ["NCCL_NTHREADS", "1000"]),
        ("NCCL_MAX_NCHANNELS=99", ["NCCL_MAX_NCHANNELS", "99"]),
        ("NCCL_PROTO", ["NAME=VALUE"]),
    ],
)
def test_cli_rejects_bad_settings(shared_dir, tmp_path, setting, words):
    d = shared_dir / "inputs"
    proc = run_fastverify(
        ["topo", "--nvidia-smi", str(d / "topo-blog-chlc-rtx4090.txt"), "--set", setting], cwd=tmp_path
    )
    assert_user_error(proc, *words)


def test_cli_set_changes_the_diagnosis(shared_dir, tmp_path):
    d = shared_dir / "inputs"
    proc = run_fastverify(
        ["topo", "--nvidia-smi", str(d / "topo-blog-chlc-rtx4090.txt"), "--set", "NCCL_P2P_LEVEL=SYS", "--json"],
        cwd=tmp_path,
    )
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


def test_log_without_pairs_is_a_partial_diagnosis(tmp_path):
    # issue 11 §3: partial evidence gives a partial diagnosis, never a refusal (was: exit 2 "no GPU pairs")
    (tmp_path / "x.log").write_text("host0:1:2 [0] NCCL INFO NCCL version 2.27.5+cuda12.9\n")
    proc = run_fastverify(["topo", "--nccl-log", "x.log"], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "GPU count unknown" in proc.stdout and "NCCL 2.27.5" in proc.stdout
    assert "partial: the log shows no GPU pair" in proc.stdout and "it holds the version" in proc.stdout


def test_cli_bounds(shared_dir, tmp_path):
    t = str(shared_dir / "inputs" / "topo-blog-chlc-rtx4090.txt")
    assert_user_error(run_fastverify(["topo", "--nvidia-smi", t, "--sm", "999"], cwd=tmp_path), "--sm", "999")
    assert_user_error(run_fastverify(["topo", "--nvidia-smi", t, "--batch", "100000000"], cwd=tmp_path), "--batch")


# --------------------------------------------------------------------------------------------
# Issue 11 §3: partial evidence, disagreements between evidence, the user's own measurements

LOC_LOG = "".join(f"host0:4242:{4300 + r} [{r}] NCCL INFO NCCL_P2P_LEVEL set by environment to LOC\n" for r in range(8))


def test_log_with_only_p2p_level_loc_puts_every_pair_on_shm(tmp_path):
    log = parse_nccl_log(LOC_LOG, source="loc.log")
    d = diagnose(None, log, {})
    assert d.n_gpus == 8 and len(d.pairs) == 28  # the 8 devices that printed, C(8, 2) pairs
    assert {(p.transport_now, p.transport_recommended, p.basis) for p in d.pairs} == {
        ("SHM", "SHM", "environment: NCCL_P2P_LEVEL=LOC")
    }
    assert (d.p2p_level_now, d.p2p_level_now_source) == ("LOC", "NCCL_P2P_LEVEL=LOC")
    assert any(a.startswith("NCCL_P2P_LEVEL=LOC turns P2P off for every pair") for a in d.actions)
    # the SHM model for 8 ranks, as for any all-SHM box
    assert (
        d.predictions
        and d.predictions[0].now_us
        == diagnose(
            parse_nvidia_smi_topo(
                "\t"
                + "\t".join(f"GPU{i}" for i in range(8))
                + "\n"
                + "".join(
                    f"GPU{i}\t" + "\t".join(" X " if i == j else "SYS" for j in range(8)) + "\n" for i in range(8)
                ),
                source="s",
            ),
            None,
            {},
        )
        .predictions[0]
        .now_us
    )
    (tmp_path / "loc.log").write_text(LOC_LOG)
    proc = run_fastverify(["topo", "--nccl-log", "loc.log"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "environment:" in proc.stdout and "8 GPU(s)" in proc.stdout


def test_one_line_loc_log_is_partial_with_unknown_gpu_count(tmp_path):
    log = parse_nccl_log(LOC_LOG.splitlines(keepends=True)[0], source="loc1.log")
    d = diagnose(None, log, {})
    assert d.n_gpus == 0 and d.pairs == [] and d.predictions == []
    assert any("NCCL_P2P_LEVEL=LOC (P2P disabled) puts every pair on SHM" in n for n in d.log_notes)
    assert d.pcie_ipc_allreduce["possible"] is None and d.custom_allreduce["possible"] is None


def _ring_only_tuning_log(prefix="host0:1:2 [0] NCCL INFO "):
    head = [
        "  Algorithm   |" + "".join(" %14s   %14s   %14s |" % ("", a, "") for a in ("Tree", "Ring", "CollNetDirect")),
        "  Protocol    |" + "".join(" %14s |" % p for _ in range(3) for p in ("LL", "LL128", "Simple")),
        " Max NThreads |" + "".join(" %14d |" % n for n in (0, 0, 0, 512, 0, 512, 0, 0, 0)),
    ]
    row = "%13s |" % "AllReduce" + "".join(
        "%8.1f/%6.1f |" % c for c in [(0.0, 0.0)] * 3 + [(6.6, 4.0), (0.0, 0.0), (29.0, 12.0)] + [(0.0, 0.0)] * 3
    )
    calls = ["AllReduce: 57344 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}"] * 3 + [
        "AllReduce: 229376 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..1}"
    ]
    return "".join(prefix + m + "\n" for m in (*head, row, *calls))


def test_log_with_only_the_tuning_table_reports_it(tmp_path):
    log = parse_nccl_log(_ring_only_tuning_log(), source="tuning.log")
    d = diagnose(None, log, {}, batches=(1, 2, 4))
    tu = d.nccl_tuning
    assert tu["model_table"] == [
        {"algo": "RING", "proto": "LL", "latency_us": 6.6, "algbw_gbps": 4.0},
        {"algo": "RING", "proto": "SIMPLE", "latency_us": 29.0, "algbw_gbps": 12.0},
    ]
    # by hand, lat + bytes / (1000 * algBw): 57344 B: LL 6.6 + 14.336 = 20.9 < Simple 29 + 4.779 = 33.8;
    # 114688 B: LL 35.3 < Simple 38.6; 229376 B: LL 63.9 > Simple 29 + 19.115 = 48.1
    assert [(v["msg_bytes"], v["algo_proto"], v["time_us"]) for v in tu["verify_choice"]] == [
        (57344, "RING/LL", 20.9),
        (114688, "RING/LL", 35.3),
        (229376, "RING/SIMPLE", 48.1),
    ]
    assert all(v["label"] == "predicted" for v in tu["verify_choice"])
    assert [(c["size_bytes"], c["algo"], c["proto"]) for c in tu["launched"]] == [
        (57344, "RING", "LL"),
        (229376, "RING", "SIMPLE"),
    ]
    # an NCCL_PROTO being evaluated restricts the table's cells: Simple only -> 33.8 at 57344 B
    d2 = diagnose(None, log, {"NCCL_PROTO": "Simple"}, batches=(1,))
    assert [(v["algo_proto"], v["time_us"]) for v in d2.nccl_tuning["verify_choice"]] == [("RING/SIMPLE", 33.8)]
    (tmp_path / "tuning.log").write_text(_ring_only_tuning_log())
    proc = run_fastverify(["topo", "--nccl-log", "tuning.log"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "NCCL's model table (TUNING, AllReduce): RING/LL 6.6 µs + size/4 GB/s" in proc.stdout
    assert "57,344 B -> RING/LL" in proc.stdout


MIXED_LOG = (
    "host0:100:200 [0] NCCL INFO NCCL version 2.21.5+cuda12.4\n"
    "host0:100:200 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct/direct\n"
    "host0:100:201 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[2] via P2P/CUMEM\n"
    "host0:100:207 [7] NCCL INFO Channel 00/0 : 7[7] -> 0[99] via P2P/CUMEM\n"
)


def test_gpu_outside_the_topology_is_a_warning_and_the_rest_is_kept(inputs):
    d = diagnose(inputs["307"], parse_nccl_log(MIXED_LOG, source="mixed.log"), {})
    stray = [w for w in d.warnings if "names GPU(s) 99" in w]
    assert len(stray) == 1 and "(line 4)" in stray[0] and "307" in stray[0] and "GPUs 0-7" in stray[0]
    assert len(d.pairs) == 28
    assert (_transport(d, 1, 2).transport_now, _transport(d, 1, 2).seen) == ("P2P", True)


def test_log_shm_at_pix_beats_the_topology_recommendation(inputs):
    # 0-1 share a switch (PIX, within the default PXB): the topology alone says P2P; the log shows SHM
    before = _transport(diagnose(inputs["307"], None, {}), 0, 1)
    assert (before.transport_now, before.transport_recommended) == ("P2P", "P2P")
    d = diagnose(inputs["307"], parse_nccl_log(MIXED_LOG, source="mixed.log"), {})
    p = _transport(d, 0, 1)
    assert (p.link, p.transport_now, p.transport_recommended, p.hw_p2p, p.seen) == ("PIX", "SHM", "SHM", False, True)
    assert any("shows SHM for pair(s) 0-1" in w and "NCCL_P2P_LEVEL=PXB" in w for w in d.warnings)
    assert d.pcie_ipc_allreduce["possible"] is False
    # the other pairs keep the topology's answer
    assert _transport(d, 0, 2).transport_recommended == "P2P" and d.p2p_level_recommended == "SYS"


def test_log_p2p_where_the_level_forbids_it_is_a_warning(inputs):
    log = parse_nccl_log("host0:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 4[4] via P2P/CUMEM\n", source="x.log")
    d = diagnose(inputs["307"], log, {})
    assert _transport(d, 0, 4).transport_now == "P2P"  # the log's transport is shown
    assert any("shows P2P for pair(s) 0-4" in w and "other settings" in w for w in d.warnings)


def test_perf_table_gives_measured_verify_times(shared_dir, inputs):
    from fastverify.nccl.perftable import parse_all_reduce_perf

    f = shared_dir / "inputs" / "allreduceperf-blog-chlc-rtx4090-p2pdisabled.txt"
    perf = parse_all_reduce_perf(f.read_text(), source=str(f))
    d = diagnose(inputs["chlc"], None, {}, batches=(1, 16), perf=perf)
    # the in-place columns (SGLang's all-reduce is in place): 57344 B between the 32768 (43.63 µs) and
    # 65536 (45.28 µs) rows; 917504 B between 524288 (200.5) and 1048576 (226.1): log-log by hand
    import math

    f1 = math.log(57344 / 32768) / math.log(2)
    f2 = math.log(917504 / 524288) / math.log(2)
    assert [(m["msg_bytes"], m["time_us"]) for m in d.measured] == [
        (57344, round(43.63 * (45.28 / 43.63) ** f1, 1)),
        (917504, round(200.5 * (226.1 / 200.5) ** f2, 1)),
    ]
    assert d.measured[0]["time_us"] == 45.0 and d.measured[1]["time_us"] == 220.9  # 200.5 * 1.1277^0.807
    assert all(m["label"] == "measured" for m in d.measured) and d.warnings == []
    assert d.perf_table["rows"] == 25 and d.sources[-1] == str(f)
    assert any("measures NCCL at 45.0 µs" in a for a in d.actions)
    # an 8-rank table next to a 2-GPU topology: said so
    two = parse_nvidia_smi_topo("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tPIX\t X \n", source="two")
    d = diagnose(two, None, {}, perf=perf)
    assert [w for w in d.warnings if "measured on 8 ranks" in w and "topology has 2" in w]
    # a log whose pairs are an excerpt (4 of the GPUs, no communicator line) is no world size: no warning
    log307 = parse_nccl_log((shared_dir / "inputs" / "nccldebug-nccl-tests-307.txt").read_text(), source="307.log")
    assert diagnose(None, log307, {}, perf=perf).warnings == []


def test_cli_bad_perf_table_is_one_line(tmp_path):
    (tmp_path / "perf.txt").write_text("# nThread 1 nGpus 8 minBytes 8 maxBytes 128\n#  size count\n")
    assert_user_error(run_fastverify(["topo", "--perf-table", "perf.txt"], cwd=tmp_path), "perf.txt")
    assert_user_error(run_fastverify(["topo", "--perf-table", "missing.txt"], cwd=tmp_path), "missing.txt")
