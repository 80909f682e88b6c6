"""``tune --draft-shape``: known answers on synthetic accept histograms and verify cost curves.

Every expected number is worked out by hand in the test from the histogram and costs it builds:
accept length at depth k = E[min(A, k)] + 1, cycle = k x draft step + verify(k + 1 tokens per
request) + draft extend, tok/s = accept length / cycle.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from fastverify.errors import UserError
from fastverify.tune import draft_model as DM, draft_shape as DS

# A: accepted draft tokens per request per verify, one run at S = 5 steps; 100 request-verifies.
COUNTS = [20, 20, 20, 20, 10, 10]
# E[min(A,k)]: k=1: 80/100; k=2: (20 + 2*60)/100; k=3: (20 + 40 + 3*40)/100; k=4: (20+40+60 + 4*20)/100;
# k=5: (20+40+60+40 + 5*10)/100 -> +1 each
ACCEPT = {1: 1.8, 2: 2.4, 3: 2.8, 4: 3.0, 5: 3.1}


def _curve(ms_by_tokens: dict[int, float]) -> DM.CostCurve:
    return DM.CostCurve(
        batch=1,
        label="measured",
        source="test",
        points=[DM.CostPoint(tokens_per_request=t, verify_ms=ms, records=10) for t, ms in sorted(ms_by_tokens.items())],
    )


def _draft(step_ms: float, extend_ms: float = 0.0, label: str = "given") -> DM.DraftCost:
    return DM.DraftCost(draft_step_ms=step_ms, draft_extend_ms=extend_ms, label=label, source="test")


HIST = DM.AcceptHistogram(steps=5, counts=COUNTS)


def test_accept_length_by_depth_is_e_min_a_k_plus_1():
    for k, want in ACCEPT.items():
        assert DM.accept_length(COUNTS, k) == pytest.approx(want)
    # a tiny one: A in {0, 2}, half each: k=1 -> 0.5 + 1; k=2 -> 1 + 1
    assert DM.accept_length([1, 0, 1], 1) == pytest.approx(1.5) and DM.accept_length([1, 0, 1], 2) == pytest.approx(2.0)


def test_flat_verify_cost_deepest_chain_wins():
    """verify 10 ms at every token count, 0.1 ms a draft step: cycles 10.1..10.5 ms;
    tok/s 1.8/10.1 = 178.2, 2.4/10.2 = 235.3, 2.8/10.3 = 271.8, 3.0/10.4 = 288.5, 3.1/10.5 = 295.2."""
    rep = DM.recommend(HIST, _curve({t: 10.0 for t in range(2, 7)}), _draft(0.1))
    assert [r.cycle_ms for r in rep.rows] == pytest.approx([10.1, 10.2, 10.3, 10.4, 10.5])
    assert [r.tok_s for r in rep.rows] == pytest.approx([178.22, 235.29, 271.84, 288.46, 295.24], abs=0.01)
    assert rep.best_depth == 5 and rep.tok_s_change_pct == 0.0
    assert rep.flags == "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6"


def test_steep_verify_cost_shallow_chain_wins():
    """verify 10 ms per token per request (20..60 ms), 0.1 ms a step: tok/s 1.8/20.1 = 89.55,
    2.4/30.2 = 79.47, 2.8/40.3 = 69.48, 3.0/50.4 = 59.52, 3.1/60.5 = 51.24: depth 1, a gain of
    (89.55 - 51.24) / 51.24 = +74.8 % over the run's depth 5."""
    rep = DM.recommend(HIST, _curve({t: 10.0 * t for t in range(2, 7)}), _draft(0.1))
    assert [r.tok_s for r in rep.rows] == pytest.approx([89.55, 79.47, 69.48, 59.52, 51.24], abs=0.01)
    assert rep.best_depth == 1 and rep.tok_s_change_pct == pytest.approx(74.77, abs=0.02)
    assert rep.flags.startswith("--speculative-num-steps 1 ") and rep.flags.endswith("--speculative-num-draft-tokens 2")
    # depth 5 = the run itself: accept and verify measured, the draft cost given -> "given"
    assert [r.label for r in rep.rows] == ["derived"] * 4 + ["given"]
    assert rep.rows[-1].accept_label == "measured" and rep.rows[-1].verify_label == "measured"


