"""The box facts the cost model and the backend gates need (compute capability, PCIe generation,
GPU count), each with where it came from: a flag, ``--describe-box``, NVML on this machine, the
topology text, or a guess. A guess is never silent: :meth:`BoxFacts.first_line` says it first.

Order, per fact: the flag (``--sm``, ``--pcie-gen``), then the described box, then NVML (only when
this machine's GPUs can be the box: no topology text given, or the same GPU count), then the
topology text (GPU count), then the guess. The guess is the cost model's calibration box, 8×
RTX 4090 (SM89, PCIe Gen 4; :mod:`fastverify.nccl.model`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

GUESS_SM = 89
"""Compute capability × 10 assumed when nothing says it (the calibration box's, RTX 4090)."""
GUESS_PCIE_GEN = 4
"""PCIe generation assumed when nothing says it (the calibration box's)."""
SM_RANGE = (30, 300)
"""Compute capability × 10 that ``--sm`` and a described box may state: the cost model's range
(:class:`fastverify.nccl.model.ModelInputs`), sm_30 (Kepler) to past today's sm_121."""


@dataclass(frozen=True)
class Fact:
    """One fact and its source: ``"--sm"``/``"--pcie-gen"`` (flag), ``"--describe-box"``,
    ``"nvml"`` (this machine), ``"topology"`` or ``"guessed"``."""

    value: int | None
    source: str

    @property
    def guessed(self) -> bool:
        return self.source == "guessed"


@dataclass(frozen=True)
class BoxFacts:
    """SM (compute capability × 10), PCIe generation and GPU count of the box the command is about."""

    sm: Fact
    pcie_gen: Fact
    gpu_count: Fact

    def as_dict(self) -> dict:
        return {name: {"value": f.value, "source": f.source}
                for name, f in (("sm", self.sm), ("pcie_gen", self.pcie_gen), ("gpu_count", self.gpu_count))}

    def first_line(self) -> str:
        """``# box: …`` naming each fact and its source; a guessed one is said loud, with the fix."""
        parts = [f"SM {self.sm.value} ({self.sm.source})", f"PCIe Gen {self.pcie_gen.value} ({self.pcie_gen.source})"]
        if self.gpu_count.value is not None:
            parts.append(f"{self.gpu_count.value} GPUs ({self.gpu_count.source})")
        line = "# box: " + ", ".join(parts)
        guessed = [flag for flag, f in (("--sm", self.sm), ("--pcie-gen", self.pcie_gen)) if f.guessed]
        if guessed:
            line += (f"; GUESSED, as the cost model's calibration box (8x RTX 4090): give {' and '.join(guessed)} "
                     "or --describe-box for yours")
        return line


def nvml_facts(nvml: Any | None = None) -> tuple[int | None, int | None, int]:
    """(lowest SM × 10, lowest max PCIe link generation, GPU count) of this machine from NVML
    (``nvmlDeviceGetCudaComputeCapability``, ``nvmlDeviceGetMaxPcieLinkGeneration``: the link the
    GPU and its slot can train to, not the idle-downshifted current one). ``(None, None, 0)``
    without NVML or GPUs; never raises."""
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415
        except ImportError:
            return None, None, 0
    error_type = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except (error_type, OSError):
        return None, None, 0
    sms, gens = [], []
    try:
        count = nvml.nvmlDeviceGetCount()
        for i in range(count):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
            sms.append(int(major) * 10 + int(minor))
            try:
                gens.append(int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)))
            except error_type:
                pass
    except error_type:
        return None, None, 0
    finally:
        try:
            nvml.nvmlShutdown()
        except error_type:
            pass
    return (min(sms) if sms else None), (min(gens) if len(gens) == len(sms) and gens else None), len(sms)


