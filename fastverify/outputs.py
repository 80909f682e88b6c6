"""The two writers of output files, each all or none through temporary files in the target's
folder renamed into place (the paths are checked first: :mod:`fastverify.output_paths`).

* :func:`write_files`, the one writer of ``profile``, ``p2p``, ``report`` and the verify-log
  summary: new names reserved by :func:`reserve_names` (exclusive creates, so concurrent runs never
  share one) or the user's file, replaced without a backup.
* :func:`atomic_write_texts`, the writer of tuned settings (the env file, its deployment record, the
  tuner CSV): the old file kept as ``<name>.bak``, every new file fsync'd.

A name the user gives is claimed before any work by :func:`claim_output`: an existing file only
with ``--force``, else the name taken with an exclusive create, as :func:`reserve_names` takes a
default one. A symlink, a directory, a device or a FIFO at an output path is refused, never
written through.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastverify.errors import UserError
from fastverify.output_paths import backup_path, check_folder, check_new_output, refuse_symlink, shown, writable_target


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
    """Check an output the user named (:func:`fastverify.output_paths.check_new_output`: an
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
        As :func:`~fastverify.output_paths.check_new_output`, or the name was taken meanwhile.
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
