"""The live run's memory preflight checks FREE GPU memory (NVML, no CUDA context) plus the CUDA
context and NCCL's buffers, not capacity: a 24 GiB GPU a server fills to 0.5 GiB free refuses
``fastverify profile`` in one line, naming the GPU as CUDA numbers it, its free GiB, the holder
process and the fix, with exit 2 and before any rank starts. Where NVML is absent the check falls
back to capacity, as before.

The stand-in NVML returns pynvml's own structures (``c_nvmlMemory_t``, ``c_nvmlProcessInfo_v3_t``
through ``nvmlStructToFriendlyObject``), as nvidia-ml-py 13 hands them out."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastverify import cli, procs
from fastverify.live import preflight
from fastverify.live.config import load_model_config
from fastverify.topo.nvml import in_host_pid_namespace

pynvml = pytest.importorskip("pynvml")
torch = pytest.importorskip("torch")

GIB = 2**30
MIB = 2**20


class FakeNVMLError(Exception):
    def __init__(self, value: int = 3, text: str = "Not Supported"):
        super().__init__(text)
        self.value = value


def process_info(pid: int, used: int):
    """One entry of ``nvmlDeviceGetComputeRunningProcesses`` as pynvml builds it."""
    return pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_v3_t(pid=pid, usedGpuMemory=used))


class FakeNvml:
    """NVML of ``len(free)`` RTX 4090s of ``total`` bytes with ``free[i]`` bytes free and
    ``holders[i]`` ``[(pid, bytes)]`` processes; ``init_error`` makes ``nvmlInit`` fail."""

    NVMLError = FakeNVMLError

    def __init__(self, free, *, total=24 * GIB, holders=None, init_error=None, refuse_memory=()):
        self.free, self.total = list(free), total
        self.holders = holders or {}
        self.init_error = init_error
        self.refuse_memory = set(refuse_memory)
        self.calls: list[str] = []

    def __getattr__(self, name):  # constants as the installed binding defines them
        return getattr(pynvml, name)

    def nvmlInit(self):
        self.calls.append("init")
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.free)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA GeForce RTX 4090"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:08d}-aaaa-bbbb-cccc-000000000000"

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{0x18 + 0x10 * h:02X}:00.0")

    def nvmlDeviceGetMemoryInfo(self, h):
        if h in self.refuse_memory:
            raise FakeNVMLError(3, "Not Supported")
        return pynvml.c_nvmlMemory_t(total=self.total, free=self.free[h], used=self.total - self.free[h])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [process_info(pid, used) for pid, used in self.holders.get(h, [])]


def test_fake_matches_installed_pynvml():
    for name in (
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetName",
        "NVMLError",
    ):
        assert hasattr(pynvml, name), name
    mem = pynvml.c_nvmlMemory_t(total=24 * GIB, free=GIB // 2, used=24 * GIB - GIB // 2)
    assert (mem.total, mem.free) == (24 * GIB, GIB // 2)
    p = process_info(4242, 23 * GIB)
    assert (p.pid, p.usedGpuMemory) == (4242, 23 * GIB)


def held_by(pid: int, gib: float, comm: str) -> str:
    """How the line names a holder: by its /proc name where this process sees the host's pids
    (the pids NVML reports), by pid alone inside a container's pid namespace."""
    if in_host_pid_namespace(Path("/proc")):
        return f"held by {comm} (pid {pid}, {gib:.1f} GiB)"
    return f"held by pid {pid} ({gib:.1f} GiB)"


