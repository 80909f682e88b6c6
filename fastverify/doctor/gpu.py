"""Doctor checks that need CUDA GPUs: the CUDA and NCCL versions, NVML, the tiny verify forward
in a CUDA graph and its profiler trace, FlashInfer's norm, the live profiler's hook cost, and with
several GPUs the real P2P check and one trial per all-reduce backend.

First of them, the check that every GPU has the memory its GPU checks need free, before they run
(:func:`check_gpu_free_memory`): a GPU a server already fills makes them die of
``OutOfMemoryError`` and blame the wrong thing (the patch's timer, P2P, NCCL). Free memory and its
holders come from NVML without a CUDA context (:func:`fastverify.live.preflight.cuda_gpu_memory`)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from fastverify.analyze import analyze_rank
from fastverify.cudagraph import capture_cuda_graph
from fastverify.doctor.core import (
    BUILDING,
    GRAPH_REPLAYS,
    HOOK_CALLS,
    HOOK_REPEATS,
    P2P_TIMEOUT_S,
    PROBE_MODEL,
    VERIFY_TOKENS,
    CheckContext,
    Outcome,
    Status,
    _error_text,
    _out,
)
from fastverify.doctor.jit import run_doctor_trial
from fastverify.errors import UserError
from fastverify.events import EventClass
from fastverify.live.clocks import CudaEventRecorder as _CudaEventRecorder
from fastverify.live.config import load_model_config
from fastverify.live.preflight import (
    GIB,
    RANK_OVERHEAD_BYTES,
    cuda_gpu_memory,
    free_fix,
    short_text,
)
from fastverify.live.worker import TRACE_REPLAYS, export_trace as _export_trace
from fastverify.registry import BACKENDS, Role, backend_info, names
from fastverify.topo.gpu_identity import visible_gpus
from fastverify.topo.nvml import read_nvml_topology, sysfs_bdf
from fastverify.topo.p2p import NO_PEER_ACCESS, check_p2p
from fastverify.trace.load import load_trace
from fastverify.tune.trial import Op, TrialSpec
from fastverify.tune.worker import graph_calls
from fastverify.tune.workload import workload_from_model

DOCTOR_GPU_BYTES = 2 * RANK_OVERHEAD_BYTES
"""Free memory each GPU needs for doctor's GPU checks (bytes): two processes at a time, each with
a CUDA context and an NCCL communicator (:data:`~fastverify.live.preflight.RANK_OVERHEAD_BYTES`):
doctor itself on GPU 0 (its 1-rank NCCL group, the tiny verify forward) and one spawned check
process per GPU (a trial rank, a P2P side). The tensors they move are a few MiB."""


def check_gpu_free_memory(ctx: CheckContext, *, nvml=None, environ=None) -> Outcome:
    """``fail`` when a GPU CUDA shows this process has less than :data:`DOCTOR_GPU_BYTES` free,
    naming the GPU as CUDA numbers it, its free GiB and the processes holding it; ``ok`` with
    each GPU's free GiB; ``skipped`` where NVML does not say (no ``pynvml``, no driver, or
    ordinals NVML cannot map). ``nvml``/``environ``: the binding and the environment (None: ``pynvml``
    and this process's)."""
    gpus = cuda_gpu_memory(ctx.gpu_count, nvml=nvml, environ=environ)
    if not gpus:
        return _out(
            Status.skipped,
            "NVML does not report this process's GPUs (no nvidia-ml-py or driver, MIG, or "
            "GPUs of several models in CUDA's default order), so their free memory is not known",
        )
    free = {g["cuda"]: None if g["free_bytes"] is None else round(g["free_bytes"] / GIB, 2) for g in gpus}
    short = [g for g in gpus if g["free_bytes"] is not None and g["free_bytes"] < DOCTOR_GPU_BYTES]
    if short:
        return _out(
            Status.fail,
            f"doctor's GPU checks need about {DOCTOR_GPU_BYTES / GIB:.1f} GiB free on each GPU "
            f"(2 CUDA contexts and NCCL communicators); {short_text(short)}; GPU checks below fail "
            "from lack of memory, not for the reasons they name",
            free_fix(short, []),
            free_gib=free,
            need_gib=round(DOCTOR_GPU_BYTES / GIB, 2),
        )
    return _out(
        Status.ok,
        "free memory per GPU (GiB, CUDA numbering): "
        + ", ".join(f"{k}: {v if v is not None else 'unknown'}" for k, v in free.items()),
        free_gib=free,
        need_gib=round(DOCTOR_GPU_BYTES / GIB, 2),
    )


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - optional fact; the NVML check reports NVML problems
        return None


def check_cuda(ctx: CheckContext) -> Outcome:
    """CUDA runtime torch was built with, the driver, and the GPUs torch sees."""
    import torch

    gpus = [
        {
            "index": i,
            "name": torch.cuda.get_device_name(i),
            "sm": "{}{}".format(*torch.cuda.get_device_capability(i)),
            "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
        }
        for i in range(ctx.gpu_count)
    ]
    driver = _driver_version()
    names = sorted({g["name"] for g in gpus})
    return _out(
        Status.ok,
        f"CUDA {torch.version.cuda} (torch), driver {driver or 'unknown'}, {len(gpus)} GPU(s): "
        f"{', '.join(names)} (SM{gpus[0]['sm']})",
        cuda=torch.version.cuda,
        driver=driver,
        gpus=gpus,
    )


def _pci_key(bus_id: str | None) -> tuple[int, int, int] | None:
    """(domain, bus, device) of an NVML bus id (``"00000000:18:00.0"``); None when unreadable."""
    bdf = sysfs_bdf(bus_id) if bus_id else None
    if bdf is None:
        return None
    domain, bus, rest = bdf.split(":")
    return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)


