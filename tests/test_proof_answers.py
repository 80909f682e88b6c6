"""The answer phase's prompts and the verdict on two sets of answers (fastverify.proof.answers).

The verdict's rule: a numerics-only change moves each logprob by at most ``tol``; so the chosen
tokens' logprobs before a divergence may differ by at most ``tol``, and a greedy answer may diverge
only where the baseline's top-1/top-2 margin is at most ``2 x tol``. Each case below is built so
that exactly one side of that rule decides it.
"""

from __future__ import annotations

import pytest
from conftest import cli, one_line_error

from fastverify.errors import UserError
from fastverify.proof.answers import (
    CHANGED,
    DEFAULT_TOL,
    NOISE,
    SAME,
    Answer,
    Prompt,
    answer_of,
    judge,
    parse_prompts,
    read_prompts,
    tolerance,
)

TOL = 1e-3


def _answer(ids, logprobs=None, margins=None, pid="p0") -> Answer:
    n = len(ids)
    return Answer(
        pid,
        list(ids),
        logprobs if logprobs is not None else [-0.1] * n,
        margins if margins is not None else [5.0] * n,
        n,
        max(1, n // 2),
        0.01,
    )


def test_identical_answers_are_the_same():
    v = judge([_answer([1, 2, 3])], [_answer([1, 2, 3])], TOL, "basis")
    assert (v.verdict, v.identical, v.total) == (SAME, 1, 1)
    assert v.line() == "same answers (1/1)"


def test_a_logprob_moved_past_tol_is_changed_even_with_the_same_tokens():
    before = _answer([1, 2, 3], logprobs=[-0.1, -0.2, -0.3])
    after = _answer([1, 2, 3], logprobs=[-0.1, -0.2 - 2.5 * TOL, -0.3])
    v = judge([before], [after], TOL, "basis")
    assert v.verdict == CHANGED and v.identical == 1
    assert v.prompts[0].max_dlogprob == pytest.approx(2.5 * TOL)
    assert v.line().startswith("CHANGED: prompt p0:") and "do not deploy" in v.line()


def test_a_logprob_within_tol_is_the_same():
    before = _answer([1, 2, 3], logprobs=[-0.1, -0.2, -0.3])
    after = _answer([1, 2, 3], logprobs=[-0.1, -0.2 - 0.5 * TOL, -0.3])
    assert judge([before], [after], TOL, "basis").verdict == SAME


def test_a_divergence_at_a_near_tie_is_noise_and_says_its_margin_and_basis():
    # the baseline's margin at token 2 is 1.5 x tol <= 2 x tol: a reordered sum can swap the two
    before = _answer([1, 2, 3, 4], margins=[5.0, 5.0, 1.5 * TOL, 5.0])
    after = _answer([1, 2, 9, 9])
    v = judge([before], [after], TOL, "fastverify's default for float32")
    assert v.verdict == NOISE and v.identical == 0
    p = v.prompts[0]
    assert (p.status, p.position, p.margin) == ("near_tie", 2, 1.5 * TOL)
    assert "near-tie" in v.line() and "2 x 0.001" in v.line() and "float32" in v.line()


def test_a_divergence_past_a_clear_margin_is_changed():
    before = _answer([1, 2, 3, 4], margins=[5.0, 5.0, 2.5 * TOL, 5.0])  # 2.5 x tol > 2 x tol
    after = _answer([1, 2, 9, 9])
    v = judge([before], [after], TOL, "basis")
    assert v.verdict == CHANGED
    assert v.prompts[0].position == 2 and "diverged at token 2" in v.line()


def test_a_divergence_without_logprobs_is_changed_not_excused():
    before = Answer("p0", [1, 2, 3], None, None, 3, 2, 0.01)
    after = Answer("p0", [1, 5, 3], None, None, 3, 2, 0.01)
    v = judge([before], [after], TOL, "basis")
    assert v.verdict == CHANGED and "no margin known" in v.prompts[0].why


def test_a_shorter_answer_diverges_where_it_ends():
    v = judge([_answer([1, 2, 3])], [_answer([1, 2])], TOL, "basis")
    assert v.prompts[0].position == 2 and v.verdict == CHANGED


def test_the_worst_prompt_decides_and_counts_are_over_all():
    same = [_answer([1, 2], pid=f"p{i}") for i in range(3)]
    bad = _answer([7, 7], pid="p3")
    v = judge([*same, _answer([1, 2], pid="p3")], [*same, bad], TOL, "basis")
    assert (v.verdict, v.identical, v.total) == (CHANGED, 3, 4) and v.first_changed().id == "p3"


def test_different_prompts_are_not_comparable():
    with pytest.raises(UserError, match="different prompts"):
        judge([_answer([1], pid="a")], [_answer([1], pid="b")], TOL, "basis")


def test_tolerance_by_dtype_and_flag():
    assert tolerance("float32", None) == (DEFAULT_TOL["float32"], "fastverify's default for float32")
    assert tolerance(None, None)[0] == DEFAULT_TOL["bfloat16"] and "unknown" in tolerance(None, None)[1]
    assert tolerance("float32", 0.5) == (0.5, "--logprob-tol")


def test_answer_of_reads_sglangs_reply():
    # SGLang 0.5.23: output_token_logprobs [logprob, id, text]; output_top_logprobs the top 2 of each position
    reply = {
        "text": "ab",
        "output_ids": [11, 12],
        "meta_info": {
            "output_token_logprobs": [[-0.25, 11, None], [-1.5, 12, None]],
            "output_top_logprobs": [[[-0.25, 11, None], [-3.0, 40, None]], [[-1.5, 12, None], [-1.75, 41, None]]],
            "completion_tokens": 2,
            "spec_verify_ct": 1,
        },
    }
    a = answer_of(Prompt("x", "hi"), reply, 0.5)
    assert a.output_ids == [11, 12] and a.logprobs == [-0.25, -1.5]
    assert a.margins == [pytest.approx(2.75), pytest.approx(0.25)]
    assert a.accept_length == 2.0
    assert answer_of(Prompt("x", "hi"), {"output_ids": [1], "meta_info": {}}, 0.1).logprobs is None
    with pytest.raises(ValueError):
        answer_of(Prompt("x", "hi"), {"text": "no ids"}, 0.1)


def test_default_prompts_are_sixteen_distinct():
    prompts, source = read_prompts(None)
    assert len(prompts) == 16 and len({p.id for p in prompts}) == 16 and source.endswith("prompts.jsonl")
    assert all(p.text.strip() for p in prompts)


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"prompt": "a"}\nnot json\n', ["line 2", "not valid JSON"]),
        ('{"prompt": "a"}\n{"prompt": "  "}\n', ["line 2", "empty prompt"]),
        ('{"prompt": 3}\n', ["line 1", "must be a string"]),
        ('{"id": "x", "prompt": "a"}\n{"id": "x", "prompt": "b"}\n', ["line 2", "again"]),
        ('["prompt"]\n', ["line 1", "expected an object"]),
        ("\n\n", ["no prompt"]),
    ],
)
def test_bad_prompt_files_name_the_line(text, words):
    with pytest.raises(UserError) as e:
        parse_prompts(text, "mine.jsonl")
    assert str(e.value).startswith("mine.jsonl") and all(w in str(e.value) for w in words), str(e.value)


