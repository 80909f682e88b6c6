"""``fastverify tune --predict``: rank NCCL settings for a verify workload with NCCL's cost model
(every number **predicted**), and the per-size NCCL tuner-plugin table of a candidate.

* Transport per GPU pair: :func:`fastverify.topo.diagnose.diagnose` with the candidate's
  environment (NCCL's ``NCCL_P2P_LEVEL`` path rule); one SHM pair paces the whole ring.
* One all-reduce: :data:`fastverify.topo.diagnose.CALIBRATION` for that transport (NCCL's cost
  model, PCIe correction fitted on one 8x RTX 4090 box) on the graph of
  :func:`~fastverify.nccl.model.inputs_for_pcie_box`, only the algorithms / protocols the candidate
  enables; NCCL picks the pair with its own model, the correction changes only its time.
* Per verify step: ``sum(count x time(size))`` over the workload's message sizes.

Candidates: ``NCCL_P2P_LEVEL`` in {current, PHB, SYS} (a level only where it moves a pair to
another transport) x ``NCCL_PROTO`` in {current, LL, Simple} x ``NCCL_ALGO`` in {current, Ring,
Tree}, written ``allreduce:<name>`` from NCCL 2.24 (per-function grammar: the logits all-gather
keeps its own) and as a plain list before; the baseline is ranked too; ties: fewer settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import product
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fastverify.envfile import TUNER_MAX_BYTES, TunerChoice
from fastverify.errors import UserError
from fastverify.inputs import read_text
from fastverify.nccl import model as M
from fastverify.nccl.checks import GRAMMAR_2_24, Severity, validate_setting
from fastverify.nccl.model import enabled_algos_protos
from fastverify.nccl.version import NcclVersion
from fastverify.topo import diagnose as D
from fastverify.topo.matrix import Topology, parse_nvidia_smi_topo
from fastverify.tune.workload import Workload

LABEL = "predicted"
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
            "name": self.name,
            "settings": dict(self.settings),
            "is_baseline": self.is_baseline,
            "p2p_level": self.p2p_level,
            "transport": self.transport,
            "p2p_pairs": self.p2p_pairs,
            "pairs": self.pairs,
            "allreduce_us_per_step": round(self.allreduce_us, 3),
            "vs_baseline_pct": round(self.vs_baseline_pct, 2),
            "per_size": [
                {
                    "msg_bytes": s.msg_bytes,
                    "count": s.count,
                    "time_us": round(s.time_us, 3),
                    "algo": s.algo,
                    "proto": s.proto,
                }
                for s in self.per_size
            ],
            "notes": list(self.notes),
            "label": self.label,
        }


# --- inputs --------------------------------------------------------------------------------------


def _version(nccl_version: NcclVersion | str | None) -> NcclVersion | None:
    if nccl_version is None or isinstance(nccl_version, NcclVersion):
        v = nccl_version
    else:
        v = NcclVersion.parse(str(nccl_version))
    if v is not None and v.code < 20900:
        raise UserError(f"NCCL {v}: the cost model covers NCCL >= 2.9 only")
    if v is not None and v.major > 2:
        raise UserError(
            f"NCCL {v}: newer than the NCCL 2.x releases the cost model knows; give the 2.x version "
            "you run (--nccl-version), or measure with `fastverify tune`"
        )
    return v


def _topology(topology: Topology | str | Path, tp: int) -> Topology:
    if not isinstance(topology, Topology):
        path = Path(topology)
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

    return replace(
        topology,
        gpus=tuple(g for g in topology.gpus if g.index in keep),
        links=sub(topology.links),
        p2p_read=sub(topology.p2p_read),
        p2p_write=sub(topology.p2p_write),
        p2p_reason=sub(topology.p2p_reason),
    )


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
        raise UserError(
            f"--p2p-check {source}: GPU {stray[0]} is not in the topology {topology.source} "
            f"(GPUs {', '.join(map(str, sorted(have)))}): a check from another box?"
        )
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
    new = version is None or version >= GRAMMAR_2_24
    return f"allreduce:{_ALGO_VALUES[algo]}" if new else _ALGO_VALUES[algo]


def _proto_value(proto: M.Proto, version: NcclVersion | None) -> str:
    new = version is None or version >= GRAMMAR_2_24
    return f"allreduce:{_PROTO_VALUES[proto]}" if new else {M.Proto.LL: "LL", M.Proto.SIMPLE: "Simple"}[proto]


# --- ranking -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Level:
    name: str  # "current" or the level written
    level: str  # the level NCCL uses
    settings: dict
    transports: tuple[str, ...]
    notes: tuple[str, ...]


def _levels(
    topo: Topology, env: dict, version: NcclVersion | None, pcie_gen: int, sm: int, p2p_check: str | None = None
) -> list[_Level]:
    def run(e: dict) -> tuple[str, tuple[str, ...], list]:
        d = D.diagnose(
            topo, None, e, nccl_version=str(version) if version else None, batches=(), pcie_gen=pcie_gen, sm=sm
        )
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
        unknown = [
            f"{p.a}-{p.b}"
            for p, q in zip(lpairs, pairs)
            if p.transport_now == "P2P" and q.transport_now != "P2P" and p.hw_p2p is None
        ]
        if unknown and p2p_check is not None:
            notes.append(
                f"NCCL_P2P_LEVEL={level} moves {len(unknown)} pair(s) to P2P that the P2P check "
                f"{p2p_check} does not cover ({', '.join(unknown[:4])}{'...' if len(unknown) > 4 else ''}), "
                "assuming the driver allows it: run the check with every GPU of the box visible"
            )
        elif unknown:
            notes.append(
                f"NCCL_P2P_LEVEL={level} moves {len(unknown)} pair(s) to P2P assuming the driver allows it "
                "(unknown from nvidia-smi text): check with `fastverify p2p`; consumer "
                "GPUs on stock drivers refuse P2P and stay on SHM; ACS/IOMMU can make it slow or hang"
            )
        out.append(_Level(level, lvl, {"NCCL_P2P_LEVEL": level}, transports, tuple(notes)))
    return out


def _per_size(workload: Workload, transport: M.Transport, inputs: M.ModelInputs) -> tuple[SizePrediction, ...]:
    model = D.CALIBRATION[transport]
    out = []
    for nbytes, count in workload.msg_sizes:
        p = model.predict(nbytes, inputs)
        out.append(SizePrediction(nbytes, count, p.time_us, p.algo.value, p.proto.value))
    return tuple(out)


def rank_nccl_settings(
    workload: Workload,
    topology: Topology | str | Path,
    *,
    env: Mapping[str, str] | None = None,
    nccl_version: NcclVersion | str | None = None,
    pcie_gen: int = 4,
    sm: int = 89,
    p2p_check: str | None = None,
) -> list[Candidate]:
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
    base_notes: list[str] = []
    if version is None:
        base_notes.append("NCCL version unknown: model constants and setting grammar of NCCL 2.30.7")
    enabled = enabled_algos_protos(env, version, sm)
    base_notes += enabled.notes
    levels = _levels(topo, env, version, pcie_gen, sm, p2p_check)
    proto_opts, algo_opts = _proto_algo_options(env, version, enabled.algos, enabled.protos_or_none)
    built, rejected = [], []
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
        built.append(
            _candidate(
                workload, lvl, settings, algos, protos, version=version, pcie_gen=pcie_gen, sm=sm, base_notes=base_notes
            )
        )
    return _ranked(built, rejected)


def _proto_algo_options(env: Mapping[str, str], version: NcclVersion | None, env_algos, env_protos):
    """``(value written or None, what it enables)`` per protocol and per algorithm choice: the
    environment's own first, then each single one the environment does not set already."""
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
    return proto_opts, algo_opts


