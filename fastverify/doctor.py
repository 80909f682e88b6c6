"""``fastverify doctor``: check a box end to end before tuning, and exercise every GPU code path.

Each check is one function in :data:`CHECKS`, a table of ``(name, function, needs_gpu, quick)``
run in order. A check returns an outcome (status, one-line reason, one-line fix, JSON-able
details); :func:`run_doctor` times it and turns any exception it raises into a ``fail`` whose
reason is the exception's first line, never a traceback, so one broken check never stops the
others. GPU checks are ``skipped`` with the reason when torch sees no CUDA device; ``--quick``
runs only the checks marked quick (versions, library presence, the env-file validator, the
analyzer on a built-in trace: no processes, no GPU work, a few seconds).

Nothing here re-implements what the rest of fastverify does: the gloo check is a tune trial
(:func:`fastverify.tune.sweep.run_trial`, checked against the torch reference in its workers), the
CUDA-graph checks run the live runner's verify forward (:class:`fastverify.live.forward.TPVerifyModel`)
and its trace export, traces go through the loader and analyzer of ``fastverify profile``, and the
backends are probed and built by :mod:`fastverify.backends`.

Nothing is installed at run time. FlashInfer may JIT-compile its norm kernel the first time it
runs on a GPU architecture (minutes without ``flashinfer-jit-cache``); that is FlashInfer's
build, reported in the check's time.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import orjson

from fastverify.errors import UserError

SCHEMA = "fastverify.doctor"
SCHEMA_VERSION = 1

NO_GPU = "no CUDA GPU (torch.cuda.is_available() is False)"
PINNED_FLASHINFER = "0.7.4"  # pyproject.toml [gpu] extra: the version the backend signature tests check
PATCH_NOT_CHECKED = "SGLang not installed: the patch targets of `fastverify launch` are not checked"
NO_NCCL = "no libnccl found: NCCL settings are checked against the newest rules"

# What the SGLang patch (fastverify/patch/install.py) wraps: module, class, attribute.
SGLANG_PATCH_TARGETS: tuple[tuple[str, str, str], ...] = (
    ("sglang.srt.distributed.parallel_state", "GroupCoordinator", "all_reduce"),
    ("sglang.srt.managers.tp_worker", "TpModelWorker", "forward_batch_generation"),
    ("sglang.srt.layers.layernorm", "RMSNorm", "forward_with_allreduce_fusion"),
)

GLOO_TIMEOUT_S = 60.0
TRIAL_TIMEOUT_S = 60.0  # measurement limit of one multi-GPU backend trial
TRIAL_STARTUP_S = 120.0  # its start-up limit (interpreter, torch, CUDA, NCCL, FlashInfer import)
P2P_TIMEOUT_S = 60.0
GRAPH_REPLAYS = 20
HOOK_CALLS = 200
HOOK_REPEATS = 5
VERIFY_TOKENS = (4, 32, 128)  # rows of the 3-size probe: batch 1, 8, 32 × 4 draft tokens
PROBE_MODEL = "kimi-k2"  # hidden size of the multi-GPU probes (the verify messages fastverify targets)


class Status(str, Enum):
    ok = "ok"
    warn = "warn"
    fail = "fail"
    skipped = "skipped"


@dataclass(frozen=True)
class Check:
    """The outcome of one check. ``reason`` and ``fix`` are one line each (``fix`` None when there
    is nothing to do); ``seconds`` is the check's wall time; ``details`` is JSON-able."""

    name: str
    status: Status
    reason: str
    fix: str | None = None
    seconds: float = 0.0
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"name": self.name, "status": self.status.value, "reason": self.reason, "fix": self.fix,
                "seconds": round(self.seconds, 3), "details": self.details}


@dataclass(frozen=True)
class Outcome:
    """What a check function returns; :func:`run_doctor` adds the name and the time."""

    status: Status
    reason: str
    fix: str | None = None
    details: dict = field(default_factory=dict)


def _out(status: Status, reason: str, fix: str | None = None, **details: Any) -> Outcome:
    return Outcome(status, reason, fix, details)


@dataclass(frozen=True)
class CheckSpec:
    """One row of :data:`CHECKS`: run ``fn(ctx)`` as check ``name``; ``needs_gpu`` checks are
    skipped without CUDA; ``quick`` checks are the only ones ``--quick`` runs."""

    name: str
    fn: Callable[["_Context"], Outcome]
    needs_gpu: bool
    quick: bool


# --- running -----------------------------------------------------------------------------------


def one_line(text: str) -> str:
    """``text`` on one line: its first non-blank line, whitespace collapsed."""
    for line in str(text).splitlines():
        if line.strip():
            return " ".join(line.split())
    return ""


def _error_text(err: BaseException) -> str:
    msg = one_line(str(err))
    if isinstance(err, UserError):
        return msg or type(err).__name__
    return f"{type(err).__name__}: {msg}" if msg else type(err).__name__


