"""fastverify.tune.backend_model: the published-measurement file and the per-backend estimates.

Expected values are worked out here by hand from the numbers the sources print (named per test),
not read back from the module."""

from __future__ import annotations

import json
import math
from importlib import resources

import pytest

from fastverify.errors import UserError
from fastverify.registry import BackendName
from fastverify.tune import backend_model

SEED_BYTES = 4 * 7168 * 2  # Kimi-K2 hidden 7168, bf16, batch 1 x 4 draft tokens = 57,344 B
SM120 = (12, 0)


def _loglog(x0, y0, x1, y1, x):
    return math.exp(
        math.log(y0) + (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) * (math.log(y1) - math.log(y0))
    )


def _raw() -> dict:
    return json.loads(resources.files("fastverify.data").joinpath(backend_model.DATA_FILE).read_bytes())


def test_data_file_loads_strictly_and_every_record_has_a_link():
    data = backend_model.load()
    assert data.version == 1 and len(data.boxes) >= 9 and len(data.measurements) >= 19
    for r in (*data.boxes, *data.measurements):
        assert r.link.startswith("https://"), r.id
    # the SGLang docstring numbers, exactly as the source prints them (pcie_ipc_ar.py, SGLang 0.5.23)
    ipc = next(m for m in data.measurements if m.id == "sglang-docstring-pcie-ipc")
    assert ipc.times_us[:3] == (5.3, 15.3, 34.6) and ipc.sizes_bytes[:3] == (12288, 98304, 393216)
    assert ipc.backend is BackendName.pcie_ipc
    assert set(backend_model.published_boxes()) == {b.id for b in data.boxes}


@pytest.mark.parametrize(
    "mutate, says",
    [
        (lambda d: d["measurements"][0].pop("link"), "link"),
        (lambda d: d["measurements"][0].__setitem__("link", "blog.example"), "no https link"),
        (lambda d: d["measurements"][0].__setitem__("world_size", "eight"), "world_size"),
        (lambda d: d["measurements"][0].__setitem__("surprise", 1), "surprise"),
        (lambda d: d["measurements"][0].__setitem__("box", "nowhere"), "unknown box"),
        (lambda d: d["measurements"][0].__setitem__("times_us", [1.0]), "sizes but 1 values"),
        (lambda d: d["measurements"][0].__setitem__("backend", "pcie-ipc"), "backend"),
    ],
)
def test_bad_data_file_is_one_line_naming_the_file(tmp_path, mutate, says):
    d = _raw()
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(UserError) as ei:
        backend_model.load(p)
    msg = str(ei.value)
    assert str(p) in msg and says in msg and "\n" not in msg


MAD_SD = 1 / 0.6745  # 1 / normal 0.75 quantile (tables): MAD -> standard deviation


def test_seed_case_pcie_ipc_from_the_kernel_model():
    """The seed case, 8x SM120, PCIe Gen5, 56 KiB (4 tokens x 7168 x 2 B). PCIe IPC's point is the
    P2P kernel model's: latency = the median over boxes of each box's smallest-size (<= 4 KiB) P2P
    kernel times: V100 4.0 (4 KiB), EPYC 9124 7.5, WRX90 7.5 (1 KiB), luke 7.5 (256 B), ASUS
    median(6.2, 8.3, 6.1) = 6.2 -> 7.5 us; plus 7 x 57,344 B over PCIe Gen5 x16, 63.0 GB/s."""

    data = backend_model.load()
    assert backend_model.latency_us(data) == 7.5
    ipc = backend_model.estimate(BackendName.pcie_ipc, SEED_BYTES, world_size=8, sm=SM120, pcie_gen=5, p2p=True)
    assert ipc.label == "predicted"
    p_ipc = 7.5 + 7 * 57344 / 63000
    assert ipc.point_us == pytest.approx(p_ipc) and p_ipc == pytest.approx(13.87, abs=0.01)
    # the SGLang 8x SM120 table is the one pcie_ipc measurement at TP8 within 2x of 56 KiB
    assert ipc.sources == ("sglang-docstring-pcie-ipc",) and "sglang-docstring-pcie-ipc 11.6 µs" in ipc.evidence
    f = backend_model.fit(backend_model.kernel_residuals(data), world_size=8, msg_bytes=SEED_BYTES)
    assert f.known and f.boxes == 9 and (ipc.low_us, ipc.high_us) == pytest.approx((p_ipc * f.low, p_ipc * f.high))
    assert ipc.low_us < ipc.point_us < ipc.high_us and ipc.high_us / ipc.low_us <= 8.0


