"""What the in-rank patch did in one rank (:class:`PatchReport`), and the one line each TP rank
prints from it: ``fastverify patch [TP r]: backend=... applied=... built=... skipped=... (why)``.
Filled by :func:`fastverify.patch.install.install` and completed by the rank step before
CUDA-graph capture."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PatchReport:
    """What :func:`fastverify.patch.install.install` (and, later, the rank step before capture) did.

    Attributes
    ----------
    backend : str
        ``FASTVERIFY_BACKEND`` as given.
    applied : list[str]
        Target keys in effect.
    skipped : dict[str, str]
        Key → one-line reason (a target, ``backend``, ``deployment``, ``add_norm``, ...).
    settings : dict[str, str]
        Environment settings applied in-rank.
    built : dict[str, str]
        Slot → what was built (``"gloo: world 2, single node, P2P proven by p2p_check"``).
    counting, uncounted : list[str], dict[str, str]
        Counting targets in effect (:mod:`fastverify.patch.counting`), and those missing with why
        (their part of the path counts is then absent).
    covers : str
        What SGLang's captured graphs in this rank cover (``verify steps up to 48 requests x 6
        tokens (288 rows) in CUDA graphs``), set by the rank step.
    active : bool
        False when ``FASTVERIFY_PATCH`` is not ``1``.
    """

    backend: str
    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)
    built: dict[str, str] = field(default_factory=dict)
    active: bool = True
    counting: list[str] = field(default_factory=list)
    uncounted: dict[str, str] = field(default_factory=dict)
    covers: str = ""

    def line(self, tp: str | None = None) -> str:
        """One line: ``fastverify patch [TP r]: backend=... applied=... built=... skipped=k (why); ...``."""
        parts = [f"backend={self.backend}", "applied=" + (",".join(self.applied) or "none")]
        if self.built:
            parts.append("built=" + "; ".join(f"{k}={v}" for k, v in self.built.items()))
        if self.skipped:
            parts.append("skipped=" + "; ".join(f"{k} ({v})" for k, v in self.skipped.items()))
        if self.counting:
            parts.append("counting=" + ",".join(self.counting))
        if self.uncounted:
            parts.append("uncounted=" + "; ".join(f"{k} ({v})" for k, v in self.uncounted.items()))
        where = f" [TP {tp}]" if tp is not None else ""
        covers = f" covers: {self.covers}" if self.covers else ""
        return f"fastverify patch{where}: " + " ".join(parts) + covers
