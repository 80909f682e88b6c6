"""The ``verify_timer`` check: the patch's verify timer (:class:`fastverify.patch.verify.VerifyTimer`)
on real CUDA events, recorded behind queued GPU work, must cost the host no wait.

Everything the timed steps touch for the first time in this process is done once before the timed
window (:func:`warm_up`): cuBLAS creates its handle and workspace at the first matmul, CUDA loads a
kernel's module at its first launch (lazy loading, ``CUDA_MODULE_LOADING=LAZY``, the default since
CUDA 12.2), the caching allocator takes its blocks, and the timer creates its events and starts its
writer thread. Done inside the window, behind the queued GPU work, any of these can wait for the
GPU, and the check would blame the timer for it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson

from fastverify.doctor.core import Outcome, Status, _Context, _out
from fastverify.patch.verify import VerifyTimer

TIMER_STEPS = 8
TIMER_BUSY_MS = 200.0  # GPU work queued ahead of the timed steps
WARMUP_STEPS = 2  # untimed steps before the window: the allocator then holds the loop's blocks


def judge_verify_timer(*, host_ms: float, busy_ms: float, written_while_busy: int, written_after: int,
                       steps: int, rows: list[dict]) -> tuple[bool, str]:
    """Whether the verify timer timed ``steps`` steps with CUDA events without waiting for the GPU.

    Parameters
    ----------
    host_ms : float
        Host time of ``steps`` start/stop pairs and one drain while ``busy_ms`` of GPU work was
        queued ahead of them (ms, ``time.perf_counter``).
    written_while_busy, written_after : int
        Rows the drain wrote while the GPU was busy (must be 0: nothing had finished) and after a
        synchronize (must be ``steps``).
    rows : list of dict
        The JSON lines the timer wrote.
    """
    if host_ms >= busy_ms / 2:
        return False, (f"recording and draining took {host_ms:.1f} ms of host time behind {busy_ms:.0f} ms of "
                       "GPU work: the timer waits for the GPU")
    if written_while_busy:
        return False, f"the drain wrote {written_while_busy} row(s) before their events could have completed"
    if written_after != steps or len(rows) != steps:
        return False, (f"{written_after} row(s) written after the GPU finished ({len(rows)} in the file), "
                       f"expected {steps}")
    bad = [r for r in rows if r.get("clock") != "cuda_events" or not float(r.get("verify_ms", 0)) > 0]
    if bad:
        return False, f"row {bad[0]} is not a positive CUDA-event time"
    return True, (f"{steps} steps timed with CUDA events; {host_ms:.2f} ms host time behind {busy_ms:.0f} ms of "
                  "queued GPU work, nothing written before it finished")


def _timer(torch: Any, out_dir: Path) -> VerifyTimer:
    return VerifyTimer(out_dir, every=TIMER_STEPS + 1,  # drained by hand
                       event_factory=lambda: torch.cuda.Event(enable_timing=True), clock="cuda_events")


def _step(timer, a):
    """One timed step, as the patch times a verify forward: events around GPU work (a matmul)."""
    ev = timer.start()
    a = a @ a / 256
    timer.stop(ev)
    return a


def warm_up(torch: Any, a: Any, out_dir: Path) -> Any:
    """:data:`WARMUP_STEPS` steps of the timed loop on a throwaway timer writing under ``out_dir``,
    then a synchronize: cuBLAS, the loop's kernels, the allocator's blocks and the timer's first use
    are paid here, not in the window. ``a``: the (256, 256) fp32 CUDA tensor the loop multiplies."""
    timer = _timer(torch, out_dir)
    for _ in range(WARMUP_STEPS):
        a = _step(timer, a)
    torch.cuda._sleep(1000)  # load the spin kernel too
    torch.cuda.synchronize()
    timer.drain(wait=True)
    return a


def time_steps(torch: Any, out_dir: Path) -> dict:
    """The timed run on GPU 0 of ``torch`` (the real module, or a stand-in in tests): warm up,
    queue :data:`TIMER_BUSY_MS` of spin work (``torch.cuda._sleep``, its cycles calibrated with
    events), then :data:`TIMER_STEPS` steps and a drain, timed on the host; then a synchronize and
    a second drain. Returns :func:`judge_verify_timer`'s keyword arguments (``rows``: the lines the
    timer wrote) and ``clock``."""
    torch.cuda.set_device(0)
    a = warm_up(torch, torch.randn(256, 256, device="cuda"), out_dir / "warm-up")
    timer = _timer(torch, out_dir / "timed")
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(10_000_000)
    e1.record()
    e1.synchronize()
    cycles = int(10_000_000 * TIMER_BUSY_MS / max(e0.elapsed_time(e1), 1e-3))
    torch.cuda._sleep(cycles)  # ~TIMER_BUSY_MS of GPU work ahead of the steps
    t0 = time.perf_counter()
    for _ in range(TIMER_STEPS):
        a = _step(timer, a)
    busy = timer.drain()
    host_ms = (time.perf_counter() - t0) * 1000
    torch.cuda.synchronize()
    after = timer.drain()
    path = next(iter(sorted((out_dir / "timed").glob("*.jsonl"))), None)
    rows = [orjson.loads(ln) for ln in path.read_bytes().splitlines()] if path else []
    return {"host_ms": host_ms, "busy_ms": TIMER_BUSY_MS, "written_while_busy": busy, "written_after": after,
            "steps": TIMER_STEPS, "rows": rows, "clock": timer.clock}


def check_verify_timer(ctx: _Context) -> Outcome:
    """The patch's verify timer on real CUDA events (:func:`time_steps`): steps recorded behind
    queued GPU work must cost no host wait, and every step is written once the GPU is done."""
    import torch

    got = time_steps(torch, ctx.tmp / "verify-timer")
    clock = got.pop("clock")
    ok, line = judge_verify_timer(**got)
    details = {"host_ms": round(got["host_ms"], 3), "busy_ms": TIMER_BUSY_MS, "written_while_busy":
               got["written_while_busy"], "written_after": got["written_after"], "rows": got["rows"][:3],
               "clock": clock, "warm_up_steps": WARMUP_STEPS}
    if not ok:
        return _out(Status.fail, f"verify timer: {line}", "report this: the patch's timer must never sync the host",
                    **details)
    return _out(Status.ok, line, **details)
