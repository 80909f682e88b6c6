"""The patch's counting wrappers: every all-reduce's path, the forward mode it belongs to, and the
CUDA graphs that replay it (:mod:`fastverify.patch.paths` defines the counts).

Targets (SGLang 0.5.23, names checked like every other target by :mod:`fastverify.patch.targets`):

``parallel_state.GroupCoordinator.all_reduce`` (wrapped in :mod:`fastverify.patch.slots`)
    the entry point: :func:`counted` runs it and books ONE count with the path the innermost
    observed method ran;
``GroupCoordinator._all_reduce_out_place(self, input_, outplace_all_reduce_method)``
    the out-of-place method SGLang runs; ``"auto"`` (what the compiled graph's
    ``outplace_all_reduce`` op passes) is resolved by SGLang's own
    ``_resolve_outplace_all_reduce_method``, and its None by that function's own rule (PyNccl when
    the group has it, else the in-place path, which then names itself);
``GroupCoordinator._all_reduce_in_place(self, input_)``
    PyNccl when its communicator is enabled, torch symmetric memory where its own predicate takes
    the tensor, else torch.distributed on the device group;
``GroupCoordinator._flashinfer_allreduce(self, input_)``
    the FlashInfer all-reduce path (``flashinfer``);
``device_communicators.pynccl.PyNcclCommunicator.all_reduce(self, tensor)``
    reached first (no method above named itself) inside ``all_reduce``: SGLang's symmetric-memory
    path, which calls PyNccl directly (``pynccl_symm_mem``).

The three ``GroupCoordinator`` methods are also what SGLang's custom ops (``outplace_all_reduce``,
``inplace_all_reduce``, ``flashinfer_allreduce``) call from a torch.compile graph, and what
``dp_attention.py`` / ``engram.py`` reach through ``inplace_all_reduce`` without ``all_reduce``:
called outside ``all_reduce`` they book their own count (one per call, the innermost method).
Nothing is counted while Dynamo traces (the ops run, and count, when the compiled code runs).

``ModelRunner.forward(self, forward_batch)`` sets the forward mode (``forward_batch.forward_mode``,
target or draft runner) and prints the rank's paths line after its first verify forward.

CUDA graphs are counted where every SGLang graph runner captures and replays them: the graph
backend (``runner_backend/base_cuda_graph_backend.py``: ``capture_one(self, shape_key, forward_fn,
...)`` and ``replay(self, shape_key, static_forward_batch, ...)``), wrapped on every subclass that
defines them (decode, prefill, EAGLE draft and draft-extend runners all call
``self.backend.capture_one`` / ``self.backend.replay``). A graph is keyed by its backend and
SGLang's ``ShapeKey``; each replay adds its captured counts to the replaying forward's mode (the
graph's capture mode when no ``ModelRunner.forward`` is running, as when the EAGLE worker replays
its draft graphs). A backend that runs the whole forward eagerly at replay (SGLang's
``--debug-cuda-graph``: ``BreakableCudaGraphBackend(debug_eager=True)``) keeps no graph counts:
its all-reduces are counted as they run, once per replay.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from fastverify.patch import rank as R, targets as T
from fastverify.patch.paths import COUNTER, mode_of, summary

_seen = threading.local()
_first_verify_line: list[Callable[[dict], None]] = []


def _device_backend(coord: Any) -> str:
    try:
        import torch.distributed as dist

        return str(dist.get_backend(coord.device_group)).lower()
    except Exception:
        return "torch_distributed"


def _cpu_path(coord: Any, x: Any, modules: Any) -> str:
    """SGLang 0.5.23's CPU rule (``GroupCoordinator.all_reduce``): ``shm_allreduce`` where its own
    ``is_shm_available(dtype, world_size, local_size)`` holds, else torch.distributed."""
    fn = getattr(R.module(R.MOD_PARALLEL_STATE, modules), "is_shm_available", None)
    try:
        if callable(fn) and fn(x.dtype, coord.world_size, getattr(coord, "local_size", coord.world_size)):
            return "shm"
    except Exception:
        pass
    return _device_backend(coord)


def counted(original: Callable, coord: Any, x: Any, modules: Any = None) -> Any:
    """Run SGLang's own ``all_reduce`` and count the path it took (or the fallback a slot marked)."""
    outer = getattr(_seen, "depth", 0)
    _seen.depth, _seen.method = outer + 1, None
    try:
        out = original(coord, x)
        method = _seen.method
    finally:
        _seen.depth, _seen.method = outer, None
    if method is None:
        method = _cpu_path(coord, x, modules) if getattr(x, "is_cpu", False) else "unobserved"
    fb = COUNTER.take_fallback()
    COUNTER.count(f"fastverify.{fb}.fallback" if fb else f"sglang.{method}", capturing=R.is_capturing())
    return out


