"""Which all-reduce algorithms and protocols an environment leaves enabled, for one NCCL version.

The one public answer that ``fastverify topo`` and ``fastverify tune`` both ask. It replays
NCCL's own parsing of ``NCCL_ALGO`` / ``NCCL_PROTO`` through :mod:`fastverify.nccl.algoproto`
(NCCL ``src/graph/tuning.cc`` ``parseList`` for NCCL <= 2.23, the per-function grammar of
``src/graph/tuning.cc`` from 2.24 on) and NCCL's default protocol rule
(:func:`fastverify.nccl.model.default_protos`, ``tuning.cc`` ``ncclTopoTuneModel``: LL128 only on
some architectures and links).

Only the algorithms the cost model knows on one PCIe node are answered (Ring, Tree,
:class:`fastverify.nccl.model.Algo`); CollNet, NVLS and PAT need hardware a PCIe box has not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fastverify.nccl import model as M
from fastverify.nccl.algoproto import parse
from fastverify.nccl.catalogue import validate_setting
from fastverify.nccl.findings import Ctx, Severity
from fastverify.nccl.version import NcclVersion

__all__ = ["EnabledAlgos", "allreduce_enabled", "enabled_algos_protos"]

_ALL_ALGOS = frozenset({M.Algo.RING, M.Algo.TREE})


@dataclass(frozen=True)
class EnabledAlgos:
    """What an environment leaves enabled for AllReduce on one PCIe node.

    Attributes
    ----------
    algos : frozenset of fastverify.nccl.model.Algo
        Never empty: an NCCL_ALGO that turns every algorithm off makes NCCL <= 2.23 switch Ring and
        Tree back on (``tuning.cc``), and fails init on >= 2.24 (a catalogue error finding).
    protos : frozenset of fastverify.nccl.model.Proto
        Never empty. Where the environment does not decide them (``protos_set`` False) this is
        NCCL's default set for a PCIe link, ``default_protos(PCI, sm, version)``.
    notes : tuple of str
        One line per setting that NCCL rejects or ignores (the prediction is made without it).
    protos_set : bool
        True when ``NCCL_PROTO`` decided ``protos``; False when they are NCCL's default (what
        :class:`fastverify.nccl.model.ModelInputs` means by ``protos=None``).
    """

    algos: frozenset[M.Algo]
    protos: frozenset[M.Proto]
    notes: tuple[str, ...] = ()
    protos_set: bool = False

    @property
    def protos_or_none(self) -> frozenset[M.Proto] | None:
        """``protos`` where the environment set them, else ``None`` (NCCL's default rule), the form
        :func:`fastverify.nccl.model.inputs_for_pcie_box` takes."""
        return self.protos if self.protos_set else None


def allreduce_enabled(name: str, value: str, version: NcclVersion | None) -> dict[str, int] | None:
    """What ``NCCL_ALGO`` / ``NCCL_PROTO`` = ``value`` leaves enabled for AllReduce.

    Parameters
    ----------
    name : {"NCCL_ALGO", "NCCL_PROTO"}
    value : str
        The setting as written.
    version : NcclVersion or None
        ``None``: the newest NCCL the catalogue was checked against (its grammar).

    Returns
    -------
    dict or None
        NCCL's name (``"Ring"``, ``"LL128"`` …) → 0 off, 1 on, 2 NCCL's default rule; ``None``
        when NCCL rejects the value (init fails) or ignores all of it.
    """
    if name not in ("NCCL_ALGO", "NCCL_PROTO"):
        raise ValueError(f"name must be NCCL_ALGO or NCCL_PROTO, got {name!r}")
    parsed = parse(name, value, Ctx.of(version))
    if parsed.error:
        return None
    return dict(parsed.enable["AllReduce"])


def enabled_algos_protos(env: Mapping[str, str], version: NcclVersion | None, sm: int) -> EnabledAlgos:
    """The all-reduce algorithms and protocols ``env`` leaves enabled for this NCCL version.

    Parameters
    ----------
    env : mapping of str to str
        ``NCCL_*`` settings (others are ignored); only ``NCCL_ALGO`` and ``NCCL_PROTO`` matter here.
    version : NcclVersion or None
        The NCCL that reads ``env``; ``None`` = unknown (the newest grammar, the model's default
        version for the default protocol rule).
    sm : int
        GPU compute capability × 10 (89 = Ada, 120 = Blackwell workstation): decides LL128 in
        NCCL's default protocol set.

    Returns
    -------
    EnabledAlgos
        Settings NCCL rejects (a catalogue error) or ignores entirely are left out and named in
        ``notes``; their algorithms / protocols are NCCL's defaults.
    """
    notes: list[str] = []
    algos = _ALL_ALGOS
    code = version.code if version else M.DEFAULT_NCCL_VERSION
    default = M.default_protos(M.LinkType.PCI, sm, code)
    protos, protos_set = default, False
    if "NCCL_ALGO" in env and validate_setting("NCCL_ALGO", env["NCCL_ALGO"], version).severity is not Severity.ERROR:
        on = allreduce_enabled("NCCL_ALGO", env["NCCL_ALGO"], version)
        if on is not None:
            algos = frozenset(a for a in M.Algo if on.get(a.value)) or _ALL_ALGOS
    elif "NCCL_ALGO" in env:
        notes.append(f"NCCL rejects or ignores NCCL_ALGO={env['NCCL_ALGO']!r}: the baseline is predicted without it")
    if "NCCL_PROTO" in env and validate_setting("NCCL_PROTO", env["NCCL_PROTO"], version).severity is not Severity.ERROR:
        on = allreduce_enabled("NCCL_PROTO", env["NCCL_PROTO"], version)
        if on is not None:
            chosen = frozenset(p for p in M.Proto if on.get(p.value) == 1 or (on.get(p.value) == 2 and p in default))
            if chosen:
                protos, protos_set = chosen, True
    elif "NCCL_PROTO" in env:
        notes.append(f"NCCL rejects NCCL_PROTO={env['NCCL_PROTO']!r}: the baseline is predicted without it")
    return EnabledAlgos(algos, protos, tuple(notes), protos_set)
