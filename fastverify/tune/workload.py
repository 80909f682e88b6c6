"""The verify step's collectives, as the tuner needs them: message sizes, counts per step, and the
measured compute / verify time per step where a profile has it.

Two sources:

* :func:`workload_from_model` — shapes only, from a preset or ``config.json`` (the same reader as
  ``fastverify profile --model``). One verify forward of a DeepSeek-V3 / Kimi-K2 / Llama model at
  tensor parallelism ``tp`` on ``T = batch × draft_tokens`` tokens runs (SGLang's TP layers, see
  ``fastverify/live/forward.py``): one all-reduce after the vocab-parallel embedding, then per
  layer one after attention (``o_proj``) and one after the MLP / MoE, all of ``T × hidden``
  elements; then one all-gather of the logits (column-parallel ``lm_head``). So
  ``1 + 2 × num_layers`` all-reduces of ``T × hidden × 2`` bytes (bf16) — 123 × 57,344 B for
  Kimi-K2 at T = 4 — plus the logits all-gather, kept apart in :attr:`Workload.allgather_bytes`
  because it is not an all-reduce and no all-reduce setting or backend changes it.
* :func:`workload_from_profile` — what a ``fastverify profile`` JSON measured: all-reduces per step
  and their sizes, compute and window time per step, and the clock they came from.

Nothing here imports torch or numpy: sweep workers import this module.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fastverify.errors import UserError
from fastverify.live.config import ModelConfig, check_tp

DTYPE = "bfloat16"
DTYPE_BYTES = 2

# Clocks of a profile (README, ``timing.clock``) that time the GPU; ``cpu_wall_clock`` does not.
GPU_CLOCKS = frozenset({"trace", "cuda_events"})

UNKNOWN_SIZE_MESSAGE = ("profile has all-reduces of unknown size (CUDA-graph trace); "
                        "use --model/--tp/--draft-tokens/--batch")


@dataclass(frozen=True)
class Workload:
    """The all-reduces of one verify step, and what was measured about the step.

    Attributes
    ----------
    msg_sizes : tuple of (msg_bytes, count)
        All-reduce buffer size in bytes and how many all-reduces of that size one verify step runs,
        sorted by size.
    dtype : str
        Element type of the all-reduces (``"bfloat16"``; a profile does not record it, so it is
        assumed there).
    hidden, tokens : int | None
        Hidden size and tokens per verify step (``batch × draft_tokens``); ``None`` when the
        source does not say (a trace profile).
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

    def __post_init__(self) -> None:
        sizes = tuple(sorted((int(b), int(c)) for b, c in self.msg_sizes))
        for b, c in sizes:
            if b < 0 or c < 1:
                raise ValueError(f"Workload.msg_sizes: ({b}, {c}): need msg_bytes >= 0 and count >= 1")
        if len({b for b, _ in sizes}) != len(sizes):
            raise ValueError(f"Workload.msg_sizes: a size appears twice in {sizes}")
        object.__setattr__(self, "msg_sizes", sizes)
        object.__setattr__(self, "notes", tuple(self.notes))

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
            "allreduce_count": self.allreduce_count, "dtype": self.dtype, "hidden": self.hidden,
            "tokens": self.tokens, "tp": self.tp, "compute_us": self.compute_us, "verify_us": self.verify_us,
            "accept_length": self.accept_length, "source": self.source, "clock": self.clock,
            "allreduce_us": self.allreduce_us, "allgather_bytes": self.allgather_bytes, "notes": list(self.notes),
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
        msg_sizes=((msg, count),), dtype=DTYPE, hidden=config.hidden_size, tokens=tokens, tp=tp,
        source=f"model {config.name} ({config.source}), tp {tp}, {draft_tokens} draft tokens x batch {batch}",
        clock=None,
        allgather_bytes=tokens * (config.vocab_padded // tp) * DTYPE_BYTES,
        notes=(f"shapes only: 1 embedding all-reduce + 2 per layer x {config.num_layers} layers of "
               f"{tokens} x {config.hidden_size} x {DTYPE_BYTES} B ({DTYPE}); no times measured",
               "the logits all-gather is not an all-reduce and is left out of the all-reduce time"),
    )


