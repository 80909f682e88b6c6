"""``fastverify doctor``: check a box end to end before tuning, and exercise every GPU code path.

Each check is one function in :data:`CHECKS`, a table of ``(name, function, needs_gpu, quick)``
run in order. A check returns an outcome (status, one-line reason, one-line fix, JSON-able
details); :func:`run_doctor` times it and turns any exception it raises into a ``fail`` whose
reason is the exception's first line, never a traceback, so one broken check never stops the
others. GPU checks are ``skipped`` with the reason when torch sees no CUDA device; ``--quick``
runs only the checks marked quick (versions, library presence, the env-file validator, the
analyzer on a built-in trace: no processes, no GPU work, a few seconds).

On one GPU it is the single-GPU self-check (:mod:`.selfcheck`): FlashInfer's stream
binding with real streams, a 1-rank NCCL backend eager and in a replayed CUDA graph, the live
runner at TP 1, ``fused_add_rmsnorm`` against the fp32 reference eager and in a graph, FlashInfer's
JIT build times, the patch's verify timer on real events without a host sync, NVML on one GPU,
``ncclGetVersion`` against ``torch.cuda.nccl.version()`` and whether a late
``CUDA_DEVICE_MAX_CONNECTIONS`` takes effect. FlashInfer checks are skipped where FlashInfer does
not import. ``fastverify doctor --json`` prints one JSON summary of all of it.

Nothing here re-implements what the rest of fastverify does: the gloo and backend checks are tune
trials (:func:`fastverify.tune.sweep.run_trial`, checked against the torch reference in its
workers; a backend's build has its own limit, :mod:`.jit`), the CUDA-graph checks run the live
runner's verify forward (:class:`fastverify.live.forward.TPVerifyModel`) and its trace export,
traces go through the loader and analyzer of ``fastverify profile``, and the backends come from
the registry (:mod:`fastverify.registry`) and are probed and built by :mod:`fastverify.backends`.

Nothing is installed at run time. FlashInfer compiles its kernels the first time they run on a GPU
architecture (minutes without ``flashinfer-jit-cache``): the ``jit_builds`` check does that once,
timed, under its own limit, before any trial.

``--json`` (:func:`run_doctor_json`): stdout holds the JSON document and nothing else.
NCCL writes its ``NCCL_DEBUG`` log to stdout unless ``NCCL_DEBUG_FILE`` names a file (NCCL's
environment variables documentation: ``NCCL_DEBUG_FILE``, where ``%h`` is the host name and ``%p``
the process id), and the checks start processes (trials, the P2P pair children, spawned ranks)
that inherit this process's stdout. So under ``--json``:

* where ``NCCL_DEBUG`` is set and ``NCCL_DEBUG_FILE`` is not, ``NCCL_DEBUG_FILE`` is set to a file
  per process in a new folder before any check runs (so before NCCL starts here and in every child,
  which get this environment), and the summary names it (``nccl_log``; null, and the folder
  removed, where NCCL wrote nothing);
* while the checks run, file descriptor 1 points at stderr, so whatever still writes to stdout
  (this process, NCCL, a child) lands on stderr; the JSON is written after it is restored.

Modules: :mod:`.core` (outcome types, context, summary), :mod:`.cpu` (checks without a GPU),
:mod:`.gpu` (CUDA, NVML, graphs, multi-GPU trials), :mod:`.selfcheck` (the single-GPU self-check),
:mod:`.connections`, :mod:`.jit` (their logic, testable on CPU).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, MutableMapping

import orjson

from fastverify.doctor.core import (
    BUILDING,
    NO_GPU,
    NO_NCCL,
    PATCH_NOT_CHECKED,
    PINNED_FLASHINFER,
    SCHEMA,
    SCHEMA_VERSION,
    Check,
    CheckContext,
    CheckSpec,
    Outcome,
    Status,
    _error_text,
    _jsonable,
    _out,
    one_line,
    print_checks,
    summarise,
)
from fastverify.doctor.cpu import (
    check_env_file,
    check_flashinfer,
    check_gloo_allreduce,
    check_nccl_library,
    check_sglang,
    check_sglang_patch_targets,
    check_trace_analyzer,
    check_versions,
    sample_trace,
)
from fastverify.doctor.gpu import (
    backends_to_probe,
    check_backend_latency,
    check_backends,
    check_cuda,
    check_cuda_graph,
    check_gpu_free_memory,
    check_hook_overhead,
    check_nvml_topology,
    check_p2p_real,
    check_profiler_trace,
    match_torch_to_nvml,
)
from fastverify.doctor.graph_counts import check_compiled_counts, check_graph_counts
from fastverify.doctor.selfcheck import (
    check_cuda_max_connections,
    check_flashinfer_norm,
    check_fused_two_groups,
    check_jit_builds,
    check_live_graph_timing,
    check_nccl_1rank,
    check_stream_binding,
    check_torch_nccl,
    check_verify_timer,
)
from fastverify.errors import UserError, shown

CHECKS: tuple[CheckSpec, ...] = (
    # name, function, needs_gpu, quick
    CheckSpec("versions", check_versions, False, True),
    CheckSpec("gloo_allreduce", check_gloo_allreduce, False, False),
    CheckSpec("trace_analyzer", check_trace_analyzer, False, True),
    CheckSpec("env_file", check_env_file, False, True),
    CheckSpec("nccl_library", check_nccl_library, False, True),
    CheckSpec("flashinfer", check_flashinfer, False, True),
    CheckSpec("sglang", check_sglang, False, True),
    CheckSpec("sglang_patch_targets", check_sglang_patch_targets, False, False),
    CheckSpec("gpu_free_memory", check_gpu_free_memory, True, True),
    CheckSpec("cuda", check_cuda, True, True),
    CheckSpec("torch_nccl", check_torch_nccl, True, True),
    CheckSpec("nvml_topology", check_nvml_topology, True, True),
    CheckSpec("cuda_max_connections", check_cuda_max_connections, True, False),
    # Builds first, so that no later check or trial compiles inside its own limit.
    CheckSpec("jit_builds", check_jit_builds, True, False),
    CheckSpec("stream_binding", check_stream_binding, True, False),
    CheckSpec("flashinfer_norm", check_flashinfer_norm, True, False),
    CheckSpec("verify_timer", check_verify_timer, True, False),
    CheckSpec("nccl_1rank", check_nccl_1rank, True, False),
    CheckSpec("fused_two_groups", check_fused_two_groups, True, False),
    CheckSpec("graph_counts", check_graph_counts, True, False),
    CheckSpec("compiled_counts", check_compiled_counts, True, False),
    CheckSpec("live_graph_timing", check_live_graph_timing, True, False),
    CheckSpec("cuda_graph_forward", check_cuda_graph, True, False),
    CheckSpec("profiler_trace", check_profiler_trace, True, False),
    CheckSpec("hook_overhead", check_hook_overhead, True, False),
    CheckSpec("p2p", check_p2p_real, True, False),
    CheckSpec("backend_allreduce", check_backends, True, False),
    CheckSpec("backend_latency", check_backend_latency, True, False),
)


def run_doctor(*, quick: bool, env_file: str | None = None) -> list[Check]:
    """Run the checks of :data:`CHECKS` in order (only the quick ones when ``quick``).

    Parameters
    ----------
    quick
        Only checks marked quick: versions, library presence, the env-file validator, the analyzer
        on a built-in trace. No processes are started; a few seconds.
    env_file
        An env file to validate (``fastverify tune --write-env`` output); without it the validator
        is shown to accept a known-good line and refuse a known-bad one.

    Returns
    -------
    list[Check]
        One per check run, in table order. Never raises for a failing check.
    """
    ctx = CheckContext(quick=quick, env_file=env_file)
    out: list[Check] = []
    try:
        for spec in CHECKS:
            if quick and not spec.quick:
                continue
            t0 = time.perf_counter()
            if spec.needs_gpu and ctx.gpu_reason is not None:
                outcome = _out(Status.skipped, ctx.gpu_reason)
            else:
                try:
                    outcome = spec.fn(ctx)
                except UserError as err:  # bad input or box state, said in its own one line
                    outcome = _out(Status.fail, _error_text(err))
                except Exception as err:  # noqa: BLE001 - every check is isolated: one line, the rest go on
                    outcome = _out(
                        Status.fail,
                        f"check raised {_error_text(err)}",
                        "report this with the output of `fastverify doctor --json`",
                    )
            out.append(
                Check(
                    name=spec.name,
                    status=Status(outcome.status),
                    reason=one_line(outcome.reason),
                    fix=one_line(outcome.fix) if outcome.fix else None,
                    seconds=time.perf_counter() - t0,
                    details=_jsonable(outcome.details),
                )
            )
    finally:
        ctx.close()
    return out


NCCL_LOG_NAME = "nccl.%h.%p.log"  # one file per host and process (NCCL_DEBUG_FILE's %h and %p)


def nccl_log_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings ``--json`` adds to ``environ``: ``{"NCCL_DEBUG_FILE": <new folder>/nccl.%h.%p.log}``
    where ``NCCL_DEBUG`` is set and ``NCCL_DEBUG_FILE`` is not; else ``{}`` (a user's own file wins)."""
    if not environ.get("NCCL_DEBUG") or environ.get("NCCL_DEBUG_FILE"):
        return {}
    folder = tempfile.mkdtemp(prefix="fastverify-doctor-nccl-")
    return {"NCCL_DEBUG_FILE": os.path.join(folder, NCCL_LOG_NAME)}


