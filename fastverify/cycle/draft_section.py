"""The draft-shape section of ``fastverify report``: when the bundle's verify-log part carries
``accepted`` (per request accepted draft tokens, :mod:`fastverify.patch.verify`), the accept
length by chain depth (derived: ``E[min(A, k)] + 1``, exact for topk 1) and the recommended depth
of :mod:`fastverify.tune.draft_shape` (verify cost from the records, draft cost from the trace)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from fastverify.console import say
from fastverify.errors import UserError
from fastverify.tune import draft_shape
from fastverify.tune.draft_inputs import from_bundle
from fastverify.tune.draft_model import DraftCost, DraftShapeReport, recommend


def draft_section(bundle_path: str | Path, split=None) -> dict | None:
    """The section as plain dicts (:class:`fastverify.tune.draft_model.DraftShapeReport`), or
    None when the bundle has no verify records with ``accepted``; ``{"error": one line}`` when
    they cannot be read (the rest of the report stands). ``split``: the report's cycle split
    (:class:`fastverify.cycle.split.CycleSplit`), so the trace is not read twice."""
    try:
        hist, curve, draft, notes = from_bundle(bundle_path, split)  # a path or an opened Bundle
    except UserError as e:
        return None if "no verify-log part" in str(e) else {"error": str(e)}
    if hist is None or not curve.points:
        return None
    draft = draft or DraftCost(draft_step_ms=0.0, draft_extend_ms=0.0, label="assumed", source="none in the trace")
    return msgspec.to_builtins(recommend(hist, curve, draft, sources=[curve.source, draft.source], notes=notes))


def print_draft_section(section: dict | None, console) -> None:
    """Print the section under the report (nothing when it is None)."""
    if section is None:
        return
    if "error" in section:
        say(console, f"# draft shape: not read ({section['error']})")
        return
    console.print("[bold]draft shape[/bold] (accept length by depth: derived from the verify records' accepted)")
    draft_shape.print_report(msgspec.convert(section, DraftShapeReport), console)
