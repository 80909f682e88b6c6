"""FlashInfer's JIT builds, timed in a child process under their own limit.

FlashInfer compiles a module the first time it is needed (``JitSpec.build_and_load``,
``flashinfer/jit/core.py``), unless ``flashinfer-jit-cache`` ships it (``is_aot``) or an earlier
run left it in the JIT directory (``is_compiled``). The backends need ``norm``
(``flashinfer/jit/norm.py``, for ``fused_add_rmsnorm``) and each its registry entry's
``jit_modules``: ``pcie_ipc_comm`` (built in ``PcieIpcAllReduceWorkspace``'s constructor) and
``trtllm_comm`` (built at the first ``allreduce_fusion`` call; ``flashinfer/jit/comm.py`` builds it
for SM majors 9, 10, 12 only).

The child (``python -m fastverify.doctor.jit``) builds each module in turn and prints one JSON
line as each starts and ends, then times the first ``fused_add_rmsnorm`` call. The parent reads
the lines until the build limit, so a build that outlasts it is reported by name as still
building, and every later trial loads the module from FlashInfer's cache instead of compiling it
inside its measurement limit.

Tune trials as the doctor runs them: the build of a backend (FlashInfer's JIT compile, a default
``tune()``) kept out of the measurement limit, and a trial stopped while building reported as
``building/JIT`` instead of ``failed``.

Two ways, whichever the installed trial runner offers:

* :func:`fastverify.tune.sweep.run_trial` takes a separate build limit (``build_timeout_s``): the
  workers report the end of the backend's construction and the measurement limit starts there.
* Otherwise the build runs inside the measurement limit, so the doctor widens that limit by the
  build allowance, and a timeout while the worker's last stage was still the backend's
  construction (``make backend ...``, see :mod:`fastverify.tune.worker`) is classified as a
  build, not a hang.

Either way the ``jit_builds`` check compiles FlashInfer's modules once before any trial, so the
trials normally only load them from FlashInfer's cache.
"""

from __future__ import annotations

import inspect
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from typing import Any

from fastverify.doctor.core import BUILDING, TRIAL_BUILD_S, TRIAL_STARTUP_S, TRIAL_TIMEOUT_S
from fastverify.registry import BACKENDS, BackendName, backend_info
from fastverify.tune import sweep

# (module label, generator module, generator function, registry backend whose kernel gate applies or None):
# the norm every backend can use, then each backend's own (the registry's ``jit_modules``, in its order)
MODULES: tuple[tuple[str, str, str, BackendName | None], ...] = (
    ("norm", "flashinfer.jit.norm", "gen_norm_module", None),
    *((j.label, j.module, j.function, b.name) for b in BACKENDS for j in b.jit_modules),
)


