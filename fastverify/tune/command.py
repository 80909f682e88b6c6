"""``fastverify tune``: build the workload, rank NCCL settings with the cost model, measure the
candidates in isolated workers (unless ``--predict``), report, and write the env file / tuner CSV.

Two modes:

* ``--predict --topology FILE``: cost model only, for a box described by ``nvidia-smi topo -m``
  text. Every number is labelled predicted, and so is the env file's header.
* measure (default): each candidate runs in a fresh set of worker processes
  (:mod:`fastverify.tune.sweep`): NCCL settings ranked by the model (top ``--top``) plus the current
  environment as the baseline, and on GPUs FlashInfer's PCIe IPC all-reduce, its fused
  all-reduce + residual + RMSNorm and SGLang's custom all-reduce where their capability checks
  pass. Without GPUs the same machinery runs on gloo, which ignores NCCL settings: the output says
  so and the timings are CPU wall clock.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from fastverify.errors import UserError


def add_arguments(p: argparse.ArgumentParser, positive, bounded) -> None:
    """The ``tune`` subcommand's flags (``positive``/``bounded`` are the CLI's int parsers)."""
    w = p.add_argument_group("workload (a profile, or a model's shapes)")
    w.add_argument("--profile", type=Path, metavar="JSON", help="profile written by `fastverify profile`")
    w.add_argument("--model", default=None, help="preset (tiny, kimi-k2, deepseek-v3) or config.json [default: tiny]")
    w.add_argument("--tp", type=bounded(2, 64), default=2, help="tensor-parallel world size")
    w.add_argument("--draft-tokens", type=bounded(1, 64), default=4, help="draft tokens per request")
    w.add_argument("--batch", type=bounded(1, 4096), default=1, help="requests per verify batch")
    b = p.add_argument_group("box")
    b.add_argument("--topology", type=Path, metavar="FILE", help="`nvidia-smi topo -m` text (else NVML on a GPU box)")
    b.add_argument("--nccl-version", default=None, help="NCCL version for the catalogue and model [default: the "
                                                        "library's own, else the newest known]")
    b.add_argument("--pcie-gen", type=int, choices=(3, 4, 5, 6), default=4, help="PCIe generation for the model")
    b.add_argument("--sm", type=bounded(30, 300), default=89, help="compute capability x10 for the model")
    m = p.add_argument_group("measurement")
    m.add_argument("--predict", action="store_true", help="cost model only: rank NCCL settings, measure nothing")
    m.add_argument("--top", type=bounded(0, 20), default=3, help="NCCL candidates from the model to measure")
    m.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where trials run")
    m.add_argument("--iters", type=bounded(1, 10000), default=20, help="timed repetitions per size")
    m.add_argument("--warmup", type=bounded(0, 1000), default=3, help="untimed repetitions per size")
    m.add_argument("--timeout", type=float, default=120.0, help="seconds a trial may measure before it counts as hung")
    m.add_argument("--journal", type=Path, default=None,
                   help="append-only record of finished trials [default: nccl_configs/<box>.journal.jsonl]")
    m.add_argument("--resume", action="store_true", help="skip trials the journal already holds")
    o = p.add_argument_group("output")
    o.add_argument("--accept-length", type=float, default=None, help="tokens per cycle per stream [profile's, else 3.0]")
    o.add_argument("--tok-s", type=float, default=None, help="measured tok/s per stream now (fixes the rest of the cycle)")
    o.add_argument("--write-env", nargs="?", const="", default=None, metavar="PATH",
                   help="write the winning settings [default path: nccl_configs/<box fingerprint>.env]")
    o.add_argument("--write-tuner-config", type=Path, metavar="PATH", help="per-size NCCL tuner-plugin CSV")
    o.add_argument("--png", type=Path, default=None, help="latency vs message size per candidate (measure mode)")


MIN_WIN_PCT = 2.0
"""A measured candidate must beat the baseline's verify-step all-reduce time by this much (and by
more than the baseline's own p90 spread) before its settings are written: smaller differences are
run-to-run noise, not a reason to change a server's settings."""


