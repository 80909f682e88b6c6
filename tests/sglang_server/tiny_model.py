"""Test-only builder of a tiny random Llama and its own tokenizer (never imported by fastverify).

Why: the CPU test server needs a real Hugging Face model folder SGLang 0.5.23 can load
(``config.json``, ``model.safetensors``, a fast tokenizer), small enough that a TP 2 forward on two
CPU cores takes milliseconds, and made without a model hub (CI has no credentials and must not
download weights). A random Llama (hidden 64, 2 layers, 4 heads of 16, vocab 512) with a byte-level
BPE tokenizer trained here on a fixed, repetitive text (so NGRAM finds n-gram matches to draft)
does both; ``torch.manual_seed`` makes it the same every time.

Run in the SGLang venv (it has ``transformers`` / ``tokenizers``)::

    python -m tests.sglang_server.tiny_model OUT_DIR
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


def build(out: str | Path) -> Path:
    """Write the model folder to ``out`` (created); returns it. Takes ~10-30 s (imports)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    assert len(fast) <= VOCAB, len(fast)

    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1]))
