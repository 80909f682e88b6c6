"""Doctor checks that need CUDA GPUs: the CUDA and NCCL versions, NVML, the tiny verify forward
in a CUDA graph and its profiler trace, FlashInfer's norm, the live profiler's hook cost, and with
several GPUs the real P2P check and one trial per all-reduce backend."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from fastverify.doctor.core import (
    GRAPH_REPLAYS,
    HOOK_CALLS,
    HOOK_REPEATS,
    P2P_TIMEOUT_S,
    PROBE_MODEL,
    BUILDING,
    VERIFY_TOKENS,
    Outcome,
    Status,
    _Context,
    _error_text,
    _out,
)
from fastverify.errors import UserError

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


def check_cuda(ctx: _Context) -> Outcome:
    """CUDA runtime torch was built with, the driver, and the GPUs torch sees."""
    import torch

    gpus = [{"index": i, "name": torch.cuda.get_device_name(i),
             "sm": "{}{}".format(*torch.cuda.get_device_capability(i)),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(ctx.gpu_count)]
    driver = _driver_version()
    names = sorted({g["name"] for g in gpus})
    return _out(Status.ok, f"CUDA {torch.version.cuda} (torch), driver {driver or 'unknown'}, {len(gpus)} GPU(s): "
                f"{', '.join(names)} (SM{gpus[0]['sm']})", cuda=torch.version.cuda, driver=driver, gpus=gpus)


def _pci_key(bus_id: str | None) -> tuple[int, int, int] | None:
    """(domain, bus, device) of an NVML bus id (``"00000000:18:00.0"``); None when unreadable."""
    from fastverify.topo.nvml import sysfs_bdf

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
    return {"cuda_to_nvml": mapping,
            "unmatched": [i for i, v in mapping.items() if v is None and torch_pci[i] is not None],
            "unknown": [i for i, k in enumerate(torch_pci) if k is None]}


def _torch_pci(torch, i: int) -> tuple[int, int, int] | None:
    props = torch.cuda.get_device_properties(i)
    values = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    return None if None in values else tuple(int(v) for v in values)


def check_nvml_topology(ctx: _Context) -> Outcome:
    """The GPU topology from NVML (what ``fastverify topo`` reads), also on one GPU: every CUDA
    device found among NVML's GPUs by PCI address, and each NVML query that was not supported
    named (a pair whose link NVML would not report makes it a warning)."""
    import torch

    from fastverify.topo.nvml import read_nvml_topology

    try:
        topo = read_nvml_topology()
    except UserError as err:
        return _out(Status.fail, str(err), "install the NVIDIA driver's NVML (libnvidia-ml) and nvidia-ml-py")
    ctx.state["topology"] = topo
    pairs = topo.pairs_by_type()
    kinds = ", ".join(f"{k} {len(v)}" for k, v in pairs.items()) or \
        ("no pairs (one GPU)" if len(topo.gpus) == 1 else "none known")
    refused = sum(1 for v in list(topo.p2p_read.values()) + list(topo.p2p_write.values()) if v is False)
    match = match_torch_to_nvml([g.pci_bus_id for g in topo.gpus], [_torch_pci(torch, i) for i in range(ctx.gpu_count)])
    details = {**topo.as_dict(), "torch_to_nvml": match}
    reason = f"{len(topo.gpus)} GPU(s) via {topo.source}; pairs: {kinds}"
    if topo.unsupported:
        reason += f"; {len(topo.unsupported)} NVML quer{'y' if len(topo.unsupported) == 1 else 'ies'} not supported"
    if match["unmatched"]:
        return _out(Status.warn, f"{reason}; CUDA device(s) {match['unmatched']} not found among NVML's GPUs by PCI "
                    "address", "check CUDA_VISIBLE_DEVICES and that NVML and CUDA see the same driver", **details)
    if topo.link_errors:
        (i, j), err = next(iter(sorted(topo.link_errors.items())))
        return _out(Status.warn, f"{reason}; NVML did not report the link of {len(topo.link_errors) // 2} pair(s), "
                    f"first GPU{i}-GPU{j}: {err}", "give `fastverify topo --nvidia-smi FILE` the output of "
                    "`nvidia-smi topo -m` for those pairs", **details)
    if refused:
        return _out(Status.warn, f"{reason}; NVML refuses P2P for {refused} direction(s)",
                    "see `fastverify topo` for why and what to set", **details)
    return _out(Status.ok, reason, **details)


def _median_us(times_ms: list[float]) -> float:
    return round(statistics.median(times_ms) * 1000, 3)


def check_cuda_graph(ctx: _Context) -> Outcome:
    """Capture the tiny preset's verify forward (world size 1) in a CUDA graph, replay it, compare
    with the eager result and time both with CUDA events."""
    import torch

    from fastverify.backends import check_close

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
    from fastverify.cudagraph import capture_cuda_graph

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
    details = {"tokens": model.tokens, "eager_us": _median_us(eager_ms), "replay_us": _median_us(replay_ms),
               "replays": GRAPH_REPLAYS, "replay_vs_eager_rel_err": rel, "clock": "cuda_events"}
    if not ok:
        return _out(Status.fail, f"CUDA-graph replay differs from the eager forward (relative error {rel:.3g})",
                    "report this: graph capture changed the result", **details)
    return _out(Status.ok, f"tiny verify forward ({model.tokens} tokens): graph replay {details['replay_us']:.1f} µs, "
                f"eager {details['eager_us']:.1f} µs (CUDA events, median), replay = eager", **details)


def check_profiler_trace(ctx: _Context) -> Outcome:
    """Record the live runner's CUDA-graph replay trace (torch.profiler) of the tiny forward and
    read it with the trace analyzer: the forward's kernels must be found."""
    import torch

    from fastverify.analyze import analyze_rank
    from fastverify.live.trace_export import TRACE_REPLAYS, export_trace as _export_trace
    from fastverify.trace.load import load_trace

    model = ctx.tiny_model()
    dist = ctx.process_group()
    path = _export_trace(model, 0, str(ctx.tmp), torch, dist)
    ranks = load_trace(path)
    r = analyze_rank(ranks[0])
    counts = r["counts"]
    details = {"events": r["events"], "counts": counts, "steps": len(r["steps"]), "step_source":
               ranks[0].meta.get("step_source"), "window_us_median": (r["step_median"] or {}).get("window_us"),
               "top_kernels": [k["name"][:100] for k in r["top_kernels"][:5]], "replays": TRACE_REPLAYS}
    if r["events"] == 0 or counts["compute"] == 0:
        return _out(Status.fail, f"the trace of {TRACE_REPLAYS} graph replays holds {r['events']} GPU events, "
                    f"{counts['compute']} compute kernels", "torch.profiler recorded no kernels under CUDA-graph "
                    "replay: check the torch/CUPTI install", **details)
    if counts["unknown_comm"]:
        return _out(Status.warn, f"{r['events']} kernels found, {counts['unknown_comm']} look collective but match "
                    "no rule", "add the names to fastverify/trace/classify.py", **details)
    return _out(Status.ok, f"{r['events']} GPU events ({counts['compute']} compute) in {len(r['steps'])} profiler "
                f"steps of the graph replay; median step window {details['window_us_median']} µs", **details)


