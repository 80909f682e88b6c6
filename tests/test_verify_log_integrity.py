"""`profile --verify-log DIR [DIR2]` refuses what the verify timer never writes, in one line, exit 2,
with nothing written or changed: a file whose records name another rank (never merged into that
rank), a rank file that cannot be read (never silently dropped), values outside the bounds of
fastverify.bounds, a rank that is not an ASCII number, an --output inside a log folder, more rank
files than one server has (MAX_RANK_FILES); a non-UTF-8 folder name is shown escaped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_fastverify, tree_state


def _rec(rank="0", **fields) -> str:
    return json.dumps({"step": 0, "verify_ms": 1.5, "clock": "cpu_wall_clock", "rank": rank, "pid": 7, **fields})


def _log(folder: Path, rank="0", lines=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"verify-rank{rank}.jsonl"
    path.write_text("\n".join(lines or [_rec(rank, step=i, verify_ms=1.0 + i) for i in range(3)]) + "\n")
    return path


def _refused(tmp_path: Path, args: list[str], *words: str) -> str:
    """Run `profile --verify-log ARGS`; exit 2, one `fastverify: error:` line holding ``words``,
    and nothing under tmp_path written, removed or changed."""
    before = tree_state(tmp_path)
    proc = run_fastverify(["profile", "--verify-log", *args, "--quiet"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastverify: error: "), proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert proc.stdout == ""
    assert tree_state(tmp_path) == before, "a file was written or changed"
    return lines[0]


def test_a_record_of_another_rank_is_refused_not_merged(tmp_path):
    _log(tmp_path / "log", "0")
    _log(tmp_path / "log", "1", [_rec("1"), _rec("1", step=1), _rec("0", step=2)])
    _refused(tmp_path, ["log"], "log/verify-rank1.jsonl:3", "rank '0'", "rank '1'")


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: p.symlink_to(p.name), ["Too many levels of symbolic links"]),
        (lambda p: p.symlink_to("/dev/zero"), ["is a device"]),
        (lambda p: os.mkfifo(p), ["is a FIFO"]),
        (lambda p: p.mkdir(), ["is a directory"]),
        (lambda p: p.symlink_to("gone.jsonl"), ["No such file"]),
    ],
    ids=["symlink_loop", "dev_zero_via_symlink", "fifo", "directory", "dangling_symlink"],
)
def test_an_unreadable_rank_file_is_refused_never_dropped(tmp_path, make, words):
    _log(tmp_path / "log", "0")
    make(tmp_path / "log" / "verify-rank1.jsonl")
    _refused(tmp_path, ["log"], "log/verify-rank1.jsonl", "cannot read a verify log", *words)


def test_an_unreadable_rank_file_named_rank0_is_refused(tmp_path):
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "verify-rank0.jsonl").mkdir()
    _refused(tmp_path, ["log"], "log/verify-rank0.jsonl", "is a directory")


@pytest.mark.parametrize("value", [1.7e308, 3.6e6 * 1.0000001, -0.5])
def test_verify_ms_out_of_bounds_is_refused_never_inf(tmp_path, value):
    _log(tmp_path / "log", "0", [_rec(), _rec(step=1, verify_ms=value)])
    line = _refused(tmp_path, ["log"], "log/verify-rank0.jsonl:2", "verify_ms", "is not a verify time", "1 hour")
    assert "inf" not in line and "null" not in line


def test_verify_ms_overflowing_json_is_refused(tmp_path):
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "verify-rank0.jsonl").write_text(_rec().replace("1.5", "1e400") + "\n")
    _refused(tmp_path, ["log"], "log/verify-rank0.jsonl:1")


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"step": -1}, ["step", "-1"]),
        ({"step": 10**18}, ["step"]),
        ({"pid": -5}, ["pid", "-5"]),
        ({"pid": 2**40}, ["pid"]),
        ({"clock": "\x1b[2J" + "x" * 100}, ["clock", "not a clock name"]),
    ],
)
def test_other_fields_out_of_bounds_are_refused(tmp_path, fields, words):
    _log(tmp_path / "log", "0", [_rec(**fields)])
    line = _refused(tmp_path, ["log"], "log/verify-rank0.jsonl:1", *words)
    assert "\x1b" not in line


def test_a_superscript_digit_rank_is_one_line_not_a_traceback(tmp_path):
    _log(tmp_path / "log", "²", [_rec("²")])
    _refused(tmp_path, ["log"], "verify-rank².jsonl", "not a verify log name")


def test_a_superscript_digit_rank_in_a_rank0_file_is_another_rank(tmp_path):
    _log(tmp_path / "log", "0", [_rec("²")])
    _refused(tmp_path, ["log"], "log/verify-rank0.jsonl:1", "'²'", "'0'")


def test_a_rank_number_of_200_digits_is_refused_by_name(tmp_path):
    rank = "9" * 200  # no rank has more than 9 digits (int() of a 4301-digit string raises, too)
    _log(tmp_path / "log", rank, [_rec(rank)])
    _refused(tmp_path, ["log"], "not a verify log name")


def test_two_files_of_one_rank_are_refused(tmp_path):
    _log(tmp_path / "log", "1")
    _log(tmp_path / "log", "01", [_rec("01")])
    _refused(tmp_path, ["log"], "verify-rank1.jsonl", "verify-rank01.jsonl", "rank 1 again")


def test_pid_ranks_are_read(tmp_path):
    _log(tmp_path / "log", "pid123", [_rec("pid123")])
    out = tmp_path / "o.json"
    proc = run_fastverify(["profile", "--verify-log", "log", "--output", str(out), "--quiet"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [r["rank"] for r in json.loads(out.read_text())["before"]["ranks"]] == ["pid123"]


@pytest.mark.parametrize(
    "out", ["log/verify-rank9.jsonl", "log/sub/report.json", "log", "./log/../log/x.json", "after/r.json"]
)
def test_an_output_inside_a_log_folder_is_refused_before_reading(tmp_path, out):
    _log(tmp_path / "log", "0")
    _log(tmp_path / "after", "0")
    os.mkfifo(tmp_path / "log" / "verify-rank1.jsonl")  # read, it would be the error (or a hang)
    line = _refused(tmp_path, ["log", "after", "--output", out], "--output")
    assert "inside the --verify-log folder" in line


def test_an_output_inside_a_log_folder_through_a_linked_folder_is_refused(tmp_path):
    _log(tmp_path / "log", "0")
    (tmp_path / "alias").symlink_to("log")
    _refused(tmp_path, ["log", "--output", "alias/r.json"], "--output alias/r.json", "inside the --verify-log folder")


def test_a_symlinked_output_is_refused(tmp_path):
    _log(tmp_path / "log", "0")
    (tmp_path / "out.json").symlink_to("nowhere/out.json")
    _refused(tmp_path, ["log", "--output", "out.json"], "--output out.json", "is a symlink", "refused")


def test_ten_thousand_rank_files_are_refused_with_the_bound(tmp_path):
    from fastverify.verify_records import MAX_RANK_FILES

    d = tmp_path / "log"
    d.mkdir()
    line = _rec("0") + "\n"
    for r in range(10_000):
        (d / f"verify-rank{r}.jsonl").write_text(line.replace('"rank": "0"', f'"rank": "{r}"'))
    _refused(tmp_path, ["log"], "10,000", f"{MAX_RANK_FILES:,}", "verify-rank*.jsonl")


def test_a_non_utf8_folder_name_succeeds_and_is_escaped(tmp_path):
    d = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"log\xff")))
    _log(d, "0")
    out = tmp_path / "o.json"
    proc = run_fastverify(["profile", "--verify-log", str(d), "--output", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads(out.read_text())
    assert doc["before"]["dir"] == f"{tmp_path}/log\\xff"
    assert doc["before"]["files"] == [f"{tmp_path}/log\\xff/verify-rank0.jsonl"]
    assert f"{tmp_path}/log\\xff" in proc.stdout


def test_a_non_utf8_folder_with_a_bad_record_is_one_line(tmp_path):
    d = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"log\xff")))
    _log(d, "0", [_rec("1")])
    _refused(tmp_path, [str(d)], "log\\xff/verify-rank0.jsonl:1")
