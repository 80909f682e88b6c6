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


T95 = {5: 2.015, 10: 1.812, 11: 1.796, 20: 1.725, 22: 1.717, 24: 1.711}  # Student t, one-sided 0.95 (tables)


def _kernel_spread_by_hand():
    """s of the P2P-kernel cells of the packaged file, worked out from the sources' numbers.

    Cells with two boxes: PCIe IPC TP8 at 8 and 16 KiB (SGLang 8x SM120 12 KiB 5.3 us held below /
    log-log to 96 KiB 15.3 us; FlashInfer L40S 21.8 us, one size, held within 2x) and the
    lukealonso/sglang one-shot kernel at TP4 on the WRX90 3-switch box vs the ASUS ESC8000A,
    4 KiB .. 1 MiB (WRX90's table ends at 512 KiB: 1 MiB continues its last slope). Two boxes per
    cell: the squared deviations from the cell mean sum to (ln a - ln b)^2 / 2, one df per cell."""
    wrx_1m = 128.0 * 2 ** (math.log(128.0 / 40.1) / math.log(4))  # slope 131072 -> 524288, < 1
    pairs = [(5.3, 21.8), (_loglog(12288, 5.3, 98304, 15.3, 16384), 21.8),
             (7.9, 6.5), (_loglog(4096, 7.9, 16384, 11.6, 8192), 6.4), (11.6, 7.7), (16.3, 9.2), (24.6, 11.8),
             (40.1, 17.6), (_loglog(131072, 40.1, 524288, 128.0, 262144), 28.7), (128.0, 51.0), (wrx_1m, 95.6)]
    ss = sum((math.log(a) - math.log(b)) ** 2 / 2 for a, b in pairs)
    return math.sqrt(ss / len(pairs)), len(pairs)


def test_seed_case_pcie_ipc_low_end_is_at_most_40_percent_of_nccl_point():
    """Issue 11 done-when: 8x SM120, PCIe Gen5, 56 KiB (4 tokens x 7168 x 2 B): the pcie_ipc
    candidate's range low end is <= 40 % of the NCCL baseline point."""
    ipc = BM.estimate(BackendName.pcie_ipc, SEED_BYTES, world_size=8, sm=SM120, pcie_gen=5, p2p=True)
    nccl = BM.estimate(BackendName.nccl, SEED_BYTES, world_size=8, sm=SM120, pcie_gen=5, p2p=True)
    assert ipc.label == nccl.label == "predicted"
    # PCIe IPC: only the SGLang 8x SM120 box covers 56 KiB (the L40S batch-1 figure is at 12 KiB, and
    # 56 KiB is more than 2x away): log-log between 12 KiB 5.3 us and 96 KiB 15.3 us = 11.62 us.
    p_ipc = _loglog(12288, 5.3, 98304, 15.3, SEED_BYTES)
    assert ipc.point_us == pytest.approx(p_ipc) and p_ipc == pytest.approx(11.62, abs=0.01)
    assert ipc.sources == ("sglang-docstring-pcie-ipc",)
    # range: n = 1 box, s of the kernel cells (11 df: own pool), q = t_0.95(11) = 1.796
    s, df = _kernel_spread_by_hand()
    assert df == 11 and s == pytest.approx(0.6017, abs=1e-4)
    factor = math.exp(T95[11] * s * math.sqrt(1 + 1 / 1))  # 4.61
    assert ipc.low_us == pytest.approx(p_ipc / factor, rel=1e-3)  # 2.52 us, below the envelope's 11.62 / 1.25
    assert ipc.high_us == pytest.approx(p_ipc * factor, rel=1e-3)  # 53.6 us
    assert "90 % prediction interval" in ipc.evidence and "8x SM120 GPU (model not named)" in ipc.evidence
    # NCCL point: median over the SM12x boxes on PCIe Gen5 at 56 KiB (EPYC 9124 direct-attach and
    # luke's 3-switch Max-Q box; the SGLang SM120 box's generation is not stated).
    epyc = _loglog(32768, 24.9, 65536, 27.0, SEED_BYTES)
    luke = _loglog(32768, 24.5, 65536, 24.1, SEED_BYTES)
    p_nccl = statistics.median([epyc, luke])
    assert nccl.point_us == pytest.approx(p_nccl) and p_nccl == pytest.approx(25.38, abs=0.01)
    assert nccl.low_us <= nccl.point_us <= nccl.high_us
    assert ipc.low_us <= 0.40 * nccl.point_us  # 2.52 us vs 0.4 x 25.38 = 10.15 us
    assert ipc.low_us / nccl.point_us == pytest.approx(0.0994, abs=0.001)


