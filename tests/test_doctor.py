"""``fastverify doctor`` on a machine without a GPU: the CPU checks pass, every GPU check is skipped
with the no-GPU reason, a failing or raising check never stops the others, and the summary counts.

``torch.cuda.is_available`` is forced False here, so these tests mean the same on a GPU box; the GPU
checks themselves are exercised by running ``fastverify doctor`` on one.
"""

from __future__ import annotations

import dataclasses
import json
import time
from decimal import Decimal

import orjson
import pytest

from fastverify import doctor
from fastverify.doctor import NO_GPU, PATCH_NOT_CHECKED, Check, Status, run_doctor, summarise

GPU_CHECKS = {s.name for s in doctor.CHECKS if s.needs_gpu}
QUICK_CHECKS = [s.name for s in doctor.CHECKS if s.quick]


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def full_run():
    import torch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        t0 = time.perf_counter()
        checks = run_doctor(quick=False)
        return checks, time.perf_counter() - t0


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def assert_well_formed(checks: list[Check]) -> None:
    for c in checks:
        assert isinstance(c.status, Status)
        assert c.reason and "\n" not in c.reason and "Traceback" not in c.reason, c
        assert c.fix is None or (c.fix and "\n" not in c.fix), c
        assert c.seconds >= 0
        json.dumps(c.details)  # JSON-able


def expected_allreduce_from_file(text: bytes) -> tuple[int, Decimal]:
    """Count and summed µs of the NCCL all-reduce kernels, read from the trace text with Decimal
    (no float, no fastverify code)."""
    doc = json.loads(text, parse_float=Decimal)
    durs = [
        Decimal(ev["dur"])
        for ev in doc["traceEvents"]
        if ev.get("cat") == "kernel" and ev["name"].startswith("ncclDevKernel_AllReduce")
    ]
    return len(durs), sum(durs, Decimal(0))


# --- whole runs ---------------------------------------------------------------------------------


def test_quick_run_runs_only_quick_checks_and_is_fast():
    t0 = time.perf_counter()
    checks = run_doctor(quick=True)
    elapsed = time.perf_counter() - t0
    assert [c.name for c in checks] == QUICK_CHECKS
    assert_well_formed(checks)
    got = by_name(checks)
    for name in ("versions", "trace_analyzer", "env_file"):
        assert got[name].status is Status.ok, got[name]
    assert "gloo_allreduce" not in got  # starts processes: not quick
    # --quick on a machine without the NVIDIA driver never imports torch (1-3 s): it says so
    import os

    from fastverify.doctor.core import NO_DRIVER, NVIDIA_DEVICE_NODES

    no_driver = not any(os.path.exists(p) for p in NVIDIA_DEVICE_NODES)
    for name in GPU_CHECKS & set(got):
        assert got[name].status is Status.skipped and got[name].reason == (NO_DRIVER if no_driver else NO_GPU)
    if no_driver:
        assert got["versions"].details["torch_imported"] is False and "not imported" in got["versions"].reason
    assert elapsed < 10, elapsed


