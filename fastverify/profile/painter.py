"""Draw the profile PNG in a helper process that gets matplotlib ready while the traces load.

Importing matplotlib costs about 0.25 s of CPU, as long as reading a 50 MB trace. On a box with
two or more cores, ``profile --trace`` starts a :class:`Painter` first: a forked child imports
:mod:`fastverify.profile.plot` while the parent reads and analyses the traces, then draws the figure when
the parent sends the profile. (It draws no throw-away figure meanwhile: that loads fonts and the
PNG writer, which saved 7 ms of the real drawing, 76 against 83 ms, for 65 ms of CPU taken from
the parent's reading on two cores, and it delayed the real drawing when the profile came during
it.) The PNG is the same figure, pixel for pixel, as drawn
in-process.

Anything that goes wrong in the child (it died, matplotlib failed to import, the drawing raised)
makes :meth:`Painter.draw` return False, and the caller draws in-process, where the same failure
surfaces as it always did.

:data:`EARLY` and :data:`PROGRAM` are the start-up state the command line shares with
``profile``: the painter started before parsing, and whether this process is the fastverify
program (which may end with ``os._exit`` once its outputs are written).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fastverify.procs import quiet_child_signals, signals_held, usable_cores


def _serve(conn, parent_end) -> None:
    quiet_child_signals()
    parent_end.close()
    try:
        _serve_one(conn)
    except BaseException:  # noqa: BLE001 - the parent went away mid-drawing (pipe closed): nothing to say
        pass


def _serve_one(conn) -> None:
    try:
        from fastverify.profile.plot import plot_profile  # lazy: matplotlib

        ready = None
    except Exception as e:  # reported to the parent, which draws in-process
        ready = f"{type(e).__name__}: {e}"
    try:
        job = conn.recv()
    except EOFError:  # the parent needs no PNG after all (an error, --no-png path)
        return
    if ready is not None:
        conn.send(ready)
        return
    profile, path = job
    try:
        plot_profile(profile, Path(path))
        conn.send(None)
    except Exception as e:
        conn.send(f"{type(e).__name__}: {e}")


class Painter:
    """A child process that draws one profile PNG (see the module docstring).

    Use ``Painter.start()`` (None where it brings nothing: one core, or no ``fork`` start method),
    then :meth:`draw` once, and :meth:`close` in all cases.
    """

    def __init__(self) -> None:
        import multiprocessing  # here, not at the top: the CLI imports this module on every start-up

        ctx = multiprocessing.get_context("fork")
        self._sent = False
        self._conn, child_end = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child_end, self._conn), daemon=True, name="fastverify-png")
        with signals_held():
            self._proc.start()
        child_end.close()

    @classmethod
    def start(cls) -> Painter | None:
        """A started painter, or None on a single core or where ``fork`` is unavailable or unsafe
        (only Linux forks here: macOS system libraries are not fork-safe)."""
        if usable_cores() < 2 or not sys.platform.startswith("linux"):
            return None
        try:
            return cls()
        except OSError:  # no processes left to fork: draw in-process
            return None

    def draw(self, profile: dict, path: Path) -> bool:
        """Draw ``profile`` (plain JSON-able dict) to ``path`` in the child; True when the PNG is
        written, False when the caller must draw it in-process."""
        try:
            self._sent = True
            self._conn.send((profile, str(path)))
            err = self._conn.recv()
        except (EOFError, OSError):
            return False
        except BaseException:
            # interrupted while the child draws: stop it before the caller removes the temporary
            # PNG, or the child would write it again after the clean-up
            self._stop()
            raise
        return err is None

    def _stop(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()

    def close(self) -> None:
        """Stop the child (if it still runs) and release the pipe. A child never sent a profile (an
        error, nothing to draw) is stopped at once rather than waited for: it may still be in its
        matplotlib import, which an error line need not wait 0.3 s for."""
        try:
            self._conn.close()
        finally:
            if self._sent:
                self._proc.join(timeout=2.0)
            self._stop()


EARLY: dict = {}
"""What :func:`fastverify.cli.main` started before parsing (the painter of a ``profile --trace`` run)."""
PROGRAM: dict = {}
"""Set by :func:`fastverify.cli.run`: this process is the fastverify program, not a caller of ``main()``."""


def start_painter_early(argv: list[str]) -> None:
    """``profile --trace`` with a PNG: fork the painter before anything but numpy is imported, so
    its matplotlib import overlaps the parsing and the trace loading (:class:`Painter`)."""
    if (
        argv[:1] == ["profile"]
        and any(a == "--trace" or a.startswith("--trace=") for a in argv)
        and "--no-png" not in argv
        and not any(a in ("-h", "--help") for a in argv)
    ):
        # numpy first, with one BLAS thread (a trace job sorts and sums, it multiplies no
        # matrices): the painter then shares this import instead of paying for its own, and its
        # OpenBLAS does not spin up a thread per core, which took a core from the trace reading
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        import numpy  # noqa: F401

        EARLY["painter"] = Painter.start()
