"""The profile record (schema ``fastverify.profile``): one typed structure that ``fastverify
profile`` writes and ``fastverify tune --profile`` reads.

Version 2 (this module) adds :class:`Shapes` — the dtype, hidden size, tokens per step, draft
tokens and batch of the profiled verify step — and, for live runs, the all-reduce backend the
forward ran with (:attr:`LiveSource.backend`, a :class:`fastverify.registry.BackendName` value).
A fact is recorded only where the source knows it: a live run knows every shape; a trace profile
records none of them (the trace loader keeps message bytes per collective, not their dtype or
dims), so tune never re-derives a hidden size or a dtype from byte counts.

Version 1 files (written before the shapes existed) still load in :func:`read_profile_view`,
with dtype and hidden unknown, so an old profile is timed as plain all-reduces.

The README ("Profile JSON") documents every field. Nothing here imports torch or numpy: tune's
sweep workers import this module through :mod:`fastverify.tune.workload`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import msgspec

from fastverify.errors import UserError

SCHEMA = "fastverify.profile"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Versions :func:`read_profile_view` reads (1 with every shape unknown)."""

DTYPES = ("bfloat16", "float16", "float32")
"""torch dtype names a profile may record (the verify step's all-reduce element type)."""


class _Base(msgspec.Struct, frozen=True, omit_defaults=False):
    pass


class Shapes(_Base, forbid_unknown_fields=True):
    """The profiled verify step's shapes; None where the source does not say.

    Attributes
    ----------
    dtype : str or None
        torch dtype name of the all-reduced tensors (``"bfloat16"``), one of :data:`DTYPES`.
    hidden : int or None
        Hidden size: elements per row of every verify all-reduce ``[tokens, hidden]``.
    tokens : int or None
        Rows per all-reduce: ``batch × draft_tokens``.
    draft_tokens, batch : int or None
        Tokens verified per request and requests per step.
    """

    dtype: str | None = None
    hidden: int | None = None
    tokens: int | None = None
    draft_tokens: int | None = None
    batch: int | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"shapes.dtype must be one of {', '.join(DTYPES)} or null, got {self.dtype!r}")
        for name in ("hidden", "tokens", "draft_tokens", "batch"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or v < 1):
                raise ValueError(f"shapes.{name} must be a positive integer or null, got {v!r}")
        if None not in (self.tokens, self.draft_tokens, self.batch) and self.tokens != self.draft_tokens * self.batch:
            raise ValueError(f"shapes.tokens {self.tokens} != draft_tokens {self.draft_tokens} x batch {self.batch}")


class TraceSource(_Base, tag_field="kind", tag="trace"):
    """Profile of PyTorch profiler traces: the files read, one per rank (or a merged file)."""

    files: list[str]


class LiveSource(_Base, tag_field="kind", tag="live"):
    """Profile of a live verify forward (``fastverify profile --model``): its run parameters.

    ``backend`` is the all-reduce backend the forward ran with (registry name); ``dist_backend``
    the torch.distributed group it ran on (``nccl`` / ``gloo``).
    """

    model: str
    tp: int
    draft_tokens: int
    batch: int
    tokens: int
    iters: int
    warmup: int
    device: str | None
    dist_backend: str | None
    backend: str
    dtype: str
    hidden: int
    experts_allocated: int | None = None
    n_routed_experts: int | None = None
    graph_replay_traces: str | None = None


Source = Union[TraceSource, LiveSource]


class Timing(_Base):
    """``clock``: ``trace``, ``cuda_events``, ``cpu_wall_clock`` or ``mixed``; ``note`` in words."""

    clock: str
    note: str


class Summary(_Base):
    ranks: int
    allreduce_count: int
    allreduce_us: float
    allreduce_share_of_window_pct: float | None
    straggler_rank: int | None


class Hta(_Base):
    kernel_time_us: float
    idle_us: float
    compute_us: float
    non_compute_us: float
    comm_compute_overlap_pct: float | None