def _jsonable(value: Any) -> Any:
    """``value`` with tuples as lists, non-string keys as strings and anything else JSON cannot
    hold as its ``str``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, Enum):
        return _jsonable(value.value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return str(value)


class _Context:
    """What the checks share: the options, whether CUDA is usable, and GPU state built once (the
    tiny model, a 1-rank NCCL group, P2P and backend results). :meth:`close` releases it."""

    def __init__(self, *, quick: bool, env_file: str | None) -> None:
        self.quick = quick
        self.env_file = env_file
        self.state: dict[str, Any] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._group = False
        self._gpu: tuple[str | None, int] | None = None

    def _detect_gpu(self) -> tuple[str | None, int]:
        # On first use, not at start: importing torch is part of the first check's time.
        if self._gpu is None:
            try:
                import torch

                self._gpu = (None, torch.cuda.device_count()) if torch.cuda.is_available() else (NO_GPU, 0)
            except Exception as err:  # noqa: BLE001 - no torch means no GPU checks, said in the reason
                self._gpu = (f"no CUDA GPU (torch not importable: {_error_text(err)})", 0)
        return self._gpu

    @property
    def gpu_reason(self) -> str | None:
        """Why GPU checks are skipped; None when CUDA is usable."""
        return self._detect_gpu()[0]

    @property
    def gpu_count(self) -> int:
        return self._detect_gpu()[1]

    @property
    def tmp(self) -> Path:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fastverify-doctor-")
        return Path(self._tmp.name)

    def nccl_version(self):
        """The libnccl version (:func:`read_nccl_version`), None when none is found or readable."""
        if "nccl_version" not in self.state:
            from fastverify.nccl.version import read_nccl_version

            try:
                self.state["nccl_version"] = read_nccl_version()
            except UserError:
                self.state["nccl_version"] = None
        return self.state["nccl_version"]

    def process_group(self):
        """A 1-rank NCCL default group on GPU 0 (created once; destroyed by :meth:`close`)."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            torch.cuda.set_device(0)
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                    device_id=torch.device("cuda", 0))
            self._group = True
        return dist

    def tiny_model(self):
        """The tiny preset's verify forward at world size 1 on GPU 0 (built once)."""
        if "model" not in self.state:
            import torch

            from fastverify.live.config import load_model_config
            from fastverify.live.forward import TPVerifyModel

            torch.cuda.set_device(0)
            self.state["model"] = TPVerifyModel(load_model_config("tiny"), tp=1, rank=0, batch=1, draft_tokens=4,
                                                device=torch.device("cuda", 0), dtype=torch.bfloat16)
        return self.state["model"]

    def close(self) -> None:
        self.state.pop("model", None)
        if self._group:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown of a 1-rank group; nothing to report
                pass
            self._group = False
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


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
    ctx = _Context(quick=quick, env_file=env_file)
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
                    outcome = _out(Status.fail, f"check raised {_error_text(err)}",
                                   "report this with the output of `fastverify doctor --json`")
            out.append(Check(
                name=spec.name,
                status=Status(outcome.status),
                reason=one_line(outcome.reason),
                fix=one_line(outcome.fix) if outcome.fix else None,
                seconds=time.perf_counter() - t0,
                details=_jsonable(outcome.details),
            ))
    finally:
        ctx.close()
    return out


def summarise(checks: list[Check]) -> dict:
    """The JSON document of ``fastverify doctor --json``: counts per status, the verdict (``fail``
    if any check failed, else ``warn`` if any warned, else ``ok``), total seconds and every check."""
    counts = {s.value: sum(1 for c in checks if c.status is s) for s in Status}
    verdict = "fail" if counts["fail"] else "warn" if counts["warn"] else "ok"
    from fastverify import __version__

    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "fastverify_version": __version__,
        "verdict": verdict,
        "counts": counts,
        "seconds": round(sum(c.seconds for c in checks), 3),
        "checks": [c.as_dict() for c in checks],
    }


_STYLE = {Status.ok: "green", Status.warn: "yellow", Status.fail: "bold red", Status.skipped: "dim"}


