"""The noise removed from ``all_reduce_perf`` output before its rows are read.

MPI launchers prefix each line (``[0] ``, ``[1,0]<stdout>:``, Slurm ``0: ``), and those that tag
every chunk they forward put the tag inside a row too (``-1[0]``, ``0[0]``: nccl-tests writes a
row in pieces); NCCL's own ``NCCL_DEBUG=INFO`` lines share stdout and can land between rows or
inside one (NCCL >= 2.22 connects lazily at the first collective, so its ``Channel …`` lines
appear after the first row's size/count/type columns).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from fastverify.nccl.loglines import search_near_nccl
from fastverify.nccl.perfrows import looks_like_row

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
