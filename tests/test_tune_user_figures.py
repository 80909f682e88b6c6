"""``tune --predict`` from the user's own four figures (verify 30 ms, all-reduce 25 ms of it, 82 tok/s,
accept length 3), and the per-size rows of the measure-mode JSON document.

Expected numbers are worked out here: a candidate's all-reduce is 25 ms × its predicted ratio to the
predicted baseline (the same command without the user's figures gives both), its verify time
``30 − 25 + all-reduce`` ms, its tok/s ``3 / (3/82 s − 30 ms + verify)``.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import SHARED, assert_user_error, run_fastverify, two_rank_trace_profile

from fastverify.cli import main
from fastverify.errors import UserError

TOPO_307 = SHARED / "inputs" / "topo-nccl-tests-307.txt"
KIMI = ["--model", "kimi-k2", "--tp", "8", "--sm", "120", "--pcie-gen", "5"]
MINE = ["--verify-ms", "30", "--allreduce-ms", "25"]
A, TOK_S, VERIFY_S, ALLREDUCE_S = 3.0, 82.0, 0.030, 0.025
needs_topo = pytest.mark.skipif(not TOPO_307.is_file(), reason=f"{TOPO_307} absent (../shared/inputs)")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("NCCL_")]:
        monkeypatch.delenv(k)


@pytest.fixture
def no_nvml(monkeypatch):
    """A machine without GPUs, whatever this one has."""

    def refuse(*_a, **_k):
        raise UserError("NVML: no GPUs here")

    monkeypatch.setattr("fastverify.tune.command.read_nvml_topology", refuse)


def _run(argv, capsys):
    rc = main(["tune", "--predict", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _json(argv, capsys):
    rc, out, err = _run([*argv, "--json"], capsys)
    assert rc == 0, err
    return json.loads(out), err


def _ranked_others(doc):
    return [c for c in doc["candidates"] if not c["is_baseline"] and c["allreduce_us_per_step"] is not None]


@needs_topo
def test_figures_with_tok_s(capsys):
    doc, _ = _json(["--topology", TOPO_307, *KIMI, *MINE, "--tok-s", "82", "--accept-length", "3"], capsys)
    pred, _ = _json(["--topology", TOPO_307, *KIMI, "--accept-length", "3"], capsys)  # the same, predicted only
    base = doc["baseline"]
    assert base["label"] == "measured-by-user" and base["bound"] is None
    assert base["allreduce_us_per_step"] == pytest.approx(25_000.0)
    assert base["verify_ms"] == pytest.approx(30.0) and base["tok_s"] == pytest.approx(82.0, abs=0.01)
    u = doc["user_figures"]
    assert (u["label"], u["verify_ms"], u["allreduce_ms"], u["tok_s"], u["bound"]) == (
        "measured-by-user",
        30,
        25,
        82,
        "upper",
    )
    assert u["t_rest_ms"] == pytest.approx((A / TOK_S - VERIFY_S) * 1e3) and "fastverify collect" in u["settle"]
    assert doc["verify_baseline_basis"].startswith("measured-by-user")
    pred_base = pred["baseline"]["allreduce_us_per_step"]
    pred_by = {(c["backend"], c["name"]): c["allreduce_us_per_step"] for c in pred["candidates"]}
    others = _ranked_others(doc)
    assert len(others) >= 3 and {c["backend"] for c in others} == {"nccl", "pcie_ipc"}
    # pcie_ipc (the P2P kernel model) on the user's scale: its ratio to the predicted baseline x 25 ms,
    # its range likewise; NCCL's figures are the cost model's ratio x 25 ms, with no range left, so
    # pcie_ipc's whole range below NCCL_P2P_LEVEL=SYS's figure decides it: the winner, nothing too close
    ipc = next(c for c in doc["candidates"] if c["backend"] == "pcie_ipc")
    p_ipc = next(c for c in pred["candidates"] if c["backend"] == "pcie_ipc")
    k = 25_000.0 / pred_base
    assert ipc["allreduce_us_per_step_range"] == pytest.approx(
        [k * x for x in p_ipc["allreduce_us_per_step_range"]], rel=1e-4
    )
    level = next(c for c in others if c["settings"] == {"NCCL_P2P_LEVEL": "SYS"})
    assert ipc["allreduce_us_per_step_range"][1] < level["allreduce_us_per_step"]
    assert doc["too_close_to_call"] == {} and doc["winner"] == "pcie_ipc"
    assert pred["winner"] == "NCCL_P2P_LEVEL=SYS" and "pcie_ipc" in pred["too_close_to_call"]
    for c in others:
        # faster than the baseline: an upper bound on the gain; slower: the loss is at most the figure
        assert c["label"] == "predicted" and c["bound"] == (
            "upper" if c["allreduce_us_per_step"] < 25_000.0 else "lower"
        )
        ratio = pred_by[(c["backend"], c["name"])] / pred_base
        assert c["allreduce_us_per_step"] == pytest.approx(25_000.0 * ratio, rel=1e-4)
        assert c["verify_ms"] == pytest.approx(5.0 + c["allreduce_us_per_step"] / 1e3, abs=2e-4)
        assert c["tok_s"] == pytest.approx(A / (A / TOK_S - VERIFY_S + c["verify_ms"] / 1e3), rel=1e-3)
    # the brief's check: an all-reduce of 0 leaves verify 5 ms and 3 / 11.585 ms
    assert A / (A / TOK_S - VERIFY_S + (VERIFY_S - ALLREDUCE_S)) == pytest.approx(258.95, abs=0.01)
    assert any("UPPER BOUND" in n and "fastverify report BUNDLE" in n for n in doc["notes"])


@needs_topo
def test_text_output_labels_the_baseline_and_says_upper_bound(capsys):
    rc, out, err = _run(["--topology", TOPO_307, *KIMI, *MINE, "--tok-s", "82", "--accept-length", "3"], capsys)
    assert rc == 0, err
    text = " ".join(out.split())  # rich wraps long lines
    # the winner, pcie_ipc (decided on the user's scale, test_figures_with_tok_s): its predicted ratio
    # to the predicted baseline x 25 ms, plus the 5 ms of compute the figures leave: 5 + 25 x ratio ms
    pred, _ = _json(["--topology", TOPO_307, *KIMI, "--accept-length", "3"], capsys)
    win = next(c for c in pred["candidates"] if c["backend"] == "pcie_ipc")
    v = 5.0 + 25.0 * win["allreduce_us_per_step"] / pred["baseline"]["allreduce_us_per_step"]
    assert v == pytest.approx(5.0 + 25.0 * 123 * (7.5 + 7 * 57344 / 63000) / pred["baseline"]["allreduce_us_per_step"])
    assert (
        f"verify step: 30.000 ms (measured-by-user) -> {v:.3f} ms (predicted), "
        f"{100 * (v - 30.0) / 30.0:+.1f} % (upper bound)"
    ) in text
    assert "winner: pcie_ipc: all-reduce per verify step" in text
    assert "tok/s per stream at accept length 3: 82.0 (measured-by-user) ->" in text
    assert "all-reduce per verify step 25,000.0 µs (measured-by-user) ->" in text
    assert "measured-by-user" in text.split("┃")[-1]  # the table's baseline row
    # why it is an upper bound, and how to settle it: behind --explain
    rc, out, err = _run(
        ["--topology", TOPO_307, *KIMI, *MINE, "--tok-s", "82", "--accept-length", "3", "--explain"], capsys
    )
    text = " ".join(out.split())
    assert "UPPER BOUND" in text and "`fastverify collect`" in text and "`fastverify report BUNDLE`" in text


@needs_topo
def test_without_tok_s_there_is_no_tok_s(capsys):
    doc, _ = _json(["--topology", TOPO_307, *KIMI, *MINE], capsys)
    for c in (doc["baseline"], *doc["candidates"]):
        assert c["tok_s"] is None and c["tok_s_range"] is None
    assert doc["user_figures"]["tok_s"] is None and "--tok-s" in doc["user_figures"]["tok_s_note"]
    for c in _ranked_others(doc):  # the all-reduce change and verify time are still there
        assert c["verify_ms"] == pytest.approx(5.0 + c["allreduce_us_per_step"] / 1e3, abs=2e-4)
    rc, out, _ = _run(["--topology", TOPO_307, *KIMI, *MINE], capsys)
    assert rc == 0
    text = " ".join(out.split())
    assert "tok/s per stream at" not in text and "tok/s" not in text  # no tok/s column either
    rc, out, _ = _run(["--topology", TOPO_307, *KIMI, *MINE, "--explain"], capsys)
    assert rc == 0
    text = " ".join(out.split())
    assert "tok/s per stream at" not in text and "no tok/s figures: without --tok-s" in text
    assert "upper bound: the rest of the cycle" not in text  # no starred tok/s either
    head = [line for line in out.splitlines() if line.startswith("┃")]
    assert len(head) == 1 and "verify ms" in head[0] and "tok/s" not in head[0]  # no tok/s column at all


def test_no_topology_and_no_nvml_assumes_a_box_and_says_so(no_nvml, capsys, tmp_path):
    doc, err = _json([*MINE, "--tok-s", "82", "--accept-length", "3"], capsys)
    assert doc["box"]["topology"].startswith("assumed box: 2 GPUs") and doc["user_figures"]["topology_assumed"]
    assert any(n.startswith("assumed box") for n in doc["notes"])
    assert any("tiny preset" in n for n in doc["notes"])  # the default workload is said too
    assert doc["baseline"]["label"] == "measured-by-user"
    for c in _ranked_others(doc):
        assert c["tok_s"] == pytest.approx(A / (A / TOK_S - VERIFY_S + c["verify_ms"] / 1e3), rel=1e-3)
    rc, out, _ = _run([*MINE, "--tok-s", "82"], capsys)
    assert rc == 0 and "assumed box" in out
    rc, _, err = _run([*MINE, "--write-env", tmp_path / "k.env"], capsys)
    assert rc == 2 and "--write-env" in err and "--topology" in err and not (tmp_path / "k.env").exists()


def test_without_figures_predict_still_needs_a_topology(no_nvml, capsys):
    rc, _, err = _run(["--tok-s", "82"], capsys)
    assert rc == 2 and "--topology" in err


@needs_topo
def test_env_file_header_labels_the_baseline(tmp_path, capsys):
    env = tmp_path / "k.env"
    rc, _, err = _run(["--topology", TOPO_307, *KIMI, *MINE, "--tok-s", "82", "--write-env", env], capsys)
    assert rc == 0, err
    header = [line for line in env.read_text().splitlines() if line.startswith("#")]
    text = "\n".join(header)
    assert "baseline, measured-by-user" in text and "82.0 (measured-by-user)" in text
    assert "baseline measured-by-user: verify 30 ms per step, all-reduce 25 ms" in text and "UPPER BOUND" in text


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--predict", "--verify-ms", "30"], ["--verify-ms 30", "--allreduce-ms"]),
        (["--predict", "--allreduce-ms", "25"], ["--allreduce-ms 25", "--verify-ms"]),
        (["--predict", "--verify-ms", "nan", "--allreduce-ms", "1"], ["--verify-ms nan"]),
        (["--predict", "--verify-ms", "inf", "--allreduce-ms", "1"], ["--verify-ms inf"]),
        (["--predict", "--verify-ms", "61000", "--allreduce-ms", "1"], ["--verify-ms 61000"]),
        (["--predict", "--verify-ms", "30", "--allreduce-ms", "0"], ["--allreduce-ms 0"]),
        (["--predict", "--verify-ms", "30", "--allreduce-ms", "-2"], ["--allreduce-ms -2"]),
        (["--predict", "--verify-ms", "30", "--allreduce-ms", "31"], ["--allreduce-ms 31", "--verify-ms 30"]),
        (["--predict", "--verify-ms", "abc", "--allreduce-ms", "1"], ["--verify-ms", "abc"]),
        (["--predict", *MINE, "--tok-s", "200", "--accept-length", "3"], ["--tok-s 200", "measured-by-user"]),
        (MINE, ["--verify-ms 30", "--predict"]),
        (["--predict", "--profile", "p.json", *MINE], ["--verify-ms 30", "p.json", "contradicts"]),
    ],
)
def test_bad_figures_exit_2_with_one_line(tmp_path, extra, words):
    (tmp_path / "p.json").write_text(json.dumps(two_rank_trace_profile()))  # verify 20 us, all-reduce 5 us
    assert_user_error(run_fastverify(["tune", *extra], cwd=tmp_path), *words)


@needs_topo
def test_figures_that_agree_with_the_profile_leave_it_in_charge(tmp_path, capsys):
    (tmp_path / "p.json").write_text(json.dumps(two_rank_trace_profile()))
    doc, err = _json(
        ["--topology", TOPO_307, "--profile", tmp_path / "p.json", "--verify-ms", "0.0201", "--allreduce-ms", "0.005"],
        capsys,
    )
    assert "user_figures" not in doc and doc["baseline"]["label"] != "measured-by-user"
    assert doc["verify_baseline_basis"].startswith("measured (trace")  # the profile's own window
    assert "agree with --profile" in " ".join(err.split())


# --- Task B: per-size rows of the measure-mode document -------------------------------------------


def test_measured_document_has_the_per_size_rows():
    from fastverify.live.config import load_model_config
    from fastverify.tune.printer import measured_document
    from fastverify.tune.ranking import rank_candidates
    from fastverify.tune.trial import SizeResult, TrialResult, TrialSpec
    from fastverify.tune.workload import workload_from_model

    common = dict(backend="gloo", world_size=2, device="cpu", dtype="bfloat16", hidden=64, sizes=((64, 2), (512, 4)))
    specs = [
        TrialSpec(env={}, label="baseline", baseline=True, **common),
        TrialSpec(env={"NCCL_PROTO": "LL"}, label="ll", **common),
    ]
    rows = {
        "baseline": (SizeResult(64, 128, 2, 10.0, 12.5, 0.0), SizeResult(512, 1024, 4, 20.0, None, 0.0)),
        "ll": (SizeResult(64, 128, 2, 9.0, 9.5, 0.0), SizeResult(512, 1024, 4, None, None, None)),
    }
    step = {"baseline": 2 * 10.0 + 4 * 20.0, "ll": 2 * 9.0}
    results = [
        TrialResult(s.trial_id, "ok", "", rows[s.label], step[s.label], "cpu_wall_clock", 0.0, 1.0) for s in specs
    ]
    workload = workload_from_model(load_model_config("tiny"), tp=2, draft_tokens=4, batch=1)
    doc = measured_document(
        rank_candidates(specs, results), workload, accept_length=None, tok_s=None, box={"device": "cpu"}
    )
    want = {
        "baseline": [
            {"msg_bytes": 128, "count_per_step": 2, "median_us": 10.0, "p90_us": 12.5},
            {"msg_bytes": 1024, "count_per_step": 4, "median_us": 20.0, "p90_us": None},
        ],
        "ll": [
            {"msg_bytes": 128, "count_per_step": 2, "median_us": 9.0, "p90_us": 9.5},
            {"msg_bytes": 1024, "count_per_step": 4, "median_us": None, "p90_us": None},
        ],
    }
    assert len(doc["candidates"]) == 2
    for c in doc["candidates"]:
        assert c["sizes"] == want[c["name"]]
        assert all(isinstance(r["msg_bytes"], int) and isinstance(r["count_per_step"], int) for r in c["sizes"])
        assert {"allreduce_us_per_step", "allreduce_us_per_step_range", "verify_ms", "tok_s", "label"} <= set(c)
    assert doc["baseline"]["sizes"] == want["baseline"]
    json.dumps(doc)  # still one JSON document


def test_scaling_keeps_an_unknown_backend_range_unknown_and_says_so():
    """user_figures.scale_prediction: a backend figure whose range is unknown (None) stays unknown on
    the user's scale (never a range made up), and one with no point stays unranked; both say so."""
    from types import MappingProxyType

    from fastverify.registry import BackendName
    from fastverify.tune import candidates as C, user_figures as uf

    base = C.Figure(
        BackendName.nccl,
        "baseline",
        MappingProxyType({}),
        100.0,
        (50.0, 200.0),
        ("b",),
        is_baseline=True,
        nccl=object(),
    )
    known = C.Figure(BackendName.pcie_ipc, "pcie_ipc", MappingProxyType({}), 40.0, (20.0, 80.0), ("k",))
    open_ = C.Figure(BackendName.b12x, "b12x", MappingProxyType({}), 60.0, None, ("u",))
    none = C.Figure(BackendName.custom_ar, "custom_ar", MappingProxyType({}), None, None, ("n",), status=C.UNKNOWN)
    pred = C.PredictedRanking(base, (base, known, open_, none), ())
    out = uf.scale_prediction(pred, uf.UserFigures(verify_us=3000.0, allreduce_us=1000.0))  # k = 10
    by = {f.name: f for f in out.candidates}
    assert by["baseline"].point_us == 1000.0 and by["baseline"].label == uf.LABEL
    assert by["pcie_ipc"].point_us == pytest.approx(400.0) and by["pcie_ipc"].range_us == pytest.approx((200.0, 800.0))
    assert by["b12x"].point_us == pytest.approx(600.0) and by["b12x"].range_us is None
    assert f"range: {uf.UNSCALED}" in by["b12x"].evidence
    assert not by["custom_ar"].ranked and by["custom_ar"].range_us is None
    assert by["custom_ar"].evidence[-1] == f"scaled: {uf.UNSCALED}"
