"""``fastverify profile``: the verify step split into compute and all-reduce time, from PyTorch
profiler traces (``--trace``), from a live TP verify forward, or the measured verify latency of a
server's records (``--verify-log``). Outputs are checked before any work; a default name is taken
with an exclusive create.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import msgspec

from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS, MAX_ITERS, MAX_WARMUP
from fastverify.errors import UserError, printable
from fastverify.live.config import load_model_config, preset_names
from fastverify.outputs import check_outputs, claim_output, output_arg, path_text_arg, refuse_symlink
from fastverify.profile.painter import EARLY, PROGRAM
from fastverify.profile.record import DTYPES, Shapes, live_timing, median_or_none
from fastverify.progress import say
from fastverify.registry import BackendName


def add_arguments(sub, positive, bounded, seconds, formatter) -> None:
    """The ``profile`` subcommand and its flags (``positive``/``bounded``/``seconds``: the CLI's
    parsers; ``formatter``: its help formatter)."""
    prof = sub.add_parser(
        "profile",
        allow_abbrev=False,
        help="split the verify step into compute and all-reduce time",
        description=(
            "Split the verify step into compute vs all-reduce time per TP rank, per step, per layer "
            "position and per message size. With --trace: from PyTorch profiler traces (one per rank; CPU-only "
            "traces of a CPU server read as CPU-clock all-reduces). With --verify-log: the measured "
            "verify latency from the records of `fastverify launch --profile-verify`. "
            "Otherwise: a live TP verify forward with the model's shapes (default: the tiny preset on "
            "2 ranks; gloo on CPU, NCCL on GPUs)."
        ),
        formatter_class=formatter,
    )
    prof.add_argument(
        "--trace",
        nargs="+",
        metavar="PATH",
        type=path_text_arg,
        help="trace files (.json, .json.gz) or folders of them, one file per TP rank",
    )
    prof.add_argument(
        "--verify-log",
        nargs="+",
        metavar="DIR",
        type=path_text_arg,
        help=(
            "measured verify latency from the records of `fastverify launch --profile-verify DIR` "
            "(steps, p50/p90 per rank, clock); DIR DIR2: before and after, and the change"
        ),
    )
    prof.add_argument(
        "--model",
        default="tiny",
        help="live run: preset (tiny, kimi-k2, kimi-k2.5, deepseek-v3) or a Hugging Face config.json",
    )
    prof.add_argument("--tp", "--tp-size", type=positive, default=2, help="live run: tensor-parallel world size")
    # The same bounds as tune's (fastverify.tune.command): a verify step never has more.
    prof.add_argument(
        "--draft-tokens",
        "--speculative-num-draft-tokens",
        type=bounded(1, MAX_DRAFT_TOKENS),
        default=4,
        help="live run: draft tokens per request (K)",
    )
    prof.add_argument(
        "--batch", type=bounded(1, MAX_BATCH), default=1, help="live run: requests in the verify batch (B)"
    )
    prof.add_argument("--iters", type=bounded(1, MAX_ITERS), default=5, help="live run: timed verify forwards")
    prof.add_argument("--warmup", type=bounded(0, MAX_WARMUP), default=2, help="live run: untimed warm-up forwards")
    prof.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="live run: device")
    prof.add_argument(
        "--backend",
        default=None,
        metavar="NAME",
        help=(
            "live run: all-reduce backend of the forward, one of "
            f"{', '.join(b.value for b in BackendName)} [default: "
            f"{BackendName.nccl.value} on GPUs, {BackendName.gloo.value} on CPU]"
        ),
    )
    prof.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="live run: dtype of weights, activations and all-reduces"
    )
    prof.add_argument(
        "--timeout", type=seconds, default=300.0, help="live run: seconds before a rank counts as hung, in (0, 86400]"
    )
    prof.add_argument(
        "--output", type=output_arg, default=None, help="profile JSON path [default: profiles/<name>-<UTC time>.json]"
    )
    png = prof.add_mutually_exclusive_group()
    png.add_argument("--png", type=output_arg, default=None, help="PNG path [default: beside the JSON]")
    png.add_argument("--no-png", action="store_true", help="write no PNG")
    prof.add_argument("--quiet", action="store_true", help="print no table, only the output paths")
    prof.add_argument(
        "--jobs",
        type=positive,
        default=None,
        metavar="N",
        help=(
            "--trace: decode up to N rank files at once in worker processes [default: one per core, "
            "fewer when memory is short (about 4 bytes per byte of trace JSON each) or the traces are "
            "small]; a file of 16 MiB of JSON or more read on its own is read in two halves at once "
            "(no PNG) unless N is 1"
        ),
    )
    prof.add_argument(
        "--force",
        action="store_true",
        help=(
            "replace an existing --output / --png file; --trace: also merge traces that cannot be "
            "one run (different world size, GPU model, NCCL version or backend), with a warning "
            "instead of an error"
        ),
    )


_LIVE_FLAGS = (
    "--model",
    "--tp",
    "--tp-size",
    "--draft-tokens",
    "--speculative-num-draft-tokens",
    "--batch",
    "--iters",
    "--warmup",
    "--device",
    "--timeout",
    "--backend",
    "--dtype",
)


def _cmd_verify_log(args: argparse.Namespace, argv: list[str]) -> int:
    from fastverify.profile.build import default_output  # lazy: numpy
    from fastverify.verifylog import build_report, format_report, write_report  # lazy: numpy

    if len(args.verify_log) > 2:
        raise UserError(f"--verify-log takes DIR or BEFORE_DIR AFTER_DIR, got {len(args.verify_log)} folders")
    if len(args.verify_log) == 2 and all((Path(f) / "load.json").is_file() for f in args.verify_log):
        from fastverify.proof.compare import print_comparison  # lazy: numpy; two load runs: compare's alias

        if args.output is not None:
            raise UserError(
                "two `launch --load` runs are compared by `fastverify compare BEFORE AFTER` (--json for "
                "the document); --output does not apply"
            )
        return print_comparison(*args.verify_log)
    clash = [
        f for f in (*_LIVE_FLAGS, "--trace", "--png", "--jobs") if any(a == f or a.startswith(f + "=") for a in argv)
    ]
    if clash:
        raise UserError(f"--verify-log reads verify records; {', '.join(clash)} does not apply to it")
    if args.output is not None:  # before reading anything: the report never replaces a record
        refuse_symlink(args.output, "--output")
        real_out = Path(os.path.realpath(args.output))
        for folder in args.verify_log:  # a report in a log folder could be read as (or replace) a record
            real_dir = Path(os.path.realpath(folder))
            if real_out == real_dir or real_out.is_relative_to(real_dir):
                raise UserError(
                    f"--output {args.output}: is inside the --verify-log folder {folder}; "
                    "write the report outside the log folders"
                )
    for folder in args.verify_log:
        check_outputs({"--output": args.output}, {"--verify-log": folder})
    if args.force and args.output is None:
        raise UserError("--force replaces an existing --output file; the default name is always a new one")
    claim_output(args.output, "--output", force=args.force)
    report = build_report(*args.verify_log)
    out = args.output or default_output("verify-log", png=False)
    write_report(report, out)
    if not args.quiet:
        sys.stdout.write(printable(format_report(report)))
    print(f"wrote {printable(out)}")
    return 0


def _is_preset(model: str) -> bool:
    return model in preset_names()


def _check_profile_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, a --output or PNG that would replace an input (a --trace file, a
    file inside a --trace folder, the --model config) or each other. A default --output is a new
    name under profiles/ (and its PNG too), so only the paths the user gave can clash."""
    outputs = {"--output": args.output}
    if not args.no_png:
        if args.png is not None:
            outputs["--png"] = args.png
        elif args.output is not None:  # the default PNG, beside the JSON
            outputs["the PNG beside --output"] = args.output.with_suffix(".png")
    inputs = [("--trace", t) for t in args.trace or ()]
    if not args.trace and not _is_preset(args.model):
        inputs.append(("--model", args.model))
    for flag, path in inputs or [("--trace", None)]:
        check_outputs(outputs, {flag: path})
    folders = [os.path.realpath(t) for t in args.trace or () if os.path.isdir(t)]
    for flag, path in outputs.items():  # before any trace is read or rank started
        # an existing file only with --force; no placeholder where a --trace folder would read it
        inside = path is not None and any(Path(os.path.realpath(path)).is_relative_to(f) for f in folders)
        claim_output(path, flag, force=args.force, reserve=not inside)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """``fastverify profile``: verify records (--verify-log), traces (--trace) or a live run."""
    if args.verify_log:
        return _cmd_verify_log(args, argv)
    _check_profile_outputs(args)
    if args.force and not args.trace and args.output is None and args.png is None:
        raise UserError(
            "--force replaces an existing --output / --png file, or merges --trace files that are not "
            "one run; it does not apply without one of them"
        )
    if args.jobs is not None and not args.trace:
        raise UserError("--jobs sets how many --trace files are decoded at once; it does not apply without --trace")
    painter = EARLY.pop("painter", None)
    try:
        if not (args.trace and not args.no_png) and painter is not None:
            painter.close()
            painter = None
        return _profile(args, argv, painter)
    finally:
        if painter is not None:
            painter.close()


