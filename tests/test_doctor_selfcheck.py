"""The single-GPU self-check of ``fastverify doctor`` (issue 9, What to build §5) and doctor's
share of items 2 and 9, on a CPU box.

Every new GPU check says ``skipped`` with its reason here, and the JSON summary holds it. The
decisions those checks make are exercised with given inputs: FlashInfer's real stream rule
(``bind_stream`` and the workspace's ``_check_stream``/``rebind_stream`` from the wheel) on fake
streams, the ``CUDA_DEVICE_MAX_CONNECTIONS`` verdict from given timings, the NCCL version
comparison, the JIT build summary, the verify-timer judgement, the trial phase (build vs
measurement) and the multi-GPU verdict over the backend trials.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import types
import zipfile
from pathlib import Path
from typing import Optional

import pytest
import torch

from fastverify import doctor
from fastverify.doctor import NO_GPU, Status, connections, jit, run_doctor, selfcheck, summarise
from fastverify.nccl.version import NcclVersion
from fastverify.registry import BACKENDS, BackendName, Role, names

NEW_GPU_CHECKS = (
    "torch_nccl",
    "nvml_topology",
    "cuda_max_connections",
    "jit_builds",
    "stream_binding",
    "flashinfer_norm",
    "verify_timer",
    "nccl_1rank",
    "live_graph_timing",
)
WHEEL_ENV = "FASTVERIFY_FLASHINFER_WHEEL"
AR_PATH = "flashinfer/comm/pcie_ipc_ar.py"


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def gpu_ctx(count: int = 1) -> doctor.CheckContext:
    ctx = doctor.CheckContext(quick=False, env_file=None)
    ctx._gpu = (None, count)
    return ctx


# --- skipped on CPU, in the JSON summary ----------------------------------------------------------


def test_new_gpu_checks_are_in_the_table_and_skip_on_cpu_with_the_reason():
    table = {s.name: s for s in doctor.CHECKS}
    for name in NEW_GPU_CHECKS:
        assert table[name].needs_gpu, name
    # jit_builds runs before every check that uses FlashInfer or starts a trial.
    order = [s.name for s in doctor.CHECKS]
    for later in ("stream_binding", "flashinfer_norm", "nccl_1rank", "backend_allreduce"):
        assert order.index("jit_builds") < order.index(later)
    only = tuple(s for s in doctor.CHECKS if s.name in NEW_GPU_CHECKS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(doctor, "CHECKS", only)
        checks = run_doctor(quick=False)
    summary = json.loads(json.dumps(summarise(checks)))
    got = {c["name"]: c for c in summary["checks"]}
    assert list(got) == list(NEW_GPU_CHECKS)
    for name in NEW_GPU_CHECKS:
        assert got[name]["status"] == "skipped" and got[name]["reason"] == NO_GPU, got[name]
    assert summary["counts"] == {"ok": 0, "warn": 0, "fail": 0, "skipped": len(NEW_GPU_CHECKS)}


def test_flashinfer_checks_skip_without_flashinfer_on_a_gpu_box(monkeypatch):
    """On a GPU box without FlashInfer (the H200 session box) the FlashInfer checks say so."""
    monkeypatch.setattr(selfcheck, "flashinfer_installed", lambda: False)
    for fn in (selfcheck.check_jit_builds, selfcheck.check_flashinfer_norm):
        out = fn(gpu_ctx())
        assert out.status is Status.skipped and out.reason == selfcheck.NO_FLASHINFER


def test_stream_rule_unavailable_names_why(monkeypatch):
    monkeypatch.delenv(WHEEL_ENV, raising=False)
    binding, why = selfcheck.load_binding("cuda:0")
    assert binding is None
    assert why.startswith("flashinfer not importable (ModuleNotFoundError") and why.endswith(f"{WHEEL_ENV} not set")
    monkeypatch.setenv(WHEEL_ENV, "/nonexistent.whl")
    binding, why = selfcheck.load_binding("cuda:0")
    assert binding is None and why == (
        f"{WHEEL_ENV}=/nonexistent.whl: cannot read {selfcheck.LIFECYCLE_PATH} (FileNotFoundError)"
    )


# --- stream binding: FlashInfer's real rule on fake streams --------------------------------------


class FakeStreams:
    """The :class:`fastverify.doctor.selfcheck.CudaStreams` interface over plain objects; the
    torch.cuda functions FlashInfer's rule reads are monkeypatched to this object's state."""

    def __init__(self, monkeypatch):
        self.default, self.side = object(), object()
        self.current, self.capturing = self.default, False
        self.orders: list[tuple[str, str]] = []
        self.uses = self.expected = 0
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)

    def name(self, s):
        return "default" if s is self.default else "side" if s is self.side else "other"

    @contextlib.contextmanager
    def on(self, s):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev

    def order(self, waiter, waited):
        self.orders.append((self.name(waiter), self.name(waited)))

    def use(self):
        self.uses += 1

    def ran(self, calls=1):
        self.expected += calls

    @contextlib.contextmanager
    def capture(self):
        prev, self.current, self.capturing = self.current, object(), True  # torch.cuda.graph's own stream
        try:
            yield
        finally:
            self.current, self.capturing = prev, False


@pytest.fixture(scope="module")
def fi_wheel():
    wheel = os.environ.get(WHEEL_ENV)
    if not wheel:
        pytest.skip(f"set {WHEEL_ENV} to the flashinfer-python 0.7.4 wheel to run FlashInfer's own stream rule")
    return wheel


def workspace_methods(wheel: str, bind_stream) -> type:
    """``PcieIpcAllReduceWorkspace._check_stream`` and ``rebind_stream``, compiled from the wheel's
    own source with the wheel's ``bind_stream`` as their global, as methods of a bare class."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read(AR_PATH).decode(), filename=AR_PATH)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PcieIpcAllReduceWorkspace")
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in ("_check_stream", "rebind_stream")]
    assert len(methods) == 2
    ns = {"bind_stream": bind_stream, "torch": torch, "Optional": Optional}
    exec(compile(ast.Module(body=methods, type_ignores=[]), AR_PATH, "exec"), ns)
    return type("Workspace", (), {"_check_stream": ns["_check_stream"], "rebind_stream": ns["rebind_stream"]})


