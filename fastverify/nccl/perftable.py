"""Read the text output of nccl-tests ``all_reduce_perf`` into a :class:`PerfTable`.

The format (NVIDIA/nccl-tests ``src/util.cu`` and ``src/common.cu``; older layouts from nccl-tests
issue threads) is read in parts, in this order below: the data rows (their layouts, how one row is
read); the ``#`` header lines and the rank count; the noise removed before the rows are read (MPI
prefixes and NCCL log lines mixed into the rows); and the table itself, :func:`parse_all_reduce_perf`.

The parser never raises anything but :class:`~fastverify.errors.UserError`: when no complete data
row is left, or when a row (or the footer's average bus bandwidth) holds a value no measurement can
have (:mod:`fastverify.bounds`; :func:`parse_all_reduce_perf` lists them). The table is then
refused whole, because a nan or a negative time is a broken run, not a noisy one. Rows dropped
otherwise (a row cut off at the end, a row without its size column, a row of the wrong width) are
listed with their line and the reason in :attr:`PerfTable.dropped` (and as text in
:attr:`PerfTable.problems`).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from fastverify.bounds import MAX_MSG_BYTES, implausible_bandwidth, implausible_count, implausible_time_us
from fastverify.errors import UserError
from fastverify.nccl.debuglog import search_near_nccl

# The data rows of an ``all_reduce_perf`` table: their layouts, and how one row is read.
#
# A row is ``%12li  %12li  %8s  %6s  %6s`` (size, count, type, redop, root), then twice
# (out-of-place, in-place) ``  %7s  %6s  %6s  %6g`` (time µs, algbw GB/s, busbw GB/s, #wrong, or
# ``N/A`` with ``-c 0``) (NVIDIA/nccl-tests ``src/common.cu``). Floats shrink their precision to fit
# the width: ``38.83``, ``124.8``, ``16253``. ``-I 1`` adds i_min/i_max/i_p99/i_cv% after each half;
# ``-T``-style timestamps add a date and a time at the end. Pre-2020 builds have no root column and
# an ``error`` column (max abs error, a float like ``1e-07``) instead of ``#wrong``.


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


GUESSES = {
    lay.n_tokens: lay
    for lay in (
        Layout(root=r, error_col=not r, per_iter=p, timestamp=t)
        for r in (True, False)
        for p in (False, True)
        for t in (False, True)
    )
}


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
        t = tokens[i + h * width : i + h * width + 4]
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
        if lay.per_iter and any(to_float(x) is None for x in tokens[i + h * width + 4 : i + (h + 1) * width]):
            return None
        halves.append((nums, wrong, err))
    (o, ow, oe), (p, pw, pe) = halves
    return PerfRow(
        size,
        count,
        dtype,
        redop,
        root,
        o[0],
        o[1],
        o[2],
        ow,
        p[0],
        p[1],
        p[2],
        pw,
        oop_error=oe,
        ip_error=pe,
        line=lineno,
    )


def implausible(row: PerfRow) -> str | None:
    """Why ``row`` cannot be a measurement (:mod:`fastverify.bounds`), or None when it can."""
    for name, value in (("size", row.size_bytes), ("count", row.count)):
        if why := implausible_count(value, upper=MAX_MSG_BYTES, what=name):
            return f"{name} {why} (a message holds at most 1 TiB)"
    for half, t, alg, bus, wrong in (
        ("out-of-place", row.oop_time_us, row.oop_algbw_gbps, row.oop_busbw_gbps, row.oop_wrong),
        ("in-place", row.ip_time_us, row.ip_algbw_gbps, row.ip_busbw_gbps, row.ip_wrong),
    ):
        if why := implausible_time_us(t):
            return f"{half} time {why}"
        for what, v in (("algbw", alg), ("busbw", bus)):
            if why := implausible_bandwidth(v):
                return f"{half} {what} {why}"
        if wrong is not None and (why := implausible_count(wrong, upper=MAX_MSG_BYTES, what="#wrong")):
            return f"{half} #wrong {why}"
    return None


# nccl-tests' type names (src/common.cu test_typenames), old and new
_DTYPES = frozenset(
    {
        "int8",
        "uint8",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "half",
        "float",
        "double",
        "bfloat16",
        "fp8_e4m3",
        "fp8_e5m2",
        "char",
        "int",
        "uint",
    }
)


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
    numeric = sum(to_float(t) is not None or t == "N/A" for t in tokens[k + 2 :])
    if numeric < len(tokens[k + 2 :]) - 1:
        return None
    return (
        "no size column (the row starts with its element count)"
        if k == 1
        else "no size and no count column (the row starts with its data type)"
    )


def looks_like_row(body: str) -> bool:
    """A line that starts like a data row (a size and a count) and so must not be silently skipped."""
    toks = body.split(None, 2)
    return len(toks) >= 1 and _INT.match(toks[0]) is not None and (len(toks) == 1 or _INT.match(toks[1]) is not None)


def clip(s: str, n: int = 80) -> str:
    """``s`` with its whitespace squeezed, clipped to ``n`` characters, for a message."""
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


# The ``#`` header lines of an ``all_reduce_perf`` table, and its rank count.
#
# Header lines (NVIDIA/nccl-tests ``src/util.cu``, ``src/common.cu``): ``# nccl-tests version …``
# (recent), ``# nThread 1 nGpus 8 minBytes 8 maxBytes … step: 2(factor) warmup iters: 5 iters: 20
# agg iters: 1 validation: 1 graph: 0 [unalign: 0]``, ``#  Rank  0 Group  0 Pid 1756513 on host
# device  0 [0x01] NVIDIA GeForce RTX 4090`` (the bus id is ``[0x%02x]`` in older builds,
# ``[%04x:%02x:%02x]`` in newer ones), two column-header rows and a units row, then the footer
# ``# Out of bounds values : 0 OK`` and ``# Avg bus bandwidth    : 4.85265``.
#
# Rank count: the ``#  Rank`` lines when the table has them, else nThread × nGpus of the header, but
# both halves' busBw/algBw = 2(n−1)/n (nccl-tests ``doc/PERFORMANCE.md``) is solved for n as well;
# where the header's product disagrees with a ratio that every row agrees on, the ratio wins (under
# MPI the header counts one process's GPUs).

_RUN_KEYS = re.compile(
    r"(nThread|nGpus|minBytes|maxBytes|step:|warmup iters:|agg iters:|iters:|validation:|graph:|unalign:)"
    r"\s*(\S+)"
)
_VERSION_LINE = re.compile(r"^#\s*nccl-tests version\s+(\S+)(.*)$")
_RANK_LINE = re.compile(
    r"^#\s*Rank\s+([0-9]+)(?:\s+Group\s+([0-9]+))?\s+Pid\s+([0-9]+)\s+on\s+(\S+)\s+device\s+([0-9]+)\s+"
    r"\[([^\]]*)\]\s*(.*?)\s*$"
)
_KV_LINE = re.compile(r"^#\s*([A-Za-z][\w .()-]*?)\s*:\s*(.*?)\s*$")


def read_header_line(s: str, header: dict[str, str], ranks: dict[int, str], hosts: dict[str, None]) -> None:
    """One ``#`` line into ``header`` (key → value as printed), ``ranks`` (rank → GPU name) and ``hosts``."""
    if len(s) > 4096:  # nccl-tests header lines are short; keeps the lazy regexes below linear
        return
    m = _RANK_LINE.match(s)
    if m:
        ranks[int(m.group(1))] = m.group(7)
        hosts.setdefault(m.group(4), None)
        return
    m = _VERSION_LINE.match(s)
    if m:
        header["nccl-tests version"] = m.group(1)
        for k, v in re.findall(r"([\w-]+)=(\S+)", m.group(2)):
            header[k] = v
        return
    if "nThread" in s and "nGpus" in s:
        for k, v in _RUN_KEYS.findall(s):
            header[k.rstrip(":")] = v
        return
    m = _KV_LINE.match(s)
    if m:
        header[m.group(1)] = m.group(2)


