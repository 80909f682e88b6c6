"""The single-GPU self-check: what one GPU can prove about the paths
the multi-GPU swap depends on.

* ``torch_nccl``: ``ncclGetVersion`` of the libnccl this process really mapped, against
  ``torch.cuda.nccl.version()``.
* ``cuda_max_connections``: whether ``CUDA_DEVICE_MAX_CONNECTIONS`` set late still takes effect
  (:mod:`.connections`).
* ``jit_builds``: FlashInfer's JIT builds, timed under their own limit (:mod:`.jit`).
* ``stream_binding``: FlashInfer's stream-binding rule with real streams (below), and
  with two or more GPUs the real ``pcie_ipc`` backend in a tune trial.
* ``flashinfer_norm``: ``fused_add_rmsnorm`` against the fp32 reference, eager and in a graph.
* ``verify_timer``: the patch's verify timer with real CUDA events and no host sync
  (:func:`check_verify_timer`).
* ``nccl_1rank``: a 1-rank NCCL backend eager and in a captured, replayed CUDA graph (its path
  counted once at capture, attributed to each replay, warm-ups apart), in this
  process and as a tune trial in a fresh worker.
* ``live_graph_timing``: the live runner at TP 1, timed from CUDA-graph replays.
* ``fused_two_groups``: the patch's fused-norm slot on two different groups, on 4 CPU ranks
  (:func:`check_fused_two_groups`).

Each check is skipped with its reason where its library or hardware is missing.

The stream-binding self-check: FlashInfer's PCIe IPC workspace binds itself to one CUDA stream,
and fastverify's backends must rebind it (after ordering the streams) before the calls of a
CUDA-graph warm-up on a side stream.

The rule is FlashInfer's, driven for real: ``PcieIpcAllReduceWorkspace._check_stream`` /
``rebind_stream`` (``flashinfer/comm/pcie_ipc_ar.py``) where FlashInfer imports, else the function
they call, ``bind_stream`` (``flashinfer/comm/pcie_ipc_collectives/_lifecycle.py``), from the
installed package or from the wheel named by ``FASTVERIFY_FLASHINFER_WHEEL``. The workspace needs
two ranks to exist; its stream methods need only ``device`` and ``_stream`` on ``self``, so on one
GPU they run on a stand-in ``self`` with the real streams of :class:`CudaStreams`.

The rule as FlashInfer 0.7.4 states it: the first executing call binds the workspace to the
current stream; a call from another stream raises ``RuntimeError("this workspace is already
bound to ...; use one workspace per stream")``; calls while the current stream is capturing are
exempt (``torch.cuda.graph`` records on a side stream, nothing executes); ``rebind_stream()``
clears the binding, an assertion by the caller that the streams are ordered.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import time
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import orjson

from fastverify.cudagraph import capture_cuda_graph
from fastverify.doctor import connections
from fastverify.doctor.core import (
    BUILDING,
    JIT_BUILD_TIMEOUT_S,
    PINNED_FLASHINFER,
    CheckContext,
    Outcome,
    Status,
    _out,
    free_port,
    spawn,
)
from fastverify.doctor.jit import run_builds, run_doctor_trial
from fastverify.errors import UserError
from fastverify.live.config import load_model_config
from fastverify.live.runner import run_live
from fastverify.nccl.version import read_nccl_version
from fastverify.patch import rank as R, slots
from fastverify.patch.paths import PathCounter
from fastverify.patch.rank import is_capturing
from fastverify.patch.verify import VerifyTimer
from fastverify.registry import BackendName
from fastverify.tune.trial import Op, TrialSpec

WHEEL_ENV = "FASTVERIFY_FLASHINFER_WHEEL"
LIFECYCLE_MODULE = "flashinfer.comm.pcie_ipc_collectives._lifecycle"
LIFECYCLE_PATH = "flashinfer/comm/pcie_ipc_collectives/_lifecycle.py"
WORKSPACE_MODULE = "flashinfer.comm.pcie_ipc_ar"
OPERATION = "all_reduce"  # the operation name _check_stream passes

# (what happens, where the call runs, rebind after ordering first, what FlashInfer must do)
STEPS: tuple[tuple[str, str, bool, str], ...] = (
    ("eager call on the default stream", "default", False, "binds default"),
    ("second eager call on the default stream", "default", False, "binds default"),
    ("side-stream call without rebind (capture_cuda_graph's warm-up)", "side", False, "raises already bound"),
    ("side-stream call after ordering + rebind_stream()", "side", True, "binds side"),
    ("call inside CUDA-graph capture", "capture", False, "exempt"),
    ("default-stream call after ordering + rebind_stream()", "default", True, "binds default"),
)


class FunctionBinding:
    """``bind_stream`` with the state handling of the workspace's ``_check_stream`` (keep what it
    returns) and ``rebind_stream`` (forget the binding)."""

    source = "bind_stream"

    def __init__(self, bind: Callable[..., Any], device: Any) -> None:
        self.bind, self.device, self.bound = bind, device, None

    def check(self) -> Any:
        self.bound = self.bind(self.device, self.bound, OPERATION)
        return self.bound

    def rebind(self) -> None:
        self.bound = None


class WorkspaceBinding:
    """The workspace class's own ``_check_stream`` and ``rebind_stream`` on a stand-in ``self``
    holding only ``device`` and ``_stream`` (all those methods read)."""

    source = "PcieIpcAllReduceWorkspace._check_stream/rebind_stream"

    def __init__(self, cls: type, device: Any) -> None:
        self.cls, self.state = cls, SimpleNamespace(device=device, _stream=None)

    @property
    def bound(self) -> Any:
        return self.state._stream

    def check(self) -> Any:
        self.cls._check_stream(self.state)
        return self.state._stream

    def rebind(self) -> None:
        self.cls.rebind_stream(self.state)


def lifecycle_from_wheel(path: str) -> types.ModuleType:
    """FlashInfer's ``_lifecycle`` module executed from the wheel at ``path`` (it imports only
    torch and torch.distributed), for boxes where FlashInfer itself is not installed.

    Raises
    ------
    OSError, KeyError, zipfile.BadZipFile
        ``path`` is not a readable FlashInfer wheel.
    """
    with zipfile.ZipFile(path) as z:
        source = z.read(LIFECYCLE_PATH)
    mod = types.ModuleType("fastverify_flashinfer_lifecycle")
    mod.__file__ = f"{path}/{LIFECYCLE_PATH}"
    exec(compile(source, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - the library's own file
    return mod


def load_binding(device: Any) -> tuple[Any, str] | tuple[None, str]:
    """The real rule: ``(binding, where it came from)``, or ``(None, why not)``."""
    import importlib

    try:
        ws = importlib.import_module(WORKSPACE_MODULE)
        return WorkspaceBinding(ws.PcieIpcAllReduceWorkspace, device), f"{WORKSPACE_MODULE} (installed FlashInfer)"
    except Exception as err:  # noqa: BLE001 - fall back to the function the methods call
        first = f"{type(err).__name__}: {' '.join(str(err).split())[:120]}"
    try:
        mod = importlib.import_module(LIFECYCLE_MODULE)
        return FunctionBinding(mod.bind_stream, device), f"{LIFECYCLE_MODULE} (installed FlashInfer)"
    except Exception:  # noqa: BLE001
        pass
    wheel = os.environ.get(WHEEL_ENV)
    if wheel:
        try:
            return FunctionBinding(lifecycle_from_wheel(wheel).bind_stream, device), f"{wheel}:{LIFECYCLE_PATH}"
        except Exception as err:  # noqa: BLE001
            return None, f"{WHEEL_ENV}={wheel}: cannot read {LIFECYCLE_PATH} ({type(err).__name__})"
    return None, f"flashinfer not importable ({first}) and {WHEEL_ENV} not set"


class CudaStreams:
    """Real CUDA streams on one device: the default stream, one side stream, a counter tensor each
    call increments on the stream it runs on (the work a workspace would do), and capture."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch, self.device = torch, device
        self.default = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.expected = 0
        self._graph = None

    def name(self, stream: Any) -> str:
        return "default" if stream == self.default else "side" if stream == self.side else "other"

    def on(self, stream: Any):
        return self.torch.cuda.stream(stream)

    def order(self, waiter: Any, waited: Any) -> None:
        waiter.wait_stream(waited)

    def use(self) -> None:
        self.counter.add_(1)

    def ran(self, calls: int = 1) -> None:
        self.expected += calls

    @contextlib.contextmanager
    def capture(self):
        self._graph = self.torch.cuda.CUDAGraph()
        with self.torch.cuda.graph(self._graph):
            yield

    def finish(self) -> tuple[int, int]:
        """Replay the captured graph once on the default stream, then ``(counter, expected)``."""
        if self._graph is not None:
            self.order(self.default, self.side)
            self._graph.replay()
            self.ran()
        self.torch.cuda.synchronize(self.device)
        return int(self.counter.item()), self.expected


