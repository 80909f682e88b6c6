"""The facts about this box that decide which all-reduce backend can run in SGLang here.

* :func:`read_box`: the :class:`~fastverify.deploy.BoxFingerprint` (GPU name, compute capability,
  GPU count, driver, NCCL version) from NVML (``pynvml``: ``nvmlDeviceGetName``,
  ``nvmlDeviceGetCudaComputeCapability``, ``nvmlSystemGetDriverVersion``), falling back to
  ``torch.cuda`` where NVML cannot start. NVML creates no CUDA context, so ``launch`` can ask
  before SGLang starts; torch is imported only for the fallback.
* :func:`box_from_description`: a *described* box (JSON object or a file holding one) for tests
  and for checking a record on a machine other than the target (``launch`` reads it from the
  ``FASTVERIFY_DESCRIBE_BOX`` variable or its hidden ``--describe-box`` flag).
* :func:`read_p2p_results` / :func:`p2p_file_facts`: the results, then the
  :class:`~fastverify.deploy.P2PFacts`, of the real check's output (``fastverify p2p --output
  p2p.json``, or its cache file ``~/.cache/fastverify/p2p-<fingerprint>.json``): the only source
  that *proves* P2P.
* :func:`p2p_from_topology` / :func:`p2p_from_results`: facts from NVML's P2P status (not proof)
  or from :func:`fastverify.topo.p2p.check_p2p` results (proof).
* :func:`resolve_box` / :func:`resolve_args`: the box facts the cost model and the backend gates
  need (:class:`BoxFacts`), each with where it came from.

The box facts (compute capability, PCIe generation, GPU count) come from a flag, ``--describe-box``,
NVML on this machine, the topology text, or a guess. A guess is never silent:
:meth:`BoxFacts.first_line` says it first. Order, per fact: the flag (``--sm``, ``--pcie-gen``),
then the described box, then NVML (only when this machine's GPUs can be the box: no topology text
given, or the same GPU count), then the topology text (GPU count), then the guess. The guess is the
cost model's calibration box, 8× RTX 4090 (SM89, PCIe Gen 4; :mod:`fastverify.nccl.model`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from fastverify.bounds import (
    MAX_GPU_MEMORY_BYTES,
    MAX_WORLD_SIZE,
    implausible_count,
    implausible_name,
)
from fastverify.deploy import BOX_EXAMPLES, BoxFingerprint, P2PFacts
from fastverify.errors import UserError, one_line, schema_error
from fastverify.inputs import loads_json, read_text
from fastverify.nccl.version import read_nccl_version
from fastverify.topo.gpu_identity import nvml_gpus, visible_gpus
from fastverify.topo.nvml import nvml_text
from fastverify.topo.p2p_proof import read_check_file

ENV_DESCRIBE_BOX = "FASTVERIFY_DESCRIBE_BOX"
"""Env var holding a described box (JSON object text, or the path of a file with one)."""


def _nccl_text() -> str | None:
    try:
        v = read_nccl_version()
    except (UserError, OSError):
        return None
    return str(v) if v is not None else None


def _summarise(names: list[str], sms: list[tuple[int, int]]) -> tuple[str | None, tuple[int, int] | None]:
    """One name and one SM for the box. Mixed boxes report the lowest SM (the gate every rank
    must pass) and the name of a GPU with that SM."""
    if not sms:
        return (names[0] if names else None), None
    low = min(sms)
    return names[sms.index(low)] if names else None, low


def _nvlink_full(nvml: Any, handles: list[Any], error_type: type) -> bool | None:
    """SGLang 0.5.23's own test (``custom_all_reduce_utils.py::is_full_nvlink``): every pair's
    ``nvmlDeviceGetP2PStatus(a, b, NVML_P2P_CAPS_INDEX_NVLINK)`` is ``NVML_P2P_STATUS_OK``.
    None when NVML lacks the query or it fails (unknown, not "no")."""
    index = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", None)
    ok = getattr(nvml, "NVML_P2P_STATUS_OK", None)
    if index is None or ok is None or not hasattr(nvml, "nvmlDeviceGetP2PStatus"):
        return None
    try:
        return all(
            nvml.nvmlDeviceGetP2PStatus(a, b, index) == ok for i, a in enumerate(handles) for b in handles[i + 1 :]
        )
    except error_type:
        return None


def read_box(
    tp: int = 0,
    *,
    nvml: Any | None = None,
    torch_fallback: bool = True,
    nccl_version: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> BoxFingerprint:
    """This box's fingerprint.

    Parameters
    ----------
    tp : int
        Tensor-parallel size the fingerprint is for (0: not known yet).
    nvml : module or None
        The NVML binding (tests pass a stand-in); ``None`` imports ``pynvml``.
    torch_fallback : bool
        Ask ``torch.cuda`` when NVML cannot start (it imports torch, ~1 s).
    nccl_version : str or None
        Known NCCL version; default read from the library the box would load.
    environ : mapping or None
        The environment whose ``CUDA_VISIBLE_DEVICES`` picks and orders the GPUs (default
        ``os.environ``): the fingerprint is of the GPUs CUDA shows a process started with it
        (:func:`fastverify.topo.gpu_identity.visible_gpus`; NVML order where that cannot be told).

    Returns
    -------
    BoxFingerprint
        ``gpu_count == 0`` and ``sm is None`` when neither NVML nor torch sees a GPU (never raises
        for that: a box without GPUs is a fact, and the callers refuse what it cannot run).
        ``nvlink_full`` from NVML over the first ``tp`` GPUs CUDA shows (all when ``tp`` is 0);
        None without NVML.
    """
    names: list[str] = []
    nvlink: bool | None = None
    sms: list[tuple[int, int]] = []
    driver: str | None = None
    got = False
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415
        except ImportError:
            nvml = None
    if nvml is not None:
        names, sms, nvlink, driver, got = _nvml_facts(nvml, tp, environ if environ is not None else os.environ)
    if not got and torch_fallback:
        try:
            import torch  # noqa: PLC0415

            if torch.cuda.is_available():
                n = torch.cuda.device_count()
                names = [torch.cuda.get_device_name(i) for i in range(n)]
                sms = [tuple(torch.cuda.get_device_capability(i)) for i in range(n)]  # type: ignore[misc]
                got = n > 0
        except Exception:  # a broken CUDA install reads as "no GPU", never a traceback
            names, sms, got = [], [], False
    name, sm = _summarise(names, sms) if got else (None, None)
    return BoxFingerprint(
        gpu_name=name,
        sm=sm,
        gpu_count=len(names) if got else 0,
        tp=int(tp),
        driver=driver,
        nccl_version=nccl_version if nccl_version is not None else (_nccl_text() if got else None),
        nvlink_full=nvlink if got else None,
    )


def _nvml_facts(
    nvml: Any, tp: int, environ: Mapping[str, str]
) -> tuple[list[str], list, bool | None, str | None, bool]:
    """(names, SMs, nvlink_full, driver, any GPU) from NVML, for the GPUs CUDA shows under
    ``environ`` in CUDA's order (:func:`_cuda_order`)."""
    names: list[str] = []
    nvlink: bool | None = None
    sms: list[tuple[int, int]] = []
    driver: str | None = None
    got = False
    error_type = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except (error_type, OSError):
        pass
    else:
        try:
            count = nvml.nvmlDeviceGetCount()
            order = _cuda_order(nvml, environ)
            handles = []
            for i in order if order is not None else range(count):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                handles.append(h)
                names.append(nvml_text(nvml.nvmlDeviceGetName(h)))
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
                sms.append((int(major), int(minor)))
            nvlink = _nvlink_full(nvml, handles[: tp or None], error_type) if len(handles) > 1 else None
            try:
                driver = nvml_text(nvml.nvmlSystemGetDriverVersion())
            except error_type:
                driver = None
            got = len(handles) > 0
        except error_type:
            names, sms, got, nvlink = [], [], False, None
        finally:
            try:
                nvml.nvmlShutdown()
            except error_type:
                pass
    return names, sms, nvlink, driver, got


