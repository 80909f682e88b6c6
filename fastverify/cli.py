"""The ``fastverify`` command line. User mistakes exit with code 2 and one line on stderr.

A run imports only its own subcommand's modules: each is imported where the subcommand's parser
is built or run, marked ``# lazy: subcommand`` (with the heavy library it brings, where it brings
one), so that ``fastverify profile --trace`` does not pay for ``doctor``'s or ``launch``'s imports."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from fastverify.bounds import MAX_TIMEOUT_S
from fastverify.errors import EXIT_USER_ERROR, UserError, one_line, print_guarded, printable
from fastverify.inputs import read_text
from fastverify.outputs import or_default, output_arg, path_arg, path_arg as _folder, path_text_arg
from fastverify.profile.painter import EARLY, PROGRAM, start_painter_early


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's own code for usage errors)
        sys.stderr.write(f"fastverify: error: {one_line(message)}\n")
        raise SystemExit(EXIT_USER_ERROR)


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults in the help, once: not where the help says its own ``[default: …]``, and
    not for a flag without a value (``None``, ``False``)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "[default" in text or action.default in (None, False) or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _bounded(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {v}")
        return v

    return parse


def _up_to(hi: float, unit: str, lo: float = 0.0):
    """A parser of a finite number of ``unit`` in (0, ``hi``], or [``lo``, ``hi``] when ``lo`` is
    given; nan and inf are refused."""
    span = f"[{lo:g}, {hi:g}]" if lo else f"(0, {hi:g}]"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {unit} in {span}, got {text!r}") from None
        if not (lo <= v if lo else 0 < v) or not v <= hi:  # also false for nan
            raise argparse.ArgumentTypeError(f"expected {unit} in {span}, got {text}")
        return v

    return parse


_seconds = _up_to(MAX_TIMEOUT_S, "seconds")
"""Seconds in (0, MAX_TIMEOUT_S]: nan, inf and 1e300 are refused here, before
``torch.distributed.TCPStore`` turns them into an OverflowError or a hang."""
_nats = _up_to(100.0, "nats")


def _subcommand(sub, name: str, description: str, formatter_class=DefaultsHelp) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``: its help line from :data:`COMMANDS`, no abbreviated flags."""
    return sub.add_parser(
        name, allow_abbrev=False, help=COMMANDS[name][0], description=description, formatter_class=formatter_class
    )


def _add_profile(sub) -> None:
    from fastverify.profile.command import add_arguments  # lazy: subcommand

    add_arguments(sub, _positive, _bounded, _seconds, DefaultsHelp)


def _add_topo(sub) -> None:
    from fastverify.topo_command import add_arguments  # lazy: subcommand

    topo = _subcommand(
        sub,
        "topo",
        (
            "Which GPU pairs NCCL runs over P2P and which over SHM, whether a PCIe IPC all-reduce can "
            "run, the NCCL_P2P_LEVEL to use, NCCL settings NCCL would ignore, and the PREDICTED "
            "all-reduce time of the verify messages now and with the recommended settings. Reads NVML "
            "on a GPU box; offline, give the text of `nvidia-smi topo -m`, an NCCL_DEBUG=INFO log and/or an "
            "all_reduce_perf table, in any combination; partial evidence gives a partial diagnosis."
        ),
    )
    add_arguments(topo, _bounded)