def run_steps(binding: Any, streams: Any) -> list[dict]:
    """Run :data:`STEPS` through ``binding`` on ``streams``; one row per step with what FlashInfer
    was expected to do and what it did (``binds default|side|other``, ``raises ...``, ``exempt``)."""
    rows: list[dict] = []
    prev = streams.default
    for label, where, rebind, expect in STEPS:
        stream = streams.side if where == "side" else streams.default
        before = binding.bound
        try:
            if where == "capture":
                with streams.capture():
                    got = binding.check()
                    streams.use()
                did = "exempt" if got is before else f"binds {streams.name(got)}"
            else:
                if rebind:
                    streams.order(stream, prev)  # what rebind_stream() asserts: the streams are ordered
                    binding.rebind()
                with streams.on(stream):
                    got = binding.check()
                    streams.use()
                streams.ran()
                did = f"binds {streams.name(got)}"
                prev = stream
        except RuntimeError as err:
            did = "raises already bound" if "already bound" in str(err) else f"raises {' '.join(str(err).split())}"
        rows.append({"step": label, "expect": expect, "did": did, "ok": did == expect})
    return rows


def judge(rows: list[dict], counter: int | None = None, expected: int | None = None) -> tuple[bool, str]:
    """``(passed, one line)``: every step did what FlashInfer's rule says, and the counter the
    calls incremented on their streams holds one increment per call that ran (ordering kept)."""
    wrong = [r for r in rows if not r["ok"]]
    if wrong:
        r = wrong[0]
        return False, f"{r['step']}: expected '{r['expect']}', FlashInfer did '{r['did']}'"
    if counter is not None and counter != expected:
        return False, f"the calls' work on the two streams summed to {counter}, expected {expected}"
    return True, (
        f"{len(rows)} steps as FlashInfer's rule says: binds on first use, raises on another stream, "
        "exempts capture, rebinds after ordering"
    )


