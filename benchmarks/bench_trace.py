#!/usr/bin/env python3
"""fastverify's trace analyzer against Holistic Trace Analysis (HTA 0.5.0) on the same traces.

For every case (a set of trace files, one per rank) these run as whole child processes, start-up and
imports included, several times, interleaved (the order is reversed on every other repeat):

* HTA:             ``<hta python> -c <runner> ...`` -> ``TraceAnalysis(trace_files=[...])``,
                   ``get_temporal_breakdown()``, ``get_comm_comp_overlap()`` (HTA defaults; the rank of
                   each file comes from HTA's own regex on the file content, as with ``trace_dir``);
* fastverify:      ``<python> -m fastverify profile --trace FILE... --output OUT.json --no-png --quiet``;
* fastverify PNG:  the same without ``--no-png``: the JSON plus the PNG beside it (the default output);
* fastverify ``--jobs 1`` (cases of 2 or more files only): the no-PNG run with the rank files decoded one
                   after the other, against the default (one worker per core when there is enough JSON);
                   ``sequential / parallel`` is the whole-process speed-up of the parallel decode;
* floor:           ``<python> -c <floor runner> FILE...``: reads each file, inflates it with python-isal
                   (``isal.igzip_lib.IgzipDecompressor(DECOMP_GZIP).decompress``) and does one typed
                   msgspec decode of ``traceEvents`` into a small Struct (``ph``, ``cat``, ``name``, ``ts``,
                   ``dur``, ``pid``, ``args`` kept as ``msgspec.Raw``), one file after the other, and prints
                   the event count. That is the least any reader that looks at every event must do
                   (inflate every byte, tokenize every event once, keep the fields an analysis needs);
                   it analyses nothing and writes nothing, so ``fastverify / floor`` says how far the whole
                   tool is from the cost of reading its input, and ``HTA / floor`` the same for HTA.
                   Same launcher and interpreter as fastverify, so start-up and imports count alike.

Each child is started (``posix_spawn``) and reaped (``os.wait4``) by a tiny launcher process, which
reports the child's wall time and own ``rusage``: the peak memory is its ``ru_maxrss`` (on Linux the
maximum over the child and the descendants it waited for, e.g. HTA's multiprocessing workers - not
their sum). The launcher exists because a child's ``ru_maxrss`` starts from the peak RSS of the
process that spawned it; spawned straight from this process (which reads the traces) both tools would
show this process's peak. The median wall time over the repeats is reported, with min and max.

fastverify's JSON from every no-PNG, PNG and ``--jobs 1`` run of a case is compared with the first
no-PNG one, ``created_utc`` left out: ``json identical: yes`` means the PNG and the worker processes
change nothing in the numbers. The machine (nproc, CPU model, memory) and the load average at the
start and the end are recorded; a 1-minute load average above 0.5 at the start is flagged, since the
timings are then not from an idle machine.

Then the numbers both tools compute are printed side by side per rank: HTA's ``idle_time(us)``,
``compute_time(us)``, ``non_compute_time(us)``, ``kernel_time(us)`` and the comm/compute overlap %,
against fastverify's ``ranks[].hta`` block (HTA's formulas, fastverify's parsing and kernel classes).
The timed HTA runs leave ``HTA_DISABLE_NS_ROUNDING`` unset (HTA's default: float ``ts`` rounded,
start up / end down); one extra, untimed HTA run with rounding disabled (and, for traces with
``ProfilerStep#`` markers, one with the last step included) shows which part of each difference comes
from rounding or step filtering; the rest is kernel classification, explained in the notes.

Cases: the real traces under ``../shared/traces`` (``b200-eager``, ``hta-pair``, ``sglang-qwen3``); the
derived ~50 MB ``b200-eager-xN`` (the B200 trace tiled N times by ``make_big_trace.py``) and the derived
2-rank ``b200-rank-pair-xN`` (the same tiling written twice, ``--rank 0`` and ``--rank 1``); the real
53.7 MB HTA test trace ``hta-df-index`` when ``bench_out/df_index_resolver.json.gz`` is present (see
benchmarks/README.md for fetching it); and any ``--trace-case NAME=PATH[,PATH...]``. ``--no-big`` drops
the ~50 MB ones.

Usage (from the repository root, with the project's venv)::

    .venv/bin/python benchmarks/bench_trace.py                  # all cases, 3 repeats
    .venv/bin/python benchmarks/bench_trace.py --cases b200-eager --repeats 5 --json bench_out/r.json
    .venv/bin/python benchmarks/bench_trace.py --no-big --trace-case mine=a.json.gz,b.json.gz

HTA: ``pip install -e '.[bench]'`` puts it in the venv; otherwise the benchmark uses (and on first run
creates) a separate venv ``bench_out/hta-venv`` with ``holistictraceanalysis==0.5.0``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SHARED = REPO.parent / "shared" / "traces"
DEFAULT_OUT = REPO / "bench_out"
HTA_REQUIREMENT = "holistictraceanalysis==0.5.0"
HTA_DIST = "holistictraceanalysis"
HTA_VERSION = "0.5.0"
NS_ROUNDING_ENV = "HTA_DISABLE_NS_ROUNDING"
SPEED_AIM = 10.0  # issue 13: HTA / fastverify on a ~50 MB trace, whole process, without the PNG
SPEED_AIM_PNG = 6.0  # the same with the PNG
PARALLEL_AIM = 1.5  # issue 13: two ~50 MB rank files, --jobs 1 / default, on 2 idle cores
BIG_JSON_BYTES = 40e6  # a case (or each file of a multi-rank case) this large is a "~50 MB" one
IDLE_LOAD = 0.5  # 1-minute load average above this at the start: timings not from an idle machine
HTA_TRACE_NAME = "df_index_resolver.json.gz"
# The 53.7 MB, 216,092-event test trace of HTA (MIT): tests/data/df_index_resolver/ in
# https://github.com/facebookresearch/HolisticTraceAnalysis, git blob of this id.
HTA_TRACE_BLOB = "07019a1e8e6d026c4b834477b5691c2505badc1e"

# (fastverify key in ranks[].hta, HTA column, unit, label)
METRICS = (
    ("kernel_time_us", "kernel_time_us", "us", "kernel_time"),
    ("idle_us", "idle_time_us", "us", "idle"),
    ("compute_us", "compute_time_us", "us", "compute"),
    ("non_compute_us", "non_compute_time_us", "us", "non_compute"),
    ("comm_compute_overlap_pct", "overlap_pct", "%", "comm_comp_overlap"),
)

# The HTA side. Runs in the HTA interpreter; writes one JSON file; prints nothing itself.
HTA_RUNNER = r"""
import json, math, sys
out, include_last, files = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
from hta.trace_analysis import TraceAnalysis
ta = TraceAnalysis(trace_files=files, include_last_profiler_step=include_last)
tb = ta.get_temporal_breakdown(visualize=False)
ov = ta.get_comm_comp_overlap(visualize=False)
def num(x):
    x = float(x)
    return None if math.isnan(x) else x
ranks = {}
for row in tb.to_dict("records"):
    ranks[int(row["rank"])] = {
        "rank": int(row["rank"]),
        "idle_time_us": num(row["idle_time(us)"]),
        "compute_time_us": num(row["compute_time(us)"]),
        "non_compute_time_us": num(row["non_compute_time(us)"]),
        "kernel_time_us": num(row["kernel_time(us)"]),
    }