def test_launch_refuses_a_bad_prompts_file_in_one_line_before_starting_anything(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    marker = tmp_path / "started"
    rc, out, err = cli(
        [
            "launch",
            "--backend",
            "off",
            "--load",
            bad,
            "--profile-verify",
            tmp_path / "run",
            "--url",
            "http://127.0.0.1:9",
            "--",
            "touch",
            marker,
        ],
        capsys,
    )
    one_line_error(rc, out, err, "p.jsonl line 2", "empty prompt")
    assert not marker.exists()


def test_a_margin_moved_past_twice_tol_is_changed_though_the_chosen_logprob_barely_moves():
    # a token near probability 1 keeps a logprob near 0 while its logits move: the margin shows it
    before = _answer([1, 2, 3], logprobs=[-1e-6] * 3, margins=[14.0, 14.0, 14.0])
    after = _answer([1, 2, 3], logprobs=[-1.1e-6] * 3, margins=[14.0, 14.0 + 2.5 * TOL, 14.0])
    v = judge([before], [after], TOL, "basis")
    assert v.verdict == CHANGED and "margin moved" in v.prompts[0].why
    assert v.prompts[0].max_dmargin == pytest.approx(2.5 * TOL)
    after_ok = _answer([1, 2, 3], logprobs=[-1.1e-6] * 3, margins=[14.0, 14.0 + 1.5 * TOL, 14.0])
    assert judge([before], [after_ok], TOL, "basis").verdict == SAME


def test_a_byte_order_mark_is_not_part_of_the_first_prompt():
    (p,) = parse_prompts('\ufeff{"prompt": "hello"}\n', "bom.jsonl")
    assert p.text == "hello" and p.id == "line1"
