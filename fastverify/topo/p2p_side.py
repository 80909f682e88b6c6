"""One GPU's side of a real P2P pair test (needs CUDA; run as ``python -m fastverify.topo.p2p side``).

The driver's P2P report (``cudaDeviceCanAccessPeer``, NVML's P2P status) can say yes where P2P
reads or writes fail, hang or corrupt data (IOMMU/ACS settings, some BIOSes and consumer boards);
vLLM tests P2P for real before enabling its custom all-reduce for that reason
(``custom_all_reduce_utils.py::gpu_p2p_access_check``). Each side allocates a 4 MiB buffer on its
GPU, fills it with its own byte pattern and publishes the buffer's CUDA IPC handle
(``UntypedStorage._share_cuda_``, the call behind ``torch.multiprocessing``'s CUDA sharing). It
opens the peer's handle **under its own device** (``UntypedStorage._new_shared_cuda``), so every
torch op on the peer's memory runs on its own GPU and crosses the PCIe/NVLink fabric: it reads the
peer pattern back (P2P read), writes a second pattern with a copy-engine copy (first half) and an
SM kernel (second half) (P2P write), and finally checks that its own buffer holds what the peer
wrote. This is legacy CUDA IPC (``cudaIpcOpenMemHandle``), the mechanism of the PCIe IPC
all-reduces (SGLang/vLLM custom all-reduce, FlashInfer); NCCL may use cuMem handles instead
(``NCCL_CUMEM_ENABLE``), which share the same fabric path.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

from fastverify.topo.p2p_results import POLL_S, write_json_atomic

BUFFER_BYTES = 4 << 20
NO_PEER_ACCESS = "driver reports no peer access"  # a direction's reason starts with it: P2P not offered
_SEEDS = {"a": (1, 3), "b": (2, 4)}  # per side: (pattern of its own buffer, pattern it writes to the peer)


class _CheckFailed(Exception):
    """A failure this module diagnosed itself (its message is the whole reason)."""


class _TimedOut(_CheckFailed):
    """No answer from the peer in time: a timeout, not a failure (the report row says
    ``"timed_out": true``; :mod:`fastverify.topo.p2p_results`)."""


def _pattern(torch: Any, seed: int, n: int, device: str) -> Any:
    """``n`` bytes ``(k * (2*seed + 1) + seed) % 256`` on ``device``: different for each seed."""
    k = torch.arange(n, dtype=torch.int64, device=device)
    return ((k * (2 * seed + 1) + seed) % 256).to(torch.uint8)


def _encode_share(share: Sequence[Any]) -> list:
    return [{"hex": v.hex()} if isinstance(v, bytes) else v for v in share]


def _decode_share(items: list) -> tuple:
    return tuple(bytes.fromhex(v["hex"]) if isinstance(v, dict) else v for v in items)


def _wait_for(path: Path, deadline: float, what: str) -> Any:
    while not path.exists():
        if time.monotonic() > deadline:
            raise _TimedOut(f"timeout waiting for {what}")
        time.sleep(POLL_S)
    return json.loads(path.read_text())


def _failed(err: BaseException) -> dict:
    """A report entry for ``err``: ``{"ok": False, "reason"}``, plus ``"timed_out": True`` for a timeout."""
    return {"ok": False, "reason": _first_line(err), **({"timed_out": True} if isinstance(err, _TimedOut) else {})}


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split())[:200]
    if isinstance(err, _CheckFailed):
        return text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _publish_buffer(torch: Any, me: str, my_gpu: int, workdir: Path) -> Any | None:
    """This side's buffer, its IPC handle published in ``<me>.handle.json``; None when it could
    not be shared, after writing the failure as this side's handle, written flag and report."""
    try:
        torch.cuda.set_device(my_gpu)
        buf = _pattern(torch, _SEEDS[me][0], BUFFER_BYTES, f"cuda:{my_gpu}")
        torch.cuda.synchronize(my_gpu)
        share = tuple(buf.untyped_storage()._share_cuda_())
        if len(share) != 8:
            raise _CheckFailed(f"torch's CUDA IPC handle has {len(share)} fields, expected 8 (torch {torch.__version__})")
    except Exception as err:  # noqa: BLE001 - reported to the peer and the pair child
        failed = {"ok": False, "reason": f"GPU {my_gpu} could not share a buffer: {_first_line(err)}"}
        write_json_atomic(workdir / f"{me}.handle.json", {"error": failed["reason"]})
        write_json_atomic(workdir / f"{me}.written.json", {"wrote": False})
        write_json_atomic(workdir / f"{me}.report.json", {"access": failed, "own": failed})
        return None
    write_json_atomic(workdir / f"{me}.handle.json", {"share": _encode_share(share)})
    return buf