def _emit(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def child() -> None:
    """Build every module this GPU can run, then time the first ``fused_add_rmsnorm``."""
    import importlib

    import torch

    sm = tuple(torch.cuda.get_device_capability(0))
    for label, module, fn, backend in MODULES:
        if backend is not None and not backend_info(backend).kernel_runs_on(sm):
            _emit({"module": label, "event": "skipped", "reason": f"kernel not built for SM{sm[0]}{sm[1]}"})
            continue
        spec = getattr(importlib.import_module(module), fn)()
        facts = {
            "module": label,
            "jit_name": getattr(spec, "name", label),
            "aot": bool(getattr(spec, "is_aot", False)),
            "cached": bool(getattr(spec, "is_compiled", False)),
        }
        _emit({**facts, "event": "start"})
        t0 = time.perf_counter()
        try:
            spec.build_and_load()
        except Exception as err:  # noqa: BLE001 - one module's compile error, reported by name
            _emit(
                {
                    **facts,
                    "event": "error",
                    "seconds": round(time.perf_counter() - t0, 3),
                    "error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}",
                }
            )
            continue
        _emit({**facts, "event": "done", "seconds": round(time.perf_counter() - t0, 3)})
    from fastverify.backends.base import FUSED_ADD_RMSNORM  # lazy: torch

    fused = FUSED_ADD_RMSNORM.resolve()
    x = torch.ones(4, 1024, dtype=torch.bfloat16, device="cuda")
    r, w = torch.ones_like(x), torch.ones(1024, dtype=torch.bfloat16, device="cuda")
    _emit({"module": "fused_add_rmsnorm first call", "event": "start"})
    t0 = time.perf_counter()
    fused(**FUSED_ADD_RMSNORM.kwargs(input=x, residual=r, weight=w, eps=1e-6, enable_pdl=False))
    torch.cuda.synchronize()
    _emit({"module": "fused_add_rmsnorm first call", "event": "done", "seconds": round(time.perf_counter() - t0, 3)})


def summarize(events: list[dict], *, killed: bool, limit_s: float, elapsed_s: float, exit_reason: str = "") -> dict:
    """The outcome of a build run from the child's lines.

    Parameters
    ----------
    events : list of dict
        The child's JSON lines in order (``{"module", "event": start|done|error|skipped, ...}``).
    killed : bool
        The child was stopped at the build limit (so the module it started last is still building).
    limit_s, elapsed_s : float
        The build limit and the child's wall time, in seconds.
    exit_reason : str
        One line when the child exited non-zero.

    Returns
    -------
    dict
        ``modules`` (label -> {"status": built|loaded|building|error|skipped, "seconds", "aot",
        "cached"}), ``building`` (the label still building at the limit, else None), ``errors``
        (label -> one line), ``killed``, ``limit_s``, ``elapsed_s``, ``exit``.
    """
    modules: dict[str, dict] = {}
    errors: dict[str, str] = {}
    building = None
    for ev in events:
        label = ev.get("module", "?")
        row = modules.setdefault(label, {})
        for k in ("aot", "cached", "jit_name"):
            if k in ev:
                row[k] = ev[k]
        kind = ev.get("event")
        if kind == "start":
            row["status"], building = "building", label
        elif kind == "done":
            row.update(status="loaded" if row.get("aot") or row.get("cached") else "built", seconds=ev["seconds"])
            building = None
        elif kind == "error":
            row.update(status="error", seconds=ev.get("seconds"))
            errors[label] = ev.get("error", "")
            building = None
        elif kind == "skipped":
            row.update(status="skipped", reason=ev.get("reason"))
    if building is not None and not killed:  # the child died inside that build: an error, not a build
        modules[building]["status"] = "error"
        errors[building] = exit_reason or "the build process exited"
        building = None
    return {
        "modules": modules,
        "building": building,
        "errors": errors,
        "killed": killed,
        "limit_s": limit_s,
        "elapsed_s": round(elapsed_s, 3),
        "exit": exit_reason,
    }


def run_builds(limit_s: float) -> dict:
    """Run :func:`child` in a fresh interpreter for at most ``limit_s`` seconds; :func:`summarize`
    of what it printed (killed at the limit: ``building`` names the module it was on)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as err_file:  # a file: compiler output must never block the child
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdout=subprocess.PIPE,
            stderr=err_file,
            stdin=subprocess.DEVNULL,
            text=True,
            env=dict(os.environ),
            start_new_session=True,
        )
        events: list[dict] = []
        killed = False
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                left = limit_s - (time.monotonic() - t0)
                if left <= 0:
                    killed = True
                    break
                if sel.select(timeout=min(left, 1.0)):
                    line = proc.stdout.readline()
                    if not line:
                        break  # the child closed stdout: it is done
                    if line.startswith("{"):
                        events.append(json.loads(line))
        finally:
            sel.close()
            if killed and proc.poll() is None:
                os.killpg(proc.pid, 9)
            proc.wait()
        err_file.seek(0)
        err = [ln.strip() for ln in err_file.read().splitlines() if ln.strip()]
    if killed:
        exit_reason = f"stopped at the {limit_s:g} s build limit"
    else:
        exit_reason = "" if proc.returncode == 0 else f"exit code {proc.returncode}: {err[-1] if err else 'no stderr'}"
    return summarize(events, killed=killed, limit_s=limit_s, elapsed_s=time.monotonic() - t0, exit_reason=exit_reason)


BUILD_PARAM = "build_timeout_s"  # run_trial's build limit, where the runner has one
# Worker stages (fastverify/tune/worker.py ``_stage``) that belong to building the backend.
BUILD_STAGES = ("make backend", "build", "prepare", "jit")


def runner_has_build_phase(run_trial: Any) -> bool:
    """Whether ``run_trial`` takes a separate build limit (:data:`BUILD_PARAM`)."""
    try:
        return BUILD_PARAM in inspect.signature(run_trial).parameters
    except (TypeError, ValueError):
        return False


def trial_phase(status: str, reason: str) -> str:
    """Where a trial ended: ``"building/JIT"`` for a trial stopped while its backend was still
    being built (a build timeout, or a timeout whose still-running stage is a build stage),
    ``"start-up"`` for ranks that never joined the process group, ``"measurement"`` for
    everything else (a crash, a hang in the kernels, a wrong result, ok).

    Parameters
    ----------
    status : str
        ``TrialStatus`` value (``"ok"``, ``"failed"``, ``"skipped"``, ``"wrong_result"``).
    reason : str
        The trial's one-line reason, as :func:`fastverify.tune.sweep.run_trial` writes it
        (``"timeout after 60 s; still running: rank 0: make backend pcie_ipc"``).
    """
    if status != "failed":
        return "measurement"
    text = reason.lower()
    if text.startswith("start-up timeout"):
        return "start-up"
    if "build timeout" in text or "build limit" in text or "building/jit" in text:
        return BUILDING
    if "timeout" not in text or "still running:" not in text:
        return "measurement"  # a crash is a crash, also while building
    stages = [part.split(":", 1)[-1].strip() for part in text.split("still running:", 1)[1].split(", rank ")]
    if stages and all(any(stage.startswith(b) for b in BUILD_STAGES) for stage in stages):
        return BUILDING
    return "measurement"


def run_doctor_trial(
    spec: Any,
    *,
    timeout_s: float = TRIAL_TIMEOUT_S,
    startup_timeout_s: float = TRIAL_STARTUP_S,
    build_timeout_s: float = TRIAL_BUILD_S,
) -> tuple[Any, dict]:
    """Run one :class:`~fastverify.tune.trial.TrialSpec` with the build outside the measurement limit.

    Returns
    -------
    (TrialResult, dict)
        The result and ``{"phase", "limits"}``: ``phase`` from :func:`trial_phase`, ``limits`` the
        seconds each phase was given and how the build was kept out of the measurement.
    """
    if runner_has_build_phase(sweep.run_trial):
        res = sweep.run_trial(
            spec, timeout_s=timeout_s, startup_timeout_s=startup_timeout_s, **{BUILD_PARAM: build_timeout_s}
        )
        how = "separate build phase of the trial runner"
        measure_s = timeout_s
    else:
        measure_s = timeout_s + build_timeout_s
        res = sweep.run_trial(spec, timeout_s=measure_s, startup_timeout_s=startup_timeout_s)
        how = "measurement limit widened by the build allowance (the runner has no build phase)"
    status = getattr(res.status, "value", str(res.status))
    limits = {
        "startup_s": startup_timeout_s,
        "build_s": build_timeout_s,
        "measurement_s": timeout_s,
        "given_s": measure_s,
        "how": how,
    }
    return res, {"phase": trial_phase(status, res.reason or ""), "limits": limits}


if __name__ == "__main__":
    child()