class StepMedian(_Base):
    """Medians over a rank's steps (µs; the count ``allreduce_count`` is a median, so a float)."""

    steps: int
    window_us: float
    busy_us: float
    idle_us: float
    compute_us: float
    allreduce_us: float
    other_comm_us: float
    memory_us: float
    exposed_comm_us: float
    allreduce_kernel_sum_us: float
    allreduce_count: float


class _Split(_Base):
    """The split of one window (:func:`fastverify.analyze.breakdown`); an empty window has only
    ``events`` and ``window_us``, so every other field defaults."""

    events: int = 0
    window_us: float = 0.0
    busy_us: float = 0.0
    idle_us: float = 0.0
    compute_us: float = 0.0
    allreduce_us: float = 0.0
    fused_allreduce_us: float = 0.0
    other_comm_us: float = 0.0
    ep_alltoall_us: float = 0.0  # expert-parallel all-to-all (DeepEP, pplx, NCCL all-to-all)
    memory_us: float = 0.0
    unknown_comm_us: float = 0.0
    exposed_comm_us: float = 0.0
    allreduce_exposed_us: float = 0.0
    other_exposed_us: float = 0.0
    comm_compute_overlap_pct: float | None = None
    allreduce_kernel_sum_us: float = 0.0
    allreduce_count: int = 0
    counts: dict[str, int] = {}


class StepSplit(_Split, kw_only=True):
    index: int
    name: str
    gpu_start_us: float


class TopKernel(_Base):
    name: str
    # ``class`` is a Python keyword: the attribute is ``cls``, the JSON key stays ``class``.
    cls: str = msgspec.field(name="class")
    count: int
    sum_us: float


class RankRecord(_Split, kw_only=True):
    """One TP rank: the whole-window split, its steps and facts about its source (``meta``)."""

    rank: int
    origin: str
    hta: Hta | None = None
    steps: list[StepSplit] = []
    step_median: StepMedian | None = None
    outside_steps_events: int = 0
    unknown_comm_kernels: list[str] = []
    top_kernels: list[TopKernel] = []
    meta: dict[str, Any] = {}
    allreduce_wait_us: float | None = None
    allreduce_transfer_us: float | None = None


class SizeRow(_Base):
    msg_bytes: int | None
    count: int
    median_us: float
    p90_us: float
    min_us: float
    max_us: float
    sum_us: float


class PositionRow(_Base):
    position: int
    label: str | None
    count: int
    msg_bytes: int | None
    median_us: float
    p90_us: float


class Collective(_Base):
    index: int
    kind: str
    name: str
    msg_bytes: int | None
    step: int
    label: str | None
    duration_us: dict[str, float]
    transfer_us: float
    straggler_rank: int


class RankWait(_Base):
    wait_us: float
    transfer_us: float
    allreduce_wait_us: float
    allreduce_transfer_us: float
    straggler_count: int


class CrossRank(_Base):
    matched: int
    per_rank: dict[str, RankWait]
    straggler_rank: int | None
    collectives: list[Collective]
    warnings: list[str]


class Profile(_Base, kw_only=True):
    """A whole profile (see the README, "Profile JSON"). ``schema`` stays the first key: the trace
    loader recognises a profile (and skips it in a folder of traces) by its opening bytes."""

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    fastverify_version: str
    created_utc: str
    source: Source
    timing: Timing
    world_size: int | None
    shapes: Shapes
    summary: Summary
    ranks: list[RankRecord]
    allreduce_by_msg_size: list[SizeRow]
    allreduce_by_position: list[PositionRow]
    cross_rank: CrossRank
    warnings: list[str]
    graph_replay: Profile | None = None


# --- the view tune reads -------------------------------------------------------------------------
# Tune needs a handful of fields. Version 2 files decode in full (:class:`Profile`, strict);
# version 1 files decode into the lenient view below, which is all that version 1 guaranteed.


