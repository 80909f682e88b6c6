"""GPU topology records and the parser for ``nvidia-smi topo -m`` text.

A :class:`Topology` holds one box's GPUs, the connection of every ordered GPU pair in nvidia-smi's
names (``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``, ``NV<n>``), the NICs and their connection to
each GPU, and NVML's P2P read/write status per pair (``None`` when unknown, as offline). It comes
from :func:`parse_nvidia_smi_topo` (text) or :func:`fastverify.topo.nvml.read_nvml_topology`.
:func:`nccl_path_type` maps nvidia-smi's names onto NCCL's path types and :func:`p2p_allowed`
applies NCCL's ``NCCL_P2P_LEVEL`` rule (NCCL ``src/include/graph.h``: the order;
``src/graph/topo.cc``: the names; ``src/graph/paths.cc`` ``ncclTopoSetPaths`` /
``ncclTopoCheckP2p``: the rules). The text parsed (tabs or spaces between cells)::

            GPU0    GPU1    NIC0    CPU Affinity    NUMA Affinity   GPU NUMA ID
    GPU0     X      PIX     PIX     0-35,72-107     0               N/A
    GPU1    PIX      X      PIX     0-35,72-107     0               N/A
    NIC0    PIX     PIX      X
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

from fastverify.errors import UserError, path_text, printable

# nvidia-smi connection names, closest first (the order of its legend, reversed).
SMI_LINK_ORDER: tuple[str, ...] = ("NV#", "PIX", "PXB", "PHB", "NODE", "SYS")

# NCCL path types in NCCL's order (src/include/graph.h, HEAD: LOC 0 ... SYS 9; NET and DIS follow).
# Older NCCL releases number them differently (2.21 has no C2C/P2C), so code compares names,
# never NCCL's integers.
NCCL_PATH_ORDER: tuple[str, ...] = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS")
_NCCL_RANK = {name: rank for rank, name in enumerate(NCCL_PATH_ORDER)}

# NCCL's default P2P level on a PCIe box (ncclTopoCheckP2p: PATH_PXB unless NCCL_P2P_LEVEL says
# otherwise; AMD CPUs with <= 2 GPUs get SYS, which this module does not try to detect).
DEFAULT_P2P_LEVEL = "PXB"

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_GPU_LABEL = re.compile(r"GPU([0-9]{1,6})", re.ASCII)
_NIC_LABEL = re.compile(r"NIC([0-9]{1,6})", re.ASCII)
_NV_LINK = re.compile(r"NV([1-9][0-9]{0,3})", re.ASCII)
_QUERY_GPU = re.compile(r"\bGPU ([0-9]+)", re.ASCII)  # the GPUs an ``unsupported`` entry names
_SMALL_INT = re.compile(r"[0-9]{1,6}", re.ASCII)
_NIC_LEGEND = re.compile(r"(NIC[0-9]{1,6})\s*:\s*(\S+)", re.ASCII)
_PLAIN_LINKS = frozenset({"PIX", "PXB", "PHB", "NODE", "SYS"})
# nvidia-smi before ~2017 printed SOC for what is now SYS (legend: "the SMP link between CPU sockets").
_OLD_NAMES = {"SOC": "SYS"}
# Attribute columns after the device columns; their headers are several words long.
_ATTRIBUTE_HEADERS: tuple[tuple[str, ...], ...] = (("CPU", "Affinity"), ("NUMA", "Affinity"), ("GPU", "NUMA", "ID"))
_MAX_SHOWN = 40


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi / NVML index it. Fields the source does not give are ``None``.

    ``numa_node`` is the CPU NUMA node the GPU hangs off (nvidia-smi "NUMA Affinity", sysfs
    ``numa_node``); ``gpu_numa_id`` is the NUMA node *of the GPU's own memory* on platforms where
    GPUs are NUMA nodes (nvidia-smi "GPU NUMA ID", ``nvmlDeviceGetNumaNodeId``; N/A on PCIe boxes).
    ``cpu_affinity`` is nvidia-smi's CPU list text, e.g. ``"0-35,72-107"``. PCIe fields are the link
    generation and lane count now (``pcie_gen``/``pcie_width``, which drop when the GPU idles) and
    the most the link can do (``pcie_max_gen``/``pcie_max_width``).
    """

    index: int
    name: str | None = None
    pci_bus_id: str | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None
    gpu_numa_id: int | None = None


