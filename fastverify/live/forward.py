"""One rank's tensor-parallel verify forward: the real per-rank shapes and collective sequence, random weights.

Real: every per-rank weight shape, the token count ``T = batch × draft_tokens``, the dtype (bf16 as
served, by default), and the collectives with their payloads, in SGLang's order for DeepSeek-V2/V3
and Kimi (SGLang 0.5.23 ``python/sglang/srt/models/deepseek_v2.py`` with ``layers/communicator.py``):
an all-reduce of ``[T, hidden]`` (``T × hidden × 2`` bytes) after the ``VocabParallelEmbedding``;
per decoder layer one after attention's row-parallel ``o_proj`` and one after the MLP (dense for the
first ``first_k_dense_replace`` layers, TP-MoE + shared experts after), each followed by the
residual add + RMSNorm; after the final norm and the column-parallel ``lm_head``, an all-gather of
the logits ``[T, vocab_padded / tp]`` (``LogitsProcessor``). That is ``1 + 2 × num_layers``
all-reduces (123 for Kimi-K2) and one all-gather per forward; none at ``tp == 1`` (SGLang's
``GroupCoordinator.all_reduce`` returns at once for a world of one), so no region is recorded.

Not real: one attention block, one dense MLP and one MoE block serve every layer (the full model
does not fit); only the routed experts ``T`` tokens can reach are allocated; the routing is a fixed
draw and the attention simplified (see :meth:`TPVerifyModel._routing_plan` and
:meth:`TPVerifyModel._attention`). Message sizes do not depend on any of this.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastverify.events import EventClass
from fastverify.live.config import DEFAULT_CONTEXT_TOKENS, ModelConfig, check_tp
from fastverify.registry import Role, backend_info

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"

# torch >= 2.10 renames all_gather_into_tensor (deprecated) to all_gather_single; the CUDA torch a
# user already has may predate the rename.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Recorder(Protocol):
    """Times labelled regions of a forward; see :mod:`fastverify.live.clocks` for the clocks."""

    def region(self, name: str, cls: EventClass, label: str, msg_bytes: int) -> ContextManager[None]:
        """Context manager around one region. ``name`` is the stable event name (``"allreduce"``,
        ``"compute:attn"``), ``label`` says where (``"layer3.attn_out.allreduce"``), ``msg_bytes`` is
        the collective payload in bytes (-1 for compute)."""
        ...


class NullRecorder:
    """Records nothing: warm-up forwards and CUDA-graph capture."""

    _NULL = contextlib.nullcontext()

    def region(self, name: str, cls: EventClass, label: str, msg_bytes: int) -> ContextManager[None]:
        return self._NULL


NULL_RECORDER = NullRecorder()


def _weight(shape: tuple[int, ...], fan_in: int, *, dtype, device, gen) -> torch.Tensor:
    """Random ``N(0, 1/fan_in)`` weight, so activations stay O(1) through the shared layers."""
    # Drawn in place on the device: Kimi-K2's experts are ~4 GB per rank at TP8, too much to stage in host fp32.
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, fan_in**-0.5, generator=gen)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, result in ``x.dtype``. ``x``: [T, d]; ``weight``: [d]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(x W_g) * x W_u)``. ``x``: [..., H]; ``gate_up``: [H, 2I]; ``down``: [I, H]."""
    gu = x @ gate_up
    inter = down.shape[0]
    return (F.silu(gu[..., :inter]) * gu[..., inter:]) @ down