def print_checks(checks: list[Check], console) -> None:
    """A table of the checks (status, seconds, reason, fix) and a summary line on ``console``
    (a ``rich.console.Console``)."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title="fastverify doctor", title_justify="left")
    for col, kw in (("check", {"no_wrap": True}), ("status", {"no_wrap": True}), ("s", {"justify": "right"}),
                    ("reason", {"overflow": "fold"}), ("fix", {"overflow": "fold"})):
        t.add_column(col, **kw)
    for c in checks:
        t.add_row(Text(c.name), Text(c.status.value, style=_STYLE[c.status]), f"{c.seconds:.1f}",
                  Text(c.reason), Text(c.fix or ""))
    console.print(t)
    s = summarise(checks)
    counts = ", ".join(f"{n} {k}" for k, n in s["counts"].items())
    console.print(Text(f"doctor: {counts} in {s['seconds']:.1f} s; verdict {s['verdict']}",
                       style=_STYLE[Status(s["verdict"])]))


# --- CPU checks --------------------------------------------------------------------------------


def check_versions(ctx: _Context) -> Outcome:
    """Python, torch and numpy versions (and what torch was built for)."""
    import numpy

    from fastverify import __version__

    details: dict[str, Any] = {"python": platform.python_version(), "numpy": numpy.__version__,
                               "fastverify": __version__, "platform": platform.platform(),
                               "cpu_count": os.cpu_count()}
    if sys.version_info < (3, 11):
        return _out(Status.fail, f"Python {details['python']} is older than 3.11", "use Python >= 3.11 (./setup.sh)",
                    **details)
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - a broken torch install is the finding
        return _out(Status.fail, f"torch not importable ({_error_text(err)})",
                    "run ./setup.sh (installs a CPU torch only where none imports)", **details)
    details.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                   torch_distributed=torch.distributed.is_available())
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    reason = f"Python {details['python']}, torch {torch.__version__} ({build}), numpy {numpy.__version__}"
    if not torch.distributed.is_available():
        return _out(Status.fail, reason + "; torch.distributed is not available",
                    "install a torch built with distributed support", **details)
    return _out(Status.ok, reason, **details)


def check_nccl_library(ctx: _Context) -> Outcome:
    """The libnccl this box would load (:func:`read_nccl_version`, no GPU needed)."""
    from fastverify.nccl.version import find_libnccl, read_nccl_version

    try:
        version = read_nccl_version()
    except UserError as err:
        return _out(Status.fail, str(err), "point NCCL_LIBRARY at a libnccl.so.2, or unset it")
    ctx.state["nccl_version"] = version
    if version is None:
        return _out(Status.warn, NO_NCCL,
                    "install the NCCL your torch loads (the nvidia-nccl-cu12 wheel comes with a CUDA torch) "
                    "or set NCCL_LIBRARY=/path/to/libnccl.so.2", candidates=find_libnccl())
    return _out(Status.ok, f"NCCL {version} ({version.library})", version=str(version), library=version.library)


_GOOD_LINE = "NCCL_P2P_LEVEL=SYS"
_BAD_LINE = "NCCL_P2P_LEVEL=sys"  # NCCL compares level names case-sensitively: it would ignore this


def check_env_file(ctx: _Context) -> Outcome:
    """Validate ``--env-file`` with the reader ``tune`` and ``launch`` use; without one, prove the
    validator accepts a known-good line and refuses a known-bad one."""
    from fastverify.tune.envfile import read_env_file

    version = ctx.nccl_version()
    rules = f"NCCL {version} rules" if version is not None else "the newest NCCL rules"
    if ctx.env_file is not None:
        try:
            settings = read_env_file(ctx.env_file, nccl_version=version)
        except UserError as err:
            fix = ("fix or delete the line named (plain KEY=VALUE, allowed keys, values NCCL accepts), or rewrite "
                   "the file with `fastverify tune --write-env`") if ": line " in str(err) else \
                "give the path of a readable UTF-8 env file"
            return _out(Status.fail, str(err), fix, file=str(ctx.env_file))
        return _out(Status.ok, f"{ctx.env_file}: {len(settings)} setting(s) valid against {rules}",
                    file=str(ctx.env_file), settings=settings)
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
        return _out(Status.fail, f"validator accepted the known-bad line {_BAD_LINE!r}",
                    "the NCCL settings catalogue lost its case-sensitivity rule")
    if "line 2" not in refusal:
        return _out(Status.fail, f"validator refused the known-bad line without naming line 2: {refusal}")
    return _out(Status.ok, f"validator accepts {_GOOD_LINE} and refuses {_BAD_LINE} (line 2), {rules}; "
                f"pass --env-file FILE to check a file", good=_GOOD_LINE, bad=_BAD_LINE, refusal=refusal)


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


def check_flashinfer(ctx: _Context) -> Outcome:
    """FlashInfer importable with every name the backends call, and its version vs the pinned one."""
    if not _installed("flashinfer"):
        return _out(Status.skipped, "flashinfer not installed: the pcie_ipc and fused backends are unavailable",
                    f"on a GPU box: pip install flashinfer-python=={PINNED_FLASHINFER}")
    version = _dist_version("flashinfer-python", "flashinfer")
    details: dict[str, Any] = {"version": version, "pinned": PINNED_FLASHINFER}
    if ctx.quick:
        details["imported"] = False
        reason = f"flashinfer {version or '(version unknown)'} installed (not imported with --quick)"
    else:
        from fastverify.backends import base, flashinfer_fused, flashinfer_pcie_ipc

        needed = tuple(flashinfer_pcie_ipc.EXTERNAL_CALLS) + tuple(flashinfer_fused.EXTERNAL_CALLS)
        cap = base.library_status("flashinfer", "flashinfer-python", flashinfer_pcie_ipc.MIN_FLASHINFER, needed)
        details.update(imported=True, external_calls=len(needed))
        if not cap.ok:
            return _out(Status.fail, cap.reason, f"pip install flashinfer-python=={PINNED_FLASHINFER}", **details)
        version = cap.reason.split()[-1]
        details["version"] = version
        reason = f"flashinfer {version} imports and has all {len(needed)} names the backends call"
    if version != PINNED_FLASHINFER:
        return _out(Status.warn, f"{reason}; fastverify is checked against {PINNED_FLASHINFER}",
                    f"pip install flashinfer-python=={PINNED_FLASHINFER}", **details)
    return _out(Status.ok, reason, **details)


def check_sglang(ctx: _Context) -> Outcome:
    """SGLang importable, its version, and whether the custom all-reduce backend's names exist."""
    if not _installed("sglang"):
        return _out(Status.skipped, "SGLang not installed: the custom_ar backend and the patch targets are not checked")
    version = _dist_version("sglang")
    if ctx.quick:
        return _out(Status.ok, f"SGLang {version or '(version unknown)'} installed (not imported with --quick)",
                    version=version, imported=False)
    try:
        mod = importlib.import_module("sglang")
    except Exception as err:  # noqa: BLE001 - SGLang failing inside its own import is the finding
        return _out(Status.fail, f"sglang not importable ({_error_text(err)})",
                    "reinstall SGLang with the torch it was built for", version=version)
    version = str(getattr(mod, "__version__", "") or version or "unknown")
    from fastverify.backends import base, sglang_custom_ar

    cap = base.library_status("sglang", "sglang", sglang_custom_ar.MIN_SGLANG, sglang_custom_ar.EXTERNAL_CALLS)
    return _out(Status.ok, f"SGLang {version} imports; custom_ar: {'ok' if cap.ok else cap.reason}",
                version=version, imported=True, custom_ar=cap.reason, custom_ar_ok=cap.ok)


