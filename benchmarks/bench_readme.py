#!/usr/bin/env python3
"""Run the README's commands as written and measure what the README says about them.

For every ``.venv/bin/fastverify ...`` line in a README code block, :data:`COMMANDS` says either how
this benchmark runs it (the line itself, from the repository root, in a scratch copy of nothing:
outputs go where the line says) or why it cannot run on this machine (a GPU, a running SGLang
server, an interrupted sweep). ``tests/test_readme_commands.py`` fails when a README line is in
neither list, so the two cannot drift apart.

For each command that runs it prints: exit status, wall time (s), peak memory of the process tree
(``ru_maxrss`` of the child via ``os.wait4``: the largest single process, not a sum), and the longest
stretch with no line on stdout or stderr (s): the README promises that no command is silent for more
than 10 s (:data:`SILENCE_AIM_S`). Each README figure that names a command's time is printed beside
the measurement, with the ratio (README timings must be within 30 %, :data:`TIMING_TOLERANCE`).

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_readme.py                 # every runnable command, once
    .venv/bin/python benchmarks/bench_readme.py --only doctor-quick,profile-tiny --repeats 3

Machine, load average at start and end, and the time are printed in the ``#`` header; a 1-minute
load average above 0.5 at the start is flagged (timings from a busy machine are slow). Exits 0;
the verdicts are printed, never turned into a failure (performance goals live in benchmarks).
"""

from __future__ import annotations

import argparse
import os
import platform
import selectors
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SILENCE_AIM_S = 10.0
TIMING_TOLERANCE = 0.30


@dataclass(frozen=True)
class Command:
    """One README line. ``key`` names it here; ``line`` is the README text (after the prompt-less
    ``.venv/bin/fastverify``); ``runs`` False with ``why`` for lines this machine cannot run;
    ``claim_s`` a time the README gives for it (seconds) or None."""

    key: str
    line: str
    runs: bool = True
    why: str = ""
    claim_s: float | None = None
    timeout_s: float = 900.0
    after: str = ""  # what the README line has after ``--`` (the wrapped server command), for a run