def _add_p2p(sub) -> None:
    p = _subcommand(
        sub,
        "p2p",
        (
            "Child processes open and write each GPU pair's memory through CUDA IPC, both ways; a hang "
            "is a timeout, not a failure (never cached; retried). Prints the check's JSON (the GPUs "
            "tested, by CUDA ordinal, NVML index, PCI bus id and UUID, and a result per ordered pair) "
            "that `tune --p2p-check` and `launch --p2p-check` read; passes and failures cached per "
            "box. Exit 1 if any pair fails or times out."
        ),
    )
    from fastverify.topo.p2p import DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S  # lazy: subcommand

    p.add_argument(
        "--output",
        type=output_arg,
        metavar="FILE",
        default=None,
        help="write the JSON there (a new file) instead of printing it",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --output file")
    p.add_argument(
        "--timeout",
        type=_up_to(MAX_TIMEOUT_S, "seconds", MIN_TIMEOUT_S),
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds per pair, at least {MIN_TIMEOUT_S:g} (each side imports torch)",
    )
    p.add_argument("--refresh", action="store_true", help="run again even where this box's result is cached")


def _add_tune(sub) -> None:
    from fastverify.tune.command import add_arguments as add_tune_arguments  # lazy: subcommand (numpy)

    tune = _subcommand(
        sub,
        "tune",
        (
            "Rank NCCL settings with the cost model and measure them, with FlashInfer's PCIe IPC and "
            "fused all-reduce and SGLang's custom all-reduce where they can run, in isolated worker "
            "processes; report the verify-latency reduction and write the winning settings. "
            "--predict: measure nothing; rank NCCL settings and the backends the box allows, PREDICTED "
            "from the cost model and published measurements, your --profile / --perf-table / --nccl-log "
            "first, for a box described by `nvidia-smi topo -m` text. --json: one JSON document."
        ),
    )
    add_tune_arguments(tune, _positive, _bounded)


def _add_doctor(sub) -> None:
    doctor = _subcommand(
        sub,
        "doctor",
        (
            "Checks, each ok / warn / fail / skipped with a one-line reason and a fix: versions, a gloo "
            "all-reduce across 2 processes, the trace analyzer, the env-file validator, the NCCL "
            "library, FlashInfer, SGLang; on one GPU the single-GPU self-check (ncclGetVersion vs "
            "torch, NVML, whether a late CUDA_DEVICE_MAX_CONNECTIONS takes effect, FlashInfer's JIT "
            "build times and stream binding with real streams, fused_add_rmsnorm eager and in a graph, "
            "the verify timer without host sync, a 1-rank NCCL backend in a replayed graph, the patch's "
            "counts on SGLang's draft/prefill graphs, a compiled forward and two fused groups, the live "
            "runner at TP 1, the tiny forward's graph and profiler trace); with several GPUs the real "
            "P2P check and one all-reduce per registry backend. FlashInfer checks are skipped where "
            "it is not installed. Exit 1 if any check fails."
        ),
    )
    doctor.add_argument("--quick", action="store_true", help="only the checks that take well under a second")
    doctor.add_argument("--json", action="store_true", help="print the checks and summary as JSON")
    doctor.add_argument("--env-file", type=path_arg, default=None, help="also validate this env file")


def _add_launch(sub) -> None:
    from fastverify.patch.launch import BACKENDS  # lazy: subcommand (importlib.metadata)

    launch = _subcommand(
        sub,
        "launch",
        (
            "Validate the env file (allow-listed keys only), put its settings in the environment, make "
            "the patch load in every TP rank (SGLang's plugin entry point, else an import hook) and exec "
            "the command given after --. --dry-run prints what would be set, which route loads the "
            "patch, and every check that would refuse the launch with its fix (exit 2 when any does, "
            "0 when none); the real launch stops at the first one and starts nothing."
        ),
    )
    launch.add_argument(
        "--env", type=path_arg, metavar="FILE", help="env file written by `fastverify tune --write-env`"
    )
    launch.add_argument(
        "--backend",
        default="auto",
        metavar="{" + ",".join(BACKENDS) + "}",
        help="all-reduce backend in the ranks (auto: the deployment record's)",
    )
    launch.add_argument(
        "--deployment",
        type=path_arg,
        metavar="FILE",
        help="deployment record [default: X.deploy.json beside the --env file X.env]",
    )
    launch.add_argument(
        "--p2p-check",
        type=path_arg,
        metavar="FILE",
        help="JSON of `fastverify p2p` (proves P2P for pcie_ipc, fused, b12x)",
    )
    launch.add_argument(
        "--describe-box",
        metavar="JSON|FILE",
        default=None,
        help=(
            "describe the serving box when checking a record away from it: a "
            'JSON object with the box fingerprint\'s fields, e.g. \'{"gpu_name": "NVIDIA RTX PRO '
            '6000 Blackwell Server Edition", "sm": [12, 0], "gpu_count": 8}\' (also '
            'driver, nccl_version, nvlink_full, gpu_memory_bytes, and gpus: [{"index", '
            '"pci_bus_id", "uuid"}, ...] in CUDA order, which P2P proofs bind to), or a '
            "file holding one; the same as FASTVERIFY_DESCRIBE_BOX [default: read this machine]"
        ),
    )
    launch.add_argument(
        "--profile-verify",
        type=_folder,
        metavar="DIR",
        help="time every verify forward with CUDA events into DIR/verify-rank<R>.jsonl",
    )
    launch.add_argument(
        "--trace-verify-steps",
        type=_bounded(0, 1000),
        default=0,
        metavar="N",
        help="also record a torch.profiler trace of N verify steps per rank into --profile-verify",
    )
    launch.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and every check that blocks it, start nothing (exit 2 if blocked)",
    )
    proof = launch.add_argument_group(
        "the proof of a swap (launch stays the server's parent, forwards SIGINT/SIGTERM to it and stops it after)"
    )
    proof.add_argument(
        "--load",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        type=or_default(path_text_arg),
        help=(
            "once the server is healthy, run a fixed load and write DIR/load.json beside the verify "
            "records (--profile-verify DIR), then stop the server: greedy answers to the prompts of "
            "FILE (JSONL, {\"prompt\": ...} a line) or fastverify's own 16, then SGLang's benchmark "
            "client at each --concurrency"
        ),
    )
    proof.add_argument(
        "--baseline",
        type=path_arg,
        metavar="DIR",
        help=(
            "a --load run of the server without the swap: ask its prompts first and stop the server "
            "(exit 1) when the answers CHANGED; without --load, then go on serving"
        ),
    )
    proof.add_argument(
        "--max-new-tokens",
        type=_bounded(1, 4096),
        default=64,
        metavar="N",
        help="tokens per answer of the answer phase",
    )
    proof.add_argument(
        "--concurrency",
        default="1",
        metavar="C[,C...]",
        help="parallel streams of each throughput run (1 = the single-stream tok/s)",
    )
    proof.add_argument(
        "--requests",
        type=_bounded(1, 100_000),
        default=8,
        metavar="N",
        help="requests per throughput run (at least the concurrency)",
    )
    proof.add_argument(
        "--input-len",
        type=_bounded(1, 1_000_000),
        default=128,
        metavar="N",
        help="prompt tokens of each throughput request",
    )
    proof.add_argument(
        "--output-len",
        type=_bounded(2, 1_000_000),
        default=256,
        metavar="N",
        help="output tokens of each throughput request",
    )
    proof.add_argument(
        "--ready-timeout",
        type=_seconds,
        default=1800.0,
        metavar="S",
        help="seconds the server may take to become healthy (then it is stopped)",
    )
    proof.add_argument(
        "--logprob-tol",
        type=_nats,
        default=None,
        metavar="NATS",
        help="how far a numerics-only change may move a logprob [default: by the served dtype]",
    )
    proof.add_argument(
        "--url",
        default=None,
        metavar="URL",
        help="the server's base URL [default: read from the command's --host/--port]",
    )
    proof.add_argument("--force", action="store_true", help="replace a run already in --profile-verify DIR")
    proof.add_argument(
        "--on-mismatch",
        choices=("stop", "fallback"),
        default="stop",
        help=(
            "when the answers CHANGED (against --baseline or the record's baseline of `tune "
            "--write-env --baseline`): stop (exit 1), or start the server again without the swap"
        ),
    )
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the sglang command")


