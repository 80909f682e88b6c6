"""``tune --predict`` from the user's own scalar figures (``--verify-ms`` V, ``--allreduce-ms`` R,
``--tok-s`` S, ``--accept-length`` A): no profile, no bundle, four numbers.

The baseline is V and R per verify step (and S), labelled :data:`LABEL` (``measured-by-user``)
everywhere. A candidate's all-reduce is ``R_c = R × pred_c / pred_base`` (the prediction's ratio,
:mod:`fastverify.tune.candidates`, applied to R: the rule
:func:`fastverify.tune.verify_time.verify_reduction` uses for a profile's times; the range scales
alike), its verify ``V_c = V − R + R_c``, and with S ``tok/s_c = A / (t_rest + V_c)``,
``t_rest = A / S − V`` held fixed; without S no tok/s. Scalars cannot split R into wait and
transfer, so every gain is an upper bound (``"bound": "upper"``). Box: ``--topology`` or NVML, else
an assumed box (:func:`assumed_topology`), said in every output, for which no env file or tuner
table is written. A ``--profile`` with GPU times refuses figures more than :data:`AGREE` off its
own and otherwise stays in charge (it splits wait from transfer); one without gives sizes only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fastverify.bounds import MIN_TIME_US
from fastverify.errors import UserError
from fastverify.topo.matrix import Gpu, Topology

LABEL = "measured-by-user"
MAX_VERIFY_MS = 60_000.0  # a verify step of a minute is no verify step
AGREE = 0.05  # relative difference to a profile's own times still called agreement
ASSUMED_SOURCE = "assumed box: {n} GPUs, every pair SYS (no --topology, no NVML on this machine)"
BOUND_NOTE = (
    "your figures are scalars: they cannot separate the all-reduce's wait for the slowest rank from "
    "its transfer, and a faster kernel removes transfer, not the wait, so each predicted gain is an "
    "UPPER BOUND"
)
SETTLE = "to settle it, run `fastverify collect` on the box, then `fastverify report BUNDLE`"
UNSCALED = (
    "unknown at this size: the predicted figure has no range (or no point) to scale, so the figure on "
    "your scale is unknown too; measure with fastverify tune"
)
NO_TOK_S = (
    "no tok/s figures: without --tok-s the rest of the cycle (drafting, draft-extend, scheduling) is "
    "unknown; give --tok-s (your measured tok/s per stream now)"
)


@dataclass(frozen=True)
class UserFigures:
    """The user's verify and all-reduce time per verify step (µs) and tok/s per stream (or None)."""

    verify_us: float
    allreduce_us: float
    tok_s: float | None = None
    label: str = LABEL

    @property
    def basis(self) -> str:
        return f"{self.label}: --verify-ms {self.verify_us / 1e3:g}, --allreduce-ms {self.allreduce_us / 1e3:g}"


def from_args(args) -> UserFigures | None:
    """``--verify-ms`` / ``--allreduce-ms`` checked (both or neither, finite, in
    [:data:`~fastverify.bounds.MIN_TIME_US`, :data:`MAX_VERIFY_MS`] ms, all-reduce <= verify,
    with ``--predict``); None when neither. Raises :class:`UserError` (one line naming the flag)."""
    v, r = args.verify_ms, args.allreduce_ms
    if v is None and r is None:
        return None
    if r is None:
        raise UserError(f"--verify-ms {v:g}: give --allreduce-ms too (the all-reduce time of that verify step, ms)")
    if v is None:
        raise UserError(f"--allreduce-ms {r:g}: give --verify-ms too (the verify step it is part of, ms)")
    low = MIN_TIME_US / 1e3
    for flag, x in (("--verify-ms", v), ("--allreduce-ms", r)):
        if not (math.isfinite(x) and low <= x <= MAX_VERIFY_MS):
            raise UserError(f"{flag} {x:g}: expected a finite time in [{low:g}, {MAX_VERIFY_MS:g}] ms per verify step")
    if r > v:
        raise UserError(
            f"--allreduce-ms {r:g}: more than --verify-ms {v:g}; the all-reduce time is part of the verify step"
        )
    if not args.predict:
        raise UserError(f"--verify-ms {v:g}: your figures scale a prediction; use them with --predict")
    return UserFigures(v * 1e3, r * 1e3, tok_s=args.tok_s)