NO_FLASHINFER = "flashinfer not importable: FlashInfer checks are optional and skipped"
LIVE_TIMEOUT_S = 240.0


def flashinfer_installed() -> bool:
    try:
        return importlib.util.find_spec("flashinfer") is not None
    except (ImportError, ValueError):
        return False


# --- NCCL version ------------------------------------------------------------------------------


def libnccl_mapped(maps_text: str) -> list[str]:
    """Paths of the libnccl objects mapped into a process, from its ``/proc/<pid>/maps`` text."""
    out: list[str] = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        path = parts[5].strip() if len(parts) == 6 else ""
        if os.path.basename(path).startswith("libnccl.so") and path not in out:
            out.append(path)
    return out


def compare_nccl(torch_says: Any, library: Any, how: str) -> tuple[Status, str, str | None]:
    """``torch.cuda.nccl.version()`` (``(major, minor, patch[, suffix])``) against the
    :class:`~fastverify.nccl.version.NcclVersion` ``ncclGetVersion`` returned (None: no library);
    ``how`` says which library that was. Returns (status, reason, fix)."""
    loaded = ".".join(map(str, torch_says[:3])) if isinstance(torch_says, tuple) else str(torch_says)
    if library is None:
        return (
            Status.warn,
            f"torch loads NCCL {loaded}; fastverify found no libnccl to read, so NCCL settings are "
            "checked against the newest rules",
            "set NCCL_LIBRARY=/path/to/libnccl.so.2",
        )
    if str(library) != loaded:
        return (
            Status.warn,
            f"torch loads NCCL {loaded} but ncclGetVersion of {library.library} ({how}) says "
            f"{library}: settings are checked against the wrong version",
            "set NCCL_LIBRARY to the libnccl torch loads",
        )
    return Status.ok, f"torch loads NCCL {loaded}; ncclGetVersion of {library.library} ({how}) agrees", None


def check_torch_nccl(ctx: CheckContext) -> Outcome:
    """The NCCL torch loads (``torch.cuda.nccl.version()``) against ``ncclGetVersion`` (ctypes) of
    the libnccl mapped into this process, else of the one fastverify would read."""
    import torch

    try:
        v = torch.cuda.nccl.version()
    except Exception as err:  # noqa: BLE001 - torch built without NCCL raises
        return _out(
            Status.fail, f"torch has no NCCL ({type(err).__name__}: {err})", "install a CUDA torch built with NCCL"
        )
    try:
        mapped = libnccl_mapped(Path("/proc/self/maps").read_text())
    except OSError:
        mapped = []
    library, how = None, "found by fastverify (none mapped in this process)"
    for path in mapped:
        try:
            library, how = read_nccl_version(library=path), "mapped in this process"
            break
        except UserError:
            continue
    if library is None:
        library = ctx.nccl_version()
    status, reason, fix = compare_nccl(v, library, how)
    return _out(
        status,
        reason,
        fix,
        torch_nccl=".".join(map(str, v[:3])) if isinstance(v, tuple) else str(v),
        torch_nccl_raw=str(v),
        library=None if library is None else str(library),
        library_path=None if library is None else library.library,
        mapped=mapped,
        how=how,
    )


# --- CUDA_DEVICE_MAX_CONNECTIONS -----------------------------------------------------------------


def check_cuda_max_connections(ctx: CheckContext) -> Outcome:
    """Whether ``CUDA_DEVICE_MAX_CONNECTIONS=1`` set after ``torch.cuda.is_available()`` still
    takes effect, measured in three child processes (:mod:`.connections`)."""
    runs = connections.measure()
    ratios = {m: runs[m].get("ratio") for m in connections.MODES}
    word, why = connections.verdict(ratios)
    details = {"verdict": word, "runs": runs, "serial_ratio": connections.SERIAL_RATIO, "clock": "cuda_events"}
    if word == connections.TAKES_EFFECT:
        return _out(Status.ok, f"{connections.ENV} set late {word}: {why}", **details)
    if word == connections.DOES_NOT:
        return _out(
            Status.warn,
            f"{connections.ENV} set late {word}: {why}",
            f"set {connections.ENV} before the interpreter starts (fastverify launch's environment)",
            **details,
        )
    return _out(Status.warn, f"{connections.ENV} set late: {word}: {why}", "run doctor again on an idle GPU", **details)