def test_quick_versions_on_a_driverless_machine_import_no_torch(tmp_path):
    """In a fresh interpreter: doctor --quick leaves torch out of sys.modules when there is no driver."""
    import os
    import subprocess
    import sys

    from fastverify.doctor.core import NVIDIA_DEVICE_NODES

    if any(os.path.exists(p) for p in NVIDIA_DEVICE_NODES):
        pytest.skip("this machine has the NVIDIA driver: --quick imports torch to look for GPUs")
    code = "import sys; from fastverify.doctor import run_doctor; run_doctor(quick=True); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_full_run_cpu_checks_pass_and_gpu_checks_skip(full_run):
    """Every check's status, exactly. The machinery checks pass ("ok") on any box; each library
    check has the one status this box's installs call for, found here without the doctor's code
    (import specs, distribution versions, ``ncclGetVersion`` through ctypes); every GPU check is
    skipped with the no-GPU reason."""
    import ctypes
    import ctypes.util
    import glob
    import importlib.metadata
    import importlib.util
    import os
    import sys

    import torch

    checks, elapsed = full_run
    assert [c.name for c in checks] == [s.name for s in doctor.CHECKS]
    assert_well_formed(checks)
    got = by_name(checks)
    for name in sorted(GPU_CHECKS):
        assert (got[name].status, got[name].reason) == (Status.skipped, NO_GPU), got[name]
    assert "no CUDA GPU" in NO_GPU
    machinery = ("versions", "gloo_allreduce", "trace_analyzer", "env_file")
    libraries = ("nccl_library", "flashinfer", "sglang", "sglang_patch_targets")
    assert set(got) - GPU_CHECKS == set(machinery + libraries)  # a new CPU check must be added here
    for name in machinery:
        assert got[name].status is Status.ok, got[name]
    gloo = got["gloo_allreduce"].details
    assert gloo["trial"] == "ok" and gloo["clock"] == "cpu_wall_clock"
    assert all(s["max_rel_err"] is not None and s["max_rel_err"] < 0.03125 for s in gloo["sizes"])

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def nccl_code():  # the first libnccl that loads, searched where torch and the nvidia wheel put it
        paths = [os.environ.get("NCCL_LIBRARY", "")]
        paths += glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libnccl*.so*"))
        paths += [p for d in sys.path for p in glob.glob(os.path.join(d, "nvidia", "nccl", "lib", "libnccl.so*"))]
        paths.append(ctypes.util.find_library("nccl") or "")
        for path in filter(None, paths):
            try:
                code = ctypes.c_int()
                if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code)) == 0:
                    return code.value
            except (OSError, AttributeError):
                continue
        return None

    has_fi, has_sg = importlib.util.find_spec("flashinfer") is not None, importlib.util.find_spec("sglang") is not None
    code = nccl_code()
    want = {
        "nccl_library": Status.warn if code is None else Status.ok,
        "flashinfer": Status.skipped
        if not has_fi
        else Status.ok
        if version("flashinfer-python") == "0.7.4"
        else Status.warn,
        "sglang": Status.ok if has_sg else Status.skipped,
        "sglang_patch_targets": Status.skipped
        if not has_sg
        else Status.ok
        if version("sglang") == "0.5.23"
        else Status.warn,
    }
    assert {name: got[name].status for name in libraries} == want
    nccl, targets = got["nccl_library"].reason, got["sglang_patch_targets"].reason
    # NCCL >= 2.9 encodes its version as major * 10000 + minor * 100 + patch (nccl.h, NCCL_VERSION_CODE)
    assert (
        nccl == doctor.NO_NCCL
        if code is None
        else nccl.startswith(f"NCCL {code // 10000}.{code % 10000 // 100}.{code % 100} (")
    ), nccl
    assert (
        targets == PATCH_NOT_CHECKED if not has_sg else targets.endswith("patch targets found in the installed SGLang")
    ), targets
    assert elapsed < 60, elapsed


def test_trace_analyzer_finds_the_exact_allreduce_time(full_run, tmp_path):
    details = by_name(full_run[0])["trace_analyzer"].details
    text = orjson.dumps(doctor.sample_trace())  # what the check wrote
    count, total_us = expected_allreduce_from_file(text)
    assert count == 2
    assert details["allreduce_count"] == count
    assert Decimal(repr(details["allreduce_us"])) == total_us  # 12.345 + 7.891 = 20.236 µs, to the ns
    assert details["compute_count"] == 2 and details["memory_count"] == 2 and details["steps"] == 2
    assert details["msg_bytes"] == [4 * 7168 * 2]


def test_trace_analyzer_check_fails_when_the_analyzer_is_off(monkeypatch):
    import fastverify.analyze as analyze_mod
    from fastverify.doctor import cpu as doctor_cpu

    real = analyze_mod.analyze

    def off_by_one_ns(ranks):
        body = real(ranks)
        body["ranks"][0]["allreduce_kernel_sum_us"] += 0.001
        return body

    monkeypatch.setattr(doctor_cpu, "analyze", off_by_one_ns)
    c = by_name(run_doctor(quick=True))["trace_analyzer"]
    assert c.status is Status.fail
    assert "allreduce_us 20.237" in c.reason and "expected 20.236" in c.reason


