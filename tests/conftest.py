"""Shared fixtures: tiny random models of each supported family, and SmolLM2.

The tiny configs are small enough to run in milliseconds on a CPU but keep
what makes each family different: Llama with ``llama3`` RoPE scaling (its
rotary embedding must come from the model), Qwen2 with q/k/v biases and an
untied head, Qwen3 with q/k norms. Weights are drawn with a large init so the
logits are far apart and greedy decoding has no near-ties to flip.
"""

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

SHARED = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)
TINY = {
    "llama": lambda: LlamaConfig(
        **SHARED, tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": lambda: Qwen2Config(**SHARED, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**SHARED, tie_word_embeddings=True),
}


def tiny_model(family: str, dtype=torch.float32):
    config = TINY[family]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, real weights, offline (first use dequantizes and caches)."""
    from kvlib import load_model

    return load_model("smollm2-135m", device="cpu")


# --- exercise checks: the notebooks' `exercises` package, importable by the tests -------------
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