# --- JIT builds ---------------------------------------------------------------------------------


def check_jit_builds(ctx: CheckContext) -> Outcome:
    """Build (or load) each FlashInfer module the backends use, timed, in a child under its own
    limit, so that later trials load them from FlashInfer's cache."""
    if not flashinfer_installed():
        return _out(Status.skipped, NO_FLASHINFER, f"pip install flashinfer-python=={PINNED_FLASHINFER}")

    res = run_builds(JIT_BUILD_TIMEOUT_S)
    ctx.state["jit"] = res
    return jit_outcome(res)


def jit_outcome(res: dict) -> Outcome:
    """The check's verdict over :func:`fastverify.doctor.jit.summarize`'s dict."""
    mods = res["modules"]
    parts = [
        f"{k} {v.get('status')} {v['seconds']:.1f} s" if v.get("seconds") is not None else f"{k} {v.get('status')}"
        for k, v in mods.items()
    ]
    if res["building"]:
        return _out(
            Status.warn,
            f"{BUILDING}: {res['building']} still building after {res['limit_s']:g} s ({'; '.join(parts)})",
            "let it finish once (FlashInfer caches the build), or install flashinfer-jit-cache",
            **res,
        )
    if res["errors"]:
        k, e = next(iter(res["errors"].items()))
        return _out(
            Status.fail,
            f"FlashInfer JIT build of {k} failed: {e}",
            "check nvcc / CUDA_HOME, or install flashinfer-jit-cache",
            **res,
        )
    if res["exit"]:
        return _out(Status.fail, f"FlashInfer JIT build run: {res['exit']}", None, **res)
    return _out(Status.ok, "FlashInfer modules: " + "; ".join(parts), **res)


# --- stream binding ------------------------------------------------------------------------------


def check_stream_binding(ctx: CheckContext) -> Outcome:
    """FlashInfer's stream-binding rule with real streams on GPU 0 (:mod:`.streams`); with two or
    more GPUs also a 2-rank ``pcie_ipc`` tune trial (eager on the default stream, then the graph's
    side-stream warm-up and capture) where its probe allows."""
    import torch

    device = torch.device("cuda", 0)
    binding, source = load_binding(device)
    if binding is None:
        return _out(
            Status.skipped,
            f"FlashInfer's stream rule not available: {source}",
            f"pip install flashinfer-python=={PINNED_FLASHINFER} or set {WHEEL_ENV}",
        )
    with torch.cuda.device(device):
        cuda = CudaStreams(torch, device)
        rows = run_steps(binding, cuda)
        counter, expected = cuda.finish()
    ok, line = judge(rows, counter, expected)
    details: dict[str, Any] = {
        "source": source,
        "binding": binding.source,
        "steps": rows,
        "counter": counter,
        "expected": expected,
    }
    if not ok:
        return _out(
            Status.fail,
            f"stream binding: {line}",
            "the pcie_ipc backend's rebind logic no longer matches "
            "FlashInfer: report this with `fastverify doctor --json`",
            **details,
        )
    if ctx.gpu_count >= 2:
        trial = _pcie_ipc_trial(ctx)
        details["backend_trial"] = trial
        if trial["status"] in ("failed", "wrong_result"):
            return _out(
                Status.fail,
                f"stream rule holds, but the real pcie_ipc trial {trial['status']}: {trial['reason']}",
                "do not deploy pcie_ipc",
                **details,
            )
        line += f"; pcie_ipc 2-rank trial {trial['status']}"
    return _out(Status.ok, f"{line} ({binding.source})", **details)


def _pcie_ipc_trial(ctx: CheckContext) -> dict:
    import torch

    from fastverify.backends import ProbeContext, probe  # lazy: torch
    from fastverify.backends.base import summarize_p2p  # lazy: torch

    hidden = load_model_config("kimi-k2").hidden_size
    p2p_ok, p2p_note = summarize_p2p(ctx.state.get("p2p"))
    pctx = ProbeContext(
        world_size=2,
        device_type="cuda",
        dtype=torch.bfloat16,
        group_backend="nccl",
        sm=tuple(torch.cuda.get_device_capability(0)),
        p2p_ok=p2p_ok,
        p2p_note=p2p_note,
        single_node=True,
    )
    cap = probe(BackendName.pcie_ipc, pctx)
    if not cap.ok:
        return {"status": "skipped", "reason": cap.reason}
    spec = TrialSpec(
        backend=BackendName.pcie_ipc.value,
        env={},
        world_size=2,
        device="cuda",
        dtype="bfloat16",
        hidden=hidden,
        sizes=((4 * hidden, 1),),
        warmup=1,
        iters=3,
        options={"max_numel": 4 * hidden, "tune": False},
        op=Op.ALL_REDUCE,
        probe_facts={"p2p_ok": p2p_ok},
        label="doctor stream binding",
    )
    res, how = run_doctor_trial(spec)
    return {"status": BUILDING if how["phase"] == BUILDING else res.status.value, "reason": res.reason, **how}


