"""The one output writer (fastverify.procs.write_files / reserve_names): default names are taken
with an exclusive create, so concurrent runs in one folder never share (or overwrite) a file; a
symlinked output is refused, never written through; a failed write leaves nothing behind; a
non-UTF-8 path is shown escaped, never as a traceback."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import DATA, subprocess_env, tree_state

TRACES = [
    DATA / "rccl_generic" / "rccl_generic_eager.trace.json.gz",
    DATA / "merged_sglang" / "merged-distinct-ids.trace.json.gz",
    DATA / "bigint" / "comms_id_over_64_bits.trace.json.gz",
    DATA / "ns_timestamps" / "ns_fractions.trace.json.gz",
]
GOOD = TRACES[0]


def _run(args, cwd, **kw):
    return subprocess.run(
        [sys.executable, "-m", "fastverify", *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        timeout=180,
        **kw,
    )


def _one_error_line(proc, *words):
    err = proc.stderr.decode() if isinstance(proc.stderr, bytes) else proc.stderr
    assert proc.returncode == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastverify: error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# --- item 1: concurrent runs with default names ------------------------------------------------------


def test_four_concurrent_runs_with_default_names_each_get_their_own_files(tmp_path):
    """Four `profile --trace` runs at once in one folder: four JSON and four PNG files, and each
    JSON (the name that run printed) holds that run's own profile (its own trace file)."""
    inputs = []
    for i, t in enumerate(TRACES):
        dest = tmp_path / f"in{i}.trace.json.gz"
        dest.write_bytes(t.read_bytes())
        inputs.append(dest)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "fastverify", "profile", "--trace", str(t), "--quiet"],
            cwd=tmp_path,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for t in inputs
    ]
    results = [(p.communicate(timeout=180), p.returncode) for p in procs]
    wrote = {}
    for t, ((out, err), rc) in zip(inputs, results):
        assert rc == 0 and err == "", err
        line = out.strip().splitlines()[-1]
        assert line.startswith("wrote profiles/") and " and profiles/" in line, line
        json_name, png_name = line[len("wrote ") :].split(" and ")
        wrote[t] = (tmp_path / json_name, tmp_path / png_name)
    names = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert len(names) == 8, names  # no placeholder, temporary file or lost output
    assert len({j for j, _ in wrote.values()}) == 4 and len({p for _, p in wrote.values()}) == 4
    for t, (j, png) in wrote.items():
        doc = json.loads(j.read_text())
        assert set(doc["source"]["files"]) == {str(t)}, (j, doc["source"])  # a merged trace: 2 ranks, 1 file
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.with_suffix(".json") == j


def test_same_second_names_are_unique_across_threads(tmp_path):
    """The same timestamp for every caller (the race of the issue, made certain): each gets a
    distinct name; both placeholders exist until written or released."""
    from fastverify.outputs import release_reserved
    from fastverify.profile.build import default_output

    now = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    got: list[Path] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def take():
        start.wait()
        p = default_output("trace", tmp_path / "profiles", now=now)
        with lock:
            got.append(p)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(set(got)) == 8
    assert {p.name for p in got} == {"trace-20260102-030405.json"} | {
        f"trace-20260102-030405-{n}.json" for n in range(2, 9)
    }
    for p in got:
        assert p.is_file() and p.with_suffix(".png").is_file()
    release_reserved()
    assert list(tmp_path.iterdir()) == []  # the placeholders, and the folder made for them, are gone


def test_a_taken_png_name_moves_the_pair_on(tmp_path):
    from fastverify.outputs import release_reserved
    from fastverify.profile.build import default_output

    now = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "trace-20260102-030405.png").write_bytes(b"someone else's")
    (folder / "trace-20260102-030405-2.json").symlink_to("elsewhere.json")  # a link counts as taken
    p = default_output("trace", folder, png=False, now=now)
    assert p.name == "trace-20260102-030405-3.json"
    release_reserved()
    assert not p.exists() and not (folder / "elsewhere.json").exists()


def test_a_failed_write_leaves_no_placeholder_and_no_temporary_file(tmp_path):
    from fastverify.errors import UserError
    from fastverify.outputs import write_files
    from fastverify.profile.build import default_output

    out = default_output("trace", tmp_path / "profiles")
    assert out.exists()

    def fail(tmp):
        raise OSError(28, "No space left on device")

    with pytest.raises(UserError) as ei:
        write_files([(out, lambda tmp: tmp.write_bytes(b"{}")), (out.with_suffix(".png"), fail)])
    assert str(ei.value) == f"{out.with_suffix('.png')}: cannot write (No space left on device)"
    assert list(tmp_path.iterdir()) == []


