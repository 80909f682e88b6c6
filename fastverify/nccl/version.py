"""The NCCL version, read from the library itself.

``ncclGetVersion(int*)`` needs no GPU and no communicator, so the version can be read on any box
that has a ``libnccl.so.2``: the ``nvidia-nccl-cu12`` / ``nvidia-nccl-cu13`` wheel (what a CUDA
build of torch loads), a library under torch's own ``lib/`` (old torch wheels bundled one), or a
system install. ``NCCL_LIBRARY`` (read by fastverify, not by NCCL) names one explicitly.

Why ctypes and not ``torch.cuda.nccl.version()``: that needs a CUDA build of torch and imports all
of torch; the wheel's library answers on a GPU-less box in milliseconds (checked on
nvidia-nccl-cu12 2.32.3: ``ncclGetVersion`` -> 23203).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fastverify.errors import UserError

LIBRARY_ENV = "NCCL_LIBRARY"  # fastverify's own variable: path of the libnccl to read

# NCCL_VERSION(X,Y,Z) in src/nccl.h.in:
#   X*1000  + Y*100 + Z   when X <= 2 and Y <= 8   (2.8.4 -> 2804)
#   X*10000 + Y*100 + Z   otherwise                (2.9.6 -> 20906, 2.32.3 -> 23203)
# Every old-style code is below 10000 and every new-style one is above it, so the size of the
# code alone tells the encoding. Decode with divmod, never by slicing the decimal string (a
# version with patch 0, such as 22000, is where string slicing goes wrong).
_NEW_ENCODING_MIN_CODE = 10000

_VERSION_RE = re.compile(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-+][0-9A-Za-z.+-]*)?\s*")


def encode_version(major: int, minor: int, patch: int) -> int:
    """The integer ``ncclGetVersion`` reports for ``major.minor.patch`` (``NCCL_VERSION`` macro)."""
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


@dataclass(frozen=True, order=True)
class NcclVersion:
    """One NCCL release. Ordered and compared by (major, minor, patch); ``library`` is ignored.

    ``code`` is the integer ``ncclGetVersion`` returns (see :func:`encode_version`); ``library``
    is the path (or soname) the version was read from, ``None`` when parsed from text.
    """

    major: int
    minor: int
    patch: int
    code: int
    library: str | None = field(default=None, compare=False)

    @classmethod
    def of(cls, major: int, minor: int, patch: int = 0, library: str | None = None) -> NcclVersion:
        return cls(major, minor, patch, encode_version(major, minor, patch), library)

    @classmethod
    def from_code(cls, code: int, library: str | None = None) -> NcclVersion:
        """Decode the integer of ``ncclGetVersion``: 23203 -> 2.32.3, 2804 -> 2.8.4, 2803 -> 2.8.3.

        Raises ``ValueError`` for anything but a positive int that ``NCCL_VERSION`` can produce
        (e.g. 2950 would be "2.9.50" in the old encoding, which 2.9 never used)."""
        if isinstance(code, bool) or not isinstance(code, int) or code <= 0:
            raise ValueError(f"NCCL version code must be a positive int, got {code!r}")
        if code >= _NEW_ENCODING_MIN_CODE:
            major, rest = divmod(code, 10000)
        else:
            major, rest = divmod(code, 1000)
        minor, patch = divmod(rest, 100)
        if encode_version(major, minor, patch) != code:
            raise ValueError(f"{code} is no NCCL version code (X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z from 2.9)")
        return cls(major, minor, patch, code, library)

    @classmethod
    def parse(cls, text: str) -> NcclVersion:
        """Parse ``"2.27.5"`` (also ``"2.27"``, ``"v2.27.5-1"``, ``"2.32.3+cuda12.9"``), or the
        integer ``ncclGetVersion`` reports, as text, in either encoding (:meth:`from_code`:
        ``"2803"`` -> 2.8.3, ``"21903"`` -> 2.19.3).

        Raises
        ------
        UserError
            ``text`` is not a version; the message names it.
        """
        if isinstance(text, str) and text.strip().isascii() and text.strip().isdigit() and 4 <= len(text.strip()) <= 6:
            try:
                return cls.from_code(int(text.strip()))
            except ValueError as err:
                raise UserError(f"not an NCCL version: {text!r} ({err})") from None
        m = _VERSION_RE.fullmatch(text) if isinstance(text, str) else None
        if m is None:
            raise UserError(f"not an NCCL version: {text!r} (expected MAJOR.MINOR[.PATCH], e.g. 2.27.5)")
        major, minor, patch = int(m[1]), int(m[2]), int(m[3] or 0)
        if minor > 99 or patch > 99:
            raise UserError(f"not an NCCL version: {text!r} (minor and patch are at most 99)")
        return cls.of(major, minor, patch)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def _find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """The import spec of top-level package ``name``, found without importing it; ``None`` when
    it is not installed or its finder fails."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _nvidia_wheel_libraries() -> list[str]:
    """``<site>/nvidia/nccl/lib/libnccl.so.2`` of every installed nvidia-nccl-cu12/cu13 wheel.

    ``nvidia`` and ``nvidia.nccl`` have no ``__init__.py`` (namespace packages, one portion per
    site directory), so the portions come from the spec's search locations, which is what
    ``nvidia.__path__`` holds; ``find_spec`` does this without importing anything.
    """
    spec = _find_spec("nvidia")
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [str(Path(portion) / "nccl" / "lib" / "libnccl.so.2") for portion in spec.submodule_search_locations]


