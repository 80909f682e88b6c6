"""The PCIe IPC backend (and the patch's dispatch slot) under CUDA-graph capture, against FlashInfer
0.7.4's own launch-configuration rule.

FlashInfer resolves a shape's launch configuration collectively on its first use (a host read-back)
and caches it until ``tune()``; under capture an unresolved shape raises
(``PcieIpcAllReduceWorkspace.tuned_launch_config``). The patch prepares the verify rows only, and
SGLang's EAGLE draft, draft-extend and prefill graphs present other shapes to the same slot.

Run from ``$FASTVERIFY_FLASHINFER_WHEEL``:

* ``launch_config``, ``supports``, ``tuned_launch_config``, ``prepare``, ``all_reduce`` (its
  ``flashinfer_api`` logging decorator dropped), ``_check_stream`` and ``rebind_stream``: the
  method bodies of ``flashinfer/comm/pcie_ipc_ar.py``, compiled from the wheel's source;
  ``_SUPPORTED_DTYPES`` from the same source;
* ``get_pcie_ipc_launch_config``: ``flashinfer/comm/pcie_ipc_policy.py`` imported from the wheel
  (it needs only ``pcie_ipc_collectives/_constants.py``); ``bind_stream``: ``_lifecycle.py``.

Stood in, each because it is collective or needs CUDA (what the real ones do that matters here
is checked with ``ast``): ``__init__`` (sets the attributes the real one sets, the device CPU),
``_resolve_tuned`` (the cross-rank agreement on the seed: returns the seed), ``_joint_check`` (a
gather), ``_launch`` (the kernel: ``out = inp * WORLD``), ``tune`` (its effect on the cache, the
real ``self._tuned.clear()``), ``destroy``, and FlashInfer's ``AutoTuner`` outside tuning mode.
``torch.cuda``'s stream functions are monkeypatched (capture is a flag).
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
import types
import zipfile

import pytest
import torch

from fastverify.backends.flashinfer_pcie_ipc import PcieIpcBackend
from fastverify.patch import slots
from fastverify.patch.paths import COUNTER

WHEEL_ENV = "FASTVERIFY_FLASHINFER_WHEEL"
COMM = "flashinfer/comm/"
AR_PATH = COMM + "pcie_ipc_ar.py"
PKG = "_fv_fi074"  # the wheel's flashinfer/ under a name of its own: its real __init__ needs CUDA
WORLD, H = 2, 64
VERIFY_ROWS = [6, 12, 24, 48]  # batch 1..8 x 6 draft tokens: what the rank step prepares
MAX_NUMEL = 48 * H
REAL_METHODS = (
    "launch_config",
    "supports",
    "tuned_launch_config",
    "prepare",
    "all_reduce",
    "_check_stream",
    "rebind_stream",
)


def _method_source(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []  # all_reduce's flashinfer_api: API logging only
    return fn


@pytest.fixture(scope="module")
def fi(tmp_path_factory) -> types.SimpleNamespace:
    """The wheel's rule as a workspace class (real methods, stand-ins where noted above)."""
    wheel = os.environ.get(WHEEL_ENV)
    if not wheel:
        pytest.skip(f"set {WHEEL_ENV} to the flashinfer-python 0.7.4 wheel to run FlashInfer's own rule")
    root = tmp_path_factory.mktemp("fi_wheel")
    with zipfile.ZipFile(wheel) as z:
        for rel in ("pcie_ipc_policy.py", "pcie_ipc_collectives/_constants.py", "pcie_ipc_collectives/_lifecycle.py"):
            z.extract(COMM + rel, root)
        source = z.read(AR_PATH).decode()
    saved = {
        k: sys.modules.get(k) for k in (PKG, f"{PKG}.comm", f"{PKG}.comm.pcie_ipc_collectives", f"{PKG}.autotuner")
    }
    for name, path in (
        (PKG, "flashinfer"),
        (f"{PKG}.comm", "flashinfer/comm"),
        (f"{PKG}.comm.pcie_ipc_collectives", "flashinfer/comm/pcie_ipc_collectives"),
    ):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root / path)]
        sys.modules[name] = pkg
    autotuner = types.ModuleType(f"{PKG}.autotuner")

    class AutoTuner:  # flashinfer/autotuner: only is_tuning_mode is read before _resolve_tuned
        @staticmethod
        def get():
            return types.SimpleNamespace(is_tuning_mode=False)

    autotuner.AutoTuner = AutoTuner
    sys.modules[autotuner.__name__] = autotuner
    try:
        policy = importlib.import_module(f"{PKG}.comm.pcie_ipc_policy")
        lifecycle = importlib.import_module(f"{PKG}.comm.pcie_ipc_collectives._lifecycle")
        constants = importlib.import_module(f"{PKG}.comm.pcie_ipc_collectives._constants")
        tree = ast.parse(source, filename=AR_PATH)
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PcieIpcAllReduceWorkspace")
        real = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        # What the stand-ins copy from the real class: an empty cache and an unbound stream at
        # construction, tune() and destroy() empty the cache, and every method read below exists.
        init = [ast.unparse(n) for n in ast.walk(real["__init__"]) if isinstance(n, (ast.Assign, ast.AnnAssign))]
        assert any(s.startswith("self._tuned") and s.endswith("= {}") for s in init), init
        for name in ("tune", "destroy"):
            assert "self._tuned.clear()" in ast.unparse(real[name]), name
        dtypes = next(
            n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_SUPPORTED_DTYPES"
        )
        ns = {
            "torch": torch,
            "get_pcie_ipc_launch_config": policy.get_pcie_ipc_launch_config,
            "bind_stream": lifecycle.bind_stream,
            "__name__": f"{PKG}.comm.pcie_ipc_ar",
            "__package__": f"{PKG}.comm",
        }
        # annotations stay unevaluated: they name typing and policy types the bodies never use
        body = ast.parse("from __future__ import annotations").body + [dtypes]
        body += [_method_source(cls, m) for m in REAL_METHODS]
        exec(compile(ast.Module(body=body, type_ignores=[]), AR_PATH, "exec"), ns)
        yield types.SimpleNamespace(methods={m: ns[m] for m in REAL_METHODS}, max_blocks=constants.AR_MAX_BLOCKS)
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
        for name in [k for k in sys.modules if k.startswith(f"{PKG}.")]:
            sys.modules.pop(name, None)


