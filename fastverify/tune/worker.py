"""One rank of a tuning trial, run as ``python -m fastverify.tune.worker SPEC_JSON RANK``.

Started by :mod:`fastverify.tune.sweep` in a fresh interpreter per rank and trial, so every trial
gets its own NCCL/IPC state. In order: (1) read the spec (the parent's JSON: the
:class:`~fastverify.tune.trial.TrialSpec` plus ``port``, ``timeout_s``, ``threads``, ``workdir``) and
apply its ``env`` *before* ``torch`` is imported (NCCL reads most settings once per process);
(2) join the parent's ``TCPStore`` and init the process group (gloo on CPU, NCCL on CUDA, one GPU
per rank), touch ``rank<r>.ready``; (3) build, under the parent's build limit: make the backend
(unavailable on any rank: ``skipped`` on every rank), ``prepare()`` (FlashInfer's ``tune()``), one
call per size (the lazy JIT builds), a device synchronize, touch ``rank<r>.built``; (4) measure,
under the trial's limit: per size warm up, check against the torch reference (any rank off:
``wrong_result`` on every rank), time (:func:`_time_cpu`, :func:`_time_cuda`: per-iteration ns;
the parent takes the slowest rank per iteration); (5) write ``rank<r>.json`` atomically. A failing
rank prints its traceback to stderr, writes ``rank<r>.failed`` (``time.monotonic_ns()``) and exits
1; stage lines on stderr (``fastverify-tune rank R: ...``) say where a hung trial was.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import orjson

from fastverify.cudagraph import capture_cuda_graph
from fastverify.errors import shown
from fastverify.procs import rank_device
from fastverify.tune.trial import Op, TrialSpec

HOST = "127.0.0.1"
GRAPH_OPS_MAX = 32
"""Most all-reduce calls captured in one CUDA graph per message size."""
EPS = 1e-6
"""RMSNorm epsilon of the residual + RMSNorm check."""
INJECT_ENV = "FASTVERIFY_TEST_INJECT"
"""Test hook (tests only, never set it otherwise): ``hang:<rank>`` makes that rank sleep forever
right after the build (so in the measurement); ``crash:<rank>`` makes it exit with
:data:`INJECT_CRASH_EXIT` there; ``slow_build:<rank>:<seconds>`` makes it sleep that long in the
build, right after making the backend (a slow JIT build); ``unavailable:<rank>`` makes
``make_backend`` raise ``BackendUnavailable`` on that rank only. Read after the trial's ``env`` is
applied, so a trial can carry it in its ``env``."""
INJECT_CRASH_EXIT = 3
INJECT_KINDS = ("hang", "crash", "slow_build", "unavailable")
READY_MARK = "ready"
"""``rank<r>.ready``: the rank joined the process group (start-up is over)."""
BUILT_MARK = "built"
"""``rank<r>.built``: the rank built its backend, prepared it and ran every size once."""
BUILD_STAGE = "build: "
"""Prefix of the stage lines of the build phase."""


def _stage(rank: int, msg: str) -> None:
    sys.stderr.write(f"fastverify-tune rank {rank:d}: {shown(msg)}\n")
    sys.stderr.flush()


def main(spec_path: str, rank: int) -> None:
    """Run one rank; on any error record the failure and exit 1 (see the module docstring)."""
    workdir = Path(spec_path).parent
    try:
        spec = orjson.loads(Path(spec_path).read_bytes())
        os.environ.update(spec["trial"]["env"])  # before torch: NCCL reads its env once
        os.environ.update(spec["trial"].get("server_env", {}))  # SGLang's start-up sets these last
        result = _run_rank(rank, spec)
        tmp = workdir / f"rank{rank}.json.tmp"
        tmp.write_bytes(orjson.dumps(result))
        os.replace(tmp, workdir / f"rank{rank}.json")
    except BaseException:  # noqa: BLE001 - report everything to the parent, KeyboardInterrupt included
        (workdir / f"rank{rank}.failed").write_text(str(time.monotonic_ns()))
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: communicator destructors at exit can block


def _injection(rank: int) -> tuple[str, str] | None:
    """``(kind, argument)`` of the test hook when it targets ``rank``, else None."""
    value = os.environ.get(INJECT_ENV, "")
    if not value:
        return None
    what, _, rest = value.partition(":")
    target, _, arg = rest.partition(":")
    if what not in INJECT_KINDS or not target.isdigit() or (what == "slow_build") != bool(arg):
        raise ValueError(
            f"{INJECT_ENV}={value!r}: expected hang:<rank>, crash:<rank>, "
            f"slow_build:<rank>:<seconds> or unavailable:<rank>"
        )
    return (what, arg) if target == str(rank) else None


def _inject(rank: int, *kinds: str) -> None:
    """Act on the test hook if it targets ``rank`` with one of ``kinds``."""
    hook = _injection(rank)
    if hook is None or hook[0] not in kinds:
        return
    what, arg = hook
    if what == "hang":
        _stage(rank, "injected hang (test hook)")
        while True:
            time.sleep(3600)
    if what == "crash":
        _stage(rank, f"injected crash, exit code {INJECT_CRASH_EXIT} (test hook)")
        os._exit(INJECT_CRASH_EXIT)
    if what == "slow_build":
        _stage(rank, f"{BUILD_STAGE}injected slow build, {float(arg):g} s (test hook)")
        time.sleep(float(arg))


def trial_norm(trial, dtype):
    """The :class:`~fastverify.backends.base.NormKernel` every backend of ``trial`` gets:
    ``trial.norm``, with ``"auto"`` resolved by :func:`~fastverify.backends.base.choose_norm` from the
    trial's device and ``dtype`` (a ``torch.dtype``) alone, never from the backend."""
    from fastverify.backends.base import resolve_norm  # lazy: torch

    return resolve_norm(trial.norm, trial.device.value, dtype, backend=trial.backend)


