"""A trial's build (backend construction, prepare/tune, first call: FlashInfer's JIT builds) runs
under its own limit, not the measurement's (issue 9, item 9); and a backend unavailable on one rank
skips the trial on every rank (item 2, the worker's share). Real gloo rank processes, world size 2;
the slow build and the one-rank refusal are the worker's ``FASTVERIFY_TEST_INJECT`` hooks."""

from __future__ import annotations

import os
import sys
import time

import pytest
from test_tune_sweep import _worker_pids

from fastverify.errors import UserError
from fastverify.tune.sweep import BUILD_HANG, DEFAULT_BUILD_TIMEOUT_S, TrialLimits, run_sweep, run_trial
from fastverify.tune.trial import TrialSpec, TrialStatus

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; parent-death signal")

MEASURE_S = 3.0
SLOW_BUILD_S = 6.0  # longer than the measurement limit


def _spec(inject: str, **kw) -> TrialSpec:
    base = dict(
        backend="gloo",
        env={"FASTVERIFY_TEST_INJECT": inject},
        world_size=2,
        device="cpu",
        dtype="bfloat16",
        hidden=64,
        sizes=((64, 2),),
        warmup=1,
        iters=3,
        op="all_reduce_residual_rmsnorm",
    )
    base.update(kw)
    return TrialSpec(**base)


def test_a_build_longer_than_the_measurement_limit_succeeds():
    t0 = time.monotonic()
    r = run_trial(
        _spec(f"slow_build:1:{SLOW_BUILD_S:g}"), timeout_s=MEASURE_S, startup_timeout_s=120, build_timeout_s=120
    )
    assert r.status is TrialStatus.OK, r.reason
    assert time.monotonic() - t0 >= SLOW_BUILD_S  # the slow build really ran, past the measurement limit
    assert r.sizes[0].max_rel_err is not None and r.sizes[0].max_rel_err <= 2.0**-5
    assert r.norm == "torch"  # recorded for the report: CPU trials use the torch norm


def test_a_build_past_its_limit_is_reported_as_a_build_hang(tmp_path):
    [r] = run_sweep(
        [_spec("slow_build:1:120")],
        journal_path=tmp_path / "j.jsonl",
        timeout_s=60,
        startup_timeout_s=120,
        build_timeout_s=2,
    )
    assert r.status is TrialStatus.FAILED and "\n" not in r.reason
    assert r.reason.startswith(f"build timeout after 2 s ({BUILD_HANG}); still building: "), r.reason
    assert "hung while building/JIT-compiling" in r.reason
    assert "rank 1: build: injected slow build, 120 s (test hook)" in r.reason
    assert not _worker_pids(parent=os.getpid())  # killed and reaped


def test_unavailable_on_one_rank_skips_the_trial_on_every_rank():
    r = run_trial(_spec("unavailable:1"), timeout_s=60, startup_timeout_s=120, build_timeout_s=120)
    assert r.status is TrialStatus.SKIPPED
    # The reason is the refusing rank's own, not rank 0's "unavailable on another rank".
    assert r.reason == "all-reduce backend 'gloo' unavailable: injected on rank 1 (test hook)"
    assert r.step_us is None and r.sizes == ()


def test_limits_are_checked_and_documented():
    assert TrialLimits(measure_s=120).build_s == DEFAULT_BUILD_TIMEOUT_S >= 600
    assert TrialLimits(measure_s=1, startup_s=2, build_s=3).total_s == 6
    with pytest.raises(UserError, match="build timeout must be > 0 seconds"):
        TrialLimits(measure_s=1, build_s=0)
    with pytest.raises(UserError, match="build timeout"):
        run_trial(_spec("hang:9"), timeout_s=1, build_timeout_s=-1)
