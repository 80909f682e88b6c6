"""``fastverify collect``: gather everything a diagnosis of this box needs into one bundle
(:mod:`fastverify.bundle`), within a time budget.

Before any work (:func:`_prepare`): the flags' values (each ``--batch`` size once), ``--output``
(never a file that is not a bundle, never inside ``--verify-log``, in a folder that takes new
files), ``--verify-log`` (a folder with verify records) and ``--server`` (no user or password in
it; it must answer ``/server_info``; its arguments give the verify shapes' defaults). Then the
parts run in :data:`RUN_ORDER` (the server's trace before the
GPU work that would disturb it); each part not excluded up front (``--skip``, no GPUs, no server)
gets a share of the time left in proportion to its weight (:data:`SPECS`), capped by its own
maximum; a part whose share is under its minimum is skipped ``time budget``. The manifest lists
every part of :data:`~fastverify.bundle.PART_NAMES`, in that order. Ctrl-C leaves no file behind.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import errno
import os
import platform
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastverify import __version__, errors
from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS, MAX_HIDDEN, MAX_TIMEOUT_S
from fastverify.bundle import PART_NAMES, Manifest, Part, write_bundle
from fastverify.collect import client, parts, server
from fastverify.collect.core import Context, Outcome, ServerInfo, Shapes, failed
from fastverify.errors import StdoutError, UserError, one_line, path_text, printable
from fastverify.outputs import claim_output, output_arg, path_arg, release_reserved, reserve_names, shown, write_files
from fastverify.procs import make_workdir
from fastverify.progress import progress_lost, say

DEFAULT_BUDGET_S = 600.0
DEFAULT_CYCLES = 20
MIN_BUDGET_S = 1.0
"""Shortest --budget (s); a budget of a few seconds runs only the quick parts, the rest say "time budget"."""
DEFAULT_DRAFT_TOKENS = 4  # SGLang 0.5.23's EAGLE choice for DeepSeek-V3/Kimi (fastverify.tune.command)
DEFAULT_HIDDEN = 7168  # DeepSeek-V3 / Kimi-K2 hidden_size (fastverify/live/presets)
DEFAULT_BATCHES = (1, 2, 4, 8)
WRITE_RESERVE = 0.02
"""Share of the budget kept back for writing the bundle (at most :data:`WRITE_RESERVE_MAX_S`)."""
WRITE_RESERVE_MAX_S = 10.0
TIME_BUDGET = "time budget"


@dataclass(frozen=True)
class PartSpec:
    """A part: its function ``fn(ctx, limit_s) -> Outcome``, ``weight`` (its share of the time
    left), ``min_s`` (skipped ``time budget`` below it) and ``max_s`` (its cap), seconds."""

    name: str
    fn: Callable[[Context, float], Outcome]
    weight: float
    min_s: float
    max_s: float | None = None


SPECS = {
    s.name: s
    for s in (
        PartSpec("doctor", parts.doctor, 1.0, 3.0, 120.0),
        PartSpec("nvidia_smi_topo", parts.nvidia_smi_topo, 0.2, 1.0, 30.0),
        PartSpec("nvml", parts.nvml, 0.2, 1.0, 30.0),
        PartSpec("host_iommu", parts.host_iommu, 0.2, 0.5, 30.0),
        PartSpec("server_args", server.server_args, 0.05, 0.05, 10.0),
        PartSpec("verify_log", parts.verify_log, 0.2, 0.5, 60.0),
        PartSpec("server_trace", server.server_trace, 3.0, 10.0),
        PartSpec("p2p_check", parts.p2p_check, 1.5, 20.0),
        PartSpec("nccl_log", parts.nccl_log, 1.0, 30.0, 300.0),
        PartSpec("sweep", parts.sweep, 4.0, 60.0),
    )
}
RUN_ORDER = (
    "doctor",
    "nvidia_smi_topo",
    "nvml",
    "host_iommu",
    "server_args",
    "verify_log",
    "server_trace",
    "p2p_check",
    "nccl_log",
    "sweep",
)
assert sorted(RUN_ORDER) == sorted(PART_NAMES) == sorted(SPECS)


def _number(kind, lo, hi, what):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} in [{lo:g}, {hi:g}], got {text!r}") from None
        if not lo <= v <= hi:  # also false for nan
            raise argparse.ArgumentTypeError(f"expected {what} in [{lo:g}, {hi:g}], got {text}")
        return v

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``collect`` subcommand's flags."""
    p.add_argument(
        "--output",
        type=output_arg,
        default=None,
        help="bundle path, a new file [default: fastverify-bundle-<UTC time>[-<n>].tar.gz in the working "
        "directory, a name no other run takes]",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --output file")
    p.add_argument(
        "--budget",
        type=_number(float, MIN_BUDGET_S, MAX_TIMEOUT_S, "seconds"),
        default=DEFAULT_BUDGET_S,
        help=f"seconds for the whole run; parts that no longer fit are skipped ('time budget') "
        f"[default: {DEFAULT_BUDGET_S:g}]",
    )
    p.add_argument(
        "--server",
        metavar="URL",
        default=None,
        help="a running SGLang server (http://host:port): its arguments and a profiler trace",
    )
    p.add_argument(
        "--cycles",
        type=_number(int, 1, 1000, "cycles"),
        default=DEFAULT_CYCLES,
        help="complete speculative cycles to trace (the profiler's num_steps is this + 2: the last "
        f"cycle's end, and a prefill step) [default: {DEFAULT_CYCLES}]",
    )
    p.add_argument(
        "--send-requests",
        type=_number(int, 0, 1000, "requests"),
        default=0,
        metavar="N",
        help="send N small /generate requests while the server profiles (for a quiet server) "
        "[default: none; collect never sends traffic unless asked]",
    )
    p.add_argument(
        "--verify-log",
        type=path_arg,
        metavar="DIR",
        default=None,
        help="the records of `fastverify launch --profile-verify DIR` to include",
    )
    p.add_argument(
        "--tp",
        type=_number(int, 1, 64, "ranks"),
        default=None,
        help="tensor-parallel size of the verify all-reduces [default: the server's tp_size, else the GPU count]",
    )
    p.add_argument(
        "--draft-tokens",
        type=_number(int, 1, MAX_DRAFT_TOKENS, "tokens"),
        default=None,
        help=f"draft tokens per request (K) [default: the server's, else {DEFAULT_DRAFT_TOKENS}]",
    )
    p.add_argument(
        "--batch",
        type=_number(int, 1, MAX_BATCH, "requests"),
        nargs="+",
        default=None,
        help=f"verify batch sizes [default: {' '.join(map(str, DEFAULT_BATCHES))}]",
    )
    p.add_argument(
        "--hidden",
        type=_number(int, 1, MAX_HIDDEN, "a hidden size"),
        default=None,
        help=f"model hidden size (message = batch x K x hidden x 2 B) [default: the served model's "
        f"config.json, else {DEFAULT_HIDDEN}]",
    )
    p.add_argument(
        "--skip",
        action="append",
        choices=PART_NAMES,
        default=[],
        metavar="PART",
        help=f"leave a part out (repeatable): {', '.join(PART_NAMES)}",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def default_output(now: _dt.datetime | None = None, folder: Path | str = ".") -> Path:
    """``fastverify-bundle-<UTC time>[-<n>].tar.gz`` in ``folder`` (the working directory), a new
    name taken with an exclusive create (:func:`fastverify.outputs.reserve_names`), so that runs
    started in the same second each get their own; the empty placeholder is removed if the run
    ends without a bundle.

    Raises
    ------
    UserError
        The folder cannot be written.
    """
    stamp = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%d-%H%M%S")
    return reserve_names(folder, f"fastverify-bundle-{stamp}", (".tar.gz",))[0]


def _check_output(out: Path, verify_log: Path | None, force: bool) -> None:
    """``--output``: not inside ``--verify-log``; an existing file only with ``--force``, and then
    only a regular, writable one; a folder that takes new files (:func:`fastverify.outputs.claim_output`)."""
    if verify_log is not None:
        inside = Path(os.path.realpath(out)).is_relative_to(os.path.realpath(verify_log))
        if inside:
            raise UserError(
                f"--output {shown(out)}: is inside --verify-log {shown(verify_log)}; write the bundle elsewhere"
            )
    claim_output(out, "--output", force=force)


def _write(out: Path, manifest: Manifest, files: dict) -> None:
    """The bundle at ``out`` through the one writer (:func:`fastverify.outputs.write_files`): it
    is written whole to a temporary file beside ``out`` and renamed over the placeholder (or, with
    ``--force``, the old file); an error names ``out``, never the temporary file."""

    def fill(tmp: Path) -> None:
        tmp.unlink()  # write_bundle makes its own file there (it never replaces a non-bundle)
        try:
            write_bundle(tmp, manifest, files)
        except UserError as e:
            raise UserError(str(e).replace(str(tmp), str(out))) from None

    write_files([(out, fill)])


def _shapes(args, info: ServerInfo | None, gpus: int) -> Shapes:
    """The verify shapes: each flag, else the server's, else the defaults (said per field)."""
    source: dict[str, str] = {}

    def pick(name, flag_value, server_key, fallback, fallback_what):
        if flag_value is not None:
            source[name] = "flag"
            return flag_value
        value = info.fact(server_key) if info is not None and server_key else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            source[name] = "server"
            return value
        source[name] = fallback_what
        return fallback

    tp = pick("tp", args.tp, "tp_size", gpus if gpus >= 2 else None, "GPU count" if gpus >= 2 else "unknown")
    k = pick("draft_tokens", args.draft_tokens, "speculative_num_draft_tokens", DEFAULT_DRAFT_TOKENS, "default")
    hidden = args.hidden
    source["hidden"] = "flag"
    if hidden is None:
        hidden = server.model_hidden_size(info) if info is not None else None
        source["hidden"] = "the served model's config.json" if hidden else "default"
        hidden = hidden or DEFAULT_HIDDEN
    batches = tuple(args.batch) if args.batch else DEFAULT_BATCHES
    source["batches"] = "flag" if args.batch else "default"
    return Shapes(tp=tp, draft_tokens=k, hidden=hidden, batches=batches, source=source)


def _host() -> tuple[dict, int]:
    """Host facts for the manifest, and the CUDA GPU count (0 without torch or CUDA)."""
    torch_version, cuda, gpus = None, False, 0
    try:
        import torch

        torch_version = str(torch.__version__)  # a str subclass msgspec does not encode
        cuda = bool(torch.cuda.is_available())
        gpus = torch.cuda.device_count() if cuda else 0
    except ImportError:
        pass
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
        "cuda_available": cuda,
        "gpu_count": gpus,
    }, gpus


def _skip_reasons(args, ctx: Context) -> dict[str, str]:
    """Parts left out before the run, and why."""
    why = {name: "--skip" for name in args.skip}
    if ctx.server is None:
        why.setdefault("server_args", "no --server")
        why.setdefault("server_trace", "no --server")
    if ctx.verify_log is None:
        why.setdefault("verify_log", "no --verify-log")
    if shutil.which("nvidia-smi") is None:
        why.setdefault("nvidia_smi_topo", parts.NO_NVIDIA_SMI)
    for name, reason in (
        ("p2p_check", parts.gpu_skip_reason(ctx, needs_tp=False)),
        ("nccl_log", parts.gpu_skip_reason(ctx)),
        ("sweep", parts.gpu_skip_reason(ctx, sweep=True)),
    ):
        if reason is not None:
            why.setdefault(name, reason)
    return why


def _run_part(spec: PartSpec, ctx: Context, limit_s: float) -> Outcome:
    """``spec.fn`` with any exception but Ctrl-C turned into a failed part (one line)."""
    try:
        return spec.fn(ctx, limit_s)
    except UserError as e:
        return failed(one_line(str(e), 300))
    except Exception as e:  # noqa: BLE001 - one broken part never costs the others
        return failed(one_line(f"{type(e).__name__}: {e}", 300))


def _member_name(arcname: str) -> str:
    """``arcname`` with each undecodable byte of a non-UTF-8 file name (``os.fsdecode``'s lone
    surrogates) as ``%xx``; any other name as it is."""
    return "".join(f"%{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else c for c in arcname)


def run_parts(ctx: Context, budget_s: float, t0: float, excluded: dict[str, str]) -> tuple[dict[str, Part], dict]:
    """Run the parts not ``excluded`` in :data:`RUN_ORDER`, each within its share of the time left
    (module docstring); returns name -> :class:`Part`, and arcname -> bytes or Path of their files."""
    out: dict[str, Part] = {}
    files: dict = {}
    todo = [n for n in RUN_ORDER if n not in excluded]
    reserve = min(WRITE_RESERVE * budget_s, WRITE_RESERVE_MAX_S)
    for name in RUN_ORDER:
        if name in excluded:
            out[name] = Part(name, "skipped", excluded[name])
            if not ctx.quiet:
                say(f"collect: {name} skipped: {excluded[name]}")
            continue
        spec = SPECS[name]
        left = budget_s - reserve - (time.monotonic() - t0)
        weights = sum(SPECS[n].weight for n in todo[todo.index(name) :])
        limit = min(left * spec.weight / weights, spec.max_s or float("inf"))
        if limit < spec.min_s:
            out[name] = Part(
                name,
                "skipped",
                f"{TIME_BUDGET}: {max(left, 0):.1f} s of {budget_s:g} s left, its share "
                f"{max(limit, 0):.1f} s is under the {spec.min_s:g} s it needs",
            )
            if not ctx.quiet:
                say(f"collect: {name} skipped: {out[name].reason}")
            continue
        if not ctx.quiet:
            say(f"collect: {name} (up to {limit:.0f} s)")
        t = time.monotonic()
        res = _run_part(spec, ctx, limit)
        seconds = time.monotonic() - t
        # the manifest is UTF-8 JSON: a name taken from a path (a non-UTF-8 folder or record
        # name) goes in with its undecodable bytes escaped (%xx in a member name, which takes no
        # backslash), never as a traceback after the work
        got = {_member_name(arc): src for arc, src in res.files.items()}
        meta = {k: path_text(v) if isinstance(v, str) else v for k, v in (res.meta or {}).items()}
        out[name] = Part(
            name,
            res.status,
            None if res.status == "ok" else one_line(res.reason or res.status, 400),
            files=tuple(got),
            seconds=round(seconds, 3),
            meta=meta,
        )
        files.update(got)
        if not ctx.quiet:
            say(f"collect: {name} {res.status} in {seconds:.1f} s" + (f": {res.reason}" if res.reason else ""))
    return out, files


def _prepare(args) -> tuple[Path, ServerInfo | None, Path | None]:
    """Every refusal that needs no part to run (module docstring)."""
    verify_log = args.verify_log
    if verify_log is not None:
        parts.check_verify_log(verify_log)
    if args.force and args.output is None:
        raise UserError("--force replaces an existing --output file; the default name is always a new one")
    if args.output is not None:
        _check_output(args.output, verify_log, args.force)
    if args.send_requests and not args.server:
        raise UserError("--send-requests sends requests to --server; give --server URL")
    twice = sorted({b for b in args.batch or () if args.batch.count(b) > 1})
    if twice:
        raise UserError(
            f"--batch {' '.join(map(str, args.batch))}: batch size {twice[0]} is given twice; give "
            "each verify batch size once"
        )
    info = None
    if args.server is not None:
        info = server.fetch_server_info(client.normalise_url(args.server))
    out = args.output or default_output()  # last: a refusal above leaves no placeholder
    return out, info, verify_log


def run(args) -> int:
    """``fastverify collect``: check the flags, run the parts, write the bundle; 0 when written.

    Raises
    ------
    UserError
        A refusal before any work (:func:`_prepare`), or the bundle cannot be written.
    """

    t0 = time.monotonic()
    try:
        out, info, verify_log = _prepare(args)
    except BaseException:
        release_reserved()  # the name claimed for --output: not left behind
        raise
    host, gpus = _host()
    workdir = make_workdir("fastverify-collect-")
    try:
        ctx = Context(
            workdir=workdir,
            shapes=_shapes(args, info, gpus),
            gpus=gpus,
            quiet=args.quiet,
            server=info,
            cycles=args.cycles,
            send_requests=args.send_requests,
            verify_log=verify_log,
        )
        done, files = run_parts(ctx, args.budget, t0, _skip_reasons(args, ctx))
        manifest = Manifest(
            created_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            fastverify_version=__version__,
            host=host,
            budget_s=float(args.budget),
            elapsed_s=round(time.monotonic() - t0, 3),
            parts=tuple(done[n] for n in PART_NAMES),
        )
        _write(out, manifest, files)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        release_reserved()  # a claimed name not written (Ctrl-C, a failed write): removed
    counts = {s: sum(1 for p in manifest.parts if p.status == s) for s in ("ok", "skipped", "failed")}
    rc = _say_wrote(f"wrote {out} ({counts['ok']} ok, {counts['skipped']} skipped, {counts['failed']} failed)")
    return 1 if progress_lost() is not None else rc  # progress lines lost (2>/dev/full): the bundle stands


def _say_wrote(line: str) -> int:
    """Print ``line`` (the bundle written; escaped to one line) on stdout; 0. Where stdout is
    closed (``>&-``) or refuses the write (a full device), the line goes to stderr after why, and
    the exit code is 1, as ``profile``'s: the bundle is kept, and its name is said. A reader that
    left (a broken pipe) is :func:`fastverify.errors.print_guarded`'s, as for every command."""
    text = errors.shown(line, limit=None)
    try:
        if sys.stdout is None:
            raise StdoutError(errno.EBADF, "it is closed")
        print(text)
        sys.stdout.flush()
    except OSError as e:
        if e.errno == errno.EPIPE:
            raise
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - nothing more goes there, even at exit
        sys.stderr.write(f"fastverify: error: cannot write to standard output ({printable(e.strerror or e)}); {text}\n")
        return 1
    return 0