def _profile(args: argparse.Namespace, argv: list[str], painter) -> int:
    if args.trace:
        clash = [f for f in _LIVE_FLAGS if any(a == f or a.startswith(f + "=") for a in argv)]
        if clash:
            raise UserError(
                f"--trace reads existing traces; {', '.join(clash)} applies only to a live run"
                if len(clash) == 1
                else f"--trace reads existing traces; {', '.join(clash)} apply only to a live run"
            )
        # a trace job uses numpy for sorting and reductions only: no BLAS thread pool to spin up
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        from fastverify.trace import load  # lazy: numpy

        if PROGRAM.get("running"):  # the process ends right after this command (see run())
            load.HOLD_DECODED = True
        # With the painter drawing the PNG on the second core, one big file is read on one core
        # (measured on 2 cores: reading in halves there slowed the PNG, the run's end, by 6-14 %)
        ranks = load.load_traces(
            args.trace, force=args.force, workers=args.jobs, progress=not args.quiet, halves=painter is None
        )
        source = {"kind": "trace", "files": [r.origin for r in ranks]}
        stem = "trace"
    else:
        if args.warmup < 0:
            raise UserError(f"--warmup must be >= 0, got {args.warmup}")
        ranks, source, stem = measure_live(args)

    from fastverify.profile.build import as_builtins, build_profile, default_output, write_outputs  # lazy: numpy

    shapes = None
    if source["kind"] == "live":  # a live run knows its shapes; a trace records none (never guessed)
        shapes = Shapes(
            dtype=source["dtype"],
            hidden=source["hidden"],
            tokens=source["tokens"],
            draft_tokens=source["draft_tokens"],
            batch=source["batch"],
        )
    profile = build_profile(ranks, source, shapes)
    if source["kind"] == "live":
        profile = msgspec.structs.replace(profile, timing=live_timing(profile.timing, ranks[0].meta))
    if source.get("graph_replay_traces"):
        profile = _with_graph_replay(profile, ranks, shapes)
    # a default name is taken with an exclusive create (its PNG's too): concurrent runs never share one
    out = args.output or default_output(stem, png=not args.no_png and args.png is None)
    png = None if args.no_png else (args.png or out.with_suffix(".png"))
    write_outputs(profile, out, png, painter)
    wrote = f"wrote {printable(out)}" + (f" and {printable(png)}" if png else "")
    try:
        if not args.quiet and sys.stdout is not None:  # `>&-` closes it: the files are the output
            from fastverify.profile.table import print_profile  # lazy: rich, off the --quiet trace path

            print_profile(as_builtins(profile))
        print(wrote)
        if sys.stdout is not None:
            sys.stdout.flush()
    except OSError as e:  # a full disk or a device that refuses writes behind stdout
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - nothing more goes there, even at exit
        why = printable(e.strerror or e)
        sys.stderr.write(f"fastverify: error: cannot write to standard output ({why}); {wrote}\n")
        return 1
    if source["kind"] == "trace":
        PROGRAM["exit_now"] = True
    return 0