def rank_count(header: dict[str, str], ranks: dict[int, str], bw_ranks: int | None) -> tuple[int | None, str | None]:
    """The rank count and where it comes from (module docstring). Rank lines fewer than
    nThread × nGpus are an excerpt of the header: the product wins then."""
    t, g = to_int(header.get("nThread", "")), to_int(header.get("nGpus", ""))
    product = t * g if t is not None and g is not None and t > 0 and g > 0 else None
    if ranks and (product is None or len(ranks) >= product):
        return len(ranks), "rank lines"
    if product is not None and (ranks or bw_ranks in (None, product)):
        return product, "nThread x nGpus"
    if bw_ranks is not None:
        return bw_ranks, "busBw/algBw"
    return None, None


def _half_unit(v: float) -> float:
    """Half the last printed digit of a bandwidth: nccl-tests prints ``%6.2f`` and drops decimals
    to keep 6 characters (``124.85``, ``1234.5``, ``16253``)."""
    return 0.005 if v < 1000 else 0.05 if v < 10000 else 0.5


def ranks_from_bw(rows: list[PerfRow]) -> int | None:
    """n from busBw/algBw = 2(n−1)/n (nccl-tests ``src/all_reduce.cu`` GetBw), over both halves of
    every row with algBw >= 0.5 GB/s (smaller ones are printed with too few digits): solved on the
    summed ratio, rounded, and kept only when every such row's ratio, within its printed rounding
    (and 0.1 %), agrees. ``None`` without such rows or when they disagree."""
    pts = [
        (a, b)
        for r in rows
        for a, b in ((r.oop_algbw_gbps, r.oop_busbw_gbps), (r.ip_algbw_gbps, r.ip_busbw_gbps))
        if a >= 0.5
    ]
    if not pts:
        return None
    ratio = sum(b for _, b in pts) / sum(a for a, _ in pts)
    if not 0 <= ratio < 2 - 2e-6:
        return None
    n = round(2 / (2 - ratio))
    if not 1 <= n <= 1 << 20:
        return None
    want = 2 * (n - 1) / n
    for a, b in pts:
        lo = max(b - _half_unit(b), 0.0) / (a + _half_unit(a)) * 0.999
        hi = (b + _half_unit(b)) / (a - _half_unit(a)) * 1.001
        if not lo <= want <= hi:
            return None
    return n


