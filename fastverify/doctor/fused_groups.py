"""The doctor case "fused slot on two different groups": the patch's fused-norm slot
(:mod:`fastverify.patch.fused_slot`) with two SGLang groups, as SGLang has them with MoE data
parallelism (moe_dp 2): the attention output owed to the attention-TP group (all 4 ranks), the MoE
output to ``post_experts_reduction_group()`` (a pair; SGLang 0.5.23 ``layers/moe/utils.py``).

Four CPU processes on gloo run the slot's real code: the owed group found through a
``resolve_fusion_group`` with SGLang's signature (``layers/flashinfer_comm_fusion.py``), one backend
built per group with the slot's own votes (the registry's CPU baseline standing in for the fused
kernel, as the patch itself does on CPU), the first-result check, and each call's sum. Rank ``r``
holds ``r + 1``, so each sum names the ranks it spans: 10 for the four, 3 or 7 for a pair.
"""

from __future__ import annotations

import datetime
import types
from typing import Any

from fastverify.doctor.core import free_port, spawn
from fastverify.patch import fused_slot as F
from fastverify.patch import rank as R
from fastverify.patch import slots
from fastverify.registry import BackendName

WORLD = 4
ROWS, HIDDEN = 4, 64
TIMEOUT_S = 120.0


class _Coordinator:
    """What the slot reads of SGLang's ``GroupCoordinator`` (``distributed/parallel_state.py``)."""

    def __init__(self, ranks: list[int], name: str) -> None:
        import torch.distributed as dist

        self.ranks, self.unique_name, self.world_size = ranks, name, len(ranks)
        self.device_group = dist.new_group(ranks)  # collective: every rank makes every group
        self.cpu_group = dist.new_group(ranks)
        self.rank_in_group = ranks.index(dist.get_rank()) if dist.get_rank() in ranks else -1

    def all_reduce(self, x: Any) -> Any:
        import torch.distributed as dist

        y = x.clone()
        dist.all_reduce(y, group=self.device_group)
        return y


def _rank(rank: int, port: int, q: Any) -> None:
    """One rank: build the groups, the slot's backends, and run both calls; puts (rank, result)."""
    out: dict[str, Any] = {}
    try:
        import torch
        import torch.distributed as dist

        from fastverify.backends import make_backend  # lazy: torch

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        whole = _Coordinator(list(range(WORLD)), "attn_tp")
        pairs = [_Coordinator([0, 1], "moe_tp:0"), _Coordinator([2, 3], "moe_tp:1")]
        pair = pairs[rank // 2]
        owed = {True: whole, False: pair}
        fusion = types.SimpleNamespace(resolve_fusion_group=lambda *, use_attn_tp_group: (
            owed[use_attn_tp_group].world_size, owed[use_attn_tp_group].rank_in_group, owed[use_attn_tp_group]))
        modules = {R.MOD_FI_FUSION: fusion}
        slots._fused.kind, slots._fused.disabled = BackendName.fused, None
        slots._fused.factory = lambda c, x: make_backend(BackendName.gloo, c.device_group, device=x.device,
                                                          dtype=x.dtype, max_numel=ROWS * HIDDEN, hidden=HIDDEN)
        F._fused_groups.clear()
        built, failed = F._build_fused(modules, torch.zeros(ROWS, HIDDEN), [])
        out["built"], out["failed"] = built, failed
        out["groups"] = [s.group.ranks for s in F._fused_groups if s.backend is not None]

        def sglang_own(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the slot declined: SGLang's own method was called")

        forward = F._make_fused_norm(modules)(sglang_own)
        norm = types.SimpleNamespace(weight=torch.ones(HIDDEN), variance_epsilon=1e-6)
        x = torch.full((ROWS, HIDDEN), float(rank + 1))
        residual = torch.zeros(ROWS, HIDDEN)
        out["sums"] = {}
        for name, use_attn in (("attn", True), ("moe", False)):  # attention first, as a layer runs
            _, new_res = forward(norm, x.clone(), residual.clone(), None, use_attn)
            out["sums"][name] = sorted({float(v) for v in (new_res - residual).flatten()})
        out["want"] = {"attn": [float(sum(r + 1 for r in whole.ranks))],
                       "moe": [float(sum(r + 1 for r in pair.ranks))]}
        for s in F._fused_groups:
            slots._close_quietly(s.backend)
        F._fused_groups.clear()
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - reported to the parent in one line
        out["error"] = f"{type(err).__name__}: {err}"
    q.put((rank, out))


def run_two_groups() -> dict[int, dict[str, Any]]:
    """Run the four ranks (spawned processes); {rank: result}. A rank that does not answer within
    :data:`TIMEOUT_S` is reported as such (a one-sided collective)."""
    port = free_port()
    answers = spawn(_rank, [(r, port) for r in range(WORLD)], TIMEOUT_S)
    got: dict[int, dict[str, Any]] = {a[0]: a[1] for a in answers if isinstance(a, tuple)}
    for r in range(WORLD):
        got.setdefault(r, {"error": f"rank {r} did not answer within {TIMEOUT_S:.0f} s"})
    return got


def verdict(got: dict[int, dict[str, Any]]) -> tuple[bool, str]:
    """(every rank's two calls summed over their own group's ranks, one line)."""
    bad = [f"rank {r}: {res['error']}" for r, res in sorted(got.items()) if "error" in res]
    if bad:
        return False, "; ".join(bad)
    wrong = [f"rank {r} summed {res['sums']} (want {res['want']})" for r, res in sorted(got.items())
             if res["sums"] != res["want"]]
    if wrong:
        return False, "the fused slot reduced over the wrong ranks: " + "; ".join(wrong)
    return True, (f"fused slot on two groups ({WORLD} gloo ranks): one backend per group "
                  f"({got[0]['built']}); the attention call summed over all {WORLD} ranks, the MoE call over its "
                  f"pair")
