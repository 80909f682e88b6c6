"""One bounded pass over a ``.tar.gz``: the reader under :func:`fastverify.bundle.open_bundle`.

The gzip stream is inflated here (``zlib``, one gzip member) and the tar read from it in stream
mode (``tarfile`` ``r|``), so the archive is read once, front to back, and nothing is read twice:

- at most ``max_inflated`` bytes are inflated in all (headers, data and padding alike), whatever
  the headers declare;
- any byte after the end of the gzip data (zeros appended by a copy tool, a second gzip member,
  anything) is refused at once from the file's size, without reading it;
- after the tar's end-of-archive block, at most :data:`MAX_TAIL_BYTES` of zero padding may follow
  inside the gzip data (``tarfile`` pads to 10,240-byte records); more, or anything not zero, is
  refused;
- an extended header (pax ``x``/``g``, GNU long name or link) over :data:`MAX_HEADER_BYTES` is
  refused before it is read (``tarfile`` would read it whole into memory);
- a sparse member (GNU sparse, or pax ``GNU.sparse.*``), which inflates past its stored size, is
  refused;
- a member time (``mtime``, pax or not, and a pax ``atime`` or ``ctime``) that is not a finite
  number of seconds within ±:data:`MAX_TIME_S` (a pax ``mtime`` of ``nan``, ``1e30`` or ``abc``)
  is refused.

Every refusal is an :class:`ArchiveRefused` whose text is one line without the file's name (the
caller names it); a cut or damaged stream raises ``EOFError``, ``zlib.error`` or
``tarfile.TarError`` as the standard library does.
"""

from __future__ import annotations

import math
import os
import re
import tarfile
import zlib
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["MAX_HEADER_BYTES", "MAX_TAIL_BYTES", "MAX_TIME_S", "ArchiveRefused", "members"]

MAX_HEADER_BYTES = 1 << 20
"""Largest extended header (bytes): a pax header of a path of 4,096 bytes and a few fields is
~4.2 KB; 1 MiB leaves a wide margin and bounds the memory ``tarfile`` takes for one."""
MAX_TAIL_BYTES = 1 << 20
"""Most zero bytes after the end-of-archive block, inside the gzip data: ``tarfile`` and GNU tar
pad to a record of 10,240 bytes (GNU tar's ``--record-size`` is at most a few hundred KiB)."""
MAX_TIME_S = 1e11
"""Largest member time (seconds from 1970, either sign): year ~5100; a pax ``mtime`` past it (or
NaN) is no time, and ``os.utime`` raises on it."""
_PAX_TIMES = ("mtime", "atime", "ctime")
_PAX_TIME = re.compile(r"-?[0-9]{1,20}(\.[0-9]{0,20})?")
"""A pax time as POSIX writes it (``pax``, "extended header keyword descriptions"): decimal
seconds with an optional fraction; ``nan``, ``inf``, ``1e30`` and ``abc`` are no such time."""
_CHUNK = 1 << 20
_LONG_HEADERS = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)


class ArchiveRefused(Exception):
    """The archive is hostile or altered; ``str()`` is one line that does not name the file."""


class _Inflate:
    """A single-member gzip stream as a read-only file of at most ``cap`` inflated bytes; at the
    end of the gzip data, anything left in the file is refused."""

    def __init__(self, raw: BinaryIO, cap: int) -> None:
        self._raw, self._cap = raw, cap
        self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._pending = b""  # compressed input not yet inflated
        self.total = 0  # inflated bytes handed out
        self.eof = False

    def read(self, n: int = -1) -> bytes:
        n = _CHUNK if n is None or n < 0 else n
        out: list[bytes] = []
        got = 0
        while got < n and not self.eof:
            exhausted = False
            if not self._pending:
                self._pending = self._raw.read(_CHUNK)
                exhausted = not self._pending
            piece = self._d.decompress(self._pending, n - got)
            self._pending = self._d.unconsumed_tail
            if exhausted and not piece and not self._d.eof:
                raise EOFError("the gzip stream ends early")
            got += len(piece)
            out.append(piece)
            if self._d.eof:
                self.eof = True
                self._check_end()
        self.total += got
        if self.total > self._cap:
            raise ArchiveRefused(f"inflates to over {self._cap:,} bytes, the most a bundle may hold")
        return b"".join(out)

    def _check_end(self) -> None:
        left = len(self._d.unused_data) + os.fstat(self._raw.fileno()).st_size - self._raw.tell()
        if left > 0:
            raise ArchiveRefused(
                f"{left:,} bytes after the end of the gzip data (appended to the file, or a "
                "second archive); copy the bundle again"
            )


class _Info(tarfile.TarInfo):
    """``tarfile``'s member header with the bounds of the module docstring applied before any
    extended header is read."""

    def _proc_member(self, tarfile_):  # the hook tarfile calls for every header it reads
        if self.type in _LONG_HEADERS and self.size > MAX_HEADER_BYTES:
            raise ArchiveRefused(f"an extended header of {self.size:,} bytes (over {MAX_HEADER_BYTES:,})")
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise ArchiveRefused(f"{self.name!r}: a sparse member")
        return super()._proc_member(tarfile_)


def _check_member(m: tarfile.TarInfo) -> None:
    if m.sparse is not None:
        raise ArchiveRefused(f"{m.name!r}: a sparse member")
    t = m.mtime
    bad = isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and abs(t) <= MAX_TIME_S)
    for key in _PAX_TIMES:  # tarfile keeps the header's time for a pax value it cannot read ("abc")
        text = m.pax_headers.get(key)
        if text is not None and not (_PAX_TIME.fullmatch(text) and abs(float(text)) <= MAX_TIME_S):
            t, bad = text, True
            break
    if bad:
        raise ArchiveRefused(
            f"{m.name!r}: a member time of {t!r:.80} s (not a finite time within ±{MAX_TIME_S:g} "
            "s): a damaged or hand-made pax header"
        )


def members(raw: BinaryIO, *, max_inflated: int) -> Iterator[tuple[tarfile.TarInfo, tarfile.ExFileObject | None]]:
    """Each member of the gzip-compressed tar ``raw`` (a regular file opened for reading, at the
    start of the gzip data), in order, with a reader of its data (None but for a regular file;
    good until the next member is asked for; its unread data is then inflated and dropped). After the last member the tail and
    the gzip trailer are checked (CRC and length: a cut or altered archive fails).

    Raises
    ------
    ArchiveRefused
        A bound of the module docstring is broken.
    EOFError, zlib.error, tarfile.TarError
        A cut or damaged archive, as the standard library says it.
    """
    stream = _Inflate(raw, max_inflated)
    tar = tarfile.open(fileobj=stream, mode="r|", tarinfo=_Info)  # noqa: SIM115 - holds only stream, ours
    while (m := tar.next()) is not None:
        _check_member(m)
        yield m, tar.extractfile(m) if m.isreg() else None  # never a link's target
        tar.members = []  # keep no index of TarInfo objects: a hostile archive can hold millions
    tail = 0
    while chunk := stream.read(_CHUNK):  # the padding after the end-of-archive block, to the trailer
        tail += len(chunk)
        if tail > MAX_TAIL_BYTES or chunk.strip(b"\0"):
            raise ArchiveRefused("data after the tar's end-of-archive block (an altered archive)")
