"""One exclusive-create rule for every output, and every path checked at argument time (issue 34).

* Default names are unique under concurrency: four ``collect`` runs started together in one
  folder write four bundles (before: one name, one bundle, four "wrote" lines).
* An existing file is never written over unless the user asked (``--force``): bundles, P2P check
  files, env files and their deployment record (no ``.bak`` over an older ``.bak``), PNGs and
  profile/report JSON; the refusal comes before any work, in one line, exit 2, the file untouched.
* A run that cannot write says so before the work: a folder path, a path under a file, a
  read-only file, a folder that refuses new files.
* Every path flag of every command refuses an empty path, a 300-byte name and a 5,000-byte path
  while parsing the flags (before: ``OSError: File name too long`` tracebacks in 11 places), and
  takes a non-UTF-8 name as its bytes (before: a traceback after every part of ``collect`` ran).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import assert_user_error, run_fastverify, subprocess_env, tree_state

ALL_PARTS = ["doctor", "nvidia_smi_topo", "nvml", "host_iommu", "p2p_check", "nccl_log", "sweep"]
"""Every part of ``collect`` that needs no flag: skipped, a run takes about a second (no GPU, no server)."""
QUICK_COLLECT = ["collect", "--quiet", *[a for p in ALL_PARTS for a in ("--skip", p)]]
TWO_GPU_TOPO = "        GPU0    GPU1\nGPU0     X      PHB\nGPU1    PHB      X\n"
PREDICT_2 = ["tune", "--predict", "--model", "tiny", "--tp", "2", "--sm", "120"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(folder: Path, names=("verify-rank0.jsonl",)) -> None:
    """Verify records of ``launch --profile-verify`` (3 steps each) in ``folder``, made as bytes
    so that a name may be non-UTF-8."""
    os.makedirs(folder, exist_ok=True)
    for name in names:
        lines = "".join(
            json.dumps({"step": i, "verify_ms": 1.0 + i, "clock": "cpu_wall_clock", "rank": "0", "pid": 7}) + "\n"
            for i in range(3)
        )
        with open(os.path.join(os.fsencode(folder), os.fsencode(name)), "wb") as f:
            f.write(lines.encode())


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _is_bundle(path: Path) -> bool:
    from fastverify.bundle import is_bundle

    return is_bundle(path)


# ---- default names unique under concurrency -------------------------------------------------------


def test_default_bundle_names_of_one_second_are_unique_across_threads(tmp_path, monkeypatch):
    """Eight threads asking for the default name in the same second get eight names, each taken
    on disk at once (an exclusive create), so no later run can take it either."""
    from fastverify.collect.command import default_output

    monkeypatch.chdir(tmp_path)
    now = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    got: list[Path] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def one():
        start.wait()
        p = default_output(now)
        with lock:
            got.append(p)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = sorted(str(p) for p in got)
    assert len(set(names)) == 8, names
    want = ["fastverify-bundle-20260102-030405.tar.gz"] + [
        f"fastverify-bundle-20260102-030405-{n}.tar.gz" for n in range(2, 9)
    ]
    assert names == sorted(want)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(want)  # each name taken on disk
    from fastverify.outputs import release_reserved

    release_reserved()  # the placeholders of this process: removed, as at its exit
    assert list(tmp_path.iterdir()) == []


def test_four_concurrent_collect_runs_in_one_folder_write_four_bundles(tmp_path):
    env = subprocess_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "fastverify", *QUICK_COLLECT],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    wrote = sorted(o.split()[1] for o, _ in outs)
    assert len(set(wrote)) == 4, wrote
    bundles = sorted(p.name for p in tmp_path.glob("*.tar.gz"))
    assert bundles == wrote and all(_is_bundle(tmp_path / b) for b in bundles)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


# ---- never over an existing file unless --force --------------------------------------------------------


def test_collect_never_writes_over_an_existing_bundle_without_force(tmp_path):
    out = tmp_path / "b.tar.gz"
    first = run_fastverify([*QUICK_COLLECT, "--output", str(out)], tmp_path)
    assert first.returncode == 0, first.stderr
    before = _digest(out)
    proc = run_fastverify([*QUICK_COLLECT, "--output", str(out)], tmp_path)
    assert_user_error(proc, "--output", "b.tar.gz", "exists", "--force")
    assert _digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["b.tar.gz"]
    forced = run_fastverify([*QUICK_COLLECT, "--output", str(out), "--force"], tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert _digest(out) != before and _is_bundle(out)  # a new bundle (its manifest's time differs)


def test_collect_force_replaces_a_file_the_user_names(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert_user_error(run_fastverify([*QUICK_COLLECT, "--output", str(notes)], tmp_path), "exists", "--force")
    assert notes.read_text() == "mine"
    proc = run_fastverify([*QUICK_COLLECT, "--output", str(notes), "--force"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _is_bundle(notes)


def test_p2p_never_writes_over_an_earlier_check_file(tmp_path):
    """Before: an earlier P2P document at --output was replaced; now refused before any GPU is
    looked for (this box has none: the refusal must come first)."""
    doc = tmp_path / "p2p.json"
    doc.write_text('{"schema_version": 1, "gpus": [], "results": []}\n')
    before = tree_state(tmp_path)
    assert_user_error(
        run_fastverify(["p2p", "--output", str(doc)], tmp_path), "--output", "p2p.json", "exists", "--force"
    )
    assert tree_state(tmp_path) == before


def test_report_never_writes_over_an_existing_png(tmp_path):
    png = tmp_path / "split.png"
    png.write_bytes(PNG_MAGIC + b"an earlier drawing")
    before = tree_state(tmp_path)
    proc = run_fastverify(["report", str(tmp_path / "no-such-bundle.tar.gz"), "--png", str(png)], tmp_path)
    assert_user_error(proc, "--png", "split.png", "exists", "--force")  # before the bundle is even opened
    assert tree_state(tmp_path) == before


def test_profile_verify_log_report_never_writes_over_an_existing_file(tmp_path):
    _records(tmp_path / "log")
    out = tmp_path / "report.json"
    out.write_text("an unrelated file\n")
    proc = run_fastverify(["profile", "--verify-log", str(tmp_path / "log"), "--output", str(out), "--quiet"], tmp_path)
    assert_user_error(proc, "--output", "report.json", "exists", "--force")
    assert out.read_text() == "an unrelated file\n"
    proc = run_fastverify(
        ["profile", "--verify-log", str(tmp_path / "log"), "--output", str(out), "--quiet", "--force"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["before"]["ranks"][0]["steps"] == 3


def test_tune_write_env_keeps_the_pair_and_its_backups_without_force(tmp_path):
    """A second ``--write-env X.env`` is refused (before: X.env and X.deploy.json replaced, and
    the .bak of an earlier replacement lost); with --force the old pair goes to .bak. The first
    write, over the names this run took, leaves no .bak of an empty file."""
    (tmp_path / "t2.txt").write_text(TWO_GPU_TOPO)
    argv = [*PREDICT_2, "--topology", "t2.txt", "--write-env", "X.env"]
    first = run_fastverify(argv, tmp_path)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X.deploy.json", "X.env", "t2.txt"]
    (tmp_path / "X.env.bak").write_text("# an older env file, kept by hand\n")
    before = tree_state(tmp_path)
    assert_user_error(run_fastverify([*argv, "--pcie-gen", "5"], tmp_path), "--write-env", "X.env", "exists", "--force")
    assert tree_state(tmp_path) == before
    old_env = (tmp_path / "X.env").read_text()
    forced = run_fastverify([*argv, "--pcie-gen", "5", "--force"], tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert (tmp_path / "X.env.bak").read_text() == old_env  # the user asked: the old pair kept as .bak
    assert (tmp_path / "X.deploy.json.bak").is_file()


# ---- a run that cannot write says so before the work -----------------------------------------------


def test_an_unwritable_collect_output_is_refused_before_any_part_runs(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    ro = tmp_path / "ro.tar.gz"
    ro.write_text("read-only")
    ro.chmod(0o444)
    before = tree_state(tmp_path)
    # under a file, a folder, a read-only file even with --force: refused before any part runs
    for argv, words in (
        (["--output", str(tmp_path / "afile" / "b.tar.gz")], ("afile is a file, not a folder",)),
        (["--output", str(tmp_path / "adir")], ("adir", "is a directory")),
        (["--output", str(ro), "--force"], ("ro.tar.gz", "read-only")),
    ):
        proc = run_fastverify(["collect", "--quiet", *argv], tmp_path)  # doctor would run first: not reached
        line = assert_user_error(proc, *words)
        assert "collect:" not in proc.stdout + proc.stderr, line  # no part started
    assert tree_state(tmp_path) == before


def test_a_folder_that_refuses_new_files_is_named_before_the_work(tmp_path, monkeypatch, capsys):
    from fastverify.cli import main
    from fastverify.collect import command

    def never(ctx, limit_s):
        raise AssertionError("a part ran before the output was checked")

    for name in command.SPECS:
        monkeypatch.setitem(command.SPECS, name, command.PartSpec(name, never, 1.0, 0.0))
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    assert main(["collect", "--output", str(tmp_path / "b.tar.gz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"fastverify: error: {tmp_path / 'b.tar.gz'}: cannot write in {tmp_path} "
        "(no write permission, or a read-only file system)"
    ]


# ---- every path flag checked at argument time ------------------------------------------------------------

LONG_NAME = "a" * 300
LONG_PATH = "/tmp/" + "b/" * 2500 + "x"
FLAGS = [
    ("collect", ["collect", "--output", "{}"]),
    ("collect --verify-log", ["collect", "--verify-log", "{}"]),
    ("report", ["report", "{}"]),
    ("report --png", ["report", "b.tar.gz", "--png", "{}"]),
    ("p2p --output", ["p2p", "--output", "{}"]),
    ("tune --write-env", [*PREDICT_2, "--write-env={}"]),
    ("tune --topology", [*PREDICT_2, "--topology", "{}"]),
    ("tune --bundle", ["tune", "--draft-shape", "--bundle", "{}"]),
    ("profile --trace", ["profile", "--trace", "{}"]),
    ("profile --output", ["profile", "--trace", "t.json", "--output", "{}"]),
    ("profile --png", ["profile", "--trace", "t.json", "--png", "{}"]),
    ("profile --verify-log", ["profile", "--verify-log", "{}"]),
    ("launch --env", ["launch", "--env", "{}", "--", "true"]),
    ("launch --profile-verify", ["launch", "--profile-verify", "{}", "--", "true"]),
    ("compare", ["compare", "{}", "after"]),
    ("topo --nvidia-smi", ["topo", "--nvidia-smi", "{}"]),
    ("doctor --env-file", ["doctor", "--env-file", "{}"]),
]


BAD_PATHS = [
    ("300-byte name", LONG_NAME, ("300 bytes", "ENAMETOOLONG")),
    ("5000-byte path", LONG_PATH, ("5,006 bytes", "ENAMETOOLONG")),
    ("empty", "", ("an empty path",)),
]
CASES = [
    (f"{bad}-{what}", what, argv, value, words)
    for what, argv in FLAGS
    for bad, value, words in BAD_PATHS
    if not (bad == "empty" and what == "tune --write-env")
]  # `--write-env=` means the default path


@pytest.mark.parametrize("what, argv, value, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_path_flag_refuses_a_bad_path_while_parsing(what, argv, value, words, tmp_path, monkeypatch, capsys):
    """One line, exit 2, before any work (argparse's own exit), the path cut short in the line."""
    from fastverify.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([a.replace("{}", value) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("fastverify: error: argument "), err
    assert all(w in lines[0] for w in words), lines[0]
    assert len(lines[0]) < 700  # the 5,000-character path is not printed whole
    assert list(tmp_path.iterdir()) == []


def test_a_flag_whose_value_is_optional_keeps_its_default(tmp_path, monkeypatch):
    """``--write-env`` and ``--load`` without a value mean their default (argparse passes the
    missing value through the flag's type as ""): not refused as an empty path."""
    from fastverify.cli import build_parser

    args = build_parser("tune").parse_args([*PREDICT_2, "--write-env"])
    assert args.write_env == ""
    args = build_parser("launch").parse_args(["launch", "--load", "--", "true"])
    assert args.load == ""


def test_a_non_utf8_verify_log_folder_and_record_name_give_a_bundle(tmp_path):
    """Before: the manifest could not be encoded, a traceback after every part had run and no
    bundle. The names go in with their bytes escaped."""
    log = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"log\xff")))
    _records(log, names=["verify-rank0.jsonl", os.fsdecode(b"verify-rank\xff.jsonl")])
    out = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"b\xff.tar.gz")))
    proc = run_fastverify([*QUICK_COLLECT, "--verify-log", str(log), "--output", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.startswith(f"wrote {tmp_path}/b\\xff.tar.gz (1 ok")
    from fastverify.bundle import open_bundle

    b = open_bundle(out)
    part = b.part("verify_log")
    assert part.status == "ok" and part.meta["folder"] == f"{tmp_path}/log\\xff"
    assert "verify-log/verify-rank0.jsonl" in part.files
    assert all(f.isprintable() and "\\" not in f for f in part.files)  # member names: UTF-8, no backslash