def test_kernel_model_residuals_by_hand():
    """ln(measured / model) of two published one-shot rows: sglang-V100 PR #2, 4x V100 (Gen3 by its
    GPU generation, 15.75 GB/s), 4 KiB 4.0 us: model 7.5 + 3 x 4096 / 15,750 = 8.28 us; EPYC 9124
    8x RTX PRO 6000 (Gen5), 1 MiB 288.6 us: 7.5 + 7 x 1,048,576 / 63,000 = 124.0 us. Leaving a box out
    leaves it out of the latency too: without the V100 box the latency is still 7.5 us."""

    data = backend_model.load()
    res = {(r.box, r.msg_bytes): r.log_ratio for r in backend_model.kernel_residuals(data)}
    assert res[("sglang-v100-pr2-4xv100", 4096)] == pytest.approx(math.log(4.0 / (7.5 + 3 * 4096 / 15750)))
    epyc = 7.5 + 7 * 1048576 / 63000
    assert res[("rtx6kpro-epyc9124-8xpro6000", 1048576)] == pytest.approx(math.log(288.6 / epyc))
    held = backend_model.kernel_residuals(data, "sglang-v100-pr2-4xv100")
    assert (
        "sglang-v100-pr2-4xv100" not in {r.box for r in held}
        and backend_model.latency_us(data, "sglang-v100-pr2-4xv100") == 7.5
    )
    assert len({r.box for r in backend_model.kernel_residuals(data)}) == 9


def test_range_constants_match_their_sources():
    assert (
        backend_model.LEVEL == 0.80
        and backend_model.LEVELS[0] == 0.5
        and backend_model.LEVELS[-1] == 0.975
        and len(backend_model.LEVELS) == 20
    )
    assert backend_model.MAD_TO_SD == pytest.approx(MAD_SD, abs=1e-3)
    assert backend_model.FLOOR == pytest.approx(math.sqrt(28.9 / 18.7), abs=0.01)  # FlashInfer PR #4393 run range
    # lower weighted median: 1 (w 1), 2 (w 1), 10 (w 2): half the weight (2) is reached at 2
    assert backend_model.weighted_median([(10.0, 2.0), (1.0, 1.0), (2.0, 1.0)]) == 2.0
    assert backend_model.weighted_median([(3.0, 1.0)]) == 3.0
    with pytest.raises(ValueError):
        backend_model.weighted_median([])


def _box(i):
    return {
        "id": i,
        "gpu": f"GPU {i}",
        "sm": [12, 0],
        "gpu_count": 8,
        "pcie_gen": 5,
        "fabric": "switch",
        "numa": "one node",
        "link": f"https://example.org/{i}",
    }


def _meas(mid, box, backend, sizes, times, *, kernel="k", ws=8, p2p=True, settings="default"):
    return {
        "id": mid,
        "box": box,
        "backend": backend,
        "kernel": kernel,
        "world_size": ws,
        "p2p": p2p,
        "tool": "t",
        "settings": settings,
        "tuned": False,
        "dtype": None,
        "sizes_bytes": sizes,
        "times_us": times,
        "speedup_vs_nccl": None,
        "run_range_us": None,
        "read_from": "table",
        "cuda_graph": None,
        "table_file": None,
        "link": f"https://example.org/{mid}",
    }


