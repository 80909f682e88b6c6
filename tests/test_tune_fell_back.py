"""A tune trial whose backend fell back (to torch.distributed) is never ranked, chosen or written as
that backend: its path counts decide, read from the journaled result.

The real worker path runs on gloo ranks with a stand-in ``b12x`` backend (a ``sitecustomize`` on the
trial's PYTHONPATH points the registry entry at a CPU class) that counts its calls the way
``fastverify/backends/flashinfer_b12x.py`` does: ``fallback`` + ``fallback_all_reduce`` without a
prepared plan, ``fused`` when its kernel runs. The ``--write-env`` path runs ``fastverify tune``
in-process on a pretend GPU box whose sweep returns fixed results.
"""

from __future__ import annotations

import io
import json
import os
import sys

import pytest
from conftest import REPO_ROOT
from rich.console import Console

from fastverify.tune.ranking import print_report, rank_candidates
from fastverify.tune.sweep import run_sweep
from fastverify.tune.trial import SizeResult, TrialResult, TrialSpec, TrialStatus, fell_back

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo rank processes")

SIZES = ((64, 2), (512, 4))
WARMUP, ITERS = 1, 3
# Calls per size in the worker: one build call, the warm-up, one checked call, the timed ones.
CALLS = len(SIZES) * (1 + WARMUP + 1 + ITERS)  # 2 × 6 = 12

STANDIN = '''
import torch.distributed as dist

from fastverify.backends.base import BackendName, add_rmsnorm
from fastverify.backends.torch_dist import GlooBackend


class _StandIn(GlooBackend):
    name = BackendName.b12x

    def _sum(self, x):
        out = x.clone()
        dist.all_reduce(out, group=self.group)
        return out


class FallsBack(_StandIn):
    """b12x without a prepared plan: every call goes to torch.distributed."""

    def all_reduce(self, x):
        self.path_counts["fallback_all_reduce"] += 1
        return self._sum(x)

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps):
        self.path_counts["fallback"] += 1
        return add_rmsnorm(self.all_reduce(x), residual, weight, eps)


class FallsBackOnRank1(_StandIn):
    """b12x whose plan is prepared on rank 0 only: rank 1 sends every call to torch.distributed."""

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps):
        if dist.get_rank(self.group) == 1:
            self.path_counts["fallback"] += 1
            self.path_counts["fallback_all_reduce"] += 1
        else:
            self.path_counts["fused"] += 1
        return add_rmsnorm(self._sum(x), residual, weight, eps)


class TakesItsPath(_StandIn):
    """b12x with a plan for every shape: the fused path takes every call."""

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps):
        self.path_counts["fused"] += 1
        return add_rmsnorm(self._sum(x), residual, weight, eps)
'''

SITECUSTOMIZE = """
import dataclasses
import os

from fastverify import registry

_name = registry.BackendName.b12x
registry._BY_NAME[_name] = dataclasses.replace(registry._BY_NAME[_name], module="standin_backend",
                                               qualname=os.environ["STANDIN_CLASS"], device="cpu")
"""


def _spec(backend="gloo", env=None, **kw) -> TrialSpec:
    base = dict(
        backend=backend,
        env=env or {},
        world_size=2,
        device="cpu",
        dtype="bfloat16",
        hidden=64,
        sizes=SIZES,
        warmup=WARMUP,
        iters=ITERS,
        op="all_reduce_residual_rmsnorm",
    )
    base.update(kw)
    return TrialSpec(**base)


@pytest.fixture(scope="module")
def standin_sweep(tmp_path_factory):
    folder = tmp_path_factory.mktemp("standin")
    (folder / "standin_backend.py").write_text(STANDIN)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = f"{folder}{os.pathsep}{REPO_ROOT}"
    trials = [
        _spec(baseline=True, label="baseline"),
        _spec("b12x", {"PYTHONPATH": path, "STANDIN_CLASS": "FallsBack"}, label="falls back"),
        _spec("b12x", {"PYTHONPATH": path, "STANDIN_CLASS": "TakesItsPath"}, label="takes its path"),
        _spec("b12x", {"PYTHONPATH": path, "STANDIN_CLASS": "FallsBackOnRank1"}, label="rank 1 falls back"),
    ]
    results = run_sweep(trials, journal_path=folder / "j.jsonl", timeout_s=60)
    return trials, results