COMMANDS: tuple[Command, ...] = (
    Command("profile-tiny", "profile", claim_s=3.5),
    Command("profile-trace-folder", "profile --trace tests/data/cuda_graph_replay/"),
    Command(
        "profile-trace-b200",
        "profile --trace docs/traces/b200-eager.trace.json.gz --output /tmp/fastverify-readme/verify.json",
    ),
    Command(
        "profile-live-kimi-tp8",
        "profile --model kimi-k2 --tp 8 --draft-tokens 4 --batch 1",
        runs=False,
        why="needs 8 GPUs (on CPU it refuses at once when memory is short, or runs with progress)",
    ),
    Command("profile-live-config-cpu", "profile --model fastverify/live/presets/tiny.json --tp 2 --device cpu"),
    Command(
        "profile-kimi-tp2-cpu",
        "profile --model kimi-k2 --tp 2 --device cpu --output /tmp/fastverify-readme/kimi-tp2.json",
        claim_s=108.0,
    ),
    Command(
        "profile-kimi-pcie-ipc",
        "profile --model kimi-k2 --tp 8 --backend pcie_ipc",
        runs=False,
        why="needs 8 GPUs with P2P (FlashInfer's PCIe IPC all-reduce)",
    ),
    Command(
        "verify-log",
        "profile --verify-log /tmp/verify",
        runs=False,
        why="reads the records of a running `fastverify launch --profile-verify` server",
    ),
    Command(
        "verify-log-change",
        "profile --verify-log /tmp/verify-nccl /tmp/verify-fast",
        runs=False,
        why="reads the records of two server runs",
    ),
    Command("topo-live", "topo", runs=False, why="reads NVML on a GPU box"),
    Command(
        "topo-offline",
        "topo --topology docs/topo-nccl-tests-307.txt --nccl-log docs/nccldebug-nccl-tests-307.txt --set NCCL_P2P_LEVEL=SYS --json",
    ),
    Command(
        "topo-perf-table",
        "topo --perf-table docs/allreduceperf-blog-chlc-rtx4090-p2punlocked.txt --topology docs/topo-blog-chlc-rtx4090.txt",
    ),
    Command(
        "tune-predict-write",
        "tune --predict --topology docs/topo-nccl-tests-307.txt --model kimi-k2 --tp 8 --draft-tokens 4 --max-batch 32 --sm 89 --write-env /tmp/fastverify-readme/example.env --write-tuner-config /tmp/fastverify-readme/example-tuner.csv",
    ),
    Command(
        "tune-predict-seed",
        "tune --predict --topology docs/topo-nccl-tests-307.txt --model kimi-k2 --tp 8 --sm 120 --pcie-gen 5 --tok-s 82 --accept-length 3 --json",
    ),
    Command(
        "tune-predict-evidence",
        "tune --predict --topology docs/topo-blog-chlc-rtx4090.txt --profile /tmp/fastverify-readme/verify.json --perf-table docs/allreduceperf-blog-chlc-rtx4090-p2punlocked.txt --nccl-log docs/nccldebug-nccl-tests-307.txt --sm 89 --pcie-gen 4 --hidden 7168",
    ),
    Command(
        "tune-measure",
        "tune --profile profiles/verify.json --hidden 7168 --draft-tokens 4 --max-batch 32 --write-env",
        runs=False,
        why="measures on the GPU box it tunes",
    ),
    Command(
        "tune-resume",
        "tune --model kimi-k2 --tp 8 --resume",
        runs=False,
        why="continues a sweep interrupted on a GPU box",
    ),
    Command(
        "launch-dry-run",
        "launch --env nccl_configs/<box>.env --backend auto --dry-run --",
        runs=False,
        why="needs the box's env file and SGLang",
    ),
    Command(
        "launch-pcie-ipc",
        "launch --env nccl_configs/<box>.env --backend pcie_ipc --p2p-check p2p.json --",
        runs=False,
        why="needs GPUs and SGLang",
    ),
    Command(
        "flow-profile",
        "profile --trace /tmp/sglang-profile/ --output profiles/verify.json",
        runs=False,
        why="the whole flow on a GPU box: traces from a running SGLang server's /start_profile",
    ),
    Command("flow-doctor", "doctor", runs=False, why="the whole flow on a GPU box (doctor --json runs here)"),
    Command(
        "flow-tune",
        "tune --profile profiles/verify.json --hidden 7168 --draft-tokens 4 --max-batch 32 --write-env nccl_configs/box.env",
        runs=False,
        why="the whole flow on a GPU box: measures there",
    ),
    Command(
        "flow-launch",
        "launch --env nccl_configs/box.env --profile-verify /tmp/verify --",
        runs=False,
        why="the whole flow on a GPU box: starts SGLang",
    ),
    Command(
        "collect-server",
        "collect --server http://localhost:30000 --cycles 20 --verify-log /tmp/verify",
        runs=False,
        why="needs a running SGLang server and its verify-log folder (tests/test_sglang_server.py runs it on a real CPU server)",
    ),
    Command(
        "report-bundle",
        "report fastverify-bundle-<UTC time>.tar.gz --png cycle.png",
        runs=False,
        why="reads the bundle collect wrote on the serving box (tests/test_cycle_report.py builds bundles)",
    ),
    Command(
        "tune-predict-user",
        "tune --predict --verify-ms 30 --allreduce-ms 25 --tok-s 82 --accept-length 3 --model kimi-k2 --tp 8 --sm 120 --pcie-gen 5",
    ),
    Command(
        "box-baseline",
        "launch --load --profile-verify before/ --",
        runs=False,
        why="on the GPU box: starts the user's SGLang server, unchanged, runs the fixed load "
        "(tests/test_sglang_proof.py runs it on a real CPU server)",
    ),
    Command(
        "box-tune",
        "tune --profile profiles/verify.json --hidden 7168 --speculative-num-draft-tokens 4 "
        "--cuda-graph-max-bs-decode 32 --write-env nccl_configs/box.env",
        runs=False,
        why="on the GPU box: measures there",
    ),
    Command("box-p2p", "p2p --output p2p.json", runs=False, why="the real P2P check needs 2+ GPUs"),
    Command(
        "box-launch",
        "launch --env nccl_configs/box.env --p2p-check p2p.json --load --baseline before/ --profile-verify after/ --",
        runs=False,
        why="on the GPU box: starts SGLang with the winner under the same load",
    ),
    Command(
        "box-change",
        "compare before/ after/",
        runs=False,
        why="reads the two load runs of the box (tests/test_sglang_proof.py compares two on a real CPU server)",
    ),
    Command(
        "away-predict",
        "tune --predict --topology docs/topo-nccl-tests-307.txt --model kimi-k2.5 "
        "--tp-size 8 --sm 120 --pcie-gen 5 --tok-s 82 --accept-length 3",
    ),
    Command(
        "away-topo", "topo --topology docs/topo-nccl-tests-307.txt --model kimi-k2.5 --tp-size 8 --sm 120 --pcie-gen 5"
    ),
    Command(
        "away-write",
        "tune --predict --topology docs/topo-nccl-tests-307.txt --model kimi-k2.5 "
        "--tp-size 8 --sm 120 --pcie-gen 5 --cuda-graph-max-bs-decode 32 --write-env /tmp/fastverify-readme/box.env",
    ),
    Command(
        "away-dry-run",
        'launch --env /tmp/fastverify-readme/box.env --describe-box \'{"gpu_name": "NVIDIA L40S", '
        '"sm": [8, 9], "gpu_count": 8}\' --dry-run --',
        after="python -m sglang.launch_server --model-path ... --tp-size 8 --speculative-algorithm EAGLE3",
    ),
    Command("doctor-quick", "doctor --quick", claim_s=0.2),
    Command("doctor-json", "doctor --json", claim_s=2.7),
    Command("doctor-env-file", "doctor --env-file nccl_configs/example.env"),
)