def test_stream_steps_pass_with_flashinfers_real_rule(fi_wheel, monkeypatch):
    lifecycle = selfcheck.lifecycle_from_wheel(fi_wheel)
    for binding in (
        selfcheck.FunctionBinding(lifecycle.bind_stream, "cuda:0"),
        selfcheck.WorkspaceBinding(workspace_methods(fi_wheel, lifecycle.bind_stream), "cuda:0"),
    ):
        fake = FakeStreams(monkeypatch)
        rows = selfcheck.run_steps(binding, fake)
        assert [r["did"] for r in rows] == [
            "binds default",
            "binds default",
            "raises already bound",
            "binds side",
            "exempt",
            "binds default",
        ], rows
        assert all(r["ok"] for r in rows)
        assert fake.orders == [("side", "default"), ("default", "side")]  # ordered before each rebind
        assert (fake.uses, fake.expected) == (5, 4)  # 4 executed calls + 1 captured
        ok, line = selfcheck.judge(rows, fake.expected, fake.expected)
        assert ok and line.startswith("6 steps as FlashInfer's rule says")


@pytest.mark.parametrize(
    "broken, step, did",
    [
        # a rule that never refuses another stream: the side-stream step does not raise
        (lambda dev, bound, op: torch.cuda.current_stream(dev), 2, "binds side"),
        # a rule that forgets the capture exemption: the capture step raises
        ("no_exemption", 4, "raises already bound"),
    ],
)
def test_stream_steps_fail_when_the_rule_is_broken(fi_wheel, monkeypatch, broken, step, did):
    lifecycle = selfcheck.lifecycle_from_wheel(fi_wheel)
    if broken == "no_exemption":

        def broken(dev, bound, op):
            current = torch.cuda.current_stream(dev)
            if bound is not None and current != bound:
                raise RuntimeError(f"this workspace is already bound to {bound}")
            return current

    fake = FakeStreams(monkeypatch)
    rows = selfcheck.run_steps(selfcheck.FunctionBinding(broken, "cuda:0"), fake)
    assert rows[step]["did"] == did and not rows[step]["ok"]
    ok, line = selfcheck.judge(rows)
    assert (
        not ok and line == f"{selfcheck.STEPS[step][0]}: expected '{selfcheck.STEPS[step][3]}', FlashInfer did '{did}'"
    )
    # the real rule on the same fakes passes, so the difference is the rule
    assert all(
        r["ok"]
        for r in selfcheck.run_steps(selfcheck.FunctionBinding(lifecycle.bind_stream, 0), FakeStreams(monkeypatch))
    )


