"""doctor says only what it saw (issue 33 items 4, 5, 6, 9a, 9b), on a CPU box.

* the verify-timer check warms up what its timed steps touch first (a stand-in GPU whose first
  matmul waits for the device, as cuBLAS's handle/workspace creation and lazy kernel loading do);
* a driver that reports no peer access is a warning that names the backends it rules out, a
  timed-out direction a timeout, and only promised access that failed a failure (the reasons
  come from the real P2P side, run on a stand-in torch);
* backend latencies come from as many calls per graph as tune captures;
* ``doctor --json`` keeps stdout pure JSON and sends NCCL's log to a file;
* GPUs are numbered as CUDA sees them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import types

import pytest
import torch
from test_doctor_selfcheck import _no_cuda, gpu_ctx  # noqa: E402,F401 - _no_cuda: the same autouse fixture

from fastverify import doctor
from fastverify.doctor import Status, selfcheck

# --- item 4: the verify timer's first matmul ------------------------------------------------------


class StandInGpu:
    """One stream of GPU work on the host clock: work queued runs back to back; an event completes
    when the work queued before it has. The process's first matmul waits for the device (what
    cuBLAS's handle and workspace creation and lazy loading of the kernel can do), then runs."""

    CYCLES_PER_S = 1e9  # torch.cuda._sleep's spin: 10M cycles = 10 ms here

    def __init__(self) -> None:
        self.free_at = time.perf_counter()
        self.first_matmul_waits = True
        self.lock = threading.Lock()

    def enqueue(self, seconds: float) -> float:
        with self.lock:
            self.free_at = max(time.perf_counter(), self.free_at) + seconds
            return self.free_at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.free_at - time.perf_counter()))

    def module(self) -> types.ModuleType:
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t: float | None = None

            def record(self) -> None:
                self.t = gpu.enqueue(0.0)

            def query(self) -> bool:
                return self.t is not None and time.perf_counter() >= self.t

            def synchronize(self) -> None:
                time.sleep(max(0.0, self.t - time.perf_counter()))

            def elapsed_time(self, end: Event) -> float:
                return (end.t - self.t) * 1000

        class Tensor:
            def __matmul__(self, other: Tensor) -> Tensor:
                if gpu.first_matmul_waits:
                    gpu.first_matmul_waits = False
                    gpu.synchronize()
                gpu.enqueue(50e-6)
                return Tensor()

            def __truediv__(self, k: float) -> Tensor:
                gpu.enqueue(5e-6)
                return Tensor()

        cuda = types.SimpleNamespace(
            is_available=lambda: True,
            set_device=lambda i: None,
            Event=Event,
            synchronize=gpu.synchronize,
            _sleep=lambda cycles: gpu.enqueue(cycles / self.CYCLES_PER_S),
        )
        mod = types.ModuleType("torch")
        mod.cuda = cuda
        mod.randn = lambda *shape, device=None: Tensor()
        return mod


def test_verify_timer_warms_up_the_first_matmul_before_its_window(monkeypatch):
    """The check must pass on a GPU whose first matmul waits for the device. Before the warm-up,
    that wait (the 200 ms of queued spin) fell inside the timed window and the check failed with
    "the timer waits for the GPU"."""
    monkeypatch.setitem(sys.modules, "torch", StandInGpu().module())
    out = doctor.check_verify_timer(gpu_ctx())
    assert out.status is Status.ok, out.reason
    assert out.details["host_ms"] < selfcheck.TIMER_BUSY_MS / 2
    assert out.details["written_while_busy"] == 0 and out.details["written_after"] == selfcheck.TIMER_STEPS


def test_verify_timer_without_the_warm_up_blames_the_timer(monkeypatch):
    """The stand-in is sharp: with the warm-up taken out, the first matmul's wait lands in the
    window and the check fails (what doctor said on a GPU box before the fix)."""
    monkeypatch.setitem(sys.modules, "torch", StandInGpu().module())
    monkeypatch.setattr(selfcheck, "warm_up", lambda torch_mod, a, out_dir: a)
    out = doctor.check_verify_timer(gpu_ctx())
    assert out.status is Status.fail and "the timer waits for the GPU" in out.reason, out.reason
    assert out.details["host_ms"] >= selfcheck.TIMER_BUSY_MS / 2


# --- item 5: P2P the driver does not offer, P2P that timed out ------------------------------------


