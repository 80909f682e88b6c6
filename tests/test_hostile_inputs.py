"""Hostile-input suite (issue 12, items 1-3 and 7): every input flag of every subcommand is given a
FIFO, ``/dev/zero``, a directory, an oversize (sparse) file, a 200,000-deep JSON array, truncated
and binary files (and, for traces, a 5,000-deep array inside one kernel's args). Each must give exit
code 2, one line on stderr naming the file, no traceback, nothing written, within seconds; a FIFO
that hangs fails at the subprocess timeout instead of hanging the suite.

Run with ``-s`` to see the count of hostile inputs tried and how many were clean.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from conftest import DATA, subprocess_env

from fastverify.errors import UserError
from fastverify.inputs import CAPS

GOOD_TRACE = DATA / "bigint" / "comms_id_over_64_bits.trace.json.gz"  # a valid one-rank trace
TWO_GPU_TOPO = "        GPU0    GPU1\nGPU0     X      PHB\nGPU1    PHB      X\n"
ROOT = Path(__file__).resolve().parents[1]
HANG_S = 30  # a command still running after this is a hang
FAST_S = 20  # "at once": refused well before this (a cold start of python -m fastverify is ~1-3 s)

# flag -> (argv with {} for the hostile path, kind of input for the size cap, JSON-shaped input?)
FLAGS = {
    "profile --trace": (["profile", "--trace", "{}", "--output", "o.json", "--no-png", "--quiet"], "trace", True),
    "profile --model": (["profile", "--model", "{}", "--output", "o.json", "--no-png", "--quiet"], "text", True),
    "topo --nvidia-smi": (["topo", "--nvidia-smi", "{}"], "text", False),
    "topo --nccl-log": (["topo", "--nvidia-smi", "t2.txt", "--nccl-log", "{}"], "log", False),
    "topo --perf-table": (["topo", "--nvidia-smi", "t2.txt", "--perf-table", "{}"], "text", False),
    "tune --topology": (["tune", "--predict", "--topology", "{}", "--model", "tiny", "--tp", "2"], "text", False),
    "tune --profile": (["tune", "--predict", "--topology", "t2.txt", "--profile", "{}"], "json", True),
    "tune --model": (["tune", "--predict", "--topology", "t2.txt", "--model", "{}", "--tp", "2"], "text", True),
    "tune --perf-table": (
        ["tune", "--predict", "--topology", "t2.txt", "--model", "tiny", "--tp", "2", "--perf-table", "{}"],
        "text",
        False,
    ),
    "tune --nccl-log": (
        ["tune", "--predict", "--topology", "t2.txt", "--model", "tiny", "--tp", "2", "--nccl-log", "{}"],
        "log",
        False,
    ),
    "tune --p2p-check": (
        ["tune", "--predict", "--topology", "t2.txt", "--model", "tiny", "--tp", "2", "--p2p-check", "{}"],
        "text",
        True,
    ),
    "launch --env": (["launch", "--env", "{}", "--dry-run", "--", "true"], "text", False),
    "launch --deployment": (["launch", "--deployment", "{}", "--dry-run", "--", "true"], "json", True),
    "doctor --env-file": (["doctor", "--quick", "--env-file", "{}"], "text", False),
}


def _deep_args_trace() -> bytes:
    """A valid trace whose one kernel carries a 5,000-deep array in its args."""
    deep = "[" * 5000 + "]" * 5000
    return (
        '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2, "pid": 0, "tid": 7, '
        '"args": {"x": ' + deep + "}}]}"
    ).encode()


def _make(kind_of_input: str, hostile: str, folder: Path) -> str:
    """Create the hostile input in ``folder``; returns the path to pass."""
    p = folder / ("hostile.env" if kind_of_input == "env" else "hostile.json")
    if hostile == "fifo":
        os.mkfifo(p)
    elif hostile == "dev_zero":
        return "/dev/zero"
    elif hostile == "directory":
        p.mkdir()
    elif hostile == "oversize":
        with open(p, "wb") as f:
            f.truncate(CAPS[kind_of_input] + 1)  # sparse: no disk used
    elif hostile == "deep_200k":
        p.write_bytes(b"[" * 200_000 + b"]" * 200_000)
    elif hostile == "deep_kernel_args":
        p.write_bytes(_deep_args_trace())
    elif hostile == "truncated":
        raw = GOOD_TRACE.read_bytes() if kind_of_input == "trace" else b'{"schema": "fastverify.profile", "versi'
        p.write_bytes(raw[: len(raw) // 2])
    elif hostile == "binary":
        p.write_bytes(bytes(range(256)) * 16)
    else:  # pragma: no cover
        raise AssertionError(hostile)
    return p.name


def _cases():
    for flag, (argv, kind, is_json) in FLAGS.items():
        classes = ["fifo", "dev_zero", "directory", "oversize", "deep_200k", "binary"]
        if is_json:
            classes.append("truncated")
        if kind == "trace":
            classes.append("deep_kernel_args")
        for hostile in classes:
            yield pytest.param(flag, hostile, id=f"{flag.replace(' ', '')}-{hostile}")


_TRIED: list[str] = []
_CLEAN: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    print(
        f"\nhostile-input suite: {len(_TRIED)} hostile inputs tried, {len(_CLEAN)} clean "
        "(exit 2, one line naming the file, no traceback, nothing written, in time)"
    )


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("flag, hostile", list(_cases()))
def test_hostile_input_is_refused_in_one_line(tmp_path, flag, hostile):
    argv, kind, _ = FLAGS[flag]
    _TRIED.append(f"{flag} {hostile}")
    (tmp_path / "t2.txt").write_text(TWO_GPU_TOPO)
    env_like = flag in ("launch --env", "doctor --env-file")
    name = _make("env" if env_like and hostile != "oversize" else kind, hostile, tmp_path)
    if env_like and hostile == "oversize":
        os.rename(tmp_path / name, tmp_path / "hostile.env")
        name = "hostile.env"
    before = _files(tmp_path)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "fastverify", *[a.replace("{}", name) for a in argv]],
            cwd=tmp_path,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{flag} {hostile}: hung for {HANG_S} s")
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    if flag == "doctor --env-file" and hostile == "deep_200k":
        # a readable text file whose content is wrong is one of doctor's findings: its env_file check
        # fails, naming the file, and doctor exits 1 (its verdict), with no traceback; a binary file
        # is not text, so it is a bad argument (one line, exit 2) as everywhere else
        assert proc.returncode == 1 and "Traceback" not in out, out[-2000:]
        assert any("env_file" in ln and "fail" in ln and name in ln for ln in out.splitlines()), out
        assert took < FAST_S and _files(tmp_path) == before
        _CLEAN.append(f"{flag} {hostile}")
        return
    assert proc.returncode == 2, f"rc {proc.returncode}: {out[-2000:]}"
    assert "Traceback" not in out, out[-2000:]
    lines = proc.stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].strip(), proc.stderr[-2000:]
    assert name in lines[0] or Path(name).name in lines[0], lines[0]
    assert len(lines[0]) < 400, lines[0]
    if hostile in ("fifo", "dev_zero", "directory"):
        assert any(w in lines[0] for w in ("FIFO", "device", "directory", "no config.json", "no .json")), lines[0]
    if hostile == "oversize":
        assert "limit" in lines[0], lines[0]
    assert took < FAST_S, f"took {took:.1f} s"
    assert _files(tmp_path) == before, "nothing written"
    _CLEAN.append(f"{flag} {hostile}")


# --- the opener itself ---------------------------------------------------------------------------


def test_opener_refuses_special_files_at_once(tmp_path):
    from fastverify.inputs import read_bytes, read_text

    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"--x .*/p: cannot read: is a FIFO \(named pipe\); give a regular file"):
        read_bytes(fifo, flag="--x")
    with pytest.raises(UserError, match="is a device"):
        read_bytes("/dev/zero")
    with pytest.raises(UserError, match="is a directory"):
        read_bytes(tmp_path)
    assert time.monotonic() - t0 < 1.0
    (tmp_path / "b").write_bytes(b"ab\x00cd")
    with pytest.raises(UserError, match=r"binary file \(NUL byte at offset 2\)"):
        read_text(tmp_path / "b")
    (tmp_path / "l1").write_bytes(b"caf\xe9\n")
    with pytest.raises(UserError, match=r"not UTF-8 text \(byte 3\)"):
        read_text(tmp_path / "l1")
    assert read_text(tmp_path / "l1", errors="replace") == "caf\ufffd\n"


def test_size_caps_are_stated_and_enforced(tmp_path):
    from fastverify.inputs import read_bytes

    assert CAPS == {"trace": 2 << 30, "json": 512 << 20, "log": 512 << 20, "text": 16 << 20}
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate((16 << 20) + 1)
    with pytest.raises(UserError, match=r"16\.0 MiB is over the 16\.0 MiB limit for a text input"):
        read_bytes(big)
    assert len(read_bytes(big, kind="log")) == (16 << 20) + 1  # a log may be larger


def test_gzip_of_several_members_reads_as_zcat_reads_it(tmp_path, monkeypatch):
    """``cat a.gz b.gz``: the members' texts one after the other (as Python's gzip reads them);
    zero padding after the last is fine; other bytes after it, or a cut second member, are an
    error naming the file; the inflated-size cap counts every member."""
    import fastverify.inputs as inputs

    text = b'{"traceEvents": [' + b", ".join(b'{"ph": "X", "n": %d}' % i for i in range(2000)) + b"]}"
    cut = len(text) // 3
    two = gzip.compress(text[:cut], mtime=0) + gzip.compress(text[cut:], mtime=0)
    assert inputs.inflate_trace(two, "t.gz") == text == gzip.decompress(two)
    assert inputs.inflate_trace(two + b"\0" * 9, "t.gz") == text
    with pytest.raises(UserError, match=r"^t\.gz: 4 bytes after the end of the gzip data"):
        inputs.inflate_trace(two + b"junk", "t.gz")
    with pytest.raises(UserError, match=r"^t\.gz: truncated or corrupt gzip"):
        inputs.inflate_trace(two[:-5], "t.gz")
    monkeypatch.setattr(inputs, "TRACE_INFLATED_CAP", len(text) - 1)
    with pytest.raises(UserError, match="inflates to over"):
        inputs.inflate_trace(two, "t.gz")


def test_gzip_bomb_is_capped_on_the_inflated_size(tmp_path, monkeypatch):
    import fastverify.inputs as inputs

    monkeypatch.setattr(inputs, "TRACE_INFLATED_CAP", 1 << 20)
    raw = gzip.compress(b"0" * (2 << 20))
    with pytest.raises(UserError, match=r"t\.gz: inflates to over the 1\.0 MiB limit"):
        inputs.inflate_trace(raw, tmp_path / "t.gz")
    assert inputs.inflate_trace(gzip.compress(b"{}"), "x") == b"{}"
    with pytest.raises(UserError, match="truncated or corrupt gzip"):
        inputs.inflate_trace(gzip.compress(b"0" * 5000)[:-12], "x")


OLD_ORJSON = r"""
import orjson

