"""``fastverify doctor --json``: stdout holds the JSON document and nothing else.

NCCL writes its ``NCCL_DEBUG`` log to stdout unless ``NCCL_DEBUG_FILE`` names a file (NCCL's
environment variables documentation: ``NCCL_DEBUG_FILE``, where ``%h`` is the host name and ``%p``
the process id), and the checks start processes (trials, the P2P pair children, spawned ranks)
that inherit this process's stdout. So under ``--json``:

* where ``NCCL_DEBUG`` is set and ``NCCL_DEBUG_FILE`` is not, ``NCCL_DEBUG_FILE`` is set to a file
  per process in a new folder before any check runs (so before NCCL starts here and in every child,
  which get this environment), and the summary names it (``nccl_log``; null, and the folder
  removed, where NCCL wrote nothing);
* while the checks run, file descriptor 1 points at stderr, so whatever still writes to stdout
  (this process, NCCL, a child) lands on stderr; the JSON is written after it is restored.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, MutableMapping

import orjson

from fastverify.doctor import run_doctor, summarise
from fastverify.errors import shown

NCCL_LOG_NAME = "nccl.%h.%p.log"  # one file per host and process (NCCL_DEBUG_FILE's %h and %p)


def nccl_log_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings ``--json`` adds to ``environ``: ``{"NCCL_DEBUG_FILE": <new folder>/nccl.%h.%p.log}``
    where ``NCCL_DEBUG`` is set and ``NCCL_DEBUG_FILE`` is not; else ``{}`` (a user's own file wins)."""
    if not environ.get("NCCL_DEBUG") or environ.get("NCCL_DEBUG_FILE"):
        return {}
    folder = tempfile.mkdtemp(prefix="fastverify-doctor-nccl-")
    return {"NCCL_DEBUG_FILE": os.path.join(folder, NCCL_LOG_NAME)}


@contextlib.contextmanager
def stdout_on_stderr() -> Iterator[None]:
    """File descriptor 1 (and ``sys.stdout``) pointed at stderr for the block; restored after."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def _environ_with(added: Mapping[str, str], environ: MutableMapping[str, str]) -> Iterator[None]:
    environ.update(added)
    try:
        yield
    finally:
        for k in added:
            environ.pop(k, None)


def run_doctor_json(*, quick: bool, env_file: str | None) -> int:
    """Run the checks (:func:`fastverify.doctor.run_doctor`) and write the summary
    (:func:`fastverify.doctor.summarise`, plus ``nccl_log`` when NCCL's log was sent to a file) as
    JSON to stdout. Returns the exit code: 1 when the verdict is ``fail``, else 0."""
    added = nccl_log_env(os.environ)
    if added:
        sys.stderr.write(shown(f"fastverify doctor: NCCL's log (NCCL_DEBUG={os.environ['NCCL_DEBUG']}) goes to "
                               f"{added['NCCL_DEBUG_FILE']}") + "\n")
    with _environ_with(added, os.environ), stdout_on_stderr():
        checks = run_doctor(quick=quick, env_file=env_file)
    summary = summarise(checks)
    if added:
        folder = os.path.dirname(added["NCCL_DEBUG_FILE"])
        if os.listdir(folder):
            summary["nccl_log"] = added["NCCL_DEBUG_FILE"]
        else:  # NCCL never started (no GPU, --quick): no log, no folder left behind
            os.rmdir(folder)
            summary["nccl_log"] = None
    sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n")
    return 1 if summary["verdict"] == "fail" else 0