# --- fused_add_rmsnorm ---------------------------------------------------------------------------


def check_flashinfer_norm(ctx: CheckContext) -> Outcome:
    """``flashinfer.norm.fused_add_rmsnorm`` (the norm kernel every backend can use) against the fp32
    torch reference on random data, eager and replayed from a CUDA graph."""
    if not flashinfer_installed():
        return _out(Status.skipped, NO_FLASHINFER, f"pip install flashinfer-python=={PINNED_FLASHINFER}")
    import torch

    from fastverify.backends import TOLERANCE, check_close, reference_residual_rmsnorm  # lazy: torch
    from fastverify.backends.base import FUSED_ADD_RMSNORM  # lazy: torch

    fn = FUSED_ADD_RMSNORM.resolve()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, eps = 32, 7168, 1e-6
    results: dict[str, Any] = {}
    worst = None
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        x0 = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
        r0 = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)
        want_norm, want_res = reference_residual_rmsnorm([x0], r0, weight, eps)
        x, r = x0.clone(), r0.clone()

        def call():  # in place on x and r: reload them first, so every replay computes the same thing
            x.copy_(x0)
            r.copy_(r0)
            fn(**FUSED_ADD_RMSNORM.kwargs(input=x, residual=r, weight=weight, eps=eps, enable_pdl=False))
            return x, r

        call()
        torch.cuda.synchronize()
        row: dict[str, Any] = {}
        for mode in ("eager", "graph"):
            if mode == "graph":
                graph, _ = capture_cuda_graph(call, warmup=1)  # its warm-up runs call() eagerly ...
                x.zero_()  # ... so clear the outputs: what is checked below comes from the replays
                r.zero_()
                graph.replay()
                graph.replay()
                torch.cuda.synchronize()
            ok_n, rel_n = check_close(x, want_norm, dtype)
            ok_r, rel_r = check_close(r, want_res, dtype)
            row[mode] = {"rel_err_norm": rel_n, "rel_err_residual": rel_r, "ok": ok_n and ok_r}
            if not (ok_n and ok_r) and worst is None:
                worst = f"{name} {mode}: relative error {max(rel_n, rel_r):.3g} (tolerance {TOLERANCE[dtype]:.3g})"
        results[name] = row
    details = {"tokens": tokens, "hidden": hidden, "eps": eps, "reference": "fp32 torch", "results": results}
    if worst:
        return _out(
            Status.fail,
            f"fused_add_rmsnorm differs from the fp32 reference: {worst}",
            "use the torch norm (backend option norm=torch) until fixed",
            **details,
        )
    parts = [
        f"{k} eager {v['eager']['rel_err_norm']:.2g} / graph {v['graph']['rel_err_norm']:.2g}"
        for k, v in results.items()
    ]
    return _out(Status.ok, "fused_add_rmsnorm vs fp32 reference, relative error: " + ", ".join(parts), **details)


# --- 1-rank NCCL and the live runner at TP 1 ------------------------------------------------------


