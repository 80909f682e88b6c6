"""`fastverify profile --verify-log DIR [DIR2]` (issue 10, What to build 3): the measured verify
latency from the verify timer's records, per rank and overall, and the change between a before
and an after folder. The expected percentiles are worked out by hand below (linear between
closest ranks) and cross-checked with the standard library's ``statistics.quantiles``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from conftest import assert_user_error, run_fastverify

R0 = [float(v) for v in range(1, 11)]  # 1..10 ms
R1 = [2.0, 4.0, 6.0, 8.0]
# By hand: p50 of 1..10 is halfway between the 5th and 6th value, 5.5; p90 sits at position
# 0.9 * 9 = 8.1, i.e. 9 + 0.1 * (10 - 9) = 9.1. Rank 1: p50 (4 + 6) / 2 = 5; p90 at 0.9 * 3 = 2.7,
# 6 + 0.7 * 2 = 7.4. Pooled (14 values 1,2,2,3,4,4,5,6,6,7,8,8,9,10): p50 (5 + 6) / 2 = 5.5, p90 at
# 0.9 * 13 = 11.7, 8 + 0.7 * 1 = 8.7. The after folder is every time halved.
EXPECTED = {"0": (5.5, 9.1), "1": (5.0, 7.4), "all": (5.5, 8.7)}


def _quantiles(values):
    q = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), q[8]


def test_hand_values_match_the_standard_library():
    for key, values in (("0", R0), ("1", R1), ("all", R0 + R1)):
        p50, p90 = _quantiles(values)
        assert (round(p50, 9), round(p90, 9)) == EXPECTED[key]


def _write(folder: Path, rank: str, times, clock="cpu_wall_clock", pid=4242, tail: bytes = b"") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"verify-rank{rank}.jsonl"
    lines = [
        json.dumps({"step": i, "verify_ms": t, "clock": clock, "rank": rank, "pid": pid}) for i, t in enumerate(times)
    ]
    path.write_bytes(("\n".join(lines) + "\n").encode() + tail)
    return path


def _profile(tmp_path: Path, *dirs: Path) -> tuple[dict, str]:
    out = tmp_path / "out" / "vl.json"
    proc = run_fastverify(["profile", "--verify-log", *map(str, dirs), "--output", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_one_folder_per_rank_and_overall(tmp_path):
    before = tmp_path / "before"
    _write(before, "0", R0)
    _write(before, "1", R1)
    doc, text = _profile(tmp_path, before)
    assert doc["schema"] == "fastverify.verify_log" and doc["basis"] == "measured"
    assert doc["clock"] == "cpu_wall_clock" and "NOT GPU time" in doc["clock_label"]
    got = {
        r["rank"]: (r["steps"], r["p50_ms"], r["p90_ms"]) for r in [*doc["before"]["ranks"], doc["before"]["overall"]]
    }
    assert got == {"0": (10, *EXPECTED["0"]), "1": (4, *EXPECTED["1"]), "all": (14, *EXPECTED["all"])}
    assert doc["after"] is None and doc["change"] == []
    assert "measured" in text and "CPU wall clock" in text and "NOT GPU time" in text


def test_before_after_change(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    _write(before, "0", R0)
    _write(before, "1", R1)
    _write(after, "0", [t / 2 for t in R0], pid=5)
    _write(after, "1", [t / 2 for t in R1], pid=6)
    doc, text = _profile(tmp_path, before, after)
    change = {c["rank"]: c for c in doc["change"]}
    assert set(change) == {"0", "1", "all"}
    for key, (p50, p90) in EXPECTED.items():
        c = change[key]
        assert (c["before_p50_ms"], c["after_p50_ms"]) == (p50, p50 / 2)
        assert c["p50_change_ms"] == pytest.approx(-p50 / 2) and c["change_pct"] == -50.0
        assert (c["before_p90_ms"], c["after_p90_ms"]) == (p90, pytest.approx(p90 / 2))
        assert c["p90_change_pct"] == -50.0
    assert "measured change" in text


def test_torn_last_line_is_skipped_and_reported(tmp_path):
    """A writer killed mid-write can leave only its last line cut; the rest counts."""
    d = tmp_path / "run"
    _write(d, "0", R0, tail=b'{"step": 10, "verify_')
    doc, _ = _profile(tmp_path, d)
    assert doc["before"]["ranks"][0]["steps"] == 10 and doc["before"]["ranks"][0]["p50_ms"] == 5.5
    assert doc["before"]["torn_last_lines"] == ["verify-rank0.jsonl:11"]
    assert any("cut last line" in w for w in doc["warnings"])


def test_cuda_clock_is_labelled_gpu_time(tmp_path):
    d = tmp_path / "gpu"
    _write(d, "0", R1, clock="cuda_events")
    doc, _ = _profile(tmp_path, d)
    assert doc["clock"] == "cuda_events" and doc["clock_label"].startswith("GPU time")


def _bad_cases(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (--verify-log arguments, words the one error line must hold); files made here."""
    (tmp / "empty").mkdir()
    (tmp / "other").mkdir()
    (tmp / "other" / "notes.txt").write_text("hello")
    (tmp / "norecords").mkdir()
    (tmp / "norecords" / "verify-rank0.jsonl").write_bytes(b"")
    _write(tmp / "onlytorn", "0", [], tail=b'{"step": 0, "ver')
    p = _write(tmp / "corrupt", "0", R0)
    lines = p.read_bytes().split(b"\n")
    lines[3] = b'{"step": 3, "verify_ms": "fast"}'
    p.write_bytes(b"\n".join(lines))
    p = _write(tmp / "cutmiddle", "0", R0)
    lines = p.read_bytes().split(b"\n")
    lines[4] = lines[4][:10]  # cut, but not the last line: not what a killed writer leaves
    p.write_bytes(b"\n".join(lines))
    _write(tmp / "negative", "0", [1.0, -2.0])
    _write(tmp / "mixed", "0", R0)
    _write(tmp / "mixed", "1", R1, clock="cuda_events")
    _write(tmp / "cpu", "0", R0)
    _write(tmp / "gpu", "0", R0, clock="cuda_events")
    return {
        "missing": (["nosuch"], ["nosuch", "no such folder"]),
        "a_file": (["cpu/verify-rank0.jsonl"], ["verify-rank0.jsonl", "a file, not a folder", "give its folder"]),
        "empty_dir": (["empty"], ["empty", "verify-rank*.jsonl"]),
        "unrelated_files": (["other"], ["other", "verify-rank*.jsonl"]),
        "no_records": (["norecords"], ["verify-rank0.jsonl", "no verify records"]),
        "only_a_torn_line": (["onlytorn"], ["verify-rank0.jsonl", "no verify records"]),
        "corrupt_line": (
            ["corrupt"],
            ['verify-rank0.jsonl:4: field "verify_ms": expected a number, got a string (e.g. "verify_ms": 1.25)'],
        ),
        "cut_line_not_last": (["cutmiddle"], ["verify-rank0.jsonl:5", "not a verify record"]),
        "negative_time": (["negative"], ["verify-rank0.jsonl:2", "-2.0"]),
        "mixed_clocks_in_a_folder": (["mixed"], ["mixed", "cpu_wall_clock", "cuda_events"]),
        "mixed_clocks_before_after": (["cpu", "gpu"], ["gpu", "cuda_events", "cpu_wall_clock"]),
        "three_folders": (["cpu", "cpu", "cpu"], ["--verify-log", "3 folders"]),
    }


