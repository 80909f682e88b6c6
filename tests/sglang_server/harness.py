"""Test-only helpers that start the CPU SGLang server through ``fastverify launch`` and read what it
left behind (never imported by fastverify).

Why: issue 10's tests all need the same expensive thing (a real SGLang 0.5.23 TP 2 engine on CPU,
about two minutes a start) and the same reading of its outputs, so both live here once. The NGRAM
engine is the default; ``engine=`` / ``engine_drop=`` of :func:`launch_engine` change its
``sglang.Engine`` kwargs (the EAGLE / EAGLE-3 tests, ``tests/test_sglang_eagle.py``). A run that
:func:`launch_engine` waits for is bounded by its ``timeout`` and leaves no process behind
(:func:`_run_bounded`).

The environment a server gets (:func:`server_env`) holds the CPU settings issue 10 found necessary
for SGLang 0.5.23, each checked against its source:

* ``SGLANG_USE_CPU_ENGINE=1`` (``srt/utils/common.py::is_cpu``);
* ``SGLANG_NCCL_SO_PATH`` naming a libnccl that does not exist, so SGLang's NCCL wrapper fails to
  load and turns itself off (else TP > 1 fails with "Expected a cuda device, but got: cpu");
* ``SGLANG_CPU_OMP_THREADS_BIND="0|1"`` (one core per TP rank; at TP 2 an assertion otherwise);
* ``SGLANG_PLUGINS=fastverify_test_shim``: 0.5.23 loads only the plugins listed there
  (``srt/plugins/__init__.py``; the install brings two ``smg-*`` plugins), and ``launch`` appends
  ``fastverify`` (:func:`fastverify.patch.launch.plan_launch`);
* ``PYTHONPATH``: the shim's ``.dist-info`` folder, the ``sgl_kernel`` stand-in and this checkout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
KERNELS = HERE / "kernels"
ENGINE = HERE / "engine.py"
PATCH_LINE = re.compile(r"^fastverify patch \[TP (\d+)\]: (.*)$", re.M)
PATHS_LINE = re.compile(r"^fastverify paths \[TP (\d+)\] after the first verify forward: (.*)$", re.M)
RESULT = "FVTEST_RESULT "


def write_shim_site(site: Path) -> Path:
    """A folder whose ``.dist-info`` registers :func:`tests.sglang_server.shim.plugin` as the SGLang
    general plugin ``fastverify_test_shim`` (``importlib.metadata`` finds distributions on every
    ``sys.path`` entry, so no install is needed)."""
    info = site / "fastverify_test_shim-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fastverify-test-shim\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nfastverify_test_shim = tests.sglang_server.shim:plugin\n"
    )
    return site


def server_env(work: Path, *, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for ``fastverify launch`` (see the module docstring); no ``FASTVERIFY_*``
    from the caller's environment."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FASTVERIFY_", "SGLANG_", "NCCL_", "FVTEST_")) and k != "PYTHONPATH"
    }
    site = write_shim_site(work / "site")
    env.update(
        {
            "SGLANG_USE_CPU_ENGINE": "1",
            "SGLANG_NCCL_SO_PATH": str(work / "no-such-dir" / "libnccl.so.2"),
            "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
            "SGLANG_PLUGINS": "fastverify_test_shim",
            "PYTHONPATH": os.pathsep.join([str(site), str(KERNELS), str(REPO)]),
            "CUDA_VISIBLE_DEVICES": "",
            "TOKENIZERS_PARALLELISM": "false",
            "FVTEST_STATS_DIR": str(work / "stats"),
        }
    )
    (work / "stats").mkdir(parents=True, exist_ok=True)
    env.update(extra or {})
    return env


@dataclass
class Run:
    """One server run: its exit code, output, wall time, and what it left in ``work``."""

    rc: int
    stdout: str
    stderr: str
    wall_s: float
    work: Path
    result: dict = field(default_factory=dict)

    def patch_lines(self) -> dict[int, str]:
        """TP rank → the rest of its ``fastverify patch [TP r]: ...`` line (last one wins)."""
        return {int(r): rest for r, rest in PATCH_LINE.findall(self.stderr + self.stdout)}

    def paths_lines(self) -> dict[int, str]:
        """TP rank → the rest of its ``fastverify paths [TP r] after the first verify forward: ...`` line."""
        return {int(r): rest for r, rest in PATHS_LINE.findall(self.stderr + self.stdout)}

    def stats(self) -> dict[int, dict]:
        """TP rank → the shim's ``stats-rank<R>.json`` (env seen in the worker, verify forwards)."""
        out = {}
        for p in sorted((self.work / "stats").glob("stats-rank*.json")):
            d = json.loads(p.read_text())
            out[int(d["rank"])] = d
        return out

    def verify_records(self, prof: Path) -> dict[int, list[dict]]:
        """Rank → the JSON records of ``prof/verify-rank<R>.jsonl``."""
        out = {}
        for p in sorted(prof.glob("verify-rank*.jsonl")):
            rank = int(p.stem.removeprefix("verify-rank"))
            out[rank] = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return out

    def tail(self, n: int = 4000) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.stdout[-n:]}\n--- stderr\n{self.stderr[-n:]}"


