"""``fastverify tune --predict``: rank NCCL settings for a verify workload with NCCL's cost model
(every number **predicted**), and the per-size NCCL tuner-plugin table of a candidate.

* Transport per GPU pair: :func:`fastverify.topo.diagnose.diagnose` with the candidate's
  environment (NCCL's ``NCCL_P2P_LEVEL`` path rule); one SHM pair paces the whole ring.
* One all-reduce: :data:`fastverify.topo.diagnose.CALIBRATION` for that transport (NCCL's cost
  model, PCIe correction fitted on one 8x RTX 4090 box) on the inputs
  :func:`~fastverify.nccl.model.inputs_for_env` gives the candidate's environment (only the
  algorithms / protocols it enables); NCCL picks the pair with its own model, the correction
  changes only its time.
* Per verify step: ``sum(count x time(size))`` over the workload's message sizes.

Candidates: the sweep table :data:`NCCL_SWEEP`, one axis per setting it names, each the current
value or one of the table's: ``NCCL_P2P_LEVEL`` in {current, PHB, SYS} (a level only where it moves
a pair to another transport) x ``NCCL_PROTO`` in {current, LL, Simple} x ``NCCL_ALGO`` in {current,
Ring, Tree}, the last two written ``allreduce:<name>`` from NCCL 2.24 (per-function grammar: the
logits all-gather keeps its own) and as a plain list before; plus the settings the user asks for
(``tune --set``, :func:`priced`); the baseline is ranked too; ties: fewer settings. Every candidate's
cost-model inputs come from its environment (:func:`fastverify.nccl.model.inputs_for_env`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
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
from fastverify.nccl.version import NcclVersion
from fastverify.topo import diagnose as D
from fastverify.topo.matrix import Topology, parse_nvidia_smi_topo
from fastverify.tune.workload import Workload

LABEL = "predicted"
MEASURED_ONLY = "measured only, not predicted"
"""What a ``tune --set`` candidate the cost model cannot price is called in the sweep and the ranking."""


@dataclass(frozen=True)
class SweepValue:
    """One value of one NCCL setting in the sweep table.

    ``per_function``: written ``allreduce:<value in lower case>`` from NCCL 2.24 (the per-function
    grammar of ``NCCL_ALGO`` / ``NCCL_PROTO``), and as ``value`` before.
    """

    name: str
    value: str
    per_function: bool = False

    def written(self, version: NcclVersion | None) -> str:
        """The value as set in the environment for NCCL ``version`` (``None``: the newest grammar)."""
        if self.per_function and (version is None or version >= GRAMMAR_2_24):
            return f"allreduce:{self.value.lower()}"
        return self.value


NCCL_SWEEP: tuple[SweepValue, ...] = (
    SweepValue("NCCL_P2P_LEVEL", "PHB"),  # the levels beyond NCCL's default PXB that a PCIe box can need
    SweepValue("NCCL_P2P_LEVEL", "SYS"),
    SweepValue("NCCL_PROTO", "LL", per_function=True),
    SweepValue("NCCL_PROTO", "Simple", per_function=True),
    SweepValue("NCCL_ALGO", "ring", per_function=True),
    SweepValue("NCCL_ALGO", "tree", per_function=True),
)
"""The NCCL settings ``fastverify tune`` (``--predict`` and the sweep) and ``fastverify topo``'s
advice try, one axis per name in the order given; each axis is also tried at its current value.
``NCCL_P2P_LEVEL`` values move GPU pairs between transports (:func:`fastverify.topo.diagnose.diagnose`);
the others reach the cost model through :func:`fastverify.nccl.model.inputs_for_env`."""


def sweep_values(name: str, version: NcclVersion | None) -> tuple[str, ...]:
    """The values of ``name`` in :data:`NCCL_SWEEP`, as written for NCCL ``version``."""
    return tuple(e.written(version) for e in NCCL_SWEEP if e.name == name)


def priced(name: str, value: str, version: NcclVersion | None) -> bool:
    """Whether the cost model can predict ``name=value`` (a value NCCL accepts): a setting the sweep
    table names, and for ``NCCL_ALGO`` / ``NCCL_PROTO`` one that leaves on an algorithm / protocol
    of the model (NVLS alone is not one). Any other setting can only be measured."""
    if name not in {e.name for e in NCCL_SWEEP}:
        return False
    if name in ("NCCL_ALGO", "NCCL_PROTO"):
        on = M.allreduce_enabled(name, value, version)
        known = M.Algo if name == "NCCL_ALGO" else M.Proto
        return on is not None and any(on.get(k.value) for k in known)
    return True


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
    given: bool = False  # asked for with ``tune --set``: ranked even where it acts like another

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
    return topology.first_gpus(tp)  # the first tp GPUs, as a server started without CUDA_VISIBLE_DEVICES uses


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
    level_now, now, pairs = _transports(topo, env, version, pcie_gen, sm)
    out = [_Level("current", level_now, {}, now, ())]
    if env.get("NCCL_P2P_DISABLE", "").strip() == "1":
        return out  # NCCL_P2P_DISABLE=1 overrides any level
    for level in sweep_values("NCCL_P2P_LEVEL", version):
        if level == level_now:
            continue
        lvl, transports, lpairs = _transports(topo, {**env, "NCCL_P2P_LEVEL": level}, version, pcie_gen, sm)
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


def _transports(topo: Topology, env: Mapping[str, str], version: NcclVersion | None, pcie_gen: int, sm: int):
    """``(level NCCL uses, transport per pair, pairs)`` under ``env`` (:func:`fastverify.topo.diagnose.diagnose`)."""
    d = D.diagnose(
        topo, None, env, nccl_version=str(version) if version else None, batches=(), pcie_gen=pcie_gen, sm=sm
    )
    return d.p2p_level_now, tuple(p.transport_now for p in d.pairs), d.pairs


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
    given: Sequence[Mapping[str, str]] = (),
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
    given
        Settings asked for (``tune --set``), one candidate each, already checked and each
        :func:`priced`: ranked (``given``) even where they act like another candidate.

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
    # the notes of the environment itself (settings NCCL rejects or ignores)
    base_notes += M.inputs_for_env(env, workload.tp, p2p=True, version=version, pcie_gen=pcie_gen, sm=sm)[1]
    levels = _levels(topo, env, version, pcie_gen, sm, p2p_check)
    # one axis per other setting of the table: its current value (None), then each value it does not have
    names = list(dict.fromkeys(e.name for e in NCCL_SWEEP if e.name != "NCCL_P2P_LEVEL"))
    axes = [[None, *(v for v in sweep_values(name, version) if env.get(name) != v)] for name in names]
    asked = [dict(sorted(g.items())) for g in given]
    built, rejected = [], []
    for lvl, *values in product(levels, *axes):
        settings = dict(lvl.settings)
        settings.update((name, v) for name, v in zip(names, values) if v is not None)
        bad = [f for k, v in settings.items() if (f := validate_setting(k, v, version)).severity is Severity.ERROR]
        if bad:
            rejected.append(f"{bad[0].name}={bad[0].value}: {bad[0].reason}")
            continue
        c = _candidate(workload, lvl, settings, env, version=version, pcie_gen=pcie_gen, sm=sm, base_notes=base_notes)
        if dict(c.settings) in asked:
            c = replace(c, given=True)
            asked.remove(dict(c.settings))
        built.append(c)
    for settings in asked:  # asked for and not in the sweep: its own transports
        level, transports, _ = _transports(topo, {**env, **settings}, version, pcie_gen, sm)
        lvl = _Level(level, level, settings, transports, ())
        c = _candidate(workload, lvl, settings, env, version=version, pcie_gen=pcie_gen, sm=sm, base_notes=base_notes)
        built.append(replace(c, given=True))
    return _ranked(built, rejected)


def _candidate(
    workload: Workload,
    lvl: _Level,
    settings: dict,
    env: Mapping[str, str],
    *,
    version: NcclVersion | None,
    pcie_gen: int,
    sm: int,
    base_notes: list[str],
) -> Candidate:
    """One combination of settings over ``env``, its time predicted on the ring's pace-setting transport."""
    transport = M.Transport.SHM if "SHM" in lvl.transports else M.Transport.P2P
    inputs, _ = M.inputs_for_env(
        {**env, **settings}, workload.tp, p2p=transport is M.Transport.P2P, version=version, pcie_gen=pcie_gen, sm=sm
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
        if same and not c.is_baseline and not c.given:
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
