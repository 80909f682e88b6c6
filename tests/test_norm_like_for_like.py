"""Every backend does the residual add + RMSNorm after its all-reduce with the same kernel, chosen
once per trial.

Before: ``nccl``/``gloo``/``custom_ar`` always used the ~13-kernel fp32 torch path
(``base.add_rmsnorm``) and ``pcie_ipc`` always FlashInfer's ``fused_add_rmsnorm``, so a sweep ranked
the norms, times ~123 calls per verify step. Now the ``norm`` option is handled by the base class
for every backend, and the tune worker gives every backend of a trial the same value.

FlashInfer's norm kernel cannot run on CPU, so ``flashinfer.norm`` is a stand-in here that keeps
the contract of ``fused_add_rmsnorm`` in ``flashinfer/norm/__init__.py`` (0.7.4): in place,
``residual += input`` then ``input = residual / RMS(residual) * weight``; shapes
``(batch, hidden)``, ``(batch, hidden)``, ``(hidden,)``.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
import torch.distributed as dist

# Only names the old code had at module level, so each test fails on its own behaviour there.
from fastverify.backends.base import REGISTRY, BackendUnavailable, backend_class
from fastverify.backends.flashinfer_pcie_ipc import PcieIpcBackend
from fastverify.backends.torch_dist import GlooBackend
from fastverify.registry import BackendName, names
from fastverify.tune import worker
from fastverify.tune.sweep import run_sweep
from fastverify.tune.trial import TrialSpec

EPS = 1e-6
X = [[0.25 * ((i * 5 + j) % 9 - 4) for j in range(8)] for i in range(2)]
RESIDUAL = [[0.5 * ((i * 7 + j) % 5 - 2) for j in range(8)] for i in range(2)]
WEIGHT = [1 + (j % 3) / 4 for j in range(8)]


def _hand_norm(summed):
    """(normed, residual_out) of ``summed + RESIDUAL`` in plain floats."""
    res = [[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(summed, RESIDUAL)]
    normed = []
    for row in res:
        inv = 1 / math.sqrt(sum(v * v for v in row) / len(row) + EPS)
        normed.append([v * inv * w for v, w in zip(row, WEIGHT)])
    return normed, res


@pytest.fixture
def fi_norm(monkeypatch):
    """A stand-in ``flashinfer.norm`` whose ``fused_add_rmsnorm`` keeps FlashInfer's contract and
    counts its calls."""
    calls = []

    def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
        assert input.dim() == 2 and residual.shape == input.shape and weight.shape == (input.shape[1],)
        assert input.is_contiguous() and residual.is_contiguous() and enable_pdl is False
        calls.append(tuple(input.shape))
        r = input.float() + residual.float()
        residual.copy_(r)
        r = residual.float()
        input.copy_(r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.float())

    fi = types.ModuleType("flashinfer")
    norm = types.ModuleType("flashinfer.norm")
    norm.fused_add_rmsnorm = fused_add_rmsnorm
    fi.norm = norm
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.norm", norm)
    return calls


@pytest.fixture
def one_rank_gloo():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Workspace:
    """A PCIe IPC workspace stand-in for one rank: the sum over a 1-rank group is the input."""

    def __init__(self, group, max_numel, dtype, **kw):
        self.max_numel = max_numel

    def supports(self, inp):
        return True

    def all_reduce(self, inp, *, out=None):
        return out.copy_(inp)

    def rebind_stream(self):
        pass

    def destroy(self):
        pass


@pytest.fixture
def pcie_standin(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "default stream")
    comm = types.ModuleType("flashinfer.comm")
    comm.PcieIpcAllReduceWorkspace = _Workspace
    monkeypatch.setitem(sys.modules, "flashinfer.comm", comm)


def _run(be, dtype=torch.float32):
    x = torch.tensor(X, dtype=dtype)
    return be.all_reduce_residual_rmsnorm(
        x, torch.tensor(RESIDUAL, dtype=dtype), torch.tensor(WEIGHT, dtype=dtype), EPS
    )


@pytest.mark.parametrize("norm", ["flashinfer", "torch"])
def test_one_norm_choice_gives_one_kernel_to_nccl_style_and_pcie_ipc(norm, fi_norm, one_rank_gloo, pcie_standin):
    gloo = GlooBackend(None, device="cpu", dtype=torch.bfloat16, max_numel=None, options={"norm": norm})
    pcie = PcieIpcBackend(None, device="cuda:0", dtype=torch.bfloat16, max_numel=64, options={"norm": norm})
    want_norm, want_res = _hand_norm(X)  # one rank: the all-reduce is the identity
    for be in (gloo, pcie):
        assert be.norm == norm
        normed, res = _run(be, torch.bfloat16)
        for got, want in ((normed, want_norm), (res, want_res)):
            err = max(abs(g - w) for gr, wr in zip(got.float().tolist(), want) for g, w in zip(gr, wr))
            assert err <= 2 * 2.0**-8 * max(abs(w) for wr in want for w in wr)  # bf16 rounding
        assert be.path_counts == {"all_reduce": 1, "unfused": 1}  # the same path on both
        be.close()
    # Both backends ran FlashInfer's kernel, or neither did.
    assert fi_norm == ([(2, 8), (2, 8)] if norm == "flashinfer" else [])


def test_the_norm_option_is_the_base_classs_for_every_backend():
    from fastverify.backends.base import COMMON_OPTIONS

    assert COMMON_OPTIONS == {"norm"}
    for info in REGISTRY:
        try:
            cls = backend_class(info.name)
        except ImportError:
            continue  # a backend module still to come; the base class gives it the option anyway
        assert "norm" not in cls.option_names, f"{info.name}: norm is handled once, in the base class"


def test_auto_depends_on_device_and_dtype_only(fi_norm, monkeypatch):
    from fastverify.backends.base import NormKernel, choose_norm

    assert choose_norm("cuda:0", torch.bfloat16) is NormKernel.FLASHINFER
    assert choose_norm("cuda", torch.float16) is NormKernel.FLASHINFER
    assert choose_norm("cuda", torch.float32) is NormKernel.TORCH  # FlashInfer's kernels: fp16/bf16 only
    assert choose_norm("cpu", torch.bfloat16) is NormKernel.TORCH
    monkeypatch.setitem(sys.modules, "flashinfer.norm", None)  # import fails
    assert choose_norm("cuda", torch.bfloat16) is NormKernel.TORCH


def test_an_unusable_explicit_flashinfer_norm_is_unavailable_not_a_crash(monkeypatch, one_rank_gloo):
    monkeypatch.setitem(sys.modules, "flashinfer.norm", None)
    with pytest.raises(BackendUnavailable, match="norm 'flashinfer'.*use norm 'torch'"):
        GlooBackend(None, device="cpu", dtype=torch.bfloat16, max_numel=None, options={"norm": "flashinfer"})
    with pytest.raises(ValueError, match="option norm must be one of"):
        GlooBackend(None, device="cpu", dtype=torch.bfloat16, max_numel=None, options={"norm": "fast"})


def _trial(backend, device="cuda", **kw):
    base = dict(
        backend=backend,
        env={},
        world_size=2,
        device=device,
        dtype="bfloat16",
        hidden=64,
        sizes=((128, 2), (512, 4)),
        op="all_reduce_residual_rmsnorm",
    )
    base.update(kw)
    return TrialSpec(**base)


@pytest.mark.parametrize("device,want", [("cuda", "flashinfer"), ("cpu", "torch")])
def test_the_worker_gives_every_backend_the_same_norm_and_the_hidden_size(device, want, fi_norm, monkeypatch):
    made = {}

    def fake_make_backend(name, group, **kw):
        made[name] = kw
        return object()

    monkeypatch.setattr("fastverify.backends.make_backend", fake_make_backend)
    for name in names():
        trial = _trial(name.value, device=device, options={"max_numel": 1024} if name is BackendName.pcie_ipc else {})
        norm = worker.trial_norm(trial, torch.bfloat16)
        worker.make_trial_backend(trial, device=device, dtype=torch.bfloat16, norm=norm, context=None)
    assert set(made) == {n.value for n in names()}
    assert {kw["options"]["norm"] for kw in made.values()} == {want}
    assert {kw["hidden"] for kw in made.values()} == {64}  # the fused backends size rows from it
    assert made["pcie_ipc"]["max_numel"] == 1024 and made["nccl"]["max_numel"] == 512


def test_a_sweep_shares_one_norm_and_the_trial_id_knows_it(tmp_path):
    a, b = _trial("nccl"), _trial("pcie_ipc", norm="torch")
    assert _trial("nccl").trial_id == a.trial_id != _trial("nccl", norm="torch").trial_id
    with pytest.raises(ValueError, match="same TrialSpec.norm"):
        run_sweep([a, b], journal_path=tmp_path / "j.jsonl", timeout_s=5)
    assert not (tmp_path / "j.jsonl").exists()  # refused before anything ran or was written
    with pytest.raises(ValueError, match="must not hold 'norm'"):
        _trial("nccl", options={"norm": "torch"})
    with pytest.raises(ValueError, match="TrialSpec.norm must be one of"):
        _trial("nccl", norm="fast")