def test_judge_catches_lost_ordering():
    rows = [{"step": s[0], "expect": s[3], "did": s[3], "ok": True} for s in selfcheck.STEPS]
    assert selfcheck.judge(rows, 4, 4)[0]
    ok, line = selfcheck.judge(rows, 3, 4)
    assert not ok and line == "the calls' work on the two streams summed to 3, expected 4"


# --- CUDA_DEVICE_MAX_CONNECTIONS ----------------------------------------------------------------


@pytest.mark.parametrize(
    "ratios, word",
    [
        ({"unset": 2.02, "early": 3.01, "late": 3.0}, connections.TAKES_EFFECT),
        ({"unset": 2.02, "early": 3.01, "late": 2.05}, connections.DOES_NOT),
        ({"unset": 2.9, "early": 3.01, "late": 3.0}, connections.INCONCLUSIVE),  # no overlap even by default
        ({"unset": 2.02, "early": 2.1, "late": 2.0}, connections.INCONCLUSIVE),  # the setting does nothing at all
        ({"unset": 2.02, "early": None, "late": 3.0}, connections.INCONCLUSIVE),
        ({"unset": 2.0, "early": 2.5, "late": 2.5}, connections.TAKES_EFFECT),  # 2.5 is serial (the boundary)
    ],
)
def test_connections_verdict(ratios, word):
    got, why = connections.verdict(ratios)
    assert got == word, why
    if word == connections.TAKES_EFFECT and ratios["late"] == 3.0:
        assert why == (
            "set after torch.cuda.is_available() it still serializes the streams (unset 2.02, early 3.01, late 3.00)"
        )
    if ratios["early"] is None:
        assert why.startswith("no measurement for early")


def test_connections_child_reports_a_failure_as_one_line(monkeypatch):
    """The children need CUDA; here each fails and the check says inconclusive, not a traceback."""
    runs = connections.measure(timeout_s=120)
    assert set(runs) == set(connections.MODES)
    for mode in connections.MODES:
        assert runs[mode]["error"].startswith("exit code 1: "), runs[mode]
    out = selfcheck.check_cuda_max_connections(gpu_ctx())
    assert out.status is Status.warn and "inconclusive" in out.reason and "no measurement for unset" in out.reason


# --- NCCL version --------------------------------------------------------------------------------


MAPS = """\
7f01a000-7f01b000 r-xp 00000000 08:01 123 /usr/lib/python3/site-packages/nvidia/nccl/lib/libnccl.so.2
7f01b000-7f01c000 r--p 00001000 08:01 123 /usr/lib/python3/site-packages/nvidia/nccl/lib/libnccl.so.2
7f02a000-7f02b000 r-xp 00000000 08:01 124 /usr/lib/libnccl-net.so
7f03a000-7f03b000 rw-p 00000000 00:00 0
7f04a000-7f04b000 r-xp 00000000 08:01 125 /opt/x/lib/libnccl.so.2.21.5 (deleted)
"""


def test_libnccl_mapped_reads_proc_maps():
    assert selfcheck.libnccl_mapped(MAPS) == [
        "/usr/lib/python3/site-packages/nvidia/nccl/lib/libnccl.so.2",
        "/opt/x/lib/libnccl.so.2.21.5 (deleted)",
    ]
    assert selfcheck.libnccl_mapped(Path("/proc/self/maps").read_text()) == []  # CPU torch maps no NCCL