def match_torch_to_nvml(nvml_bus_ids: list[str | None], torch_pci: list[tuple[int, int, int] | None]) -> dict:
    """Which NVML GPU each torch (CUDA) device is, by PCI address.

    Parameters
    ----------
    nvml_bus_ids : list of str or None
        ``Gpu.pci_bus_id`` per NVML index (``nvidia-smi`` order; NVML ignores CUDA_VISIBLE_DEVICES).
    torch_pci : list of (domain, bus, device) or None
        ``torch.cuda.get_device_properties(i).pci_domain_id / pci_bus_id / pci_device_id`` per CUDA
        device; None where torch does not report them.

    Returns
    -------
    dict
        ``{"cuda_to_nvml": {cuda index: nvml index or None}, "unmatched": [cuda indices whose PCI
        address no NVML GPU has], "unknown": [cuda indices torch gave no PCI address for]}``.
    """
    by_key = {_pci_key(b): i for i, b in enumerate(nvml_bus_ids) if _pci_key(b) is not None}
    mapping = {i: (by_key.get(k) if k is not None else None) for i, k in enumerate(torch_pci)}
    return {
        "cuda_to_nvml": mapping,
        "unmatched": [i for i, v in mapping.items() if v is None and torch_pci[i] is not None],
        "unknown": [i for i, k in enumerate(torch_pci) if k is None],
    }


def _torch_pci(torch, i: int) -> tuple[int, int, int] | None:
    props = torch.cuda.get_device_properties(i)
    values = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    return None if None in values else tuple(int(v) for v in values)


def cuda_to_nvml(topo, match: dict, environ) -> tuple[dict[int, int], str]:
    """``({CUDA ordinal: NVML index}, note)`` of the GPUs this process sees: by PCI address
    (:func:`match_torch_to_nvml`); an ordinal torch gave no PCI address for, as
    ``CUDA_VISIBLE_DEVICES`` in ``environ`` maps it (:func:`fastverify.topo.gpu_identity.visible_gpus`,
    whose one line is the note). ``topo``: the NVML :class:`~fastverify.topo.matrix.Topology`."""

    got = {c: n for c, n in match["cuda_to_nvml"].items() if n is not None}
    if not match["unknown"]:
        return got, ""
    rows = [{"index": g.index, "name": g.name, "pci_bus_id": g.pci_bus_id, "uuid": None} for g in topo.gpus]
    visible, why = visible_gpus(rows, environ)
    for c in match["unknown"]:
        if visible and c < len(visible):
            got[c] = visible[c]["index"]
    return got, why


