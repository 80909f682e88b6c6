"""The versioned profile document: assembly and atomic writing (JSON, and a PNG beside it).

The document is the typed record :class:`fastverify.profile.record.Profile` (schema
``fastverify.profile`` version 2, documented in the README, "Profile JSON"); :func:`build_profile`
validates what the analyzer produced against it, and :func:`write_outputs` writes it through the
record's one encoder, so every file ``profile`` writes is one ``tune`` can decode. Every
timing in it carries the clock it came from in ``timing.clock``: ``trace`` (GPU timestamps from
a profiler trace), ``cpu_trace`` (a CPU-only profiler trace of a CPU server, whose all-reduces
are gloo CPU events: host wall clock), ``cuda_events`` (live run on GPUs) or ``cpu_wall_clock``
(live run on CPU over gloo); the two CPU clocks are not GPU timings and say so in ``timing.note``.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

import msgspec

from fastverify import __version__
from fastverify.analyze import analyze, short_allreduces
from fastverify.bounds import MIN_TIME_US
from fastverify.errors import UserError, path_text
from fastverify.events import RankEvents
from fastverify.outputs import release_reserved, reserve_names, write_error, write_files
from fastverify.profile.record import SCHEMA, SCHEMA_VERSION, Profile, Shapes, encode_profile

__all__ = ["SCHEMA", "SCHEMA_VERSION", "build_profile", "default_output", "write_outputs", "write_error", "as_builtins"]

CLOCK_NOTES = {
    "trace": "GPU event timestamps from PyTorch profiler traces",
    "cuda_events": "live run, CUDA events on the GPU",
    "cpu_wall_clock": (
        "live run on CPU over gloo, wall clock: NOT GPU timings; use them for the "
        "shape of the collective sequence, not for latency"
    ),
    "cpu_trace": (
        "CPU-only PyTorch profiler traces (a CPU server over gloo): CPU ops and CPU-clock "
        "all-reduces (gloo:* spans), host wall clock: NOT GPU timings"
    ),
}


def build_profile(ranks: list[RankEvents], source: dict, shapes: Shapes | None = None) -> Profile:
    """Assemble a profile record from per-rank events.

    Parameters
    ----------
    ranks : list of RankEvents, one per TP rank, sorted by rank
    source : dict
        ``{"kind": "trace", "files": [...]}`` or ``{"kind": "live", ...run parameters}`` with the
        fields of :class:`~fastverify.profile.record.TraceSource` / ``LiveSource``.
    shapes : Shapes or None
        The verify step's dtype, hidden size, tokens, draft tokens and batch where the caller knows
        them (a live run); None records them all as unknown (a trace).

    Returns
    -------
    Profile
        The record, validated against its schema.

    Raises
    ------
    ValueError
        The analyzer's output or ``source`` does not fit the schema (a bug, not a user error).
    """
    body = analyze(ranks)
    source = {k: _text(v) for k, v in source.items()}  # a non-UTF-8 path, escaped: JSON holds text
    clocks = sorted({r.meta.get("timing", "trace") for r in ranks})
    clock = clocks[0] if len(clocks) == 1 else "mixed"
    warnings: list[str] = list(body["cross_rank"].get("warnings", []))
    world = {r.meta.get("world_size") for r in ranks} - {None}
    for r in body["ranks"]:
        if r["unknown_comm_kernels"]:
            warnings.append(
                f"rank {r['rank']}: {len(r['unknown_comm_kernels'])} kernel name(s) look like "
                f"collectives but match no rule, reported as unknown_comm (not compute): "
                + "; ".join(n[:80] for n in r["unknown_comm_kernels"][:3])
            )
        m = r["meta"]
        if str(m.get("rank_source", "")).startswith("default"):
            warnings.append(f"{r['origin']}: no rank in the trace or its name; taken as rank 0")
        for key, what in (
            ("rank_conflict", None),
            ("merge_conflict", None),
            ("skipped_gpu_events", "GPU events without a usable ts/dur were skipped"),
            ("negative_duration_events", "GPU events had a negative duration, counted as 0"),
            ("implausible_duration_events", "GPU events last over 10 s; check the trace"),
        ):
            if m.get(key):
                warnings.append(f"rank {r['rank']}: {m[key]}" if what is None else f"rank {r['rank']}: {m[key]} {what}")
    for r in ranks:
        short, total = short_allreduces(r)
        if short:
            warnings.append(
                f"rank {r.rank}: {short} of {total} all-reduce kernels last under {MIN_TIME_US:g} µs, less than "
                "any all-reduce takes: their times (and the all-reduce µs, medians and split) are no measurement"
            )
    if world and len(ranks) < max(world) and len(ranks) > 1:
        warnings.append(
            f"{len(ranks)} of {max(world)} ranks given: transfer vs wait and the straggler cover these ranks only"
        )
    kinds = {c["kind"] for c in body["cross_rank"]["collectives"]}
    if kinds and not kinds & {"allreduce", "fused_allreduce"}:
        warnings.append(
            "the collectives matched across ranks include no all-reduce (e.g. pipeline "
            "send/recv): their transfer/wait split says nothing about TP all-reduces"
        )
    total_window = sum(r["window_us"] for r in body["ranks"])
    total_ar = sum(r["allreduce_us"] for r in body["ranks"])
    doc = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "fastverify_version": __version__,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "timing": {"clock": clock, "note": CLOCK_NOTES.get(clock, "mixed clocks: compare with care")},
        "world_size": max(world) if world else None,
        "shapes": msgspec.to_builtins(shapes or Shapes()),
        "summary": {
            "ranks": len(ranks),
            "allreduce_count": sum(r["allreduce_count"] for r in body["ranks"]),
            "allreduce_us": round(total_ar, 3),
            "allreduce_share_of_window_pct": round(100.0 * total_ar / total_window, 3) if total_window else None,
            "straggler_rank": body["cross_rank"]["straggler_rank"],
        },
        **body,
        "warnings": warnings,
    }
    try:
        return msgspec.convert(_plain(doc), Profile)
    except msgspec.ValidationError as err:
        raise ValueError(f"profile does not fit schema {SCHEMA} v{SCHEMA_VERSION}: {err}") from None


def _text(value):
    """A str (or the strs of a list) as valid UTF-8 text (:func:`fastverify.errors.path_text`)."""
    if isinstance(value, str):
        return path_text(value)
    if isinstance(value, list):
        return [_text(v) for v in value]
    return value


def _plain(obj):
    """Numpy scalars/arrays (a trace's ``meta`` may hold them) as Python numbers and lists."""
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if type(obj).__module__ == "numpy":
        return _plain(obj.tolist())
    return obj


def as_builtins(profile: Profile) -> dict:
    """The record as plain dicts and lists, keys as in the JSON (what the table and plot read)."""
    return msgspec.to_builtins(profile)


def default_output(
    stem: str, folder: str | Path = "profiles", *, png: bool = True, now: _dt.datetime | None = None
) -> Path:
    """A new ``profiles/<stem>-<UTC timestamp>[-<n>].json`` (relative to the working directory),
    taken with an exclusive create: the JSON name (and, with ``png``, the PNG beside it) is created
    empty here, so runs started in the same second, in this or other processes, each get their own
    names, and neither name was in use (``-<n>`` counts up until both are free). The placeholders
    are filled by :func:`write_outputs` (or :func:`fastverify.verifylog.write_report`) through a
    temporary file renamed over each, and removed if the run ends without writing them.

    Raises
    ------
    UserError
        The folder cannot be created or written.
    """
    stamp = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    suffixes = (".json", ".png") if png else (".json",)
    return reserve_names(folder, f"{stem}-{stamp}", suffixes, free=(".png",))[0]


def write_outputs(profile: Profile, json_path: Path, png_path: Path | None, painter=None) -> None:
    """Write the JSON (and the PNG) atomically through the one writer
    (:func:`fastverify.outputs.write_files`): both go to temporary files in the target folder and are
    renamed into place only when both are complete, so a failure leaves nothing behind; a
    symlinked output is refused, never written through. ``painter``: a
    :class:`fastverify.profile.painter.Painter` that draws the PNG in its own process (drawn here when it
    is None or fails).

    Raises
    ------
    UserError
        The folder cannot be created or written, or an output is a symlink or not a regular file.
    """
    json_path = Path(json_path)
    png_path = Path(png_path) if png_path else None
    if png_path is not None and os.path.abspath(png_path) == os.path.abspath(json_path):
        release_reserved()  # a default name taken for this run: not left behind
        raise UserError(f"{png_path}: the PNG and the JSON would be the same file")

    def fill_json(tmp: Path) -> None:
        tmp.write_bytes(encode_profile(profile))

    def fill_png(tmp: Path) -> None:
        if painter is None or not painter.draw(as_builtins(profile), tmp):
            from fastverify.profile.plot import plot_profile  # lazy: matplotlib

            plot_profile(as_builtins(profile), tmp)

    write_files([(json_path, fill_json)] + ([(png_path, fill_png)] if png_path else []))
