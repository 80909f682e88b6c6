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
from fastverify.live.estimate import CPU_PROCESS_BYTES, CpuEstimate, estimate_cpu_run
from fastverify.profile.record import DTYPES
from fastverify.registry import BackendName, Role, backend_info
from fastverify.topo.gpu_identity import visible_gpus
from fastverify.topo.nvml import read_gpu_memory
from fastverify.topo.p2p import check_p2p

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
        The CPU run's expected time and memory (:func:`~fastverify.live.estimate.estimate_cpu_run`);
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