def check_nvml_topology(ctx: CheckContext) -> Outcome:
    """The GPU topology from NVML (what ``fastverify topo`` reads), also on one GPU: every CUDA
    device found among NVML's GPUs by PCI address, and each NVML query that was not supported
    named (a pair whose link NVML would not report makes it a warning). GPUs are numbered as
    CUDA sees them (:func:`cuda_to_nvml`); pairs with a GPU CUDA does not see are left out."""
    import torch

    try:
        topo = read_nvml_topology()
    except UserError as err:
        return _out(Status.fail, str(err), "install the NVIDIA driver's NVML (libnvidia-ml) and nvidia-ml-py")
    ctx.state["topology"] = topo
    match = match_torch_to_nvml([g.pci_bus_id for g in topo.gpus], [_torch_pci(torch, i) for i in range(ctx.gpu_count)])
    nvml_of, note = cuda_to_nvml(topo, match, os.environ)
    ctx.state["cuda_to_nvml"] = nvml_of
    cuda_of = {n: c for c, n in nvml_of.items()}

    def seen(pairs) -> list[tuple[int, int]]:  # NVML pairs both CUDA sees, as CUDA ordinals
        return sorted((cuda_of[i], cuda_of[j]) for i, j in pairs if i in cuda_of and j in cuda_of)

    pairs = {k: seen(v) for k, v in topo.pairs_by_type().items()}
    kinds = ", ".join(f"{k} {len(v)}" for k, v in pairs.items() if v) or (
        "no pairs (one GPU)" if len(cuda_of) == 1 else "none known"
    )
    refused = len(seen(k for k, v in list(topo.p2p_read.items()) + list(topo.p2p_write.items()) if v is False))
    link_errors = seen(k for k in topo.link_errors if k[0] < k[1])
    details = {**topo.as_dict(), "torch_to_nvml": match, "cuda_to_nvml": nvml_of, "numbering": "CUDA ordinals"}
    reason = f"{len(topo.gpus)} GPU(s) via {topo.source}"
    if len(cuda_of) != len(topo.gpus):
        reason += f", CUDA sees {len(cuda_of)} of them (numbered as CUDA does)"
    reason += f"; pairs: {kinds}"
    if topo.unsupported:
        reason += f"; {len(topo.unsupported)} NVML quer{'y' if len(topo.unsupported) == 1 else 'ies'} not supported"
    if match["unmatched"]:
        return _out(
            Status.warn,
            f"{reason}; CUDA device(s) {match['unmatched']} not found among NVML's GPUs by PCI address",
            "check CUDA_VISIBLE_DEVICES and that NVML and CUDA see the same driver",
            **details,
        )
    if note:
        return _out(Status.warn, f"{reason}; {note}", "check CUDA_VISIBLE_DEVICES", **details)
    if link_errors:
        i, j = link_errors[0]
        err = topo.link_errors[(nvml_of[i], nvml_of[j])]
        return _out(
            Status.warn,
            f"{reason}; NVML did not report the link of {len(link_errors)} pair(s), first GPU{i}-GPU{j}: {err}",
            "give `fastverify topo --nvidia-smi FILE` the output of `nvidia-smi topo -m` for those pairs",
            **details,
        )
    if refused:
        return _out(
            Status.warn,
            f"{reason}; NVML refuses P2P for {refused} direction(s)",
            "see `fastverify topo` for why and what to set",
            **details,
        )
    return _out(Status.ok, reason, **details)


def _median_us(times_ms: list[float]) -> float:
    return round(statistics.median(times_ms) * 1000, 3)