@pytest.mark.parametrize(
    "torch_says, lib, status",
    [
        ((2, 27, 3), (2, 27, 3), Status.ok),
        ((2, 27, 3, "+cuda12.9"), (2, 27, 3), Status.ok),
        ((2, 27, 3), (2, 27, 5), Status.warn),
        ((2, 27, 3), None, Status.warn),
    ],
)
def test_compare_nccl(torch_says, lib, status):
    library = None if lib is None else NcclVersion.of(*lib, library="/x/libnccl.so.2")
    got, reason, fix = selfcheck.compare_nccl(torch_says, library, "mapped in this process")
    assert got is status, reason
    if status is Status.ok:
        assert reason == "torch loads NCCL 2.27.3; ncclGetVersion of /x/libnccl.so.2 (mapped in this process) agrees"
        assert fix is None
    elif lib is not None:
        assert "says 2.27.5" in reason and fix == "set NCCL_LIBRARY to the libnccl torch loads"


# --- JIT builds (item 9) -------------------------------------------------------------------------


def test_jit_summary_names_the_module_still_building_at_the_limit():
    events = [
        {"module": "norm", "event": "start", "aot": False, "cached": True},
        {"module": "norm", "event": "done", "seconds": 0.4},
        {"module": "pcie_ipc_comm", "event": "start", "aot": False, "cached": False},
    ]
    res = jit.summarize(events, killed=True, limit_s=900, elapsed_s=900.2, exit_reason="stopped")
    assert res["building"] == "pcie_ipc_comm"
    assert res["modules"]["norm"] == {"aot": False, "cached": True, "status": "loaded", "seconds": 0.4}
    out = selfcheck.jit_outcome(res)
    assert out.status is Status.warn
    assert (
        out.reason
        == "building/JIT: pcie_ipc_comm still building after 900 s (norm loaded 0.4 s; pcie_ipc_comm building)"
    )


def test_jit_summary_crash_inside_a_build_is_an_error_not_a_build():
    events = [{"module": "trtllm_comm", "event": "start", "aot": False, "cached": False}]
    res = jit.summarize(events, killed=False, limit_s=900, elapsed_s=3, exit_reason="exit code 1: nvcc not found")
    assert res["building"] is None and res["errors"] == {"trtllm_comm": "exit code 1: nvcc not found"}
    out = selfcheck.jit_outcome(res)
    assert (
        out.status is Status.fail
        and out.reason == "FlashInfer JIT build of trtllm_comm failed: exit code 1: nvcc not found"
    )


def test_jit_summary_all_built():
    events = [
        {"module": "norm", "event": "start", "aot": False, "cached": False},
        {"module": "norm", "event": "done", "seconds": 71.25},
        {"module": "trtllm_comm", "event": "skipped", "reason": "kernel not built for SM89"},
    ]
    out = selfcheck.jit_outcome(jit.summarize(events, killed=False, limit_s=900, elapsed_s=72))
    assert out.status is Status.ok and out.reason == "FlashInfer modules: norm built 71.2 s; trtllm_comm skipped"


def test_jit_modules_gate_on_the_registry():
    gated = {b for *_, b in jit.MODULES if b is not None}
    assert gated <= set(BackendName)
    # trtllm_comm is built only where the fused kernel runs (flashinfer/jit/comm.py: majors 9, 10, 12)
    from fastverify.registry import backend_info

    fused = next(b for label, *_, b in jit.MODULES if label == "trtllm_comm")
    assert [m for m in range(7, 13) if backend_info(fused).kernel_runs_on((m, 0))] == [9, 10, 12]


# --- trials: the build kept out of the measurement limit (item 9) ---------------------------------