def _check_outputs(args) -> None:
    """Refuse unusable output paths before any work, so nothing is half-written afterwards."""
    from fastverify.procs import writable_target

    for flag, value in (("--write-env", args.write_env or None), ("--write-tuner-config", args.write_tuner_config),
                        ("--png", args.png), ("--journal", args.journal)):
        if value:
            path = Path(value)
            if str(value).endswith(os.sep):
                raise UserError(f"{flag} {value}: give a file path, not a folder")
            writable_target(path)
    if not args.predict and args.write_tuner_config is not None:
        raise UserError("--write-tuner-config comes from the cost model's per-size choice: use it with --predict")
    if args.predict and args.png is not None:
        raise UserError("--png plots measured latencies: it does not apply with --predict")


def _workload(args):
    from fastverify.tune.workload import workload_from_model, workload_from_profile

    if args.profile is not None:
        if args.model is not None:
            raise UserError("--profile and --model both describe the workload; give one")
        return workload_from_profile(args.profile)
    from fastverify.live.config import load_model_config

    return workload_from_model(load_model_config(args.model or "tiny"), tp=args.tp, draft_tokens=args.draft_tokens,
                               batch=args.batch)


def _topology(args, tp: int):
    if args.topology is not None:
        from fastverify.topo.matrix import parse_nvidia_smi_topo

        try:
            text = args.topology.read_text(errors="replace")
        except OSError as e:
            raise UserError(f"{args.topology}: cannot read ({e.strerror or e})") from None
        return parse_nvidia_smi_topo(text, source=str(args.topology))
    from fastverify.topo.nvml import read_nvml_topology

    try:
        return read_nvml_topology()
    except UserError:
        if args.predict:
            raise UserError("--predict needs the box's topology: give --topology FILE (`nvidia-smi topo -m` text)") from None
        return None


def _version(args):
    from fastverify.nccl.version import NcclVersion, read_nccl_version

    if args.nccl_version:
        return NcclVersion.parse(args.nccl_version)
    return read_nccl_version()


def _fingerprint(workload, topo, version) -> str:
    gpus = topo.gpus if topo else ()
    name = next((g.name for g in gpus if g.name), None) or (Path(topo.source).stem if topo else "unknown-box")
    return f"{name}-tp{workload.tp}-nccl{version or 'unknown'}"


def run(args) -> int:
    from rich.console import Console

    from fastverify.tune.predict import rank_nccl_settings, verify_reduction

    import sys

    console = Console(width=None if sys.stdout.isatty() else 130)
    workload = _workload(args)
    if args.accept_length is not None and not (1.0 <= args.accept_length <= 64):
        raise UserError(f"--accept-length {args.accept_length:g}: expected tokens per cycle in [1, 64]")
    if args.tok_s is not None and not args.tok_s > 0:
        raise UserError(f"--tok-s {args.tok_s:g}: expected a positive tok/s")
    if not 0 < args.timeout <= 86400:
        raise UserError(f"--timeout {args.timeout:g}: expected seconds in (0, 86400]")
    _check_outputs(args)
    version = _version(args)
    topo = _topology(args, workload.tp)
    if topo is not None and len(topo.gpus) < workload.tp:
        raise UserError(f"{topo.source}: {len(topo.gpus)} GPUs, fewer than --tp {workload.tp}")

    from fastverify.nccl.catalogue import Severity, validate_env

    for f in validate_env(os.environ, version):
        if f.severity is not Severity.OK:
            console.print(f"# setting {f.severity.value}: {f.name}={f.value!r}: {f.reason}"
                          + (f" -> {f.fix}" if f.fix else ""), markup=False)
    ranked = rank_nccl_settings(workload, topo, env=os.environ, nccl_version=version, pcie_gen=args.pcie_gen,
                                sm=args.sm) if topo is not None else []
    for note in (ranked[0].notes if ranked and ranked[0].is_baseline else ()):
        console.print(f"# note: {note}", markup=False)
    if args.predict:
        return _report_prediction(args, console, workload, topo, version, ranked)
    return _measure(args, console, workload, topo, version, ranked, verify_reduction)


