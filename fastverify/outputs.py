"""Output files: every path checked before any work, then written all or none.

The two writers, each through temporary files in the target's folder renamed into place:

* :func:`write_files`, the one writer of ``profile``, ``p2p``, ``report`` and the verify-log
  summary: new names reserved by :func:`reserve_names` (exclusive creates, so concurrent runs never
  share one) or the user's file, replaced without a backup.
* :func:`atomic_write_texts`, the writer of tuned settings (the env file, its deployment record, the
  tuner CSV): the old file kept as ``<name>.bak``, every new file fsync'd.

A name the user gives is claimed before any work by :func:`claim_output`: an existing file only
with ``--force``, else the name taken with an exclusive create, as :func:`reserve_names` takes a
default one. A symlink, a directory, a device or a FIFO at an output path is refused, never
written through.

The checks on paths, made before any work:

* Every path flag of every command is parsed by :func:`path_arg` / :func:`path_text_arg` (a file
  or folder it reads) or :func:`output_arg` (a file it writes): an empty path, a NUL byte and a
  name or path longer than the file system takes (``ENAMETOOLONG``) are refused while the flags
  are parsed, in one line, instead of as a traceback after the work; bytes that are not UTF-8
  are taken as they are and shown as ``\\x..`` escapes.
* :func:`check_new_output`, called by each command right after parsing, before any work: an
  output never replaces an existing file unless the user asked (``--force``), is never a
  directory, device, FIFO, read-only file or symlink, and lies in a folder this process can
  write in (or create).
* :func:`check_outputs`: an output never replaces an input or another output.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastverify.errors import UserError, printable

NAME_MAX = 255
"""Longest file name (bytes) where the file system does not say (``pathconf`` ``PC_NAME_MAX``):
ext4, xfs, btrfs and tmpfs all take 255."""
PATH_MAX = 4096
"""Longest path (bytes) a system call takes on Linux (``PC_PATH_MAX``), the fallback likewise."""
NAME_MARGIN = 40
"""Bytes an output's name leaves free for the names made beside it: the temporary file of
:func:`write_files` (``.<name>.<8 random>.tmp.png``), a backup ``<name>.bak``
and its temporary file, and a bundle's own ``.part`` file of that temporary file (2 x 17 bytes)."""
SHOWN_CHARS = 240
"""Most characters of a refused path said in its error line (its start, then "…")."""


def shown(path: object) -> str:
    """``path`` for an error line: terminal-safe (:func:`fastverify.errors.printable`) and cut to
    :data:`SHOWN_CHARS` characters."""
    text = printable(path)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}… ({len(text):,} characters)"


def _limits(path: str) -> tuple[int, int]:
    """``(name max, path max)`` in bytes of the file system of ``path``'s nearest existing folder."""
    folder = os.path.dirname(os.path.abspath(path)) or "/"
    while True:
        try:
            return (os.pathconf(folder, "PC_NAME_MAX") or NAME_MAX), (os.pathconf(folder, "PC_PATH_MAX") or PATH_MAX)
        except (OSError, ValueError):
            parent = os.path.dirname(folder)
            if parent == folder:
                return NAME_MAX, PATH_MAX
            folder = parent


def path_problem(text: str, *, output: bool = False) -> str | None:
    """Why ``text`` (a path as given on the command line, its non-UTF-8 bytes as lone surrogates)
    cannot be used, or None: empty (which would read as the working directory), a NUL byte, bytes
    that are not UTF-8, or a file/folder name or a whole path over the file system's limits in
    bytes; an ``output`` leaves :data:`NAME_MARGIN` bytes of its name, and of the path, free."""
    if not text.strip():
        return "an empty path; give a file or folder name"
    if "\0" in text:
        return "a NUL byte in the path"
    try:
        raw = os.fsencode(text)  # a non-UTF-8 name is taken as its bytes, and shown escaped
    except UnicodeEncodeError as e:  # a lone surrogate no byte decodes to (never from argv)
        return f"character {e.start} is not a file-name character"
    name_max, path_max = _limits(text)
    margin = NAME_MARGIN if output else 0
    if len(raw) + margin >= path_max:
        return (
            f"a path of {len(raw):,} bytes, over the {path_max - margin - 1:,}-byte limit"
            f"{' of an output' if output else ''} (ENAMETOOLONG)"
        )
    parts = [p for p in text.split(os.sep) if p]
    for i, part in enumerate(parts):
        n = len(os.fsencode(part))
        limit = name_max - margin if output and i == len(parts) - 1 else name_max
        if n > limit:
            what = "the output's name" if limit < name_max else "a file or folder name"
            return f"{what} has {n} bytes, over the {limit}-byte limit (ENAMETOOLONG)"
    return None


