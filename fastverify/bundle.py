"""The support bundle of ``fastverify collect``: one ``.tar.gz`` that ``fastverify report`` reads.

Layout: ``manifest.json`` is the first member (a :class:`Manifest`, msgspec-encoded JSON), then
the part files under their arcnames (:data:`ARCNAMES`; relative POSIX paths, no ``..``, no
absolute path, regular files only). Every part of :data:`PART_NAMES` is listed in the manifest,
``ok``, ``skipped`` or ``failed``, with why and the files it brought.

:func:`write_bundle` writes atomically (a temporary file in the same folder, then ``os.replace``)
and never replaces a file that is not a bundle, nor one of the files it collects.
:func:`open_bundle` reads the whole archive once before trusting it: a file that is not gzip, not a
tar, truncated (the gzip trailer is checked to the last byte), without ``manifest.json`` first,
with another schema or version, a member named in the manifest but absent, a member with ``..``,
an absolute name, a link, a device or a directory, or sizes past :data:`MAX_MEMBER_BYTES` /
:data:`MAX_TOTAL_BYTES` / :data:`MAX_MANIFEST_BYTES` is refused with one
:class:`~fastverify.errors.UserError` line naming the file. Only the standard library's ``gzip``
and ``tarfile`` (with ``filter="data"`` on extraction where Python has it) and msgspec are used.
"""

from __future__ import annotations

import gzip
import io
import os
import posixpath
import stat
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from fastverify.errors import UserError

__all__ = ["ARCNAMES", "MANIFEST_NAME", "PART_NAMES", "SCHEMA", "SCHEMA_VERSION", "STATUSES", "Bundle", "Manifest",
           "Part", "is_bundle", "open_bundle", "write_bundle"]

SCHEMA = "fastverify.bundle"
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
PART_NAMES = ("doctor", "nvidia_smi_topo", "nvml", "host_iommu", "p2p_check", "nccl_log", "sweep",
              "server_args", "server_trace", "verify_log")
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
            raise UserError(f"{where}: manifest.json: part {p.name} has status {p.status!r}, not one of "
                            f"{', '.join(STATUSES)}")
        for f in p.files:
            why = arcname_problem(f)
            if why is not None or f == MANIFEST_NAME:
                raise UserError(f"{where}: manifest.json: part {p.name} names a bad file ({why or f})")


def encode_manifest(m: Manifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(m), indent=2) + b"\n"


def decode_manifest(data: bytes, where: str) -> Manifest:
    """The manifest in ``data``; UserError naming ``where`` for bad JSON, another schema or version,
    or a field of the wrong type."""
    try:
        raw = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError) as e:
        raise UserError(f"{where}: manifest.json is not JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        got = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
        raise UserError(f"{where}: manifest.json has schema {got!r}, not {SCHEMA!r}: not a fastverify bundle")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{where}: bundle schema version {raw.get('schema_version')!r}; this fastverify reads "
                        f"version {SCHEMA_VERSION}")
    try:
        m = msgspec.convert(raw, Manifest)
    except msgspec.ValidationError as e:
        raise UserError(f"{where}: manifest.json: {e}") from None
    _check_manifest(m, where)
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
            raise UserError(f"{src}: {st.st_size / GiB:.1f} GiB, over the bundle's {MAX_MEMBER_BYTES // GiB} GiB "
                            "limit per file")
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
            with tarfile.open(fileobj=out, mode="w:gz", compresslevel=COMPRESS_LEVEL,
                              format=tarfile.PAX_FORMAT) as tar:
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


class Bundle:
    """An opened, validated bundle: :attr:`manifest`, :meth:`part`, :meth:`read`, :meth:`extract`.
    Holds no open file: each read opens the archive again."""

    def __init__(self, path: Path, manifest: Manifest, members: dict[str, int]) -> None:
        self.path = path
        self.manifest = manifest
        self.members = members  # arcname -> size (bytes), manifest.json excluded

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def part(self, name: str) -> Part | None:
        return self.manifest.part(name)

    def _tarinfos(self, names: Iterable[str]) -> list[str]:
        names = list(names)
        for n in names:
            if n not in self.members:
                raise UserError(f"{self.path}: has no member {n!r}")
        return names

    def read(self, arcname: str) -> bytes:
        """The bytes of member ``arcname``; UserError when it is not in the bundle."""
        (name,) = self._tarinfos([arcname])
        try:
            with tarfile.open(self.path, "r:gz") as tar:
                f = tar.extractfile(tar.getmember(name))
                return f.read() if f is not None else b""
        except (tarfile.TarError, EOFError, OSError, zlib.error, KeyError) as e:
            raise UserError(f"{self.path}: cannot read {name} ({e})") from None

    def extract(self, arcnames: Iterable[str], dest_dir: str | Path) -> list[Path]:
        """Write the members ``arcnames`` under ``dest_dir`` (made if missing), regular files only,
        never outside it (``filter="data"``, plus a resolved-path check); returns their paths."""
        names = self._tarinfos(arcnames)
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        root = os.path.realpath(dest)
        out = []
        try:
            with tarfile.open(self.path, "r:gz") as tar:
                for name in names:
                    target = os.path.realpath(dest / name)
                    if os.path.commonpath([root, target]) != root:
                        raise UserError(f"{self.path}: member {name!r} would land outside {dest}")
                    member = tar.getmember(name)
                    if hasattr(tarfile, "data_filter"):
                        tar.extract(member, dest, filter="data")
                    else:  # Python < 3.11.4: the same checks by hand, never through a link
                        os.makedirs(os.path.dirname(target), exist_ok=True)
                        src = tar.extractfile(member)
                        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
                        with os.fdopen(fd, "wb") as f:
                            while chunk := src.read(_CHUNK):
                                f.write(chunk)
                    out.append(dest / name)
        except (tarfile.TarError, EOFError, zlib.error) as e:
            raise UserError(f"{self.path}: cannot extract ({e})") from None
        except OSError as e:
            raise UserError(f"{self.path}: cannot extract into {dest} ({e.strerror or e})") from None
        return out


