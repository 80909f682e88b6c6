"""``fastverify topo``'s recommendation: the box's options ranked by
:func:`fastverify.tune.advice.rank_options` (the ranking ``tune --predict`` prints), as JSON entries
and as the lines of "what to do", each saying where its evidence stops.

An entry's ``change_pct`` is new − old over old, in % of the all-reduce time (−: less time);
``allreduce_us`` is per verify step for a model workload, and one all-reduce of each verify size
where the counts per step are unknown (no ``--model``).
"""

from __future__ import annotations

import re

from fastverify.errors import UserError

TOP = 3
"""Options listed in "what to do" (those predicted faster than the current settings, at most this many)."""
MODEL_ERROR_PCT = 10.0
"""Held-out error of the NCCL cost model (:data:`fastverify.topo.diagnose.CALIBRATION`): a smaller
predicted change of an NCCL setting is within it."""


def _title(backend: str | None) -> str:
    """The registry's words for a backend (empty for NCCL settings or an unknown name)."""
    from fastverify.registry import BackendName, backend_info

    try:
        return backend_info(BackendName(backend)).title
    except ValueError:
        return ""


def build_advice(workload, topo, *, counts_known: bool, env, nccl_version, sm: int, pcie_gen: int, perf=None,
                 log=None, tune_hint: str = "", no_p2p_pairs: tuple[str, ...] = ()) -> tuple[list[dict] | None, list[str]]:
    """The ranking for ``workload`` on ``topo`` and the lines saying where its evidence stops.

    Parameters
    ----------
    workload : fastverify.tune.workload.Workload
    topo : Topology or None
        None: no ranking (the one note says why).
    counts_known : bool
        The workload counts its all-reduces per verify step (a model); else each size once.
    env, nccl_version, sm, pcie_gen, perf, log
        As :func:`fastverify.tune.advice.rank_options` takes them; a ``perf`` table of another
        world size than ``workload.tp`` is left out of the ranking (said in the notes).
    tune_hint : str
        The ``fastverify tune --predict`` command line that ranks the same options.
    no_p2p_pairs : tuple of str
        Pairs (``"a-b"``) the diagnosis finds without P2P (NCCL re-routed them, or fell back to SHM
        where the level allows P2P); the ranking's P2P facts do not hold them, so a note says so.

    Returns
    -------
    (entries, notes)
        ``entries`` (:func:`advice_entries`) or None where the ranking cannot run; ``notes``: the
        workload, the evidence and what is unknown, or the one line saying why there is no ranking.
        A UserError of the ranking (a topology it cannot use) becomes that line.
    """
    if topo is None:
        return None, ["no ranking of options: the box's topology is unknown from this input (an NCCL log or an "
                      "all_reduce_perf table alone); add --topology FILE (`nvidia-smi topo -m`) to rank NCCL settings "
                      "and all-reduce backends together"]
    from fastverify.tune.advice import prediction_p2p, rank_options

    notes = []
    if perf is not None and perf.n_ranks is not None and perf.n_ranks != workload.tp:
        notes.append(f"{perf.source} ran on {perf.n_ranks} GPUs, the ranking on tp {workload.tp}: left out of it")
        perf = None
    try:
        pred = rank_options(workload, topo, env=env, nccl_version=nccl_version, sm=sm, pcie_gen=pcie_gen,
                            perf=perf, log=log)
    except UserError as e:
        return None, [f"no ranking of options: {e}"]
    p2p_ok, p2p_source = prediction_p2p(None, topo, log)
    entries = advice_entries(pred, p2p_ok=p2p_ok, p2p_source=p2p_source, per_verify_step=counts_known)
    return entries, [*_workload_notes(workload, counts_known), *notes,
                     *_limits(pred, entries, p2p_ok, p2p_source, no_p2p_pairs), *([tune_hint] if tune_hint else [])]