def test_t_quantile_matches_the_tables():
    for df in (5, 10, 20):
        assert BM.t_quantile(df) == pytest.approx(T95[df], abs=0.001)
    assert BM.t_quantile(1) == pytest.approx(6.314, abs=0.001)  # closed forms
    assert BM.t_quantile(2) == pytest.approx(2.920, abs=0.001)
    assert BM.t_quantile(3) == pytest.approx(2.353, abs=0.001)
    assert BM.t_quantile(29) == pytest.approx(1.699, abs=0.001)
    assert BM.t_quantile(30) == BM.t_quantile(500) == pytest.approx(1.6449, abs=1e-4)  # normal from df 30
    assert BM.t_quantile(10, 0.975) == pytest.approx(2.228, abs=0.001)
    with pytest.raises(ValueError):
        BM.t_quantile(0)


def _box(i):
    return {"id": i, "gpu": f"GPU {i}", "sm": [12, 0], "gpu_count": 8, "pcie_gen": 5, "fabric": "switch",
            "numa": "one node", "link": f"https://example.org/{i}"}


def _meas(mid, box, backend, sizes, times, *, kernel="k", ws=8, p2p=True, settings="default"):
    return {"id": mid, "box": box, "backend": backend, "kernel": kernel, "world_size": ws, "p2p": p2p, "tool": "t",
            "settings": settings, "tuned": False, "dtype": None, "sizes_bytes": sizes, "times_us": times,
            "speedup_vs_nccl": None, "run_range_us": None, "read_from": "table", "cuda_graph": None,
            "table_file": None, "link": f"https://example.org/{mid}"}


@pytest.fixture
def synthetic(tmp_path):
    """Three boxes A, B, C. NCCL TP8 default: 4 KiB .. 4 MiB, C = 2 B = 4 A at every size, so each of
    the 11 grid cells has ln values ln a + (0, ln 2, 2 ln 2): deviations (-ln 2, 0, ln 2), SS 2 ln^2 2,
    2 df; s_nccl^2 = 22 ln^2 2 / 22, s_nccl = ln 2, df 22. Kernel "k" (no backend), P2P on, A 5 us,
    B 15 us at 4 KiB (held to 8 KiB): 2 cells, SS (ln 3)^2 / 2 each, 2 df: under 10 -> pool of all:
    s^2 = (22 ln^2 2 + ln^2 3) / 24. Left out by the comparable rule (each would change s): NCCL
    with settings changed on A, a pcie_ipc run with P2P off on C, kernel "k" with P2P unknown on C."""
    d = {"version": 1, "description": "synthetic", "boxes": [_box("A"), _box("B"), _box("C")], "measurements": [
        _meas("a-nccl", "A", "nccl", [4096, 4194304], [10.0, 1000.0]),
        _meas("b-nccl", "B", "nccl", [4096, 4194304], [20.0, 2000.0]),
        _meas("c-nccl", "C", "nccl", [4096, 4194304], [40.0, 4000.0]),
        _meas("a-nccl-tuned", "A", "nccl", [4096, 4194304], [900.0, 9.0], settings="NCCL_PROTO=LL"),
        _meas("a-k", "A", None, [4096], [5.0]),
        _meas("b-k", "B", None, [4096], [15.0]),
        _meas("c-k-unknown", "C", None, [4096], [500.0], p2p=None),
        _meas("a-ipc", "A", "pcie_ipc", [4096], [7.0]),
        _meas("c-ipc-no-p2p", "C", "pcie_ipc", [4096], [700.0], p2p=False),
    ]}
    p = tmp_path / "synthetic.json"
    p.write_text(json.dumps(d))
    return BM.load(p)


def test_pooled_spread_by_hand(synthetic):
    ln2, ln3 = math.log(2), math.log(3)
    sp = BM.spread("nccl", data=synthetic)
    assert (sp.group, sp.df, sp.cells) == ("nccl", 22, 11)
    assert sp.s == pytest.approx(ln2) and sp.q == pytest.approx(T95[22], abs=0.001)
    k = BM.spread("kernel", data=synthetic)  # own pool: 2 df < MIN_GROUP_DF -> all cells
    assert (k.group, k.df, k.cells) == ("all", 24, 13)
    assert k.s == pytest.approx(math.sqrt((22 * ln2 ** 2 + ln3 ** 2) / 24)) and k.q == pytest.approx(T95[24], abs=0.001)


