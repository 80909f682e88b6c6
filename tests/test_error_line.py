"""A user error stays one readable line even when it quotes a huge input (issue 12: a 10 MB
env-file line was echoed whole into the error)."""

from __future__ import annotations

import subprocess
import sys

from fastverify.errors import MAX_ERROR_CHARS, one_line


def test_one_line_keeps_short_messages_and_cuts_long_ones_in_the_middle():
    assert one_line("a.env: line 3: bad\nvalue") == "a.env: line 3: bad value"
    long = "a.env: line 1: " + "x" * 10_000 + ": not a valid NCCL_ALGO"
    got = one_line(long)
    assert len(got) <= MAX_ERROR_CHARS + 60
    assert got.startswith("a.env: line 1: xxx") and got.endswith(": not a valid NCCL_ALGO")
    head, tail = MAX_ERROR_CHARS * 2 // 3, MAX_ERROR_CHARS // 4
    assert f"[{len(long) - head - tail:,} characters left out]" in got


def test_a_10_mb_env_file_line_is_not_echoed_whole(tmp_path):
    env = tmp_path / "big.env"
    env.write_text("NCCL_ALGO=" + "x" * 10_000_000 + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "fastverify", "launch", "--env", str(env), "--dry-run", "--", "python", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and str(env) in lines[0]
    assert len(lines[0]) < MAX_ERROR_CHARS + 100
    assert "characters left out" in lines[0]