@contextlib.contextmanager
def stdout_on_stderr() -> Iterator[None]:
    """File descriptor 1 (and ``sys.stdout``) pointed at stderr for the block; restored after."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def _environ_with(added: Mapping[str, str], environ: MutableMapping[str, str]) -> Iterator[None]:
    environ.update(added)
    try:
        yield
    finally:
        for k in added:
            environ.pop(k, None)


def run_doctor_json(*, quick: bool, env_file: str | None) -> int:
    """Run the checks (:func:`fastverify.doctor.run_doctor`) and write the summary
    (:func:`fastverify.doctor.summarise`, plus ``nccl_log`` when NCCL's log was sent to a file) as
    JSON to stdout. Returns the exit code: 1 when the verdict is ``fail``, else 0."""
    added = nccl_log_env(os.environ)
    if added:
        sys.stderr.write(
            shown(
                f"fastverify doctor: NCCL's log (NCCL_DEBUG={os.environ['NCCL_DEBUG']}) goes to "
                f"{added['NCCL_DEBUG_FILE']}"
            )
            + "\n"
        )
    with _environ_with(added, os.environ), stdout_on_stderr():
        checks = run_doctor(quick=quick, env_file=env_file)
    summary = summarise(checks)
    if added:
        folder = os.path.dirname(added["NCCL_DEBUG_FILE"])
        if os.listdir(folder):
            summary["nccl_log"] = added["NCCL_DEBUG_FILE"]
        else:  # NCCL never started (no GPU, --quick): no log, no folder left behind
            os.rmdir(folder)
            summary["nccl_log"] = None
    sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n")
    return 1 if summary["verdict"] == "fail" else 0


__all__ = [
    "BUILDING",
    "CHECKS",
    "NO_GPU",
    "NO_NCCL",
    "PATCH_NOT_CHECKED",
    "PINNED_FLASHINFER",
    "SCHEMA",
    "SCHEMA_VERSION",
    "Check",
    "CheckSpec",
    "Outcome",
    "Status",
    "backends_to_probe",
    "match_torch_to_nvml",
    "one_line",
    "print_checks",
    "run_doctor",
    "run_doctor_json",
    "sample_trace",
    "summarise",
]