def _candidate(
    workload: Workload,
    lvl: _Level,
    settings: dict,
    algos,
    protos,
    *,
    version: NcclVersion | None,
    pcie_gen: int,
    sm: int,
    base_notes: list[str],
) -> Candidate:
    """One combination of settings, its time predicted on the ring's pace-setting transport."""
    transport = M.Transport.SHM if "SHM" in lvl.transports else M.Transport.P2P
    inputs = M.inputs_for_pcie_box(
        workload.tp,
        gen=pcie_gen,
        width=16,
        sm=sm,
        p2p=transport is M.Transport.P2P,
        version=version.code if version else M.DEFAULT_NCCL_VERSION,
        algos=algos,
        protos=protos,
    )
    per_size = _per_size(workload, transport, inputs)
    is_base = not settings
    name = (
        "baseline (current environment, NCCL_P2P_LEVEL " + lvl.level + ")"
        if is_base
        else " ".join(f"{k}={v}" for k, v in sorted(settings.items()))
    )
    notes = list(lvl.notes) + (base_notes if is_base else [])
    return Candidate(
        name=name,
        settings=MappingProxyType(dict(sorted(settings.items()))),
        is_baseline=is_base,
        p2p_level=lvl.level,
        transport=transport.value,
        p2p_pairs=sum(t == "P2P" for t in lvl.transports),
        pairs=len(lvl.transports),
        allreduce_us=sum(s.total_us for s in per_size),
        per_size=per_size,
        notes=tuple(notes),
        inputs=inputs,
    )


def _ranked(built: list[Candidate], rejected: list[str]) -> list[Candidate]:
    """``built`` with their change against the baseline, fastest first (ties: fewer settings),
    less those predicted to act exactly like a simpler one; the baseline's notes say what was
    skipped or left out."""
    baseline = next(c for c in built if c.is_baseline)
    if rejected:
        baseline = replace(
            baseline, notes=baseline.notes + tuple(f"skipped, the catalogue rejects {r}" for r in rejected)
        )
        built = [baseline if c.is_baseline else c for c in built]
    base_us = baseline.allreduce_us
    ranked = [
        replace(c, vs_baseline_pct=100.0 * (base_us - c.allreduce_us) / base_us if base_us > 0 else 0.0) for c in built
    ]
    ranked.sort(key=lambda c: (round(c.allreduce_us, 6), len(c.settings), c.name))
    # A candidate predicted to behave exactly like a simpler one ranked before it (same transports,
    # same pair and time at every size) adds nothing: e.g. NCCL_ALGO=allreduce:ring where NCCL picks
    # Ring anyway. Keep the simpler one only.
    kept: list[Candidate] = []
    dropped = 0
    for c in ranked:
        same = any(k.transport == c.transport and k.p2p_pairs == c.p2p_pairs and k.per_size == c.per_size for k in kept)
        if same and not c.is_baseline:
            dropped += 1
            continue
        kept.append(c)
    if dropped:
        kept = [
            replace(
                c, notes=c.notes + (f"{dropped} candidate(s) predicted to act exactly like a simpler one left out",)
            )
            if c.is_baseline
            else c
            for c in kept
        ]
    return kept


# --- tuner table ------------------------------------------------------------------------------------


# Ring/LL and Ring/Simple thread thresholds and threads per channel (NCCL src/graph/tuning.cc):
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
    the count NCCL itself would use for the band's lower size (its per-channel thresholds, NCCL
    ``src/graph/tuning.cc``), never more than the communicator's ``2 x graph`` channels — always
    explicit, because the example plugin runs unmatched sizes and ``-1`` on one channel. Only ``allreduce``
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