def check_hook_overhead(ctx: _Context) -> Outcome:
    """Host time per ``dist.all_reduce`` on a 1-rank NCCL group, with and without the region timer
    the live runner wraps around every collective (two CUDA events)."""
    import torch

    from fastverify.events import EventClass
    from fastverify.live.forward import ALLREDUCE
    from fastverify.live.clocks import CudaEventRecorder as _CudaEventRecorder

    from fastverify.live.config import load_model_config

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
    details = {"calls": HOOK_CALLS, "repeats": HOOK_REPEATS, "msg_bytes": nbytes, "plain_us_per_call": round(p, 3),
               "hooked_us_per_call": round(h, 3), "added_us_per_call": round(h - p, 3), "clock": "host perf_counter"}
    return _out(Status.ok, f"the live profiler's region timer adds {h - p:.2f} µs per all-reduce call "
                f"({p:.2f} -> {h:.2f} µs host time, 1-rank NCCL, median of {HOOK_REPEATS}×{HOOK_CALLS})", **details)


def _needs_gpus(ctx: _Context, n: int = 2) -> Outcome | None:
    if ctx.gpu_count < n:
        return _out(Status.skipped, f"needs >= {n} CUDA GPUs, found {ctx.gpu_count}")
    return None


def check_p2p_real(ctx: _Context) -> Outcome:
    """The real P2P check (child processes read and write each pair's memory; a hang fails)."""
    skip = _needs_gpus(ctx)
    if skip:
        return skip
    from fastverify.backends.base import summarize_p2p
    from fastverify.topo.p2p import check_p2p

    results = check_p2p(timeout_s=P2P_TIMEOUT_S, refresh=True, max_parallel=min(8, os.cpu_count() or 1))
    ctx.state["p2p"] = results
    ok, note = summarize_p2p(results)
    details = {"pairs": {f"{i}->{j}": {"ok": r.ok, "reason": r.reason} for (i, j), r in sorted(results.items())}}
    if not ok:
        return _out(Status.fail, note, "IPC all-reduces hang without P2P: fix ACS/IOMMU settings, or tune with nccl "
                    "only", **details)
    return _out(Status.ok, note, **details)


def _probe_world(n: int) -> int:
    return max(w for w in (2, 4, 8) if w <= n)


def backends_to_probe() -> tuple:
    """The registry's backends a multi-GPU doctor run tries: the CUDA baseline first (it must
    work), then every tunable CUDA backend in the registry's preference order."""
    from fastverify.registry import Role, names

    return names(role=Role.baseline, device="cuda") + names(tunable=True, device="cuda")