def _with_graph_replay(profile, ranks, shapes):
    """``profile`` with the ranks' graph-replay traces read into ``graph_replay``; a trace that a
    rank could not write, or that holds no kernels (CUPTI missing, or taken by another client
    such as Nsight Systems), leaves the measured profile as it is, with one warning line on
    stderr and in its ``warnings``."""
    from fastverify.profile.build import build_profile  # lazy: numpy
    from fastverify.trace.load import load_traces  # lazy: numpy

    failed = [f"rank {r.rank}: {r.meta['trace_error']}" for r in ranks if r.meta.get("trace_error")]
    why = "; ".join(failed)
    if not failed:
        try:
            replay = load_traces([profile.source.graph_replay_traces], progress=False)
            return msgspec.structs.replace(
                profile,
                graph_replay=build_profile(replay, {"kind": "trace", "files": [r.origin for r in replay]}, shapes),
            )
        except (UserError, OSError, ValueError) as err:
            why = " ".join(str(err).split())
    line = f"graph-replay trace not used ({why[:300]}); the measured profile is kept without it"
    say(f"warning: {line}")
    return msgspec.structs.replace(
        profile,
        source=msgspec.structs.replace(profile.source, graph_replay_traces=None),
        warnings=[*profile.warnings, line],
    )


def measure_live(args: argparse.Namespace):
    from fastverify.live.runner import run_live  # lazy: numpy
    from fastverify.profile.build import default_output  # lazy: numpy

    model = args.model
    config = load_model_config(model)
    stem = f"live-{Path(model).stem if model.endswith('.json') else model}-tp{args.tp}"
    trace_dir = None
    if args.device != "cpu":
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() >= args.tp:
            # On GPUs the ranks also trace a CUDA-graph replay of the forward; it goes through the
            # same trace analyzer as --trace input and lands in the profile as "graph_replay".
            args.output = args.output or default_output(stem)  # one name for the JSON and its traces
            trace_dir = args.output.parent / f"{args.output.stem}-traces"
    ranks = run_live(
        config,
        tp=args.tp,
        draft_tokens=args.draft_tokens,
        batch=args.batch,
        iters=args.iters,
        warmup=args.warmup,
        device=args.device,
        timeout_s=args.timeout,
        trace_dir=None if trace_dir is None else str(trace_dir),
        backend=args.backend,
        dtype=args.dtype,
        progress=not args.quiet,
    )
    meta = ranks[0].meta
    source = {
        "kind": "live",
        "model": model,
        "tp": args.tp,
        "draft_tokens": args.draft_tokens,
        "batch": args.batch,
        "tokens": args.batch * args.draft_tokens,
        "iters": args.iters,
        "warmup": args.warmup,
        "device": meta.get("device"),
        "dist_backend": meta.get("dist_backend"),
        "backend": meta["allreduce_backend"],
        "dtype": meta["dtype"],
        "hidden": meta["hidden_size"],
        "experts_allocated": meta.get("experts_allocated"),
        "n_routed_experts": config.n_routed_experts,
        "timed_forward": meta.get("timed_forward"),
        "graph_forward_us": median_or_none(meta.get("graph_forward_us")),
        "eager_forward_us": median_or_none(meta.get("eager_forward_us")),
    }
    if trace_dir is not None:
        source["graph_replay_traces"] = str(trace_dir)
    return ranks, source, stem
