"""``tune --write-env``: the env file holds NCCL settings only, and the env file and its deployment
record are written both or neither, never over an input, backups included (P2P issue, items 2
and 5).

* item 2: sourced without ``launch`` (``docker --env-file``, systemd ``EnvironmentFile=``,
  ``set -a; . FILE``), a switch in the env file would start SGLang's IPC all-reduce with no P2P
  check, so the file carries no ``SGLANG_*`` line; the backend lives in the record alone.
* item 5: with ``X.env`` present, ``--topology X.env.bak ... --write-env X.env`` replaced the
  topology with the old env file (the ``.bak`` the atomic writer keeps); and an env file that
  could not be written left a new ``X.deploy.json`` beside the old env file.

Commands run in-process (:func:`fastverify.cli.main`), so a write can be made to fail; every
refusal is exit 2 with one line, and every file in the folder is hashed before and after.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SHARED, cli, one_line_error, pin_pcie_ipc

from fastverify import outputs
from fastverify.deploy import read_record
from fastverify.envfile import read_env_file
from fastverify.registry import BackendName

TOPO_307 = SHARED / "inputs" / "topo-nccl-tests-307.txt"
TWO_GPU_TOPO = "        GPU0    GPU1\nGPU0     X      PHB\nGPU1    PHB      X\n"
PREDICT_2 = ["tune", "--predict", "--model", "tiny", "--tp", "2", "--sm", "120"]


def digest(folder: Path) -> dict:
    """Every file under ``folder`` (names relative), by content hash: what must not change."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FASTVERIFY_DESCRIBE_BOX", raising=False)
    for k in [k for k in os.environ if k.startswith(("NCCL_", "SGLANG_"))]:
        monkeypatch.delenv(k)
    (tmp_path / "t2.txt").write_text(TWO_GPU_TOPO)
    return tmp_path


# --- item 2: NCCL settings only; the backend in the record ------------------------------------------


def test_a_backend_winner_goes_to_the_record_and_the_env_file_stays_nccl_only(work, capsys, monkeypatch):
    if not TOPO_307.is_file():
        pytest.skip(f"{TOPO_307} absent (../shared/inputs)")
    pin_pcie_ipc(monkeypatch)  # 123 x 11.6 us vs NCCL's 5.9 ms per step: pcie_ipc wins
    (work / "topo.txt").write_text(TOPO_307.read_text())
    rc, out, err = cli(
        [
            "tune",
            "--predict",
            "--topology",
            "topo.txt",
            "--model",
            "kimi-k2",
            "--tp",
            "8",
            "--sm",
            "120",
            "--max-batch",
            "32",
            "--write-env",
            "k.env",
        ],
        capsys,
    )
    assert rc == 0, err
    rec = read_record("k.deploy.json")
    assert rec.backend is BackendName.pcie_ipc  # the pinned IPC all-reduce is the predicted winner
    assert "winner: pcie_ipc: all-reduce per verify step" in " ".join(out.split())
    text = (work / "k.env").read_text()
    settings = read_env_file("k.env")
    assert all(k.startswith("NCCL_") or k == "CUDA_DEVICE_MAX_CONNECTIONS" for k in settings)
    assert not [
        ln
        for ln in text.splitlines()
        if ln.startswith("SGLANG_") or ("SGLANG_" in ln and "=" in ln and not ln.startswith("#"))
    ]
    assert "the backend (pcie_ipc) is in the deployment record" in " ".join(text.split())
    if shutil.which("bash"):  # what systemd / `set -a; . FILE` would export: no SGLang switch
        env = subprocess.run(
            ["bash", "-c", "set -a; . ./k.env; set +a; env"],
            capture_output=True,
            text=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            cwd=work,
            timeout=30,
        )
        assert env.returncode == 0 and "SGLANG_" not in env.stdout


# --- item 5: a backup never lands on an input ---------------------------------------------------------


@pytest.mark.parametrize(
    "flag, bak, out_flag",
    [
        ("--topology", "X.env.bak", "--write-env (backup of the env file)"),
        ("--topology", "X.deploy.json.bak", "--write-env (backup of the deployment record)"),
        ("--p2p-check", "X.env.bak", "--write-env (backup of the env file)"),
        ("--p2p-check", "X.deploy.json.bak", "--write-env (backup of the deployment record)"),
    ],
)
def test_a_backup_never_replaces_an_input(work, capsys, flag, bak, out_flag):
    rc, _, err = cli(PREDICT_2 + ["--topology", "t2.txt", "--write-env", "X.env"], capsys)  # X.env and its record
    assert rc == 0, err
    if flag == "--topology":
        (work / bak).write_text(TWO_GPU_TOPO)
        argv = PREDICT_2 + ["--topology", bak, "--write-env", "X.env"]
    else:
        (work / bak).write_text(
            '[{"src": 0, "dst": 1, "ok": true, "reason": ""}, {"src": 1, "dst": 0, "ok": true, "reason": ""}]'
        )
        argv = PREDICT_2 + ["--topology", "t2.txt", "--p2p-check", bak, "--write-env", "X.env"]
    before = digest(work)
    one_line_error(*cli(argv, capsys), out_flag, bak, flag, "an output never replaces an input")
    assert digest(work) == before


