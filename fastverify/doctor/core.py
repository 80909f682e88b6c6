"""What every doctor check shares: the outcome types, the context GPU state is built in once, and
the summary and table printing, and the spawned processes of the multi-rank cases. Torch is imported
only inside the context's methods."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable

from fastverify import __version__
from fastverify.console import cell
from fastverify.errors import UserError, shown
from fastverify.live.config import load_model_config
from fastverify.nccl.version import read_nccl_version

SCHEMA = "fastverify.doctor"
SCHEMA_VERSION = 1

NO_GPU = "no CUDA GPU (torch.cuda.is_available() is False)"
PINNED_FLASHINFER = "0.7.4"  # pyproject.toml [gpu] extra: the version the backend signature tests check
PATCH_NOT_CHECKED = "SGLang not installed: the patch targets of `fastverify launch` are not checked"
NO_NCCL = "no libnccl found: NCCL settings are checked against the newest rules"

GLOO_TIMEOUT_S = 60.0
TRIAL_TIMEOUT_S = 60.0  # measurement limit of one backend trial: warm-up, check, graph replays
TRIAL_STARTUP_S = 120.0  # its start-up limit (interpreter, torch, CUDA, NCCL, FlashInfer import)
# Building a backend (FlashInfer's JIT compile of its module in the constructor, trtllm_comm at its
# first call, a default tune()) is not measurement: minutes on a cold cache without
# flashinfer-jit-cache. It gets its own limit, and a trial stopped there is "building/JIT", not
# "failed".
TRIAL_BUILD_S = 600.0
JIT_BUILD_TIMEOUT_S = 900.0  # the jit_builds check: every FlashInfer module compiled once, in a child
BUILDING = "building/JIT"
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
        return {
            "name": self.name,
            "status": self.status.value,
            "reason": self.reason,
            "fix": self.fix,
            "seconds": round(self.seconds, 3),
            "details": self.details,
        }


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
    fn: Callable[["CheckContext"], Outcome]
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


NVIDIA_DEVICE_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia/version")
"""Present wherever the NVIDIA kernel driver is loaded (the driver creates both); CUDA needs it."""
NO_DRIVER = "no NVIDIA driver on this machine (no /dev/nvidiactl): no CUDA GPU"


class CheckContext:
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
            if self.quick and not any(os.path.exists(p) for p in NVIDIA_DEVICE_NODES):
                # --quick on a machine without the NVIDIA driver: no GPU to find, and importing torch
                # (1-3 s) would be the whole run's time
                self._gpu = (NO_DRIVER, 0)
                return self._gpu
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
            dist.init_process_group(
                "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0)
            )
            self._group = True
        return dist

    def tiny_model(self):
        """The tiny preset's verify forward at world size 1 on GPU 0 (built once)."""
        if "model" not in self.state:
            import torch

            from fastverify.live.forward import TPVerifyModel  # lazy: torch

            torch.cuda.set_device(0)
            self.state["model"] = TPVerifyModel(
                load_model_config("tiny"),
                tp=1,
                rank=0,
                batch=1,
                draft_tokens=4,
                device=torch.device("cuda", 0),
                dtype=torch.bfloat16,
            )
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


def summarise(checks: list[Check]) -> dict:
    """The JSON document of ``fastverify doctor --json``: counts per status, the verdict (``fail``
    if any check failed, else ``warn`` if any warned, else ``ok``), total seconds and every check."""
    counts = {s.value: sum(1 for c in checks if c.status is s) for s in Status}
    verdict = "fail" if counts["fail"] else "warn" if counts["warn"] else "ok"

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
    for col, kw in (
        ("check", {"no_wrap": True}),
        ("status", {"no_wrap": True}),
        ("s", {"justify": "right"}),
        ("reason", {"overflow": "fold"}),
        ("fix", {"overflow": "fold"}),
    ):
        t.add_column(col, **kw)
    for c in checks:
        t.add_row(
            cell(c.name),
            Text(shown(c.status.value), style=_STYLE[c.status]),
            f"{c.seconds:.1f}",
            cell(c.reason),
            cell(c.fix or ""),
        )
    console.print(t)
    s = summarise(checks)
    counts = ", ".join(f"{n} {k}" for k, n in s["counts"].items())
    console.print(
        Text(
            shown(f"doctor: {counts} in {s['seconds']:.1f} s; verdict {s['verdict']}"),
            style=_STYLE[Status(s["verdict"])],
        )
    )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a spawned group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(target: Callable, args_per_proc: list[tuple], timeout_s: float) -> list[Any]:
    """Run ``target(*args, q)`` in one spawned process per args tuple; what each put on ``q``, in
    arrival order; a missing answer is ``{"error": ...}``."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, q)) for a in args_per_proc]
    for p in procs:
        p.start()
    got: list[Any] = []
    try:
        for _ in procs:
            try:
                got.append(q.get(timeout=timeout_s))
            except Exception:  # noqa: BLE001 - queue.Empty or a dead process: said in one line
                got.append({"error": f"a process did not answer within {timeout_s:.0f} s"})
                break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return got