CASES = [
    "missing",
    "a_file",
    "empty_dir",
    "unrelated_files",
    "no_records",
    "only_a_torn_line",
    "corrupt_line",
    "cut_line_not_last",
    "negative_time",
    "mixed_clocks_in_a_folder",
    "mixed_clocks_before_after",
    "three_folders",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, case):
    args, words = _bad_cases(tmp_path)[case]
    before = {p for p in tmp_path.rglob("*")}
    proc = run_fastverify(["profile", "--verify-log", *args, "--quiet"], cwd=tmp_path)
    assert_user_error(proc, *words)
    assert {p for p in tmp_path.rglob("*")} == before, "a file was left behind"


def test_verify_log_with_trace_or_live_flags_is_refused(tmp_path):
    _write(tmp_path / "cpu", "0", R0)
    for extra in (["--trace", "x.json"], ["--tp", "4"]):
        proc = run_fastverify(["profile", "--verify-log", "cpu", *extra, "--quiet"], cwd=tmp_path)
        assert_user_error(proc, extra[0])
    assert not (tmp_path / "profiles").exists()


def _one(tmp_path, name="verify-rank0.jsonl", **fields):
    rec = {"step": 0, "verify_ms": 1.5, "clock": "cpu_wall_clock", "rank": "0", "pid": 1, **fields}
    d = tmp_path / "log"
    d.mkdir(exist_ok=True)
    (d / name).write_text(json.dumps(rec) + "\n")
    return d


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"allreduce_paths": {"verify": {"sglang.gloo": -1}}}, "verify.sglang.gloo=-1 is not a count"),
        ({"allreduce_paths": {"warp": {"sglang.gloo": 1}}}, "unknown forward mode 'warp'"),
        ({"allreduce_paths": {"verify": {"": 1}}}, "'' is not a path"),
        ({"allreduce_paths": {"verify": {"sglang.\x1b[31mred": 1}}}, "is not a path"),
        ({"allreduce_paths": {"verify": {"sglang." + "x" * 5000: 1}}}, "is not a path"),
        ({"verify_ms": 1e308}, "verify_ms 1e+308 is not a verify time"),
        ({"verify_ms": 3.6e6 + 1}, "is not a verify time"),
        ({"rank": "1"}, "a record of rank '1' in the file of rank '0'"),
    ],
)
def test_records_the_patch_cannot_write_are_refused_in_one_line(tmp_path, fields, words):
    from fastverify.errors import UserError
    from fastverify.verifylog import build_report

    with pytest.raises(UserError, match="verify-rank0.jsonl:1: ") as err:
        build_report(_one(tmp_path, **fields))
    assert words in str(err.value), err.value


def test_a_rank_file_of_another_spelling_is_not_merged_into_rank_0(tmp_path):
    from fastverify.errors import UserError
    from fastverify.verifylog import build_report

    d = _one(tmp_path)
    (d / "verify-rank00.jsonl").write_text((d / "verify-rank0.jsonl").read_text())
    with pytest.raises(UserError, match="a record of rank '0' in the file of rank '00'"):
        build_report(d)


def test_empty_counts_are_said_as_such(tmp_path):
    from fastverify.verifylog import build_report, format_report

    text = format_report(build_report(_one(tmp_path, allreduce_paths={"verify": {}})))
    assert "1 record(s) carry allreduce_paths, all of them empty" in text, text


def test_a_fifo_named_like_a_log_is_refused_by_name(tmp_path):
    import os

    from fastverify.errors import UserError
    from fastverify.verifylog import build_report

    d = tmp_path / "log"
    d.mkdir()
    os.mkfifo(d / "verify-rank0.jsonl")
    with pytest.raises(UserError, match="verify-rank0.jsonl"):
        build_report(d)


def test_the_same_folder_as_before_and_after_is_refused(tmp_path):
    from fastverify.errors import UserError
    from fastverify.verifylog import build_report

    d = _one(tmp_path)
    with pytest.raises(UserError, match="is both the before and the after folder: give the two runs' folders"):
        build_report(d, d)
