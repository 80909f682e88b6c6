"""Doctor checks that need no GPU: versions, libraries, the env-file validator, a 2-rank gloo
tune trial and the trace analyzer on a built-in trace."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
from decimal import Decimal
from typing import Any

import orjson

from fastverify import __version__
from fastverify.analyze import analyze
from fastverify.doctor.core import (
    GLOO_TIMEOUT_S,
    NO_NCCL,
    PATCH_NOT_CHECKED,
    PINNED_FLASHINFER,
    CheckContext,
    Outcome,
    Status,
    _error_text,
    _out,
)
from fastverify.envfile import read_env_file
from fastverify.errors import UserError
from fastverify.nccl.version import find_libnccl, read_nccl_version
from fastverify.patch.targets import TARGETS, check_signature, resolve
from fastverify.registry import BACKENDS, BackendName
from fastverify.trace.load import load_trace
from fastverify.tune.sweep import run_trial
from fastverify.tune.trial import Op, TrialSpec


def check_versions(ctx: CheckContext) -> Outcome:
    """Python, torch and numpy versions (and what torch was built for)."""
    import numpy

    details: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "fastverify": __version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    if sys.version_info < (3, 11):
        return _out(
            Status.fail, f"Python {details['python']} is older than 3.11", "use Python >= 3.11 (./setup.sh)", **details
        )
    if ctx.quick:
        # --quick does not import torch (1-3 s): it says which torch is installed; the full doctor imports it
        version = _dist_version("torch")
        if version is None or importlib.util.find_spec("torch") is None:
            return _out(
                Status.fail,
                "torch is not installed",
                "run ./setup.sh (installs a CPU torch only where none imports)",
                **details,
            )
        details.update(torch=version, torch_imported=False)
        return _out(
            Status.ok,
            f"Python {details['python']}, torch {version} installed (not imported under --quick; "
            f"the full doctor imports it), numpy {numpy.__version__}",
            **details,
        )
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - a broken torch install is the finding
        return _out(
            Status.fail,
            f"torch not importable ({_error_text(err)})",
            "run ./setup.sh (installs a CPU torch only where none imports)",
            **details,
        )
    details.update(
        torch=torch.__version__, torch_cuda=torch.version.cuda, torch_distributed=torch.distributed.is_available()
    )
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    reason = f"Python {details['python']}, torch {torch.__version__} ({build}), numpy {numpy.__version__}"
    if not torch.distributed.is_available():
        return _out(
            Status.fail,
            reason + "; torch.distributed is not available",
            "install a torch built with distributed support",
            **details,
        )
    return _out(Status.ok, reason, **details)


def check_nccl_library(ctx: CheckContext) -> Outcome:
    """The libnccl this box would load (:func:`read_nccl_version`, no GPU needed)."""
    try:
        version = read_nccl_version()
    except UserError as err:
        return _out(Status.fail, str(err), "point NCCL_LIBRARY at a libnccl.so.2, or unset it")
    ctx.state["nccl_version"] = version
    if version is None:
        return _out(
            Status.warn,
            NO_NCCL,
            "install the NCCL your torch loads (the nvidia-nccl-cu12 wheel comes with a CUDA torch) "
            "or set NCCL_LIBRARY=/path/to/libnccl.so.2",
            candidates=find_libnccl(),
        )
    return _out(Status.ok, f"NCCL {version} ({version.library})", version=str(version), library=version.library)


_GOOD_LINE = "NCCL_P2P_LEVEL=SYS"
_BAD_LINE = "NCCL_P2P_LEVEL=sys"  # NCCL compares level names case-sensitively: it would ignore this


def check_env_file(ctx: CheckContext) -> Outcome:
    """Validate ``--env-file`` with the reader ``tune`` and ``launch`` use; without one, prove the
    validator accepts a known-good line and refuses a known-bad one."""
    version = ctx.nccl_version()
    rules = f"NCCL {version} rules" if version is not None else "the newest NCCL rules"
    if ctx.env_file is not None:
        try:
            settings = read_env_file(ctx.env_file, nccl_version=version)
        except UserError as err:
            text = str(err)
            if ": line " in text:
                fix = (
                    "fix or delete the line named (plain KEY=VALUE, allowed keys, values NCCL accepts), or "
                    "rewrite the file with `fastverify tune --write-env`"
                )
            elif "contradict" in text:  # settings valid one by one, not together (check_together)
                fix = "change one of the two settings named so that they agree, or drop one of them"
            else:
                fix = "give the path of a readable UTF-8 env file"
            return _out(Status.fail, str(err), fix, file=str(ctx.env_file))
        return _out(
            Status.ok,
            f"{ctx.env_file}: {len(settings)} setting(s) valid against {rules}",
            file=str(ctx.env_file),
            settings=settings,
        )
    good, bad = ctx.tmp / "good.env", ctx.tmp / "bad.env"
    good.write_text(f"# doctor: known good\n{_GOOD_LINE}\n")
    bad.write_text(f"# doctor: known bad\n{_BAD_LINE}\n")
    accepted = read_env_file(good, nccl_version=version)
    if accepted != {"NCCL_P2P_LEVEL": "SYS"}:
        return _out(Status.fail, f"validator read {_GOOD_LINE!r} as {accepted}", None)
    try:
        read_env_file(bad, nccl_version=version)
    except UserError as err:
        refusal = str(err)
    else:
        return _out(
            Status.fail,
            f"validator accepted the known-bad line {_BAD_LINE!r}",
            "the NCCL settings catalogue lost its case-sensitivity rule",
        )
    if "line 2" not in refusal:
        return _out(Status.fail, f"validator refused the known-bad line without naming line 2: {refusal}")
    return _out(
        Status.ok,
        f"validator accepts {_GOOD_LINE} and refuses {_BAD_LINE} (line 2), {rules}; "
        f"pass --env-file FILE to check a file",
        good=_GOOD_LINE,
        bad=_BAD_LINE,
        refusal=refusal,
    )


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def flashinfer_backends() -> dict[str, tuple]:
    """Registry backends whose module calls FlashInfer: name -> (module, its FlashInfer calls).
    A backend module that does not import is left out (its own check reports it)."""
    out: dict[str, tuple] = {}
    for info in BACKENDS:
        try:
            mod = importlib.import_module(info.module)
        except Exception:  # noqa: BLE001 - reported by backend_allreduce
            continue
        calls = tuple(c for c in getattr(mod, "EXTERNAL_CALLS", ()) if c.public.split(".")[0] == "flashinfer")
        if calls:
            out[info.name.value] = (mod, calls)
    return out


def check_flashinfer(ctx: CheckContext) -> Outcome:
    """FlashInfer importable with every name each registry backend that uses it calls, and its
    version vs the pinned one."""
    if not _installed("flashinfer"):
        return _out(
            Status.skipped,
            "flashinfer not installed: the FlashInfer backends are unavailable",
            f"on a GPU box: pip install flashinfer-python=={PINNED_FLASHINFER}",
        )
    version = _dist_version("flashinfer-python", "flashinfer")
    details: dict[str, Any] = {"version": version, "pinned": PINNED_FLASHINFER}
    if ctx.quick:
        details["imported"] = False
        reason = f"flashinfer {version or '(version unknown)'} installed (not imported with --quick)"
    else:
        from fastverify.backends import base  # lazy: torch

        per: dict[str, str] = {}
        missing: list[str] = []
        total = 0
        for name, (mod, calls) in flashinfer_backends().items():
            cap = base.library_status("flashinfer", "flashinfer-python", getattr(mod, "MIN_FLASHINFER", (0,)), calls)
            per[name] = cap.reason
            total += len(calls)
            if not cap.ok:
                missing.append(name)
            else:
                version = cap.reason.split()[-1]
        details.update(imported=True, external_calls=total, backends=per, version=version)
        if missing and len(missing) == len(per):
            return _out(
                Status.fail,
                f"{missing[0]}: {per[missing[0]]}",
                f"pip install flashinfer-python=={PINNED_FLASHINFER}",
                **details,
            )
        if missing:
            return _out(
                Status.warn,
                f"flashinfer {version}: {', '.join(missing)} unavailable ({missing[0]}: {per[missing[0]]})",
                f"pip install flashinfer-python=={PINNED_FLASHINFER}",
                **details,
            )
        reason = f"flashinfer {version} imports and has all {total} names the backends call ({', '.join(per)})"
    if version != PINNED_FLASHINFER:
        return _out(
            Status.warn,
            f"{reason}; fastverify is checked against {PINNED_FLASHINFER}",
            f"pip install flashinfer-python=={PINNED_FLASHINFER}",
            **details,
        )
    return _out(Status.ok, reason, **details)


def check_sglang(ctx: CheckContext) -> Outcome:
    """SGLang importable, its version, and whether the custom all-reduce backend's names exist."""
    if not _installed("sglang"):
        return _out(Status.skipped, "SGLang not installed: the custom_ar backend and the patch targets are not checked")
    version = _dist_version("sglang")
    if ctx.quick:
        return _out(
            Status.ok,
            f"SGLang {version or '(version unknown)'} installed (not imported with --quick)",
            version=version,
            imported=False,
        )
    try:
        mod = importlib.import_module("sglang")
    except Exception as err:  # noqa: BLE001 - SGLang failing inside its own import is the finding
        return _out(
            Status.fail,
            f"sglang not importable ({_error_text(err)})",
            "reinstall SGLang with the torch it was built for",
            version=version,
        )
    version = str(getattr(mod, "__version__", "") or version or "unknown")
    from fastverify.backends import base, sglang_custom_ar  # lazy: torch

    cap = base.library_status("sglang", "sglang", sglang_custom_ar.MIN_SGLANG, sglang_custom_ar.EXTERNAL_CALLS)
    return _out(
        Status.ok,
        f"SGLang {version} imports; custom_ar: {'ok' if cap.ok else cap.reason}",
        version=version,
        imported=True,
        custom_ar=cap.reason,
        custom_ar_ok=cap.ok,
    )