def path_text_arg(text: str) -> str:
    """The argparse type of a path a command reads (a file or folder), kept as text.

    Raises
    ------
    argparse.ArgumentTypeError
        :func:`path_problem`, in one line naming the path.
    """
    why = path_problem(text)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{shown(text)}: {why}" if text.strip() else why)
    return text


def path_arg(text: str) -> Path:
    """:func:`path_text_arg` as a Path: the type of every path flag that reads a file or folder,
    or names a folder to write in."""
    return Path(path_text_arg(text))


def output_arg(text: str) -> Path:
    """The argparse type of a file a command writes: :func:`path_problem` with the output's
    margin. What is at the path (a directory, a device, an existing file without ``--force``) and
    whether its folder takes new files is the command's :func:`check_new_output`, before any work.

    Raises
    ------
    argparse.ArgumentTypeError
        One line naming the path and the reason.
    """
    why = path_problem(text, output=True)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{shown(text)}: {why}" if text.strip() else why)
    return Path(text)


def or_default(parse):
    """``parse`` for a flag with an optional value (``nargs="?", const=""``): argparse passes the
    missing value ``""`` through the type too, so ``""`` is kept (it means the flag's default) and
    any other value goes to ``parse``."""

    def parse_or_default(text: str):
        return text if text == "" else parse(text)

    return parse_or_default


