"""Ranges from the point's own misses, per-size verdicts, crossovers and tok/s only with a cycle."""

from __future__ import annotations

import importlib.util
import math
import statistics
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import pytest

from fastverify.registry import BackendName
from fastverify.tune import candidates as C
from fastverify.tune import per_size as P
from fastverify.tune import ranges as R

REPO = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_model", REPO / "benchmarks" / "bench_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lobo_of_the_nccl_figure_covers_80_percent_and_reports_abstention():
    r = _bench().lobo_cost_model()
    pts = [p for pts in r["boxes"].values() for p in pts]
    inside = sum(p["inside"] for p in pts)
    answered = [p for p in pts if not p["abstained"]]
    assert r["all_points"] == len(pts) and r["abstained"] == len(pts) - len(answered)
    assert inside / len(pts) >= 0.8  # unknowns counted as misses
    # every answered range holds its point and is never zero-width
    assert all(p["low_us"] < p["point_us"] < p["high_us"] for p in answered)
    # the median width is what the data gives (4.8x on the packaged file, the 4x aim missed): at most 8x
    assert statistics.median(p["width"] for p in answered) <= R.MAX_WIDTH


def test_lobo_of_p2p_kernels_abstains_where_the_evidence_is_thin():
    b = _bench()
    for backend in (BackendName.pcie_ipc, BackendName.custom_ar):
        r = b.lobo(backend)
        answered = [p for pts in r["boxes"].values() for p in pts if not p["abstained"]]
        if answered:  # where it answers: the aim holds
            assert sum(p["inside"] for p in answered) / len(answered) >= 0.8
            assert statistics.median(p["width"] for p in answered) <= 4.0
        assert r["abstained"] == r["all_points"] - len(answered)


def test_fit_by_hand():
    # 4 boxes, one residual each: ln 0.8, 0, ln 1.25, ln 2 -> lower weighted median 0, |r| lower median ln 1.25
    res = [R.Residual(b, 8, 65536, math.log(x)) for b, x in zip("ABCD", (0.8, 1.0, 1.25, 2.0))]
    f = R.fit(res, world_size=8, msg_bytes=65536)
    s = 1.4826 * math.log(1.25)
    assert f.centre == pytest.approx(0.0)
    assert f.scale == pytest.approx(s)
    assert (f.low, f.high) == pytest.approx((math.exp(-1.2816 * s), math.exp(1.2816 * s)), rel=1e-3)  # x0.65 .. x1.53
    assert not R.fit(res[:3], world_size=8, msg_bytes=65536).known  # 3 boxes < MIN_BOXES
    assert not R.fit(res, world_size=32, msg_bytes=65536).known  # 32 GPUs is 4x from 8
    assert not R.fit(res, world_size=8, msg_bytes=1 << 20).known  # 16x beyond the sizes
    # ln 0.5, 0, ln 2, ln 8: s = 1.4826 ln 2, width e^(2 x 1.2816 s) = 13.9x > 8x: unknown, not a wide range
    wide = [R.Residual(b, 8, 65536, math.log(x)) for b, x in zip("ABCD", (0.5, 1.0, 2.0, 8.0))]
    assert not R.fit(wide, world_size=8, msg_bytes=65536).known


def test_a_seven_gpu_box_gets_a_range_that_is_not_zero_width():
    f = R.nccl_fit(57344, 7)
    assert f.known and f.low < 1 < f.high
    assert f.width > R.FLOOR ** 2


def _fig(name, backend, per, nccl=None):
    return C.Figure(backend, name, MappingProxyType({}), sum(p for p, _ in per.values()), (1.0, 2.0), (),
                    nccl=nccl, per_call_us=MappingProxyType({b: p for b, (p, _) in per.items()}),
                    per_call_range=MappingProxyType({b: r for b, (_, r) in per.items()}))


def test_per_size_verdicts_and_crossover_by_hand():
    wl = SimpleNamespace(msg_sizes=((16384, 1), (65536, 1), (262144, 1)))
    nccl = _fig("current environment", BackendName.nccl,
                {16384: (40.0, (30.0, 50.0)), 65536: (45.0, (35.0, 55.0)), 262144: (60.0, (50.0, 70.0))}, nccl=object())
    ipc = _fig("pcie_ipc", BackendName.pcie_ipc,
               {16384: (10.0, (8.0, 12.0)), 65536: (40.0, (30.0, 50.0)), 262144: (90.0, (80.0, 100.0))})
    rows, cross = P.per_size_rows(wl, [nccl, ipc])
    assert [r["verdict"] for r in rows] == ["pcie_ipc", P.TOO_CLOSE, "current environment"]
    # NCCL's point 45 > 40 at 64 KiB, 60 <= 90 at 256 KiB: the crossover is 262144 B
    assert cross == {"pcie_ipc": 262144}
    assert P.per_size_rows(SimpleNamespace(msg_sizes=((16384, 1),)), [nccl, ipc])[1] == {"pcie_ipc": None}
    unknown = _fig("pcie_ipc", BackendName.pcie_ipc, {16384: (10.0, None)})
    rows, cross = P.per_size_rows(SimpleNamespace(msg_sizes=((16384, 1),)), [nccl, unknown])
    assert rows[0]["verdict"] == P.UNKNOWN == C.UNKNOWN and rows[0]["winner"] is None
    assert cross == {}  # no range at any size: no crossover is claimed from its point


def test_b12x_with_no_fitting_size_is_not_a_candidate():
    from fastverify.registry import backend_info

    info = backend_info(BackendName.b12x)
    hidden = 7168
    rows = info.max_rows + 10
    wl = SimpleNamespace(dtype="bfloat16", hidden=hidden, msg_sizes=((rows * 2 * hidden, 3),), tp=8)
    base = SimpleNamespace(per_call_us={rows * 2 * hidden: 50.0})
    out = C._backend_figure(info, wl, base, sm=(12, 0), pcie_gen=5, p2p_ok=True, estimate=None)
    assert isinstance(out, str) and "not a candidate" in out and f"{info.max_rows} rows" in out


SEED = ["--topology", str(REPO.parent / "shared" / "inputs" / "topo-nccl-tests-307.txt"), "--model", "kimi-k2.5",
        "--tp-size", "8", "--sm", "120", "--pcie-gen", "5"]


def _run(args, capsys):
    from fastverify.cli import main

    rc = main(["tune", "--predict", *args])
    return rc, capsys.readouterr().out


@pytest.mark.skipif(not Path(SEED[1]).is_file(), reason="shared inputs absent")
def test_no_tok_s_without_a_cycle_text_and_json(capsys):
    import json

    rc, text = _run(SEED, capsys)
    assert rc == 0 and "tok/s" not in text and "2098" not in text
    rc, out = _run([*SEED, "--json"], capsys)
    doc = json.loads(out)
    assert all(c["tok_s"] is None for c in doc["candidates"])
    assert "no tok/s" in doc["tok_s_reason"]
    rc, text = _run([*SEED, "--tok-s", "82", "--accept-length", "3"], capsys)
    assert "tok/s per stream" in text and len(text.strip().splitlines()) <= 20
    assert "per size: 57 KB" in text


@pytest.mark.skipif(not Path(SEED[1]).is_file(), reason="shared inputs absent")
def test_baseline_evidence_names_the_cost_model_as_the_point(capsys):
    import json

    _, out = _run([*SEED, "--json"], capsys)
    ev = json.loads(out)["baseline"]["evidence"]
    assert any("point = the cost model" in e for e in ev)
    assert not any("median of the SM12x boxes" in e for e in ev)
    assert any(e.startswith("range: the NCCL cost model's point x/÷ its misses") for e in ev)
