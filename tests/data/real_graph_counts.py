"""Run in the SGLang venv by tests/test_patch_coverage.py: SGLang 0.5.23's real graph runners and
FullCudaGraphBackend capture and replay one shape each on CPU (the CUDA graph object and the device
module are stand-ins); prints RESULT <json> with what the patch counted."""

import contextlib
import json
from types import SimpleNamespace

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
    PrefillCudaGraphRunner,
)
from sglang.srt.model_executor.runner.shape_key import ShapeKey
from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import (
    FullCudaGraphBackend,
)
from sglang.srt.speculative.eagle_draft_cuda_graph_runner import (
    EAGLEDraftCudaGraphRunner,
)
from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import (
    EAGLEDraftExtendCudaGraphRunner,
)

from fastverify.patch import counting as C, rank as R
from fastverify.patch.install import install, installed
from fastverify.patch.paths import COUNTER

# the patch as every TP worker applies it (backend off: counting only)
report = install(environ={"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "off"})
done = [k for k in installed() if k.split(".")[-1] in ("capture_one", "replay")]
why = report.uncounted
flag = {"on": False}
R.is_capturing = lambda: flag["on"]


@contextlib.contextmanager
def graph_ctx(cuda_graph, pool, stream):  # the device module's graph(): the stream captures inside
    flag["on"] = True
    try:
        yield
    finally:
        flag["on"] = False


class Graph:  # torch.cuda.CUDAGraph needs a GPU; replay runs no Python, as on a GPU
    replays = 0

    def replay(self):
        Graph.replays += 1


torch.cuda.CUDAGraph = Graph
coord = SimpleNamespace(world_size=2)


def all_reduces(n):
    def fwd():
        for _ in range(n):
            C.counted(lambda c, x: x, coord, SimpleNamespace(is_cpu=False))

    return fwd


def backend_for(runner):
    be = object.__new__(FullCudaGraphBackend)
    be._cuda_graph_runner, be._pool, be._capture_stream, be._graphs, be._outputs = runner, None, None, {}, {}
    be._device_module = SimpleNamespace(synchronize=lambda: None, graph=graph_ctx)
    be._tp_group = SimpleNamespace(barrier=lambda: None)
    be._precarve = SimpleNamespace(measure=contextlib.nullcontext, mint=lambda: None)
    be._reuse_output_buffer, be._output_buffer, be._memory_saver_adapter = False, None, None
    return be


out = {"wrapped": sorted(done), "why": why}
runners = {}
for name, cls, mode, draft, n in (
    ("eagle_draft", EAGLEDraftCudaGraphRunner, ForwardMode.DECODE, True, 2),
    ("eagle_draft_extend", EAGLEDraftExtendCudaGraphRunner, ForwardMode.DRAFT_EXTEND_V2, True, 3),
    ("prefill", PrefillCudaGraphRunner, ForwardMode.EXTEND, False, 5),
):
    r = object.__new__(cls)  # the GPU-only constructor skipped; capture/replay bookkeeping is SGLang's
    r.capture_forward_mode, r.model_runner = mode, SimpleNamespace(is_draft_worker=draft)
    r.backend = backend_for(r)
    r.backend.capture_one(ShapeKey(size=4), all_reduces(n))
    runners[name] = r
out["warmup"] = COUNTER.snapshot()
COUNTER.take()
# the EAGLE worker replays its draft graphs directly (no ModelRunner.forward): the graph's own mode
runners["eagle_draft"].backend.replay(ShapeKey(size=4), None)
runners["eagle_draft_extend"].backend.replay(ShapeKey(size=4), None)
with COUNTER.in_mode("extend"):  # ModelRunner.forward of an extend batch replays the prefill graph
    runners["prefill"].backend.replay(ShapeKey(size=4), None)
out["replayed"] = COUNTER.take()
out["graph_replays"] = Graph.replays
print("RESULT " + json.dumps(out))