def _side_reports(
    monkeypatch,
    tmp_path,
    *,
    can_access: bool,
    open_error: str | None = None,
    sides: tuple[str, ...] = ("a", "b"),
    timeout_s: float = 5.0,
) -> dict:
    """The reports of the real P2P side (:func:`fastverify.topo.p2p.run_side`) for GPUs 0
    (side a) and 1 (side b), on a stand-in torch whose driver answers ``can_access`` to
    ``cudaDeviceCanAccessPeer`` and whose IPC open raises ``open_error``; each side publishes a
    stand-in buffer. Only ``sides`` run (one alone: its peer never answers)."""
    from fastverify.topo import p2p
    from fastverify.topo.p2p_proof import write_json_atomic

    def publish(torch_mod, me, my_gpu, workdir):
        write_json_atomic(workdir / f"{me}.handle.json", {"share": [my_gpu, {"hex": "00"}, 0, 0, 0, 0, 0, 0]})
        return object()

    def new_shared_cuda(*args):
        raise RuntimeError(open_error)

    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(can_device_access_peer=lambda a, b: can_access, synchronize=lambda d=None: None)
    fake.UntypedStorage = types.SimpleNamespace(_new_shared_cuda=new_shared_cuda)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(p2p, "publish_buffer", publish)
    gpu = {"a": 0, "b": 1}
    threads = [
        threading.Thread(
            target=p2p.run_side, args=(me, "b" if me == "a" else "a", gpu[me], 1 - gpu[me], tmp_path, timeout_s)
        )
        for me in sides
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {me: json.loads((tmp_path / f"{me}.report.json").read_text()) for me in sides}


def _results(reports: dict) -> dict:
    """Direction (memory on GPU i, used from GPU j) as the P2P check reports it: the user's access."""
    from fastverify.topo.p2p_proof import results_from_json

    gpu = {"a": 0, "b": 1}
    rows = [{"src": 1 - gpu[user], "dst": gpu[user], **r["access"]} for user, r in reports.items()]
    return results_from_json(rows)


def test_p2p_the_driver_does_not_offer_is_a_warning_naming_the_backends(monkeypatch, tmp_path):
    """An RTX 4090 box: cudaDeviceCanAccessPeer = 0 both ways. Before: fail, "fix ACS/IOMMU settings"."""
    from fastverify.registry import BACKENDS

    results = _results(_side_reports(monkeypatch, tmp_path, can_access=False))
    assert results[(1, 0)].reason == "driver reports no peer access (cudaDeviceCanAccessPeer(0, 1) = 0)"
    out = doctor.gpu.p2p_outcome(results)
    assert out.status is Status.warn, out
    needs = [b.name.value for b in BACKENDS if b.needs_p2p]
    assert set(needs) >= {"pcie_ipc", "b12x", "fused"}
    assert out.reason == (
        "this GPU/driver does not offer P2P (2 direction(s), first GPU0->GPU1: driver reports no "
        "peer access (cudaDeviceCanAccessPeer(1, 0) = 0)); " + "/".join(needs) + " are not candidates"
    )
    assert "ACS" not in (out.fix or "") and "IOMMU" not in (out.fix or "")
    assert out.details["not_offered"] == 2 and out.details["failed"] == 0


def test_p2p_access_the_driver_offered_that_failed_is_a_failure(monkeypatch, tmp_path):
    results = _results(
        _side_reports(
            monkeypatch,
            tmp_path,
            can_access=True,
            open_error="CUDA error: peer access is not supported between these two devices",
        )
    )
    out = doctor.gpu.p2p_outcome(results)
    assert out.status is Status.fail, out
    assert out.reason.startswith(
        "P2P access the driver offers failed for 2 direction(s), first GPU0->GPU1: "
        "RuntimeError: CUDA error: peer access"
    )
    assert "ACS/IOMMU" in out.fix


def test_a_timed_out_p2p_direction_is_a_timeout_not_a_failure(monkeypatch, tmp_path):
    """Side b never starts: side a waits for its buffer and times out. Before: fail, "fix ACS/IOMMU"."""
    reports = _side_reports(monkeypatch, tmp_path, can_access=True, sides=("a",), timeout_s=0.3)
    results = _results(reports)
    assert results[(1, 0)].timed_out, results
    out = doctor.gpu.p2p_outcome(results)
    assert out.status is Status.warn, out
    assert out.reason == (
        "P2P check timed out for 1 direction(s), first GPU1->GPU0: timeout waiting for GPU 1's buffer: P2P is not known"
    )
    assert out.details["timed_out"] == 1 and out.details["failed"] == 0
    # a real failure beside a timeout still fails
    from fastverify.topo.p2p_proof import P2PResult

    out = doctor.gpu.p2p_outcome({**results, (0, 1): P2PResult(False, "P2P read returned 12 of 4194304 bytes wrong")})
    assert out.status is Status.fail and "GPU0->GPU1: P2P read returned 12" in out.reason


def test_check_p2p_real_says_what_the_check_saw(monkeypatch):
    """The check itself, on the P2P check's results: no peer access warns, it does not fail."""
    from fastverify.doctor import gpu as doctor_gpu
    from fastverify.topo.p2p_proof import P2PResult

    got = {
        (0, 1): P2PResult(False, "driver reports no peer access (cudaDeviceCanAccessPeer(1, 0) = 0)"),
        (1, 0): P2PResult(False, "driver reports no peer access (cudaDeviceCanAccessPeer(0, 1) = 0)"),
    }
    monkeypatch.setattr(doctor_gpu, "check_p2p", lambda **kw: got)
    ctx = gpu_ctx(2)
    out = doctor.check_p2p_real(ctx)
    assert out.status is Status.warn and out.reason.startswith("this GPU/driver does not offer P2P"), out
    assert ctx.state["p2p"] is got  # the backends' probes still see P2P as not ok


# --- item 6: backend latencies from many calls per graph ------------------------------------------


def test_backend_trials_capture_as_many_calls_per_graph_as_tune(monkeypatch):
    """Each size is given Kimi-K2's all-reduces per verify step (1 + 2 x 61 layers = 123), so the
    worker captures 32 calls per graph (tune's cap) and the latency is per call over them. Before:
    1 call per graph, the rank skew of one replay in every number."""
    from fastverify import backends
    from fastverify.backends.base import Capability
    from fastverify.live.config import load_model_config
    from fastverify.tune import sweep
    from fastverify.tune.trial import TrialStatus
    from fastverify.tune.worker import GRAPH_OPS_MAX, graph_calls

    assert load_model_config("kimi-k2").num_layers == 61
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (12, 0))
    monkeypatch.setattr(backends, "probe", lambda name, ctx: Capability(True, "ok"))
    specs = {}

    def fake_run_trial(spec, *, timeout_s, startup_timeout_s=180.0, **kw):
        specs[spec.backend] = spec
        sizes = tuple(
            types.SimpleNamespace(msg_bytes=n * 2, median_us=10.0 + i, p90_us=11.0, max_rel_err=0.0)
            for i, (n, _) in enumerate(spec.sizes)
        )
        return types.SimpleNamespace(status=TrialStatus.OK, reason="", sizes=sizes)

    monkeypatch.setattr(sweep, "run_trial", fake_run_trial)
    ctx = gpu_ctx(2)
    ctx.state["p2p"] = {(0, 1): True, (1, 0): True}
    assert doctor.check_backends(ctx).status is Status.ok
    assert specs and all(c == 123 for s in specs.values() for _, c in s.sizes), specs
    assert graph_calls(123) == GRAPH_OPS_MAX == 32
    out = doctor.check_backend_latency(ctx)
    assert out.details["calls_per_graph"] == 32
    assert "median per call over graph replays of 32 calls" in out.reason, out.reason