def test_a_failed_png_after_the_name_is_taken_leaves_nothing(tmp_path, monkeypatch):
    """The default names are taken, then drawing the PNG fails: no placeholder, no temporary
    file, and the profiles/ folder made for them is removed again."""
    import fastverify.profile.plot
    from fastverify.errors import UserError
    from fastverify.profile.build import build_profile, default_output, write_outputs
    from fastverify.trace.load import load_traces

    ranks = load_traces([str(GOOD)])
    profile = build_profile(ranks, {"kind": "trace", "files": [r.origin for r in ranks]})
    out = default_output("trace", tmp_path / "profiles")

    def fail(doc, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fastverify.profile.plot, "plot_profile", fail)
    with pytest.raises(UserError, match="cannot write"):
        write_outputs(profile, out, out.with_suffix(".png"))
    assert list(tmp_path.iterdir()) == []


def test_a_default_verify_log_report_gets_its_own_name(tmp_path):
    d = tmp_path / "log"
    d.mkdir()
    (d / "verify-rank0.jsonl").write_text(
        json.dumps({"step": 0, "verify_ms": 1.5, "clock": "cpu_wall_clock", "rank": "0", "pid": 1}) + "\n"
    )
    names = set()
    for _ in range(2):
        proc = _run(["profile", "--verify-log", "log", "--quiet"], tmp_path, text=True)
        assert proc.returncode == 0, proc.stderr
        names.add(proc.stdout.strip().removeprefix("wrote "))
    assert len(names) == 2
    assert sorted(p.name for p in (tmp_path / "profiles").iterdir()) == sorted(Path(n).name for n in names)


# --- item 2: a symlinked output is refused ---------------------------------------------------------


@pytest.mark.parametrize(
    "flags, link",
    [
        (["--output", "dang.json", "--no-png"], "dang.json"),
        (["--output", "dang.json"], "dang.json"),
        (["--output", "o.json", "--png", "dang.png"], "dang.png"),
        (["--output", "o.json"], "o.png"),  # the PNG beside --output
    ],
)
def test_a_symlinked_output_is_refused_in_one_line_and_nothing_is_written(tmp_path, flags, link):
    (tmp_path / "nowhere").mkdir()
    (tmp_path / link).symlink_to("nowhere/x")
    before = tree_state(tmp_path)
    proc = _run(["profile", "--trace", str(GOOD), "--quiet", *flags], tmp_path)
    line = _one_error_line(proc, link, "is a symlink", "refused")
    assert "nowhere/x" in line
    assert tree_state(tmp_path) == before


def test_a_symlink_to_an_existing_file_is_refused_too(tmp_path):
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    before = tree_state(tmp_path)
    proc = _run(["profile", "--trace", str(GOOD), "--output", "link.json", "--no-png", "--quiet"], tmp_path)
    _one_error_line(proc, "--output link.json", "is a symlink (to real.json)")
    assert tree_state(tmp_path) == before


def test_the_writer_refuses_a_symlink_swapped_in_after_the_checks(tmp_path):
    from fastverify.errors import UserError
    from fastverify.outputs import write_files

    out = tmp_path / "o.json"

    def swap(tmp):
        tmp.write_bytes(b"{}")
        out.symlink_to(tmp_path / "elsewhere.json")

    with pytest.raises(UserError, match="is a symlink"):
        write_files([(out, swap)])
    assert not (tmp_path / "elsewhere.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.json"] and out.is_symlink()


# --- item 4: non-UTF-8 file names ----------------------------------------------------------------


def test_a_trace_folder_with_a_non_utf8_name_succeeds_and_shows_it_escaped(tmp_path):
    d = os.path.join(os.fsencode(tmp_path), b"tr\xff")
    os.mkdir(d)
    with open(os.path.join(d, b"\xff.json.gz"), "wb") as f:
        f.write(GOOD.read_bytes())
    proc = _run(["profile", "--trace", os.fsdecode(d), "--output", "o.json", "--no-png", "--quiet"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert b"Traceback" not in proc.stderr
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["source"]["files"] == [f"{tmp_path}/tr\\xff/\\xff.json.gz"]


def test_a_bad_trace_with_a_non_utf8_name_is_one_line_with_the_bytes_escaped(tmp_path):
    d = os.path.join(os.fsencode(tmp_path), b"tr\xff")
    os.mkdir(d)
    with open(os.path.join(d, b"\xff.json"), "wb") as f:
        f.write(b"not json")
    before = tree_state(tmp_path)
    proc = _run(["profile", "--trace", os.fsdecode(d), "--quiet"], tmp_path)
    line = _one_error_line(proc, "tr\\xff")
    assert "\udcff" not in line
    assert tree_state(tmp_path) == before


def test_a_non_utf8_output_name_is_written_and_printed_escaped(tmp_path):
    out = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"o\xff.json"))
    proc = _run(["profile", "--trace", str(GOOD), "--output", out, "--no-png", "--quiet"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().strip() == f"wrote {tmp_path}/o\\xff.json"
    assert json.loads(Path(out).read_text())["schema"] == "fastverify.profile"
