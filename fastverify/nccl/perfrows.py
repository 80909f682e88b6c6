"""The data rows of an ``all_reduce_perf`` table: their layouts, and how one row is read.

A row is ``%12li  %12li  %8s  %6s  %6s`` (size, count, type, redop, root), then twice
(out-of-place, in-place) ``  %7s  %6s  %6s  %6g`` (time µs, algbw GB/s, busbw GB/s, #wrong, or
``N/A`` with ``-c 0``) (NVIDIA/nccl-tests ``src/common.cu``). Floats shrink their precision to fit
the width: ``38.83``, ``124.8``, ``16253``. ``-I 1`` adds i_min/i_max/i_p99/i_cv% after each half;
``-T``-style timestamps add a date and a time at the end. Pre-2020 builds have no root column and
an ``error`` column (max abs error, a float like ``1e-07``) instead of ``#wrong``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from fastverify.bounds import MAX_MSG_BYTES, implausible_bandwidth, implausible_count, implausible_time_us


@dataclass(frozen=True)
class PerfRow:
    """One message size of an ``all_reduce_perf`` table. Times in µs, bandwidths in GB/s (1e9 B/s).

    ``root`` is the printed root column (``-1`` for all-reduce), ``None`` when the build has none.
    ``*_wrong`` is the count of wrong elements; ``None`` when the check was off (``N/A``) or the build
    printed an ``error`` column instead, whose value is then in ``*_error``.
    """

    size_bytes: int
    count: int
    dtype: str
    redop: str
    root: int | None
    oop_time_us: float
    oop_algbw_gbps: float
    oop_busbw_gbps: float
    oop_wrong: int | None
    ip_time_us: float
    ip_algbw_gbps: float
    ip_busbw_gbps: float
    ip_wrong: int | None
    oop_error: float | None = None
    ip_error: float | None = None
    line: int = 0  # 1-based line of the source text where the row starts


@dataclass(frozen=True)
class DroppedRow:
    """A line that looked like a data row and was not read: its 1-based ``line``, why (``reason``)
    and the text (whitespace squeezed, clipped to 80 characters)."""

    line: int
    reason: str
    text: str


_INT = re.compile(r"^-?[0-9]+$")
_FLOAT = re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?(?:inf|nan)$", re.IGNORECASE)
_WORD = re.compile(r"^[A-Za-z_][\w]*$")


@dataclass(frozen=True)
class Layout:
    """Column layout of the data rows, from the column-header row or guessed from a row's width."""

    root: bool = True
    error_col: bool = False  # old builds: ``error`` (float) instead of ``#wrong`` (count)
    per_iter: bool = False  # ``-I 1``: 4 more columns after each half
    timestamp: bool = False  # date and time at the end

    @property
    def n_tokens(self) -> int:
        return 4 + self.root + 2 * (4 + 4 * self.per_iter) + 2 * self.timestamp


GUESSES = {lay.n_tokens: lay for lay in (
    Layout(root=r, error_col=not r, per_iter=p, timestamp=t)
    for r in (True, False) for p in (False, True) for t in (False, True)
)}


def layout_from_header(cols: list[str]) -> Layout:
    """The row layout a column-header row announces."""
    low = [c.lower() for c in cols]
    return Layout(
        root="root" in low,
        error_col="error" in low and "#wrong" not in low,
        per_iter="i_min" in low,
        timestamp="timestamp" in low,
    )


def is_column_header(body: str) -> list[str] | None:
    """The column names of a ``#  size  count  type …`` header row, else ``None``."""
    cols = body.split()
    if len(cols) >= 8 and cols[0] == "size" and "count" in cols and "busbw" in cols:
        return cols
    return None


def to_int(tok: str) -> int | None:
    """An integer column (ASCII digits, at most 30 characters), else ``None``."""
    if not _INT.match(tok) or len(tok) > 30:
        return None
    return int(tok)


def to_float(tok: str) -> float | None:
    """A float column (``inf`` and ``nan`` included, at most 60 characters), else ``None``."""
    if not _FLOAT.match(tok) or len(tok) > 60:
        return None
    return float(tok)


def _wrong(tok: str) -> tuple[bool, int | None]:
    """``#wrong`` column: an integer, ``%g`` of one (``1e+06``) or ``N/A``. (ok, value)."""
    if tok == "N/A":
        return True, None
    v = to_float(tok)
    if v is None or not math.isfinite(v) or v < 0 or v != int(v):
        return False, None
    return True, int(v)


def _error(tok: str) -> tuple[bool, float | None]:
    """Old builds' ``error`` column: a float or ``N/A``. (ok, value)."""
    if tok == "N/A":
        return True, None
    v = to_float(tok)
    return (v is not None), v