def test_verify_cost_between_and_beyond_the_points_is_labelled():
    curve = _curve({2: 10.0, 5: 16.0})  # slope 2 ms per token
    assert DM.verify_at(curve, 2) == (10.0, "measured")
    assert DM.verify_at(curve, 3) == (pytest.approx(12.0), "derived")
    assert DM.verify_at(curve, 6) == (pytest.approx(18.0), "extrapolated")
    assert DM.verify_at(_curve({6: 7.5}), 3) == (7.5, "extrapolated")  # one point: flat, and said so
    rep = DM.recommend(HIST, _curve({6: 7.5}), _draft(0.0, label="assumed"))
    assert [r.label for r in rep.rows] == ["extrapolated"] * 4 + ["assumed"]
    assert any("extrapolated outside the measured tokens per request (6)" in n for n in rep.notes)
    assert any("draft cost assumed 0 ms" in n for n in rep.notes)


def test_a_tie_goes_to_the_shallower_depth():
    """Every request-verify accepts 2 of 2 draft tokens: accept length 2 at depth 1, 3 at depth 2.
    Verify 10 ms at 2 tokens per request, 15 ms at 3, no draft cost: 2 / 0.010 s = 200 tok/s and
    3 / 0.015 s = 200 tok/s, a tie; the shallower chain (fewer draft tokens) wins. A 14.9 ms depth 2
    (201.3 tok/s) wins on its own."""
    hist = DM.AcceptHistogram(steps=2, counts=[0, 0, 10])
    rep = DM.recommend(hist, _curve({2: 10.0, 3: 15.0}), _draft(0.0))
    assert [(r.depth, r.tok_s) for r in rep.rows] == [(1, 200.0), (2, 200.0)]
    assert rep.best_depth == 1 and rep.tok_s_change_pct == 0.0
    assert rep.flags == "--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2"
    assert DM.recommend(hist, _curve({2: 10.0, 3: 14.9}), _draft(0.0)).best_depth == 2