# --- item 9a: doctor --json keeps stdout pure JSON -------------------------------------------------


def _noisy_check(seen: dict):
    """A check that writes to stdout the ways NCCL and the checks' children do, and records the
    environment a child process gets (:func:`fastverify.procs.child_env`)."""
    import os
    import subprocess

    from fastverify.procs import child_env

    def check(ctx):
        seen["child_env"] = child_env()
        print("NCCL INFO from print")
        os.write(1, b"host:1:1 [0] NCCL INFO from the library's own fd 1 write\n")
        subprocess.run(
            [sys.executable, "-c", "print('host:2:2 [0] NCCL INFO from a child')"], check=True, env=seen["child_env"]
        )
        log = seen["child_env"].get("NCCL_DEBUG_FILE", "")
        if "%p" in log and not seen.get("silent_nccl"):  # NCCL writing its log where it was told to
            with open(log.replace("%h", "host").replace("%p", str(os.getpid())), "w") as f:
                f.write("host:1:1 [0] NCCL INFO into the file\n")
        return doctor.Outcome(Status.ok, "noisy but fine")

    return check


def _doctor_json(monkeypatch, capfd, seen: dict) -> tuple[int, str, str]:
    from fastverify import cli

    monkeypatch.setattr(doctor, "CHECKS", (doctor.CheckSpec("noisy", _noisy_check(seen), False, True),))
    code = cli.main(["doctor", "--quick", "--json"])
    out, err = capfd.readouterr()
    return code, out, err


def test_doctor_json_stdout_is_json_with_nccl_debug_set(monkeypatch, capfd):
    """NCCL_DEBUG=INFO, no NCCL_DEBUG_FILE: the children get a NCCL_DEBUG_FILE in a fresh folder
    (one file per host and process), the summary names it, and whatever this process or a child
    writes to stdout goes to stderr. Before: the lines came first on stdout and json.loads failed."""
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    seen: dict = {}
    code, out, err = _doctor_json(monkeypatch, capfd, seen)
    assert code == 0, err
    doc = json.loads(out)
    assert [c["name"] for c in doc["checks"]] == ["noisy"] and doc["verdict"] == "ok"
    log = seen["child_env"]["NCCL_DEBUG_FILE"]
    assert log.endswith("/nccl.%h.%p.log") and os.path.isdir(os.path.dirname(log))
    assert doc["nccl_log"] == log
    for line in ("NCCL INFO from print", "NCCL INFO from the library's own fd 1 write", "NCCL INFO from a child"):
        assert line in err and line not in out
    assert "NCCL_DEBUG_FILE" not in os.environ  # set for the run only