def check_sglang_patch_targets(ctx: _Context) -> Outcome:
    """The attributes the SGLang patch (``fastverify launch``) wraps, found by import + hasattr: ok
    when all are there, warn when some are missing (the patch then skips them, one log line each)."""
    targets: dict[str, Any] = {}
    if _installed("sglang"):
        for module, cls, attr in SGLANG_PATCH_TARGETS:
            key = f"{module}.{cls}.{attr}"
            try:
                obj = getattr(importlib.import_module(module), cls, None)
            except Exception as err:  # noqa: BLE001 - reported per target
                targets[key] = f"import failed: {_error_text(err)}"
                continue
            targets[key] = "found" if obj is not None and hasattr(obj, attr) else \
                ("missing" if obj is not None else f"class {cls} missing")
        found = sum(v == "found" for v in targets.values())
        status = Status.ok if found == len(targets) else Status.warn
        return _out(status, f"{found} of {len(targets)} patch targets found in the installed SGLang",
                    None if status is Status.ok else "the patch skips missing targets and leaves SGLang as it is",
                    targets=targets)
    return _out(Status.skipped, PATCH_NOT_CHECKED, targets=targets)


def check_gloo_allreduce(ctx: _Context) -> Outcome:
    """All-reduce + residual + RMSNorm across 2 gloo processes, checked against the torch
    reference: a tune trial (fresh worker processes, start-up and measurement timeouts)."""
    from fastverify.tune.sweep import run_trial
    from fastverify.tune.trial import Op, TrialSpec

    hidden = 64
    spec = TrialSpec(backend="gloo", env={}, world_size=2, device="cpu", dtype="bfloat16", hidden=hidden,
                     sizes=((4 * hidden, 1), (32 * hidden, 1)), warmup=1, iters=3,
                     op=Op.ALL_REDUCE_RESIDUAL_RMSNORM, label="doctor gloo")
    result = run_trial(spec, timeout_s=GLOO_TIMEOUT_S, startup_timeout_s=GLOO_TIMEOUT_S)
    sizes = [{"numel": s.numel, "msg_bytes": s.msg_bytes, "median_us": s.median_us, "max_rel_err": s.max_rel_err}
             for s in result.sizes]
    details = {"trial": result.status.value, "sizes": sizes, "clock": result.clock and result.clock.value,
               "seconds": round(result.finished_unix_s - result.started_unix_s, 3)}
    if not result.ok:
        return _out(Status.fail, f"gloo trial {result.status.value}: {result.reason}",
                    "check that 127.0.0.1 TCP ports can be opened and torch.distributed works", **details)
    worst = max(s.max_rel_err for s in result.sizes)
    return _out(Status.ok, f"2 gloo ranks: all-reduce + residual + RMSNorm matches the torch reference "
                f"(max relative error {worst:.2g}, {len(sizes)} sizes)", **details)


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
    events: list[dict] = [{"ph": "X", "cat": "python_function", "name": "doctor.py(1): <module>", "pid": 1, "tid": 1,
                           "ts": _us(900_000), "dur": _us(700_000)}]
    corr = 100
    for i, (start, gemm, ar, copy) in enumerate(_SAMPLE_STEPS):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": 1, "tid": 1,
                       "ts": _us(start), "dur": _us(150_000), "args": {}})
        gpu_t = start + 5_250
        for name, cat, dur, extra in ((_GEMM, "kernel", gemm, {}),
                                      (_ALLREDUCE, "kernel", ar, {"In msg nelems": _AR_NELEMS, "dtype": "BFloat16",
                                                                   "Collective name": "allreduce"}),
                                      (_MEMCPY, "gpu_memcpy", copy, {"bytes": 1024})):
            corr += 1
            launch = start + 1_000 * (corr % 10 + 1)
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel" if cat == "kernel" else
                           "cudaMemcpyAsync", "pid": 1, "tid": 1, "ts": _us(launch), "dur": _us(3_125),
                           "args": {"correlation": corr}})
            events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": _us(gpu_t), "dur": _us(dur),
                           "args": {"correlation": corr, "stream": 7, "device": 0, **extra}})
            gpu_t += dur + 1_375
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "doctor sample GPU"}],
            "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2}, "traceEvents": events,
            "baseTimeNanoseconds": 1_700_000_000_000_000_000}