@pytest.mark.parametrize(
    "status, reason, phase",
    [
        (
            "failed",
            "timeout after 660 s; still running: rank 0: make backend pcie_ipc, rank 1: make backend pcie_ipc",
            "building/JIT",
        ),
        (
            "failed",
            "timeout after 60 s; still running: rank 0: numel 28672: timing, rank 1: make backend pcie_ipc",
            "measurement",
        ),
        ("failed", "build timeout after 600 s; still running: rank 0: make backend fused", "building/JIT"),
        ("failed", "rank 1 crashed (exit code 1): make backend fused", "measurement"),
        ("failed", "start-up timeout after 120 s; still running: rank 0: init process group", "start-up"),
        ("ok", "", "measurement"),
        ("wrong_result", "numel 4: max relative error 0.5 on rank 0", "measurement"),
    ],
)
def test_trial_phase(status, reason, phase):
    assert jit.trial_phase(status, reason) == phase


def test_trial_phase_reads_the_runners_own_build_message():
    from fastverify.tune import sweep

    assert jit.runner_has_build_phase(sweep.run_trial) is hasattr(sweep, "BUILD_HANG")
    if not hasattr(sweep, "BUILD_HANG"):
        pytest.skip("this trial runner has no build phase")
    reason = f"build timeout after 600 s ({sweep.BUILD_HANG}); still building: rank 0"
    assert jit.trial_phase("failed", reason) == "building/JIT"


@pytest.mark.parametrize("has_build_phase", [True, False])
def test_run_doctor_trial_keeps_the_build_out_of_the_measurement_limit(monkeypatch, has_build_phase):
    from fastverify.tune import sweep

    seen = {}
    res = types.SimpleNamespace(
        status=types.SimpleNamespace(value="failed"),
        reason="timeout after 660 s; still running: rank 0: make backend pcie_ipc",
    )
    if has_build_phase:

        def fake(spec, *, timeout_s, startup_timeout_s=180.0, build_timeout_s=300.0):
            seen.update(timeout_s=timeout_s, startup=startup_timeout_s, build=build_timeout_s)
            return res
    else:

        def fake(spec, *, timeout_s, startup_timeout_s=180.0):
            seen.update(timeout_s=timeout_s, startup=startup_timeout_s)
            return res

    monkeypatch.setattr(sweep, "run_trial", fake)
    got, how = jit.run_doctor_trial("spec", timeout_s=60, startup_timeout_s=120, build_timeout_s=600)
    assert got is res and how["phase"] == "building/JIT"
    if has_build_phase:
        assert seen == {"timeout_s": 60, "startup": 120, "build": 600}
    else:
        assert seen == {"timeout_s": 660, "startup": 120}
    assert how["limits"]["given_s"] == (60 if has_build_phase else 660)


def _per(status, reason="", phase="measurement"):
    return {"status": status, "reason": reason, "phase": phase}


def test_backends_verdict_building_warns_wrong_result_fails():
    kw = dict(world=2, hidden=7168, p2p_note="ok", nvlink_full=False)
    out = doctor.gpu.backends_outcome(
        {"nccl": _per("ok"), "pcie_ipc": _per("building/JIT", "building/JIT: timeout", "building/JIT")}, **kw
    )
    assert out.status is Status.warn and out.reason.startswith("nccl ok, pcie_ipc building/JIT; pcie_ipc: building/JIT")
    out = doctor.gpu.backends_outcome({"nccl": _per("ok"), "fused": _per("wrong_result", "numel 4: error 0.5")}, **kw)
    assert out.status is Status.fail and out.fix.startswith("do not deploy fused")
    out = doctor.gpu.backends_outcome({"nccl": _per("failed", "rank 0 crashed"), "pcie_ipc": _per("ok")}, **kw)
    assert out.status is Status.fail and out.reason.endswith("nccl: rank 0 crashed")
    out = doctor.gpu.backends_outcome({"nccl": _per("ok"), "custom_ar": _per("skipped", "needs 2 GPUs")}, **kw)
    assert out.status is Status.ok


# --- the registry, not string literals (item 2's caller) ------------------------------------------


def test_doctor_iterates_the_registry():
    got = doctor.backends_to_probe()
    assert got[0] is BackendName.nccl and got[1:] == names(tunable=True, device="cuda")
    assert set(got) == {b.name for b in BACKENDS if b.device == "cuda" and (b.tunable or b.role is Role.baseline)}