def test_doctor_json_leaves_no_folder_where_nccl_wrote_nothing(monkeypatch, capfd):
    """NCCL never started (a CPU box, --quick): the folder made for its log is removed and the
    summary's nccl_log is null."""
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    seen: dict = {"silent_nccl": True}
    code, out, _ = _doctor_json(monkeypatch, capfd, seen)
    doc = json.loads(out)
    folder = os.path.dirname(seen["child_env"]["NCCL_DEBUG_FILE"])
    assert code == 0 and doc["nccl_log"] is None and not os.path.exists(folder)


def test_doctor_json_keeps_the_users_nccl_debug_file(monkeypatch, capfd, tmp_path):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "mine.%p"))
    seen: dict = {}
    code, out, _ = _doctor_json(monkeypatch, capfd, seen)
    doc = json.loads(out)
    assert code == 0 and "nccl_log" not in doc
    assert seen["child_env"]["NCCL_DEBUG_FILE"] == str(tmp_path / "mine.%p")


# --- item 9b: GPUs numbered as CUDA sees them -----------------------------------------------------


def _four_gpu_box():
    """NVML's 4 GPUs: 0-1 on NVLink, 2-3 under one PCIe host bridge, the rest across the CPUs;
    NVML could not read the 0-2 link and refuses P2P between 2 and 3."""
    from fastverify.topo.matrix import Gpu, Topology

    gpus = tuple(Gpu(index=i, name="H200", pci_bus_id=f"00000000:{0x18 + i:02X}:00.0") for i in range(4))
    links = {}
    for i in range(4):
        for j in range(4):
            if i != j:
                links[(i, j)] = "NV18" if {i, j} == {0, 1} else "PHB" if {i, j} == {2, 3} else "SYS"
    err = "NVML_ERROR_NOT_SUPPORTED"
    return Topology(
        gpus=gpus,
        links=links,
        link_errors={(0, 2): err, (2, 0): err},
        p2p_read={(2, 3): False, (3, 2): False},
        source="NVML",
    )


@pytest.mark.parametrize("torch_pci", [True, False], ids=["by-pci-address", "by-CUDA_VISIBLE_DEVICES"])
def test_doctor_numbers_gpus_as_cuda_sees_them(monkeypatch, torch_pci):
    """CUDA_VISIBLE_DEVICES=2,3 on a 4-GPU box: CUDA's GPU0/GPU1 are NVML's 2/3. The NVML check
    speaks of those two only, numbered 0 and 1, and the backend probes' NVLink fact is of NVML
    2-3 (PHB: no NVLink). Before: NVML's numbering (the 0-2 link error named as "GPU0-GPU2", a GPU
    CUDA does not see) and NVLink judged on NVML 0-1 (NV18: "full NVLink")."""
    from fastverify import backends
    from fastverify.backends.base import Capability
    from fastverify.doctor import gpu as doctor_gpu
    from fastverify.topo import nvml as topo_nvml
    from fastverify.tune import sweep
    from fastverify.tune.trial import TrialStatus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(topo_nvml, "read_nvml_topology", _four_gpu_box)
    monkeypatch.setattr(doctor_gpu, "read_nvml_topology", _four_gpu_box)
    props = (
        (lambda i: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1A + i, pci_device_id=0))
        if torch_pci
        else (lambda i: types.SimpleNamespace())
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    ctx = gpu_ctx(2)
    out = doctor.check_nvml_topology(ctx)
    assert ctx.state["cuda_to_nvml"] == {0: 2, 1: 3}
    assert out.status is Status.warn
    assert out.reason == (
        "4 GPU(s) via NVML, CUDA sees 2 of them (numbered as CUDA does); pairs: PHB 1; NVML "
        "refuses P2P for 2 direction(s)"
    ), out.reason

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setattr(backends, "probe", lambda name, pctx: Capability(True, "ok"))
    facts = {}

    def fake_run_trial(spec, *, timeout_s, startup_timeout_s=180.0, **kw):
        facts[spec.backend] = dict(spec.probe_facts)
        return types.SimpleNamespace(status=TrialStatus.OK, reason="", sizes=())

    monkeypatch.setattr(sweep, "run_trial", fake_run_trial)
    ctx.state["p2p"] = {(0, 1): True, (1, 0): True}
    doctor.check_backends(ctx)
    assert facts and all(f["nvlink_full"] is False for f in facts.values()), facts
