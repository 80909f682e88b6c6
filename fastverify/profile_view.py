"""The view of a profile that ``fastverify tune --profile`` reads (:class:`ProfileView`), from a
file of either readable version.

Tune needs a handful of fields. Version 2 files decode in full and strictly
(:class:`fastverify.profile_record.Profile`); version 1 files (written before the shapes existed)
decode into the lenient structures below, which is all that version 1 guaranteed: dtype and
hidden size unknown, so an old profile is timed as plain all-reduces. Both are checked against
fastverify's plausibility bounds. No torch, no numpy: tune's sweep workers read this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS
from fastverify.errors import UserError
from fastverify.inputs import read_bytes
from fastverify.profile_bounds import BOUND_NAMES
from fastverify.profile_record import (SCHEMA_VERSION, Count, FloatCount, LiveSource, MsgBytes, Profile, Ranks,
                                       Shapes, Us, decode_as, decode_head)

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
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf") \
        else None


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
    raise UserError(f"{p}: not a usable fastverify profile: schema_version {head.schema_version!r}, this "
                    f"fastverify reads {' or '.join(map(str, READABLE_VERSIONS))}")


def _view_v2(prof: Profile, p: Path, accept: float | None) -> ProfileView:
    """The view of a version-2 profile; one without ranks or without a step median is refused."""
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
        version=1, kind=kind, shapes=_v1_shapes(old.source, str(p)) if kind == "live" else Shapes(), backend=None,
        world_size=old.world_size,
        clock=old.timing.clock, step_allreduce_counts=tuple(m.allreduce_count for m in ms),
        step_compute_us=tuple(v for m in ms if (v := _finite(m.compute_us)) is not None),
        step_window_us=tuple(v for m in ms if (v := _finite(m.window_us)) is not None),
        step_allreduce_us=tuple(v for m in ms if (v := _finite(m.allreduce_us)) is not None),
        sizes=tuple((s.msg_bytes, s.count) for s in old.allreduce_by_msg_size),
        ranks=len(old.ranks), accept_length=accept)


def _accept_length(value: Any, where: str, key: str) -> float | None:
    """A recorded accept length, or None where none is recorded (or it is not a number, as before);
    a number outside [0, :data:`MAX_ACCEPT_LENGTH`] is refused."""
    v = _finite(value)
    if v is not None and not 0 <= v <= MAX_ACCEPT_LENGTH:
        raise UserError(f"{where}: not a usable fastverify profile: {key} = {value!r} is outside [0, "
                        f"{MAX_ACCEPT_LENGTH}] (a verify step accepts at most {MAX_DRAFT_TOKENS} draft tokens + 1)")
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
            raise UserError(f"{where}: not a usable fastverify profile: source.{key} = {v} is past "
                            f"{BOUND_NAMES[tops[key]]} ({tops[key]})")
        return v

    tokens, draft, batch = pos("tokens"), pos("draft_tokens"), pos("batch")
    if None not in (tokens, draft, batch) and tokens != draft * batch:
        draft = batch = None
    return Shapes(tokens=tokens, draft_tokens=draft, batch=batch)
