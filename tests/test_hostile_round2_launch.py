"""Issue 34, a second hostile run against launch, the JSON helpers and the box description.

- ``launch --tp-size 10**18`` with a described box built a list of 10**18 GPU ordinals (out of
  memory after 40 s) before any check of the value; so did a deployment record's ``box.tp``;
- an integer of more than 4,300 digits in a JSON document was a msgspec traceback, or a line
  holding Python's own advice ("use sys.set_int_max_str_digits() ...");
- a key given twice in a deployment record or a ``load.json`` kept the last value silently, and so
  did ``topo --set NAME=... --set NAME=...``;
- a ``--describe-box`` whose ``gpu_count`` disagrees with the ``--topology`` was taken, and so was
  ``gpu_count: 0``;
- ``launch --dry-run --url ftp://x`` said "blocked by: nothing" where ``collect --server`` refuses
  the same URL.

Each refusal is one line naming the file or flag, exit 2.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import cli, one_line_error, subprocess_env

from fastverify.deploy import BoxFingerprint, DeploymentRecord, P2PFacts, VerifyShapes, encode_record, record_path_for
from fastverify.errors import UserError
from fastverify.inputs import decode_json, loads_json
from fastverify.nccl.checks import apply_sets
from fastverify.proof.answers import answer_of, prompt_digest, read_prompts
from fastverify.proof.record import LoadRun, read_run
from fastverify.registry import BackendName
from fastverify.topo.box import box_from_description

REPO = Path(__file__).resolve().parent.parent
TOPO = REPO / "docs" / "topo-nccl-tests-307.txt"  # an 8-GPU `nvidia-smi topo -m`
BIG = "9" * 6000  # past Python's 4300-digit limit on int <-> str
PYTHON_ADVICE = "set_int_max_str_digits"
BOX_1_GPU = {
    "gpu_name": "X",
    "sm": [12, 0],
    "gpu_count": 8,
    "gpus": [{"index": 0, "pci_bus_id": "00000000:00:00.0", "uuid": "GPU-0"}],
}
SGLANG = ["python", "-m", "sglang.launch_server", "--model-path", "m"]


def _env(tmp_path: Path, *, tp: int = 8, backend: str = "nccl") -> Path:
    """An env file and its deployment record (8 x SM120, ``tp``)."""
    env = tmp_path / "box.env"
    env.write_text("NCCL_P2P_LEVEL=SYS\n")
    rec = DeploymentRecord(
        backend=BackendName(backend),
        shapes=VerifyShapes(max_batch=1, draft_tokens=4, hidden=7168),
        p2p=P2PFacts(ok=None, source="not_checked"),
        box=BoxFingerprint(gpu_name=None, sm=(12, 0), gpu_count=8, tp=tp),
        sglang_version=None,
    )
    record_path_for(env).write_bytes(encode_record(rec))
    return env


def _run_capped(argv: list[str]) -> subprocess.CompletedProcess:
    """``python -m fastverify ARGV`` with its address space capped at 3 GiB, so a list of 10**8
    ordinals fails at once (MemoryError) instead of filling the test machine's memory."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    return subprocess.run(
        [sys.executable, "-m", "fastverify", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
        preexec_fn=cap,
    )


