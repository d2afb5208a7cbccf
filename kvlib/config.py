"""What a model's config says about its KV cache, and the byte units. The course's configs ship in
``kvlib/configs/``, so the arithmetic and the ``meta`` models built from it need no network.
"""

import json
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

__all__ = ["GIB", "MIB", "head_dim", "kv_bytes_per_token", "kv_heads", "kv_token_bytes",
           "load_config", "shipped_configs", "size"]

MIB = 1024 * 1024
GIB = 1024 * MIB
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def size(nbytes: int) -> str:
    """MiB from a MiB up, exact bytes below: a small cache in MiB would print as 0.0."""
    return f"{nbytes / MIB:,.1f} MiB" if nbytes >= MIB else f"{nbytes:,} B"


def shipped_configs() -> list[str]:
    """Names of the configs shipped in ``kvlib/configs`` (real models' ``config.json``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_config(name: str) -> PretrainedConfig:
    """A shipped config by name ("qwen3-4b", ...): no network, no weights."""
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no shipped config {name!r}; shipped: {', '.join(shipped_configs())}")
    return AutoConfig.for_model(**json.loads(path.read_text()))


def head_dim(config: PretrainedConfig) -> int:
    """``config.head_dim`` where the config sets it (Qwen3's 128 is not hidden/heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config: PretrainedConfig) -> int:
    """KV heads: fewer than query heads under grouped-query attention, equal without it."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def kv_token_bytes(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V for one more token, all layers: ``2 * L * Hkv * D * bytes per element``, the one
    formula every cache and plan uses. Only the KV heads count: query heads share them under GQA."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype, batch: int = 1) -> int:
    """:func:`kv_token_bytes` of a config, for ``batch`` sequences."""
    L, Hkv, D = config.num_hidden_layers, kv_heads(config), head_dim(config)
    return batch * kv_token_bytes(L, Hkv, D, dtype)
