"""The verify step's collectives, as the tuner needs them: message sizes, counts per step, and the
measured compute / verify time per step where a profile has it.

* :func:`workload_from_model`: shapes only, from a preset or ``config.json`` (the reader of
  ``fastverify profile --model``). One verify forward at tensor parallelism ``tp`` on ``T = batch ×
  draft_tokens`` tokens runs SGLang's TP layers (``fastverify/live/forward.py``): one all-reduce
  after the vocab-parallel embedding, then per layer one after attention (``o_proj``) and one
  after the MLP / MoE, each of ``T × hidden`` elements, so ``1 + 2 × num_layers`` all-reduces of
  ``T × hidden × 2`` bytes (bf16; 123 × 57,344 B for Kimi-K2 at T = 4). The logits all-gather
  (column-parallel ``lm_head``) is kept apart in :attr:`Workload.allgather_bytes`: no all-reduce
  setting or backend changes it.
* :func:`workload_from_profile`: what a ``fastverify profile`` JSON measured: all-reduces per step
  and their sizes, compute and window time per step, and their clock.

Nothing here imports torch or numpy: sweep workers import this module.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from fastverify.bounds import MAX_COUNT, MAX_MSG_BYTES, implausible_time_us
from fastverify.errors import UserError
from fastverify.inputs import read_bytes
from fastverify.live.config import ModelConfig, check_tp
from fastverify.profile.record import (
    SCHEMA_VERSION,
    decode_profile,
    read_profile_view,  # torch- and numpy-free
)
from fastverify.tune.trial import DTYPE_BYTES as _ELEMENT_BYTES

DTYPE = "bfloat16"
DTYPE_BYTES = 2

# Clocks of a profile (its ``timing.clock``) that time the GPU; ``cpu_wall_clock`` does not.
GPU_CLOCKS = frozenset({"trace", "cuda_events"})

UNKNOWN_SIZE_MESSAGE = (
    "profile has all-reduces of unknown size (CUDA-graph trace); use --model/--tp/--draft-tokens/--batch"
)


@dataclass(frozen=True)
class Workload:
    """The all-reduces of one verify step, and what was measured about the step.

    Attributes
    ----------
    msg_sizes : tuple of (msg_bytes, count)
        All-reduce buffer size in bytes and how many all-reduces of that size one verify step runs,
        sorted by size.
    dtype : str
        Element type of the all-reduces: a profile's recorded ``shapes.dtype``; ``"bfloat16"``
        for a model workload, and assumed (with a note) for a profile that does not record it.
    hidden, tokens : int | None
        Hidden size and tokens per verify step (``batch × draft_tokens``); ``None`` when the
        source does not say (a trace profile).
    draft_tokens, batch : int | None
        Tokens per request (SGLang's ``speculative_num_draft_tokens``) and requests of the verify
        step, as the source records them (a live profile's ``shapes``, the model workload's
        arguments); ``None`` when it does not say (a trace profile).
    tp : int
        Ranks of the all-reduce (tensor parallelism).
    compute_us, verify_us : float | None
        Per step, measured: median over steps (then over ranks) of a profile's ``compute_us`` and
        ``window_us``; ``None`` for a model workload (nothing measured).
    accept_length : float | None
        Accept length A, when the source records one.
    source : str
        Where the workload came from, in words (``"model kimi-k2 (…)"`` or the profile path).
    clock : str | None
        Where the times came from: a profile's ``timing.clock`` (``trace``, ``cuda_events``,
        ``cpu_wall_clock``); ``None`` when there are no times.
    allreduce_us : float | None
        Per step, measured: median of a profile's ``step_median.allreduce_us`` (union of all-reduce
        kernel time); ``None`` for a model workload.
    allgather_bytes : int | None
        Per-rank input of the logits all-gather (``T × vocab_padded / tp × 2``), model workloads
        only; not an all-reduce, reported for completeness.
    allreduce_us_by_size : tuple of (msg_bytes, median_us)
        Measured median time of ONE all-reduce call per message size (µs), from a version-2
        profile's ``allreduce_by_msg_size[].median_us``; empty when nothing was measured.
    allreduce_wait_us, allreduce_transfer_us : float | None
        Per verify step, measured: the all-reduce time split into waiting for the slowest rank and
        the transfer itself (µs). The profile's cross-rank split (``ranks[].allreduce_wait_us`` /
        ``allreduce_transfer_us``, window totals) gives the wait fraction (median over ranks),
        which is applied to :attr:`allreduce_us`. ``None`` with one rank or without the split.
    profile_backend : str | None
        The all-reduce backend a live profile ran with (registry name), else ``None``.
    notes : tuple of str
        Assumptions made while building the workload.
    """

    msg_sizes: tuple[tuple[int, int], ...]
    dtype: str = DTYPE
    hidden: int | None = None
    tokens: int | None = None
    tp: int = 1
    compute_us: float | None = None
    verify_us: float | None = None
    accept_length: float | None = None
    source: str = ""
    clock: str | None = None
    allreduce_us: float | None = None
    allgather_bytes: int | None = None
    notes: tuple[str, ...] = field(default=())
    allreduce_us_by_size: tuple[tuple[int, float], ...] = ()
    allreduce_wait_us: float | None = None
    allreduce_transfer_us: float | None = None
    profile_backend: str | None = None
    draft_tokens: int | None = None
    batch: int | None = None

    def __post_init__(self) -> None:
        sizes = tuple(sorted((int(b), int(c)) for b, c in self.msg_sizes))
        for b, c in sizes:
            if not (0 <= b <= MAX_MSG_BYTES and 1 <= c <= MAX_COUNT):
                raise ValueError(
                    f"Workload.msg_sizes: ({b}, {c}): need msg_bytes in [0, {MAX_MSG_BYTES}] (1 TiB) "
                    f"and count in [1, {MAX_COUNT}] (fastverify/bounds.py)"
                )
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"Workload.tp: {self.tp!r}: need an int >= 1")
        for name in ("compute_us", "verify_us", "allreduce_us", "allreduce_wait_us", "allreduce_transfer_us"):
            v = getattr(self, name)
            if v is not None and (why := implausible_time_us(v)):
                raise ValueError(f"Workload.{name}: {why}")
        if len({b for b, _ in sizes}) != len(sizes):
            raise ValueError(f"Workload.msg_sizes: a size appears twice in {sizes}")
        object.__setattr__(self, "msg_sizes", sizes)
        object.__setattr__(self, "notes", tuple(self.notes))
        if None not in (self.tokens, self.draft_tokens, self.batch) and self.tokens != self.draft_tokens * self.batch:
            raise ValueError(f"Workload: tokens {self.tokens} != draft_tokens {self.draft_tokens} x batch {self.batch}")

    @property
    def allreduce_count(self) -> int:
        """All-reduces per verify step."""
        return sum(c for _, c in self.msg_sizes)

    @property
    def allreduce_bytes(self) -> int:
        """Bytes all-reduced per verify step (sum of buffer sizes)."""
        return sum(b * c for b, c in self.msg_sizes)

    @property
    def measured_on_gpu(self) -> bool:
        """True when :attr:`compute_us` / :attr:`verify_us` are GPU timings."""
        return self.clock in GPU_CLOCKS

    def as_dict(self) -> dict:
        return {
            "msg_sizes": [{"msg_bytes": b, "count": c} for b, c in self.msg_sizes],
            "allreduce_count": self.allreduce_count,
            "dtype": self.dtype,
            "hidden": self.hidden,
            "tokens": self.tokens,
            "tp": self.tp,
            "compute_us": self.compute_us,
            "verify_us": self.verify_us,
            "accept_length": self.accept_length,
            "source": self.source,
            "clock": self.clock,
            "allreduce_us": self.allreduce_us,
            "allgather_bytes": self.allgather_bytes,
            "notes": list(self.notes),
            "allreduce_us_by_size": [{"msg_bytes": b, "median_us": t} for b, t in self.allreduce_us_by_size],
            "allreduce_wait_us": self.allreduce_wait_us,
            "allreduce_transfer_us": self.allreduce_transfer_us,
            "profile_backend": self.profile_backend,
            "draft_tokens": self.draft_tokens,
            "batch": self.batch,
        }


def _positive_int(value: object, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{flag} must be a positive integer, got {value!r}")
    return value


def workload_from_model(config: ModelConfig, *, tp: int, draft_tokens: int, batch: int) -> Workload:
    """The verify step of ``config`` at ``tp`` ranks on ``batch × draft_tokens`` tokens.

    Returns
    -------
    Workload
        ``1 + 2 × num_layers`` all-reduces of ``T × hidden × 2`` bytes; the logits all-gather in
        ``allgather_bytes``; no times (``clock=None``).

    Raises
    ------
    UserError
        ``tp``, ``draft_tokens`` or ``batch`` not a positive integer; ``tp == 1`` (no collective
        runs, nothing to tune); ``tp`` does not split the model (:func:`check_tp`).
    """
    tp = _positive_int(tp, "--tp")
    draft_tokens = _positive_int(draft_tokens, "--draft-tokens")
    batch = _positive_int(batch, "--batch")
    if tp == 1:
        raise UserError("--tp 1: a single rank runs no all-reduce; nothing to tune (use --tp >= 2)")
    check_tp(config, tp)
    tokens = batch * draft_tokens
    msg = tokens * config.hidden_size * DTYPE_BYTES
    count = 1 + 2 * config.num_layers
    return Workload(
        msg_sizes=((msg, count),),
        dtype=DTYPE,
        hidden=config.hidden_size,
        tokens=tokens,
        tp=tp,
        draft_tokens=draft_tokens,
        batch=batch,
        source=f"model {config.name} ({config.source}), tp {tp}, {draft_tokens} draft tokens x batch {batch}",
        clock=None,
        allgather_bytes=tokens * (config.vocab_padded // tp) * DTYPE_BYTES,
        notes=(
            f"shapes only: 1 embedding all-reduce + 2 per layer x {config.num_layers} layers of "
            f"{tokens} x {config.hidden_size} x {DTYPE_BYTES} B ({DTYPE}); no times measured",
            "the logits all-gather is not an all-reduce and is left out of the all-reduce time",
        ),
    )


# --- profiles ------------------------------------------------------------------------------------


def workload_from_profile(path: str | Path) -> Workload:
    """The verify step measured by a ``fastverify profile`` JSON (schema ``fastverify.profile``,
    decoded by the typed record :mod:`fastverify.profile.record`; versions 1 and 2).

    * all-reduces per step: the median over ranks of ``ranks[].step_median.allreduce_count``;
    * their sizes: ``allreduce_by_msg_size`` (counted over all ranks and steps), scaled to that
      per-step count and rounded (the largest share absorbs the rounding);
    * compute / all-reduce / verify time per step: the median over ranks of ``step_median.compute_us``
      / ``allreduce_us`` / ``window_us``, with the clock of ``timing.clock``;
    * ``tp``: ``world_size`` (the number of ranks recorded when it is missing); at least 2;
    * ``dtype``, ``hidden``, ``tokens``: as the profile's ``shapes`` record them (version 2). Nothing
      is re-derived from message bytes: where the profile does not say (a trace, a version-1 file),
      ``hidden`` and ``tokens`` stay None (so the sweep times plain all-reduces) and the dtype is
      assumed bf16, with a note saying so.

    Raises
    ------
    UserError
        One line naming the file: unreadable, not JSON, not schema ``fastverify.profile``, a version
        this fastverify does not read, a missing or mistyped field, no all-reduce at all, an
        all-reduce of unknown size (a CUDA-graph replay trace: :data:`UNKNOWN_SIZE_MESSAGE`), a
        recorded hidden size / dtype that the message sizes contradict, a size, count or time past
        the plausibility bounds of :mod:`fastverify.bounds` (refused by the decoder), or a world
        size below 2 (one rank runs no all-reduce).
    """
    path = Path(path)
    view = read_profile_view(path)  # refuses sizes, counts and times past fastverify/bounds.py
    tp = _profile_tp(path, view)
    notes: list[str] = []
    msg_sizes = _per_step_sizes(path, view, notes)
    clock = view.clock
    compute_us = statistics.median(view.step_compute_us) if view.step_compute_us else None
    allreduce_us = statistics.median(view.step_allreduce_us) if view.step_allreduce_us else None
    verify_us = statistics.median(view.step_window_us) if view.step_window_us else None
    if clock == "cpu_wall_clock":
        notes.append("times are CPU wall clock over gloo (timing.clock = cpu_wall_clock): not GPU timings")
    elif clock not in GPU_CLOCKS:
        notes.append(f"unknown timing.clock {clock!r}: times treated as not measured on the GPU")
    shapes = view.shapes
    dtype = _profile_dtype(path, view, msg_sizes, notes)
    if view.backend:
        notes.append(f"profiled with all-reduce backend {view.backend}")
    accept = view.accept_length if view.accept_length is not None and view.accept_length >= 1 else None
    by_size, wait_us, transfer_us = _measured_split(path, view.version, allreduce_us)
    return Workload(
        msg_sizes=msg_sizes,
        dtype=dtype,
        hidden=shapes.hidden,
        tokens=shapes.tokens,
        tp=tp,
        compute_us=compute_us,
        verify_us=verify_us,
        accept_length=accept,
        source=f"profile {path} ({view.kind})",
        clock=clock,
        allreduce_us=allreduce_us,
        notes=tuple(notes),
        allreduce_us_by_size=by_size,
        allreduce_wait_us=wait_us,
        allreduce_transfer_us=transfer_us,
        profile_backend=view.backend,
        draft_tokens=shapes.draft_tokens,
        batch=shapes.batch,
    )


def _profile_tp(path: Path, view) -> int:
    """The profile's ``world_size`` (else the number of ranks it recorded); below 2 is refused."""
    tp_raw = view.world_size  # >= 1 when recorded (the decoder refuses 0)
    tp = tp_raw if tp_raw is not None else view.ranks
    if tp < 2:
        said = f"world_size {tp_raw}" if tp_raw is not None else f"no world_size and {view.ranks} rank"
        raise UserError(
            f"{path}: the profile records {said}: a single rank runs no all-reduce; nothing to "
            "tune (profile a run with tensor parallelism >= 2)"
        )
    return tp