@pytest.fixture
def server():
    """A real process standing in for the SGLang server that holds the GPU: its pid is readable in
    /proc, its name (``/proc/<pid>/comm``) is ``sleep``."""
    proc = subprocess.Popen(["sleep", "120"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def gpus_24gib(monkeypatch):
    """Two 24 GiB CUDA GPUs as torch sees them (torch's own capacity check reads these)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(total_memory=24 * GIB, name="NVIDIA GeForce RTX 4090"),
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


@pytest.fixture
def ranks_started(monkeypatch):
    """Every process the rank launcher would start, recorded and refused (no rank runs)."""
    started: list[list[str]] = []

    def refuse(argv, **kwargs):
        started.append(list(argv))
        raise RuntimeError("a rank process was started")

    monkeypatch.setattr(procs, "popen_dying_with_parent", refuse)
    return started


def _profile(monkeypatch, tmp_path, capsys, nvml, *extra):
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    t0 = time.monotonic()
    code = cli.main(
        ["profile", "--model", "tiny", "--tp", "2", "--draft-tokens", "4", "--batch", "1", "--quiet", *extra]
    )
    return code, capsys.readouterr(), time.monotonic() - t0


def test_busy_24gib_gpu_refuses_live_profile_in_one_line_before_any_rank(
    monkeypatch, tmp_path, capsys, server, gpus_24gib, ranks_started
):
    nvml = FakeNvml([GIB // 2, 20 * GIB], holders={0: [(server, 23 * GIB)]})
    code, out, elapsed = _profile(monkeypatch, tmp_path, capsys, nvml)
    assert ranks_started == []  # no rank process was started
    assert code == 2
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err
    line = lines[0]
    # Need worked out by hand: 768 MiB (CUDA context) + 688 MiB (NCCL) = 1456 MiB = 1.42 GiB, plus
    # the tiny model's ~2 MB of tensors: "about 1.4 GiB free"; "CUDA context and NCCL's buffers 1.4".
    assert line.startswith(
        "fastverify: error: --batch 1 x --draft-tokens 4 (T = 4 tokens) of tiny at --tp 2: "
        "each rank needs about 1.4 GiB free ("
    ), line
    assert "CUDA context and NCCL's buffers 1.4)" in line
    assert (
        f"; GPU 0 (NVIDIA GeForce RTX 4090) has 0.5 GiB free of 24.0 GiB, {held_by(server, 23, 'sleep')}; " in line
    ), line
    # GPU 0 itself is short (--tp smaller cannot help), and 0.5 GiB is under the CUDA context and
    # NCCL's 1.4 GiB, so a smaller --batch cannot help either: the fix is to stop the holder.
    assert line.endswith("; stop the server holding it, or set CUDA_VISIBLE_DEVICES to GPUs with room"), line
    assert "GPU 1" not in line  # 20 GiB free: not short
    assert nvml.calls == ["init", "shutdown"]
    assert elapsed < 30


def test_cuda_numbering_honours_cuda_visible_devices(monkeypatch, tmp_path, capsys, server, gpus_24gib, ranks_started):
    """NVML GPU 2 is CUDA's GPU 1 under CUDA_VISIBLE_DEVICES=0,2: the line names it as CUDA does,
    and since CUDA's GPU 0 has room, --tp 1 is a fix."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    nvml = FakeNvml([20 * GIB, GIB // 4, int(1.3 * GIB)], holders={2: [(server, 22 * GIB)]})
    code, out, _ = _profile(monkeypatch, tmp_path, capsys, nvml)
    assert ranks_started == [] and code == 2
    (line,) = out.err.splitlines()
    assert (
        f"; GPU 1 (NVIDIA GeForce RTX 4090, NVML GPU 2) has 1.3 GiB free of 24.0 GiB, "
        f"{held_by(server, 22, 'sleep')}; " in line
    ), line
    assert "NVML GPU 1" not in line  # 0.25 GiB free, but CUDA does not show it to the ranks
    assert line.endswith(
        "; stop the server holding it, or set CUDA_VISIBLE_DEVICES to GPUs with room, or use --tp 1"
    ), line


def test_free_memory_above_the_overhead_offers_a_smaller_batch():
    """Kimi-K2 at --tp 8, T = 4: 1.03 GiB of tensors (rank_memory) + 1.42 GiB of context and NCCL =
    2.5 GiB; with 2.0 GiB free on both GPUs a smaller shape could fit, so --batch is named; no
    holder NVML can see: the line says so and asks to free the memory."""
    config = load_model_config("kimi-k2")
    mem = preflight.rank_memory(
        config, tp=8, batch=1, draft_tokens=4, dtype_bytes=2, context_tokens=preflight.DEFAULT_CONTEXT_TOKENS
    )
    assert abs(mem.total / GIB - 1.0335) < 1e-3
    nvml = FakeNvml([2 * GIB] * 8)
    with pytest.raises(preflight.UserError) as info:
        preflight.check_gpu_memory(config, mem, tp=8, batch=1, draft_tokens=4, torch=torch, nvml=nvml, environ={})
    msg = str(info.value)
    assert (
        "each rank needs about 2.5 GiB free (weights and KV context 1.0, largest temporary 0.0, CUDA context "
        "and NCCL's buffers 1.4); GPU 0 (NVIDIA GeForce RTX 4090) has 2.0 GiB free of 24.0 GiB, held by no "
        "process NVML names" in msg
    ), msg
    assert "; GPUs 1, 2, 3, 4, 5, 6, 7 too; " in msg
    assert msg.endswith(
        "; free that memory, or set CUDA_VISIBLE_DEVICES to GPUs with room, or lower --batch or --draft-tokens"
    ), msg


def test_room_on_every_gpu_lets_the_ranks_start(monkeypatch, tmp_path, capsys, gpus_24gib, ranks_started):
    nvml = FakeNvml([20 * GIB, 20 * GIB])
    with pytest.raises(RuntimeError, match="a rank process was started"):
        _profile(monkeypatch, tmp_path, capsys, nvml)
    assert len(ranks_started) == 1  # the launcher's first rank


def test_without_nvml_the_free_check_is_skipped_and_capacity_still_checked(
    monkeypatch, tmp_path, capsys, gpus_24gib, ranks_started
):
    nvml = FakeNvml([GIB // 2, GIB // 2], init_error=OSError("libnvidia-ml.so.1: cannot open shared object file"))
    assert preflight.cuda_gpu_memory(2, nvml=nvml, environ={}) is None
    with pytest.raises(RuntimeError, match="a rank process was started"):  # free memory unknown: not refused
        _profile(monkeypatch, tmp_path, capsys, nvml)
    # Capacity from torch still refuses a shape that no 24 GiB GPU holds: kimi-k2 at --tp 1 with a
    # 4096 x 64 verify step needs far more (its logits alone are 262144 x 163840 x 2 B = 80 GiB).
    mem = preflight.rank_memory(
        load_model_config("kimi-k2"),
        tp=1,
        batch=4096,
        draft_tokens=64,
        dtype_bytes=2,
        context_tokens=preflight.DEFAULT_CONTEXT_TOKENS,
    )
    with pytest.raises(preflight.UserError, match=r"this machine has 24\.0 GiB per GPU; lower --batch"):
        preflight.check_gpu_memory(
            load_model_config("kimi-k2"), mem, tp=1, batch=4096, draft_tokens=64, torch=torch, nvml=nvml, environ={}
        )


def test_a_gpu_whose_memory_nvml_does_not_report_is_not_refused():
    nvml = FakeNvml([GIB // 2, 20 * GIB], refuse_memory={0})
    gpus = preflight.cuda_gpu_memory(2, nvml=nvml, environ={})
    assert [(g["cuda"], g["free_bytes"]) for g in gpus] == [(0, None), (1, 20 * GIB)]
    mem = preflight.rank_memory(
        load_model_config("tiny"),
        tp=2,
        batch=1,
        draft_tokens=4,
        dtype_bytes=2,
        context_tokens=preflight.DEFAULT_CONTEXT_TOKENS,
    )
    preflight.check_gpu_memory(
        load_model_config("tiny"), mem, tp=2, batch=1, draft_tokens=4, torch=torch, nvml=nvml, environ={}
    )  # no refusal


def test_holders_text_names_unnamed_and_extra_processes():
    import os

    holders = [
        {"pid": 11, "name": None, "used_bytes": 2 * GIB},
        {"pid": 12, "name": "python3", "used_bytes": 5 * GIB},
        {"pid": os.getpid(), "name": "me", "used_bytes": 9 * GIB},
        {"pid": 13, "name": "x", "used_bytes": None},
        {"pid": 14, "name": "y", "used_bytes": GIB},
    ]
    assert preflight.holders_text(holders) == (
        "held by python3 (pid 12, 5.0 GiB), pid 11 (2.0 GiB), y (pid 14, 1.0 GiB) and 1 more"
    )
    assert preflight.holders_text([]).startswith("held by no process NVML names")