def check_sglang_patch_targets(ctx: CheckContext) -> Outcome:
    """Every target the SGLang patch may wrap (``fastverify.patch.targets.TARGETS``: methods and
    the layer boundary's module-level fusions), resolved and signature-checked in the installed
    SGLang by the patch's own rule: ok when all are there, warn when some are missing or differ (the
    patch then skips them, one line each)."""
    targets: dict[str, Any] = {}
    if _installed("sglang"):
        for target in TARGETS:
            try:
                _, fn, why = resolve(target, None)
                if why is None:
                    why = check_signature(fn, target)
            except Exception as err:  # noqa: BLE001 - reported per target
                why = f"import failed: {_error_text(err)}"
            targets[target.where] = "found" if why is None else why
        found = sum(v == "found" for v in targets.values())
        status = Status.ok if found == len(targets) else Status.warn
        return _out(
            status,
            f"{found} of {len(targets)} patch targets found in the installed SGLang",
            None if status is Status.ok else "the patch skips missing targets and leaves SGLang as it is",
            targets=targets,
        )
    return _out(Status.skipped, PATCH_NOT_CHECKED, targets=targets)


def check_gloo_allreduce(ctx: CheckContext) -> Outcome:
    """All-reduce + residual + RMSNorm across 2 gloo processes, checked against the torch
    reference: a tune trial (fresh worker processes, start-up and measurement timeouts)."""

    hidden = 64
    spec = TrialSpec(
        backend=BackendName.gloo.value,
        env={},
        world_size=2,
        device="cpu",
        dtype="bfloat16",
        hidden=hidden,
        sizes=((4 * hidden, 1), (32 * hidden, 1)),
        warmup=1,
        iters=3,
        op=Op.ALL_REDUCE_RESIDUAL_RMSNORM,
        label="doctor gloo",
    )
    result = run_trial(spec, timeout_s=GLOO_TIMEOUT_S, startup_timeout_s=GLOO_TIMEOUT_S)
    sizes = [
        {"numel": s.numel, "msg_bytes": s.msg_bytes, "median_us": s.median_us, "max_rel_err": s.max_rel_err}
        for s in result.sizes
    ]
    details = {
        "trial": result.status.value,
        "sizes": sizes,
        "clock": result.clock and result.clock.value,
        "seconds": round(result.finished_unix_s - result.started_unix_s, 3),
    }
    if not result.ok:
        return _out(
            Status.fail,
            f"gloo trial {result.status.value}: {result.reason}",
            "check that 127.0.0.1 TCP ports can be opened and torch.distributed works",
            **details,
        )
    worst = max(s.max_rel_err for s in result.sizes)
    return _out(
        Status.ok,
        f"2 gloo ranks: all-reduce + residual + RMSNorm matches the torch reference "
        f"(max relative error {worst:.2g}, {len(sizes)} sizes)",
        **details,
    )


