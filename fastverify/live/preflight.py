"""The checks and choices of a live run that come before any rank starts: arguments, device,
all-reduce backend, memory and P2P.

GPU memory is checked against what each GPU has free now (NVML, no CUDA context:
:func:`fastverify.topo.nvml.read_gpu_memory`), not its capacity: a GPU a server already fills
refuses the run in one line naming the GPU as CUDA numbers it, its free GiB and the processes
holding it, instead of ranks dying of ``OutOfMemoryError`` after start-up. Where NVML is absent the
check falls back to capacity (torch's ``total_memory``).

Each refusal is one :class:`~fastverify.errors.UserError` line naming the flag, so a run that
cannot work fails at once instead of after its ranks have started. Callers pass the ``torch``
module in (it is imported by :func:`fastverify.live.runner.run_live` only when it is needed).

What a live run on CPU + gloo will cost, in seconds and bytes, before any rank starts.

:func:`estimate_cpu_run` models the run from the shapes alone (:func:`forward_work` counts one
rank's weight bytes and GEMM FLOPs per forward, :func:`fastverify.live.config.rank_memory` its
memory); the constants below calibrate it on one machine. No torch needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The CLI's bounds (fastverify/bounds.py), also enforced here for callers of run_live.
from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS, MAX_ITERS, MAX_TIMEOUT_S, MAX_WARMUP
from fastverify.errors import UserError
from fastverify.live.config import (
    DEFAULT_CONTEXT_TOKENS,
    ModelConfig,
    RankMemory,
    check_tp,
    rank_memory,
)
from fastverify.profile.record import DTYPES
from fastverify.registry import BackendName, Role, backend_info
from fastverify.topo.gpu_identity import visible_gpus
from fastverify.topo.nvml import read_gpu_memory
from fastverify.topo.p2p import check_p2p

# Calibration of estimate_cpu_run (see its docstring for the runs these come from).
CPU_PROCESS_BYTES = 192 * 2**20
"""Memory of one rank process beyond its tensors (Python, torch, gloo), bytes: measured PSS."""
CPU_PARENT_BYTES = 320 * 2**20
"""Memory of the parent ``fastverify`` process (it imports torch too), bytes: measured PSS."""
CPU_START_S = 1.5
"""CPU seconds one rank spends before its first tensor: interpreter, ``import torch``, joining gloo."""
CPU_FILL_PER_S = 9.0e7
"""Elements of random weights one core draws per second (``normal_`` in bf16)."""
CPU_READ_BYTES_PER_S = 6.5e9
"""Bytes of weights one core streams per second through the forward's small GEMMs (bf16)."""
CPU_FLOPS_PER_S = 4.5e11
"""GEMM FLOPs one core does per second once a GEMM has enough rows to be compute-bound (bf16)."""
CPU_COLLECTIVE_S = 1.5e-3
"""Seconds of one gloo collective between ranks on one host (latency; the payloads are small)."""
CPU_PARENT_S = 1.5
"""Seconds of the parent around the ranks: the store, the spec, reading the results."""


@dataclass(frozen=True)
class CpuEstimate:
    """What a live run on CPU is expected to take (:func:`estimate_cpu_run`); estimates, not measurements.

    Attributes
    ----------
    seconds : float
        Wall time of :func:`~fastverify.live.runner.run_live`, start-up included.
    memory_bytes : int
        Peak memory of all ranks and the parent together, bytes.
    start_s, build_s, forward_s : float
        Rank start-up, weight allocation, and one forward (all ranks together), seconds.
    forwards : int
        ``warmup + iters``.
    cores : int
        Cores the ranks share (``os.sched_getaffinity``).
    tp : int
        Ranks.
    """

    seconds: float
    memory_bytes: int
    start_s: float
    build_s: float
    forward_s: float
    forwards: int
    cores: int
    tp: int

    def describe(self, model: str) -> str:
        """One clause for a ``fastverify:`` line, e.g. ``"estimated 150 s and 8.7 GiB for kimi-k2 at
        --tp 2 (2 ranks on 2 cores: 40 s to start and build, 7 forwards of 15.7 s)"``."""
        return (
            f"estimated {_seconds_text(self.seconds)} and {bytes_text(self.memory_bytes)} for {model} "
            f"at --tp {self.tp} ({self.tp} rank{'s' if self.tp > 1 else ''} on {self.cores} "
            f"core{'s' if self.cores > 1 else ''}: {_seconds_text(self.start_s + self.build_s)} to start and "
            f"build, {self.forwards} forward{'s' if self.forwards > 1 else ''} of "
            f"{_seconds_text(self.forward_s)})"
        )


