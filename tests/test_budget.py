"""The budget arithmetic, checked against the real models and the real architecture."""

import dataclasses
import logging
import warnings

import pytest
import torch
from transformers import AutoConfig

from kvlib.budget import (
    Budget,
    WindowBudget,
    largest,
    meta_model,
    param_count,
    plan_budget,
    plan_kv,
    run_workspace,
    weight_bytes,
    workspace_bytes,
    workspace_phases,
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


def meta_param_count(config) -> int:
    """Parameters of the real model, built on ``meta``: ``parameters()`` yields a tied weight once,
    as ``param_count`` counts it."""
    return sum(p.numel() for p in meta_model(config).parameters())


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


def test_workspace_phases_price_what_each_phase_holds():
    c, n = load_config("qwen3-4b"), 512
    fused = workspace_phases(c, torch.bfloat16, n)
    # all forward: x and its norm, cos and sin, positions and packed ids, the last logits
    base = n * (2 * 2560 * 2 + 2 * 128 * 2 + 16) + 151936 * 2
    # the kernel takes the causal rule itself: no mask, nothing grows with the context
    assert "mask" not in fused and all(per_token == 0 for _, per_token in fused.values())
    assert fused["mlp"][0] == base + 3 * n * 9728 * 2  # gate, up, their product
    qkv = n * (32 + 2 * 8) * 128 * 2
    assert fused["attention"][0] == base + qkv + n * 32 * (128 * 2 + 4)  # + output, log-sum-exp
    assert fused["norm"][0] == base + qkv + n * 32 * (128 * 8 + 8)  # q_norm in fp32
    math = workspace_phases(c, torch.bfloat16, n, attention="math")
    held = n * 4 * 2  # per token of context: the mask [4n, S] bf16, all forward
    # building it: the visibility [n, S] bool, zeros, their masked copy, the repeat
    assert math["mask"] == (151936 * 2, n * (1 + (2 + 4) * 2))
    # + q folded (a copy), in fp32 and scaled, softmax's row test [Hq, n] and the scale (4 B);
    # per token: K and V upcast to fp32, scores and softmax in fp32 and their -inf test [Hq, n]
    assert math["attention"] == (base + qkv + n * 32 * 128 * (2 + 8) + 32 * n + 4,
                                 held + 2 * 8 * 128 * 4 + 32 * n * (4 + 4 + 1))
    # as the scores are made: K scaled too, the scores alone (a decode step's peak)
    assert math["scores"][1] == held + 3 * 8 * 128 * 4 + 32 * n * 4
    cat = workspace_phases(c, torch.bfloat16, n, cache="cat")
    assert cat["cat"] == (base + qkv - n * 8 * 128 * 2, 8 * 128 * 2)  # a layer's old V
    assert "cat" not in fused and "scores" not in fused
    f32 = workspace_phases(c, torch.float32, 1)  # no flash in fp32, and the memory-efficient
    assert f32["mask"][1] == 1 + (2 + 4) * 4  # kernel takes no grouped heads: masked again
    assert f32["logits"][0] - f32["mlp"][0] == 151936 * 4 - 3 * 9728 * 4  # fp32 logits: no copy


def test_a_batch_holds_every_request_s_tokens_but_one_request_s_attention():
    c, n = load_config("qwen3-4b"), 512
    one, two = (workspace_phases(c, torch.bfloat16, n, attention="math", batch=b) for b in (1, 2))
    assert two["mlp"] == (2 * one["mlp"][0], 2 * one["mlp"][1])  # tokens, logits, masks: each's
    # the scores are one request's at a time; the first request's output waits for the second
    assert two["attention"][1] - one["attention"][1] == n * 4 * 2
    assert workspace_bytes(c, torch.bfloat16, n, 2, context=100, attention="math") == max(
        fixed + per_token * 100 for fixed, per_token in two.values())


def test_workspace_bytes_is_the_largest_phase_at_the_context():
    c = load_config("qwen3-4b")
    phases = workspace_phases(c, torch.bfloat16, 512, attention="math")
    assert workspace_bytes(c, torch.bfloat16, 512, context=30_000, attention="math") == max(
        fixed + per_token * 30_000 for fixed, per_token in phases.values())


def test_a_cat_cache_holds_less_kv_during_prefill_and_copies_a_layer():
    c, kv = load_config("qwen3-4b"), 147456
    pre, cat = (run_workspace(c, torch.bfloat16, 30_000, cache=k, attention="math")
                for k in ("prealloc", "cat"))
    # at the mask's peak, the last full chunk (29,696 tokens), cat holds 304 fewer tokens of KV
    assert pre - cat == 304 * kv
    pre, cat = (run_workspace(c, torch.bfloat16, 30_000, cache=k) for k in ("prealloc", "cat"))
    # fused, prealloc's workspace is the MLP's alone; cat's copy of a layer's V grows past it
    assert pre == workspace_bytes(c, torch.bfloat16, 512) + 8 * 30_000
    assert cat > pre


def test_qwen3_4b_on_12_gib_holds_roughly_32k_tokens():
    c = load_config("qwen3-4b")
    b = plan_budget(c, torch.bfloat16, 12 * GIB)
    print(b)
    assert 30_000 < b.max_context < 34_000
    assert "max_context=" in repr(b) and "144 KiB/token" in repr(b)
    # no mask: the fused workspace is the MLP's chunk and the prompt's ids, whatever the context
    assert b.workspace == workspace_bytes(c, torch.bfloat16, 512) + 8 * b.max_context
    math = plan_budget(c, torch.bfloat16, 12 * GIB, attention="math")
    assert math.max_context < b.max_context // 1.5
    # issue 25's case: the math path at 1,024-token chunks, 10,757 tokens on the simulated card
    assert plan_budget(c, torch.bfloat16, 12 * GIB, prefill_chunk=1024,
                       attention="math").max_context <= 10_757


def test_max_context_is_exact_at_the_edges():
    b = plan_budget(load_config("qwen3-4b"), torch.bfloat16, 12 * GIB)
    parts = b.breakdown(b.max_context)
    assert sum(parts.values()) == b.budget and parts["workspace"] == b.workspace
    assert parts["free"] >= 0 > b.breakdown(b.max_context + 1)["free"]
    assert dataclasses.asdict(b) == {"weights": b.weights, "kv_per_token": 147456,
                                     "budget": 12 * GIB, "block": 1,
                                     "max_context": b.max_context, "workspace": b.workspace}
    assert Budget(weights=10, kv_per_token=1, budget=5).max_context == 0
    assert Budget(weights=10, kv_per_token=1, budget=15).max_context == 5


def test_plan_budget_rejects_nonsense_with_numbers():
    with pytest.raises(ValueError, match="budget_bytes=0"):
        plan_budget(load_config("smollm2-135m"), torch.float32, 0)
    with pytest.raises(ValueError, match="'flash'"):
        plan_budget(load_config("smollm2-135m"), torch.float32, GIB, attention="flash")
    with pytest.raises(ValueError, match="block=0"):
        plan_budget(load_config("smollm2-135m"), torch.float32, GIB, block=0)
    with pytest.raises(ValueError, match="tp=3 must divide the 32 query heads, and divide the 8"):
        plan_budget(load_config("qwen3-4b"), torch.bfloat16, GIB, tp=3)


def test_a_block_reserves_whole_blocks():
    c, kv = load_config("qwen3-4b"), 147456
    whole, paged = (plan_budget(c, torch.bfloat16, 12 * GIB, block=b) for b in (1, 256))
    assert paged.breakdown(257)["kv"] == 512 * kv == paged.breakdown(512)["kv"]
    assert paged.max_context == whole.max_context // 256 * 256  # the blocks that fit, whole
    assert whole.breakdown(257)["kv"] == 257 * kv


@pytest.mark.parametrize("tp, heads", [(1, 8), (2, 4), (8, 1), (16, 1)])
def test_tensor_parallel_splits_weights_and_kv_heads_down_to_one(tp, heads):
    c = load_config("qwen3-4b")
    one, split = (plan_budget(c, torch.bfloat16, 12 * GIB, tp=t) for t in (1, tp))
    assert split.kv_per_token == 36 * heads * 128 * 2 * 2  # L x heads per GPU x D x (K, V) x bf16
    rope = 4 * 128
    assert split.weights - rope == (one.weights - rope) // tp


def test_plan_kv_moves_only_the_kv_term():
    config = load_config("qwen3-4b")
    base = plan_budget(config, torch.bfloat16, 12 * GIB)
    assert plan_kv(config, torch.bfloat16, 12 * GIB) == base
    plans = {kv: plan_kv(config, torch.bfloat16, 12 * GIB, kv) for kv in ("bf16", "fp8", "int8",
                                                                          "int4")}
    # the weights and the workspace are the base plan's; the KV is not
    for kv, plan in plans.items():
        assert (plan.weights, plan.budget) == (base.weights, base.budget)
        assert plan.kv_per_token == kv_bytes_per_token(config, kv)
        c = plan.max_context
        assert plan.breakdown(c)["free"] >= 0 > plan.breakdown(c + 1)["free"], kv
        assert plan.breakdown(c)["workspace"] == base.breakdown(c)["workspace"]
    contexts = {kv: plan.max_context for kv, plan in plans.items()}
    assert contexts["bf16"] < contexts["int8"] < contexts["fp8"] < contexts["int4"]
    two = plan_kv(config, torch.bfloat16, 12 * GIB, "int8", batch=2)
    assert two.kv_per_token == 2 * kv_bytes_per_token(config, "int8")


def test_a_window_caps_the_kv_and_hands_the_limit_to_the_model():
    config = load_config("qwen3-4b")
    plan = plan_kv(config, torch.bfloat16, 12 * GIB, "bf16", window=4096)
    assert isinstance(plan, WindowBudget)
    assert plan.max_context == config.max_position_embeddings == 40960
    assert plan.breakdown(10**6)["kv"] == plan.breakdown(4096)["kv"] == 4096 * 147456
    assert plan.breakdown(100)["kv"] == 100 * 147456
    too_big = plan_kv(config, torch.bfloat16, 12 * GIB, "bf16", window=10**6)
    assert too_big.max_context == 0
    assert "max_context=40,960" in repr(plan)


def test_largest_bisects_from_the_plan():
    for limit in (0, 1, 7, 500, 999):
        for first in (None, 0, 3, 600, 999, 5000):
            calls = []
            fits = lambda n: calls.append(n) or n <= limit  # noqa: B023, E731
            assert largest(fits, 1000, first) == limit
            assert len(calls) <= 12  # log2(1000) + the plan
            if first is not None and 0 < first < 1000:
                assert calls[0] == first
    assert largest(lambda n: True, 1) == 0  # nothing to try