class _StepMedianV1(msgspec.Struct, frozen=True):
    allreduce_count: float
    compute_us: float | None = None
    window_us: float | None = None
    allreduce_us: float | None = None


class _RankV1(msgspec.Struct, frozen=True):
    step_median: _StepMedianV1


class _SizeV1(msgspec.Struct, frozen=True):
    msg_bytes: int | None
    count: int


class _TimingV1(msgspec.Struct, frozen=True):
    clock: str | None = None


class _ProfileV1(msgspec.Struct, frozen=True):
    ranks: list[_RankV1]
    allreduce_by_msg_size: list[_SizeV1]
    timing: _TimingV1 = _TimingV1()
    world_size: int | None = None
    source: dict[str, Any] = {}


class ProfileView(msgspec.Struct, frozen=True):
    """What ``tune`` reads from a profile of any readable version.

    Attributes
    ----------
    version : int
        The file's ``schema_version``.
    kind : str
        ``source.kind`` (``"trace"``, ``"live"``; ``"unknown"`` for a version-1 file without one).
    shapes : Shapes
        Version 2: as recorded. Version 1: ``tokens``, ``draft_tokens``, ``batch`` of a live run;
        ``dtype`` and ``hidden`` None (version 1 did not record them).
    backend : str or None
        Live version-2 profiles: the all-reduce backend the forward ran with.
    world_size : int or None
    clock : str or None
        ``timing.clock``.
    step_allreduce_counts, step_compute_us, step_window_us, step_allreduce_us : tuple
        Per rank with a step median, the medians over steps (None entries dropped for times).
    sizes : tuple of (msg_bytes or None, count)
        ``allreduce_by_msg_size`` rows over all ranks and steps.
    ranks : int
        Entries in ``ranks``.
    accept_length : float or None
        ``accept_length`` at the top level or in ``source``, where a writer recorded one.
    """

    version: int
    kind: str
    shapes: Shapes
    backend: str | None
    world_size: int | None
    clock: str | None
    step_allreduce_counts: tuple[float, ...]
    step_compute_us: tuple[float, ...]
    step_window_us: tuple[float, ...]
    step_allreduce_us: tuple[float, ...]
    sizes: tuple[tuple[int | None, int], ...]
    ranks: int
    accept_length: float | None = None


class _Head(msgspec.Struct):
    schema: Any = None
    schema_version: Any = None
    accept_length: Any = None


_ENCODER = msgspec.json.Encoder()


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf") \
        else None


def encode_profile(profile: Profile) -> bytes:
    """The profile as indented JSON bytes, keys in field order, newline-terminated (the one
    encoder every profile file goes through)."""
    return msgspec.json.format(_ENCODER.encode(profile), indent=2) + b"\n"


def decode_profile(data: bytes, *, source: str = "profile") -> Profile:
    """Parse a current-version profile strictly.

    Raises
    ------
    UserError
        One line naming ``source``: not JSON, not schema ``fastverify.profile``, another version,
        or a field missing, mistyped or out of range (msgspec's message says which, as a JSON path).
    """
    head = _head(data, source)
    if head.schema_version != SCHEMA_VERSION:
        raise UserError(f"{source}: profile schema_version {head.schema_version!r}; this reads "
                        f"{SCHEMA_VERSION} (re-run `fastverify profile`)")
    return _decode(data, Profile, source)