class TPVerifyModel:
    """One TP rank of the verify forward, with its per-rank weights (``dtype``, bf16 by default) on ``device``.

    Parameters
    ----------
    config : ModelConfig
        Model shapes; ``check_tp(config, tp)`` must pass.
    tp, rank : int
        World size and this rank's index (the default process group is used for collectives when
        ``tp > 1``; it must be initialised).
    batch, draft_tokens : int
        Requests and tokens verified per request: the forward runs ``T = batch × draft_tokens`` tokens.
    device : torch.device | str
        Where weights and activations live (``"cpu"``, ``"cuda:<rank>"``, or ``"meta"`` to check shapes
        without memory; a meta model cannot run).
    dtype : torch.dtype
        Weights and activations (``torch.bfloat16`` by default, as served).
    context_tokens : int
        Cached tokens per request in the fake KV context.
    seed : int
        Inputs and routing plans derive from ``seed`` alone, so they are the same on every rank;
        weights derive from ``seed`` and ``rank``.
    backend : fastverify.backends.AllReduceBackend or None
        Does the all-reduces (``tp > 1``), built on the group the model runs on for
        ``[T, hidden]`` tensors of ``dtype`` (``make_backend(name, group, device=, dtype=,
        max_numel=T × hidden, hidden=hidden)``); :meth:`forward` says which call is used
        where. None: ``dist.all_reduce`` on the default group. Not owned: the caller closes it.

    Raises
    ------
    UserError
        ``tp`` cannot split the model (:func:`~fastverify.live.config.check_tp`).

    Attributes
    ----------
    tokens : int
        ``T``.
    allreduce_bytes : int
        Payload of every all-reduce: ``T × hidden_size × dtype size``.
    allgather_bytes : int
        Per-rank input of the logits all-gather: ``T × (vocab_padded / tp) × dtype size`` (the
        gathered output is ``tp`` times that).
    experts_allocated : int
        Routed experts allocated on this rank (``config.experts_allocated(T)``).
    experts_used : list[int]
        Distinct experts the routing plan of each MoE layer visits (in layer order).
    fused_norm : bool
        Whether the forward calls the backend's fused all-reduce + residual + RMSNorm.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        tp: int,
        rank: int,
        batch: int,
        draft_tokens: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        context_tokens: int = DEFAULT_CONTEXT_TOKENS,
        seed: int = 0,
        backend=None,
    ) -> None:
        check_tp(config, tp)
        self.backend = backend
        self.fused_norm = backend is not None and backend_info(backend.name).role is Role.fused_norm
        self.config = config
        self.tp, self.rank = tp, rank
        self.batch, self.draft_tokens = batch, draft_tokens
        self.tokens = T = batch * draft_tokens
        self.device = torch.device(device)
        self.dtype = dtype
        self.context_tokens = context_tokens
        elt = torch.empty((), dtype=dtype).element_size()
        H = config.hidden_size
        self.vocab_shard = config.vocab_padded // tp
        self.allreduce_bytes = T * H * elt
        self.allgather_bytes = T * self.vocab_shard * elt

        shared = torch.Generator().manual_seed(seed)  # same on every rank
        own = None  # the "meta" device (shape checks, no memory) has no generator
        if self.device.type != "meta":
            own = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + 7919 * (rank + 1))
        mk = lambda shape, fan_in: _weight(shape, fan_in, dtype=dtype, device=self.device, gen=own)  # noqa: E731
        ones = lambda n: torch.ones(n, dtype=dtype, device=self.device)  # noqa: E731

        self._build_embedding(mk, ones, shared)
        self._build_attention(mk, ones)
        self._build_dense_mlp(mk)
        self._build_moe(mk, shared)

    def _build_embedding(self, mk, ones, shared: torch.Generator) -> None:
        """Vocab-parallel embedding and ``lm_head`` (rows ``[rank × V/tp, (rank+1) × V/tp)`` of the
        padded vocabulary), the three norms, and the input ids (``[T]`` int64, drawn from ``shared``)."""
        config, H = self.config, self.config.hidden_size
        self.vocab_start = self.rank * self.vocab_shard
        self.embed = mk((self.vocab_shard, H), 1)  # [V/tp, H]
        self.lm_head = mk((H, self.vocab_shard), H)  # [H, V/tp]
        self.final_norm = ones(H)
        self.input_norm = ones(H)
        self.post_attn_norm = ones(H)
        ids = torch.randint(0, config.vocab_size, (self.tokens,), generator=shared)
        self.input_ids = ids.to(self.device)  # [T] int64

    def _build_attention(self, mk, ones) -> None:
        """One attention block shared by every layer (MLA or GQA), its fake KV context
        ``[batch, kv_heads, context_tokens, dq | dv]`` and the verify mask."""
        config, tp, H = self.config, self.tp, self.config.hidden_size
        batch, draft_tokens, context_tokens = self.batch, self.draft_tokens, self.context_tokens
        self.heads = config.num_attention_heads // tp
        ctx = (batch, self.heads, context_tokens)
        if config.is_mla:
            dq = config.qk_nope_head_dim + config.qk_rope_head_dim
            self.dq, self.dv = dq, config.v_head_dim
            if config.q_lora_rank is None:
                self.q_proj = mk((H, self.heads * dq), H)  # column-parallel
            else:
                self.q_a = mk((H, config.q_lora_rank), H)  # replicated
                self.q_a_norm = ones(config.q_lora_rank)
                self.q_b = mk((config.q_lora_rank, self.heads * dq), config.q_lora_rank)  # column-parallel
            self.kv_a = mk((H, config.kv_lora_rank + config.qk_rope_head_dim), H)  # replicated (MQA rope key)
            self.kv_a_norm = ones(config.kv_lora_rank)
            self.kv_b = mk(  # column-parallel: per head [k_nope | v]
                (config.kv_lora_rank, self.heads * (config.qk_nope_head_dim + config.v_head_dim)),
                config.kv_lora_rank,
            )
            self.kv_heads = self.heads
        else:
            hd = config.head_dim
            self.dq = self.dv = hd
            # KV heads per rank; with fewer KV heads than ranks each is replicated (vLLM/SGLang QKVParallelLinear).
            self.kv_heads = max(1, config.num_key_value_heads // tp)
            self.q_proj = mk((H, self.heads * hd), H)
            self.kv_proj = mk((H, 2 * self.kv_heads * hd), H)
            ctx = (batch, self.kv_heads, context_tokens)
        self.o_proj = mk((self.heads * self.dv, H), self.heads * self.dv)  # row-parallel, no reduce
        self.k_cache = mk(ctx + (self.dq,), 1)  # [batch, kv_heads, ctx, dq]
        self.v_cache = mk(ctx + (self.dv,), 1)  # [batch, kv_heads, ctx, dv]
        # True = may attend: the whole cached context, then causal over the request's draft tokens.
        mask = torch.ones(draft_tokens, context_tokens + draft_tokens, dtype=torch.bool)
        mask[:, context_tokens:] = torch.tril(mask[:, context_tokens:])
        self.attn_mask = mask.to(self.device)

    def _build_dense_mlp(self, mk) -> None:
        """The dense MLP of the first ``first_k_dense_replace`` layers: gate and up fused,
        column-parallel; down row-parallel."""
        config, tp, H = self.config, self.tp, self.config.hidden_size
        if config.first_k_dense_replace > 0:
            inter = config.intermediate_size // tp
            self.dense_gate_up = mk((H, 2 * inter), H)
            self.dense_down = mk((inter, H), inter)

    def _build_moe(self, mk, shared: torch.Generator) -> None:
        """Router (replicated), routed experts and shared experts, and one routing plan per MoE layer.

        Only ``min(n_routed_experts, T × top_k)`` routed experts are allocated, the most ``T`` tokens
        can reach. As in SGLang's TP-MoE (``FusedMoE`` without expert parallelism) each rank holds
        the ``moe_intermediate_size / tp`` slice of every expert's gate/up and down projections.
        """
        config, tp, H = self.config, self.tp, self.config.hidden_size
        self.experts_allocated = config.experts_allocated(self.tokens)
        self.experts_used: list[int] = []
        self.plans: dict[int, tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if config.num_moe_layers > 0:
            E, I = self.experts_allocated, config.moe_intermediate_size // tp
            self.router = mk((H, config.n_routed_experts), H)  # [H, n_routed]
            self.experts_gate_up = mk((E, H, 2 * I), H)  # [E, H, 2I/tp]
            self.experts_down = mk((E, I, H), I)  # [E, I/tp, H]
            shared_inter = config.moe_intermediate_size * config.n_shared_experts // tp
            if shared_inter:
                self.shared_gate_up = mk((H, 2 * shared_inter), H)
                self.shared_down = mk((shared_inter, H), shared_inter)
            for layer in range(config.num_layers):
                if config.is_moe_layer(layer):
                    self.plans[layer] = self._routing_plan(shared)
                    self.experts_used.append(self.plans[layer][0])

    def _routing_plan(self, gen: torch.Generator) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fixed routing for one MoE layer: each token visits ``top_k`` distinct experts drawn uniformly.

        The router GEMM and the sigmoid top-k still run in the forward (their cost is real), but the
        experts each token visits come from this draw, the same on every rank (``gen`` is seeded
        alike): random weights make the router's own choice meaningless, and a fixed plan keeps
        every shape static, so the forward can be captured in a CUDA graph.

        Returns ``(used, cap, token_index, pair_index, valid)``: ``used`` distinct experts are mapped to
        allocated slots ``0..used-1``; slot ``s`` takes ``cap`` rows, row ``s × cap + j`` being token
        ``token_index[...]`` (int64, [used × cap]) whose combine weight is entry ``pair_index[...]`` of
        the flattened ``[T, top_k]`` router weights; ``valid`` ([used × cap, 1], ``dtype``) is 0 on
        padding rows (which point at token 0 and add nothing).
        """
        cfg, T = self.config, self.tokens
        k = cfg.num_experts_per_tok
        chosen = torch.rand(T, cfg.n_routed_experts, generator=gen).topk(k, dim=1).indices  # [T, k]
        _, slot = torch.unique(chosen.flatten(), return_inverse=True)  # [T*k] in [0, used)
        used = int(slot.max()) + 1
        counts = torch.bincount(slot, minlength=used)
        cap = int(counts.max())
        order = torch.argsort(slot, stable=True)  # pair ids grouped by slot
        starts = torch.cumsum(counts, 0) - counts
        rows = slot[order] * cap + (torch.arange(T * k) - starts[slot[order]])
        token_index = torch.zeros(used * cap, dtype=torch.int64)
        pair_index = torch.zeros(used * cap, dtype=torch.int64)
        valid = torch.zeros(used * cap, 1, dtype=self.dtype)
        token_index[rows] = order // k
        pair_index[rows] = order
        valid[rows] = 1
        assert used <= self.experts_allocated
        to = lambda t: t.to(self.device)  # noqa: E731
        return used, cap, to(token_index), to(pair_index), to(valid)

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights, KV context and routing plans (everything allocated at setup)."""
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor)) + sum(
            t.numel() * t.element_size() for plan in self.plans.values() for t in plan[2:]
        )

    # ---- blocks -------------------------------------------------------------------------------

    def _embed(self) -> torch.Tensor:
        """Masked lookup of this rank's vocabulary shard: [T, H], zero rows for other ranks' tokens."""
        local = self.input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_shard)
        rows = F.embedding(local.clamp(0, self.vocab_shard - 1), self.embed)
        return rows * inside.unsqueeze(1).to(rows.dtype)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] → partial ``o_proj`` output [T, H] (to be all-reduced).

        Simplified: MLA is computed in its non-absorbed form (``kv_b_proj`` expands the latent into
        per-head K/V; SGLang absorbs it for decode), without RoPE, against the fixed random context
        of ``context_tokens`` cached tokens per request plus the request's draft tokens, with a
        causal mask over the drafts (EAGLE with ``topk=1``, SGLang's default for Kimi, verifies a chain).
        """
        cfg, b, d = self.config, self.batch, self.draft_tokens
        if cfg.is_mla:
            if cfg.q_lora_rank is None:
                q = x @ self.q_proj
            else:
                q = _rms_norm(x @ self.q_a, self.q_a_norm, cfg.rms_norm_eps) @ self.q_b
            latent, k_rope = (x @ self.kv_a).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            kv = (_rms_norm(latent, self.kv_a_norm, cfg.rms_norm_eps) @ self.kv_b).view(
                -1, self.heads, cfg.qk_nope_head_dim + cfg.v_head_dim
            )
            k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, self.heads, -1)], dim=-1)  # [T, h, dq]
        else:
            q = x @ self.q_proj
            k, v = (x @ self.kv_proj).view(-1, 2, self.kv_heads, self.dq).unbind(1)  # [T, kv, hd] each
        q = q.view(b, d, self.heads, self.dq).transpose(1, 2)  # [b, h, d, dq]
        k = torch.cat([self.k_cache, k.reshape(b, d, self.kv_heads, self.dq).transpose(1, 2)], dim=2)
        v = torch.cat([self.v_cache, v.reshape(b, d, self.kv_heads, self.dv).transpose(1, 2)], dim=2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.attn_mask)  # [b, h, d, dv]
        return out.transpose(1, 2).reshape(b * d, self.heads * self.dv) @ self.o_proj

    def _moe(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Router + routed experts (this rank's slice) + shared experts: [T, H] → partial [T, H].

        The combine weights are the router's normalised top-k scores. Experts run as one padded
        batched GEMM per projection (each expert's tokens padded to the busiest expert's count),
        which reads each used expert's weights once, as the fused MoE kernel does.
        """
        cfg, H = self.config, self.config.hidden_size
        used, cap, token_index, pair_index, valid = self.plans[layer]
        scores = (x @ self.router).float().sigmoid()  # [T, n_routed]
        top = scores.topk(cfg.num_experts_per_tok, dim=-1).values  # [T, k]
        weights = (top / top.sum(-1, keepdim=True)).to(x.dtype).flatten()  # [T*k]
        xs = x.index_select(0, token_index).view(used, cap, H)
        gu = torch.bmm(xs, self.experts_gate_up[:used])  # [used, cap, 2I/tp]
        inter = self.experts_down.shape[1]
        ys = torch.bmm(F.silu(gu[..., :inter]) * gu[..., inter:], self.experts_down[:used])  # [used, cap, H]
        ys = ys.view(used * cap, H) * (weights.index_select(0, pair_index).unsqueeze(1) * valid)
        out = torch.zeros_like(x).index_add_(0, token_index, ys)
        if hasattr(self, "shared_gate_up"):
            out = out + swiglu(x, self.shared_gate_up, self.shared_down)
        return out

    # ---- forward ------------------------------------------------------------------------------

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` [T, H] over the ranks (the backend's out-of-place call, or in place)."""
        if self.backend is None:
            dist.all_reduce(x)
            return x
        return self.backend.all_reduce(x)

    def forward(self, rec: Recorder = NULL_RECORDER) -> torch.Tensor:
        """One verify forward over the ``T`` tokens, every region timed by ``rec``.

        The all-reduces go through ``backend`` (as gpt-fast adds its collectives to a model by
        hooks, so one forward measures any backend), by its registry role (:mod:`fastverify.registry`).
        ``Role.fused_norm`` (FlashInfer's fused all-reduce + residual + RMSNorm): at every boundary
        where the residual add and RMSNorm follow the all-reduce (after ``o_proj``, the
        ``post_attention_layernorm``; after the MLP/MoE, the next ``input_layernorm`` or the final
        norm) it calls ``backend.all_reduce_residual_rmsnorm``, as SGLang's
        ``RMSNorm.forward_with_allreduce_fusion`` does (``layers/layernorm.py``); the embedding's
        all-reduce has no residual and stays plain. Every other role: ``backend.all_reduce``, then
        the model's own add + RMSNorm, so non-fused backends share one norm kernel. No backend:
        ``dist.all_reduce`` in place on the default group.

        Returns
        -------
        torch.Tensor
            Gathered logits, ``[tp × T, vocab_padded / tp]`` (rank-major; ``[T, V/tp]`` when tp is 1),
            ``dtype``, on ``device``.
        """
        cfg, eps, comm = self.config, self.config.rms_norm_eps, self.tp > 1
        C, AR, FUSED = EventClass.COMPUTE, EventClass.ALLREDUCE, EventClass.FUSED_ALLREDUCE
        fused = comm and self.fused_norm
        with rec.region("compute:embed", C, "embed", -1):
            h = self._embed()
        if comm:
            with rec.region(ALLREDUCE, AR, "embed.allreduce", self.allreduce_bytes):
                h = self._all_reduce(h)
        residual = None
        x = None  # the normed input of the next block when a fused boundary already produced it
        last = cfg.num_layers - 1
        for i in range(cfg.num_layers):
            with rec.region("compute:attn", C, f"layer{i}.attn", -1):
                if x is None:
                    if residual is None:  # SGLang's first input_layernorm has no residual yet
                        residual = h
                    else:  # SGLang: input_layernorm(hidden_states, residual) = fused add + RMSNorm
                        h = h + residual
                        residual = h
                    x = _rms_norm(h, self.input_norm, eps)
                a = self._attention(x)
                x = None
            if fused:
                with rec.region(ALLREDUCE, FUSED, f"layer{i}.attn_out.allreduce", self.allreduce_bytes):
                    x, residual = self.backend.all_reduce_residual_rmsnorm(a, residual, self.post_attn_norm, eps)
            elif comm:
                with rec.region(ALLREDUCE, AR, f"layer{i}.attn_out.allreduce", self.allreduce_bytes):
                    a = self._all_reduce(a)
            moe = cfg.is_moe_layer(i)
            with rec.region("compute:moe" if moe else "compute:mlp", C, f"layer{i}.mlp", -1):
                if x is None:
                    h = a + residual
                    residual = h
                    x = _rms_norm(h, self.post_attn_norm, eps)
                h = self._moe(x, i) if moe else swiglu(x, self.dense_gate_up, self.dense_down)
                x = None
            if fused:  # the next layer's input_layernorm, or the final norm after the last layer
                norm = self.final_norm if i == last else self.input_norm
                with rec.region(ALLREDUCE, FUSED, f"layer{i}.mlp_out.allreduce", self.allreduce_bytes):
                    x, residual = self.backend.all_reduce_residual_rmsnorm(h, residual, norm, eps)
            elif comm:
                with rec.region(ALLREDUCE, AR, f"layer{i}.mlp_out.allreduce", self.allreduce_bytes):
                    h = self._all_reduce(h)
        with rec.region("compute:lm_head", C, "lm_head", -1):
            if x is None:
                h = h if residual is None else h + residual
                x = _rms_norm(h, self.final_norm, eps)
            logits = x @ self.lm_head  # [T, V/tp]
        if not comm:
            return logits
        gathered = torch.empty(self.tp * self.tokens, self.vocab_shard, dtype=logits.dtype, device=logits.device)
        with rec.region(ALLGATHER, EventClass.OTHER_COMM, "logits.allgather", self.allgather_bytes):
            _all_gather(gathered, logits)
        return gathered
