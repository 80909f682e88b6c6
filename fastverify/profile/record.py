"""The profile record (schema ``fastverify.profile``): one typed structure that ``fastverify
profile`` writes, its plausibility bounds said in words, and the view that ``fastverify tune
--profile`` reads (:class:`ProfileView`, from a file of either readable version).

Version 2 adds :class:`Shapes` (dtype, hidden size, tokens per step, draft tokens and batch of the
profiled verify step) and, for live runs, the all-reduce backend the forward ran with
(:attr:`LiveSource.backend`, a :class:`fastverify.registry.BackendName` value). A fact is recorded
only where the source knows it: a live run knows every shape; a trace profile records none (the
trace loader keeps message bytes per collective, not their dtype or dims), so tune never
re-derives a hidden size or a dtype from byte counts.

Decoding checks fastverify's plausibility bounds (:mod:`fastverify.bounds`): a message over 1 TiB,
a time outside [0, 1 hour], a count over 1e9, a world size or TP size of 0, a shape past the
verify-step bounds is refused with the field's JSON path, its value and the bound
(:func:`out_of_bounds`). The README ("Profile JSON") documents every field.

Tune needs a handful of fields. Version 2 files decode in full and strictly (:class:`Profile`);
version 1 files (written before the shapes existed) decode into the lenient structures of the
view, which is all that version 1 guaranteed: dtype and hidden size unknown, so an old profile is
timed as plain all-reduces. Both are checked against the same bounds. Nothing here imports torch
or numpy: tune's sweep workers import this module through :mod:`fastverify.tune.workload`.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Annotated, Any, Union

import msgspec

from fastverify.bounds import MAX_BATCH, MAX_COUNT, MAX_DRAFT_TOKENS, MAX_EVENT_US, MAX_HIDDEN, MAX_MSG_BYTES
from fastverify.errors import UserError, schema_error
from fastverify.inputs import decode_json, read_bytes

SCHEMA = "fastverify.profile"
SCHEMA_VERSION = 2

DTYPES = ("bfloat16", "float16", "float32")
"""torch dtype names a profile may record (the verify step's all-reduce element type)."""

# Plausibility bounds (fastverify.bounds), checked by msgspec when a profile is decoded (not when
# one is built): a value past them is a broken or hand-edited file, and refused with the field's path.
Us = Annotated[float, msgspec.Meta(ge=0, le=MAX_EVENT_US)]
"""A time in µs: [0, 1 hour]."""
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
"""A count (events, calls, steps) or an index (a rank, a position): [0, 1e9]."""
FloatCount = Annotated[float, msgspec.Meta(ge=0, le=MAX_COUNT)]
"""A median of counts: [0, 1e9]."""
MsgBytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_MSG_BYTES)]
"""One collective's payload in bytes: [0, 1 TiB]."""
Pct = Annotated[float, msgspec.Meta(ge=0, le=100)]
"""A share of a union (overlap of comm with compute): [0, 100]."""
Share = Annotated[float, msgspec.Meta(ge=0)]
"""A ratio of two sums in percent (all-reduce time over window time): >= 0 (timers of a live run can
put it a little over 100)."""
Ranks = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
"""A world size / TP size: at least one rank."""
Hidden = Annotated[int, msgspec.Meta(ge=1, le=MAX_HIDDEN)]
Tokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH * MAX_DRAFT_TOKENS)]
DraftTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_DRAFT_TOKENS)]
Batch = Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH)]
Step = Annotated[int, msgspec.Meta(ge=-1, le=MAX_COUNT)]
"""A step index; -1 for a collective outside every step."""


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
    hidden: Hidden | None = None
    tokens: Tokens | None = None
    draft_tokens: DraftTokens | None = None
    batch: Batch | None = None

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
    the torch.distributed group it ran on (``nccl`` / ``gloo``). ``timed_forward``: which forward
    the rows time, one of :data:`TIMED_FORWARDS` (None in a profile written before it was
    recorded). ``graph_forward_us`` / ``eager_forward_us`` (CUDA only): rank 0's median µs of one
    replay of the whole-forward CUDA graph (the step as served) and of one eager forward (a
    second figure, never the rows).
    """

    model: str
    tp: Ranks
    draft_tokens: DraftTokens
    batch: Batch
    tokens: Tokens
    iters: Count
    warmup: Count
    device: str | None
    dist_backend: str | None
    backend: str
    dtype: str
    hidden: Hidden
    experts_allocated: Count | None = None
    n_routed_experts: Count | None = None
    graph_replay_traces: str | None = None
    timed_forward: str | None = None
    graph_forward_us: Us | None = None
    eager_forward_us: Us | None = None


Source = Union[TraceSource, LiveSource]


class Timing(_Base):
    """``clock``: ``trace``, ``cuda_events``, ``cpu_wall_clock`` or ``mixed``; ``note`` in words."""

    clock: str
    note: str


TIMED_FORWARDS = {
    "cuda_graph": (
        "the CUDA-graph forward, as SGLang serves it: CUDA events between replays of one graph per "
        "region (compute sections, each all-reduce)"
    ),
    "eager": "the eager forward (no CUDA graphs on CPU)",
}
"""Which forward a live run timed (``timed_forward`` in its ranks' meta and its source), in words."""


def live_timing(timing: Timing, meta: dict[str, Any]) -> Timing:
    """The ``timing`` of a live profile: ``timing`` (the clock's own note) plus which forward was
    timed (:data:`TIMED_FORWARDS`) and, on CUDA, the whole-graph and eager medians of ``meta``
    (rank 0's)."""
    timed = meta.get("timed_forward")
    note = f"{timing.note}; timed: {TIMED_FORWARDS.get(timed, 'the eager forward (a run that did not record which)')}"
    graph, eager = median_or_none(meta.get("graph_forward_us")), median_or_none(meta.get("eager_forward_us"))
    if graph is not None:
        note += f"; whole-forward graph replay {graph:.1f} µs (the served step)"
    if eager is not None:
        note += f"; eager forward {eager:.1f} µs (second figure, not used)"
    return Timing(clock=timing.clock, note=note)


def median_or_none(values) -> float | None:
    """The median of a non-empty list of numbers, else None."""
    return float(statistics.median(values)) if values else None


class Summary(_Base):
    ranks: Count
    allreduce_count: Count
    allreduce_us: Us
    allreduce_share_of_window_pct: Share | None
    straggler_rank: Count | None


class Hta(_Base):
    kernel_time_us: Us
    idle_us: Us
    compute_us: Us
    non_compute_us: Us
    comm_compute_overlap_pct: Pct | None


class StepMedian(_Base):
    """Medians over a rank's steps (µs; the count ``allreduce_count`` is a median, so a float)."""

    steps: Count
    window_us: Us
    busy_us: Us
    idle_us: Us
    compute_us: Us
    allreduce_us: Us
    other_comm_us: Us
    memory_us: Us
    exposed_comm_us: Us
    allreduce_kernel_sum_us: Us
    allreduce_count: FloatCount


class _Split(_Base):
    """The split of one window (:func:`fastverify.analyze.breakdown`); an empty window has only
    ``events`` and ``window_us``, so every other field defaults."""

    events: Count = 0
    window_us: Us = 0.0
    busy_us: Us = 0.0
    idle_us: Us = 0.0
    compute_us: Us = 0.0
    allreduce_us: Us = 0.0
    fused_allreduce_us: Us = 0.0
    other_comm_us: Us = 0.0
    ep_alltoall_us: Us = 0.0  # expert-parallel all-to-all (DeepEP, pplx, NCCL all-to-all)
    memory_us: Us = 0.0
    unknown_comm_us: Us = 0.0
    exposed_comm_us: Us = 0.0
    allreduce_exposed_us: Us = 0.0
    other_exposed_us: Us = 0.0
    comm_compute_overlap_pct: Pct | None = None
    allreduce_kernel_sum_us: Us = 0.0
    allreduce_count: Count = 0
    counts: dict[str, Count] = {}


class StepSplit(_Split, kw_only=True):
    index: Count
    name: str
    gpu_start_us: float  # a clock reading, not a duration: only finite (JSON has no nan or inf)


class TopKernel(_Base):
    name: str
    # ``class`` is a Python keyword: the attribute is ``cls``, the JSON key stays ``class``.
    cls: str = msgspec.field(name="class")
    count: Count
    sum_us: Us


class RankRecord(_Split, kw_only=True):
    """One TP rank: the whole-window split, its steps and facts about its source (``meta``)."""

    rank: Count
    origin: str
    hta: Hta | None = None
    steps: list[StepSplit] = []
    step_median: StepMedian | None = None
    outside_steps_events: Count = 0
    unknown_comm_kernels: list[str] = []
    top_kernels: list[TopKernel] = []
    meta: dict[str, Any] = {}
    allreduce_wait_us: Us | None = None
    allreduce_transfer_us: Us | None = None


class SizeRow(_Base):
    msg_bytes: MsgBytes | None
    count: Count
    median_us: Us
    p90_us: Us
    min_us: Us
    max_us: Us
    sum_us: Us


class PositionRow(_Base):
    position: Count
    label: str | None
    count: Count
    msg_bytes: MsgBytes | None
    median_us: Us
    p90_us: Us


class Collective(_Base):
    index: Count
    kind: str
    name: str
    msg_bytes: MsgBytes | None
    step: Step
    label: str | None
    duration_us: dict[str, Us]
    transfer_us: Us
    straggler_rank: Count


class RankWait(_Base):
    wait_us: Us
    transfer_us: Us
    allreduce_wait_us: Us
    allreduce_transfer_us: Us
    straggler_count: Count


class CrossRank(_Base):
    matched: Count
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
    world_size: Ranks | None
    shapes: Shapes
    summary: Summary
    ranks: list[RankRecord]
    allreduce_by_msg_size: list[SizeRow]
    allreduce_by_position: list[PositionRow]
    cross_rank: CrossRank
    warnings: list[str]
    graph_replay: Profile | None = None


class ProfileHead(msgspec.Struct):
    """The keys read before a profile is decoded: which schema and version it claims, and an
    ``accept_length`` a writer may have put at the top level (any JSON value)."""

    schema: Any = None
    schema_version: Any = None
    accept_length: Any = None


_ENCODER = msgspec.json.Encoder()


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
    head = decode_head(data, source)
    if head.schema_version != SCHEMA_VERSION:
        raise UserError(
            f"{source}: profile schema_version {head.schema_version!r}; this reads "
            f"{SCHEMA_VERSION} (re-run `fastverify profile`)"
        )
    return decode_as(data, Profile, source)


def decode_head(data: bytes, source: str) -> ProfileHead:
    """The head of the profile JSON ``data``.

    Raises
    ------
    UserError
        Not JSON, nested too deeply, not an object, or ``schema`` is not ``fastverify.profile``.
    """
    try:
        head = decode_json(data, source, ProfileHead, what="the profile")
    except msgspec.ValidationError:  # valid JSON, but not an object
        raise UserError(
            f"{source}: not a usable fastverify profile: 'schema' is not {SCHEMA!r} "
            "(write one with `fastverify profile`)"
        ) from None
    if head.schema != SCHEMA:
        raise UserError(
            f"{source}: not a usable fastverify profile: 'schema' is not {SCHEMA!r} "
            "(write one with `fastverify profile`)"
        )
    return head


_US_FIELDS = (
    "allreduce_us",
    "kernel_time_us",
    "idle_us",
    "compute_us",
    "non_compute_us",
    "window_us",
    "busy_us",
    "other_comm_us",
    "memory_us",
    "exposed_comm_us",
    "allreduce_kernel_sum_us",
    "fused_allreduce_us",
    "ep_alltoall_us",
    "unknown_comm_us",
    "allreduce_exposed_us",
    "other_exposed_us",
    "sum_us",
    "median_us",
    "p90_us",
    "min_us",
    "max_us",
    "transfer_us",
    "wait_us",
    "allreduce_wait_us",
    "allreduce_transfer_us",
)
PROFILE_EXAMPLES = {
    "schema": f'"{SCHEMA}"',
    "schema_version": str(SCHEMA_VERSION),
    "fastverify_version": '"0.1.0"',
    "created_utc": '"2025-06-01T12:00:00+00:00"',
    "source": '{"kind": "trace", "files": ["rank0.trace.json"]}',
    "timing": '{"clock": "trace", "note": "kernel times from the profiler trace"}',
    "world_size": "2",
    "shapes": '{"dtype": "bfloat16", "hidden": 7168, "tokens": 16, "draft_tokens": 4, "batch": 4}',
    "summary": '{"ranks": 2, "allreduce_count": 61, "allreduce_us": 900.0, "allreduce_share_of_window_pct": 30.0, '
    '"straggler_rank": null}',
    "ranks": '[{"rank": 0, "origin": "rank0.trace.json"}]',
    "allreduce_by_msg_size": "[]",
    "allreduce_by_position": "[]",
    "cross_rank": '{"matched": 0, "per_rank": {}, "straggler_rank": null, "collectives": [], "warnings": []}',
    "warnings": "[]",
    "graph_replay": "null",
    "accept_length": "2.5",
    "dtype": '"bfloat16"',
    "hidden": "7168",
    "tokens": "16",
    "draft_tokens": "4",
    "batch": "4",
    "files": '["rank0.trace.json"]',
    "kind": '"trace"',
    "model": '"tiny"',
    "tp": "2",
    "iters": "20",
    "warmup": "3",
    "device": '"cuda"',
    "dist_backend": '"nccl"',
    "backend": '"nccl"',
    "experts_allocated": "256",
    "n_routed_experts": "256",
    "graph_replay_traces": "null",
    "timed_forward": '"cuda_graph"',
    "graph_forward_us": "850.0",
    "eager_forward_us": "1200.0",
    "clock": '"trace"',
    "note": '"kernel times"',
    "summary.ranks": "2",
    "allreduce_count": "61",
    "allreduce_share_of_window_pct": "30.0",
    "straggler_rank": "1",
    "comm_compute_overlap_pct": "35.0",
    "step_median.steps": "8",
    "events": "5000",
    "counts": '{"allreduce": 61}',
    "index": "0",
    "name": '"step[TARGET_VERIFY #0]"',
    "gpu_start_us": "1750000000000000.0",
    "class": '"allreduce"',
    "count": "61",
    "rank": "0",
    "origin": '"rank0.trace.json"',
    "hta": "null",
    "step_median": "null",
    "ranks.steps": '[{"index": 0, "name": "step[TARGET_VERIFY #0]", "gpu_start_us": 0.0}]',
    "outside_steps_events": "0",
    "unknown_comm_kernels": "[]",
    "top_kernels": "[]",
    "meta": "{}",
    "msg_bytes": "229376",
    "position": "0",
    "label": '"attn"',
    "step": "0",
    "duration_us": '{"0": 12.5, "1": 13.0}',
    "matched": "61",
    "per_rank": '{"0": {"wait_us": 1.0, "transfer_us": 9.0, "allreduce_wait_us": 1.0, '
    '"allreduce_transfer_us": 9.0, "straggler_count": 0}}',
    "straggler_count": "3",
    "collectives": "[]",
    **{name: "12.5" for name in _US_FIELDS},
}
"""An example value (JSON text) of every profile field (by name, or path where names repeat),
said in a schema error."""


def decode_as(data: bytes, typ: type, source: str):
    """``data`` decoded as ``typ`` (a profile record or a lenient view of one).

    Raises
    ------
    UserError
        A field missing, mistyped or past a bound: the field's path, the value and the bound, or an
        example value of the field (:data:`PROFILE_EXAMPLES`).
    """
    try:
        return msgspec.json.decode(data, type=typ)
    except msgspec.ValidationError as err:
        bound = out_of_bounds(" ".join(str(err).split()), data)
        if bound is not None:
            raise UserError(f"{source}: not a usable fastverify profile: {bound}") from None
        raise schema_error(f"{source}: not a usable fastverify profile", err, PROFILE_EXAMPLES) from None
    except (ValueError, RecursionError) as err:
        text = " ".join(str(err).split())
        raise UserError(f"{source}: not a usable fastverify profile: {text}") from None


BOUND_NAMES = {
    MAX_MSG_BYTES: "1 TiB, fastverify's bound on one message",
    MAX_EVENT_US: "1 hour in µs, fastverify's bound on a time",
    MAX_COUNT: "fastverify's bound on a count",
    MAX_HIDDEN: "fastverify's bound on a hidden size",
    MAX_BATCH: "fastverify's bound on a batch",
    MAX_DRAFT_TOKENS: "fastverify's bound on draft tokens",
    MAX_BATCH * MAX_DRAFT_TOKENS: "fastverify's bound on tokens per step",
}
"""Each upper bound of the profile's fields → what it bounds, in words."""

_CONSTRAINT = re.compile(r"^Expected `(\w+)` (>=|<=) (-?[0-9.e+]+) - at `\$(.*)`$")
_PATH_PART = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[([0-9]+)\]|\[\.\.\.\]")


def _value_at(data: bytes, path: str) -> Any:
    """The JSON value at msgspec's ``path`` (``.ranks[0].msg_bytes``) in ``data``; None where the
    walk cannot follow it (a dict value, ``[...]``)."""
    value: Any = msgspec.json.decode(data)  # valid JSON: the typed decode got as far as a value
    for part in _PATH_PART.finditer(path):
        key, index = part.group(1), part.group(2)
        if key is not None and isinstance(value, dict) and key in value:
            value = value[key]
        elif index is not None and isinstance(value, list) and int(index) < len(value):
            value = value[int(index)]
        else:  # a dict value (``[...]``) or a path this walk does not follow: no value to show
            return None
    return value


def out_of_bounds(text: str, data: bytes) -> str | None:
    """msgspec's message for a value past a bound (``Expected `int` <= 1099511627776 - at
    `$.allreduce_by_msg_size[0].msg_bytes```), said with the value and what the bound is:
    ``allreduce_by_msg_size[0].msg_bytes = 1000000000000000 is past 1 TiB, …``; None for any other
    message."""
    m = _CONSTRAINT.match(text)
    if m is None:
        return None
    kind, op, bound, path = m.groups()
    value = _value_at(data, path)
    number = float(bound)
    name = BOUND_NAMES.get(int(number)) if op == "<=" and number == int(number) else None
    shown = "" if value is None else f" = {value!r}"
    if op == ">=":
        return f"{path.lstrip('.')}{shown} is below {bound}: expected {kind} >= {bound}"
    return (
        f"{path.lstrip('.')}{shown} is past {name or 'its bound'}: expected {kind} <= {bound}"
        " (values past fastverify's plausibility bounds are broken or hand-edited input)"
    )


READABLE_VERSIONS = (1, 2)
"""Versions :func:`read_profile_view` reads (1 with every shape unknown)."""
MAX_ACCEPT_LENGTH = MAX_DRAFT_TOKENS + 1
"""Tokens one verify step can accept: every draft token and the bonus token."""


class _StepMedianV1(msgspec.Struct, frozen=True):
    allreduce_count: FloatCount
    compute_us: Us | None = None
    window_us: Us | None = None
    allreduce_us: Us | None = None


class _RankV1(msgspec.Struct, frozen=True):
    step_median: _StepMedianV1


class _SizeV1(msgspec.Struct, frozen=True):
    msg_bytes: MsgBytes | None
    count: Count


class _TimingV1(msgspec.Struct, frozen=True):
    clock: str | None = None


class _ProfileV1(msgspec.Struct, frozen=True):
    ranks: list[_RankV1]
    allreduce_by_msg_size: list[_SizeV1]
    timing: _TimingV1 = _TimingV1()
    world_size: Ranks | None = None
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


def _finite(x: Any) -> float | None:
    return (
        float(x)
        if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")
        else None
    )


def read_profile_view(path: str | Path) -> ProfileView:
    """Read the profile at ``path`` (version 1 or 2) into the view ``tune`` needs.

    Raises
    ------
    UserError
        One line naming the file: unreadable, not JSON, not schema ``fastverify.profile``, a version
        this fastverify does not read, a field missing or mistyped, or a size, count or time past the
        plausibility bounds of :mod:`fastverify.bounds` (the message names the field, its value and the
        bound), a world size below 1 or an accept length outside [0, draft tokens + 1].
    """
    p = Path(path)
    data = read_bytes(p, kind="json", what="profile")
    head = decode_head(data, str(p))
    accept = _accept_length(head.accept_length, str(p), "accept_length")
    if head.schema_version == SCHEMA_VERSION:
        return _view_v2(decode_as(data, Profile, str(p)), p, accept)
    if head.schema_version == 1:
        return _view_v1(decode_as(data, _ProfileV1, str(p)), p, accept)
    raise UserError(
        f"{p}: not a usable fastverify profile: schema_version {head.schema_version!r}, this "
        f"fastverify reads {' or '.join(map(str, READABLE_VERSIONS))}"
    )


def _view_v2(prof: Profile, p: Path, accept: float | None) -> ProfileView:
    """The view of a version-2 profile; one without ranks or without a step median is refused."""
    if not prof.ranks:
        raise UserError(f"{p}: not a usable fastverify profile: 'ranks' is empty")
    live = prof.source if isinstance(prof.source, LiveSource) else None
    medians = [r.step_median for r in prof.ranks if r.step_median is not None]
    if not medians:
        raise UserError(f"{p}: not a usable fastverify profile: no rank has a step_median (no steps found)")
    return ProfileView(
        version=SCHEMA_VERSION,
        kind="live" if live else "trace",
        shapes=prof.shapes,
        backend=live.backend if live else None,
        world_size=prof.world_size,
        clock=prof.timing.clock,
        step_allreduce_counts=tuple(m.allreduce_count for m in medians),
        step_compute_us=tuple(m.compute_us for m in medians),
        step_window_us=tuple(m.window_us for m in medians),
        step_allreduce_us=tuple(m.allreduce_us for m in medians),
        sizes=tuple((s.msg_bytes, s.count) for s in prof.allreduce_by_msg_size),
        ranks=len(prof.ranks),
        accept_length=accept,
    )


def _view_v1(old: _ProfileV1, p: Path, accept: float | None) -> ProfileView:
    """The view of a version-1 profile: shapes only from a live source, no backend; the accept
    length at the top level, else in ``source``."""
    if not old.ranks:
        raise UserError(f"{p}: not a usable fastverify profile: 'ranks' is empty")
    kind = old.source.get("kind") if isinstance(old.source.get("kind"), str) else "unknown"
    if accept is None:
        accept = _accept_length(old.source.get("accept_length"), str(p), "source.accept_length")
    ms = [r.step_median for r in old.ranks]
    return ProfileView(
        version=1,
        kind=kind,
        shapes=_v1_shapes(old.source, str(p)) if kind == "live" else Shapes(),
        backend=None,
        world_size=old.world_size,
        clock=old.timing.clock,
        step_allreduce_counts=tuple(m.allreduce_count for m in ms),
        step_compute_us=tuple(v for m in ms if (v := _finite(m.compute_us)) is not None),
        step_window_us=tuple(v for m in ms if (v := _finite(m.window_us)) is not None),
        step_allreduce_us=tuple(v for m in ms if (v := _finite(m.allreduce_us)) is not None),
        sizes=tuple((s.msg_bytes, s.count) for s in old.allreduce_by_msg_size),
        ranks=len(old.ranks),
        accept_length=accept,
    )


def _accept_length(value: Any, where: str, key: str) -> float | None:
    """A recorded accept length, or None where none is recorded (or it is not a number, as before);
    a number outside [0, :data:`MAX_ACCEPT_LENGTH`] is refused."""
    v = _finite(value)
    if v is not None and not 0 <= v <= MAX_ACCEPT_LENGTH:
        raise UserError(
            f"{where}: not a usable fastverify profile: {key} = {value!r} is outside [0, "
            f"{MAX_ACCEPT_LENGTH}] (a verify step accepts at most {MAX_DRAFT_TOKENS} draft tokens + 1)"
        )
    return v


def _v1_shapes(source: dict[str, Any], where: str) -> Shapes:
    """A version-1 live source recorded tokens, draft tokens and batch, but no hidden size or dtype.
    A value that is not a positive integer is left out (version 1 did not promise one); one past
    fastverify's bounds is refused."""
    tops = {"tokens": MAX_BATCH * MAX_DRAFT_TOKENS, "draft_tokens": MAX_DRAFT_TOKENS, "batch": MAX_BATCH}

    def pos(key: str) -> int | None:
        v = source.get(key)
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            return None
        if v > tops[key]:
            raise UserError(
                f"{where}: not a usable fastverify profile: source.{key} = {v} is past "
                f"{BOUND_NAMES[tops[key]]} ({tops[key]})"
            )
        return v

    tokens, draft, batch = pos("tokens"), pos("draft_tokens"), pos("batch")
    if None not in (tokens, draft, batch) and tokens != draft * batch:
        draft = batch = None
    return Shapes(tokens=tokens, draft_tokens=draft, batch=batch)
