"""`fastverify tune` end to end: the --predict path on the real nccl-tests#307 topology, the measure
path on gloo workers, and the one-line errors."""

from __future__ import annotations

import json

import pytest
from conftest import assert_user_error, run_fastverify, two_rank_trace_profile

from fastverify.envfile import read_env_file
from fastverify.nccl.checks import Severity, validate_env


def test_predict_writes_a_valid_env_file(shared_dir, tmp_path):
    """The issue's Done-when command: kimi-k2 (61 layers -> 1 + 2 x 61 = 123 all-reduces) at TP 8."""
    topo = shared_dir / "inputs" / "topo-nccl-tests-307.txt"
    proc = run_fastverify(
        [
            "tune",
            "--predict",
            "--topology",
            str(topo),
            "--model",
            "kimi-k2",
            "--tp",
            "8",
            "--draft-tokens",
            "4",
            "--write-env",
            "nccl_configs/example.env",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())  # rich wraps long lines
    assert "all-reduce per verify step (123 calls)" in out
    # pcie_ipc's range reaches NCCL's at 57 KB (too close to call): the cost model's NCCL_P2P_LEVEL=SYS wins
    assert "winner: NCCL_P2P_LEVEL=SYS: all-reduce per verify step" in out and "% (predicted)" in out
    assert "pcie_ipc: too close to call: measure (its predicted range " in out
    env_path = tmp_path / "nccl_configs" / "example.env"
    settings = read_env_file(env_path)
    from fastverify.deploy import read_record

    # the winner is an NCCL setting: the record says nccl, the env file holds it
    assert read_record(tmp_path / "nccl_configs" / "example.deploy.json").backend.value == "nccl"
    assert settings == {"NCCL_P2P_LEVEL": "SYS"}
    assert all(k.startswith("NCCL_") for k in settings)
    assert all(f.severity is not Severity.ERROR for f in validate_env(settings, None))
    text = env_path.read_text()
    assert "PREDICTED" in text
    assert all(line.startswith("#") or "=" in line for line in text.splitlines() if line)


def test_measure_on_gloo_with_journal_and_resume(shared_dir, tmp_path):
    topo = shared_dir / "inputs" / "topo-nccl-tests-307.txt"
    args = [
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
    ]
    first = run_fastverify(args, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "NOT GPU timings" in " ".join(first.stdout.split())
    records = [json.loads(line) for line in (tmp_path / "j.jsonl").read_text().splitlines()]
    trials = [r for r in records if r["kind"] == "trial"]
    assert len(trials) == 2  # baseline + the model's top candidate
    again = run_fastverify(args + ["--resume"], cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "j.jsonl").read_text().count("\n") == len(records)  # nothing re-run


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--profile", "p.json", "--model", "tiny"], ["--profile", "--model"]),
        (["--predict"], ["--topology"]),
        (["--predict", "--topology", "topo.txt", "--accept-length", "0"], ["--accept-length"]),
        (["--predict", "--topology", "topo.txt", "--tp", "16"], ["16"]),
        (["--predict", "--topology", "missing.txt"], ["missing.txt"]),
        (["--predict", "--topology", "topo.txt", "--model", "nope"], ["nope"]),
    ],
)
def test_tune_errors(shared_dir, tmp_path, extra, words):
    (tmp_path / "topo.txt").write_text((shared_dir / "inputs" / "topo-nccl-tests-307.txt").read_text())
    (tmp_path / "p.json").write_text("{}")
    assert_user_error(run_fastverify(["tune", *extra], cwd=tmp_path), *words)


