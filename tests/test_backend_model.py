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


MAD_SD = 1 / 0.6745  # 1 / normal 0.75 quantile (tables): MAD -> standard deviation


def test_seed_case_pcie_ipc_from_the_kernel_model_and_nccl_has_a_range():
    """The seed case, 8x SM120, PCIe Gen5, 56 KiB (4 tokens x 7168 x 2 B). PCIe IPC's point is the
    P2P kernel model's: latency = the median over boxes of each box's smallest-size (<= 4 KiB) P2P
    kernel times: V100 4.0 (4 KiB), EPYC 9124 7.5, WRX90 7.5 (1 KiB), luke 7.5 (256 B), ASUS
    median(6.2, 8.3, 6.1) = 6.2 -> 7.5 us; plus 7 x 57,344 B over PCIe Gen5 x16, 63.0 GB/s."""
    from fastverify.tune import kernel_cost as K
    from fastverify.tune import ranges as R

    data = BM.load()
    assert K.latency_us(data) == 7.5
    ipc = BM.estimate(BackendName.pcie_ipc, SEED_BYTES, world_size=8, sm=SM120, pcie_gen=5, p2p=True)
    nccl = BM.estimate(BackendName.nccl, SEED_BYTES, world_size=8, sm=SM120, pcie_gen=5, p2p=True)
    assert ipc.label == nccl.label == "predicted"
    p_ipc = 7.5 + 7 * 57344 / 63000
    assert ipc.point_us == pytest.approx(p_ipc) and p_ipc == pytest.approx(13.87, abs=0.01)
    # the SGLang 8x SM120 table is the one pcie_ipc measurement at TP8 within 2x of 56 KiB
    assert ipc.sources == ("sglang-docstring-pcie-ipc",) and "sglang-docstring-pcie-ipc 11.6 µs" in ipc.evidence
    f = R.fit(K.kernel_residuals(data), world_size=8, msg_bytes=SEED_BYTES)
    assert f.known and f.boxes == 8 and (ipc.low_us, ipc.high_us) == pytest.approx((p_ipc * f.low, p_ipc * f.high))
    assert ipc.low_us < ipc.point_us < ipc.high_us and ipc.high_us / ipc.low_us <= 8.0
    # NCCL point: median over the SM12x boxes on PCIe Gen5 at 56 KiB (EPYC 9124 direct-attach and
    # luke's 3-switch Max-Q box; the SGLang SM120 box's generation is not stated).
    epyc = _loglog(32768, 24.9, 65536, 27.0, SEED_BYTES)
    luke = _loglog(32768, 24.5, 65536, 24.1, SEED_BYTES)
    p_nccl = statistics.median([epyc, luke])
    assert nccl.point_us == pytest.approx(p_nccl) and p_nccl == pytest.approx(25.38, abs=0.01)


def test_kernel_model_residuals_by_hand():
    """ln(measured / model) of two published one-shot rows: sglang-V100 PR #2, 4x V100 (Gen3 by its
    GPU generation, 15.75 GB/s), 4 KiB 4.0 us: model 7.5 + 3 x 4096 / 15,750 = 8.28 us; EPYC 9124
    8x RTX PRO 6000 (Gen5), 1 MiB 288.6 us: 7.5 + 7 x 1,048,576 / 63,000 = 124.0 us. Leaving a box out
    leaves it out of the latency too: without the V100 box the latency is still 7.5 us."""
    from fastverify.tune import kernel_cost as K

    data = BM.load()
    res = {(r.box, r.msg_bytes): r.log_ratio for r in K.kernel_residuals(data)}
    assert res[("sglang-v100-pr2-4xv100", 4096)] == pytest.approx(math.log(4.0 / (7.5 + 3 * 4096 / 15750)))
    epyc = 7.5 + 7 * 1048576 / 63000
    assert res[("rtx6kpro-epyc9124-8xpro6000", 1048576)] == pytest.approx(math.log(288.6 / epyc))
    held = K.kernel_residuals(data, "sglang-v100-pr2-4xv100")
    assert "sglang-v100-pr2-4xv100" not in {r.box for r in held} and K.latency_us(data, "sglang-v100-pr2-4xv100") == 7.5
    assert len({r.box for r in K.kernel_residuals(data)}) == 8