def _per_step_sizes(path: Path, view, notes: list[str]) -> tuple[tuple[int, int], ...]:
    """``(msg_bytes, count per step)``: the sizes counted over all ranks and steps, scaled to the
    median per-step count and rounded (the largest share absorbs the rounding, said in ``notes``)."""
    per_step = statistics.median(view.step_allreduce_counts)
    n_per_step = int(round(per_step))
    if n_per_step < 1:
        raise UserError(f"{path}: the profile has no all-reduce per step: nothing to tune")
    sizes: dict[int, int] = {}
    for i, (b, c) in enumerate(view.sizes):
        if b is None:
            raise UserError(f"{path}: {UNKNOWN_SIZE_MESSAGE}")
        if b < 0 or c < 0:
            raise UserError(
                f"{path}: not a usable fastverify profile: allreduce_by_msg_size[{i}]: msg_bytes "
                "and count must be integers >= 0"
            )
        if c:
            sizes[b] = sizes.get(b, 0) + c
    total = sum(sizes.values())
    if total == 0:
        raise UserError(f"{path}: {UNKNOWN_SIZE_MESSAGE}")
    scaled = {b: c * n_per_step / total for b, c in sizes.items()}
    counts = {b: int(round(v)) for b, v in scaled.items()}
    biggest = max(counts, key=lambda b: (scaled[b], b))
    counts[biggest] += n_per_step - sum(counts.values())
    if any(abs(counts[b] - scaled[b]) > 1e-6 for b in counts):
        notes.append(
            f"per-step counts per size scaled from {total} all-reduces over all ranks and steps to "
            f"{n_per_step} per step and rounded"
        )
    return tuple((b, c) for b, c in sorted(counts.items()) if c > 0)