def _add_compare(sub) -> None:
    p = _subcommand(
        sub,
        "compare",
        (
            "Two `launch --load` runs of the same prompts, model and server shapes: verify ms per (requests, "
            "tokens) bucket both served, tok/s per stream and aggregate with 95 % bootstrap intervals, the "
            "accept length, and the answers (same, same within reordering noise, or CHANGED: exit 1)."
        ),
    )
    p.add_argument(
        "before", type=path_arg, metavar="BEFORE", help="the run without the swap (its --profile-verify DIR)"
    )
    p.add_argument("after", type=path_arg, metavar="AFTER", help="the run with it")
    p.add_argument(
        "--logprob-tol",
        type=_nats,
        default=None,
        metavar="NATS",
        help="how far a numerics-only change may move a logprob [default: by the served dtype]",
    )
    p.add_argument("--allow-incomplete", action="store_true", help="compare runs that were cut short")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")


def _add_patch(sub) -> None:
    patch = _subcommand(
        sub,
        "patch",
        (
            "For the installed SGLang, or a source tree (--sglang-source, read with ast, never imported): "
            "which targets the patch would wrap, which it would skip and why, and whether the plugin "
            "entry point or the import hook loads it. Exit 1 when a target does not resolve."
        ),
    )
    patch.add_argument("--check", action="store_true", required=True, help="report (the only action)")
    patch.add_argument("--sglang-source", type=path_arg, metavar="DIR", help="an unpacked SGLang wheel or checkout")