def _check_kind(path: Path, flag: str) -> os.stat_result | None:
    """``path``'s ``lstat`` (None where nothing is there, or a file stands on the way, which
    :func:`check_writable` names); anything but a regular file (a directory, a device, a FIFO, a
    socket, a symlink) is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            return None
        raise UserError(f"{flag} {shown(path)}: cannot write ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise UserError(f"{flag} {shown(path)}: is {kind}; give a file path to write")
    return st


def check_new_output(path: Path | str | None, flag: str, *, force: bool = False) -> None:
    """The one rule for an output file the user named, checked before any work: it is not a
    symlink, a directory, a device or a FIFO; where a file is there already it is replaced only
    with ``force`` (the user asked) and only when it is writable; its folder takes new files
    (:func:`check_writable`). None is skipped.

    Raises
    ------
    UserError
        One line naming the flag and the path: ``... exists; fastverify never writes over a file:
        give a new name, or --force to replace it``, or the reason it cannot be written.
    """
    if path is None:
        return
    p = Path(path)
    refuse_symlink(p, flag)
    st = _check_kind(p, flag)
    if st is not None:
        if not force:
            raise UserError(
                f"{flag} {shown(p)}: exists; fastverify never writes over a file: give a new name, "
                "or --force to replace it"
            )
        if not os.access(p, os.W_OK) or not st.st_mode & 0o222:  # no write bit: read-only, even for root
            raise UserError(
                f"{flag} {shown(p)}: is read-only; it is not replaced, even with --force "
                "(make it writable, or give a new name)"
            )
    check_writable(p)


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same inode when both exist, else the same
    resolved path (symlinks and ``./`` folded)."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return Path(os.path.realpath(a)) == Path(os.path.realpath(b))


def check_outputs(outputs: "dict[str, Path | str | None]", inputs: "dict[str, Path | str | None]" = None) -> None:
    """Refuse, before any work, an output that would replace an input or another output.

    Parameters
    ----------
    outputs : dict[str, path or None]
        Flag (``"--output"``) → the file it writes; None entries are ignored. Each is also checked
        with :func:`writable_target` (no directory, device or FIFO).
    inputs : dict[str, path or None]
        Flag → a file (or folder) it reads. A folder input also protects every existing file
        inside it (a new file may be written there).

    Raises
    ------
    UserError
        One line naming both flags and the path.
    """
    outs = [(flag, Path(p)) for flag, p in outputs.items() if p]
    ins = [(flag, Path(p)) for flag, p in (inputs or {}).items() if p]
    for i, (flag, path) in enumerate(outs):
        writable_target(path)
        for in_flag, in_path in ins:
            # a file that already sits in an input folder is one of the inputs read from it
            inside = (
                in_path.is_dir()
                and path.exists()
                and Path(os.path.realpath(path)).is_relative_to(os.path.realpath(in_path))
            )
            if inside or _same_file(path, in_path):
                raise UserError(f"{flag} {path}: is the input of {in_flag}; an output never replaces an input")
        for other_flag, other in outs[:i]:
            if _same_file(path, other):
                raise UserError(f"{flag} {path}: is also the output of {other_flag}; give each output its own file")


def writable_target(path: Path) -> Path:
    """The file to write for ``path``: a symlink's target; anything but a regular file (a directory,
    a device, a FIFO) is refused with a UserError naming it, so an output never replaces one."""
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise UserError(f"{path}: is {kind}; give a file path to write")
    return path


def refuse_symlink(path: Path | str, flag: str | None = None) -> None:
    """Refuse an output path that is a symlink (dangling or not): fastverify replaces the file at
    ``path`` by renaming a new one over it, and never writes through a link to somewhere else.

    Raises
    ------
    UserError
        One line naming the flag, the path and where the link points.
    """
    p = Path(path)
    if os.path.islink(p):
        try:
            target = os.readlink(p)
        except OSError:
            target = "?"
        name = f"{flag} {p}" if flag else str(p)
        raise UserError(
            f"{name}: is a symlink (to {target}); outputs are never written through a symlink, "
            "so it is refused: give the real file's path"
        )


def check_writable(path: Path) -> None:
    """Refuse, before any work, an output that cannot be written: its folder (or the nearest one
    that exists, where it will be created) must take new files, since outputs are written to a
    temporary file there and renamed. ``os.access`` answers for the real user and sees read-only
    mounts.

    Raises
    ------
    UserError
        One line naming the path and the folder that refuses it.
    """
    folder = Path(os.path.abspath(path)).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(
            f"{shown(path)}: {shown(folder.name or folder)} is a file, not a folder; give a path in a folder"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(
            f"{shown(path)}: cannot write in {shown(folder)} (no write permission, or a read-only file system)"
        )


def check_folder(path: str | Path, flag: str = "", *, is_folder: bool = False) -> None:
    """Refuse, before any work, an output whose folder can neither be used nor created: the
    nearest existing ancestor of ``path``'s folder (of ``path`` itself with ``is_folder``) must
    be a folder this process may write in.

    Raises
    ------
    UserError
        ``<flag> <path>: <ancestor> is a file, not a folder`` (where ``mkdir`` would only say
        "File exists"), or ``... cannot write in <ancestor> (permission denied)``.
    """
    p = Path(path)
    what = f"{flag} {p}" if flag else str(p)
    folder = p if is_folder else p.parent
    while not (folder.exists() or folder.is_symlink()) and folder != folder.parent:
        folder = folder.parent
    shown = folder if str(folder) else Path(".")
    if not folder.is_dir():
        raise UserError(
            f"{what}: {shown} is a file, not a folder"
            if folder.exists()
            else f"{what}: {shown} is a broken link, not a folder"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{what}: cannot write in {shown} (permission denied)")


def backup_path(path: str | Path) -> Path:
    """Where :func:`atomic_write_text` keeps the old ``path``: ``<path>.bak`` beside the file it
    really writes (a symlink's target). The caller's input/output check must cover it too: the
    backup replaces whatever is there."""
    p = Path(path)
    if p.is_symlink():
        p = Path(os.path.realpath(p))
    return p.with_name(p.name + ".bak")


def write_error(path: Path, err: OSError) -> str:
    """The one line for a failed write of ``path``: where a folder on the way is a file (mkdir says
    only "File exists" / "Not a directory"), that file is named; else the OS reason."""
    for parent in Path(path).parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{path}: cannot write: {parent} is a file, not a folder"
            break
    return f"{path}: cannot write ({err.strerror or err})"


# ---- the one writer of new outputs -------------------------------------------------------------

_RESERVED: dict[str, tuple[int, int]] = {}
"""Placeholders this process made with :func:`reserve_names` (absolute path -> ``(st_dev, st_ino)``)
and has not yet filled (:func:`write_files`) or removed (:func:`release_reserved`)."""
_CREATED: list[str] = []
"""Folders :func:`reserve_names` made; :func:`release_reserved` removes each one left empty."""
_MAX_TRIES = 10_000


def _exclusive_create(path: Path) -> tuple[int, int]:
    """Create ``path`` empty, failing with FileExistsError if any entry (a symlink too) has the name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o666)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_dev, st.st_ino