def test_no_backend_name_is_spelled_in_doctor():
    """Registry names appear in doctor's code only through BackendName; ``"nccl"``/``"gloo"`` are
    allowed where they are torch.distributed's own process-group backend names (the argument of
    ``init_process_group``, ``ProbeContext.group_backend``, a Kineto trace's
    ``distributedInfo.backend``)."""
    spelled = {b.value for b in BackendName}
    root = Path(doctor.__file__).parent
    offenders = []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        allowed = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("init_process_group") and node.args:
                allowed.add(id(node.args[0]))
            if isinstance(node, ast.keyword) and node.arg == "group_backend":
                allowed.add(id(node.value))
            if isinstance(node, ast.Dict):
                allowed.update(
                    id(v)
                    for k, v in zip(node.keys, node.values)
                    if isinstance(k, ast.Constant) and k.value == "backend"
                )
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and node.value in spelled
                and not (id(node) in allowed and node.value in ("nccl", "gloo"))
            ):
                offenders.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert offenders == []


# --- verify timer and NVML on one GPU -------------------------------------------------------------


def _rows(n):
    return [{"step": i, "verify_ms": 0.5, "clock": "cuda_events", "rank": "0", "pid": 1} for i in range(n)]


@pytest.mark.parametrize(
    "kw, ok, start",
    [
        (
            dict(host_ms=1.2, written_while_busy=0, written_after=8, rows=_rows(8)),
            True,
            "8 steps timed with CUDA events",
        ),
        (
            dict(host_ms=150.0, written_while_busy=0, written_after=8, rows=_rows(8)),
            False,
            "recording and draining took",
        ),
        (dict(host_ms=1.2, written_while_busy=2, written_after=6, rows=_rows(8)), False, "the drain wrote 2 row(s)"),
        (dict(host_ms=1.2, written_while_busy=0, written_after=7, rows=_rows(7)), False, "7 row(s) written"),
        (
            dict(
                host_ms=1.2,
                written_while_busy=0,
                written_after=8,
                rows=_rows(7) + [{"verify_ms": 0.5, "clock": "cpu_wall_clock"}],
            ),
            False,
            "row {",
        ),
    ],
)
def test_judge_verify_timer(kw, ok, start):
    got, line = selfcheck.judge_verify_timer(busy_ms=200.0, steps=8, **kw)
    assert got is ok and line.startswith(start), line


def test_match_torch_to_nvml_by_pci_address():
    nvml = ["00000000:18:00.0", "00000000:3B:00.0", None]
    got = doctor.match_torch_to_nvml(nvml, [(0, 0x3B, 0), (0, 0x18, 0), (0, 0x99, 0), None])
    assert got == {"cuda_to_nvml": {0: 1, 1: 0, 2: None, 3: None}, "unmatched": [2], "unknown": [3]}


def test_nvml_check_names_unsupported_queries_and_unknown_links(monkeypatch):
    from fastverify.doctor import gpu as doctor_gpu
    from fastverify.topo.matrix import Gpu, Topology

    gpus = tuple(
        Gpu(
            index=i,
            name="H200",
            pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
            numa_node=0,
            cpu_affinity=None,
            pcie_gen=5,
            pcie_width=16,
            pcie_max_gen=5,
            pcie_max_width=16,
            gpu_numa_id=None,
        )
        for i in range(2)
    )
    err = "NVML_ERROR_NOT_SUPPORTED"
    topo = Topology(
        gpus=gpus,
        links={},
        link_errors={(0, 1): err, (1, 0): err},
        unsupported=(
            f"nvmlDeviceGetTopologyCommonAncestor(GPU 0, GPU 1): {err}",
            f"nvmlDeviceGetTopologyCommonAncestor(GPU 1, GPU 0): {err}",
        ),
        source="NVML",
    )
    monkeypatch.setattr(doctor_gpu, "read_nvml_topology", lambda: topo)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x18 + i, pci_device_id=0),
    )
    out = doctor.check_nvml_topology(gpu_ctx(2))
    assert out.status is Status.warn
    assert out.reason == (
        "2 GPU(s) via NVML; pairs: none known; 2 NVML queries not supported; NVML did not "
        "report the link of 1 pair(s), first GPU0-GPU1: NVML_ERROR_NOT_SUPPORTED"
    )
    assert out.details["unsupported"] == list(topo.unsupported)
    one = Topology(gpus=gpus[:1], links={}, source="NVML (driver 580.159.03)")
    monkeypatch.setattr(doctor_gpu, "read_nvml_topology", lambda: one)
    out = doctor.check_nvml_topology(gpu_ctx(1))
    assert out.status is Status.ok and out.reason == "1 GPU(s) via NVML (driver 580.159.03); pairs: no pairs (one GPU)"