def _add_collect(sub) -> None:
    from fastverify.collect.command import add_arguments  # lazy: subcommand (the HTTP client)

    p = _subcommand(
        sub,
        "collect",
        (
            "Run on the box that serves (ideally while the SGLang server runs): doctor's checks, "
            "`nvidia-smi topo -m`, NVML facts, IOMMU/ACS facts, the P2P check, an NCCL_DEBUG log and a "
            "measured all-reduce sweep at the verify sizes, a trace of the server's speculative cycles "
            "(/start_profile) and its arguments, and verify-log records; each part optional and said "
            "when skipped. Writes one .tar.gz that `fastverify report` reads anywhere."
        ),
        formatter_class=argparse.HelpFormatter,
    )  # plain help: argparse's defaults not appended
    add_arguments(p)


def _add_report(sub) -> None:
    from fastverify.cycle.command import add_arguments  # lazy: subcommand (numpy)

    p = _subcommand(
        sub,
        "report",
        (
            "Per cycle and forward mode (draft, verify, draft-extend): compute, all-reduce transfer and "
            "wait, other communication, GPU idle by cause; anomaly flags with their evidence (rank "
            "skew, P2P off / SHM, IOMMU/ACS, slow transfer, idle); and how much of the cycle a faster "
            "all-reduce can remove (the transfer) and how much it cannot (wait, idle, compute)."
        ),
    )
    add_arguments(p)


