"""The live run times the CUDA-graph forward SGLang serves (fastverify.live.clocks), and its trace is
optional evidence (fastverify.live.worker, fastverify.profile.command).

No GPU here: the CUDA path runs on a stand-in for ``torch.cuda``'s graph, stream and event API with
the semantics of PyTorch's ``torch/cuda/graphs.py`` and ``torch/cuda/streams.py``: work issued
while a graph captures is recorded into the graph, not run; ``replay()`` runs it; a timing event
records the GPU clock when the stream reaches it. Each stand-in kernel costs a known GPU time,
and an eager launch adds a known launch gap (what a graph removes), so graph-replay times and
eager times differ by an amount worked out here.
"""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from fastverify import cli  # noqa: E402 - after the torch skip
from fastverify.events import EventClass, RankEvents, Step  # noqa: E402 - after the torch skip
from fastverify.live import clocks, worker  # noqa: E402 - after the torch skip
from fastverify.profile import record  # noqa: E402 - after the torch skip

LAUNCH_GAP_NS = 5_000  # an eager launch's GPU idle before its kernel (host enqueue, launch-bound)
KERNEL_NS = {"compute:attn": 40_000, "compute:mlp": 70_000, "allreduce": 12_000}


class FakeGpu:
    """One GPU clock (ns) and the capture state of ``torch.cuda.graph``."""

    def __init__(self) -> None:
        self.now = 0
        self.capturing: list | None = None

    def launch(self, kernel_ns: int) -> None:
        if self.capturing is not None:
            self.capturing.append(kernel_ns)  # captured, not run
        else:
            self.now += LAUNCH_GAP_NS + kernel_ns


def fake_torch(gpu: FakeGpu):
    class CUDAGraph:
        def __init__(self):
            self.kernels: list[int] = []

        def replay(self):
            assert gpu.capturing is None
            gpu.now += sum(self.kernels)  # one launch, kernels back to back

    class graph:
        def __init__(self, g, pool=None, stream=None):
            self.g = g

        def __enter__(self):
            assert gpu.capturing is None, "one capture at a time"
            gpu.capturing = self.g.kernels

        def __exit__(self, *exc):
            gpu.capturing = None

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            # A timing event inside a capture is not a timestamp (torch/cuda/streams.py, external=False).
            assert gpu.capturing is None, "timing event recorded inside a capture"
            self.t = gpu.now

        def elapsed_time(self, other):
            return (other.t - self.t) / 1e6  # ms

        def synchronize(self):
            pass

    class Stream:
        def wait_stream(self, other):
            pass

    class _StreamCtx:
        def __init__(self, s):
            pass

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            pass

    cuda = SimpleNamespace(
        CUDAGraph=CUDAGraph,
        graph=graph,
        Event=Event,
        Stream=Stream,
        stream=_StreamCtx,
        current_stream=lambda: Stream(),
        synchronize=lambda: None,
        graph_pool_handle=lambda: object(),
    )
    return SimpleNamespace(cuda=cuda)


class FakeModel:
    """Two layers: attention region, its all-reduce, MLP region, its all-reduce."""

    REGIONS = (
        ("compute:attn", EventClass.COMPUTE, "layer{}.attn", -1),
        ("allreduce", EventClass.ALLREDUCE, "layer{}.attn_out.allreduce", 1024),
        ("compute:mlp", EventClass.COMPUTE, "layer{}.mlp", -1),
        ("allreduce", EventClass.ALLREDUCE, "layer{}.mlp_out.allreduce", 1024),
    )

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu

    def forward(self, rec=None):
        from fastverify.live.forward import NULL_RECORDER

        rec = rec or NULL_RECORDER
        for layer in range(2):
            for name, cls, label, nbytes in self.REGIONS:
                with rec.region(name, cls, label.format(layer), nbytes):
                    self.gpu.launch(KERNEL_NS[name])