class Cuda:
    """``torch.cuda`` as the rule and the backend read it: one stream, capture a flag."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.capturing, self.stream = False, object()
        mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        mp.setattr(torch.cuda, "current_stream", lambda device=None: self.stream)
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        mp.setattr(torch.cuda, "synchronize", lambda device=None: None)


@pytest.fixture
def env(fi, monkeypatch) -> types.SimpleNamespace:
    cuda = Cuda(monkeypatch)
    log: list[tuple] = []

    def __init__(self, group, max_numel, dtype=torch.bfloat16, max_blocks=fi.max_blocks, **kw):
        self.group, self.world_size, self.max_numel, self.max_blocks = group, WORLD, max_numel, max_blocks
        self.device = torch.device("cpu")  # the real one: torch.device("cuda", current_device())
        self._handle, self._stream, self._tuned = 1, None, {}
        self.elem_size = torch.empty((), dtype=dtype).element_size()

    def _resolve_tuned(self, inp, seed, tuner):
        log.append(("resolve", tuple(inp.shape)))  # the real one agrees across ranks (host read-back)
        return seed

    def _launch(self, inp, out, config, enable_pdl=False):
        log.append(("launch", tuple(inp.shape), cuda.capturing))
        out.copy_(inp * WORLD)

    def tune(self, hiddens, *, dtype, tune_group=None):
        log.append(("tune",))
        self._tuned.clear()

    workspace = type(
        "PcieIpcAllReduceWorkspace",
        (),
        {
            **fi.methods,
            "__init__": __init__,
            "_resolve_tuned": _resolve_tuned,
            "_launch": _launch,
            "tune": tune,
            "_joint_check": lambda self, local, what: None,
            "destroy": lambda self: log.append(("destroy",)),
        },
    )
    flashinfer, comm = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.comm")
    comm.PcieIpcAllReduceWorkspace = workspace
    flashinfer.comm = comm
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    monkeypatch.setitem(sys.modules, "flashinfer.comm", comm)
    return types.SimpleNamespace(cuda=cuda, log=log, workspace=workspace)


def _backend() -> PcieIpcBackend:
    be = PcieIpcBackend(None, device="cuda:0", dtype=torch.bfloat16, max_numel=MAX_NUMEL, options={"norm": "torch"})
    be.device = torch.device("cpu")  # built for the current CUDA device; its tensors are CPU ones here
    return be


def _x(rows: int) -> torch.Tensor:
    return torch.full((rows, H), 0.5, dtype=torch.bfloat16)


def test_the_wheels_rule_raises_for_a_shape_first_met_under_capture(env):
    """The harness has teeth: FlashInfer's own methods refuse an unresolved shape under capture,
    and serve a prepared or eagerly met one there."""
    ws = env.workspace(None, MAX_NUMEL)
    assert ws.prepare([(6, H)])[(6, H)] is not None
    ws.all_reduce(_x(2), out=torch.empty(2, H, dtype=torch.bfloat16))  # eager: resolved, then cached
    env.cuda.capturing = True
    for rows in (6, 2):
        ws.all_reduce(_x(rows), out=torch.empty(rows, H, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="has not been resolved yet, and resolving it inside a CUDA graph capture"):
        ws.all_reduce(_x(4), out=torch.empty(4, H, dtype=torch.bfloat16))
    assert env.log == [
        ("resolve", (6, H)),
        ("resolve", (2, H)),
        ("launch", (2, H), False),
        ("launch", (6, H), True),
        ("launch", (2, H), True),
    ]


def _slot_all_reduce(be: PcieIpcBackend, sglang_log: list):
    """The patch's ``GroupCoordinator.all_reduce`` with ``be`` in the dispatch slot; SGLang's own
    method records the shape and sums as a 2-rank group of equal inputs would."""

    def original(coord, x, *args, **kwargs):
        sglang_log.append(tuple(x.shape))
        return x * WORLD

    slots.attach_dispatch_backend(be)
    coord = types.SimpleNamespace(unique_name="tp:0", world_size=WORLD)
    wrapped = slots.make_all_reduce(original, {})
    return lambda x: wrapped(coord, x)


def test_dispatch_slot_declines_every_shape_flashinfer_would_refuse_under_capture(env):
    """With the verify rows prepared, every row count a capture can present (1..48: EAGLE draft
    rows ``bs x topk``, draft-extend and verify rows ``bs x draft tokens``, small prefill
    buckets) runs under capture without an error: the slot takes it exactly where FlashInfer's own
    ``tuned_launch_config`` serves it from the cache, and SGLang's own all-reduce runs the rest."""
    be = _backend()
    be.prepare([(r, H) for r in VERIFY_ROWS])
    assert env.log[0] == ("tune",) and sorted(be.prepared) == [(r, H) for r in VERIFY_ROWS]
    sglang: list = []
    all_reduce = _slot_all_reduce(be, sglang)
    COUNTER.take()
    try:
        env.cuda.capturing = True
        taken = []
        for rows in range(1, MAX_NUMEL // H + 1):
            try:
                served = be._ws.tuned_launch_config(_x(rows)) is not None
            except RuntimeError:
                served = False
            before = len(env.log)
            out = all_reduce(_x(rows))
            assert torch.equal(out, _x(rows) * WORLD), rows
            if env.log[before:]:
                assert env.log[before:] == [("launch", (rows, H), True)]
                taken.append(rows)
            assert (rows in taken) == served, rows
        assert taken == VERIFY_ROWS
        assert sglang == [(r, H) for r in range(1, 49) if r not in VERIFY_ROWS]
        counts = COUNTER.take()["other"]  # outside a forward SGLang runs: mode "other"
        assert counts == {"fastverify.pcie_ipc": 4, "fastverify.pcie_ipc.fallback": 44}
    finally:
        slots.DISPATCH_SLOT.backend = None
        be.close()


def test_a_shape_an_eager_warm_up_ran_is_taken_under_capture_until_the_next_tune(env):
    """SGLang warms every graph up eagerly before it captures it (``capture_one``: two runs):
    that resolves the shape in FlashInfer's cache, so the capture may take it. A later prepare's
    ``tune()`` empties that cache, and the slot forgets the shape with it."""
    be = _backend()
    be.prepare([(6, H)])
    sglang: list = []
    all_reduce = _slot_all_reduce(be, sglang)
    try:
        all_reduce(_x(2))  # the draft graph's warm-up
        env.cuda.capturing = True
        all_reduce(_x(2))
        assert sglang == [] and env.log[-1] == ("launch", (2, H), True)
        env.cuda.capturing = False
        be.prepare([(6, H)])  # tunes again: FlashInfer's cache is empty, then 6 rows resolved
        env.cuda.capturing = True
        all_reduce(_x(2))
        assert sglang == [(2, H)] and be.resolved == {(6 * H, H)}
        with pytest.raises(RuntimeError, match="has not been resolved yet"):
            be._ws.tuned_launch_config(_x(2))  # FlashInfer would have refused it
    finally:
        slots.DISPATCH_SLOT.backend = None
        be.close()