def _seconds_text(s: float) -> str:
    if s < 0.1:
        return f"{s * 1e3:.0f} ms"
    if s < 10:
        return f"{s:.1f} s"
    if s < 600:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min"


def bytes_text(n: int) -> str:
    """``n`` bytes as ``"<x.y> MiB"``, or ``"<x.y> GiB"`` from 1 GiB up (progress lines and estimates)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def forward_work(
    config: ModelConfig, *, tp: int, batch: int, draft_tokens: int, dtype_bytes: int, context_tokens: int
) -> tuple[int, int]:
    """Weight bytes one rank reads and GEMM FLOPs it does in one live verify forward (no torch).

    Counted from the shapes :class:`fastverify.live.forward.TPVerifyModel` uses, per layer (its one
    attention block, dense MLP and MoE block serve every layer, so each is read once per layer):
    every projection of ``[T, k] @ [k, n]`` reads ``k × n × dtype_bytes`` bytes and does ``2 × T × k
    × n`` FLOPs, ``T = batch × draft_tokens``. Routed experts: ``T × top_k`` rows, and the expected
    number of distinct experts a uniform draw visits, ``E × (1 − (1 − top_k / E)^T)`` (at most the
    allocated ones), read. Attention over the fake context: reading its K and V
    (``batch × kv_heads × context × (dq + dv)`` elements) and ``2 × batch × heads × draft × (context
    + draft) × (dq + dv)`` FLOPs. Norms, the embedding lookup and the collectives are left out.

    Returns
    -------
    tuple[int, int]
        ``(bytes, flops)`` of one rank per forward.
    """
    T, H, e = batch * draft_tokens, config.hidden_size, dtype_bytes
    heads = config.num_attention_heads // tp
    read = flops = 0

    def gemm(rows: int, k: int, n: int, times: int) -> None:
        nonlocal read, flops
        read += k * n * e * times
        flops += 2 * rows * k * n * times

    L = config.num_layers
    if config.is_mla:
        dq, dv, kv_heads = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim, heads
        if config.q_lora_rank is None:
            gemm(T, H, heads * dq, L)
        else:
            gemm(T, H, config.q_lora_rank, L)
            gemm(T, config.q_lora_rank, heads * dq, L)
        gemm(T, H, config.kv_lora_rank + config.qk_rope_head_dim, L)
        gemm(T, config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim), L)
    else:
        dq = dv = config.head_dim
        kv_heads = max(1, config.num_key_value_heads // tp)
        gemm(T, H, heads * dq, L)
        gemm(T, H, 2 * kv_heads * dq, L)
    gemm(T, heads * dv, H, L)  # o_proj
    read += batch * kv_heads * context_tokens * (dq + dv) * e * L
    flops += 2 * batch * heads * draft_tokens * (context_tokens + draft_tokens) * (dq + dv) * L
    moe_layers = config.num_moe_layers
    dense_layers = L - moe_layers
    if dense_layers and config.first_k_dense_replace > 0:
        inter = config.intermediate_size // tp
        gemm(T, H, 2 * inter, dense_layers)
        gemm(T, inter, H, dense_layers)
    if moe_layers:
        E, k, inter = config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size // tp
        gemm(T, H, E, moe_layers)  # router
        visited = min(config.experts_allocated(T), E * (1 - (1 - k / E) ** T))
        read += round(visited * 3 * H * inter * e) * moe_layers
        flops += 2 * T * k * 3 * H * inter * moe_layers
        shared = config.moe_intermediate_size * config.n_shared_experts // tp
        if shared:
            gemm(T, H, 2 * shared, moe_layers)
            gemm(T, shared, H, moe_layers)
    gemm(T, H, config.vocab_padded // tp, 1)  # lm_head
    return int(read), int(flops)


def estimate_cpu_run(
    config: ModelConfig,
    *,
    tp: int,
    batch: int,
    draft_tokens: int,
    iters: int,
    warmup: int,
    dtype_bytes: int = 2,
    cores: int | None = None,
) -> CpuEstimate:
    """Expected wall time and memory of :func:`~fastverify.live.runner.run_live` on CPU + gloo: a
    simple model of the run, calibrated on one machine, to tell a user at once what a CPU run will
    cost. An estimate: another CPU can be several times faster or slower.

    Model (``P`` = cores the ranks use together = ``min(cores, tp × max(1, cpu_count // tp))``,
    each rank running ``cpu_count // tp`` torch threads as ``run_live`` sets them):

    * memory = ``tp × (rank_memory(...).total + CPU_PROCESS_BYTES) + CPU_PARENT_BYTES``
      (:func:`fastverify.live.config.rank_memory`);
    * start = ``CPU_START_S × tp / min(tp, cores)``;
    * build = all ranks' setup elements (``rank_memory(...).setup / dtype_bytes × tp``) /
      (``CPU_FILL_PER_S × P``);
    * one forward = ``tp × (bytes / CPU_READ_BYTES_PER_S + flops / CPU_FLOPS_PER_S) / P +
      collectives × CPU_COLLECTIVE_S``, with ``(bytes, flops)`` of one rank from
      :func:`forward_work` and ``1 + 2 × num_layers`` all-reduces and one all-gather at ``tp > 1``;
    * seconds = ``CPU_PARENT_S + start + build + (warmup + iters) × forward``.

    Calibrated on a 2-core AMD EPYC VM (KVM, 24 GiB, no GPU; torch CPU build, bf16; the 2 cores
    shared with other work, so times varied by up to 30 %): ``fastverify profile`` with its
    defaults (``--draft-tokens 4 --batch 1 --iters 5 --warmup 2``): the whole command's wall time
    (``/usr/bin/time``; about 2 s more than ``run_live``, for the CLI's imports and the
    report), the peak of the summed PSS of its process tree (sampled every 0.2 s), the stage
    times from its progress lines, and the timed forwards from the profile:

    ===============================  =======  ===========  ===============  =============  ==================
    run                              wall     peak memory  start / build    one forward    this estimate
    ===============================  =======  ===========  ===============  =============  ==================
    tiny (the default), --tp 2       4.1 s    555 MiB      1.9 s / 0 s      10-40 ms       3.1 s, 708 MiB
    kimi-k2 --tp 2 --device cpu      156 s    8883 MiB     2.6 s / 27 s     14.8-23.8 s    132 s, 8.7 GiB
    kimi-k2 --tp 8 (auto → CPU)      135 s    10056 MiB    5.1 s / 21 s     14.3-15.3 s    144 s, 10.1 GiB
    ===============================  =======  ===========  ===============  =============  ==================

    (A second kimi-k2 --tp 2 run, with the cores busier, took 181 s, forwards 17.5-25.0 s.)
    ``CPU_PROCESS_BYTES`` and ``CPU_PARENT_BYTES`` solve the two Kimi-K2 memory rows (PSS less
    ``tp × rank_memory().total``: 2 R + P = 631 MiB, 8 R + P = 1589 MiB, so R = 160 MiB and
    P = 311 MiB), rounded up. ``CPU_READ_BYTES_PER_S`` fits the Kimi-K2 forwards (188 GB of
    weights read per forward at --tp 2, 201 GB at --tp 8, :func:`forward_work`); a one-thread
    bf16 ``[T, 7168] @ [7168, 4096]`` there took 7.1 ms at T = 1 and 4 (8.2 GB/s) and 33.5 ms at
    T = 256, which with the read time taken off is 5.7e11 FLOP/s: ``CPU_FLOPS_PER_S`` is a
    rounded-down 4.5e11. ``CPU_START_S`` and ``CPU_FILL_PER_S`` (8.06 GiB drawn in 27 s at
    --tp 2, 8.27 GiB in 21 s at --tp 8, on 2 cores) come from the stage times;
    ``CPU_COLLECTIVE_S`` from the tiny run's all-reduces (83 ms for 45 on rank 0, waits included).

    Parameters
    ----------
    config : ModelConfig
    tp, batch, draft_tokens, iters, warmup : int
        As for ``run_live``.
    dtype_bytes : int
        Bytes per element (2 for bfloat16).
    cores : int or None
        Cores the ranks share; None: this process's CPU affinity.

    Returns
    -------
    CpuEstimate
    """
    cores = _cores() if cores is None else max(1, int(cores))
    mem = rank_memory(
        config,
        tp=tp,
        batch=batch,
        draft_tokens=draft_tokens,
        dtype_bytes=dtype_bytes,
        context_tokens=DEFAULT_CONTEXT_TOKENS,
    )
    threads = max(1, (os.cpu_count() or cores) // tp)
    parallel = max(1, min(cores, tp * threads))
    start = CPU_START_S * tp / min(tp, cores)
    build = mem.setup / dtype_bytes * tp / (CPU_FILL_PER_S * parallel)
    read, flops = forward_work(
        config,
        tp=tp,
        batch=batch,
        draft_tokens=draft_tokens,
        dtype_bytes=dtype_bytes,
        context_tokens=DEFAULT_CONTEXT_TOKENS,
    )
    collectives = 2 + 2 * config.num_layers if tp > 1 else 0
    forward = tp * (read / CPU_READ_BYTES_PER_S + flops / CPU_FLOPS_PER_S) / parallel + collectives * CPU_COLLECTIVE_S
    forwards = warmup + iters
    return CpuEstimate(
        seconds=CPU_PARENT_S + start + build + forwards * forward,
        memory_bytes=tp * (mem.total + CPU_PROCESS_BYTES) + CPU_PARENT_BYTES,
        start_s=start,
        build_s=build,
        forward_s=forward,
        forwards=forwards,
        cores=cores,
        tp=tp,
    )


GIB = 2**30

CUDA_CONTEXT_BYTES = 768 * 2**20
"""Allowance for one process's CUDA context on its GPU (bytes; an estimate from public reports,
not measured here): the first CUDA call of a PyTorch process took a GPU from 0 to 723 MiB used
(PyTorch forums, "What is the reason for pytorch's GPU memory floor?"), "~700+MB" depending on the
CUDA version and device (PyTorch forums, "High gpu memory overhead"); rounded up to 768 MiB."""

NCCL_COMM_BYTES = 688 * 2**20
"""Allowance for one NCCL communicator's buffers on each of its GPUs (bytes; an estimate from
public reports, not measured here): 688 MB per GPU for a group of 3-4 A100s after one 4 MB
all-reduce, 544 MB for 2 (NVIDIA/nccl#964); 484 MiB for a 1-GPU communicator at init (RTX
3090, pull request NVIDIA/nccl#2366). NCCL's maintainers say it grows with the channels and
algorithms used (NVIDIA/nccl#864), so this is a typical figure, not a bound."""

RANK_OVERHEAD_BYTES = CUDA_CONTEXT_BYTES + NCCL_COMM_BYTES
"""What a live rank holds on its GPU besides its tensors: one CUDA context and the default process
group's NCCL communicator (bytes)."""


@dataclass(frozen=True)
class LivePlan:
    """What :func:`plan_run` settled for a live run.

    Attributes
    ----------
    cuda : bool
        CUDA + NCCL (True) or CPU + gloo.
    fallback : str | None
        Why ``--device auto`` chose the CPU; None otherwise.
    estimate : CpuEstimate | None
        The CPU run's expected time and memory (:func:`estimate_cpu_run`);
        None on CUDA.
    backend, dist_backend : str
        Registry names of the all-reduce backend and of the process group's backend.
    p2p_ok, p2p_note : bool | None, str | None
        The real P2P check's verdict and note for a backend that needs P2P; None otherwise.
    """

    cuda: bool
    fallback: str | None
    estimate: CpuEstimate | None
    backend: str
    dist_backend: str
    p2p_ok: bool | None = None
    p2p_note: str | None = None


def check_run_args(
    config: ModelConfig, *, tp: int, draft_tokens: int, batch: int, iters: int, warmup: int, timeout_s: float
) -> None:
    """Refuse a ``tp`` that cannot split ``config`` (:func:`~fastverify.live.config.check_tp`),
    counts that are not integers in range (``--iters`` at most ``MAX_ITERS``, ``--warmup`` at most
    ``MAX_WARMUP``: :mod:`fastverify.bounds`), and a timeout outside ``(0, MAX_TIMEOUT_S]`` seconds."""
    check_tp(config, tp)
    for flag, value, low in (
        ("--draft-tokens", draft_tokens, 1),
        ("--batch", batch, 1),
        ("--iters", iters, 1),
        ("--warmup", warmup, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"{flag} must be an integer >= {low}, got {value!r}")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:  # also false for nan; inf and 1e300 overflow TCPStore's timedelta
        raise UserError(f"--timeout {timeout_s!r}: expected seconds in (0, {MAX_TIMEOUT_S:g}]")
    for flag, value, high in (
        ("--draft-tokens", draft_tokens, MAX_DRAFT_TOKENS),
        ("--batch", batch, MAX_BATCH),
        ("--iters", iters, MAX_ITERS),
        ("--warmup", warmup, MAX_WARMUP),
    ):
        if value > high:
            raise UserError(f"{flag} {value}: expected at most {high}")


def plan_run(
    config: ModelConfig,
    *,
    tp: int,
    draft_tokens: int,
    batch: int,
    iters: int,
    warmup: int,
    device: str,
    backend: str | None,
    dtype: str,
    torch,
) -> LivePlan:
    """Check ``dtype``, pick the device, estimate a CPU run, refuse a shape that does not fit in
    memory and pick the all-reduce backend, in that order, so the first refusal is the one a user
    sees. The P2P verdict comes later (:func:`check_p2p_for`), after the trace directory."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    use_cuda, fallback = pick_device(device, tp, torch)
    dtype_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    estimate = (
        None
        if use_cuda
        else estimate_cpu_run(
            config, tp=tp, batch=batch, draft_tokens=draft_tokens, iters=iters, warmup=warmup, dtype_bytes=dtype_bytes
        )
    )
    check_memory(
        config,
        tp=tp,
        batch=batch,
        draft_tokens=draft_tokens,
        dtype=dtype,
        cuda=use_cuda,
        torch=torch,
        estimate=estimate,
        fallback=fallback,
    )
    ar_backend = pick_backend(backend, use_cuda, tp, dtype, torch)
    dist_backend = (BackendName.nccl if use_cuda else BackendName.gloo).value
    return LivePlan(use_cuda, fallback, estimate, ar_backend, dist_backend)


def check_p2p_for(plan: LivePlan, tp: int) -> LivePlan:
    """``plan`` with the P2P verdict filled in when its backend needs P2P on a CUDA run of
    ``tp > 1`` ranks: IPC kernels hang without P2P, and only the real read/write check
    (:func:`fastverify.topo.p2p.check_p2p`, cached per box) proves it."""
    if not (plan.cuda and tp > 1 and backend_info(plan.backend).needs_p2p):
        return plan
    from fastverify.backends.base import summarize_p2p  # lazy: torch

    p2p_ok, p2p_note = summarize_p2p(check_p2p(pairs=[(a, b) for a in range(tp) for b in range(a + 1, tp)]))
    return LivePlan(plan.cuda, plan.fallback, plan.estimate, plan.backend, plan.dist_backend, p2p_ok, p2p_note)


def pick_device(device: str, tp: int, torch) -> tuple[bool, str | None]:
    """``(True, None)`` for CUDA + NCCL; ``(False, why)`` for CPU + gloo, where ``why`` says why
    ``"auto"`` fell back to the CPU (None for ``--device cpu``)."""
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cpu":
        return False, None
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    if device == "cuda" and count < tp:
        raise UserError(f"--device cuda needs {tp} GPUs for --tp {tp}, found {count}")
    if count >= tp:
        return True, None
    if not available:
        why = (
            "this torch has no CUDA (a CPU-only build)"
            if torch.version.cuda is None
            else "no CUDA GPU found (torch.cuda.is_available() is False)"
        )
    else:
        why = f"only {count} GPU{'' if count == 1 else 's'} for --tp {tp}"
    return False, why


def pick_backend(name: str | None, use_cuda: bool, tp: int, dtype: str, torch) -> str:
    """The all-reduce backend's registry name for this run; :class:`UserError` (one line) for an
    unknown name or a backend that cannot run on this run's device, with the probe's reason."""
    if name is None:
        return (BackendName.nccl if use_cuda else BackendName.gloo).value
    try:
        info = backend_info(name)
    except ValueError as err:
        raise UserError(f"--backend: {err}") from None
    here = "cuda" if use_cuda else "cpu"
    if tp == 1 and info.role is not Role.baseline:
        raise UserError(
            f"--backend {info.name.value}: --tp 1 runs no all-reduce, so there is nothing for it to do; use --tp >= 2"
        )
    if info.device == here:
        return info.name.value
    if info.role is Role.baseline:
        # torch.distributed's probes need an initialised group; the reason is the device alone.
        other = next(b for b in (BackendName.nccl, BackendName.gloo) if backend_info(b).device == here)
        raise UserError(
            f"--backend {info.name.value}: runs on {info.device} tensors and this run is on {here}"
            f"{'' if use_cuda else f' (fewer than {tp} GPUs, or --device cpu)'}; use --backend "
            f"{other.value}"
        )
    from fastverify.backends.base import ProbeContext, backend_class  # lazy: torch

    try:
        cls = backend_class(info.name)
    except ImportError as err:
        raise UserError(f"--backend {info.name.value}: its module {info.module} does not import ({err})") from None
    ctx = ProbeContext(
        world_size=tp,
        device_type=here,
        dtype=getattr(torch, dtype),
        group_backend=(BackendName.nccl if use_cuda else BackendName.gloo).value,
        single_node=True,
    )
    cap = cls.probe(ctx)
    raise UserError(
        f"--backend {info.name.value}: cannot run on {here}: "
        f"{cap.reason if not cap.ok else 'needs ' + info.device + ' tensors'}"
    )


def available_bytes(cuda: bool, tp: int, torch) -> tuple[int, str] | None:
    """Memory the ranks can use and what it is: the smallest GPU's total on CUDA (one rank per GPU),
    else the host's ``MemAvailable`` (``/proc/meminfo``, shared by all ranks); None when unknown."""
    if cuda:
        return min(torch.cuda.get_device_properties(r).total_memory for r in range(tp)), "per GPU"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "of host memory available"
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(
    config: ModelConfig,
    *,
    tp: int,
    batch: int,
    draft_tokens: int,
    dtype: str,
    cuda: bool,
    torch,
    estimate: CpuEstimate | None = None,
    fallback: str | None = None,
) -> None:
    """Refuse, before any rank starts, a shape whose memory exceeds what this machine has, naming
    the flags. CUDA: :func:`check_gpu_memory`. CPU: all ranks share the host, so the need is
    ``estimate.memory_bytes`` (:func:`estimate_cpu_run`: the lower bound of
    :func:`fastverify.live.config.rank_memory` plus each process's Python and torch) against
    ``MemAvailable``. ``fallback``: why ``--device auto`` chose the CPU, named in the message."""
    mem = rank_memory(
        config,
        tp=tp,
        batch=batch,
        draft_tokens=draft_tokens,
        dtype_bytes=torch.empty((), dtype=getattr(torch, dtype)).element_size(),
        context_tokens=DEFAULT_CONTEXT_TOKENS,
    )
    if cuda:
        check_gpu_memory(config, mem, tp=tp, batch=batch, draft_tokens=draft_tokens, torch=torch)
        return
    have = available_bytes(cuda, tp, torch)
    if have is None:
        return
    need = mem.total if estimate is None else estimate.memory_bytes
    if need > have[0]:
        who = (
            f"{tp} ranks need at least {need / GIB:.1f} GiB ({mem.total / GIB:.1f} each, "
            f"+ {CPU_PROCESS_BYTES / 2**20:.0f} MiB per process for Python and torch)"
        )
        physical = _physical_bytes()
        of = f" (of {physical / GIB:.1f} GiB physical)" if physical else ""
        where = f" on CPU ({fallback})" if fallback else ""
        raise UserError(
            f"{_shape(config, tp, batch, draft_tokens)}{where}: {who} (weights and KV context "
            f"{mem.setup / GIB:.1f}, largest temporary {mem.transient / GIB:.1f}); this machine has "
            f"{have[0] / GIB:.1f} GiB {have[1]}{of}; lower --batch or --draft-tokens"
            f"{'' if tp == 1 else ', or --tp (each CPU rank is a process of its own)'}"
        )


def _shape(config: ModelConfig, tp: int, batch: int, draft_tokens: int) -> str:
    return (
        f"--batch {batch} x --draft-tokens {draft_tokens} (T = {batch * draft_tokens} tokens) of {config.name} "
        f"at --tp {tp}"
    )


def check_gpu_memory(
    config: ModelConfig, mem: RankMemory, *, tp: int, batch: int, draft_tokens: int, torch, nvml=None, environ=None
) -> None:
    """Refuse a CUDA run whose rank does not fit its GPU: ``mem`` (bytes, a lower bound,
    :func:`~fastverify.live.config.rank_memory`) plus :data:`RANK_OVERHEAD_BYTES` against the
    smallest GPU's capacity, then against each GPU's free memory now (:func:`cuda_gpu_memory`:
    NVML, CUDA ordinals ``0..tp-1`` under ``environ``'s ``CUDA_VISIBLE_DEVICES``; ``nvml``: the
    binding, None for ``pynvml``). Without NVML only the capacity is checked, from torch."""
    need = mem.total + RANK_OVERHEAD_BYTES
    parts = (
        f"weights and KV context {mem.setup / GIB:.1f}, largest temporary {mem.transient / GIB:.1f}, "
        f"CUDA context and NCCL's buffers {RANK_OVERHEAD_BYTES / GIB:.1f}"
    )
    gpus = cuda_gpu_memory(tp, nvml=nvml, environ=environ)
    totals = [g["total_bytes"] for g in gpus or () if g["total_bytes"] is not None]
    total = min(totals) if totals else available_bytes(True, tp, torch)[0]
    if need > total:
        raise UserError(
            f"{_shape(config, tp, batch, draft_tokens)}: each rank needs at least {need / GIB:.1f} GiB "
            f"({parts}); this machine has {total / GIB:.1f} GiB per GPU; lower --batch or --draft-tokens"
        )
    short = [g for g in gpus or () if g["free_bytes"] is not None and g["free_bytes"] < need]
    if short:
        # A smaller shape helps only where more than the context and NCCL is free; a smaller --tp
        # only where the GPUs before the first short one have room (rank r runs on CUDA GPU r).
        fixes = ["lower --batch or --draft-tokens"] if min(g["free_bytes"] for g in short) > RANK_OVERHEAD_BYTES else []
        fewer = next((t for t in range(short[0]["cuda"], 0, -1) if _splits(config, t)), None)
        if fewer is not None:
            fixes.append(f"use --tp {fewer}")
        raise UserError(
            f"{_shape(config, tp, batch, draft_tokens)}: each rank needs about {need / GIB:.1f} GiB free "
            f"({parts}); {short_text(short)}; {free_fix(short, fixes)}"
        )


def _splits(config: ModelConfig, tp: int) -> bool:
    """Whether ``tp`` ranks can split ``config`` (:func:`~fastverify.live.config.check_tp`)."""
    try:
        check_tp(config, tp)
    except UserError:
        return False
    return True


def cuda_gpu_memory(count: int, *, nvml=None, environ=None) -> list[dict] | None:
    """The first ``count`` CUDA devices a process started with ``environ`` (None: this process's)
    gets, as :func:`fastverify.topo.nvml.read_gpu_memory` rows (bytes) with ``"cuda"``: the
    ordinal, mapped by :func:`fastverify.topo.gpu_identity.visible_gpus`. None where it cannot be
    told: no NVML (a CPU box, no driver, no ``pynvml``) or ordinals NVML cannot map (MIG, a mixed
    box in CUDA's default order)."""
    rows = read_gpu_memory(nvml)
    if not rows:
        return None
    shown, _why = visible_gpus(rows, os.environ if environ is None else environ)
    if shown is None:
        return None
    return [{"cuda": k, **row} for k, row in enumerate(shown[:count])]


def short_text(short: list[dict]) -> str:
    """``"GPU 0 (NVIDIA GeForce RTX 4090, NVML GPU 2) has 0.5 GiB free of 24.0 GiB, held by
    python3 (pid 4242, 23.1 GiB); GPUs 1, 3 too"``: the first GPU of ``short`` (the
    :func:`cuda_gpu_memory` rows short of memory, in CUDA order) and who holds its memory, then
    the others' CUDA ordinals; NVML's index is named where it differs from CUDA's."""
    g = short[0]
    nvml_index = "" if g["index"] == g["cuda"] else f", NVML GPU {g['index']}"
    text = (
        f"GPU {g['cuda']} ({g['name'] or 'name unknown'}{nvml_index}) has {g['free_bytes'] / GIB:.1f} GiB free "
        f"of {g['total_bytes'] / GIB:.1f} GiB, {holders_text(g['holders'])}"
    )
    if len(short) > 1:
        text += f"; GPU{'s' if len(short) > 2 else ''} {', '.join(str(o['cuda']) for o in short[1:])} too"
    return text


def holders_text(holders: list[dict], most: int = 3) -> str:
    """``"held by sglang::schedul (pid 4242, 21.3 GiB), pid 977 (1.2 GiB)"`` for
    :func:`~fastverify.topo.nvml.read_gpu_memory` holders, largest first, at most ``most`` named;
    this process is left out."""
    others = sorted((h for h in holders if h["pid"] != os.getpid()), key=lambda h: -(h["used_bytes"] or 0))
    if not others:
        return "held by no process NVML names (another container's, or not a compute process)"
    named = []
    for h in others[:most]:
        used = "" if h["used_bytes"] is None else f", {h['used_bytes'] / GIB:.1f} GiB"
        named.append(
            f"{h['name']} (pid {h['pid']}{used})" if h["name"] else f"pid {h['pid']} ({used[2:] or 'size unknown'})"
        )
    more = f" and {len(others) - most} more" if len(others) > most else ""
    return "held by " + ", ".join(named) + more


def free_fix(short: list[dict], fixes: list[str]) -> str:
    """The fix of a free-memory refusal: stop what holds ``short``'s GPUs, or point
    ``CUDA_VISIBLE_DEVICES`` at GPUs with room, then the caller's ``fixes``."""
    held = any(h["pid"] != os.getpid() for g in short for h in g["holders"])
    first = f"stop the server holding {'it' if len(short) == 1 else 'them'}" if held else "free that memory"
    return ", or ".join([first, "set CUDA_VISIBLE_DEVICES to GPUs with room", *fixes])


def _physical_bytes() -> int | None:
    """The host's physical memory in bytes (``SC_PHYS_PAGES`` × ``SC_PAGE_SIZE``), None when unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