orjson.__version__ = "3.8.3"
def _called(*_a, **_k):
    raise SystemExit("the old orjson was called")
orjson.loads = _called

from fastverify import inputs
from fastverify.errors import UserError

assert "shadows the required >=3.9.15" in inputs.orjson_problem()
try:
    inputs.loads_json(b"[" * 200_000 + b"]" * 200_000, "d.json")
except UserError as err:
    print(err)
assert inputs.loads_json(b'{"a": 1}', "x") == {"a": 1}
"""


def test_an_old_orjson_shadowing_the_pin_is_named_and_never_crashes():
    """orjson 3.8.3 .. 3.9.14 segfault on a 200,000-deep array (measured: fastverify/inputs.py): an
    old copy is named once on stderr and the standard parser, which raises, is used instead. In a
    fresh process, which has named no old orjson yet."""
    proc = subprocess.run(
        [sys.executable, "-c", OLD_ORJSON], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-500:]
    assert proc.stdout.startswith("d.json: JSON nested too deeply"), proc.stdout
    assert proc.stderr.count("orjson 3.8.3") == 1 and "pip install 'orjson>=3.9.15'" in proc.stderr


def test_the_installed_orjson_raises_on_deep_nesting_in_a_subprocess():
    """The real parser on the real 200,000-deep array: exit 2 and one line, not SIGSEGV (-11)."""
    code = (
        "from fastverify.inputs import loads_json\nfrom fastverify.errors import UserError\n"
        "try:\n    loads_json(b'[' * 200000 + b']' * 200000, 'deep.json')\n"
        "except UserError as e:\n    print(e)\n    raise SystemExit(2)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-500:])
    assert proc.stdout.strip().startswith("deep.json: JSON nested too deeply"), proc.stdout


def test_dependency_floors_reject_deep_nesting():
    """pyproject's floors: orjson >= 3.9.15 (first release that raises, measured), msgspec >= 0.18."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {d.split(">=")[0]: tuple(int(x) for x in d.split(">=")[1].split(".")) for d in deps if ">=" in d}
    assert pins["orjson"] >= (3, 9, 15)
    assert pins["msgspec"] >= (0, 18)


