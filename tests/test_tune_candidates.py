"""Tune's candidates: backends and NCCL settings ranked together, the user's evidence before the
model, the wait kept / wait shrinks bounds, and ``tune --json`` in both modes.

Expected numbers are worked out here: backend figures from :func:`fastverify.tune.backend_model.estimate`
summed by hand over the workload's sizes × counts, NCCL figures from
:func:`fastverify.tune.predict.rank_nccl_settings`, measured ones from the input files read here with
plain string splitting, verify / tok/s by the plan's formula ``tok/s = A / (t_rest + t_verify)``.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from conftest import SHARED, run_fastverify

from fastverify.cli import main
from fastverify.live.config import load_model_config
from fastverify.registry import BackendName
from fastverify.tune.workload import Workload, workload_from_model

TOPO_307 = SHARED / "inputs" / "topo-nccl-tests-307.txt"
PERF_4090 = SHARED / "inputs" / "allreduceperf-blog-chlc-rtx4090-p2pdisabled.txt"
SEED = [
    "tune",
    "--predict",
    "--topology",
    str(TOPO_307),
    "--model",
    "kimi-k2",
    "--tp",
    "8",
    "--sm",
    "120",
    "--pcie-gen",
    "5",
    "--tok-s",
    "82",
    "--accept-length",
    "3",
]
KEYS = {
    "backend",
    "settings",
    "allreduce_us_per_step",
    "allreduce_us_per_step_range",
    "evidence",
    "verify_ms",
    "tok_s",
    "label",
    "candidate",
}

pytestmark = pytest.mark.skipif(not TOPO_307.is_file(), reason=f"{TOPO_307} absent (../shared/inputs)")


def _json(argv, capsys):
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out), out.err  # stdout is exactly one JSON document


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("NCCL_")]:
        monkeypatch.delenv(k)


@pytest.fixture(scope="module")
def kimi() -> Workload:
    return workload_from_model(load_model_config("kimi-k2"), tp=8, draft_tokens=4, batch=1)


def _sum_estimates(backend, workload, sm=(12, 0), pcie_gen=5):
    from fastverify.tune.backend_model import estimate

    ests = [
        (c, estimate(backend, b, world_size=workload.tp, sm=sm, pcie_gen=pcie_gen, p2p=True))
        for b, c in workload.msg_sizes
    ]
    point = sum(c * e.point_us for c, e in ests)
    if any(e.low_us is None for _, e in ests):  # a size whose range is unknown: no range for the step
        return point, None, None, [e for _, e in ests]
    return (point, sum(c * e.low_us for c, e in ests), sum(c * e.high_us for c, e in ests), [e for _, e in ests])


# --- the seed case (Done-when, first bullet) ---------------------------------------------------------------


def test_seed_case_pcie_ipc_candidate(kimi, capsys):
    """The seed box: pcie_ipc gets the P2P kernel model's point and range at 57,344 B (summed over
    the step's all-reduces), is ranked first by its point, and is too close to call: its range
    reaches the best NCCL setting's. The winner is that NCCL setting, with tok/s from 82 tok/s."""
    from fastverify.tune.predict import rank_nccl_settings

    doc, _ = _json(SEED + ["--json"], capsys)
    assert doc["label"] == "predicted" and doc["mode"] == "predict"
    base = doc["baseline"]
    ranked = rank_nccl_settings(kimi, TOPO_307, env={}, sm=120, pcie_gen=5)
    model_base = next(c for c in ranked if c.is_baseline)
    assert base["allreduce_us_per_step"] == pytest.approx(model_base.allreduce_us, rel=1e-6)
    ipc = [c for c in doc["candidates"] if c["backend"] == "pcie_ipc"]
    assert len(ipc) == 1
    ipc = ipc[0]
    point, low, high, ests = _sum_estimates(BackendName.pcie_ipc, kimi)
    assert ipc["label"] == "predicted" and ipc["candidate"] == 1
    assert ipc["allreduce_us_per_step"] == pytest.approx(point, abs=1e-3)
    assert ipc["allreduce_us_per_step_range"] == pytest.approx([low, high], abs=1e-3)
    assert ipc["per_call"] == [
        {
            "msg_bytes": e.msg_bytes,
            "point_us": pytest.approx(e.point_us, abs=5e-4),
            "range_us": [pytest.approx(e.low_us, abs=5e-4), pytest.approx(e.high_us, abs=5e-4)],
        }
        for e in ests
    ]
    assert set(ipc["sources"]) == {s for e in ests for s in e.sources} and ipc["sources"]
    assert all(e.evidence in ipc["evidence"] for e in ests)
    # published measurements disagree: the notes say so and say to measure
    assert any("disagree" in n for n in ipc["notes"])
    assert any("measure with `fastverify tune`" in n for n in ipc["notes"])
    level = doc["candidates"][1]
    assert low <= level["allreduce_us_per_step_range"][1] and high >= level["allreduce_us_per_step_range"][0]
    assert doc["too_close_to_call"] == {"pcie_ipc": doc["too_close_to_call"]["pcie_ipc"]}
    assert doc["too_close_to_call"]["pcie_ipc"].startswith("pcie_ipc: too close to call: measure (its predicted range ")
    assert doc["winner"] == "NCCL_P2P_LEVEL=SYS"
    # the winner: the NCCL setting the cost model ranks first (NCCL_P2P_LEVEL=SYS, -2.9 %)
    best = doc["candidates"][1]
    assert best["candidate"] == 2 and best["backend"] == "nccl" and best["settings"] == dict(ranked[0].settings)
    assert best["settings"] == {"NCCL_P2P_LEVEL": "SYS"}
    assert best["change_pct"] == pytest.approx(-ranked[0].vs_baseline_pct, abs=0.01)
    assert best["change_pct"] == pytest.approx(-2.9, abs=0.05)
    # verify_ms / tok_s: model workload, nothing measured -> verify = all-reduce only; t_rest from 82 tok/s
    a, tok_s = 3.0, 82.0
    t_rest = a / tok_s - base["allreduce_us_per_step"] * 1e-6
    p = best["allreduce_us_per_step"]
    assert best["verify_ms"] == pytest.approx(p / 1e3, abs=1e-4)
    assert best["tok_s"] == pytest.approx(a / (t_rest + p * 1e-6), abs=0.01)
    lo, hi = best["allreduce_us_per_step_range"]
    assert best["tok_s_range"] == pytest.approx([a / (t_rest + hi * 1e-6), a / (t_rest + lo * 1e-6)], abs=0.01)
    assert base["tok_s"] == pytest.approx(82.0, abs=0.01)