def advice_entries(pred, *, p2p_ok: bool | None, p2p_source: str, per_verify_step: bool = True) -> list[dict]:
    """One dict per candidate of ``pred`` (:class:`fastverify.tune.candidates.Prediction`), in rank
    order: ``rank`` (None: not ranked, no published data), ``candidate`` (name), ``backend``,
    ``settings``, ``is_baseline``, ``label``, ``allreduce_us`` / ``allreduce_us_range`` /
    ``baseline_us`` (µs), ``change_pct`` (new − old, %), ``evidence``, ``notes``, ``needs_p2p`` and
    ``p2p`` (``proven`` / ``reported by NVML`` / ``unproven`` / ``refuted``, None for NCCL),
    ``per_verify_step`` (False: the times are one all-reduce of each size, counts unknown), ``too_close``
    (:attr:`fastverify.tune.candidates.Prediction.too_close`'s line, None when its lead is decided)."""
    from fastverify.registry import backend_info

    base = pred.baseline.point_us
    p2p = ("unproven" if p2p_ok is None else "refuted" if p2p_ok is False
           else "reported by NVML, not proven" if p2p_source == "nvml" else "proven")
    out = []
    for i, f in enumerate(pred.candidates, 1):
        needs = backend_info(f.backend).needs_p2p
        change = None if f.point_us is None or not base else round(100.0 * (f.point_us - base) / base, 2)
        out.append({"rank": i if f.ranked else None, "candidate": f.name, "backend": f.backend.value,
                    "settings": dict(f.settings), "is_baseline": f.is_baseline, "label": f.label,
                    "allreduce_us": None if f.point_us is None else round(f.point_us, 3),
                    "allreduce_us_range": None if f.range_us is None else [round(x, 3) for x in f.range_us],
                    "baseline_us": None if base is None else round(base, 3), "change_pct": change,
                    "evidence": list(f.evidence), "notes": list(f.notes), "needs_p2p": needs,
                    "p2p": p2p if needs else None, "per_verify_step": per_verify_step, "status": f.status,
                    "too_close": pred.too_close.get(f.name)})
    return out


def _workload_notes(workload, counts_known: bool) -> list[str]:
    if counts_known:
        return [f"for {workload.source}: {workload.allreduce_count} all-reduces per verify step"]
    n = len(workload.msg_sizes)
    each = "the one verify size" if n == 1 else f"one all-reduce of each of the {n} verify sizes"
    return [f"counts per verify step are unknown without --model: the times are {each} "
            f"({', '.join(f'{b:,}' for b, _ in workload.msg_sizes)} B), not a verify step; give --model "
            "(and --tp) for per-step figures"]


def _limits(pred, entries: list[dict], p2p_ok, p2p_source: str, no_p2p_pairs=()) -> list[str]:
    """Where the evidence of the listed options stops, and what this input cannot tell."""
    listed = _listed(entries) + [e for e in entries if e["is_baseline"]]
    out = []
    if no_p2p_pairs and p2p_ok is not False and any(e["needs_p2p"] for e in listed):
        shown = ", ".join(no_p2p_pairs[:6]) + (" ..." if len(no_p2p_pairs) > 6 else "")
        out.append(f"caution: this input shows {len(no_p2p_pairs)} pair(s) without P2P ({shown}; see the pairs "
                   "below), which the ranking's P2P facts do not hold: an option that needs P2P between every pair "
                   "will likely not run; prove it with `fastverify p2p` first")
    kinds = []
    if any(e["label"] == "measured" or any(x.startswith("measured") for x in e["evidence"]) for e in listed):
        kinds.append("measured on this box (your files)")
    if any(any(x.startswith("published") for x in e["evidence"]) for e in listed):
        kinds.append("published measurements of other, comparable boxes")
    if any(any("cost model" in x or "TUNING" in x for x in e["evidence"]) for e in listed):
        kinds.append("NCCL's cost model (PCIe correction fitted on one 8x RTX 4090 box)")
    out.append(f"evidence: {'; '.join(kinds) or 'none'}; nothing here was measured by fastverify on this box")
    unknown = []
    if p2p_ok is None:
        unknown.append(f"driver P2P ({p2p_source})")
    unknown += ["ACS/IOMMU (can make P2P slow or hang; no input here shows it)",
                "the rest of the verify step (compute not measured: the % are of all-reduce time)"]
    out.append("unknown from this input: " + "; ".join(unknown))
    ruled = [r.split(";")[0] for r in pred.not_candidates]
    if ruled:
        out.append("ruled out on this box: " + "; ".join(ruled))
    unranked = [f"{e['backend']} ({(e['status'] or 'no figure').split(':')[0]})" for e in entries if e["rank"] is None]
    if unranked:
        out.append(f"not ranked: {', '.join(unranked)}: measure each with `fastverify tune` on the box")
    return out