def parse_row(tokens: list[str], lay: Layout, lineno: int) -> PerfRow | None:
    """The row ``tokens`` make in layout ``lay``, or ``None`` when a column does not parse."""
    if len(tokens) != lay.n_tokens:
        return None
    size, count = to_int(tokens[0]), to_int(tokens[1])
    if size is None or count is None:  # a negative one is a row, refused by _implausible
        return None
    dtype, redop = tokens[2], tokens[3]
    if not _WORD.match(dtype) or not _WORD.match(redop):
        return None
    i = 4
    root = None
    if lay.root:
        root = to_int(tokens[4])
        if root is None:
            return None
        i = 5
    halves = []
    width = 4 + 4 * lay.per_iter
    for h in range(2):
        t = tokens[i + h * width: i + h * width + 4]
        nums = [to_float(x) for x in t[:3]]
        if any(v is None for v in nums):
            return None
        if lay.error_col:
            ok, err = _error(t[3])
            wrong = None
        else:
            ok, wrong = _wrong(t[3])
            err = None
        if not ok:
            return None
        if lay.per_iter and any(to_float(x) is None for x in tokens[i + h * width + 4: i + (h + 1) * width]):
            return None
        halves.append((nums, wrong, err))
    (o, ow, oe), (p, pw, pe) = halves
    return PerfRow(size, count, dtype, redop, root, o[0], o[1], o[2], ow, p[0], p[1], p[2], pw,
                   oop_error=oe, ip_error=pe, line=lineno)


def implausible(row: PerfRow) -> str | None:
    """Why ``row`` cannot be a measurement (:mod:`fastverify.bounds`), or None when it can."""
    for name, value in (("size", row.size_bytes), ("count", row.count)):
        if why := implausible_count(value, upper=MAX_MSG_BYTES, what=name):
            return f"{name} {why} (a message holds at most 1 TiB)"
    for half, t, alg, bus, wrong in (("out-of-place", row.oop_time_us, row.oop_algbw_gbps, row.oop_busbw_gbps,
                                      row.oop_wrong),
                                     ("in-place", row.ip_time_us, row.ip_algbw_gbps, row.ip_busbw_gbps, row.ip_wrong)):
        if why := implausible_time_us(t):
            return f"{half} time {why}"
        for what, v in (("algbw", alg), ("busbw", bus)):
            if why := implausible_bandwidth(v):
                return f"{half} {what} {why}"
        if wrong is not None and (why := implausible_count(wrong, upper=MAX_MSG_BYTES, what="#wrong")):
            return f"{half} #wrong {why}"
    return None


# nccl-tests' type names (src/common.cu test_typenames), old and new
_DTYPES = frozenset({"int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double", "bfloat16",
                     "fp8_e4m3", "fp8_e5m2", "char", "int", "uint"})


def drop_reason(tokens: list[str], lay: Layout | None, *, last: bool) -> str | None:
    """Why a line that looks like a data row was not read, or ``None`` when it is no data row at
    all: a row cut off at the end, one whose size (or count) column is missing, one of another
    width than the table's rows, one with a column that does not parse."""
    if len(tokens) >= 2 and _INT.match(tokens[0]) and _INT.match(tokens[1]):
        if last:
            return "cut off at the end of the text"
        if lay is not None and len(tokens) != lay.n_tokens:
            return f"{len(tokens)} columns where the table's rows have {lay.n_tokens}"
        if lay is None:
            return f"{len(tokens)} columns: no all_reduce_perf layout has that many"
        return "a column that is not a number where one is expected"
    if len(tokens) == 1 and _INT.match(tokens[0]):
        return "cut off at the end of the text" if last else "only one column"
    k = next((i for i, t in enumerate(tokens[:3]) if t in _DTYPES), None)
    if k is None or k >= 2 or not all(_INT.match(t) for t in tokens[:k]) or len(tokens) < k + 6:
        return None
    numeric = sum(to_float(t) is not None or t == "N/A" for t in tokens[k + 2:])
    if numeric < len(tokens[k + 2:]) - 1:
        return None
    return ("no size column (the row starts with its element count)" if k == 1
            else "no size and no count column (the row starts with its data type)")


def looks_like_row(body: str) -> bool:
    """A line that starts like a data row (a size and a count) and so must not be silently skipped."""
    toks = body.split(None, 2)
    return len(toks) >= 1 and _INT.match(toks[0]) is not None and (len(toks) == 1 or _INT.match(toks[1]) is not None)


def clip(s: str, n: int = 80) -> str:
    """``s`` with its whitespace squeezed, clipped to ``n`` characters, for a message."""
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"