def _report_prediction(args, console, workload, topo, version, ranked) -> int:
    from rich.table import Table

    from fastverify.tune.envfile import default_env_path, write_env_file, write_tuner_config
    from fastverify.tune.predict import prediction_header, tuner_choices, verify_reduction

    baseline = next(c for c in ranked if c.is_baseline)
    best = ranked[0]
    console.print(f"# fastverify tune --predict: {workload.source}; {workload.allreduce_count} all-reduces per verify "
                  f"step; topology {topo.source}; NCCL {version or 'version unknown (newest rules)'}", markup=False)
    t = Table(title="NCCL settings, PREDICTED all-reduce time per verify step (not measured)", title_justify="left")
    for col in ("rank", "settings", "transport", "P2P pairs", "µs / step", "vs baseline (− = faster)"):
        t.add_column(col, justify="right", overflow="fold")
    for i, c in enumerate(ranked, 1):
        t.add_row(str(i), ", ".join(f"{k}={v}" for k, v in c.settings.items()) or "(current environment)",
                  c.transport, f"{c.p2p_pairs}/{c.pairs}", f"{c.allreduce_us:,.1f}", f"{-c.vs_baseline_pct:+.1f} %")
    console.print(t)
    red = verify_reduction(workload, baseline.allreduce_us, best.allreduce_us, accept_length=args.accept_length,
                           tok_s=args.tok_s)
    _print_reduction(console, red, predicted=True)
    for n in best.notes:
        console.print(f"# note: {n}", markup=False)
    if args.write_env is not None:
        path = Path(args.write_env) if args.write_env else default_env_path(_fingerprint(workload, topo, version))
        header = prediction_header(workload, best, baseline, red, topology_source=topo.source, n_gpus=len(topo.gpus),
                                   pcie_gen=args.pcie_gen, sm=args.sm)
        write_env_file(path, dict(best.settings), header_lines=header, nccl_version=version)
        console.print(f"wrote {path} ({len(best.settings)} setting(s); header says PREDICTED)", markup=False)
    if args.write_tuner_config is not None:
        write_tuner_config(args.write_tuner_config, tuner_choices(best),
                           header_lines=[f"PREDICTED by fastverify tune --predict for {workload.source}",
                                         "allreduce rows only; other collectives run on one channel under this plugin"])
        console.print(f"wrote {args.write_tuner_config}", markup=False)
    return 0


def _print_reduction(console, red: dict, *, predicted: bool) -> None:
    word = "predicted" if predicted else "from the measured all-reduce times"
    console.print(f"all-reduce per verify step: -{red['allreduce_reduction_pct']:.1f} % ({word})", markup=False)
    console.print(f"verify step: {red['verify_baseline_us'] / 1e3:.3f} ms -> {red['verify_predicted_us'] / 1e3:.3f} ms, "
                  f"-{red['verify_reduction_pct']:.1f} % (predicted; baseline {red['verify_baseline_basis']})",
                  markup=False)
    if red.get("tok_s_baseline") is not None:
        console.print(f"tok/s per stream at accept length {red['accept_length']:g}: {red['tok_s_baseline']:.1f} -> "
                      f"{red['tok_s_predicted']:.1f} (predicted; rest of the cycle {red['t_rest_basis']})", markup=False)