def avg_busbw(header: dict[str, str]) -> float | None:
    """The footer's ``Avg bus bandwidth`` in GB/s, ``None`` without one."""
    v = header.get("Avg bus bandwidth", "").split()
    return to_float(v[0]) if v else None


# The noise removed from ``all_reduce_perf`` output before its rows are read.
#
# MPI launchers prefix each line (``[0] ``, ``[1,0]<stdout>:``, Slurm ``0: ``), and those that tag
# every chunk they forward put the tag inside a row too (``-1[0]``, ``0[0]``: nccl-tests writes a
# row in pieces); NCCL's own ``NCCL_DEBUG=INFO`` lines share stdout and can land between rows or
# inside one (NCCL >= 2.22 connects lazily at the first collective, so its ``Channel …`` lines
# appear after the first row's size/count/type columns).

# Open MPI --tag-output ``[1,0]<stdout>:``, Intel MPI/MPICH -prepend-rank ``[0] ``, Slurm --label ``0: ``.
_MPI_PREFIX = re.compile(r"^(?:\[[0-9]+(?:,[0-9]+)*\](?:<std(?:out|err)>)?:?[ \t]?|[ \t]*[0-9]+:[ \t])")
# An NCCL debug line: optional ``[%F %T] `` timestamp, ``host:pid:tid [dev] `` then ``NCCL INFO`` /
# ``file:line NCCL WARN``. Searched anywhere in a line, because it can start right after a row's
# first columns (stdout is shared and rows are printed in pieces).
_NCCL_LOG = re.compile(
    r"(?:\[[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9:]{8}\] )?"
    r"(?P<host>[^\s:\[\]]{0,255}):[0-9]{1,12}:[0-9]{1,12} \[-?[0-9]{1,9}\] (?:[0-9.]{1,30} )?"
    r"(?:[^\s:]{1,255}:[0-9]{1,9} (?:\([^)]{0,255}\) )?)?"
    r"NCCL (?:INFO|WARN|TRACE|ABORT)"
)


def _find_log(line: str) -> re.Match[str] | None:
    """An NCCL log line's prefix inside ``line`` (a log line can interrupt a table row)."""
    return search_near_nccl(line, _NCCL_LOG)


