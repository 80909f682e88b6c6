"""doctor's ``gpu_free_memory`` check: listed among the GPU self-checks (skipped on CPU, with the
reason, in ``doctor --json``), and on a GPU box it fails, naming the GPU as CUDA numbers it, its
free GiB and the holder, when a server leaves less than the GPU checks' processes need."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from conftest import run_fastverify
from test_live_preflight import GIB, FakeNvml, held_by

from fastverify.doctor.core import NO_DRIVER, NO_GPU, NVIDIA_DEVICE_NODES, Status
from fastverify.doctor.gpu import DOCTOR_GPU_BYTES, check_gpu_free_memory


def test_doctor_json_on_cpu_lists_the_free_memory_check_as_skipped(tmp_path):
    proc = run_fastverify(["doctor", "--quick", "--json"], cwd=tmp_path, timeout=120)
    doc = json.loads(proc.stdout)
    by = {c["name"]: c for c in doc["checks"]}
    assert "gpu_free_memory" in by, sorted(by)
    no_driver = not any(os.path.exists(p) for p in NVIDIA_DEVICE_NODES)
    if not no_driver:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU box: the check runs")
    assert by["gpu_free_memory"]["status"] == "skipped"
    assert by["gpu_free_memory"]["reason"] == (NO_DRIVER if no_driver else NO_GPU)


def test_busy_gpu_fails_the_check_naming_gpu_free_gib_and_holder():
    # 2 x (768 MiB CUDA context + 688 MiB NCCL) = 2912 MiB = 2.84 GiB per GPU.
    assert DOCTOR_GPU_BYTES == 2912 * 2**20
    nvml = FakeNvml([20 * GIB, GIB // 2], holders={1: [(os.getppid(), 23 * GIB)]})
    out = check_gpu_free_memory(SimpleNamespace(gpu_count=2), nvml=nvml, environ={})
    with open(f"/proc/{os.getppid()}/comm") as f:
        comm = f.read().strip()
    assert out.status is Status.fail
    assert out.reason == (
        f"doctor's GPU checks need about 2.8 GiB free on each GPU (2 CUDA contexts and NCCL "
        f"communicators); GPU 1 (NVIDIA GeForce RTX 4090) has 0.5 GiB free of 24.0 GiB, "
        f"{held_by(os.getppid(), 23, comm)}; GPU checks below fail from lack of memory, not for "
        "the reasons they name"
    )
    assert out.fix == "stop the server holding it, or set CUDA_VISIBLE_DEVICES to GPUs with room"
    assert out.details["free_gib"] == {0: 20.0, 1: 0.5}


def test_room_everywhere_is_ok_and_no_nvml_is_skipped():
    out = check_gpu_free_memory(SimpleNamespace(gpu_count=2), nvml=FakeNvml([20 * GIB, 3 * GIB]), environ={})
    assert out.status is Status.ok and out.reason == "free memory per GPU (GiB, CUDA numbering): 0: 20.0, 1: 3.0"
    gone = FakeNvml([GIB], init_error=OSError("libnvidia-ml.so.1: cannot open shared object file"))
    out = check_gpu_free_memory(SimpleNamespace(gpu_count=1), nvml=gone, environ={})
    assert out.status is Status.skipped and out.reason.startswith("NVML does not report this process's GPUs")