def _machine() -> str:
    """The machine line, from the trace benchmark's own record of it (one reading of /proc)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_trace import machine_meta  # sibling script

    m = machine_meta()
    return f"nproc {m['nproc']}, cpu {m['cpu']}, memory {m['mem_gib']:.1f} GiB"


def run_one(cmd: Command, python: str) -> dict:
    """Run one README line; wall, peak RSS (MB), longest silence (s), exit status."""
    argv = [python, "-m", "fastverify", *shlex.split(cmd.line), *shlex.split(cmd.after)]
    t0 = time.perf_counter()
    last = t0
    longest = 0.0
    lines = 0
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
    )
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    tail = b""
    timed_out = False
    open_streams = 2
    while open_streams:
        if time.perf_counter() - t0 > cmd.timeout_s:
            os.killpg(proc.pid, signal.SIGKILL)
            timed_out = True
            break
        for key, _ in sel.select(timeout=0.5):
            chunk = key.fileobj.read()
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            now = time.perf_counter()
            n = chunk.count(b"\n")
            if n:
                longest = max(longest, now - last)
                last = now
                lines += n
            tail = (tail + chunk)[-400:]
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    longest = max(longest, wall - last) if lines == 0 else longest
    return {
        "key": cmd.key,
        "rc": os.waitstatus_to_exitcode(status),
        "wall_s": wall,
        "maxrss_mb": ru.ru_maxrss / 1024,
        "longest_silence_s": longest,
        "lines": lines,
        "timed_out": timed_out,
        "tail": tail.decode(errors="replace").strip().splitlines()[-1:] or [""],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated command keys")
    ap.add_argument("--repeats", type=int, default=1, help="runs per command (median wall shown)")
    ap.add_argument("--python", default=sys.executable, help="interpreter that has fastverify")
    args = ap.parse_args(argv)
    keys = set(args.only.split(",")) if args.only else None
    (Path("/tmp") / "fastverify-readme").mkdir(exist_ok=True)
    load0 = os.getloadavg()
    print("# fastverify README commands, run as written from the repository root")
    print(
        f"# date {datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}  host {platform.system()} "
        f"{platform.release()} {platform.machine()}"
    )
    print(f"# machine: {_machine()}; python {platform.python_version()}")
    print(
        f"# load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}"
        + ("  (WARNING: not an idle machine; timings are slow)" if load0[0] > 0.5 else "")
    )
    print(f"# {'key':<24} {'rc':>3} {'wall s':>8} {'peak MB':>8} {'silent s':>8} {'lines':>6}  last line")
    results = []
    for cmd in COMMANDS:
        if keys is not None and cmd.key not in keys:
            continue
        if not cmd.runs:
            print(f"  {cmd.key:<24} {'-':>3} {'-':>8} {'-':>8} {'-':>8} {'-':>6}  not run here: {cmd.why}")
            continue
        runs = [run_one(cmd, args.python) for _ in range(max(1, args.repeats))]
        r = dict(runs[-1])
        r["wall_s"] = statistics.median(x["wall_s"] for x in runs)
        r["longest_silence_s"] = max(x["longest_silence_s"] for x in runs)
        results.append((cmd, r))
        print(
            f"  {cmd.key:<24} {r['rc']:>3} {r['wall_s']:>8.2f} {r['maxrss_mb']:>8.0f} {r['longest_silence_s']:>8.1f} "
            f"{r['lines']:>6}  {r['tail'][0][:90]}",
            flush=True,
        )
    load1 = os.getloadavg()
    print(f"# load average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    for cmd, r in results:
        verdict = "met" if r["longest_silence_s"] <= SILENCE_AIM_S else "MISSED"
        print(f"# {cmd.key}: longest silence {r['longest_silence_s']:.1f} s (aim <= {SILENCE_AIM_S:g} s): {verdict}")
        if cmd.claim_s is not None:
            ratio = r["wall_s"] / cmd.claim_s
            ok = abs(ratio - 1) <= TIMING_TOLERANCE
            print(
                f"# {cmd.key}: README says ~{cmd.claim_s:g} s, measured {r['wall_s']:.1f} s ({ratio:.2f}x): "
                f"{'within' if ok else 'OUTSIDE'} {TIMING_TOLERANCE:.0%}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