@dataclass(frozen=True)
class Nic:
    """A NIC column of ``nvidia-smi topo -m``: ``label`` as in the matrix (``NIC0``, or ``mlx5_0`` in
    old nvidia-smi), ``name`` from the ``NIC Legend`` (``mlx5_0``; ``None`` when absent) and the
    connection to each GPU by GPU index."""

    label: str
    name: str | None
    gpu_links: dict[int, str]


@dataclass(frozen=True)
class Topology:
    """GPU topology of one box.

    ``links[(i, j)]`` is nvidia-smi's connection name for every ordered pair of GPU indices
    ``i != j`` (symmetric). ``p2p_read``/``p2p_write`` are NVML's P2P status per ordered pair:
    ``True``/``False``, or ``None`` when unknown (always for text parsed offline);
    ``p2p_reason[(i, j)]`` says why NVML refused, for pairs it refused. ``source`` names where the
    data came from (a file name, or ``NVML (driver ...)``).

    ``link_errors[(i, j)]`` names the NVML error (``NVML_ERROR_NOT_SUPPORTED``) for a pair whose
    connection NVML would not report; such a pair is absent from ``links`` and :meth:`link`
    returns None for it. ``unsupported`` lists every NVML query that failed, one
    ``"function(GPU i[, GPU j]): NVML_ERROR_..."`` string each (empty for offline text).
    """

    gpus: tuple[Gpu, ...]
    links: dict[tuple[int, int], str]
    nics: tuple[Nic, ...] = ()
    p2p_read: dict[tuple[int, int], bool | None] = field(default_factory=dict)
    p2p_write: dict[tuple[int, int], bool | None] = field(default_factory=dict)
    source: str = "<unknown>"
    p2p_reason: dict[tuple[int, int], str] = field(default_factory=dict)
    link_errors: dict[tuple[int, int], str] = field(default_factory=dict)
    unsupported: tuple[str, ...] = ()

    @property
    def gpu_indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    def link(self, i: int, j: int) -> str | None:
        """nvidia-smi connection name between GPUs ``i`` and ``j`` (``"X"`` when ``i == j``; None
        for a pair in ``link_errors``, whose connection NVML did not report)."""
        if i == j:
            return "X"
        if (i, j) in self.link_errors:
            return None
        return self.links[(i, j)]

    def first_gpus(self, n: int) -> Topology:
        """The topology of the ``n`` lowest-indexed GPUs: the GPUs a TP group of ``n`` ranks uses.

        SGLang puts TP rank ``r`` on CUDA device ``--base-gpu-id + r * --gpu-id-step`` (defaults
        0 and 1; SGLang 0.5.23 ``srt/entrypoints/engine.py``), so ``--tp n`` runs on devices
        0..n-1, which are nvidia-smi's GPUs 0..n-1 when ``CUDA_VISIBLE_DEVICES`` is unset and CUDA
        orders devices as nvidia-smi does (``CUDA_DEVICE_ORDER=PCI_BUS_ID``; CUDA's default,
        ``FASTEST_FIRST``, makes its guess of the fastest device 0 and leaves the order of the rest
        unspecified: the CUDA programming guide's environment variables).

        Every per-GPU part is restricted to those GPUs: the GPUs, the pairs in ``links``,
        ``p2p_read``/``p2p_write``/``p2p_reason`` and ``link_errors``, each NIC's ``gpu_links``,
        and the ``unsupported`` queries that name another GPU. ``source`` is kept. Returns
        ``self`` when ``n`` is the GPU count.

        Raises ``ValueError`` when ``n`` is below 1 or above the GPU count (callers refuse a too
        large ``--tp`` first, in the user's words).
        """
        indices = sorted(self.gpu_indices)
        if not 1 <= n <= len(indices):
            raise ValueError(f"first_gpus({n}): {self.source} has {len(indices)} GPU(s)")
        if n == len(indices):
            return self
        keep = frozenset(indices[:n])

        def sub(d: dict) -> dict:
            return {pair: v for pair, v in d.items() if pair[0] in keep and pair[1] in keep}

        return replace(
            self,
            gpus=tuple(g for g in self.gpus if g.index in keep),
            links=sub(self.links),
            nics=tuple(
                replace(nic, gpu_links={g: link for g, link in nic.gpu_links.items() if g in keep}) for nic in self.nics
            ),
            p2p_read=sub(self.p2p_read),
            p2p_write=sub(self.p2p_write),
            p2p_reason=sub(self.p2p_reason),
            link_errors=sub(self.link_errors),
            unsupported=tuple(u for u in self.unsupported if {int(g) for g in _QUERY_GPU.findall(u)} <= keep),
        )

    def pairs_by_type(self, *, nccl: bool = False) -> dict[str, tuple[tuple[int, int], ...]]:
        """Unordered GPU pairs ``(i, j)``, ``i < j``, grouped by connection name, closest type first.

        With ``nccl=True`` the keys are NCCL path types (:func:`nccl_path_type`), so nvidia-smi's
        NODE pairs land under PHB and all NV<n> pairs under NVL.
        """
        groups: dict[str, list[tuple[int, int]]] = {}
        for (i, j), link in self.links.items():
            if i < j:
                groups.setdefault(nccl_path_type(link) if nccl else link, []).append((i, j))
        order = _nccl_rank if nccl else _smi_rank
        return {key: tuple(sorted(groups[key])) for key in sorted(groups, key=lambda k: (order(k), k))}

    def as_dict(self) -> dict:
        """JSON-ready form: pairs written ``"i-j"``."""

        def pairs(d: dict) -> dict:
            return {f"{i}-{j}": v for (i, j), v in sorted(d.items())}

        return {
            "source": self.source,
            "gpus": [asdict(g) for g in self.gpus],
            "links": pairs(self.links),
            "nics": [
                {"label": n.label, "name": n.name, "gpu_links": {str(k): v for k, v in sorted(n.gpu_links.items())}}
                for n in self.nics
            ],
            "p2p_read": pairs(self.p2p_read),
            "p2p_write": pairs(self.p2p_write),
            "p2p_reason": pairs(self.p2p_reason),
            "link_errors": pairs(self.link_errors),
            "unsupported": list(self.unsupported),
        }


def _smi_rank(link: str) -> int:
    return SMI_LINK_ORDER.index("NV#" if _NV_LINK.fullmatch(link) else link) if link != "X" else -1


def _nccl_rank(path: str) -> int:
    return _NCCL_RANK[path]


def nccl_path_type(link: str) -> str:
    """NCCL's path type for an nvidia-smi connection name.

    NCCL classifies paths itself (``ncclTopoSetPaths`` in ``src/graph/paths.cc``): a PCI-PCI hop is
    PXB, any PCI link that touches a CPU node is PHB, a CPU-CPU link is SYS. nvidia-smi's NODE
    (different host bridges in one NUMA node) therefore is NCCL's PHB; PIX, PXB, PHB and SYS have
    the same meaning in both; ``NV<n>`` is NVL (names in ``src/graph/topo.cc``); ``X`` is LOC.

    Raises ``ValueError`` for a name that is none of these.
    """
    if link == "X":
        return "LOC"
    if link == "NODE":
        return "PHB"
    if link in _PLAIN_LINKS:
        return link
    if _NV_LINK.fullmatch(link):
        return "NVL"
    raise ValueError(f"unknown nvidia-smi connection {link!r}; expected X, PIX, PXB, PHB, NODE, SYS or NV<n>")


def p2p_allowed(link: str, level: str = DEFAULT_P2P_LEVEL) -> bool:
    """Whether NCCL's path rule lets a pair with nvidia-smi connection ``link`` use P2P at ``level``.

    True when the pair's NCCL path type is at most ``level`` in NCCL's order
    LOC < NVL < NVB < C2C < PIX < PXB < P2C < PXN < PHB < SYS (default level PXB, as NCCL on a
    PCIe box without ``NCCL_P2P_LEVEL``). This is only the path rule of ``ncclTopoCheckP2p``: NCCL
    also needs NVML's P2P read/write status and ``cudaDeviceCanAccessPeer`` to agree.

    ``level`` is an NCCL path name, upper case (NCCL ignores other spellings). Raises
    ``ValueError`` for an unknown ``link`` or ``level``.
    """
    if level not in _NCCL_RANK:
        raise ValueError(f"unknown NCCL P2P level {level!r}; expected one of {', '.join(NCCL_PATH_ORDER)}")
    return _NCCL_RANK[nccl_path_type(link)] <= _NCCL_RANK[level]


