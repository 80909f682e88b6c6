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


Z80 = 1.2816  # normal 0.90 quantile (tables): an 80 % central range
MAD_SD = 1 / 0.6745  # 1 / normal 0.75 quantile (tables): MAD -> standard deviation


def _lower_weighted_median(pairs):
    """Sorted (value, weight): the first value where the running weight reaches half the total."""
    items = sorted(pairs)
    total, acc = sum(w for _, w in items), 0.0
    for v, w in items:
        acc += w
        if acc >= total / 2 - 1e-9:
            return v
    raise AssertionError("unreachable")


def _kernel_pairs_by_hand():
    """The P2P-kernel cells of the packaged file with two boxes, worked out from the sources' numbers:
    (SGLang 8x SM120 or WRX90 value, FlashInfer L40S or ASUS ESC8000A value) in µs.

    PCIe IPC TP8 at 8 and 16 KiB (SGLang 8x SM120 12 KiB 5.3 us held below / log-log to 96 KiB
    15.3 us; FlashInfer L40S 21.8 us, one size, held within 2x) and the lukealonso/sglang one-shot
    kernel at TP4 on the WRX90 3-switch box vs the ASUS ESC8000A, 4 KiB .. 1 MiB (WRX90's table ends
    at 512 KiB: 1 MiB continues its last slope)."""
    wrx_1m = 128.0 * 2 ** (math.log(128.0 / 40.1) / math.log(4))  # slope 131072 -> 524288, < 1
    tp8 = [(5.3, 21.8), (_loglog(12288, 5.3, 98304, 15.3, 16384), 21.8)]
    tp4 = [(7.9, 6.5), (_loglog(4096, 7.9, 16384, 11.6, 8192), 6.4), (11.6, 7.7), (16.3, 9.2), (24.6, 11.8),
           (40.1, 17.6), (_loglog(131072, 40.1, 524288, 128.0, 262144), 28.7), (128.0, 51.0), (wrx_1m, 95.6)]
    return tp8, tp4


def _kernel_fit_by_hand():
    """Centre, scale and width of the kernel range (ranges.py rules) from :func:`_kernel_pairs_by_hand`.

    Two boxes per cell: each box's point is the other's value, so its residual is ln(own / other).
    Each box weighs 1, shared over its cells: the TP8 boxes 1/2 per residual, the TP4 boxes 1/9."""
    tp8, tp4 = _kernel_pairs_by_hand()
    res = [(math.log(a / b), 1 / 2) for a, b in tp8] + [(math.log(b / a), 1 / 2) for a, b in tp8]
    res += [(math.log(a / b), 1 / 9) for a, b in tp4] + [(math.log(b / a), 1 / 9) for a, b in tp4]
    c = _lower_weighted_median(res)
    s = MAD_SD * _lower_weighted_median((abs(x - c), w) for x, w in res)
    return c, s, math.exp(2 * Z80 * s), len(res)


