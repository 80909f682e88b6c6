"""Model shapes for the live verify forward, read from a Hugging Face ``config.json`` or a preset.

Two families are understood:

* **DeepSeek-V3 / Kimi-K2** (MLA attention, MoE after ``first_k_dense_replace`` dense layers). A file
  is read as this family when it has ``kv_lora_rank`` or ``n_routed_experts``. Kimi-K2.5-style
  multimodal configs nest the text model under ``text_config``; that dict is read instead.
* **Llama-style dense** models (``num_key_value_heads`` GQA attention, a SwiGLU MLP in every layer).

Presets are JSON files in ``fastverify/live/presets/`` holding the same keys as the real
``config.json`` plus a ``_source`` key that says where each value was checked. Nothing here
imports torch: the CLI can validate ``--model`` and ``--tp`` before any worker starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fastverify.errors import UserError
from fastverify.inputs import loads_json, read_text

# SGLang pads the vocabulary to a multiple of 64 before splitting it over TP ranks
# (vLLM/SGLang ``layers/vocab_parallel_embedding.py``: ``DEFAULT_VOCAB_PADDING_SIZE = 64``,
# ``pad_vocab_size``), so the per-rank embedding and lm_head shards, and the logits all-gather,
# use the padded size.
VOCAB_PADDING = 64

DEFAULT_CONTEXT_TOKENS = 256
"""Cached KV tokens per request that the draft tokens attend to (a short fake context)."""

_PRESET_PACKAGE = "fastverify.live"  # presets live in its presets/ folder (package data, no __init__)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of one model, as the live forward needs them. Sizes are element counts, not bytes.

    Attributes
    ----------
    name : str
        Preset name, or the checkpoint directory (or file stem) a config was read from.
    source : str
        The file the values came from (a preset's path inside the package, or the user's file).
    family : str
        ``"deepseek_v3"`` (MLA + MoE; also Kimi-K2) or ``"llama"`` (GQA + dense MLP).
    hidden_size, num_layers, vocab_size : int
        ``hidden_size``, ``num_hidden_layers``, ``vocab_size`` of the config.
    num_attention_heads, num_key_value_heads : int
        Query heads and KV heads (for MLA, KV heads = query heads: every head has its own K/V
        after ``kv_b_proj``).
    head_dim : int
        Llama: per-head size of q/k/v (``head_dim``, else ``hidden_size // num_attention_heads``).
        DeepSeek: ``qk_nope_head_dim + qk_rope_head_dim``.
    intermediate_size : int
        Width of a dense layer's MLP (before TP split).
    rms_norm_eps : float
        RMSNorm epsilon.
    first_k_dense_replace : int
        Number of leading dense layers; every later layer is MoE (if ``moe_layer_freq`` divides it).
        A Llama model has ``first_k_dense_replace == num_layers``.
    moe_layer_freq : int
        DeepSeek: layer ``i >= first_k_dense_replace`` is MoE when ``i % moe_layer_freq == 0``.
    n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts : int
        Routed experts, top-k, per-expert MLP width, shared experts (0 for a dense model).
    q_lora_rank : int | None
        Rank of the query down-projection; ``None`` means one ``q_proj`` (DeepSeek-V2-Lite style).
    kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim : int
        MLA sizes (0 for a Llama model).
    """

    name: str
    source: str
    family: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    first_k_dense_replace: int
    moe_layer_freq: int = 1
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.family == "deepseek_v3"

    def is_moe_layer(self, layer: int) -> bool:
        """True when decoder layer ``layer`` (0-based) has an MoE MLP (DeepSeek ``DeepseekV2DecoderLayer``)."""
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def vocab_padded(self) -> int:
        """Vocabulary rounded up to a multiple of :data:`VOCAB_PADDING` (SGLang's embedding shards)."""
        return -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING

    def experts_allocated(self, tokens: int) -> int:
        """Routed experts the live forward allocates per rank: ``min(n_routed_experts, tokens × top-k)``,
        the most that ``tokens`` tokens can reach (0 for a dense model)."""
        if self.n_routed_experts == 0:
            return 0
        return min(self.n_routed_experts, tokens * self.num_experts_per_tok)


_Field = tuple[str, tuple[type, ...], bool]
"""(field, allowed JSON types, may be null). ``int`` excludes ``bool`` (checked by ``_get``)."""


def _ints(*names: str) -> tuple[_Field, ...]:
    """Required integer fields, not null."""
    return tuple((name, (int,), False) for name in names)