def test_cuda_timing_is_graph_replays_labelled_with_the_eager_forward_second():
    gpu = FakeGpu()
    dist = SimpleNamespace(barrier=lambda device_ids=None: None)
    rows, labels, steps, *rest = clocks.time_forwards(FakeModel(gpu), 3, 0, True, fake_torch(gpu), dist)
    per_forward = [KERNEL_NS[n] for _ in range(2) for n, *_ in FakeModel.REGIONS]
    # Rows are the graph replays' times: each region's kernel alone, no eager launch gap.
    assert [r[3] for r in rows] == per_forward * 3
    assert labels[:4] == ["layer0.attn", "layer0.attn_out.allreduce", "layer0.mlp", "layer0.mlp_out.allreduce"]
    assert [r[0] for r in rows[:4]] == ["compute:attn", "allreduce", "compute:mlp", "allreduce"]
    assert [r[4] for r in rows[:4]] == [-1, 1024, -1, 1024]
    figures = rest[0]
    assert figures["timed_forward"] == "cuda_graph" and figures["graph_sections"] == 8
    # The whole-forward graph: the kernels back to back; the eager forward: plus a launch gap each.
    assert figures["graph_forward_us"] == [sum(per_forward) / 1e3] * 3
    assert figures["eager_forward_us"] == [(sum(per_forward) + 8 * LAUNCH_GAP_NS) / 1e3] * 3
    for (_, start, end), i in zip(steps, range(3)):
        mine = rows[8 * i : 8 * i + 8]
        assert mine[0][2] >= start and mine[-1][2] + mine[-1][3] <= end


def test_cpu_timing_stays_eager_and_says_so():
    gpu = FakeGpu()
    dist = SimpleNamespace(barrier=lambda: None)
    rows, _, steps, figures = clocks.time_forwards(FakeModel(gpu), 2, 0, False, None, dist)
    assert figures == {"timed_forward": "eager"}
    assert len(rows) == 16 and len(steps) == 2


def test_the_clock_note_says_which_forward_was_timed():
    TIMED_FORWARDS, Timing = record.TIMED_FORWARDS, record.Timing
    cuda = record.live_timing(
        Timing("cuda_events", "live run, CUDA events on the GPU"),
        {
            "timed_forward": "cuda_graph",
            "graph_forward_us": [900.0, 800.0, 1000.0],
            "eager_forward_us": [1500.0, 1400.0],
        },
    )
    assert cuda.clock == "cuda_events"
    assert TIMED_FORWARDS["cuda_graph"] in cuda.note
    assert "whole-forward graph replay 900.0 µs" in cuda.note and "eager forward 1450.0 µs (second figure" in cuda.note
    cpu = record.live_timing(Timing("cpu_wall_clock", "wall clock"), {"timed_forward": "eager"})
    assert cpu.note == f"wall clock; timed: {TIMED_FORWARDS['eager']}"
    assert "timed_forward" in record.LiveSource.__struct_fields__


# ---- the trace is optional evidence ---------------------------------------------------------------


class _Replays:
    def __init__(self):
        self.n = 0

    def replay(self):
        self.n += 1


def test_a_profiler_step_that_raises_still_runs_every_replay(monkeypatch, tmp_path):
    import torch.profiler

    class BrokenProfile:
        exited = False

        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def step(self):
            raise RuntimeError("CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED")

        def __exit__(self, *exc):
            BrokenProfile.exited = True

    monkeypatch.setattr(torch.profiler, "profile", BrokenProfile)
    graph = _Replays()
    fake = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None))
    with pytest.raises(Exception, match="profiler step failed: RuntimeError: CUPTI_ERROR_MULTIPLE") as err:
        worker.export_trace(graph, 0, str(tmp_path), fake, SimpleNamespace(barrier=lambda device_ids=None: None))
    assert err.type is worker.TraceFailed
    assert graph.n == 1 + worker.TRACE_REPLAYS  # the other ranks' replays still find this rank's collectives
    assert BrokenProfile.exited  # the profiler is stopped


def test_no_empty_profiler_session_before_the_trace(monkeypatch, tmp_path):
    import torch.profiler

    opened = []
    monkeypatch.setattr(torch.profiler._utils, "_init_for_cuda_graphs", lambda: opened.append(1))

    class Profile:
        def __init__(self, **kw):
            self.kw = kw

        def __enter__(self):
            return self

        def step(self):
            pass

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    fake = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None))
    worker.export_trace(_Replays(), 0, str(tmp_path), fake, SimpleNamespace(barrier=lambda device_ids=None: None))
    assert opened == []