# The built-in trace: two profiler steps, each a GEMM, an NCCL all-reduce and a device-to-host copy,
# in Kineto's format (µs with ns fractions). Integers in ns; the file holds them as µs.
_GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1_execute_segment_k_off_kernel"
_ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
_MEMCPY = "Memcpy DtoH (Device -> Pinned)"
_AR_NELEMS = 4 * 7168  # a Kimi-K2 verify message: 4 tokens × hidden, bf16
_SAMPLE_STEPS = (  # (step start, gemm dur, all-reduce dur, memcpy dur), ns
    (1_000_000, 30_125, 12_345, 2_500),
    (1_200_000, 29_870, 7_891, 2_436),
)


def _us(ns: int) -> float:
    return ns / 1000  # ns with at most 3 decimals of µs: the shortest repr is exact


def sample_trace() -> dict:
    """The Chrome trace the ``trace_analyzer`` check writes and loads (deterministic)."""
    events: list[dict] = [
        {
            "ph": "X",
            "cat": "python_function",
            "name": "doctor.py(1): <module>",
            "pid": 1,
            "tid": 1,
            "ts": _us(900_000),
            "dur": _us(700_000),
        }
    ]
    corr = 100
    for i, (start, gemm, ar, copy) in enumerate(_SAMPLE_STEPS):
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{i}",
                "pid": 1,
                "tid": 1,
                "ts": _us(start),
                "dur": _us(150_000),
                "args": {},
            }
        )
        gpu_t = start + 5_250
        for name, cat, dur, extra in (
            (_GEMM, "kernel", gemm, {}),
            (
                _ALLREDUCE,
                "kernel",
                ar,
                {"In msg nelems": _AR_NELEMS, "dtype": "BFloat16", "Collective name": "allreduce"},
            ),
            (_MEMCPY, "gpu_memcpy", copy, {"bytes": 1024}),
        ):
            corr += 1
            launch = start + 1_000 * (corr % 10 + 1)
            events.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel" if cat == "kernel" else "cudaMemcpyAsync",
                    "pid": 1,
                    "tid": 1,
                    "ts": _us(launch),
                    "dur": _us(3_125),
                    "args": {"correlation": corr},
                }
            )
            events.append(
                {
                    "ph": "X",
                    "cat": cat,
                    "name": name,
                    "pid": 0,
                    "tid": 7,
                    "ts": _us(gpu_t),
                    "dur": _us(dur),
                    "args": {"correlation": corr, "stream": 7, "device": 0, **extra},
                }
            )
            gpu_t += dur + 1_375
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "doctor sample GPU"}],
        "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2},
        "traceEvents": events,
        "baseTimeNanoseconds": 1_700_000_000_000_000_000,
    }


