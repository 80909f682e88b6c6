"""What a live run on CPU + gloo will cost, in seconds and bytes, before any rank starts.

:func:`estimate_cpu_run` models the run from the shapes alone (:func:`forward_work` counts one
rank's weight bytes and GEMM FLOPs per forward, :func:`fastverify.live.config.rank_memory` its
memory); the constants below calibrate it on one machine. No torch needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fastverify.live.config import DEFAULT_CONTEXT_TOKENS, ModelConfig, rank_memory

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
