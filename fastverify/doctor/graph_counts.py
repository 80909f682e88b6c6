"""The doctor cases a CPU cannot show: the patch's counts (:mod:`fastverify.patch.counting`) on a
real CUDA graph and on a compiled forward, through SGLang's own classes.

``graph_counts``: SGLang 0.5.23's ``EAGLEDraftCudaGraphRunner``, ``EAGLEDraftExtendCudaGraphRunner``
(``speculative/eagle_draft_cuda_graph_runner.py``, ``eagle_draft_extend_cuda_graph_runner.py``) and
``PrefillCudaGraphRunner`` (``model_executor/runner/prefill_cuda_graph_runner.py``), each with
SGLang's ``FullCudaGraphBackend`` (``model_executor/runner_backend/full_cuda_graph_backend.py``),
capture one shape whose forward issues 2, 3 and 5 all-reduces and replay it once. Each all-reduce is
the patch's ``counted()`` around a real in-place add of 1 on a 1-element fp32 tensor on the device
(no collective: one process). The runners' GPU-only constructors are skipped
(``object.__new__``); the backend gets the device module (``torch.cuda`` on a GPU), the TP group's
barrier, the pool precarve and the memory saver as no-ops. Want: the two warm-ups of each capture
booked as ``capture_warmup`` (2 x (2 + 3 + 5)), each replay its own count in the ``draft``,
``draft_extend`` and ``extend`` modes, and with a real graph the tensor at 3 x N (two eager warm-ups
and one replay: a capture runs no kernel).

``compiled_counts``: two processes on a gloo group call SGLang's ``GroupCoordinator.all_reduce``
(``distributed/parallel_state.py``) from a ``torch.compile`` d forward (Dynamo's ``eager`` backend),
:data:`CALLS` times. Under compile SGLang emits its custom op: ``inplace_all_reduce`` for a group
with no accelerated communicator (``torch.distributed`` on the gloo device group, CUDA tensors
staged by gloo: both ranks may share one GPU), ``outplace_all_reduce(..., "auto")`` for a group with
PyNccl (SGLang's own ``PyNcclCommunicator``: one GPU per rank, so only with two GPUs). Want: one
count per call, on the path SGLang ran (``gloo``, ``pynccl``), and each rank's output
``2 * (1 + 2) + 1 = 7`` (rank ``r`` holds ``r + 1``).

The core functions take the device pieces as parameters, so a CPU test drives the same code with
stand-ins; :func:`check_graph_counts` and :func:`check_compiled_counts` run them on the GPU in
spawned processes (the patch is installed there, never in the doctor's own process).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from fastverify.doctor.core import CheckContext, Outcome, Status, _out, free_port, spawn
from fastverify.patch import counting as C, rank as R
from fastverify.patch.install import install, installed
from fastverify.patch.paths import COUNTER

TIMEOUT_S = 300.0
WORLD = 2
CALLS = 3
RUNNERS = (  # (name, module, class, capture mode, draft worker, all-reduces in the forward)
    (
        "eagle_draft",
        "sglang.srt.speculative.eagle_draft_cuda_graph_runner",
        "EAGLEDraftCudaGraphRunner",
        "DECODE",
        True,
        2,
    ),
    (
        "eagle_draft_extend",
        "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner",
        "EAGLEDraftExtendCudaGraphRunner",
        "DRAFT_EXTEND_V2",
        True,
        3,
    ),
    (
        "prefill",
        "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
        "PrefillCudaGraphRunner",
        "EXTEND",
        False,
        5,
    ),
)
REPLAY_MODE = {"eagle_draft": "draft", "eagle_draft_extend": "draft_extend", "prefill": "extend"}
NO_SGLANG = "SGLang not importable: the patch's counts on SGLang's graph runners and compiled ops are not checked"
PATCH_ENV = {"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "off"}  # counting only, as every TP worker has it


# --- graph_counts ------------------------------------------------------------------------------


def _backend_for(runner: Any, device_module: Any) -> Any:
    """SGLang's ``FullCudaGraphBackend`` for ``runner`` with the device module given; what its
    constructor reads from SGLang's parallel state and memory saver set to no-ops."""
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import (
        FullCudaGraphBackend,
    )

    be = object.__new__(FullCudaGraphBackend)
    be._cuda_graph_runner, be._pool, be._capture_stream, be._graphs, be._outputs = runner, None, None, {}, {}
    be._device_module = device_module
    be._tp_group = SimpleNamespace(barrier=lambda: None)  # one process: nothing to wait for
    be._precarve = SimpleNamespace(measure=contextlib.nullcontext, mint=lambda: None)
    be._reuse_output_buffer, be._output_buffer, be._memory_saver_adapter = False, None, None
    return be


