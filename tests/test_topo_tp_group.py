"""``fastverify topo --tp N`` below the box's GPU count describes the TP group, GPUs 0..N-1.

SGLang places TP rank r on CUDA device ``--base-gpu-id + r * --gpu-id-step`` (0 and 1 by default;
SGLang 0.5.23 ``srt/entrypoints/engine.py``), so a server started with ``--tp 3`` on an 8-GPU box
uses GPUs 0, 1 and 2. The pairs, the transports, the predictions, the all-reduce fit lines, the
NCCL_P2P_LEVEL line and the ranking must all be about those three GPUs. The expected pairs are read
here from the ``nvidia-smi topo -m`` text with a few lines of plain Python, not with fastverify's
parser.
"""

from __future__ import annotations

import json

import pytest
from conftest import SHARED, SHARED_MISSING

from fastverify.cli import main
from fastverify.topo.matrix import Gpu, Nic, Topology, parse_nvidia_smi_topo

TOPO = SHARED / "inputs" / "topo-nccl-tests-307.txt"
needs_shared = pytest.mark.skipif(not TOPO.is_file(), reason=SHARED_MISSING)


def _matrix(path) -> dict[tuple[int, int], str]:
    """``{(i, j): cell}`` for the GPU rows and columns of the matrix, read by hand."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    header = lines[0].split()
    columns = [c for c in header if c.startswith("GPU") and c[3:].isdigit()]
    out = {}
    for ln in lines[1:]:
        cells = ln.split()
        if not cells or cells[0] not in columns:
            continue
        for col, value in zip(columns, cells[1 : 1 + len(columns)]):
            out[(int(cells[0][3:]), int(col[3:]))] = value
    return out


def _topo(capsys, *extra: str) -> str:
    assert main(["topo", "--topology", str(TOPO), *extra]) == 0
    return capsys.readouterr().out


def _json(capsys, *extra: str) -> dict:
    return json.loads(_topo(capsys, *extra, "--json"))


@needs_shared
def test_tp3_json_describes_gpus_0_to_2(capsys):
    cells = _matrix(TOPO)
    box = 1 + max(i for i, _ in cells)
    assert box == 8  # the premise: a box larger than the TP group
    doc = _json(capsys, "--tp", "3")

    assert doc["n_gpus"] == 3
    pairs = {(p["a"], p["b"]): p["link"] for p in doc["pairs"]}
    assert pairs == {(a, b): cells[(a, b)] for a in range(3) for b in range(a + 1, 3)}
    assert len(pairs) == 3

    assert doc["predictions"], doc["prediction_note"]
    assert "3 ranks" in doc["prediction_note"] and f"{box} ranks" not in doc["prediction_note"]

    custom = doc["custom_allreduce"]["reason"]
    assert "3 GPUs" in custom and f"{box} PCIe GPUs" not in custom and f"; {box} GPUs" not in custom
    assert doc["pcie_ipc_allreduce"]["possible"] is False
    assert doc["pcie_ipc_allreduce"]["reason"].startswith("world size 3:")

    assert "GPUs 0-2 of 8" in doc["scope"] and "--tp 8" in doc["scope"]


@needs_shared
def test_tp3_level_and_ranking_agree(capsys):
    doc = _json(capsys, "--tp", "3")
    entries = doc["advice"]
    assert entries is not None, doc["advice_notes"]
    baseline_rank = next(e["rank"] for e in entries if e["is_baseline"])
    keep = baseline_rank == 1
    rec = doc["p2p_level_recommended"]
    if rec is not None:
        # a recommended level is one of the ranking's options, so the header can place it in it
        entry = next((e for e in entries if e["settings"] == {"NCCL_P2P_LEVEL": rec}), None)
        assert entry is not None, f"recommended {rec} is not an option of the ranking"
        if keep:
            assert entry["rank"] is None or entry["rank"] > baseline_rank
    if keep:
        # the ranking keeps the current settings: the predicted table shows nothing faster
        assert all(p["recommended_us"] >= p["now_us"] for p in doc["predictions"])
    # the pairs of GPUs 0-2 are PIX, inside NCCL's default level PXB: nothing to change
    assert rec is None and keep


@needs_shared
def test_tp3_text_agrees_with_itself(capsys):
    out = _topo(capsys, "--tp", "3")
    lines = out.splitlines()
    level = next(ln for ln in lines if ln.startswith("# NCCL_P2P_LEVEL now:"))
    if "keep the current settings" in out:
        assert level.endswith("no change") or "predicted slower" in level, level
    assert "# fastverify topo: 3 GPU(s)" in out
    assert any(ln.startswith("# --tp 3: the TP group is GPUs 0-2 of 8") for ln in lines), out
    assert "8 PCIe GPUs" not in out and "8 ranks" not in out
    assert "3 ranks" in out
    # the pairs table names only pairs among GPUs 0-2
    assert " 0-1 0-2 1-2 " in out and "0-3" not in out and "4-5" not in out


@needs_shared
def test_tp_of_whole_box_is_the_default(capsys):
    assert _json(capsys, "--tp", "8") == _json(capsys)
    assert _topo(capsys, "--tp", "8") == _topo(capsys)
    doc = _json(capsys)
    assert doc["scope"] is None and doc["n_gpus"] == 8 and len(doc["pairs"]) == 28


@needs_shared
def test_tp_above_the_box_is_refused(capsys):
    assert main(["topo", "--topology", str(TOPO), "--tp", "9"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--tp 9" in err and "8 GPUs" in err and len(err.splitlines()) == 1


def _nvml_like() -> Topology:
    """A 4-GPU topology as NVML gives it: P2P status and reasons, a link error, failed queries."""
    gpus = tuple(Gpu(index=i, name="RTX", pci_bus_id=f"0000:{i + 1:02x}:00.0") for i in range(4))
    links = {(i, j): "PIX" if (i < 2) == (j < 2) else "SYS" for i in range(4) for j in range(4) if i != j}
    errors = {(0, 3): "NVML_ERROR_NOT_SUPPORTED", (3, 0): "NVML_ERROR_NOT_SUPPORTED"}
    for pair in errors:
        del links[pair]
    ok = {(i, j): (i < 2) == (j < 2) for i in range(4) for j in range(4) if i != j}
    return Topology(
        gpus=gpus,
        links=links,
        nics=(Nic("NIC0", "mlx5_0", {i: "PIX" if i < 2 else "SYS" for i in range(4)}),),
        p2p_read=dict(ok),
        p2p_write=dict(ok),
        source="NVML (driver 570)",
        p2p_reason={pair: "NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED" for pair, v in ok.items() if not v},
        link_errors=errors,
        unsupported=(
            "nvmlDeviceGetTopologyCommonAncestor(GPU 0, GPU 3): NVML_ERROR_NOT_SUPPORTED",
            "nvmlDeviceGetNumaNodeId(GPU 1): NVML_ERROR_NOT_SUPPORTED",
            "nvmlDeviceGetNumaNodeId(GPU 2): NVML_ERROR_NOT_SUPPORTED",
            "nvmlSystemGetDriverVersion(): NVML_ERROR_UNKNOWN",
        ),
    )


def test_first_gpus_restricts_every_part_of_the_record():
    whole = _nvml_like()
    two = whole.first_gpus(2)
    assert two.gpu_indices == (0, 1) and two.source == whole.source
    assert two.links == {(0, 1): "PIX", (1, 0): "PIX"}
    assert two.p2p_read == {(0, 1): True, (1, 0): True} == two.p2p_write
    assert two.p2p_reason == {} and two.link_errors == {}
    assert two.nics == (Nic("NIC0", "mlx5_0", {0: "PIX", 1: "PIX"}),)
    assert two.unsupported == (
        "nvmlDeviceGetNumaNodeId(GPU 1): NVML_ERROR_NOT_SUPPORTED",
        "nvmlSystemGetDriverVersion(): NVML_ERROR_UNKNOWN",
    )
    three = whole.first_gpus(3)
    assert set(three.p2p_reason) == {(0, 2), (2, 0), (1, 2), (2, 1)}
    assert three.link_errors == {} and three.link(0, 2) == "SYS"
    assert whole.first_gpus(4) == whole


@pytest.mark.parametrize("n", [0, 5])
def test_first_gpus_outside_the_box_is_an_error(n):
    with pytest.raises(ValueError, match="GPU"):
        _nvml_like().first_gpus(n)


@needs_shared
def test_first_gpus_of_the_shared_topology():
    topo = parse_nvidia_smi_topo(TOPO.read_text(), source="t")
    cells = _matrix(TOPO)
    sub = topo.first_gpus(3)
    assert sub.gpu_indices == (0, 1, 2)
    assert sub.links == {k: v for k, v in cells.items() if k[0] != k[1] and max(k) < 3}
    assert [set(n.gpu_links) for n in sub.nics] == [{0, 1, 2}]


@needs_shared
def test_tp3_with_the_boxs_own_log_warns_of_no_stray_gpu(capsys):
    log = SHARED / "inputs" / "nccldebug-nccl-tests-307.txt"
    doc = _json(capsys, "--tp", "3", "--nccl-log", str(log))
    assert doc["n_gpus"] == 3 and {(p["a"], p["b"]) for p in doc["pairs"]} == {(0, 1), (0, 2), (1, 2)}
    # the log's GPUs 3-7 are on this box, outside the TP group: no "from another box" warning
    assert not any("does not have" in w for w in doc["warnings"]), doc["warnings"]