def check_trace_analyzer(ctx: _Context) -> Outcome:
    """Write the built-in trace, load it with the profile loader and check that the analyzer finds
    both all-reduces and their time to the ns."""
    from fastverify.analyze import analyze
    from fastverify.trace.load import load_trace

    path = ctx.tmp / "doctor-TP-0.trace.json"
    path.write_bytes(orjson.dumps(sample_trace()))
    body = analyze(load_trace(path))
    rank, by_size = body["ranks"][0], body["allreduce_by_msg_size"]
    want_count = len(_SAMPLE_STEPS)
    want_us = float(Decimal(sum(s[2] for s in _SAMPLE_STEPS)) / 1000)
    got = {"allreduce_count": rank["allreduce_count"], "allreduce_us": rank["allreduce_kernel_sum_us"],
           "compute_count": rank["counts"]["compute"], "memory_count": rank["counts"]["memory"],
           "steps": len(rank["steps"]), "msg_bytes": [r["msg_bytes"] for r in by_size]}
    want = {"allreduce_count": want_count, "allreduce_us": want_us, "compute_count": want_count,
            "memory_count": want_count, "steps": want_count, "msg_bytes": [_AR_NELEMS * 2]}
    wrong = [f"{k} {got[k]} (expected {want[k]})" for k in want if got[k] != want[k]]
    if wrong:
        return _out(Status.fail, "trace analyzer: " + "; ".join(wrong), "a regression in fastverify/trace or "
                    "fastverify/analyze.py: run the test suite", got=got, expected=want)
    return _out(Status.ok, f"analyzer found {want_count} all-reduces, {want_us:.3f} µs exactly, "
                f"in {want_count} steps of a built-in trace", **got)


# --- GPU checks --------------------------------------------------------------------------------


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - optional fact; the NVML check reports NVML problems
        return None