def make_trial_backend(trial, *, device, dtype, norm, context):
    """``make_backend`` for ``trial`` on the default group: its ``hidden``, its options with
    ``max_numel`` split off (default: the largest size) and ``norm`` added, ``context``.

    Raises
    ------
    BackendUnavailable
        The backend's probe or constructor said no (the caller turns it into ``skipped``).
    """
    from fastverify import backends  # lazy: torch

    options = trial.options_dict
    max_numel = options.pop("max_numel", None)
    if max_numel is None:
        max_numel = max(n for n, _ in trial.sizes)
    options["norm"] = norm.value
    return backends.make_backend(
        trial.backend,
        None,
        device=device,
        dtype=dtype,
        max_numel=max_numel,
        hidden=trial.hidden,
        options=options,
        context=context,
    )


def _run_rank(rank: int, spec: dict) -> dict:
    """Steps 2-4 of the module docstring on this rank: the result document it writes."""
    import torch
    import torch.distributed as dist

    trial = TrialSpec.from_dict(spec["trial"])
    cuda = trial.device.value == "cuda"
    device = rank_device(rank, cuda, spec["threads"])
    dtype = getattr(torch, trial.dtype)
    _store = _join_group(rank, spec, trial.world_size, cuda, device, dist)  # held until the rank is done
    workdir = Path(spec["workdir"])
    (workdir / f"rank{rank}.{READY_MARK}").touch()  # start-up is over when every rank is up

    ctx = _probe_context(trial, device, dtype)
    meta = _meta(trial, torch, rank, cuda)
    clock = "cuda_events" if cuda else "cpu_wall_clock"
    backend, unavailable = _make_backend(rank, trial, device, dtype, ctx, meta)
    _inject(rank, "slow_build")
    if _any_rank(bool(unavailable), device, torch, dist):
        # No close(): a backend built on some ranks only may need a collective close that never comes.
        return {
            "status": "skipped",
            "reason": unavailable or "skipped: the backend is unavailable on another rank",
            "sizes": [],
            "clock": clock,
            "meta": meta,
        }
    cases = _build_cases(rank, trial, backend, device, dtype, torch)
    (workdir / f"rank{rank}.{BUILT_MARK}").touch()
    _stage(rank, "built")
    _inject(rank, "hang", "crash")

    status, reason, sizes_out = _measure_sizes(rank, trial, cases, backend, device, torch, dist)
    meta["path_counts"] = dict(backend.path_counts)
    backend.close()
    dist.barrier(device_ids=[rank]) if cuda else dist.barrier()
    dist.destroy_process_group()
    _stage(rank, "done")
    return {"status": status, "reason": reason, "sizes": sizes_out, "clock": clock, "meta": meta}


