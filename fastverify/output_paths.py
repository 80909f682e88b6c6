"""Checks on paths, made before any work.

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

:mod:`fastverify.outputs` writes them.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
from pathlib import Path

from fastverify.errors import UserError, printable

NAME_MAX = 255
"""Longest file name (bytes) where the file system does not say (``pathconf`` ``PC_NAME_MAX``):
ext4, xfs, btrfs and tmpfs all take 255."""
PATH_MAX = 4096
"""Longest path (bytes) a system call takes on Linux (``PC_PATH_MAX``), the fallback likewise."""
NAME_MARGIN = 40
"""Bytes an output's name leaves free for the names made beside it: the temporary file of
:func:`fastverify.outputs.write_files` (``.<name>.<8 random>.tmp.png``), a backup ``<name>.bak``
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
    """Where :func:`fastverify.outputs.atomic_write_text` keeps the old ``path``: ``<path>.bak`` beside the file it
    really writes (a symlink's target). The caller's input/output check must cover it too: the
    backup replaces whatever is there."""
    p = Path(path)
    if p.is_symlink():
        p = Path(os.path.realpath(p))
    return p.with_name(p.name + ".bak")
