"""tune's trials run in the environment SGLang's start-up imposes (NCCL_CUMEM_ENABLE=0 unless the
user set it, NCCL_NVLS_ENABLE=0, CUDA_DEVICE_MAX_CONNECTIONS=8, ...): `tune --json` on gloo shows
every trial's environment, the user's explicit setting wins, and SGLang's real
`_set_envs_and_config` (SGLang 0.5.23 srt/entrypoints/engine.py) gives the values the table
restates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import sglang_python_or_skip, subprocess_env

from fastverify.tune.server_env import SOURCE_SGLANG, server_environment, table_env


def _tune_json(tmp_path, shared_dir, **env_over) -> dict:
    topo = shared_dir / "inputs" / "topo-nccl-tests-307.txt"
    env = subprocess_env()
    for k in [k for k in env if k.startswith("NCCL_")]:
        del env[k]
    env.update(env_over)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastverify",
            "tune",
            "--topology",
            str(topo),
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
            "--timeout",
            "60",
            "--json",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_tune_json_shows_every_trials_environment_and_the_users_setting_wins(tmp_path, shared_dir):
    (tmp_path / "unset").mkdir()
    doc = _tune_json(tmp_path / "unset", shared_dir)
    trials = doc["candidates"] + doc["not_ranked"]
    assert len(trials) == 2  # the baseline and the cost model's top NCCL candidate
    for t in trials:
        env = t["environment"]
        assert env["NCCL_CUMEM_ENABLE"] == "0", t["name"]  # the shell leaves it unset: SGLang's 0
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
        assert t["server_env"]["NCCL_CUMEM_ENABLE"] == "0"
        for k, v in t["settings"].items():  # the candidate's own settings are in effect too
            assert env[k] == v
    journal = [json.loads(line) for line in (tmp_path / "unset" / "j.jsonl").read_text().splitlines()]
    recs = [r for r in journal if r["kind"] == "trial"]
    assert len(recs) == 2
    assert all(r["result"]["environment"]["NCCL_CUMEM_ENABLE"] == "0" for r in recs)
    assert all(r["spec"]["server_env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "8" for r in recs)

    (tmp_path / "set").mkdir()
    doc = _tune_json(tmp_path / "set", shared_dir, NCCL_CUMEM_ENABLE="1")
    for t in doc["candidates"] + doc["not_ranked"]:
        assert t["environment"]["NCCL_CUMEM_ENABLE"] == "1", t["name"]  # the user's explicit setting wins
        assert "NCCL_CUMEM_ENABLE" not in t["server_env"]


CASES = [
    ({}, [], {}),
    ({"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "1"}, [], {}),
    ({"NCCL_CUMEM_ENABLE": "0"}, ["--enable-symm-mem"], {}),
    ({}, ["--enable-nccl-nvls"], {}),
    ({"TRTLLM_ENABLE_PDL": "0", "CUTE_DSL_LOG_LEVEL": "10"}, [], {"NCCL_ALGO": "Ring"}),
]


def test_sglangs_own_set_envs_and_config_and_the_table_agree():
    """SGLang's real function in the 0.5.23 venv, on its parsed arguments: NCCL_CUMEM_ENABLE=0
    when unset, the user's 1 kept, --enable-symm-mem forcing 1; the 0.5.23 table (used where SGLang
    does not import) gives the same for each case."""
    py = sglang_python_or_skip()
    base = {
        k: v
        for k, v in subprocess_env().items()
        if not k.startswith(("NCCL_", "CUDA_DEVICE_MAX", "TRTLLM_", "CUTE_DSL_"))
    }
    for shell, flags, overlay in CASES:
        got = server_environment(
            ["--model-path", "/nonexistent/m", "--tp-size", "2", *flags],
            [overlay],
            tp=2,
            python=py,
            shell={**base, **shell},
        )
        assert got.source == SOURCE_SGLANG, got.note
        assert got.envs[0] == table_env(flags, {**shell, **overlay}), (shell, flags)
        if not shell and not flags:
            assert got.envs[0]["NCCL_CUMEM_ENABLE"] == "0" and got.envs[0]["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
        if shell.get("NCCL_CUMEM_ENABLE") == "1":
            assert "NCCL_CUMEM_ENABLE" not in got.envs[0]  # the user's setting wins
        if "--enable-symm-mem" in flags:
            assert got.envs[0]["NCCL_CUMEM_ENABLE"] == "1"


@pytest.mark.parametrize("flags, want", [([], "0"), (["--enable-symm-mem"], "1")])
def test_without_sglang_the_table_is_used(flags, want):
    got = server_environment(flags, [{}], tp=2, shell={})
    assert got.envs[0]["NCCL_CUMEM_ENABLE"] == want


@pytest.mark.parametrize(
    "server_args, words",
    [
        ('--tp 2 "x', ("--server-args", "No closing quotation")),
        ("--tp-size 3", ("--tp-size 3", "--tp is 2")),
        ("python -m sglang.launch_server --model-path m --tensor-parallel-size 4", ("--tp-size 4", "--tp is 2")),
    ],
)
def test_server_args_that_cannot_be_read_or_name_other_gpus_are_one_line(tmp_path, shared_dir, server_args, words):
    from conftest import assert_user_error, run_fastverify

    topo = shared_dir / "inputs" / "topo-nccl-tests-307.txt"
    proc = run_fastverify(
        [
            "tune",
            "--topology",
            str(topo),
            "--model",
            "tiny",
            "--tp",
            "2",
            "--top",
            "1",
            "--iters",
            "1",
            "--warmup",
            "1",
            "--journal",
            "j.jsonl",
            f"--server-args={server_args}",
        ],
        cwd=tmp_path,
    )
    assert_user_error(proc, *words)
    assert not (tmp_path / "j.jsonl").exists()  # refused before any trial


def test_without_sglang_the_line_says_the_flags_were_not_checked():
    env = server_environment(["--bogus-flag", "1"], [{}], tp=2, shell={})
    assert "not checked" in env.note and env.envs[0]["NCCL_CUMEM_ENABLE"] == "0"
