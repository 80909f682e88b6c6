"""The patch's counting wrappers: every all-reduce's path, the forward mode it belongs to, and the
CUDA graphs that replay it (:mod:`fastverify.patch.paths` defines the counts).

Targets (SGLang 0.5.23, names checked like every other target by :mod:`fastverify.patch.targets`):

``parallel_state.GroupCoordinator._all_reduce_out_place(self, input_, outplace_all_reduce_method)``
    records the method SGLang's dispatch chose, as it runs it;
``parallel_state.GroupCoordinator._all_reduce_in_place(self, input_)``
    records the in-place path: PyNccl when its communicator is enabled, torch symmetric memory where
    its own predicate takes the tensor, else torch.distributed on the device group;
``model_runner.ModelRunner.forward(self, forward_batch)``
    sets the forward mode (``forward_batch.forward_mode``, target or draft runner) for the all-reduces
    it issues, and prints the rank's paths line after its first verify forward;
``runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_one_shape(self, size)``
    counts what one graph captures, keyed by its capture mode and size (the key SGLang replays by:
    the batch size, or the token count in ragged-verify mode);
``runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute(self, forward_batch)``
    adds the replayed graph's counts (``_replay_graph_key.size``) to the replaying forward's mode.

``GroupCoordinator.all_reduce`` itself is wrapped in :mod:`fastverify.patch.install` (one wrapper
for the dispatch slot and the count): :func:`counted` is what it calls for SGLang's own path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from fastverify.patch import rank as R
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
    _seen.method = None
    out = original(coord, x)
    method = _seen.method
    _seen.method = None
    if method is None:
        method = _cpu_path(coord, x, modules) if getattr(x, "is_cpu", False) else "unobserved"
    fb = COUNTER.take_fallback()
    COUNTER.count(f"fastverify.{fb}.fallback" if fb else f"sglang.{method}", capturing=R.is_capturing())
    return out


def make_out_place(original: Callable) -> Callable:
    def _all_reduce_out_place(self, input_, outplace_all_reduce_method, *args, **kwargs):
        _seen.method = str(outplace_all_reduce_method)
        return original(self, input_, outplace_all_reduce_method, *args, **kwargs)

    return _all_reduce_out_place


def make_in_place(original: Callable) -> Callable:
    def _all_reduce_in_place(self, input_, *args, **kwargs):
        try:
            nccl, symm = getattr(self, "pynccl_comm", None), getattr(self, "torch_symm_mem_comm", None)
            if nccl is not None and not nccl.disabled:
                _seen.method = "pynccl"
            elif symm is not None and not symm.disabled and symm.should_torch_symm_mem_allreduce(input_):
                _seen.method = "torch_symm_mem"
            else:
                _seen.method = _device_backend(self)
        except Exception:
            _seen.method = "unobserved"
        return original(self, input_, *args, **kwargs)

    return _all_reduce_in_place


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
    """The counting mode of the graphs a ``DecodeCudaGraphRunner`` captures: its
    ``capture_forward_mode`` on its model runner (target or draft)."""
    return mode_of(getattr(runner, "capture_forward_mode", None),
                   bool(getattr(getattr(runner, "model_runner", None), "is_draft_worker", False)))


def _graph_key(runner: Any, size: int) -> tuple[str, int]:
    """(capture mode, the size SGLang keys the graph by): its own ``_capture_graph_size(bs=size,
    num_tokens=size x captured_req_width)`` (0.5.23: the token count in ragged-verify mode, else
    the batch size), else ``size``."""
    mode = _capture_mode(runner)
    rule = getattr(runner, "_capture_graph_size", None)
    if callable(rule):
        try:
            width = int(getattr(runner, "captured_req_width", 1) or 1)
            return mode, int(rule(bs=int(size), num_tokens=int(size) * width))
        except Exception:
            pass
    return mode, int(size)


def make_capture_one_shape(original: Callable) -> Callable:
    def capture_one_shape(self, size, *args, **kwargs):
        with COUNTER.capturing(_graph_key(self, size)):
            return original(self, size, *args, **kwargs)

    return capture_one_shape


def make_execute(original: Callable) -> Callable:
    def execute(self, forward_batch, *args, **kwargs):
        out = original(self, forward_batch, *args, **kwargs)
        size = getattr(getattr(self, "_replay_graph_key", None), "size", None)
        if isinstance(size, int):
            COUNTER.replayed((_capture_mode(self), size), into=COUNTER.mode)
        return out

    return execute


def paths_line(tp: str, counts: dict, backend: str | None) -> str:
    """``fastverify paths [TP r] after the first verify forward: verify: sglang.gloo 5 of 5; ...``"""
    return f"fastverify paths [TP {tp}] after the first verify forward: {summary(counts, backend=backend)}"