def test_cpu_sweep_refuses_to_write_an_env_file(shared_dir, tmp_path):
    """gloo ignores NCCL settings: a CPU 'winner' is noise and must never reach an env file."""
    topo = shared_dir / "inputs" / "topo-nccl-tests-307.txt"
    proc = run_fastverify(
        ["tune", "--topology", str(topo), "--model", "tiny", "--tp", "2", "--write-env", "k.env"], cwd=tmp_path
    )  # --tp 2: tiny's 4 heads do not split over the topology's 8 GPUs
    assert_user_error(proc, "--write-env", "gloo")
    assert not (tmp_path / "k.env").exists() and not (tmp_path / "nccl_configs").exists()


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--timeout", "inf"], ["--timeout"]),
        (
            [
                "--predict",
                "--topology",
                "topo.txt",
                "--tp",
                "2",
                "--write-env",
                "ok.env",
                "--write-tuner-config",
                "adir",
            ],
            ["adir"],
        ),  # --tp 2: tiny's 4 heads do not split over the topology's 8 GPUs
        (["--journal", "adir"], ["adir"]),
        (["--write-tuner-config", "t.csv"], ["--predict"]),
        (["--predict", "--topology", "topo.txt", "--png", "x.png"], ["--png"]),
        (
            ["--predict", "--topology", "topo.txt", "--journal", "topo.txt"],
            ["--journal", "does not apply with --predict"],
        ),
        (["--predict", "--topology", "topo.txt", "--resume"], ["--resume", "does not apply with --predict"]),
    ],
)
def test_tune_output_paths_checked_before_any_work(shared_dir, tmp_path, extra, words):
    (tmp_path / "topo.txt").write_text((shared_dir / "inputs" / "topo-nccl-tests-307.txt").read_text())
    (tmp_path / "adir").mkdir()
    assert_user_error(run_fastverify(["tune", *extra], cwd=tmp_path), *words)
    assert not (tmp_path / "ok.env").exists()
    assert list((tmp_path / "adir").iterdir()) == []


