"""The budget arithmetic, checked against the real models and the real architecture."""

import dataclasses
import logging
import warnings

import pytest
import torch
from transformers import AutoConfig

from kvlib.budget import (
    Budget,
    meta_param_count,
    param_count,
    plan_budget,
    weight_bytes,
    workspace_bytes,
)
from kvlib.config import kv_bytes_per_token, load_config, shipped_configs

GIB = 1024**3
NAMES = ["llama-3.2-3b", "qwen2.5-3b", "qwen3-4b", "smollm2-135m"]

# layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, rope_theta, max_pos, eps
REAL = {
    "qwen3-4b": (36, 2560, 32, 8, 128, 9728, 151936, 1e6, 40960, 1e-6),
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152, 1e5, 8192, 1e-5),
    "llama-3.2-3b": (28, 3072, 24, 8, 128, 8192, 128256, 5e5, 131072, 1e-5),
    "qwen2.5-3b": (36, 2048, 16, 2, None, 11008, 151936, 1e6, 32768, 1e-6),
}
# Published parameter counts of the real checkpoints (tied embeddings counted once).
PUBLISHED = {
    "qwen3-4b": 4_022_468_096,
    "smollm2-135m": 134_515_008,
    "llama-3.2-3b": 3_212_749_824,
    "qwen2.5-3b": 3_085_938_688,
}


def test_shipped_configs_are_the_real_models():
    assert shipped_configs() == NAMES
    for name, row in REAL.items():
        c = load_config(name)
        got = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
               getattr(c, "head_dim", None), c.intermediate_size, c.vocab_size,
               c.rope_parameters["rope_theta"], c.max_position_embeddings, c.rms_norm_eps)
        assert got == row, name
        assert c.tie_word_embeddings
    assert load_config("llama-3.2-3b").rope_parameters["rope_type"] == "llama3"
    assert load_config("qwen2.5-3b").use_sliding_window is False


def test_configs_load_without_warnings():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for name in NAMES:
                load_config(name)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []


def test_unknown_config_names_the_shipped_ones():
    with pytest.raises(ValueError, match="qwen3-4b"):
        load_config("gpt-5")


def test_kv_bytes_per_token_exact():
    assert kv_bytes_per_token(load_config("qwen3-4b"), torch.bfloat16) == 147456  # 144 KiB
    smol = load_config("smollm2-135m")
    assert kv_bytes_per_token(smol, torch.float32) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(smol, torch.float32, batch=4) == 4 * 46080
    # Qwen2.5 has no head_dim in its config: hidden / heads = 128
    assert kv_bytes_per_token(load_config("qwen2.5-3b"), torch.float16) == 2 * 36 * 2 * 128 * 2


@pytest.mark.parametrize("name", NAMES)
def test_param_arithmetic_matches_meta_model_and_published_count(name):
    config = load_config(name)
    assert param_count(config) == meta_param_count(config) == PUBLISHED[name]
    assert weight_bytes(config, torch.bfloat16) == 2 * PUBLISHED[name]


@pytest.mark.parametrize(
    "model_type, extra",
    [
        ("llama", dict(attention_bias=True, mlp_bias=True)),
        ("qwen2", {}),
        ("qwen3", dict(attention_bias=True)),
    ],
)
def test_param_arithmetic_covers_biases_and_untied_heads(model_type, extra):
    config = AutoConfig.for_model(
        model_type, vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=12, tie_word_embeddings=False,
        **extra,
    )
    assert param_count(config) == meta_param_count(config)


def test_param_count_refuses_unknown_family():
    with pytest.raises(ValueError, match="gpt2"):
        param_count(AutoConfig.for_model("gpt2"))


def test_workspace_terms():
    c = load_config("qwen3-4b")
    # decode: the logits of one position (bf16 + fp32 copy) outweigh one token's MLP
    assert workspace_bytes(c, torch.bfloat16) == 151936 * (2 + 4)
    # a 512-token prefill chunk: gate, up, act(gate)*up
    assert workspace_bytes(c, torch.bfloat16, tokens=512) == 3 * 512 * 9728 * 2
    # the math path materialises scores: heads * tokens * context
    assert workspace_bytes(c, torch.bfloat16, tokens=512, context=8192) == 32 * 512 * 8192 * 2
    assert workspace_bytes(c, torch.float32) == 151936 * 4  # already fp32: no copy


def test_qwen3_4b_on_12_gib_holds_roughly_30k_tokens():
    b = plan_budget(load_config("qwen3-4b"), torch.bfloat16, 12 * GIB)
    print(b)
    assert b.max_context == (12 * GIB - b.weights - b.workspace) // 147456
    assert 20_000 < b.max_context < 40_000
    assert "max_context=" in repr(b) and "144 KiB/token" in repr(b)


def test_max_context_is_exact_at_the_edges():
    b = plan_budget(load_config("qwen3-4b"), torch.bfloat16, 12 * GIB)
    one_less = dataclasses.replace(b, budget=b.budget - b.kv_per_token)
    assert one_less.max_context == b.max_context - 1
    parts = b.breakdown(b.max_context)
    assert sum(parts.values()) == b.budget
    assert 0 <= parts["free"] < b.kv_per_token
    assert b.breakdown(b.max_context + 1)["free"] < 0
    assert Budget(weights=10, kv_per_token=1, workspace=1, budget=5).max_context == 0


def test_plan_budget_rejects_nonsense_with_numbers():
    with pytest.raises(ValueError, match="budget_bytes=0"):
        plan_budget(load_config("smollm2-135m"), torch.float32, 0)
