"""KV bytes priced by design: MHA, GQA, multi-head latent attention, windowed layers and layers
that reuse an earlier layer's K/V, from the shipped configs; and plans that never hold more."""

import pytest
import torch
from transformers import AutoConfig

from kvlib.budget import Budget, meta_model, plan_budget
from kvlib.config import GIB, kv_bytes, kv_bytes_per_token, load_config

BF16 = torch.bfloat16
# bf16 bytes per token, past any window
PER_TOKEN = {
    "llama-2-7b": 2 * 32 * 32 * 128 * 2,  # MHA: K and V of every head
    "llama-3-8b": 2 * 32 * 8 * 128 * 2,  # GQA: 8 KV heads for 32 query heads
    "qwen3-4b": 2 * 36 * 8 * 128 * 2,
    "deepseek-v2-lite": 27 * (512 + 64) * 2,  # MLA: a latent and a shared RoPE key, no x2
    "gemma-3-4b": 5 * 2 * 4 * 256 * 2,  # 5 global layers of 34; 29 hold 1,024 tokens at most
}


def test_each_format_s_bytes_per_token_exact():
    got = {name: kv_bytes_per_token(load_config(name), BF16) for name in PER_TOKEN}
    assert got == PER_TOKEN
    assert got["deepseek-v2-lite"] == 31_104 and got["llama-2-7b"] == 524_288
    assert got["llama-3-8b"] == 131_072 and got["qwen3-4b"] == 147_456
    assert kv_bytes_per_token(load_config("deepseek-v2-lite"), BF16, batch=3) == 3 * 31_104


def test_a_windowed_layer_stops_growing_at_its_window():
    gemma = load_config("gemma-3-4b")
    assert (gemma.sliding_window, gemma.layer_types.count("full_attention")) == (1024, 5)
    every_layer = 34 * 2 * 4 * 256 * 2
    assert kv_bytes_per_token(gemma, BF16, context=1023) == every_layer == 139_264
    assert kv_bytes_per_token(gemma, BF16, context=1024) == 20_480  # the window is full
    assert kv_bytes(gemma, BF16, 1000) == 1000 * every_layer
    assert kv_bytes(gemma, BF16, 5000) == 5000 * 20_480 + 1024 * 29 * 2 * 4 * 256 * 2
    llama = load_config("llama-3-8b")  # no window: linear at any context
    assert kv_bytes(llama, BF16, 5000) == 5000 * kv_bytes_per_token(llama, BF16, context=7)


def test_layers_that_reuse_an_earlier_layer_s_kv_hold_none():
    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=12, num_key_value_heads=2,
                                  head_dim=64, sliding_window=16)
    config.num_kv_shared_layers = 4  # as Gemma 3n and Gemma 4 set it: the last 4 reuse
    own = config.layer_types[:8]
    assert kv_bytes_per_token(config, BF16) == own.count("full_attention") * 2 * 2 * 64 * 2
    assert kv_bytes_per_token(config, BF16, context=0) == 8 * 2 * 2 * 64 * 2


def plan(name):
    """12 GiB, the weights included where they fit, else the KV alone (weights 0)."""
    config = load_config(name)
    if config.model_type in ("llama", "qwen3"):
        b = plan_budget(config, BF16, 12 * GIB)
        if b.max_context:
            return config, b
    weights = sum(p.numel() for p in meta_model(config).parameters()) * 2
    weights = weights if weights < 12 * GIB else 0
    return config, Budget(weights, kv_bytes_per_token(config, BF16), 12 * GIB,
                          kv_at=lambda n: kv_bytes(config, BF16, n))


@pytest.mark.parametrize("name", list(PER_TOKEN))
def test_a_plan_on_12_gib_never_holds_more_kv_than_the_bytes_allow(name):
    config, b = plan(name)
    n = b.max_context
    assert b.weights + kv_bytes(config, BF16, n) + b.workspace <= 12 * GIB
    assert b.breakdown(n + 1)["free"] < 0
    if not b.weights:  # the KV alone: exactly what the bytes allow
        assert kv_bytes(config, BF16, n + 1) > 12 * GIB
    if name == "gemma-3-4b":  # past the window the 5 global layers set it: 6x every layer's
        assert n > 6 * (12 * GIB - b.weights) // (34 * 2 * 4 * 256 * 2)


def test_formats_the_budget_prices():
    config = load_config("qwen3-4b")
    bf16 = kv_bytes_per_token(config, BF16)
    assert kv_bytes_per_token(config, "bf16") == bf16 == 147456
    assert kv_bytes_per_token(config, "fp8") == bf16 // 2  # one scale per tensor: nothing per token
    assert kv_bytes_per_token(config, "int8") == 2 * 36 * 8 * (128 + 2)
    assert kv_bytes_per_token(config, "int4") == 2 * 36 * 8 * (64 + 4 * 2)
    lite = load_config("deepseek-v2-lite")  # a format prices the latent vector the same way
    assert kv_bytes_per_token(lite, "int8") == 27 * (512 + 64 + 2)