def _synthetic_dict() -> dict:
    return {
        "version": 1,
        "description": "synthetic",
        "boxes": [_box("A"), _box("B"), _box("C")],
        "measurements": [
            _meas("a-nccl", "A", "nccl", [4096, 4194304], [10.0, 1000.0]),
            _meas("b-nccl", "B", "nccl", [4096, 4194304], [20.0, 2000.0]),
            _meas("c-nccl", "C", "nccl", [4096, 4194304], [40.0, 4000.0]),
            _meas("a-nccl-tuned", "A", "nccl", [4096, 4194304], [900.0, 9.0], settings="NCCL_PROTO=LL"),
            _meas("a-k", "A", None, [4096], [5.0]),
            _meas("b-k", "B", None, [4096], [15.0]),
            _meas("c-k-unknown", "C", None, [4096], [500.0], p2p=None),
            _meas("a-ipc", "A", "pcie_ipc", [4096], [7.0]),
            _meas("c-ipc-no-p2p", "C", "pcie_ipc", [4096], [700.0], p2p=False),
        ],
    }


@pytest.fixture
def synthetic(tmp_path):
    """Three boxes A, B, C, all SM120 Gen5. NCCL TP8 default: 4 KiB .. 4 MiB, C = 2 B = 4 A.
    P2P kernels at 4 KiB (the kernel model's latency): "k" (no backend) A 5 us, B 15 us; pcie_ipc A
    7 us. Left out by the comparable rule: NCCL with settings changed on A, a pcie_ipc run with P2P
    off on C, kernel "k" with P2P unknown on C."""
    p = tmp_path / "synthetic.json"
    p.write_text(json.dumps(_synthetic_dict()))
    return backend_model.load(p)


def _by_box(residuals) -> dict[str, set[float]]:
    out: dict[str, set[float]] = {}
    for r in residuals:
        out.setdefault(r.box, set()).add(round(r.log_ratio, 9))
    return out


def test_kernel_pool_and_comparable_rows_by_hand(synthetic):
    # kernel latency: A median(5, 7) = 6, B 15 -> 10.5 us; C's two P2P rows are not comparable
    assert backend_model.latency_us(synthetic) == pytest.approx(10.5)
    assert {r.box for r in backend_model.kernel_residuals(synthetic)} == {"A", "B"}
    # without A: B's 15 us alone
    assert backend_model.latency_us(synthetic, "A") == pytest.approx(15.0)
    assert {r.box for r in backend_model.kernel_residuals(synthetic, "A")} == {"B"}
    # NCCL rows: default settings only (the tuned A run is not the baseline)
    assert [m.id for m in backend_model.comparable(BackendName.nccl, 8, data=synthetic)] == [
        "a-nccl",
        "b-nccl",
        "c-nccl",
    ]
    assert [m.id for m in backend_model.comparable(BackendName.nccl, 8, "C", data=synthetic)] == ["a-nccl", "b-nccl"]
    assert backend_model.comparable(BackendName.pcie_ipc, 8, data=synthetic) == [
        m for m in synthetic.measurements if m.id == "a-ipc"
    ]


def test_estimate_on_other_data_is_unknown_with_two_boxes(synthetic):
    ipc = backend_model.estimate(BackendName.pcie_ipc, 4096, world_size=8, sm=SM120, p2p=True, data=synthetic)
    # kernel model: 10.5 us latency + 7 x 4096 B / 63,000 (Gen5 by SM12x); its misses on 2 boxes
    assert ipc.sources == ("a-ipc",) and ipc.point_us == pytest.approx(10.5 + 7 * 4096 / 63000)
    assert ipc.low_us is None and "2 published boxes, fewer than 4" in ipc.unknown
    # leaving A out leaves pcie_ipc no published row at all: no number invented
    assert (
        backend_model.estimate(
            BackendName.pcie_ipc, 4096, world_size=8, sm=SM120, p2p=True, data=synthetic, exclude_box="A"
        )
        is None
    )
    with pytest.raises(ValueError, match="cost model"):
        backend_model.estimate(BackendName.nccl, 4096, world_size=8, sm=SM120, data=synthetic)


