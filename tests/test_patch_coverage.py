"""Every CUDA graph and every all-reduce path SGLang 0.5.23 runs is counted (fastverify/patch/
counting.py, targets.py): the graph backends wrapped by rule and driven through SGLang's real
EAGLE draft, draft-extend and prefill runners on CPU; ``--debug-cuda-graph`` counted once; the
compiled graph's custom ops and the symmetric-memory / FlashInfer paths counted with what ran;
and a walk over the real wheel's source that fails on any graph entry point or all-reduce call
site neither wrapped nor named in ``targets.UNCOUNTED`` with a reason."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastverify.patch import counting as C, rank as R, targets as T
from fastverify.patch.paths import COUNTER

REPO = Path(__file__).resolve().parents[1]
_REAL_GRAPHS = Path(__file__).parent / "data" / "real_graph_counts.py"


def _sglang_python() -> str:
    py = os.environ.get("FASTVERIFY_SGLANG_PYTHON")
    if not py or not Path(py).is_file():
        pytest.skip("FASTVERIFY_SGLANG_PYTHON not set (make the SGLang venv with .ci/sglang-venv.sh)")
    return py


def test_eagle_draft_draft_extend_and_prefill_graphs_are_counted_through_sglangs_real_runners():
    """SGLang's real EAGLEDraftCudaGraphRunner, EAGLEDraftExtendCudaGraphRunner and
    PrefillCudaGraphRunner, each with SGLang's real FullCudaGraphBackend (only the CUDA graph
    object and the device module are CPU stand-ins), capture a shape whose forward issues 2, 3 and
    5 all-reduces; the two warm-ups of each are capture_warmup (2 x 10), and one replay of each
    adds its own count to the draft, draft_extend and extend modes."""
    py = _sglang_python()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    cp = subprocess.run([py, str(_REAL_GRAPHS)], capture_output=True, text=True, timeout=300, env=env, cwd=str(REPO))
    assert cp.returncode == 0, cp.stderr[-3000:]
    got = json.loads(next(ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert {
        "FullCudaGraphBackend.capture_one",
        "FullCudaGraphBackend.replay",
        "BreakableCudaGraphBackend.replay",
        "BreakableCudaGraphBackend.capture_one",
    } <= set(got["wrapped"]), got
    assert got["warmup"] == {"capture_warmup": {"sglang.unobserved": 2 * (2 + 3 + 5)}}
    assert got["replayed"] == {
        "draft": {"sglang.unobserved": 2},
        "draft_extend": {"sglang.unobserved": 3},
        "extend": {"sglang.unobserved": 5},
    }
    assert got["graph_replays"] == 3


# --- stand-ins with SGLang 0.5.23's call structure (parallel_state.py) --------------------------------


class _Comm(SimpleNamespace):
    disabled = False


class _Coord:
    """GroupCoordinator's dispatch as SGLang 0.5.23 has it: symmetric memory calls PyNccl directly;
    FlashInfer through ``_flashinfer_allreduce``; ``"auto"`` resolved inside ``_all_reduce_out_place``."""

    world_size, unique_name = 2, "tp:0"

    def __init__(self, symm=False, fi=False, ca_rows=0):
        self.pynccl_comm = _Pynccl()
        self.torch_symm_mem_comm = None
        self.symm, self.fi, self.ca_rows = symm, fi, ca_rows

    def all_reduce(self, input_):
        if self.symm:
            self.pynccl_comm.all_reduce(input_)
            return input_
        if self.fi:
            return self._flashinfer_allreduce(input_)
        return self._all_reduce_out_place(input_, "auto")

    def _resolve_outplace_all_reduce_method(self, input_):
        return "ca" if input_.rows <= self.ca_rows else None

    def _all_reduce_out_place(self, input_, outplace_all_reduce_method):
        if outplace_all_reduce_method == "auto" and self._resolve_outplace_all_reduce_method(input_) is None:
            return self.pynccl_comm.outplace_all_reduce(input_)
        return input_

    def _all_reduce_in_place(self, input_):
        self.pynccl_comm.all_reduce(input_)

    def _flashinfer_allreduce(self, input_):
        return input_


class _Pynccl:
    disabled = False

    def all_reduce(self, tensor, op=None):
        return None

    def outplace_all_reduce(self, in_tensor):
        return in_tensor


@pytest.fixture
def wrapped(monkeypatch):
    for target, make in (
        (T.TARGET_OUT_PLACE, C.make_out_place),
        (T.TARGET_IN_PLACE, C.make_in_place),
        (T.TARGET_FLASHINFER_AR, C.make_flashinfer),
    ):
        monkeypatch.setattr(_Coord, target.attr, make(_Coord.__dict__[target.attr]))
    monkeypatch.setattr(_Pynccl, "all_reduce", C.make_pynccl(_Pynccl.__dict__["all_reduce"]))
    orig = _Coord.__dict__["all_reduce"]
    monkeypatch.setattr(_Coord, "all_reduce", lambda self, x: C.counted(orig, self, x))
    monkeypatch.setattr(R, "is_capturing", lambda: False)
    COUNTER.reset()
    yield
    COUNTER.reset()


def _x(rows):
    return SimpleNamespace(rows=rows, is_cpu=False)


def test_symmetric_memory_and_flashinfer_paths_are_counted_by_what_ran(wrapped):
    _Coord(symm=True).all_reduce(_x(4))
    _Coord(fi=True).all_reduce(_x(4))
    _Coord(ca_rows=8).all_reduce(_x(4))  # "auto" resolved by SGLang's own rule: ca
    _Coord(ca_rows=8).all_reduce(_x(16))  # resolved None with a PyNccl communicator: pynccl
    assert COUNTER.snapshot() == {
        "other": {"sglang.pynccl_symm_mem": 1, "sglang.flashinfer": 1, "sglang.ca": 1, "sglang.pynccl": 1}
    }


def test_a_compiled_graphs_custom_ops_and_direct_inplace_callers_are_counted_once(wrapped):
    """Under torch.compile SGLang's all_reduce is traced into ``outplace_all_reduce(x, "auto")`` /
    ``inplace_all_reduce`` ops whose bodies call the GroupCoordinator methods directly at run time
    (``dp_attention.py`` and ``engram.py`` call ``inplace_all_reduce`` eagerly too)."""
    coord = _Coord(ca_rows=8)
    with COUNTER.in_mode("verify"):
        coord._all_reduce_out_place(_x(4), "auto")  # the op's body, as the compiled code runs it
        coord._all_reduce_out_place(_x(64), "auto")
        coord._all_reduce_in_place(_x(64))
        coord._flashinfer_allreduce(_x(4))
        coord.pynccl_comm.all_reduce(_x(4))  # PyNccl on its own: not a TP all-reduce
    assert COUNTER.snapshot() == {"verify": {"sglang.ca": 1, "sglang.pynccl": 2, "sglang.flashinfer": 1}}


def test_debug_cuda_graph_counts_each_replay_once(monkeypatch):
    """``--debug-cuda-graph`` (SGLang 0.5.23 ``runner_backend/utils.py``) builds
    ``BreakableCudaGraphBackend(debug_eager=True)``, which captures the whole forward as one eager
    break and reruns it in Python at every replay: its all-reduces count as they run, and the
    graph adds nothing more, even where the capture-time run was seen as capturing."""
    flag = {"on": False}
    monkeypatch.setattr(R, "is_capturing", lambda: flag["on"])
    coord = SimpleNamespace(world_size=2)

    def forward():
        for _ in range(3):
            C.counted(lambda c, x: x, coord, _x(4))

    class Breakable:
        def __init__(self, debug_eager):
            self._debug_eager, self._fns = debug_eager, {}

        def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
            forward_fn()
            flag["on"] = True  # the capture context; the eager break runs inside it
            forward_fn()
            flag["on"] = False
            self._fns[shape_key] = forward_fn if self._debug_eager else (lambda: None)

        def replay(self, shape_key, static_forward_batch, **kwargs):
            self._fns[shape_key]()  # debug: the forward's Python again

    for target, make in ((T.TARGET_CAPTURE_SHAPE, C.make_capture_one), (T.TARGET_REPLAY, C.make_backend_replay)):
        monkeypatch.setattr(Breakable, target.attr, make(Breakable.__dict__[target.attr]))
    for debug in (True, False):
        COUNTER.reset()
        be = Breakable(debug)
        be.capture_one(7, forward)
        COUNTER.take()
        with COUNTER.in_mode("verify"):
            be.replay(7, None)
            be.replay(7, None)
        assert COUNTER.take() == {"verify": {"sglang.unobserved": 6}}, debug
    COUNTER.reset()


# --- coverage by rule, over the real wheel's source ---------------------------------------------------

GRAPH_METHODS = ("capture_one_shape", "execute", "replay", "capture")
AR_CALLS = (
    "_all_reduce_out_place",
    "_all_reduce_in_place",
    "outplace_all_reduce",
    "inplace_all_reduce",
    "flashinfer_allreduce",
    "_flashinfer_allreduce",
)
COUNTED_ATTRS = {t.attr for t in T.COUNT_TARGETS} | {
    "flashinfer_allreduce",
    "outplace_all_reduce",
    "inplace_all_reduce",
}


def _wheel_sources() -> dict[str, str]:
    whl = os.environ.get("FASTVERIFY_SGLANG_WHEEL")
    if whl and Path(whl).is_file():
        with zipfile.ZipFile(whl) as z:
            return {
                n: z.read(n).decode("utf-8", "replace")
                for n in z.namelist()
                if n.startswith("sglang/srt/") and n.endswith(".py")
            }
    pytest.skip("FASTVERIFY_SGLANG_WHEEL not set")


def _uncounted(qual: str) -> bool:
    for key, why in T.UNCOUNTED.items():
        assert why.strip(), key
        stem = key.split("*")[0]
        if qual.startswith(stem) and (key.count("*") == 0 or qual.endswith(key.split("*")[1])):
            return True
    return False


def _graph_class_verdict(mod: str, cls: ast.ClassDef, graph_bases: set[str]) -> str | None:
    """None when the class is covered, else what it lacks."""
    qual = f"{mod}.{cls.name}"
    bases = {getattr(b, "id", getattr(b, "attr", "")) for b in cls.bases}
    if bases & graph_bases or cls.name == "BaseCudaGraphBackend":
        return None  # a graph backend: capture_one / replay wrapped by rule on every subclass
    if _uncounted(qual):
        return None
    src = ast.unparse(cls)
    if "backend.capture_one(" in src or "backend.replay(" in src or ".capture_one_shape(" in src:
        return None  # captures / replays through its backend, which is counted
    if "runner.replay(" in src or "r.replay(" in src:
        return None
    return f"{qual} defines {', '.join(GRAPH_METHODS)}-style methods and is neither wrapped nor in UNCOUNTED"


def test_every_graph_entry_point_and_all_reduce_call_site_is_counted_or_named():
    srcs = _wheel_sources()
    trees = {n: ast.parse(s) for n, s in srcs.items()}
    graph_bases = {"BaseCudaGraphBackend"}
    changed = True
    while changed:  # every class deriving from a graph backend, transitively
        changed = False
        for tree in trees.values():
            for c in (n for n in tree.body if isinstance(n, ast.ClassDef)):
                names = {getattr(b, "id", getattr(b, "attr", "")) for b in c.bases}
                if names & graph_bases and c.name not in graph_bases:
                    graph_bases.add(c.name)
                    changed = True
    misses, seen_graph, seen_calls = [], 0, 0
    for name, tree in trees.items():
        mod = name[:-3].replace("/", ".")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                defs = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                # a graph entry point by name or by what it touches (a class that mentions graphs)
                if not defs & set(GRAPH_METHODS) or not (
                    "Graph" in node.name or "graph" in name or "graph" in ast.unparse(node).lower()
                ):
                    continue
                seen_graph += 1
                why = _graph_class_verdict(mod, node, graph_bases)
                if why:
                    misses.append(why)
            elif isinstance(node, ast.Call):
                fn = node.func
                called = getattr(fn, "attr", getattr(fn, "id", None))
                if called in AR_CALLS:
                    seen_calls += 1
                    if called not in COUNTED_ATTRS:
                        misses.append(f"{mod}:{node.lineno} calls {called}, which is not counted")
                elif called == "all_reduce" and isinstance(fn, ast.Attribute) and "pynccl_comm" in ast.unparse(fn):
                    seen_calls += 1  # PyNcclCommunicator.all_reduce: wrapped (symmetric-memory path)
                    if T.TARGET_PYNCCL_AR not in T.COUNT_TARGETS:
                        misses.append(f"{mod}:{node.lineno} calls pynccl all_reduce, not counted")
    assert seen_graph >= 30 and seen_calls >= 12, (seen_graph, seen_calls)
    assert misses == [], "\n".join(misses)
    # the custom ops reach only wrapped methods (their bodies, read from the source)
    ps = trees["sglang/srt/distributed/parallel_state.py"]
    ops = {f.name: ast.unparse(f) for f in ps.body if isinstance(f, ast.FunctionDef)}
    assert "group._all_reduce_in_place(" in ops["inplace_all_reduce"]
    assert "group._all_reduce_out_place(" in ops["outplace_all_reduce"]
    assert "group._flashinfer_allreduce(" in ops["flashinfer_allreduce"]