def check_backends(ctx: _Context) -> Outcome:
    """One trial per all-reduce backend of the registry the capability probes allow, on all
    (2/4/8) GPUs: all-reduce + residual + RMSNorm at 3 verify sizes, each checked against the
    torch reference. A backend's build (JIT, tune) has its own limit (:mod:`.trials`)."""
    skip = _needs_gpus(ctx)
    if skip:
        return skip
    import torch

    from fastverify.backends import ProbeContext, backend_class, probe
    from fastverify.backends.base import summarize_p2p
    from fastverify.doctor.trials import run_doctor_trial
    from fastverify.live.config import load_model_config
    from fastverify.registry import Role, backend_info
    from fastverify.tune.trial import Op, TrialSpec

    world = _probe_world(ctx.gpu_count)
    hidden = load_model_config(PROBE_MODEL).hidden_size
    p2p_ok, p2p_note = summarize_p2p(ctx.state.get("p2p"))
    topo = ctx.state.get("topology")
    nvlink_full = None
    if topo is not None:
        links = [topo.link(i, j) for i in range(world) for j in range(world) if i != j]
        nvlink_full = None if None in links else bool(links) and all(link.startswith("NV") for link in links)
    pctx = ProbeContext(world_size=world, device_type="cuda", dtype=torch.bfloat16, group_backend="nccl",
                        sm=tuple(torch.cuda.get_device_capability(0)), p2p_ok=p2p_ok, p2p_note=p2p_note,
                        nvlink_full=nvlink_full, single_node=True)
    sizes = tuple((t * hidden, 1) for t in VERIFY_TOKENS)
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
        spec = TrialSpec(backend=name.value, env={}, world_size=world, device="cuda", dtype="bfloat16", hidden=hidden,
                         sizes=sizes, warmup=2, iters=10, options=options, op=Op.ALL_REDUCE_RESIDUAL_RMSNORM,
                         probe_facts={"p2p_ok": p2p_ok, "nvlink_full": nvlink_full}, label=f"doctor {name.value}")
        res, how = run_doctor_trial(spec)
        status = res.status.value
        reason = f"{BUILDING}: {res.reason}" if how["phase"] == BUILDING else res.reason
        per[name.value] = {
            "status": BUILDING if how["phase"] == BUILDING else status, "reason": reason,
            "phase": how["phase"], "limits": how["limits"], "tuned": not tune_option,
            "sizes": [{"tokens": n // hidden, "msg_bytes": s.msg_bytes, "median_us": s.median_us, "p90_us": s.p90_us,
                       "max_rel_err": s.max_rel_err} for n, s in zip((n for n, _ in sizes), res.sizes)],
        }
    ctx.state["backends"] = {"world": world, "hidden": hidden, "results": per}
    return _backends_outcome(per, world=world, hidden=hidden, p2p_note=p2p_note, nvlink_full=nvlink_full)


def _backends_outcome(per: dict[str, dict], *, world: int, hidden: int, p2p_note: str,
                      nvlink_full: bool | None) -> Outcome:
    """The verdict over the per-backend trials: a wrong result or a failed measurement fails (do
    not deploy it), a trial stopped while building warns (run again: FlashInfer caches its build),
    and the baseline must pass."""
    from fastverify.registry import Role, backend_info

    summary = ", ".join(f"{k} {v['status']}" for k, v in per.items())
    details = {"world_size": world, "hidden": hidden, "tokens": list(VERIFY_TOKENS), "p2p": p2p_note,
               "nvlink_full": nvlink_full, "backends": per}
    bad = {k: v for k, v in per.items() if v["status"] in ("failed", "wrong_result")}
    if bad:
        k, v = next(iter(bad.items()))
        return _out(Status.fail, f"{summary}; {k}: {v['reason']}",
                    f"do not deploy {', '.join(bad)}; tune skips a backend whose result is wrong", **details)
    base = [k for k in per if backend_info(k).role is Role.baseline]
    for k in base:
        if per[k]["status"] != "ok":
            return _out(Status.fail, f"{summary}; {k}: {per[k]['reason']}", "NCCL must work: check the driver, "
                        "NCCL_* settings and `fastverify topo`", **details)
    building = [k for k, v in per.items() if v["status"] == BUILDING]
    if building:
        k = building[0]
        return _out(Status.warn, f"{summary}; {k}: {per[k]['reason']}",
                    "a first build of FlashInfer's kernels takes minutes: run doctor again (the build is cached), "
                    "or install flashinfer-jit-cache", **details)
    return _out(Status.ok, f"{world} GPUs, all-reduce + residual + RMSNorm vs torch reference: {summary}", **details)


def check_backend_latency(ctx: _Context) -> Outcome:
    """Latency per backend at the 3 verify sizes, from the trials of ``backend_allreduce``
    (CUDA-graph replays timed with CUDA events)."""
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
    return _out(Status.ok, f"fastest per size ({info['world']} GPUs, CUDA events, median): " + "; ".join(parts),
                world_size=info["world"], tokens=list(VERIFY_TOKENS), median_us=rows,
                note="pcie_ipc runs untuned here; `fastverify tune` tunes it")