def test_the_worker_records_the_counts_and_a_fallen_back_trial_is_not_ranked(standin_sweep):
    trials, results = standin_sweep
    by_label = {t.label: r for t, r in zip(trials, results)}
    for r in results:
        assert r.status is TrialStatus.OK, r.reason  # every trial measured a correct sum
    meta = dict(by_label["falls back"].worker_meta)
    assert {k: v for k, v in meta.items() if k.startswith("path_count")} == {
        "path_count:fallback": CALLS,
        "path_count:fallback_all_reduce": CALLS,
        "path_counts_rank": 0,
    }
    assert dict(by_label["takes its path"].worker_meta)["path_count:fused"] == CALLS

    ranking = rank_candidates(trials, results)
    assert {c.spec.label for c in ranking.candidates} == {"baseline", "takes its path"}
    assert all(b.best.label not in ("falls back", "rank 1 falls back") for b in ranking.buckets)
    assert sorted(spec.label for spec, _ in ranking.not_ok) == ["falls back", "rank 1 falls back"]
    spec, entry = next((s, e) for s, e in ranking.not_ok if s.label == "falls back")
    assert entry.status.value == "fell_back"
    assert entry.reason == f"fell back: fused 0 of {CALLS} calls, fallback {CALLS}, fallback_all_reduce {CALLS}"
    assert entry.trial_id == spec.trial_id and entry.step_us == by_label["falls back"].step_us

    out = io.StringIO()
    print_report(ranking, Console(file=out, width=250))
    not_ranked = out.getvalue().split("not ranked", 1)[1]
    assert "falls back" in not_ranked and "fell_back" in not_ranked and f"fused 0 of {CALLS} calls" in not_ranked


def test_one_rank_falling_back_keeps_the_trial_out_of_the_ranking(standin_sweep):
    """Rank 0 ran its kernel on every call, rank 1 none: the trial measured torch.distributed on one
    rank, so it is not ranked. The counts recorded are rank 1's (the first rank that fell back), and
    the reason says so in rank 1's counts."""
    trials, results = standin_sweep
    spec, result = next((t, r) for t, r in zip(trials, results) if t.label == "rank 1 falls back")
    assert result.status is TrialStatus.OK, result.reason
    assert {k: v for k, v in dict(result.worker_meta).items() if k.startswith("path_count")} == {
        "path_count:fallback": CALLS,
        "path_count:fallback_all_reduce": CALLS,
        "path_counts_rank": 1,
    }
    ranking = rank_candidates(trials, results)
    assert spec.label not in {c.spec.label for c in ranking.candidates}
    assert all(b.best.label != spec.label for b in ranking.buckets)
    [entry] = [e for s, e in ranking.not_ok if s.label == spec.label]
    assert entry.status.value == "fell_back"
    assert entry.reason == f"fell back: fused 0 of {CALLS} calls, fallback {CALLS}, fallback_all_reduce {CALLS}"


def test_the_json_document_lists_it_as_fell_back(standin_sweep):
    from fastverify.live.config import load_model_config
    from fastverify.tune.printer import measured_document
    from fastverify.tune.workload import workload_from_model

    trials, results = standin_sweep
    workload = workload_from_model(load_model_config("tiny"), tp=2, draft_tokens=4, batch=1)
    doc = measured_document(
        rank_candidates(trials, results), workload, accept_length=None, tok_s=None, box={"device": "cpu"}
    )
    assert {c["name"] for c in doc["candidates"]} == {"baseline", "takes its path"}
    reason = f"fell back: fused 0 of {CALLS} calls, fallback {CALLS}, fallback_all_reduce {CALLS}"
    # each entry also says the environment its ranks ran in (the trial's own settings here)
    assert all(e["environment"]["STANDIN_CLASS"] for e in doc["not_ranked"]), doc["not_ranked"]
    assert sorted(
        ({k: e[k] for k in ("name", "status", "reason")} for e in doc["not_ranked"]), key=lambda e: e["name"]
    ) == [
        {"name": "falls back", "status": "fell_back", "reason": reason},
        {"name": "rank 1 falls back", "status": "fell_back", "reason": reason},
    ]