# In the order they are checked, so the first bad field is the one named.
_DEEPSEEK_FIELDS: tuple[_Field, ...] = (
    *_ints(
        "hidden_size",
        "num_hidden_layers",
        "first_k_dense_replace",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_shared_experts",
        "intermediate_size",
    ),
    ("q_lora_rank", (int,), True),
    *_ints("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_attention_heads", "vocab_size"),
    ("rms_norm_eps", (int, float), False),
)

_LLAMA_FIELDS = _ints(
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"
)

# Fields that may be 0; every other integer field must be >= 1.
_MAY_BE_ZERO = frozenset({"first_k_dense_replace", "n_shared_experts", "qk_rope_head_dim"})


def preset_names() -> list[str]:
    """Names of the shipped presets (``fastverify/live/presets/*.json``), sorted."""
    root = resources.files(_PRESET_PACKAGE).joinpath("presets")
    return sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json"))


def load_model_config(preset_or_path: str) -> ModelConfig:
    """Read a model's shapes from a preset name, a ``config.json`` file, or a checkpoint directory.

    Parameters
    ----------
    preset_or_path : str
        A preset name (see :func:`preset_names`: ``kimi-k2``, ``deepseek-v3``, ``tiny``), a path to
        a Hugging Face ``config.json``, or a directory that holds one.

    Returns
    -------
    ModelConfig

    Raises
    ------
    UserError
        Unknown preset (the message lists the known ones), unreadable file, invalid JSON, or a
        missing / wrongly typed / out-of-range field (the message names the file and the field).
    """
    names = preset_names()
    if preset_or_path in names:
        ref = resources.files(_PRESET_PACKAGE).joinpath("presets").joinpath(preset_or_path + ".json")
        return _from_text(ref.read_text(encoding="utf-8"), source=str(ref), name=preset_or_path)
    path = Path(preset_or_path)
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise UserError(f"{path.parent}: no config.json in this directory")
    if not path.exists():
        raise UserError(f"--model {preset_or_path!r}: no such preset or file (known presets: {', '.join(names)})")
    text = read_text(path, kind="text", what="model config")
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return _from_text(text, source=str(path), name=name)


def _from_text(text: str, *, source: str, name: str) -> ModelConfig:
    doc = loads_json(text, source, what="the model config", exact_ints=True)
    if not isinstance(doc, dict):
        raise UserError(f"{source}: a model config must be a JSON object, got {type(doc).__name__}")
    prefix = ""
    if "text_config" in doc:
        # Kimi-K2.5/K2.6 (KimiK25ForConditionalGeneration) wrap the DeepSeek-V3 text model.
        doc = doc["text_config"]
        prefix = "text_config."
        if not isinstance(doc, dict):
            raise UserError(f"{source}: field 'text_config' must be an object, got {_json_type(doc)}")
    if "kv_lora_rank" in doc or "n_routed_experts" in doc:
        return _deepseek(doc, source=source, name=name, prefix=prefix)
    for key in _OTHER_MOE_KEYS:
        if doc.get(key):
            # Qwen-MoE / Mixtral-style experts would silently run as a dense Llama: refuse instead.
            raise UserError(
                f"{source}: field '{prefix}{key}' = {doc[key]!r}: only DeepSeek-V3/Kimi-K2-style "
                "MoE configs (n_routed_experts) and dense Llama-style configs are supported"
            )
    return _llama(doc, source=source, name=name, prefix=prefix)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


# MoE keys of other families (Qwen2/3-MoE ``num_experts``, Mixtral ``num_local_experts``).
_OTHER_MOE_KEYS = ("num_experts", "num_local_experts")

# Upper bounds far above any real model, so that a typo (1e9 layers) fails at once instead of
# allocating or looping for minutes before a rank starts.
_MAX_VALUE = {
    "num_hidden_layers": 4096,
    "hidden_size": 1 << 17,
    "vocab_size": 1 << 22,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "n_routed_experts": 1 << 14,
    "intermediate_size": 1 << 20,
    "moe_intermediate_size": 1 << 20,
}


def _get(doc: dict, key: str, types: tuple[type, ...], nullable: bool, *, source: str, prefix: str):
    where = f"{source}: field '{prefix}{key}'"
    if key not in doc:
        raise UserError(f"{where} is missing")
    value = doc[key]
    if value is None:
        if nullable:
            return None
        raise UserError(f"{where} must be an integer, got null")
    want = "a number" if float in types else "an integer"
    if isinstance(value, bool) or not isinstance(value, types):
        raise UserError(f"{where} must be {want}, got {_json_type(value)} {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{where} must be a finite number, got {value!r}")
    lowest = 0 if key in _MAY_BE_ZERO else 1
    if float in types:
        if value <= 0:
            raise UserError(f"{where} must be > 0, got {value!r}")
    elif value < lowest:
        raise UserError(f"{where} must be >= {lowest}, got {value!r}")
    if key in _MAX_VALUE and value > _MAX_VALUE[key]:
        raise UserError(f"{where} = {value!r} is implausibly large (limit {_MAX_VALUE[key]})")
    return value