for row in ov.to_dict("records"):
    r = ranks.setdefault(int(row["rank"]), {"rank": int(row["rank"])})
    r["overlap_pct"] = num(row["comp_comm_overlap_pctg"])  # HTA rounds it to 2 decimals
files_by_rank = {str(k): v for k, v in ta.t.trace_files.items()}
with open(out, "w") as fh:
    json.dump({"ranks": [ranks[k] for k in sorted(ranks)], "files_by_rank": files_by_rank}, fh)
"""

# Spawns one measured child (posix_spawn, so no copy of this small process's memory) and reaps it
# with os.wait4; prints "wall user sys maxrss_kib rc timed_out". Imports only builtin modules.
LAUNCHER = r"""
import os, sys, time, signal
out, err, cwd, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
cmd = sys.argv[5:]
os.chdir(cwd)
fa = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
      (os.POSIX_SPAWN_OPEN, 1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
      (os.POSIX_SPAWN_OPEN, 2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)]
killed = []
t0 = time.perf_counter()
pid = os.posix_spawn(cmd[0], cmd, os.environ, file_actions=fa)
def on_alarm(*_):
    killed.append(1)
    os.kill(pid, signal.SIGKILL)
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, timeout)
while True:
    try:
        _, status, ru = os.wait4(pid, 0)
        break
    except InterruptedError:
        continue
wall = time.perf_counter() - t0
signal.setitimer(signal.ITIMER_REAL, 0)
print(wall, ru.ru_utime, ru.ru_stime, ru.ru_maxrss, os.waitstatus_to_exitcode(status), 1 if killed else 0)
"""

# The floor: inflate + one typed decode of every event; prints the event count. See the module docstring.
FLOOR_RUNNER = r"""
import sys
import msgspec
from isal.igzip_lib import DECOMP_GZIP, IgzipDecompressor

class Event(msgspec.Struct):
    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: float | None = None
    dur: float | None = None
    pid: int | str | None = None
    args: msgspec.Raw = msgspec.Raw()

class Trace(msgspec.Struct):
    traceEvents: list[Event] = []

decode = msgspec.json.Decoder(Trace).decode
n = 0
for path in sys.argv[1:]:
    with open(path, "rb") as fh:
        data = fh.read()
    if path.endswith(".gz"):
        d = IgzipDecompressor(DECOMP_GZIP)
        data = d.decompress(data)
        if not d.eof or d.unused_data:
            sys.exit(f"{path}: not one complete gzip member; the floor reads single-member files only")
    n += len(decode(data).traceEvents)
print(n)
"""

# Times fastverify's loader alone on the files of one case, one worker then the default, alternating;
# prints JSON {"sequential": [s...], "parallel": [s...], "workers": N}. Run in a child so that this
# process's memory and imports do not count.
DECODE_PROBE = r"""
import json, sys, time
from fastverify.trace.load import load_traces, load_workers
from pathlib import Path
repeats, files = int(sys.argv[1]), sys.argv[2:]
out = {"sequential": [], "parallel": [], "workers": load_workers([Path(f) for f in files])}
load_traces(files, workers=1, force=True)  # warm the page cache and the imports
for _ in range(repeats):
    for key, w in (("sequential", 1), ("parallel", None)):
        t = time.perf_counter()
        load_traces(files, workers=w, force=True)
        out[key].append(time.perf_counter() - t)
print(json.dumps(out))
"""

VERSIONS_PROBE = r"""
import json, platform, sys
from importlib import metadata
out = {"python": platform.python_version(), "executable": sys.executable}
for d in sys.argv[1:]:
    try:
        out[d] = metadata.version(d)
    except metadata.PackageNotFoundError:
        out[d] = None
print(json.dumps(out))
"""


class BenchError(Exception):
    """A condition that stops the benchmark with one clear line."""


# --------------------------------------------------------------------------------------------------
# cases and trace facts


@dataclass
class Case:
    name: str
    files: list[Path]
    note: str = ""
    facts: dict[str, Any] = field(default_factory=dict)


def discover_cases(
    shared: Path, out_dir: Path, big: bool, big_copies: int | None, rebuild_big: bool, extra: list[Case] | None = None
) -> tuple[list[Case], list[str]]:
    """The cases whose files exist (building the derived ones when missing), and one line per case
    skipped. ``extra`` (from --trace-case) is appended as given."""
    cases: list[Case] = []
    skipped: list[str] = []
    b200 = shared / "TraceLens" / "eager_trace.json.gz"
    pair = [shared / "HolisticTraceAnalysis" / f"sampled_rank-{r}.json.gz" for r in (0, 1)]
    sgl = shared / "TraceLens" / "sglang_Qwen3-8B_prefilldecode.json.gz"
    for name, files, note in (
        ("b200-eager", [b200], "real vLLM B200 TP8 rank 0 (TraceLens)"),
        ("hta-pair", pair, "real 2-rank pair, A100, NCCL send/recv (HTA test data)"),
        ("sglang-qwen3", [sgl], "real SGLang MI300X 1 rank, graph replay (TraceLens)"),
    ):
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            skipped.append(f"{name}: missing {', '.join(missing)}")
        else:
            cases.append(Case(name, files, note))
    if big:
        if not b200.is_file():
            skipped.append(f"b200-eager-big and b200-rank-pair: their source {b200} is missing")
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import make_big_trace  # noqa: E402  (sibling script)

            copies = big_copies
            if copies is None:
                raw_len = _json_size(b200)
                copies = max(1, round(make_big_trace.DEFAULT_TARGET_MB * 1e6 / raw_len))
            path = out_dir / f"eager_trace_x{copies}.json.gz"
            if rebuild_big or not path.is_file():
                print(f"# building {path} ({copies} tiled copies of {b200.name}) ...", file=sys.stderr)
                make_big_trace.make_big_trace(b200, path, copies=copies)
            cases.append(
                Case(f"b200-eager-x{copies}", [path], f"DERIVED: real b200 trace tiled {copies}x (make_big_trace.py)")
            )
            ranked = [out_dir / f"eager_trace_x{copies}_rank{r}.json.gz" for r in (0, 1)]
            for r, p in enumerate(ranked):
                if rebuild_big or not p.is_file():
                    print(f"# building {p} ({copies} tiled copies of {b200.name}, rank {r}) ...", file=sys.stderr)
                    make_big_trace.make_big_trace(b200, p, copies=copies, rank=r)
            cases.append(
                Case(
                    f"b200-rank-pair-x{copies}",
                    ranked,
                    f"DERIVED: 2 ranks, each the real b200 trace tiled {copies}x, distributedInfo.rank "
                    f"set to 0 and 1 (make_big_trace.py --rank); same events in both",
                )
            )
        # looked for in the work folder, then in the default one (where the README puts it)
        hta_trace = next(
            (d / HTA_TRACE_NAME for d in (out_dir, DEFAULT_OUT) if (d / HTA_TRACE_NAME).is_file()),
            out_dir / HTA_TRACE_NAME,
        )
        if hta_trace.is_file():
            cases.append(
                Case(
                    "hta-df-index",
                    [hta_trace],
                    "real 53.7 MB trace, HTA test data tests/data/df_index_resolver (MIT), rank 1 of 2",
                )
            )
        else:
            skipped.append(f"hta-df-index: {hta_trace} not present (how to fetch it: benchmarks/README.md)")
    cases.extend(extra or [])
    return cases, skipped


def parse_trace_case(spec: str) -> Case:
    """``NAME=PATH[,PATH...]`` -> a Case (one file per rank). Raises BenchError naming the bad part:
    no ``=``, an empty name or list, or a path that is not a file."""
    name, sep, paths = spec.partition("=")
    name = name.strip()
    if not sep or not name or not paths.strip():
        raise BenchError(f"--trace-case {spec!r}: expected NAME=PATH[,PATH...]")
    files = [Path(p.strip()).expanduser() for p in paths.split(",") if p.strip()]
    for f in files:
        if not f.is_file():
            raise BenchError(f"--trace-case {name}: {f} is not a file")
    return Case(name, files, f"given with --trace-case ({len(files)} file(s))")


def _json_size(path: Path) -> int:
    n = 0
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            n += len(chunk)
    return n


def _loads(raw: bytes) -> Any:
    try:
        import orjson  # type: ignore

        return orjson.loads(raw)
    except ImportError:
        return json.loads(raw)
    except Exception:  # orjson rejects integers wider than 64 bits; json does not
        return json.loads(raw)


def trace_facts(path: Path) -> dict[str, Any]:
    """Untimed facts about one trace file, used for the table and for the notes."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    doc = _loads(raw)
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else []
    gpu_cats = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
    float_ts = False
    steps: set[str] = set()
    gpu = nccl = 0
    nccl_us = 0.0
    stray: list[dict[str, Any]] = []  # non-GPU events HTA takes for GPU events (its filter: stream != -1)
    for ev in events:
        if not isinstance(ev, dict):
            continue
        ts = ev.get("ts")
        if isinstance(ts, float) and not float_ts and ts != int(ts):
            float_ts = True
        name = ev.get("name")
        args = ev.get("args")
        if (
            ev.get("ph") == "X"
            and ev.get("cat") not in gpu_cats
            and isinstance(args, dict)
            and isinstance(args.get("stream"), int)
            and args["stream"] != -1
            and "dur" in ev
        ):
            stray.append({"cat": ev.get("cat"), "name": name, "dur_us": float(ev["dur"])})
        if isinstance(name, str):
            if "ProfilerStep" in name:
                steps.add(name)
            if ev.get("cat") in gpu_cats and ev.get("ph") == "X":
                gpu += 1
                if name.startswith("nccl"):  # HTA 0.5.0's COMMUNICATION pattern is ^nccl
                    nccl += 1
                    nccl_us += float(ev.get("dur", 0) or 0)
    m = re.search(rb'"rank":\s+(\d+)', raw)  # the regex HTA uses to find a file's rank
    return {
        "json_bytes": len(raw),
        "events": len(events),
        "float_ts": float_ts,
        "profiler_steps": len(steps),
        "gpu_events": gpu,
        "hta_comm_kernels": nccl,
        "hta_comm_kernel_sum_us": nccl_us,
        "hta_rank_regex": int(m.group(1)) if m else None,
        "hta_stray_gpu_events": stray,
        "trace_name": doc.get("traceName") if isinstance(doc, dict) else None,
    }