def _listed(entries: list[dict]) -> list[dict]:
    """The options predicted faster than the current settings, at most :data:`TOP`."""
    out = []
    for e in entries:
        if e["is_baseline"] or e["rank"] is None:
            break
        out.append(e)
    return out[:TOP]


def _pct(v: float) -> str:
    from fastverify.tune.verify_time import change_pct

    return change_pct(v)


def _amount(us: float, counts_known: bool) -> str:
    return f"{us / 1e3:.3f} ms" if counts_known else f"{us:,.1f} µs"


def advice_lines(entries: list[dict] | None, notes: list[str]) -> list[str]:
    """The lines of "what to do" from the ranking: the listed options in rank order with their
    change and evidence, then the current settings, then the notes; without a ranking, its note."""
    if entries is None:
        return list(notes)
    listed = _listed(entries)
    base = next(e for e in entries if e["is_baseline"])
    counts_known = base["per_verify_step"]
    unit = "per verify step" if counts_known else "of the all-reduce time"
    lines = []
    for e in listed:
        title = _title(e["backend"])
        name = f"{e['candidate']} ({title})" if title and not e["settings"] else e["candidate"]
        line = (f"{e['rank']}. {name}: {_pct(e['change_pct'])} {unit} ({_amount(e['allreduce_us'], counts_known)} "
                f"vs {_amount(e['baseline_us'], counts_known)} now), {_basis(e)}")
        if e.get("too_close"):
            why = e["too_close"].removeprefix(f"{e['candidate']}: ")
            line = f"{e['rank']}. {name}: {why}; at its point {_pct(e['change_pct'])}, {_basis(e)}"
        if e["needs_p2p"]:
            line += f"; needs P2P: {e['p2p']}"
            if e["p2p"] != "proven":
                line += ", run `fastverify p2p --output p2p.json` (and `fastverify launch --p2p-check p2p.json` deploys it)"
        lines.append(line)
    if not listed:
        lines.append("keep the current settings: no option is predicted faster")
    per = " per verify step" if counts_known else ""
    lines.append(f"then: {base['candidate']}: {_amount(base['allreduce_us'], counts_known)}{per}, {_basis(base)}")
    return lines + notes


def _basis(e: dict) -> str:
    """Where one option's figure comes from, in words."""
    ev = e["evidence"]
    if e["label"] == "measured":
        return f"measured ({ev[0].removeprefix('measured: ')})" if ev else "measured"
    if any(x.startswith("P2P kernel model") for x in ev):
        m = re.search(r"misses on (\d+) published boxes", " ".join(ev))
        return "predicted by the P2P kernel model" + (f" (its misses on {m.group(1)} published boxes)" if m else "")
    published = next((x for x in ev if x.startswith("published")), None)
    if published is not None:
        m = re.search(r"(\d+) comparable box", published)
        boxes = f"{m.group(1)} comparable published box{'es' if m.group(1) != '1' else ''}" if m else \
            "published measurements of other boxes"
        return f"predicted from {boxes}"
    words = "predicted by NCCL's cost model"
    if any(x.startswith("measured") for x in ev):
        words += ", against your measured baseline"
    if not e["is_baseline"] and e["change_pct"] is not None and abs(e["change_pct"]) < MODEL_ERROR_PCT:
        words += f", within the model's error (~{MODEL_ERROR_PCT:.0f} %): measure it"
    return words


def level_line(d) -> str:
    """The ``# NCCL_P2P_LEVEL now: …`` line of :class:`fastverify.topo.diagnose.Diagnosis` ``d``: the
    widest level P2P can use, placed in the ranking where there is one."""
    head = f"# NCCL_P2P_LEVEL now: {d.p2p_level_now} ({d.p2p_level_now_source}); "
    rec = d.p2p_level_recommended
    if rec is None:
        return head + "recommended: no change"
    entry = next((e for e in d.advice or () if e["settings"] == {"NCCL_P2P_LEVEL": rec}), None)
    if entry is None:
        return head + f"recommended: {rec}"
    base_rank = next(e["rank"] for e in d.advice if e["is_baseline"])
    if entry["rank"] is not None and entry["rank"] < base_rank:
        return head + f"best level: {rec} (option {entry['rank']} of the ranking below, {_pct(entry['change_pct'])})"
    return head + f"{rec} would give P2P to more pairs but is predicted slower ({_pct(entry['change_pct'])}): no change"
