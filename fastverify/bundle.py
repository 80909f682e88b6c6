"""The support bundle of ``fastverify collect``: one ``.tar.gz`` that ``fastverify report`` reads.

Layout: ``manifest.json`` is the first member (a :class:`Manifest`, msgspec-encoded JSON), then
the part files under their arcnames (:data:`ARCNAMES`; relative POSIX paths, no ``..``, no
absolute path, regular files only). Every part of :data:`PART_NAMES` is listed in the manifest,
``ok``, ``skipped`` or ``failed``, with why and the files it brought.

:func:`write_bundle` writes atomically (a temporary file in the same folder, then ``os.replace``)
and never replaces a file that is not a bundle, nor one of the files it collects.
:func:`open_bundle` reads the archive once, front to back (below: inflated
bytes bounded, nothing after the gzip data, extended headers and member times checked), copying
each listed member into a private temporary folder as it passes; nothing is read twice. Refused
in one :class:`~fastverify.errors.UserError` line naming the file: not gzip, not a tar, truncated
(the gzip trailer is checked), bytes after the gzip data, no ``manifest.json`` first, another
schema or version, a manifest figure out of bounds (:func:`manifest_figure_problem`), a member
named in the manifest but absent, a member it does not list (refused at its header, unread),
``..``, an absolute name, a link, a device or a directory, or sizes past :data:`MAX_MEMBER_BYTES`
/ :data:`MAX_TOTAL_BYTES` / :data:`MAX_MANIFEST_BYTES`. A listed member over the cap its kind
has as a file (:func:`member_kind`, :data:`fastverify.inputs.CAPS`: 16 MiB for text and small
JSON, 512 MiB for the NCCL log) is left uncopied: the bundle opens, and reading that member says
why (:attr:`Bundle.unreadable`), so a report names the part it could not read and reports the rest.

One bounded pass over a ``.tar.gz``: the reader under :func:`open_bundle`.

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

import io
import math
import os
import posixpath
import re
import shutil
import stat
import tarfile
import tempfile
import time
import weakref
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import msgspec

from fastverify import bounds as B
from fastverify.bounds import duplicate_json_key
from fastverify.errors import UserError, one_line, path_text, printable
from fastverify.inputs import CAPS, check_regular, decode_json

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


__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_TAIL_BYTES",
    "MAX_TIME_S",
    "ArchiveRefused",
    "members",
    "ARCNAMES",
    "MANIFEST_NAME",
    "PART_NAMES",
    "SCHEMA",
    "SCHEMA_VERSION",
    "STATUSES",
    "Bundle",
    "Manifest",
    "Part",
    "is_bundle",
    "open_bundle",
    "write_bundle",
]

SCHEMA = "fastverify.bundle"
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
PART_NAMES = (
    "doctor",
    "nvidia_smi_topo",
    "nvml",
    "host_iommu",
    "p2p_check",
    "nccl_log",
    "sweep",
    "server_args",
    "server_trace",
    "verify_log",
)
STATUSES = ("ok", "skipped", "failed")
ARCNAMES = {
    "doctor": "doctor.json",
    "nvidia_smi_topo": "topo/nvidia-smi-topo.txt",
    "nvml": "topo/nvml.json",
    "host_iommu": "host/iommu.json",
    "p2p_check": "p2p.json",
    "nccl_log": "nccl/nccl-debug.log",
    "sweep": "sweep/tune.json",
    "server_args": "server/server_info.json",
    "server_trace": "server/traces/",  # + the trace file's own name, one per TP rank
    "verify_log": "verify-log/",  # + the record's (or trace's) own name
}
"""Where each part's files go: a fixed name, or a folder (ending in ``/``) for files that keep
their original names."""

GiB, MiB = 1 << 30, 1 << 20
MAX_MEMBER_BYTES = 2 * GiB
"""Largest member (bytes); a TP rank's GPU trace of a real verify run is ~60 MB gzipped."""
MAX_TOTAL_BYTES = 16 * GiB
"""Largest sum of member sizes (bytes): 8 ranks of large traces fit; a tar bomb does not."""
MAX_MANIFEST_BYTES = 4 * MiB
MAX_MEMBERS = 10_000
MAX_HEADERS_BYTES = 256 * MiB
"""Inflated bytes allowed on top of :data:`MAX_TOTAL_BYTES` for headers and padding: 10,000
members of 512-byte headers and 4 KiB pax headers take ~45 MB."""
TRACE_SUFFIXES = (".trace.json", ".trace.json.gz")
COMPRESS_LEVEL = 6  # tarfile's default 9 costs much time on already-gzipped traces for ~no gain
_CHUNK = 1 << 20


