"""What a fresh user hit on the ``profile`` / ``topo`` side (fresh-user test, items 1, 4, 12 and the
low items): an output that replaced an input, a timeout that crashed or hung, an unbounded
shape that failed late without naming the flag, an empty ``--set`` value, a trace whose rank is
past its world size. Each is one line on stderr, exit code 2, before any work, nothing written."""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
from pathlib import Path

import pytest
from conftest import DATA, assert_user_error, run_fastverify

GOOD = DATA / "bigint" / "comms_id_over_64_bits.trace.json.gz"  # a valid one-rank trace (rank 3)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- item 1: an output never replaces an input, nor another output --------------------------------


@pytest.mark.parametrize(
    "name, args",
    [
        ("in.json", ["--trace", "in.json", "--output", "in.json", "--no-png"]),
        ("in.json", ["--trace", "in.json", "--output", "./in.json", "--no-png"]),
        ("r0.json.gz", ["--trace", "r0.json.gz", "--output", "r0.json.gz", "--no-png"]),
        ("in.json", ["--trace", "in.json", "--output", "x.json", "--png", "in.json"]),
        ("in.json", ["--trace", "sub/../in.json", "--output", "in.json", "--no-png"]),
    ],
)
def test_profile_output_or_png_on_a_trace_is_refused_and_the_trace_kept(tmp_path, name, args):
    raw = GOOD.read_bytes()
    (tmp_path / "sub").mkdir()
    (tmp_path / name).write_bytes(gzip.decompress(raw) if name.endswith(".json") else raw)
    before = _files(tmp_path)
    proc = run_fastverify(["profile", *args, "--quiet"], cwd=tmp_path)
    assert_user_error(proc, "is the input of --trace")
    assert _files(tmp_path) == before  # the trace unchanged, no x.json, no PNG