# --- profiles ------------------------------------------------------------------------------------


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def workload_from_profile(path: str | Path) -> Workload:
    """The verify step measured by a ``fastverify profile`` JSON (schema ``fastverify.profile`` v1).

    * all-reduces per step: the median over ranks of ``ranks[].step_median.allreduce_count``;
    * their sizes: ``allreduce_by_msg_size`` (counted over all ranks and steps), scaled to that
      per-step count and rounded (the largest share absorbs the rounding);
    * compute / all-reduce / verify time per step: the median over ranks of ``step_median.compute_us``
      / ``allreduce_us`` / ``window_us``, with the clock of ``timing.clock``;
    * ``tp``: ``world_size``; ``hidden`` and ``tokens`` from a live profile's ``source``.

    Raises
    ------
    UserError
        One line naming the file: unreadable, not JSON, not schema ``fastverify.profile`` v1, a
        missing or mistyped field, no all-reduce at all, or an all-reduce of unknown size (a
        CUDA-graph replay trace: :data:`UNKNOWN_SIZE_MESSAGE`).
    """
    from fastverify.profile import SCHEMA, SCHEMA_VERSION  # local: keeps sweep workers light

    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise UserError(f"{path}: cannot read profile: {err.strerror or err}") from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f" at line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
        raise UserError(f"{path}: not a fastverify profile: invalid JSON{where}") from None

    def bad(what: str) -> UserError:
        return UserError(f"{path}: not a usable fastverify profile: {what}")

    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise bad(f"'schema' is not {SCHEMA!r} (write one with `fastverify profile`)")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise bad(f"schema_version {doc.get('schema_version')!r}, this fastverify reads {SCHEMA_VERSION}")
    ranks = doc.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise bad("'ranks' is missing or empty")
    medians = []
    for i, r in enumerate(ranks):
        sm = r.get("step_median") if isinstance(r, dict) else None
        if not isinstance(sm, dict):
            raise bad(f"ranks[{i}].step_median is missing")
        count = _finite(sm.get("allreduce_count"))
        if count is None or count < 0:
            raise bad(f"ranks[{i}].step_median.allreduce_count is missing or not a number >= 0")
        medians.append(sm)
    per_step = statistics.median(_finite(sm["allreduce_count"]) for sm in medians)
    n_per_step = int(round(per_step))
    if n_per_step < 1:
        raise UserError(f"{path}: the profile has no all-reduce per step: nothing to tune")

    by_size = doc.get("allreduce_by_msg_size")
    if not isinstance(by_size, list):
        raise bad("'allreduce_by_msg_size' is missing")
    sizes: dict[int, int] = {}
    for i, row in enumerate(by_size):
        if not isinstance(row, dict):
            raise bad(f"allreduce_by_msg_size[{i}] is not an object")
        b, c = row.get("msg_bytes"), row.get("count")
        if b is None:
            raise UserError(f"{path}: {UNKNOWN_SIZE_MESSAGE}")
        if isinstance(b, bool) or not isinstance(b, int) or b < 0 or isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise bad(f"allreduce_by_msg_size[{i}]: msg_bytes and count must be integers >= 0")
        if c:
            sizes[b] = sizes.get(b, 0) + c
    total = sum(sizes.values())
    if total == 0:
        raise UserError(f"{path}: {UNKNOWN_SIZE_MESSAGE}")
    notes = []
    scaled = {b: c * n_per_step / total for b, c in sizes.items()}
    counts = {b: int(round(v)) for b, v in scaled.items()}
    biggest = max(counts, key=lambda b: (scaled[b], b))
    counts[biggest] += n_per_step - sum(counts.values())
    if any(abs(counts[b] - scaled[b]) > 1e-6 for b in counts):
        notes.append(f"per-step counts per size scaled from {total} all-reduces over all ranks and steps to "
                     f"{n_per_step} per step and rounded")
    msg_sizes = tuple((b, c) for b, c in sorted(counts.items()) if c > 0)

    timing = doc.get("timing") if isinstance(doc.get("timing"), dict) else {}
    clock = timing.get("clock") if isinstance(timing.get("clock"), str) else None
    compute = [v for sm in medians if (v := _finite(sm.get("compute_us"))) is not None]
    window = [v for sm in medians if (v := _finite(sm.get("window_us"))) is not None]
    compute_us = statistics.median(compute) if compute else None
    ar_times = [v for sm in medians if (v := _finite(sm.get("allreduce_us"))) is not None]
    allreduce_us = statistics.median(ar_times) if ar_times else None
    verify_us = statistics.median(window) if window else None
    if clock == "cpu_wall_clock":
        notes.append("times are CPU wall clock over gloo (timing.clock = cpu_wall_clock): not GPU timings")
    elif clock not in GPU_CLOCKS:
        notes.append(f"unknown timing.clock {clock!r}: times treated as not measured on the GPU")

    source = doc.get("source") if isinstance(doc.get("source"), Mapping) else {}
    tp_raw = doc.get("world_size")
    if tp_raw is None and source.get("kind") == "live":
        tp_raw = source.get("tp")
    tp = tp_raw if isinstance(tp_raw, int) and not isinstance(tp_raw, bool) and tp_raw >= 1 else len(ranks)
    tokens = source.get("tokens") if source.get("kind") == "live" else None
    tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else None
    hidden = None
    if tokens:
        main = max(msg_sizes, key=lambda bc: (bc[1], bc[0]))[0]
        if main % (tokens * DTYPE_BYTES) == 0:
            hidden = main // (tokens * DTYPE_BYTES)
    accept = _finite(doc.get("accept_length", source.get("accept_length")))
    accept = accept if accept is not None and accept >= 1 else None
    notes.append(f"dtype assumed {DTYPE} (profiles record bytes, not dtypes)")
    kind = source.get("kind", "unknown")
    return Workload(
        msg_sizes=msg_sizes, dtype=DTYPE, hidden=hidden, tokens=tokens, tp=tp,
        compute_us=compute_us, verify_us=verify_us, accept_length=accept,
        source=f"profile {path} ({kind})", clock=clock, allreduce_us=allreduce_us, notes=tuple(notes),
    )