def _cuda_order(nvml: Any, environ: Mapping[str, str]) -> list[int] | None:
    """NVML indices of the GPUs CUDA shows under ``environ``, in CUDA's order; None where that
    cannot be told (then NVML's order, all GPUs)."""
    rows, _ = visible_gpus(nvml_gpus(nvml), environ)
    return None if rows is None else [int(r["index"]) for r in rows]


def _names_a_file(text: str) -> bool:
    """Whether ``text`` is the path of something that exists (a name too long or holding a NUL
    names nothing)."""
    try:
        return Path(text).expanduser().exists()
    except (OSError, ValueError):
        return False


def box_from_description(text: str, *, where: str = ENV_DESCRIBE_BOX, tp: int = 0) -> BoxFingerprint:
    """A described box: a JSON object with :class:`BoxFingerprint`'s fields (``sm`` as
    ``[major, minor]``; ``tp`` defaults to ``tp``), or the path of a file holding one.

    Raises
    ------
    UserError
        One line naming ``where``: unreadable file, bad JSON, unknown field or bad value.
    """
    raw = text.strip()
    # JSON text when it looks like JSON or names no file; a path otherwise (so "[]" is a JSON
    # array, not a missing file called "[]").
    is_json = raw[:1] in ("{", "[", '"')
    if not is_json and not _names_a_file(raw):
        try:
            json.loads(raw)
            is_json = True
        except (ValueError, RecursionError):  # not JSON; or an integer over Python's 4300 digits
            pass
    if not is_json:
        raw = read_text(Path(raw).expanduser(), kind="text", flag=where, what="the box description")
    doc = loads_json(raw, where, what="the box description", exact_ints=True)
    if not isinstance(doc, dict):
        raise UserError(
            f"{where}: box description must be a JSON object, got {type(doc).__name__} {raw.strip()[:40]!r}"
        )
    count_given = "gpu_count" in doc
    doc.setdefault("tp", tp)
    doc.setdefault("gpu_name", None)
    doc.setdefault("sm", None)
    doc.setdefault("gpu_count", 0)  # not given: 0, which launch says as "no GPU"
    try:
        box = msgspec.convert(doc, BoxFingerprint)
    except msgspec.ValidationError as err:
        raise schema_error(f"{where}: invalid box description", err, BOX_EXAMPLES) from None
    except ValueError as err:
        raise UserError(f"{where}: invalid box description: {err}") from None
    if (why := implausible_box(box)) is not None:
        raise UserError(f"{where}: invalid box description: {why}")
    if count_given and box.gpu_count < 1:
        raise UserError(f'{where}: invalid box description: field "gpu_count": 0 GPUs; a box has at least 1')
    return box


