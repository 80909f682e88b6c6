"""FlashInfer's fused all-reduce + residual add + RMSNorm (``flashinfer.comm``
``create_allreduce_fusion_workspace`` / ``allreduce_fusion``, pattern ``kARResidualRMSNorm``, TRT-LLM
kernel, FlashInfer >= 0.7).

Fastest on NVLink; on the wrong fabric it was measured ~10x slower (vLLM #48071/#48075), and its
one-shot Lamport kernel is the all-to-all push FlashInfer itself says collapses on root-complex
PCIe. So ``tune`` measures it like every other candidate; the probe checks hard requirements only,
the registry's (:data:`INFO`; FlashInfer 0.7.4 ``flashinfer/comm/trtllm_ar.py``, ``flashinfer/jit/comm.py``):

* CUDA, SM90 / SM10x / SM12x: the ``trtllm_comm`` JIT module is built for majors 9, 10, 12 only;
* world size 2/4/8/16: the C++ dispatch handles only these (``_trtllm_workspace_check`` says
  ``<= 16``; 3, 5, 6, 7 ... pass that check and fail in the kernel dispatch);
* bf16, fp16 or fp32; all ranks on one host; working P2P (peer buffers are mapped and written
  with plain loads/stores; there is no P2P probe in FlashInfer).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist

from fastverify.backends.base import (
    AllReduceBackend,
    BackendName,
    BackendUnavailable,
    Capability,
    ExternalCall,
    ProbeContext,
    Shape,
    Tensor,
    _check_norm_args,
    check_close,
)
from fastverify.backends.ipc import element_size, flashinfer_status, ipc_requirements, torch_all_reduce
from fastverify.registry import backend_info

logger = logging.getLogger(__name__)

INFO = backend_info(BackendName.fused)
"""The registry entry: world sizes, dtypes and SM majors the probe checks (module docstring)."""
MIN_FLASHINFER = (0, 7)

# FlashInfer's one-shot heuristic (trtllm_ar.py ``_use_oneshot_heuristics``, measured on B200):
# one-shot iff tokens*hidden*2*world*itemsize <= this many MiB. It has no entry for 16 ranks (the
# library raises KeyError there); for missing entries we use one-shot up to 128 tokens, the
# min-latency recommendation of flashinfer PR #1229.
ONESHOT_MAX_MIB = {2: 512, 4: 64, 8: 42}
ONESHOT_FALLBACK_MAX_TOKENS = 128
# trtllm_ar.py MAX_COMM_SIZE: INT32_MAX rounded down to 2 MiB; above it one-shot is impossible.
MAX_COMM_BYTES = 2147483647 & ~((1 << 21) - 1)

CREATE_WORKSPACE = ExternalCall(
    "flashinfer.comm",
    "create_allreduce_fusion_workspace",
    "flashinfer.comm.allreduce",
    ("backend", "world_size", "rank", "max_token_num", "hidden_dim", "dtype", "group"),
)
ALLREDUCE_FUSION = ExternalCall(
    "flashinfer.comm",
    "allreduce_fusion",
    "flashinfer.comm.allreduce",
    (
        "input",
        "workspace",
        "pattern",
        "launch_with_pdl",
        "trigger_completion_at_end",
        "output",
        "residual_out",
        "norm_out",
        "residual_in",
        "rms_gamma",
        "rms_eps",
        "use_oneshot",
        "fp32_acc",
    ),
)
PATTERN_AR = ExternalCall(
    "flashinfer.comm", "AllReduceFusionPattern.kAllReduce", "flashinfer.comm.trtllm_ar", (), "attribute"
)
PATTERN_AR_RESIDUAL_RMSNORM = ExternalCall(
    "flashinfer.comm", "AllReduceFusionPattern.kARResidualRMSNorm", "flashinfer.comm.trtllm_ar", (), "attribute"
)
WS_DESTROY = ExternalCall(
    "flashinfer.comm", "TRTLLMAllReduceFusionWorkspace.destroy", "flashinfer.comm.allreduce", (), "method"
)
EXTERNAL_CALLS = (CREATE_WORKSPACE, ALLREDUCE_FUSION, PATTERN_AR, PATTERN_AR_RESIDUAL_RMSNORM, WS_DESTROY)


def choose_oneshot(tokens: int, hidden: int, itemsize: int, world_size: int, mode: str = "auto") -> bool:
    """One-shot (True) or two-shot (False) for a ``(tokens, hidden)`` input; a pure function of
    the shape, so all ranks agree. ``mode`` ``"oneshot"``/``"twoshot"`` forces a strategy where the
    kernel can run it (two-shot needs ``tokens > world_size``; one-shot needs the Lamport payload
    ``tokens*hidden*2*world*(2 if fp32 else 1)`` bytes within ``MAX_COMM_BYTES``)."""
    lamport_bytes = tokens * hidden * 2 * world_size * (2 if itemsize == 4 else 1)
    oneshot_possible = lamport_bytes <= MAX_COMM_BYTES
    twoshot_possible = tokens > world_size
    if mode == "oneshot" and oneshot_possible:
        return True
    if mode == "twoshot" and twoshot_possible:
        return False
    if mode not in ("auto", "oneshot", "twoshot"):
        raise ValueError(f"oneshot mode must be 'auto', 'oneshot' or 'twoshot', got {mode!r}")
    if not twoshot_possible:
        return True
    if not oneshot_possible:
        return False
    if world_size in ONESHOT_MAX_MIB:
        return tokens * hidden * 2 * world_size * itemsize / 2**20 <= ONESHOT_MAX_MIB[world_size]
    return tokens <= ONESHOT_FALLBACK_MAX_TOKENS


class FusedBackend(AllReduceBackend):
    """FlashInfer TRT-LLM fused all-reduce (+ residual + RMSNorm); collective construction.

    ``hidden`` (the ``make_backend`` argument, stored as ``self.hidden``) is required: the workspace
    holds ``max_numel // hidden`` tokens of it. Without it, or with a hidden size or ``max_numel``
    the workspace cannot take, construction raises :class:`~fastverify.backends.base.BackendUnavailable`
    before any collective call (the same on every rank, as the arguments are), which every caller
    (tune worker, doctor, the patch) treats as "skipped", never as a crash.

    Options
    -------
    oneshot : str
        ``"auto"`` (default, :func:`choose_oneshot`), ``"oneshot"`` or ``"twoshot"``.
    fp32_acc : bool
        fp32 accumulation in the all-reduce (default True, as vLLM).
    self_check : bool
        Compare the fused result with the unfused path in :meth:`prepare` and disable the fused
        path on every rank on a mismatch (default True).
    """

    name = BackendName.fused
    option_names = frozenset({"oneshot", "fp32_acc", "self_check"})

    @classmethod
    def probe(cls, ctx: ProbeContext) -> Capability:
        bad = ipc_requirements(ctx, INFO, "FlashInfer builds trtllm_comm for SM90/SM10x/SM12x only")
        return bad if bad is not None else flashinfer_status(MIN_FLASHINFER, EXTERNAL_CALLS)

    def _setup(self) -> None:
        """Check ``hidden`` and ``max_numel``, then build the TRT-LLM workspace (collective). On
        failure the base class marks this closed: nothing was allocated, or FlashInfer failed on
        every rank.

        Memory per rank (TRT-LLM workspace): ``buffer = W*T*H*2 B``, ``lamport = 3*W*T*H*2 B`` (W
        ranks, T = ``max_numel // hidden`` tokens, H hidden; x2 for fp32), each rounded to 2 MiB:
        TP8, hidden 7168, bf16: 7 MiB at 16 tokens, 56 MiB at 128.

        Raises
        ------
        BackendUnavailable
            No ``hidden``, a ``hidden`` not a whole number of 16-byte vectors, or ``max_numel``
            below one token (``hidden`` elements).
        ValueError
            An unknown ``oneshot`` mode.
        """
        group, dtype, max_numel = self.group, self.dtype, self.max_numel
        # Checked before any collective: the arguments are the same on every rank, so every rank
        # raises the same BackendUnavailable and the caller skips the backend on all of them.
        hidden = self.hidden
        pack = 16 // element_size(dtype)
        if hidden is None:
            raise BackendUnavailable(
                self.name, "needs the hidden size to size its workspace; pass make_backend(..., hidden=H)"
            )
        if hidden % pack:
            raise BackendUnavailable(
                self.name,
                f"hidden {hidden} is not a multiple of {pack} ({dtype} in 16-byte vectors); use pcie_ipc or nccl",
            )
        if max_numel is None or max_numel < hidden:
            raise BackendUnavailable(
                self.name, f"max_numel must be >= hidden ({hidden}) to hold one token, got {max_numel!r}"
            )
        self.max_tokens = max_numel // hidden
        self.oneshot_mode = self.options.get("oneshot", "auto")
        choose_oneshot(1, hidden, element_size(dtype), 2, self.oneshot_mode)  # validates the mode
        self.fp32_acc = bool(self.options.get("fp32_acc", True))
        self.world_size = dist.get_world_size(group)
        self.disabled_reason: str | None = None
        self._allreduce_fusion = ALLREDUCE_FUSION.resolve()
        self._pattern_ar = PATTERN_AR.resolve()
        self._pattern_norm = PATTERN_AR_RESIDUAL_RMSNORM.resolve()
        # backend="trtllm", not "auto": auto picks the multicast (mnnvl) workspace where NVSwitch
        # exists, whose one-shot sizing and flags differ; one kernel family keeps results
        # comparable across boxes.
        self._ws = CREATE_WORKSPACE.resolve()(
            **CREATE_WORKSPACE.kwargs(
                backend="trtllm",
                world_size=self.world_size,
                rank=dist.get_rank(group),
                max_token_num=self.max_tokens,
                hidden_dim=hidden,
                dtype=dtype,
                group=group,
            )
        )

    # -- per call -------------------------------------------------------------------------------

    def supports(self, x: Tensor) -> bool:
        """Whether the fused kernel takes ``x``: base checks, contiguous, hidden a multiple of 16 B,
        ``rows * hidden <= max_tokens * hidden``. Pure function of the shape: all ranks agree."""
        if not (super().supports(x) and x.is_contiguous()):
            return False
        rows, hidden = x.shape
        return hidden % (16 // x.element_size()) == 0 and rows * hidden <= self.max_tokens * self.hidden and rows > 0

    def _common(self, x: Tensor) -> dict[str, Any]:
        """The ``allreduce_fusion`` arguments both patterns pass.

        ``use_oneshot`` is always explicit, from the shape alone (:func:`choose_oneshot`), so every
        rank picks the same kernel. ``trigger_completion_at_end=True`` and ``launch_with_pdl=False``:
        with PDL and early completion the one-shot Lamport kernel lets the next kernel read
        uncommitted data, giving NaN at <= 16 tokens, i.e. exactly the verify step (vLLM PR #45448).
        """
        rows, hidden = x.shape
        return {
            "input": x,
            "workspace": self._ws,
            "launch_with_pdl": False,
            "trigger_completion_at_end": True,
            "use_oneshot": choose_oneshot(rows, hidden, x.element_size(), self.world_size, self.oneshot_mode),
            "fp32_acc": self.fp32_acc,
        }

    def all_reduce(self, x: Tensor) -> Tensor:
        if not self.supports(x) or self.disabled_reason is not None:
            self.path_counts["fallback_all_reduce"] += 1
            return torch_all_reduce(x, self.group)
        out = torch.empty_like(x)
        self._allreduce_fusion(**ALLREDUCE_FUSION.kwargs(pattern=self._pattern_ar, output=out, **self._common(x)))
        self.path_counts["fused_all_reduce"] += 1
        return out

    def all_reduce_residual_rmsnorm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """As the base class, except that ``residual`` is never written: the kernel writes
        ``residual_out`` into a new ``(T, hidden)`` tensor, and so does the fallback, which a shape
        the workspace cannot take (or a fused path the self-check disabled) takes: still an
        all-reduce (``torch.distributed``), then add + RMSNorm."""
        _check_norm_args(x, residual, weight)
        if not self.supports(x) or self.disabled_reason is not None:
            return self._unfused(x, residual, weight, eps)
        residual_out = torch.empty_like(x)
        norm_out = torch.empty_like(x)
        self._allreduce_fusion(
            **ALLREDUCE_FUSION.kwargs(
                pattern=self._pattern_norm,
                residual_in=residual.contiguous(),
                rms_gamma=weight.contiguous(),
                rms_eps=float(eps),
                residual_out=residual_out,
                norm_out=norm_out,
                **self._common(x),
            )
        )
        self.path_counts["fused"] += 1
        return norm_out, residual_out

    def _unfused(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        # The fallback still all-reduces: plain torch.distributed on the same group, then the
        # backend's norm kernel, as every backend's unfused path, into a copy of ``residual``.
        self.path_counts["fallback"] += 1
        return self._residual_rmsnorm_copy(torch_all_reduce(x, self.group), residual, weight, eps)

    # -- lifetime -------------------------------------------------------------------------------

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Start-up self-check on the largest supported shape in ``shapes``: the fused result is
        compared with the unfused path on every rank, and the fused path is disabled on all ranks
        (one MIN all-reduce of the verdict) when any rank sees a mismatch. Collective."""
        if not self.options.get("self_check", True) or self.disabled_reason is not None:
            return
        fits = [
            tuple(s)
            for s in shapes
            if len(s) == 2 and s[1] == self.hidden and 0 < s[0] * s[1] <= self.max_tokens * self.hidden
        ]
        if not fits:
            return
        rows, hidden = max(fits)
        gen = torch.Generator(device="cpu").manual_seed(1234 + dist.get_rank(self.group))
        x = torch.randn(rows, hidden, generator=gen).to(self.device, self.dtype)
        residual = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(99)).to(self.device, self.dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(7))).to(self.device, self.dtype)
        got_norm, got_res = self.all_reduce_residual_rmsnorm(x, residual, weight, 1e-6)
        want_norm, want_res = self._unfused(x, residual, weight, 1e-6)
        ok_n, err_n = check_close(got_norm, want_norm.float(), self.dtype)
        ok_r, err_r = check_close(got_res, want_res.float(), self.dtype)
        verdict = torch.tensor([1 if ok_n and ok_r else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self.group)
        if int(verdict.item()) == 0:
            self.disabled_reason = (
                f"fused result differs from all-reduce + RMSNorm at shape {(rows, hidden)} on some rank "
                f"(this rank: normed rel err {err_n:.3g}, residual rel err {err_r:.3g}); using the unfused path"
            )
            if dist.get_rank(self.group) == 0:
                logger.warning("fastverify fused all-reduce disabled: %s", self.disabled_reason)
        self.path_counts.clear()

    def _release(self) -> None:
        """Drop the workspace references (FlashInfer frees the memory when they die)."""
        self._ws.destroy()
