"""The proof of a swap on the REAL SGLang 0.5.23 CPU server (TP 2 over gloo, NGRAM): ``launch --load``
before and after, ``compare``, and the start-up answer check against broken all-reduces.

The model is the tiny random Llama with a peaked output layer (``--lm-head-scale 200``,
:data:`tests.sglang_server.tiny_model.PEAKED_LM_HEAD_SCALE`: margins of several nats instead of
0.01) served in float32 (``--dtype float32``; SGLang's ``auto`` serves a float32 checkpoint in a
16-bit type on CPU, whose 8-bit logits tie exactly). Runs, one server start each (about 90 s on
two cores):

* ``baseline``: no swap (SGLang's own all-reduce over gloo);
* ``patched``: the dispatch slot carries every all-reduce of at most 4 rows (the verify steps)
  through a stand-in backend (``FVTEST_STANDIN_MAX_ROWS``): a correct swap;
* ``scale`` (sum x 1.01), ``drop5`` (every fifth call TP rank 0's part alone): broken, through the dispatch slot;
  ``ulp`` (every element one float step up, what a reordered sum does): not broken;
* ``eagle3`` and ``eagle3-patched``: the same pair under EAGLE-3 (a chain: 3 steps, topk 1, 4 draft
  tokens; the tiny random drafter of ``tiny_model.build_eagle3_drafter``), the drafter's all-reduces
  of one row taken by the stand-in too;
* ``heldout``: a broken all-reduce that fastverify never sees, an SGLang plugin written into a
  folder outside the project at test time, wrapping ``GroupCoordinator.all_reduce``.

Skipped, with the reason, when ``FASTVERIFY_SGLANG_PYTHON`` is not set.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import cli, sglang_python_or_skip

from tests.sglang_server.harness import launch_load, report_line
from tests.sglang_server.tiny_model import PEAKED_LM_HEAD_SCALE

LOAD = [
    "--load",
    "--max-new-tokens",
    "24",
    "--requests",
    "4",
    "--input-len",
    "16",
    "--output-len",
    "24",
    "--ready-timeout",
    "400",
]
FLOAT32 = ("--dtype", "float32")
HELDOUT = '''
"""A broken all-reduce from outside fastverify: every seventh call zeroes one element of the sum."""
def plugin():
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    original = GroupCoordinator.all_reduce
    calls = [0]
    def all_reduce(self, input_):
        out = original(self, input_)
        calls[0] += 1
        if calls[0] % 7 == 3:
            out = out.clone()
            out.view(-1)[0] = 0.0
        return out
    GroupCoordinator.all_reduce = all_reduce
'''


@pytest.fixture(scope="module")
def sglang_python() -> str:
    return sglang_python_or_skip()


@pytest.fixture(scope="module")
def peaked_model(sglang_python, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("peaked-llama")
    cp = subprocess.run(
        [sglang_python, "-m", "tests.sglang_server.tiny_model", str(out), "--lm-head-scale", str(PEAKED_LM_HEAD_SCALE)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(Path(__file__).resolve().parents[1]),
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def eagle3_drafter(sglang_python, peaked_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("peaked-eagle3")
    code = (
        "import sys; from tests.sglang_server.tiny_model import build_eagle3_drafter; "
        "build_eagle3_drafter(sys.argv[1], sys.argv[2])"
    )
    cp = subprocess.run(
        [sglang_python, "-c", code, str(out), str(peaked_model)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(Path(__file__).resolve().parents[1]),
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(sglang_python, peaked_model, tmp_path_factory, request):
    """name -> (Run, pids left after launch exited, run folder); started on first use."""
    root = tmp_path_factory.mktemp("proof")
    done: dict = {}

    def get(name: str, *, env: dict | None = None, args: list[str] | None = None, flags: tuple[str, ...] = ()):
        if name not in done:
            prof = root / name / "run"
            t0 = time.perf_counter()
            run, left = launch_load(
                sglang_python,
                root / name,
                peaked_model,
                prof=prof,
                fastverify_args=[*LOAD, *(args or [])],
                extra_env=env,
                server_flags=(*FLOAT32, *flags),
            )
            report_line(
                request, "sglang proof", f"{name}: launch --load rc {run.rc} in {time.perf_counter() - t0:.1f} s"
            )
            done[name] = (run, left, prof)
        return done[name]

    return get


def _baseline(runs):
    run, left, prof = runs("baseline")
    assert run.rc == 0, run.tail()
    return prof


def test_baseline_run_is_whole_and_stops_its_server(runs):
    run, left, prof = runs("baseline")
    assert run.rc == 0, run.tail()
    assert left == [], f"launch left processes running: {left}"
    doc = json.loads((prof / "load.json").read_text())
    assert doc["complete"] is True and doc["incomplete"] is None
    assert doc["clock"] == "cpu_server_wall_clock" and doc["server_info"]["device"] == "cpu"
    assert doc["server"]["tp"] == 2 and doc["server"]["algorithm"] == "NGRAM" and doc["server"]["dtype"] == "float32"
    assert len(doc["answers"]) == 16
    for a in doc["answers"]:
        assert len(a["output_ids"]) == 24 and a["completion_tokens"] == 24  # ignore_eos: the full length
        assert 1 <= a["spec_verify_ct"] <= 24
        assert len(a["logprobs"]) == 24 and all(lp <= 0 for lp in a["logprobs"])
    margins = [m for a in doc["answers"] for m in a["margins"] if m is not None]
    assert sorted(margins)[len(margins) // 2] > 1.0, "the peaked model's median margin should be over 1 nat"
    (t,) = doc["throughput"]
    assert t["concurrency"] == 1 and t["completed"] == 4 and t["errors"] == 0 and len(t["per_stream_tok_s"]) == 4
    # the benchmark client's own lines, beside the verify records of the same run
    assert (prof / "bench-c1.jsonl").exists() and sorted(p.name for p in prof.glob("verify-rank*.jsonl")) == [
        "verify-rank0.jsonl",
        "verify-rank1.jsonl",
    ]


def test_patched_run_under_the_same_load_gives_the_same_answers(runs, capsys):
    base = _baseline(runs)
    run, left, prof = runs("patched", env={"FVTEST_STANDIN_MAX_ROWS": "4"})
    assert run.rc == 0 and left == [], run.tail()
    rc, out, err = cli(["compare", base, prof], capsys)
    assert rc == 0, (out, err)
    assert "answers: same answers (16/16)" in out, out
    # the verify table is per (requests, tokens) bucket: NGRAM at one request verifies 4 tokens
    assert "1 x 4" in out and "NOT GPU time" in out, out
    assert "tok/s per stream at concurrency 1:" in out and "CPU wall clock (a CPU server): NOT a GPU timing" in out
    assert "accept length:" in out and "DROPPED" not in out
    closing = out.strip().splitlines()[-1]
    assert (
        closing.startswith("auto: verify step ")
        and "tok/s per stream" in closing
        and closing.endswith("same answers (16/16)")
    ), closing
    rc, out, err = cli(["compare", base, prof, "--json"], capsys)
    doc = json.loads(out)
    # the stand-in carried every verify all-reduce: the records say which path each took
    recs = [json.loads(x) for x in (prof / "verify-rank0.jsonl").read_text().splitlines()]
    assert all(r["allreduce_paths"]["verify"] == {"fastverify.gloo": 5} for r in recs), recs[0]
    b = next(x for x in doc["buckets"] if (x["batch"], x["tokens"]) == (1, 4))
    assert b["compared"] and b["before_steps"] >= 3 and b["after_steps"] >= 3
    assert doc["answers"]["identical"] == 16 and doc["exit_code"] == 0


@pytest.mark.parametrize("how", ["scale", "drop5"])
def test_a_broken_all_reduce_stops_the_server_at_the_startup_check_and_compare_says_changed(runs, how, capsys):
    base = _baseline(runs)
    run, left, prof = runs(how, env={"FVTEST_BROKEN": how}, args=["--baseline", str(base)])
    assert run.rc == 1, run.tail()
    assert left == [], f"the server was not stopped: {left}"
    line = next(x for x in run.stderr.splitlines() if "answers against --baseline" in x)
    assert "CHANGED: prompt " in line and "do not deploy" in line, line
    doc = json.loads((prof / "load.json").read_text())
    assert doc["complete"] is False and "start-up check" in doc["incomplete"] and doc["throughput"] == []
    rc, out, err = cli(["compare", base, prof], capsys)  # incomplete: refused unless asked
    assert rc == 2 and "incomplete run" in err, err
    rc, out, err = cli(["compare", base, prof, "--allow-incomplete"], capsys)
    assert rc == 1, (out, err)
    assert "answers: CHANGED: prompt " in out and "do not deploy" in out.strip().splitlines()[-1], out


def test_a_one_ulp_all_reduce_is_not_changed(runs, capsys):
    base = _baseline(runs)
    run, left, prof = runs("ulp", env={"FVTEST_BROKEN": "ulp"}, args=["--baseline", str(base)])
    assert run.rc == 0 and left == [], run.tail()
    rc, out, err = cli(["compare", base, prof, "--json"], capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["answers"]["verdict"] != "CHANGED", doc["answers"]
    # it did move the logprobs (the backend ran), by far less than the float32 tolerance
    moved = [p["max_dlogprob"] for p in doc["answers"]["prompts"]]
    assert 0 < max(moved) < doc["answers"]["tol"], moved


def test_a_held_out_broken_all_reduce_from_outside_the_project_is_caught(runs, tmp_path_factory, capsys):
    base = _baseline(runs)
    site = tmp_path_factory.mktemp("heldout-site")
    (site / "heldout_break.py").write_text(HELDOUT)
    info = site / "heldout_break-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: heldout-break\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\nheldout_break = heldout_break:plugin\n")
    # the harness's PYTHONPATH with this folder in front; both plugins allowed
    from tests.sglang_server.harness import server_env

    env = server_env(tmp_path_factory.mktemp("heldout-env"))
    run, left, prof = runs(
        "heldout",
        args=["--baseline", str(base)],
        env={
            "PYTHONPATH": os.pathsep.join([str(site), env["PYTHONPATH"]]),
            "SGLANG_PLUGINS": "fastverify_test_shim,heldout_break",
        },
    )
    assert run.rc == 1 and left == [], run.tail()
    assert any("answers against --baseline" in x and "CHANGED" in x for x in run.stderr.splitlines()), run.tail()
    rc, out, err = cli(["compare", base, prof, "--allow-incomplete"], capsys)
    assert rc == 1 and "CHANGED" in out, out


def test_eagle3_chain_patched_run_gives_the_same_answers(runs, eagle3_drafter, capsys):
    # the later flags win in SGLang's parser: EAGLE-3 replaces the harness's NGRAM
    flags = (
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(eagle3_drafter),
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
        "--speculative-draft-attention-backend",
        "intel_amx",
    )
    base, left, base_dir = runs("eagle3", flags=flags)
    assert base.rc == 0 and left == [], base.tail()
    run, left, prof = runs(
        "eagle3-patched", env={"FVTEST_STANDIN_MAX_ROWS": "4"}, flags=flags, args=["--baseline", str(base_dir)]
    )
    assert run.rc == 0 and left == [], run.tail()
    doc = json.loads((prof / "load.json").read_text())
    assert doc["server"]["algorithm"] == "EAGLE3" and doc["server"]["draft_tokens"] == 4
    rc, out, err = cli(["compare", base_dir, prof], capsys)
    assert rc == 0 and "answers: same answers (16/16)" in out and "1 x 4" in out, (out, err)
