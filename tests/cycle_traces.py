"""Synthetic SGLang-shaped per-rank Kineto traces of EAGLE speculative cycles, with planted causes.

Each cycle on each TP rank: a ``draft`` stage span holding ``draft_steps`` ``step[DRAFT bs=1]``
forwards (compute, all-reduce, compute, all-reduce each), one ``step[VERIFY bs=1]`` forward (an
embedding all-reduce, then per layer attention compute, all-reduce, MoE compute, all-reduce), a
device-to-host copy with ``cudaStreamSynchronize`` after verify and a host pause, then a
``draft_extend`` stage span (compute, all-reduce, compute, all-reduce). All-reduces finish
together on every rank: each rank's kernel runs from its own arrival to the last arrival plus the
transfer. The planted ``straggler`` rank spends ``straggle_us`` longer in every MoE compute, so
every other rank waits that long in every MoE all-reduce of the verify forward; ``moe_extra_us[r]``
adds to rank ``r``'s MoE compute (every rank its own wait); ``late_launch_us`` delays the host
launch of each verify forward's last compute kernel (a launch gap); ``host_sync_us``: after the
verify forward's embedding all-reduce the host blocks in ``cudaStreamSynchronize`` until the GPU
drains, then works that long before it launches the next kernel (an idle gap under a host sync).
``graph``: the forward modes (``draft``, ``verify``, ``draft_extend``) replayed from a CUDA graph
(one ``cudaGraphLaunch`` per forward, its kernels carrying the launch's correlation and no c10d
size args); the others launch every kernel eagerly (``cudaLaunchKernel``), as under
``--disable-cuda-graph``.
Times are µs in the generator, written as Kineto floats (µs with ns fractions).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import orjson

AR_KERNEL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
COMPUTE = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)"
D2H = "Memcpy DtoH (Device -> Pinned)"
LAG = 20.0  # µs the host runs ahead of the GPU: launches and spans sit this much before their kernels


@dataclass(frozen=True)
class Plan:
    world: int = 8
    cycles: int = 6
    layers: int = 4
    draft_steps: int = 3
    transfer_us: float = 40.0
    attn_us: float = 150.0
    moe_us: float = 200.0
    draft_us: float = 60.0
    straggler: int | None = 5
    straggle_us: float = 80.0
    d2h_us: float = 10.0
    host_pause_us: float = 300.0
    late_launch_us: float = 50.0
    host_sync_us: float = 0.0
    moe_extra_us: tuple[float, ...] = ()
    graph: tuple[str, ...] = ()
    msg_bytes: int | None = 4 * 7168 * 2  # None: sizes unknown, as under CUDA-graph replay

    @property
    def verify_ars(self) -> int:
        return 1 + 2 * self.layers

    @property
    def draft_ars(self) -> int:
        return 2 * self.draft_steps


class _Clock:
    def __init__(self, world: int) -> None:
        self.t = [1000.0] * world
        self.events: list[list[dict]] = [[] for _ in range(world)]
        self.corr = [0] * world
        self.graph: list[int | None] = [None] * world  # the correlation of the graph replaying now

    def replay(self, on: bool) -> None:
        """Start (one ``cudaGraphLaunch`` per rank, LAG before its GPU work) or end a graph replay."""
        for r in range(len(self.t)):
            self.graph[r] = None
            if on:
                self.corr[r] += 1
                self.graph[r] = self.corr[r]
                self.events[r].append(
                    {
                        "ph": "X",
                        "cat": "cuda_runtime",
                        "name": "cudaGraphLaunch",
                        "pid": 1,
                        "tid": 1,
                        "ts": self.t[r] - LAG,
                        "dur": 5.0,
                        "args": {"correlation": self.corr[r]},
                    }
                )

    def kernel(self, r: int, name: str, dur: float, *, launch_at: float | None = None, cat: str = "kernel") -> None:
        start = self.t[r]
        ev = self.events[r]
        c = self.graph[r]
        if c is None:
            self.corr[r] += 1
            c = self.corr[r]
            ev.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "pid": 1,
                    "tid": 1,
                    "ts": start - LAG if launch_at is None else launch_at,
                    "dur": 3.0,
                    "args": {"correlation": c},
                }
            )
        ev.append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "pid": 0,
                "tid": 7,
                "ts": start,
                "dur": dur,
                "args": {"correlation": c, "stream": 7, "device": r},
            }
        )
        self.t[r] = start + dur

    def span(self, r: int, name: str, start: float, end: float) -> None:
        self.events[r].append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": name,
                "pid": 1,
                "tid": 1,
                "ts": start - LAG,
                "dur": end - start,
            }
        )

    def all_reduce(self, transfer: float, msg_bytes: int | None) -> None:
        end = max(self.t) + transfer
        for r in range(len(self.t)):
            self.kernel(r, AR_KERNEL, end - self.t[r])
            if msg_bytes and self.graph[r] is None:  # eager NCCL kernels carry c10d's args (In msg nelems x dtype)
                self.events[r][-1]["args"].update(
                    {"In msg nelems": msg_bytes // 2, "dtype": "BFloat16", "Collective name": "allreduce"}
                )


def _draft_forward(ck: _Clock, plan: Plan) -> list[float]:
    """One ``step[DRAFT bs=1]`` forward on every rank (compute, all-reduce, compute, all-reduce);
    returns each rank's start (µs)."""
    s0 = list(ck.t)
    for half in (1.0, 0.5):
        for r in range(plan.world):
            ck.kernel(r, COMPUTE, plan.draft_us * half)
        ck.all_reduce(plan.transfer_us, plan.msg_bytes)
    for r in range(plan.world):
        ck.span(r, "step[DRAFT bs=1]", s0[r], ck.t[r])
    return s0


