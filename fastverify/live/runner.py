"""Run the synthetic verify forward on ``tp`` rank processes and return one :class:`RankEvents` per rank.

Process model: one fresh Python process per rank (``sys.executable -c`` calling
:func:`_worker_main`; no inherited CUDA or gloo state, as SGLang starts its scheduler ranks with
``spawn``). The environment passes through, so ``NCCL_*`` settings reach the ranks. The parent holds
the rendezvous ``TCPStore`` on 127.0.0.1 with a port the OS picks, so no port is guessed. The spec
goes to each rank as a JSON file and the result comes back as ``rank<r>.json`` in a temporary
directory; stderr goes to ``rank<r>.stderr`` there, and stdout is never parsed. A rank that exits
non-zero or outlives ``timeout_s`` ends the run: every rank's process group is stopped by the one
launcher's kill rule (:class:`fastverify.procs.RankGroup`: SIGTERM, then SIGKILL) and
:class:`~fastverify.errors.UserError` names the rank and the last line of its stderr. While the
parent waits it reads each rank's ``rank<r>.progress`` (one line per stage: joined, weights built,
and on rank 0 each forward done) and prints progress lines on stderr (:mod:`fastverify.progress`).
A CPU run's time and memory are estimated before any rank starts (:func:`estimate_cpu_run`).

Clocks
------
* CPU (gloo): each region is bracketed by ``time.perf_counter_ns()`` (``CLOCK_MONOTONIC`` on Linux,
  one clock for every process on the machine), so ranks line up without conversion. Wall time,
  labelled ``timing = "cpu_wall_clock"``: it is not GPU time.
* CUDA (NCCL): each region is bracketed by ``torch.cuda.Event(enable_timing=True)`` on the
  current stream. Before each timed forward the ranks synchronise (device sync, barrier, device
  sync), then record a base event on an idle GPU and read ``perf_counter_ns()``; an event's time is
  that host time plus its ``elapsed_time`` from the base event (ms → ns). ``timing = "cuda_events"``.
  Afterwards the forward is captured in a CUDA graph and replayed under ``torch.profiler``; the
  Chrome trace of each rank goes to ``trace_dir/verify-TP-<rank>.trace.json.gz`` (SGLang's
  ``-TP-<rank>`` naming, so :mod:`fastverify.trace.load` reads it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import orjson

# The CLI's bounds (fastverify/bounds.py), also enforced here for callers of run_live.
from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS, MAX_TIMEOUT_S
from fastverify.errors import UserError
from fastverify.events import EventClass, RankEvents, Step
from fastverify.live.config import ModelConfig, check_tp, rank_memory
from fastverify.procs import (
    RankGroup,
    child_env as _child_env,
    exit_reason as _exit_reason,
    failure_time as _failure_time,
    last_stderr_line as _last_stderr_line,
    rank_device,
    rank_workdir,
)
from fastverify.progress import Progress, default_after_s, say

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
TRACE_REPLAYS = 3
"""Graph replays recorded in each rank's Chrome trace (after one profiler warm-up replay)."""