def implausible_box(box: BoxFingerprint) -> str | None:
    """Why a described box cannot be a real one (:mod:`fastverify.bounds`), or None when it can:
    ``gpu_count``, ``tp``, ``gpus`` and their indices within ``MAX_WORLD_SIZE``; ``sm`` a
    compute capability the cost model takes (``SM_RANGE``, minor 0-9); ``gpu_memory_bytes`` up to
    ``MAX_GPU_MEMORY_BYTES``; each text at most ``MAX_NAME_CHARS`` characters."""
    for name in ("gpu_count", "tp"):
        if why := implausible_count(getattr(box, name), upper=MAX_WORLD_SIZE, what=name):
            return f'field "{name}": {why} (fastverify/bounds.py MAX_WORLD_SIZE)'
    if box.sm is not None:
        major, minor = box.sm
        if not (SM_RANGE[0] <= 10 * major + minor <= SM_RANGE[1] and 0 <= minor <= 9):
            return (
                f'field "sm": {one_line(repr(list(box.sm)), 60)} is no compute capability from '
                f"[{SM_RANGE[0] // 10}, 0] to [{SM_RANGE[1] // 10}, 0] (e.g. [12, 0])"
            )
    mem = box.gpu_memory_bytes
    if mem is not None and mem > MAX_GPU_MEMORY_BYTES:
        return f'field "gpu_memory_bytes": {mem:.3g} bytes is over {MAX_GPU_MEMORY_BYTES:,} (1 TiB)'
    texts = [(n, getattr(box, n)) for n in ("gpu_name", "driver", "nccl_version")]
    if box.gpus is not None:
        if len(box.gpus) > MAX_WORLD_SIZE:
            return f'field "gpus": {len(box.gpus):,} GPUs is over {MAX_WORLD_SIZE} (fastverify/bounds.py)'
        for i, g in enumerate(box.gpus):
            if g.index is not None and g.index > MAX_WORLD_SIZE:
                return f'field "gpus[{i}].index": {g.index:.3g} is over {MAX_WORLD_SIZE}'
            texts += [(f"gpus[{i}].{n}", getattr(g, n)) for n in ("pci_bus_id", "uuid", "name")]
    for name, text in texts:
        if text is not None and (why := implausible_name(text, what=name)):
            return f'field "{name}": {why}'
    return None