COMMANDS = {
    "profile": ("split the verify step into compute and all-reduce time", _add_profile),
    "topo": ("diagnose GPU topology and NCCL settings: P2P vs SHM per pair, P2P level, PCIe IPC all-reduce", _add_topo),
    "p2p": ("the real GPU P2P check: every ordered GPU pair's memory written and read (GPU box only)", _add_p2p),
    "tune": ("sweep NCCL settings and all-reduce backends on the verify shapes; write the winner", _add_tune),
    "doctor": ("check a box end to end before tuning; exercise every GPU code path on the GPUs present", _add_doctor),
    "launch": ("start SGLang with the tuned settings and the fastverify patch in every TP worker", _add_launch),
    "compare": ("the proof of a swap: two `launch --load` runs, answers and tok/s", _add_compare),
    "patch": ("report which SGLang patch targets resolve and which route loads the patch", _add_patch),
    "collect": (
        "gather one evidence bundle on the serving box (traces of the server's cycles, topology, NCCL log, sweep)",
        _add_collect,
    ),
    "report": (
        "where each speculative cycle's time goes, from a bundle of `fastverify collect` (no GPU needed)",
        _add_report,
    ),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. ``only``: build that subcommand's arguments alone (the others get their
    name and help line), so that a run imports only what its own subcommand needs."""
    p = _Parser(
        prog="fastverify",
        allow_abbrev=False,
        description="Profile and speed up the TP verify step of EAGLE speculative decoding.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (helptext, add) in COMMANDS.items():
        if only is None or only == name:
            add(sub)
        else:
            sub.add_parser(name, help=helptext)
    return p


class _Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP, raised like Ctrl-C so that the same clean-up runs (ranks killed, temporary
    files removed, nothing half-written)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, _frame) -> None:
    raise _Terminated(signum)


def _cmd_launch(args: argparse.Namespace) -> int:
    from fastverify.patch.launch import describe, exec_plan, plan_launch, plan_of_args, proof_asked  # lazy: subcommand
    from fastverify.patch.launch_plan import summary  # lazy: subcommand

    # The dry run collects every blocker into the plan (the proof inputs' too); the real launch raises at the first.
    plan = plan_of_args(args, os.environ)
    if args.dry_run:
        sys.stdout.write(printable(describe(plan)))
        if plan.blockers:
            sys.stdout.flush()  # the plan first, then the one-line verdict
            sys.stderr.write(f"fastverify: error: {one_line(summary(plan.blockers))}\n")
            return EXIT_USER_ERROR
        return 0
    if proof_asked(args, plan):
        from fastverify.proof.run import FallBack, load_options, supervise  # lazy: subcommand

        try:
            return supervise(plan, load_options(args), os.environ)
        except FallBack:
            sys.stderr.write(
                "fastverify launch: --on-mismatch fallback: starting the server again without the swap "
                "(no env file, no patch)\n"
            )
            plan = plan_launch(None, "off", None, plan.argv, environ=os.environ)
    exec_plan(plan)  # replaces this process; returns only through an error
    return 1


def _cmd_doctor(args: argparse.Namespace) -> int:
    from fastverify.doctor import (  # lazy: subcommand
        print_checks,
        run_doctor,
        run_doctor_json,  # lazy: subcommand
        summarise,
    )

    if args.env_file:  # a FIFO, folder, oversize or binary file is a bad argument (exit 2), not a finding
        read_text(args.env_file, kind="text", flag="--env-file", what="env file")
    env_file = str(args.env_file) if args.env_file else None
    if args.json:  # stdout holds the JSON only: NCCL's log and the checks' output go elsewhere
        return run_doctor_json(quick=args.quick, env_file=env_file)
    checks = run_doctor(quick=args.quick, env_file=env_file)
    from rich.console import Console

    print_checks(checks, Console(width=None if sys.stdout.isatty() else 150))
    return 1 if summarise(checks)["verdict"] == "fail" else 0


def run() -> None:
    """The program's entry point (the ``fastverify`` console script, ``python -m fastverify``):
    :func:`main`, then the exit with its code.

    A ``profile --trace`` run that succeeded ends with ``os._exit`` once its output is flushed:
    its files are written and renamed in place, its helper processes stopped and reaped, and
    nothing else is left to do but free the decoded traces one object at a time, which the
    interpreter's normal exit would spend about 20 ms of a 0.3 s run on (the trace loader keeps
    them for this, :data:`fastverify.trace.load.HOLD_DECODED`). Every other command exits the
    normal way.
    """
    PROGRAM["running"] = True
    rc = main()
    if PROGRAM.get("exit_now"):
        try:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:  # None: closed by the shell (`>&-`)
                    stream.flush()
        except (BrokenPipeError, OSError):  # a closed pipe: the normal exit reports it as it always did
            sys.exit(rc)
        os._exit(rc)
    sys.exit(rc)


def _streams_survive_any_encoding() -> None:
    """Make stdout/stderr write what their encoding cannot hold as escapes (``\\xb5`` for µ under
    ``PYTHONIOENCODING=ascii`` or a C-locale cron job) instead of raising after outputs were written."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "errors", None) == "strict":
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a closed or detached stream: nothing to write to anyway
                pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _streams_survive_any_encoding()
    try:
        start_painter_early(argv)
        return print_guarded(lambda: _main(argv))  # a closed or full stdout: one line, exit 2
    except KeyboardInterrupt:  # Ctrl-C while parsing or importing, before _main's own handler
        sys.stderr.write("fastverify: interrupted\n")
        return 130
    finally:
        leftover = EARLY.pop("painter", None)  # parsing failed, or another path never took it
        if leftover is not None:
            leftover.close()