def read_profile_view(path: str | Path) -> ProfileView:
    """Read the profile at ``path`` (version 1 or 2) into the view ``tune`` needs.

    Raises
    ------
    UserError
        One line naming the file: unreadable, not JSON, not schema ``fastverify.profile``, a version
        this fastverify does not read, or a field missing or mistyped.
    """
    p = Path(path)
    from fastverify.inputs import read_bytes

    data = read_bytes(p, kind="json", what="profile")
    head = _head(data, str(p))
    accept = _finite(head.accept_length)
    if head.schema_version == SCHEMA_VERSION:
        prof = _decode(data, Profile, str(p))
        if not prof.ranks:
            raise UserError(f"{p}: not a usable fastverify profile: 'ranks' is empty")
        live = prof.source if isinstance(prof.source, LiveSource) else None
        medians = [r.step_median for r in prof.ranks if r.step_median is not None]
        if not medians:
            raise UserError(f"{p}: not a usable fastverify profile: no rank has a step_median (no steps found)")
        return ProfileView(
            version=SCHEMA_VERSION, kind="live" if live else "trace", shapes=prof.shapes,
            backend=live.backend if live else None, world_size=prof.world_size, clock=prof.timing.clock,
            step_allreduce_counts=tuple(m.allreduce_count for m in medians),
            step_compute_us=tuple(m.compute_us for m in medians),
            step_window_us=tuple(m.window_us for m in medians),
            step_allreduce_us=tuple(m.allreduce_us for m in medians),
            sizes=tuple((s.msg_bytes, s.count) for s in prof.allreduce_by_msg_size),
            ranks=len(prof.ranks), accept_length=accept)
    if head.schema_version == 1:
        old = _decode(data, _ProfileV1, str(p))
        if not old.ranks:
            raise UserError(f"{p}: not a usable fastverify profile: 'ranks' is empty")
        kind = old.source.get("kind") if isinstance(old.source.get("kind"), str) else "unknown"
        if accept is None:
            accept = _finite(old.source.get("accept_length"))
        ms = [r.step_median for r in old.ranks]
        return ProfileView(
            version=1, kind=kind, shapes=_v1_shapes(old.source) if kind == "live" else Shapes(), backend=None, world_size=old.world_size,
            clock=old.timing.clock, step_allreduce_counts=tuple(m.allreduce_count for m in ms),
            step_compute_us=tuple(v for m in ms if (v := _finite(m.compute_us)) is not None),
            step_window_us=tuple(v for m in ms if (v := _finite(m.window_us)) is not None),
            step_allreduce_us=tuple(v for m in ms if (v := _finite(m.allreduce_us)) is not None),
            sizes=tuple((s.msg_bytes, s.count) for s in old.allreduce_by_msg_size),
            ranks=len(old.ranks), accept_length=accept)
    raise UserError(f"{p}: not a usable fastverify profile: schema_version {head.schema_version!r}, this "
                    f"fastverify reads {' or '.join(map(str, READABLE_VERSIONS))}")


def _v1_shapes(source: dict[str, Any]) -> Shapes:
    """A version-1 live source recorded tokens, draft tokens and batch, but no hidden size or dtype."""
    def pos(key: str) -> int | None:
        v = source.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    tokens, draft, batch = pos("tokens"), pos("draft_tokens"), pos("batch")
    if None not in (tokens, draft, batch) and tokens != draft * batch:
        draft = batch = None
    return Shapes(tokens=tokens, draft_tokens=draft, batch=batch)


def _head(data: bytes, source: str) -> _Head:
    try:
        head = msgspec.json.decode(data, type=_Head)
    except msgspec.ValidationError:  # valid JSON, but not an object
        raise UserError(f"{source}: not a usable fastverify profile: 'schema' is not {SCHEMA!r} "
                        "(write one with `fastverify profile`)") from None
    except msgspec.DecodeError as err:
        raise UserError(f"{source}: not a fastverify profile: invalid JSON ({err})") from None
    except RecursionError:  # msgspec bounds nesting (fastverify/inputs.py)
        raise UserError(f"{source}: not a fastverify profile: JSON nested too deeply") from None
    if head.schema != SCHEMA:
        raise UserError(f"{source}: not a usable fastverify profile: 'schema' is not {SCHEMA!r} "
                        "(write one with `fastverify profile`)")
    return head


def _decode(data: bytes, typ: type, source: str):
    try:
        return msgspec.json.decode(data, type=typ)
    except (msgspec.ValidationError, ValueError, RecursionError) as err:
        text = " ".join(str(err).split())
        raise UserError(f"{source}: not a usable fastverify profile: {text}") from None