def _join_group(rank: int, spec: dict, world: int, cuda: bool, device, dist):
    """Join the parent's ``TCPStore`` and init the process group (gloo on CPU, NCCL on CUDA, one
    GPU per rank, ``spec["timeout_s"]`` for both); returns the store."""
    timeout = timedelta(seconds=spec["timeout_s"])
    _stage(rank, "init process group")
    store = dist.TCPStore(HOST, spec["port"], None, False, timeout=timeout)
    kwargs = {"device_id": device} if cuda else {}
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout, **kwargs
    )
    return store


def _probe_context(trial, device, dtype):
    """What the backend's probe may know of this box: the trial's ``probe_facts`` (P2P, NVLink)."""
    from fastverify.backends.base import ProbeContext  # lazy: torch

    facts = dict(trial.probe_facts)
    return ProbeContext.detect(
        None,
        device=device,
        dtype=dtype,
        p2p=facts.get("p2p_ok"),
        nvlink_full=facts.get("nvlink_full"),
        single_node=True,
    )


def _make_backend(rank: int, trial, device, dtype, ctx, meta: dict):
    """``(backend, "")``, or ``(None, why)`` where the backend is unavailable on this rank (the
    trial is then skipped on every rank); records the norm kernel in ``meta``."""
    from fastverify.backends import BackendUnavailable  # lazy: torch

    try:
        norm = trial_norm(trial, dtype)  # raises BackendUnavailable for an unusable explicit "flashinfer"
        meta["norm"] = norm.value
        _stage(rank, f"{BUILD_STAGE}make backend {trial.backend} (norm {norm.value}; FlashInfer JIT-compiles here)")
        if (_injection(rank) or ("",))[0] == "unavailable":
            raise BackendUnavailable(trial.backend, f"injected on rank {rank} (test hook)")
        return make_trial_backend(trial, device=device, dtype=dtype, norm=norm, context=ctx), ""
    except BackendUnavailable as err:
        return None, str(err)


def _build_cases(rank: int, trial, backend, device, dtype, torch) -> list[_Case]:
    """The rest of the build: ``prepare()`` (tunes), the inputs of every size and one call each
    (the lazy JIT builds), then a device synchronize."""
    world = trial.world_size
    shapes = [_shape(n, trial.hidden) for n, _ in trial.sizes]
    _stage(rank, f"{BUILD_STAGE}prepare {len(shapes)} shape(s) (tunes)")
    backend.prepare(shapes)
    cases = [_Case(trial, shape, rank, world, device, dtype, torch) for shape in shapes]
    for (numel, _), case in zip(trial.sizes, cases):
        _stage(rank, f"{BUILD_STAGE}numel {numel}: first call (lazy JIT builds)")
        case.fresh_call(backend)  # output unchecked: the measurement checks every size
    if trial.device.value == "cuda":
        torch.cuda.synchronize()  # the build is over when its kernels have run, not when queued
    return cases


