"""Which internal path a trial's backend took: its ``path_counts`` as the ranks report them, and
whether it fell back (to ``torch.distributed``) instead of running its own kernel. A trial that
fell back measured the fallback, not the backend, so :mod:`fastverify.tune.report` never ranks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from fastverify.registry import Role, backend_info
from fastverify.tune.trial import Op, TrialResult, TrialSpec


class NotRankedStatus(StrEnum):
    """Why an ``ok`` trial is left out of the ranking (:func:`fastverify.tune.report.rank_candidates`)."""

    FELL_BACK = "fell_back"  # its path counts show calls off the backend's own path (:func:`fell_back`)
    UNVERIFIED = "unverified"  # no path counts to show it took its own path (an older journal)


PATH_COUNT_PREFIX = "path_count:"
"""``TrialResult.worker_meta`` keys ``path_count:<path>``: how many calls took each internal path
of the trial's backend (its ``path_counts``: build, warm-up, check and timed calls together), as
one rank counted them (:data:`PATH_COUNTS_RANK`)."""
PATH_COUNTS_RANK = "path_counts_rank"
"""``worker_meta`` key: the rank whose counts are recorded, the first that fell back, else 0."""
_FUSED_PATH = "fused"
_FUSED_OFF_PATHS = ("fallback", "unfused")
_PLAIN_PATHS = ("all_reduce", "fused_all_reduce")
_PLAIN_FALLBACK = "fallback_all_reduce"


def backend_paths(spec: TrialSpec, counts: Mapping[str, int]) -> tuple[str, int, int]:
    """``(own path, calls on it, calls of the timed operation)`` from a backend's ``path_counts``.

    The path names are the backends' own labels (``fastverify/backends``): a fused residual +
    RMSNorm backend timed on that operation must take ``"fused"``; its others are ``"fallback"``
    (``torch.distributed`` + norm) and the base class's ``"unfused"``. Any other trial counts
    plain all-reduces: ``"all_reduce"`` (``"fused_all_reduce"`` for the trtllm kernel), against
    ``"fallback_all_reduce"``. An unknown backend name counts as a plain backend.
    """
    try:
        fused = backend_info(spec.backend).role is Role.fused_norm
    except ValueError:
        fused = False
    if fused and spec.op is Op.ALL_REDUCE_RESIDUAL_RMSNORM:
        own = counts.get(_FUSED_PATH, 0)
        return _FUSED_PATH, own, own + sum(counts.get(k, 0) for k in _FUSED_OFF_PATHS)
    own_key = next((k for k in _PLAIN_PATHS if counts.get(k)), _PLAIN_PATHS[0])
    own = sum(counts.get(k, 0) for k in _PLAIN_PATHS)
    return own_key, own, own + counts.get(_PLAIN_FALLBACK, 0)


def fell_back(spec: TrialSpec, counts: Mapping[str, int]) -> str | None:
    """None when the trial's backend took its own path (:func:`backend_paths`) on every call it
    counted, else one line with the counts: ``fell back: fused 0 of 40 calls, fallback 40``.
    Every call of a size takes the same path, so this holds for the timed calls too."""
    own_key, own, total = backend_paths(spec, counts)
    if total and own == total:
        return None
    others = "".join(f", {k} {v}" for k, v in sorted(counts.items()) if k != own_key and v)
    return f"fell back: {own_key} {own} of {total} calls{others}"


def path_meta(spec: TrialSpec, docs: list[dict]) -> dict[str, int]:
    """The ``worker_meta`` entries of the ranks' path counts (:data:`PATH_COUNT_PREFIX`): those of
    the first rank that fell back, else rank 0's; nothing where a rank sent none (a skipped trial)."""
    per_rank = [d.get("meta", {}).get("path_counts") for d in docs]
    if not per_rank or not all(isinstance(c, dict) for c in per_rank):
        return {}
    rank = next((r for r, c in enumerate(per_rank) if fell_back(spec, c) is not None), 0)
    out = {PATH_COUNT_PREFIX + str(k): v for k, v in per_rank[rank].items()}
    out[PATH_COUNTS_RANK] = rank
    return out


def path_counts(result: TrialResult) -> dict[str, int] | None:
    """A result's path counts (:data:`PATH_COUNT_PREFIX` entries of ``worker_meta``); None where it
    has none (a trial that never ran its backend, or an older journal) or one is not a count >= 0."""
    counts = {k[len(PATH_COUNT_PREFIX):]: v for k, v in result.worker_meta if k.startswith(PATH_COUNT_PREFIX)}
    if not counts or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in counts.values()):
        return None
    return counts