def _scan(path: Path, gz: gzip.GzipFile) -> tuple[Manifest, dict[str, int]]:
    where = str(path)
    tar = tarfile.open(fileobj=gz, mode="r:")  # noqa: SIM115 - holds nothing of its own: gz is the caller's
    first = tar.next()
    if first is None or first.name != MANIFEST_NAME:
        raise UserError(f"{where}: no manifest.json as the first member: not a fastverify bundle")
    if not first.isreg() or first.size > MAX_MANIFEST_BYTES:
        raise UserError(f"{where}: manifest.json is not a regular file of at most {MAX_MANIFEST_BYTES // MiB} MiB")
    manifest = decode_manifest(tar.extractfile(first).read(), where)
    members: dict[str, int] = {}
    total = 0
    while (m := tar.next()) is not None:
        why = _member_problem(m)
        if why is not None:
            raise UserError(f"{where}: refused member {why}")
        if m.name in members or m.name == MANIFEST_NAME:
            raise UserError(f"{where}: member {m.name!r} appears twice")
        if m.size > MAX_MEMBER_BYTES:
            raise UserError(f"{where}: member {m.name!r} is {m.size / GiB:.1f} GiB, over {MAX_MEMBER_BYTES // GiB} GiB")
        total += m.size
        if total > MAX_TOTAL_BYTES or len(members) >= MAX_MEMBERS:
            raise UserError(f"{where}: more than {MAX_TOTAL_BYTES // GiB} GiB or {MAX_MEMBERS} members in all")
        members[m.name] = m.size
        tar.members = []  # keep no index of TarInfo objects: a hostile archive can hold millions
    while gz.read(_CHUNK):  # to the gzip trailer: a cut archive fails here (EOFError), a bad CRC too
        pass
    missing = [f for p in manifest.parts for f in p.files if f not in members]
    if missing:
        raise UserError(f"{where}: manifest.json names {', '.join(missing[:5])} but the archive lacks "
                        f"{'it' if len(missing) == 1 else 'them'} (truncated or altered?)")
    return manifest, members


def open_bundle(path: str | Path) -> Bundle:
    """Open and validate the bundle at ``path`` (reads it through once).

    Raises
    ------
    UserError
        One line naming the file: unreadable, not gzip, not a tar, truncated or damaged, no
        ``manifest.json`` first, another schema or version, a member named in the manifest but
        missing, a hostile member (``..``, absolute, link, device), or past the size limits.
    """
    from fastverify.inputs import check_regular

    path = check_regular(path, what="the bundle")  # a FIFO or device is refused before it is opened
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as e:
        raise UserError(f"{path}: cannot read the bundle ({e.strerror or e})") from None
    with raw:
        if not stat.S_ISREG(os.fstat(raw.fileno()).st_mode):  # replaced since the check
            raise UserError(f"{path}: is not a regular file; give a bundle file (.tar.gz)")
        if raw.read(2) != b"\x1f\x8b":
            raise UserError(f"{path}: not a gzip file: not a fastverify bundle (.tar.gz)")
        raw.seek(0)
        try:
            with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                manifest, members = _scan(path, gz)
        except EOFError:
            raise UserError(f"{path}: truncated archive (the gzip stream ends early); copy the bundle again") from None
        except tarfile.ReadError as e:
            raise UserError(f"{path}: not a tar archive inside the gzip ({e})") from None
        except (tarfile.TarError, OSError, zlib.error) as e:
            raise UserError(f"{path}: damaged archive ({e})") from None
    return Bundle(path, manifest, members)


def is_bundle(path: str | Path) -> bool:
    """Whether ``path`` starts like a fastverify bundle (gzip, tar, ``manifest.json`` of our
    schema first); reads only the start of the file."""
    try:
        with gzip.open(path, "rb") as gz:
            tar = tarfile.open(fileobj=gz, mode="r:")  # noqa: SIM115 - over gz, closed by the with
            first = tar.next()
            if first is None or first.name != MANIFEST_NAME or not first.isreg() or first.size > MAX_MANIFEST_BYTES:
                return False
            raw = msgspec.json.decode(tar.extractfile(first).read())
    except (OSError, EOFError, tarfile.TarError, zlib.error, msgspec.DecodeError, RecursionError):
        return False
    return isinstance(raw, dict) and raw.get("schema") == SCHEMA