def check_cuda(ctx: _Context) -> Outcome:
    """CUDA runtime torch was built with, the driver, and the GPUs torch sees."""
    import torch

    gpus = [{"index": i, "name": torch.cuda.get_device_name(i),
             "sm": "{}{}".format(*torch.cuda.get_device_capability(i)),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(ctx.gpu_count)]
    driver = _driver_version()
    names = sorted({g["name"] for g in gpus})
    return _out(Status.ok, f"CUDA {torch.version.cuda} (torch), driver {driver or 'unknown'}, {len(gpus)} GPU(s): "
                f"{', '.join(names)} (SM{gpus[0]['sm']})", cuda=torch.version.cuda, driver=driver, gpus=gpus)


def check_torch_nccl(ctx: _Context) -> Outcome:
    """The NCCL torch loads (``torch.cuda.nccl.version()``), against the libnccl fastverify reads."""
    import torch

    try:
        v = torch.cuda.nccl.version()
    except Exception as err:  # noqa: BLE001 - torch built without NCCL raises
        return _out(Status.fail, f"torch has no NCCL ({_error_text(err)})", "install a CUDA torch built with NCCL")
    # (major, minor, patch) or (major, minor, patch, suffix) (torch/cuda/nccl.py::version)
    loaded = ".".join(map(str, v[:3])) if isinstance(v, tuple) else str(v)
    read = ctx.nccl_version()
    details = {"torch_nccl": loaded, "torch_nccl_raw": str(v), "library": None if read is None else str(read),
               "library_path": None if read is None else read.library}
    if read is None:
        return _out(Status.warn, f"torch loads NCCL {loaded}; fastverify found no libnccl to read, so NCCL settings "
                    "are checked against the newest rules", "set NCCL_LIBRARY=/path/to/libnccl.so.2", **details)
    if str(read) != loaded:
        return _out(Status.warn, f"torch loads NCCL {loaded} but fastverify reads {read} ({read.library}): "
                    "settings are checked against the wrong version",
                    "set NCCL_LIBRARY to the libnccl torch loads", **details)
    return _out(Status.ok, f"torch loads NCCL {loaded}, the same as fastverify reads", **details)


def check_nvml_topology(ctx: _Context) -> Outcome:
    """The GPU topology from NVML (what ``fastverify topo`` reads)."""
    from fastverify.topo.nvml import read_nvml_topology

    try:
        topo = read_nvml_topology()
    except UserError as err:
        return _out(Status.fail, str(err), "install the NVIDIA driver's NVML (libnvidia-ml) and nvidia-ml-py")
    ctx.state["topology"] = topo
    pairs = topo.pairs_by_type()
    kinds = ", ".join(f"{k} {len(v)}" for k, v in pairs.items()) or "no pairs (one GPU)"
    refused = sum(1 for v in list(topo.p2p_read.values()) + list(topo.p2p_write.values()) if v is False)
    reason = f"{len(topo.gpus)} GPU(s) via {topo.source}; pairs: {kinds}"
    if refused:
        return _out(Status.warn, f"{reason}; NVML refuses P2P for {refused} direction(s)",
                    "see `fastverify topo` for why and what to set", **topo.as_dict())
    return _out(Status.ok, reason, **topo.as_dict())


def _median_us(times_ms: list[float]) -> float:
    return round(statistics.median(times_ms) * 1000, 3)


def check_cuda_graph(ctx: _Context) -> Outcome:
    """Capture the tiny preset's verify forward (world size 1) in a CUDA graph, replay it, compare
    with the eager result and time both with CUDA events."""
    import torch

    from fastverify.backends import check_close

    model = ctx.tiny_model()
    eager_ms = []
    for i in range(3 + 5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        eager = model.forward()
        e1.record()
        e1.synchronize()
        if i >= 3:
            eager_ms.append(e0.elapsed_time(e1))
    from fastverify.cudagraph import capture_cuda_graph

    graph, out = capture_cuda_graph(model.forward, warmup=2)
    replay_ms = []
    for _ in range(GRAPH_REPLAYS):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        replay_ms.append(e0.elapsed_time(e1))
    ok, rel = check_close(out, eager.float(), torch.bfloat16)
    del graph
    details = {"tokens": model.tokens, "eager_us": _median_us(eager_ms), "replay_us": _median_us(replay_ms),
               "replays": GRAPH_REPLAYS, "replay_vs_eager_rel_err": rel, "clock": "cuda_events"}
    if not ok:
        return _out(Status.fail, f"CUDA-graph replay differs from the eager forward (relative error {rel:.3g})",
                    "report this: graph capture changed the result", **details)
    return _out(Status.ok, f"tiny verify forward ({model.tokens} tokens): graph replay {details['replay_us']:.1f} µs, "
                f"eager {details['eager_us']:.1f} µs (CUDA events, median), replay = eager", **details)


def check_profiler_trace(ctx: _Context) -> Outcome:
    """Record the live runner's CUDA-graph replay trace (torch.profiler) of the tiny forward and
    read it with the trace analyzer: the forward's kernels must be found."""
    import torch

    from fastverify.analyze import analyze_rank
    from fastverify.live.runner import TRACE_REPLAYS, _export_trace
    from fastverify.trace.load import load_trace

    model = ctx.tiny_model()
    dist = ctx.process_group()
    path = _export_trace(model, 0, str(ctx.tmp), torch, dist)
    ranks = load_trace(path)
    r = analyze_rank(ranks[0])
    counts = r["counts"]
    details = {"events": r["events"], "counts": counts, "steps": len(r["steps"]), "step_source":
               ranks[0].meta.get("step_source"), "window_us_median": (r["step_median"] or {}).get("window_us"),
               "top_kernels": [k["name"][:100] for k in r["top_kernels"][:5]], "replays": TRACE_REPLAYS}
    if r["events"] == 0 or counts["compute"] == 0:
        return _out(Status.fail, f"the trace of {TRACE_REPLAYS} graph replays holds {r['events']} GPU events, "
                    f"{counts['compute']} compute kernels", "torch.profiler recorded no kernels under CUDA-graph "
                    "replay: check the torch/CUPTI install", **details)
    if counts["unknown_comm"]:
        return _out(Status.warn, f"{r['events']} kernels found, {counts['unknown_comm']} look collective but match "
                    "no rule", "add the names to fastverify/trace/classify.py", **details)
    return _out(Status.ok, f"{r['events']} GPU events ({counts['compute']} compute) in {len(r['steps'])} profiler "
                f"steps of the graph replay; median step window {details['window_us_median']} µs", **details)


def check_flashinfer_norm(ctx: _Context) -> Outcome:
    """``flashinfer.norm.fused_add_rmsnorm`` (what the pcie_ipc backend calls) against the fp32
    torch reference on random data."""
    if not _installed("flashinfer"):
        return _out(Status.skipped, "flashinfer not installed", f"pip install flashinfer-python=={PINNED_FLASHINFER}")
    import torch

    from fastverify.backends import check_close, reference_residual_rmsnorm
    from fastverify.backends.flashinfer_pcie_ipc import FUSED_ADD_RMSNORM

    fn = FUSED_ADD_RMSNORM.resolve()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, eps = 32, 7168, 1e-6
    results: dict[str, Any] = {}
    worst_fail = None
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
        residual = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)
        want_norm, want_res = reference_residual_rmsnorm([x], residual, weight, eps)
        out, res = x.clone(), residual.clone()
        try:
            fn(**FUSED_ADD_RMSNORM.kwargs(input=out, residual=res, weight=weight, eps=eps, enable_pdl=False))
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - fp32 may be outside FlashInfer's dtype dispatch
            if dtype is torch.bfloat16:
                raise
            results[name] = {"supported": False, "error": _error_text(err)[:200]}
            continue
        ok_n, rel_n = check_close(out, want_norm, dtype)
        ok_r, rel_r = check_close(res, want_res, dtype)
        results[name] = {"supported": True, "rel_err_norm": rel_n, "rel_err_residual": rel_r, "ok": ok_n and ok_r}
        if not (ok_n and ok_r) and worst_fail is None:
            worst_fail = f"{name}: relative error {max(rel_n, rel_r):.3g} (tolerance {_tolerance(dtype):.3g})"
    details = {"tokens": tokens, "hidden": hidden, "eps": eps, "reference": "fp32 torch", "results": results}
    if worst_fail:
        return _out(Status.fail, f"fused_add_rmsnorm differs from the fp32 reference: {worst_fail}",
                    "do not use the pcie_ipc backend's FlashInfer norm (option norm=torch) until fixed", **details)
    parts = [f"{k} rel err {v['rel_err_norm']:.2g}" if v["supported"] else f"{k} not supported by this kernel"
             for k, v in results.items()]
    return _out(Status.ok, "fused_add_rmsnorm vs fp32 reference: " + ", ".join(parts), **details)


def _tolerance(dtype) -> float:
    from fastverify.backends import TOLERANCE

    return TOLERANCE[dtype]


def check_hook_overhead(ctx: _Context) -> Outcome:
    """Host time per ``dist.all_reduce`` on a 1-rank NCCL group, with and without the region timer
    the live runner wraps around every collective (two CUDA events)."""
    import torch

    from fastverify.events import EventClass
    from fastverify.live.forward import ALLREDUCE
    from fastverify.live.runner import _CudaEventRecorder

    from fastverify.live.config import load_model_config

    dist = ctx.process_group()
    x = torch.ones(4, load_model_config("tiny").hidden_size, dtype=torch.bfloat16, device="cuda")  # 4 draft tokens
    nbytes = x.numel() * x.element_size()

    def loop(hooked: bool) -> float:
        rec = _CudaEventRecorder(torch)
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(HOOK_CALLS):
            if hooked:
                with rec.region(ALLREDUCE, EventClass.ALLREDUCE, "doctor.allreduce", nbytes):
                    dist.all_reduce(x)
            else:
                dist.all_reduce(x)
        torch.cuda.synchronize()
        return (time.perf_counter_ns() - t0) / HOOK_CALLS / 1000

    loop(False)
    loop(True)  # warm-up: NCCL communicator and event pool
    plain, hooked = [], []
    for _ in range(HOOK_REPEATS):
        plain.append(loop(False))
        hooked.append(loop(True))
    p, h = statistics.median(plain), statistics.median(hooked)
    details = {"calls": HOOK_CALLS, "repeats": HOOK_REPEATS, "msg_bytes": nbytes, "plain_us_per_call": round(p, 3),
               "hooked_us_per_call": round(h, 3), "added_us_per_call": round(h - p, 3), "clock": "host perf_counter"}
    return _out(Status.ok, f"the live profiler's region timer adds {h - p:.2f} µs per all-reduce call "
                f"({p:.2f} -> {h:.2f} µs host time, 1-rank NCCL, median of {HOOK_REPEATS}×{HOOK_CALLS})", **details)


def _needs_gpus(ctx: _Context, n: int = 2) -> Outcome | None:
    if ctx.gpu_count < n:
        return _out(Status.skipped, f"needs >= {n} CUDA GPUs, found {ctx.gpu_count}")
    return None


def check_p2p_real(ctx: _Context) -> Outcome:
    """The real P2P check (child processes read and write each pair's memory; a hang fails)."""
    skip = _needs_gpus(ctx)
    if skip:
        return skip
    from fastverify.backends.base import summarize_p2p
    from fastverify.topo.p2p import check_p2p

    results = check_p2p(timeout_s=P2P_TIMEOUT_S, refresh=True, max_parallel=min(8, os.cpu_count() or 1))
    ctx.state["p2p"] = results
    ok, note = summarize_p2p(results)
    details = {"pairs": {f"{i}->{j}": {"ok": r.ok, "reason": r.reason} for (i, j), r in sorted(results.items())}}
    if not ok:
        return _out(Status.fail, note, "IPC all-reduces hang without P2P: fix ACS/IOMMU settings, or tune with nccl "
                    "only", **details)
    return _out(Status.ok, note, **details)


def _probe_world(n: int) -> int:
    return max(w for w in (2, 4, 8) if w <= n)


def check_backends(ctx: _Context) -> Outcome:
    """One trial per all-reduce backend the capability probes allow, on all (2/4/8) GPUs: all-reduce
    + residual + RMSNorm at 3 verify sizes, each checked against the torch reference."""
    skip = _needs_gpus(ctx)
    if skip:
        return skip
    import torch

    from fastverify.backends import BackendName, ProbeContext, probe
    from fastverify.backends.base import summarize_p2p
    from fastverify.live.config import load_model_config
    from fastverify.tune.sweep import run_trial
    from fastverify.tune.trial import Op, TrialSpec

    world = _probe_world(ctx.gpu_count)
    hidden = load_model_config(PROBE_MODEL).hidden_size
    p2p_ok, p2p_note = summarize_p2p(ctx.state.get("p2p"))
    topo = ctx.state.get("topology")
    nvlink_full = None
    if topo is not None:
        links = [topo.link(i, j) for i in range(world) for j in range(world) if i != j and (i, j) in topo.links]
        nvlink_full = bool(links) and all(link.startswith("NV") for link in links)
    pctx = ProbeContext(world_size=world, device_type="cuda", dtype=torch.bfloat16, group_backend="nccl",
                        sm=tuple(torch.cuda.get_device_capability(0)), p2p_ok=p2p_ok, p2p_note=p2p_note,
                        nvlink_full=nvlink_full, single_node=True)
    sizes = tuple((t * hidden, 1) for t in VERIFY_TOKENS)
    max_numel = max(n for n, _ in sizes)
    per: dict[str, dict] = {}
    for name in (BackendName.nccl, BackendName.pcie_ipc, BackendName.fused, BackendName.custom_ar):
        # torch.distributed's own probe needs a live group in this process; the workers probe it there.
        cap = probe(name, pctx) if name is not BackendName.nccl else None
        if cap is not None and not cap.ok:
            per[name.value] = {"status": "skipped", "reason": cap.reason}
            continue
        options: dict[str, Any] = {"max_numel": max_numel}
        if name is BackendName.pcie_ipc:
            options["tune"] = False  # FlashInfer's tuning takes minutes; the untuned seed policy is slower
        spec = TrialSpec(backend=name.value, env={}, world_size=world, device="cuda", dtype="bfloat16", hidden=hidden,
                         sizes=sizes, warmup=2, iters=10, options=options, op=Op.ALL_REDUCE_RESIDUAL_RMSNORM,
                         probe_facts={"p2p_ok": p2p_ok, "nvlink_full": nvlink_full}, label=f"doctor {name.value}")
        res = run_trial(spec, timeout_s=TRIAL_TIMEOUT_S, startup_timeout_s=TRIAL_STARTUP_S)
        per[name.value] = {
            "status": res.status.value, "reason": res.reason, "tuned": name is not BackendName.pcie_ipc,
            "sizes": [{"tokens": n // hidden, "msg_bytes": s.msg_bytes, "median_us": s.median_us, "p90_us": s.p90_us,
                       "max_rel_err": s.max_rel_err} for n, s in zip((n for n, _ in sizes), res.sizes)],
        }
    ctx.state["backends"] = {"world": world, "hidden": hidden, "results": per}
    summary = ", ".join(f"{k} {v['status']}" for k, v in per.items())
    details = {"world_size": world, "hidden": hidden, "tokens": list(VERIFY_TOKENS), "p2p": p2p_note,
               "nvlink_full": nvlink_full, "backends": per}
    bad = {k: v for k, v in per.items() if v["status"] in ("failed", "wrong_result")}
    if bad:
        k, v = next(iter(bad.items()))
        return _out(Status.fail, f"{summary}; {k}: {v['reason']}",
                    f"do not deploy {', '.join(bad)}; tune skips a backend whose result is wrong", **details)
    if per["nccl"]["status"] != "ok":
        return _out(Status.fail, f"{summary}; nccl: {per['nccl']['reason']}", "NCCL must work: check the driver, "
                    "NCCL_* settings and `fastverify topo`", **details)
    return _out(Status.ok, f"{world} GPUs, all-reduce + residual + RMSNorm vs torch reference: {summary}", **details)


def check_backend_latency(ctx: _Context) -> Outcome:
    """Latency per backend at the 3 verify sizes, from the trials of ``backend_allreduce``
    (CUDA-graph replays timed with CUDA events)."""
    skip = _needs_gpus(ctx)
    if skip:
        return skip
    info = ctx.state.get("backends")
    if info is None:
        return _out(Status.skipped, "backend_allreduce did not finish; no latencies")
    rows: dict[str, list] = {}
    for name, r in info["results"].items():
        if r["status"] == "ok":
            rows[name] = [s["median_us"] for s in r["sizes"]]
    if not rows:
        return _out(Status.skipped, "no backend finished with a correct result", backends=info["results"])
    parts = []
    for i, t in enumerate(VERIFY_TOKENS):
        best = min(rows, key=lambda k: rows[k][i])
        parts.append(f"{t * info['hidden'] * 2 // 1024} KiB: {best} {rows[best][i]:.1f} µs")
    return _out(Status.ok, f"fastest per size ({info['world']} GPUs, CUDA events, median): " + "; ".join(parts),
                world_size=info["world"], tokens=list(VERIFY_TOKENS), median_us=rows,
                note="pcie_ipc runs untuned here; `fastverify tune` tunes it")


# --- the table ---------------------------------------------------------------------------------

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
    CheckSpec("cuda", check_cuda, True, True),
    CheckSpec("torch_nccl", check_torch_nccl, True, True),
    CheckSpec("nvml_topology", check_nvml_topology, True, True),
    CheckSpec("cuda_graph_forward", check_cuda_graph, True, False),
    CheckSpec("profiler_trace", check_profiler_trace, True, False),
    CheckSpec("flashinfer_norm", check_flashinfer_norm, True, False),
    CheckSpec("hook_overhead", check_hook_overhead, True, False),
    CheckSpec("p2p", check_p2p_real, True, False),
    CheckSpec("backend_allreduce", check_backends, True, False),
    CheckSpec("backend_latency", check_backend_latency, True, False),
)
