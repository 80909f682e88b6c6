"""What an all-reduce change per verify step means for the verify step and tok/s, and the one way
tune writes a change in percent.

``tok/s per stream ≈ A / (t_rest + t_verify)``. ``t_rest`` (draft forwards, draft-extend,
scheduling) is not in a verify workload: given a measured per-stream tok/s at the baseline it is
``A / tok_s − t_verify(baseline)``, held fixed; otherwise it is unknown and there is no tok/s
figure at all (None, with the reason in ``t_rest_basis``).
"""

from __future__ import annotations

import math

from fastverify.bounds import MAX_EVENT_US
from fastverify.errors import UserError
from fastverify.tune.predict import LABEL
from fastverify.tune.workload import Workload

DEFAULT_ACCEPT_LENGTH = 3.0  # the tune default until a measured accept length is at hand


def verify_reduction(
    workload: Workload,
    baseline_us: float,
    candidate_us: float,
    *,
    accept_length: float | None = None,
    tok_s: float | None = None,
    user=None,
) -> dict:
    """What an all-reduce saving per verify step means for the verify step and tok/s (predicted).

    Parameters
    ----------
    workload
        Supplies the measured verify / compute / all-reduce time per step when it has GPU timings.
        With a measured verify time the predicted verify time is the measured one less the
        measured all-reduce time x (1 - candidate_us / baseline_us): the model's ratio applied to
        the measurement, assuming the profile was taken on the box being tuned.
    baseline_us, candidate_us
        Predicted all-reduce time per verify step now and with the candidate (µs).
    accept_length
        A, tokens emitted per cycle per stream; default the workload's, else 3.0.
    tok_s
        A measured per-stream tok/s at the baseline, if known: fixes ``t_rest``. Without it
        ``t_rest`` and both tok/s values are None (no tok/s without a cycle).
    user
        The user's own verify / all-reduce time per step
        (:class:`fastverify.tune.user_figures.UserFigures`, µs), labelled ``measured-by-user``: the
        baseline verify time, and the all-reduce time the predicted ratio applies to (as with a
        profile's measured times). Without ``tok_s`` the tok/s values are then None, not bounds.

    Returns
    -------
    dict
        ``allreduce_*_us`` and ``allreduce_reduction_pct``; ``verify_baseline_us`` with
        ``verify_baseline_basis`` (measured, or predicted as compute + all-reduce, or all-reduce
        only); ``verify_predicted_us``, ``verify_reduction_pct``; ``accept_length`` and its source;
        ``t_rest_us`` and its basis; ``tok_s_baseline`` / ``tok_s_predicted`` per stream;
        ``notes``; ``label`` = "predicted".

    Raises
    ------
    UserError
        A non-positive or non-finite accept length or tok/s, an accept length above the
        workload's draft tokens (:func:`accept_length_in_force`), or a tok/s that implies a cycle
        shorter than the verify step or longer than an hour.
    """
    for name, v in (("baseline_us", baseline_us), ("candidate_us", candidate_us)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}={v!r}: expected a finite time >= 0 in µs")
    notes: list[str] = []
    a, a_src = accept_length_in_force(workload, accept_length)
    saved = baseline_us - candidate_us
    v_base, basis, v_pred = _verify_times(workload, baseline_us, candidate_us, user, notes)
    red = 100.0 * (v_base - v_pred) / v_base if v_base > 0 else 0.0
    t_rest, rest_basis = _rest_of_cycle(a, tok_s, v_base, basis, user)

    def rate(v: float) -> float | None:
        if t_rest is None:
            return None
        total = t_rest + v
        return a / (total * 1e-6) if total > 0 else None

    return {
        "label": LABEL,
        "allreduce_baseline_us": baseline_us,
        "allreduce_predicted_us": candidate_us,
        "allreduce_saved_us": saved,
        "allreduce_reduction_pct": 100.0 * saved / baseline_us if baseline_us > 0 else 0.0,
        "verify_baseline_us": v_base,
        "verify_baseline_basis": basis,
        "verify_predicted_us": v_pred,
        "verify_reduction_pct": red,
        "accept_length": a,
        "accept_length_source": a_src,
        "t_rest_us": t_rest,
        "t_rest_basis": rest_basis,
        "tok_s_baseline": rate(v_base),
        "tok_s_predicted": rate(v_pred),
        "tok_s_formula": "tok/s per stream = A / (t_rest + t_verify)",
        "notes": notes,
    }