def check_nccl_1rank(ctx: CheckContext) -> Outcome:
    """The NCCL backend on a 1-rank group: all-reduce + residual + RMSNorm eager on the default
    stream, then captured in a CUDA graph (side-stream warm-up) and replayed, both against the
    reference; then the same as a tune trial in a fresh worker process."""
    import torch

    from fastverify.backends import ProbeContext, check_close, make_backend, reference_residual_rmsnorm  # lazy: torch

    ctx.process_group()
    device, dtype, eps = torch.device("cuda", 0), torch.bfloat16, 1e-6
    hidden = load_model_config("tiny").hidden_size
    tokens = 4
    pctx = ProbeContext.detect(None, device=device, dtype=dtype, single_node=True)
    backend = make_backend(
        BackendName.nccl, None, device=device, dtype=dtype, max_numel=tokens * hidden, hidden=hidden, context=pctx
    )
    gen = torch.Generator(device="cuda").manual_seed(1)
    x0 = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    r0 = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).to(dtype)
    want = reference_residual_rmsnorm([x0], r0, w, eps)
    x, r = x0.clone(), r0.clone()

    counter = PathCounter()  # the patch's path counting, on a real capture: counted once per graph

    def call():  # fresh inputs every call: the unfused path adds into ``r`` in place
        x.copy_(x0)
        r.copy_(r0)
        out = backend.all_reduce_residual_rmsnorm(x, r, w, eps)
        counter.count("sglang.nccl", capturing=is_capturing())
        return out

    errs: dict[str, float] = {}
    try:
        eager = tuple(t.clone() for t in call())  # ``r`` is returned and reused by the graph below
        torch.cuda.synchronize()
        errs["eager"] = max(check_close(g, e, dtype)[1] for g, e in zip(eager, want))
        with counter.in_mode("verify"), counter.capturing(("verify", 1)):
            graph, out = capture_cuda_graph(call, warmup=2)
        for _ in range(3):
            graph.replay()
            counter.replayed(("verify", 1), into="verify")
        torch.cuda.synchronize()
        errs["graph"] = max(check_close(g, e, dtype)[1] for g, e in zip(out, want))
        ok_in = all(check_close(g, e, dtype)[0] for g, e in zip(out, want)) and all(
            check_close(g, e, dtype)[0] for g, e in zip(eager, want)
        )
        del graph
    finally:
        backend.close()
    spec = TrialSpec(
        backend=BackendName.nccl.value,
        env={},
        world_size=1,
        device="cuda",
        dtype="bfloat16",
        hidden=hidden,
        sizes=((tokens * hidden, 1), (8 * tokens * hidden, 1)),
        warmup=1,
        iters=5,
        op=Op.ALL_REDUCE_RESIDUAL_RMSNORM,
        label="doctor nccl 1 rank",
    )
    res, how = run_doctor_trial(spec)
    counts = counter.snapshot()
    counts_ok = counts == {
        "other": {"sglang.nccl": 1},
        "capture_warmup": {"sglang.nccl": 2},
        "verify": {"sglang.nccl": 3},
    } and counter.graphs == {("verify", 1): {"sglang.nccl": 1}}
    details = {
        "hidden": hidden,
        "tokens": tokens,
        "in_process_rel_err": errs,
        "path_counts": dict(backend.path_counts),
        "allreduce_paths": counts,
        "trial": {
            "status": res.status.value,
            "reason": res.reason,
            **how,
            "median_us": [s.median_us for s in res.sizes],
            "clock": res.clock and res.clock.value,
        },
    }
    if not ok_in:
        return _out(
            Status.fail,
            f"1-rank NCCL backend differs from the reference (relative error {errs})",
            "report this with `fastverify doctor --json`",
            **details,
        )
    if not counts_ok:  # the eager call (no mode), the graph's 2 warm-ups apart, 1 captured x 3 replays
        return _out(
            Status.fail,
            f"path counts of a captured, replayed graph are wrong: {counts}",
            "report this with `fastverify doctor --json`",
            **details,
        )
    if res.status.value != "ok":
        status = Status.warn if how["phase"] == BUILDING else Status.fail
        return _out(
            status,
            f"in-process eager + graph replay ok; tune trial {res.status.value}: {res.reason}",
            "check the NCCL install (NCCL_DEBUG=INFO)",
            **details,
        )
    return _out(
        Status.ok,
        f"1-rank NCCL: eager and graph replay match the reference (rel err {errs['graph']:.2g}); "
        f"tune trial ok, {res.sizes[0].median_us:.1f} µs per call (CUDA events)",
        **details,
    )