def test_excluding_a_box_changes_s_no_leakage(synthetic):
    ln2 = math.log(2)
    sp = BM.spread("nccl", exclude_box="C", data=synthetic)  # A, B: deviations ±ln2/2, 1 df per cell
    assert (sp.df, sp.cells) == (11, 11) and sp.s == pytest.approx(ln2 / math.sqrt(2))
    assert BM.spread("nccl", exclude_box="C", data=synthetic).s != BM.spread("nccl", data=synthetic).s
    # the held-out box's estimate uses that s: A and B only, n = 2
    e = BM.estimate(BackendName.nccl, 4096, world_size=8, sm=SM120, data=synthetic, exclude_box="C")
    half = T95[11] * (ln2 / math.sqrt(2)) * math.sqrt(1 + 1 / 2)  # n = 2 boxes (A 10, B 20)
    centre = math.sqrt(10.0 * 20.0)
    assert e.low_us == pytest.approx(min(10.0 / 1.25, centre / math.exp(half)), rel=1e-3)
    assert e.high_us == pytest.approx(max(20.0 * 1.25, centre * math.exp(half)), rel=1e-3)
    # and the LOBO benchmark's pcie_ipc held-out SGLang box: its two kernel cells leave the kernel pool
    # with 9 df, under MIN_GROUP_DF: the pool of all cells is used
    assert BM.spread("kernel", exclude_box="sglang-docstring-8xsm120").group == "all"
    assert BM.spread("kernel").group == "kernel"


def test_estimate_on_other_data_is_a_prediction_interval(synthetic):
    ln2, ln3 = math.log(2), math.log(3)
    e = BM.estimate(BackendName.nccl, 4096, world_size=8, sm=SM120, pcie_gen=5, data=synthetic)
    assert e.point_us == pytest.approx(20.0)  # median of 10, 20, 40; the tuned A run is not comparable
    half = T95[22] * ln2 * math.sqrt(1 + 1 / 3)  # geometric mean 20, x/÷ e^half = 3.95
    assert e.low_us == pytest.approx(20.0 / math.exp(half), rel=1e-3)  # 5.06 < envelope 10 / 1.25
    assert e.high_us == pytest.approx(20.0 * math.exp(half), rel=1e-3)  # 79.0 > envelope 40 x 1.25
    assert e.sources == ("a-nccl", "b-nccl", "c-nccl")
    assert "3 comparable boxes (8x GPU A, 8x GPU B, 8x GPU C)" in e.evidence and "df 22, q 1.717" in e.evidence
    # one box (n = 1): the interval still applies, with the pooled s (all cells: 24 df)
    ipc = BM.estimate(BackendName.pcie_ipc, 4096, world_size=8, sm=SM120, p2p=True, data=synthetic)
    s_all = math.sqrt((22 * ln2 ** 2 + ln3 ** 2) / 24)
    f = math.exp(T95[24] * s_all * math.sqrt(2))
    assert ipc.sources == ("a-ipc",) and ipc.point_us == 7.0
    assert (ipc.low_us, ipc.high_us) == pytest.approx((7.0 / f, 7.0 * f), rel=1e-3)
    assert BM.comparable(BackendName.pcie_ipc, 8, data=synthetic) == [m for m in synthetic.measurements
                                                                       if m.id == "a-ipc"]


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
    assert both.point_us == pytest.approx(21.8)  # same SM major (8) as the L40S box
    s, _ = _kernel_spread_by_hand()
    half = T95[11] * s * math.sqrt(1 + 1 / 2)
    centre = math.sqrt(5.3 * 21.8)
    assert both.low_us == pytest.approx(min(5.3 / 1.25, centre / math.exp(half)), rel=1e-3)  # 2.45 us
    assert both.high_us == pytest.approx(max(28.9 * 1.25, centre * math.exp(half)), rel=1e-3)  # 47.2 us
    only_l40s = BM.estimate(BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True,
                            exclude_box="sglang-docstring-8xsm120")
    assert only_l40s.sources == ("flashinfer-pr4393-pcie-ipc-b1",) and only_l40s.point_us == pytest.approx(21.8)
    # the held-out box is out of s too: the kernel pool drops to 9 df and the pool of all cells is used
    sp = BM.spread("kernel", exclude_box="sglang-docstring-8xsm120")
    f = math.exp(sp.q * sp.s * math.sqrt(2))
    assert (only_l40s.low_us, only_l40s.high_us) == pytest.approx(
        (min(18.7 / 1.25, 21.8 / f), max(28.9 * 1.25, 21.8 * f)))
    assert BM.estimate(BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True,
                       exclude_box="flashinfer-pr4393-8xl40s").point_us == pytest.approx(5.3)


def test_interpolation_rule():
    s, v = (1000, 4000), (10.0, 40.0)
    assert BM.interpolate(s, v, 2000) == pytest.approx(20.0)  # log-log, slope 1
    assert BM.interpolate(s, v, 500) == 10.0 and BM.interpolate(s, v, 499) is None  # held flat, <= 2x
    assert BM.interpolate(s, v, 8000) == pytest.approx(80.0) and BM.interpolate(s, v, 8001) is None
    assert BM.interpolate((1000, 2000), (10.0, 100.0), 4000) == pytest.approx(200.0)  # slope clamped to 1
    assert BM.interpolate((1000,), (10.0,), 2000) == 10.0