def test_seed_case_pcie_ipc_is_unknown_at_this_size_and_nccl_has_a_range():
    """Issue 11's seed case, 8x SM120, PCIe Gen5, 56 KiB (4 tokens x 7168 x 2 B): the pcie_ipc point
    is still below NCCL's, but its range is unknown (the kernel misses are too wide to order it
    against NCCL), so nothing can claim its low end is <= 40 % of NCCL's point."""
    ipc = BM.estimate(BackendName.pcie_ipc, SEED_BYTES, world_size=8, sm=SM120, pcie_gen=5, p2p=True)
    nccl = BM.estimate(BackendName.nccl, SEED_BYTES, world_size=8, sm=SM120, pcie_gen=5, p2p=True)
    assert ipc.label == nccl.label == "predicted"
    # PCIe IPC: only the SGLang 8x SM120 box covers 56 KiB (the L40S batch-1 figure is at 12 KiB, and
    # 56 KiB is more than 2x away): log-log between 12 KiB 5.3 us and 96 KiB 15.3 us = 11.62 us.
    p_ipc = _loglog(12288, 5.3, 98304, 15.3, SEED_BYTES)
    assert ipc.point_us == pytest.approx(p_ipc) and p_ipc == pytest.approx(11.62, abs=0.01)
    assert ipc.sources == ("sglang-docstring-pcie-ipc",)
    # range: 4 boxes, 22 residuals; centre ln(6.5 / 7.9) (ASUS's 4 KiB miss), robust s 1.59, so the
    # 80 % range would be e^(2 x 1.2816 x 1.59) = 59x wide, more than 8x: unknown, no range at all
    c, s, width, k = _kernel_fit_by_hand()
    assert k == 22 and c == pytest.approx(math.log(6.5 / 7.9))
    assert s == pytest.approx(1.590, abs=2e-3) and width == pytest.approx(59, abs=1)
    assert ipc.low_us is None and ipc.high_us is None
    assert ipc.unknown.startswith("unknown at this size: measure with fastverify tune")
    assert f"on 4 published boxes give a range {width:.0f}x wide (more than 8x)" in ipc.unknown
    assert "8x SM120 GPU (model not named)" in ipc.evidence
    # NCCL point: median over the SM12x boxes on PCIe Gen5 at 56 KiB (EPYC 9124 direct-attach and
    # luke's 3-switch Max-Q box; the SGLang SM120 box's generation is not stated).
    epyc = _loglog(32768, 24.9, 65536, 27.0, SEED_BYTES)
    luke = _loglog(32768, 24.5, 65536, 24.1, SEED_BYTES)
    p_nccl = statistics.median([epyc, luke])
    assert nccl.point_us == pytest.approx(p_nccl) and p_nccl == pytest.approx(25.38, abs=0.01)
    assert nccl.unknown is None and nccl.low_us < nccl.point_us < nccl.high_us
    assert nccl.high_us / nccl.low_us <= 8.0
    assert ipc.point_us / nccl.point_us == pytest.approx(0.458, abs=0.001)  # the point alone: no verdict


def test_normal_quantile_and_mad_constants_match_the_tables():
    from fastverify.tune import ranges as R

    assert R.Z == pytest.approx(Z80, abs=1e-4) and R.LEVEL == 0.80
    assert R.MAD_TO_SD == pytest.approx(MAD_SD, abs=1e-3)
    assert R.FLOOR == pytest.approx(math.sqrt(28.9 / 18.7), abs=0.01)  # FlashInfer PR #4393 run range
    # lower weighted median: 1 (w 1), 2 (w 1), 10 (w 2): half the weight (2) is reached at 2
    assert R.weighted_median([(10.0, 2.0), (1.0, 1.0), (2.0, 1.0)]) == 2.0
    assert R.weighted_median([(3.0, 1.0)]) == 3.0
    with pytest.raises(ValueError):
        R.weighted_median([])


def _box(i):
    return {"id": i, "gpu": f"GPU {i}", "sm": [12, 0], "gpu_count": 8, "pcie_gen": 5, "fabric": "switch",
            "numa": "one node", "link": f"https://example.org/{i}"}


def _meas(mid, box, backend, sizes, times, *, kernel="k", ws=8, p2p=True, settings="default"):
    return {"id": mid, "box": box, "backend": backend, "kernel": kernel, "world_size": ws, "p2p": p2p, "tool": "t",
            "settings": settings, "tuned": False, "dtype": None, "sizes_bytes": sizes, "times_us": times,
            "speedup_vs_nccl": None, "run_range_us": None, "read_from": "table", "cuda_graph": None,
            "table_file": None, "link": f"https://example.org/{mid}"}