def test_seed_case_terminal_table(capsys):
    rc = main(SEED)
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0
    assert "candidate" in out and "┃ rank" not in out
    assert "pcie_ipc" in out and "predicted" in out and "--explain shows them" in out
    # the published measurements' disagreement and the advice to measure: behind --explain
    assert main(SEED + ["--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "disagree" in out and "measure with `fastverify tune`" in out


def test_unreachable_backends_are_absent_with_a_reason(capsys):
    doc, _ = _json(SEED + ["--json"], capsys)
    backends = {c["backend"] for c in doc["candidates"]}
    assert "fused" not in backends and "custom_ar" not in backends
    why = " | ".join(doc["not_candidates"])
    assert "fused: SGLang calls it only on SM90/SM100; this box is SM120" in why
    assert "custom_ar: world size 8 needs full NVLink" in why
    # SM89: b12x's kernel runs only on SM120/121
    doc, _ = _json([a if a != "120" else "89" for a in SEED] + ["--json"], capsys)
    assert "b12x" not in {c["backend"] for c in doc["candidates"]}
    assert any(w.startswith("b12x: the kernel runs only on SM120") for w in doc["not_candidates"])


def test_a_failing_p2p_check_rules_out_the_p2p_backends(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pairs = [(i, j) for i in range(8) for j in range(8) if i != j]
    (tmp_path / "bad.json").write_text(
        json.dumps([{"src": i, "dst": j, "ok": (i, j) != (0, 5), "reason": "zeros"} for i, j in pairs])
    )
    doc, _ = _json(SEED + ["--p2p-check", "bad.json", "--json"], capsys)
    assert {c["backend"] for c in doc["candidates"]} == {"nccl"}
    assert any(w.startswith("pcie_ipc: needs P2P between every GPU pair and it fails") for w in doc["not_candidates"])


def test_a_backend_without_published_data_is_listed_not_ranked(capsys):
    from fastverify.tune.backend_model import estimate

    doc, _ = _json(SEED + ["--json"], capsys)
    none = [c for c in doc["candidates"] if c["allreduce_us_per_step"] is None]
    assert {c["backend"] for c in none} == {"b12x"}  # no published b12x measurement
    assert estimate(BackendName.b12x, 57344, world_size=8, sm=(12, 0), pcie_gen=5, p2p=True) is None
    (c,) = none
    assert c["candidate"] is None and c["allreduce_us_per_step_range"] is None
    assert c["status"] == "no published data: measure with fastverify tune"
    assert "no published data: measure with fastverify tune" in c["evidence"][0]
    ranked = [c for c in doc["candidates"] if c["allreduce_us_per_step"] is not None]
    assert doc["candidates"][: len(ranked)] == ranked  # unranked ones come last
    assert [c["allreduce_us_per_step"] for c in ranked] == sorted(c["allreduce_us_per_step"] for c in ranked)


# --- JSON schema -----------------------------------------------------------------------------------------


def test_predict_json_schema(capsys):
    doc, _ = _json(SEED + ["--json"], capsys)  # json.loads of the whole stdout: nothing else is there
    assert {"label", "baseline", "candidates"} <= set(doc)
    assert KEYS <= set(doc["baseline"])
    assert doc["baseline"]["is_baseline"] is True and doc["baseline"]["backend"] == "nccl"
    for c in doc["candidates"]:
        assert KEYS <= set(c), c
        assert isinstance(c["evidence"], list) and c["evidence"] and all(isinstance(e, str) for e in c["evidence"])
        if c["allreduce_us_per_step"] is not None:
            lo, hi = c["allreduce_us_per_step_range"]
            assert lo <= c["allreduce_us_per_step"] <= hi
            assert c["label"] in ("predicted", "measured")
    assert sum(c["is_baseline"] for c in doc["candidates"]) == 1
    assert any(w.startswith("fused: ") for w in doc["not_candidates"])  # in the document, not in words


def test_measure_json_on_gloo_is_cpu_wall_clock(tmp_path):
    proc = run_fastverify(
        [
            "tune",
            "--model",
            "tiny",
            "--tp",
            "2",
            "--top",
            "1",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--journal",
            "j.jsonl",
            "--topology",
            str(TOPO_307),
            "--json",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["mode"] == "measure" and doc["label"] == "CPU wall clock"
    assert KEYS <= set(doc["baseline"])
    assert len(doc["candidates"]) == 2
    for c in doc["candidates"]:
        assert KEYS <= set(c) and c["label"] == "CPU wall clock" and c["clock"] == "cpu_wall_clock"
        lo, hi = c["allreduce_us_per_step_range"]
        assert lo == c["allreduce_us_per_step"] <= hi
        assert c["verify_ms"] is None and c["tok_s"] is None  # CPU times say nothing about a GPU verify step
    assert "NOT GPU timings" in " ".join(proc.stderr.split())


# --- evidence order --------------------------------------------------------------------------------------


def _inplace_times(path):
    """size -> in-place time µs, read from the all_reduce_perf text by splitting its data rows."""
    out = {}
    for line in path.read_text().splitlines():
        tok = line.split()
        if len(tok) >= 13 and tok[0].isdigit() and tok[2] == "float":
            out[int(tok[0])] = float(tok[9])
    return out


def test_perf_table_overrides_the_model_for_nccl(kimi, capsys):
    from fastverify.tune.predict import rank_nccl_settings

    t = _inplace_times(PERF_4090)
    lo, hi, size = 32768, 65536, 57344
    f = (math.log(size) - math.log(lo)) / (math.log(hi) - math.log(lo))
    per_call = math.exp(math.log(t[lo]) + f * (math.log(t[hi]) - math.log(t[lo])))
    doc, _ = _json(SEED + ["--perf-table", PERF_4090, "--json"], capsys)
    base = doc["baseline"]
    assert base["allreduce_us_per_step"] == pytest.approx(123 * per_call, rel=1e-6)
    assert base["label"] == "measured" and base["allreduce_us_per_step_range"] == pytest.approx([123 * per_call] * 2)
    assert any(str(PERF_4090) in e for e in base["evidence"])
    # an NCCL setting: the cost model's ratio applied to the measured baseline
    ranked = rank_nccl_settings(kimi, TOPO_307, env={}, sm=120, pcie_gen=5)
    model_base = next(c for c in ranked if c.is_baseline).allreduce_us
    sys_ = next(c for c in ranked if dict(c.settings) == {"NCCL_P2P_LEVEL": "SYS"})
    got = next(c for c in doc["candidates"] if c["settings"] == {"NCCL_P2P_LEVEL": "SYS"})
    assert got["allreduce_us_per_step"] == pytest.approx(123 * per_call * sys_.allreduce_us / model_base, rel=1e-6)
    assert got["label"] == "predicted"


def _figures(workload, **kw):
    from fastverify.tune.candidates import predict_candidates
    from fastverify.tune.predict import rank_nccl_settings

    ranked = rank_nccl_settings(workload, TOPO_307, env={}, sm=120, pcie_gen=5)
    kw.setdefault("p2p_ok", True)
    return ranked, predict_candidates(workload, ranked, sm=120, pcie_gen=5, p2p_source="test", nvlink_full=False, **kw)


def _perf():
    from fastverify.nccl.perftable import parse_all_reduce_perf

    return parse_all_reduce_perf(PERF_4090.read_text(), source=str(PERF_4090))


def test_evidence_order_profile_then_perf_table_then_log_then_topology(kimi):
    from fastverify.nccl.debuglog import NcclLog

    size, count = kimi.msg_sizes[0]
    # NCCL's TUNING table (latency us, bandwidth GB/s): time = lat + bytes / (1000 x bw), fastest pair
    log = NcclLog(
        source="run.log",
        tuning={
            "AllReduce": {("RING", "LL"): (10.0, 5.0), ("TREE", "LL"): (20.0, 8.0), ("RING", "SIMPLE"): (5.0, 0.0)}
        },
    )
    nccl_own = min(10.0 + size / 5000.0, 20.0 + size / 8000.0)  # bw 0 = disabled, left out
    ranked, topo_only = _figures(kimi)
    assert topo_only.baseline.point_us == pytest.approx(next(c for c in ranked if c.is_baseline).allreduce_us)
    assert any("cost model" in e for e in topo_only.baseline.evidence)
    _, with_log = _figures(kimi, log=log)
    assert with_log.baseline.point_us == pytest.approx(count * nccl_own)
    assert any("run.log" in e and "TUNING" in e for e in with_log.baseline.evidence)
    perf = _perf()
    _, with_perf = _figures(kimi, log=log, perf=perf)
    assert with_perf.baseline.point_us == pytest.approx(count * perf.time_us(size, in_place=True))
    assert with_perf.baseline.label == "measured"
    profiled = Workload(
        msg_sizes=((size, count),),
        hidden=7168,
        tokens=4,
        tp=8,
        clock="trace",
        allreduce_us=count * 150.0,
        allreduce_us_by_size=((size, 150.0),),
        source="profile p.json",
    )
    _, with_profile = _figures(profiled, log=log, perf=perf)
    assert with_profile.baseline.point_us == pytest.approx(count * 150.0)
    assert with_profile.baseline.evidence == ("measured: profile p.json, median per call (trace)",)
    # a CPU wall-clock profile is no evidence for a GPU box: the perf table wins again
    cpu = Workload(
        msg_sizes=((size, count),),
        hidden=7168,
        tokens=4,
        tp=8,
        clock="cpu_wall_clock",
        allreduce_us_by_size=((size, 150.0),),
        source="profile c.json",
    )
    _, with_cpu = _figures(cpu, perf=perf)
    assert with_cpu.baseline.point_us == pytest.approx(count * perf.time_us(size, in_place=True))


def test_wait_kept_and_wait_shrinks_bounds_by_hand():
    """A profile that split its all-reduce time: 123 x 200 us, 40 % of it waiting for the slowest
    rank. A faster kernel replaces the transfer only: wait kept = wait + kernel, wait shrinks =
    kernel; the published range runs from the shrink bound's low to the kept bound's high."""
    size, count = 57344, 123
    ar = count * 200.0
    wait, transfer = 0.4 * ar, 0.6 * ar
    w = Workload(
        msg_sizes=((size, count),),
        hidden=7168,
        tokens=4,
        tp=8,
        clock="trace",
        allreduce_us=ar,
        allreduce_us_by_size=((size, 200.0),),
        allreduce_wait_us=wait,
        allreduce_transfer_us=transfer,
        source="profile split.json",
    )

    def estimate(backend, nbytes, **kw):
        if backend is BackendName.pcie_ipc:
            return SimpleNamespace(
                point_us=12.0, low_us=9.0, high_us=15.0, sources=("s1",), evidence="published: test", notes=()
            )
        return None

    _, pred = _figures(w, estimate=estimate)
    ipc = next(f for f in pred.candidates if f.backend is BackendName.pcie_ipc)
    assert ipc.bounds["wait_kept_us"] == pytest.approx(wait + count * 12.0)
    assert ipc.bounds["wait_shrinks_us"] == pytest.approx(count * 12.0)
    assert ipc.point_us == pytest.approx(wait + count * 12.0)
    assert ipc.range_us == pytest.approx((count * 9.0, wait + count * 15.0))
    assert any("split.json" in e and "wait" in e for e in ipc.evidence)
    assert pred.baseline.point_us == pytest.approx(ar) and pred.baseline.label == "measured"


def test_profile_wait_split_is_read_from_a_real_profile(tmp_path):
    """The per-step wait is the median over ranks of wait / (wait + transfer) (the profile's window
    totals) times the measured all-reduce time per step; read here from the JSON itself."""
    from test_profile_record import _live_source, _ranks

    from fastverify.profile.build import build_profile, write_outputs
    from fastverify.profile.record import Shapes
    from fastverify.tune.workload import workload_from_profile

    shapes = Shapes(dtype="bfloat16", hidden=128, tokens=8, draft_tokens=4, batch=2)
    prof = build_profile(_ranks(2048), _live_source(dtype="bfloat16"), shapes)
    path = tmp_path / "p.json"
    write_outputs(prof, path, None)
    doc = json.loads(path.read_text())
    fr = sorted(r["allreduce_wait_us"] / (r["allreduce_wait_us"] + r["allreduce_transfer_us"]) for r in doc["ranks"])
    ar = sorted(r["step_median"]["allreduce_us"] for r in doc["ranks"])
    med = lambda xs: (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2  # noqa: E731
    w = workload_from_profile(path)
    assert fr[-1] > 0  # the synthetic ranks do wait for each other
    assert w.allreduce_wait_us == pytest.approx(med(fr) * med(ar))
    assert w.allreduce_wait_us + w.allreduce_transfer_us == pytest.approx(w.allreduce_us)
    assert dict(w.allreduce_us_by_size) == {r["msg_bytes"]: r["median_us"] for r in doc["allreduce_by_msg_size"]}


def test_hidden_flag_gives_a_trace_profile_its_hidden_size_for_every_stage(tmp_path, capsys):
    """A trace profile records no hidden size; --hidden fills it for the whole run: without it the
    fused backends are refused for that reason, with it b12x (SM120) is judged on its rows and the workload
    notes say where the hidden size came from."""
    trace = SHARED / "traces" / "TraceLens" / "eager_trace.json.gz"
    if not trace.is_file():
        pytest.skip(f"{trace} absent")
    prof = tmp_path / "verify.json"
    assert main(["profile", "--trace", str(trace), "--output", str(prof), "--no-png", "--quiet"]) == 0
    capsys.readouterr()
    argv = [
        "tune",
        "--predict",
        "--topology",
        str(TOPO_307),
        "--profile",
        str(prof),
        "--sm",
        "120",
        "--pcie-gen",
        "5",
        "--json",
    ]
    doc, _ = _json(argv, capsys)
    assert any("b12x: the workload has no hidden size" in r for r in doc["not_candidates"]), doc["not_candidates"]
    assert "b12x" not in {c["backend"] for c in doc["candidates"]}
    doc, _ = _json(argv + ["--hidden", "7168"], capsys)
    assert not any("no hidden size" in r for r in doc["not_candidates"])
    # with the hidden size b12x is judged on its rows: every all-reduce of this trace has more than
    # its max_rows (bytes / (2 B x 7168) rows), so it is not a candidate, for that reason
    from fastverify.registry import backend_info

    rows = sorted({m["msg_bytes"] // (2 * 7168) for m in doc["workload"]["msg_sizes"]})
    assert all(r > backend_info(BackendName.b12x).max_rows for r in rows)
    assert "b12x" not in {c["backend"] for c in doc["candidates"]}
    assert any(
        r.startswith("b12x: not a candidate: it takes at most") and ", ".join(map(str, rows)) in r
        for r in doc["not_candidates"]
    ), doc["not_candidates"]
    assert "hidden size 7168 from --hidden" in doc["workload"]["notes"]


def test_a_float16_workload_gets_no_pcie_ipc_candidate_and_says_why(kimi):
    """SGLang 0.5.23 sends its PCIe IPC all-reduce bf16 only (``should_pcie_ipc_ar``), so on an fp16
    model the switch is a no-op: no figure for it, and one line naming SGLang's gate. The other
    backends are judged by their own limits (b12x takes fp16 on this SM120 box)."""
    from dataclasses import replace

    _, bf16 = _figures(kimi)
    assert BackendName.pcie_ipc in {f.backend for f in bf16.candidates}  # the same box and sizes in bf16
    _, fp16 = _figures(replace(kimi, dtype="float16"))
    assert BackendName.pcie_ipc not in {f.backend for f in fp16.candidates}
    why = [r for r in fp16.not_candidates if r.startswith("pcie_ipc:")]
    assert len(why) == 1 and "\n" not in why[0], fp16.not_candidates
    assert why[0].startswith("pcie_ipc: dtype float16 unsupported (takes bfloat16")
    assert "should_pcie_ipc_ar" in why[0] and "SGLang 0.5.23" in why[0]
    assert BackendName.b12x in {f.backend for f in fp16.candidates}
