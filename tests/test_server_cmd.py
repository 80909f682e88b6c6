"""The verify shapes read from an SGLang server command (fastverify/patch/server_cmd.py): the reader
of 0.5.23's flags on its own, and against SGLang 0.5.23's own parser (``prepare_server_args``) in the
SGLang venv. Expected values are the commands' own numbers and SGLang's rules as its source states
them (``srt/arg_groups/speculative_hook.py``, ``srt/speculative/adaptive_spec_params.py``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fastverify.errors import UserError
from fastverify.patch.server_cmd import (
    SOURCE_READER,
    SOURCE_SGLANG,
    read_command,
    read_flags,
    read_with_sglang,
    server_args_of,
)

REPO = Path(__file__).resolve().parents[1]
LAUNCH = ["python", "-m", "sglang.launch_server", "--model-path", "/models/kimi-k2.5"]

# (flags, tp, algorithm, draft tokens, topk, steps, max batch, graphs disabled)
CASES = [
    (
        [
            "--tp",
            "8",
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-num-steps",
            "5",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "6",
            "--cuda-graph-max-bs-decode",
            "48",
        ],
        8,
        "EAGLE3",
        6,
        1,
        5,
        48,
        False,
    ),
    (
        [
            "--tp-size",
            "8",
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-steps",
            "3",
            "--cuda-graph-bs-decode",
            "1",
            "2",
            "4",
            "16",
        ],
        8,
        "EAGLE",
        4,
        1,
        3,
        16,
        False,
    ),
    # tree draft: 4 steps x topk 2, 8 draft tokens (more than 36 rows per step from batch 5)
    (
        [
            "--tensor-parallel-size",
            "4",
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-num-steps",
            "4",
            "--speculative-eagle-topk",
            "2",
            "--speculative-num-draft-tokens",
            "8",
        ],
        4,
        "EAGLE3",
        8,
        2,
        4,
        None,
        False,
    ),
    # adaptive: SGLang's default candidate steps {0, 1, 3, 5, 7} -> up to 7 + 1 tokens
    (
        ["--tp", "2", "--speculative-algorithm", "EAGLE3", "--speculative-adaptive", "--cuda-graph-max-bs-decode", "8"],
        2,
        "EAGLE3",
        8,
        1,
        None,
        8,
        False,
    ),
    (["--tp", "2", "--speculative-algorithm", "NGRAM", "--disable-cuda-graph"], 2, "NGRAM", 12, None, None, None, True),
    (["--tp", "2", "--cuda-graph-backend-decode", "disabled"], 2, None, None, None, None, None, True),
]


@pytest.mark.parametrize("flags, tp, algo, draft, topk, steps, max_bs, off", CASES)
def test_reader_of_the_flags(flags, tp, algo, draft, topk, steps, max_bs, off):
    s = read_command(LAUNCH + flags, sglang_found=False)
    assert (s.tp, s.algorithm, s.draft_tokens, s.topk, s.steps, s.max_batch, s.graphs_disabled) == (
        tp,
        algo,
        draft,
        topk,
        steps,
        max_bs,
        off,
    )
    assert s.source == SOURCE_READER
    if max_bs and draft and not off:
        assert (
            s.max_rows == max_bs * draft
            and s.covers() == f"verify steps up to {max_bs} requests x {draft} tokens ({max_bs * draft} rows)"
        )
    if off:
        assert s.max_rows is None and "eager (decode CUDA graphs off)" in s.covers()


@pytest.mark.parametrize(
    "flags, draft, words",
    [
        # SGLang turns adaptive off here (adaptive_unsupported_reason) and verifies the tokens given
        (
            [
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-adaptive",
                "--speculative-eagle-topk",
                "2",
                "--speculative-num-steps",
                "4",
                "--speculative-num-draft-tokens",
                "16",
            ],
            16,
            "only topk=1 is supported",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-adaptive", "--speculative-num-draft-tokens", "16"],
            16,
            "only EAGLE/EAGLE3 are supported",
        ),
    ],
)
def test_adaptive_is_dropped_where_sglang_drops_it(flags, draft, words):
    s = read_flags(flags)
    assert not s.adaptive and s.draft_tokens == draft and words in s.note, s


def test_one_token_and_one_request_read_as_such():
    s = read_flags(
        [
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-steps",
            "0",
            "--cuda-graph-max-bs-decode",
            "1",
        ]
    )
    assert s.covers() == "verify steps up to 1 request x 1 token (1 rows)"


def _adaptive(tmp_path, config) -> list[str]:
    cfg = tmp_path / "adaptive.json"
    cfg.write_text(json.dumps(config))
    return ["--speculative-algorithm", "EAGLE", "--speculative-adaptive", "--speculative-adaptive-config", str(cfg)]


def test_adaptive_config_file_sets_the_widest_step(tmp_path):
    s = read_flags(_adaptive(tmp_path, {"1": {"candidate_steps": [1, 2]}, "16": {"candidate_steps": [0, 4]}}))
    assert s.draft_tokens == 5  # max candidate 4, + the root token
    # keys that are not digits are skipped, as SGLang's _load_adaptive_config skips them
    s = read_flags(
        _adaptive(tmp_path, {"comment": "x", "x": {"candidate_steps": [1, 30]}, "1": {"candidate_steps": [1, 3]}})
    )
    assert s.draft_tokens == 4


@pytest.mark.parametrize(
    "config, words",
    [
        ({}, "at least one integer-string BS key"),
        ({"1": {"candidate_steps": []}}, "candidate_steps must be a list of non-negative ints, got []"),
        ({"1": {"candidate_steps": [-5]}}, "got [-5]"),
        ({"1": {"candidate_steps": [1.5, 3]}}, "got [1.5, 3]"),
        ({"1": {"candidate_steps": ["3", "9"]}}, "got ['3', '9']"),
        ({"1": {"candidate_steps": [10**20]}}, "got [1e+20]"),  # past 64 bits the JSON reader gives a float
        ({"1": {"candidate_steps": [100]}}, "candidate step 100 means 101 draft tokens, more than 64"),
        ({"1": [1, 3]}, "got None"),
        ([1, 3], "expected an object of batch sizes"),
    ],
)
def test_adaptive_configs_sglang_refuses_are_refused(tmp_path, config, words):
    with pytest.raises(UserError, match="not an SGLang adaptive config") as err:
        read_flags(_adaptive(tmp_path, config))
    assert words in str(err.value), err.value


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--cuda-graph-max-bs", "48"], "ambiguous option: --cuda-graph-max-bs could match"),
        (["--tp", "eight"], "invalid int value: 'eight'"),
        (["--speculative-num-draft-tokens"], "expected one argument"),
        (["--speculative-num-draft-tokens", "-6"], "--speculative-num-draft-tokens -6: expected 1..64"),
        (["--speculative-num-draft-tokens", "0"], "--speculative-num-draft-tokens 0: expected 1..64"),
        (["--cuda-graph-max-bs-decode", "-48"], "--cuda-graph-max-bs-decode -48: expected 1..4096"),
        (["--cuda-graph-bs-decode", "1", "0"], "--cuda-graph-bs-decode 0: expected 1..4096"),
        (["--tp-size", "0"], "--tp-size 0: expected 1..4096"),
        (["--speculative-num-steps", "-3"], "--speculative-num-steps -3: expected 0..64"),
        (["--speculative-num-draft-tokens", "1" + "0" * 22], "expected 1..64"),
        # SGLang 0.5.23 asserts both unset when the steps are (speculative_hook.py _handle_eagle_family)
        (
            ["--speculative-algorithm", "EAGLE3", "--speculative-num-draft-tokens", "6"],
            "without --speculative-num-steps",
        ),
    ],
)
def test_flags_sglang_refuses_are_refused_in_one_line(flags, words):
    with pytest.raises(UserError, match=words):
        read_flags(flags)


def test_only_sglang_server_commands_are_read():
    assert server_args_of(["python3", "-m", "sglang.launch_server", "--tp", "2"]) == ["--tp", "2"]
    assert server_args_of(["/opt/venv/bin/sglang", "serve", "--tp", "2"]) == ["--tp", "2"]
    assert server_args_of(["python", "my_engine.py", "--tp", "2"]) is None
    assert read_command(["python", "my_engine.py"], sglang_found=True) is None


_AGAINST = r"""
import json, sys
from sglang.srt.server_args import prepare_server_args
from fastverify.patch.server_cmd import read_flags
out = []
for flags in json.loads(sys.argv[1]):
    sa = prepare_server_args(["--model-path", "/nonexistent"] + flags)
    mine = read_flags(flags)
    theirs = {"tp": sa.tp_size, "algorithm": sa.speculative_algorithm, "topk": sa.speculative_eagle_topk,
              "steps": sa.speculative_num_steps, "decode_bs": list(sa.cuda_graph_bs_decode or []),
              "decode_max_bs": sa.cuda_graph_max_bs_decode, "adaptive": sa.speculative_adaptive, "dtype": sa.dtype,
              "draft_as_given": sa.speculative_num_draft_tokens}
    ours = {"tp": mine.tp, "algorithm": mine.algorithm, "topk": mine.topk if not mine.adaptive else None,
            "steps": mine.steps, "decode_bs": list(mine.decode_bs), "decode_max_bs": mine.decode_max_bs,
            "adaptive": mine.adaptive, "dtype": mine.dtype, "draft_as_given": None}
    out.append({"flags": flags, "theirs": theirs, "ours": ours, "draft": mine.draft_tokens})