def reserve_names(folder: Path | str, base: str, suffixes: tuple[str, ...], free: tuple[str, ...] = ()) -> list[Path]:
    """New, unique file names ``folder/<base>[-<n>]<suffix>`` for each of ``suffixes``, each created
    empty with an exclusive create (``O_CREAT | O_EXCL``) so that no other run, started in the same
    second, can take the same name; ``-<n>`` (2, 3, ...) is added until every name is new and no
    entry named ``<base>[-<n>]<s>`` for ``s`` in ``free`` exists. The placeholders are filled by
    :func:`write_files` (a temporary file renamed over each) and removed by :func:`release_reserved`
    (at the latest when the process exits) if they never are.

    Raises
    ------
    UserError
        The folder cannot be created or written.
    """
    folder = Path(folder)
    if not _RESERVED:
        atexit.register(release_reserved)
    n = remade = 0
    while n < _MAX_TRIES:
        n += 1
        if n == 1 or remade:  # again if a concurrent run removed its empty new folder
            try:
                if not folder.is_dir():
                    folder.mkdir(parents=True)
                    _CREATED.append(os.path.abspath(folder))
            except FileExistsError:
                pass  # made meanwhile by a concurrent run, or a file: the create below says which
            except OSError as e:
                raise UserError(write_error(folder / f"{base}{suffixes[0]}", e)) from None
        stem = base if n == 1 else f"{base}-{n}"
        made: list[Path] = []
        current = folder / f"{stem}{suffixes[0]}"
        try:
            for suffix in suffixes:
                current = folder / f"{stem}{suffix}"
                ident = _exclusive_create(current)
                made.append(current)
                _RESERVED[os.path.abspath(current)] = ident
            if any(os.path.lexists(folder / f"{stem}{s}") for s in free if s not in suffixes):
                raise FileExistsError
        except FileExistsError:
            release_reserved(made)
            continue
        except FileNotFoundError as e:  # the folder went (a concurrent run's clean-up): make it again
            release_reserved(made)
            if folder.is_dir() or remade >= 3:
                raise UserError(write_error(current, e)) from None
            n, remade = n - 1, remade + 1
            continue
        except OSError as e:
            release_reserved(made)
            raise UserError(write_error(current, e)) from None
        return made
    raise UserError(f"{folder}: {_MAX_TRIES} names {base}-<n>{suffixes[0]} are taken; give --output")