def _synthetic_dict() -> dict:
    return {"version": 1, "description": "synthetic", "boxes": [_box("A"), _box("B"), _box("C")], "measurements": [
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


@pytest.fixture
def synthetic(tmp_path):
    """Three boxes A, B, C, all SM120 Gen5. NCCL TP8 default: 4 KiB .. 4 MiB, C = 2 B = 4 A at every
    size, so each of the 11 grid cells holds a, 2a, 4a. Each box's residual is ln(its value / the
    median of the other two): A ln(1 / 3), B ln(2 / 2.5) = ln 0.8, C ln(4 / 1.5) = ln(8 / 3).
    Kernel "k" (no backend), P2P on, A 5 us, B 15 us at 4 KiB (held to 8 KiB): 2 cells, residuals
    -ln 3 (A) and ln 3 (B). Left out by the comparable rule (each would change a residual): NCCL with
    settings changed on A, a pcie_ipc run with P2P off on C, kernel "k" with P2P unknown on C."""
    p = tmp_path / "synthetic.json"
    p.write_text(json.dumps(_synthetic_dict()))
    return BM.load(p)


def _by_box(residuals) -> dict[str, set[float]]:
    out: dict[str, set[float]] = {}
    for r in residuals:
        out.setdefault(r.box, set()).add(round(r.log_ratio, 9))
    return out


def test_residual_pools_by_hand(synthetic):
    from fastverify.tune import ranges as R

    ln3 = math.log(3)
    nccl = BM.published_residuals("nccl", data=synthetic)
    assert len(nccl) == 33 and {r.msg_bytes for r in nccl} == set(BM.SPREAD_GRID)
    assert _by_box(nccl) == {"A": {round(math.log(1 / 3), 9)}, "B": {round(math.log(0.8), 9)},
                             "C": {round(math.log(8 / 3), 9)}}
    # each box weighs 1 (1/11 per residual): the lower weighted median is B's ln 0.8
    assert R.weighted_median((r.log_ratio, 1 / 11) for r in nccl) == pytest.approx(math.log(0.8))
    k = BM.published_residuals("kernel", data=synthetic)  # the pcie_ipc cells have one box: no residual
    assert len(k) == 4 and _by_box(k) == {"A": {round(-ln3, 9)}, "B": {round(ln3, 9)}}
    # 3 boxes tell: fewer than MIN_BOXES (4), so the range is unknown, never a guess
    f = R.fit(nccl, world_size=8, msg_bytes=4096)
    assert not f.known and f.low is None and "3 published boxes, fewer than 4" in f.reason


def test_excluding_a_box_changes_the_residuals_no_leakage(synthetic):
    ln2 = math.log(2)
    full = _by_box(BM.published_residuals("nccl", data=synthetic))
    held = _by_box(BM.published_residuals("nccl", exclude_box="C", data=synthetic))
    # A and B only: each one's point is the other's value, ln(10 / 20) and ln(20 / 10)
    assert held == {"A": {round(-ln2, 9)}, "B": {round(ln2, 9)}} and held["A"] != full["A"]
    e = BM.estimate(BackendName.nccl, 4096, world_size=8, sm=SM120, data=synthetic, exclude_box="C")
    assert e.point_us == pytest.approx(15.0) and e.sources == ("a-nccl", "b-nccl")  # median of 10, 20
    assert e.low_us is None and "2 published boxes, fewer than 4" in e.unknown
    # the LOBO benchmark's pcie_ipc held-out SGLang box leaves the packaged kernel pool entirely, and
    # so does the L40S box, whose two TP8 cells had only these two boxes: the TP4 pair is left
    pool = BM.published_residuals("kernel", exclude_box="sglang-docstring-8xsm120")
    assert len(_by_box(BM.published_residuals("kernel"))) == 4
    assert set(_by_box(pool)) == {"rtx6kpro-wrx90-3switch-8xpro6000", "rtx6kpro-asus-esc8000a"}


def test_estimate_on_other_data_is_unknown_with_three_boxes_and_a_range_with_four(synthetic, tmp_path):
    e = BM.estimate(BackendName.nccl, 4096, world_size=8, sm=SM120, pcie_gen=5, data=synthetic)
    assert e.point_us == pytest.approx(20.0)  # median of 10, 20, 40; the tuned A run is not comparable
    assert e.sources == ("a-nccl", "b-nccl", "c-nccl")
    assert "3 comparable boxes (8x GPU A, 8x GPU B, 8x GPU C)" in e.evidence
    assert (e.low_us, e.high_us) == (None, None) and "fewer than 4" in e.unknown
    ipc = BM.estimate(BackendName.pcie_ipc, 4096, world_size=8, sm=SM120, p2p=True, data=synthetic)
    assert ipc.sources == ("a-ipc",) and ipc.point_us == 7.0 and ipc.low_us is None  # kernel pool: 2 boxes
    assert "2 published boxes" in ipc.unknown
    assert BM.comparable(BackendName.pcie_ipc, 8, data=synthetic) == [m for m in synthetic.measurements
                                                                       if m.id == "a-ipc"]
    # a fourth box D at 1.5 A: cells a, 1.5a, 2a, 4a. Residuals (own / median of the others):
    # A ln(1/2), D ln(1.5/2) = ln 0.75, B ln(2/1.5), C ln(4/1.5). Lower median c = ln 0.75; |r - c|:
    # D 0, A ln(2/3), B ln(16/9), C ln(32/9): MAD ln 1.5, s = 1.4826 ln 1.5 = 0.601; the range is
    # e^(c ± 1.2816 s) = x0.347 .. x1.621 (4.7x wide), beyond the 1.25 floor both ways.
    d = _synthetic_dict()
    d["boxes"].append(_box("D"))
    d["measurements"].append(_meas("d-nccl", "D", "nccl", [4096, 4194304], [15.0, 1500.0]))
    p = tmp_path / "four.json"
    p.write_text(json.dumps(d))
    four = BM.load(p)
    e4 = BM.estimate(BackendName.nccl, 4096, world_size=8, sm=SM120, pcie_gen=5, data=four)
    c, s = math.log(0.75), MAD_SD * math.log(1.5)
    assert e4.point_us == pytest.approx(17.5)  # median of 10, 15, 20, 40
    assert e4.unknown is None
    assert e4.low_us == pytest.approx(17.5 * math.exp(c - Z80 * s), rel=2e-3)  # 6.07 us
    assert e4.high_us == pytest.approx(17.5 * math.exp(c + Z80 * s), rel=2e-3)  # 28.4 us
    assert "4 published boxes left out one at a time (44 sizes)" in e4.evidence


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
    assert set(both.sources) == {"sglang-docstring-pcie-ipc", "flashinfer-pr4393-pcie-ipc-b1"}
    _, _, width, _ = _kernel_fit_by_hand()
    assert both.low_us is None and f"{width:.0f}x wide" in both.unknown  # 4 boxes, 59x: unknown
    only_l40s = BM.estimate(BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True,
                            exclude_box="sglang-docstring-8xsm120")
    assert only_l40s.sources == ("flashinfer-pr4393-pcie-ipc-b1",) and only_l40s.point_us == pytest.approx(21.8)
    # the held-out box is out of the residual pool too (and the L40S one with it, alone in its cells):
    # 2 boxes left, fewer than 4
    assert only_l40s.low_us is None and "2 published boxes, fewer than 4" in only_l40s.unknown
    assert BM.estimate(BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True,
                       exclude_box="flashinfer-pr4393-8xl40s").point_us == pytest.approx(5.3)


def test_interpolation_rule():
    s, v = (1000, 4000), (10.0, 40.0)
    assert BM.interpolate(s, v, 2000) == pytest.approx(20.0)  # log-log, slope 1
    assert BM.interpolate(s, v, 500) == 10.0 and BM.interpolate(s, v, 499) is None  # held flat, <= 2x
    assert BM.interpolate(s, v, 8000) == pytest.approx(80.0) and BM.interpolate(s, v, 8001) is None
    assert BM.interpolate((1000, 2000), (10.0, 100.0), 4000) == pytest.approx(200.0)  # slope clamped to 1
    assert BM.interpolate((1000,), (10.0,), 2000) == 10.0