class Part(msgspec.Struct, frozen=True):
    """One part of the bundle: ``status`` ``ok`` / ``skipped`` / ``failed``, ``reason`` one line
    (None when ok), its ``files`` (arcnames), wall time ``seconds`` (s) and small facts ``meta``."""

    name: str
    status: str
    reason: str | None
    files: tuple[str, ...] = ()
    seconds: float = 0.0
    meta: dict = {}


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """``manifest.json``: who wrote the bundle, when (ISO 8601 UTC), on which host, within which
    time budget (s), and every part of :data:`PART_NAMES` in that order."""

    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    created_utc: str
    fastverify_version: str
    host: dict
    budget_s: float
    elapsed_s: float
    parts: tuple[Part, ...]

    def part(self, name: str) -> Part | None:
        return next((p for p in self.parts if p.name == name), None)


# ---- names ----------------------------------------------------------------------------------------


def arcname_problem(name: object) -> str | None:
    """Why ``name`` cannot be a member name (None when it can): it must be a non-empty relative
    POSIX path in normal form, without ``..``, ``.``, empty components, backslashes or NUL."""
    if not isinstance(name, str) or not name:
        return "an empty name"
    if "\x00" in name or "\\" in name:
        return f"{name!r}: a NUL or backslash in the name"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return f"{name!r}: an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return f"{name!r}: a '..' component"
    if any(p in ("", ".") for p in parts) or posixpath.normpath(name) != name:
        return f"{name!r}: not a plain relative path"
    return None


def _check_manifest(m: Manifest, where: str) -> None:
    """Raise UserError (``where``: the file) unless ``m`` is a valid version-1 manifest."""
    names = [p.name for p in m.parts]
    if len(set(names)) != len(names):
        raise UserError(f"{where}: manifest.json lists a part twice ({', '.join(sorted(names))})")
    for p in m.parts:
        if p.name not in PART_NAMES:
            raise UserError(f"{where}: manifest.json: unknown part {p.name!r} (known: {', '.join(PART_NAMES)})")
        if p.status not in STATUSES:
            raise UserError(
                f"{where}: manifest.json: part {p.name} has status {p.status!r}, not one of {', '.join(STATUSES)}"
            )
        for f in p.files:
            why = arcname_problem(f)
            if why is not None or f == MANIFEST_NAME:
                raise UserError(f"{where}: manifest.json: part {p.name} names a bad file ({why or f})")


def encode_manifest(m: Manifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(m), indent=2) + b"\n"


def decode_manifest(data: bytes, where: str) -> Manifest:
    """The manifest in ``data``; UserError naming ``where`` for bad JSON, another schema or version,
    a key given twice in one object, or a field of the wrong type."""
    raw = decode_json(data, where, what="manifest.json", unique_keys=False)  # checked below, after the schema
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        got = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
        raise UserError(f"{where}: manifest.json has schema {got!r}, not {SCHEMA!r}: not a fastverify bundle")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise UserError(
            f"{where}: bundle schema version {raw.get('schema_version')!r}; this fastverify reads "
            f"version {SCHEMA_VERSION}"
        )
    if (key := duplicate_json_key(data)) is not None:
        raise UserError(f"{where}:manifest.json: the key {one_line(repr(key), 80)} is given twice in one object")
    try:
        m = msgspec.convert(raw, Manifest)
    except msgspec.ValidationError as e:
        raise UserError(f"{where}: manifest.json: {e}") from None
    _check_manifest(m, where)
    why = manifest_figure_problem(m)
    if why is not None:
        raise UserError(f"{where}: manifest.json: {why} (an altered or damaged bundle)")
    return m