@pytest.mark.parametrize(
    "backend, op, counts, want",
    [
        # b12x without a plan (its all_reduce inside the fallback counts too)
        (
            "b12x",
            "all_reduce_residual_rmsnorm",
            {"fallback": 40, "fallback_all_reduce": 40},
            "fell back: fused 0 of 40 calls, fallback 40, fallback_all_reduce 40",
        ),
        # the trtllm kernel declined 10 of 40 calls (a size over its workspace)
        (
            "fused",
            "all_reduce_residual_rmsnorm",
            {"fused": 30, "fallback": 10},
            "fell back: fused 30 of 40 calls, fallback 10",
        ),
        ("fused", "all_reduce_residual_rmsnorm", {"fused": 40}, None),
        (
            "fused",
            "all_reduce",
            {"fused_all_reduce": 5, "fallback_all_reduce": 3},
            "fell back: fused_all_reduce 5 of 8 calls, fallback_all_reduce 3",
        ),
        # a plain backend on the residual op: the base class's unfused path around its own kernel
        ("pcie_ipc", "all_reduce_residual_rmsnorm", {"unfused": 12, "all_reduce": 12, "stream_rebind": 1}, None),
        ("nccl", "all_reduce", {"all_reduce": 8}, None),
        ("b12x", "all_reduce_residual_rmsnorm", {}, "fell back: fused 0 of 0 calls"),
    ],
)
def test_the_verdict_from_the_counts(backend, op, counts, want):
    assert fell_back(_spec(backend, op=op, hidden=64, device="cuda"), counts) == want


def test_the_sweeps_progress_line_says_it_fell_back():
    """Not a terminal (CI, a log): one ``fastverify:`` line per trial that is not ranked as run."""
    from fastverify.tune.sweep import TrialProgress as _Progress

    spec = _spec("b12x", device="cuda")
    buf = io.StringIO()
    with _Progress(True, 2, console=Console(file=buf, force_terminal=False)) as bar:
        for counts in ({"fused": 6}, {"fallback": 6, "fallback_all_reduce": 6}):
            bar.start(spec)
            bar.finish(spec, _result(spec, 5.0, counts))
    lines = [ln for ln in buf.getvalue().splitlines() if "fell" in ln]
    assert lines == [
        f"fastverify: tune: trial 2/2 {spec.name}: fell_back "
        "(fell back: fused 0 of 6 calls, fallback 6, fallback_all_reduce 6)"
    ]


def _result(spec, step_us, counts=None):
    meta = {f"path_count:{k}": v for k, v in (counts or {}).items()}
    return TrialResult(
        spec.trial_id,
        "ok",
        "",
        (SizeResult(7168, 14336, 1, step_us, step_us, 0.0),),
        step_us,
        "cuda_events",
        1.0,
        2.0,
        worker_meta=tuple(meta.items()),
    )


def test_a_journaled_result_without_counts_is_not_ranked_as_its_backend():
    """A journal written before the counts were recorded: a b12x time cannot be shown to be b12x's;
    the torch.distributed baseline has no other path."""
    base, fast = _spec("nccl", baseline=True, device="cuda"), _spec("b12x", device="cuda")
    ranking = rank_candidates([base, fast], [_result(base, 20.0), _result(fast, 5.0)])
    assert [c.spec.backend for c in ranking.candidates] == ["nccl"]
    [(spec, entry)] = ranking.not_ok
    assert spec is fast and entry.status.value == "unverified" and "no path counts recorded" in entry.reason