def engine_command(
    py: str,
    work: Path,
    model: Path,
    *,
    env_file: Path | None,
    prof: Path | None,
    trace_steps: int = 0,
    prompts: list[str],
    tp: int = 2,
    max_new_tokens: int = 24,
    linger_s: float = 0,
    loop_s: float | None = None,
    engine: dict | None = None,
    engine_drop: list[str] | None = None,
) -> list[str]:
    """The ``python -m fastverify launch ... -- python engine.py CONFIG`` command line (``CONFIG``
    written to ``work/engine.json``; see :mod:`tests.sglang_server.engine` for its fields:
    ``engine`` are extra ``sglang.Engine`` kwargs over the CPU defaults, ``engine_drop`` defaults
    left out)."""
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "engine.json"
    conf = {"model": str(model), "tp": tp, "prompts": prompts, "max_new_tokens": max_new_tokens, "linger_s": linger_s}
    if loop_s is not None:
        conf["loop_s"] = loop_s
    if engine:
        conf["engine"] = engine
    if engine_drop:
        conf["engine_drop"] = list(engine_drop)
    cfg.write_text(json.dumps(conf))
    cmd = [py, "-m", "fastverify", "launch", "--backend", "auto"]
    if env_file is not None:
        cmd += ["--env", str(env_file)]
    if prof is not None:
        cmd += ["--profile-verify", str(prof)]
    if trace_steps:
        cmd += ["--trace-verify-steps", str(trace_steps)]
    return cmd + ["--", py, str(ENGINE), str(cfg)]


def launch_engine(
    py: str,
    work: Path,
    model: Path,
    *,
    env_file: Path | None,
    prof: Path | None,
    trace_steps: int = 0,
    prompts: list[str],
    tp: int = 2,
    max_new_tokens: int = 24,
    extra_env: dict[str, str] | None = None,
    linger_s: float = 0,
    timeout: float = 600,
    engine: dict | None = None,
    engine_drop: list[str] | None = None,
) -> Run:
    """``python -m fastverify launch [--env F] [--profile-verify D [--trace-verify-steps N]] --
    python engine.py CONFIG`` in the SGLang venv ``py``; waits for it to end (at most ``timeout``
    seconds: then the whole process tree is killed, see :func:`_run_bounded`)."""
    cmd = engine_command(
        py,
        work,
        model,
        env_file=env_file,
        prof=prof,
        trace_steps=trace_steps,
        prompts=prompts,
        tp=tp,
        max_new_tokens=max_new_tokens,
        linger_s=linger_s,
        engine=engine,
        engine_drop=engine_drop,
    )
    env = server_env(work, extra=extra_env)
    t0 = time.perf_counter()
    rc, so, se = _run_bounded(cmd, work, env, timeout)
    run = Run(rc, so, se, time.perf_counter() - t0, work)
    for line in so.splitlines():
        if line.startswith(RESULT):
            run.result = json.loads(line[len(RESULT) :])
    return run


