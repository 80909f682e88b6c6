"""Run in the SGLang venv by tests/test_doctor_graph_counts.py: doctor's graph_counts and
compiled_counts cases (fastverify/doctor/graph_counts.py) driven on CPU with stand-ins for the
device pieces only; prints RESULT <json>.

graph: torch.cuda.CUDAGraph (replay runs no Python, as on a GPU), the device module's graph()
(the capture runs the forward eagerly with the patch's capture flag set) and synchronize().
compiled: tensors report is_cpu False (so SGLang's all_reduce takes its accelerator branch and
emits its custom op under torch.compile), SGLang's own op functions registered for the CPU key as
SGLang registers them for CUDA, and on the second group a PyNccl stand-in that all-reduces on
the gloo device group."""

import contextlib
import json
import sys
from types import SimpleNamespace

import torch

from fastverify.doctor import graph_counts as G


def graph_case():
    flag = {"on": False}

    @contextlib.contextmanager
    def graph(cuda_graph, pool, stream):
        flag["on"] = True
        try:
            yield
        finally:
            flag["on"] = False

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    got = G.run_graphs(
        SimpleNamespace(synchronize=lambda: None, graph=graph),
        torch.device("cpu"),
        graph_class=Graph,
        capturing=lambda: flag["on"],
    )
    got["graph_replays"] = Graph.replays
    return got


class PyNcclStandIn:
    disabled = False

    def __init__(self, group):
        self.group = group

    @contextlib.contextmanager
    def change_state(self, enable=None):
        yield

    def outplace_all_reduce(self, x):
        y = x.clone()
        torch.distributed.all_reduce(y, group=self.group)
        return y

    def all_reduce(self, x):
        torch.distributed.all_reduce(x, group=self.group)


def attach(coord):
    coord.pynccl_comm = PyNcclStandIn(coord.device_group)


def cpu_rank(rank, port, q):
    try:
        from sglang.srt.distributed import parallel_state as P

        torch.Tensor.is_cpu = property(lambda self: False)
        lib = torch.library.Library("sglang", "IMPL")
        for op in (P.inplace_all_reduce, P.outplace_all_reduce):
            lib.impl(op.__name__, op.__wrapped__, "CPU")
        got = G.run_compiled(rank, port, torch.device("cpu"), attach=attach)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        got = {"error": f"{type(err).__name__}: {err}"}
    q.put((rank, got))


if __name__ == "__main__":
    out = {}
    if "graph" in sys.argv[1:]:
        out["graph"] = graph_case()
    if "compiled" in sys.argv[1:]:
        port = G.free_port()
        out["compiled"] = dict(G.spawn(cpu_rank, [(r, port) for r in range(G.WORLD)], G.TIMEOUT_S))
    print("RESULT " + json.dumps(out))