def _live_ranks(trace_error: str | None = None) -> list[RankEvents]:
    ranks = []
    for rank in range(2):
        rows = [
            ("compute:attn", EventClass.COMPUTE, 1_000, 40_000, -1),
            ("allreduce", EventClass.ALLREDUCE, 41_000, 12_000, 64 * 2),
        ]
        meta = {
            "timing": "cuda_events",
            "world_size": 2,
            "device": "NVIDIA H100",
            "dist_backend": "nccl",
            "allreduce_backend": "nccl",
            "dtype": "bfloat16",
            "hidden_size": 64,
            "experts_allocated": 0,
            "timed_forward": "cuda_graph",
            "graph_forward_us": [50.0],
            "eager_forward_us": [70.0],
        }
        if trace_error:
            meta["trace_error"] = trace_error
        ranks.append(
            RankEvents.from_rows(
                rank,
                "live:nccl",
                rows,
                steps=[Step("verify#0", 0, 60_000)],
                labels=["layer0.attn", "layer0.attn_out.allreduce"],
                meta=meta,
            )
        )
    return ranks


def _run_profile(monkeypatch, tmp_path, ranks, traces):
    from fastverify.profile import command as profile_command

    def fake_live(args):
        source = {
            "kind": "live",
            "model": "tiny",
            "tp": 2,
            "draft_tokens": 4,
            "batch": 1,
            "tokens": 4,
            "iters": 1,
            "warmup": 0,
            "device": "NVIDIA H100",
            "dist_backend": "nccl",
            "backend": "nccl",
            "dtype": "bfloat16",
            "hidden": 64,
            "experts_allocated": 0,
            "n_routed_experts": 0,
            "timed_forward": "cuda_graph",
            "graph_forward_us": 50.0,
            "eager_forward_us": 70.0,
            "graph_replay_traces": str(traces),
        }
        return ranks, source, "live-tiny-tp2"

    monkeypatch.setattr(profile_command, "measure_live", fake_live)
    out = tmp_path / "p.json"
    code = cli.main(["profile", "--output", str(out), "--no-png", "--quiet"])
    return code, out


def test_a_trace_with_no_kernels_keeps_the_measured_profile(monkeypatch, tmp_path, capsys):
    traces = tmp_path / "traces"
    traces.mkdir()
    for rank in range(2):  # what CUPTI taken by another client (nsys) leaves: CPU ops, no kernels
        doc = {
            "traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2, "pid": 1, "tid": 1}],
            "distributedInfo": {"rank": rank, "world_size": 2},
        }
        with gzip.open(traces / f"verify-TP-{rank}.trace.json.gz", "wt") as f:
            json.dump(doc, f)
    code, out = _run_profile(monkeypatch, tmp_path, _live_ranks(), traces)
    err = capsys.readouterr().err
    assert code == 0 and out.is_file(), err
    doc = json.loads(out.read_text())
    warned = [ln for ln in err.splitlines() if "graph-replay trace not used" in ln]
    assert len(warned) == 1 and "no GPU events" in warned[0]
    assert doc["graph_replay"] is None and doc["source"]["graph_replay_traces"] is None
    assert any("graph-replay trace not used" in w for w in doc["warnings"])
    assert doc["summary"]["allreduce_us"] == 2 * 12.0  # the measured rows, both ranks
    assert doc["source"]["timed_forward"] == "cuda_graph"
    assert record.TIMED_FORWARDS["cuda_graph"] in doc["timing"]["note"]


def test_a_rank_whose_trace_failed_keeps_the_measured_profile(monkeypatch, tmp_path, capsys):
    traces = tmp_path / "traces"
    traces.mkdir()
    code, out = _run_profile(monkeypatch, tmp_path, _live_ranks("profiler step failed: RuntimeError: CUPTI"), traces)
    err = capsys.readouterr().err
    assert code == 0 and out.is_file(), err
    warned = [ln for ln in err.splitlines() if "graph-replay trace not used" in ln]
    assert len(warned) == 1 and "rank 0: profiler step failed" in warned[0]
