"""`fastverify profile --trace` on CPU-only traces (issue 10, What to build 2, last bullet).

On a CPU SGLang server the traces hold CPU ops only: the all-reduces are gloo CPU events, no GPU
kernel. Here two real processes all-reduce over gloo inside ``step[TARGET_VERIFY #i]`` spans,
traced by the patch's own :class:`fastverify.patch.verify.VerifyTrace` (torch.profiler, CPU
activity), and the profile's numbers are checked against values worked out here from the raw
JSON with the standard library (Decimal, sort + merge intervals from conftest).
"""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from conftest import DATA, REPO_ROOT, assert_user_error, length, read_raw_trace, run_fastverify, subprocess_env

STEPS = 3
LAYERS = 2
ROWS, HIDDEN = 16, 64  # float32 all-reduces of 16 x 64: 4096 bytes

CHILD = r"""
import os, sys, time
import torch, torch.distributed as dist
from fastverify.patch.verify import VerifyTrace
rank, out = int(os.environ["RANK"]), sys.argv[1]
torch.set_num_threads(1)  # two ranks on a small CI box: no OpenMP threads fighting over the cores
dist.init_process_group("gloo", rank=rank, world_size=2)
x, w = torch.randn(16, 64), torch.randn(64, 64)
dist.barrier()  # both ranks start the traced steps together
trace = VerifyTrace(out, %(steps)d, rank=lambda: str(rank))
for step in range(%(steps)d + 1):  # one more: after the trace, not traced
    trace.begin()
    for layer in range(%(layers)d):
        y = x @ w
        if rank == 1:
            time.sleep(0.03)  # rank 1 arrives late: rank 0 waits in every all-reduce
        dist.all_reduce(y)
    trace.end()
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # the trace is written; skip C++ static teardown (gloo/profiler threads can abort there)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cpu_traces(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cpu-traces")
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **subprocess_env(),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD % {"steps": STEPS, "layers": LAYERS}, str(out)],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for p in procs:
        text, _ = p.communicate(timeout=180)
        assert p.returncode == 0, text
    files = sorted(out.glob("verify-TP-*.trace.json.gz"))
    assert [f.name for f in files] == ["verify-TP-0.trace.json.gz", "verify-TP-1.trace.json.gz"]
    return out


def _profile(paths, out_dir: Path) -> dict:
    from fastverify.cli import main

    out = out_dir / "profile.json"
    assert main(["profile", "--trace", *map(str, paths), "--output", str(out), "--no-png", "--quiet"]) == 0
    return json.loads(out.read_text())


def _iv(e) -> tuple[Decimal, Decimal]:
    return Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"])


def _raw_facts(path: Path) -> dict:
    """From the raw JSON alone: the gloo all-reduce spans in start order, their union, the compute
    union (every cpu_op outside the c10d hand-off ops and what they hold), and the step spans."""
    doc = read_raw_trace(path)
    evs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert not [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")], "a CPU trace"
    ars = sorted((e for e in evs if e.get("name") == "gloo:all_reduce"), key=lambda e: Decimal(e["ts"]))
    handoff = [(e["tid"], *_iv(e)) for e in evs if e.get("cat") == "cpu_op" and e["name"].startswith("c10d::")]
    compute = [
        _iv(e)
        for e in evs
        if e.get("cat") == "cpu_op"
        and not e["name"].startswith("c10d::")
        and not any(t == e["tid"] and s <= _iv(e)[0] and _iv(e)[1] <= t_end for t, s, t_end in handoff)
    ]
    steps = sorted(_iv(e) for e in evs if e.get("name", "").startswith("step[TARGET_VERIFY"))
    return {
        "ars": ars,
        "ar_union": length([_iv(e) for e in ars]),
        "compute": length(compute),
        "durs": [Decimal(e["dur"]) for e in ars],
        "steps": steps,
        "dims": [(e["args"].get("Input Dims"), e["args"].get("Input type")) for e in ars],
    }


def _us(x: Decimal) -> float:
    return float(round(x, 3))


def test_cpu_traces_read_as_cpu_clock_allreduces(cpu_traces, tmp_path):
    prof = _profile([cpu_traces], tmp_path)
    assert prof["timing"]["clock"] == "cpu_trace" and "NOT GPU" in prof["timing"]["note"]
    raw = {r: _raw_facts(cpu_traces / f"verify-TP-{r}.trace.json.gz") for r in (0, 1)}
    by_rank = {r["rank"]: r for r in prof["ranks"]}
    assert sorted(by_rank) == [0, 1]
    for rank, facts in raw.items():
        r = by_rank[rank]
        assert len(facts["ars"]) == STEPS * LAYERS
        assert all(d == ([[ROWS, HIDDEN]], ["float"]) for d in facts["dims"])
        assert r["allreduce_count"] == STEPS * LAYERS and r["counts"]["allreduce"] == STEPS * LAYERS
        assert r["allreduce_us"] == pytest.approx(_us(facts["ar_union"]), abs=1e-3)
        assert r["compute_us"] == pytest.approx(_us(facts["compute"]), abs=1e-3)
        assert r["meta"]["timing"] == "cpu_trace" and "not GPU" in r["meta"]["cpu_only"]
        assert r["meta"]["dist_backend"] == "gloo" and r["meta"]["world_size"] == 2
        assert [s["name"] for s in r["steps"]] == [f"step[TARGET_VERIFY #{i}]" for i in range(STEPS)]
        assert [s["allreduce_count"] for s in r["steps"]] == [LAYERS] * STEPS
    assert prof["allreduce_by_msg_size"][0]["msg_bytes"] == ROWS * HIDDEN * 4
    assert prof["allreduce_by_msg_size"][0]["count"] == 2 * STEPS * LAYERS

    # Cross-rank: the i-th all-reduce of each rank; transfer = the shorter span, wait = the rest.
    d0, d1 = raw[0]["durs"], raw[1]["durs"]
    transfer = [min(a, b) for a, b in zip(d0, d1)]
    cross = prof["cross_rank"]
    assert cross["matched"] == STEPS * LAYERS
    for rank, durs in ((0, d0), (1, d1)):
        wait = sum(d - t for d, t in zip(durs, transfer))
        assert cross["per_rank"][str(rank)]["allreduce_wait_us"] == pytest.approx(_us(wait), abs=STEPS * LAYERS * 1e-3)
        assert cross["per_rank"][str(rank)]["transfer_us"] == pytest.approx(
            _us(sum(transfer)), abs=STEPS * LAYERS * 1e-3
        )
        assert by_rank[rank]["allreduce_wait_us"] == cross["per_rank"][str(rank)]["allreduce_wait_us"]
    for i, c in enumerate(cross["collectives"]):
        assert c["kind"] == "allreduce" and c["name"] == "gloo:all_reduce"
        assert c["duration_us"] == {"0": _us(d0[i]), "1": _us(d1[i])}
        assert c["straggler_rank"] == (0 if d0[i] <= d1[i] else 1)  # argmin: the first on a tie
    # Rank 1 sleeps before each all-reduce, so rank 0 waits in (nearly) all of them; the first one
    # also holds the two processes' start-up skew (up to a second on a loaded machine), left out
    assert sum(d0[1:]) > sum(d1[1:]) and prof["summary"]["straggler_rank"] == 1


def test_cpu_profile_never_poses_as_gpu(cpu_traces, tmp_path):
    proc = run_fastverify(
        ["profile", "--trace", str(cpu_traces), "--output", str(tmp_path / "p.json"), "--no-png"], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "clock: cpu_trace" in proc.stdout and "NOT GPU timings" in proc.stdout
    from fastverify.tune.workload import GPU_CLOCKS

    assert "cpu_trace" not in GPU_CLOCKS  # tune never takes these times as GPU times


def test_cpu_and_gpu_traces_are_not_mixed(cpu_traces, tmp_path):
    gpu = DATA / "bigint" / "comms_id_over_64_bits.trace.json.gz"  # a GPU trace of rank 3
    proc = run_fastverify(
        ["profile", "--trace", str(cpu_traces / "verify-TP-0.trace.json.gz"), str(gpu), "--quiet"], cwd=tmp_path
    )
    assert_user_error(proc, "verify-TP-0.trace.json.gz", "CPU-only", "GPU")
    assert not (tmp_path / "profiles").exists()


def _ev(name, ts, dur, cat="cpu_op", tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _write(path: Path, rank: int, events) -> Path:
    doc = {"distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2}, "traceEvents": events}
    path.write_bytes(gzip.compress(json.dumps(doc).encode(), mtime=0))
    return path


def test_record_param_comms_without_gloo_spans(tmp_path):
    """Builds whose only trace of a collective is ``record_param_comms`` (its ``Collective name``
    says which): those are the all-reduces; the nested ops in them are not compute. By hand:
    rank 0 computes 10 + 5 µs and all-reduces 20 µs; rank 1 30 µs; transfer 20, rank 1 waits 10."""
    for rank, ar_dur in ((0, 20), (1, 30)):
        _write(
            tmp_path / f"t-TP-{rank}.json.gz",
            rank,
            [
                _ev("step[TARGET_VERIFY #0]", 0, 100, cat="user_annotation"),
                _ev("aten::mm", 1, 10),
                _ev("aten::addmm_inner", 2, 3),  # nested: counted once
                _ev("record_param_comms", 20, ar_dur, **{"Collective name": "allreduce"}),
                _ev("aten::copy_", 21, 2),  # inside the collective: not compute
                _ev("aten::add", 60, 5),
            ],
        )
    prof = _profile(sorted(tmp_path.glob("t-TP-*.json.gz")), tmp_path)
    assert prof["timing"]["clock"] == "cpu_trace"
    r0, r1 = prof["ranks"]
    assert (r0["compute_us"], r0["allreduce_us"], r0["allreduce_count"]) == (15.0, 20.0, 1)
    assert (r1["compute_us"], r1["allreduce_us"]) == (15.0, 30.0)
    assert prof["cross_rank"]["per_rank"]["1"]["allreduce_wait_us"] == 10.0
    assert prof["cross_rank"]["per_rank"]["0"]["allreduce_wait_us"] == 0.0


def test_record_param_comms_beside_gloo_is_the_handoff(tmp_path):
    """With a ``gloo:all_reduce`` span present, ``record_param_comms`` and ``c10d::allreduce_``
    only hand the tensor over: one all-reduce per collective (the span on gloo's thread), never two."""
    _write(
        tmp_path / "t-TP-0.json.gz",
        0,
        [
            _ev("aten::mm", 0, 10),
            _ev("record_param_comms", 10, 3, **{"Collective name": "allreduce"}),
            _ev("c10d::allreduce_", 11, 1),
            _ev("aten::empty", 11, 0.5),  # nested in the hand-off
            _ev("gloo:all_reduce", 12, 40, cat="user_annotation", tid=9),
            _ev("gloo:broadcast", 60, 4, cat="user_annotation", tid=9),
        ],
    )
    prof = _profile([tmp_path / "t-TP-0.json.gz"], tmp_path)
    (r,) = prof["ranks"]
    assert (r["allreduce_count"], r["allreduce_us"], r["other_comm_us"], r["compute_us"]) == (1, 40.0, 4.0, 10.0)
    assert r["counts"]["compute"] == 1 and r["counts"]["other_comm"] == 1
