"""``fastverify tune --predict``: rank NCCL settings for a verify workload with the cost model, and
turn a predicted all-reduce saving into verify time and tok/s. Every number here is **predicted**.

How a candidate is predicted
----------------------------
* Transport per GPU pair: :func:`fastverify.topo.diagnose.diagnose` run on the topology with the
  candidate's environment (NCCL's ``NCCL_P2P_LEVEL`` path rule; P2P where the pair's NCCL path
  type is within the level and NVML does not refuse P2P). The ring runs at the pace of its slowest
  hop, so one SHM pair makes the whole all-reduce SHM-paced (diagnose's rule).
* Time of one all-reduce: :data:`fastverify.topo.diagnose.CALIBRATION` for that transport — NCCL's
  own cost model (``fastverify.nccl.model``) with the PCIe correction fitted on one 8x RTX 4090
  box — on the graph :func:`~fastverify.nccl.model.inputs_for_pcie_box` derives for the PCIe
  generation and sm, restricted to the algorithms / protocols the candidate leaves enabled. NCCL
  still picks the (algorithm, protocol) pair with its *own* model; the correction only changes
  the time of that pair.
* Per verify step: ``sum(count x time(size))`` over the workload's message sizes.

Candidates (the catalogue values that matter for small all-reduces on PCIe):
``NCCL_P2P_LEVEL`` in {current, PHB, SYS} — a level is kept only where it moves some pair to
another transport; ``NCCL_PROTO`` in {current, LL, Simple}; ``NCCL_ALGO`` in {current, Ring, Tree},
written ``allreduce:<name>`` from NCCL 2.24 (the per-function grammar, which leaves the logits
all-gather alone) and as a plain list before. "current" means "what the environment has now",
so the baseline (the current environment, nothing changed) is one of the candidates and is ranked
like the others; ties go to the candidate that changes fewer settings.

Verify time and tok/s (``plan/eagle-fast-verify.md`` §1.4): ``tok/s per stream ≈ A / (t_rest +
t_verify)``. ``t_rest`` (draft forwards, draft-extend, scheduling) is not in a verify workload:
given a measured per-stream tok/s at the baseline it is ``A / tok_s − t_verify(baseline)`` (held
fixed, as in the plan); otherwise it is unknown and there is no tok/s figure at all (None, with
the reason in ``t_rest_basis``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import product
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fastverify.errors import UserError
from fastverify.nccl import catalogue as cat
from fastverify.nccl import model as M
from fastverify.nccl.catalogue import Severity, validate_setting
from fastverify.nccl.enabled import enabled_algos_protos
from fastverify.nccl.version import NcclVersion
from fastverify.topo import diagnose as D
from fastverify.topo.matrix import Topology, parse_nvidia_smi_topo
from fastverify.envfile import TUNER_MAX_BYTES, TunerChoice
from fastverify.tune.workload import Workload

LABEL = "predicted"
DEFAULT_ACCEPT_LENGTH = 3.0  # plan §1.4: the tune default until a measured accept length is at hand
P2P_LEVELS = ("PHB", "SYS")  # the levels beyond NCCL's default PXB that a PCIe box can need
_PROTO_VALUES = {M.Proto.LL: "ll", M.Proto.SIMPLE: "simple"}
_ALGO_VALUES = {M.Algo.RING: "ring", M.Algo.TREE: "tree"}


@dataclass(frozen=True)
class SizePrediction:
    """One message size of the workload under one candidate (µs, predicted)."""

    msg_bytes: int
    count: int
    time_us: float  # one all-reduce
    algo: str  # the pair NCCL picks
    proto: str
    label: str = LABEL

    @property
    def total_us(self) -> float:
        return self.count * self.time_us


@dataclass(frozen=True)
class Candidate:
    """One NCCL setting (or the current environment) and its predicted all-reduce time per verify step.

    ``settings`` are the ``NCCL_*`` values to set on top of the current environment (empty for the
    baseline); ``transport`` is the pace-setting transport of the ring (``"SHM"`` when any pair is
    on SHM); ``p2p_pairs`` / ``pairs`` count GPU pairs on P2P / in all; ``allreduce_us`` is the
    per-step all-reduce time, ``vs_baseline_pct`` its reduction against the baseline (positive =
    faster). ``inputs`` are the cost-model inputs (for a per-size tuner table).
    """

    name: str
    settings: Mapping[str, str]
    is_baseline: bool
    p2p_level: str
    transport: str
    p2p_pairs: int
    pairs: int
    allreduce_us: float
    per_size: tuple[SizePrediction, ...]
    notes: tuple[str, ...] = ()
    vs_baseline_pct: float = 0.0
    inputs: M.ModelInputs | None = field(default=None, compare=False, repr=False)
    label: str = LABEL

    def as_dict(self) -> dict:
        return {
            "name": self.name, "settings": dict(self.settings), "is_baseline": self.is_baseline,
            "p2p_level": self.p2p_level, "transport": self.transport, "p2p_pairs": self.p2p_pairs,
            "pairs": self.pairs, "allreduce_us_per_step": round(self.allreduce_us, 3),
            "vs_baseline_pct": round(self.vs_baseline_pct, 2),
            "per_size": [{"msg_bytes": s.msg_bytes, "count": s.count, "time_us": round(s.time_us, 3),
                          "algo": s.algo, "proto": s.proto} for s in self.per_size],
            "notes": list(self.notes), "label": self.label,
        }


# --- inputs --------------------------------------------------------------------------------------


def _version(nccl_version: NcclVersion | str | None) -> NcclVersion | None:
    if nccl_version is None or isinstance(nccl_version, NcclVersion):
        v = nccl_version
    else:
        v = NcclVersion.parse(str(nccl_version))
    if v is not None and v.code < 20900:
        raise UserError(f"NCCL {v}: the cost model covers NCCL >= 2.9 only")
    return v


def _topology(topology: Topology | str | Path, tp: int) -> Topology:
    if not isinstance(topology, Topology):
        path = Path(topology)
        from fastverify.inputs import read_text

        text = read_text(path, kind="text", errors="replace", what="topology")
        topology = parse_nvidia_smi_topo(text, source=str(path))
    gpus = sorted(topology.gpu_indices)
    if tp > len(gpus):
        raise UserError(f"--tp {tp}: the topology {topology.source} has only {len(gpus)} GPU(s)")
    if tp == len(gpus):
        return topology
    keep = set(gpus[:tp])  # the first tp GPUs, as a server started without CUDA_VISIBLE_DEVICES uses

    def sub(d: dict) -> dict:
        return {k: v for k, v in d.items() if k[0] in keep and k[1] in keep}

    return replace(topology, gpus=tuple(g for g in topology.gpus if g.index in keep), links=sub(topology.links),
                   p2p_read=sub(topology.p2p_read), p2p_write=sub(topology.p2p_write),
                   p2p_reason=sub(topology.p2p_reason))


def with_p2p_results(topology: Topology, results: Mapping[tuple[int, int], Any], *, source: str) -> Topology:
    """``topology`` with the real P2P check's per-direction results in place of NVML's status.

    ``results[(src, dst)].ok`` (GPU ``dst`` read and wrote GPU ``src``'s memory,
    :func:`fastverify.topo.box.read_p2p_results`) becomes ``p2p_read`` and ``p2p_write`` of that
    ordered pair, so a pair with a failed direction is not P2P in any candidate (diagnose's
    ``hw_p2p`` is False when any of the four values is) and a pair whose directions all passed is
    known to allow P2P. The check exercises P2P; NVML only reports it, so the check wins.

    Raises
    ------
    UserError
        A result names a GPU the topology does not have (a check from another box).
    """
    have = set(topology.gpu_indices)
    stray = sorted({g for pair in results for g in pair} - have)
    if stray:
        raise UserError(f"--p2p-check {source}: GPU {stray[0]} is not in the topology {topology.source} "
                        f"(GPUs {', '.join(map(str, sorted(have)))}): a check from another box?")
    read, write, reason = dict(topology.p2p_read), dict(topology.p2p_write), dict(topology.p2p_reason)
    for pair, r in results.items():
        ok = bool(r.ok)
        read[pair] = write[pair] = ok
        if not ok:
            reason[pair] = f"P2P check {source}: {r.reason or 'failed'}"
        else:
            reason.pop(pair, None)
    return replace(topology, p2p_read=read, p2p_write=write, p2p_reason=reason)


def _algo_value(algo: M.Algo, version: NcclVersion | None) -> str:
    new = version is None or version >= cat.GRAMMAR_2_24
    return f"allreduce:{_ALGO_VALUES[algo]}" if new else _ALGO_VALUES[algo]


def _proto_value(proto: M.Proto, version: NcclVersion | None) -> str:
    new = version is None or version >= cat.GRAMMAR_2_24
    return f"allreduce:{_PROTO_VALUES[proto]}" if new else {M.Proto.LL: "LL", M.Proto.SIMPLE: "Simple"}[proto]


# --- ranking -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Level:
    name: str  # "current" or the level written
    level: str  # the level NCCL uses
    settings: dict
    transports: tuple[str, ...]
    notes: tuple[str, ...]


def _levels(topo: Topology, env: dict, version: NcclVersion | None, pcie_gen: int, sm: int,
            p2p_check: str | None = None) -> list[_Level]:
    def run(e: dict) -> tuple[str, tuple[str, ...], list]:
        d = D.diagnose(topo, None, e, nccl_version=str(version) if version else None, batches=(),
                       pcie_gen=pcie_gen, sm=sm)
        return d.p2p_level_now, tuple(p.transport_now for p in d.pairs), d.pairs

    level_now, now, pairs = run(env)
    out = [_Level("current", level_now, {}, now, ())]
    if env.get("NCCL_P2P_DISABLE", "").strip() == "1":
        return out  # NCCL_P2P_DISABLE=1 overrides any level
    for level in P2P_LEVELS:
        if level == level_now:
            continue
        lvl, transports, lpairs = run({**env, "NCCL_P2P_LEVEL": level})
        if any(transports == o.transports for o in out):
            continue  # moves no pair onto another transport
        notes = []
        unknown = [f"{p.a}-{p.b}" for p, q in zip(lpairs, pairs)
                   if p.transport_now == "P2P" and q.transport_now != "P2P" and p.hw_p2p is None]
        if unknown and p2p_check is not None:
            notes.append(f"NCCL_P2P_LEVEL={level} moves {len(unknown)} pair(s) to P2P that the P2P check "
                         f"{p2p_check} does not cover ({', '.join(unknown[:4])}{'...' if len(unknown) > 4 else ''}), "
                         "assuming the driver allows it: run the check with every GPU of the box visible")
        elif unknown:
            notes.append(f"NCCL_P2P_LEVEL={level} moves {len(unknown)} pair(s) to P2P assuming the driver allows it "
                         "(unknown from nvidia-smi text): check with `fastverify p2p`; consumer "
                         "GPUs on stock drivers refuse P2P and stay on SHM; ACS/IOMMU can make it slow or hang")
        out.append(_Level(level, lvl, {"NCCL_P2P_LEVEL": level}, transports, tuple(notes)))
    return out


def _per_size(workload: Workload, transport: M.Transport, inputs: M.ModelInputs) -> tuple[SizePrediction, ...]:
    model = D.CALIBRATION[transport]
    out = []
    for nbytes, count in workload.msg_sizes:
        p = model.predict(nbytes, inputs)
        out.append(SizePrediction(nbytes, count, p.time_us, p.algo.value, p.proto.value))
    return tuple(out)


def rank_nccl_settings(workload: Workload, topology: Topology | str | Path, *,
                       env: Mapping[str, str] | None = None, nccl_version: NcclVersion | str | None = None,
                       pcie_gen: int = 4, sm: int = 89, p2p_check: str | None = None) -> list[Candidate]:
    """NCCL setting candidates for ``workload`` on ``topology``, fastest predicted first.

    Parameters
    ----------
    workload
        The verify step's all-reduces (:mod:`fastverify.tune.workload`); ``workload.tp`` ranks run on
        the first ``tp`` GPUs of the topology.
    topology
        A :class:`~fastverify.topo.matrix.Topology`, or the path of ``nvidia-smi topo -m`` text.
    env
        The current environment (default ``os.environ``): the baseline, and what every candidate
        adds its settings to.
    nccl_version
        The NCCL the server loads; ``None`` = the newest release the model and catalogue know
        (2.30.7): ``allreduce:`` grammar and its constants.
    pcie_gen, sm
        PCIe generation (x16 assumed) and compute capability x10, which nvidia-smi text lacks.
    p2p_check
        The file of the real P2P check whose results are already in ``topology``
        (:func:`with_p2p_results`): the notes then never ask for that check again.

    Returns
    -------
    list of Candidate
        Sorted by predicted all-reduce time per step; ties: fewer settings first. The baseline
        (``is_baseline``) is always included. Settings the catalogue rejects for ``nccl_version``
        are never candidates.

    Raises
    ------
    UserError
        A topology that cannot be read, ``workload.tp`` above its GPU count or below 2, a version
        older than 2.9.
    """
    if workload.tp < 2:
        raise UserError(f"tp {workload.tp}: a single rank runs no all-reduce; nothing to rank")
    if not workload.msg_sizes:
        raise UserError("the workload has no all-reduce; nothing to rank")
    version = _version(nccl_version)
    env = {k: str(v) for k, v in (os.environ if env is None else env).items() if isinstance(k, str)}
    topo = _topology(topology, workload.tp)
    code = version.code if version else M.DEFAULT_NCCL_VERSION
    base_notes: list[str] = []
    if version is None:
        base_notes.append("NCCL version unknown: model constants and setting grammar of NCCL 2.30.7")
    enabled = enabled_algos_protos(env, version, sm)
    base_notes += enabled.notes
    env_algos, env_protos = enabled.algos, enabled.protos_or_none

    levels = _levels(topo, env, version, pcie_gen, sm, p2p_check)
    proto_opts: list[tuple[str | None, frozenset[M.Proto] | None]] = [(None, env_protos)]
    for proto in (M.Proto.LL, M.Proto.SIMPLE):
        value = _proto_value(proto, version)
        if env.get("NCCL_PROTO") != value:
            proto_opts.append((value, frozenset({proto})))
    algo_opts: list[tuple[str | None, frozenset[M.Algo]]] = [(None, env_algos)]
    for algo in (M.Algo.RING, M.Algo.TREE):
        value = _algo_value(algo, version)
        if env.get("NCCL_ALGO") != value:
            algo_opts.append((value, frozenset({algo})))

    rejected: list[str] = []
    built: list[Candidate] = []
    for lvl, (proto_v, protos), (algo_v, algos) in product(levels, proto_opts, algo_opts):
        settings = dict(lvl.settings)
        if proto_v is not None:
            settings["NCCL_PROTO"] = proto_v
        if algo_v is not None:
            settings["NCCL_ALGO"] = algo_v
        bad = [f for k, v in settings.items() if (f := validate_setting(k, v, version)).severity is Severity.ERROR]
        if bad:
            rejected.append(f"{bad[0].name}={bad[0].value}: {bad[0].reason}")
            continue
        transport = M.Transport.SHM if "SHM" in lvl.transports else M.Transport.P2P
        inputs = M.inputs_for_pcie_box(workload.tp, gen=pcie_gen, width=16, sm=sm,
                                       p2p=transport is M.Transport.P2P, version=code,
                                       algos=algos, protos=protos)
        per_size = _per_size(workload, transport, inputs)
        is_base = not settings
        name = ("baseline (current environment, NCCL_P2P_LEVEL " + lvl.level + ")" if is_base
                else " ".join(f"{k}={v}" for k, v in sorted(settings.items())))
        notes = list(lvl.notes) + (base_notes if is_base else [])
        built.append(Candidate(
            name=name, settings=MappingProxyType(dict(sorted(settings.items()))), is_baseline=is_base,
            p2p_level=lvl.level, transport=transport.value,
            p2p_pairs=sum(t == "P2P" for t in lvl.transports), pairs=len(lvl.transports),
            allreduce_us=sum(s.total_us for s in per_size), per_size=per_size, notes=tuple(notes), inputs=inputs))
    baseline = next(c for c in built if c.is_baseline)
    if rejected:
        baseline = replace(baseline, notes=baseline.notes + tuple(f"skipped, the catalogue rejects {r}"
                                                                  for r in rejected))
        built = [baseline if c.is_baseline else c for c in built]
    base_us = baseline.allreduce_us
    ranked = [replace(c, vs_baseline_pct=100.0 * (base_us - c.allreduce_us) / base_us if base_us > 0 else 0.0)
              for c in built]
    ranked.sort(key=lambda c: (round(c.allreduce_us, 6), len(c.settings), c.name))
    # A candidate predicted to behave exactly like a simpler one ranked before it (same transports,
    # same pair and time at every size) adds nothing: e.g. NCCL_ALGO=allreduce:ring where NCCL picks
    # Ring anyway. Keep the simpler one only.
    kept: list[Candidate] = []
    dropped = 0
    for c in ranked:
        same = any(k.transport == c.transport and k.p2p_pairs == c.p2p_pairs and k.per_size == c.per_size
                   for k in kept)
        if same and not c.is_baseline:
            dropped += 1
            continue
        kept.append(c)
    if dropped:
        kept = [replace(c, notes=c.notes + (f"{dropped} candidate(s) predicted to act exactly like a simpler one "
                                            "left out",)) if c.is_baseline else c for c in kept]
    return kept


# --- verify time and tok/s ---------------------------------------------------------------------------


def verify_reduction(workload: Workload, baseline_us: float, candidate_us: float, *,
                     accept_length: float | None = None, tok_s: float | None = None, user=None) -> dict:
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
        A, tokens emitted per cycle per stream; default the workload's, else 3.0 (plan §1.4).
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
        A non-positive or non-finite accept length or tok/s, or a tok/s that implies a cycle
        shorter than the verify step.
    """
    for name, v in (("baseline_us", baseline_us), ("candidate_us", candidate_us)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}={v!r}: expected a finite time >= 0 in µs")
    notes: list[str] = []
    if accept_length is not None:
        a, a_src = float(accept_length), "given"
    elif workload.accept_length is not None:
        a, a_src = float(workload.accept_length), "from the profile"
    else:
        a, a_src = DEFAULT_ACCEPT_LENGTH, "default (plan §1.4; pass --accept-length)"
    if not (math.isfinite(a) and a >= 1):
        raise UserError(f"--accept-length {a!r}: must be a number >= 1 (tokens per cycle, bonus token included)")

    saved = baseline_us - candidate_us
    if user is not None:
        v_base, basis = user.verify_us, user.basis
        cut = user.allreduce_us * (1.0 - candidate_us / baseline_us) if baseline_us > 0 else saved
        notes.append(f"predicted verify = your verify - your all-reduce x (1 - predicted candidate / predicted "
                     f"baseline), i.e. the predicted ratio applied to your all-reduce time ({user.label})")
        v_pred = max(v_base - cut, v_base - user.allreduce_us)
    elif workload.verify_us is not None and workload.measured_on_gpu:
        v_base = workload.verify_us
        basis = f"measured ({workload.clock}: median verify-step window)"
        floor = workload.compute_us or 0.0
        if workload.allreduce_us is not None and baseline_us > 0:
            # The model predicts the ratio; the measured all-reduce time carries the box's level.
            cut = workload.allreduce_us * (1.0 - candidate_us / baseline_us)
            notes.append("predicted verify = measured verify - measured all-reduce x (1 - predicted candidate / "
                         "predicted baseline), i.e. the predicted ratio applied to the measured all-reduce time")
        else:
            cut = saved
            notes.append("predicted verify = measured verify - predicted all-reduce saving")
        v_pred = max(v_base - cut, floor)
    elif workload.compute_us is not None and workload.measured_on_gpu:
        v_base = workload.compute_us + baseline_us
        basis = "predicted: measured compute + predicted all-reduce"
        v_pred = workload.compute_us + candidate_us
    else:
        v_base, v_pred = baseline_us, candidate_us
        basis = "predicted: all-reduce only (compute not measured), so the reduction is an upper bound"
        if workload.verify_us is not None:
            notes.append(f"the workload's times ({workload.clock}) are not GPU timings and are not used")
    red = 100.0 * (v_base - v_pred) / v_base if v_base > 0 else 0.0

    if tok_s is not None:
        if not (isinstance(tok_s, (int, float)) and math.isfinite(tok_s) and tok_s > 0):
            raise UserError(f"--tok-s {tok_s!r}: must be a positive number (tokens/s per stream)")
        t_rest = a / tok_s * 1e6 - v_base
        if t_rest < 0:
            raise UserError(f"--tok-s {tok_s:g} with accept length {a:g} means a cycle of {a / tok_s * 1e3:.2f} ms, "
                            f"shorter than the verify step ({v_base / 1e3:.2f} ms, {basis.split(':')[0]})")
        rest_basis = f"A / tok_s - verify(baseline) with the given {tok_s:g} tok/s, held fixed (plan §1.4)"
    elif user is not None:
        t_rest = None
        rest_basis = "unknown without --tok-s (your measured tok/s per stream now): no tok/s figures"
    else:
        t_rest = None
        rest_basis = ("unknown without --tok-s (your measured tok/s per stream now) or a cycle time: no tok/s "
                      "figures, the all-reduce change only")

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


