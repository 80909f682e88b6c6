"""Bad input to `python -m fastverify profile`: exit code 2, exactly one line on stderr naming the
file / field / value, no traceback, and no output file left behind (neither at --output nor in a
profiles/ folder of the working directory)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
from conftest import DATA, assert_user_error, run_fastverify

GOOD = DATA / "bigint" / "comms_id_over_64_bits.trace.json.gz"  # a valid one-rank trace (rank 3)

CPU_ONLY = {
    "traceEvents": [
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::mm",
            "pid": 1,
            "tid": 1,
            "ts": 10,
            "dur": 5,
            "args": {"External id": 1},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": 1,
            "tid": 1,
            "ts": 11,
            "dur": 1,
            "args": {"correlation": 1, "External id": 1},
        },
        {"ph": "X", "cat": "python_function", "name": "model.py(1): forward", "pid": 1, "tid": 1, "ts": 9, "dur": 8},
    ]
}


def _gz(obj) -> bytes:
    return gzip.compress(json.dumps(obj).encode(), mtime=0)


# name -> (files to create {name: bytes}, --trace arguments, word(s) the error line must contain)
TRACE_CASES = {
    "truncated_gzip": (
        {"trunc.json.gz": GOOD.read_bytes()[: len(GOOD.read_bytes()) // 2]},
        ["trunc.json.gz"],
        ["trunc.json.gz"],
    ),
    "gzip_garbage": ({"garbage.json.gz": b"\x1f\x8b\x08\x00" + b"\x00" * 40}, ["garbage.json.gz"], ["garbage.json.gz"]),
    "not_json": ({"notes.json": b"this is not JSON {"}, ["notes.json"], ["notes.json"]),
    "gzipped_not_json": ({"log.json.gz": gzip.compress(b"INFO hello\n", mtime=0)}, ["log.json.gz"], ["log.json.gz"]),
    "no_traceEvents": (
        {"meta.json": b'{"schemaVersion": 1, "deviceProperties": []}'},
        ["meta.json"],
        ["meta.json", "traceEvents"],
    ),
    "json_number": ({"num.json": b"42"}, ["num.json"], ["num.json"]),
    "traceEvents_not_list": ({"obj.json": b'{"traceEvents": {"a": 1}}'}, ["obj.json"], ["obj.json", "traceEvents"]),
    "empty_trace": ({"empty.json": b'{"traceEvents": []}'}, ["empty.json"], ["empty.json"]),
    "cpu_only": ({"cpu.json.gz": _gz(CPU_ONLY)}, ["cpu.json.gz"], ["cpu.json.gz", "GPU"]),
    "duplicate_rank": (
        {"a-TP-x.json.gz": GOOD.read_bytes(), "b-TP-x.json.gz": GOOD.read_bytes()},
        ["a-TP-x.json.gz", "b-TP-x.json.gz"],
        ["b-TP-x.json.gz", "rank 3"],
    ),
    "duplicate_rank_in_folder": (
        {"runs/r0.json.gz": GOOD.read_bytes(), "runs/r0-copy.json.gz": GOOD.read_bytes()},
        ["runs"],
        ["r0", "rank 3"],
    ),
    "missing_path": ({}, ["no_such_trace.json.gz"], ["no_such_trace.json.gz"]),
    "empty_folder": ({"emptydir/readme.txt": b"nothing"}, ["emptydir"], ["emptydir"]),
}


def _make(tmp: Path, files: dict[str, bytes]) -> set[Path]:
    made = set()
    for name, data in files.items():
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        made.add(p)
    return made


def _all_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("use_output", [False, True], ids=["default_profiles_dir", "with_--output"])
@pytest.mark.parametrize("case", list(TRACE_CASES))
def test_bad_trace_input(tmp_path, case, use_output):
    files, trace_args, must_name = TRACE_CASES[case]
    made = _make(tmp_path, files)
    args = ["profile", "--trace", *trace_args, "--quiet"]
    if use_output:
        args += ["--output", "out/deeper/profile.json"]
    proc = run_fastverify(args, cwd=tmp_path)
    assert_user_error(proc, *must_name)
    assert proc.stdout == ""
    assert _all_files(tmp_path) == made, "a file was left behind"
    assert not (tmp_path / "profiles").exists()


@pytest.mark.parametrize(
    "extra",
    [["--model", "tiny"], ["--model=tiny"], ["--tp", "4"], ["--draft-tokens", "3"]],
    ids=["--model", "--model=", "--tp", "--draft-tokens"],
)
def test_trace_with_live_flags(tmp_path, extra):
    made = _make(tmp_path, {"t.json.gz": GOOD.read_bytes()})
    proc = run_fastverify(["profile", "--trace", "t.json.gz", *extra, "--quiet"], cwd=tmp_path)
    assert_user_error(proc, extra[0].split("=")[0])
    assert _all_files(tmp_path) == made
    assert not (tmp_path / "profiles").exists()


def test_trace_with_abbreviated_live_flag(tmp_path):
    """argparse would take `--mod` as `--model`; abbreviations are refused, so nothing is silently ignored."""
    made = _make(tmp_path, {"t.json.gz": GOOD.read_bytes()})
    proc = run_fastverify(["profile", "--trace", "t.json.gz", "--mod", "tiny", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, "--mod")
    assert _all_files(tmp_path) == made
    assert not (tmp_path / "profiles").exists()


def test_unwritable_output(tmp_path):
    made = _make(tmp_path, {"t.json.gz": GOOD.read_bytes(), "blocker": b"a file, not a folder"})
    proc = run_fastverify(
        ["profile", "--trace", "t.json.gz", "--output", "blocker/p.json", "--no-png", "--quiet"], cwd=tmp_path
    )
    assert_user_error(proc, "blocker")
    assert _all_files(tmp_path) == made


def test_good_trace_writes_into_profiles(tmp_path):
    """The positive control for the checks above: a good trace does write profiles/*.json."""
    _make(tmp_path, {"t.json.gz": GOOD.read_bytes()})
    proc = run_fastverify(["profile", "--trace", "t.json.gz", "--no-png", "--quiet"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    written = list((tmp_path / "profiles").glob("*.json"))
    assert len(written) == 1
    assert json.loads(written[0].read_text())["schema"] == "fastverify.profile"


# --- live-run input: presets and config.json (fastverify.live.config) -----------------------


def _has_live_config() -> bool:
    try:
        return importlib.util.find_spec("fastverify.live.config") is not None
    except ModuleNotFoundError:  # no fastverify.live package at all
        return False


needs_live_config = pytest.mark.skipif(
    not _has_live_config(), reason="fastverify.live.config (load_model_config) is not written yet"
)


@needs_live_config
def test_unknown_preset(tmp_path):
    proc = run_fastverify(["profile", "--model", "nope", "--quiet"], cwd=tmp_path)
    assert_user_error(proc, "nope")
    assert _all_files(tmp_path) == set()
    assert not (tmp_path / "profiles").exists()


@needs_live_config
@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "n_routed_experts"])
def test_config_json_missing_field(tmp_path, field):
    import fastverify.live

    tiny = json.loads((Path(fastverify.live.__file__).parent / "presets" / "tiny.json").read_text())
    del tiny[field]
    cfg = tmp_path / "model" / "config.json"
    made = _make(tmp_path, {"model/config.json": json.dumps(tiny).encode()})
    proc = run_fastverify(["profile", "--model", str(cfg), "--quiet", "--output", "out/p.json"], cwd=tmp_path)
    assert_user_error(proc, field, "config.json")
    assert _all_files(tmp_path) == made
    assert not (tmp_path / "profiles").exists()


# distributedInfo values a trace should not have; the command either uses the trace (exit 0,
# a valid JSON profile) or rejects it in one line (exit 2), never a traceback.
ODD_DIST = {
    "world_size_list": {"rank": 0, "world_size": []},
    "rank_wider_than_64_bits": {"rank": 2**64, "world_size": 2},
    "rank_bool": {"rank": True, "world_size": 2},
    "rank_negative": {"rank": -1, "world_size": 2},
    "rank_string": {"rank": "0", "world_size": "two"},
}


@pytest.mark.parametrize("case", list(ODD_DIST))
def test_odd_distributed_info(tmp_path, case, capsys):
    from fastverify.cli import main

    doc = {
        "distributedInfo": ODD_DIST[case],
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 10, "dur": 5, "args": {}}
        ],
    }
    trace = tmp_path / "odd.json"
    trace.write_text(json.dumps(doc))
    out = tmp_path / "out" / "p.json"
    rc = main(["profile", "--trace", str(trace), "--output", str(out), "--no-png", "--quiet"])
    err = capsys.readouterr().err
    if rc == 0:
        prof = json.loads(out.read_text())
        assert isinstance(prof["ranks"][0]["rank"], int) and not isinstance(prof["ranks"][0]["rank"], bool)
        assert 0 <= prof["ranks"][0]["rank"] < 2**31
    else:
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "odd.json" in err
        assert not out.parent.exists() or not any(out.parent.iterdir())