def run_live(
    config: ModelConfig,
    *,
    tp: int,
    draft_tokens: int,
    batch: int,
    iters: int = 5,
    warmup: int = 2,
    device: str = "auto",
    timeout_s: float = 300.0,
    trace_dir: str | None = None,
    backend: str | None = None,
    dtype: str = "bfloat16",
    progress: bool = True,
) -> list[RankEvents]:
    """Time ``iters`` verify forwards of ``config`` on ``tp`` ranks (after ``warmup`` untimed ones).

    Parameters
    ----------
    config : ModelConfig
        From :func:`~fastverify.live.config.load_model_config`.
    tp : int
        Tensor-parallel ranks (processes); each uses one GPU on CUDA.
    draft_tokens, batch : int
        Tokens per request in verify (SGLang ``speculative_num_draft_tokens``, 1..64) and requests
        (1..4096); the forward runs ``T = batch × draft_tokens`` tokens.
    iters, warmup : int
        Timed forwards (one :class:`~fastverify.events.Step` each, named ``verify#<i>``) and
        untimed ones before them.
    device : {"auto", "cpu", "cuda"}
        ``"auto"`` is CUDA + NCCL when ``torch.cuda.device_count() >= tp``, else CPU + gloo; that
        fallback is said at once on stderr (unless ``progress`` is False), before any rank
        starts, in one ``fastverify:`` line: why (no CUDA, or only K GPUs for ``tp``) and the CPU
        run's estimated time and memory (:func:`estimate_cpu_run`), with a warning when the
        estimate is over ``timeout_s``. An explicit ``"cpu"`` run says its estimate only in that
        last case.
    timeout_s : float
        Limit for the whole run, start-up included, in seconds, in (0, 86400].
    trace_dir : str | None
        CUDA only: where each rank writes ``verify-TP-<rank>.trace.json.gz``.
    backend : str | None
        All-reduce backend of the forward, a :class:`fastverify.registry.BackendName` value; each
        rank builds it with ``make_backend`` on the run's group (P2P from the real check,
        :func:`fastverify.topo.p2p.check_p2p`, for a backend that needs it). None: NCCL on CUDA,
        gloo on CPU.
    dtype : str
        torch dtype name of weights, activations and all-reduces (``bfloat16``, ``float16``,
        ``float32``).
    progress : bool
        Progress lines on stderr (:class:`fastverify.progress.Progress`: none in the first 2 s,
        then at most one a second): ranks started ``i/tp``, weights built ``i/tp``, forwards done
        ``i/(warmup + iters)`` with the time left. The ranks report through small files in the
        run's folder (``rank<r>.progress``; forwards from rank 0 only), which the parent reads
        while it waits. ``FASTVERIFY_PROGRESS_AFTER_S=0`` prints from the first step. False
        (``--quiet``): nothing on stderr but errors (no progress lines, no fallback line).

    Returns
    -------
    list[RankEvents]
        One per rank, sorted by rank. Rows are op regions: compute (``EventClass.COMPUTE``, names
        ``compute:embed|attn|mlp|moe|lm_head``), all-reduces (``ALLREDUCE``, name ``allreduce``,
        ``msg_bytes = T × hidden × dtype size``; ``FUSED_ALLREDUCE`` for a fused all-reduce + RMSNorm
        backend) and the logits all-gather (``OTHER_COMM``, name ``allgather``,
        ``msg_bytes = T × vocab_padded / tp × dtype size``, the per-rank input); ``label``
        says where (``layer3.attn_out.allreduce``). Compute rows have ``msg_bytes = -1``. Times are
        ns in one clock shared by all ranks (see the module docstring). ``meta`` holds ``timing``,
        ``device``, ``dist_backend``, ``world_size``, ``model``, ``hidden_size``, ``num_layers``,
        ``draft_tokens``, ``batch``, ``tokens``, ``warmup``, ``iters``, ``dtype``,
        ``allreduce_backend``, ``allreduce_paths`` (the backend's ``path_counts``),
        ``experts_allocated`` and more.

    Raises
    ------
    UserError
        Bad arguments, a model that ``tp`` cannot split, a shape whose memory
        (:func:`~fastverify.live.config.rank_memory`, a lower bound) exceeds the host's available
        memory (CPU, all ranks, with each process's interpreter: :func:`estimate_cpu_run`) or a
        GPU's total (CUDA, per rank), a CUDA request without ``tp`` GPUs, an
        unknown backend or one that cannot run here (the probe's one-line reason), or a rank that
        crashed or timed out (the message names the rank, how far the run got and the rank's last
        stderr line).
    """
    job_start = time.monotonic()
    check_tp(config, tp)
    for flag, value, low in (("--draft-tokens", draft_tokens, 1), ("--batch", batch, 1),
                             ("--iters", iters, 1), ("--warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"{flag} must be an integer >= {low}, got {value!r}")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:  # also false for nan; inf and 1e300 overflow TCPStore's timedelta
        raise UserError(f"--timeout {timeout_s!r}: expected seconds in (0, {MAX_TIMEOUT_S:g}]")
    for flag, value, high in (("--draft-tokens", draft_tokens, MAX_DRAFT_TOKENS), ("--batch", batch, MAX_BATCH)):
        if value > high:
            raise UserError(f"{flag} {value}: expected at most {high}")

    import torch
    import torch.distributed as dist

    from fastverify.profile_record import DTYPES

    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    use_cuda, fallback = _pick_device(device, tp, torch)
    dtype_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    estimate = None if use_cuda else estimate_cpu_run(config, tp=tp, batch=batch, draft_tokens=draft_tokens,
                                                      iters=iters, warmup=warmup, dtype_bytes=dtype_bytes)
    _check_memory(config, tp=tp, batch=batch, draft_tokens=draft_tokens, dtype=dtype, cuda=use_cuda, torch=torch,
                  estimate=estimate, fallback=fallback)
    ar_backend = _pick_backend(backend, use_cuda, tp, dtype, torch)
    warnings: list[str] = []
    if trace_dir is not None and not use_cuda:
        if device == "cpu":
            raise UserError("a trace directory needs --device cuda: a CPU run has no CUDA graph to trace")
        warnings.append("trace_dir ignored: no CUDA run (fewer GPUs than --tp), so no CUDA graph to trace")
        logger.warning("%s", warnings[-1])
        trace_dir = None
    if trace_dir is not None:
        try:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create trace directory {trace_dir}: {err.strerror or err}") from None
    from fastverify.registry import BackendName, backend_info

    dist_backend = (BackendName.nccl if use_cuda else BackendName.gloo).value
    p2p_ok = p2p_note = None
    if use_cuda and tp > 1 and backend_info(ar_backend).needs_p2p:
        from fastverify.backends.base import summarize_p2p
        from fastverify.topo.p2p import check_p2p

        # IPC kernels hang without P2P; only the real read/write check proves it (cached per box).
        p2p_ok, p2p_note = summarize_p2p(check_p2p(pairs=[(a, b) for a in range(tp) for b in range(a + 1, tp)]))
    if estimate is not None and progress:  # after every refusal (each is one line alone), before any rank starts
        late = (f"; that is over --timeout {timeout_s:g} s, so raise --timeout or the run will be stopped"
                if estimate.seconds > timeout_s else "")
        if fallback:
            say(f"live run on CPU + gloo, not CUDA: {fallback}; {estimate.describe(config.name)}{late}")
        elif late:
            say(f"live run on CPU: {estimate.describe(config.name)}{late}")
    logger.info("live verify: model %s, tp %d, T = %d tokens, all-reduce %s over %s on %s",
                config.name, tp, batch * draft_tokens, ar_backend, dist_backend, "cuda" if use_cuda else "cpu")

    # The parent owns the store (port 0: the OS picks a free one), so ranks never race for a port.
    store = dist.TCPStore(_HOST, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    spec = {
        "config": asdict(config),
        "tp": tp,
        "draft_tokens": draft_tokens,
        "batch": batch,
        "iters": iters,
        "warmup": warmup,
        "cuda": use_cuda,
        "port": store.port,
        "timeout_s": float(timeout_s),
        "trace_dir": None if trace_dir is None else str(Path(trace_dir).resolve()),
        "threads": max(1, (os.cpu_count() or 1) // tp),
        "warnings": warnings,
        "dist_backend": dist_backend,
        "backend": ar_backend,
        "dtype": dtype,
        "p2p_ok": p2p_ok,
        "p2p_note": p2p_note,
    }
    try:
        with rank_workdir("fastverify-live-") as workdir:
            spec_path = Path(workdir) / "spec.json"
            spec_path.write_bytes(orjson.dumps(spec))
            watch = _LiveWatch(workdir, tp, warmup=warmup, iters=iters, enabled=progress, job_start=job_start,
                               estimate=estimate)
            try:
                _launch(_worker_argv(str(spec_path)), tp, timeout_s, workdir, _child_env(), watch=watch)
            except UserError:
                # A backend a rank could not build: its probe's line, not "rank r failed".
                refused = sorted(Path(workdir).glob("rank*.unavailable"))
                if refused:
                    raise UserError(refused[0].read_text().strip()) from None
                raise
            return [_load_result(Path(workdir), r, dist_backend) for r in range(tp)]
    finally:
        del store


def _pick_backend(name: str | None, use_cuda: bool, tp: int, dtype: str, torch) -> str:
    """The all-reduce backend's registry name for this run; :class:`UserError` (one line) for an
    unknown name or a backend that cannot run on this run's device, with the probe's reason."""
    from fastverify.registry import BackendName, Role, backend_info

    if name is None:
        return (BackendName.nccl if use_cuda else BackendName.gloo).value
    try:
        info = backend_info(name)
    except ValueError as err:
        raise UserError(f"--backend: {err}") from None
    here = "cuda" if use_cuda else "cpu"
    if tp == 1 and info.role is not Role.baseline:
        raise UserError(f"--backend {info.name.value}: --tp 1 runs no all-reduce, so there is nothing for it to do; "
                        "use --tp >= 2")
    if info.device == here:
        return info.name.value
    if info.role is Role.baseline:
        # torch.distributed's probes need an initialised group; the reason is the device alone.
        other = next(b for b in (BackendName.nccl, BackendName.gloo) if backend_info(b).device == here)
        raise UserError(f"--backend {info.name.value}: runs on {info.device} tensors and this run is on {here}"
                        f"{'' if use_cuda else f' (fewer than {tp} GPUs, or --device cpu)'}; use --backend "
                        f"{other.value}")
    from fastverify.backends.base import ProbeContext, backend_class

    try:
        cls = backend_class(info.name)
    except ImportError as err:
        raise UserError(f"--backend {info.name.value}: its module {info.module} does not import ({err})") from None
    ctx = ProbeContext(world_size=tp, device_type=here, dtype=getattr(torch, dtype),
                       group_backend=(BackendName.nccl if use_cuda else BackendName.gloo).value, single_node=True)
    cap = cls.probe(ctx)
    raise UserError(f"--backend {info.name.value}: cannot run on {here}: "
                    f"{cap.reason if not cap.ok else 'needs ' + info.device + ' tensors'}")


def _available_bytes(cuda: bool, tp: int, torch) -> tuple[int, str] | None:
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


def _check_memory(config: ModelConfig, *, tp: int, batch: int, draft_tokens: int, dtype: str, cuda: bool,
                  torch, estimate: CpuEstimate | None = None, fallback: str | None = None) -> None:
    """Refuse, before any rank starts, a shape whose memory exceeds what this machine has, naming
    the flags. CUDA: :func:`fastverify.live.config.rank_memory` (a lower bound) per GPU. CPU: all
    ranks share the host, so the need is ``estimate.memory_bytes`` (:func:`estimate_cpu_run`: that
    lower bound plus each process's Python and torch) against ``MemAvailable``. ``fallback``: why
    ``--device auto`` chose the CPU, named in the message."""
    have = _available_bytes(cuda, tp, torch)
    if have is None:
        return
    mem = rank_memory(config, tp=tp, batch=batch, draft_tokens=draft_tokens,
                      dtype_bytes=torch.empty((), dtype=getattr(torch, dtype)).element_size(),
                      context_tokens=_context_tokens())
    need = mem.total if cuda or estimate is None else estimate.memory_bytes
    if need > have[0]:
        gib = 2 ** 30
        if cuda:
            who = f"each rank needs at least {mem.total / gib:.1f} GiB"
        else:
            who = (f"{tp} ranks need at least {need / gib:.1f} GiB ({mem.total / gib:.1f} each, "
                   f"+ {CPU_PROCESS_BYTES / 2 ** 20:.0f} MiB per process for Python and torch)")
        physical = _physical_bytes()
        of = f" (of {physical / gib:.1f} GiB physical)" if not cuda and physical else ""
        where = f" on CPU ({fallback})" if fallback else ""
        raise UserError(f"--batch {batch} x --draft-tokens {draft_tokens} (T = {batch * draft_tokens} tokens) of "
                        f"{config.name} at --tp {tp}{where}: {who} (weights and KV context {mem.setup / gib:.1f}, "
                        f"largest temporary {mem.transient / gib:.1f}); this machine has {have[0] / gib:.1f} GiB "
                        f"{have[1]}{of}; lower --batch or --draft-tokens"
                        f"{'' if cuda or tp == 1 else ', or --tp (each CPU rank is a process of its own)'}")


def _physical_bytes() -> int | None:
    """The host's physical memory in bytes (``SC_PHYS_PAGES`` × ``SC_PAGE_SIZE``), None when unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _context_tokens() -> int:
    from fastverify.live.forward import DEFAULT_CONTEXT_TOKENS

    return DEFAULT_CONTEXT_TOKENS


def _pick_device(device: str, tp: int, torch) -> tuple[bool, str | None]:
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
        why = ("this torch has no CUDA (a CPU-only build)" if torch.version.cuda is None
               else "no CUDA GPU found (torch.cuda.is_available() is False)")
    else:
        why = f"only {count} GPU{'' if count == 1 else 's'} for --tp {tp}"
    return False, why


# ---- what a CPU run will cost ---------------------------------------------------------------------

# Calibration of estimate_cpu_run (see its docstring for the runs these come from).
CPU_PROCESS_BYTES = 192 * 2 ** 20
"""Memory of one rank process beyond its tensors (Python, torch, gloo), bytes: measured PSS."""
CPU_PARENT_BYTES = 320 * 2 ** 20
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
        Wall time of :func:`run_live`, start-up included.
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
        return (f"estimated {_seconds_text(self.seconds)} and {_bytes_text(self.memory_bytes)} for {model} "
                f"at --tp {self.tp} ({self.tp} rank{'s' if self.tp > 1 else ''} on {self.cores} "
                f"core{'s' if self.cores > 1 else ''}: {_seconds_text(self.start_s + self.build_s)} to start and "
                f"build, {self.forwards} forward{'s' if self.forwards > 1 else ''} of "
                f"{_seconds_text(self.forward_s)})")


def _seconds_text(s: float) -> str:
    if s < 0.1:
        return f"{s * 1e3:.0f} ms"
    if s < 10:
        return f"{s:.1f} s"
    if s < 600:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min"


def _bytes_text(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def forward_work(config: ModelConfig, *, tp: int, batch: int, draft_tokens: int, dtype_bytes: int,
                 context_tokens: int) -> tuple[int, int]:
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


def estimate_cpu_run(config: ModelConfig, *, tp: int, batch: int, draft_tokens: int, iters: int, warmup: int,
                     dtype_bytes: int = 2, cores: int | None = None) -> CpuEstimate:
    """Expected wall time and memory of :func:`run_live` on CPU + gloo: a simple model of the run,
    calibrated on one machine, to tell a user at once what a CPU run will cost. An estimate:
    another CPU can be several times faster or slower.

    Model (``P`` = cores the ranks use together = ``min(cores, tp × max(1, cpu_count // tp))``,
    each rank running ``cpu_count // tp`` torch threads as :func:`run_live` sets them):

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
    (``/usr/bin/time``; about 2 s more than :func:`run_live`, for the CLI's imports and the
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
        As for :func:`run_live`.
    dtype_bytes : int
        Bytes per element (2 for bfloat16).
    cores : int or None
        Cores the ranks share; None: this process's CPU affinity.

    Returns
    -------
    CpuEstimate
    """
    cores = _cores() if cores is None else max(1, int(cores))
    mem = rank_memory(config, tp=tp, batch=batch, draft_tokens=draft_tokens, dtype_bytes=dtype_bytes,
                      context_tokens=_context_tokens())
    threads = max(1, (os.cpu_count() or cores) // tp)
    parallel = max(1, min(cores, tp * threads))
    start = CPU_START_S * tp / min(tp, cores)
    build = mem.setup / dtype_bytes * tp / (CPU_FILL_PER_S * parallel)
    read, flops = forward_work(config, tp=tp, batch=batch, draft_tokens=draft_tokens, dtype_bytes=dtype_bytes,
                               context_tokens=_context_tokens())
    collectives = 2 + 2 * config.num_layers if tp > 1 else 0
    forward = tp * (read / CPU_READ_BYTES_PER_S + flops / CPU_FLOPS_PER_S) / parallel + collectives * CPU_COLLECTIVE_S
    forwards = warmup + iters
    return CpuEstimate(seconds=CPU_PARENT_S + start + build + forwards * forward,
                       memory_bytes=tp * (mem.total + CPU_PROCESS_BYTES) + CPU_PARENT_BYTES,
                       start_s=start, build_s=build, forward_s=forward, forwards=forwards, cores=cores, tp=tp)


# ---- parent side: start, watch, collect ---------------------------------------------------------

# A rank is a fresh interpreter running this module's _worker_main. It is started with ``-c`` rather
# than through multiprocessing's spawn, which re-imports the caller's ``__main__`` in every child (a
# script without an ``if __name__ == "__main__"`` guard would start ranks recursively), and which
# leaves a child's import-time errors on the parent's stderr instead of the rank's file.
_WORKER_CODE = "import sys; from fastverify.live.runner import _worker_main; _worker_main(sys.argv[1], int(sys.argv[2]))"


def _worker_argv(spec_path: str) -> Callable[[int], list[str]]:
    return lambda rank: [sys.executable, "-c", _WORKER_CODE, spec_path, str(rank)]


def _launch(argv: Callable[[int], list[str]], tp: int, timeout_s: float, workdir: str,
            env: dict[str, str] | None = None, watch: _LiveWatch | None = None) -> None:
    """Start ``tp`` processes ``argv(rank)`` (stderr to ``workdir/rank<r>.stderr``) and wait for all to exit 0.

    The ranks run under :class:`fastverify.procs.RankGroup`, the one launcher and kill rule. On the
    first failure (the earliest by the time the rank recorded in ``rank<r>.failed``, else by when
    the exit was seen) or at the deadline, every rank's process group is stopped (SIGTERM, then
    SIGKILL) and a one-line :class:`UserError` names the rank, the reason and the last line of its
    stderr (and, with a ``watch``, how far the run had got). While it waits it calls
    ``watch.poll()`` (progress lines) every :data:`_WATCH_EVERY_S` seconds.
    """
    deadline = time.monotonic() + timeout_s
    next_watch = 0.0
    with RankGroup(workdir, env=env) as ranks:
        ranks.start(argv(rank) for rank in range(tp))
        while True:
            seen_exit = ranks.poll()
            failed = [r for r in seen_exit if ranks.returncode(r) != 0]
            if failed:
                rank = min(failed, key=lambda r: (_failure_time(workdir, r, seen_exit[r]), r))
                raise UserError(f"live rank {rank} failed ({_exit_reason(ranks.returncode(rank))}): "
                                f"{_last_stderr_line(workdir, rank)}")
            if len(seen_exit) == tp:
                if watch is not None:
                    watch.poll()  # the last forward's line
                return
            now = time.monotonic()
            if watch is not None and now >= next_watch:
                watch.poll()
                next_watch = now + _WATCH_EVERY_S
            if now >= deadline:
                rank = min(r for r in range(tp) if r not in seen_exit)
                got = "" if watch is None else f"{watch.reached()}; "
                raise UserError(f"live rank {rank} did not finish within {timeout_s:g} s "
                                f"({got}last stderr line: {_last_stderr_line(workdir, rank)})")
            time.sleep(0.02)


_WATCH_EVERY_S = 0.25
"""Seconds between two reads of the ranks' progress files by the waiting parent."""


HEARTBEAT_S = 5.0
"""Longest a live run's progress stays silent once it has begun printing (s)."""


class _LiveWatch:
    """The parent's view of a live run's progress, read from the ranks' ``rank<r>.progress`` files.

    A rank appends one line per stage (``up`` once it has joined the process group, ``built
    <bytes>`` once its weights are allocated; rank 0 also ``forward <k>`` after its k-th forward,
    warm-up ones first, and ``trace`` before the CUDA trace export). :meth:`poll` turns new lines
    into :class:`~fastverify.progress.Progress` lines; :meth:`reached` says how far the run got,
    for a timeout message."""

    def __init__(self, workdir: str | Path, tp: int, *, warmup: int, iters: int, enabled: bool = True,
                 job_start: float | None = None, estimate: CpuEstimate | None = None, stream=None) -> None:
        self.workdir = Path(workdir)
        self.stream = stream  # the lines' stream (None: stderr)
        self.tp, self.warmup, self.iters = tp, warmup, iters
        self.enabled = enabled
        self.job_start = time.monotonic() if job_start is None else job_start
        self.estimate = estimate
        self._sizes = [-1] * tp
        self.stages: list[list[str]] = [[] for _ in range(tp)]
        self.up = self.built = self.forwards = 0
        self.weight_bytes = 0
        self.tracing = False
        # Ranks start and build side by side: no time left from the first one's pace.
        self._up = Progress("live run: ranks started", tp, enabled=enabled, job_start=self.job_start, eta=False,
                            stream=stream)
        self._built = Progress("live run: weights built", tp, enabled=enabled, job_start=self.job_start, eta=False,
                               stream=stream)
        self._fwd: Progress | None = None
        self._last_line: float | None = None

    def _read(self) -> None:
        for rank in range(self.tp):
            path = self.workdir / f"rank{rank}.progress"
            try:
                size = path.stat().st_size
                if size == self._sizes[rank]:
                    continue
                text = path.read_text(errors="replace")
            except OSError:
                continue
            self._sizes[rank] = size
            self.stages[rank] = text.split("\n")[:-1]  # complete lines only

    def _count(self) -> tuple[int, int, int]:
        """Ranks up, ranks built, and rank 0's forwards done, from the files as they are now."""
        self._read()
        up = sum("up" in lines for lines in self.stages)
        built_lines = [next((ln for ln in lines if ln.startswith("built ")), None) for lines in self.stages]
        built = sum(b is not None for b in built_lines)
        if built and not self.weight_bytes:
            self.weight_bytes = int(next(b for b in built_lines if b is not None).split()[1])
        forwards = max((int(ln.split()[1]) for ln in self.stages[0] if ln.startswith("forward ")), default=0)
        self.tracing = "trace" in self.stages[0]
        return up, built, forwards

    def poll(self) -> None:
        """Read the progress files and print the lines that are due; with nothing new for
        :data:`HEARTBEAT_S`, one line saying what is running (a CPU forward of a large model takes
        15 s and more, and no command may stay silent for over 10 s)."""
        up, built, forwards = self._count()
        printed = False
        if up > self.up:
            self.up = up
            printed |= self._up.update(up)
        if built > self.built:
            self.built = built
            printed |= self._built.update(built, f"{_bytes_text(self.weight_bytes)} per rank")
        if built == self.tp and self._fwd is None:
            # The forwards begin once every rank is built: the time left comes from their own rate.
            self._fwd = Progress("live run: forwards", self.warmup + self.iters, enabled=self.enabled,
                                 job_start=self.job_start, stream=self.stream)
        if forwards > self.forwards and self._fwd is not None:
            self.forwards = forwards
            printed |= self._fwd.update(forwards, self._which(forwards))
        now = time.monotonic()
        if printed or self._last_line is None:
            self._last_line = now
        elif self.enabled and now - self._last_line >= HEARTBEAT_S and now - self.job_start >= default_after_s():
            self._last_line = now
            say(f"live run: {self._running(up, built, forwards)}, {now - self.job_start:.1f} s elapsed",
                stream=self.stream)

    def _running(self, up: int, built: int, forwards: int) -> str:
        if up < self.tp:
            return f"starting ranks ({up}/{self.tp} up)"
        if built < self.tp:
            return f"building weights ({built}/{self.tp} ranks done)"
        if forwards < self.warmup + self.iters:
            return f"forward {forwards + 1}/{self.warmup + self.iters} running ({self._which(forwards + 1)})"
        return "exporting the CUDA trace" if self.tracing else "collecting the ranks' results"

    def _which(self, k: int) -> str:
        return f"warm-up {k}/{self.warmup}" if k <= self.warmup else f"timed {k - self.warmup}/{self.iters}"

    def reached(self) -> str:
        """How far the run got, e.g. ``"reached: 2/2 ranks started, 2/2 built, forward 3/7 (timed
        1/5)"``, plus the CPU estimate when there is one (for a timeout message)."""
        up, built, forwards = self._count()
        parts = [f"{up}/{self.tp} ranks started"]
        if up:
            parts.append(f"{built}/{self.tp} built")
        if built == self.tp:
            parts.append(f"forward {forwards}/{self.warmup + self.iters}"
                         + (f" ({self._which(forwards)})" if forwards else ""))
        if self.tracing:
            parts.append("exporting the CUDA trace")
        est = "" if self.estimate is None else f"; estimated {self.estimate.seconds:.0f} s for the whole run"
        return "reached: " + ", ".join(parts) + est


def _load_result(workdir: Path, rank: int, backend: str) -> RankEvents:
    path = workdir / f"rank{rank}.json"
    try:
        doc = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as err:
        raise UserError(f"live rank {rank} exited without a result ({path.name}: {err})") from None
    rows = [(name, EventClass(cls), start, dur, nbytes) for name, cls, start, dur, nbytes in doc["rows"]]
    steps = [Step(name, start, end) for name, start, end in doc["steps"]]
    return RankEvents.from_rows(rank, f"live:{backend}", rows, steps=steps, labels=doc["labels"], meta=doc["meta"])


# ---- rank side ------------------------------------------------------------------------------------


def _worker_main(spec_path: str, rank: int) -> None:
    """Entry of a rank process: run it, write ``rank<r>.json`` next to the spec; on any error print
    the traceback to stderr (the rank's file), record the failure time and exit 1."""
    workdir = Path(spec_path).parent
    try:
        spec = orjson.loads(Path(spec_path).read_bytes())
        result = _run_rank(rank, spec, workdir)
        tmp = workdir / f"rank{rank}.json.tmp"
        tmp.write_bytes(orjson.dumps(result))
        os.replace(tmp, workdir / f"rank{rank}.json")
    except BaseException:  # noqa: BLE001 - report everything, KeyboardInterrupt included, to the parent
        (workdir / f"rank{rank}.failed").write_text(str(time.monotonic_ns()))
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _mark(workdir: Path, rank: int, stage: str) -> None:
    """Append one line ``stage`` to ``rank<r>.progress`` (read by the parent's :class:`_LiveWatch`).
    One ``write`` of a short line per stage, so a reader sees whole lines or none of the new one."""
    with open(workdir / f"rank{rank}.progress", "a", encoding="utf-8") as f:
        f.write(stage + "\n")


class _WallClockRecorder:
    """CPU: regions bracketed by ``perf_counter_ns``; rows ``[name, cls, start_ns, dur_ns, bytes]``."""

    def __init__(self) -> None:
        self.rows: list[list] = []
        self.labels: list[str] = []

    def region(self, name, cls, label, msg_bytes):
        return _WallRegion(self, name, cls, label, msg_bytes)


class _WallRegion:
    __slots__ = ("rec", "name", "cls", "label", "msg_bytes", "t0")

    def __init__(self, rec, name, cls, label, msg_bytes):
        self.rec, self.name, self.cls, self.label, self.msg_bytes = rec, name, cls, label, msg_bytes

    def __enter__(self):
        self.t0 = time.perf_counter_ns()

    def __exit__(self, *exc):
        t1 = time.perf_counter_ns()
        self.rec.rows.append([self.name, self.cls.value, self.t0, t1 - self.t0, self.msg_bytes])
        self.rec.labels.append(self.label)
        return False


class _CudaEventRecorder:
    """CUDA: regions bracketed by timing events on the current stream, resolved after a sync."""

    def __init__(self, torch) -> None:
        self.torch = torch
        self.pending: list[tuple] = []

    def region(self, name, cls, label, msg_bytes):
        return _CudaRegion(self, name, cls, label, msg_bytes)

    def event(self):
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def resolve(self, base_event, base_ns: int) -> tuple[list[list], list[str]]:
        """Rows in host ns: ``base_ns`` + elapsed ms since ``base_event`` × 1e6. Call after a device sync."""
        rows, labels = [], []
        for name, cls, label, nbytes, e0, e1 in self.pending:
            start = base_ns + round(base_event.elapsed_time(e0) * 1e6)
            rows.append([name, cls.value, start, round(e0.elapsed_time(e1) * 1e6), nbytes])
            labels.append(label)
        return rows, labels


class _CudaRegion:
    __slots__ = ("rec", "name", "cls", "label", "msg_bytes", "e0")

    def __init__(self, rec, name, cls, label, msg_bytes):
        self.rec, self.name, self.cls, self.label, self.msg_bytes = rec, name, cls, label, msg_bytes

    def __enter__(self):
        self.e0 = self.rec.event()

    def __exit__(self, *exc):
        self.rec.pending.append((self.name, self.cls, self.label, self.msg_bytes, self.e0, self.rec.event()))
        return False


def _make_allreduce(rank: int, spec: dict, device, dtype, tokens: int, hidden: int, workdir: Path, torch, dist):
    """Build the run's all-reduce backend on the default group, or None at ``tp == 1``.

    Every rank probes first and the ranks vote (a MAX all-reduce of a flag) before any of them
    constructs: construction is collective for the IPC backends, so one rank must never build it
    alone. A rank whose probe fails writes ``rank<r>.unavailable`` (its one-line reason, read by
    the parent) before the vote, so the file exists once any rank knows the run is off."""
    if spec["tp"] == 1:
        return None
    from fastverify.backends.base import ProbeContext, make_backend, probe

    ctx = ProbeContext.detect(None, device=device, dtype=dtype, p2p=spec["p2p_ok"], single_node=True)
    if spec["p2p_note"] and ctx.p2p_ok is not None:
        ctx = dataclasses.replace(ctx, p2p_note=spec["p2p_note"])
    cap = probe(spec["backend"], ctx)
    if not cap.ok:
        (workdir / f"rank{rank}.unavailable").write_text(
            f"--backend {spec['backend']}: unavailable on rank {rank}: {cap.reason}")
    flag = torch.tensor([0 if cap.ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()):
        raise UserError(f"--backend {spec['backend']}: unavailable on {'this' if not cap.ok else 'another'} rank")
    return make_backend(spec["backend"], None, device=device, dtype=dtype, max_numel=tokens * hidden,
                        hidden=hidden, context=ctx)


def _run_rank(rank: int, spec: dict, workdir: Path) -> dict:
    import torch
    import torch.distributed as dist

    from fastverify.live.forward import DEFAULT_CONTEXT_TOKENS, TPVerifyModel

    tp, cuda = spec["tp"], spec["cuda"]
    timeout = timedelta(seconds=spec["timeout_s"])
    device = rank_device(rank, cuda, spec["threads"])
    store = dist.TCPStore(_HOST, spec["port"], None, False, timeout=timeout)
    dist_backend = spec["dist_backend"]
    dist.init_process_group(dist_backend, store=store, rank=rank, world_size=tp, timeout=timeout)
    _mark(workdir, rank, "up")
    # No teardown on error: the process exits at once (os._exit), and destroying a communicator with
    # work in flight can block and hide the error behind the timeout.
    config = ModelConfig(**spec["config"])
    dtype = getattr(torch, spec["dtype"])
    tokens = spec["batch"] * spec["draft_tokens"]
    ar = _make_allreduce(rank, spec, device, dtype, tokens, config.hidden_size, workdir, torch, dist)
    if ar is not None:
        ar.prepare([(tokens, config.hidden_size)])  # before any forward, so before graph capture
    model = TPVerifyModel(config, tp=tp, rank=rank, batch=spec["batch"], draft_tokens=spec["draft_tokens"],
                          device=device, dtype=dtype, context_tokens=DEFAULT_CONTEXT_TOKENS, backend=ar)
    _mark(workdir, rank, f"built {model.weight_bytes()}")
    warmup = spec["warmup"]

    def forward_done(k: int) -> None:  # rank 0 alone reports forwards: they run in lockstep
        if rank == 0:
            _mark(workdir, rank, f"forward {k}")

    for k in range(warmup):
        model.forward()
        forward_done(k + 1)
    if cuda:
        torch.cuda.synchronize()
    rows, labels, steps = _time_forwards(model, spec["iters"], rank, cuda, torch, dist,
                                         done=lambda i: forward_done(warmup + i + 1))
    meta = {
        "timing": "cuda_events" if cuda else "cpu_wall_clock",
        "device": torch.cuda.get_device_name(rank) if cuda else "cpu",
        "dist_backend": dist_backend,
        "allreduce_backend": spec["backend"],
        "world_size": tp,
        "model": config.name,
        "model_source": config.source,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "draft_tokens": spec["draft_tokens"],
        "batch": spec["batch"],
        "tokens": model.tokens,
        "warmup": spec["warmup"],
        "iters": spec["iters"],
        "dtype": spec["dtype"],
        "experts_allocated": model.experts_allocated,
        "experts_used_max": max(model.experts_used, default=0),
        "context_tokens": model.context_tokens,
        "allreduce_bytes": model.allreduce_bytes,
        "allgather_bytes": model.allgather_bytes,
        "weight_bytes_per_rank": model.weight_bytes(),
        "torch_version": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "warnings": list(spec["warnings"]),
    }
    if cuda:
        meta["nccl_version"] = _nccl_version(torch)
        if spec["trace_dir"] is not None:
            _mark(workdir, rank, "trace")
            meta["trace_file"] = _export_trace(model, rank, spec["trace_dir"], torch, dist)
    if ar is not None:
        meta["allreduce_paths"] = dict(ar.path_counts)
        ar.close()  # collective for the IPC backends: every rank reaches it, before the group goes
    dist.destroy_process_group()
    return {"rows": rows, "labels": labels, "steps": steps, "meta": meta}


def _time_forwards(model, iters: int, rank: int, cuda: bool, torch, dist,
                   done: Callable[[int], None] | None = None) -> tuple[list[list], list[str], list[list]]:
    """Run ``iters`` timed forwards, each after a barrier. Returns rows ``[name, cls, start_ns, dur_ns,
    msg_bytes]``, their labels, and steps ``[name, start_ns, end_ns]`` (clocks: module docstring).
    ``done(i)`` is called after timed forward ``i`` (0-based), outside its timed window."""
    rows: list[list] = []
    labels: list[str] = []
    steps: list[list] = []
    for i in range(iters):
        if cuda:
            torch.cuda.synchronize()
            dist.barrier(device_ids=[rank])
            torch.cuda.synchronize()
            rec = _CudaEventRecorder(torch)
            base_ns = time.perf_counter_ns()
            base = rec.event()
            model.forward(rec)
            end = rec.event()
            torch.cuda.synchronize()
            r, lab = rec.resolve(base, base_ns)
            step_end = base_ns + round(base.elapsed_time(end) * 1e6)
            steps.append([f"verify#{i}", base_ns, max(step_end, r[-1][2] + r[-1][3])])
        else:
            dist.barrier()
            rec = _WallClockRecorder()
            start = time.perf_counter_ns()
            model.forward(rec)
            steps.append([f"verify#{i}", start, time.perf_counter_ns()])
            r, lab = rec.rows, rec.labels
        rows += r
        labels += lab
        if done is not None:
            done(i)
    return rows, labels, steps


def _nccl_version(torch) -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - optional fact; torch built without NCCL raises
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _export_trace(model, rank: int, trace_dir: str, torch, dist) -> str:
    """Capture one forward in a CUDA graph, replay it under ``torch.profiler`` and write a gzipped
    Chrome trace ``verify-TP-<rank>.trace.json.gz``. Returns its path.

    The graph mirrors SGLang's verify path (``DecodeCudaGraphRunner`` replays TARGET_VERIFY), so the
    trace shows what a served verify step looks like: kernels tied to one ``cudaGraphLaunch``, NCCL
    kernels without ``record_param_comms``. Each replay is one ``ProfilerStep#<n>`` (a schedule is
    needed for the profiler to emit those markers).
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    init_graphs = getattr(getattr(torch.profiler, "_utils", None), "_init_for_cuda_graphs", None)
    if init_graphs is not None:
        # Graphs captured before the profiler's first use may be missing from traces (pytorch PR #100441).
        init_graphs()
    from fastverify.cudagraph import capture_cuda_graph

    graph, _ = capture_cuda_graph(model.forward, warmup=2)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[rank])
    path = Path(trace_dir) / f"verify-TP-{rank}.trace.json.gz"
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=0, warmup=1, active=TRACE_REPLAYS, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
    ) as prof:
        for _ in range(1 + TRACE_REPLAYS):
            graph.replay()
            torch.cuda.synchronize()
            prof.step()
    del graph
    return str(path)
