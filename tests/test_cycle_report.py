"""``fastverify report``: the cycle split, the flags and the answer, on bundles built from synthetic
8-rank EAGLE traces with planted causes (tests/cycle_traces.py), a planted P2P-off NCCL log and the
public inputs in ../shared/. Expected values are worked out from each plan's parameters."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest

from fastverify.bundle import PART_NAMES, Manifest, Part, write_bundle
from fastverify.cli import main
from tests import cycle_traces as ct

SHARED = Path(__file__).resolve().parents[2] / "shared"
P2P_OFF_LOG = (
    "\n".join(
        [
            "host0:1000:1000 [0] NCCL INFO NCCL version 2.27.5+cuda12.9",
            "host0:1000:1000 [0] NCCL INFO NCCL_P2P_DISABLE set by environment to 1",
        ]
        + [
            f"host0:1000:{1010 + r} [{r}] NCCL INFO Channel 00 : {r}[{r}] -> {(r + 1) % 8}[{(r + 1) % 8}] via SHM/direct/direct"
            for r in range(8)
        ]
    )
    + "\n"
)


def make_bundle(
    tmp: Path,
    plan: ct.Plan | None = None,
    *,
    nccl_log: str | None = None,
    iommu: dict | None = None,
    sweep: dict | None = None,
    p2p: list | None = None,
    nvml: dict | None = None,
    topo: str | None = None,
) -> Path:
    """A bundle as `collect` writes it, with the given parts ok and the others skipped."""
    files: dict[str, bytes | Path] = {}
    parts = []
    for name in PART_NAMES:
        arcs: tuple[str, ...] = ()
        if name == "server_trace" and plan is not None:
            traces = ct.write(tmp / "traces", plan)
            arcs = tuple(f"server/traces/{p.name}" for p in traces)
            files.update(zip(arcs, traces))
        elif name == "nccl_log" and nccl_log is not None:
            arcs = ("nccl/nccl-debug.log",)
            files[arcs[0]] = nccl_log.encode()
        elif name == "p2p_check" and p2p is not None:
            arcs = ("p2p.json",)
            files[arcs[0]] = orjson.dumps(p2p)
        elif name == "nvidia_smi_topo" and topo is not None:
            arcs = ("topo/nvidia-smi-topo.txt",)
            files[arcs[0]] = topo.encode()
        elif name == "nvml" and nvml is not None:
            arcs = ("topo/nvml.json",)
            files[arcs[0]] = orjson.dumps(nvml)
        elif name == "sweep" and sweep is not None:
            arcs = ("sweep/tune.json",)
            files[arcs[0]] = orjson.dumps(sweep)
        elif name == "host_iommu" and iommu is not None:
            arcs = ("host/iommu.json",)
            files[arcs[0]] = orjson.dumps(iommu)
        parts.append(Part(name, "ok", None, arcs) if arcs else Part(name, "skipped", "not in this test"))
    out = tmp / "bundle.tar.gz"
    write_bundle(
        out,
        Manifest(
            created_utc="2026-12-01T00:00:00Z",
            fastverify_version="test",
            host={"hostname": "box"},
            budget_s=600.0,
            elapsed_s=1.0,
            parts=tuple(parts),
        ),
        files,
    )
    return out


def report_json(bundle: Path, capsys) -> dict:
    assert main(["report", str(bundle), "--json"]) == 0
    return orjson.loads(capsys.readouterr().out)


def _cycle_us(p: ct.Plan) -> float:
    draft = p.draft_steps * (1.5 * p.draft_us + 2 * p.transfer_us)
    straggle = p.straggle_us if p.straggler is not None else 0.0
    verify = p.transfer_us + p.layers * (p.attn_us + p.moe_us + straggle + 2 * p.transfer_us) + p.late_launch_us
    extend = 1.5 * p.draft_us + 2 * p.transfer_us
    return draft + verify + p.d2h_us + p.host_pause_us + extend


def test_straggler_and_p2p_off_are_named_with_the_removable_share(tmp_path, capsys):
    plan = ct.Plan()
    doc = report_json(make_bundle(tmp_path, plan, nccl_log=P2P_OFF_LOG), capsys)
    kinds = {f["kind"]: f for f in doc["flags"]}
    assert {"rank_skew", "p2p_off"} <= set(kinds), kinds
    # each of the 7 waiting ranks waits in every verify MoE all-reduce for the straggler: 4 x 80 µs per cycle;
    # its all-reduce time per cycle: 17 all-reduces x 40 µs transfer + that wait = 1000 µs, so 32 %
    assert kinds["rank_skew"]["finding"] == (
        "TP rank 5 arrives last: each of the other 7 ranks waits 0.320 ms per cycle for it (mean over them; "
        "range 0.320-0.320 ms), 32 % of their all-reduce time"
    )
    assert doc["cycles"]["straggler_rank"] == plan.straggler and doc["cycles"]["straggler_share"] == 1.0
    per_mode = doc["cycles"]["straggler_by_mode"]  # only the verify MoE all-reduces had anyone waiting
    assert set(per_mode) == {"verify"} and per_mode["verify"] == {
        "rank": plan.straggler,
        "last": plan.layers * plan.cycles,
        "waited": plan.layers * plan.cycles,
        "matched": plan.verify_ars * plan.cycles,
    }
    assert "NCCL_P2P_DISABLE=1" in " ".join(kinds["p2p_off"]["evidence"])
    assert "8 of 8 GPU pairs run over SHM" in kinds["p2p_off"]["evidence"][0]
    ans = doc["answer"]
    transfer = (plan.draft_ars + plan.verify_ars + 2) * plan.transfer_us  # every all-reduce, per cycle
    wait = (plan.world - 1) / plan.world * plan.layers * plan.straggle_us  # mean over ranks
    assert ans["removable_ms"] == pytest.approx(transfer / 1000, abs=1e-6)
    assert ans["not_removable_ms"]["wait"] == pytest.approx(wait / 1000, abs=1e-6)
    assert ans["not_removable_ms"]["idle"] == pytest.approx((plan.late_launch_us + plan.host_pause_us) / 1000, abs=1e-6)
    assert ans["cycle_ms"] == pytest.approx(_cycle_us(plan) / 1000, abs=1e-6)
    assert ans["next_action"].startswith("both")


def test_modes_and_idle_causes(tmp_path, capsys):
    plan = ct.Plan()
    doc = report_json(make_bundle(tmp_path, plan), capsys)
    means = doc["modes_mean_us"]
    assert means["verify"]["allreduce_count"] == plan.verify_ars
    assert means["draft"]["allreduce_count"] == plan.draft_ars
    assert means["draft_extend"]["allreduce_count"] == 2
    assert means["verify"]["transfer_us"] == pytest.approx(plan.verify_ars * plan.transfer_us)
    assert means["verify"]["idle_causes_us"]["launch_gap"] == pytest.approx(plan.late_launch_us)
    ranks = doc["cycles"]["ranks"]
    assert all(r["cycles"] == plan.cycles for r in ranks)
    assert all(r["between_causes_us"]["d2h_copy"] == pytest.approx(plan.host_pause_us) for r in ranks)
    waits = {r["rank"]: next(m["wait_us"] for m in r["modes"] if m["mode"] == "verify") for r in ranks}
    assert waits[plan.straggler] == 0.0
    assert all(w == pytest.approx(plan.layers * plan.straggle_us) for k, w in waits.items() if k != plan.straggler)


def test_no_straggler_no_skew_flag_and_swap_is_the_answer(tmp_path, capsys):
    plan = dataclasses.replace(
        ct.Plan(), straggler=None, host_pause_us=0.0, late_launch_us=0.0, d2h_us=0.0, graph=GRAPHED
    )
    doc = report_json(make_bundle(tmp_path, plan), capsys)
    assert not doc["flags"], doc["flags"]
    assert doc["answer"]["not_removable_ms"]["wait"] == 0.0
    assert doc["answer"]["next_action"].startswith("swap the backend")


GRAPHED = ("draft", "verify", "draft_extend")  # every forward replayed from a CUDA graph, as SGLang on a GPU


def test_straggler_line_states_the_wait_of_each_waiting_rank(tmp_path, capsys):
    """Rank r's MoE compute takes moe_extra[r] longer (the straggler 80 µs more): in each of the 4
    verify MoE all-reduces rank r waits 80 - moe_extra[r] µs for rank 5, per cycle 4 x that:
    320, 300, 280, 260, 240, (5: 0), 220, 200 µs. Mean over the 7 waiting ranks 1820 / 7 = 260 µs
    (over all 8 ranks it would be 227.5); each rank's all-reduce time is 17 x 40 µs transfer plus its
    wait, so the waiting ranks wait 1820 of 7 x 680 + 1820 = 6580 µs: 27.7 %."""
    extra = (0.0, 5.0, 10.0, 15.0, 20.0, 0.0, 25.0, 30.0)
    plan = dataclasses.replace(ct.Plan(), moe_extra_us=extra)
    doc = report_json(make_bundle(tmp_path, plan), capsys)
    [skew] = [f for f in doc["flags"] if f["kind"] == "rank_skew"]
    assert skew["finding"] == (
        "TP rank 5 arrives last: each of the other 7 ranks waits 0.260 ms per cycle for it "
        "(mean over them; range 0.200-0.320 ms), 28 % of their all-reduce time"
    )
    assert skew["evidence"][1] == (
        "all-reduce wait per cycle by TP rank (ms): 0: 0.320, 1: 0.300, 2: 0.280, "
        "3: 0.260, 4: 0.240, 5: 0.000 (last to arrive), 6: 0.220, 7: 0.200"
    )


def test_a_host_sync_in_an_idle_gap_is_its_cause(tmp_path, capsys):
    """After the verify forward's embedding all-reduce the host blocks in cudaStreamSynchronize
    until the GPU drains, then works 200 µs before its next launch: 200 µs of GPU idle per cycle in
    the verify forward caused by the host sync (launched late too, so without the host_sync rule it
    would read as a launch gap). The planted late launch stays a 50 µs launch gap; the D2H gap
    between forwards (under a sync as well) stays a d2h_copy of 300 µs."""
    plan = dataclasses.replace(ct.Plan(), host_sync_us=200.0)
    doc = report_json(make_bundle(tmp_path, plan), capsys)
    for r in doc["cycles"]["ranks"]:
        verify = next(m for m in r["modes"] if m["mode"] == "verify")
        assert verify["idle_causes_us"] == pytest.approx(
            {"d2h_copy": 0.0, "host_sync": 200.0, "launch_gap": 50.0, "dependency": 0.0}
        ), r["rank"]
        assert r["between_causes_us"] == pytest.approx(
            {"d2h_copy": 300.0, "host_sync": 0.0, "launch_gap": 0.0, "dependency": 0.0}
        ), r["rank"]
    cycle = _cycle_us(plan) + plan.host_sync_us
    assert doc["answer"]["cycle_ms"] == pytest.approx(cycle / 1000, abs=1e-6)
    idle = next(f for f in doc["flags"] if f["kind"] == "idle" and "in verify forwards" in f["finding"])
    assert idle["finding"] == (
        f"GPU idle in verify forwards: 0.250 ms per cycle ({100 * 250 / cycle:.0f} % of the "
        "cycle), mostly while the host blocked in cudaStreamSynchronize-like calls"
    )
    assert idle["fix"] == "remove the blocking synchronize from the cycle's host path"


def _eager_flags(doc: dict) -> list[dict]:
    return [f for f in doc["flags"] if f["kind"] == "eager_kernels"]


@pytest.mark.parametrize(
    "graph, why",
    [
        (
            (),
            (
                "no mode replays a CUDA graph: the server ran without them (--disable-cuda-graph or "
                "--cuda-graph-backend-decode=disabled)"
            ),
        ),
        (
            ("draft", "draft_extend"),
            (
                "other modes replay CUDA graphs (draft, draft_extend): the verify batch fit no "
                "captured graph (a batch above the captured sizes, --cuda-graph-max-bs-decode)"
            ),
        ),
    ],
)
def test_a_fully_eager_verify_forward_raises_eager_kernels(tmp_path, capsys, graph, why):
    """A verify forward with no graph replay at all (--disable-cuda-graph, or a batch above the
    captured sizes): 9 all-reduces + 4 x 2 computes = 17 kernels per cycle, launched one by one.
    Their time per rank is the verify span less its 50 µs launch gap: 40 + 4 x (150 + 200 + 80 +
    2 x 40) = 2080 µs, the same on every rank (a waiting rank's longer all-reduces make up for the
    straggler's longer MoE). The drafter's eager forwards are not flagged: only forwards SGLang
    replays from its decode graph runner (verify, decode) are expected in a graph."""
    doc = report_json(make_bundle(tmp_path, dataclasses.replace(ct.Plan(), graph=graph)), capsys)
    [flag] = _eager_flags(doc)
    assert flag["finding"] == (
        "verify forwards run everything eager: 17 kernels per cycle launched one by one, "
        "none from a CUDA graph (2.080 ms)"
    )
    assert flag["evidence"] == ["verify: 0 kernels replay from a graph, 17 do not", why]
    assert "--cuda-graph-max-bs-decode" in flag["fix"] and flag["setup"] is True
    verify = doc["modes_mean_us"]["verify"]
    assert (verify["eager_kernels"], verify["graph_kernels"]) == (17, 0)
    assert doc["modes_mean_us"]["draft"]["graph_kernels"] == (12 if "draft" in graph else 0)


def test_graph_replayed_forwards_raise_no_eager_flag(tmp_path, capsys):
    """Every forward in a graph: verify's 17 kernels per cycle all replay, none is eager."""
    doc = report_json(make_bundle(tmp_path, dataclasses.replace(ct.Plan(), graph=GRAPHED)), capsys)
    assert not _eager_flags(doc)
    verify = doc["modes_mean_us"]["verify"]
    assert (verify["eager_kernels"], verify["graph_kernels"]) == (0, 17)


def test_iommu_and_acs_signs_are_flagged(tmp_path, capsys):
    iommu = {
        "cmdline_iommu_tokens": ["intel_iommu=on"],
        "iommu_groups": 120,
        "acs": [{"device": "0000:00:01.1", "acsctl": "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+"}],
    }
    doc = report_json(make_bundle(tmp_path, None, iommu=iommu), capsys)
    flag = next(f for f in doc["flags"] if f["kind"] == "iommu_acs")
    assert any("intel_iommu=on" in e for e in flag["evidence"]) and any("0000:00:01.1" in e for e in flag["evidence"])
    assert doc["answer"] is None and any("no server trace" in n for n in doc["notes"])


def test_passthrough_iommu_is_not_flagged(tmp_path, capsys):
    iommu = {"cmdline_iommu_tokens": ["intel_iommu=on", "iommu=pt"], "iommu_groups": 120, "acs": []}
    doc = report_json(make_bundle(tmp_path, None, iommu=iommu), capsys)
    assert not [f for f in doc["flags"] if f["kind"] == "iommu_acs"]


@pytest.mark.skipif(not (SHARED / "inputs").is_dir(), reason="../shared/inputs is absent on this machine")
def test_public_nccl_log_with_a_shm_hop_is_p2p_off(tmp_path, capsys):
    text = (SHARED / "inputs" / "nccldebug-nccl-1027.txt").read_text()
    doc = report_json(make_bundle(tmp_path, None, nccl_log=text), capsys)
    flag = next(f for f in doc["flags"] if f["kind"] == "p2p_off")
    assert "3-4" in flag["evidence"][0]  # the log's one SHM hop: 3[3] -> 4[4] via SHM/direct/direct


def test_text_report_and_png(tmp_path, capsys):
    bundle = make_bundle(tmp_path, ct.Plan(), nccl_log=P2P_OFF_LOG)
    png = tmp_path / "cycle.png"
    assert main(["report", str(bundle), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "removable by a faster all-reduce (transfer)" in out and "[rank_skew]" in out and "[p2p_off]" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_bundle_and_png_over_the_bundle_exit_2(tmp_path, capsys):
    bad = tmp_path / "not-a-bundle.tar.gz"
    bad.write_bytes(b"hello")
    assert main(["report", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err
    bundle = make_bundle(tmp_path, ct.Plan())
    before = bundle.read_bytes()
    assert main(["report", str(bundle), "--png", str(bundle)]) == 2
    assert bundle.read_bytes() == before


def test_loader_reads_spans_syncs_and_launches_the_same_on_both_paths(tmp_path, monkeypatch):
    import numpy as np

    from fastverify.trace import load as L
    from tests.test_fast_vs_slow_path import _both

    path = ct.write(tmp_path, ct.Plan(world=2, cycles=2))[0]
    fast, slow = _both(path, monkeypatch)
    for a, b in zip(fast, slow):
        assert a.spans == b.spans and a.host_syncs == b.host_syncs
        assert np.array_equal(a.launch_ns, b.launch_ns) and np.array_equal(a.in_graph, b.in_graph)
    r = fast[0]
    assert [s.name for s in r.spans] == ["draft", "draft_extend"] * 3  # 2 cycles + the last start
    assert len(r.host_syncs) == 3 and r.host_syncs[0].name == "cudaStreamSynchronize"
    assert not r.in_graph.any()
    # the host launched each kernel LAG µs before it ran; the planted late one 1 µs before (after the GPU ran dry)
    lead = (r.start_ns - r.launch_ns) / 1000.0
    assert set(np.round(lead, 3).tolist()) == {ct.LAG, 1.0}
    assert L.HOST_SYNC.match("cudaStreamSynchronize") and not L.HOST_SYNC.match("cudaStreamSynchronizeX")


def test_graph_replayed_kernels_are_marked_in_graph():
    from fastverify.trace.load import load_trace

    data = Path(__file__).parent / "data" / "cuda_graph_replay"
    r = load_trace(sorted(data.glob("*.json*"))[0])[0]
    assert r.in_graph.any() and r.meta["step_source"] in ("graph_launch", "annotation")


def test_seed_sized_transfer_is_slow_against_published_boxes(tmp_path, capsys):
    """200 µs per 56 KiB all-reduce (the seed's figure) on 8 ranks against the published NCCL
    boxes of that world size; 40 µs is within them."""
    from fastverify.registry import BackendName
    from fastverify.tune.backend_model import comparable

    times = sorted(t for m in comparable(BackendName.nccl, 8) if (t := m.time_at(57344)))
    median = times[len(times) // 2] if len(times) % 2 else (times[len(times) // 2 - 1] + times[len(times) // 2]) / 2
    slow = dataclasses.replace(ct.Plan(), straggler=None, transfer_us=200.0)
    doc = report_json(make_bundle(tmp_path / "slow", slow), capsys)
    assert doc["verify_msg_bytes"] == 57344
    flag = next(f for f in doc["flags"] if f["kind"] == "slow_transfer")
    assert f"{200 / median:.1f}x" in flag["finding"] and f"median {median:.1f} µs" in flag["evidence"][1]
    fast = dataclasses.replace(ct.Plan(), straggler=None, transfer_us=40.0)
    doc = report_json(make_bundle(tmp_path / "fast", fast), capsys)
    assert not [f for f in doc["flags"] if f["kind"] == "slow_transfer"]


def test_transfer_is_set_against_the_boxs_own_sweep_first(tmp_path, capsys):
    sweep = {
        "mode": "measure",
        "label": "measured",
        "candidates": [
            {
                "is_baseline": True,
                "name": "current environment",
                "sizes": [
                    {"msg_bytes": 28672, "count_per_step": 1, "median_us": 25.0, "p90_us": 27.0},
                    {"msg_bytes": 57344, "count_per_step": 1, "median_us": 30.0, "p90_us": 33.0},
                ],
            }
        ],
    }
    plan = dataclasses.replace(ct.Plan(), straggler=None, transfer_us=70.0)  # 2.3x the sweep, ~1.5x published
    doc = report_json(make_bundle(tmp_path, plan, sweep=sweep), capsys)
    flag = next(f for f in doc["flags"] if f["kind"] == "slow_transfer")
    assert "2.3x" in flag["finding"] and "this box's measured sweep: NCCL 30.0 µs at 57,344 B" in flag["evidence"][1]


def test_wrong_typed_json_parts_are_read_as_absent_facts(tmp_path, capsys):
    iommu = {"cmdline_iommu_tokens": "intel_iommu=on", "iommu_groups": "many", "acs": 5}
    sweep = {
        "label": "measured",
        "candidates": [{"is_baseline": True, "sizes": [{"msg_bytes": "x", "median_us": None}]}],
    }
    doc = report_json(make_bundle(tmp_path, ct.Plan(transfer_us=200.0), iommu=iommu, sweep=sweep), capsys)
    assert not [f for f in doc["flags"] if f["kind"] == "iommu_acs"]
    slow = next(f for f in doc["flags"] if f["kind"] == "slow_transfer")  # published boxes, the sweep unusable
    assert "published NCCL" in slow["evidence"][1]


def test_cpu_clock_traces_are_never_set_against_gpu_figures(tmp_path, capsys, monkeypatch):
    """A CPU server's trace (gloo, CPU clock): no slow-transfer verdict from GPU NCCL figures."""
    import msgspec

    from fastverify.cycle.split import split_cycles as real

    def cpu_split(ranks):
        return msgspec.structs.replace(real(ranks), clock="cpu_trace")

    monkeypatch.setattr("fastverify.cycle.bundle_evidence.split_cycles", cpu_split)
    doc = report_json(make_bundle(tmp_path, dataclasses.replace(ct.Plan(), transfer_us=200.0)), capsys)
    assert not [f for f in doc["flags"] if f["kind"] == "slow_transfer"]
    assert all(not f["finding"].startswith("GPU") for f in doc["flags"])


def test_a_corrupt_trace_in_the_bundle_is_named_by_its_member(tmp_path, capsys):
    import gzip
    import tarfile

    bundle = make_bundle(tmp_path, ct.Plan(world=2, cycles=2))
    # rewrite one trace member with a cut-off gzip stream, the manifest unchanged
    src = tmp_path / "bundle.tar.gz"
    out = tmp_path / "cut.tar.gz"
    with tarfile.open(src, "r:gz") as a, tarfile.open(out, "w:gz") as b:
        for m in a.getmembers():
            data = a.extractfile(m).read()
            if m.name.endswith("TP-1.trace.json.gz"):
                data = gzip.compress(b'{"traceEvents": [{"ph": "X", "cat": "kernel"')
                m.size = len(data)
            b.addfile(m, __import__("io").BytesIO(data))
    assert bundle == src
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out}:server/traces/1700000000-TP-1.trace.json.gz:" in err, err


def test_png_refusals_come_before_any_output(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("mine")
    bundle = make_bundle(tmp_path, ct.Plan(world=2, cycles=2))
    assert main(["report", str(bundle), "--png", str(text)]) == 2
    assert text.read_text() == "mine" and capsys.readouterr().out == ""
    no_trace = make_bundle(tmp_path / "empty", None, nccl_log=P2P_OFF_LOG)
    assert main(["report", str(no_trace), "--png", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().out == "" and not (tmp_path / "x.png").exists()


def test_an_unreadable_nccl_log_is_a_note(tmp_path, capsys):
    doc = report_json(make_bundle(tmp_path, ct.Plan(world=2, cycles=2), nccl_log="\x00\x01garbage\n"), capsys)
    assert any(n.startswith("nccl_log: not read") for n in doc["notes"]) and doc["answer"] is not None


def test_one_cycle_start_is_no_complete_cycle_and_says_so(tmp_path, capsys):
    doc = report_json(make_bundle(tmp_path, ct.Plan(world=2, cycles=0)), capsys)
    assert doc["cycles"] is None and doc["answer"] is None
    assert any("no complete cycle" in n for n in doc["notes"])


def test_failed_p2p_check_and_nvml_refusals_are_p2p_evidence(tmp_path, capsys):
    p2p = [
        {"src": 0, "dst": 1, "ok": True, "reason": ""},
        {"src": 1, "dst": 0, "ok": False, "reason": "P2P write left 12 bytes wrong"},
    ]
    nvml = {"p2p_read": {"0-1": True, "0-2": False, "1-2": False}, "p2p_write": {}}
    doc = report_json(make_bundle(tmp_path, None, p2p=p2p, nvml=nvml), capsys)
    flag = next(f for f in doc["flags"] if f["kind"] == "p2p_off")
    assert flag["finding"].startswith("P2P does not work")
    assert "1 of 2 directions failed" in flag["evidence"][0] and "P2P write left 12 bytes wrong" in flag["evidence"][0]
    assert "refused on 2 GPU pairs (0-2, 1-2)" in flag["evidence"][1]
    ok = [{"src": 0, "dst": 1, "ok": True, "reason": ""}]
    doc = report_json(make_bundle(tmp_path / "ok", None, p2p=ok, nvml={"p2p_read": {"0-1": True}}), capsys)
    assert not [f for f in doc["flags"] if f["kind"] == "p2p_off"]


@pytest.mark.skipif(not (SHARED / "inputs").is_dir(), reason="../shared/inputs is absent on this machine")
def test_public_topology_predicts_shm_pairs_under_nccls_default(tmp_path, capsys):
    """nccl-tests#307's 8x RTX 4090 box: 4 GPUs per socket, every cross-socket pair SYS, which NCCL's
    default NCCL_P2P_LEVEL=PXB puts on SHM (4 x 4 = 16 pairs; 12 same-socket pairs stay P2P)."""
    text = (SHARED / "inputs" / "topo-nccl-tests-307.txt").read_text()
    doc = report_json(make_bundle(tmp_path, None, topo=text), capsys)
    flag = next(f for f in doc["flags"] if f["kind"] == "p2p_off")
    assert flag["finding"].startswith("predicted from the topology")
    assert "NCCL_P2P_LEVEL=PXB (default) NCCL puts 16 of 28 GPU pairs on SHM" in flag["evidence"][0]
    assert "SYS would put them on P2P" in flag["evidence"][0]