# --- env file header and tuner table ------------------------------------------------------------------


def change_pct(pct: float) -> str:
    """A change in percent, new vs old (``(new - old) / old x 100``: ``-`` is less time), with its
    sign, one decimal: ``-3.5 %``, ``+1.2 %``; ``0.0 %`` when it rounds to zero (never ``-0.0 %``).
    The one formatter of a change in tune's words."""
    r = round(pct, 1) + 0.0  # + 0.0 turns -0.0 into 0.0
    return "0.0 %" if r == 0 else f"{r:+.1f} %"


def prediction_header(workload: Workload, best, baseline, reduction: Mapping, *,
                      topology_source: str, n_gpus: int, pcie_gen: int, sm: int, user=None,
                      box_facts=None) -> list[str]:
    """Comment lines for an env file written from a prediction: how the values were obtained, the
    box, the workload and the predicted numbers with their ranges and evidence (the writer adds
    date and NCCL version).

    Parameters
    ----------
    best, baseline : fastverify.tune.candidates.Figure
        The winner (an NCCL setting or a registry backend) and the current environment.
    reduction : mapping
        :func:`verify_reduction` of the winner against the baseline.
    user : fastverify.tune.user_figures.UserFigures or None
        The user's own figures: the baseline is labelled with their label (``measured-by-user``),
        and their lines (:func:`fastverify.tune.user_figures.header_lines`) follow.
    """
    sizes = ", ".join(f"{c} x {b:,} B" for b, c in workload.msg_sizes)

    def tok(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    def rng(f) -> str:
        if f.range_us is None:
            return "range unknown at this size"
        lo, hi = f.range_us
        return f"range {lo:,.1f}..{hi:,.1f} us"

    lines = [
        "PREDICTED, not measured: NCCL cost model + PCIe correction fitted on one 8x RTX 4090 box "
        "(fastverify.topo.diagnose.CALIBRATION) and published all-reduce measurements of comparable boxes "
        "(fastverify/data/published_allreduce.json); measure with `fastverify tune` before relying on it",
        f"topology: {topology_source}; GPUs: {n_gpus} in the topology, tp {workload.tp}; "
        + (box_facts.first_line()[2:] if box_facts is not None else f"assumed PCIe Gen{pcie_gen} x16, sm_{sm}"),
        f"workload: {workload.source}; all-reduces per verify step: {sizes}",
        f"chosen: {best.name} (backend {best.backend.value}, {best.label})",
        f"all-reduce per verify step: {baseline.point_us:.1f} us (baseline"
        f"{', ' + user.label if user is not None else ''}, {rng(baseline)}) -> "
        f"{best.point_us:.1f} us ({rng(best)}), {change_pct(-reduction['allreduce_reduction_pct'])} ({best.label})",
        f"verify step: {reduction['verify_baseline_us'] / 1e3:.3f} ms -> {reduction['verify_predicted_us'] / 1e3:.3f} ms, "
        f"{change_pct(-reduction['verify_reduction_pct'])} (predicted; baseline {reduction['verify_baseline_basis']})",
        f"tok/s per stream at A = {reduction['accept_length']:g}: {tok(reduction['tok_s_baseline'])}"
        f"{' (' + user.label + ')' if user is not None else ''} -> "
        f"{tok(reduction['tok_s_predicted'])} (predicted; t_rest {reduction['t_rest_basis']})"
        if reduction["tok_s_baseline"] is not None else
        f"tok/s per stream: not computed (t_rest {reduction['t_rest_basis']})",
    ]
    if user is not None:
        from fastverify.tune.user_figures import header_lines

        lines += header_lines(user, reduction)
    lines += [f"evidence: {e}" for e in best.evidence]
    lines += [f"note: {n}" for n in best.notes]
    return lines


# Ring/LL and Ring/Simple thread thresholds and threads per channel (nccl.md §2.4, tuning.cc):
# NCCL drops channels while nBytes < nChannels x threads x threshold.
def _channels(nbytes: int, algo: M.Algo, proto: M.Proto, n_ranks: int, comm_channels: int) -> int:
    if algo is M.Algo.TREE:
        per = 640 * (8 if proto is M.Proto.LL else 64)
    else:
        per = 512 * (8 * n_ranks if proto is M.Proto.LL else 64)
    return max(1, min(comm_channels, nbytes // per))


def tuner_choices(candidate: Candidate, *, max_log2: int = 36) -> list[TunerChoice]:
    """Per-size rows for NCCL's example tuner plugin from ``candidate``'s cost-model inputs.

    For every size band ``[2^k, 2^(k+1) - 1]`` (and ``[0, 1]``) the (algorithm, protocol) with the
    lowest *corrected* predicted time (which may differ from the pair NCCL's own model picks),
    adjacent bands with the same choice merged, the last band open to the largest size. Channels:
    the count NCCL itself would use for the band's lower size (its per-channel thresholds,
    ``nccl.md`` §2.4), never more than the communicator's ``2 x graph`` channels — always explicit,
    because the example plugin runs unmatched sizes and ``-1`` on one channel. Only ``allreduce``
    rows: other collectives keep NCCL's own choice only if the plugin's 1-channel default suits
    them — the header written with the file should say so.
    """
    inputs = candidate.inputs
    if inputs is None:
        raise ValueError("candidate has no model inputs")
    model = D.CALIBRATION[M.Transport(candidate.transport)]
    comm_channels = min(64, 2 * inputs.n_channels)
    bands = [(0, 1)] + [(1 << k, (1 << (k + 1)) - 1) for k in range(1, max_log2)]
    bands[-1] = (bands[-1][0], TUNER_MAX_BYTES)
    rows: list[TunerChoice] = []
    for lo, hi in bands:
        times = model.times_us(max(lo, 1), inputs)
        algo, proto = min(times, key=lambda k: (times[k], list(M.Algo).index(k[0]), list(M.Proto).index(k[1])))
        ch = _channels(max(lo, 1), algo, proto, inputs.n_ranks, comm_channels)
        row = TunerChoice(lo, hi, algo.value.lower(), proto.value.lower(), ch, inputs.n_ranks)
        prev = rows[-1] if rows else None
        if prev and (prev.algorithm, prev.protocol, prev.channels) == (row.algorithm, row.protocol, row.channels):
            rows[-1] = replace(prev, max_bytes=hi)
        else:
            rows.append(row)
    return rows
