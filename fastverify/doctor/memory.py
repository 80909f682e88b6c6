"""The doctor check that every GPU has the memory its GPU checks need free, before they run: a GPU
a server already fills makes them die of ``OutOfMemoryError`` and blame the wrong thing (the
patch's timer, P2P, NCCL). Free memory and its holders come from NVML without a CUDA context
(:func:`fastverify.live.preflight.cuda_gpu_memory`)."""

from __future__ import annotations

from fastverify.doctor.core import Outcome, Status, _Context, _out
from fastverify.live.preflight import (
    GIB,
    RANK_OVERHEAD_BYTES,
    cuda_gpu_memory,
    free_fix,
    short_text,
)

DOCTOR_GPU_BYTES = 2 * RANK_OVERHEAD_BYTES
"""Free memory each GPU needs for doctor's GPU checks (bytes): two processes at a time, each with
a CUDA context and an NCCL communicator (:data:`~fastverify.live.preflight.RANK_OVERHEAD_BYTES`):
doctor itself on GPU 0 (its 1-rank NCCL group, the tiny verify forward) and one spawned check
process per GPU (a trial rank, a P2P side). The tensors they move are a few MiB."""


def check_gpu_free_memory(ctx: _Context, *, nvml=None, environ=None) -> Outcome:
    """``fail`` when a GPU CUDA shows this process has less than :data:`DOCTOR_GPU_BYTES` free,
    naming the GPU as CUDA numbers it, its free GiB and the processes holding it; ``ok`` with
    each GPU's free GiB; ``skipped`` where NVML does not say (no ``pynvml``, no driver, or
    ordinals NVML cannot map). ``nvml``/``environ``: the binding and the environment (None: ``pynvml``
    and this process's)."""
    gpus = cuda_gpu_memory(ctx.gpu_count, nvml=nvml, environ=environ)
    if not gpus:
        return _out(Status.skipped, "NVML does not report this process's GPUs (no nvidia-ml-py or driver, MIG, or "
                    "GPUs of several models in CUDA's default order), so their free memory is not known")
    free = {g["cuda"]: None if g["free_bytes"] is None else round(g["free_bytes"] / GIB, 2) for g in gpus}
    short = [g for g in gpus if g["free_bytes"] is not None and g["free_bytes"] < DOCTOR_GPU_BYTES]
    if short:
        return _out(Status.fail, f"doctor's GPU checks need about {DOCTOR_GPU_BYTES / GIB:.1f} GiB free on each GPU "
                    f"(2 CUDA contexts and NCCL communicators); {short_text(short)}; GPU checks below fail "
                    "from lack of memory, not for the reasons they name",
                    free_fix(short, []), free_gib=free, need_gib=round(DOCTOR_GPU_BYTES / GIB, 2))
    return _out(Status.ok, "free memory per GPU (GiB, CUDA numbering): "
                + ", ".join(f"{k}: {v if v is not None else 'unknown'}" for k, v in free.items()),
                free_gib=free, need_gib=round(DOCTOR_GPU_BYTES / GIB, 2))
