"""Bounds on the figures a bundle's ``manifest.json`` states (:func:`manifest_figure_problem`),
checked by :func:`fastverify.bundle.decode_manifest` when ``fastverify report`` or ``tune
--draft-shape --bundle`` reads a bundle back: a figure past the bounds of :mod:`fastverify.bounds`
is no measurement (an altered or damaged bundle) and the bundle is refused, in one line naming
the field."""

from __future__ import annotations

import math

from fastverify import bounds as B
from fastverify.errors import printable

__all__ = ["manifest_figure_problem"]

_FIGURES = {  # meta or host key -> (least, most) of the int it holds (each int of a list)
    **dict.fromkeys(("tp", "tp_size", "pp_size"), (1, B.MAX_WORLD_SIZE)),
    **dict.fromkeys(("gpus", "gpu_count"), (0, B.MAX_WORLD_SIZE)),
    "hidden": (1, B.MAX_HIDDEN),
    **dict.fromkeys(("draft_tokens", "speculative_num_draft_tokens"), (1, B.MAX_DRAFT_TOKENS)),
    **dict.fromkeys(("batch", "batches"), (1, B.MAX_BATCH)),
    **dict.fromkeys(("msg_bytes", "swept_msg_bytes"), (0, B.MAX_MSG_BYTES)),
}


def _figure_problem(key: str, parent: str, value: int | float) -> str | None:
    if key in _FIGURES or parent in _FIGURES:
        lo, hi = _FIGURES[key if key in _FIGURES else parent]
        if isinstance(value, int) and lo <= value <= hi:
            return None
        return f"{value!r} is not an integer in [{lo}, {hi:,}]"
    if key.endswith("_s") or key == "seconds":
        ok = math.isfinite(value) and 0 <= value <= B.MAX_TIMEOUT_S
        return None if ok else f"{value!r} s is outside [0, {B.MAX_TIMEOUT_S:g} s]"
    if key.endswith("_us") or parent.endswith("_us"):
        return B.implausible_time_us(value)
    if not math.isfinite(value) or not 0 <= value <= B.MAX_COUNT:
        return f"{value!r} is outside [0, {B.MAX_COUNT:g}] (the bound of a count or size)"
    return None


def manifest_figure_problem(m) -> str | None:
    """Why a figure of ``m`` cannot be what collect measured (None when every one can): world
    sizes (``tp``, ``tp_size``, ``pp_size``, ``gpus``, ``gpu_count``) up to
    :data:`~fastverify.bounds.MAX_WORLD_SIZE`, ``hidden`` up to ``MAX_HIDDEN``, draft tokens up to
    ``MAX_DRAFT_TOKENS``, batches up to ``MAX_BATCH``, message sizes up to ``MAX_MSG_BYTES``, times
    (``budget_s``, ``elapsed_s``, a part's ``seconds``, any ``*_s``) finite in [0, ``MAX_TIMEOUT_S``],
    ``*_us`` as a measured time, and any other number a count or size in [0, ``MAX_COUNT``]."""
    stack: list[tuple[str, str, object]] = [
        ("budget_s", "", m.budget_s),
        ("elapsed_s", "", m.elapsed_s),
        ("host", "", m.host),
    ]
    for p in m.parts:
        stack += [(f"parts[{p.name}].seconds", "", p.seconds), (f"parts[{p.name}].meta", "", p.meta)]
    while stack:  # no recursion: a hostile manifest nests as deep as the JSON parser allows
        where, parent, value = stack.pop()
        key = where.rsplit(".", 1)[-1]
        if isinstance(value, dict):
            stack += [(f"{where}.{k}", key, v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(where, parent, v) for v in value]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            why = _figure_problem(key, parent, value)
            if why is not None:
                return f"{printable(where)[:200]} = {why}"
    return None
