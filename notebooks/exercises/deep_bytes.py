"""Exercise of the deep dive "fewer bytes by design": a check and its reference solution.

The check prices shipped configs with exact integers, so it prints the same on every machine.
"""

from __future__ import annotations

import torch

from kvlib import config as kv_config
from kvlib.config import load_config

from .checking import attempt, check, expect, hint

# What the exercise builds, hidden from the learner's function while the check calls it.
PRICED = ((kv_config, "kv_bytes_per_token"), (kv_config, "kv_bytes"),
          (kv_config, "kv_token_bytes"))
FORMATS = ("llama-2-7b", "llama-3-8b", "qwen3-4b", "gemma-3-4b", "deepseek-v2-lite")


def bytes_per_token_solution(config, dtype: torch.dtype, context: int) -> int:
    """What one more token adds to a sequence of ``context`` tokens: K and V per KV head in every
    layer that holds its own (a ``sliding_attention`` layer holds nothing more once its window is
    full); MLA: one latent and one shared RoPE key per layer, for K and V at once."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or 0
    layers = sum(k == "full_attention" or context < window for k in kinds)
    if rank := getattr(config, "kv_lora_rank", None):
        return layers * (rank + config.qk_rope_head_dim) * dtype.itemsize
    D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * layers * config.num_key_value_heads * D * dtype.itemsize


@check
def check_bytes_per_token(fn) -> None:
    """``fn(config, dtype, context)`` on the five shipped formats, in bf16 and fp32, inside and past
    Gemma 3's window."""
    for name in FORMATS:
        config = load_config(name)
        for dtype in (torch.bfloat16, torch.float32):
            for context in (100, 1_023, 1_024, 32_768):
                got = attempt(fn, config, dtype, context, hide=PRICED)
                want = bytes_per_token_solution(config, dtype, context)
                layers, s = config.num_hidden_layers, dtype.itemsize
                known = {}
                if rank := getattr(config, "kv_lora_rank", None):
                    known[2 * want] = ("MLA caches one latent that `kv_b_proj` expands into both "
                                       "K and V: no factor 2.")
                    known[layers * rank * s] = "The shared RoPE key is cached too."
                    known[2 * layers * config.num_attention_heads * (
                        config.qk_nope_head_dim + config.qk_rope_head_dim) * s] = (
                        "That is the K and V the latent stands for, not what is cached.")
                else:
                    D = config.hidden_size // config.num_attention_heads
                    heads = config.num_attention_heads
                    known[2 * layers * heads * getattr(config, "head_dim", D) * s] = (
                        "Only the KV heads are cached: `num_key_value_heads`.")
                    known[2 * layers * config.num_key_value_heads * getattr(
                        config, "head_dim", D) * s] = (
                        "A sliding-window layer adds nothing once its window is full: count only "
                        "the layers still growing at this context.")
                expect(got == want, f"{name}, {dtype}, at {context:,} tokens: you said {got}, "
                                    f"one more token adds {want:,} B.",
                       hint(got, {k: v for k, v in known.items() if k != want}))
