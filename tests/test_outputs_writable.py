"""An output that cannot be written is refused before any work (a trace read, a rank started)."""

from __future__ import annotations

import os

import pytest

from fastverify.cli import main
from fastverify.errors import UserError
from fastverify.outputs import check_writable


def test_check_writable_names_the_folder_that_refuses(tmp_path, monkeypatch):
    deep = tmp_path / "a" / "b" / "out.json"  # folders to be created: the nearest existing one counts
    check_writable(deep)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    with pytest.raises(UserError) as ei:
        check_writable(deep)
    assert str(ei.value) == f"{deep}: cannot write in {tmp_path} (no write permission, or a read-only file system)"


def test_check_writable_refuses_a_path_under_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UserError, match="file is a file, not a folder"):
        check_writable(f / "out.json")


def test_profile_refuses_an_unwritable_output_before_loading_anything(tmp_path, monkeypatch, capsys):
    import fastverify.trace.load as L

    def never(*a, **k):
        raise AssertionError("traces were loaded before the output was checked")

    monkeypatch.setattr(L, "load_traces", never)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    trace = tmp_path / "t.json"
    trace.write_text("{}")
    rc = main(["profile", "--trace", str(trace), "--output", str(tmp_path / "p.json"), "--no-png"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"fastverify: error: {tmp_path / 'p.json'}: cannot write in {tmp_path} (no write permission, "
        "or a read-only file system)"
    ]


def _profile_cmd(trace, out):
    import sys

    return [sys.executable, "-m", "fastverify", "profile", "--trace", str(trace), "--output", str(out), "--no-png"]


def test_stdout_closed_or_full_gives_one_line_and_keeps_the_files(tmp_path):
    """The files are the output: with stdout closed (`>&-`) the run succeeds without the table;
    with stdout on a full device it says so in one line (exit 1), naming what it wrote."""
    import subprocess

    from conftest import DATA, subprocess_env

    trace = DATA / "rccl_generic" / "rccl_generic_eager.trace.json.gz"
    closed = subprocess.run(
        _profile_cmd(trace, tmp_path / "a.json"),
        env=subprocess_env(),
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.close(1),
        timeout=120,
    )
    assert closed.returncode == 0 and closed.stderr == "", closed.stderr
    assert (tmp_path / "a.json").stat().st_size > 0
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        for extra in ([], ["--quiet"]):
            out = tmp_path / f"b{len(extra)}.json"
            r = subprocess.run(
                _profile_cmd(trace, out) + extra,
                env=subprocess_env(),
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
            assert r.returncode == 1
            assert r.stderr == (
                f"fastverify: error: cannot write to standard output (No space left on device); wrote {out}\n"
            )
            assert out.stat().st_size > 0
