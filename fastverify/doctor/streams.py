"""The stream-binding self-check: FlashInfer's PCIe IPC workspace binds itself to one CUDA stream,
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
import os
import types
import zipfile
from types import SimpleNamespace
from typing import Any, Callable

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
