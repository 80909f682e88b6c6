"""``fastverify launch --load`` / ``--baseline``: launch stays the server's parent, waits (bounded)
until it is healthy, runs the answer phase (:mod:`fastverify.proof.answers`), checks the answers
against a baseline run when given, runs the throughput phase (:mod:`fastverify.proof.throughput`),
writes the run's record ``load.json`` beside the verify records, and stops the server.

A run folder holds ``verify-rank<R>.jsonl`` (the patch's verify timer), ``answers.jsonl`` (one
answer a line, appended as each arrives), ``bench-c<C>.jsonl`` / ``.log`` (the benchmark client's
result and log per concurrency) and ``load.json`` (:class:`LoadRun`, written last, whole). A run
cut short (the server died, a signal, a client failure) still writes ``load.json``, with
``complete`` false and the reason; ``compare`` refuses it unless asked.

The server ``launch`` keeps as its child (with ``--load`` or ``--baseline``): started in its own
process group, killed by the kernel if ``launch`` dies (``PR_SET_PDEATHSIG``), sent the signals
``launch`` receives, waited for until healthy (bounded), and stopped (SIGTERM, then SIGKILL).

SGLang 0.5.23's scheduler and detokenizer processes ask for SIGKILL when their parent dies
(``srt/utils/common.py::kill_itself_when_parent_died``), so a server whose main process ends takes
its workers with it; its HTTP server turns SIGINT/SIGTERM into a graceful stop
(``srt/entrypoints/http_server.py``). ``GET /health_generate`` answers 200 once the server has run
a generation (the same file).
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import orjson

from fastverify.collect.client import normalise_url
from fastverify.collect.server import fetch_server_info, http
from fastverify.errors import UserError, one_line, path_text
from fastverify.outputs import atomic_write_text
from fastverify.patch.launch_plan import Blocker, Checks
from fastverify.patch.verify import FLUSH_INTERVAL_S
from fastverify.proof.answers import (
    Answer,
    AnswerBaseline,
    Prompt,
    answer_of,
    judge,
    prompt_digest,
    read_prompts,
    request_body,
    tolerance,
)
from fastverify.proof.record import ANSWERS, RECORD, LoadRun, read_run, server_difference
from fastverify.proof.throughput import CLIENT, parse_concurrency, run_client
from fastverify.verify_records import FILE_GLOB

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HEALTH = "/health_generate"
POLL_S = 2.0
PROBE_TIMEOUT_S = 60.0
STOP_GRACE_S = 30.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ServerExited(Exception):
    """The server's main process ended on its own; ``returncode`` as :attr:`subprocess.Popen.returncode`."""

    def __init__(self, returncode: int) -> None:
        super().__init__(returncode)
        self.returncode = returncode


class Stopped(Exception):
    """``launch`` received ``signum`` (forwarded to the server's process group)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def exit_code(returncode: int) -> int:
    """A shell's exit code for a child's ``returncode`` (``-N``: killed by signal N, 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux; elsewhere nothing). ``launch``
    calls Popen from its only thread, so ``preexec_fn`` is safe here."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Server:
    """The server command, started at construction.

    Raises
    ------
    UserError
        The command cannot be run (not found, not executable).
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        try:
            self.proc = subprocess.Popen(list(argv), env=dict(env), start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as err:
            raise UserError(f"cannot run {argv[0]!r}: {err.strerror or err}") from None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Server:
        for s in FORWARDED:
            self._previous[s] = signal.signal(s, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        for s, h in self._previous.items():
            signal.signal(s, h)

    def _forward(self, signum, _frame) -> None:
        self.signal(signum)
        raise Stopped(signum)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the server's process group (nothing when it is gone)."""
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def check_alive(self) -> None:
        """Raise :class:`ServerExited` when the server's main process has ended."""
        rc = self.proc.poll()
        if rc is not None:
            raise ServerExited(rc)

    def wait_healthy(self, url: str, timeout_s: float) -> float:
        """Seconds until ``url + /health_generate`` answered 200.

        Raises
        ------
        ServerExited
            The server ended first.
        TimeoutError
            Not healthy within ``timeout_s``.
        """
        t0 = time.monotonic()
        while True:
            self.check_alive()
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                raise TimeoutError(f"{url} was not healthy after {timeout_s:g} s ({HEALTH} never answered 200)")
            try:
                status, _ = http("GET", url + HEALTH, timeout_s=min(PROBE_TIMEOUT_S, max(left, 1.0)))
            except OSError:
                status = 0
            if status == 200:
                return time.monotonic() - t0
            time.sleep(min(POLL_S, max(left, 0.05)))

    def wait(self) -> int:
        """Wait for the server to end; its :attr:`~subprocess.Popen.returncode`."""
        return self.proc.wait()

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM to the process group, SIGKILL to it after ``grace_s``; the main process's
        return code (its own, when it had already ended)."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # whatever of the group is left (a worker that ignored SIGTERM)
        return self.proc.wait()