# ``-1[0]``: an MPI launcher's rank tag glued to a printed column. nccl-tests prints one row in
# pieces (common.cu: the size/count/type/redop/root part, then each half), and launchers that tag
# every chunk they forward (Intel MPI / MPICH ``-prepend-rank``, Open MPI ``--tag-output``) put
# ``[0] `` / ``[1,0]<stdout>:`` in front of each piece, i.e. in the middle of the row.
MPI_TAG_INSIDE = re.compile(r"\[[0-9]{1,6}(?:,[0-9]{1,6})*\](?:<std(?:out|err)>)?:?")

# ``-1host0``: a row's last printed column glued to the host name of a log line. A host name that
# itself starts with digits is mis-split here; no way to tell them apart from the text alone.
_NUMERIC_HEAD = re.compile(r"^(-?[0-9]+|N/A)([A-Za-z].*)$")


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """Yield ``(lineno, body)`` with MPI prefixes and NCCL log text removed; a row split by log lines
    is joined again and reported at the line where it started."""
    pending = ""
    pending_no = 0
    lineno = 0
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = _MPI_PREFIX.sub("", raw, count=1)
        m = _find_log(line)
        if m is not None:
            frag = line[: m.start()]
            host_glue = _NUMERIC_HEAD.match(m.group("host") or "")
            if frag.strip() and host_glue:
                frag += host_glue.group(1)
            # text before a log line is kept only as a row's start or the rest of a row already begun
            if frag.strip() and (pending or looks_like_row(frag)):
                if not pending:
                    pending_no = lineno
                pending += frag
            continue
        if pending:
            line = pending + line
            yield pending_no, line
            pending = ""
            continue
        yield lineno, line
    if pending:
        yield pending_no, pending


IN_PLACE = "in-place"
OUT_OF_PLACE = "out-of-place"


