"""The PCIe IPC backend against FlashInfer 0.7.4's real stream-binding rule (issue 9, item 1).

FlashInfer binds a ``PcieIpcAllReduceWorkspace`` to the first stream that runs it and raises
"already bound ... use one workspace per stream" on any other; capture is exempt. The rule is
plain Python, so it runs here from the wheel itself:

* ``bind_stream`` is ``flashinfer/comm/pcie_ipc_collectives/_lifecycle.py``, extracted from
  ``$FASTVERIFY_FLASHINFER_WHEEL`` and loaded as a module (it imports only torch);
* ``_check_stream`` and ``rebind_stream`` are the method bodies of ``flashinfer/comm/pcie_ipc_ar.py``,
  compiled from the wheel's source with that ``bind_stream`` as their global. The stand-in workspace
  around them does only what the wheel's source does around them (checked with ``ast``): its
  ``__init__`` leaves the stream unbound and its ``all_reduce`` calls ``self._check_stream()``
  before launching.

CUDA streams are fake objects (identity equality, as distinct ``torch.cuda.Stream`` handles compare);
``torch.cuda.current_stream`` / ``is_current_stream_capturing`` / ``stream`` / ``graph`` are
monkeypatched, so :func:`fastverify.cudagraph.capture_cuda_graph` runs its real sequence: an eager
call on the default stream, warm-up on a side stream, capture, then eager again.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import types
import zipfile
from contextlib import contextmanager
from typing import Optional

import pytest
import torch

from fastverify.backends.flashinfer_pcie_ipc import PcieIpcBackend
from fastverify.cudagraph import capture_cuda_graph

WHEEL_ENV = "FASTVERIFY_FLASHINFER_WHEEL"
AR_PATH = "flashinfer/comm/pcie_ipc_ar.py"
LIFECYCLE_PATH = "flashinfer/comm/pcie_ipc_collectives/_lifecycle.py"
WORLD = 2


def _calls_in_order(fn: ast.FunctionDef) -> list[str]:
    calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
    return [ast.unparse(c.func) for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


@pytest.fixture(scope="module")
def fi_rule(tmp_path_factory) -> types.SimpleNamespace:
    """The wheel's ``bind_stream`` module and its ``_check_stream`` / ``rebind_stream`` functions."""
    wheel = os.environ.get(WHEEL_ENV)
    if not wheel:
        pytest.skip(f"set {WHEEL_ENV} to the flashinfer-python 0.7.4 wheel to run FlashInfer's own stream rule")
    root = tmp_path_factory.mktemp("fi_wheel")
    with zipfile.ZipFile(wheel) as z:
        z.extract(LIFECYCLE_PATH, root)
        ar_source = z.read(AR_PATH).decode()
    spec = importlib.util.spec_from_file_location("fi_pcie_ipc_lifecycle", root / LIFECYCLE_PATH)
    lifecycle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lifecycle)

    tree = ast.parse(ar_source, filename=AR_PATH)
    # _check_stream's bind_stream is the _lifecycle one: the module imports it from there.
    assert any(
        isinstance(n, ast.ImportFrom)
        and n.level == 1
        and n.module == "pcie_ipc_collectives._lifecycle"
        and "bind_stream" in [a.name for a in n.names]
        for n in tree.body
    )
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PcieIpcAllReduceWorkspace")
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    # What the stand-in copies from the real class: unbound at construction ...
    init_sets = [ast.unparse(n) for n in ast.walk(methods["__init__"]) if isinstance(n, (ast.Assign, ast.AnnAssign))]
    assert any(s.startswith("self._stream") and s.endswith("= None") for s in init_sets), init_sets
    # ... and all_reduce checks the stream before it launches.
    order = _calls_in_order(methods["all_reduce"])
    assert "self._check_stream" in order and order.index("self._check_stream") < order.index("self._launch"), order
    assert "bind_stream" in _calls_in_order(methods["_check_stream"])

    module = ast.Module(body=[methods["_check_stream"], methods["rebind_stream"]], type_ignores=[])
    namespace = {"bind_stream": lifecycle.bind_stream, "torch": torch, "Optional": Optional}
    exec(compile(module, AR_PATH, "exec"), namespace)
    return types.SimpleNamespace(
        lifecycle=lifecycle, check_stream=namespace["_check_stream"], rebind_stream=namespace["rebind_stream"]
    )


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self._log = name, log

    def wait_stream(self, other: "FakeStream") -> None:
        self._log.append(("wait", self.name, other.name))

    def __repr__(self) -> str:
        return f"<fake stream {self.name}>"