def _read(doc: dict, fields, *, source: str, prefix: str) -> dict:
    return {k: _get(doc, k, t, n, source=source, prefix=prefix) for k, t, n in fields}


def _optional_int(doc: dict, key: str, default: int, *, source: str, prefix: str) -> int:
    if doc.get(key) is None:
        return default
    return _get(doc, key, (int,), False, source=source, prefix=prefix)


def _deepseek(doc: dict, *, source: str, name: str, prefix: str) -> ModelConfig:
    v = _read(doc, _DEEPSEEK_FIELDS, source=source, prefix=prefix)
    freq = _optional_int(doc, "moe_layer_freq", 1, source=source, prefix=prefix)
    if v["num_experts_per_tok"] > v["n_routed_experts"]:
        raise UserError(
            f"{source}: field '{prefix}num_experts_per_tok' = {v['num_experts_per_tok']} exceeds "
            f"'{prefix}n_routed_experts' = {v['n_routed_experts']}"
        )
    if v["first_k_dense_replace"] > v["num_hidden_layers"]:
        raise UserError(
            f"{source}: field '{prefix}first_k_dense_replace' = {v['first_k_dense_replace']} exceeds "
            f"'{prefix}num_hidden_layers' = {v['num_hidden_layers']}"
        )
    heads = v["num_attention_heads"]
    return ModelConfig(
        name=name,
        source=source,
        family="deepseek_v3",
        hidden_size=v["hidden_size"],
        num_layers=v["num_hidden_layers"],
        vocab_size=v["vocab_size"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=v["qk_nope_head_dim"] + v["qk_rope_head_dim"],
        intermediate_size=v["intermediate_size"],
        rms_norm_eps=float(v["rms_norm_eps"]),
        first_k_dense_replace=v["first_k_dense_replace"],
        moe_layer_freq=freq,
        n_routed_experts=v["n_routed_experts"],
        num_experts_per_tok=v["num_experts_per_tok"],
        moe_intermediate_size=v["moe_intermediate_size"],
        n_shared_experts=v["n_shared_experts"],
        q_lora_rank=v["q_lora_rank"],
        kv_lora_rank=v["kv_lora_rank"],
        qk_nope_head_dim=v["qk_nope_head_dim"],
        qk_rope_head_dim=v["qk_rope_head_dim"],
        v_head_dim=v["v_head_dim"],
    )


def _llama(doc: dict, *, source: str, name: str, prefix: str) -> ModelConfig:
    v = _read(doc, _LLAMA_FIELDS, source=source, prefix=prefix)
    heads, kv_heads, hidden = v["num_attention_heads"], v["num_key_value_heads"], v["hidden_size"]
    if "head_dim" in doc and doc["head_dim"] is not None:
        head_dim = _get(doc, "head_dim", (int,), False, source=source, prefix=prefix)
    else:
        if hidden % heads:
            raise UserError(
                f"{source}: field '{prefix}head_dim' is missing and '{prefix}hidden_size' = {hidden} "
                f"is not a multiple of '{prefix}num_attention_heads' = {heads}"
            )
        head_dim = hidden // heads
    if heads % kv_heads:
        raise UserError(
            f"{source}: field '{prefix}num_key_value_heads' = {kv_heads} does not divide "
            f"'{prefix}num_attention_heads' = {heads}"
        )
    eps = doc.get("rms_norm_eps")
    eps = 1e-6 if eps is None else _get(doc, "rms_norm_eps", (int, float), False, source=source, prefix=prefix)
    return ModelConfig(
        name=name,
        source=source,
        family="llama",
        hidden_size=hidden,
        num_layers=v["num_hidden_layers"],
        vocab_size=v["vocab_size"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=v["intermediate_size"],
        rms_norm_eps=float(eps),
        first_k_dense_replace=v["num_hidden_layers"],
    )


def check_tp(config: ModelConfig, tp: int) -> None:
    """Check that ``tp`` ranks can split ``config`` the way SGLang's TP layers do.

    Rules (SGLang ``layers/linear.py`` ``divide()`` asserts, ``layers/vocab_parallel_embedding.py``,
    ``layers/moe`` TP path): query heads, the dense MLP width, the per-expert MoE width and the
    padded vocabulary must be multiples of ``tp``; Llama KV heads must divide by ``tp`` or, when
    fewer than ``tp``, divide ``tp`` (each KV head is then replicated on ``tp / kv_heads`` ranks).

    Raises
    ------
    UserError
        Naming the value that ``tp`` does not divide.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise UserError(f"--tp must be a positive integer, got {tp!r}")
    model = config.name

    def need(value: int, field: str) -> None:
        if value % tp:
            raise UserError(f"--tp {tp} does not divide {field} = {value} of model {model!r}")

    need(config.num_attention_heads, "num_attention_heads")
    if not config.is_mla:
        kv = config.num_key_value_heads
        if kv % tp and tp % kv:
            raise UserError(
                f"--tp {tp} neither divides nor is a multiple of num_key_value_heads = {kv} of model {model!r}"
            )
    if config.first_k_dense_replace > 0:
        need(config.intermediate_size, "intermediate_size")
    if config.num_moe_layers > 0:
        need(config.moe_intermediate_size, "moe_intermediate_size")
    need(config.vocab_padded, f"vocab_size padded to a multiple of {VOCAB_PADDING}")


@dataclass(frozen=True)
class RankMemory:
    """A lower bound on one live rank's memory, in bytes (see :func:`rank_memory`).

    Attributes
    ----------
    setup : int
        What the rank allocates before the first forward and keeps: weights, the fake KV context,
        the input ids and the attention mask (routing plans, at least ``T × top-k`` rows per MoE
        layer, are not counted: their size depends on the draw).
    transient : int
        The larger of the two peaks on top of ``setup``: the routing draw (``[T, n_routed]``
        float32, at setup) and the forward's logits (``[T, V/tp]``) plus, with ``tp > 1``, the
        gathered logits (``[T, V_padded]``).
    """

    setup: int
    transient: int

    @property
    def total(self) -> int:
        return self.setup + self.transient


def rank_memory(
    config: ModelConfig, *, tp: int, batch: int, draft_tokens: int, dtype_bytes: int, context_tokens: int
) -> RankMemory:
    """At least how much memory one rank of the live verify forward needs; no allocation, no torch.

    The tensors are those :class:`fastverify.live.forward.TPVerifyModel` allocates (one layer's
    weights serve every layer; routed experts only as many as ``T × top-k`` can reach), so a shape
    that cannot fit is refused before any rank starts.

    Parameters
    ----------
    config : ModelConfig
    tp, batch, draft_tokens : int
        TP ranks, requests and draft tokens per request (``T = batch × draft_tokens``).
    dtype_bytes : int
        Bytes per element of weights and activations (2 for bfloat16).
    context_tokens : int
        Cached tokens per request in the fake KV context
        (:data:`DEFAULT_CONTEXT_TOKENS`).

    Returns
    -------
    RankMemory
        Bytes per rank; :attr:`RankMemory.setup` equals the model's ``weight_bytes()`` less its
        routing plans.
    """
    T, H, e = batch * draft_tokens, config.hidden_size, dtype_bytes
    heads, vshard = config.num_attention_heads // tp, config.vocab_padded // tp
    n = 2 * vshard * H + 3 * H  # embed, lm_head, final / input / post-attention norms
    if config.is_mla:
        dq, dv, kv_heads = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim, heads
        if config.q_lora_rank is None:
            n += H * heads * dq
        else:
            n += H * config.q_lora_rank + config.q_lora_rank + config.q_lora_rank * heads * dq
        n += H * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank
        n += config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
    else:
        dq = dv = config.head_dim
        kv_heads = max(1, config.num_key_value_heads // tp)
        n += H * heads * dq + H * 2 * kv_heads * dq
    n += heads * dv * H  # o_proj
    n += batch * kv_heads * context_tokens * (dq + dv)  # K and V context
    if config.first_k_dense_replace > 0:
        n += 3 * H * (config.intermediate_size // tp)
    routing = 0
    if config.num_moe_layers > 0:
        inter = config.moe_intermediate_size // tp
        n += H * config.n_routed_experts + 3 * config.experts_allocated(T) * H * inter
        n += 3 * H * (config.moe_intermediate_size * config.n_shared_experts // tp)
        routing = 4 * T * config.n_routed_experts  # torch.rand(T, n_routed), float32
    setup = n * e + 8 * T + draft_tokens * (context_tokens + draft_tokens)  # + int64 ids, bool mask
    logits = T * vshard * e * (1 + (tp if tp > 1 else 0))
    return RankMemory(setup=setup, transient=max(routing, logits))