@dataclass(frozen=True)
class PerfTable:
    """A whole ``all_reduce_perf`` run.

    ``n_ranks`` counts the ``#  Rank`` lines (all processes under MPI), else nThread × nGpus of the
    header, else the rank count busBw/algBw gives (``n_ranks_basis`` says which; see
    :func:`rank_count`). ``n_ranks_bw`` is n solved from busBw/algBw = 2(n−1)/n,
    ``None`` where the rows give no precise ratio (algBw under 0.5 GB/s) or disagree. ``hosts`` are
    the distinct host names of the rank lines. ``header`` holds the ``#`` key/value lines as printed (``nGpus``,
    ``graph``, ``Avg bus bandwidth`` …). ``devices`` is the GPU name of each rank line in order.
    ``dropped`` lists the lines that looked like data rows but were not read, ``problems`` the same
    and other notes as text.
    """

    rows: tuple[PerfRow, ...]
    n_ranks: int | None
    avg_busbw_gbps: float | None
    header: dict[str, str]
    devices: tuple[str, ...]
    source: str
    problems: tuple[str, ...] = ()
    dropped: tuple[DroppedRow, ...] = ()
    n_ranks_bw: int | None = None
    n_ranks_basis: str | None = None
    hosts: tuple[str, ...] = ()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(r.size_bytes for r in self.rows)

    def time_us(self, msg_bytes: int, *, in_place: bool = False) -> float | None:
        """Measured all-reduce time of one ``msg_bytes`` message on this box, in µs.

        Parameters
        ----------
        msg_bytes : int
            Message size in bytes (nccl-tests' ``size`` column: the whole buffer, not per rank).
        in_place : bool
            Read the in-place half of the table instead of the out-of-place one.

        Returns
        -------
        float or None
            The row's time where the table has that size; between two measured sizes, the
            straight line between the neighbouring rows in log(size)-log(time) (all_reduce_perf
            steps sizes by a factor, and time is close to a power law between two steps); ``None``
            below the smallest or above the largest measured size (no extrapolation), or when the
            table holds no usable time there. The first row of a size wins where a size repeats.

        Raises
        ------
        ValueError
            ``msg_bytes`` is not an integer >= 0.
        """
        if isinstance(msg_bytes, bool) or not isinstance(msg_bytes, int) or msg_bytes < 0:
            raise ValueError(f"msg_bytes must be an integer >= 0, got {msg_bytes!r}")
        pts: dict[int, float] = {}
        for r in self.rows:
            t = r.ip_time_us if in_place else r.oop_time_us
            if r.size_bytes not in pts and math.isfinite(t) and t > 0:
                pts[r.size_bytes] = t
        if msg_bytes in pts:
            return pts[msg_bytes]
        sizes = sorted(s for s in pts if s > 0)
        if not sizes or msg_bytes < sizes[0] or msg_bytes > sizes[-1]:
            return None
        for lo, hi in itertools.pairwise(sizes):
            if lo < msg_bytes < hi:
                f = (math.log(msg_bytes) - math.log(lo)) / (math.log(hi) - math.log(lo))
                return math.exp(math.log(pts[lo]) + f * (math.log(pts[hi]) - math.log(pts[lo])))
        return None  # unreachable: msg_bytes is inside [sizes[0], sizes[-1]] and not a row

    def verify_time_us(self, msg_bytes: int) -> tuple[float | None, str | None]:
        """The all-reduce time of one ``msg_bytes`` verify message, as fastverify reads the table
        everywhere (``topo`` and ``tune``): the in-place column, the out-of-place one only where
        the in-place column has no usable time for that size. SGLang's all-reduce on the NCCL path
        is in place: ``GroupCoordinator.all_reduce`` ends in ``_all_reduce_in_place``, which calls
        pynccl's ``all_reduce(input_)`` (``ncclAllReduce`` with the same pointer as send and receive
        buffer) or ``torch.distributed.all_reduce(input_)``, both writing into their input (sglang
        ``srt/distributed/parallel_state.py``, ``device_communicators/pynccl.py``).

        Returns
        -------
        (float or None, str or None)
            The time in µs (:meth:`time_us`: a row, or interpolated between two rows; ``None``
            outside the measured sizes) and the column read, ``"in-place"`` or ``"out-of-place"``
            (``None`` with no time).

        Raises
        ------
        ValueError
            ``msg_bytes`` is not an integer >= 0.
        """
        in_place = all(math.isfinite(r.ip_time_us) and r.ip_time_us > 0 for r in self._around(msg_bytes))
        t = self.time_us(msg_bytes, in_place=in_place)
        if t is None and in_place:
            in_place, t = False, self.time_us(msg_bytes, in_place=False)
        return (t, IN_PLACE if in_place else OUT_OF_PLACE) if t is not None else (None, None)

    def _around(self, msg_bytes: int) -> list[PerfRow]:
        """The rows a time at ``msg_bytes`` is read from: the first row of that size, else the
        nearest smaller and larger sizes; empty outside the table."""
        if isinstance(msg_bytes, bool) or not isinstance(msg_bytes, int) or msg_bytes < 0:
            raise ValueError(f"msg_bytes must be an integer >= 0, got {msg_bytes!r}")
        first: dict[int, PerfRow] = {}
        for r in self.rows:
            first.setdefault(r.size_bytes, r)
        if msg_bytes in first:
            return [first[msg_bytes]]
        lo = [s for s in first if s < msg_bytes]
        hi = [s for s in first if s > msg_bytes]
        return [first[max(lo)], first[min(hi)]] if lo and hi else []

    def several_nodes(self, gpus: int | None) -> str | None:
        """The warning for a table that ran across several nodes, or ``None``: its rank lines name
        more than one host, or its busBw/algBw rank count exceeds ``gpus`` (the GPU count of the
        box it is read for; ``None`` when unknown) and the ranks its own lines name. The text starts
        with :attr:`source`."""
        if len(self.hosts) > 1:
            return (
                f"{self.source}: this table ran on {self.n_ranks} ranks on {len(self.hosts)} hosts (its '# Rank' "
                "lines), several nodes: its times are not this box's"
            )
        # a table whose own rank lines count as many ranks as busBw/algBw says is one box of that
        # size (another world size, not several nodes)
        own = self.n_ranks_basis != "busBw/algBw" and self.n_ranks == self.n_ranks_bw
        if self.n_ranks_bw is not None and gpus is not None and self.n_ranks_bw > gpus and not own:
            return (
                f"{self.source}: this table ran on about {self.n_ranks_bw} ranks (busBw/algBw), likely several "
                "nodes: its times are not this box's"
            )
        return None

    def dropped_warning(self) -> str | None:
        """One line summarising :attr:`dropped` (count, first line and reason), or ``None``."""
        if not self.dropped:
            return None
        d = self.dropped[0]
        more = f" ({len(self.dropped) - 1} more)" if len(self.dropped) > 1 else ""
        return (
            f"{self.source}: {len(self.dropped)} data row(s) dropped; the first, line {d.line}: {d.reason}{more}: "
            f"{d.text}"
        )

    def summary(self) -> dict:
        """What the table holds, for a report: row count, size range (B), ranks, GPU names, data
        types, the out-of-place time at the smallest and largest size (µs), the peak out-of-place
        bus bandwidth (GB/s) and its size, the footer's average bus bandwidth, dropped lines."""
        rows = self.rows
        peak = max(rows, key=lambda r: r.oop_busbw_gbps)
        first, last = min(rows, key=lambda r: r.size_bytes), max(rows, key=lambda r: r.size_bytes)
        return {
            "source": self.source,
            "rows": len(rows),
            "min_bytes": first.size_bytes,
            "max_bytes": last.size_bytes,
            "n_ranks": self.n_ranks,
            "n_ranks_basis": self.n_ranks_basis,
            "n_ranks_bw": self.n_ranks_bw,
            "hosts": len(self.hosts),
            "devices": sorted(set(self.devices)),
            "dtypes": sorted({r.dtype for r in rows}),
            "redops": sorted({r.redop for r in rows}),
            "time_us_at_min": first.oop_time_us,
            "time_us_at_max": last.oop_time_us,
            "peak_busbw_gbps": peak.oop_busbw_gbps,
            "peak_busbw_bytes": peak.size_bytes,
            "avg_busbw_gbps": self.avg_busbw_gbps,
            "graph": self.header.get("graph"),
            "problems": list(self.problems),
            "dropped": [{"line": d.line, "reason": d.reason} for d in self.dropped],
            "label": "measured",
        }

    def row(self, size_bytes: int) -> PerfRow:
        """The first row of ``size_bytes``; ``KeyError`` naming the sizes present if there is none."""
        for r in self.rows:
            if r.size_bytes == size_bytes:
                return r
        raise KeyError(f"no row of {size_bytes} B in {self.source}; sizes: {list(self.sizes)}")