# ---- writing --------------------------------------------------------------------------------------


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _check_target(path: Path, files: Mapping[str, bytes | Path]) -> None:
    for name, src in files.items():
        if isinstance(src, Path) and _same_file(path, src):
            raise UserError(f"{path}: is the collected file {src} ({name}); a bundle never replaces its input")
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise UserError(f"{path}: exists and is not a regular file; give a new file name for the bundle")
        if not is_bundle(path):
            raise UserError(f"{path}: exists and is not a fastverify bundle; it is never replaced (give a new name)")


def _tarinfo(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = size, int(mtime), 0o644, tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add_file(tar: tarfile.TarFile, name: str, src: Path) -> None:
    """Add ``src`` (a regular file, links followed) as ``name``: its size when opened is what is
    copied, so a file that grows meanwhile still gives a whole member."""
    with open(src, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{src}: is not a regular file; only regular files go into a bundle")
        if st.st_size > MAX_MEMBER_BYTES:
            raise UserError(
                f"{src}: {st.st_size / GiB:.1f} GiB, over the bundle's {MAX_MEMBER_BYTES // GiB} GiB limit per file"
            )
        tar.addfile(_tarinfo(name, st.st_size, st.st_mtime), f)


def write_bundle(path: str | Path, manifest: Manifest, files: Mapping[str, bytes | Path]) -> None:
    """Write the bundle at ``path`` atomically: ``manifest.json`` first, then ``files`` (arcname ->
    bytes, or a Path to copy) in their order.

    Raises
    ------
    UserError
        ``path`` exists and is not a fastverify bundle (or not a regular file), is one of the
        collected files, or cannot be written (one line naming it).
    ValueError
        A bad arcname, or files and the manifest's lists disagree (a programming error).
    """
    path = Path(path)
    listed = [f for p in manifest.parts for f in p.files]
    for name in files:
        why = arcname_problem(name)
        if why is not None or name == MANIFEST_NAME:
            raise ValueError(f"bad bundle member name: {why or name}")
    if sorted(listed) != sorted(files):
        raise ValueError(f"the manifest lists {sorted(listed)} but the files are {sorted(files)}")
    _check_manifest(manifest, str(path))
    _check_target(path, files)
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".part")
    except OSError as e:
        raise UserError(f"{path}: cannot write in {folder or '.'} ({e.strerror or e})") from None
    try:
        with os.fdopen(fd, "wb") as out:
            with tarfile.open(fileobj=out, mode="w:gz", compresslevel=COMPRESS_LEVEL, format=tarfile.PAX_FORMAT) as tar:
                now = time.time()
                data = encode_manifest(manifest)
                tar.addfile(_tarinfo(MANIFEST_NAME, len(data), now), io.BytesIO(data))
                for name, src in files.items():
                    if isinstance(src, Path):
                        _add_file(tar, name, src)
                    else:
                        tar.addfile(_tarinfo(name, len(src), now), io.BytesIO(bytes(src)))
            out.flush()
            os.fsync(out.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a bundle is an ordinary file
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"{path}: cannot write the bundle ({e.strerror or e})") from None
    finally:  # Ctrl-C, a full disk, any error: no half-written file is left
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---- bounds on the manifest's figures: a figure past fastverify.bounds is no measurement (an altered or
# damaged bundle), refused when a bundle is read back, never when one is written

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


# ---- reading --------------------------------------------------------------------------------------


def _member_problem(m: tarfile.TarInfo) -> str | None:
    why = arcname_problem(m.name)
    if why is not None:
        return why
    if m.issym() or m.islnk():
        return f"{m.name!r}: a link"
    if m.ischr() or m.isblk() or m.isfifo():
        return f"{m.name!r}: a device or FIFO"
    if not m.isreg():
        return f"{m.name!r}: not a regular file"
    return None


def member_kind(arcname: str) -> str:
    """The input kind whose size cap (:data:`fastverify.inputs.CAPS`) a member gets, as the same
    file given on the command line: ``trace`` (a trace), ``log`` (the NCCL log), ``json`` (verify
    records), else ``text`` (the small JSON and text parts)."""
    if arcname.startswith(ARCNAMES["server_trace"]) or arcname.endswith(TRACE_SUFFIXES):
        return "trace"
    if arcname == ARCNAMES["nccl_log"]:
        return "log"
    if arcname.startswith(ARCNAMES["verify_log"]) and arcname.endswith(".jsonl"):
        return "json"
    return "text"


class Bundle:
    """An opened, validated bundle: :attr:`manifest`, :meth:`part`, :meth:`read`, :meth:`local`,
    :meth:`extract`. Its listed members were copied once, while it was opened, into a private
    temporary folder (mode 0700) that :meth:`close` (or leaving a ``with`` block, or the end of the
    process) removes. :attr:`unreadable` maps a member left out for its size to why; reading it
    raises. Messages name a member ``BUNDLE:member`` (:meth:`where`), never the temporary copy."""

    def __init__(
        self, path: Path, manifest: Manifest, members: dict[str, int], spool: Path, unreadable: dict[str, str]
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.members = members  # arcname -> size (bytes), manifest.json excluded
        self.unreadable = unreadable
        self._spool = spool
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(spool), ignore_errors=True)

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the temporary copies (the bundle cannot be read after)."""
        self._cleanup()

    def part(self, name: str) -> Part | None:
        return self.manifest.part(name)

    def where(self, arcname: str) -> str:
        """``BUNDLE:member``: how a message names a member."""
        return f"{path_text(self.path)}:{path_text(arcname)}"

    def rename(self, text: str) -> str:
        """``text`` (a message or note) with every path of a temporary copy as ``BUNDLE:member``."""
        return text.replace(f"{self._spool}{os.sep}", f"{path_text(self.path)}:")

    def local(self, arcnames: Iterable[str]) -> list[Path]:
        """The temporary copies of ``arcnames`` (read them, never keep them; name them in messages
        through :meth:`rename`).

        Raises
        ------
        UserError
            A member not in the bundle, or one left out for its size (:attr:`unreadable`).
        """
        out = []
        for n in arcnames:
            if n not in self.members:
                raise UserError(f"{path_text(self.path)}: has no member {n!r}")
            if n in self.unreadable:
                raise UserError(f"{self.where(n)}: {self.unreadable[n]}")
            if not self._cleanup.alive:
                raise UserError(f"{self.where(n)}: the bundle was closed")
            out.append(self._spool / n)
        return out

    def read(self, arcname: str) -> bytes:
        """The bytes of member ``arcname`` (at most its kind's cap); UserError as :meth:`local`."""
        (p,) = self.local([arcname])
        return p.read_bytes()

    def extract(self, arcnames: Iterable[str], dest_dir: str | Path) -> list[Path]:
        """Copy the members ``arcnames`` under ``dest_dir`` (made if missing) as new files, never
        through a link and never over an existing file; returns their paths.

        Raises
        ------
        UserError
            As :meth:`local`, or a target exists or cannot be written (one line naming it).
        """
        dest = Path(dest_dir)
        out = []
        for name, src in zip(arcnames := list(arcnames), self.local(arcnames)):
            target = dest / name
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with os.fdopen(fd, "wb") as f, open(src, "rb") as s:
                    shutil.copyfileobj(s, f, _CHUNK)
            except OSError as e:
                raise UserError(
                    f"{self.where(name)}: cannot extract to {path_text(target)} ({e.strerror or e})"
                ) from None
            out.append(target)
        return out


def _spool_member(spool: Path, name: str, data, size: int, where: str) -> None:
    target = spool / name
    try:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            left = size
            while left > 0 and (chunk := data.read(min(_CHUNK, left))):
                f.write(chunk)
                left -= len(chunk)
    except OSError as e:
        raise UserError(f"{where}:{name}: cannot unpack it into {spool.parent} ({e.strerror or e})") from None


def _scan(path: Path, raw, spool: Path) -> tuple[Manifest, dict[str, int], dict[str, str]]:
    """Read the archive once: the manifest, then each listed member copied under ``spool``."""
    where = path_text(path)
    it = members(raw, max_inflated=MAX_TOTAL_BYTES + MAX_HEADERS_BYTES)
    first, data = next(it, (None, None))
    if first is None or first.name != MANIFEST_NAME:
        raise UserError(f"{where}: no manifest.json as the first member: not a fastverify bundle")
    if not first.isreg() or first.size > MAX_MANIFEST_BYTES:
        raise UserError(f"{where}: manifest.json is not a regular file of at most {MAX_MANIFEST_BYTES // MiB} MiB")
    manifest = decode_manifest(data.read(), where)
    listed = {f for p in manifest.parts for f in p.files}
    sizes: dict[str, int] = {}
    unreadable: dict[str, str] = {}
    total = 0
    for m, data in it:
        why = _member_problem(m)
        if why is not None:
            raise UserError(f"{where}: refused member {why}")
        if m.name in sizes or m.name == MANIFEST_NAME:
            raise UserError(f"{where}: member {m.name!r} appears twice")
        if m.name not in listed:
            raise UserError(
                f"{where}: member {printable(m.name)!r} is not listed in manifest.json (an altered "
                "bundle); refused before it is read"
            )
        if m.size > MAX_MEMBER_BYTES:
            raise UserError(f"{where}: member {m.name!r} is {m.size / GiB:.1f} GiB, over {MAX_MEMBER_BYTES // GiB} GiB")
        total += m.size
        if total > MAX_TOTAL_BYTES or len(sizes) >= MAX_MEMBERS:
            raise UserError(f"{where}: more than {MAX_TOTAL_BYTES // GiB} GiB or {MAX_MEMBERS} members in all")
        sizes[m.name] = m.size
        kind = member_kind(m.name)
        if m.size > CAPS[kind]:
            unreadable[m.name] = f"{m.size:,} bytes, over the {CAPS[kind] // MiB} MiB limit for a {kind} input"
        else:
            _spool_member(spool, m.name, data, m.size, where)
    missing = [f for p in manifest.parts for f in p.files if f not in sizes]
    if missing:
        raise UserError(
            f"{where}: manifest.json names {', '.join(missing[:5])} but the archive lacks "
            f"{'it' if len(missing) == 1 else 'them'} (truncated or altered?)"
        )
    return manifest, sizes, unreadable


def open_bundle(path: str | Path) -> Bundle:
    """Open and validate the bundle at ``path`` in one pass (module docstring); its listed members
    are copied to a private temporary folder (:class:`Bundle`: close it, or use ``with``).

    Raises
    ------
    UserError
        One line naming the file: each refusal of the module docstring, a hostile member (``..``,
        absolute, link, device, sparse, a bad pax time), or no room to unpack it.
    """
    path = check_regular(path, what="the bundle")  # a FIFO or device is refused before it is opened
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise UserError(f"{path_text(path)}: cannot read the bundle ({e.strerror or e})") from None
    where = path_text(path)
    spool = Path(tempfile.mkdtemp(prefix="fastverify-bundle-"))
    try:
        with raw:
            if not stat.S_ISREG(os.fstat(raw.fileno()).st_mode):  # replaced since the check
                raise UserError(f"{where}: is not a regular file; give a bundle file (.tar.gz)")
            if raw.read(2) != b"\x1f\x8b":
                raise UserError(f"{where}: not a gzip file: not a fastverify bundle (.tar.gz)")
            raw.seek(0)
            try:
                manifest, sizes, unreadable = _scan(path, raw, spool)
            except ArchiveRefused as e:
                raise UserError(f"{where}: refused: {e}") from None
            except EOFError:
                raise UserError(
                    f"{where}: truncated archive (the gzip stream ends early); copy the bundle again"
                ) from None
            except tarfile.ReadError as e:
                raise UserError(f"{where}: not a tar archive inside the gzip ({e})") from None
            except (tarfile.TarError, OSError, zlib.error) as e:
                raise UserError(f"{where}: damaged archive ({e})") from None
    except BaseException:
        shutil.rmtree(spool, ignore_errors=True)
        raise
    return Bundle(path, manifest, sizes, spool, unreadable)


def is_bundle(path: str | Path) -> bool:
    """Whether ``path`` starts like a fastverify bundle (gzip, tar, ``manifest.json`` of our
    schema first); reads only the start of the file."""
    try:
        with open(path, "rb") as raw:
            first, data = next(members(raw, max_inflated=MAX_MANIFEST_BYTES + MAX_HEADERS_BYTES), (None, None))
            if first is None or first.name != MANIFEST_NAME or not first.isreg() or first.size > MAX_MANIFEST_BYTES:
                return False
            doc = msgspec.json.decode(data.read())
    except (OSError, EOFError, tarfile.TarError, zlib.error, ArchiveRefused, msgspec.DecodeError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA
