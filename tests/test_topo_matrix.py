"""`nvidia-smi topo -m` parsing and NCCL path rules.

Expected values are read off ../shared/inputs/topo-*.txt by eye and written here as literal
tables; nothing is computed with the parser's own helpers.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fastverify.errors import UserError
from fastverify.topo.matrix import Gpu, Topology, nccl_path_type, p2p_allowed, parse_nvidia_smi_topo

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

# --- topo-nccl-tests-307.txt (tab-separated, one NIC, empty cell before GPU NUMA ID) -----------
NCCL_307_MATRIX = """\
X   PIX PIX PIX SYS SYS SYS SYS
PIX X   PIX PIX SYS SYS SYS SYS
PIX PIX X   PIX SYS SYS SYS SYS
PIX PIX PIX X   SYS SYS SYS SYS
SYS SYS SYS SYS X   PIX PIX PIX
SYS SYS SYS SYS PIX X   PIX PIX
SYS SYS SYS SYS PIX PIX X   PIX
SYS SYS SYS SYS PIX PIX PIX X"""
NCCL_307_CPUS = ["0-35,72-107"] * 4 + ["36-71,108-143"] * 4
NCCL_307_NUMA = [0, 0, 0, 0, 1, 1, 1, 1]
NCCL_307_NIC0 = ["PIX", "PIX", "PIX", "PIX", "SYS", "SYS", "SYS", "SYS"]

# --- topo-blog-chlc-rtx4090.txt (space-aligned, four NICs, one GPU per NUMA node) --------------
CHLC_CPUS = [
    "24-31,88-95",
    "16-23,80-87",
    "8-15,72-79",
    "0-7,64-71",
    "56-63,120-127",
    "48-55,112-119",
    "40-47,104-111",
    "32-39,96-103",
]
CHLC_NUMA = [3, 2, 1, 0, 7, 6, 5, 4]
CHLC_NIC_NAMES = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
CHLC_NIC_LINKS = ["SYS", "SYS", "SYS", "SYS", "SYS", "SYS", "PHB", "SYS"]  # same for NIC0..NIC3


def table(text: str) -> dict[tuple[int, int], str]:
    rows = [line.split() for line in text.splitlines()]
    return {(i, j): rows[i][j] for i in range(len(rows)) for j in range(len(rows)) if i != j}


@pytest.fixture(scope="module")
def nccl_307_text(shared_dir) -> str:
    return (shared_dir / "inputs" / "topo-nccl-tests-307.txt").read_text()


@pytest.fixture(scope="module")
def chlc_text(shared_dir) -> str:
    return (shared_dir / "inputs" / "topo-blog-chlc-rtx4090.txt").read_text()


def check_307(topo: Topology, nic_name: str | None = "mlx5_bond_0") -> None:
    assert topo.gpu_indices == tuple(range(8))
    assert topo.links == table(NCCL_307_MATRIX)
    assert [g.cpu_affinity for g in topo.gpus] == NCCL_307_CPUS
    assert [g.numa_node for g in topo.gpus] == NCCL_307_NUMA
    assert [g.gpu_numa_id for g in topo.gpus] == [None] * 8
    assert [(g.name, g.pci_bus_id, g.pcie_gen, g.pcie_width) for g in topo.gpus] == [(None, None, None, None)] * 8
    assert [(n.label, n.name) for n in topo.nics] == [("NIC0", nic_name)]
    assert [topo.nics[0].gpu_links[g] for g in range(8)] == NCCL_307_NIC0
    assert set(topo.p2p_read) == set(topo.links) and set(topo.p2p_read.values()) == {None}
    assert set(topo.p2p_write) == set(topo.links) and set(topo.p2p_write.values()) == {None}


def test_nccl_tests_307(nccl_307_text):
    topo = parse_nvidia_smi_topo(nccl_307_text, source="topo-nccl-tests-307.txt")
    check_307(topo)
    assert topo.source == "topo-nccl-tests-307.txt"
    assert topo.pairs_by_type() == {
        "PIX": ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (4, 5), (4, 6), (4, 7), (5, 6), (5, 7), (6, 7)),
        "SYS": (
            (0, 4),
            (0, 5),
            (0, 6),
            (0, 7),
            (1, 4),
            (1, 5),
            (1, 6),
            (1, 7),
            (2, 4),
            (2, 5),
            (2, 6),
            (2, 7),
            (3, 4),
            (3, 5),
            (3, 6),
            (3, 7),
        ),
    }
    # NCCL default level PXB: the same-switch pairs may use P2P, the cross-socket ones may not.
    assert p2p_allowed(topo.link(0, 3)) and p2p_allowed(topo.link(5, 7))
    assert not p2p_allowed(topo.link(0, 4)) and not p2p_allowed(topo.link(3, 7))
    assert p2p_allowed(topo.link(0, 4), "SYS")


def test_chlc_rtx4090(chlc_text):
    topo = parse_nvidia_smi_topo(chlc_text, source="chlc")
    assert topo.gpu_indices == tuple(range(8))
    assert set(topo.links.values()) == {"SYS"} and len(topo.links) == 56
    assert [g.numa_node for g in topo.gpus] == CHLC_NUMA
    assert [g.cpu_affinity for g in topo.gpus] == CHLC_CPUS
    assert [g.gpu_numa_id for g in topo.gpus] == [None] * 8
    assert [(n.label, n.name) for n in topo.nics] == list(zip(["NIC0", "NIC1", "NIC2", "NIC3"], CHLC_NIC_NAMES))
    for nic in topo.nics:
        assert [nic.gpu_links[g] for g in range(8)] == CHLC_NIC_LINKS
    assert list(topo.pairs_by_type()) == ["SYS"] and len(topo.pairs_by_type()["SYS"]) == 28
    assert list(topo.pairs_by_type(nccl=True)) == ["SYS"]
    assert not any(p2p_allowed(link) for link in topo.links.values())
    assert all(p2p_allowed(link, "SYS") for link in topo.links.values())


def test_as_dict_is_json_ready(nccl_307_text):
    import json

    doc = parse_nvidia_smi_topo(nccl_307_text).as_dict()
    assert json.loads(json.dumps(doc))["links"]["0-4"] == "SYS"
    assert doc["nics"][0]["gpu_links"]["3"] == "PIX"
    assert doc["gpus"][4]["numa_node"] == 1


# --- format variants of the same matrix --------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    ["crlf", "spaces", "ansi", "trailing", "no_comment", "prompt", "no_legend", "comment_inside", "leading_blank"],
)
def test_variants_of_307(nccl_307_text, variant):
    text = nccl_307_text
    if variant == "crlf":
        text = text.replace("\n", "\r\n")
    elif variant == "spaces":
        text = text.replace("\t", "    ")
    elif variant == "ansi":  # nvidia-smi underlines/bolds the header row
        lines = text.split("\n")
        lines[1] = "\x1b[4m\x1b[1m" + lines[1] + "\x1b[0m"
        text = "\n".join(lines)
    elif variant == "trailing":
        text = "\n".join(line + " \t " for line in text.split("\n"))
    elif variant == "no_comment":
        text = text.split("\n", 1)[1]
    elif variant == "prompt":
        text = "$ nvidia-smi topo -m\n" + text
    elif variant == "no_legend":
        text = text[: text.index("Legend:")]
    elif variant == "comment_inside":
        lines = text.split("\n")
        lines.insert(5, "# a note in the middle")
        text = "\n".join(lines)
    elif variant == "leading_blank":
        text = "\n\n   \n" + text
    check_307(parse_nvidia_smi_topo(text), nic_name=None if variant == "no_legend" else "mlx5_bond_0")


NVLINK_BOX = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tNODE\tSYS\t0-63\t0
GPU1\tNV12\t X \tPXB\tSYS\t0-63\t0
GPU2\tNODE\tPXB\t X \tPHB\t0-63\t0
GPU3\tSYS\tSYS\tPHB\t X \tN/A\tN/A
"""


def test_nvlink_and_node_without_nics():
    topo = parse_nvidia_smi_topo(NVLINK_BOX)
    assert topo.nics == ()
    assert topo.links == table("""\
X    NV12 NODE SYS
NV12 X    PXB  SYS
NODE PXB  X    PHB
SYS  SYS  PHB  X""")
    assert [g.numa_node for g in topo.gpus] == [0, 0, 0, None]
    assert [g.cpu_affinity for g in topo.gpus] == ["0-63", "0-63", "0-63", None]
    assert topo.pairs_by_type() == {
        "NV12": ((0, 1),),
        "PXB": ((1, 2),),
        "PHB": ((2, 3),),
        "NODE": ((0, 2),),
        "SYS": ((0, 3), (1, 3)),
    }
    # nvidia-smi NODE is NCCL PHB; NV12 is NVL.
    assert topo.pairs_by_type(nccl=True) == {
        "NVL": ((0, 1),),
        "PXB": ((1, 2),),
        "PHB": ((0, 2), (2, 3)),
        "SYS": ((0, 3), (1, 3)),
    }


def test_single_gpu_and_gpu_numa_id():
    topo = parse_nvidia_smi_topo(
        "        GPU0    CPU Affinity    NUMA Affinity   GPU NUMA ID\nGPU0     X      0-71    0               2\n"
    )
    assert topo.gpus == (Gpu(index=0, numa_node=0, cpu_affinity="0-71", gpu_numa_id=2),)
    assert topo.links == {} and topo.pairs_by_type() == {}


def test_old_style_nic_label_and_soc():
    text = (
        "\tGPU0\tGPU1\tmlx5_0\tCPU Affinity\n"
        "GPU0\t X \tSOC\tPHB\t0-11\n"
        "GPU1\tSOC\t X \tSOC\t12-23\n"
        "mlx5_0\tPHB\tSOC\t X \n"
    )
    topo = parse_nvidia_smi_topo(text)
    assert topo.links == {(0, 1): "SYS", (1, 0): "SYS"}
    assert [(n.label, n.name, n.gpu_links) for n in topo.nics] == [("mlx5_0", "mlx5_0", {0: "PHB", 1: "SYS"})]


# --- NCCL path rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "link,path",
    [
        ("X", "LOC"),
        ("NV1", "NVL"),
        ("NV18", "NVL"),
        ("PIX", "PIX"),
        ("PXB", "PXB"),
        ("PHB", "PHB"),
        ("NODE", "PHB"),
        ("SYS", "SYS"),
    ],
)
def test_nccl_path_type(link, path):
    assert nccl_path_type(link) == path


@pytest.mark.parametrize("link", ["", "NV", "NV0", "pix", "SOC", "NET", "PXN"])
def test_nccl_path_type_rejects(link):
    with pytest.raises(ValueError):
        nccl_path_type(link)


# (link, level) -> allowed; NCCL order LOC < NVL < NVB < C2C < PIX < PXB < P2C < PXN < PHB < SYS
P2P_TABLE = [
    ("PIX", "PXB", True),
    ("PXB", "PXB", True),
    ("PHB", "PXB", False),
    ("NODE", "PXB", False),
    ("SYS", "PXB", False),
    ("NV4", "PXB", True),
    ("PIX", "PIX", True),
    ("PXB", "PIX", False),
    ("NV2", "LOC", False),
    ("NV2", "NVL", True),
    ("PIX", "NVL", False),
    ("PIX", "C2C", False),
    ("PXB", "P2C", True),
    ("PHB", "PXN", False),
    ("NODE", "PHB", True),
    ("PHB", "PHB", True),
    ("SYS", "PHB", False),
    ("SYS", "SYS", True),
    ("NODE", "SYS", True),
]


@pytest.mark.parametrize("link,level,allowed", P2P_TABLE)
def test_p2p_allowed(link, level, allowed):
    assert p2p_allowed(link, level) is allowed


@pytest.mark.parametrize("level", ["pxb", "sys", "NET", "", "5"])
def test_p2p_allowed_rejects_level(level):
    with pytest.raises(ValueError, match="level"):
        p2p_allowed("PIX", level)


# --- malformed text -> one-line UserError naming the source and the row/column -----------------

BASE = NVLINK_BOX


def edit(text: str, old: str, new: str, count: int = 1) -> str:
    assert old in text
    return text.replace(old, new, count)


MALFORMED = [
    ("empty", "", r"^bad\.txt: no header row starting with GPU0"),
    ("prose", "hello world\nGPU1 X\n", r"no header row starting with GPU0"),
    ("only_rows", "GPU0\t X \tPIX\nGPU1\tPIX\t X \n", r"no header row"),
    (
        "missing_cell",
        edit(BASE, "GPU2\tNODE\tPXB\t X \tPHB\t0-63\t0", "GPU2\tNODE\tPXB\t X \t0-63\t0"),
        r"^bad\.txt: line 4: row GPU2 has 5 cells, expected 6: a cell is missing",
    ),
    (
        "truncated_row",
        edit(BASE, "GPU3\tSYS\tSYS\tPHB\t X \tN/A\tN/A", "GPU3\tSYS\tSYS"),
        r"line 5: row GPU3 has 2 cells, expected 6: a cell is missing \(no cell from column GPU2 on\)",
    ),
    (
        "extra_cell",
        edit(BASE, "GPU1\tNV12\t X \tPXB\tSYS\t0-63\t0", "GPU1\tNV12\t X \tPXB\tSYS\t0-63\t0\t7"),
        r"line 3: row GPU1 has 7 cells, expected 6: extra cell '7'",
    ),
    (
        "unknown_code",
        edit(BASE, "GPU2\tNODE\tPXB\t X \tPHB", "GPU2\tNODE\tPXB\t X \tPCIE"),
        r"line 4: row GPU2, column GPU3: unknown connection 'PCIE'",
    ),
    ("nv0", edit(BASE, "GPU0\t X \tNV12", "GPU0\t X \tNV0"), r"row GPU0, column GPU1: unknown connection 'NV0'"),
    (
        "lower_case",
        edit(BASE, "GPU1\tNV12\t X \tPXB", "GPU1\tNV12\t X \tpxb"),
        r"row GPU1, column GPU2: unknown connection 'pxb'",
    ),
    (
        "asymmetric",
        edit(BASE, "GPU2\tNODE\tPXB", "GPU2\tNODE\tPIX"),
        r"asymmetric entries: row GPU1, column GPU2 is PXB but row GPU2, column GPU1 is PIX",
    ),
    (
        "missing_row",
        edit(BASE, "GPU3\tSYS\tSYS\tPHB\t X \tN/A\tN/A\n", ""),
        r"^bad\.txt: matrix is not square: no row for column GPU3$",
    ),
    (
        "extra_row",
        BASE + "GPU4\tSYS\tSYS\tSYS\tSYS\t0-63\t0\n",
        r"line 6: row 'GPU4' is not one of the header's columns",
    ),
    ("dup_row", edit(BASE, "GPU3\tSYS", "GPU2\tSYS"), r"line 5: row 'GPU2' appears twice"),
    (
        "x_off_diagonal",
        edit(BASE, "GPU0\t X \tNV12\tNODE\tSYS", "GPU0\t X \tNV12\tNODE\tX"),
        r"row GPU0, column GPU3: X off the diagonal",
    ),
    (
        "no_diagonal",
        edit(BASE, "GPU3\tSYS\tSYS\tPHB\t X ", "GPU3\tSYS\tSYS\tPHB\tSYS"),
        r"row GPU3, column GPU3: diagonal must be X",
    ),
    (
        "dup_column",
        edit(BASE, "\tGPU0\tGPU1\tGPU2\tGPU3", "\tGPU0\tGPU1\tGPU1\tGPU3"),
        r"line 1: column 'GPU1' appears twice",
    ),
    (
        "unknown_header",
        edit(BASE, "NUMA Affinity", "NUMA Affinity\tPower Draw"),
        r"line 1: unknown column in the header",
    ),
]


@pytest.mark.parametrize("name,text,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed(name, text, message):
    with pytest.raises(UserError) as info:
        parse_nvidia_smi_topo(text, source="bad.txt")
    text = str(info.value)
    assert "\n" not in text and "\r" not in text
    assert text.startswith("bad.txt: ")
    assert re.search(message, text), text


def test_control_characters_in_names_stay_on_one_line():
    with pytest.raises(UserError) as info:
        parse_nvidia_smi_topo(BASE + "GPU\n9\x85bad\u2028x\tSYS\n", source="a\nb")
    assert "\n" not in str(info.value) and "\u2028" not in str(info.value)
    with pytest.raises(UserError):
        parse_nvidia_smi_topo(b"GPU0")  # type: ignore[arg-type]


# --- property tests: valid matrices round-trip; any text gives a Topology or UserError ---------

LINK_CODES = st.sampled_from(["PIX", "PXB", "PHB", "NODE", "SYS", "NV1", "NV4", "NV12", "NV18"])


@st.composite
def matrices(draw):
    n_gpu = draw(st.integers(1, 6))
    n_nic = draw(st.integers(0, 3))
    labels = [f"GPU{k}" for k in range(n_gpu)] + [f"NIC{k}" for k in range(n_nic)]
    size = len(labels)
    codes = [["X"] * size for _ in range(size)]
    for a in range(size):
        for b in range(a + 1, size):
            codes[a][b] = codes[b][a] = draw(LINK_CODES)
    attrs = draw(
        st.sampled_from(
            [[], ["CPU Affinity"], ["CPU Affinity", "NUMA Affinity"], ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]]
        )
    )
    numa = [draw(st.integers(0, 7) | st.none()) for _ in range(n_gpu)]
    sep = draw(st.sampled_from(["\t", " ", "   ", "\t\t", " \t"]))
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    header = sep + sep.join(labels + attrs)
    if draw(st.booleans()):
        header = "\x1b[1m" + header + "\x1b[0m"
    lines = [header]
    for a, label in enumerate(labels):
        cells = [label] + [" X " if c == "X" else c for c in codes[a]]
        if a < n_gpu:
            values = {
                "CPU Affinity": f"{a * 8}-{a * 8 + 7}",
                "NUMA Affinity": "N/A" if numa[a] is None else str(numa[a]),
                "GPU NUMA ID": "N/A",
            }
            cells += [values[h] for h in attrs]
        lines.append(sep.join(cells))
    legend = ["", "Legend:", "", "  X    = Self"] + (
        ["", "NIC Legend:", ""] + [f"  NIC{k}: mlx5_{k}" for k in range(n_nic)] if n_nic else []
    )
    text = eol.join(lines + legend) + eol
    return text, n_gpu, codes, attrs, numa


@given(matrices())
@settings(max_examples=300, **SETTINGS)
def test_generated_matrices_round_trip(case):
    text, n_gpu, codes, attrs, numa = case
    topo = parse_nvidia_smi_topo(text)
    assert topo.gpu_indices == tuple(range(n_gpu))
    assert topo.links == {(a, b): codes[a][b] for a in range(n_gpu) for b in range(n_gpu) if a != b}
    for k, nic in enumerate(topo.nics):
        assert nic.name == f"mlx5_{k}"
        assert nic.gpu_links == {g: codes[n_gpu + k][g] for g in range(n_gpu)}
    if "NUMA Affinity" in attrs:
        assert [g.numa_node for g in topo.gpus] == numa


def parse_or_user_error(text: str) -> None:
    try:
        topo = parse_nvidia_smi_topo(text, source="fuzz")
    except UserError as err:
        assert "\n" not in str(err) and str(err).startswith("fuzz")
        return
    assert isinstance(topo, Topology)
    for link in topo.links.values():
        nccl_path_type(link)  # every stored link is a known name
    topo.pairs_by_type()
    topo.pairs_by_type(nccl=True)
    topo.as_dict()


@given(st.text(max_size=400))
@settings(max_examples=400, **SETTINGS)
def test_any_text_parses_or_user_error(text):
    parse_or_user_error(text)


TOKENS = st.sampled_from(
    [
        "GPU0",
        "GPU1",
        "GPU2",
        "NIC0",
        "X",
        " X ",
        "PIX",
        "SYS",
        "NODE",
        "NV4",
        "NV0",
        "N/A",
        "CPU",
        "Affinity",
        "NUMA",
        "ID",
        "Legend:",
        "NIC0: mlx5_0",
        "#",
        "\t",
        " ",
        "\n",
        "\r\n",
        "\x1b[1m",
        "\x1b[0m",
        "\x1b",
        "0-7",
        "GPU99999999",
        "GPU" + "9" * 5000,
        "٣",
        "\u2028",
    ]
)


@given(st.lists(TOKENS, max_size=80))
@settings(max_examples=600, **SETTINGS)
def test_token_soup_parses_or_user_error(tokens):
    parse_or_user_error("".join(tokens))


@given(
    matrices(),
    st.lists(
        st.tuples(
            st.integers(0, 10_000),
            st.integers(0, 6),
            st.sampled_from(["", "X", "PIX", "\t", "\n", "GPU1", "N/A", "NV", "\x1b[", "#"]),
        ),
        min_size=1,
        max_size=4,
    ),
)
@settings(max_examples=400, **SETTINGS)
def test_mutated_matrices_parse_or_user_error(case, edits):
    text = case[0]
    for pos, cut, insert in edits:
        pos %= len(text) + 1
        text = text[:pos] + insert + text[pos + cut :]
    parse_or_user_error(text)


@given(st.data())
@settings(max_examples=200, **SETTINGS)
def test_mutated_shared_files_parse_or_user_error(nccl_307_text, chlc_text, data):
    text = data.draw(st.sampled_from([nccl_307_text, chlc_text]))
    lines = text.splitlines()
    k = data.draw(st.integers(0, len(lines) - 1))
    op = data.draw(st.sampled_from(["drop", "dup", "swap_cells", "cut"]))
    if op == "drop":
        del lines[k]
    elif op == "dup":
        lines.insert(k, lines[k])
    elif op == "swap_cells":
        cells = lines[k].split()
        if len(cells) > 2:
            a, b = data.draw(st.integers(0, len(cells) - 1)), data.draw(st.integers(0, len(cells) - 1))
            cells[a], cells[b] = cells[b], cells[a]
            lines[k] = "\t".join(cells)
    else:
        lines[k] = lines[k][: data.draw(st.integers(0, len(lines[k])))]
    parse_or_user_error("\n".join(lines))
