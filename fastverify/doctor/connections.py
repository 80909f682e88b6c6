"""Does ``CUDA_DEVICE_MAX_CONNECTIONS`` still take effect when it is set after
``torch.cuda.is_available()`` has run?

SGLang's import calls ``torch.cuda.is_available()`` before the in-rank patch runs, so a value the
patch sets comes late. The question is answered by measurement, in child processes run as
``python -m fastverify.doctor.connections MODE``:

* ``unset``: the variable removed (the driver's default, 8 connections);
* ``early``: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` set before torch is imported;
* ``late``: torch imported, ``torch.cuda.is_available()`` called, then the variable set to 1,
  then the CUDA context created (the order inside an SGLang rank).

Each child times, with CUDA events, two spin kernels (``torch.cuda._sleep``) queued on stream A
and then two on stream B. With several hardware connections the streams run side by side
(about 2 kernel times); with one connection all streams share one queue, so B's first kernel
waits behind A's second (about 3 kernel times or more). The ratio total / one kernel tells them
apart; :func:`verdict` compares the three children. The child prints one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
MODES = ("unset", "early", "late")
SERIAL_RATIO = 2.5  # between 2 (two streams overlap) and 3+ (one shared queue)
KERNEL_MS = 20.0  # length of one spin kernel
REPEATS = 3
CHILD_TIMEOUT_S = 120.0
TAKES_EFFECT, DOES_NOT, INCONCLUSIVE = "takes effect", "does not take effect", "inconclusive"


def verdict(ratios: dict[str, float | None]) -> tuple[str, str]:
    """Whether the late setting took effect, from the three children's ratios.

    Parameters
    ----------
    ratios : dict
        ``{"unset": r, "early": r, "late": r}``: time of the 2 + 2 kernel pattern over the time of
        one kernel (dimensionless; None where the child failed).

    Returns
    -------
    (str, str)
        :data:`TAKES_EFFECT`, :data:`DOES_NOT` or :data:`INCONCLUSIVE`, and one line saying why.
        The late ratio counts only when the two controls behave: streams overlap with the default
        (``unset`` below :data:`SERIAL_RATIO`) and serialize when the variable is set at start.
    """
    unset, early, late = (ratios.get(m) for m in MODES)
    shown = ", ".join(f"{m} {ratios[m]:.2f}" if ratios.get(m) is not None else f"{m} n/a" for m in MODES)
    if None in (unset, early, late):
        missing = [m for m in MODES if ratios.get(m) is None]
        return INCONCLUSIVE, f"no measurement for {', '.join(missing)} ({shown})"
    if unset >= SERIAL_RATIO:
        return INCONCLUSIVE, f"two streams do not overlap even with the default connections ({shown})"
    if early < SERIAL_RATIO:
        return INCONCLUSIVE, f"{ENV}=1 set at start does not serialize the streams either ({shown})"
    if late >= SERIAL_RATIO:
        return TAKES_EFFECT, f"set after torch.cuda.is_available() it still serializes the streams ({shown})"
    return DOES_NOT, f"set after torch.cuda.is_available() the streams still overlap ({shown})"


def _pattern_ms(torch: Any, cycles: int) -> float:
    cur = torch.cuda.current_stream()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(cur)
    a.wait_event(e0)
    b.wait_event(e0)
    with torch.cuda.stream(a):  # A1, A2 first, then B1, B2: in one shared queue B1 waits behind A2
        torch.cuda._sleep(cycles)
        torch.cuda._sleep(cycles)
    with torch.cuda.stream(b):
        torch.cuda._sleep(cycles)
        torch.cuda._sleep(cycles)
    cur.wait_stream(a)
    cur.wait_stream(b)
    e1.record(cur)
    e1.synchronize()
    return e0.elapsed_time(e1)


def _one_ms(torch: Any, cycles: int) -> float:
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(cycles)
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1)


def child(mode: str) -> dict:
    """Measure in this process (a fresh interpreter) in ``mode``; see the module docstring."""
    if mode == "early":
        os.environ[ENV] = "1"
    else:
        os.environ.pop(ENV, None)
    import torch

    if mode == "late":
        torch.cuda.is_available()  # what SGLang's import does before the patch runs
        os.environ[ENV] = "1"
    torch.zeros(1, device="cuda")  # the context is created here
    probe_cycles = 10_000_000
    _one_ms(torch, probe_cycles)  # first launch: module load
    per_ms = probe_cycles / max(_one_ms(torch, probe_cycles), 1e-3)
    cycles = int(per_ms * KERNEL_MS)
    one = statistics.median(_one_ms(torch, cycles) for _ in range(REPEATS))
    total = statistics.median(_pattern_ms(torch, cycles) for _ in range(REPEATS))
    return {
        "mode": mode,
        "env": os.environ.get(ENV),
        "kernel_ms": round(one, 3),
        "pattern_ms": round(total, 3),
        "ratio": round(total / one, 3),
        "clock": "cuda_events",
    }


def measure(timeout_s: float = CHILD_TIMEOUT_S) -> dict[str, dict]:
    """Run the three children one after another; ``{mode: child's JSON or {"error": one line}}``."""
    out: dict[str, dict] = {}
    for mode in MODES:
        env = dict(os.environ)
        env.pop(ENV, None)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", __name__, mode],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            out[mode] = {"error": f"timed out after {timeout_s:g} s"}
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            err = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
            out[mode] = {"error": f"exit code {proc.returncode}: {err[-1] if err else 'no output'}"}
            continue
        out[mode] = json.loads(lines[-1])
    return out


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1])), flush=True)
