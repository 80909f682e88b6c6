"""Kernel classification: one ordered table of name rules, each with its source.

The registry's backends bring their own kernel names (:attr:`fastverify.registry.BackendInfo.kernel_patterns`),
placed after NCCL's. The first rule whose regex matches a GPU event's name decides its :class:`EventClass`. Rules
whose class is ``None`` need the launching CPU op (eager traces only): RCCL's generic kernel and
FlashInfer's generic ``allreduce_kernel`` names say nothing about the collective by themselves.
Under CUDA-graph replay there is no launching op, so those resolve to ``UNKNOWN_COMM`` and are
reported rather than counted as compute.

HTA 0.5.0 counts only ``^nccl`` as communication (``hta/common/types.py``), which is why it reports
0.2 % communication on a vLLM TP8 B200 trace whose all-reduces are torch symmetric-memory kernels.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from fastverify.events import EventClass
from fastverify.registry import BACKENDS

A, F, O, M, U, C, E = (
    EventClass.ALLREDUCE,
    EventClass.FUSED_ALLREDUCE,
    EventClass.OTHER_COMM,
    EventClass.MEMORY,
    EventClass.UNKNOWN_COMM,
    EventClass.COMPUTE,
    EventClass.EP_ALLTOALL,
)


SENDRECV_FAMILY = "nccl_sendrecv"


@dataclass(frozen=True)
class Rule:
    """One row of the classification table.

    ``cls`` None means: decide from the launching CPU op's collective (see :func:`resolve_from_op`).
    ``family`` names the implementation (``nccl``, ``custom_ar``, ``symm_mem``, ...).
    ``source`` says where the kernel name was seen (project and file, or a trace).
    """

    pattern: str
    cls: EventClass | None
    family: str
    source: str

    @property
    def regex(self) -> re.Pattern[str]:
        return _compiled(self.pattern)


@lru_cache(maxsize=None)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


# Order matters: specific families before the catch-alls.
RULES: tuple[Rule, ...] = (
    # --- expert-parallel all-to-all (before everything: their names hold "dispatch"/"combine",
    # never "all_reduce", and they must never fall through to compute) -------------------------
    Rule(
        r"(^|[\s:])deep_ep::(intranode|internode|internode_ll)::",
        E,
        "deep_ep",
        "DeepEP csrc/kernels/intranode.cu, internode.cu, internode_ll.cu: kernels in namespaces "
        "deep_ep::intranode / internode / internode_ll (notify_dispatch, cached_notify_dispatch, dispatch, "
        "cached_notify_combine, combine; internode_ll::dispatch/combine), demangled by Kineto as "
        "'void deep_ep::intranode::dispatch<8, 768, 8192>(...)'",
    ),
    Rule(
        r"(^|[\s:])pplx::.*(dispatch|combine)|(^|[\s:])pplx::.*[Aa]ll[Tt]o[Aa]ll",
        E,
        "pplx",
        "pplx-kernels csrc/all_to_all/ (namespace pplx, classes AllToAllIntraNode / AllToAllInterNode, "
        "dispatch and combine kernels)",
    ),
    Rule(
        r"^nccl(Symk?)?(Dev)?Kernel_AllToAll",
        E,
        "nccl",
        "NCCL ncclFuncAllToAll kernels (msccl src/collectives/device/all_to_all.h)",
    ),
    Rule(
        r"^nccl(Symk?)?(Dev)?Kernel_SendRecv",
        O,
        SENDRECV_FAMILY,
        "NCCL src/device/sendrecv.h: ncclDevKernel_SendRecv carries both pipeline send/recv and "
        "torch all_to_all(_single) (grouped ncclSend/ncclRecv); the launching op decides, see refine_from_op",
    ),
    # --- NCCL / RCCL -----------------------------------------------------------------------
    Rule(
        r"^nccl(Symk?)?(Dev)?Kernel_AllReduce",
        A,
        "nccl",
        "NCCL kernel names: ncclDevKernel_* (NCCL >= 2.19, B200 trace in TraceLens), ncclKernel_* (NCCL 2.17, "
        "HTA tests/data), ncclSym(k)DevKernel_* symmetric kernels (NCCL src/device/symmetric/generate.py)",
    ),
    Rule(
        r"^nccl(Symk?)?(Dev)?Kernel_(AllGather|ReduceScatter|Broadcast|Reduce|SendRecv|AllToAll|Send|Recv)",
        O,
        "nccl",
        "NCCL kernel names (same sources); TraceLens b200 ncclDevKernel_AllGather_RING_LL",
    ),
    Rule(
        r"^(void )?(ncclDevKernel_Generic|rcclGenericKernel)",
        None,
        "rccl",
        "RCCL generic kernel, collective only from the launching op (TraceLens mi300 traces; roctracer issue #101)",
    ),
    Rule(r"^(void )?(nccl|rccl)", None, "nccl", "any other NCCL/RCCL kernel"),
    # --- the registry's backends (fastverify.registry.BackendInfo.kernel_patterns, in its order):
    # FlashInfer PCIe IPC, the FlashInfer / TensorRT-LLM fused all-reduce + residual + RMSNorm,
    # the custom all-reduce of vLLM / SGLang / AMD aiter ------------------------------------------
    *(Rule(k.pattern, EventClass(k.event), k.family, k.source) for b in BACKENDS for k in b.kernel_patterns),
    # --- FlashInfer / TensorRT-LLM plain all-reduce (no backend of fastverify's) --------------
    Rule(
        r"oneShotAllReduceKernel|twoShotAllReduceKernel|twoshotAllreduceKernel|oneshotAllreduceKernel",
        A,
        "flashinfer_trtllm",
        "flashinfer include/flashinfer/comm/trtllm_allreduce.cuh, trtllm_mnnvl_allreduce.cuh",
    ),
    # --- MSCCL++ ------------------------------------------------------------------------------
    Rule(
        r"allreduce_1shotLL_(1|2)node|mscclpp.*[Aa]ll[Rr]educe|allreduce(Packet|Nvls|Allpair)",
        A,
        "mscclpp",
        "sglang sgl-kernel/csrc/allreduce/mscclpp_allreduce.cuh; mscclpp apps/nccl/src/allreduce.hpp",
    ),
    # --- torch symmetric memory --------------------------------------------------------------
    Rule(
        r"multimem_all_reduce_kernel|multimem_one_shot_reduce_kernel|one_shot_all_reduce_kernel"
        r"|two_shot_all_reduce_kernel",
        A,
        "symm_mem",
        "pytorch torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu; TraceLens b200 trace",
    ),
    Rule(
        r"multimem_all_gather_kernel|symm_mem.*(all_gather|reduce_scatter)",
        O,
        "symm_mem",
        "pytorch CUDASymmetricMemoryOps.cu",
    ),
    # --- SGLang / AMD others (file names in sgl-kernel/csrc/allreduce/; symbols not checked) ---
    Rule(
        r"quick_?all_?reduce|deterministic_all_reduce|trt_?reduce|allreduce_prototype",
        A,
        "sglang_other",
        "sglang sgl-kernel/csrc/allreduce/ file names; aiter quick reduce",
    ),
    # --- generic names, meaning from the launching op ------------------------------------------
    Rule(
        r"^(void )?([\w:]*::)?(allreduce_kernel|allgather_kernel|reducescatter_kernel)\b",
        None,
        "generic",
        "flashinfer include/flashinfer/comm/ generic kernel names (need CPU-op context)",
    ),
    # --- memory --------------------------------------------------------------------------------
    Rule(
        r"^(hip)?Memcpy|^(hip)?Memset|^dma|^\[?Memcpy|^\[?Memset",
        M,
        "memory",
        "Kineto gpu_memcpy / gpu_memset event names; HTA MEMORY pattern",
    ),
)

# A kernel no rule claims but whose name looks like a collective: reported, not counted as compute.
COLLECTIVE_LIKE = re.compile(
    r"(?i)all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|send_?recv|(?<![a-z])broadcast|multimem|lamport"
    r"|collective|\bnccl|rccl|mscclpp|custom_ar|cross_device"
)

# Collective names as they appear in `Collective name` args and c10d / engine CPU ops.
_OP_ALLREDUCE = re.compile(r"(?i)all_?reduce")
_OP_ALLTOALL = re.compile(r"(?i)all_?to_?all|alltoall_base|deep_ep|pplx")
_OP_OTHER_COMM = re.compile(r"(?i)all_?gather|reduce_?scatter|all_?to_?all|broadcast|send|recv|^nccl:|gather|scatter")


@dataclass(frozen=True)
class Classified:
    """Result of :func:`classify_name`: class (None = needs the launching op), family, rule index."""

    cls: EventClass | None
    family: str
    rule: int  # index into RULES; -1 = no rule (compute or collective-looking)


@lru_cache(maxsize=65536)
def classify_name(name: str) -> Classified:
    """Classify one GPU event name by :data:`RULES` (cached per distinct name).

    Returns ``Classified(cls=None, ...)`` when the name alone is not enough (see module docstring);
    callers then use :func:`resolve_from_op`.
    """
    for i, rule in enumerate(RULES):
        if rule.regex.search(name):
            return Classified(rule.cls, rule.family, i)
    if COLLECTIVE_LIKE.search(name):
        return Classified(U, "unknown", -1)
    return Classified(C, "compute", -1)


def resolve_from_op(collective: str | None) -> EventClass:
    """Class of a kernel whose name needs context, from its launching op's collective name.

    ``collective`` is the kernel's ``Collective name`` arg or the launching CPU op's name
    (e.g. ``allreduce``, ``_allgather_base``, ``c10d::allreduce_``); ``None`` when unknown
    (CUDA-graph replay) gives ``UNKNOWN_COMM``.
    """
    if not isinstance(collective, str) or not collective:
        return U
    if _OP_ALLREDUCE.search(collective):
        return A
    if _OP_ALLTOALL.search(collective):
        return E
    if _OP_OTHER_COMM.search(collective):
        return O
    return U


def refine_from_op(cls: EventClass, family: str, collective: str | None) -> EventClass:
    """An NCCL SendRecv kernel launched by an all-to-all op (``all_to_all_single``,
    ``c10d::alltoall_base_``, ``Collective name`` ``all_to_all``) is expert-parallel all-to-all;
    launched by anything else (pipeline ``send``/``recv``) or with no op known it stays ``cls``.
    """
    if family == SENDRECV_FAMILY and isinstance(collective, str) and _OP_ALLTOALL.search(collective):
        return E
    return cls