def run_graphs(
    device_module: Any, device: Any, *, graph_class: Any = None, capturing: Callable[[], bool] | None = None
) -> dict[str, Any]:
    """Install the patch (counting only), capture one shape on each runner of :data:`RUNNERS`, replay
    each once; returns what was wrapped and counted.

    Parameters
    ----------
    device_module
        What SGLang's backend calls ``synchronize()`` and ``graph(cuda_graph=, pool=, stream=)`` on:
        ``torch.cuda`` on a GPU.
    device
        Where each forward's 1-element fp32 tensor lives.
    graph_class
        Stands in for ``torch.cuda.CUDAGraph`` (which the backend builds by that name) where given.
    capturing
        Stands in for the patch's ``is_capturing`` (the stream's capture state) where given.

    Returns
    -------
    dict
        ``wrapped`` (the graph-backend targets the patch wrapped), ``uncounted`` (why not, if not),
        ``warmup`` and ``replayed`` (the patch's counts: mode -> path -> n), ``values`` (each
        forward's tensor after its replay), ``issued`` (all-reduces per forward).
    """
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    report = install(environ=PATCH_ENV)
    out: dict[str, Any] = {
        "wrapped": sorted(k for k in installed() if k.split(".")[-1] in ("capture_one", "replay")),
        "uncounted": report.uncounted,
    }
    if graph_class is not None:
        torch.cuda.CUDAGraph = graph_class
    if capturing is not None:
        R.is_capturing = capturing
    coord = SimpleNamespace(world_size=2)  # what counted() reads of SGLang's GroupCoordinator

    def forward(x: Any, n: int) -> Callable[[], Any]:
        def fwd() -> Any:
            for _ in range(n):
                C.counted(lambda c, t: t.add_(1.0), coord, x)
            return x

        return fwd

    COUNTER.reset()
    backends, tensors = {}, {}
    for name, module, cls_name, mode, draft, n in RUNNERS:
        cls = getattr(__import__(module, fromlist=[cls_name]), cls_name)
        runner = object.__new__(cls)  # the GPU-only constructor skipped: capture/replay are the backend's
        runner.capture_forward_mode = getattr(ForwardMode, mode)
        runner.model_runner = SimpleNamespace(is_draft_worker=draft)
        backends[name] = runner.backend = _backend_for(runner, device_module)
        tensors[name] = torch.zeros(1, dtype=torch.float32, device=device)
        runner.backend.capture_one(ShapeKey(size=4), forward(tensors[name], n))
    out["warmup"] = COUNTER.snapshot()  # only capture_warmup: the captured counts are the graphs'
    COUNTER.take()
    for name in ("eagle_draft", "eagle_draft_extend"):  # the EAGLE worker replays its draft graphs itself
        backends[name].replay(ShapeKey(size=4), None)
    with COUNTER.in_mode("extend"):  # ModelRunner.forward of an extend batch replays the prefill graph
        backends["prefill"].replay(ShapeKey(size=4), None)
    device_module.synchronize()
    out["replayed"] = COUNTER.take()
    out["values"] = {name: float(t.item()) for name, t in tensors.items()}
    out["issued"] = {name: n for name, *_, n in RUNNERS}
    return out