def test_profile_output_on_a_file_inside_a_trace_folder_is_refused(tmp_path):
    (tmp_path / "tr").mkdir()
    (tmp_path / "tr" / "t.json.gz").write_bytes(GOOD.read_bytes())
    before = _files(tmp_path)
    proc = run_fastverify(["profile", "--trace", "tr", "--output", "tr/t.json.gz", "--no-png", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, "--output", "tr/t.json.gz", "--trace")
    assert _files(tmp_path) == before


def test_profile_default_png_beside_the_output_never_replaces_a_trace(tmp_path):
    # --output t.json puts the PNG at t.png; here t.png is one of the traces (a trace file may
    # have any name inside a folder given to --trace, but as a file argument it is read as is).
    (tmp_path / "t.png").write_bytes(gzip.decompress(GOOD.read_bytes()))
    before = _files(tmp_path)
    proc = run_fastverify(["profile", "--trace", "t.png", "--output", "t.json", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, "t.png", "--trace")
    assert _files(tmp_path) == before


def test_verify_log_report_never_replaces_a_record(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    record = "".join(
        json.dumps({"step": i, "verify_ms": 1.0 + i, "clock": "cpu_wall_clock", "rank": "0", "pid": 1}) + "\n"
        for i in range(4)
    )
    (d / "verify-rank0.jsonl").write_text(record)
    proc = run_fastverify(["profile", "--verify-log", "run", "--output", "run/verify-rank0.jsonl"], cwd=tmp_path)
    assert_user_error(proc, "--output", "verify-rank0.jsonl", "--verify-log")
    assert (d / "verify-rank0.jsonl").read_text() == record
    assert sorted(p.name for p in d.iterdir()) == ["verify-rank0.jsonl"]
    # nor a new file in that folder: the log folder takes records only, and the report goes elsewhere
    no = run_fastverify(["profile", "--verify-log", "run", "--output", "run/summary.json", "--quiet"], cwd=tmp_path)
    assert no.returncode == 2 and no.stderr.count("\n") == 1, no.stderr
    assert sorted(p.name for p in d.iterdir()) == ["verify-rank0.jsonl"]
    ok = run_fastverify(["profile", "--verify-log", "run", "--output", "summary.json", "--quiet"], cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["before"]["overall"]["steps"] == 4


def test_live_output_on_the_model_config_is_refused_before_the_run(tmp_path):
    tiny = json.loads((Path(__file__).resolve().parents[1] / "fastverify/live/presets/tiny.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    before = _files(tmp_path)
    t0 = time.monotonic()
    proc = run_fastverify(
        ["profile", "--model", "config.json", "--output", "config.json", "--no-png", "--quiet"], cwd=tmp_path
    )
    assert_user_error(proc, "is the input of --model")
    assert time.monotonic() - t0 < 20  # refused before any rank starts
    assert _files(tmp_path) == before


# --- item 4: a timeout TCPStore cannot hold ------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "1e300", "1e10", "99999999999", "nan", "-1", "0", "86400.5"])
def test_profile_timeout_out_of_range_is_one_line(tmp_path, value):
    t0 = time.monotonic()
    proc = run_fastverify(["profile", "--timeout", value, "--output", "p.json", "--quiet"], cwd=tmp_path, timeout=60)
    assert_user_error(proc, "--timeout", "86400")
    assert time.monotonic() - t0 < 20
    assert list(tmp_path.iterdir()) == []


def test_run_live_bounds_the_timeout_for_every_caller():
    from fastverify.errors import UserError
    from fastverify.live.config import load_model_config
    from fastverify.live.runner import run_live

    for value in (float("inf"), 1e300, 1e10, float("nan")):
        with pytest.raises(UserError, match=r"--timeout .*\(0, 86400\]"):
            run_live(load_model_config("tiny"), tp=2, draft_tokens=4, batch=1, device="cpu", timeout_s=value)


# --- item 12: bounded shapes, and a shape that cannot fit refused up front ----------------------


@pytest.mark.parametrize(
    "flag, value, bound",
    [
        ("--batch", "100000000", "[1, 4096]"),
        ("--batch", "4097", "[1, 4096]"),
        ("--batch", "0", "[1, 4096]"),
        ("--draft-tokens", "65", "[1, 64]"),
        ("--draft-tokens", "0", "[1, 64]"),
    ],
)
def test_profile_batch_and_draft_tokens_are_bounded_like_tune(tmp_path, flag, value, bound):
    t0 = time.monotonic()
    proc = run_fastverify(["profile", flag, value, "--output", "p.json", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, flag, bound)
    assert time.monotonic() - t0 < 20
    assert list(tmp_path.iterdir()) == []


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="reads MemAvailable from /proc/meminfo")
def test_a_bounded_shape_that_cannot_fit_is_refused_up_front(tmp_path):
    # Kimi-K2 at TP 2, 4096 x 64 = 262144 tokens on CPU. By hand: the gathered logits alone are
    # T x vocab_padded (163840) x 2 B = 80 GiB per rank, the rank's own logits (T x V/2) 40 GiB
    # more, and all 384 experts are reachable: 3 x 384 x 7168 x 1024 (moe_intermediate_size / 2)
    # x 2 B = 15.75 GiB of expert weights per rank.
    logits = 262144 * 163840 * 2 + 262144 * 81920 * 2
    experts = 3 * 384 * 7168 * 1024 * 2
    if 2 * (logits + experts) <= _mem_available():
        pytest.skip("this machine could hold the shape")
    t0 = time.monotonic()
    proc = run_fastverify(
        [
            "profile",
            "--model",
            "kimi-k2",
            "--tp",
            "2",
            "--device",
            "cpu",
            "--batch",
            "4096",
            "--draft-tokens",
            "64",
            "--output",
            "p.json",
            "--quiet",
        ],
        cwd=tmp_path,
    )
    line = assert_user_error(proc, "--batch 4096", "--draft-tokens 64", "GiB", "lower --batch or --draft-tokens")
    assert time.monotonic() - t0 < 30  # before any rank starts, not after minutes of allocation
    assert list(tmp_path.iterdir()) == []
    need = float(line.split("need at least ")[1].split(" GiB")[0])
    assert need >= 2 * (logits + experts) / 2**30 - 0.1


def test_rank_memory_setup_is_what_the_forward_allocates():
    """The estimate against the bytes of the tensors a real ``TPVerifyModel`` holds (less its
    routing plans, whose size depends on the draw): MLA + MoE (tiny, with and without a query
    LoRA) and Llama with GQA replication, over TP and shapes."""
    torch = pytest.importorskip("torch")
    from fastverify.live.config import ModelConfig, load_model_config, rank_memory
    from fastverify.live.forward import DEFAULT_CONTEXT_TOKENS, TPVerifyModel

    tiny = load_model_config("tiny")
    llama = ModelConfig(
        name="l",
        source="test",
        family="llama",
        hidden_size=64,
        num_layers=2,
        vocab_size=1000,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        first_k_dense_replace=2,
    )
    for cfg in (tiny, dataclasses.replace(tiny, q_lora_rank=None), llama):
        for tp in (1, 2, 4):
            for batch, draft in ((1, 4), (3, 2), (8, 8)):
                for dtype in (torch.bfloat16, torch.float32):
                    m = TPVerifyModel(cfg, tp=tp, rank=0, batch=batch, draft_tokens=draft, dtype=dtype)
                    plans = sum(t.numel() * t.element_size() for p in m.plans.values() for t in p[2:])
                    est = rank_memory(
                        cfg,
                        tp=tp,
                        batch=batch,
                        draft_tokens=draft,
                        dtype_bytes=dtype.itemsize,
                        context_tokens=DEFAULT_CONTEXT_TOKENS,
                    )
                    assert est.setup == m.weight_bytes() - plans, (cfg.name, tp, batch, draft, dtype)


# --- low items -------------------------------------------------------------------------------------


def test_topo_set_with_an_empty_value_is_refused_like_the_env_file(tmp_path):
    (tmp_path / "t.txt").write_text("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPHB\t0-15\nGPU1\tPHB\t X \t0-15\n")
    ok = run_fastverify(["topo", "--nvidia-smi", "t.txt", "--set", "NCCL_P2P_LEVEL=SYS", "--json"], cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr  # the same box with a value is diagnosed
    proc = run_fastverify(["topo", "--nvidia-smi", "t.txt", "--set", "NCCL_P2P_LEVEL="], cwd=tmp_path)
    assert_user_error(proc, "NCCL_P2P_LEVEL", "empty value")


def test_trace_rank_past_its_world_size_is_refused(tmp_path):
    doc = json.loads(gzip.decompress(GOOD.read_bytes()))
    doc["distributedInfo"] = {**doc.get("distributedInfo", {}), "rank": 5, "world_size": 2}
    (tmp_path / "r5.json").write_text(json.dumps(doc))
    proc = run_fastverify(["profile", "--trace", "r5.json", "--output", "p.json", "--no-png", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, "r5.json", "distributedInfo.rank = 5", "world_size = 2")
    assert not (tmp_path / "p.json").exists()
    doc["distributedInfo"]["rank"] = 1  # the last rank of that world is fine
    (tmp_path / "r1.json").write_text(json.dumps(doc))
    ok = run_fastverify(["profile", "--trace", "r1.json", "--output", "p.json", "--no-png", "--quiet"], cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "p.json").read_text())["ranks"][0]["rank"] == 1


def test_signature_skip_line_says_what_is_really_missing(tmp_path):
    """With FASTVERIFY_FLASHINFER_WHEEL set, the installed-library check skips because FlashInfer
    is not installed; its line must say that, not ask for the variable that is already set."""
    import importlib.util
    import subprocess
    import sys

    from conftest import subprocess_env

    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("FlashInfer is installed here: the installed check runs instead of skipping")
    sig_tests = Path(__file__).resolve().parent / "test_backend_signatures.py"

    def skip_lines(**env_over) -> list[str]:
        # not under CI=true: the inner run sets a wheel path that names no file on purpose
        env = {k: v for k, v in subprocess_env().items() if k not in ("FASTVERIFY_FLASHINFER_WHEEL", "CI")}
        env.update(env_over)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-rs",
                "-p",
                "no:cacheprovider",
                str(sig_tests),
                "-k",
                "test_signature_installed and flashinfer",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SKIPPED") and "flashinfer" in ln]
        assert lines, proc.stdout
        return lines

    with_wheel = skip_lines(FASTVERIFY_FLASHINFER_WHEEL=str(tmp_path / "flashinfer_python-0.7.4-py3-none-any.whl"))
    for line in with_wheel:
        assert "set FASTVERIFY_FLASHINFER_WHEEL" not in line, line
        assert "not installed here (ModuleNotFoundError" in line and "wheel in FASTVERIFY_FLASHINFER_WHEEL" in line, (
            line
        )
    for line in skip_lines():
        assert "set FASTVERIFY_FLASHINFER_WHEEL to a flashinfer wheel" in line, line


@pytest.mark.parametrize("out", ["afile/p.json", "afile/sub/p.json"])
def test_output_under_a_file_names_that_file(tmp_path, out):
    (tmp_path / "afile").write_text("keep")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "verify-rank0.jsonl").write_text(
        json.dumps({"step": 0, "verify_ms": 1.0, "clock": "cpu_wall_clock", "rank": "0", "pid": 1}) + "\n"
    )
    for args in (["--trace", str(GOOD), "--no-png"], ["--verify-log", "run"]):
        proc = run_fastverify(["profile", *args, "--output", out, "--quiet"], cwd=tmp_path)
        line = assert_user_error(proc, out, "afile is a file, not a folder")
        assert "File exists" not in line and "Not a directory" not in line
        assert (tmp_path / "afile").read_text() == "keep"
