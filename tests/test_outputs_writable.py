"""An output that cannot be written is refused before any work (a trace read, a rank started)."""

from __future__ import annotations

import os

import pytest

from fastverify.cli import main
from fastverify.errors import UserError
from fastverify.procs import check_writable


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
    assert err == [f"fastverify: error: {tmp_path / 'p.json'}: cannot write in {tmp_path} (no write permission, "
                   "or a read-only file system)"]
