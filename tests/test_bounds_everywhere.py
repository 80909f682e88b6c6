"""fastverify's plausibility bounds (fastverify/bounds.py) held at every entry that reads numbers:
profile JSONs (tune --profile), NCCL settings taken together, all_reduce_perf tables, NCCL logs and
the tune journal.

Each refusal is driven through the real command line in-process (``fastverify.cli.main``): exit 2,
one line on stderr naming the file (or the setting) and the value, and the input file left as it
was (its SHA-256 before and after). The values that must be refused were picked past the bounds by
hand: 1e15 B is over 1 TiB (2**40 = 1,099,511,627,776 B), 1e12 channels over NCCL's 64, 1e308 GB/s
over 1e6 GB/s, -1000 µs below 0.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from fastverify.cli import main
from fastverify.events import EventClass, RankEvents, Step
from fastverify.nccl.checks import Severity, validate_env, validate_setting, validate_settings
from fastverify.nccl.debuglog import parse_nccl_log
from fastverify.nccl.perftable import parse_all_reduce_perf
from fastverify.nccl.version import NcclVersion
from fastverify.profile.build import build_profile
from fastverify.profile.record import Shapes, encode_profile
from fastverify.tune import sweep
from fastverify.tune.sweep import JOURNAL_SCHEMA_VERSION, Journal, fingerprint, read_journal
from fastverify.tune.trial import SizeResult, TrialResult, TrialSpec

TWO_GPU_TOPO = "        GPU0    GPU1\nGPU0     X      PHB\nGPU1    PHB      X\n"


@pytest.fixture(autouse=True)
def _no_nccl_env(monkeypatch, tmp_path):
    """The tests' NCCL settings are the ones they pass, not whatever this shell exports; anything
    a command writes beside its inputs lands in the test's folder."""
    for k in list(os.environ):
        if k.upper().startswith("NCCL_"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _refused(argv: list[str], capsys, inputs: list[Path], *words: str) -> str:
    """Run the CLI; assert exit 2, no output but one stderr line holding ``words``, inputs unchanged."""
    before = {p: _sha(p) for p in inputs}
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    assert rc == 2, out.out + out.err
    assert "Traceback" not in out.err
    lines = out.err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("fastverify: error: "), out.err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert {p: _sha(p) for p in inputs} == before, "an input file was changed"
    return lines[0]


# --------------------------------------------------------------------------------------------
# 1. tune --profile: sizes, counts and times past the bounds, world size 0 and 1


def _v1(**over) -> dict:
    """A version-1 trace profile of 2 ranks: 6 all-reduces of 4096 B over 3 steps, 2 per step."""
    doc = {
        "schema": "fastverify.profile",
        "schema_version": 1,
        "timing": {"clock": "trace"},
        "world_size": 2,
        "source": {"kind": "trace", "files": ["a", "b"]},
        "allreduce_by_msg_size": [{"msg_bytes": 4096, "count": 6}],
        "ranks": [
            {
                "rank": r,
                "step_median": {
                    "steps": 3,
                    "allreduce_count": 2,
                    "compute_us": 10.0,
                    "allreduce_us": 5.0,
                    "window_us": 20.0,
                },
            }
            for r in (0, 1)
        ],
    }
    doc.update(over)
    return doc


def _v2(msg_bytes: int = 2048) -> dict:
    """A version-2 live profile (bf16, hidden 128, 8 tokens: 2048 B per all-reduce) written by the
    real builder and encoder: 2 ranks, 3 steps of 5 all-reduces of ``msg_bytes``."""
    ranks = []
    for rank in (0, 1):
        rows, marks, t = [], [], 1_000
        for s in range(3):
            start = t
            for _ in range(5):
                rows.append(("gemm", EventClass.COMPUTE, t, 700, -1))
                rows.append(("ncclAllReduce", EventClass.ALLREDUCE, t + 700, 300, msg_bytes))
                t += 1_100
            marks.append(Step(f"verify#{s}", start, t))
            t += 500
        ranks.append(
            RankEvents.from_rows(rank, f"r{rank}", rows, steps=marks, meta={"world_size": 2, "timing": "cuda_events"})
        )
    source = {
        "kind": "live",
        "model": "m",
        "tp": 2,
        "draft_tokens": 4,
        "batch": 2,
        "tokens": 8,
        "iters": 3,
        "warmup": 1,
        "device": "cuda",
        "dist_backend": "nccl",
        "backend": "nccl",
        "dtype": "bfloat16",
        "hidden": 128,
    }
    shapes = Shapes(dtype="bfloat16", hidden=128, tokens=8, draft_tokens=4, batch=2)  # 8 x 128 x 2 = 2048 B
    return json.loads(encode_profile(build_profile(ranks, source, shapes)))


def _tune_profile(tmp_path: Path, doc: dict) -> tuple[list, list[Path]]:
    prof, topo = tmp_path / "p.json", tmp_path / "t2.txt"
    prof.write_text(json.dumps(doc))
    topo.write_text(TWO_GPU_TOPO)
    return ["tune", "--predict", "--topology", topo, "--profile", prof], [prof, topo]


def test_the_issue_profile_was_priced_and_is_now_refused(tmp_path, capsys):
    """Before: 1e15-byte messages priced at 491,929,073,295.8 µs per step, exit 0."""
    argv, files = _tune_profile(tmp_path, _v1(allreduce_by_msg_size=[{"msg_bytes": 10**15, "count": 6}]))
    _refused(argv, capsys, files, "p.json", "allreduce_by_msg_size[0].msg_bytes", "1000000000000000", "1 TiB")


@pytest.mark.parametrize(
    "mutate, words",
    [
        (
            lambda d: d["allreduce_by_msg_size"][0].update(count=10**12),
            ["allreduce_by_msg_size[0].count", "10000000000"],
        ),
        (lambda d: d["allreduce_by_msg_size"][0].update(msg_bytes=-4096), ["msg_bytes", "-4096", "below 0"]),
        (lambda d: d["ranks"][1]["step_median"].update(compute_us=-5.0), ["ranks[1].step_median.compute_us", "-5.0"]),
        (lambda d: d["ranks"][0]["step_median"].update(window_us=1e300), ["window_us", "1e+300", "1 hour"]),
        (lambda d: d["ranks"][0]["step_median"].update(allreduce_count=1e12), ["allreduce_count", "1000000000000"]),
        (lambda d: d.update(world_size=0), ["world_size = 0", "below 1"]),
        (lambda d: d.update(world_size=1), ["world_size 1", "nothing to tune"]),
        (
            lambda d: (d.pop("world_size"), d.update(ranks=d["ranks"][:1])),
            ["no world_size and 1 rank", "nothing to tune"],
        ),
        (lambda d: d["source"].update(kind="live", tokens=10**9), ["source.tokens", "1000000000"]),
        (lambda d: d.update(accept_length=1e9), ["accept_length", "1000000000"]),
    ],
)
def test_version_1_profile_past_the_bounds(tmp_path, capsys, mutate, words):
    doc = _v1()
    mutate(doc)
    argv, files = _tune_profile(tmp_path, doc)
    _refused(argv, capsys, files, "p.json", *words)


@pytest.mark.parametrize(
    "mutate, words",
    [
        (
            lambda d: d["allreduce_by_msg_size"][0].update(msg_bytes=10**15),
            ["allreduce_by_msg_size[0].msg_bytes", "1 TiB"],
        ),
        (
            lambda d: d["allreduce_by_msg_size"][0].update(median_us=7.2e9),
            ["allreduce_by_msg_size[0].median_us", "1 hour"],
        ),
        (lambda d: d["ranks"][0]["step_median"].update(allreduce_us=-1.0), ["ranks[0].step_median.allreduce_us"]),
        (lambda d: d["ranks"][0].update(allreduce_wait_us=1e20), ["ranks[0].allreduce_wait_us"]),
        (lambda d: d["ranks"][0]["steps"][0].update(events=10**10), ["ranks[0].steps[0].events"]),
        (lambda d: d["cross_rank"]["collectives"][0].update(msg_bytes=2**41), ["cross_rank.collectives[0].msg_bytes"]),
        (lambda d: d.update(world_size=0), ["world_size = 0"]),
        (lambda d: d["source"].update(tp=0), ["source.tp = 0", "below 1"]),
        (lambda d: d["shapes"].update(hidden=10**6), ["shapes.hidden = 1000000", "hidden size"]),
    ],
)
def test_version_2_profile_past_the_bounds(tmp_path, capsys, mutate, words):
    doc = _v2()
    mutate(doc)
    argv, files = _tune_profile(tmp_path, doc)
    _refused(argv, capsys, files, "p.json", *words)


def test_profiles_inside_the_bounds_still_tune(tmp_path, capsys):
    for doc in (_v1(), _v2()):
        argv, _ = _tune_profile(tmp_path, doc)
        rc = main([str(a) for a in argv] + ["--json"])
        out = capsys.readouterr()
        assert rc == 0, out.err


# --------------------------------------------------------------------------------------------
# 2. NCCL settings: taken together, and a buffer too small for its protocol


def test_min_channels_above_max_is_an_error_naming_both():
    """Before: NCCL_MIN_NCHANNELS=64 with NCCL_MAX_NCHANNELS=1 passed silently. NCCL caps at 1, then
    copies channels up to 64 (src/graph/connect.cc): the maximum is not honoured."""
    (f,) = validate_settings({"NCCL_MIN_NCHANNELS": "64", "NCCL_MAX_NCHANNELS": "1"})
    assert f.severity is Severity.ERROR and f.name == "NCCL_MAX_NCHANNELS" and f.value == "1"
    assert "NCCL_MIN_NCHANNELS=64" in f.reason and "runs 64 channels" in f.reason and "connect.cc" in f.reason
    assert f.fix and "\n" not in f.reason
    # each value alone is fine: only the pair is wrong
    assert validate_setting("NCCL_MIN_NCHANNELS", "64").severity is Severity.OK
    assert validate_setting("NCCL_MAX_NCHANNELS", "1").severity is Severity.OK
    # validate_env holds the pair's finding too
    env = validate_env({"NCCL_MIN_NCHANNELS": "64", "NCCL_MAX_NCHANNELS": "1"})
    assert [x.severity for x in env] == [Severity.OK, Severity.OK, Severity.ERROR]


@pytest.mark.parametrize(
    "pairs, errors",
    [
        ([("NCCL_MIN_CTAS", "16"), ("NCCL_MAX_CTAS", "4")], ["NCCL_MIN_CTAS"]),  # lowered to maxCTAs (init.cc)
        ([("NCCL_MIN_NRINGS", "8"), ("NCCL_MAX_CTAS", "2")], ["NCCL_MAX_CTAS"]),
        ([("NCCL_MIN_CTAS", "32"), ("NCCL_MAX_NCHANNELS", "4")], ["NCCL_MAX_NCHANNELS"]),
        ([("NCCL_MIN_NCHANNELS", "99"), ("NCCL_MAX_NCHANNELS", "70")], []),  # both clamped to 64: no contradiction
        ([("NCCL_MIN_NRINGS", "64"), ("NCCL_MIN_NCHANNELS", "1"), ("NCCL_MAX_NCHANNELS", "2")], []),  # NCHANNELS wins
        ([("NCCL_MIN_NCHANNELS", "8"), ("NCCL_MAX_NCHANNELS", "1"), ("NCCL_MAX_NCHANNELS", "8")], []),  # later wins
        (
            [("NCCL_MIN_NCHANNELS", "4"), ("NCCL_MAX_NCHANNELS", "8"), ("NCCL_MIN_CTAS", "2"), ("NCCL_MAX_CTAS", "16")],
            [],
        ),
        ([("NCCL_MIN_NCHANNELS", "abc"), ("NCCL_MAX_NCHANNELS", "1")], []),  # not a number: validate_setting's job
    ],
)
def test_channel_pairs(pairs, errors):
    got = [f.name for f in validate_settings(pairs) if f.severity is Severity.ERROR]
    assert got == errors


@pytest.mark.parametrize(
    "name, value, least",
    [
        ("NCCL_BUFFSIZE", "1", 4096),
        ("NCCL_BUFFSIZE", "2048", 4096),
        ("NCCL_LL_BUFFSIZE", "128", 256),
        ("NCCL_LL128_BUFFSIZE", "8192", 16384),
    ],
)
def test_buffer_too_small_for_its_chunk_is_refused_at_the_cli(tmp_path, capsys, name, value, least):
    """NCCL takes the size unchecked and divides by a 0-byte chunk (src/enqueue.cc calcCollChunking)."""
    topo = tmp_path / "t2.txt"
    topo.write_text(TWO_GPU_TOPO)
    _refused(
        ["topo", "--nvidia-smi", topo, "--set", f"{name}={value}"],
        capsys,
        [topo],
        f"--set {name}={value}",
        "SIGFPE",
        f"at least {least} bytes",
    )


def test_buffer_sizes_that_run():
    for name, value in (
        ("NCCL_BUFFSIZE", "4096"),
        ("NCCL_LL_BUFFSIZE", "256"),
        ("NCCL_LL128_BUFFSIZE", "16384"),
        ("NCCL_BUFFSIZE", "4194304"),
    ):
        assert validate_setting(name, value).severity is Severity.OK
    # before 2.22 NCCL did not round the chunk to a grain: 1024 runs (untested), 4 divides by zero
    old = NcclVersion.parse("2.21.5")
    assert validate_setting("NCCL_BUFFSIZE", "1024", old).severity is Severity.WARNING
    assert validate_setting("NCCL_BUFFSIZE", "4", old).severity is Severity.ERROR


# --------------------------------------------------------------------------------------------
# 3. all_reduce_perf tables: nan, inf, negative and over-bound times, sizes and bandwidths

PERF_HEAD = (
    "# nThread 1 nGpus 2 minBytes 8 maxBytes 65536 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 "
    "validation: 1 graph: 0\n"
    "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong\n"
    "           8             2     float     sum      -1    38.83    0.00    0.00      0    40.43    0.00    0.00      0\n"
)


@pytest.mark.parametrize(
    "row, words",
    [
        (
            "       57344         14336     float     sum      -1      nan    0.00    0.00      0    40.43    0.00    0.00      0",
            ["out-of-place time nan"],
        ),
        (
            "       57344         14336     float     sum      -1    38.83    0.00    0.00      0      inf    0.00    0.00      0",
            ["in-place time inf"],
        ),
        (
            "       57344         14336     float     sum      -1   -12.50    0.00    0.00      0    40.43    0.00    0.00      0",
            ["out-of-place time -12.5"],
        ),
        (
            "       57344         14336     float     sum      -1    7.2e9    0.00    0.00      0    40.43    0.00    0.00      0",
            ["out-of-place time 7200000000.0", "1 hour"],
        ),
        (
            "       57344         14336     float     sum      -1    38.83     nan    0.00      0    40.43    0.00    0.00      0",
            ["out-of-place algbw nan"],
        ),
        (
            "       57344         14336     float     sum      -1    38.83    0.00   -1.00      0    40.43    0.00    0.00      0",
            ["out-of-place busbw -1.0"],
        ),
        (
            "       57344         14336     float     sum      -1    38.83    0.00    0.00      0    40.43   1e308    0.00      0",
            ["in-place algbw 1e+308"],
        ),
        (
            "  1000000000000000   250000000000000     float     sum      -1    38.83    0.00    0.00      0    40.43    0.00    0.00      0",
            ["size 1000000000000000", "1 TiB"],
        ),
        (
            "      -57344         14336     float     sum      -1    38.83    0.00    0.00      0    40.43    0.00    0.00      0",
            ["size -57344"],
        ),
    ],
)
def test_perf_table_value_past_the_bounds(tmp_path, capsys, row, words):
    """Before: a nan time was kept and reported as 'measured: nan µs'."""
    perf = tmp_path / "perf.txt"
    perf.write_text(PERF_HEAD + row + "\n")
    _refused(["topo", "--perf-table", perf], capsys, [perf], "perf.txt", "line 4", *words)


def test_perf_table_average_nan_is_refused(tmp_path, capsys):
    perf = tmp_path / "perf.txt"
    perf.write_text(PERF_HEAD + "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : nan\n")
    _refused(["topo", "--perf-table", perf], capsys, [perf], "perf.txt", "line 5", "Avg bus bandwidth nan")


def test_perf_table_inside_the_bounds_is_read():
    t = parse_all_reduce_perf(PERF_HEAD + "# Avg bus bandwidth    : 0.00\n", source="ok.txt")
    assert [(r.size_bytes, r.oop_time_us) for r in t.rows] == [(8, 38.83)] and t.avg_busbw_gbps == 0.0


# --------------------------------------------------------------------------------------------
# 4. NCCL logs: every numeric field under one rule (refused, naming line, field and value)

P = "host0:1:2 [0] NCCL INFO "


@pytest.mark.parametrize(
    "line, words",
    [
        (
            "Pattern 4, crossNic 0, nChannels 2, bw 1e308/12.0, type PHB/PIX, sameChannels 1",
            ["graph intra bandwidth 1e+308 GB/s"],
        ),
        (
            "Pattern 4, crossNic 0, nChannels 1000000000000, bw 12.0/12.0, type PHB/PIX, sameChannels 1",
            ["graph nChannels 1000000000000", "64"],
        ),
        # 65 used to reach the cost model, whose ModelInputs takes 1..64 and raised a ValueError
        ("Pattern 4, crossNic 0, nChannels 65, bw 12.0/12.0, type PHB/PIX, sameChannels 1", ["graph nChannels 65"]),
        (
            "1000000000000 coll channels, 0 collnet channels, 0 nvls channels, 2 p2p channels, 2 p2p channels per peer",
            ["coll channels 1000000000000"],
        ),
        ("AllReduce: 8192 Bytes -> Algo 1 proto 0 time nan", ["call time nan"]),
        ("AllReduce: 8192 Bytes -> Algo 1 proto 0 time -3.000000", ["call time -3.0"]),
        ("AllReduce: 1000000000000000 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}", ["call size", "1 TiB"]),
        ("AllReduce: 8192 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..99}", ["call channel 99"]),
        ("Channel 99/99 :  0 1", ["ring channel 99"]),
        ("Channel 100/0 : 0[0] -> 1[1] via P2P/CUMEM", ["transport channel 100"]),
        ("=== System : maxBw 1e308 totalBw 24.0 ===", ["system maxBw 1e+308"]),
        ("GPU/0-ce000 :GPU/0-4e000 (5/1e308/SYS) ", ["path bandwidth", "1e+308"]),
        ("Trees [0] 1/-1/-1->0->-1 [70] 1/-1/-1->0->-1", ["tree channel 70"]),
    ],
)
def test_nccl_log_value_past_the_bounds(tmp_path, capsys, line, words):
    """Before: 1e308 GB/s in a TUNING cell or a call time was kept; a 10^12 channel count on the
    'coll channels' line was skipped without a word, on the GRAPH line called 'cut off?'."""
    log = tmp_path / "nccl.log"
    log.write_text(P + "NCCL version 2.27.5+cuda12.9\n" + P + line + "\n")
    _refused(["topo", "--nccl-log", log], capsys, [log], "nccl.log", "line 2", *words)


def test_nccl_log_tuning_cell_past_the_bounds(tmp_path, capsys):
    log = tmp_path / "nccl.log"
    log.write_text(
        "".join(
            P + x + "\n"
            for x in (
                "  Algorithm   |            Tree |            Ring |   CollNetDirect |",
                "  Protocol    |     LL |   LL128 |  Simple |     LL |   LL128 |  Simple |     LL |   LL128 |  Simple |",
                "    AllReduce |   10.8/   2.2 |   14.0/   0.0 |   46.0/  14.4 |    6.6/ 1e308 |   14.0/   0.0 |"
                "   14.0/  14.4 |    0.0/   0.0 |    0.0/   0.0 |    0.0/   0.0 |",
            )
        )
    )
    _refused(
        ["topo", "--nccl-log", log], capsys, [log], "nccl.log", "line 3", "TUNING AllReduce RING/LL bandwidth", "1e+308"
    )


def test_nccl_log_tree_index_of_5000_digits_is_a_problem_not_a_crash():
    """Before: int() of a 5000-digit channel index raised ValueError (Python's 4300-digit limit)."""
    log = parse_nccl_log(P + "Trees [" + "9" * 5000 + "] 1/-1/-1->0->-1\n")
    assert log.trees == () and log.problems and "cut off" in log.problems[0]


def test_nccl_log_inside_the_bounds_is_read():
    log = parse_nccl_log(
        "".join(
            P + x + "\n"
            for x in (
                "Pattern 4, crossNic 0, nChannels 64, bw 24.000000/24.000000, type PHB/PIX, sameChannels 1",
                "AllReduce: 8192 Bytes -> Algo 1 proto 0 time 3600000000.000000",  # NCCL's own 'no time yet' (1 hour)
                "GPU/0-ce000 :GPU/0-ce000 (0/5000.0/LOC) GPU/0-4e000 (5/10.0/SYS) ",
            )
        )
    )  # LOC_BW 5000 GB/s
    assert log.graphs[0].n_channels == 64 and log.calls[0].time_us == 3.6e9 and log.problems == ()


# --------------------------------------------------------------------------------------------
# 5. the tune journal: fixtures written by the current writer, at the current schema


def _spec() -> TrialSpec:
    return TrialSpec(
        backend="gloo",
        env={"NCCL_PROTO": "LL"},
        world_size=2,
        device="cpu",
        dtype="bfloat16",
        hidden=64,
        sizes=((64, 2),),
        warmup=1,
        iters=3,
    )


def _result(spec: TrialSpec, step_us: float) -> TrialResult:
    return TrialResult(
        spec.trial_id, "ok", "", (SizeResult(64, 128, 2, 10.0, 12.0, 0.0),), step_us, "cpu_wall_clock", 1.0, 2.0
    )


def _journal(path: Path, step_us: float = 20.0) -> bytes:
    """A journal of one trial written by the current code (``Journal``), not a stored file: it
    cannot fall behind JOURNAL_SCHEMA_VERSION the way a schema-1 fixture did."""
    spec = _spec()
    with Journal.open(path, fingerprint=fingerprint([spec]), resume=False) as j:
        j.append(spec, _result(spec, step_us))
    raw = path.read_bytes()
    assert json.loads(raw.split(b"\n")[0])["schema_version"] == JOURNAL_SCHEMA_VERSION
    return raw


def _tune_resume(tmp_path: Path) -> tuple[list, Path]:
    topo = tmp_path / "t2.txt"
    topo.write_text(TWO_GPU_TOPO)
    return [
        "tune",
        "--topology",
        topo,
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
        tmp_path / "j.jsonl",
        "--resume",
        "--timeout",
        "60",
    ], topo


def test_negative_step_in_the_journal_is_refused_on_resume(tmp_path, capsys):
    """The record itself is refused (line 2, step_us), not the header: a schema-1 fixture was
    refused for its schema and so never reached the step check."""
    path = tmp_path / "j.jsonl"
    _journal(path, step_us=-1000.0)
    argv, topo = _tune_resume(tmp_path)
    _refused(argv, capsys, [path, topo], "j.jsonl", "line 2 is corrupt", "step_us", "-1000.0")


def test_the_negative_step_case_reaches_the_step_check(tmp_path, monkeypatch):
    """The fixture tests what it was built for: with the time check switched off the same file
    reads back, so the refusal above comes from the step check and nothing else."""
    path = tmp_path / "j.jsonl"
    _journal(path, step_us=-1000.0)
    monkeypatch.setattr(sweep, "implausible_time_us", lambda v: None)
    (rec,) = read_journal(path).records
    assert rec.result.step_us == -1000.0


def test_torn_last_line_is_skipped_before_the_sweep_is_checked(tmp_path, capsys):
    """A torn last record is dropped (not 'corrupt'), so resuming another sweep's journal is refused
    for the fingerprint, and the file is left whole (it is cut only when the sweep matches)."""
    path = tmp_path / "j.jsonl"
    good = _journal(path)
    torn = b'{"kind":"trial","spec":{"trial_id":"c7'
    path.write_bytes(good + torn)
    got = read_journal(path)
    assert got.header["schema_version"] == JOURNAL_SCHEMA_VERSION
    assert len(got.records) == 1 and got.torn_bytes == len(torn) and got.good_bytes == len(good)
    argv, topo = _tune_resume(tmp_path)
    line = _refused(argv, capsys, [path, topo], "j.jsonl", "different sweep")
    assert "corrupt" not in line


def test_a_complete_bad_last_line_is_not_taken_for_torn(tmp_path, capsys):
    """The counter-case of the one above: with its newline the same bytes are corruption."""
    path = tmp_path / "j.jsonl"
    path.write_bytes(_journal(path) + b'{"kind":"trial","spec":{"trial_id":"c7\n')
    argv, topo = _tune_resume(tmp_path)
    _refused(argv, capsys, [path, topo], "j.jsonl", "line 3 is corrupt")


def test_topo_set_values_that_contradict_each_other_exit_2(tmp_path, capsys):
    topo = tmp_path / "topo.txt"
    topo.write_text("\tGPU0\tGPU1\nGPU0\t X \tSYS\nGPU1\tSYS\t X \n")
    before = hashlib.sha256(topo.read_bytes()).hexdigest()
    rc = main(["topo", "--nvidia-smi", str(topo), "--set", "NCCL_MIN_NCHANNELS=64", "--set", "NCCL_MAX_NCHANNELS=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "the minimum (64) is above the maximum (1)" in err, err
    assert hashlib.sha256(topo.read_bytes()).hexdigest() == before
    assert (
        main(["topo", "--nvidia-smi", str(topo), "--set", "NCCL_MIN_NCHANNELS=2", "--set", "NCCL_MAX_NCHANNELS=4"]) == 0
    )


def test_env_file_settings_that_contradict_each_other_are_refused(tmp_path, capsys):
    from fastverify.envfile import read_env_file, render_env
    from fastverify.errors import UserError

    env = tmp_path / "box.env"
    env.write_text("NCCL_MIN_NCHANNELS=64\nNCCL_MAX_NCHANNELS=1\n")
    with pytest.raises(UserError, match=r"box.env: NCCL_\w+=\d+: .*the minimum \(64\) is above the maximum \(1\)"):
        read_env_file(env)
    with pytest.raises(UserError, match="the minimum"):
        render_env({"NCCL_MIN_NCHANNELS": "64", "NCCL_MAX_NCHANNELS": "1"})
    assert read_env_file(_write(tmp_path / "ok.env", "NCCL_MIN_NCHANNELS=2\nNCCL_MAX_NCHANNELS=4\n")) == {
        "NCCL_MIN_NCHANNELS": "2",
        "NCCL_MAX_NCHANNELS": "4",
    }
    assert main(["doctor", "--quick", "--env-file", str(env)]) == 1  # the doctor's env-file check fails on it
    capsys.readouterr()


def _write(path, text):
    path.write_text(text)
    return path
