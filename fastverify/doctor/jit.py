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
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time

from fastverify.registry import BACKENDS, BackendName, backend_info

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


if __name__ == "__main__":
    child()