def test_the_tuner_config_never_lands_on_a_backup(work, capsys):
    rc, _, err = cli(PREDICT_2 + ["--topology", "t2.txt", "--write-env", "X.env"], capsys)
    assert rc == 0, err
    before = digest(work)
    one_line_error(
        *cli(PREDICT_2 + ["--topology", "t2.txt", "--write-env", "X.env", "--write-tuner-config", "X.env.bak"], capsys),
        "--write-tuner-config",
        "X.env.bak",
        "backup",
    )
    assert digest(work) == before


def test_without_an_old_file_the_bak_named_input_is_still_refused(work, capsys):
    """Refused whether or not X.env exists yet: the check does not depend on timing."""
    (work / "X.env.bak").write_text(TWO_GPU_TOPO)
    before = digest(work)
    one_line_error(*cli(PREDICT_2 + ["--topology", "X.env.bak", "--write-env", "X.env"], capsys), "X.env.bak")
    assert digest(work) == before and not (work / "X.env").exists() and not (work / "X.deploy.json").exists()


# --- item 5: both files or neither ---------------------------------------------------------------------


def test_an_env_path_that_is_a_folder_leaves_no_record(work, capsys):
    (work / "X.env").mkdir()
    before = digest(work)
    one_line_error(*cli(PREDICT_2 + ["--topology", "t2.txt", "--write-env", "X.env"], capsys), "X.env", "directory")
    assert digest(work) == before and not (work / "X.deploy.json").exists()


def _fail_replace(monkeypatch, target: Path):
    """``os.replace`` fails (disk full) when it would replace ``target``; every other call is real."""
    real = os.replace

    def replace(src, dst):
        if Path(dst).resolve() == target.resolve():
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(outputs.os, "replace", replace)


@pytest.mark.parametrize("fails", ["X.env", "X.deploy.json", "X.env.bak", "X.deploy.json.bak"])
def test_a_failed_write_leaves_the_old_pair_untouched(work, capsys, monkeypatch, fails):
    rc, _, err = cli(PREDICT_2 + ["--topology", "t2.txt", "--write-env", "X.env"], capsys)
    assert rc == 0, err
    for bak in ("X.env.bak", "X.deploy.json.bak"):
        (work / bak).unlink(missing_ok=True)
    before = digest(work)
    _fail_replace(monkeypatch, work / fails)
    one_line_error(
        *cli(PREDICT_2 + ["--topology", "t2.txt", "--pcie-gen", "5", "--write-env", "X.env", "--force"], capsys),
        f"{fails}: cannot write",
        "No space left on device",
    )
    assert digest(work) == before, "no file changed, none added (no .bak, no temporary file)"


@pytest.mark.parametrize("fails", ["X.env", "X.deploy.json"])
def test_a_failed_first_write_leaves_neither_file(work, capsys, monkeypatch, fails):
    before = digest(work)
    _fail_replace(monkeypatch, work / fails)
    one_line_error(*cli(PREDICT_2 + ["--topology", "t2.txt", "--write-env", "X.env"], capsys), f"{fails}: cannot write")
    assert digest(work) == before
    assert not (work / "X.env").exists() and not (work / "X.deploy.json").exists()


def test_atomic_write_texts_restores_the_first_file_when_the_second_rename_fails(tmp_path, monkeypatch):
    a, b = tmp_path / "a.deploy.json", tmp_path / "a.env"
    a.write_text("old record\n")
    b.write_text("NCCL_P2P_LEVEL=PHB\n")
    (tmp_path / "a.deploy.json.bak").write_text("older record\n")
    before = digest(tmp_path)
    _fail_replace(monkeypatch, b)
    with pytest.raises(outputs.UserError, match=f"^{b}: cannot write: No space left on device$"):
        outputs.atomic_write_texts([(a, "new record\n"), (b, "NCCL_P2P_LEVEL=SYS\n")])
    assert digest(tmp_path) == before
    monkeypatch.undo()
    outputs.atomic_write_texts([(a, "new record\n"), (b, "NCCL_P2P_LEVEL=SYS\n")])
    assert a.read_text() == "new record\n" and (tmp_path / "a.deploy.json.bak").read_text() == "old record\n"
    assert (tmp_path / "a.env.bak").read_text() == "NCCL_P2P_LEVEL=PHB\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.deploy.json", "a.deploy.json.bak", "a.env", "a.env.bak"]