def check_trace_analyzer(ctx: CheckContext) -> Outcome:
    """Write the built-in trace, load it with the profile loader and check that the analyzer finds
    both all-reduces and their time to the ns."""

    path = ctx.tmp / "doctor-TP-0.trace.json"
    path.write_bytes(orjson.dumps(sample_trace()))
    body = analyze(load_trace(path))
    rank, by_size = body["ranks"][0], body["allreduce_by_msg_size"]
    want_count = len(_SAMPLE_STEPS)
    want_us = float(Decimal(sum(s[2] for s in _SAMPLE_STEPS)) / 1000)
    got = {
        "allreduce_count": rank["allreduce_count"],
        "allreduce_us": rank["allreduce_kernel_sum_us"],
        "compute_count": rank["counts"]["compute"],
        "memory_count": rank["counts"]["memory"],
        "steps": len(rank["steps"]),
        "msg_bytes": [r["msg_bytes"] for r in by_size],
    }
    want = {
        "allreduce_count": want_count,
        "allreduce_us": want_us,
        "compute_count": want_count,
        "memory_count": want_count,
        "steps": want_count,
        "msg_bytes": [_AR_NELEMS * 2],
    }
    wrong = [f"{k} {got[k]} (expected {want[k]})" for k in want if got[k] != want[k]]
    if wrong:
        return _out(
            Status.fail,
            "trace analyzer: " + "; ".join(wrong),
            "a regression in fastverify/trace or fastverify/analyze.py: run the test suite",
            got=got,
            expected=want,
        )
    return _out(
        Status.ok,
        f"analyzer found {want_count} all-reduces, {want_us:.3f} µs exactly, in {want_count} steps of a built-in trace",
        **got,
    )