def reconcile(user: UserFigures | None, workload, profile) -> tuple[UserFigures | None, tuple[str, ...]]:
    """``user`` against a profile's own GPU times: (figures to use, notes).

    Raises
    ------
    UserError
        A figure more than :data:`AGREE` off the profile's own.
    """
    if user is None or not workload.measured_on_gpu:
        return user, ()
    have = [
        (flag, mine, theirs, what)
        for flag, mine, theirs, what in (
            ("--verify-ms", user.verify_us, workload.verify_us, "verify step"),
            ("--allreduce-ms", user.allreduce_us, workload.allreduce_us, "all-reduce"),
        )
        if theirs is not None and theirs > 0
    ]
    for flag, mine, theirs, what in have:
        if abs(mine - theirs) > AGREE * theirs:
            raise UserError(
                f"{flag} {mine / 1e3:g}: contradicts --profile {profile}, which measured the {what} at "
                f"{theirs / 1e3:.3f} ms per step ({workload.clock}); give the figures of that run or "
                "drop the flag"
            )
    if len(have) == 2:
        return None, (
            f"--verify-ms/--allreduce-ms agree with --profile {profile} within {AGREE:.0%}: its own "
            "measurement is used (it also splits the all-reduce's wait from its transfer)",
        )
    return user, (f"--profile {profile} measured only part of the step on the GPU: your figures are the baseline",)


def assumed_topology(tp: int, p2p_results=None):
    """A box of ``tp`` GPUs (more if ``--p2p-check`` names more), every pair ``SYS``: the widest
    path, so an ``NCCL_P2P_LEVEL`` a candidate sets covers any PCIe box's pairs, and NCCL's default
    level (PXB) keeps them on SHM, as on a box whose GPUs hang off the CPU."""
    n = max([tp] + [1 + max(pair) for pair in (p2p_results or {})])
    links = {(i, j): "SYS" for i in range(n) for j in range(n) if i != j}
    return Topology(tuple(Gpu(i) for i in range(n)), links, source=ASSUMED_SOURCE.format(n=n))


def is_assumed(topo) -> bool:
    return topo is not None and topo.source.startswith(ASSUMED_SOURCE.split(":")[0] + ":")


def check_outputs(args, topo) -> None:
    """No env file or tuner table for an assumed box."""
    for flag, value in (("--write-env", args.write_env), ("--write-tuner-config", args.write_tuner_config)):
        if value is not None and is_assumed(topo):
            raise UserError(
                f"{flag}: no topology (--topology FILE or NVML), so the box is assumed and there is no "
                "box to write settings for; give --topology FILE (`nvidia-smi topo -m` of the server)"
            )


def notes(args, topo, user: UserFigures) -> tuple[str, ...]:
    """The lines every output of the user-figures mode carries."""
    out = [
        f"baseline {user.basis}" + (f", --tok-s {user.tok_s:g}" if user.tok_s is not None else ""),
        f"{BOUND_NOTE}; {SETTLE}",
    ]
    if user.tok_s is None:
        out.append(NO_TOK_S)
    if is_assumed(topo):
        out.append(
            f"{topo.source}: the candidates' ratios assume it (NCCL on SHM now); give --topology FILE "
            "(`nvidia-smi topo -m` of the server) for that box's own"
        )
    if args.profile is None and args.model is None:
        out.append(
            "workload: the tiny preset (the default); the predicted ratios depend on the message sizes: "
            "give --model/--tp/--draft-tokens/--batch of the server your figures came from"
        )
    return tuple(out)