print("RESULT " + json.dumps(out))
"""


def _sglang_python() -> str:
    py = os.environ.get("FASTVERIFY_SGLANG_PYTHON")
    if not py or not Path(py).is_file():
        pytest.skip("FASTVERIFY_SGLANG_PYTHON not set (make the SGLang venv with .ci/sglang-venv.sh)")
    return py


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    return env


def test_reader_agrees_with_sglangs_own_parser():
    py = _sglang_python()
    flags = [c[0] for c in CASES if "--disable-cuda-graph" not in c[0] and "disabled" not in c[0]]
    cp = subprocess.run(
        [py, "-c", _AGAINST, json.dumps(flags)], capture_output=True, text=True, timeout=300, env=_env(), cwd=str(REPO)
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    got = json.loads(next(ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    for g, case in zip(got, [c for c in CASES if c[0] in flags]):
        theirs, ours = g["theirs"], g["ours"]
        if theirs["algorithm"] is not None:
            theirs["algorithm"] = theirs["algorithm"].upper()
        theirs["draft_as_given"] = None  # SGLang resolves the width at start-up; compared below
        if theirs["adaptive"]:
            theirs["topk"] = None
        assert ours == theirs, g["flags"]
        assert g["draft"] == case[3], g["flags"]


def test_read_with_sglang_runs_sglangs_parser_and_refuses_what_it_refuses():
    py = _sglang_python()
    env = _env()
    s = read_with_sglang(["--model-path", "/nonexistent", *CASES[0][0]], py, env=env)
    assert s.source == SOURCE_SGLANG and (s.tp, s.max_batch, s.draft_tokens, s.max_rows) == (8, 48, 6, 288), s
    with pytest.raises(UserError, match="SGLang's parser says: ambiguous option: --cuda-graph-max-bs"):
        read_with_sglang(["--model-path", "/nonexistent", "--cuda-graph-max-bs", "48"], py, env=env)


def test_read_with_sglang_asks_sglang_about_adaptive(tmp_path):
    py = _sglang_python()
    env = _env()
    s = read_with_sglang(
        [
            "--model-path",
            "/nonexistent",
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-adaptive",
            "--speculative-eagle-topk",
            "2",
            "--speculative-num-steps",
            "4",
            "--speculative-num-draft-tokens",
            "16",
        ],
        py,
        env=env,
    )
    assert s.source == SOURCE_SGLANG and not s.adaptive and s.draft_tokens == 16, s
    assert "speculative_eagle_topk=2 (only topk=1 is supported)" in s.note, s  # SGLang's own reason
    bad = tmp_path / "adaptive.json"
    bad.write_text(json.dumps({"1": {"candidate_steps": []}}))
    with pytest.raises(UserError, match="SGLang refuses the adaptive config: ValueError: BS 1: candidate_steps"):
        read_with_sglang(
            [
                "--model-path",
                "/nonexistent",
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-adaptive",
                "--speculative-adaptive-config",
                str(bad),
            ],
            py,
            env=env,
        )


def test_a_parser_that_cannot_run_falls_back_to_the_reader_and_keeps_its_notes():
    import sys

    # this interpreter has no SGLang: the child exits 1, the reader runs, both reasons are said
    s = read_with_sglang(["--speculative-algorithm", "NGRAM", "--speculative-adaptive"], sys.executable, env=_env())
    assert s.source == SOURCE_READER and s.draft_tokens == 12 and not s.adaptive, s
    assert s.note.startswith("SGLang's parser exited 1") and "SGLang turns --speculative-adaptive off" in s.note, s