def graph_verdict(got: dict[str, Any], *, real_graph: bool) -> tuple[bool, str]:
    """(the counts equal what was issued, one line). ``real_graph``: the graph replays kernels, so
    each tensor must read 3 x N after its replay."""
    if "error" in got:
        return False, got["error"]
    issued = got["issued"]
    want_warm = {"capture_warmup": 2 * sum(issued.values())}
    warm = {m: sum(p.values()) for m, p in got["warmup"].items()}
    rep = {m: sum(p.values()) for m, p in got["replayed"].items()}
    want_rep = {REPLAY_MODE[k]: n for k, n in issued.items()}
    if warm != want_warm:
        return False, f"capture warm-ups counted {warm}, want {want_warm} (wrapped: {got['wrapped']})"
    if rep != want_rep:
        why = f"; {got['uncounted']}" if got.get("uncounted") else ""
        return False, f"graph replays counted {rep}, want {want_rep} (wrapped: {got['wrapped']}{why})"
    want_vals = {k: 3.0 * n for k, n in issued.items()}
    if real_graph and got["values"] != want_vals:
        return False, f"the replayed graphs left {got['values']}, want {want_vals}: a replay did not run the forward"
    return True, (
        f"SGLang's EAGLE draft, draft-extend and prefill graph runners captured through FullCudaGraphBackend"
        f"{' (real CUDA graphs)' if real_graph else ''}: warm-ups {warm['capture_warmup']} capture_warmup, "
        f"replays counted draft {rep['draft']}, draft_extend {rep['draft_extend']}, extend {rep['extend']} "
        f"(each all-reduce the patch's counted() around an in-place add on the device)"
    )


def _graph_worker(q: Any) -> None:
    try:
        import torch

        torch.cuda.set_device(0)
        got = run_graphs(torch.cuda, torch.device("cuda", 0))
    except BaseException as err:  # noqa: BLE001 - reported to the parent in one line
        got = {"error": f"{type(err).__name__}: {err}"}
    q.put(got)


# --- compiled_counts ---------------------------------------------------------------------------


