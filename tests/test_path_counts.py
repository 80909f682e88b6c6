"""Which path each all-reduce took, counted in the rank by the patch (fastverify/patch/paths.py,
counting.py), driven through install() on stand-ins of SGLang 0.5.23's classes that keep its
dispatch structure (``all_reduce`` -> ``_all_reduce_out_place(method)`` or ``_all_reduce_in_place``;
``ModelRunner.forward``; ``DecodeCudaGraphRunner.capture_one_shape`` / ``execute``).

Every expected count below is the number of all-reduces the stand-in forward issues, worked out
from its loop, not read back from the code under test."""

from __future__ import annotations

import json
import types
from types import SimpleNamespace

import pytest
import torch
from conftest import PCIE_IPC_SWITCH

from fastverify.patch import install as I, rank as R, targets as T
from fastverify.patch.paths import COUNTER, PathCounter, backend_of, mode_of, summary
from fastverify.patch.verify import VerifyTimer

PCIE_CAP_ROWS = 8  # the stand-in's pcie_ipc workspace: wider tensors go in place (PyNccl)
AR_PER_FORWARD = 3


def _modules():
    ps = types.ModuleType(I.MOD_PARALLEL_STATE)

    class GroupCoordinator:
        def __init__(self):
            self.world_size, self.unique_name, self.rank_in_group = 2, "tp:0", 0
            self.pynccl_comm = SimpleNamespace(disabled=False)
            self.torch_symm_mem_comm = None
            self.ranks = [0, 1]

        def all_reduce(self, input_):  # SGLang's structure: an out-of-place method, else in place
            if input_.shape[0] <= PCIE_CAP_ROWS:
                return self._all_reduce_out_place(input_, "pcie_ipc")
            self._all_reduce_in_place(input_)
            return input_

        def _all_reduce_out_place(self, input_, outplace_all_reduce_method):
            return input_ * 2

        def _all_reduce_in_place(self, input_):
            input_.mul_(2)

    ps.GroupCoordinator = GroupCoordinator
    coord = GroupCoordinator()
    ps.get_tp_group = lambda: coord
    ps.get_attn_tp_group = lambda: coord

    mr = types.ModuleType(I.MOD_MODEL_RUNNER)

    class ModelRunner:
        def __init__(self, draft=False):
            self.is_draft_worker = draft

        def forward(self, forward_batch, *args, **kwargs):
            for _ in range(AR_PER_FORWARD):
                coord.all_reduce(torch.ones(forward_batch.rows, 4))
            return "out"

        def init_cuda_graphs(self, capture_decode_cuda_graph):
            return None

    mr.ModelRunner = ModelRunner
    dg = types.ModuleType("sglang.srt.model_executor.runner.decode_cuda_graph_runner")
    gb = types.ModuleType(T.MOD_GRAPH_BACKEND)

    class BaseCudaGraphBackend:  # SGLang 0.5.23's interface (runner_backend/base_cuda_graph_backend.py)
        def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
            raise NotImplementedError

        def replay(self, shape_key, static_forward_batch, **kwargs):
            raise NotImplementedError

    class FullCudaGraphBackend(BaseCudaGraphBackend):
        def __init__(self, runner):
            self._cuda_graph_runner, self._graphs = runner, {}

        def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):
            forward_fn()  # warm-up run, eager
            with _capturing():
                forward_fn()  # the captured run
            self._graphs[shape_key] = True

        def replay(self, shape_key, static_forward_batch, **kwargs):
            assert self._graphs[shape_key]
            return "replayed"

    gb.BaseCudaGraphBackend = BaseCudaGraphBackend

    class DecodeCudaGraphRunner:
        def __init__(self, runner, width):
            self.model_runner, self.captured_req_width = runner, width
            self.capture_forward_mode = SimpleNamespace(name="DECODE" if runner.is_draft_worker else "TARGET_VERIFY")
            self.ragged_verify_mode = False
            self.backend = FullCudaGraphBackend(self)

        def _capture_graph_size(self, *, bs, num_tokens):  # SGLang 0.5.23's rule
            return num_tokens if self.ragged_verify_mode else bs

        def capture_one_shape(self, size, forward=None):
            key = _Key(self._capture_graph_size(bs=size, num_tokens=size * self.captured_req_width))
            self.backend.capture_one(key, lambda: forward(SimpleNamespace(rows=size * self.captured_req_width)))

        def execute(self, forward_batch, pp_proxy_tensors=None):
            self._replay_graph_key = _Key(min(s for s in (1, 2, 4) if s >= forward_batch.bs))
            return self.backend.replay(self._replay_graph_key, forward_batch)

    dg.DecodeCudaGraphRunner = DecodeCudaGraphRunner
    return {I.MOD_PARALLEL_STATE: ps, I.MOD_MODEL_RUNNER: mr, dg.__name__: dg, gb.__name__: gb}, coord


class _Key(tuple):
    """A hashable stand-in for SGLang's ``ShapeKey`` (``runner/shape_key.py``: a frozen dataclass with ``size``)."""

    def __new__(cls, size):
        return super().__new__(cls, (size,))

    @property
    def size(self):
        return self[0]