# --- item 2: outputs never alias inputs (the six cases) ------------------------------------


def _run(argv, cwd):
    return subprocess.run(
        [sys.executable, "-m", "fastverify", *argv],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _refused(proc, *words):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line
    for w in words:
        assert w in line, (w, line)


def test_profile_output_through_a_symlink_to_the_trace_is_refused(tmp_path):
    (tmp_path / "in.json.gz").write_bytes(GOOD_TRACE.read_bytes())
    (tmp_path / "link.json").symlink_to("in.json.gz")
    before = _files(tmp_path)
    _refused(
        _run(["profile", "--trace", "in.json.gz", "--output", "link.json", "--no-png", "--quiet"], tmp_path),
        "is the input of --trace",
    )
    assert _files(tmp_path) == before


def test_profile_output_on_a_hard_link_of_the_trace_is_refused(tmp_path):
    (tmp_path / "in.json.gz").write_bytes(GOOD_TRACE.read_bytes())
    os.link(tmp_path / "in.json.gz", tmp_path / "same-inode.json")
    before = _files(tmp_path)
    _refused(
        _run(["profile", "--trace", "in.json.gz", "--output", "same-inode.json", "--no-png", "--quiet"], tmp_path),
        "is the input of --trace",
    )
    assert _files(tmp_path) == before


@pytest.mark.parametrize("out_flag", ["--output", "--png"])
def test_profile_output_on_the_second_of_two_traces_is_refused(tmp_path, out_flag):
    raw = gzip.decompress(GOOD_TRACE.read_bytes())
    (tmp_path / "a.json").write_bytes(raw)
    (tmp_path / "b.json").write_bytes(raw)
    before = _files(tmp_path)
    argv = ["profile", "--trace", "a.json", "b.json", "--quiet"]
    argv += ["--output", "b.json", "--no-png"] if out_flag == "--output" else ["--output", "o.json", "--png", "b.json"]
    _refused(_run(argv, tmp_path), out_flag, "b.json", "is the input of --trace")
    assert _files(tmp_path) == before


@pytest.mark.parametrize("target", ["box.env", "link.env"])
def test_tune_write_env_on_the_topology_is_refused(tmp_path, target):
    (tmp_path / "box.env").write_text(TWO_GPU_TOPO)  # a topology that happens to be named .env
    (tmp_path / "link.env").symlink_to("box.env")
    before = _files(tmp_path)
    _refused(
        _run(
            ["tune", "--predict", "--topology", "box.env", "--model", "tiny", "--tp", "2", "--write-env", target],
            tmp_path,
        ),
        "--write-env",
        "is the input of --topology",
    )
    assert _files(tmp_path) == before


# --- item 2: no .bak or temp file is left when a write fails --------------------------------------


def test_a_failed_env_write_leaves_no_bak_and_keeps_an_old_one(tmp_path, monkeypatch):
    """``path`` cannot be replaced (as for ``chattr +i``): before the fix, ``x.env.bak`` was
    already written (or an older one overwritten) when the final replace failed."""
    from fastverify import outputs

    target = tmp_path / "x.env"
    target.write_text("NCCL_P2P_LEVEL=SYS\n")
    (tmp_path / "old.env").write_text("kept\n")
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst) == target:
            raise PermissionError(1, "Operation not permitted")
        return real_replace(src, dst)

    monkeypatch.setattr(outputs.os, "replace", replace)
    with pytest.raises(UserError, match=r"x\.env: cannot write: Operation not permitted"):
        outputs.atomic_write_text(target, "NCCL_P2P_LEVEL=PHB\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.env", "x.env"]  # no .bak, no temp
    assert target.read_text() == "NCCL_P2P_LEVEL=SYS\n"

    (tmp_path / "x.env.bak").write_text("older backup\n")
    with pytest.raises(UserError):
        outputs.atomic_write_text(target, "NCCL_P2P_LEVEL=PHB\n")
    assert (tmp_path / "x.env.bak").read_text() == "older backup\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.env", "x.env", "x.env.bak"]


