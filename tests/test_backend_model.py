"""fastverify.tune.backend_model: the published-measurement file and the per-backend estimates.

Expected values are worked out here by hand from the numbers the sources print (named per test),
not read back from the module."""

from __future__ import annotations

import json
import math
import statistics
from importlib import resources

import pytest

from fastverify.errors import UserError
from fastverify.registry import BackendName
from fastverify.tune import backend_model as BM

SEED_BYTES = 4 * 7168 * 2  # Kimi-K2 hidden 7168, bf16, batch 1 x 4 draft tokens = 57,344 B
SM120 = (12, 0)


def _loglog(x0, y0, x1, y1, x):
    return math.exp(math.log(y0) + (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
                    * (math.log(y1) - math.log(y0)))


def _raw() -> dict:
    return json.loads(resources.files("fastverify.data").joinpath(BM.DATA_FILE).read_bytes())


def test_data_file_loads_strictly_and_every_record_has_a_link():
    data = BM.load()
    assert data.version == 1 and len(data.boxes) >= 9 and len(data.measurements) >= 19
    for r in (*data.boxes, *data.measurements):
        assert r.link.startswith("https://"), r.id
    # the SGLang docstring numbers, exactly as the source prints them (pcie_ipc_ar.py, SGLang 0.5.23)
    ipc = next(m for m in data.measurements if m.id == "sglang-docstring-pcie-ipc")
    assert ipc.times_us[:3] == (5.3, 15.3, 34.6) and ipc.sizes_bytes[:3] == (12288, 98304, 393216)
    assert ipc.backend is BackendName.pcie_ipc
    assert set(BM.published_boxes()) == {b.id for b in data.boxes}


@pytest.mark.parametrize("mutate, says", [
    (lambda d: d["measurements"][0].pop("link"), "link"),
    (lambda d: d["measurements"][0].__setitem__("link", "blog.example"), "no https link"),
    (lambda d: d["measurements"][0].__setitem__("world_size", "eight"), "world_size"),
    (lambda d: d["measurements"][0].__setitem__("surprise", 1), "surprise"),
    (lambda d: d["measurements"][0].__setitem__("box", "nowhere"), "unknown box"),
    (lambda d: d["measurements"][0].__setitem__("times_us", [1.0]), "sizes but 1 values"),
    (lambda d: d["measurements"][0].__setitem__("backend", "pcie-ipc"), "backend"),
])
def test_bad_data_file_is_one_line_naming_the_file(tmp_path, mutate, says):
    d = _raw()
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(UserError) as ei:
        BM.load(p)
    msg = str(ei.value)
    assert str(p) in msg and says in msg and "\n" not in msg


def test_seed_case_pcie_ipc_low_end_is_at_most_40_percent_of_nccl_point():
    ipc = BM.estimate(BackendName.pcie_ipc, SEED_BYTES, world_size=8, sm=SM120, pcie_gen=5, p2p=True)
    nccl = BM.estimate(BackendName.nccl, SEED_BYTES, world_size=8, sm=SM120, pcie_gen=5, p2p=True)
    assert ipc.label == nccl.label == "predicted"
    # PCIe IPC: only the SGLang 8x SM120 box covers 56 KiB (the L40S batch-1 figure is at 12 KiB, and
    # 56 KiB is more than 2x away): log-log between 12 KiB 5.3 us and 96 KiB 15.3 us = 11.62 us.
    p_ipc = _loglog(12288, 5.3, 98304, 15.3, SEED_BYTES)
    assert ipc.point_us == pytest.approx(p_ipc) and p_ipc == pytest.approx(11.62, abs=0.01)
    assert ipc.low_us == pytest.approx(p_ipc / 1.25) and ipc.high_us == pytest.approx(p_ipc * 1.25)
    assert ipc.sources == ("sglang-docstring-pcie-ipc",)
    # NCCL point: median over the SM12x boxes at 56 KiB.
    sglang = _loglog(12288, 205.1, 98304, 584.9, SEED_BYTES)  # 444.9
    turin = statistics.median([_loglog(32768, 48.16, 65536, 48.69, SEED_BYTES), 23.12])  # busBw-derived 64 KiB row held
    asus = _loglog(8192, 57.6, 65536, 67.8, SEED_BYTES)
    d6000 = _loglog(4096, 45.0, 65536, 344.0, SEED_BYTES)
    p_nccl = statistics.median([sglang, turin, asus, d6000])
    assert nccl.point_us == pytest.approx(p_nccl) and p_nccl == pytest.approx(189.5, abs=0.1)
    assert ipc.low_us <= 0.40 * nccl.point_us  # 9.30 us vs 0.4 x 189.5 = 75.8 us
    assert ipc.low_us / nccl.point_us == pytest.approx(0.049, abs=0.001)


def test_disagreeing_sources_carry_the_note():
    nccl = BM.estimate(BackendName.nccl, SEED_BYTES, world_size=8, sm=SM120)
    # SGLang box 444.9 us vs the busBw-derived Turin row 23.12 us: 19x, above DISAGREE = 3
    assert any("differ 19x" in n and "fastverify tune" in n for n in nccl.notes)
    ipc = BM.estimate(BackendName.pcie_ipc, SEED_BYTES, world_size=8, sm=SM120, p2p=True)
    assert any("one-shot all-to-all kernels collapse" in n and "fastverify tune" in n for n in ipc.notes)
    # 4 GPUs, 8 KiB: asus 4-GPU 1..16 KiB interpolation vs Turin 4-GPU 11.17 vs V100 20.3 -> within 3x: no note
    quiet = BM.estimate(BackendName.nccl, 8192, world_size=4, sm=(12, 0))
    assert quiet is not None and quiet.notes == ()


def test_none_where_no_comparable_data_exist():
    assert BM.estimate(BackendName.b12x, SEED_BYTES, world_size=8, sm=SM120, p2p=True) is None  # no isolated figure
    assert BM.estimate(BackendName.custom_ar, SEED_BYTES, world_size=2, sm=SM120, p2p=True) is None  # only 4x V100
    assert BM.estimate(BackendName.pcie_ipc, SEED_BYTES, world_size=8, sm=SM120, p2p=False) is None  # needs P2P
    assert BM.estimate(BackendName.nccl, SEED_BYTES, world_size=3, sm=SM120) is None
    assert BM.estimate(BackendName.nccl, 8, world_size=8, sm=SM120) is None  # nearest default table starts at 256 B

def test_exclude_box_really_excludes():
    # 12 KiB, TP8, PCIe IPC: SGLang SM120 box 5.3 us; FlashInfer PR #4393 L40S 21.8 us (runs 18.7..28.9).
    both = BM.estimate(BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True)
    assert both.low_us == pytest.approx(5.3 / 1.25) and both.high_us == pytest.approx(28.9 * 1.25)
    assert both.point_us == pytest.approx(21.8)  # same SM major (8) as the L40S box
    only_l40s = BM.estimate(BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True,
                            exclude_box="sglang-docstring-8xsm120")
    assert only_l40s.sources == ("flashinfer-pr4393-pcie-ipc-b1",)
    assert (only_l40s.low_us, only_l40s.point_us, only_l40s.high_us) == pytest.approx((18.7 / 1.25, 21.8, 28.9 * 1.25))
    assert BM.estimate(BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True,
                       exclude_box="flashinfer-pr4393-8xl40s").point_us == pytest.approx(5.3)


def test_interpolation_rule():
    s, v = (1000, 4000), (10.0, 40.0)
    assert BM.interpolate(s, v, 2000) == pytest.approx(20.0)  # log-log, slope 1
    assert BM.interpolate(s, v, 500) == 10.0 and BM.interpolate(s, v, 499) is None  # held flat, <= 2x
    assert BM.interpolate(s, v, 8000) == pytest.approx(80.0) and BM.interpolate(s, v, 8001) is None
    assert BM.interpolate((1000, 2000), (10.0, 100.0), 4000) == pytest.approx(200.0)  # slope clamped to 1
    assert BM.interpolate((1000,), (10.0,), 2000) == 10.0
