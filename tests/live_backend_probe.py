"""One rank of tests/test_live_backend.py: the verify forward with and without an all-reduce backend.

Run as ``python live_backend_probe.py RANK PORT OUT.pt`` (2 ranks, gloo, rendezvous on the parent's
TCPStore at 127.0.0.1:PORT). Writes the logits of each variant and the backends' path counts.
"""

from __future__ import annotations

import contextlib
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from fastverify.backends import make_backend
from fastverify.backends.torch_dist import GlooBackend
from fastverify.live.config import load_model_config
from fastverify.live.forward import TPVerifyModel
from fastverify.registry import BackendName


class FusedRoleOnGloo(GlooBackend):
    """A test double for the forward's dispatch only: registered role ``fused_norm`` (it takes the
    name ``fused``), and its ``all_reduce_residual_rmsnorm`` is the base class's real gloo
    all-reduce + torch add + RMSNorm, counted per call. No FlashInfer kernel runs on CPU."""

    name = BackendName.fused
    _expected = "gloo"


class ListRecorder:
    """Records ``(name, class value, label, msg_bytes)`` of every region, in order."""

    def __init__(self) -> None:
        self.regions: list[tuple] = []

    def region(self, name, cls, label, msg_bytes):
        self.regions.append((name, cls.value, label, msg_bytes))
        return contextlib.nullcontext()


def main(rank: int, port: int, out: str) -> None:
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    torch.set_num_threads(1)
    config = load_model_config("tiny")
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        kw = dict(tp=2, rank=rank, batch=2, draft_tokens=4, device="cpu", dtype=dtype, context_tokens=16, seed=3)
        tag = str(dtype).removeprefix("torch.")
        result[f"plain_{tag}"] = TPVerifyModel(config, **kw).forward()
        T, H = 8, config.hidden_size
        with make_backend(BackendName.gloo, None, device="cpu", dtype=dtype, max_numel=T * H, hidden=H) as be:
            model = TPVerifyModel(config, backend=be, **kw)
            rec = ListRecorder()
            result[f"gloo_{tag}"] = model.forward(rec)
            result[f"gloo_{tag}_regions"] = rec.regions
            result[f"gloo_{tag}_paths"] = dict(be.path_counts)
            result[f"gloo_{tag}_fused_norm"] = model.fused_norm
        with FusedRoleOnGloo(None, device="cpu", dtype=dtype, max_numel=T * H, hidden=H) as be:
            model = TPVerifyModel(config, backend=be, **kw)
            rec = ListRecorder()
            result[f"fused_{tag}"] = model.forward(rec)
            result[f"fused_{tag}_regions"] = rec.regions
            result[f"fused_{tag}_paths"] = dict(be.path_counts)
            result[f"fused_{tag}_fused_norm"] = model.fused_norm
    torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