# --- --write-env: the fallen-back trial never reaches the env file -------------------------------------


@pytest.fixture
def gpu_box(tmp_path, monkeypatch):
    """``fastverify tune`` in-process on a pretend 2-GPU SM120 box (P2P proven by a check file,
    SGLang 0.5.23): the sweep is replaced by :func:`_fixed_sweep`'s results."""
    import torch

    from fastverify.deploy import BoxFingerprint

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    box = BoxFingerprint(
        gpu_name="pretend SM120", sm=(12, 0), gpu_count=2, tp=2, driver=None, nccl_version="2.27.3", nvlink_full=False
    )
    monkeypatch.setattr("fastverify.tune.measure.read_box", lambda *a, **k: box)
    monkeypatch.setattr("fastverify.tune.measure.installed_sglang_version", lambda: "0.5.23")
    for k in [k for k in os.environ if k.startswith("NCCL_")]:
        monkeypatch.delenv(k)
    (tmp_path / "p2p.json").write_text(json.dumps([{"src": i, "dst": 1 - i, "ok": True, "reason": ""} for i in (0, 1)]))
    return tmp_path


def _fixed_sweep(b12x_counts):
    """A sweep that measured: the baseline 20 µs, b12x 5 µs (with ``b12x_counts``), every other
    backend 30 µs on its own path."""

    def sweep(trials, **kw):
        out = []
        for t in trials:
            if t.backend == "b12x":
                out.append(_result(t, 5.0, b12x_counts))
            else:
                out.append(_result(t, 20.0 if t.baseline else 30.0, {"unfused": 4, "all_reduce": 4}))
        return out

    return sweep


def _tune_write_env(monkeypatch, capsys, b12x_counts):
    """The ``--json`` document, the deployment record and the env file's text that ``tune --write-env
    w.env`` wrote (exit code 0)."""
    from fastverify.cli import main

    monkeypatch.setattr("fastverify.tune.measure.run_sweep", _fixed_sweep(b12x_counts))
    rc = main(
        [
            "tune",
            "--model",
            "tiny",
            "--tp",
            "2",
            "--top",
            "0",
            "--nccl-version",
            "2.27.3",
            "--p2p-check",
            "p2p.json",
            "--journal",
            "j.jsonl",
            "--write-env",
            "w.env",
            "--json",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out), json.loads(open("w.deploy.json").read()), open("w.env").read()


def test_write_env_never_writes_a_trial_that_fell_back(gpu_box, monkeypatch, capsys):
    doc, record, env = _tune_write_env(monkeypatch, capsys, {"fallback": 12, "fallback_all_reduce": 12})
    assert record["backend"] == "nccl"  # b12x measured 5 µs against 20, but that was torch.distributed's time
    assert "winner: current environment: 20.0 us" in env and "b12x" not in env
    ranked = [c["backend"] for c in doc["candidates"]]
    assert ranked[0] == "nccl" and sorted(ranked[1:]) == ["custom_ar", "pcie_ipc"]  # 20 µs, then the 30 µs pair
    assert {
        "name": "b12x",
        "status": "fell_back",
        "reason": "fell back: fused 0 of 12 calls, fallback 12, fallback_all_reduce 12",
    } in [{k: e[k] for k in ("name", "status", "reason")} for e in doc["not_ranked"]]


def test_write_env_writes_the_backend_when_it_took_every_call(gpu_box, monkeypatch, capsys):
    doc, record, env = _tune_write_env(monkeypatch, capsys, {"fused": 12})
    assert record["backend"] == "b12x" and "winner: b12x: 5.0 us per verify step vs 20.0 us baseline" in env
    assert [(c["backend"], c["allreduce_us_per_step"]) for c in doc["candidates"]][0] == ("b12x", 5.0)
    assert doc["not_ranked"] == []
