"""Test-only builder of a tiny random Llama and its own tokenizer (never imported by fastverify).

Why: the CPU test server needs a real Hugging Face model folder SGLang 0.5.23 can load
(``config.json``, ``model.safetensors``, a fast tokenizer), small enough that a TP 2 forward on two
CPU cores takes milliseconds, and made without a model hub (CI has no credentials and must not
download weights). A random Llama (hidden 64, 2 layers, 4 heads of 16, vocab 512) with a byte-level
BPE tokenizer trained here on a fixed, repetitive text (so NGRAM finds n-gram matches to draft)
does both; ``torch.manual_seed`` makes it the same every time.

Run in the SGLang venv (it has ``transformers`` / ``tokenizers``)::

    python -m tests.sglang_server.tiny_model OUT_DIR [--eagle3 DIR] [--eagle DIR]

``--eagle3`` / ``--eagle`` also write a tiny random drafter for that target (:func:`build_eagle3_drafter`,
:func:`build_eagle_drafter`): one decoder layer of the target's width, in the checkpoint layout
SGLang 0.5.23's ``models/llama_eagle3.py`` / ``models/llama_eagle.py`` load.
"""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB = 512
SEED = 1234
CORPUS = [
    "the quick brown fox jumps over the lazy dog. " * 4,
    "speculative decoding verifies draft tokens with one forward of the target model. " * 3,
    "an all-reduce sums a tensor over every rank of the tensor parallel group. " * 3,
    "one two three four five six seven eight nine ten. " * 4,
]


PEAKED_LM_HEAD_SCALE = 200.0
"""``--lm-head-scale`` of the answer tests: a random Llama's logits have a standard deviation of about
0.16 (its ``lm_head`` rows are N(0, 0.02) over a unit-RMS hidden of 64), so greedy answers turn on
top-1/top-2 margins of about 0.01 nats and exact ties. Multiplying ``lm_head`` by 200 makes the
logits about 32 wide: margins of several nats, few near-ties, so a wrong all-reduce shows as a
changed token or logprob and a one-ulp one does not."""