def run_side(me: str, peer: str, my_gpu: int, peer_gpu: int, workdir: Path, timeout_s: float) -> None:
    """One side of a pair test (needs CUDA). Writes ``<workdir>/<me>.report.json`` with
    ``access`` (this side's read+write of the peer's buffer) and ``own`` (whether the peer's write
    into this side's buffer arrived). Files it publishes on the way: ``<me>.handle.json`` (its
    buffer's IPC handle, or the error that prevented sharing it) and ``<me>.written.json``."""
    import torch  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    n = BUFFER_BYTES
    dev = f"cuda:{my_gpu}"
    buf = _publish_buffer(torch, me, my_gpu, workdir)
    if buf is None:
        return

    report: dict[str, Any] = {}
    storage = peer_view = None
    wrote = False
    try:
        doc = _wait_for(workdir / f"{peer}.handle.json", deadline, f"GPU {peer_gpu}'s buffer")
        if "error" in doc:
            raise _CheckFailed(str(doc["error"]))
        peer_share = _decode_share(doc["share"])
        if my_gpu != peer_gpu and not torch.cuda.can_device_access_peer(my_gpu, peer_gpu):
            raise _CheckFailed(f"{NO_PEER_ACCESS} (cudaDeviceCanAccessPeer({my_gpu}, {peer_gpu}) = 0)")
        # Open the peer's buffer under *this* device (first field replaced): the mapping lives in
        # this GPU's context, so the ops below run on this GPU and reach the peer's memory over
        # the fabric. Event sync is off: the peer synchronised before publishing the handle.
        storage = torch.UntypedStorage._new_shared_cuda(my_gpu, *peer_share[1:7], False)
        peer_view = torch.empty((0,), dtype=torch.uint8, device=dev).set_(storage, 0, (n,), (1,))
        seen = peer_view.clone()  # P2P read
        torch.cuda.synchronize(my_gpu)
        bad = int((seen != _pattern(torch, _SEEDS[peer][0], n, dev)).sum().item())
        if bad:
            raise _CheckFailed(f"P2P read returned {bad} of {n} bytes wrong")
        new = _pattern(torch, _SEEDS[me][1], n, dev)
        half = n // 2
        peer_view[:half].copy_(new[:half])  # copy engine (cudaMemcpyAsync device to device)
        torch.bitwise_or(new[half:], 0, out=peer_view[half:])  # SM stores from a kernel
        torch.cuda.synchronize(my_gpu)
        wrote = True
        report["access"] = {"ok": True, "reason": f"GPU {my_gpu} read and wrote {n >> 20} MiB on GPU {peer_gpu}"}
    except Exception as err:  # noqa: BLE001 - every CUDA failure becomes the reason of this direction
        report["access"] = _failed(err)
    write_json_atomic(workdir / f"{me}.written.json", {"wrote": wrote})

    try:
        peer_wrote = _wait_for(workdir / f"{peer}.written.json", deadline, f"GPU {peer_gpu} to write")["wrote"]
        if peer_wrote:
            torch.cuda.synchronize(my_gpu)
            bad = int((buf != _pattern(torch, _SEEDS[peer][1], n, dev)).sum().item())
            report["own"] = ({"ok": True, "reason": "the peer's write arrived"} if not bad else
                             {"ok": False, "reason": f"P2P write from GPU {peer_gpu} left {bad} of {n} bytes wrong"})
        else:
            report["own"] = {"ok": False, "reason": f"GPU {peer_gpu} did not write"}
    except Exception as err:  # noqa: BLE001
        report["own"] = _failed(err)
    try:
        del peer_view, storage  # drop the mapping of the peer's buffer before the peer frees it
        torch.cuda.synchronize(my_gpu)
    except Exception:  # noqa: BLE001 - a sticky CUDA error is already in the report
        pass
    write_json_atomic(workdir / f"{me}.report.json", report)
    # Keep this buffer alive until the peer has dropped its mapping of it.
    try:
        _wait_for(workdir / f"{peer}.report.json", deadline, "the peer to finish")
    except _CheckFailed:
        pass
