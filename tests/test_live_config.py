"""Model config reader and TP checks (fastverify.live.config); no torch needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastverify.errors import UserError
from fastverify.live.config import check_tp, load_model_config, preset_names

PRESET_DIR = Path(__file__).resolve().parents[1] / "fastverify" / "live" / "presets"

# Values checked against the published configs (sources are in each preset's "_source"):
# moonshotai/Kimi-K2-Instruct config.json and MoonshotAI/Kimi-K2 README "Model Summary";
# deepseek-ai/DeepSeek-V3 config.json / inference/configs/config_671B.json.
KIMI_K2 = dict(
    hidden_size=7168,
    num_layers=61,
    first_k_dense_replace=1,
    n_routed_experts=384,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    intermediate_size=18432,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_attention_heads=64,
    vocab_size=163840,
    rms_norm_eps=1e-6,
)
DEEPSEEK_V3 = dict(
    KIMI_K2,
    first_k_dense_replace=3,
    n_routed_experts=256,
    num_attention_heads=128,
    vocab_size=129280,
)
TINY = dict(
    hidden_size=256,
    num_layers=4,
    first_k_dense_replace=1,
    n_routed_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    n_shared_experts=1,
    intermediate_size=512,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_attention_heads=4,
    vocab_size=1024,
    rms_norm_eps=1e-6,
)

# A config.json as the checkpoint ships it (HF key names), for writing test files.
KIMI_K2_HF = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "intermediate_size": 18432,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "vocab_size": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 50000.0,
    "topk_method": "noaux_tc",
}


def write(tmp_path: Path, doc, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def user_error(fn, *args) -> str:
    with pytest.raises(UserError) as info:
        fn(*args)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_preset_names():
    assert preset_names() == ["deepseek-v3", "kimi-k2", "kimi-k2.5", "tiny"]


@pytest.mark.parametrize(
    "name,expected,moe_layers",
    [
        ("kimi-k2", KIMI_K2, 60),
        ("kimi-k2.5", dict(KIMI_K2, rms_norm_eps=1e-5), 60),  # the same text model, nested under text_config
        ("deepseek-v3", DEEPSEEK_V3, 58),
        ("tiny", TINY, 3),
    ],
)
def test_presets(name, expected, moe_layers):
    cfg = load_model_config(name)
    assert cfg.name == name and cfg.family == "deepseek_v3" and cfg.is_mla
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.num_key_value_heads == cfg.num_attention_heads
    assert cfg.head_dim == expected["qk_nope_head_dim"] + expected["qk_rope_head_dim"]
    assert cfg.num_moe_layers == moe_layers
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == [
        i >= expected["first_k_dense_replace"] for i in range(expected["num_layers"])
    ]
    # Every preset says where its numbers come from.
    doc = json.loads((PRESET_DIR / f"{name}.json").read_text())
    assert isinstance(doc["_source"], str) and len(doc["_source"]) > 40


def test_experts_allocated():
    kimi = load_model_config("kimi-k2")
    assert kimi.experts_allocated(4) == 32  # 4 tokens × top-8
    assert kimi.experts_allocated(32 * 4) == 384  # capped at n_routed_experts


def test_kimi_vocab_padding_is_a_no_op():
    assert load_model_config("kimi-k2").vocab_padded == 163840
    assert load_model_config("deepseek-v3").vocab_padded == 129280  # 2020 × 64


def test_file_and_directory(tmp_path):
    ckpt = tmp_path / "Kimi-K2-Instruct"
    ckpt.mkdir()
    write(ckpt, KIMI_K2_HF)
    for arg in (str(ckpt), str(ckpt / "config.json")):
        cfg = load_model_config(arg)
        assert cfg.name == "Kimi-K2-Instruct"
        assert cfg.source == str(ckpt / "config.json")
        assert {k: getattr(cfg, k) for k in KIMI_K2} == KIMI_K2


def test_directory_without_config(tmp_path):
    assert user_error(load_model_config, str(tmp_path)) == f"{tmp_path}: no config.json in this directory"


def test_q_lora_rank_null(tmp_path):
    cfg = load_model_config(str(write(tmp_path, dict(KIMI_K2_HF, q_lora_rank=None))))
    assert cfg.q_lora_rank is None


def test_llama_style(tmp_path):
    # Llama-3-8B shapes.
    doc = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-05,
    }
    cfg = load_model_config(str(write(tmp_path, doc, "llama3-8b.json")))
    assert cfg.name == "llama3-8b"
    assert cfg.family == "llama" and not cfg.is_mla
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (4096, 32, 14336)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert cfg.vocab_size == 128256 and cfg.rms_norm_eps == 1e-5
    assert cfg.num_moe_layers == 0 and cfg.experts_allocated(64) == 0
    check_tp(cfg, 8)
    check_tp(cfg, 16)  # 8 KV heads, each on two ranks
    msg = user_error(check_tp, cfg, 3)
    assert "--tp 3" in msg and "num_attention_heads = 32" in msg


def test_llama_head_dim_field(tmp_path):
    doc = {
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "intermediate_size": 17408,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 151936,
        "head_dim": 128,
    }
    assert load_model_config(str(write(tmp_path, doc))).head_dim == 128


def test_kimi_k25_text_config(tmp_path):
    doc = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "vision_config": {"hidden_size": 1152},
        "text_config": KIMI_K2_HF,
    }
    cfg = load_model_config(str(write(tmp_path, doc)))
    assert {k: getattr(cfg, k) for k in KIMI_K2} == KIMI_K2
    text = {k: v for k, v in KIMI_K2_HF.items() if k != "kv_lora_rank"}
    msg = user_error(load_model_config, str(write(tmp_path, dict(doc, text_config=text))))
    assert "config.json" in msg and "'text_config.kv_lora_rank' is missing" in msg


def test_kimi_k25_preset_is_the_wrapped_text_model():
    doc = json.loads((PRESET_DIR / "kimi-k2.5.json").read_text())
    assert doc["architectures"] == ["KimiK25ForConditionalGeneration"] and "hidden_size" not in doc
    assert doc["text_config"]["hidden_size"] == 7168 and doc["text_config"]["n_routed_experts"] == 384
    assert load_model_config("kimi-k2.5").rms_norm_eps == 1e-5


def test_unknown_preset_lists_known():
    msg = user_error(load_model_config, "kimi-k3")
    assert "'kimi-k3'" in msg and "deepseek-v3, kimi-k2, kimi-k2.5, tiny" in msg


def test_bad_json(tmp_path):
    path = write(tmp_path, '{"hidden_size": 7168,,}')
    msg = user_error(load_model_config, str(path))
    assert str(path) in msg and "not valid JSON" in msg and "line 1" in msg


def test_not_an_object(tmp_path):
    msg = user_error(load_model_config, str(write(tmp_path, "[1, 2]")))
    assert "JSON object" in msg


def test_unreadable(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00bad")
    msg = user_error(load_model_config, str(path))
    assert str(path) in msg and "cannot read" in msg


@pytest.mark.parametrize(
    "field",
    ["hidden_size", "num_hidden_layers", "n_routed_experts", "q_lora_rank", "v_head_dim", "vocab_size", "rms_norm_eps"],
)
def test_missing_field(tmp_path, field):
    doc = {k: v for k, v in KIMI_K2_HF.items() if k != field}
    path = write(tmp_path, doc)
    msg = user_error(load_model_config, str(path))
    assert msg == f"{path}: field '{field}' is missing"


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("hidden_size", "7168", "must be an integer, got string '7168'"),
        ("hidden_size", 7168.0, "must be an integer, got number 7168.0"),
        ("num_experts_per_tok", True, "must be an integer, got boolean True"),
        ("kv_lora_rank", None, "must be an integer, got null"),
        ("rms_norm_eps", "1e-6", "must be a number, got string"),
        ("rms_norm_eps", 0, "must be > 0"),
        ("num_attention_heads", 0, "must be >= 1"),
        ("first_k_dense_replace", -1, "must be >= 0"),
        ("q_lora_rank", [1536], "must be an integer, got array"),
    ],
)
def test_wrong_type_or_range(tmp_path, field, value, words):
    path = write(tmp_path, dict(KIMI_K2_HF, **{field: value}))
    msg = user_error(load_model_config, str(path))
    assert msg.startswith(f"{path}: field '{field}' ") and words in msg


def test_inconsistent_fields(tmp_path):
    msg = user_error(load_model_config, str(write(tmp_path, dict(KIMI_K2_HF, num_experts_per_tok=400))))
    assert "'num_experts_per_tok' = 400 exceeds 'n_routed_experts' = 384" in msg
    llama = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 3,
        "vocab_size": 100,
    }
    msg = user_error(load_model_config, str(write(tmp_path, llama)))
    assert "'num_key_value_heads' = 3" in msg


def test_text_config_not_an_object(tmp_path):
    msg = user_error(load_model_config, str(write(tmp_path, {"text_config": [1]})))
    assert "'text_config' must be an object" in msg


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_ok(tp):
    check_tp(load_model_config("kimi-k2"), tp)
    check_tp(load_model_config("deepseek-v3"), tp)


@pytest.mark.parametrize(
    "tp,words",
    [
        (3, "--tp 3 does not divide num_attention_heads = 64 of model 'kimi-k2'"),
        (128, "--tp 128 does not divide num_attention_heads = 64"),
        (0, "--tp must be a positive integer, got 0"),
    ],
)
def test_tp_rejected(tp, words):
    assert words in user_error(check_tp, load_model_config("kimi-k2"), tp)


def test_tp_rejects_expert_width(tmp_path):
    cfg = load_model_config(str(write(tmp_path, dict(KIMI_K2_HF, moe_intermediate_size=2052))))
    msg = user_error(check_tp, cfg, 8)
    assert "moe_intermediate_size = 2052" in msg


def test_tp_rejects_dense_width_and_vocab(tmp_path):
    cfg = load_model_config(str(write(tmp_path, dict(KIMI_K2_HF, intermediate_size=18436))))
    assert "intermediate_size = 18436" in user_error(check_tp, cfg, 8)
    # Everything else splits over 3 ranks; 600 pads to 640, which does not.
    cfg = load_model_config(
        str(write(tmp_path, dict(KIMI_K2_HF, vocab_size=600, num_attention_heads=48, moe_intermediate_size=2049)))
    )
    assert "vocab_size padded to a multiple of 64 = 640" in user_error(check_tp, cfg, 3)