class FakeCuda:
    """Just enough of ``torch.cuda`` for FlashInfer's rule, the backend and ``capture_cuda_graph``."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.default = FakeStream("default", self.log)
        self.current = self.default
        self.capturing = False
        self.sides = 0

    def install(self, mp: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        mp.setattr(cuda, "current_stream", lambda device=None: self.current)
        mp.setattr(cuda, "is_current_stream_capturing", lambda: self.capturing)
        mp.setattr(cuda, "current_device", lambda: 0)
        mp.setattr(cuda, "synchronize", lambda device=None: self.log.append(("sync",)))
        mp.setattr(cuda, "Stream", self._new_side)
        mp.setattr(cuda, "stream", self._stream)
        mp.setattr(cuda, "CUDAGraph", lambda: object())
        mp.setattr(cuda, "graph", self._graph)

    def _new_side(self) -> FakeStream:
        self.sides += 1
        return FakeStream("side" if self.sides == 1 else f"side{self.sides}", self.log)

    @contextmanager
    def _stream(self, s: FakeStream):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    @contextmanager
    def _graph(self, graph):
        # torch.cuda.graph: synchronize, then capture on its own stream.
        self.log.append(("sync",))
        before, self.current, self.capturing = self.current, FakeStream("capture", self.log), True
        try:
            yield
        finally:
            self.current, self.capturing = before, False


@pytest.fixture
def fake_cuda(monkeypatch, fi_rule) -> FakeCuda:
    fake = FakeCuda()
    fake.install(monkeypatch)

    class StandInWorkspace:
        """``flashinfer.comm.PcieIpcAllReduceWorkspace`` with the wheel's real stream methods."""

        _check_stream = fi_rule.check_stream

        def __init__(self, group, max_numel, dtype, **kw):
            self.device = torch.device("cuda", torch.cuda.current_device())  # as the real __init__
            self._stream = None  # "Bound on first executing use"
            self.max_numel = max_numel

        def rebind_stream(self):
            fake.log.append(("rebind",))
            fi_rule.rebind_stream(self)

        def supports(self, inp):
            return inp.numel() <= self.max_numel

        def all_reduce(self, inp, *, out=None, config=None, enable_pdl=False):
            self._check_stream()  # the real all_reduce's order (checked in fi_rule)
            fake.log.append(("launch", torch.cuda.current_stream().name))
            out.copy_(inp * WORLD)  # every rank holds the same input here
            return out

        def tune(self, hiddens, *, dtype, tune_group=None):
            fake.log.append(("tune",))

        def prepare(self, shapes, *, dtype):
            fake.log.append(("prepare",))
            return {tuple(s): "config" for s in shapes}

        def destroy(self):
            fake.log.append(("destroy",))

    fi = types.ModuleType("flashinfer")
    comm = types.ModuleType("flashinfer.comm")
    comm.PcieIpcAllReduceWorkspace = StandInWorkspace
    fi.comm = comm
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.comm", comm)
    return fake


def _backend() -> PcieIpcBackend:
    return PcieIpcBackend(None, device="cuda:0", dtype=torch.bfloat16, max_numel=64, options={"norm": "torch"})


def test_the_wheels_rule_rejects_a_second_stream(fi_rule, fake_cuda):
    # The harness has teeth: FlashInfer's own rule, called as its all_reduce calls it.
    ws = sys.modules["flashinfer.comm"].PcieIpcAllReduceWorkspace(None, 64, torch.bfloat16)
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    ws.all_reduce(x, out=torch.empty_like(x))
    assert ws._stream is fake_cuda.default
    with torch.cuda.stream(FakeStream("other", fake_cuda.log)):
        with pytest.raises(RuntimeError, match="already bound to .* use one workspace per stream"):
            ws.all_reduce(x, out=torch.empty_like(x))
    fake_cuda.capturing = True  # capture is exempt and leaves the binding alone
    with torch.cuda.stream(FakeStream("capture", fake_cuda.log)):
        ws.all_reduce(x, out=torch.empty_like(x))
    assert ws._stream is fake_cuda.default


def test_eager_then_side_stream_warm_up_then_capture(fake_cuda):
    be = _backend()
    x = torch.full((4, 8), 1.5, dtype=torch.bfloat16)
    assert be.all_reduce(x).tolist() == [[3.0] * 8] * 4  # eager, default stream: binds it

    graph, out = capture_cuda_graph(lambda: be.all_reduce(x), warmup=2, calls=3)  # the worker's sequence
    assert out.tolist() == [[3.0] * 8] * 4
    be.all_reduce(x)  # eager again on the default stream, after the capture

    assert fake_cuda.log == [
        ("launch", "default"),
        ("wait", "side", "default"),  # capture_cuda_graph orders its side stream behind the default one
        ("wait", "side", "default"),  # the backend, before it moves the binding: rebind is an assertion
        ("rebind",),
        ("launch", "side"),
        ("launch", "side"),  # same stream: nothing to move
        ("wait", "default", "side"),  # capture_cuda_graph
        ("sync",),
        ("sync",),  # capture_cuda_graph, then torch.cuda.graph
        ("launch", "capture"),
        ("launch", "capture"),
        ("launch", "capture"),  # exempt: no wait, no rebind
        ("wait", "default", "side"),  # back on the default stream: ordered behind the warm-up, then rebound
        ("rebind",),
        ("launch", "default"),
    ]
    assert be._ws._stream is fake_cuda.default
    assert be.path_counts == {"all_reduce": 7, "stream_rebind": 2}
    be.close()


def test_prepare_unbinds_after_a_synchronize(fake_cuda):
    be = _backend()
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    be.all_reduce(x)
    be.prepare([(4, 8)])
    assert be.prepared == {(4, 8): "config"}
    with torch.cuda.stream(FakeStream("sglang-capture", fake_cuda.log)):
        be.all_reduce(x)
    assert fake_cuda.log == [
        ("launch", "default"),
        ("tune",),
        ("prepare",),
        ("sync",),
        ("rebind",),  # nothing pending after the synchronize: unbinding is true
        ("launch", "sglang-capture"),  # so the next stream needs no wait
    ]
    be.close()
    assert fake_cuda.log[-1] == ("destroy",)