def described_box(environ: Mapping[str, str] | None = None, *, tp: int = 0) -> BoxFingerprint | None:
    """The box described in ``FASTVERIFY_DESCRIBE_BOX``, None when unset."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_DESCRIBE_BOX)
    return box_from_description(text, tp=tp) if text else None


def p2p_from_results(results: Mapping[tuple[int, int], Any], *, source: str = "p2p_check") -> P2PFacts:
    """Facts from real-check results (``{(i, j): P2PResult}``): ok when every direction passed;
    not known (``ok`` None) when some timed out and none failed (a timeout is no answer)."""
    if not results:
        return P2PFacts(ok=None, source="not_checked", note="no GPU pair checked")
    bad = [(p, r) for p, r in sorted(results.items()) if not r.ok and not getattr(r, "timed_out", False)]
    late = [(p, r) for p, r in sorted(results.items()) if getattr(r, "timed_out", False)]
    if late and not bad:
        (i, j), r = late[0]
        note = (
            f"{len(late)} of {len(results)} directions timed out (not a failure; rerun the check); first: "
            f"GPU {j} -> memory of GPU {i}: {r.reason}"
        )
        return P2PFacts(ok=None, source=source, note=note[:300], pairs=len(results))  # type: ignore[arg-type]
    if bad:
        (i, j), r = bad[0]
        note = f"{len(bad)} of {len(results)} directions failed; first: GPU {j} -> memory of GPU {i}: {r.reason}"
        return P2PFacts(ok=False, source=source, note=note[:300], pairs=len(results))  # type: ignore[arg-type]
    return P2PFacts(
        ok=True,
        source=source,
        note=f"all {len(results)} directions passed",  # type: ignore[arg-type]
        pairs=len(results),
    )


def read_p2p_results(path: str | Path) -> dict:
    """The per-direction results of the real check's JSON: the document ``fastverify p2p``
    prints (either version), or its cache file; read by
    :func:`fastverify.topo.p2p_proof.read_check_file`, the one reader of that file.

    Returns
    -------
    dict[(int, int), P2PResult]
        ``(src, dst)`` → result: GPU ``dst`` read and wrote the memory of GPU ``src``.

    Raises
    ------
    UserError
        One line naming the file when it cannot be read or is not such a JSON document.
    """
    return dict(read_check_file(path).results)


def p2p_file_facts(path: str | Path, results: Mapping[tuple[int, int], Any]) -> P2PFacts:
    """:class:`P2PFacts` of results read from ``path`` (:func:`read_p2p_results`)."""
    facts = p2p_from_results(results)
    return P2PFacts(ok=facts.ok, source="p2p_check", note=f"{facts.note} ({path})"[:300], pairs=facts.pairs)


def p2p_from_topology(topo: Any | None) -> P2PFacts:
    """NVML's P2P status (``Topology.p2p_read`` / ``p2p_write``): what the driver reports, which
    can say yes where P2P fails or hangs (see :func:`fastverify.topo.p2p.run_side`), so it never proves."""
    if topo is None or not getattr(topo, "p2p_read", None):
        return P2PFacts(ok=None, source="not_checked", note="no P2P status (topology text has none)")
    values = list(topo.p2p_read.values()) + list(topo.p2p_write.values())
    if all(v is None for v in values):
        return P2PFacts(ok=None, source="not_checked", note=f"no P2P status in {topo.source}"[:300])
    if any(v is False for v in values):
        return P2PFacts(ok=False, source="nvml", note="NVML reports P2P not supported for a pair", pairs=len(values))
    if all(v is True for v in values):
        return P2PFacts(
            ok=True,
            source="nvml",
            note="NVML reports P2P read/write OK for every pair (not exercised)",
            pairs=len(values),
        )
    return P2PFacts(ok=None, source="nvml", note="NVML could not tell P2P for some pairs", pairs=len(values))


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
        return {
            name: {"value": f.value, "source": f.source}
            for name, f in (("sm", self.sm), ("pcie_gen", self.pcie_gen), ("gpu_count", self.gpu_count))
        }

    def first_line(self) -> str:
        """``# box: …`` naming each fact and its source; a guessed one is said loud, with the fix."""
        parts = [f"SM {self.sm.value} ({self.sm.source})", f"PCIe Gen {self.pcie_gen.value} ({self.pcie_gen.source})"]
        if self.gpu_count.value is not None:
            parts.append(f"{self.gpu_count.value} GPUs ({self.gpu_count.source})")
        line = "# box: " + ", ".join(parts)
        guessed = [flag for flag, f in (("--sm", self.sm), ("--pcie-gen", self.pcie_gen)) if f.guessed]
        if guessed:
            line += (
                f"; GUESSED, as the cost model's calibration box (8x RTX 4090): give {' and '.join(guessed)} "
                "or --describe-box for yours"
            )
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