def build(out: str | Path, lm_head_scale: float = 1.0) -> Path:
    """Write the model folder to ``out`` (created); returns it. Takes ~10-30 s (imports).
    ``lm_head_scale`` multiplies the output layer (:data:`PEAKED_LM_HEAD_SCALE`: peaked logits)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    assert len(fast) <= VOCAB, len(fast)

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(out, safe_serialization=True)
    return out


DRAFT_VOCAB = 256
"""The EAGLE-3 drafter's reduced ("hot") vocabulary: its ``lm_head`` has this many rows and its
``d2t`` maps each to a target token, as real EAGLE-3 checkpoints do."""
EAGLE3_AUX_LAYER_IDS = [-1, 0]
"""``eagle_config.eagle_aux_hidden_state_layer_ids`` of the EAGLE-3 drafter. SGLang captures the
input of target layer ``id + 1`` (``models/llama.py::set_eagle3_layers_to_capture``) and, without
the key, defaults to layers ``[2, L // 2, L - 3]``, which a 2-layer target does not have (``L - 3 =
-1``). The 2-layer target can give two distinct captures (layers 0 and 1), so the drafter takes 2
aux hidden states (``num_aux_hidden_states``; real EAGLE-3 drafters take 3)."""


def _draft_layer(cfg, gen, prefix: str, qkv_in: int, input_norm: bool) -> dict:
    import torch

    h, inter = cfg.hidden_size, cfg.intermediate_size

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).contiguous()

    out = {
        f"{prefix}self_attn.q_proj.weight": w(h, qkv_in),
        f"{prefix}self_attn.k_proj.weight": w(h, qkv_in),
        f"{prefix}self_attn.v_proj.weight": w(h, qkv_in),
        f"{prefix}self_attn.o_proj.weight": w(h, h),
        f"{prefix}mlp.gate_proj.weight": w(inter, h),
        f"{prefix}mlp.up_proj.weight": w(inter, h),
        f"{prefix}mlp.down_proj.weight": w(h, inter),
        f"{prefix}post_attention_layernorm.weight": torch.ones(h),
    }
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = torch.ones(h)
    return out


def _drafter_config(target: Path, **extra):
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(target)
    cfg.num_hidden_layers = 1
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def build_eagle3_drafter(out: str | Path, target: str | Path) -> Path:
    """An EAGLE-3 drafter for the target at ``target`` (``LlamaForCausalLMEagle3``): ``fc`` over
    the :data:`EAGLE3_AUX_LAYER_IDS` captures, one layer whose q/k/v read ``[embeds, hidden]``
    (``2 * hidden`` wide; legacy names ``midlayer.*``), ``hidden_norm``, ``norm``, its own
    ``lm_head`` of :data:`DRAFT_VOCAB` rows and ``d2t`` (draft id → target id offsets). The
    embedding comes from the target at load time (``eagle_worker_v2.py::init_lm_head``)."""
    import torch
    from safetensors.torch import save_file

    out, target = Path(out), Path(target)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _drafter_config(
        target,
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=DRAFT_VOCAB,
        num_aux_hidden_states=len(EAGLE3_AUX_LAYER_IDS),
        target_hidden_size=None,
        eagle_config={"eagle_aux_hidden_state_layer_ids": EAGLE3_AUX_LAYER_IDS, "use_aux_hidden_state": True},
    )
    del cfg.target_hidden_size  # the target's width is the drafter's (SGLang's default when absent)
    gen = torch.Generator().manual_seed(SEED + 3)
    h = cfg.hidden_size
    hot = torch.randperm(cfg.vocab_size, generator=gen)[:DRAFT_VOCAB].sort().values
    tensors = {
        "fc.weight": (torch.randn(h, h * len(EAGLE3_AUX_LAYER_IDS), generator=gen) * 0.02).contiguous(),
        "norm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "lm_head.weight": (torch.randn(DRAFT_VOCAB, h, generator=gen) * 0.02).contiguous(),
        "d2t": (hot - torch.arange(DRAFT_VOCAB)).to(torch.int64),
        "t2d": torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, hot, True),
    }
    tensors.update(_draft_layer(cfg, gen, "midlayer.", 2 * h, input_norm=True))
    save_file(tensors, str(out / "model.safetensors"))
    cfg.save_pretrained(out)
    return out


def build_eagle_drafter(out: str | Path, target: str | Path) -> Path:
    """An EAGLE (1) drafter for the target at ``target`` (``LlamaForCausalLMEagle``): ``fc``
    (with bias) over ``[embeds, target hidden]``, one layer without ``input_layernorm`` (EAGLE's
    first layer has none), no final norm; embedding and ``lm_head`` are the target's, shared at load
    time (``eagle_worker_v2.py::init_lm_head``)."""
    import torch
    from safetensors.torch import save_file

    out, target = Path(out), Path(target)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _drafter_config(target, architectures=["LlamaForCausalLMEagle"])
    gen = torch.Generator().manual_seed(SEED + 1)
    h = cfg.hidden_size
    tensors = {"fc.weight": (torch.randn(h, 2 * h, generator=gen) * 0.02).contiguous(), "fc.bias": torch.zeros(h)}
    tensors.update(_draft_layer(cfg, gen, "layers.0.", h, input_norm=False))
    save_file(tensors, str(out / "model.safetensors"))
    cfg.save_pretrained(out)
    return out


def main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.sglang_server.tiny_model")
    ap.add_argument("out")
    ap.add_argument("--eagle3", help="also write an EAGLE-3 drafter here")
    ap.add_argument("--eagle", help="also write an EAGLE drafter here")
    ap.add_argument("--lm-head-scale", type=float, default=1.0, help="multiply lm_head (peaked logits)")
    args = ap.parse_args(argv)
    print(build(args.out, args.lm_head_scale))
    if args.eagle3:
        print(build_eagle3_drafter(args.eagle3, args.out))
    if args.eagle:
        print(build_eagle_drafter(args.eagle, args.out))


if __name__ == "__main__":
    main(sys.argv[1:])