def test_a_failed_backup_move_puts_the_original_back(tmp_path, monkeypatch):
    from fastverify import outputs

    target = tmp_path / "x.env"
    target.write_text("A=1\n")
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "x.env.bak":
            raise PermissionError(1, "Operation not permitted")
        return real_replace(src, dst)

    monkeypatch.setattr(outputs.os, "replace", replace)
    with pytest.raises(UserError, match="cannot write"):
        outputs.atomic_write_text(target, "A=2\n")
    assert target.read_text() == "A=1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.env"]


def test_tune_write_env_onto_an_immutable_file_exits_2_and_leaves_no_bak(tmp_path):
    """The issue's case with a real ``chattr +i`` (root on a file system that supports it)."""
    target = tmp_path / "box.env"
    target.write_text("NCCL_P2P_LEVEL=SYS\n")
    (tmp_path / "t2.txt").write_text(TWO_GPU_TOPO)
    if subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i not possible here (not root, or the file system has no immutable flag)")
    try:
        proc = _run(
            ["tune", "--predict", "--topology", "t2.txt", "--model", "tiny", "--tp", "2", "--write-env", "box.env"],
            tmp_path,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert not (tmp_path / "box.env.bak").exists()
        assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    finally:
        subprocess.run(["chattr", "-i", str(target)], capture_output=True)