def check_cuda_graph(ctx: CheckContext) -> Outcome:
    """Capture the tiny preset's verify forward (world size 1) in a CUDA graph, replay it, compare
    with the eager result and time both with CUDA events."""
    import torch

    from fastverify.backends import check_close  # lazy: torch

    model = ctx.tiny_model()
    eager_ms = []
    for i in range(3 + 5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        eager = model.forward()
        e1.record()
        e1.synchronize()
        if i >= 3:
            eager_ms.append(e0.elapsed_time(e1))

    graph, out = capture_cuda_graph(model.forward, warmup=2)
    replay_ms = []
    for _ in range(GRAPH_REPLAYS):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        replay_ms.append(e0.elapsed_time(e1))
    ok, rel = check_close(out, eager.float(), torch.bfloat16)
    del graph
    details = {
        "tokens": model.tokens,
        "eager_us": _median_us(eager_ms),
        "replay_us": _median_us(replay_ms),
        "replays": GRAPH_REPLAYS,
        "replay_vs_eager_rel_err": rel,
        "clock": "cuda_events",
    }
    if not ok:
        return _out(
            Status.fail,
            f"CUDA-graph replay differs from the eager forward (relative error {rel:.3g})",
            "report this: graph capture changed the result",
            **details,
        )
    return _out(
        Status.ok,
        f"tiny verify forward ({model.tokens} tokens): graph replay {details['replay_us']:.1f} µs, "
        f"eager {details['eager_us']:.1f} µs (CUDA events, median), replay = eager",
        **details,
    )


def check_profiler_trace(ctx: CheckContext) -> Outcome:
    """Record the live runner's CUDA-graph replay trace (torch.profiler) of the tiny forward and
    read it with the trace analyzer: the forward's kernels must be found."""
    import torch

    model = ctx.tiny_model()
    dist = ctx.process_group()
    path = _export_trace(model, 0, str(ctx.tmp), torch, dist)
    ranks = load_trace(path)
    r = analyze_rank(ranks[0])
    counts = r["counts"]
    details = {
        "events": r["events"],
        "counts": counts,
        "steps": len(r["steps"]),
        "step_source": ranks[0].meta.get("step_source"),
        "window_us_median": (r["step_median"] or {}).get("window_us"),
        "top_kernels": [k["name"][:100] for k in r["top_kernels"][:5]],
        "replays": TRACE_REPLAYS,
    }
    if r["events"] == 0 or counts["compute"] == 0:
        return _out(
            Status.fail,
            f"the trace of {TRACE_REPLAYS} graph replays holds {r['events']} GPU events, "
            f"{counts['compute']} compute kernels",
            "torch.profiler recorded no kernels under CUDA-graph replay: check the torch/CUPTI install",
            **details,
        )
    if counts["unknown_comm"]:
        return _out(
            Status.warn,
            f"{r['events']} kernels found, {counts['unknown_comm']} look collective but match no rule",
            "add the names to fastverify/trace/classify.py",
            **details,
        )
    return _out(
        Status.ok,
        f"{r['events']} GPU events ({counts['compute']} compute) in {len(r['steps'])} profiler "
        f"steps of the graph replay; median step window {details['window_us_median']} µs",
        **details,
    )


def check_hook_overhead(ctx: CheckContext) -> Outcome:
    """Host time per ``dist.all_reduce`` on a 1-rank NCCL group, with and without the region timer
    the live runner wraps around every collective (two CUDA events)."""
    import torch

    from fastverify.live.forward import ALLREDUCE  # lazy: torch

    dist = ctx.process_group()
    x = torch.ones(4, load_model_config("tiny").hidden_size, dtype=torch.bfloat16, device="cuda")  # 4 draft tokens
    nbytes = x.numel() * x.element_size()

    def loop(hooked: bool) -> float:
        rec = _CudaEventRecorder(torch)
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(HOOK_CALLS):
            if hooked:
                with rec.region(ALLREDUCE, EventClass.ALLREDUCE, "doctor.allreduce", nbytes):
                    dist.all_reduce(x)
            else:
                dist.all_reduce(x)
        torch.cuda.synchronize()
        return (time.perf_counter_ns() - t0) / HOOK_CALLS / 1000

    loop(False)
    loop(True)  # warm-up: NCCL communicator and event pool
    plain, hooked = [], []
    for _ in range(HOOK_REPEATS):
        plain.append(loop(False))
        hooked.append(loop(True))
    p, h = statistics.median(plain), statistics.median(hooked)
    details = {
        "calls": HOOK_CALLS,
        "repeats": HOOK_REPEATS,
        "msg_bytes": nbytes,
        "plain_us_per_call": round(p, 3),
        "hooked_us_per_call": round(h, 3),
        "added_us_per_call": round(h - p, 3),
        "clock": "host perf_counter",
    }
    return _out(
        Status.ok,
        f"the live profiler's region timer adds {h - p:.2f} µs per all-reduce call "
        f"({p:.2f} -> {h:.2f} µs host time, 1-rank NCCL, median of {HOOK_REPEATS}×{HOOK_CALLS})",
        **details,
    )


def _needs_gpus(ctx: CheckContext, n: int = 2) -> Outcome | None:
    if ctx.gpu_count < n:
        return _out(Status.skipped, f"needs >= {n} CUDA GPUs, found {ctx.gpu_count}")
    return None


def check_p2p_real(ctx: CheckContext) -> Outcome:
    """The real P2P check (child processes read and write each pair's memory; a hang times out),
    judged by :func:`p2p_outcome`."""
    skip = _needs_gpus(ctx)
    if skip:
        return skip

    results = check_p2p(timeout_s=P2P_TIMEOUT_S, refresh=True, max_parallel=min(8, os.cpu_count() or 1))
    ctx.state["p2p"] = results
    return p2p_outcome(results)


def p2p_outcome(results: dict) -> Outcome:
    """The verdict over the real P2P check's ``{(i, j): P2PResult}`` (CUDA ordinals).

    * ``fail`` only for access the driver offered that then failed (a wrong byte, a CUDA error):
      IPC all-reduces would hang or corrupt data there.
    * ``warn`` where the driver offers no peer access (``cudaDeviceCanAccessPeer`` = 0, the
      reason :data:`fastverify.topo.p2p.NO_PEER_ACCESS`; GeForce drivers, e.g. on the RTX
      4090): no setting of the box changes that, and the backends that need P2P
      (:attr:`fastverify.registry.BackendInfo.needs_p2p`) are not candidates.
    * ``warn`` for a direction that timed out (:attr:`P2PResult.timed_out`): no answer, not a failure.
    """

    def first(keys: list) -> str:
        i, j = keys[0]
        return f"{len(keys)} direction(s), first GPU{i}->GPU{j}: {results[(i, j)].reason}"

    pairs = sorted(results)
    timed_out = [k for k in pairs if results[k].timed_out]
    not_offered = [
        k for k in pairs if not results[k].ok and k not in timed_out and results[k].reason.startswith(NO_PEER_ACCESS)
    ]
    failed = [k for k in pairs if not results[k].ok and k not in timed_out and k not in not_offered]
    details = {
        "pairs": {
            f"{i}->{j}": {"ok": r.ok, "reason": r.reason, "timed_out": r.timed_out}
            for (i, j), r in sorted(results.items())
        },
        "failed": len(failed),
        "not_offered": len(not_offered),
        "timed_out": len(timed_out),
    }
    needs = "/".join(b.name.value for b in BACKENDS if b.needs_p2p)
    if failed:
        return _out(
            Status.fail,
            f"P2P access the driver offers failed for {first(failed)}",
            "IPC all-reduces hang "
            "or corrupt data where P2P fails: check the ACS/IOMMU settings (`fastverify topo`), or tune "
            "with nccl only",
            **details,
        )
    if not_offered:
        return _out(
            Status.warn,
            f"this GPU/driver does not offer P2P ({first(not_offered)}); {needs} are not candidates",
            None,
            **details,
        )
    if timed_out:
        return _out(
            Status.warn,
            f"P2P check timed out for {first(timed_out)}: P2P is not known",
            "run `fastverify p2p --refresh` on an idle box; until then the backends that need P2P are left out",
            **details,
        )
    if not results:
        return _out(Status.warn, "P2P check returned no pairs", "run `fastverify p2p --refresh`", **details)
    return _out(Status.ok, f"P2P ok for all {len(results)} checked directions", **details)


def _probe_world(n: int) -> int:
    return max(w for w in (2, 4, 8) if w <= n)


def backends_to_probe() -> tuple:
    """The registry's backends a multi-GPU doctor run tries: the CUDA baseline first (it must
    work), then every tunable CUDA backend in the registry's preference order."""
    return names(role=Role.baseline, device="cuda") + names(tunable=True, device="cuda")


def check_backends(ctx: CheckContext) -> Outcome:
    """One trial per all-reduce backend of the registry the capability probes allow, on all
    (2/4/8) GPUs: all-reduce + residual + RMSNorm at 3 verify sizes, each checked against the
    torch reference. A backend's build (JIT, tune) has its own limit (:mod:`.jit`)."""
    skip = _needs_gpus(ctx)
    if skip:
        return skip
    import torch

    from fastverify.backends import ProbeContext, backend_class, probe  # lazy: torch
    from fastverify.backends.base import summarize_p2p  # lazy: torch

    world = _probe_world(ctx.gpu_count)
    config = load_model_config(PROBE_MODEL)
    hidden = config.hidden_size
    # As tune times the model: each size as often as one verify step calls it, and the worker
    # captures up to graph_calls() of them per graph (a replay's rank skew spread over them).
    count = workload_from_model(config, tp=world, draft_tokens=VERIFY_TOKENS[0], batch=1).allreduce_count
    p2p_ok, p2p_note = summarize_p2p(ctx.state.get("p2p"))
    topo, nvml_of = ctx.state.get("topology"), ctx.state.get("cuda_to_nvml", {})
    nvlink_full = None
    if topo is not None and all(i in nvml_of for i in range(world)):  # the ranks' GPUs: CUDA ordinals 0..world-1
        links = [topo.link(nvml_of[i], nvml_of[j]) for i in range(world) for j in range(world) if i != j]
        nvlink_full = None if None in links else bool(links) and all(link.startswith("NV") for link in links)
    pctx = ProbeContext(
        world_size=world,
        device_type="cuda",
        dtype=torch.bfloat16,
        group_backend="nccl",
        sm=tuple(torch.cuda.get_device_capability(0)),
        p2p_ok=p2p_ok,
        p2p_note=p2p_note,
        nvlink_full=nvlink_full,
        single_node=True,
    )
    sizes = tuple((t * hidden, count) for t in VERIFY_TOKENS)
    max_numel = max(n for n, _ in sizes)
    per: dict[str, dict] = {}
    for name in backends_to_probe():
        baseline = backend_info(name).role is Role.baseline
        options: dict[str, Any] = {"max_numel": max_numel}
        try:
            # torch.distributed's own probe needs a live group in this process; the workers probe it there.
            cap = None if baseline else probe(name, pctx)
            tune_option = "tune" in backend_class(name).option_names
        except Exception as err:  # noqa: BLE001 - a backend module that does not import is that backend's finding
            per[name.value] = {"status": "skipped", "reason": f"backend not loadable: {_error_text(err)}"}
            continue
        if cap is not None and not cap.ok:
            per[name.value] = {"status": "skipped", "reason": cap.reason}
            continue
        if tune_option:
            options["tune"] = False  # FlashInfer's tuning takes minutes; the untuned seed policy is slower
        spec = TrialSpec(
            backend=name.value,
            env={},
            world_size=world,
            device="cuda",
            dtype="bfloat16",
            hidden=hidden,
            sizes=sizes,
            warmup=2,
            iters=10,
            options=options,
            op=Op.ALL_REDUCE_RESIDUAL_RMSNORM,
            probe_facts={"p2p_ok": p2p_ok, "nvlink_full": nvlink_full},
            label=f"doctor {name.value}",
        )
        res, how = run_doctor_trial(spec)
        status = res.status.value
        reason = f"{BUILDING}: {res.reason}" if how["phase"] == BUILDING else res.reason
        per[name.value] = {
            "status": BUILDING if how["phase"] == BUILDING else status,
            "reason": reason,
            "phase": how["phase"],
            "limits": how["limits"],
            "tuned": not tune_option,
            "sizes": [
                {
                    "tokens": n // hidden,
                    "msg_bytes": s.msg_bytes,
                    "median_us": s.median_us,
                    "p90_us": s.p90_us,
                    "max_rel_err": s.max_rel_err,
                }
                for n, s in zip((n for n, _ in sizes), res.sizes)
            ],
        }
    ctx.state["backends"] = {"world": world, "hidden": hidden, "results": per, "calls_per_graph": graph_calls(count)}
    return backends_outcome(per, world=world, hidden=hidden, p2p_note=p2p_note, nvlink_full=nvlink_full)


def backends_outcome(
    per: dict[str, dict], *, world: int, hidden: int, p2p_note: str, nvlink_full: bool | None
) -> Outcome:
    """The verdict over the per-backend trials: a wrong result or a failed measurement fails (do
    not deploy it), a trial stopped while building warns (run again: FlashInfer caches its build),
    and the baseline must pass."""
    summary = ", ".join(f"{k} {v['status']}" for k, v in per.items())
    details = {
        "world_size": world,
        "hidden": hidden,
        "tokens": list(VERIFY_TOKENS),
        "p2p": p2p_note,
        "nvlink_full": nvlink_full,
        "backends": per,
    }
    bad = {k: v for k, v in per.items() if v["status"] in ("failed", "wrong_result")}
    if bad:
        k, v = next(iter(bad.items()))
        return _out(
            Status.fail,
            f"{summary}; {k}: {v['reason']}",
            f"do not deploy {', '.join(bad)}; tune skips a backend whose result is wrong",
            **details,
        )
    base = [k for k in per if backend_info(k).role is Role.baseline]
    for k in base:
        if per[k]["status"] != "ok":
            return _out(
                Status.fail,
                f"{summary}; {k}: {per[k]['reason']}",
                "NCCL must work: check the driver, NCCL_* settings and `fastverify topo`",
                **details,
            )
    building = [k for k, v in per.items() if v["status"] == BUILDING]
    if building:
        k = building[0]
        return _out(
            Status.warn,
            f"{summary}; {k}: {per[k]['reason']}",
            "a first build of FlashInfer's kernels takes minutes: run doctor again (the build is cached), "
            "or install flashinfer-jit-cache",
            **details,
        )
    return _out(Status.ok, f"{world} GPUs, all-reduce + residual + RMSNorm vs torch reference: {summary}", **details)


def check_backend_latency(ctx: CheckContext) -> Outcome:
    """Latency per backend at the 3 verify sizes, from the trials of ``backend_allreduce``
    (CUDA-graph replays of many calls each, timed with CUDA events, per call)."""
    skip = _needs_gpus(ctx)
    if skip:
        return skip
    info = ctx.state.get("backends")
    if info is None:
        return _out(Status.skipped, "backend_allreduce did not finish; no latencies")
    rows: dict[str, list] = {}
    for name, r in info["results"].items():
        if r["status"] == "ok":
            rows[name] = [s["median_us"] for s in r["sizes"]]
    if not rows:
        return _out(Status.skipped, "no backend finished with a correct result", backends=info["results"])
    parts = []
    for i, t in enumerate(VERIFY_TOKENS):
        best = min(rows, key=lambda k: rows[k][i])
        parts.append(f"{t * info['hidden'] * 2 // 1024} KiB: {best} {rows[best][i]:.1f} µs")
    k = info["calls_per_graph"]
    return _out(
        Status.ok,
        f"fastest per size ({info['world']} GPUs, CUDA events, median per call over graph "
        f"replays of {k} calls): " + "; ".join(parts),
        world_size=info["world"],
        tokens=list(VERIFY_TOKENS),
        median_us=rows,
        calls_per_graph=k,
        note="pcie_ipc runs untuned here; `fastverify tune` tunes it",
    )