def test_extrapolation_runs_from_the_nearest_two_points_on_each_side():
    """Points (2, 10), (3, 11), (5, 17): the slope is 1 ms per token at the low end and 3 at the
    high end. Below 2 the line through the two lowest points: 1 token -> 10 - 1 = 9 ms; above 5 the
    line through the two highest: 6 -> 17 + 3 = 20 ms, 7 -> 23 ms. Never below the lowest point scaled
    by tokens (a fixed part plus a part per token, both >= 0): (3, 1), (4, 10) at 2 tokens -> the line
    gives 1 - 9 < 0, the floor 1 x 2 / 3."""
    curve = _curve({2: 10.0, 3: 11.0, 5: 17.0})
    assert DM.verify_at(curve, 1) == (pytest.approx(9.0), "extrapolated")
    assert DM.verify_at(curve, 6) == (pytest.approx(20.0), "extrapolated")
    assert DM.verify_at(curve, 7) == (pytest.approx(23.0), "extrapolated")
    assert DM.verify_at(curve, 4) == (pytest.approx(14.0), "derived")  # between 3 and 5: 11 + 3
    assert DM.verify_at(_curve({3: 1.0, 4: 10.0}), 2) == (pytest.approx(2 / 3), "extrapolated")
    # through the table: a run at 5 steps whose records were taken at 4..6 tokens per request only:
    # depths 1 and 2 (2 and 3 tokens) extrapolate down the low end's 2 ms per token: 8 - 2 x 2, 8 - 2
    rep = DM.recommend(HIST, _curve({4: 8.0, 5: 10.0, 6: 16.0}), _draft(0.0))
    assert [(r.verify_ms, r.verify_label) for r in rep.rows] == [
        (4.0, "extrapolated"),
        (6.0, "extrapolated"),
        (8.0, "measured"),
        (10.0, "measured"),
        (16.0, "measured"),
    ]


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    DS.add_arguments(p)
    p.add_argument("--json", action="store_true")
    argv = ["--draft-shape"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return p.parse_args(argv)


def _hist_file(tmp_path: Path, doc) -> Path:
    f = tmp_path / "hist.json"
    f.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return f


def test_histogram_file_table_and_winner(tmp_path, capsys):
    """counts [10, 20, 30, 20, 20] at S = 4: accept 1.9, 2.6, 3.0, 3.2; verify 10 ms at 2 tokens,
    16 at 5 (12, 14 between); draft 1 ms a step + 2 ms extend: cycles 13, 16, 19, 22 ms; tok/s
    146.2, 162.5, 157.9, 145.5: depth 2, (162.5 - 145.45) / 145.45 = +11.7 % over depth 4."""
    f = _hist_file(tmp_path, {"steps": 4, "counts": [10, 20, 30, 20, 20], "verify_ms": [[2, 10.0], [5, 16.0]]})
    args = _args(accept_histogram=f, draft_step_ms=1, draft_extend_ms=2)
    out = io.StringIO()
    assert DS.run(args, Console(file=out, width=150)) == 0
    text = out.getvalue()
    lines = text.splitlines()
    assert len(lines) <= 15, text
    assert (
        "best: depth 2 (+11.7 % tok/s vs depth 4: more tokens per second): --speculative-num-steps 2 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in " ".join(text.split())
    )
    assert "fastverify profile --verify-log before/ after/" in text
    row2 = next(ln for ln in lines if ln.strip().startswith("2 *"))
    assert row2.split() == ["2", "*", "3", "2.600", "12.000", "16.000", "162.5", "derived"]
    args = _args(accept_histogram=f, draft_step_ms=1, draft_extend_ms=2, json=True)
    assert DS.run(args, None) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["best_depth"] == 2 and doc["tok_s_change_pct"] == pytest.approx(11.72, abs=0.01)
    assert [r["accept_length"] for r in doc["rows"]] == pytest.approx([1.9, 2.6, 3.0, 3.2])
    assert [r["cycle_ms"] for r in doc["rows"]] == pytest.approx([13.0, 16.0, 19.0, 22.0])
    assert doc["draft"]["label"] == "given" and doc["rows"][-1]["label"] == "given"


def test_tree_run_says_one_run_gives_no_other_tree_shape():
    rep = DM.recommend(DM.AcceptHistogram(steps=3, counts=[5, 5, 5, 5], topk=4), _curve({8: 12.0}), _draft(0.5))
    assert rep.tree and rep.best_depth is None and rep.flags is None
    assert [r.depth for r in rep.rows] == [3] and rep.rows[0].tokens_per_request == 8
    assert "one run's records do not give other tree shapes" in rep.notes[0]
    assert "fastverify launch --profile-verify DIR_<shape>" in rep.notes[0]


def _log(d: Path, rows: list[tuple[int, int, float, list[int]]]) -> Path:
    d.mkdir()
    lines = [
        json.dumps(
            {
                "step": i,
                "verify_ms": ms,
                "clock": "cpu_wall_clock",
                "rank": "0",
                "pid": 7,
                "batch": b,
                "tokens": t,
                "accepted": acc,
            }
        )
        for i, (b, t, ms, acc) in enumerate(rows)
    ]
    (d / "verify-rank0.jsonl").write_text("\n".join(lines) + "\n")
    return d


def test_from_verify_records(tmp_path):
    """A run at 3 steps (4 tokens a request), batch 2: accepted [3, 0], [1, 3], [2, 2] -> counts
    [1, 1, 2, 2]; accept length at 3 = 11/6 + 1; verify median of 8, 9, 10 = 9 ms (measured)."""
    d = _log(tmp_path / "run", [(2, 8, 8.0, [3, 0]), (2, 8, 10.0, [1, 3]), (2, 8, 9.0, [2, 2])])
    rep = DS.build(_args(verify_log=d))
    assert rep.histogram == [1, 1, 2, 2] and rep.current_depth == 3
    r3 = rep.rows[-1]
    assert r3.accept_length == pytest.approx(11 / 6 + 1, abs=1e-4) and r3.verify_ms == 9.0
    assert (r3.accept_label, r3.verify_label, r3.label) == ("measured", "measured", "assumed")
    # E[min(A,1)] = 5/6, E[min(A,2)] = (1 + 2*4)/6
    assert [r.accept_length for r in rep.rows[:2]] == pytest.approx([5 / 6 + 1, 9 / 6 + 1], abs=1e-4)


@pytest.mark.parametrize(
    "doc, said",
    [
        ('{"steps": 3, "counts": [1, 2]', "not valid JSON"),
        ({"steps": "3", "counts": [1, 2, 3, 4]}, 'field "steps": expected an integer, got a string (e.g. "steps": 5)'),
        ({"counts": [1, 2]}, 'field "steps": missing'),
        ({"steps": 3, "counts": [1, 2]}, 'field "counts": 2 values, need steps + 1 = 4'),
        ({"steps": 2, "counts": [0, 0, 0]}, 'field "counts": each must be in [0, 1e+09] and not all 0'),
        ({"steps": 2, "counts": [1, 1, 1], "depth": 2}, 'field "depth": unknown'),
    ],
)
def test_malformed_histogram_is_one_line_naming_file_and_field(tmp_path, doc, said):
    """A UserError: `fastverify` prints it as one line on stderr and exits 2 (fastverify.cli.main)."""
    f = _hist_file(tmp_path, doc)
    with pytest.raises(UserError) as err:
        DS.build(_args(accept_histogram=f, draft_step_ms=0))
    msg = str(err.value)
    assert msg.startswith(str(f)) and said in msg and "\n" not in msg, msg


def test_no_input_or_no_cost_is_refused(tmp_path):
    with pytest.raises(UserError, match="needs --verify-log DIR, --bundle FILE or --accept-histogram FILE"):
        DS.build(_args())
    f = _hist_file(tmp_path, {"steps": 2, "counts": [1, 1, 1]})
    with pytest.raises(UserError, match="no verify cost"):
        DS.build(_args(accept_histogram=f))
    with pytest.raises(UserError, match="--draft-step-ms -1.0"):
        DS.build(_args(accept_histogram=f, draft_step_ms=-1))


def test_report_document_round_trips():
    rep = DM.recommend(HIST, _curve({2: 10.0, 6: 10.0}), _draft(0.1))
    again = msgspec.convert(msgspec.to_builtins(rep), DM.DraftShapeReport)
    assert again == rep


def test_tune_draft_shape_through_the_cli(tmp_path, capsys):
    """Through ``fastverify tune``: P(A = 0..4) = .1 .2 .3 .2 .2 gives accept lengths 1.9, 2.6, 3.0, 3.2
    at depths 1-4; verify 10 ms at 2 tokens, 16 ms at 5 (linear: 12, 14 between); cycle = depth x 1
    + verify + 2 = 13, 16, 19, 22 ms; tok/s 146.2, 162.5, 157.9, 145.5: depth 2 wins, +11.7 % on depth 4."""
    from conftest import cli, one_line_error

    h = tmp_path / "h.json"
    h.write_text(json.dumps({"steps": 4, "counts": [10, 20, 30, 20, 20], "verify_ms": [[2, 10.0], [5, 16.0]]}))
    rc, out, err = cli(
        [
            "tune",
            "--draft-shape",
            "--accept-histogram",
            str(h),
            "--draft-step-ms",
            "1",
            "--draft-extend-ms",
            "2",
            "--json",
        ],
        capsys,
    )
    assert rc == 0, err
    doc = json.loads(out)
    assert [round(r["accept_length"], 3) for r in doc["rows"]] == [1.9, 2.6, 3.0, 3.2]
    assert [round(r["cycle_ms"], 3) for r in doc["rows"]] == [13.0, 16.0, 19.0, 22.0]
    assert doc["best_depth"] == 2 and doc["current_depth"] == 4
    assert doc["tok_s_change_pct"] == pytest.approx((2.6 / 16 - 3.2 / 22) / (3.2 / 22) * 100, abs=0.05)
    assert "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in doc["flags"]
    one_line_error(
        *cli(["tune", "--predict", "--accept-histogram", str(h)], capsys),
        "--accept-histogram applies to --draft-shape only",
    )