# --- parser -----------------------------------------------------------------------------------


def _shown(value: str) -> str:
    """``value`` quoted for a one-line message (escapes control characters, cuts long text)."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 4] + "...'"


def _fail(source: str, message: str, line_no: int | None = None) -> UserError:
    name = "".join(ch if ch.isprintable() else "?" for ch in source)
    where = name + (f": line {line_no}" if line_no is not None else "")
    return UserError(f"{where}: {message}")


def _normalise_link(cell: str) -> str | None:
    """nvidia-smi connection name of a matrix cell, or ``None`` when it is not one."""
    cell = _OLD_NAMES.get(cell, cell)
    if cell == "X" or cell in _PLAIN_LINKS or _NV_LINK.fullmatch(cell):
        return cell
    return None


def _split_header(tokens: list[str]) -> tuple[list[str], list[str]] | None:
    """Device column labels and attribute column names of a header row, or ``None`` if it is not one."""
    devices: list[str] = []
    k = 0
    while k < len(tokens) and not any(tuple(tokens[k : k + len(h)]) == h for h in _ATTRIBUTE_HEADERS):
        devices.append(tokens[k])
        k += 1
    attributes: list[str] = []
    while k < len(tokens):
        for h in _ATTRIBUTE_HEADERS:
            if tuple(tokens[k : k + len(h)]) == h:
                attributes.append(" ".join(h))
                k += len(h)
                break
        else:
            return None
    return devices, attributes


def _is_header(tokens: list[str]) -> bool:
    # The header starts with GPU0; a matrix row starting with GPU0 has X as its second cell.
    return bool(tokens) and tokens[0] == "GPU0" and (len(tokens) == 1 or tokens[1] != "X")


def _optional_int(cell: str) -> int | None:
    return int(cell) if _SMALL_INT.fullmatch(cell) else None


@dataclass(frozen=True)
class _Header:
    """The header row: device column labels, attribute column names, each label's column, the
    GPU number of each ``GPU<n>`` label, and the row's index in the lines."""

    devices: list[str]
    attributes: list[str]
    column_of: dict[str, int]
    gpu_of_label: dict[str, int]
    at: int