def _group(name: str, local_rank: int, pynccl: bool) -> Any:
    """SGLang's ``GroupCoordinator`` over all ranks, its device group on the default group's
    backend (gloo); ``name`` is none of the TP group names SGLang builds its PCIe IPC
    communicator for."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    return GroupCoordinator(
        [list(range(WORLD))],
        local_rank,
        dist.get_backend(),
        use_pynccl=pynccl,
        use_mscclpp=False,
        use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False,
        use_xpu_communicator=False,
        group_name=name,
    )


def run_compiled(
    rank: int,
    port: int,
    device: Any,
    *,
    local_rank: int = 0,
    pynccl: bool = False,
    attach: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """One of :data:`WORLD` ranks: install the patch (counting only), build SGLang's
    ``GroupCoordinator`` over a gloo device group (and a second one with PyNccl when ``pynccl``, or
    one given a communicator by ``attach``), call a ``torch.compile`` d forward
    ``all_reduce(2 x) + 1`` :data:`CALLS` times on each, and take the patch's counts after each
    call. ``device`` holds the (4, 8) fp32 inputs (rank ``r``: ``r + 1``); ``local_rank`` picks
    SGLang's device for the groups (``cuda:<local_rank>`` on a GPU; one per rank for PyNccl).

    Returns {group: {"counts": [per call: path -> n], "outs": [per call: the set of output values],
    "method": what SGLang resolves for "auto" (None: its fallback)}}.
    """
    import torch
    import torch.distributed as dist

    install(environ=PATCH_ENV)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    groups = {"plain": _group("doctor", local_rank, False)}
    if pynccl or attach is not None:
        groups["pynccl"] = _group("doctor_pynccl", local_rank, pynccl)
        if attach is not None:
            attach(groups["pynccl"])
    out: dict[str, Any] = {}
    for name, g in groups.items():
        fwd = torch.compile(lambda x, g=g: g.all_reduce(x * 2) + 1, backend="eager", fullgraph=True)
        x = torch.full((4, 8), float(rank + 1), device=device)
        res = out[name] = {"counts": [], "outs": []}
        COUNTER.take()
        for _ in range(CALLS):
            y = fwd(x)
            res["outs"].append(sorted({float(v) for v in y.flatten().tolist()}))
            res["counts"].append({p: n for paths in COUNTER.take().values() for p, n in paths.items()})
        res["method"] = g._resolve_outplace_all_reduce_method(x) if g.pynccl_comm is not None else None
    dist.destroy_process_group()
    return out


def compiled_verdict(got: dict[int, dict[str, Any]]) -> tuple[bool, str]:
    """(every rank's every call counted once on the path SGLang ran and summed over both ranks, one line)."""
    bad = [f"rank {r}: {res['error']}" for r, res in sorted(got.items()) if "error" in res]
    if bad:
        return False, "; ".join(bad)
    want_out = [2.0 * sum(r + 1 for r in range(WORLD)) + 1.0]
    seen = []
    for r, res in sorted(got.items()):
        for name, g in res.items():
            path = "sglang.gloo" if name == "plain" else f"sglang.{g['method'] or 'pynccl'}"
            if g["counts"] != [{path: 1}] * CALLS:
                return False, f"rank {r} {name} group: the patch counted {g['counts']}, want {path} once per call"
            if g["outs"] != [want_out] * CALLS:
                return False, f"rank {r} {name} group: outputs {g['outs']}, want {want_out}"
            seen.append(f"{name} group {path}")
    groups = sorted(set(seen))
    return True, (
        f"torch.compile'd forward (Dynamo eager backend) calling SGLang's GroupCoordinator.all_reduce on "
        f"{WORLD} gloo ranks, {CALLS} calls: one count per call ({', '.join(groups)}); outputs {want_out[0]:g}"
    )


def _compiled_worker(rank: int, port: int, gpus: int, q: Any) -> None:
    try:
        import torch

        torch.cuda.set_device(rank % gpus)
        got = run_compiled(rank, port, torch.device("cuda", rank % gpus), local_rank=rank % gpus, pynccl=gpus >= WORLD)
    except BaseException as err:  # noqa: BLE001 - reported to the parent in one line
        got = {"error": f"{type(err).__name__}: {err}"}
    q.put((rank, got))


def _sglang_reason() -> str | None:
    try:
        return None if importlib.util.find_spec("sglang") is not None else NO_SGLANG
    except (ImportError, ValueError):
        return NO_SGLANG


def check_graph_counts(ctx: CheckContext) -> Outcome:
    """SGLang's EAGLE draft, draft-extend and prefill runners capture and replay real CUDA graphs; the
    patch's counts equal the all-reduces issued (a spawned process with the patch installed)."""
    if (why := _sglang_reason()) is not None:
        return _out(Status.skipped, why)
    got = spawn(_graph_worker, [()], TIMEOUT_S)[0]
    ok, line = graph_verdict(got, real_graph=True)
    if not ok:
        return _out(
            Status.fail,
            line,
            "report this with `fastverify doctor --json`: the patch's paths line would miscount graph replays",
            result=got,
        )
    return _out(Status.ok, line, result=got)


def check_compiled_counts(ctx: CheckContext) -> Outcome:
    """A compiled forward's SGLang all-reduce op, counted once per call (2 spawned ranks on gloo;
    PyNccl's outplace op too where there are two GPUs)."""
    if (why := _sglang_reason()) is not None:
        return _out(Status.skipped, why)
    port, gpus = free_port(), max(1, ctx.gpu_count)
    answers = spawn(_compiled_worker, [(r, port, gpus) for r in range(WORLD)], TIMEOUT_S)
    got = {a[0]: a[1] for a in answers if isinstance(a, tuple)}
    for r in range(WORLD):
        got.setdefault(r, {"error": f"rank {r} did not answer within {TIMEOUT_S:.0f} s"})
    ok, line = compiled_verdict(got)
    if ok and gpus < WORLD:
        line += '; PyNccl\'s outplace_all_reduce("auto") not checked: it needs one GPU per rank'
    if not ok:
        return _out(
            Status.fail,
            line,
            "report this with `fastverify doctor --json`: the patch would miscount compiled all-reduces",
            ranks=got,
        )
    return _out(Status.ok, line, ranks=got)