_capture_flag = {"on": False}


class _capturing:
    def __enter__(self):
        _capture_flag["on"] = True

    def __exit__(self, *exc):
        _capture_flag["on"] = False


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.setattr(R, "is_capturing", lambda: _capture_flag["on"])
    lines = []
    monkeypatch.setattr(R, "emit", lines.append)
    mods, coord = _modules()
    rep = I.install(
        mods, environ={"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "pcie_ipc"}, sglang_switch_modules=PCIE_IPC_SWITCH
    )
    yield mods, coord, rep, lines
    I.uninstall()


def _fb(mode, rows):
    return SimpleNamespace(forward_mode=SimpleNamespace(name=mode), rows=rows)


def test_eager_forwards_are_counted_by_the_method_sglang_ran_per_mode(patched):
    mods, _, rep, lines = patched
    assert set(rep.counting) == {
        "count_all_reduce",
        "count_out_place",
        "count_in_place",
        "count_mode",
        "count_capture",
        "count_replay",
    }, rep
    target, draft = mods[I.MOD_MODEL_RUNNER].ModelRunner(), mods[I.MOD_MODEL_RUNNER].ModelRunner(draft=True)
    target.forward(_fb("EXTEND", 40))  # prefill: wider than the workspace -> in place (PyNccl)
    assert lines == []  # no verify forward yet: no paths line
    target.forward(_fb("TARGET_VERIFY", 8))  # 2 requests x 4 draft tokens: the workspace takes it
    draft.forward(_fb("DECODE", 2))  # the drafter's own all-reduces, apart
    target.forward(_fb("TARGET_VERIFY", 12))  # 3 x 4: wider than the workspace
    got = COUNTER.snapshot()
    assert got == {
        "extend": {"sglang.pynccl": 3},
        "verify": {"sglang.pcie_ipc": 3, "sglang.pynccl": 3},
        "draft": {"sglang.pcie_ipc": 3},
    }
    # the rank's line came once, after the first verify forward, with the counts up to then
    assert len(lines) == 1 and lines[0].startswith("fastverify paths [TP 0] after the first verify forward: ")
    assert "verify: pcie_ipc took 3 of 3 (sglang.pcie_ipc 3)" in lines[0]
    assert "extend: pcie_ipc took 0 of 3 (sglang.pynccl 3)" in lines[0]
    assert (
        summary(got, backend="pcie_ipc").split("; ")[0]
        == "verify: pcie_ipc took 3 of 6 (sglang.pcie_ipc 3, sglang.pynccl 3)"
    )


def test_graphs_are_counted_at_capture_and_each_replay_is_attributed_to_its_graph(patched):
    mods, _, _, _ = patched
    mr, dg = mods[I.MOD_MODEL_RUNNER], mods["sglang.srt.model_executor.runner.decode_cuda_graph_runner"]
    target = mr.ModelRunner()
    graphs = dg.DecodeCudaGraphRunner(target, width=4)  # 4 draft tokens per request
    for size in (4, 2, 1):  # SGLang captures the large shapes first
        graphs.capture_one_shape(size, forward=lambda fb: target.forward.__wrapped__(target, fb))
    # captured runs only: bs 4 -> 16 rows (in place), bs 2 -> 8 and bs 1 -> 4 rows (pcie_ipc)
    assert {k[:2]: c for k, c in COUNTER.graphs.items()} == {
        ("verify", 4): {"sglang.pynccl": 3},
        ("verify", 2): {"sglang.pcie_ipc": 3},
        ("verify", 1): {"sglang.pcie_ipc": 3},
    }
    assert COUNTER.snapshot() == {"capture_warmup": {"sglang.pynccl": 3, "sglang.pcie_ipc": 6}}
    COUNTER.take()
    with COUNTER.in_mode("verify"):
        for bs in (1, 3, 3):  # replays of the bs-1 graph once and the bs-4 graph (padded) twice
            graphs.execute(SimpleNamespace(bs=bs))
    assert COUNTER.take() == {"verify": {"sglang.pcie_ipc": 3, "sglang.pynccl": 6}}
    assert COUNTER.unattributed_replays == 0


def test_a_slot_that_declines_a_tensor_is_counted_as_its_fallback(patched, monkeypatch):
    mods, coord, _, _ = patched

    class Capped:
        name = SimpleNamespace(value="b12x")
        path_counts: dict = {}

        def supports(self, x):
            return x.shape[0] <= 4

        def all_reduce(self, x):
            return x

    I.attach_dispatch_backend(Capped())
    I.uninstall()  # the dispatch wrapper is installed only where SGLang lacks its own switch
    mods, coord = _modules()
    I.install(
        mods, environ={"FASTVERIFY_PATCH": "1", "FASTVERIFY_BACKEND": "pcie_ipc"}, sglang_switch_modules=frozenset()
    )
    I.attach_dispatch_backend(Capped())
    target = mods[I.MOD_MODEL_RUNNER].ModelRunner()
    target.forward(_fb("TARGET_VERIFY", 4))  # 1 x 4: taken
    target.forward(_fb("TARGET_VERIFY", 10))  # 1 x 10 (tree draft): declined, SGLang's own path ran it
    assert COUNTER.snapshot() == {"verify": {"fastverify.b12x": 3, "fastverify.b12x.fallback": 3}}
    assert (
        summary(COUNTER.snapshot(), backend="b12x")
        == "verify: b12x took 3 of 6 (fastverify.b12x 3, fastverify.b12x.fallback 3)"
    )


def test_verify_records_carry_the_counts_since_the_previous_record(tmp_path):
    counter = PathCounter()
    timer = VerifyTimer(tmp_path, interval_s=0)
    with counter.in_mode("extend"):
        counter.count("sglang.gloo")
    with counter.in_mode("verify"):
        for _ in range(5):
            counter.count("sglang.gloo")
    timer.stop(timer.start(), counter.take())
    with counter.in_mode("verify"):
        counter.count("fastverify.gloo")
    timer.stop(timer.start(), counter.take())
    timer.drain()
    recs = [json.loads(x) for x in (tmp_path / next(p.name for p in tmp_path.iterdir())).read_text().splitlines()]
    assert [r["allreduce_paths"] for r in recs] == [
        {"extend": {"sglang.gloo": 1}, "verify": {"sglang.gloo": 5}},
        {"verify": {"fastverify.gloo": 1}},
    ]


@pytest.mark.parametrize(
    "name, draft, mode",
    [
        ("TARGET_VERIFY", False, "verify"),
        ("EXTEND", False, "extend"),
        ("DECODE", False, "decode"),
        ("DECODE", True, "draft"),
        ("DRAFT_EXTEND_V2", True, "draft_extend"),
        ("IDLE", False, "idle"),
    ],
)
def test_forward_modes(name, draft, mode):
    assert mode_of(SimpleNamespace(name=name), draft) == mode


@pytest.mark.parametrize(
    "path, backend",
    [
        ("sglang.pcie_ipc", "pcie_ipc"),
        ("sglang.ca", "custom_ar"),
        ("sglang.pynccl", "nccl"),
        ("sglang.gloo", "gloo"),
        ("fastverify.b12x", "b12x"),
        ("fastverify.b12x.fallback", None),
        ("sglang.qr", None),
    ],
)
def test_path_backends(path, backend):
    assert backend_of(path) == backend


_REAL_KEY = r"""
import json
from types import SimpleNamespace
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.model_executor.runner.shape_key import ShapeKey
from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend
from fastverify.patch.counting import graph_key
out = {}
for ragged in (False, True):
    for draft in (False, True):
        r = object.__new__(DecodeCudaGraphRunner)  # the GPU-only constructor is skipped; the rule is real
        r.ragged_verify_mode, r.captured_req_width = ragged, 4
        r.capture_forward_mode = ForwardMode.DECODE if draft else ForwardMode.TARGET_VERIFY
        r.model_runner = SimpleNamespace(is_draft_worker=draft)
        be = object.__new__(FullCudaGraphBackend)
        be._cuda_graph_runner = r  # what its constructor keeps
        # the key SGLang's capture_one_shape hands the backend: its own size rule
        out[f"{ragged}-{draft}"] = list(graph_key(be, ShapeKey(r._capture_graph_size(bs=3, num_tokens=12))))[:2]
print("RESULT " + json.dumps(out))
"""


def test_graph_keys_follow_sglangs_own_capture_size_rule():
    """The key a capture is counted under is the one SGLang replays by: its own
    ``DecodeCudaGraphRunner._capture_graph_size`` (0.5.23: the token count, size x tokens per
    request, in ragged-verify mode; else the batch size), with the target's TARGET_VERIFY graphs
    counted as verify and the draft runner's as draft."""
    import os
    import subprocess
    from pathlib import Path

    py = os.environ.get("FASTVERIFY_SGLANG_PYTHON")
    if not py or not Path(py).is_file():
        pytest.skip("FASTVERIFY_SGLANG_PYTHON not set (make the SGLang venv with .ci/sglang-venv.sh)")
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(repo))
    cp = subprocess.run([py, "-c", _REAL_KEY], capture_output=True, text=True, timeout=300, env=env, cwd=str(repo))
    assert cp.returncode == 0, cp.stderr[-3000:]
    got = json.loads(next(ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert got == {
        "False-False": ["verify", 3],
        "False-True": ["draft", 3],
        "True-False": ["verify", 12],
        "True-True": ["draft", 12],
    }


def test_nothing_is_routed_or_counted_while_torch_compile_traces(patched, monkeypatch):
    mods, coord, _, _ = patched
    monkeypatch.setattr(R, "is_compiling", lambda: True)
    coord.all_reduce(torch.ones(4, 4))
    assert COUNTER.snapshot() == {}
    monkeypatch.setattr(R, "is_compiling", lambda: False)
    coord.all_reduce(torch.ones(4, 4))
    assert COUNTER.snapshot() == {"other": {"sglang.pcie_ipc": 1}}