def _measure_sizes(rank: int, trial, cases, backend, device, torch, dist) -> tuple[str, str, list[dict]]:
    """Step 4 per size: warm up, check, time (CUDA: also check the last replay). ``(status,
    reason, sizes)``; the first wrong result on any rank ends it as ``wrong_result`` on every rank."""
    cuda = trial.device.value == "cuda"
    sizes_out: list[dict] = []
    for (numel, count), case in zip(trial.sizes, cases):
        _stage(rank, f"numel {numel}: warm-up and check")
        for _ in range(trial.warmup):
            case.fresh_call(backend)
        ok, err = case.check(case.fresh_call(backend))
        if _any_rank(not ok, device, torch, dist):
            sizes_out.append({"numel": numel, "times_ns": [], "max_rel_err": err})
            reason = (
                f"numel {numel}: max relative error {err:.3g} on rank {rank}"
                if not ok
                else f"numel {numel}: result differs from the torch reference on another rank"
            )
            return "wrong_result", reason, sizes_out
        _stage(rank, f"numel {numel}: timing")
        if cuda:
            times_ns, last = _time_cuda(case, backend, trial.iters, count, rank, torch, dist)
            ok2, err2 = case.check(last)
            err = max(err, err2)
            if _any_rank(not ok2, device, torch, dist):
                sizes_out.append({"numel": numel, "times_ns": [], "max_rel_err": err})
                reason = (
                    f"numel {numel}: CUDA-graph replay result off, max relative error {err2:.3g} on rank {rank}"
                    if not ok2
                    else f"numel {numel}: CUDA-graph replay result differs on another rank"
                )
                return "wrong_result", reason, sizes_out
        else:
            times_ns = _time_cpu(case, backend, trial.iters, dist)
        sizes_out.append({"numel": numel, "times_ns": times_ns, "max_rel_err": err})
    return "ok", "", sizes_out