def claim_output(path: Path | str | None, flag: str, *, force: bool = False, reserve: bool = True) -> None:
    """Check an output the user named (:func:`check_new_output`: an
    existing file only with ``force``) and, where nothing is there, take its name with an exclusive
    create, so that a file another run makes there meanwhile is never written over: this run is
    refused instead. The empty placeholder is filled by :func:`write_files` or
    :func:`atomic_write_texts` (or any writer that renames a complete file over it) and removed by
    :func:`release_reserved` (at the latest when the process exits) if it never is. Where the
    folder does not exist yet, or with ``reserve=False`` (the output lies in a folder the command
    reads), no placeholder is made. None is skipped.

    Raises
    ------
    UserError
        As :func:`check_new_output`, or the name was taken meanwhile.
    """
    if path is None:
        return
    check_new_output(path, flag, force=force)
    p = Path(path)
    if not reserve or os.path.lexists(p) or not p.parent.is_dir() or os.path.abspath(p) in _RESERVED:
        return
    if not _RESERVED:
        atexit.register(release_reserved)
    try:
        _RESERVED[os.path.abspath(p)] = _exclusive_create(p)
    except FileExistsError:
        raise UserError(
            f"{flag} {shown(p)}: exists (made meanwhile); fastverify never writes over a file: give a "
            "new name, or --force to replace it"
        ) from None
    except OSError as e:
        raise UserError(write_error(p, e)) from None


def release_reserved(paths: list[Path] | None = None) -> None:
    """Remove placeholders of :func:`reserve_names` that were never filled (all of them when
    ``paths`` is None): only while the entry is still the empty file made here."""
    keys = list(_RESERVED) if paths is None else [os.path.abspath(p) for p in paths]
    for key in keys:
        ident = _RESERVED.pop(key, None)
        if ident is None:
            continue
        try:
            st = os.lstat(key)
            if (st.st_dev, st.st_ino) == ident and st.st_size == 0:
                os.unlink(key)
        except OSError:
            pass
    if paths is None:
        while _CREATED:  # a folder made for the names, left empty: removed (rmdir fails if not empty)
            try:
                os.rmdir(_CREATED.pop())
            except OSError:
                pass


