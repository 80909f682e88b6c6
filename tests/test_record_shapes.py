"""The deployment record carries the profile's own verify shapes end to end: a live profile of 3
draft tokens x batch 5 (2 gloo ranks, the tiny preset) through ``tune --predict --write-env``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_fastverify

REPO = Path(__file__).resolve().parents[1]
TOPO = REPO.parent / "shared" / "inputs" / "topo-nccl-tests-307.txt"


@pytest.fixture(scope="module")
def profile_3x5(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("p3x5")
    cp = run_fastverify(
        ["profile", "--draft-tokens", "3", "--batch", "5", "--output", str(work / "p.json"), "--no-png", "--quiet"],
        cwd=work,
        timeout=300,
    )
    assert cp.returncode == 0, cp.stderr[-2000:]
    return work / "p.json"


def _tune(profile: Path, work: Path, *extra: str):
    if not TOPO.is_file():
        pytest.skip(f"{TOPO} absent (the shared inputs beside the checkout)")
    return run_fastverify(
        [
            "tune",
            "--profile",
            str(profile),
            "--predict",
            "--topology",
            str(TOPO),
            "--write-env",
            str(work / "x.env"),
            *extra,
        ],
        cwd=work,
        timeout=300,
    )


def test_record_has_the_profiles_draft_tokens_and_batch(profile_3x5, tmp_path):
    hidden = json.loads((REPO / "fastverify" / "live" / "presets" / "tiny.json").read_text())["hidden_size"]
    cp = _tune(profile_3x5, tmp_path)
    assert cp.returncode == 0, cp.stderr[-2000:]
    shapes = json.loads((tmp_path / "x.deploy.json").read_text())["shapes"]
    assert shapes == {"max_batch": 5, "draft_tokens": 3, "hidden": hidden, "dtype": "bfloat16"}
    cp = _tune(profile_3x5, tmp_path, "--max-batch", "48", "--force")  # over the first pair: asked for
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert json.loads((tmp_path / "x.deploy.json").read_text())["shapes"]["max_batch"] == 48


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--draft-tokens", "4"], "has 3 draft tokens per request; drop the flag"),
        (["--max-batch", "4"], "--max-batch 4: smaller than the workload's batch 5"),
        (["--tp", "8"], "was measured at TP 2; drop the flag"),
    ],
)
def test_flags_that_contradict_the_profile_are_refused(profile_3x5, tmp_path, extra, words):
    cp = _tune(profile_3x5, tmp_path, *extra)
    assert cp.returncode == 2 and words in cp.stderr and len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    assert not (tmp_path / "x.env").exists() and not (tmp_path / "x.deploy.json").exists()