def _observed(coord: Any, method: Callable[[], str | None], run: Callable[[], Any], *, top: bool = True) -> Any:
    """One observed method: inside a counted all-reduce it names the path (the first to name one
    wins: an outer method decides before it calls an inner one); called on its own (a compiled
    graph's custom op, a direct ``inplace_all_reduce``) it books its own count when ``top``."""
    if R.is_compiling():
        return run()
    depth = getattr(_seen, "depth", 0)
    if depth == 0 and (not top or getattr(coord, "world_size", 2) <= 1):
        return run()
    if getattr(_seen, "method", None) is None:
        try:
            _seen.method = method()
        except Exception:
            _seen.method = "unobserved"
    if depth > 0:
        return run()
    _seen.depth = 1
    try:
        out = run()
        name = _seen.method or "unobserved"
    finally:
        _seen.depth, _seen.method = 0, None
    COUNTER.count(f"sglang.{name}", capturing=R.is_capturing())
    return out


def _out_place_method(coord: Any, x: Any, method: Any) -> str | None:
    """The method ``_all_reduce_out_place`` runs: ``"auto"`` resolved by SGLang's own
    ``_resolve_outplace_all_reduce_method``; its None means PyNccl where the group has one, else
    the in-place path (which names itself: None here)."""
    if str(method) != "auto":
        return str(method)
    got = coord._resolve_outplace_all_reduce_method(x)
    if got is None:
        return "pynccl" if getattr(coord, "pynccl_comm", None) is not None else None
    return str(got)


def make_out_place(original: Callable) -> Callable:
    def _all_reduce_out_place(self, input_, outplace_all_reduce_method, *args, **kwargs):
        return _observed(
            self,
            lambda: _out_place_method(self, input_, outplace_all_reduce_method),
            lambda: original(self, input_, outplace_all_reduce_method, *args, **kwargs),
        )

    return _all_reduce_out_place


def _in_place_method(coord: Any, x: Any) -> str:
    nccl, symm = getattr(coord, "pynccl_comm", None), getattr(coord, "torch_symm_mem_comm", None)
    if nccl is not None and not nccl.disabled:
        return "pynccl"
    if symm is not None and not symm.disabled and symm.should_torch_symm_mem_allreduce(x):
        return "torch_symm_mem"
    return _device_backend(coord)


def make_in_place(original: Callable) -> Callable:
    def _all_reduce_in_place(self, input_, *args, **kwargs):
        return _observed(self, lambda: _in_place_method(self, input_), lambda: original(self, input_, *args, **kwargs))

    return _all_reduce_in_place


def make_flashinfer(original: Callable) -> Callable:
    def _flashinfer_allreduce(self, input_, *args, **kwargs):
        return _observed(self, lambda: "flashinfer", lambda: original(self, input_, *args, **kwargs))

    return _flashinfer_allreduce


def make_pynccl(original: Callable) -> Callable:
    """PyNccl reached directly inside ``all_reduce`` (no method named itself first): SGLang's
    symmetric-memory path. Outside an all-reduce it is PyNccl's own use (its warm-up at
    construction, other collectives' callers): not a tensor-parallel all-reduce, not counted."""

    def all_reduce(self, tensor, *args, **kwargs):
        return _observed(self, lambda: "pynccl_symm_mem", lambda: original(self, tensor, *args, **kwargs), top=False)

    return all_reduce