def resolve_box(*, sm: int | None, pcie_gen: int | None, described=None, topology_gpus: int | None = None,
                nvml: Any | None = None, read_nvml: bool = True, described_by: str = "--describe-box") -> BoxFacts:
    """The box facts in the order of the module docstring.

    Parameters
    ----------
    sm, pcie_gen : int or None
        ``--sm`` (compute capability × 10) and ``--pcie-gen`` as given (None: not given).
    described : BoxFingerprint or None
        The described box (:func:`fastverify.topo.box.box_from_description`); ``described_by``
        names where it came from (``--describe-box`` or ``FASTVERIFY_DESCRIBE_BOX``).
    topology_gpus : int or None
        GPUs in the ``nvidia-smi topo -m`` text / NCCL log the command reads, None without one.
    nvml : module or None
        NVML binding (tests pass a stand-in); ``read_nvml=False`` skips NVML altogether.
    """
    n_sm, n_gen, n_count = nvml_facts(nvml) if read_nvml and described is None else (None, None, 0)
    this_box = n_count > 0 and (topology_gpus is None or topology_gpus == n_count)
    d_sm = described.sm[0] * 10 + described.sm[1] if described is not None and described.sm else None

    def pick(given, flag, *found):
        if given is not None:
            return Fact(given, flag)
        for value, source in found:
            if value is not None:
                return Fact(value, source)
        return None

    sm_fact = pick(sm, "--sm", (d_sm, described_by), (n_sm if this_box else None, "nvml")) \
        or Fact(GUESS_SM, "guessed")
    gen_fact = pick(pcie_gen, "--pcie-gen", (n_gen if this_box else None, "nvml")) or Fact(GUESS_PCIE_GEN, "guessed")
    d_count = described.gpu_count if described is not None and described.gpu_count else None
    count = pick(None, "", (d_count, described_by), (topology_gpus, "topology"),
                 (n_count if this_box else None, "nvml")) or Fact(None, "unknown")
    return BoxFacts(sm=sm_fact, pcie_gen=gen_fact, gpu_count=count)


def add_box_arguments(p: argparse.ArgumentParser, bounded) -> None:
    """``--sm``, ``--pcie-gen`` and ``--describe-box``, the same for every command that models a box."""
    p.add_argument("--sm", type=bounded(*SM_RANGE), default=None,
                   help="GPU compute capability x10 (120 = RTX PRO 6000 / SM120, 90 = H100) [default: NVML on this "
                        "box, else --describe-box, else guessed 89 and said so]")
    p.add_argument("--pcie-gen", type=int, choices=(3, 4, 5, 6), default=None,
                   help="PCIe generation of the GPU links [default: NVML on this box, else guessed 4 and said so]")
    p.add_argument("--describe-box", metavar="JSON|FILE", default=None,
                   help=("describe the serving box when working away from it: a JSON object (or a file holding "
                         "one) with gpu_name, sm [major, minor], gpu_count, e.g. "
                         "'{\"gpu_name\": \"NVIDIA RTX PRO 6000 Blackwell Server Edition\", \"sm\": [12, 0], "
                         "\"gpu_count\": 8}'; the same as FASTVERIFY_DESCRIBE_BOX"))


def resolve_args(args, *, topology_gpus: int | None, tp: int = 0) -> BoxFacts:
    """Resolve ``args.sm`` / ``args.pcie_gen`` in place from :func:`resolve_box` (``--describe-box``
    read by :func:`fastverify.topo.box.box_from_description`, else FASTVERIFY_DESCRIBE_BOX) and
    return the facts with their sources. Raises UserError for a bad description."""
    from fastverify.topo.box import ENV_DESCRIBE_BOX, box_from_description, described_box

    by = "--describe-box"
    if getattr(args, "describe_box", None) is not None:
        described = box_from_description(args.describe_box, where=by, tp=tp)
    else:
        described, by = described_box(tp=tp), ENV_DESCRIBE_BOX
    facts = resolve_box(sm=args.sm, pcie_gen=args.pcie_gen, described=described, topology_gpus=topology_gpus,
                        described_by=by)
    args.sm, args.pcie_gen = facts.sm.value, facts.pcie_gen.value
    return facts