def test_trace_profile_workload_is_measured_as_plain_all_reduces(tmp_path):
    """A trace profile has sizes but no hidden size: the sweep times plain all-reduces."""
    prof = two_rank_trace_profile()
    (tmp_path / "p.json").write_text(json.dumps(prof))
    proc = run_fastverify(
        ["tune", "--profile", "p.json", "--iters", "2", "--warmup", "1", "--journal", "j.jsonl"],
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "timing plain all-reduces" in " ".join(proc.stdout.split())
    spec = [json.loads(x) for x in (tmp_path / "j.jsonl").read_text().splitlines()][1]["spec"]
    assert spec["op"] == "all_reduce" and spec["sizes"] == [[2048, 2]]


# --- the deployment record (issue 9, What-to-build §2; items 4 and 7, tune side) ----------------


def test_predict_writes_env_file_and_deployment_record(shared_dir, tmp_path):
    from fastverify.deploy import read_record

    topo = shared_dir / "inputs" / "topo-nccl-tests-307.txt"
    proc = run_fastverify(
        [
            "tune",
            "--predict",
            "--topology",
            str(topo),
            "--model",
            "kimi-k2",
            "--tp",
            "8",
            "--draft-tokens",
            "4",
            "--max-batch",
            "32",
            "--sm",
            "120",
            "--write-env",
            "out/k.env",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    rec = read_record(tmp_path / "out" / "k.deploy.json")
    # issue 11: backends are ranked with the NCCL settings; on SM120 PCIe the IPC all-reduce's range
    # is unknown at these sizes (listed, not ranked), so the cost model's best NCCL setting wins and
    # the record names its registry backend, nccl (test_write_env_pair pins a backend winner)
    assert rec.backend.value == "nccl"
    assert read_env_file(tmp_path / "out" / "k.env") == {"NCCL_P2P_LEVEL": "SYS"}
    assert (rec.shapes.max_batch, rec.shapes.draft_tokens, rec.shapes.hidden, rec.shapes.dtype) == (
        32,
        4,
        7168,
        "bfloat16",
    )
    assert rec.box.sm == (12, 0) and rec.box.gpu_count == 8 and rec.box.tp == 8
    assert rec.p2p.ok is None and not rec.p2p.proven  # nvidia-smi text has no P2P status
    assert rec.gain.basis == "predicted" and rec.gain.best_us < rec.gain.baseline_us
    settings = read_env_file(tmp_path / "out" / "k.env")
    # the record's NCCL settings are the env file's (the winner's one setting)
    assert (
        rec.nccl_settings == {k: v for k, v in settings.items() if k.startswith("NCCL_")} == {"NCCL_P2P_LEVEL": "SYS"}
    )
    # no SGLang switch in the env file: the backend is the record's, launch sets the switch after the P2P proof
    assert not [k for k in settings if k.startswith("SGLANG_")]
    assert "PREDICTED" in (tmp_path / "out" / "k.env").read_text()
    assert "# deployment record: k.deploy.json" in (tmp_path / "out" / "k.env").read_text()


def test_write_env_refuses_a_trace_profile_without_hidden(tmp_path):
    prof = two_rank_trace_profile()
    (tmp_path / "p.json").write_text(json.dumps(prof))
    (tmp_path / "t.txt").write_text("        GPU0    GPU1\nGPU0     X      PHB\nGPU1    PHB      X\n")
    proc = run_fastverify(
        ["tune", "--profile", "p.json", "--predict", "--topology", "t.txt", "--write-env", "x.env"], cwd=tmp_path
    )
    assert_user_error(proc, "--hidden")
    assert not (tmp_path / "x.env").exists() and not (tmp_path / "x.deploy.json").exists()


def _box(sm, nvlink_full=False):
    from fastverify.deploy import BoxFingerprint

    return BoxFingerprint(gpu_name="G", sm=sm, gpu_count=8, tp=8, nvlink_full=nvlink_full)


COMMON = dict(
    world_size=8,
    device="cuda",
    dtype="bfloat16",
    hidden=7168,
    sizes=((28672, 123),),
    warmup=1,
    iters=2,
    op="all_reduce_residual_rmsnorm",
)
# An 8-GPU PCIe box: SGLang 0.5.23 runs its custom all-reduce on more than 2 GPUs only with full
# NVLink (custom_all_reduce_utils.py: disabled when world_size > 2 and not full_nvlink).
CUSTOM_AR_PCIE_8 = (
    "custom_ar: world size 8 needs full NVLink between every GPU pair and this box has none; "
    "SGLang 0.5.23 runs it on 2 PCIe GPUs, on more only with full NVLink (custom_all_reduce_utils.py "
    "can_use_custom_all_reduce_with_nvlink: disabled when world_size > 2 and not full_nvlink)"
)


@pytest.mark.parametrize(
    "sm, want, not_measured",
    [
        (
            (12, 0),
            {"pcie_ipc", "b12x"},
            {"fused: SGLang 0.5.23 calls it only on SM90/SM100; this box is SM120", CUSTOM_AR_PCIE_8},
        ),
        (
            (8, 9),
            {"pcie_ipc"},
            {
                "fused: SGLang 0.5.23 calls it only on SM90/SM100; this box is SM89",
                "b12x: the kernel runs only on SM120, SM121; this box is SM89",
                CUSTOM_AR_PCIE_8,
            },
        ),
        (
            (9, 0),
            {"pcie_ipc", "fused"},
            {"b12x: the kernel runs only on SM120, SM121; this box is SM90", CUSTOM_AR_PCIE_8},
        ),
    ],
)
def test_backend_trials_iterate_the_registry_and_skip_the_unreachable(sm, want, not_measured):
    from fastverify.deploy import P2PFacts
    from fastverify.tune.measure import backend_trials

    trials, skipped = backend_trials(
        COMMON,
        box=_box(sm),
        p2p=P2PFacts(ok=True, source="nvml"),
        fused_ok=True,
        max_numel=917504,
        sglang_version="0.5.23",
    )
    assert {t.backend for t in trials} == want
    assert set(skipped) == not_measured
    assert all(t.hidden == 7168 and t.options_dict["max_numel"] == 917504 for t in trials)


def test_custom_ar_is_measured_at_tp8_only_with_full_nvlink():
    from fastverify.deploy import P2PFacts
    from fastverify.tune.measure import backend_trials

    trials, skipped = backend_trials(
        COMMON,
        box=_box((9, 0), nvlink_full=True),
        p2p=P2PFacts(ok=True, source="nvml"),
        fused_ok=True,
        max_numel=917504,
        sglang_version="0.5.23",
    )
    assert {t.backend for t in trials} == {"pcie_ipc", "fused", "custom_ar"}


def test_a_fused_winner_on_sm120_is_never_recommended():
    from types import SimpleNamespace as NS

    from fastverify.deploy import P2PFacts
    from fastverify.tune.measure import choose_winner

    def cand(backend, us):
        return NS(spec=NS(backend=backend), step_us=us)

    fused, ipc, base = cand("fused", 900.0), cand("pcie_ipc", 1200.0), cand("nccl", 24000.0)
    ranking = NS(candidates=(fused, ipc, base), baseline=base)
    proven = P2PFacts(ok=True, source="p2p_check", pairs=56)
    won, passed = choose_winner(ranking, box=_box((12, 0)), p2p=proven, world_size=8, sglang_version="0.5.23")
    assert won is ipc and passed == ["fused: SGLang 0.5.23 calls it only on SM90/SM100; this box is SM120"]
    won, passed = choose_winner(ranking, box=_box((9, 0)), p2p=proven, world_size=8, sglang_version="0.5.23")
    assert won is fused and passed == []
    # without P2P at all only the baseline is left
    won, _ = choose_winner(
        ranking, box=_box((12, 0)), p2p=P2PFacts(ok=False, source="nvml"), world_size=8, sglang_version=None
    )
    assert won is base