BENCH_GLOB = "bench-c*.jsonl"
RUN_FILES = (RECORD, RECORD + ".bak", ANSWERS, BENCH_GLOB, "bench-c*.log", FILE_GLOB)
"""What a run writes into its folder: a folder holding any of these holds a run."""
SERVER_FACTS = (
    "device",
    "dtype",
    "tp_size",
    "model_path",
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "version",
)
"""The ``/server_info`` fields a run keeps (the server's own resolved arguments)."""
REQUEST_TIMEOUT_S = 600.0
DEATH_GRACE_S = 3.0


@dataclass(frozen=True)
class LoadOptions:
    """What ``launch --load`` / ``--baseline`` was asked: ``load`` (run the throughput phase and
    write the run), ``prompts`` (a JSONL file, None: fastverify's own), ``max_new_tokens``,
    ``concurrency`` levels, ``requests`` per level, ``input_len`` / ``output_len`` (tokens),
    ``ready_timeout_s`` (s), ``baseline`` (a run folder), ``logprob_tol`` (nats), ``force`` (replace
    a run in the folder), ``url`` (the server's, when launch cannot read it from the command),
    ``on_mismatch`` (``stop``, or ``fallback``: :class:`FallBack` on CHANGED). Without ``baseline``
    the plan's deployment record's answers (``LaunchPlan.answer_baseline``), when it has some, are
    the baseline."""

    load: bool
    prompts: Path | None = None
    max_new_tokens: int = 64
    concurrency: tuple[int, ...] = (1,)
    requests: int = 8
    input_len: int = 128
    output_len: int = 256
    ready_timeout_s: float = 1800.0
    baseline: Path | None = None
    logprob_tol: float | None = None
    force: bool = False
    url: str | None = None
    on_mismatch: str = "stop"


class FallBack(Exception):
    """The answers CHANGED and ``--on-mismatch fallback`` was asked: the server was stopped; launch
    starts it again without the swap."""


def load_options(args, checks: Checks | None = None) -> LoadOptions:
    """The :class:`LoadOptions` of ``launch``'s parsed arguments; ``checks`` (default: refuse at
    once) decides whether a bad value raises or is recorded as a blocker (the dry run), then
    ``--concurrency 1`` stands in for a bad one.

    Raises
    ------
    UserError
        A bad ``--concurrency``, or ``--on-mismatch fallback`` with ``--load`` (a load run
        measures one server), unless ``checks`` collects them.
    """
    checks = Checks(collect=False) if checks is None else checks
    if args.on_mismatch == "fallback" and args.load is not None:
        checks.refuse(
            "load",
            "--on-mismatch fallback restarts a serving server without the swap; a --load run "
            "measures one server: drop one of them",
        )
    concurrency: tuple[int, ...] = (1,)
    with checks.guard("load"):
        concurrency = tuple(parse_concurrency(args.concurrency))
    return LoadOptions(
        load=args.load is not None,
        prompts=Path(args.load) if args.load else None,
        max_new_tokens=args.max_new_tokens,
        concurrency=concurrency,
        requests=args.requests,
        input_len=args.input_len,
        output_len=args.output_len,
        ready_timeout_s=args.ready_timeout,
        baseline=args.baseline,
        logprob_tol=args.logprob_tol,
        force=args.force,
        url=args.url,
        on_mismatch=args.on_mismatch,
    )


