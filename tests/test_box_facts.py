"""Box facts: SM, PCIe generation and GPU count each from a flag, a described box, NVML or the
topology, and a guess said on the first line of tune and topo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastverify.deploy import BoxFingerprint
from fastverify.topo.box import GUESS_PCIE_GEN, GUESS_SM, resolve_box
from tests.conftest import cli, one_line_error

SHARED = Path(__file__).resolve().parents[2] / "shared" / "inputs"
TOPO = SHARED / "topo-nccl-tests-307.txt"


class FakeNvml:
    """NVML with ``n`` GPUs of compute capability (12, 0) whose links train to Gen 5 (one to Gen 4)."""

    class NVMLError(Exception):
        pass

    def __init__(self, n: int) -> None:
        self.n = n

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (12, 0)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 4 if h == 3 else 5


def test_flags_win_then_description_then_nvml_then_guess():
    described = BoxFingerprint(
        gpu_name="X", sm=(9, 0), gpu_count=4, tp=0, driver=None, nccl_version=None, nvlink_full=None
    )
    f = resolve_box(sm=100, pcie_gen=6, described=described, topology_gpus=8, nvml=FakeNvml(8))
    assert (f.sm.value, f.sm.source, f.pcie_gen.value, f.pcie_gen.source) == (100, "--sm", 6, "--pcie-gen")
    assert (f.gpu_count.value, f.gpu_count.source) == (4, "--describe-box")
    f = resolve_box(sm=None, pcie_gen=None, described=described, topology_gpus=8, nvml=FakeNvml(8))
    assert (f.sm.value, f.sm.source) == (90, "--describe-box")  # a described box: this machine's NVML is not asked
    assert (f.pcie_gen.value, f.pcie_gen.source) == (GUESS_PCIE_GEN, "guessed")
    f = resolve_box(sm=None, pcie_gen=None, topology_gpus=None, nvml=FakeNvml(8))
    # the lowest of the GPUs: one link trains to Gen 4 only
    assert (f.sm.value, f.sm.source, f.pcie_gen.value, f.pcie_gen.source) == (120, "nvml", 4, "nvml")
    assert (f.gpu_count.value, f.gpu_count.source) == (8, "nvml")
    # a topology of another box (8 GPUs) read on a 2-GPU machine: NVML's answer is not that box's
    f = resolve_box(sm=None, pcie_gen=None, topology_gpus=8, nvml=FakeNvml(2))
    assert (f.sm.value, f.sm.source, f.gpu_count.value, f.gpu_count.source) == (GUESS_SM, "guessed", 8, "topology")
    assert "GUESSED" in f.first_line() and "--sm and --pcie-gen" in f.first_line()


def test_tune_says_a_guessed_box_on_its_first_line(capsys):
    if not TOPO.exists():
        pytest.skip(f"{TOPO} is absent (../shared holds the real topology inputs)")
    argv = ["tune", "--predict", "--topology", str(TOPO), "--model", "kimi-k2", "--tp", "8"]
    rc, out, err = cli(argv, capsys)
    assert rc == 0, err
    first = out.splitlines()[0]
    assert first.startswith("# box: SM 89 (guessed), PCIe Gen 4 (guessed), 8 GPUs (topology); GUESSED")
    rc, out, err = cli(argv + ["--sm", "120", "--pcie-gen", "5"], capsys)
    assert out.splitlines()[0] == "# box: SM 120 (--sm), PCIe Gen 5 (--pcie-gen), 8 GPUs (topology)"
    rc, out, err = cli(argv + ["--json", "--describe-box", json.dumps({"sm": [12, 0], "gpu_count": 8})], capsys)
    assert rc == 0, err
    facts = json.loads(out)["box"]["facts"]
    assert facts["sm"] == {"value": 120, "source": "--describe-box"}
    assert facts["pcie_gen"] == {"value": 4, "source": "guessed"}
    assert err.splitlines()[0].startswith("# box: SM 120 (--describe-box), PCIe Gen 4 (guessed)")


def test_topo_says_the_box_first_and_refuses_a_bad_description(capsys):
    if not TOPO.exists():
        pytest.skip(f"{TOPO} is absent (../shared holds the real topology inputs)")
    rc, out, err = cli(["topo", "--topology", str(TOPO), "--sm", "120"], capsys)
    assert rc == 0, err
    assert out.splitlines()[0].startswith("# box: SM 120 (--sm), PCIe Gen 4 (guessed), 8 GPUs (topology); GUESSED")
    rc, out, err = cli(["topo", "--topology", str(TOPO), "--json"], capsys)
    assert json.loads(out)["box"]["sm"] == {"value": GUESS_SM, "source": "guessed"}
    one_line_error(
        *cli(["topo", "--topology", str(TOPO), "--describe-box", "[1]"], capsys), "--describe-box", "JSON object"
    )


def test_the_fingerprint_is_of_the_gpus_cuda_shows():
    """CUDA_VISIBLE_DEVICES picks and orders the GPUs the fingerprint counts (CUDA C Programming
    Guide, "CUDA Environment Variables"): 2 of 4 NVML GPUs, both Ada, the NVLink judged over them."""
    from types import SimpleNamespace

    from fastverify.topo.box import read_box

    class Nvml:
        NVMLError = RuntimeError
        NVML_NVLINK_MAX_LINKS = 2
        cc = [(9, 0), (9, 0), (8, 9), (8, 9)]
        names = ["H100", "H100", "L40S", "L40S"]

        def nvmlInit(self):
            pass

        def nvmlShutdown(self):
            pass

        def nvmlDeviceGetCount(self):
            return 4

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetName(self, h):
            return self.names[h]

        def nvmlDeviceGetUUID(self, h):
            return f"GPU-{h}{h}{h}{h}-0000"

        def nvmlDeviceGetPciInfo(self, h):
            return SimpleNamespace(busId=f"00000000:{h + 1:02x}:00.0")

        def nvmlDeviceGetMemoryInfo(self, h):
            return SimpleNamespace(total=1 << 34)

        def nvmlDeviceGetCudaComputeCapability(self, h):
            return self.cc[h]

        def nvmlSystemGetDriverVersion(self):
            return "580.1"

        def nvmlDeviceGetNvLinkState(self, h, link):
            raise RuntimeError("no NVLink")

    env = {"CUDA_VISIBLE_DEVICES": "3,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    box = read_box(2, nvml=Nvml(), torch_fallback=False, nccl_version="2.27.3", environ=env)
    assert box.gpu_count == 2 and box.gpu_name == "L40S" and box.sm == (8, 9)
    whole = read_box(
        2, nvml=Nvml(), torch_fallback=False, nccl_version="2.27.3", environ={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    )
    assert whole.gpu_count == 4