# --- env file ----------------------------------------------------------------------------------


def test_bad_env_file_fails_with_the_line_number(tmp_path):
    path = tmp_path / "box.env"
    path.write_text("# tuned\nNCCL_P2P_LEVEL=SYS\nNCCL_PROTOCOL=LL\n")
    c = by_name(run_doctor(quick=True, env_file=str(path)))["env_file"]
    assert c.status is Status.fail
    assert c.reason.startswith(f"{path}: line 3: NCCL_PROTOCOL")
    assert "line named" in c.fix


def test_unreadable_env_file_fails_with_its_path(tmp_path):
    path = tmp_path / "missing.env"
    c = by_name(run_doctor(quick=True, env_file=str(path)))["env_file"]
    assert c.status is Status.fail and str(path) in c.reason and "readable" in c.fix


def test_good_env_file_is_ok(tmp_path):
    path = tmp_path / "box.env"
    path.write_text("# tuned\nNCCL_P2P_LEVEL=SYS\nCUDA_DEVICE_MAX_CONNECTIONS=1\n")
    c = by_name(run_doctor(quick=True, env_file=str(path)))["env_file"]
    assert c.status is Status.ok, c
    assert c.details["settings"] == {"NCCL_P2P_LEVEL": "SYS", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_env_file_with_an_sglang_switch_fails(tmp_path):
    """An env file holds NCCL settings only: sourced without `fastverify launch` (docker --env-file),
    an SGLang switch would start the IPC path with no P2P proof."""
    path = tmp_path / "box.env"
    path.write_text("NCCL_P2P_LEVEL=SYS\nSGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1\n")
    c = by_name(run_doctor(quick=True, env_file=str(path)))["env_file"]
    assert c.status is Status.fail and "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE" in c.reason, c


# --- isolation -----------------------------------------------------------------------------------


def test_an_exception_in_one_check_becomes_fail_and_the_others_run(monkeypatch):
    def boom(ctx):
        raise RuntimeError("boom\nsecond line of the message")

    table = tuple(dataclasses.replace(s, fn=boom) if s.name in ("versions", "env_file") else s for s in doctor.CHECKS)
    monkeypatch.setattr(doctor, "CHECKS", table)
    checks = run_doctor(quick=True)
    assert_well_formed(checks)
    got = by_name(checks)
    assert [c.name for c in checks] == QUICK_CHECKS
    for name in ("versions", "env_file"):
        assert got[name].status is Status.fail
        assert got[name].reason == "check raised RuntimeError: boom"
    assert got["trace_analyzer"].status is Status.ok
    assert got["cuda"].status is Status.skipped


def test_a_user_error_keeps_its_own_message(monkeypatch):
    from fastverify.errors import UserError

    def bad(ctx):
        raise UserError("/x/y: cannot read")

    monkeypatch.setattr(doctor, "CHECKS", (doctor.CheckSpec("x", bad, False, True),))
    (c,) = run_doctor(quick=True)
    assert c.status is Status.fail and c.reason == "/x/y: cannot read" and c.fix is None


# --- summary and printing ------------------------------------------------------------------------


def test_summarise_counts_and_verdict():
    def mk(name, status):
        return Check(name, status, f"{name} reason", None, 0.25, {"k": 1})

    checks = [mk("a", Status.ok), mk("b", Status.ok), mk("c", Status.warn), mk("d", Status.skipped)]
    s = summarise(checks)
    assert s["counts"] == {"ok": 2, "warn": 1, "fail": 0, "skipped": 1}
    assert s["verdict"] == "warn" and s["seconds"] == 1.0
    assert s["schema"] == "fastverify.doctor" and s["schema_version"] == 1
    assert s["checks"][2] == {
        "name": "c",
        "status": "warn",
        "reason": "c reason",
        "fix": None,
        "seconds": 0.25,
        "details": {"k": 1},
    }
    json.loads(json.dumps(s))
    assert summarise(checks + [mk("e", Status.fail)])["verdict"] == "fail"
    assert summarise([mk("a", Status.ok), mk("d", Status.skipped)])["verdict"] == "ok"
    assert summarise([])["counts"] == {"ok": 0, "warn": 0, "fail": 0, "skipped": 0}


def test_summarise_of_a_real_run(full_run):
    checks = full_run[0]
    s = summarise(checks)
    assert sum(s["counts"].values()) == len(checks) == len(doctor.CHECKS)
    assert s["counts"]["skipped"] >= len(GPU_CHECKS)
    assert s["counts"]["fail"] == 0 and s["verdict"] in ("ok", "warn")
    assert [c["name"] for c in s["checks"]] == [c.name for c in checks]


def test_check_is_frozen():
    c = Check("a", Status.ok, "fine")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.status = Status.fail  # type: ignore[misc]


def test_print_checks(full_run):
    from rich.console import Console

    console = Console(record=True, width=200)
    doctor.print_checks(full_run[0], console)
    text = console.export_text()
    for name in ("gloo_allreduce", "trace_analyzer", "cuda_graph_forward"):
        assert name in text
    assert NO_GPU in text
    assert "verdict" in text


# --- GPU-check logic that runs without a GPU -----------------------------------------------------


def test_multi_gpu_checks_skip_on_one_gpu():
    ctx = doctor.CheckContext(quick=False, env_file=None)
    ctx._gpu = (None, 1)
    for fn in (doctor.check_p2p_real, doctor.check_backends, doctor.check_backend_latency):
        out = fn(ctx)
        assert out.status is Status.skipped and out.reason == "needs >= 2 CUDA GPUs, found 1"


def test_backend_latency_reports_the_fastest_backend_per_size():
    ctx = doctor.CheckContext(quick=False, env_file=None)
    ctx._gpu = (None, 2)
    sizes = lambda *us: [{"median_us": u} for u in us]  # noqa: E731
    ctx.state["backends"] = {
        "world": 2,
        "hidden": 7168,
        "results": {
            "nccl": {"status": "ok", "sizes": sizes(20.0, 30.0, 60.0)},
            "pcie_ipc": {"status": "ok", "sizes": sizes(8.0, 31.0, 90.0)},
            "fused": {"status": "skipped", "reason": "GPU is SM89"},
        },
        "calls_per_graph": 32,
    }
    out = doctor.check_backend_latency(ctx)
    assert out.status is Status.ok
    assert "median per call over graph replays of 32 calls" in out.reason
    assert out.reason.endswith("56 KiB: pcie_ipc 8.0 µs; 448 KiB: nccl 30.0 µs; 1792 KiB: nccl 60.0 µs")
    assert out.details["median_us"] == {"nccl": [20.0, 30.0, 60.0], "pcie_ipc": [8.0, 31.0, 90.0]}


@pytest.mark.parametrize(
    "torch_says, library, status",
    [
        ((2, 21, 5), (2, 21, 5), Status.ok),
        ((2, 21, 5, "+cuda12.4"), (2, 21, 5), Status.ok),
        ((2, 27, 3), (2, 21, 5), Status.warn),
        ((2, 27, 3), None, Status.warn),
    ],
)
def test_torch_nccl_against_the_library(monkeypatch, torch_says, library, status):
    import torch

    from fastverify.nccl.version import NcclVersion

    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: torch_says)
    ctx = doctor.CheckContext(quick=False, env_file=None)
    ctx.state["nccl_version"] = None if library is None else NcclVersion.of(*library, library="/x/libnccl.so.2")
    out = doctor.check_torch_nccl(ctx)
    assert out.status is status, out
    assert out.details["torch_nccl"] == ".".join(map(str, torch_says[:3]))
