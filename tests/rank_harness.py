"""Run one function on N gloo ranks, each a fresh interpreter, for the multi-rank tests.

``run_ranks(fn, world, out_dir, *args)`` starts ``world`` processes with a fresh rendezvous port.
Each rank joins a gloo process group (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` set
as ``torchrun`` would), calls ``fn(rank, world, out_dir, *args)`` and writes the dict it returns
to ``out_dir/rank<R>.json``. The parent collects each rank's output, kills every rank still
running at the deadline (and fails the test), and returns each rank's result, or its error text.

``fn`` is a module-level function of a test module in ``tests/``; its arguments after ``out_dir``
are strings (they travel on the command line). The rank process runs this file as a script
(``python tests/rank_harness.py MODULE FUNCTION TEARDOWN RANK WORLD PORT OUT_DIR ARGS...``), so
``tests/`` is on its path and the test module is imported by name.

Teardown after ``fn`` returns:

* ``"destroy"``: ``destroy_process_group`` (also when ``fn`` raises), then the result is written.
* ``"exit"``: the result is written, a barrier, then ``os._exit(0)`` with no process-group
  teardown: gloo's can abort a rank whose peer left first ("terminate called without an active
  exception", seen on a loaded 2-core box); nothing is owed after the barrier.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve()
TEARDOWNS = ("destroy", "exit")


@dataclass
class RankRun:
    """What the ranks of one run left: per rank, its result or its error text, and its output."""

    outcomes: list[dict | str]
    """Rank r's returned dict when it exited 0, else ``"exited <code>:\\n<its output>"``."""
    returncodes: list[int]
    logs: list[str]
    """Each rank's stdout and stderr, interleaved."""
    elapsed: float
    """Seconds from the first start to the last rank's end."""

    def results(self) -> list[dict]:
        """Every rank's result; fails the test (with every rank's output) when a rank did not exit 0."""
        for r, code in enumerate(self.returncodes):
            assert code == 0, f"rank {r} exited {code}:\n" + "\n".join(self.logs)
        return list(self.outcomes)  # type: ignore[arg-type]


def run_ranks(
    fn: Callable[..., dict],
    world: int,
    out_dir: Path,
    *args: str,
    timeout_s: float = 120,
    teardown: str = "destroy",
    hang: str = "",
) -> RankRun:
    """Start ``world`` ranks of ``fn``; wait at most ``timeout_s`` for all of them together.

    At the deadline every rank still running is killed and the test fails, naming the first such
    rank (and ``hang``, what a hang there means). No rank outlives this call.
    """
    import pytest
    from conftest import free_port, subprocess_env

    if teardown not in TEARDOWNS:
        raise ValueError(f"teardown must be one of {TEARDOWNS}, not {teardown!r}")
    module = Path(sys.modules[fn.__module__].__file__).stem
    port = free_port()
    env = subprocess_env()
    env.pop("LOCAL_WORLD_SIZE", None)  # the ranks are a world of their own
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE), module, fn.__name__, teardown, str(r), str(world), str(port), str(out_dir)]
            + [str(a) for a in args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for r, p in enumerate(procs):
            left = max(1.0, timeout_s - (time.monotonic() - started))
            try:
                logs.append(p.communicate(timeout=left)[0].decode(errors="replace"))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} still running after {timeout_s} s" + (f": {hang}" if hang else ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.monotonic() - started
    codes = [p.returncode for p in procs]
    outcomes: list[dict | str] = [
        json.loads((out_dir / f"rank{r}.json").read_text()) if code == 0 else f"exited {code}:\n{logs[r]}"
        for r, code in enumerate(codes)
    ]
    return RankRun(outcomes=outcomes, returncodes=codes, logs=logs, elapsed=elapsed)


def _rank_main(argv: list[str]) -> None:
    """One rank: join the gloo group, run the function, write its result, tear down."""
    import torch.distributed as dist

    module, name, teardown = argv[0], argv[1], argv[2]
    rank, world, port, out_dir = int(argv[3]), int(argv[4]), int(argv[5]), Path(argv[6])
    fn = getattr(importlib.import_module(module), name)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if teardown == "exit":
        out = fn(rank, world, out_dir, *argv[7:])
        (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()
        os._exit(0)
    try:
        out = fn(rank, world, out_dir, *argv[7:])
    finally:
        dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
