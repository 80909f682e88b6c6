"""What a check says about an NCCL setting: the :class:`Setting` record, :class:`Finding` and its
:class:`Severity`, the internal :class:`Verdict` the checks return, and the NCCL version a value is
checked against (:class:`Ctx`).

Facts: NVIDIA/nccl's own source at tags v2.18.3 … v2.30.7 (``git show <tag>:<path>``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from fastverify.nccl.version import NcclVersion

V = NcclVersion.of
ALWAYS = V(2, 0)  # "since" of settings present in every NCCL 2 release checked (the oldest tag is 2.3.5)
NEWEST_CHECKED = V(2, 30, 7)  # newest NCCL source the catalogue was checked against
CHANNELS_64 = V(2, 25)  # MAXCHANNELS 32 -> 64 (src/include/device.h)


class Severity(str, Enum):
    """How bad a value is.

    * ``error``: NCCL fails (init or the first collective), or does not use the value as written:
      it ignores it, misreads it (``NCCL_P2P_LEVEL=sys``, ``NCCL_BUFFSIZE=4MB``) or replaces it
      (clamps it to a range, falls back to the default).
    * ``warning``: NCCL uses the value, but part of it is ignored, or it is risky (LL128 forced on),
      or this NCCL version does not read the setting at all, or it replaces a useful default.
    * ``ok``: used as written (the reason may still say what it means, e.g. a legacy integer).
    """

    OK = "ok"
    WARNING = "warning"
    ERROR = "error"


class Scope(str, Enum):
    """When NCCL reads a setting: changing a ``process`` one needs a fresh process."""

    PROCESS = "process"  # NCCL_PARAM cache or another static: read once per process
    COMMUNICATOR = "communicator"  # re-read at each communicator init


class Kind(str, Enum):
    """What kind of value a setting takes, as NCCL reads it."""

    INT = "int"  # strtoll(value, NULL, 0): decimal, 0x hex, leading-0 octal
    FLAG = "flag"  # an int where only some values mean something
    CHOICE = "choice"  # one name out of a fixed set
    LIST = "list"  # a list of names with its own grammar
    TEXT = "text"  # a path or plugin name, not checked beyond being non-empty


@dataclass(frozen=True)
class Setting:
    """One NCCL environment variable. ``since`` is the first NCCL release that reads it;
    ``changes`` lists, per NCCL version, where the accepted values or their meaning changed."""

    name: str
    kind: Kind
    values: str
    default: str
    scope: Scope
    since: NcclVersion
    meaning: str
    source: str
    changes: tuple[str, ...] = ()
    alias_of: str | None = None


@dataclass(frozen=True)
class Finding:
    """The verdict on one ``name=value``: ``reason`` and ``fix`` are single lines."""

    name: str
    value: str
    severity: Severity
    reason: str
    fix: str | None = None


class Verdict(NamedTuple):
    """What one check says about a value; :func:`validate_setting` turns it into a :class:`Finding`."""

    severity: Severity
    reason: str
    fix: str | None = None


_RANK = {Severity.OK: 0, Severity.WARNING: 1, Severity.ERROR: 2}


def merge(*verdicts: Verdict | None) -> Verdict:
    """One verdict from several: the worst severity, the reasons joined, the first fix."""
    present = [v for v in verdicts if v is not None]
    worst = max((v.severity for v in present), key=_RANK.__getitem__)
    reason = "; ".join(v.reason for v in present if v.reason)
    fix = next((v.fix for v in present if v.fix and v.severity == worst), None)
    return Verdict(worst, reason, fix)


def show(value: str, limit: int = 40) -> str:
    """``repr(value)`` clipped to ``limit`` characters, for a reason line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "…" + text[-1]


@dataclass(frozen=True)
class Ctx:
    """The NCCL a value is checked against; ``known`` is False when the caller did not say."""

    version: NcclVersion  # what the value is checked against (NEWEST_CHECKED when unknown)
    known: bool

    @classmethod
    def of(cls, version: NcclVersion | None) -> Ctx:
        """``version``, or the newest NCCL checked when it is ``None``."""
        return cls(version or NEWEST_CHECKED, version is not None)

    def at_least(self, v: NcclVersion) -> bool:
        return self.version >= v

    @property
    def nccl(self) -> str:
        return f"NCCL {self.version}" if self.known else "NCCL"

    def assumed(self, what: str) -> str:
        """A note for reasons that depend on the version when it is unknown."""
        return "" if self.known else f" (NCCL version unknown: checked as {what})"


# A value check: (value as set, the NCCL it is read by, the setting) -> verdict.
Check = Callable[[str, Ctx, Setting], Verdict]


def names_at(table: tuple, ctx: Ctx) -> tuple[str, ...]:
    """The names of ``table`` (``(name, first release, first release without it)`` rows) that the
    NCCL of ``ctx`` knows."""
    return tuple(n for n, first, gone in table if ctx.at_least(first) and (gone is None or not ctx.at_least(gone)))