def scale_prediction(pred, user: UserFigures, extra_notes=()):
    """``pred`` (:class:`fastverify.tune.candidates.PredictedRanking`) on the user's scale: the baseline
    at R (label :data:`LABEL`), every ranked candidate at R × its ratio to the predicted baseline
    (range: an NCCL setting's is its point, as with any measured baseline; a backend's keeps its
    published spread, on the same scale)."""
    base = pred.baseline.point_us
    if not base or base <= 0:
        raise UserError("the predicted baseline all-reduce time is 0: no ratio to scale your figures by")
    k = user.allreduce_us / base
    r_ms = user.allreduce_us / 1e3

    def one(f):
        if f.is_baseline:
            ev = (
                f"{LABEL}: --allreduce-ms {r_ms:g} of --verify-ms {user.verify_us / 1e3:g} per verify step",
                f"the candidates' ratios are to the predicted baseline, {base:,.1f} us per step:",
                *f.evidence,
            )
            return replace(
                f,
                point_us=user.allreduce_us,
                range_us=(user.allreduce_us, user.allreduce_us),
                label=LABEL,
                evidence=ev,
                bounds=None,
            )
        if not f.ranked:  # no point (no published data, or unknown at a size): nothing to scale
            return replace(f, evidence=(*f.evidence, f"scaled: {UNSCALED}"))
        ev = [*f.evidence, f"scaled: predicted ratio to the predicted baseline x your all-reduce {r_ms:g} ms ({LABEL})"]
        bounds = None if f.bounds is None else {key: v * k for key, v in f.bounds.items()}
        point = f.point_us * k
        if f.nccl is not None:  # the cost model's ratio x a measured baseline: no published spread left
            rng = (point, point)
            ev.append("range: none, the cost model's ratio applied to your measured all-reduce")
        elif f.range_us is None:  # the backend's range is unknown: so is the scaled one
            rng = None
            ev.append(f"range: {UNSCALED}")
        else:  # a backend's own published spread, relative to the predicted baseline
            rng = (f.range_us[0] * k, f.range_us[1] * k)
        return replace(f, point_us=point, range_us=rng, evidence=tuple(ev), bounds=bounds)

    cands = tuple(one(f) for f in pred.candidates)
    return replace(
        pred, baseline=next(f for f in cands if f.is_baseline), candidates=cands, notes=pred.notes + tuple(extra_notes)
    )


def decorate(doc: dict, user: UserFigures, red: dict, *, topo) -> dict:
    """``tune --predict --json`` in this mode: ``bound`` on each candidate's gain (``"upper"`` for a
    faster one, ``"lower"`` for a slower one: its loss is at most the figure; None for the baseline,
    unchanged and unranked ones) and a ``user_figures`` block (ms, tok/s per stream)."""
    base = doc["baseline"]["allreduce_us_per_step"]
    for c in (doc["baseline"], *doc["candidates"]):
        t = c["allreduce_us_per_step"]
        # faster: the whole measured all-reduce (wait included) was scaled down, so the gain is at
        # most this; slower: the wait was scaled up too, so the loss is at most this
        c["bound"] = (
            None if c["is_baseline"] or t is None or base is None or t == base else "upper" if t < base else "lower"
        )
    a = red["accept_length"]
    cycle = a / user.tok_s * 1e3 if user.tok_s is not None else None
    doc["user_figures"] = {
        "label": LABEL,
        "verify_ms": user.verify_us / 1e3,
        "allreduce_ms": user.allreduce_us / 1e3,
        "compute_ms": (user.verify_us - user.allreduce_us) / 1e3,
        "tok_s": user.tok_s,
        "accept_length": a,
        "accept_length_source": red["accept_length_source"],
        "cycle_ms": cycle,
        "t_rest_ms": None if cycle is None else cycle - user.verify_us / 1e3,
        "bound": "upper",
        "bound_note": BOUND_NOTE,
        "settle": SETTLE,
        "tok_s_note": NO_TOK_S if user.tok_s is None else None,
        "formula": "allreduce_c = allreduce x pred_c / pred_baseline; verify_c = verify - allreduce + allreduce_c; "
        "tok/s_c = A / (A / tok_s - verify + verify_c)",
        "topology_assumed": is_assumed(topo),
    }
    return doc


def header_lines(user: UserFigures, red: dict) -> list[str]:
    """Env-file header lines of this mode (after :func:`fastverify.tune.predict_mode.prediction_header`'s)."""
    tok = f", {user.tok_s:g} tok/s per stream at A = {red['accept_length']:g}" if user.tok_s is not None else ""
    return [
        f"baseline {LABEL}: verify {user.verify_us / 1e3:g} ms per step, all-reduce {user.allreduce_us / 1e3:g} "
        f"ms of it{tok} (your --verify-ms, --allreduce-ms{', --tok-s' if tok else ''})",
        "each candidate: your all-reduce x its predicted ratio to the predicted baseline; verify = yours - your "
        "all-reduce + that",
        f"{BOUND_NOTE}; {SETTLE}",
    ]
