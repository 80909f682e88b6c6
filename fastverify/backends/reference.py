"""The plain torch result every backend is checked against, and the comparison with it.

Re-exported by :mod:`fastverify.backends.base` (and :mod:`fastverify.backends`).
"""

from __future__ import annotations

from typing import Sequence

import torch

Tensor = torch.Tensor


def reference_residual_rmsnorm(
    xs: Sequence[Tensor], residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """The plain torch result every backend is checked against, computed in fp32 on one process.

    Parameters
    ----------
    xs : sequence of Tensor
        One ``(T, hidden)`` tensor per rank (the inputs of the all-reduce), any float dtype.
    residual : Tensor
        ``(T, hidden)``; weight : ``(hidden,)``; eps : RMSNorm epsilon.

    Returns
    -------
    (normed, residual_out) : tuple[Tensor, Tensor]
        fp32 CPU tensors, ``(T, hidden)`` each; no rounding to the input dtype anywhere.
    """
    if not xs:
        raise ValueError("xs must hold one tensor per rank, got an empty sequence")
    total = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x in xs:
        if x.shape != xs[0].shape:
            raise ValueError(f"all xs must have one shape, got {tuple(x.shape)} and {tuple(xs[0].shape)}")
        total += x.detach().float().cpu()
    r = total + residual.detach().float().cpu()
    normed = r * torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.detach().float().cpu()
    return normed, r


# Normwise relative tolerance per dtype: max|got - want| / max|want| must not exceed it.
# Normwise, not elementwise: a near-zero element produced by cancellation has no meaningful
# elementwise relative error. The bound is 4 machine epsilons (bf16 2**-7, fp16 2**-10), enough for
# an 8-rank reduction in a different order plus the rounding of the inputs and of the output, and
# still far below the error of a dropped rank (~1/sqrt(world_size)) or a skipped all-reduce (~1).
# fp32 gets 1e-5 because different summation orders of thousands of terms exceed 4 eps (4.8e-7).
TOLERANCE: dict[torch.dtype, float] = {
    torch.bfloat16: 4 * 2.0**-7,  # 0.03125
    torch.float16: 4 * 2.0**-10,  # 0.00391
    torch.float32: 1e-5,
    torch.float64: 1e-12,
}


def check_close(got: Tensor, want: Tensor, dtype: torch.dtype) -> tuple[bool, float]:
    """Compare a backend's output with the reference.

    Parameters
    ----------
    got : Tensor
        The backend's output, any device/dtype.
    want : Tensor
        The reference (fp32), same shape.
    dtype : torch.dtype
        The dtype the backend ran in; picks the tolerance from :data:`TOLERANCE`.

    Returns
    -------
    (ok, max_rel_err) : tuple[bool, float]
        ``max_rel_err = max|got - want| / max|want|`` (inf when ``got`` has NaN/Inf, or when
        ``want`` is all zeros and ``got`` is not); ``ok`` when it is within the tolerance.
    """
    if dtype not in TOLERANCE:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {[str(d) for d in TOLERANCE]}")
    if tuple(got.shape) != tuple(want.shape):
        raise ValueError(f"shape mismatch: got {tuple(got.shape)}, want {tuple(want.shape)}")
    g = got.detach().double().cpu()
    w = want.detach().double().cpu()
    if not torch.isfinite(g).all():
        return False, float("inf")
    err = (g - w).abs().max().item() if g.numel() else 0.0
    scale = w.abs().max().item() if w.numel() else 0.0
    rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
    return rel <= TOLERANCE[dtype], rel
