"""Tune trials as the doctor runs them: the build of a backend (FlashInfer's JIT compile, a default
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
from typing import Any

from fastverify.doctor.core import BUILDING, TRIAL_BUILD_S, TRIAL_STARTUP_S, TRIAL_TIMEOUT_S
from fastverify.tune import sweep

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