def _one_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("fastverify: error: "), proc.stderr[-2000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# --- 1. a huge TP size is refused before anything is built from it ------------------------------------


@pytest.mark.parametrize("tp", ["1000000000000000000", "100000000"])
def test_launch_refuses_a_huge_tp_size_before_listing_its_gpus(tmp_path, tp):
    env = _env(tmp_path)
    argv = ["launch", "--env", str(env), "--describe-box", json.dumps(BOX_1_GPU), "--dry-run", "--"]
    proc = _run_capped([*argv, *SGLANG, "--tp-size", tp])
    line = _one_line(proc, f"--tp-size {tp}: expected 1..4096")
    assert "MemoryError" not in proc.stderr and "Traceback" not in proc.stderr, line
    # the real launch refuses it too, before any server starts
    proc = _run_capped(
        ["launch", "--env", str(env), "--describe-box", json.dumps(BOX_1_GPU), "--", *SGLANG, "--tp-size", tp]
    )
    _one_line(proc, f"--tp-size {tp}: expected 1..4096")


def test_launch_refuses_a_huge_tp_of_another_command(tmp_path):
    env = _env(tmp_path)
    proc = _run_capped(
        [
            "launch",
            "--env",
            str(env),
            "--describe-box",
            json.dumps(BOX_1_GPU),
            "--dry-run",
            "--",
            "torchrun",
            "serve.py",
            "--tp",
            "100000000",
        ]
    )
    _one_line(proc, "--tp 100000000: expected 1..4096")


def test_a_deployment_record_of_a_huge_tp_is_refused(tmp_path):
    env = _env(tmp_path)
    path = record_path_for(env)
    doc = json.loads(path.read_text())
    doc["box"]["tp"] = 10**18
    path.write_text(json.dumps(doc))
    proc = _run_capped(
        ["launch", "--env", str(env), "--describe-box", json.dumps(BOX_1_GPU), "--dry-run", "--", "python", "serve.py"]
    )
    _one_line(proc, str(path), "tp", "640")


# --- 2. an integer of more than 4300 digits ----------------------------------------------------------


@pytest.mark.parametrize("exact", [False, True])
def test_loads_json_says_a_huge_integer_is_too_large(exact):
    with pytest.raises(UserError) as e:
        loads_json(f'{{"a": {BIG}}}', "x.json", what="the box description", exact_ints=exact)
    msg = str(e.value)
    assert msg.startswith("x.json: ") and "too large" in msg and PYTHON_ADVICE not in msg, msg


def test_decode_json_says_a_huge_integer_is_too_large():
    class Doc(msgspec.Struct):
        a: int

    for kind in (object, Doc):
        with pytest.raises(UserError) as e:
            decode_json(f'{{"a": {BIG}}}'.encode(), "m.json", *([Doc] if kind is Doc else []))
        msg = str(e.value)
        assert msg.startswith("m.json: ") and "too large" in msg and PYTHON_ADVICE not in msg, msg


def test_launch_with_a_huge_integer_in_the_record_is_one_line(tmp_path, capsys):
    env = _env(tmp_path)
    path = record_path_for(env)
    path.write_text(path.read_text().replace('"max_batch": 1', f'"max_batch": {BIG}', 1))
    assert BIG in path.read_text()
    line = one_line_error(*cli(["launch", "--env", env, "--dry-run", "--", *SGLANG], capsys), str(path), "too large")
    assert PYTHON_ADVICE not in line


def test_a_described_box_with_a_huge_integer_is_one_line_without_pythons_advice(capsys):
    desc = json.dumps({"gpu_name": "X", "sm": [12, 0]})[:-1] + f', "gpu_count": {BIG}}}'
    line = one_line_error(
        *cli(["topo", "--topology", TOPO, "--describe-box", desc], capsys), "--describe-box", "too large"
    )
    assert PYTHON_ADVICE not in line


# --- 3. a key given twice ----------------------------------------------------------------------------


def test_json_helpers_refuse_a_key_given_twice():
    for parse in (
        lambda d: loads_json(d, "a.json"),
        lambda d: loads_json(d, "a.json", exact_ints=True),
        lambda d: decode_json(d, "a.json"),
    ):
        with pytest.raises(UserError) as e:
            parse(b'{"x": {"k": 1, "k": 2}}')
        assert str(e.value).startswith("a.json: ") and "'k'" in str(e.value) and "twice" in str(e.value)
    assert loads_json(b'{"x": {"k": 1}, "k": 2}', "a.json") == {"x": {"k": 1}, "k": 2}  # one per object


def test_launch_refuses_a_record_that_gives_backend_twice(tmp_path, capsys):
    env = _env(tmp_path)
    path = record_path_for(env)
    text = path.read_text()
    assert text.count('"backend": "nccl"') == 1
    path.write_text(text.replace('"backend": "nccl"', '"backend": "nccl", "backend": "pcie_ipc"'))
    rc, out, err = cli(["launch", "--env", env, "--dry-run", "--", *SGLANG, "--tp-size", "8"], capsys)
    one_line_error(rc, out, err, str(path), "'backend'", "twice")
    assert "pcie_ipc" not in out


def _run_folder(folder: Path) -> Path:
    prompts, source = read_prompts(None)
    reply = {
        "text": "ab",
        "output_ids": [1, 2],
        "meta_info": {"output_token_logprobs": [[-0.1, 1, None], [-0.1, 2, None]]},
    }
    run = LoadRun(
        complete=True,
        prompts=prompts,
        prompts_source=source,
        prompts_digest=prompt_digest(prompts),
        max_new_tokens=8,
        answers=[answer_of(p, reply, 0.01) for p in prompts],
        server={},
        server_info={"dtype": "float32"},
        clock="cpu_server_wall_clock",
    )
    folder.mkdir(parents=True)
    (folder / "load.json").write_bytes(msgspec.json.encode(run))
    return folder


def test_a_load_record_that_gives_max_new_tokens_twice_is_refused(tmp_path):
    folder = _run_folder(tmp_path / "run")
    assert read_run(folder, flag="--baseline").max_new_tokens == 8
    path = folder / "load.json"
    raw = path.read_bytes()
    assert raw.count(b'"max_new_tokens":8') == 1
    path.write_bytes(raw.replace(b'"max_new_tokens":8', b'"max_new_tokens":8,"max_new_tokens":64'))
    with pytest.raises(UserError) as e:
        read_run(folder, flag="--baseline")
    assert str(path) in str(e.value) and "'max_new_tokens'" in str(e.value) and "twice" in str(e.value)


def test_topo_refuses_one_setting_given_twice(capsys):
    rc, out, err = cli(
        ["topo", "--topology", TOPO, "--set", "NCCL_P2P_LEVEL=SYS", "--set", "NCCL_P2P_LEVEL=LOC"], capsys
    )
    one_line_error(rc, out, err, "--set NCCL_P2P_LEVEL", "twice", "SYS", "LOC")
    with pytest.raises(UserError):
        apply_sets(["NCCL_P2P_LEVEL=SYS", "NCCL_P2P_LEVEL=SYS"], {}, None)
    assert apply_sets(["NCCL_P2P_LEVEL=SYS", "NCCL_ALGO=Ring"], {}, None) == {
        "NCCL_P2P_LEVEL": "SYS",
        "NCCL_ALGO": "Ring",
    }


def test_tune_still_takes_one_candidate_per_set(capsys):
    argv = ["tune", "--predict", "--topology", TOPO, "--model", "kimi-k2.5", "--tp-size", "8", "--sm", "120"]
    rc, out, err = cli([*argv, "--pcie-gen", "5", "--set", "NCCL_P2P_LEVEL=SYS", "--set", "NCCL_P2P_LEVEL=LOC"], capsys)
    assert rc == 0, err


# --- 4. a described box that disagrees with the topology ---------------------------------------------


@pytest.mark.parametrize("command", ["topo", "tune"])
def test_a_described_box_of_another_gpu_count_than_the_topology_is_refused(command, capsys):
    desc = json.dumps({"gpu_name": "X", "sm": [12, 0], "gpu_count": 2})
    argv = (
        ["topo", "--topology", TOPO]
        if command == "topo"
        else ["tune", "--predict", "--topology", TOPO, "--model", "kimi-k2.5"]
    )
    one_line_error(*cli([*argv, "--describe-box", desc], capsys), "--describe-box", "gpu_count 2", "8 GPUs")
    rc, out, err = cli([*argv, "--describe-box", desc.replace('"gpu_count": 2', '"gpu_count": 8')], capsys)
    assert rc == 0, err
    assert "8 GPUs (--describe-box)" in out + err


def test_a_described_box_of_no_gpu_is_refused(capsys):
    with pytest.raises(UserError) as e:
        box_from_description('{"sm": [12, 0], "gpu_count": 0}', where="--describe-box")
    assert str(e.value).startswith("--describe-box: ") and "gpu_count" in str(e.value)
    assert box_from_description('{"sm": [12, 0], "gpu_count": 1}', where="--describe-box").gpu_count == 1


# --- 5. launch --url is checked as collect --server is -------------------------------------------------


@pytest.mark.parametrize("url", ["ftp://x", "http://h:99999", "http://u:pw@h:1"])
def test_launch_dry_run_refuses_a_url_collect_refuses(tmp_path, capsys, url):
    env = _env(tmp_path)
    rc, out, err = cli(["collect", "--server", url, "--output", tmp_path / "b.tgz"], capsys)
    assert rc == 2, err
    argv = ["launch", "--env", env, "--describe-box", json.dumps({"sm": [12, 0], "gpu_count": 8}), "--dry-run"]
    rc, out, err = cli([*argv, "--", *SGLANG, "--tp-size", "8"], capsys)
    assert rc == 0 and "blocked by: nothing" in out, (out, err)  # the same launch without --url
    rc, out, err = cli([*argv, "--url", url, "--", *SGLANG, "--tp-size", "8"], capsys)
    assert rc == 2 and "first: --url " in err, (out, err)
    blocked = [ln for ln in out.split("blocked by:", 1)[1].splitlines() if ln.startswith("  - ")]
    assert len(blocked) == 1 and "--url" in blocked[0], blocked
    assert "pw" not in out + err