def _measure(args, console, workload, topo, version, ranked, verify_reduction) -> int:
    from fastverify.tune.envfile import default_env_path, write_env_file
    from fastverify.tune.report import plot_latency, print_report, rank_candidates
    from fastverify.tune.sweep import run_sweep
    from fastverify.tune.trial import DTYPE_BYTES, Op, TrialSpec

    import torch  # the measure mode needs torch for its workers anyway

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()
                                     and torch.cuda.device_count() >= workload.tp)
    if args.device == "cuda" and not cuda:
        raise UserError(f"--device cuda: needs {workload.tp} GPUs, found "
                        f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    device = "cuda" if cuda else "cpu"
    if not cuda and args.write_env is not None:
        raise UserError("--write-env: without GPUs the sweep runs on gloo, which ignores NCCL settings, so it "
                        "measures nothing to write; use --predict --topology FILE, or run on the GPU box")
    elem = DTYPE_BYTES[workload.dtype]
    bad = [b for b, _ in workload.msg_sizes if b <= 0 or b % elem]
    if bad:
        raise UserError(f"{workload.source}: all-reduce sizes {bad} B are not whole {workload.dtype} tensors")
    sizes = tuple((b // elem, c) for b, c in workload.msg_sizes)
    # all-reduce + residual + RMSNorm (like for like with the fused kernels) needs the hidden size;
    # a trace profile has none, so its sizes are timed as plain all-reduces.
    fused_ok = bool(workload.hidden) and all(n % workload.hidden == 0 for n, _ in sizes)
    op = Op.ALL_REDUCE_RESIDUAL_RMSNORM if fused_ok else Op.ALL_REDUCE
    common = dict(world_size=workload.tp, device=device, dtype=workload.dtype, hidden=workload.hidden or 1,
                  sizes=sizes, warmup=args.warmup, iters=args.iters, op=op)
    if not fused_ok:
        console.print("# the workload has no hidden size (a trace profile): timing plain all-reduces; the fused "
                      "all-reduce + RMSNorm backend is left out", markup=False)
    base_backend = "nccl" if cuda else "gloo"
    trials = [TrialSpec(backend=base_backend, env={}, label="current environment", baseline=True, **common)]
    for c in [c for c in ranked if not c.is_baseline][: args.top]:
        trials.append(TrialSpec(backend=base_backend, env=dict(c.settings), label=c.name, **common))
    if not ranked and not cuda:
        console.print("# no topology (--topology FILE or NVML): only the current environment is measured", markup=False)
    if cuda:
        p2p_ok = _p2p_ok(topo)
        max_numel = max(n for n, _ in sizes)
        for backend in ("pcie_ipc", "fused", "custom_ar") if fused_ok else ("pcie_ipc", "custom_ar"):
            trials.append(TrialSpec(backend=backend, env={}, label=backend, options={"max_numel": max_numel},
                                    probe_facts={"p2p_ok": p2p_ok}, **common))
    fp = _fingerprint(workload, topo, version)
    journal = args.journal or Path("nccl_configs") / f"{fp}.journal.jsonl"
    console.print(f"# fastverify tune: {len(trials)} trial(s), {workload.allreduce_count} all-reduces per verify step, "
                  f"{device}; journal {journal}", markup=False)
    if not cuda:
        console.print("# no GPUs: trials run on gloo over CPU, which ignores NCCL settings; timings are CPU wall "
                      "clock, NOT GPU timings; this checks the machinery, it does not tune", markup=False)
    try:
        results = run_sweep(trials, journal_path=journal, timeout_s=args.timeout, resume=args.resume, progress=True,
                            config={"workload": workload.source, "fingerprint": fp})
    except OSError as e:
        raise UserError(f"{journal}: cannot write the journal ({e.strerror or e})") from None
    ranking = rank_candidates(trials, results)
    print_report(ranking, console)
    if args.png:
        written = plot_latency(ranking, args.png)
        console.print(f"wrote {written}", markup=False)
    if ranking.best is None or ranking.baseline is None:
        raise UserError("no trial finished with a correct result (see the reasons above); nothing to write")
    red = verify_reduction(workload, ranking.baseline.step_us, ranking.best.step_us,
                           accept_length=args.accept_length, tok_s=args.tok_s)
    if cuda:
        _print_reduction(console, red, predicted=False)
    if args.write_env is not None:
        path = Path(args.write_env) if args.write_env else default_env_path(fp)
        best = ranking.best.spec
        gain_pct = 100.0 * (ranking.baseline.step_us - ranking.best.step_us) / ranking.baseline.step_us
        spread_pct = _spread_pct(ranking.baseline.result)
        if best is not ranking.baseline.spec and gain_pct < max(MIN_WIN_PCT, spread_pct):
            console.print(f"# the best candidate is {gain_pct:.1f} % faster than the baseline, within the noise "
                          f"(needs > {max(MIN_WIN_PCT, spread_pct):.1f} %): keeping the current settings", markup=False)
            best = ranking.baseline.spec
        settings = dict(best.env)
        if best.backend == "pcie_ipc":
            settings.update({"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1",
                             "SGLANG_PCIE_IPC_MAX_NUMEL": str(best.options.get("max_numel"))})
        header = ["MEASURED by fastverify tune (GPU, CUDA events)", f"workload: {workload.source}",
                  f"winner: {best.label or best.backend}: {ranking.best.step_us:.1f} us per verify step vs "
                  f"{ranking.baseline.step_us:.1f} us baseline"]
        write_env_file(path, settings, header_lines=header, nccl_version=version)
        console.print(f"wrote {path}", markup=False)
    return 0


def _spread_pct(result) -> float:
    """The baseline's own p90-over-median spread (%, worst size): differences below it are noise."""
    spreads = [100.0 * (z.p90_us - z.median_us) / z.median_us for z in result.sizes
               if z.median_us and z.p90_us is not None]
    return max(spreads, default=0.0)


def _p2p_ok(topo) -> bool | None:
    """P2P across every pair, from NVML's report (the real check is `python -m fastverify.topo.p2p check`)."""
    if topo is None or not topo.p2p_read:
        return None
    values = list(topo.p2p_read.values()) + list(topo.p2p_write.values())
    if any(v is False for v in values):
        return False
    return True if all(v is True for v in values) else None