def parse_nvidia_smi_topo(text: str, *, source: str = "<text>") -> Topology:
    """Parse the output of ``nvidia-smi topo -m``.

    Accepts cells separated by tabs or spaces, with or without NIC columns, ANSI escape codes
    (nvidia-smi underlines the header), the multi-word ``CPU Affinity``, ``NUMA Affinity`` and
    ``GPU NUMA ID`` columns, ``N/A`` values, CRLF line ends, ``#`` comment lines anywhere, lines
    before the header (a shell prompt), and the ``Legend:`` / ``NIC Legend:`` blocks after the
    matrix. ``SOC`` (old nvidia-smi) is read as ``SYS``.

    Parameters
    ----------
    text
        The whole output.
    source
        Name used in error messages and stored in ``Topology.source`` (a file name; control
        characters and the bytes of a non-UTF-8 name escaped).

    Returns
    -------
    Topology
        P2P read/write status is ``None`` (unknown) for every pair; names, bus ids and PCIe fields
        are ``None``; ``numa_node`` and ``cpu_affinity`` come from the attribute columns.

    Raises
    ------
    UserError
        One line naming ``source`` and the line/row/column: no header row starting with ``GPU0``,
        an unknown column header, a row with a missing or extra cell, an unknown connection code,
        a non-square matrix (missing or unknown row), a missing ``X`` diagonal, or asymmetric
        entries.
    """
    source = printable(path_text(source))  # printed by every command and stored in records
    if not isinstance(text, str):
        raise _fail(source, f"expected text, got {type(text).__name__}")
    lines = [_ANSI.sub("", line).replace("\x1b", "") for line in text.splitlines()]
    head = _read_header(lines, source)
    cells, attrs, row_line, end = _read_rows(lines, head, source)
    _check_square(cells, head, row_line, source)
    nic_names: dict[str, str] = {}
    for line in lines[end:]:
        m = _NIC_LEGEND.fullmatch(line.strip())
        if m:
            nic_names[m.group(1)] = m.group(2)
    return _topology(head, cells, attrs, nic_names, source)


def _read_header(lines: list[str], source: str) -> _Header:
    """The first row starting with ``GPU0`` that is not a matrix row, split into its columns."""
    header_at = None
    for n, line in enumerate(lines):
        tokens = line.split()
        if tokens and not tokens[0].startswith("#") and _is_header(tokens):
            header_at = n
            break
    if header_at is None:
        raise _fail(source, "no header row starting with GPU0: not the output of `nvidia-smi topo -m`")
    split = _split_header(lines[header_at].split())
    if split is None:
        raise _fail(
            source,
            "unknown column in the header row: expected device labels, then CPU Affinity, NUMA Affinity, GPU NUMA ID",
            header_at + 1,
        )
    devices, attributes = split
    column_of: dict[str, int] = {}
    for c, label in enumerate(devices):
        if label in column_of:
            raise _fail(source, f"column {_shown(label)} appears twice in the header", header_at + 1)
        column_of[label] = c
    gpu_of_label = {label: int(m.group(1)) for label in devices if (m := _GPU_LABEL.fullmatch(label))}
    if len(set(gpu_of_label.values())) != len(gpu_of_label):
        raise _fail(source, "two GPU columns have the same number", header_at + 1)
    return _Header(devices, attributes, column_of, gpu_of_label, header_at)