def _profile_dtype(path: Path, view, msg_sizes, notes: list[str]) -> str:
    """The recorded dtype (else bf16, said in ``notes``), once the recorded hidden size and tokens
    agree with the most common all-reduce; a missing hidden size is said in ``notes``."""
    shapes = view.shapes
    dtype = shapes.dtype
    if dtype is None:
        dtype = DTYPE
        why = "schema version 1" if view.version == 1 else f"a {view.kind} profile"
        notes.append(f"dtype assumed {DTYPE}: {why} records message bytes, not the dtype")
    hidden, tokens = shapes.hidden, shapes.tokens
    if hidden is not None and tokens is not None:
        row = tokens * hidden * _ELEMENT_BYTES[dtype]
        main = max(msg_sizes, key=lambda bc: (bc[1], bc[0]))[0]
        if main != row:
            raise UserError(
                f"{path}: not a usable fastverify profile: shapes say tokens {tokens} x hidden "
                f"{hidden} x {dtype} = {row} B per all-reduce, the most common all-reduce is {main} B"
            )
    elif view.kind == "live" or view.version == 1:
        notes.append(
            "no hidden size recorded (schema version 1): all-reduce + RMSNorm cannot be timed; "
            "re-run `fastverify profile` to record it"
            if view.version == 1
            else "no hidden size recorded: all-reduce + RMSNorm cannot be timed"
        )
    return dtype


def _measured_split(
    path: Path, version: int, allreduce_us: float | None
) -> tuple[tuple[tuple[int, float], ...], float | None, float | None]:
    """A version-2 profile's measured median per message size and the per-step wait / transfer
    split of :attr:`Workload.allreduce_us` (see its docstring); nothing for version 1, which
    recorded neither. The file was already validated by ``read_profile_view``."""
    if version != SCHEMA_VERSION:
        return (), None, None

    prof = decode_profile(read_bytes(path, kind="json", what="profile"), source=str(path))
    by_size = tuple(
        sorted(
            (s.msg_bytes, float(s.median_us))
            for s in prof.allreduce_by_msg_size
            if s.msg_bytes is not None and s.count > 0 and s.median_us > 0
        )
    )
    fractions = []
    for r in prof.ranks:
        w, t = r.allreduce_wait_us, r.allreduce_transfer_us
        if w is not None and t is not None and w >= 0 and t >= 0 and w + t > 0:
            fractions.append(w / (w + t))
    if not fractions or allreduce_us is None:
        return by_size, None, None
    wait = statistics.median(fractions) * allreduce_us
    return by_size, wait, allreduce_us - wait