def baseline_of(folder: str | Path, flag: str = "--baseline") -> AnswerBaseline:
    """The answers of the complete run in ``folder`` as a deployment record carries them. Raises
    :class:`UserError` as :func:`read_run`."""
    run = read_run(folder, flag=flag)
    return AnswerBaseline(
        source=path_text(Path(folder).resolve()),
        prompts=run.prompts,
        max_new_tokens=run.max_new_tokens,
        answers=run.answers,
        server=run.server,
        dtype=run.dtype,
    )


def ask(url: str, prompt: Prompt, max_new_tokens: int, timeout_s: float) -> Answer:
    """One greedy answer of the server at ``url``.

    Raises
    ------
    OSError
        No answer in ``timeout_s``, an HTTP error status, or a reply that is not an SGLang answer
        (its first 200 characters said).
    """
    t0 = time.perf_counter()
    status, raw = http("POST", url + "/generate", request_body(prompt, max_new_tokens), timeout_s=timeout_s)
    latency = time.perf_counter() - t0
    if status != 200:
        raise OSError(f"/generate answered HTTP {status}: {raw[:200].decode(errors='replace')}")
    try:
        reply = orjson.loads(raw)
        if not isinstance(reply, dict):
            raise ValueError("not a JSON object")
        answer = answer_of(prompt, reply, latency)
    except (orjson.JSONDecodeError, ValueError) as err:
        raise OSError(f"/generate: not an SGLang answer ({err}): {raw[:200].decode(errors='replace')}") from None
    if not 0 < len(answer.output_ids) <= max_new_tokens:
        raise OSError(f"/generate answered {len(answer.output_ids)} tokens for max_new_tokens {max_new_tokens}")
    return answer


def answer_phase(
    url: str,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    *,
    timeout_s: float,
    on_answer: Callable[[Answer], None] | None = None,
) -> list[Answer]:
    """Ask every prompt in turn (one at a time: the answers do not depend on batching); each answer
    goes to ``on_answer`` as it arrives. Raises OSError as :func:`ask` (the answers so far were
    given to ``on_answer``)."""
    out = []
    for p in prompts:
        a = ask(url, p, max_new_tokens, timeout_s)
        out.append(a)
        if on_answer is not None:
            on_answer(a)
    return out


def _utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _say(text: str) -> None:
    """One progress line on stderr; server text in it made terminal-safe and kept on one line."""
    sys.stderr.write(f"fastverify launch: {one_line(text, 2000)}\n")
    sys.stderr.flush()


def proof_blockers(plan, args) -> tuple[Blocker, ...]:
    """``launch --dry-run`` with ``--load`` / ``--baseline`` (or a record's baseline): every check
    the real launch runs on these inputs before it starts the server (:func:`load_options`, then
    :func:`_inputs`, the same code), each failure a :class:`Blocker`; nothing is made or cleared.
    Empty when nothing would refuse."""
    checks = Checks(collect=True)
    _inputs(plan, load_options(args, checks), checks, dry_run=True)
    return checks.blockers