def algbw_from_time(size_bytes: int, time_us: float) -> float:
    """Algorithm bandwidth in GB/s: ``size / time`` (nccl-tests ``doc/PERFORMANCE.md``)."""
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
    if not time_us > 0:
        raise ValueError(f"time_us must be > 0, got {time_us}")
    return size_bytes / 1e3 / time_us  # B / µs = 1e6 B/s; / 1e3 → GB/s


def busbw_from_time(size_bytes: int, time_us: float, n_ranks: int) -> float:
    """All-reduce bus bandwidth in GB/s: ``algBw · 2(n−1)/n`` (nccl-tests ``src/all_reduce.cu``).

    Raises ``ValueError`` for ``n_ranks < 1``, a negative size or a time that is not positive.
    """
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    return algbw_from_time(size_bytes, time_us) * 2 * (n_ranks - 1) / n_ranks


def parse_all_reduce_perf(text: str, *, source: str = "<text>") -> PerfTable:
    """Parse ``all_reduce_perf`` stdout.

    Parameters
    ----------
    text
        The whole output, as printed (MPI rank prefixes and NCCL log lines may be mixed in).
    source
        Name of the input used in messages (a file path).

    Returns
    -------
    PerfTable
        Rows in file order; lines that started like a data row but did not parse (a row cut off at
        the end of the file) are dropped and listed in ``problems``.

    Raises
    ------
    UserError
        One line naming ``source`` and a line number when no complete data row is found, or when a
        row (or the footer's average bus bandwidth) holds a value past fastverify's plausibility
        bounds: a nan, inf or negative time or bandwidth, a time over 1 hour, a size or count that
        is negative or over 1 TiB, a bandwidth over 1e6 GB/s.
    """
    if not isinstance(text, str):
        raise UserError(f"{source}: expected all_reduce_perf output as text, got {type(text).__name__}")
    reader = _Reader(source, last_line=len(text.splitlines()))
    for lineno, body in logical_lines(text):
        reader.line(lineno, body)
    return reader.table()