def on_first_verify(fn: Callable[[dict], None]) -> None:
    """Call ``fn(counts)`` once, after this process's first verify forward (the rank's line)."""
    _first_verify_line[:] = [fn]


def make_forward(original: Callable) -> Callable:
    def forward(self, forward_batch, *args, **kwargs):
        mode = mode_of(getattr(forward_batch, "forward_mode", None), bool(getattr(self, "is_draft_worker", False)))
        with COUNTER.in_mode(mode):
            out = original(self, forward_batch, *args, **kwargs)
        if mode == "verify" and _first_verify_line and not R.is_capturing():
            fn = _first_verify_line.pop()
            try:
                fn(COUNTER.snapshot())
            except Exception:
                pass
        return out

    return forward


def _capture_mode(runner: Any) -> str:
    """The counting mode of the graphs a graph runner captures: its ``capture_forward_mode`` on its
    model runner (target or draft); ``other`` without one."""
    return mode_of(
        getattr(runner, "capture_forward_mode", None),
        bool(getattr(getattr(runner, "model_runner", None), "is_draft_worker", False)),
    )


def graph_key(backend: Any, shape_key: Any) -> tuple[str, int, int]:
    """(capture mode, ``shape_key.size``, the backend's identity): the graph SGLang replays as
    ``backend.replay(shape_key, ...)``. Variants of one size (LoRA, attention, greedy sampling)
    share a key: they run the same layers, so the same all-reduces."""
    runner = getattr(backend, "_cuda_graph_runner", None)
    size = getattr(shape_key, "size", shape_key)
    return _capture_mode(runner), int(size) if isinstance(size, int) else -1, id(backend)


def make_capture_one(original: Callable) -> Callable:
    def capture_one(self, shape_key, forward_fn, *args, **kwargs):
        if getattr(_seen, "graph", None) is not None:  # a subclass's super() call: counted outside
            return original(self, shape_key, forward_fn, *args, **kwargs)
        eager = bool(getattr(self, "_debug_eager", False))
        _seen.graph = shape_key
        try:
            with COUNTER.capturing(graph_key(self, shape_key), eager=eager):
                return original(self, shape_key, forward_fn, *args, **kwargs)
        finally:
            _seen.graph = None

    return capture_one


def make_backend_replay(original: Callable) -> Callable:
    def replay(self, shape_key, static_forward_batch, *args, **kwargs):
        if getattr(_seen, "graph", None) is not None:  # a subclass's super() call: counted outside
            return original(self, shape_key, static_forward_batch, *args, **kwargs)
        _seen.graph = shape_key
        try:
            out = original(self, shape_key, static_forward_batch, *args, **kwargs)
        finally:
            _seen.graph = None
        key = graph_key(self, shape_key)
        COUNTER.replayed(key, into=COUNTER.forward_mode or key[0])
        return out

    return replay


def wrap_graph_backends(modules: Any = None) -> tuple[list[str], str | None]:
    """Wrap ``capture_one`` / ``replay`` on every graph backend class now defined (SGLang's own
    backend modules imported first); idempotent, so the step before capture walks again for a
    backend defined after install. (``Class.attr`` newly wrapped, why none could be)."""
    for name in T.GRAPH_BACKEND_MODULES:
        R.module(name, modules)  # imports it; None (nothing of it to wrap) where this SGLang lacks it
    done, why = [], None
    for target, make in ((T.TARGET_CAPTURE_SHAPE, make_capture_one), (T.TARGET_REPLAY, make_backend_replay)):
        got, why_t = T.wrap_subclasses(target, modules, make)
        done += [f"{c}.{target.attr}" for c in got]
        why = why or why_t
    return done, why


def paths_line(tp: str, counts: dict, backend: str | None) -> str:
    """``fastverify paths [TP r] after the first verify forward: verify: sglang.gloo 5 of 5; ...``"""
    return f"fastverify paths [TP {tp}] after the first verify forward: {summary(counts, backend=backend)}"