def build(plan: Plan = Plan()) -> list[dict]:
    """One Kineto document per rank (a dict with ``traceEvents`` and ``distributedInfo``)."""
    ck = _Clock(plan.world)
    ranks = range(plan.world)
    for _cycle in range(plan.cycles + 1):  # the last cycle start has no end: the analysis drops it
        start = list(ck.t)
        ck.replay("draft" in plan.graph)
        for _s in range(plan.draft_steps):
            _draft_forward(ck, plan)
        for r in ranks:
            ck.span(r, "draft", start[r], ck.t[r])
        v0 = list(ck.t)
        ck.replay("verify" in plan.graph)
        ck.all_reduce(plan.transfer_us, plan.msg_bytes)  # embedding
        if plan.host_sync_us:
            for r in ranks:  # blocks from its launch until the GPU drains, then host work, then a late launch
                ck.events[r].append(
                    {
                        "ph": "X",
                        "cat": "cuda_runtime",
                        "name": "cudaStreamSynchronize",
                        "pid": 1,
                        "tid": 1,
                        "ts": ck.t[r] - plan.transfer_us - LAG + 3.0,
                        "dur": plan.transfer_us + LAG - 2.0,
                    }
                )
                ck.t[r] += plan.host_sync_us
        for layer in range(plan.layers):
            for r in ranks:
                ck.kernel(r, COMPUTE, plan.attn_us)
            ck.all_reduce(plan.transfer_us, plan.msg_bytes)
            for r in ranks:
                extra = (plan.straggle_us if r == plan.straggler else 0.0) + (
                    plan.moe_extra_us[r] if plan.moe_extra_us else 0.0
                )
                last = layer == plan.layers - 1
                if last and plan.late_launch_us:
                    ck.t[r] += plan.late_launch_us  # the GPU ran dry: the launch came late
                    ck.kernel(r, COMPUTE, plan.moe_us + extra, launch_at=ck.t[r] - 1.0)
                else:
                    ck.kernel(r, COMPUTE, plan.moe_us + extra)
            ck.all_reduce(plan.transfer_us, plan.msg_bytes)
        for r in ranks:
            ck.span(r, "step[VERIFY bs=1]", v0[r], ck.t[r])
        ck.replay(False)
        for r in ranks:  # accept-length read back: D2H copy, host sync, host work, then draft_extend
            ck.kernel(r, D2H, plan.d2h_us, cat="gpu_memcpy")
            ck.events[r].append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaStreamSynchronize",
                    "pid": 1,
                    "tid": 1,
                    "ts": ck.t[r] - plan.d2h_us - LAG + 3.0,
                    "dur": plan.d2h_us + LAG - 2.0,
                }
            )
            ck.t[r] += plan.host_pause_us
        ck.replay("draft_extend" in plan.graph)
        e0 = _draft_forward(ck, plan)
        ck.replay(False)
        for r in ranks:
            ck.span(r, "draft_extend", e0[r], ck.t[r])
        ck.t = [max(ck.t)] * plan.world  # the scheduler's next batch starts on every rank together
    return [
        {
            "schemaVersion": 1,
            "distributedInfo": {"backend": "nccl", "rank": r, "world_size": plan.world},
            "deviceProperties": [{"id": 0, "name": "NVIDIA GeForce RTX 4090"}],
            "traceEvents": ck.events[r],
        }
        for r in ranks
    ]


def write(folder: Path, plan: Plan = Plan(), stem: str = "1700000000") -> list[Path]:
    """Write one ``<stem>-TP-<r>.trace.json.gz`` per rank (SGLang's name form) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for r, doc in enumerate(build(plan)):
        p = folder / f"{stem}-TP-{r}.trace.json.gz"
        p.write_bytes(gzip.compress(orjson.dumps(doc)))
        out.append(p)
    return out