# --- check_backends end to end with a stand-in trial runner (item 9) --------------------------------


def test_a_trial_still_building_is_not_a_failed_backend(monkeypatch):
    """A pcie_ipc trial that times out while its ranks are still constructing the backend (the
    JIT build of FlashInfer's module) is reported as building/JIT, a warning, and the trial got
    more than the 60 s measurement limit for it. At af0acb4 this was "fail: do not deploy
    pcie_ipc", and the build had 60 s."""
    import fastverify.backends as backends
    from fastverify.backends.base import Capability
    from fastverify.tune import sweep
    from fastverify.tune.trial import TrialStatus

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (12, 0))
    monkeypatch.setattr(backends, "probe", lambda name, ctx: Capability(True, "ok"))
    given: dict[str, float] = {}

    def fake_run_trial(spec, *, timeout_s, startup_timeout_s=180.0, **kw):
        given[spec.backend] = timeout_s + sum(kw.values())  # the time the build could use
        if spec.backend == BackendName.pcie_ipc.value:
            return types.SimpleNamespace(
                status=TrialStatus.FAILED,
                sizes=(),
                reason=(
                    f"timeout after {timeout_s:g} s; still running: rank 0: make backend pcie_ipc, "
                    "rank 1: make backend pcie_ipc"
                ),
            )
        sizes = tuple(
            types.SimpleNamespace(msg_bytes=n * 2, median_us=20.0, p90_us=21.0, max_rel_err=0.0) for n, _ in spec.sizes
        )
        return types.SimpleNamespace(status=TrialStatus.OK, reason="", sizes=sizes)

    monkeypatch.setattr(sweep, "run_trial", fake_run_trial)
    ctx = gpu_ctx(2)
    ctx.state["p2p"] = {(0, 1): True, (1, 0): True}
    out = doctor.check_backends(ctx)
    per = out.details["backends"]
    assert per["pcie_ipc"]["status"] == "building/JIT", per["pcie_ipc"]
    assert per["nccl"]["status"] == "ok"
    assert out.status is Status.warn, out
    assert "pcie_ipc: building/JIT: timeout after" in out.reason
    assert given["pcie_ipc"] >= doctor.core.TRIAL_TIMEOUT_S + doctor.core.TRIAL_BUILD_S


@pytest.mark.parametrize(
    "timed, graph, want", [("cuda_graph", [900.0, 800.0, 850.0], Status.ok), ("eager", [], Status.fail)]
)
def test_live_graph_timing_wants_graph_replays(monkeypatch, timed, graph, want):
    """The live check passes only when the runner timed CUDA-graph replays, one whole-graph timing
    per verify step; an eager-timed run fails and says what it timed."""
    from types import SimpleNamespace

    rank = SimpleNamespace(
        names=["attn", "all_reduce"],
        name_id=[0, 1, 0, 1],
        steps=[[0, 0, 1]] * 3,
        meta={"timed_forward": timed, "graph_forward_us": graph, "eager_forward_us": [1500.0] * 3 if graph else []},
    )
    monkeypatch.setattr(selfcheck, "run_live", lambda *a, **k: [rank])
    out = selfcheck.check_live_graph_timing(None)
    assert out.status is want, out
    if want is Status.ok:
        assert "850.0 us from its graph, 1500.0 us eager" in out.reason
    else:
        assert "timed 'eager' forwards, not CUDA-graph replays" in out.reason