class _Reader:
    """The table read so far, one logical line at a time (:func:`parse_all_reduce_perf`)."""

    def __init__(self, source: str, last_line: int) -> None:
        self.source = source
        self.last_line = last_line  # a row on it may be cut off
        self.header: dict[str, str] = {}
        self.ranks: dict[int, str] = {}
        self.rows: list[PerfRow] = []
        self.problems: list[str] = []
        self.dropped: list[DroppedRow] = []
        self.hosts: dict[str, None] = {}
        self.layout: Layout | None = None
        self.header_line = 0
        self.n_lines = 0
        self.size_lines: dict[tuple[int, str, str], int] = {}  # (size, type, redop) -> line, this table
        self.row_layout: Layout | None = None  # the layout the last row was read with

    def line(self, lineno: int, body: str) -> None:
        self.n_lines = lineno
        s = body.strip()
        if not s:
            return
        if s.startswith("#"):
            self._hash_line(lineno, s)
        else:
            self._data_line(lineno, s)

    def _hash_line(self, lineno: int, s: str) -> None:
        """A column-header row (the layout of the rows after it) or a header line."""
        cols = is_column_header(s[1:])
        if cols is not None:
            if self.rows and self.header_line:
                self.problems.append(f"line {lineno}: a second table starts here; its rows are appended")
            self.layout = layout_from_header(cols)
            self.header_line = lineno
            self.size_lines = {}
            return
        avg_before = self.header.get("Avg bus bandwidth")
        read_header_line(s, self.header, self.ranks, self.hosts)
        if self.header.get("Avg bus bandwidth") is not avg_before:
            avg = avg_busbw(self.header)
            if avg is not None and (why := implausible_bandwidth(avg)):
                raise UserError(
                    f"{self.source}: line {lineno}: Avg bus bandwidth {why}: not a measured all_reduce_perf value"
                )

    def _data_line(self, lineno: int, s: str) -> None:
        """A data row, or a line that looks like one and is dropped with its reason."""
        if "[" in s:
            s = MPI_TAG_INSIDE.sub(" ", s).strip()
        tokens = s.split()
        lay = self.layout or GUESSES.get(len(tokens))
        row = parse_row(tokens, lay, lineno) if lay is not None else None
        if row is not None:
            if why := implausible(row):
                raise UserError(f"{self.source}: line {lineno}: {why}: not a measured all_reduce_perf row")
            if lay is not self.row_layout:  # rows of another width: another build's table
                self.row_layout, self.size_lines = lay, {}
            key = (row.size_bytes, row.dtype, row.redop)
            if (first := self.size_lines.get(key)) is not None:
                raise UserError(
                    f"{self.source}: line {lineno}: {row.size_bytes:,} B {row.dtype} {row.redop} again (first on "
                    f"line {first}); all_reduce_perf prints each size once per table, so which row holds is not known"
                )
            self.size_lines[key] = lineno
            self.rows.append(row)
        elif (why := drop_reason(tokens, self.layout or lay, last=lineno == self.last_line)) is not None:
            self.dropped.append(DroppedRow(lineno, why, clip(s)))
            self.problems.append(f"line {lineno}: data row dropped ({why}): {clip(s)}")

    def table(self) -> PerfTable:
        """The :class:`PerfTable` of the lines read; ``UserError`` when it has no data row."""
        if not self.rows:
            if self.problems:
                raise UserError(f"{self.source}: {self.problems[0]}; no complete all_reduce_perf data row")
            where = (
                f"line {self.header_line}: column header is followed by"
                if self.header_line
                else f"line {max(self.n_lines, 1)}:"
            )
            raise UserError(
                f"{self.source}: {where} no all_reduce_perf data rows (size count type redop … time algbw busbw)"
            )
        bw_ranks = ranks_from_bw(self.rows)
        n_ranks, basis = rank_count(self.header, self.ranks, bw_ranks)
        return PerfTable(
            rows=tuple(self.rows),
            n_ranks=n_ranks,
            avg_busbw_gbps=avg_busbw(self.header),
            header=self.header,
            devices=tuple(self.ranks[r] for r in sorted(self.ranks)),
            source=self.source,
            problems=tuple(self.problems),
            dropped=tuple(self.dropped),
            n_ranks_bw=bw_ranks,
            n_ranks_basis=basis,
            hosts=tuple(self.hosts),
        )