def _read_rows(
    lines: list[str], head: _Header, source: str
) -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, int], int]:
    """Matrix rows, up to the first blank line or the legend: each row's connections and attribute
    cells, its 1-based line number, and the index of the line after the matrix."""
    devices, attributes = head.devices, head.attributes
    cells: dict[str, list[str]] = {}
    attrs: dict[str, list[str]] = {}
    row_line: dict[str, int] = {}
    n = head.at + 1
    while n < len(lines):
        tokens = lines[n].split()
        if not tokens:
            if cells:
                break
            n += 1
            continue
        if tokens[0].startswith("#"):
            n += 1
            continue
        if tokens[0].startswith("Legend"):
            break
        label = tokens[0]
        if label not in head.column_of:
            raise _fail(source, f"row {_shown(label)} is not one of the header's columns", n + 1)
        if label in cells:
            raise _fail(source, f"row {_shown(label)} appears twice", n + 1)
        values = tokens[1:]
        wanted = len(devices) + (len(attributes) if label in head.gpu_of_label else 0)
        if len(values) < wanted:
            where = f" (no cell from column {devices[len(values)]} on)" if len(values) < len(devices) else ""
            raise _fail(
                source, f"row {label} has {len(values)} cells, expected {wanted}: a cell is missing{where}", n + 1
            )
        if len(values) > len(devices) + len(attributes):
            raise _fail(
                source,
                f"row {label} has {len(values)} cells, expected {wanted}: extra cell "
                f"{_shown(values[len(devices) + len(attributes)])}",
                n + 1,
            )
        cells[label] = [
            _row_link(source, label, devices[c], cell, n + 1) for c, cell in enumerate(values[: len(devices)])
        ]
        attrs[label] = values[len(devices) :]
        row_line[label] = n + 1
        n += 1
    return cells, attrs, row_line, n


def _row_link(source: str, label: str, column: str, cell: str, line_no: int) -> str:
    """The connection name of one matrix cell; UserError for a code that is none."""
    link = _normalise_link(cell)
    if link is None:
        raise _fail(
            source,
            f"row {label}, column {column}: unknown connection {_shown(cell)} "
            "(expected X, PIX, PXB, PHB, NODE, SYS or NV<n>)",
            line_no,
        )
    return link


def _check_square(cells: dict[str, list[str]], head: _Header, row_line: dict[str, int], source: str) -> None:
    """Every column has its row, X exactly on the diagonal, and the matrix is symmetric."""
    for label in head.devices:
        if label not in cells:
            raise _fail(source, f"matrix is not square: no row for column {label}")
    for label, links in cells.items():
        for c, link in enumerate(links):
            other = head.devices[c]
            if (link == "X") != (other == label):
                what = "diagonal must be X" if other == label else "X off the diagonal"
                raise _fail(source, f"row {label}, column {other}: {what}", row_line[label])
            if cells[other][head.column_of[label]] != link:
                raise _fail(
                    source,
                    f"asymmetric entries: row {label}, column {other} is {link} but row "
                    f"{other}, column {label} is {cells[other][head.column_of[label]]}",
                    row_line[label],
                )


def _topology(
    head: _Header, cells: dict[str, list[str]], attrs: dict[str, list[str]], nic_names: dict[str, str], source: str
) -> Topology:
    """The checked matrix as a :class:`Topology`: GPUs with their attribute columns, GPU pairs, NICs."""
    gpu_of_label, column_of = head.gpu_of_label, head.column_of
    gpus: list[Gpu] = []
    for label, index in sorted(gpu_of_label.items(), key=lambda kv: kv[1]):
        row_attrs = dict(zip(head.attributes, attrs[label]))
        affinity = row_attrs.get("CPU Affinity")
        gpus.append(
            Gpu(
                index=index,
                numa_node=_optional_int(row_attrs.get("NUMA Affinity", "")),
                cpu_affinity=None if affinity in (None, "N/A") else affinity,
                gpu_numa_id=_optional_int(row_attrs.get("GPU NUMA ID", "")),
            )
        )
    pair_links = {
        (gpu_of_label[a], gpu_of_label[b]): cells[a][column_of[b]] for a in gpu_of_label for b in gpu_of_label if a != b
    }
    nics = tuple(
        Nic(
            label=label,
            name=nic_names.get(label, None if _NIC_LABEL.fullmatch(label) else label),
            gpu_links={gpu_of_label[g]: cells[label][column_of[g]] for g in gpu_of_label},
        )
        for label in head.devices
        if label not in gpu_of_label
    )
    unknown = {pair: None for pair in pair_links}
    return Topology(
        gpus=tuple(gpus), links=pair_links, nics=nics, p2p_read=dict(unknown), p2p_write=dict(unknown), source=source
    )