def _shape(numel: int, hidden: int) -> tuple[int, int]:
    """``(T, hidden)`` where ``hidden`` divides ``numel``, else one row: backends take 2-D tensors."""
    return (numel // hidden, hidden) if numel % hidden == 0 else (1, numel)


def _any_rank(flag: bool, device, torch, dist) -> bool:
    """True on every rank when ``flag`` is True on any (plain torch.distributed, not the backend under test)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class _Case:
    """Inputs of one message size and the reference they must reduce to.

    ``x`` on rank r holds ``((i·5 + 3r) mod 9 − 4) / 4`` (element i, row-major): quarter steps in
    [-1, 1], exact in bf16/fp16, and their sum over ranks is exact too, so any error comes from the
    backend. Residual and weight are the same on every rank, as in tensor parallelism.

    ``residual`` is the pristine residual, never passed to a backend; ``residuals`` are the
    buffers the calls get (the unfused path adds into the residual it is given, as SGLang's does:
    :meth:`fastverify.backends.AllReduceBackend.all_reduce_residual_rmsnorm`), one per call slot
    (:meth:`use_slots`), put back to ``residual`` by :meth:`reset` outside the timed region.
    """

    def __init__(self, trial, shape, rank, world, device, dtype, torch):
        from fastverify.backends import reference_residual_rmsnorm, result_tolerance  # lazy: torch

        self.torch, self.dtype = torch, dtype
        self.tolerance = result_tolerance(trial.backend, dtype, world)  # the registry's, lossy backends their own
        self.fused = trial.op is Op.ALL_REDUCE_RESIDUAL_RMSNORM
        numel = shape[0] * shape[1]
        idx = torch.arange(numel, dtype=torch.int64)

        def pattern(r: int):
            return (((idx * 5 + 3 * r) % 9 - 4).float() / 4).reshape(shape)

        xs = [pattern(r) for r in range(world)]
        self.x = xs[rank].to(device=device, dtype=dtype).contiguous()
        if self.fused:
            self.residual = (((idx * 7) % 5 - 2).float() / 2).reshape(shape).to(device=device, dtype=dtype)
            self.residuals = [self.residual.clone()]
            self.weight = (1 + (torch.arange(shape[1]) % 3).float() / 4).to(device=device, dtype=dtype)
            normed, res = reference_residual_rmsnorm([x.to(dtype) for x in xs], self.residual, self.weight, EPS)
            self.want = (normed, res)
        else:
            self.want = (sum(xs),)

    def use_slots(self, k: int) -> None:
        """Give the residual + RMSNorm op ``k`` residual buffers (call slots 0..k-1)."""
        if self.fused:
            self.residuals += [self.residual.clone() for _ in range(k - len(self.residuals))]

    def reset(self) -> None:
        """Put every residual buffer back to the pristine residual (not timed: call it outside)."""
        if self.fused:
            for buf in self.residuals:
                buf.copy_(self.residual)

    def call(self, backend, slot: int = 0):
        """One call of the trial's op, on residual buffer ``slot``, as it is (see :meth:`reset`)."""
        if self.fused:
            return backend.all_reduce_residual_rmsnorm(self.x, self.residuals[slot], self.weight, EPS)
        return (backend.all_reduce(self.x),)

    def fresh_call(self, backend):
        """:meth:`reset`, then :meth:`call` on slot 0: an untimed call whose result can be checked."""
        self.reset()
        return self.call(backend)

    def check(self, got) -> tuple[bool, float]:
        from fastverify.backends import check_close  # lazy: torch

        ok, worst = True, 0.0
        for g, w in zip(got, self.want):
            good, err = check_close(g, w, self.dtype, tolerance=self.tolerance)
            ok, worst = ok and good, max(worst, err)
        return ok, worst


def _time_cpu(case: _Case, backend, iters: int, dist) -> list[int]:
    """ns per call: each timed call bracketed by ``time.perf_counter_ns()`` after a barrier, the
    host wall time of an eager gloo call (``clock = "cpu_wall_clock"``), not GPU time."""
    out = []
    for _ in range(iters):
        case.reset()
        dist.barrier()
        t0 = time.perf_counter_ns()
        case.call(backend)
        out.append(time.perf_counter_ns() - t0)
    return out


def graph_calls(count: int) -> int:
    """All-reduce calls captured in one CUDA graph for a size one verify step calls ``count`` times."""
    return max(1, min(count, GRAPH_OPS_MAX))


def _time_cuda(case: _Case, backend, iters: int, count: int, rank: int, torch, dist):
    """Capture ``k = min(count, GRAPH_OPS_MAX)`` calls in one CUDA graph, replay it ``iters``
    times, each replay bracketed by CUDA events after a barrier: ns per call per replay (elapsed
    / ``k``, ``clock = "cuda_events"``), and the outputs of the last captured call (read after the
    last replay, checked too). Captured call ``j`` uses residual slot ``j`` (the warm-up call slot
    ``k - 1``); all are reset before each replay, before the barrier, so the copies are not timed
    and every replay computes the reference."""
    import itertools

    k = graph_calls(count)
    case.use_slots(k)
    slots = itertools.count(-1)
    graph, last = capture_cuda_graph(lambda: case.call(backend, next(slots) % k), warmup=1, calls=k)
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        case.reset()
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        torch.cuda.synchronize()
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        out.append(round(e0.elapsed_time(e1) * 1e6 / k))  # ms → ns, per call
    torch.cuda.synchronize()
    last = tuple(t.clone() for t in last)
    del graph
    return out, last


def _meta(trial, torch, rank: int, cuda: bool) -> dict:
    meta = {
        "torch_version": torch.__version__,
        "dist_backend": "nccl" if cuda else "gloo",
        "device_name": torch.cuda.get_device_name(rank) if cuda else "cpu",
    }
    if cuda:
        try:
            v = torch.cuda.nccl.version()
            meta["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - optional fact; torch built without NCCL raises
            pass
    else:
        meta["cpu_threads"] = torch.get_num_threads()
    return meta


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
