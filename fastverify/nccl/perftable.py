"""Read the text output of nccl-tests ``all_reduce_perf`` into a :class:`PerfTable`.

The format (NVIDIA/nccl-tests ``src/util.cu`` and ``src/common.cu``; older layouts from nccl-tests
issue threads) is read in three parts: the noise removed first, MPI prefixes and NCCL log lines
mixed into the rows (:mod:`fastverify.nccl.perflines`); the data rows
(:mod:`fastverify.nccl.perfrows`); the ``#`` header lines and the rank count
(:mod:`fastverify.nccl.perfheader`).

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
from dataclasses import dataclass

from fastverify.bounds import implausible_bandwidth
from fastverify.errors import UserError
from fastverify.nccl.perfheader import avg_busbw, rank_count, ranks_from_bw, read_header_line
from fastverify.nccl.perflines import MPI_TAG_INSIDE, logical_lines
from fastverify.nccl.perfrows import (
    GUESSES,
    DroppedRow,
    Layout,
    PerfRow,
    clip,
    drop_reason,
    implausible,
    is_column_header,
    layout_from_header,
    parse_row,
)

__all__ = ["DroppedRow", "PerfRow", "PerfTable", "algbw_from_time", "busbw_from_time", "parse_all_reduce_perf"]

IN_PLACE = "in-place"
OUT_OF_PLACE = "out-of-place"


@dataclass(frozen=True)
class PerfTable:
    """A whole ``all_reduce_perf`` run.

    ``n_ranks`` counts the ``#  Rank`` lines (all processes under MPI), else nThread × nGpus of the
    header, else the rank count busBw/algBw gives (``n_ranks_basis`` says which; see
    :mod:`fastverify.nccl.perfheader`). ``n_ranks_bw`` is n solved from busBw/algBw = 2(n−1)/n,
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
            return (f"{self.source}: this table ran on {self.n_ranks} ranks on {len(self.hosts)} hosts (its '# Rank' "
                    "lines), several nodes: its times are not this box's")
        # a table whose own rank lines count as many ranks as busBw/algBw says is one box of that
        # size (another world size, not several nodes)
        own = self.n_ranks_basis != "busBw/algBw" and self.n_ranks == self.n_ranks_bw
        if self.n_ranks_bw is not None and gpus is not None and self.n_ranks_bw > gpus and not own:
            return (f"{self.source}: this table ran on about {self.n_ranks_bw} ranks (busBw/algBw), likely several "
                    "nodes: its times are not this box's")
        return None

    def dropped_warning(self) -> str | None:
        """One line summarising :attr:`dropped` (count, first line and reason), or ``None``."""
        if not self.dropped:
            return None
        d = self.dropped[0]
        more = f" ({len(self.dropped) - 1} more)" if len(self.dropped) > 1 else ""
        return (f"{self.source}: {len(self.dropped)} data row(s) dropped; the first, line {d.line}: {d.reason}{more}: "
                f"{d.text}")

    def summary(self) -> dict:
        """What the table holds, for a report: row count, size range (B), ranks, GPU names, data
        types, the out-of-place time at the smallest and largest size (µs), the peak out-of-place
        bus bandwidth (GB/s) and its size, the footer's average bus bandwidth, dropped lines."""
        rows = self.rows
        peak = max(rows, key=lambda r: r.oop_busbw_gbps)
        first, last = min(rows, key=lambda r: r.size_bytes), max(rows, key=lambda r: r.size_bytes)
        return {
            "source": self.source, "rows": len(rows), "min_bytes": first.size_bytes, "max_bytes": last.size_bytes,
            "n_ranks": self.n_ranks, "n_ranks_basis": self.n_ranks_basis, "n_ranks_bw": self.n_ranks_bw,
            "hosts": len(self.hosts), "devices": sorted(set(self.devices)), "dtypes": sorted({r.dtype for r in rows}),
            "redops": sorted({r.redop for r in rows}),
            "time_us_at_min": first.oop_time_us, "time_us_at_max": last.oop_time_us,
            "peak_busbw_gbps": peak.oop_busbw_gbps, "peak_busbw_bytes": peak.size_bytes,
            "avg_busbw_gbps": self.avg_busbw_gbps, "graph": self.header.get("graph"),
            "problems": list(self.problems), "dropped": [{"line": d.line, "reason": d.reason} for d in self.dropped],
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
            return
        avg_before = self.header.get("Avg bus bandwidth")
        read_header_line(s, self.header, self.ranks, self.hosts)
        if self.header.get("Avg bus bandwidth") is not avg_before:
            avg = avg_busbw(self.header)
            if avg is not None and (why := implausible_bandwidth(avg)):
                raise UserError(f"{self.source}: line {lineno}: Avg bus bandwidth {why}: not a measured "
                                "all_reduce_perf value")

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
            self.rows.append(row)
        elif (why := drop_reason(tokens, self.layout or lay, last=lineno == self.last_line)) is not None:
            self.dropped.append(DroppedRow(lineno, why, clip(s)))
            self.problems.append(f"line {lineno}: data row dropped ({why}): {clip(s)}")

    def table(self) -> PerfTable:
        """The :class:`PerfTable` of the lines read; ``UserError`` when it has no data row."""
        if not self.rows:
            if self.problems:
                raise UserError(f"{self.source}: {self.problems[0]}; no complete all_reduce_perf data row")
            where = (f"line {self.header_line}: column header is followed by" if self.header_line
                     else f"line {max(self.n_lines, 1)}:")
            raise UserError(f"{self.source}: {where} no all_reduce_perf data rows "
                            "(size count type redop … time algbw busbw)")
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