_SPELLINGS = (
    ("--tp", "--tp-size"),
    ("--draft-tokens", "--speculative-num-draft-tokens"),
    ("--max-batch", "--cuda-graph-max-bs-decode"),
    ("--topology", "--nvidia-smi"),
)
"""fastverify's name and SGLang's (or the older) name of the same flag."""


def _one_spelling(argv: list[str]) -> None:
    """Refuse a flag given twice, under either of its names, before the ``--`` of a wrapped command."""
    mine = argv[: argv.index("--")] if "--" in argv else argv
    for names in _SPELLINGS:
        given = [a.split("=", 1)[0] for a in mine if a.split("=", 1)[0] in names]
        if len(given) > 1:
            raise UserError(
                f"{' and '.join(dict.fromkeys(given))}: the same setting given {len(given)} times; give it once"
            )


def _main(argv: list[str]) -> int:
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    previous = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        _one_spelling(argv)
        if args.command == "profile":
            from fastverify.profile.command import run as run_profile  # lazy: subcommand

            return run_profile(args, argv)
        if args.command == "topo":
            from fastverify.topo_command import run as run_topo  # lazy: subcommand

            return run_topo(args)
        if args.command == "p2p":
            from fastverify.topo.p2p import run_check_command  # lazy: subcommand

            return run_check_command(output=args.output, timeout_s=args.timeout, refresh=args.refresh, force=args.force)
        if args.command == "patch":
            from fastverify.patch.sglang_info import check, format_report  # lazy: subcommand (importlib.metadata)

            info, statuses, route = check(args.sglang_source)
            sys.stdout.write(printable(format_report(info, statuses, route)))
            return 0 if all(s.status == "found" for s in statuses) else 1
        if args.command == "launch":
            return _cmd_launch(args)
        if args.command == "doctor":
            return _cmd_doctor(args)
        if args.command == "compare":
            from fastverify.proof.compare import run as run_compare  # lazy: subcommand (numpy)

            return run_compare(args)
        if args.command == "collect":
            from fastverify.collect.command import run as run_collect  # lazy: subcommand (the HTTP client)

            return run_collect(args)
        if args.command == "report":
            from fastverify.cycle.command import run as run_report  # lazy: subcommand (numpy)

            return run_report(args)
        if args.command == "tune":
            from fastverify.tune.command import run as run_tune  # lazy: subcommand (numpy)

            return run_tune(args)
    except UserError as e:
        sys.stderr.write(f"fastverify: error: {one_line(str(e))}\n")
        return EXIT_USER_ERROR
    except _Terminated as e:
        sys.stderr.write(f"fastverify: stopped by {signal.Signals(e.signum).name}\n")
        return 128 + e.signum
    except KeyboardInterrupt:
        sys.stderr.write("fastverify: interrupted\n")
        return 130
    finally:
        if "fastverify.outputs" in sys.modules:  # a name this run claimed for an output, never written: removed
            sys.modules["fastverify.outputs"].release_reserved()
        for s, h in previous.items():
            signal.signal(s, h)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
