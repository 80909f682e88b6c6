"""``fastverify compare`` on hand-built run folders: buckets only where both runs served, their
percentiles as numpy computes them, the tok/s intervals, the accept-length flag, refusals."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
from conftest import cli

from fastverify.proof.answers import Answer, prompt_digest, read_prompts
from fastverify.proof.record import LoadRun
from fastverify.proof.throughput import ThroughputRun


def _run(folder, *, tok_s, verify, spec_ct=4, server=None, complete=True, ids_shift=0):
    """A run folder: fastverify's 16 prompts answered with 8 tokens, one throughput run at
    concurrency 1 (``tok_s`` per request), and verify records ``{(batch, tokens): [ms, ...]}`` on
    rank 0."""
    prompts, source = read_prompts(None)
    answers = [Answer(p.id, [i + ids_shift] * 8, [-0.1] * 8, [4.0] * 8, 8, spec_ct, 0.1) for i, p in enumerate(prompts)]
    t = ThroughputRun(1, len(tok_s), len(tok_s), 16, 24, 1, 1.0, float(np.mean(tok_s)), list(tok_s), [10.0], 2.0, 0)
    run = LoadRun(
        complete=complete,
        incomplete=None if complete else "cut",
        prompts=prompts,
        prompts_source=source,
        prompts_digest=prompt_digest(prompts),
        max_new_tokens=8,
        answers=answers,
        throughput=[t],
        server=server or {"tp": 2, "algorithm": "NGRAM", "draft_tokens": 4, "dtype": "float32"},
        server_info={"dtype": "float32"},
        clock="cpu_server_wall_clock",
        backend="pcie_ipc",
    )
    folder.mkdir(parents=True)
    (folder / "load.json").write_bytes(msgspec.json.encode(run))
    lines, step = [], 0
    for (b, k), ms in verify.items():
        for x in ms:
            lines.append(
                json.dumps(
                    {
                        "step": step,
                        "verify_ms": x,
                        "clock": "cpu_wall_clock",
                        "rank": "0",
                        "pid": 1,
                        "batch": b,
                        "tokens": k,
                    }
                )
            )
            step += 1
    (folder / "verify-rank0.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_compare_buckets_tok_s_and_verdict(tmp_path, capsys):
    bv = {(1, 4): [10.0, 11.0, 12.0, 13.0], (2, 8): [20.0, 21.0, 22.0], (4, 16): [40.0] * 5}
    av = {(1, 4): [6.0, 7.0, 8.0, 9.0], (2, 8): [15.0, 16.0], (8, 32): [80.0] * 5}
    before = _run(tmp_path / "b", tok_s=[80.0, 82.0, 84.0, 82.0], verify=bv)
    after = _run(tmp_path / "a", tok_s=[110.0, 112.0, 114.0, 112.0], verify=av)
    rc, out, err = cli(["compare", before, after, "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    buckets = {(x["batch"], x["tokens"]): x for x in doc["buckets"]}
    assert set(buckets) == {(1, 4), (2, 8)}  # only what both served: (4, 16) and (8, 32) never pooled in
    one = buckets[(1, 4)]
    assert one["p50_before"] == pytest.approx(np.percentile(bv[(1, 4)], 50))
    assert one["p90_after"] == pytest.approx(np.percentile(av[(1, 4)], 90))
    assert one["p50_change_pct"] == pytest.approx((7.5 - 11.5) / 11.5 * 100, abs=1e-3)
    assert buckets[(2, 8)]["compared"] is False and buckets[(2, 8)]["p50_change_pct"] is None  # 2 steps after
    (s,) = doc["streams"]
    assert s["before"]["mean"] == pytest.approx(82.0) and s["after"]["mean"] == pytest.approx(112.0)
    assert s["before"]["lo"] <= 82.0 <= s["before"]["hi"] and s["change_lo"] <= s["change_pct"] <= s["change_hi"]
    assert s["change_pct"] == pytest.approx((112 - 82) / 82 * 100, abs=1e-3)
    assert doc["answers"]["verdict"] == "same answers" and doc["exit_code"] == 0
    assert doc["accept"]["dropped"] is False
    rc, out, err = cli(["compare", before, after], capsys)
    assert rc == 0
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith("pcie_ipc: verify step -35 % (1 x 4 tokens, p50), tok/s per stream 82.0 -> 112.0 (+37 %")
    )
    assert "NOT a GPU timing" in out and "same answers (16/16)" in out


def test_changed_answers_exit_1_and_a_dropped_accept_length_is_flagged(tmp_path, capsys):
    v = {(1, 4): [10.0] * 4}
    before = _run(tmp_path / "b", tok_s=[80.0] * 4, verify=v, spec_ct=4)  # 8 tokens / 4 steps = 2.0
    after = _run(tmp_path / "a", tok_s=[80.0] * 4, verify=v, spec_ct=8, ids_shift=1)  # 1.0
    rc, out, err = cli(["compare", before, after], capsys)
    assert rc == 1, err
    assert "DROPPED" in out and "answers: CHANGED: prompt p00: diverged at token 0" in out
    assert out.strip().splitlines()[-1].endswith("CHANGED answers (0/16 with identical tokens): do not deploy")


@pytest.mark.parametrize(
    "change, words",
    [
        ({"server": {"tp": 4, "algorithm": "NGRAM", "draft_tokens": 4, "dtype": "float32"}}, ["tp", "not comparable"]),
        ({"complete": False}, ["incomplete run", "--allow-incomplete"]),
    ],
)
def test_not_comparable_runs_are_refused_in_one_line(tmp_path, capsys, change, words):
    v = {(1, 4): [10.0] * 4}
    before = _run(tmp_path / "b", tok_s=[80.0] * 4, verify=v)
    after = _run(tmp_path / "a", tok_s=[80.0] * 4, verify=v, **change)
    rc, out, err = cli(["compare", before, after], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and all(w in err for w in words), err


def test_profile_verify_log_of_two_load_runs_is_compare(tmp_path, capsys):
    v = {(1, 4): [10.0] * 4}
    before = _run(tmp_path / "b", tok_s=[80.0] * 4, verify=v)
    after = _run(tmp_path / "a", tok_s=[90.0] * 4, verify=v, ids_shift=1)
    rc, out, err = cli(["profile", "--verify-log", before, after], capsys)
    rc2, out2, err2 = cli(["compare", before, after], capsys)
    assert (rc, out) == (rc2, out2) and rc == 1
    rc, out, err = cli(["profile", "--verify-log", before, after, "--output", tmp_path / "x.json"], capsys)
    assert rc == 2 and "fastverify compare" in err and not (tmp_path / "x.json").exists()


def test_the_same_folder_twice_is_refused(tmp_path, capsys):
    run = _run(tmp_path / "b", tok_s=[80.0] * 4, verify={(1, 4): [10.0] * 4})
    rc, out, err = cli(["compare", run, run], capsys)
    assert rc == 2 and "same folder" in err, err


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda d: d.update(max_new_tokens=10**30), ["max_new_tokens"]),
        (lambda d: d.update(max_new_tokens=-5), ["max_new_tokens", "1..4096"]),
        (lambda d: d.update(answers=d["answers"][:3]), ["answers must follow the prompts", "3 answers"]),
        (lambda d: d["throughput"][0].update(per_stream_tok_s=[1e308, 1.0]), ["tok/s must be finite"]),
        (lambda d: d["answers"][0].update(margins=[-1.0] * 8), ["answer 'p00'", "margins"]),
        (lambda d: d.update(schema_version=2), ["of this version"]),
    ],
)
def test_a_hand_edited_run_is_refused_naming_file_and_field(tmp_path, capsys, edit, words):
    v = {(1, 4): [10.0] * 4}
    before = _run(tmp_path / "b", tok_s=[80.0] * 4, verify=v)
    after = _run(tmp_path / "a", tok_s=[80.0] * 4, verify=v)
    doc = json.loads((after / "load.json").read_text())
    edit(doc)
    (after / "load.json").write_text(json.dumps(doc))
    rc, out, err = cli(["compare", before, after], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "load.json" in err, err
    assert all(w in err for w in words), err