def launch_load(
    py: str,
    work: Path,
    model: Path,
    *,
    prof: Path,
    fastverify_args: list[str],
    extra_env: dict[str, str] | None = None,
    server_flags: tuple[str, ...] = (),
    timeout: float = 900,
) -> tuple[Run, list[int]]:
    """``python -m fastverify launch --backend auto --profile-verify PROF ARGS -- python -m
    sglang.launch_server ...`` (the CPU :data:`SERVER_FLAGS`, then ``server_flags``) waited for; the
    run, and the pids of the run still alive right after launch exited (before the clean-up kills
    them): launch must leave none."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [
        py,
        "-m",
        "fastverify",
        "launch",
        "--backend",
        "auto",
        "--profile-verify",
        str(prof),
        *fastverify_args,
        "--",
        py,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--tp-size",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        *SERVER_FLAGS,
        *server_flags,
    ]
    env = server_env(work, extra=extra_env)
    left: list[int] = []
    t0 = time.perf_counter()
    rc, so, se = _run_bounded(cmd, work, env, timeout, left_after_exit=left)
    return Run(rc, so, se, time.perf_counter() - t0, work), left


def _run_bounded(
    cmd: list[str], work: Path, env: dict[str, str], timeout: float, left_after_exit: list[int] | None = None
) -> tuple[int, str, str]:
    """Run ``cmd`` in its own session and wait at most ``timeout`` s; (rc, stdout, stderr). On a
    timeout (rc -9, a line saying so appended to stderr), and after a normal exit too, every process
    of the run still alive (:func:`run_processes`: the session, its descendants, and any process
    with the run's ``FVTEST_STATS_DIR`` in its environment) is SIGKILLed by pid, so no SGLang worker
    outlives the test."""

    proc = subprocess.Popen(
        cmd, cwd=str(work), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    marker = ("FVTEST_STATS_DIR", env["FVTEST_STATS_DIR"])
    try:
        so, se = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        so, se = proc.communicate()
        rc, se = -9, (se or "") + f"\n[timed out after {timeout} s: the run's processes were killed]"
    if left_after_exit is not None:  # what the command left running, before this clean-up
        time.sleep(1.0)
        left_after_exit.extend(p for p in run_processes(proc.pid, marker) if p != proc.pid)
    end = time.monotonic() + 30
    # the launcher itself is reaped by now: its pid is left out (it could already be another process's)
    while (left := [p for p in run_processes(proc.pid, marker) if p != proc.pid]) and time.monotonic() < end:
        sigkill(left)
        time.sleep(0.2)
    return rc, so or "", se or ""


# --- a run that a test ends itself (kill -9 of a TP worker) -----------------------------------------


def sigkill(pids) -> None:
    """SIGKILL each of ``pids``; one already gone is skipped."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def report_line(request, tag: str, line: str) -> None:
    """Print ``[tag] line`` in the test session's output, shown even under ``-q`` and capture."""
    pm = request.config.pluginmanager
    tr, cap = pm.getplugin("terminalreporter"), pm.getplugin("capturemanager")
    if tr is not None and cap is not None:
        with cap.global_and_fixture_disabled():
            tr.write_line(f"[{tag}] {line}")


def _proc_stat(pid: str) -> tuple[int, int, int, str] | None:
    """(ppid, process group, session, state) of a live process from ``/proc/<pid>/stat``."""
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(rest[1]), int(rest[2]), int(rest[3]), rest[0]


def run_processes(root: int, marker: tuple[str, str]) -> list[int]:
    """Pids of the live processes (Linux ``/proc``) of one server run started as ``root`` in its
    own session: those of its session or process group, its descendants, and any other process
    whose environment holds ``marker`` (``KEY``, ``value``).

    Why three ways: SGLang names its workers with ``setproctitle`` (``sglang::scheduler_TP0``),
    which overwrites their ``/proc/<pid>/environ``, so the environment marker alone misses them;
    the session and the parent links miss a process that called ``setsid`` and was re-parented,
    which the marker (``FVTEST_STATS_DIR``, unique to the run, :func:`server_env`) still finds.
    Zombies (already dead) are not listed."""
    needle = f"{marker[0]}={marker[1]}".encode()
    stats = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid() and (st := _proc_stat(d.name)) and st[3] not in "ZX":
            stats[int(d.name)] = st
    out = set()
    for pid, (ppid, pgrp, sid, _) in stats.items():
        if root in (sid, pgrp, pid):
            out.add(pid)
            continue
        seen, p = set(), ppid
        while p in stats and p not in seen:  # an ancestor of this run?
            if p == root:
                out.add(pid)
                break
            seen.add(p)
            p = stats[p][0]
        else:
            try:
                if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    out.add(pid)
            except OSError:  # gone, or not ours
                pass
    return sorted(out)


def wait_dead(pid: int, timeout: float = 20) -> bool:
    """True once ``pid`` is gone or a zombie (its threads have stopped: nothing more is written)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.01)
    return False


class EngineProcess:
    """``fastverify launch ... -- python engine.py CONFIG`` (``loop_s``: answering prompts until the
    test ends it) started in its own session and not waited for; stdout+stderr go to
    ``work/engine.log``. :meth:`stop` kills the whole process tree."""

    def __init__(
        self,
        py: str,
        work: Path,
        model: Path,
        *,
        prof: Path,
        prompts: list[str],
        max_new_tokens: int,
        loop_s: float,
        tp: int = 2,
    ) -> None:
        cmd = engine_command(
            py,
            work,
            model,
            env_file=None,
            prof=prof,
            prompts=prompts,
            tp=tp,
            max_new_tokens=max_new_tokens,
            loop_s=loop_s,
        )
        self.work = work
        self.log = work / "engine.log"
        env = server_env(work)
        self.marker = ("FVTEST_STATS_DIR", env["FVTEST_STATS_DIR"])  # unique to this run
        self._out = open(self.log, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, cwd=str(work), env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def text(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def processes(self) -> list[int]:
        """Live pids of this run's process tree (:func:`run_processes`)."""
        return run_processes(self.proc.pid, self.marker)

    def stop(self, timeout: float = 30) -> tuple[int, list[int]]:
        """SIGKILL to the session's process group, then, by pid, to every process of the run still
        alive (:meth:`processes`: one that left the group); waits up to ``timeout`` s for them to go.
        Returns (how many processes were found to kill, pids still alive after ``timeout``)."""
        import signal

        found = set(self.processes())
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        end = time.monotonic() + timeout
        left = self.processes()
        while left and time.monotonic() < end:
            found.update(left)
            sigkill(left)
            time.sleep(0.1)
            left = self.processes()
        try:
            self.proc.wait(max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            left = sorted(set(left) | {self.proc.pid})
        self._out.close()
        return len(found), left


SERVER_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--mem-fraction-static",
    "0.4",
    "--max-total-tokens",
    "4096",
    "--speculative-algorithm",
    "NGRAM",
    "--speculative-num-draft-tokens",
    "4",
    "--speculative-ngram-max-bfs-breadth",
    "1",
    "--max-running-requests",
    "4",
    "--log-level",
    "warning",
)
"""``python -m sglang.launch_server`` flags: the same CPU settings as :data:`engine.CPU_ENGINE_ARGS`."""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    """(status, text) of one HTTP request; (0, why) when the server does not answer."""
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ValueError) as e:
        return 0, f"{type(e).__name__}: {e}"