def prepare_folder(folder: Path, force: bool, *, dry_run: bool = False) -> None:
    """Make ``folder``; one that already holds a run (:data:`RUN_FILES`) is refused unless
    ``force``, which removes that run's files (nothing else in the folder is touched).

    Raises
    ------
    UserError
        A run is there and not ``force``; the folder cannot be made or cleared.
    """
    try:
        old = sorted({p for pat in RUN_FILES for p in folder.glob(pat)}) if folder.is_dir() else []
    except OSError as err:  # a name too long, a loop
        raise UserError(f"--profile-verify {path_text(folder)}: {err.strerror or err}") from None
    if old and not force:
        raise UserError(
            f"--profile-verify {path_text(folder)}: already holds a run ({old[0].name}, {len(old)} "
            "files); choose another folder, or --force to replace it"
        )
    if dry_run:
        return
    try:
        for p in old:
            p.unlink()
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--profile-verify {path_text(folder)}: {err.strerror or err}") from None


def check_baseline(baseline: AnswerBaseline, server: dict, where: str) -> None:
    """Refuse a baseline whose server differs from this command in any :data:`COMPARABLE` field."""
    if (diff := server_difference(baseline.server, server)) is not None:
        k, was, now = diff
        raise UserError(f"{where}: its server ran {k}={was!r}, this command {k}={now!r}: not comparable")


class _Writer:
    """The run's record in the making: answers appended to ``answers.jsonl`` as they arrive,
    ``load.json`` written once at the end (complete or not)."""

    def __init__(self, folder: Path | None, run: LoadRun) -> None:
        self.folder, self.run = folder, run
        self._answers = None
        self.done = False

    def answer(self, a: Answer) -> None:
        self.run.answers.append(a)
        if self.folder is not None:
            if self._answers is None:
                self._answers = open(self.folder / ANSWERS, "ab")
            self._answers.write(msgspec.json.encode(a) + b"\n")
            self._answers.flush()

    def finish(self, complete: bool, why: str | None = None) -> None:
        if self._answers is not None:
            self._answers.close()
            self._answers = None
        self.run.complete, self.run.incomplete, self.done = complete, why, True
        if self.folder is not None:
            text = msgspec.json.format(msgspec.json.encode(self.run).decode(), indent=1) + "\n"
            atomic_write_text(self.folder / RECORD, text)
            _say(f"wrote {path_text(self.folder / RECORD)}" + ("" if complete else " (incomplete)"))


def _new_run(plan, opts: LoadOptions, url: str, prompts: list[Prompt], source: str, max_new: int) -> LoadRun:
    server = plan.server.as_dict() if plan.server is not None else {}
    return LoadRun(
        created_utc=_utc(),
        url=url,
        command=[path_text(a) for a in plan.argv],
        server=server,
        backend=plan.backend,
        env_file=path_text(plan.env_file) if plan.env_file else None,
        deployment=path_text(plan.deployment) if plan.deployment else None,
        prompts_source=path_text(source),
        prompts_digest=prompt_digest(prompts),
        prompts=prompts,
        max_new_tokens=max_new,
        baseline=source if (opts.baseline or plan.answer_baseline) else None,
    )


def _url(plan, opts: LoadOptions) -> str:
    """The server's base URL: ``--url``, else the command's ``--host`` / ``--port``; normalised.
    Raises :class:`UserError` (naming ``--url`` or the command) when there is none or it is bad."""
    url = opts.url or (plan.server.url if plan.server is not None else None)
    if url is None:
        raise UserError("the command is not an SGLang server command launch can read: give --url http://host:port")
    return check_url(url, "--url" if opts.url else "the server's address")


def check_url(url: str, flag: str = "--url") -> str:
    """``url`` normalised by ``collect --server``'s own check (:func:`normalise_url`), its
    refusal naming ``flag``; ``launch`` checks a ``--url`` with it whether or not a proof runs.

    Raises
    ------
    UserError
        A URL that is not ``http(s)://host:port`` (a user name or password in it is never shown).
    """
    try:
        return normalise_url(url)
    except UserError as err:
        raise UserError(str(err).replace("--server", flag, 1)) from None
    except ValueError as err:  # urllib's own refusals ("Invalid IPv6 URL")
        raise UserError(f"{flag} {url!r}: {err}") from None