# --------------------------------------------------------------------------------------------------
# interpreters


def probe_versions(python: str, dists: list[str]) -> dict[str, Any]:
    res = subprocess.run([python, "-c", VERSIONS_PROBE, *dists], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise BenchError(f"{python}: cannot probe versions: {res.stderr.strip()[-300:]}")
    return json.loads(res.stdout)


def resolve_hta_python(arg: str | None, out_dir: Path, install: bool) -> tuple[str, str]:
    """Return (interpreter, how it was found)."""
    if arg:
        v = probe_versions(arg, [HTA_DIST])
        if v.get(HTA_DIST) is None:
            raise BenchError(f"--hta-python {arg}: {HTA_DIST} is not installed there")
        return arg, "given with --hta-python"
    for cand, how in (
        (sys.executable, "this interpreter (the bench extra)"),
        (str(out_dir / "hta-venv" / "bin" / "python"), "bench_out/hta-venv"),
    ):
        if Path(cand).exists():
            try:
                if probe_versions(cand, [HTA_DIST]).get(HTA_DIST) == HTA_VERSION:
                    return cand, how
            except (BenchError, subprocess.TimeoutExpired):
                pass
    if not install:
        raise BenchError(
            f"HTA is not installed: pip install -e '.[bench]' (or drop --no-install to let "
            f"the benchmark create {out_dir / 'hta-venv'})"
        )
    venv = out_dir / "hta-venv"
    print(
        f"# HTA not found: creating {venv} and installing {HTA_REQUIREMENT} there (first run only) ...", file=sys.stderr
    )
    base = getattr(sys, "_base_executable", sys.executable)
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    res = subprocess.run([py, "-m", "pip", "install", "-q", HTA_REQUIREMENT], capture_output=True, text=True)
    if res.returncode != 0:
        raise BenchError(f"installing {HTA_REQUIREMENT} into {venv} failed: {res.stderr.strip()[-400:]}")
    return py, f"{venv} (created by this run)"


def fastverify_available(python: str) -> str | None:
    """None when `python -m fastverify profile` can run; else why not."""
    res = subprocess.run(
        [python, "-m", "fastverify", "profile", "--help"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    if res.returncode != 0 or "--trace" not in res.stdout:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"`{python} -m fastverify profile --help` failed: {tail[0]}"
    return None


def compile_bytecode(python: str) -> str:
    """Compile fastverify's modules to bytecode before timing, as ``pip install`` does for an
    installed package (and as HTA's venv has them): an editable checkout under
    ``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile every module on every run (about 20 ms)."""
    code = (
        "import compileall, pathlib, fastverify; "
        "print(compileall.compile_dir(pathlib.Path(fastverify.__file__).parent, quiet=1))"
    )
    res = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    ok = res.returncode == 0 and res.stdout.strip() in ("True", "1")
    return "compiled before timing (as pip install does)" if ok else f"not compiled: {res.stderr.strip()[-200:]}"


# --------------------------------------------------------------------------------------------------
# measured child processes


@dataclass
class Run:
    wall_s: float
    user_s: float
    sys_s: float
    maxrss_kib: int
    rc: int
    stderr_path: str
    timed_out: bool = False


def _ext(base: Path, ext: str) -> Path:
    """``base`` with ``ext`` appended (not with_suffix: the run tags such as ``.r0`` must stay)."""
    return base.parent / (base.name + ext)


def run_measured(cmd: list[str], env: dict[str, str], cwd: Path, log_base: Path, timeout: float) -> Run:
    """Run cmd as one child of a tiny launcher; wall clock and rusage (os.wait4) come from the launcher.

    Why a launcher: on Linux a child's ru_maxrss starts from the peak RSS of the process it was
    spawned from (exec keeps the old mm's high-water mark), so spawning the tools from this process,
    which has read the traces for their facts, would put a floor of this process's peak under both
    tools' figures. The launcher stays at ~10 MB; `launcher_floor_mib` in the header shows that floor.
    """
    out_p, err_p = _ext(log_base, ".out"), _ext(log_base, ".err")
    exe = cmd[0] if os.path.isabs(cmd[0]) else (shutil.which(cmd[0]) or cmd[0])
    argv = [
        sys.executable,
        "-I",
        "-S",
        "-c",
        LAUNCHER,
        str(out_p),
        str(err_p),
        str(cwd),
        str(timeout),
        os.path.abspath(exe),
        *cmd[1:],
    ]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout + 60)
    if res.returncode != 0:
        raise BenchError(f"launcher failed for {cmd[0]}: {res.stderr.strip()[-300:]}")
    wall, user, sys_s, maxrss, rc, timed_out = res.stdout.split()
    return Run(float(wall), float(user), float(sys_s), int(maxrss), int(rc), str(err_p), timed_out == "1")


def _err_tail(run: Run, n: int = 3) -> str:
    try:
        lines = Path(run.stderr_path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def hta_cmd(python: str, out_json: Path, files: list[Path], include_last: bool = False) -> list[str]:
    return [python, "-c", HTA_RUNNER, str(out_json), "1" if include_last else "0", *[str(f.resolve()) for f in files]]


def fv_cmd(python: str, out_json: Path, files: list[Path], png: bool = False, jobs: int | None = None) -> list[str]:
    """fastverify's command line: --no-png unless png (then the PNG goes beside out_json);
    --jobs only when given (None = fastverify's default)."""
    cmd = [
        python,
        "-m",
        "fastverify",
        "profile",
        "--trace",
        *[str(f.resolve()) for f in files],
        "--output",
        str(out_json),
        "--quiet",
    ]
    if not png:
        cmd.append("--no-png")
    if jobs is not None:
        cmd += ["--jobs", str(jobs)]
    return cmd


def floor_cmd(python: str, files: list[Path]) -> list[str]:
    return [python, "-c", FLOOR_RUNNER, *[str(f.resolve()) for f in files]]


def same_json(a: Path, b: Path, ignore: tuple[str, ...] = ("created_utc",)) -> list[str]:
    """Top-level keys whose values differ between two JSON files, ``ignore`` left out ([] = same)."""
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    return sorted(k for k in set(da) | set(db) if k not in ignore and da.get(k, ...) != db.get(k, ...))


def hta_env(ns_rounding: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(NS_ROUNDING_ENV, None)
    if not ns_rounding:
        env[NS_ROUNDING_ENV] = "1"
    return env


def read_hta(path: Path) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    doc = json.loads(path.read_text())
    return {int(r["rank"]): r for r in doc["ranks"]}, {int(k): v for k, v in doc["files_by_rank"].items()}


def read_fv(path: Path) -> dict[int, dict[str, Any]]:
    doc = json.loads(path.read_text())
    return {int(r["rank"]): r for r in doc["ranks"]}


# --------------------------------------------------------------------------------------------------
# the benchmark


def median_run(runs: list[Run]) -> dict[str, Any]:
    walls = [r.wall_s for r in runs]
    return {
        "wall_s_median": statistics.median(walls),
        "wall_s_min": min(walls),
        "wall_s_max": max(walls),
        "user_s_median": statistics.median(r.user_s for r in runs),
        "sys_s_median": statistics.median(r.sys_s for r in runs),
        "maxrss_mib_median": statistics.median(r.maxrss_kib for r in runs) / 1024.0,
        "maxrss_mib_max": max(r.maxrss_kib for r in runs) / 1024.0,
        "runs": [r.__dict__ for r in runs],
    }


# (key in the record, label in the table)
TOOLS = (
    ("hta", "HTA"),
    ("fastverify", "fv no-PNG"),
    ("fastverify_png", "fv PNG"),
    ("fastverify_jobs1", "fv --jobs 1"),
    ("floor", "floor"),
)


def bench_case(
    case: Case,
    hta_py: str,
    fv_py: str | None,
    repeats: int,
    warmup: int,
    log_dir: Path,
    timeout: float,
    extra_hta: bool,
    floor_py: str | None = None,
) -> dict[str, Any]:
    """Time every tool on one case (interleaved repeats after the warm-ups) and gather the numbers.

    Returns the case's record: per tool a median_run() dict; ratios (HTA / fastverify and the floor's);
    ``json_identical`` (bool or None) with ``json_differences``; the shared numbers; ``errors`` (list of
    one-line strings, empty when all went well). A failed HTA or fastverify run ends the case (its
    timings so far are dropped); a failed floor run only drops the floor.
    """
    rec: dict[str, Any] = {
        "case": case.name,
        "note": case.note,
        "files": [str(f) for f in case.files],
        "facts": case.facts,
        "errors": [],
    }
    order = ["hta"]
    if fv_py:
        order += ["fastverify", "fastverify_png"]
        if len(case.files) >= 2:
            order.append("fastverify_jobs1")
    if floor_py:
        order.append("floor")
    tools: dict[str, list[Run]] = {t: [] for t in order}
    outputs: dict[str, list[Path]] = {t: [] for t in order}
    pngs: list[Path] = []
    env_hta, env_fv = hta_env(ns_rounding=True), dict(os.environ)

    def one(tool: str, tag: str) -> Run:
        base = log_dir / f"{case.name}.{tool}.{tag}"
        if tool == "hta":
            out = _ext(base, ".result.json")
            run = run_measured(hta_cmd(hta_py, out, case.files), env_hta, log_dir, base, timeout)
        elif tool == "floor":
            out = _ext(base, ".out")
            run = run_measured(floor_cmd(floor_py, case.files), env_fv, REPO, base, timeout)
        else:
            out = _ext(base, ".profile.json")
            for stale in (out, out.with_suffix(".png")):
                stale.unlink(missing_ok=True)
            run = run_measured(
                fv_cmd(
                    fv_py, out, case.files, png=tool == "fastverify_png", jobs=1 if tool == "fastverify_jobs1" else None
                ),
                env_fv,
                REPO,
                base,
                timeout,
            )
        if run.rc != 0 or not out.is_file():
            why = "timed out" if run.timed_out else f"exit {run.rc}"
            raise BenchError(f"{case.name}: {tool} run {tag} failed ({why}): {_err_tail(run)}")
        if tool == "fastverify_png":
            png = out.with_suffix(".png")
            if not png.is_file() or png.stat().st_size == 0:
                raise BenchError(f"{case.name}: fastverify run {tag} with the PNG wrote no {png.name}")
            if tag.startswith("r"):
                pngs.append(png)
        if tool == "floor":
            got = out.read_text().strip()
            want = case.facts.get("events")
            if want is not None and got != str(want):
                raise BenchError(f"{case.name}: floor run {tag} decoded {got} events, the trace has {want}")
        if tag.startswith("r"):
            outputs[tool].append(out)
        return run

    def attempt(tool: str, tag: str) -> Run | None:
        """One run; a floor failure drops the floor (recorded), any other failure propagates."""
        try:
            return one(tool, tag)
        except BenchError as exc:
            if tool != "floor":
                raise
            rec["errors"].append(str(exc))
            order.remove("floor")
            tools.pop("floor", None)
            return None

    try:
        for w in range(warmup):
            for tool in list(order):
                attempt(tool, f"w{w}")
        for i in range(repeats):
            for tool in list(order) if i % 2 == 0 else order[::-1]:  # alternate who goes first
                run = attempt(tool, f"r{i}")
                if run is not None:
                    tools[tool].append(run)
    except BenchError as exc:
        rec["errors"].append(str(exc))
        return rec

    rec["hta"] = median_run(tools["hta"])
    hta_ranks, hta_files = read_hta(outputs["hta"][0])
    rec["hta_files_by_rank"] = {str(k): v for k, v in hta_files.items()}
    if len(hta_files) < len(case.files):
        rec["errors"].append(
            f"{case.name}: HTA mapped {len(case.files)} files onto {len(hta_files)} "
            f"rank(s) (its rank regex found duplicates); numbers cover fewer ranks"
        )
    # Repeats must agree (both tools are deterministic); a mismatch would be a bug worth seeing.
    for out in outputs["hta"][1:]:
        if read_hta(out)[0] != hta_ranks:
            rec["errors"].append(f"{case.name}: HTA numbers differ between repeats")
            break
    fv_ranks: dict[int, dict[str, Any]] = {}
    if fv_py:
        rec["fastverify"] = median_run(tools["fastverify"])
        fv_ranks = read_fv(outputs["fastverify"][0])
        for out in outputs["fastverify"][1:]:
            if {k: v.get("hta") for k, v in read_fv(out).items()} != {k: v.get("hta") for k, v in fv_ranks.items()}:
                rec["errors"].append(f"{case.name}: fastverify numbers differ between repeats")
                break
        rec["fastverify_png"] = median_run(tools["fastverify_png"])
        if "fastverify_jobs1" in tools:
            rec["fastverify_jobs1"] = median_run(tools["fastverify_jobs1"])
        hta_w, fv_w = rec["hta"]["wall_s_median"], rec["fastverify"]["wall_s_median"]
        fvp_w = rec["fastverify_png"]["wall_s_median"]
        rec["ratio_speed"] = hta_w / fv_w
        rec["ratio_speed_png"] = hta_w / fvp_w
        rec["ratio_memory"] = rec["hta"]["maxrss_mib_median"] / rec["fastverify"]["maxrss_mib_median"]
        if "fastverify_jobs1" in rec:
            rec["parallel_speedup"] = rec["fastverify_jobs1"]["wall_s_median"] / fv_w
            dec = decode_probe(fv_py, case.files, repeats)
            if dec is None:
                rec["errors"].append(f"{case.name}: the decode-only probe failed")
            else:
                rec["decode"] = dec
                rec["decode_speedup"] = statistics.median(dec["sequential"]) / statistics.median(dec["parallel"])
        # Same numbers with and without the PNG (and with --jobs 1): every run's JSON against the first.
        ref = outputs["fastverify"][0]
        diffs: dict[str, list[str]] = {}
        for tool in ("fastverify", "fastverify_png", "fastverify_jobs1"):
            for out in outputs.get(tool, []):
                d = same_json(ref, out)
                if d:
                    diffs[out.name] = d
        rec["json_identical"] = not diffs
        rec["json_compared"] = sum(
            len(outputs.get(t, [])) for t in ("fastverify", "fastverify_png", "fastverify_jobs1")
        )
        rec["json_differences"] = diffs
        if diffs:
            rec["errors"].append(
                f"{case.name}: fastverify's JSON differs between runs (created_utc left out): "
                + "; ".join(f"{n}: {', '.join(k)}" for n, k in sorted(diffs.items())[:3])
            )
        rec["png_bytes"] = pngs[0].stat().st_size if pngs else None
    if tools.get("floor"):
        rec["floor"] = median_run(tools["floor"])
        fl = rec["floor"]["wall_s_median"]
        rec["hta_over_floor"] = rec["hta"]["wall_s_median"] / fl
        if fv_py:
            rec["fastverify_over_floor"] = rec["fastverify"]["wall_s_median"] / fl
            rec["fastverify_png_over_floor"] = rec["fastverify_png"]["wall_s_median"] / fl

    # Untimed HTA variants that isolate rounding and step filtering.
    variants: dict[str, dict[int, dict[str, Any]]] = {}
    if extra_hta:
        specs = []
        if case.facts.get("float_ts"):
            specs.append(("hta_noround", False, False))
        if case.facts.get("profiler_steps", 0) >= 2:
            specs.append(("hta_noround_last", False, True))
        for key, rounding, last in specs:
            base = log_dir / f"{case.name}.{key}"
            out = _ext(base, ".result.json")
            run = run_measured(
                hta_cmd(hta_py, out, case.files, include_last=last), hta_env(rounding), log_dir, base, timeout
            )
            if run.rc != 0 or not out.is_file():
                rec["errors"].append(f"{case.name}: HTA variant {key} failed: {_err_tail(run)}")
                continue
            variants[key] = read_hta(out)[0]

    rows = []
    for rank in sorted(set(hta_ranks) | set(fv_ranks)):
        h = hta_ranks.get(rank, {})
        f = (fv_ranks.get(rank) or {}).get("hta") or {}
        for fv_key, hta_key, unit, label in METRICS:
            row = {
                "rank": rank,
                "metric": label,
                "unit": unit,
                "hta": h.get(hta_key),
                "fastverify": f.get(fv_key) if fv_py else None,
            }
            for key, vr in variants.items():
                row[key] = vr.get(rank, {}).get(hta_key)
            rows.append(row)
    rec["numbers"] = rows
    rec["fastverify_classes"] = {
        str(rank): {
            k: r.get(k)
            for k in (
                "counts",
                "allreduce_us",
                "allreduce_count",
                "fused_allreduce_us",
                "other_comm_us",
                "unknown_comm_us",
                "memory_us",
                "compute_us",
                "window_us",
                "steps",
            )
            if k in r and k != "steps"
        }
        | {"steps": len(r.get("steps") or [])}
        for rank, r in fv_ranks.items()
    }
    # HTA prints this warning when it rounds float timestamps.
    rec["hta_rounded_ts"] = "Rounding down ns resolution" in Path(tools["hta"][0].stderr_path).read_text(
        errors="replace"
    )
    return rec


# --------------------------------------------------------------------------------------------------
# output


def _fmt(v: Any, unit: str = "us") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return f"{v:,.3f}" if unit == "us" else f"{v:.3f}"


def _diff(a: Any, b: Any) -> str:
    if a is None or b is None:
        return "n/a"
    return f"{a - b:+,.3f}"


def _pct(a: Any, b: Any) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{100.0 * (a - b) / b:+.2f}"


def explain(rec: dict[str, Any]) -> list[str]:
    """Plain-language reasons for the differences in one case's numbers."""
    notes: list[str] = []
    facts = rec.get("facts", {})
    rows = rec.get("numbers", [])
    if rec.get("hta_rounded_ts"):
        notes.append(
            "HTA rounded the float (ns) timestamps of this trace (ts up, ts+dur down, "
            "pytorch#122425 workaround); each GPU event loses up to 1 us, so HTA's compute, "
            "kernel and busy times are low and its idle high. fastverify keeps ns. "
            "Column HTA-noround = HTA with HTA_DISABLE_NS_ROUNDING=1."
        )
    elif not facts.get("float_ts"):
        notes.append("integer-us timestamps: HTA's ns rounding does not apply here.")
    if facts.get("profiler_steps", 0) >= 2:
        kt = [r for r in rows if r["metric"] == "kernel_time"]
        detail = ", ".join(
            f"rank {r['rank']}: HTA {_fmt(r['hta'])} vs fastverify {_fmt(r['fastverify'])} us" for r in kt
        )
        notes.append(
            f"{facts['profiler_steps']} ProfilerStep markers: HTA keeps only GPU kernels launched "
            f"before the last step (include_last_profiler_step=False) and drops kernels whose "
            f"CPU launch is outside the steps; fastverify's hta block covers the whole trace "
            f"window ({detail}). Column HTA-nr+last = no rounding and last step included."
        )
    for rank, pf in sorted(facts.get("per_file", {}).items()):
        stray = pf.get("hta_stray_gpu_events") or []
        if stray:
            ex = "; ".join(f"{e['cat']} {str(e['name'])[:60]} ({e['dur_us']:,.3f} us)" for e in stray[:3])
            notes.append(
                f"rank {rank}: HTA takes every event whose args carry a stream (stream != -1) for a GPU event, so "
                f"{len(stray)} CPU-side event(s) enter its GPU time, as compute: {ex}. fastverify uses only "
                f"kernel/memcpy/memset events; this moves up to that duration from HTA's compute to idle."
            )
    if any(r["metric"] == "comm_comp_overlap" and r["hta"] not in (None, 0.0) for r in rows):
        notes.append("HTA returns the overlap % rounded to 2 decimals (comp_comm_overlap_pctg); fastverify gives 3.")
    per_file = facts.get("per_file", {})
    for rank, cls in (rec.get("fastverify_classes") or {}).items():
        counts = cls.get("counts") or {}
        ours = sum(counts.get(k, 0) for k in ("allreduce", "fused_allreduce", "other_comm", "unknown_comm"))
        pf = per_file.get(rank, facts)
        hc, hus = pf.get("hta_comm_kernels", 0), pf.get("hta_comm_kernel_sum_us", 0.0)
        if ours != hc:
            notes.append(
                f"rank {rank}: kernel classes differ: HTA 0.5.0 counts as communication only names "
                f"matching ^nccl ({hc} kernels, {hus:,.1f} us summed); fastverify counts {ours} comm "
                f"kernels (all-reduce {counts.get('allreduce', 0)}: {cls.get('allreduce_us') or 0:,.1f} us, "
                f"other comm {counts.get('other_comm', 0)}: {cls.get('other_comm_us') or 0:,.1f} us, fused "
                f"{counts.get('fused_allreduce', 0)}, unknown {counts.get('unknown_comm', 0)}). Kernels HTA "
                f"calls compute and fastverify calls comm move from compute to non_compute, and the "
                f"comm/compute overlap changes with them."
            )
        else:
            notes.append(f"rank {rank}: both tools count {hc} communication kernels.")
    return notes


def _x(v: float | None, nd: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{nd}f}×"


def is_big(rec: dict[str, Any]) -> bool:
    """A ~50 MB case: at least BIG_JSON_BYTES of JSON (in all)."""
    return rec.get("facts", {}).get("json_bytes", 0) >= BIG_JSON_BYTES


def big_files(rec: dict[str, Any]) -> bool:
    """Every rank file of the case is a ~50 MB one (the parallel-decode aim is set for those)."""
    pf = rec.get("facts", {}).get("per_file", {})
    return bool(pf) and all(p.get("json_bytes", 0) >= BIG_JSON_BYTES for p in pf.values())


def summary_lines(rec: dict[str, Any]) -> list[str]:
    """The end-of-report lines of one case: speed against HTA and the floor, the aims, json identity,
    the parallel decode for multi-file cases. The first line is the `speed:` line."""
    if "ratio_speed" not in rec:
        return [f"speed: n/a ({'; '.join(rec.get('errors') or ['not measured'])[:200]})"]
    fv, fvp = rec["fastverify"]["wall_s_median"], rec["fastverify_png"]["wall_s_median"]
    fl = rec.get("floor", {}).get("wall_s_median")
    floor_part = (
        f"floor / fastverify = {fl / fv:.2f} (no PNG), {fl / fvp:.2f} (PNG)"
        if fl
        else "floor / fastverify = n/a (no floor run)"
    )
    ok = rec["ratio_speed"] >= SPEED_AIM and rec["ratio_speed_png"] >= SPEED_AIM_PNG
    if is_big(rec):
        aim = "met" if ok else "MISSED"
    else:
        aim = (
            f"{'met' if ok else 'MISSED'} (the aim is set for ~50 MB; this case has "
            f"{rec['facts'].get('json_bytes', 0) / 1e6:.1f} MB)"
        )
    out = [
        (
            f"speed: HTA / fastverify = {_x(rec['ratio_speed'])} (no PNG), {_x(rec['ratio_speed_png'])} (PNG); "
            f"{floor_part}; aim {SPEED_AIM:.0f}× / {SPEED_AIM_PNG:.0f}×: {aim}"
        )
    ]
    out.append(
        f"walls: HTA {rec['hta']['wall_s_median']:.3f} s, fastverify {fv:.3f} s (no PNG), {fvp:.3f} s (PNG)"
        + (
            f", fastverify --jobs 1 {rec['fastverify_jobs1']['wall_s_median']:.3f} s"
            if "fastverify_jobs1" in rec
            else ""
        )
        + (f", floor {fl:.3f} s" if fl else "")
    )
    if fl:
        out.append(
            f"from the floor: fastverify / floor = {_x(rec['fastverify_over_floor'])} (no PNG), "
            f"{_x(rec['fastverify_png_over_floor'])} (PNG); HTA / floor = {_x(rec['hta_over_floor'])}"
        )
    out.append(f"peak memory: HTA / fastverify = {_x(rec['ratio_memory'])}")
    out.append(
        f"json identical: {'yes' if rec.get('json_identical') else 'no'} "
        f"({rec.get('json_compared', 0)} fastverify JSONs, no-PNG / PNG"
        f"{' / --jobs 1' if 'fastverify_jobs1' in rec else ''}, created_utc left out)"
    )
    if "parallel_speedup" in rec:
        ps = rec["parallel_speedup"]
        verdict = (
            ("met" if ps >= PARALLEL_AIM else "MISSED")
            if big_files(rec)
            else "n/a: the aim is set for ~50 MB rank files"
        )
        out.append(
            f"parallel, whole process: sequential / parallel = {_x(ps, 2)} "
            f"(fastverify --jobs 1 vs default, no PNG, start-up and analysis included, {len(rec['files'])} files)"
        )
    if "decode_speedup" in rec:
        ds = rec["decode_speedup"]
        verdict = (
            ("met" if ds >= PARALLEL_AIM else "MISSED")
            if big_files(rec)
            else "n/a: the aim is set for ~50 MB rank files"
        )
        d = rec["decode"]
        out.append(
            f"parallel decode: sequential / parallel = {_x(ds, 2)} (aim {PARALLEL_AIM}×): {verdict} "
            f"(load_traces alone, {statistics.median(d['sequential']):.3f} s one worker vs "
            f"{statistics.median(d['parallel']):.3f} s with {d['workers']}, median of {len(d['parallel'])})"
        )
    return out


def decode_probe(python: str, files: list[Path], repeats: int) -> dict | None:
    """:data:`DECODE_PROBE` in a child: fastverify's loader alone, sequential vs parallel (s)."""
    res = subprocess.run(
        [python, "-c", DECODE_PROBE, str(max(1, repeats)), *map(str, files)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    if res.returncode != 0:
        return None
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def render(meta: dict[str, Any], recs: list[dict[str, Any]], skipped: list[str]) -> str:
    L: list[str] = []
    add = L.append
    add("# fastverify trace benchmark: fastverify profile vs Holistic Trace Analysis, whole processes")
    add(f"# date {meta['date']}  host {meta['host']}")
    add(f"# machine: nproc {meta['nproc']}, cpu {meta['cpu']}, memory {meta['mem_gib']:.1f} GiB")
    la0, la1 = meta.get("loadavg_start"), meta.get("loadavg_end")
    if la0:
        add(
            f"# load average (1/5/15 min): at start {la0[0]:.2f} {la0[1]:.2f} {la0[2]:.2f}"
            + (f", at end {la1[0]:.2f} {la1[1]:.2f} {la1[2]:.2f}" if la1 else "")
        )
        if la0[0] > IDLE_LOAD:
            add(
                f"# WARNING: 1-minute load average {la0[0]:.2f} > {IDLE_LOAD} at the start: the machine was not idle "
                f"(shared); the timings are slower and noisier than on an idle machine"
            )
    fl = meta.get("floor_env") or {}
    if meta.get("floor_missing"):
        add(f"# floor: NOT RUN ({meta['floor_missing']})")
    elif fl:
        add(f"# floor: isal {fl.get('isal')}  msgspec {fl.get('msgspec')}  python {fl.get('python')}")
    fv = meta.get("fastverify_env") or {}
    if fv:
        add(
            f"# fastverify {fv.get('fastverify')}  python {fv.get('python')} ({fv.get('executable')})  "
            f"numpy {fv.get('numpy')}  orjson {fv.get('orjson')}  msgspec {fv.get('msgspec')}  "
            f"matplotlib {fv.get('matplotlib')}; --jobs default (one per core above 16 MiB of JSON in all; one "
            f"file of 16 MiB or more read in two halves at once without the PNG); bytecode "
            f"{meta.get('fastverify_bytecode', 'as found')}"
        )
    else:
        add(f"# fastverify: NOT RUN ({meta.get('fastverify_missing')})")
    h = meta["hta_env"]
    add(
        f"# HTA {HTA_DIST} {h.get(HTA_DIST)}  python {h.get('python')} ({h.get('executable')}; "
        f"{meta['hta_how']})  pandas {h.get('pandas')}  numpy {h.get('numpy')}"
    )
    add(
        f"# HTA timed runs: {NS_ROUNDING_ENV} unset (default: float ts rounded); "
        f"include_last_profiler_step=False (default); ranks from HTA's own file regex"
    )
    add(
        f"# repeats {meta['repeats']} per tool (median), {meta['warmup']} untimed warm-up each, runs interleaved; "
        f"wall = spawn to reap (start-up, imports, parse, analysis, output file); "
        f"peak memory = ru_maxrss of the child via os.wait4"
    )
    add(
        f"# children are spawned by a small launcher: a do-nothing child measures "
        f"{meta['launcher_floor_mib']:.1f} MB (the launcher's floor under every maxrss); a bare `python -c pass` "
        f"{meta['python_bare_mib']:.1f} MB, {meta['python_bare_wall_s']:.3f} s"
    )
    for s in skipped:
        add(f"# skipped case {s}")
    add("#")
    hdr = ("case", "files", "json", "events", "tool", "wall", "min", "max", "user", "sys", "maxrss")
    units = ("", "", "(MB)", "", "", "(s)", "(s)", "(s)", "(s)", "(s)", "(MB)")
    widths = (20, 5, 7, 9, 11, 8, 8, 8, 8, 7, 8)

    def line(cells: tuple, lead: str = " ") -> str:
        out = [f"{cells[0]:>{widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:])]
        return lead + "  ".join(out)

    add(line(hdr, "#"))
    add(line(units, "#"))
    for rec in recs:
        f = rec.get("facts", {})
        lead = (rec["case"], len(rec["files"]), f"{f.get('json_bytes', 0) / 1e6:.1f}", f"{f.get('events', 0):,}")
        for tool, label in TOOLS:
            m = rec.get(tool)
            if not m:
                if tool in ("hta", "fastverify"):
                    add(line(lead + (label,) + ("n/a",) * 6))
                continue
            add(
                line(
                    lead
                    + (
                        label,
                        f"{m['wall_s_median']:.3f}",
                        f"{m['wall_s_min']:.3f}",
                        f"{m['wall_s_max']:.3f}",
                        f"{m['user_s_median']:.2f}",
                        f"{m['sys_s_median']:.2f}",
                        f"{m['maxrss_mib_median']:.1f}",
                    )
                )
            )
    add("#")
    add("# shared numbers per rank: HTA get_temporal_breakdown()/get_comm_comp_overlap() vs fastverify ranks[].hta")
    add(
        "# (diff = fastverify - HTA; HTA-noround: untimed HTA run with HTA_DISABLE_NS_ROUNDING=1; "
        "HTA-nr+last: also include_last_profiler_step=True;"
        " diff-vs-like = fastverify - the most like-for-like of those)"
    )
    nh = (
        "case",
        "rank",
        "metric",
        "unit",
        "HTA",
        "HTA-noround",
        "HTA-nr+last",
        "fastverify",
        "diff",
        "diff%",
        "diff-vs-like",
    )
    nw = (18, 4, 17, 4, 14, 14, 14, 14, 12, 8, 15)
    add("#" + "  ".join(f"{c:>{w}}" for c, w in zip(nh, nw)))
    add(
        "#"
        + "  ".join(
            f"{c:>{w}}"
            for c, w in zip(("", "", "", "", "(us|%)", "(us|%)", "(us|%)", "(us|%)", "(us|%)", "(%)", "(us|%)"), nw)
        )
    )
    for rec in recs:
        for r in rec.get("numbers", []):
            u = r["unit"]
            nr = r.get("hta_noround")
            # the most like-for-like HTA figure: no rounding, and the last step kept when it matters
            like = r.get("hta_noround_last")
            if like is None:
                like = nr if nr is not None else (r["hta"] if not rec.get("hta_rounded_ts") else None)
            cells = (
                rec["case"],
                r["rank"],
                r["metric"],
                u,
                _fmt(r["hta"], u),
                _fmt(nr, u),
                _fmt(r.get("hta_noround_last"), u),
                _fmt(r["fastverify"], u),
                _diff(r["fastverify"], r["hta"]),
                _pct(r["fastverify"], r["hta"]),
                _diff(r["fastverify"], like),
            )
            add(" " + "  ".join(f"{str(c):>{w}}" for c, w in zip(cells, nw)))
    add("#")
    add(
        "# summary (walls: medians, whole process; floor = isal gunzip + one typed msgspec decode of every "
        "event, one file after the other)"
    )
    for rec in recs:
        add(f"# {rec['case']:<20} " + " ".join(summary_lines(rec)[0:1]))
        for extra in summary_lines(rec)[1:]:
            add(f"# {'':<20} {extra}")
    add("#")
    for rec in recs:
        add(f"# notes on {rec['case']} ({rec.get('note', '')}):")
        for e in rec.get("errors", []):
            add(f"#   ERROR: {e}")
        for n in explain(rec):
            add(f"#   - {n}")
    return "\n".join(L) + "\n"


def machine_meta() -> dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0.0
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemTotal:"):
                mem = int(ln.split()[1]) / 1024 / 1024
    except OSError:
        pass
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": f"{platform.system()} {platform.release()} {platform.machine()}",
        "nproc": nproc,
        "cpu": cpu,
        "mem_gib": mem,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="fastverify profile vs HTA 0.5.0 on the same traces: "
        "whole-process wall time, peak memory, shared numbers."
    )
    ap.add_argument(
        "--shared",
        type=Path,
        default=DEFAULT_SHARED,
        help="folder of the real traces (default: ../shared/traces from the repo root)",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="work folder (default: bench_out/)")
    ap.add_argument(
        "--cases",
        default=None,
        help="comma-separated case names (b200-eager, hta-pair, sglang-qwen3, b200-eager-xN, "
        "b200-rank-pair-xN, hta-df-index, and those of --trace-case)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per tool and case (median shown)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per tool and case first")
    ap.add_argument(
        "--no-big", action="store_true", help="skip the ~50 MB cases (b200-eager-xN, b200-rank-pair-xN, hta-df-index)"
    )
    ap.add_argument(
        "--trace-case",
        action="append",
        default=[],
        metavar="NAME=PATH[,PATH...]",
        help="one more case: these trace files, one per rank (repeatable)",
    )
    ap.add_argument(
        "--big-copies",
        type=int,
        default=None,
        help="tiles of the b200 trace in the big case (default: nearest to 50 MB)",
    )
    ap.add_argument("--rebuild-big", action="store_true", help="rebuild the derived traces even if present")
    ap.add_argument(
        "--no-extra-hta", action="store_true", help="skip the untimed HTA runs without rounding / with the last step"
    )
    ap.add_argument("--hta-python", default=None, help="interpreter that has holistictraceanalysis 0.5.0")
    ap.add_argument(
        "--fastverify-python", default=sys.executable, help="interpreter that has fastverify (default: this one)"
    )
    ap.add_argument(
        "--no-install", action="store_true", help="never create bench_out/hta-venv; fail if HTA is not installed"
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child process")
    ap.add_argument("--json", type=Path, default=None, help="also write the records as JSON here")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    load_start = os.getloadavg()
    if load_start[0] > IDLE_LOAD:
        print(
            f"# WARNING: 1-minute load average {load_start[0]:.2f} > {IDLE_LOAD}: the machine is not idle, "
            f"timings will be slower and noisier",
            file=sys.stderr,
        )

    out_dir = args.out.resolve()
    log_dir = out_dir / "logs"
    try:
        extra = [parse_trace_case(spec) for spec in args.trace_case]
        names = [c.name for c in extra]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise BenchError(f"--trace-case: name {dup[0]} given twice")
        log_dir.mkdir(parents=True, exist_ok=True)
        shared_skip = [] if args.shared.is_dir() else [f"shared traces: not found at {args.shared} (pass --shared DIR)"]
        cases, skipped = discover_cases(args.shared, out_dir, not args.no_big, args.big_copies, args.rebuild_big)
        clash = sorted({c.name for c in cases} & set(names))
        if clash:
            raise BenchError(f"--trace-case: name {clash[0]} is a built-in case; pick another")
        cases += extra
        skipped = shared_skip + skipped
    except (BenchError, OSError, ValueError) as exc:
        print(f"bench_trace: {exc}", file=sys.stderr)
        return 2
    if args.cases:
        want = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = [w for w in want if w not in {c.name for c in cases}]
        if unknown:
            print(
                f"bench_trace: unknown or unavailable case(s): {', '.join(unknown)}; available: "
                f"{', '.join(c.name for c in cases)}",
                file=sys.stderr,
            )
            return 2
        cases = [c for c in cases if c.name in want]
    if not cases:
        print(f"# SKIPPED: no trace case available: {'; '.join(skipped)}")
        return 0
    try:
        hta_py, hta_how = resolve_hta_python(args.hta_python, out_dir, not args.no_install)
    except BenchError as exc:
        print(f"bench_trace: {exc}", file=sys.stderr)
        return 2

    meta = machine_meta()
    meta.update(
        repeats=args.repeats,
        warmup=args.warmup,
        hta_how=hta_how,
        loadavg_start=list(load_start),
        hta_env=probe_versions(hta_py, [HTA_DIST, "pandas", "numpy"]),
    )
    fv_py: str | None = args.fastverify_python
    missing = fastverify_available(fv_py)
    if missing:
        meta["fastverify_missing"] = missing
        fv_py = None
        print(f"# fastverify side not run: {missing}", file=sys.stderr)
    else:
        meta["fastverify_env"] = probe_versions(fv_py, ["fastverify", "numpy", "orjson", "msgspec", "matplotlib"])
        meta["fastverify_bytecode"] = compile_bytecode(fv_py)
    floor_py: str | None = args.fastverify_python
    meta["floor_env"] = probe_versions(floor_py, ["isal", "msgspec"])
    lacking = [d for d in ("isal", "msgspec") if meta["floor_env"].get(d) is None]
    if lacking:
        meta["floor_missing"] = f"{floor_py} lacks {', '.join(lacking)} (pip install isal msgspec)"
        floor_py = None
        print(f"# floor not run: {meta['floor_missing']}", file=sys.stderr)

    # What a do-nothing child measures through the launcher: the floor under every figure.
    calib = [("launcher_floor", ["/bin/true"]), ("python_bare", [fv_py or sys.executable, "-c", "pass"])]
    for key, cmd in calib:
        r = run_measured(cmd, dict(os.environ), out_dir, log_dir / f"calibrate.{key}", 60)
        meta[f"{key}_mib"] = r.maxrss_kib / 1024.0
        meta[f"{key}_wall_s"] = r.wall_s

    recs = []
    for case in cases:
        per_file = [trace_facts(f) for f in case.files]
        case.facts = {
            "json_bytes": sum(p["json_bytes"] for p in per_file),
            "events": sum(p["events"] for p in per_file),
            "float_ts": any(p["float_ts"] for p in per_file),
            "profiler_steps": max(p["profiler_steps"] for p in per_file),
            "hta_comm_kernels": sum(p["hta_comm_kernels"] for p in per_file),
            "hta_comm_kernel_sum_us": sum(p["hta_comm_kernel_sum_us"] for p in per_file),
            "hta_stray_gpu_events": [e for p in per_file for e in p["hta_stray_gpu_events"]],
            "per_file": {str(p["hta_rank_regex"]): p for p in per_file},
        }
        print(
            f"# running {case.name} ({len(case.files)} file(s), {case.facts['json_bytes'] / 1e6:.1f} MB JSON) ...",
            file=sys.stderr,
        )
        recs.append(
            bench_case(
                case, hta_py, fv_py, args.repeats, args.warmup, log_dir, args.timeout, not args.no_extra_hta, floor_py
            )
        )
    meta["loadavg_end"] = list(os.getloadavg())
    text = render(meta, recs, skipped)
    sys.stdout.write(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        for rec in recs:
            for tool, _ in TOOLS:
                if tool in rec:
                    rec[tool]["runs"] = [dict(r, maxrss_mib=r["maxrss_kib"] / 1024.0) for r in rec[tool]["runs"]]
        args.json.write_text(
            json.dumps({"meta": meta, "skipped": skipped, "cases": recs}, indent=2, default=str) + "\n"
        )
    failed = fv_py is None or any(rec.get("errors") for rec in recs)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