def _torch_libraries() -> list[str]:
    """A libnccl inside torch's ``lib/`` (bundled by some torch wheels), found without importing torch."""
    spec = _find_spec("torch")
    if spec is None or spec.origin is None:
        return []
    lib_dir = Path(spec.origin).parent / "lib"
    return sorted(str(p) for p in lib_dir.glob("libnccl.so*")) if lib_dir.is_dir() else []


def find_libnccl(library: str | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """Candidate NCCL libraries, most specific first, without duplicates.

    Order: ``library``; ``$NCCL_LIBRARY``; the nvidia-nccl wheel(s) found through the ``nvidia``
    namespace package; a libnccl under torch's ``lib/``; ``ctypes.util.find_library("nccl")``
    (a soname such as ``libnccl.so.2``, resolved by the dynamic loader). Explicit entries are
    listed even when the file does not exist (loading them reports why); searched ones only
    when the file exists.

    Parameters
    ----------
    library
        An explicit path, listed first.
    environ
        The environment to read ``NCCL_LIBRARY`` from; ``os.environ`` when ``None``.
    """
    env = os.environ if environ is None else environ
    explicit = [p for p in (library, env.get(LIBRARY_ENV)) if p]
    searched = [p for p in _nvidia_wheel_libraries() + _torch_libraries() if os.path.isfile(p)]
    system = ctypes.util.find_library("nccl")
    candidates = explicit + searched + ([system] if system else [])
    seen: set[str] = set()
    unique = []
    for path in candidates:
        key = os.path.realpath(path) if os.sep in path else path
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


class _LoadFailed(Exception):
    """A candidate that is not a loadable NCCL library; the message is one line."""


@functools.lru_cache(maxsize=None)
def _version_of(path: str) -> NcclVersion:
    """Load ``path`` once and call ``ncclGetVersion``; raise :class:`_LoadFailed` with the reason."""
    try:
        lib = ctypes.CDLL(path)
    except OSError as err:
        raise _LoadFailed(" ".join(str(err).split())) from None
    try:
        get_version = lib.ncclGetVersion
    except AttributeError:
        raise _LoadFailed("no ncclGetVersion symbol: not an NCCL library") from None
    # ncclResult_t ncclGetVersion(int* version);
    get_version.restype = ctypes.c_int
    get_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
    code = ctypes.c_int(0)
    rc = get_version(ctypes.byref(code))
    if rc != 0:
        raise _LoadFailed(f"ncclGetVersion failed: {_error_string(lib, rc)}")
    try:
        return NcclVersion.from_code(code.value, library=path)
    except ValueError as err:
        raise _LoadFailed(str(err)) from None


def _error_string(lib: ctypes.CDLL, rc: int) -> str:
    # const char* ncclGetErrorString(ncclResult_t result);
    try:
        fn = lib.ncclGetErrorString
    except AttributeError:
        return f"ncclResult_t {rc}"
    fn.restype = ctypes.c_char_p
    fn.argtypes = [ctypes.c_int]
    text = fn(rc)
    return f"{text.decode(errors='replace')} (ncclResult_t {rc})" if text else f"ncclResult_t {rc}"


def read_nccl_version(library: str | None = None, environ: Mapping[str, str] | None = None) -> NcclVersion | None:
    """The version of the NCCL library this box would load, or ``None`` when there is none.

    With ``library`` (or ``$NCCL_LIBRARY``) only that library is read. Otherwise the candidates
    of :func:`find_libnccl` are tried in order and the first that loads answers; a candidate that
    is not a loadable NCCL library is skipped.

    Raises
    ------
    UserError
        The explicit library cannot be loaded, is not NCCL, or its ``ncclGetVersion`` fails (one
        line naming the path). Searched candidates never raise: they are skipped.
    """
    env = os.environ if environ is None else environ
    explicit = library or env.get(LIBRARY_ENV)
    if explicit:
        source = "" if library else f" (from ${LIBRARY_ENV})"
        try:
            return _version_of(explicit)
        except _LoadFailed as err:
            raise UserError(f"cannot read the NCCL version from {explicit}{source}: {err}") from None
    for path in find_libnccl(environ=env):
        try:
            return _version_of(path)
        except _LoadFailed:
            continue
    return None