def _inputs(
    plan, opts: LoadOptions, checks: Checks, *, dry_run: bool = False
) -> tuple[str, AnswerBaseline | None, list[Prompt], str, int, Path | None]:
    """The URL, the baseline run, the prompts (the baseline's when given), their source, the
    tokens per answer and the run folder; every refusal before the server starts, through
    ``checks`` (the real launch raises the first; the dry run records each and goes on, and its
    return value then means nothing). ``dry_run``: the folder is checked, not made or cleared."""
    folder = Path(plan.profile_verify) if plan.profile_verify else None
    if opts.load and folder is None:
        checks.refuse("load", "--load writes its results beside the verify records: give --profile-verify DIR")
    url = ""
    with checks.guard("URL"):
        url = _url(plan, opts)
    if folder is not None and opts.baseline is not None and os.path.realpath(folder) == os.path.realpath(opts.baseline):
        checks.refuse(
            "run folder",
            f"--profile-verify {path_text(folder)} is the --baseline folder: the new run "
            "would replace the baseline; give another folder",
        )
    baseline, where = plan.answer_baseline, f"the deployment record {plan.deployment}'s baseline"
    if opts.baseline is not None:
        baseline, where = None, f"--baseline {path_text(opts.baseline)}"
        with checks.guard("baseline"):
            baseline = baseline_of(opts.baseline)
    prompts: list[Prompt] = []
    source, max_new = "", opts.max_new_tokens
    if opts.baseline is not None or baseline is not None:
        if opts.prompts is not None:
            checks.refuse("load", f"{where} brings its own prompts: give --load without a FILE")
        if baseline is not None:
            with checks.guard("baseline"):
                check_baseline(baseline, plan.server.as_dict() if plan.server is not None else {}, where)
            prompts, source, max_new = baseline.prompts, where, baseline.max_new_tokens
    else:
        with checks.guard("load"):
            prompts, source = read_prompts(opts.prompts)
    if folder is not None:
        with checks.guard("run folder"):
            prepare_folder(folder, opts.force, dry_run=True)
    if opts.load and not _client_installed():
        checks.refuse(
            "load",
            f"--load runs SGLang's benchmark client ({CLIENT}), which this Python cannot import: "
            "run launch with the Python that has SGLang",
        )
    if folder is not None and not dry_run:
        prepare_folder(folder, opts.force)
    return url, baseline, prompts, source, max_new, folder


def _client_installed() -> bool:
    """Whether this Python has SGLang's benchmark client (found by file: SGLang is never imported)."""
    spec = importlib.util.find_spec("sglang")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return any((Path(r) / "benchmark" / "serving.py").is_file() for r in roots)


def _check_answers(run: LoadRun, baseline: AnswerBaseline, opts: LoadOptions) -> bool:
    """The start-up check: True when the answers are the baseline's (or within noise)."""
    tol, basis = tolerance(baseline.dtype or run.dtype, opts.logprob_tol)
    verdict = judge(baseline.answers, run.answers, tol, basis)
    run.answers_verdict = verdict.verdict
    _say(f"answers against {run.baseline}: {verdict.line()}")
    return verdict.verdict != "CHANGED"