def _check_target(path: Path) -> None:
    """A path an output may replace: not a symlink (:func:`refuse_symlink`), and nothing but a
    regular file (a directory, a device, a FIFO) where it exists."""
    refuse_symlink(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UserError(write_error(path, e)) from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise UserError(f"{path}: is {kind}; give a file path to write")


def write_files(targets: list[tuple[Path, Callable[[Path], object]]]) -> None:
    """The one output writer: for each ``(path, fill)``, ``fill(tmp)`` writes the whole content to
    a temporary file in ``path``'s folder; only when every one is complete are they renamed into
    place (over a placeholder of :func:`reserve_names`, or over the user's file), so a failure
    leaves no output, no temporary file and no placeholder behind. A symlink, a directory, a device
    or a FIFO at a ``path`` is refused, never written through. Placeholders reserved by this process
    and not among ``targets`` (a PNG name not used) are removed.

    Raises
    ------
    UserError
        A path refused as above, or the folder cannot be created or written (one line naming the
        user's path, never the temporary file).
    """
    paths = [Path(p) for p, _ in targets]
    tmps: list[Path] = []
    current = paths[0] if paths else None
    try:
        for i, p in enumerate(paths):
            if any(os.path.abspath(p) == os.path.abspath(q) for q in paths[:i]):
                raise UserError(f"{p}: two outputs would be the same file")
        for path in paths:
            current = path
            if os.path.abspath(path) not in _RESERVED:
                _check_target(path)
            path.parent.mkdir(parents=True, exist_ok=True)
        for path, fill in zip(paths, (f for _, f in targets)):
            current = path
            suffix = ".tmp.png" if path.suffix.lower() == ".png" else ".tmp"  # a plotter goes by the suffix
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
            os.close(fd)
            tmps.append(Path(tmp))
            fill(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        for tmp, path in zip(tmps, paths):
            current = path
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
        for tmp, path in zip(tmps, paths):
            current = path
            if os.path.abspath(path) not in _RESERVED:
                _check_target(path)  # again, just before the rename: nothing swapped in meanwhile
            os.replace(tmp, path)
            _RESERVED.pop(os.path.abspath(path), None)
        tmps = []
    except OSError as e:
        raise UserError(write_error(current, e)) from None
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        release_reserved()


# ---- replacing files, keeping the old ones as <name>.bak ---------------------------------------------


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``; an
    existing file is first copied to ``<path>.bak`` (also atomically). On failure nothing at
    ``path`` or ``<path>.bak`` changes and no temporary file is left.

    The backup is staged in a temporary file and moved to ``<path>.bak`` only after ``path`` has
    been replaced: a ``path`` that cannot be replaced (an immutable file, ``chattr +i``) leaves no
    ``.bak`` behind and an older ``.bak`` untouched. Should the backup's own move fail, the
    original is moved back to ``path`` before the error is raised.

    Raises
    ------
    UserError
        ``<path>: cannot write: <reason>``.
    """
    return atomic_write_texts([(Path(path), text)])[0]


def atomic_write_texts(items: Sequence[tuple[str | Path, str]]) -> list[Path]:
    """Write several files all or none (the env file and its deployment record).

    Every file is staged first (a temporary file beside it, written and fsync'd; the old file
    copied aside for its ``.bak``); only then are the temporaries renamed over their targets, in
    order. Should a rename fail, every target already replaced gets its old content back (or is
    removed, where there was none) before the error is raised; then the backups move to
    ``<name>.bak``, and should one of those moves fail, every target is restored the same way (a
    backup already moved goes back to its target, so an older ``.bak`` it replaced is lost, and
    nothing new is left). On failure no temporary file is left and no target holds new content.

    Raises
    ------
    UserError
        ``<path>: cannot write: <reason>``, naming the file that failed.
    """
    targets = [writable_target(Path(p)) for p, _ in items]
    for t in targets:
        check_folder(t)
    batch = _Replacement(targets[0] if targets else Path())
    try:
        for path, (_, text) in zip(targets, items):
            batch.stage(path, text)
        batch.swap_in()
    except OSError as err:
        raise UserError(f"{batch.current}: cannot write: {err.strerror or err}") from None
    finally:
        for t in batch.tmps:
            try:
                os.unlink(t)
            except FileNotFoundError:
                pass
    return targets


@dataclass
class _Staged:
    """One target of :func:`atomic_write_texts`: its new text in ``tmp``, a copy of the old file
    in ``old`` (None: there was none) bound for ``bak``; ``old_moved`` once it is there."""

    path: Path
    tmp: str
    old: str | None
    bak: Path | None
    old_moved: bool = False


class _Replacement:
    """The steps of :func:`atomic_write_texts`; ``current`` is the file the step in progress writes
    (named in the error), ``tmps`` every temporary file made (removed at the end)."""

    def __init__(self, first: Path) -> None:
        self.current = first
        self.tmps: list[str] = []
        self.staged: list[_Staged] = []

    def stage(self, path: Path, text: str) -> None:
        """The new text in a temporary file beside ``path`` (fsync'd, mode 0644), and a copy of
        the old file, when there is one, beside it for the backup."""
        self.current = path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        self.tmps.append(tmp)
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        old = bak = None
        if path.exists() and os.path.abspath(path) not in _RESERVED:  # a placeholder is not an old file
            bak = backup_path(path)
            writable_target(bak)
            fd, old = tempfile.mkstemp(prefix=f".{bak.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            self.tmps.append(old)
            shutil.copy2(path, old)
        self.staged.append(_Staged(path, tmp, old, bak))

    def swap_in(self) -> None:
        """Rename every new file over its target, then every old copy to its ``.bak``; on a
        failed rename, restore what was replaced and raise."""
        done: list[_Staged] = []
        for s in self.staged:
            self.current = s.path
            try:
                os.replace(s.tmp, s.path)
            except OSError:
                _restore(done)
                raise
            _RESERVED.pop(os.path.abspath(s.path), None)
            done.append(s)
        for s in self.staged:
            if s.old is None:
                continue
            self.current = s.bak
            try:
                os.replace(s.old, s.bak)
            except OSError:
                _restore(done)  # no write without its backup
                raise
            s.old_moved = True


def _restore(done: list[_Staged]) -> None:
    """Put back what the renames replaced, last first; best effort (the first error is raised)."""
    for s in reversed(done):
        try:
            if s.old is None:
                os.unlink(s.path)
            elif s.old_moved:
                os.replace(s.bak, s.path)  # the old content went to .bak: moved back
            else:
                os.replace(s.old, s.path)
        except OSError:
            pass