def check_live_graph_timing(ctx: CheckContext) -> Outcome:
    """The live runner (``fastverify profile``'s engine) at TP 1 on the tiny preset: one rank process,
    NCCL, the forward timed from CUDA-graph replays (``timed_forward = "cuda_graph"``: region graphs
    and the whole-forward graph), the eager forward only as the second figure."""

    iters = 3
    ranks = run_live(
        load_model_config("tiny"),
        tp=1,
        draft_tokens=4,
        batch=1,
        iters=iters,
        warmup=1,
        device="cuda",
        timeout_s=LIVE_TIMEOUT_S,
        progress=False,
    )
    r = ranks[0]
    names = [r.names[i] for i in r.name_id]
    graph, eager = r.meta.get("graph_forward_us") or [], r.meta.get("eager_forward_us") or []
    details = {
        "ranks": len(ranks),
        "events": len(names),
        "steps": len(r.steps),
        "timed_forward": r.meta.get("timed_forward"),
        "graph_forward_us": graph,
        "eager_forward_us": eager,
        "timing": r.meta.get("timing"),
        "dist_backend": r.meta.get("dist_backend"),
    }
    fix = "run `fastverify profile --tp 1` for the rank's error"
    if len(r.steps) != iters or not names:
        return _out(
            Status.fail,
            f"live runner at TP 1: {len(r.steps)} steps (expected {iters}), {len(names)} events",
            fix,
            **details,
        )
    if details["timed_forward"] != "cuda_graph" or len(graph) != iters:
        return _out(
            Status.fail,
            f"live runner at TP 1 timed {details['timed_forward']!r} forwards, not CUDA-graph "
            f"replays ({len(graph)} whole-graph timings of {iters})",
            fix,
            **details,
        )
    med = sorted(graph)[len(graph) // 2]
    med_eager = sorted(eager)[len(eager) // 2] if eager else float("nan")
    return _out(
        Status.ok,
        f"live runner at TP 1: {iters} verify steps timed from CUDA-graph replays, {len(names)} "
        f"regions; whole forward {med:.1f} us from its graph, {med_eager:.1f} us eager (second figure)",
        **details,
    )


def check_fused_two_groups(ctx: CheckContext) -> Outcome:
    """The patch's fused slot with two SGLang groups (attention TP over 4 ranks, the post-experts
    pair of moe_dp 2): one backend per group, each call summed over its own group's ranks
    (:func:`run_two_groups`; 4 gloo ranks on CPU, so it needs no second GPU)."""
    got = run_two_groups()
    ok, line = two_groups_verdict(got)
    if not ok:
        return _out(
            Status.fail,
            line,
            "report this with `fastverify doctor --json`: the fused slot would "
            "change the model's answers with MoE data parallelism",
            ranks=got,
        )
    return _out(Status.ok, line, ranks=got)


# --- verify timer -------------------------------------------------------------------------------
# The ``verify_timer`` check: the patch's verify timer (:class:`fastverify.patch.verify.VerifyTimer`)
# on real CUDA events, recorded behind queued GPU work, must cost the host no wait.
#
# Everything the timed steps touch for the first time in this process is done once before the timed
# window (:func:`warm_up`): cuBLAS creates its handle and workspace at the first matmul, CUDA loads a
# kernel's module at its first launch (lazy loading, ``CUDA_MODULE_LOADING=LAZY``, the default since
# CUDA 12.2), the caching allocator takes its blocks, and the timer creates its events and starts its
# writer thread. Done inside the window, behind the queued GPU work, any of these can wait for the
# GPU, and the check would blame the timer for it.


TIMER_STEPS = 8
TIMER_BUSY_MS = 200.0  # GPU work queued ahead of the timed steps
WARMUP_STEPS = 2  # untimed steps before the window: the allocator then holds the loop's blocks


def judge_verify_timer(
    *, host_ms: float, busy_ms: float, written_while_busy: int, written_after: int, steps: int, rows: list[dict]
) -> tuple[bool, str]:
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
        return False, (
            f"recording and draining took {host_ms:.1f} ms of host time behind {busy_ms:.0f} ms of "
            "GPU work: the timer waits for the GPU"
        )
    if written_while_busy:
        return False, f"the drain wrote {written_while_busy} row(s) before their events could have completed"
    if written_after != steps or len(rows) != steps:
        return False, (
            f"{written_after} row(s) written after the GPU finished ({len(rows)} in the file), expected {steps}"
        )
    bad = [r for r in rows if r.get("clock") != "cuda_events" or not float(r.get("verify_ms", 0)) > 0]
    if bad:
        return False, f"row {bad[0]} is not a positive CUDA-event time"
    return True, (
        f"{steps} steps timed with CUDA events; {host_ms:.2f} ms host time behind {busy_ms:.0f} ms of "
        "queued GPU work, nothing written before it finished"
    )


def _timer(torch: Any, out_dir: Path) -> VerifyTimer:
    return VerifyTimer(
        out_dir,
        every=TIMER_STEPS + 1,  # drained by hand
        event_factory=lambda: torch.cuda.Event(enable_timing=True),
        clock="cuda_events",
    )


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
    return {
        "host_ms": host_ms,
        "busy_ms": TIMER_BUSY_MS,
        "written_while_busy": busy,
        "written_after": after,
        "steps": TIMER_STEPS,
        "rows": rows,
        "clock": timer.clock,
    }


def check_verify_timer(ctx: CheckContext) -> Outcome:
    """The patch's verify timer on real CUDA events (:func:`time_steps`): steps recorded behind
    queued GPU work must cost no host wait, and every step is written once the GPU is done."""
    import torch

    got = time_steps(torch, ctx.tmp / "verify-timer")
    clock = got.pop("clock")
    ok, line = judge_verify_timer(**got)
    details = {
        "host_ms": round(got["host_ms"], 3),
        "busy_ms": TIMER_BUSY_MS,
        "written_while_busy": got["written_while_busy"],
        "written_after": got["written_after"],
        "rows": got["rows"][:3],
        "clock": clock,
        "warm_up_steps": WARMUP_STEPS,
    }
    if not ok:
        return _out(
            Status.fail, f"verify timer: {line}", "report this: the patch's timer must never sync the host", **details
        )
    return _out(Status.ok, line, **details)


# --- fused slot on two groups -------------------------------------------------------------------
# The doctor case "fused slot on two different groups": the patch's fused-norm slot
# (:mod:`fastverify.patch.slots`) with two SGLang groups, as SGLang has them with MoE data
# parallelism (moe_dp 2): the attention output owed to the attention-TP group (all 4 ranks), the MoE
# output to ``post_experts_reduction_group()`` (a pair; SGLang 0.5.23 ``layers/moe/utils.py``).
#
# Four CPU processes on gloo run the slot's real code: the owed group found through a
# ``resolve_fusion_group`` with SGLang's signature (``layers/flashinfer_comm_fusion.py``), one backend
# built per group with the slot's own votes (the registry's CPU baseline standing in for the fused
# kernel, as the patch itself does on CPU), the first-result check, and each call's sum. Rank ``r``
# holds ``r + 1``, so each sum names the ranks it spans: 10 for the four, 3 or 7 for a pair.


WORLD = 4
ROWS, HIDDEN = 4, 64
TIMEOUT_S = 120.0


class _Coordinator:
    """What the slot reads of SGLang's ``GroupCoordinator`` (``distributed/parallel_state.py``)."""

    def __init__(self, ranks: list[int], name: str) -> None:
        import torch.distributed as dist

        self.ranks, self.unique_name, self.world_size = ranks, name, len(ranks)
        self.device_group = dist.new_group(ranks)  # collective: every rank makes every group
        self.cpu_group = dist.new_group(ranks)
        self.rank_in_group = ranks.index(dist.get_rank()) if dist.get_rank() in ranks else -1

    def all_reduce(self, x: Any) -> Any:
        import torch.distributed as dist

        y = x.clone()
        dist.all_reduce(y, group=self.device_group)
        return y


def _rank(rank: int, port: int, q: Any) -> None:
    """One rank: build the groups, the slot's backends, and run both calls; puts (rank, result)."""
    out: dict[str, Any] = {}
    try:
        import torch
        import torch.distributed as dist

        from fastverify.backends import make_backend  # lazy: torch

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        whole = _Coordinator(list(range(WORLD)), "attn_tp")
        pairs = [_Coordinator([0, 1], "moe_tp:0"), _Coordinator([2, 3], "moe_tp:1")]
        pair = pairs[rank // 2]
        owed = {True: whole, False: pair}
        fusion = types.SimpleNamespace(
            resolve_fusion_group=lambda *, use_attn_tp_group: (
                owed[use_attn_tp_group].world_size,
                owed[use_attn_tp_group].rank_in_group,
                owed[use_attn_tp_group],
            )
        )
        modules = {R.MOD_FI_FUSION: fusion}
        slots.FUSED_SLOT.kind, slots.FUSED_SLOT.disabled = BackendName.fused, None
        slots.FUSED_SLOT.factory = lambda c, x: make_backend(
            BackendName.gloo, c.device_group, device=x.device, dtype=x.dtype, max_numel=ROWS * HIDDEN, hidden=HIDDEN
        )
        slots.FUSED_GROUPS.clear()
        built, failed = slots._build_fused(modules, torch.zeros(ROWS, HIDDEN), [])
        out["built"], out["failed"] = built, failed
        out["groups"] = [s.group.ranks for s in slots.FUSED_GROUPS if s.backend is not None]

        def sglang_own(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the slot declined: SGLang's own method was called")

        forward = slots._make_fused_norm(modules)(sglang_own)
        norm = types.SimpleNamespace(weight=torch.ones(HIDDEN), variance_epsilon=1e-6)
        x = torch.full((ROWS, HIDDEN), float(rank + 1))
        residual = torch.zeros(ROWS, HIDDEN)
        out["sums"] = {}
        for name, use_attn in (("attn", True), ("moe", False)):  # attention first, as a layer runs
            _, new_res = forward(norm, x.clone(), residual.clone(), None, use_attn)
            out["sums"][name] = sorted({float(v) for v in (new_res - residual).flatten()})
        out["want"] = {"attn": [float(sum(r + 1 for r in whole.ranks))], "moe": [float(sum(r + 1 for r in pair.ranks))]}
        for s in slots.FUSED_GROUPS:
            slots.close_quietly(s.backend)
        slots.FUSED_GROUPS.clear()
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the parent in one line
        out["error"] = f"{type(err).__name__}: {err}"
    q.put((rank, out))


def run_two_groups() -> dict[int, dict[str, Any]]:
    """Run the four ranks (spawned processes); {rank: result}. A rank that does not answer within
    :data:`TIMEOUT_S` is reported as such (a one-sided collective)."""
    port = free_port()
    answers = spawn(_rank, [(r, port) for r in range(WORLD)], TIMEOUT_S)
    got: dict[int, dict[str, Any]] = {a[0]: a[1] for a in answers if isinstance(a, tuple)}
    for r in range(WORLD):
        got.setdefault(r, {"error": f"rank {r} did not answer within {TIMEOUT_S:.0f} s"})
    return got


def two_groups_verdict(got: dict[int, dict[str, Any]]) -> tuple[bool, str]:
    """(every rank's two calls summed over their own group's ranks, one line)."""
    bad = [f"rank {r}: {res['error']}" for r, res in sorted(got.items()) if "error" in res]
    if bad:
        return False, "; ".join(bad)
    wrong = [
        f"rank {r} summed {res['sums']} (want {res['want']})"
        for r, res in sorted(got.items())
        if res["sums"] != res["want"]
    ]
    if wrong:
        return False, "the fused slot reduced over the wrong ranks: " + "; ".join(wrong)
    return True, (
        f"fused slot on two groups ({WORLD} gloo ranks): one backend per group "
        f"({got[0]['built']}); the attention call summed over all {WORLD} ranks, the MoE call over its "
        f"pair"
    )