def test_range_constants_match_their_sources():
    from fastverify.tune import ranges as R

    assert R.LEVEL == 0.80 and R.LEVELS[0] == 0.5 and R.LEVELS[-1] == 0.975 and len(R.LEVELS) == 20
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
    P2P kernels at 4 KiB (the kernel model's latency): "k" (no backend) A 5 us, B 15 us; pcie_ipc A
    7 us. Left out by the comparable rule: NCCL with settings changed on A, a pcie_ipc run with P2P
    off on C, kernel "k" with P2P unknown on C."""
    p = tmp_path / "synthetic.json"
    p.write_text(json.dumps(_synthetic_dict()))
    return BM.load(p)


def _by_box(residuals) -> dict[str, set[float]]:
    out: dict[str, set[float]] = {}
    for r in residuals:
        out.setdefault(r.box, set()).add(round(r.log_ratio, 9))
    return out


def test_residual_pools_by_hand(synthetic):
    from fastverify.tune import kernel_cost as K
    from fastverify.tune import ranges as R

    nccl = BM.published_residuals(data=synthetic)
    assert len(nccl) == 33 and {r.msg_bytes for r in nccl} == set(BM.SPREAD_GRID)
    assert _by_box(nccl) == {"A": {round(math.log(1 / 3), 9)}, "B": {round(math.log(0.8), 9)},
                             "C": {round(math.log(8 / 3), 9)}}
    # kernel latency: A median(5, 7) = 6, B 15 -> 10.5 us; C's two P2P rows are not comparable
    assert K.latency_us(synthetic) == pytest.approx(10.5)
    assert {r.box for r in K.kernel_residuals(synthetic)} == {"A", "B"}
    # 3 boxes tell: fewer than MIN_BOXES (4), so the range is unknown, never a guess
    f = R.fit(nccl, world_size=8, msg_bytes=4096)
    assert not f.known and f.low is None and "3 published boxes, fewer than 4" in f.reason


def test_excluding_a_box_changes_the_residuals_no_leakage(synthetic):
    from fastverify.tune import kernel_cost as K

    ln2 = math.log(2)
    full = _by_box(BM.published_residuals(data=synthetic))
    held = _by_box(BM.published_residuals(exclude_box="C", data=synthetic))
    # A and B only: each one's point is the other's value, ln(10 / 20) and ln(20 / 10)
    assert held == {"A": {round(-ln2, 9)}, "B": {round(ln2, 9)}} and held["A"] != full["A"]
    e = BM.estimate(BackendName.nccl, 4096, world_size=8, sm=SM120, data=synthetic, exclude_box="C")
    assert e.point_us == pytest.approx(15.0) and e.sources == ("a-nccl", "b-nccl")  # median of 10, 20
    assert e.low_us is None and "2 published boxes, fewer than 4" in e.unknown
    # the kernel model's pool without a box has none of its misses (the SGLang box has no row <= 4 KiB,
    # so the latency stays 7.5 us)
    pool = {r.box for r in K.kernel_residuals(BM.load(), "sglang-docstring-8xsm120")}
    assert "sglang-docstring-8xsm120" not in pool and len(pool) == 7
    assert K.latency_us(BM.load(), "sglang-docstring-8xsm120") == 7.5


def test_estimate_on_other_data_is_unknown_with_three_boxes_and_with_four_that_disagree(synthetic, tmp_path):
    e = BM.estimate(BackendName.nccl, 4096, world_size=8, sm=SM120, pcie_gen=5, data=synthetic)
    assert e.point_us == pytest.approx(20.0)  # median of 10, 20, 40; the tuned A run is not comparable
    assert e.sources == ("a-nccl", "b-nccl", "c-nccl")
    assert "3 comparable boxes (8x GPU A, 8x GPU B, 8x GPU C)" in e.evidence
    assert (e.low_us, e.high_us) == (None, None) and "fewer than 4" in e.unknown
    ipc = BM.estimate(BackendName.pcie_ipc, 4096, world_size=8, sm=SM120, p2p=True, data=synthetic)
    # kernel model: 10.5 us latency + 7 x 4096 B / 63,000 (Gen5 by SM12x); its misses on 2 boxes
    assert ipc.sources == ("a-ipc",) and ipc.point_us == pytest.approx(10.5 + 7 * 4096 / 63000)
    assert ipc.low_us is None and "2 published boxes" in ipc.unknown
    assert BM.comparable(BackendName.pcie_ipc, 8, data=synthetic) == [m for m in synthetic.measurements
                                                                       if m.id == "a-ipc"]
    # a fourth box D at 1.5 A: cells a, 1.5a, 2a, 4a; each box's miss (own / median of the others) is
    # the same at all 11 sizes: A ln(1/2), D ln(0.75), B ln(4/3), C ln(8/3), no within-box spread.
    # Left out in turn, the lowest and the highest box fall outside every span of the other three at
    # every share, and the middle two are held only at shares >= 0.675 (all three offsets): 22 of 44,
    # under 80 %: unknown, with the reason. (With one miss per box and no within-box spread the two
    # extreme boxes are always out, so such a pool needs 10 boxes to reach 80 %.)
    d = _synthetic_dict()
    d["boxes"].append(_box("D"))
    d["measurements"].append(_meas("d-nccl", "D", "nccl", [4096, 4194304], [15.0, 1500.0]))
    p = tmp_path / "four.json"
    p.write_text(json.dumps(d))
    four = BM.load(p)
    e4 = BM.estimate(BackendName.nccl, 4096, world_size=8, sm=SM120, pcie_gen=5, data=four)
    assert e4.point_us == pytest.approx(17.5)  # median of 10, 15, 20, 40
    assert e4.low_us is None and "no share of the 4 published boxes' misses holds 80 %" in e4.unknown


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
    # custom_ar's one PCIe figure (4x V100) makes it a kernel-model candidate at 2 GPUs too: 7.5 + 57,344 / 63,000
    assert BM.estimate(BackendName.custom_ar, SEED_BYTES, world_size=2, sm=SM120, p2p=True).point_us == \
        pytest.approx(7.5 + 57344 / 63000)
    assert BM.estimate(BackendName.pcie_ipc, SEED_BYTES, world_size=8, sm=SM120, p2p=False) is None  # needs P2P
    assert BM.estimate(BackendName.nccl, SEED_BYTES, world_size=3, sm=SM120) is None
    assert BM.estimate(BackendName.nccl, 8, world_size=8, sm=SM120) is None  # nearest default table starts at 256 B

def test_exclude_box_really_excludes():
    # 12 KiB, TP8, PCIe IPC on an SM89 box (Gen4 by its GPU generation, 31.5 GB/s): the kernel model's
    # point 7.5 + 7 x 12,288 / 31,500 = 10.23 us; the SGLang SM120 box (5.3 us) and the FlashInfer
    # PR #4393 L40S box (21.8 us) are the published pcie_ipc rows at this size.
    from fastverify.tune import kernel_cost as K

    both = BM.estimate(BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True)
    assert both.point_us == pytest.approx(7.5 + 7 * 12288 / 31500)
    assert set(both.sources) == {"sglang-docstring-pcie-ipc", "flashinfer-pr4393-pcie-ipc-b1"}
    held = BM.estimate(BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True,
                       exclude_box="sglang-docstring-8xsm120")
    assert held.sources == ("flashinfer-pr4393-pcie-ipc-b1",)
    f = K.kernel_fit(BM.load(), 12288, 8, "sglang-docstring-8xsm120")
    assert f.boxes == 7 and (held.low_us, held.high_us) == pytest.approx((held.point_us * f.low, held.point_us * f.high))
    assert BM.estimate(BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True,
                       exclude_box="flashinfer-pr4393-8xl40s").sources == ("sglang-docstring-pcie-ipc",)


def test_interpolation_rule():
    s, v = (1000, 4000), (10.0, 40.0)
    assert BM.interpolate(s, v, 2000) == pytest.approx(20.0)  # log-log, slope 1
    assert BM.interpolate(s, v, 500) == 10.0 and BM.interpolate(s, v, 499) is None  # held flat, <= 2x
    assert BM.interpolate(s, v, 8000) == pytest.approx(80.0) and BM.interpolate(s, v, 8001) is None
    assert BM.interpolate((1000, 2000), (10.0, 100.0), 4000) == pytest.approx(200.0)  # slope clamped to 1
    assert BM.interpolate((1000,), (10.0,), 2000) == 10.0