def test_four_boxes_that_disagree_get_no_range():
    """Four boxes with one miss each at all 11 sizes, A ln(1/2), D ln(0.75), B ln(4/3), C ln(8/3),
    no within-box spread. Left out in turn, the lowest and the highest box fall outside every span of
    the other three at every share, and the middle two are held only at shares >= 0.675 (all three
    offsets): 22 of 44, under 80 %: unknown, with the reason. (With one miss per box and no
    within-box spread the two extreme boxes are always out: such a pool needs 10 boxes.)"""

    res = [
        backend_model.Residual(b, 8, 4096 << k, math.log(x))
        for b, x in zip("ADBC", (1 / 2, 0.75, 4 / 3, 8 / 3))
        for k in range(11)
    ]
    f = backend_model.fit(res, world_size=8, msg_bytes=4096)
    assert not f.known and "no share of the 4 published boxes' misses holds 80 %" in f.reason


def test_disagreeing_sources_carry_the_note():
    ipc = backend_model.estimate(BackendName.pcie_ipc, SEED_BYTES, world_size=8, sm=SM120, p2p=True)
    assert any("one-shot all-to-all kernels collapse" in n and "fastverify tune" in n for n in ipc.notes)


def test_none_where_no_comparable_data_exist():
    assert (
        backend_model.estimate(BackendName.b12x, SEED_BYTES, world_size=8, sm=SM120, p2p=True) is None
    )  # no isolated figure
    # custom_ar's one PCIe figure (4x V100) makes it a kernel-model candidate at 2 GPUs too: 7.5 + 57,344 / 63,000
    assert backend_model.estimate(
        BackendName.custom_ar, SEED_BYTES, world_size=2, sm=SM120, p2p=True
    ).point_us == pytest.approx(7.5 + 57344 / 63000)
    assert (
        backend_model.estimate(BackendName.pcie_ipc, SEED_BYTES, world_size=8, sm=SM120, p2p=False) is None
    )  # needs P2P
    assert backend_model.estimate(BackendName.pcie_ipc, 0, world_size=8, sm=SM120, p2p=True) is None


def test_exclude_box_really_excludes():
    # 12 KiB, TP8, PCIe IPC on an SM89 box (Gen4 by its GPU generation, 31.5 GB/s): the kernel model's
    # point 7.5 + 7 x 12,288 / 31,500 = 10.23 us; the SGLang SM120 box (5.3 us) and the FlashInfer
    # PR #4393 L40S box (21.8 us) are the published pcie_ipc rows at this size.

    both = backend_model.estimate(BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True)
    assert both.point_us == pytest.approx(7.5 + 7 * 12288 / 31500)
    assert set(both.sources) == {"sglang-docstring-pcie-ipc", "flashinfer-pr4393-pcie-ipc-b1"}
    held = backend_model.estimate(
        BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True, exclude_box="sglang-docstring-8xsm120"
    )
    assert held.sources == ("flashinfer-pr4393-pcie-ipc-b1",)
    f = backend_model.kernel_fit(backend_model.load(), 12288, 8, "sglang-docstring-8xsm120")
    assert f.boxes == 8 and (held.low_us, held.high_us) == pytest.approx(
        (held.point_us * f.low, held.point_us * f.high)
    )
    assert backend_model.estimate(
        BackendName.pcie_ipc, 12288, world_size=8, sm=(8, 9), p2p=True, exclude_box="flashinfer-pr4393-8xl40s"
    ).sources == ("sglang-docstring-pcie-ipc",)


def test_interpolation_rule():
    s, v = (1000, 4000), (10.0, 40.0)
    assert backend_model.interpolate(s, v, 2000) == pytest.approx(20.0)  # log-log, slope 1
    assert (
        backend_model.interpolate(s, v, 500) == 10.0 and backend_model.interpolate(s, v, 499) is None
    )  # held flat, <= 2x
    assert (
        backend_model.interpolate(s, v, 8000) == pytest.approx(80.0) and backend_model.interpolate(s, v, 8001) is None
    )
    assert backend_model.interpolate((1000, 2000), (10.0, 100.0), 4000) == pytest.approx(200.0)  # slope clamped to 1
    assert backend_model.interpolate((1000,), (10.0,), 2000) == 10.0