def _phases(srv: Server, w: _Writer, opts: LoadOptions, baseline: AnswerBaseline | None, folder: Path | None) -> int:
    """Health, answers, the check, throughput; the exit code (the record is finished by the caller
    on an exception)."""
    run = w.run
    run.ready_s = round(srv.wait_healthy(run.url, opts.ready_timeout_s), 3)
    info = fetch_server_info(run.url).info
    run.server_info = {k: info.get(k) for k in SERVER_FACTS if k in info}
    if run.server_info.get("device") == "cpu":
        run.clock = "cpu_server_wall_clock"
    _say(
        f"server healthy after {run.ready_s:.1f} s at {run.url}; answer phase: {len(run.prompts)} "
        f"prompt{'s' if len(run.prompts) != 1 else ''} x {run.max_new_tokens} tokens, greedy"
    )
    t0 = time.monotonic()
    answer_phase(run.url, run.prompts, run.max_new_tokens, timeout_s=REQUEST_TIMEOUT_S, on_answer=w.answer)
    _say(f"answers: {len(run.answers)} in {time.monotonic() - t0:.1f} s")
    if baseline is not None and not _check_answers(run, baseline, opts):
        w.finish(False, "stopped at the start-up check: answers CHANGED against the baseline")
        if opts.on_mismatch == "fallback":
            raise FallBack()
        return 1
    if not opts.load:
        w.finish(True)
        _say("serving; Ctrl-C stops the server")
        return exit_code(srv.wait())
    for c in opts.concurrency:
        srv.check_alive()
        out = folder / f"bench-c{c}.jsonl"
        t = run_client(
            run.url,
            c,
            max(opts.requests, c),
            opts.input_len,
            opts.output_len,
            out,
            run.server.get("model"),
            REQUEST_TIMEOUT_S * max(opts.requests, c),
        )
        run.throughput.append(t)
        mean = sum(t.per_stream_tok_s) / len(t.per_stream_tok_s) if t.per_stream_tok_s else float("nan")
        _say(
            f"throughput at concurrency {c}: {t.completed}/{t.requests} requests, {mean:.1f} tok/s per stream "
            f"(mean), {t.output_tok_s:.1f} tok/s aggregate ({run.clock})"
        )
    srv.check_alive()
    time.sleep(2.5 * FLUSH_INTERVAL_S)  # the verify timer's writer appends at least once a second
    w.finish(True)
    return 0


def supervise(plan, opts: LoadOptions, environ: Mapping[str, str]) -> int:
    """Run the server as launch's child through the phases above; the exit code: 0 (done), 1
    (answers CHANGED, or the run cut short by a client failure), the server's own (it ended), or
    128 + N (signal N, forwarded to the server).

    Raises
    ------
    UserError
        A plan with blockers; any refusal before the server starts (:func:`_inputs`); the server
        not healthy in time or ending before it was (the server stopped first, nothing half-written).
    """
    if plan.blockers:  # a dry run's plan: nothing starts
        raise UserError(plan.blockers[0].message)
    url, baseline, prompts, source, max_new, folder = _inputs(plan, opts, Checks(collect=False))
    w = _Writer(folder, _new_run(plan, opts, url, prompts, source, max_new))
    with Server(plan.argv, plan.child_env(environ)) as srv:
        try:
            return _phases(srv, w, opts, baseline, folder)
        except UserError as err:  # the server answers, but not as SGLang does
            w.finish(False, str(err))
            raise
        except TimeoutError as err:  # nothing was asked yet: nothing is written
            raise UserError(f"{err}; the server was stopped") from None
        except ServerExited as err:
            why = f"the server exited with code {err.returncode}"
            if w.run.ready_s is None:
                raise UserError(f"{why} before it was healthy (its own output above says why)") from None
            w.finish(False, f"{why} after {len(w.run.answers)} answers")
            _say(f"{why}; the results so far are kept, marked incomplete")
            return exit_code(err.returncode) or 1
        except Stopped as err:
            if not w.done:  # a signal while serving after a finished check leaves its record as it is
                w.finish(False, f"stopped by signal {err.signum}")
            return 128 + err.signum
        except OSError as err:
            try:  # a dropped connection may be the server's end: give it a moment to be reaped
                srv.proc.wait(DEATH_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            if srv.proc.poll() is not None:
                w.finish(False, f"the server exited with code {srv.proc.returncode} ({err})")
                return exit_code(srv.proc.returncode) or 1
            w.finish(False, str(err))
            _say(f"the load failed: {err}; the results so far are kept, marked incomplete")
            return 1