class HttpServer:
    """``fastverify launch ... -- python -m sglang.launch_server ...`` in its own session (so the
    whole tree it spawns can be ended by its process-group id); stdout+stderr go to ``work/server.log``."""

    def __init__(
        self, py: str, work: Path, model: Path, *, prof: Path, tp: int = 2, extra_env: dict[str, str] | None = None
    ) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work, self.port = work, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / "server.log"
        cmd = [
            py,
            "-m",
            "fastverify",
            "launch",
            "--backend",
            "auto",
            "--profile-verify",
            str(prof),
            "--",
            py,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            "--tp-size",
            str(tp),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *SERVER_FLAGS,
        ]
        self._out = open(self.log, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            cwd=str(work),
            env=server_env(work, extra=extra_env),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.ready_s: float | None = None

    def wait_ready(self, timeout: float = 400) -> float:
        """Seconds until ``/health_generate`` answers 200 (SGLang runs one generation for it)."""
        end = time.perf_counter() + timeout
        while time.perf_counter() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited rc={self.proc.returncode}:\n{self.text()[-4000:]}")
            status, _ = http("GET", self.url + "/health_generate", timeout=60)
            if status == 200:
                self.ready_s = time.perf_counter() - self.t0
                return self.ready_s
            time.sleep(2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 20 s."""
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self._out.close()


def _text(b) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b