def accept_length_in_force(workload: Workload, accept_length: float | None) -> tuple[float, str]:
    """``(A, where it came from)``: given, else the profile's, else :data:`DEFAULT_ACCEPT_LENGTH`
    (at most the workload's draft tokens). The one check of an accept length against the draft
    tokens per request in force (``workload.draft_tokens``: the profile's, the model's, or
    ``--draft-tokens`` for a profile that records none), whichever way each was given.

    Raises
    ------
    UserError
        A is not finite, below 1, or more than the draft tokens per request (accepted tokens per
        cycle are at most the draft tokens, bonus included).
    """
    draft = workload.draft_tokens
    if accept_length is not None:
        a, a_src, what = float(accept_length), "given", f"--accept-length {accept_length:g}"
    elif workload.accept_length is not None:
        a, a_src, what = (
            float(workload.accept_length),
            "from the profile",
            f"the accept length {workload.accept_length:g} of {workload.source}",
        )
    elif draft is not None and draft < DEFAULT_ACCEPT_LENGTH:
        return float(draft), f"default {DEFAULT_ACCEPT_LENGTH:g} capped at the {draft} draft tokens per request"
    else:
        a, a_src, what = DEFAULT_ACCEPT_LENGTH, "default (plan §1.4; pass --accept-length)", ""
    if not (math.isfinite(a) and a >= 1):
        raise UserError(f"--accept-length {a!r}: must be a number >= 1 (tokens per cycle, bonus token included)")
    if draft is not None and a > draft:
        raise UserError(
            f"{what}: more than the {draft} draft tokens a verify step checks per request "
            "(accepted tokens per cycle are at most the draft tokens)"
        )
    return a, a_src


def _verify_times(
    workload: Workload, baseline_us: float, candidate_us: float, user, notes: list[str]
) -> tuple[float, str, float]:
    """``(verify now, its basis, verify with the candidate)`` in µs: from the user's figures, else
    the workload's measured GPU times, else the all-reduce alone; how, said in ``notes``."""
    saved = baseline_us - candidate_us
    if user is not None:
        v_base, basis = user.verify_us, user.basis
        cut = user.allreduce_us * (1.0 - candidate_us / baseline_us) if baseline_us > 0 else saved
        notes.append(
            f"predicted verify = your verify - your all-reduce x (1 - predicted candidate / predicted "
            f"baseline), i.e. the predicted ratio applied to your all-reduce time ({user.label})"
        )
        return v_base, basis, max(v_base - cut, v_base - user.allreduce_us)
    if workload.verify_us is not None and workload.measured_on_gpu:
        v_base = workload.verify_us
        basis = f"measured ({workload.clock}: median verify-step window)"
        floor = workload.compute_us or 0.0
        if workload.allreduce_us is not None and baseline_us > 0:
            # The model predicts the ratio; the measured all-reduce time carries the box's level.
            cut = workload.allreduce_us * (1.0 - candidate_us / baseline_us)
            notes.append(
                "predicted verify = measured verify - measured all-reduce x (1 - predicted candidate / "
                "predicted baseline), i.e. the predicted ratio applied to the measured all-reduce time"
            )
        else:
            cut = saved
            notes.append("predicted verify = measured verify - predicted all-reduce saving")
        return v_base, basis, max(v_base - cut, floor)
    if workload.compute_us is not None and workload.measured_on_gpu:
        return (
            workload.compute_us + baseline_us,
            "predicted: measured compute + predicted all-reduce",
            workload.compute_us + candidate_us,
        )
    if workload.verify_us is not None:
        notes.append(f"the workload's times ({workload.clock}) are not GPU timings and are not used")
    basis = "predicted: all-reduce only (compute not measured), so the reduction is an upper bound"
    return baseline_us, basis, candidate_us


def _rest_of_cycle(a: float, tok_s: float | None, v_base: float, basis: str, user) -> tuple[float | None, str]:
    """``(t_rest µs, its basis)``: ``A / tok_s − verify(baseline)`` with a measured tok/s, else
    None with the reason."""
    if tok_s is not None:
        if not (isinstance(tok_s, (int, float)) and math.isfinite(tok_s) and tok_s > 0):
            raise UserError(f"--tok-s {tok_s!r}: must be a positive number (tokens/s per stream)")
        if a / tok_s * 1e6 > MAX_EVENT_US:
            raise UserError(
                f"--tok-s {tok_s:g} with accept length {a:g} means a cycle of {a / tok_s:.3g} s, longer "
                "than an hour: not a tok/s per stream"
            )
        t_rest = a / tok_s * 1e6 - v_base
        if t_rest < 0:
            raise UserError(
                f"--tok-s {tok_s:g} with accept length {a:g} means a cycle of {a / tok_s * 1e3:.2f} ms, "
                f"shorter than the verify step ({v_base / 1e3:.2f} ms, {basis.split(':')[0]})"
            )
        return t_rest, f"A / tok_s - verify(baseline) with the given {tok_s:g} tok/s, held fixed (plan §1.4)"
    if user is not None:
        return None, "unknown without --tok-s (your measured tok/s per stream now): no tok/s figures"
    return None, (
        "unknown without --tok-s (your measured tok/s per stream now) or a cycle time: no tok/s "
        "figures, the all-reduce change only"
    )


def change_pct(pct: float) -> str:
    """A change in percent, new vs old (``(new - old) / old x 100``: ``-`` is less time), with its
    sign, one decimal: ``-3.5 %``, ``+1.2 %``; ``0.0 %`` when it rounds to zero (never ``-0.0 %``).
    The one formatter of a change in tune's words."""
    r = round(pct, 1) + 0.0  # + 0.0 turns -0.0 into 0.0
    return "0.0 %" if r == 0 else f"{r:+.1f} %"