def resolve_box(
    *,
    sm: int | None,
    pcie_gen: int | None,
    described=None,
    topology_gpus: int | None = None,
    nvml: Any | None = None,
    read_nvml: bool = True,
    described_by: str = "--describe-box",
) -> BoxFacts:
    """The box facts in the order of the module docstring.

    Parameters
    ----------
    sm, pcie_gen : int or None
        ``--sm`` (compute capability × 10) and ``--pcie-gen`` as given (None: not given).
    described : BoxFingerprint or None
        The described box (:func:`box_from_description`); ``described_by``
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

    sm_fact = pick(sm, "--sm", (d_sm, described_by), (n_sm if this_box else None, "nvml")) or Fact(GUESS_SM, "guessed")
    gen_fact = pick(pcie_gen, "--pcie-gen", (n_gen if this_box else None, "nvml")) or Fact(GUESS_PCIE_GEN, "guessed")
    d_count = described.gpu_count if described is not None and described.gpu_count else None
    count = pick(
        None, "", (d_count, described_by), (topology_gpus, "topology"), (n_count if this_box else None, "nvml")
    ) or Fact(None, "unknown")
    return BoxFacts(sm=sm_fact, pcie_gen=gen_fact, gpu_count=count)


def add_box_arguments(p: argparse.ArgumentParser, bounded) -> None:
    """``--sm``, ``--pcie-gen`` and ``--describe-box``, the same for every command that models a box."""
    p.add_argument(
        "--sm",
        type=bounded(*SM_RANGE),
        default=None,
        help="GPU compute capability x10 (120 = RTX PRO 6000 / SM120, 90 = H100) [default: NVML on this "
        "box, else --describe-box, else guessed 89 and said so]",
    )
    p.add_argument(
        "--pcie-gen",
        type=int,
        choices=(3, 4, 5, 6),
        default=None,
        help="PCIe generation of the GPU links [default: NVML on this box, else guessed 4 and said so]",
    )
    p.add_argument(
        "--describe-box",
        metavar="JSON|FILE",
        default=None,
        help=(
            "describe the serving box when working away from it: a JSON object (or a file holding "
            "one) with gpu_name, sm [major, minor], gpu_count, e.g. "
            '\'{"gpu_name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "sm": [12, 0], '
            '"gpu_count": 8}\'; the same as FASTVERIFY_DESCRIBE_BOX'
        ),
    )


def resolve_args(args, *, topology_gpus: int | None, tp: int = 0, ranks_only: bool = False) -> BoxFacts:
    """Resolve ``args.sm`` / ``args.pcie_gen`` in place from :func:`resolve_box` (``--describe-box``
    read by :func:`box_from_description`, else FASTVERIFY_DESCRIBE_BOX) and
    return the facts with their sources. ``topology_gpus`` counts every GPU of the box the
    command models (``nvidia-smi topo -m`` text), or with ``ranks_only`` the ranks of an NCCL log
    (a box may have more GPUs than one run used).

    Raises
    ------
    UserError
        A bad description, or one whose ``gpu_count`` disagrees with ``topology_gpus`` (the
        description and the topology are of two boxes).
    """
    by = "--describe-box"
    if getattr(args, "describe_box", None) is not None:
        described = box_from_description(args.describe_box, where=by, tp=tp)
    else:
        described, by = described_box(tp=tp), ENV_DESCRIBE_BOX
    n = described.gpu_count if described is not None else 0
    if n and topology_gpus and (n < topology_gpus if ranks_only else n != topology_gpus):
        what = f"an NCCL log of {topology_gpus} ranks" if ranks_only else f"a topology of {topology_gpus} GPUs"
        raise UserError(
            f"{by}: gpu_count {n} disagrees with {what}: the description and the topology are of two "
            f"boxes; describe the box the topology is of, or give that box's topology"
        )
    facts = resolve_box(
        sm=args.sm, pcie_gen=args.pcie_gen, described=described, topology_gpus=topology_gpus, described_by=by
    )
    args.sm, args.pcie_gen = facts.sm.value, facts.pcie_gen.value
    return facts
