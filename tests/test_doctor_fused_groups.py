"""doctor's case "fused slot on two different groups" (issue 32): the patch's fused slot with two
SGLang groups, on 4 gloo ranks on this CPU box."""

from __future__ import annotations

from fastverify import doctor
from fastverify.doctor import Status, selfcheck


def test_fused_two_groups_is_a_gpu_case_skipped_on_cpu_with_the_reason(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = {s.name: s for s in doctor.CHECKS}["fused_two_groups"]
    assert spec.needs_gpu and not spec.quick and spec.fn is selfcheck.check_fused_two_groups
    ctx = doctor.CheckContext(quick=False, env_file=None)
    assert ctx.gpu_reason  # what run_doctor says for every GPU case here


def test_fused_two_groups_runs_the_slot_on_gloo_and_each_call_sums_over_its_own_group():
    ctx = doctor.CheckContext(quick=False, env_file=None)
    out = selfcheck.check_fused_two_groups(ctx)
    ranks = out.details["ranks"]
    assert out.status is Status.ok, (out.reason, ranks)
    for r, res in ranks.items():
        pair = [0, 1] if r < 2 else [2, 3]
        assert sorted(res["groups"]) == sorted([[0, 1, 2, 3], pair]), res  # one backend per group
        assert res["sums"] == {"attn": [10.0], "moe": [3.0 if r < 2 else 7.0]}, res
    assert "one backend per group (attn_tp: gloo, moe_tp:" in out.reason, out.reason


def test_fused_two_groups_verdict_names_a_sum_over_the_wrong_ranks():
    """What the case reports when the MoE call is summed over all four ranks (the single-backend bug)."""
    got = {
        r: {
            "built": "attn_tp: gloo",
            "sums": {"attn": [10.0], "moe": [10.0]},
            "want": {"attn": [10.0], "moe": [3.0 if r < 2 else 7.0]},
        }
        for r in range(4)
    }
    ok, line = selfcheck.two_groups_verdict(got)
    assert not ok and line.startswith("the fused slot reduced over the wrong ranks: rank 0 summed"), line
    got[2] = {"error": "rank 2 did not answer within 120 s"}
    assert selfcheck.two_groups_verdict(got) == (False, "rank 2: rank 2 did not answer within 120 s")
