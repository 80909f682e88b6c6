"""Checks on output paths, made before any work: an output never replaces an input or another
output, never is a directory, device or FIFO, never is written through a symlink, and lies in a
folder this process can write in (or create). :mod:`fastverify.outputs` writes them."""

from __future__ import annotations

import os
from pathlib import Path

from fastverify.errors import UserError


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
            inside = in_path.is_dir() and path.exists() and \
                Path(os.path.realpath(path)).is_relative_to(os.path.realpath(in_path))
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
        raise UserError(f"{name}: is a symlink (to {target}); outputs are never written through a symlink, "
                        "so it is refused: give the real file's path")


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
        raise UserError(f"{path}: {folder.name or folder} is a file, not a folder; give a path in a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{path}: cannot write in {folder} (no write permission, or a read-only file system)")


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
        raise UserError(f"{what}: {shown} is a file, not a folder" if folder.exists() else
                        f"{what}: {shown} is a broken link, not a folder")
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
