"""What a model's config says about its KV cache, and the byte units. The course's configs ship in
``kvlib/configs/``, so the arithmetic and the ``meta`` models built from it need no network."""

import json
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

__all__ = ["FORMATS", "GIB", "MIB", "head_dim", "kv_bytes", "kv_bytes_per_token", "kv_heads",
           "kv_token_bytes", "load_config", "shipped_configs", "size", "vector_bytes"]

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
    """A shipped config by name ("qwen3-4b", ...), or one of ``configs/formats/``, which only
    price KV formats (MLA, windows): no network, no weights."""
    if (path := next(CONFIG_DIR.glob(f"**/{name}.json"), None)) is None:
        raise ValueError(f"no shipped config {name!r}; shipped: {', '.join(shipped_configs())}")
    return AutoConfig.for_model(**json.loads(path.read_text()))


def head_dim(config: PretrainedConfig) -> int:
    """``config.head_dim`` where the config sets it (Qwen3's 128 is not hidden/heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads(config: PretrainedConfig) -> int:
    """KV heads: fewer than query heads under grouped-query attention, equal without it."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


# Bytes of a cached vector of D channels in each format a plan prices, with 2-byte scales (a bf16
# card's): int8 and int4 keep one scale a vector (int4: one per 32 channels); fp8, as serving
# engines store it, has one scale per tensor: nothing per token.
FORMATS = {"bf16": lambda D: 2 * D, "fp8": lambda D: D, "int8": lambda D: D + 2,
           "int4": lambda D: D // 2 + D // min(32, D) * 2}


def vector_bytes(channels: int, dtype: torch.dtype | str) -> int:
    """One cached vector (a key, a value, a latent) of ``channels`` in ``dtype``, or in a format of
    :data:`FORMATS` (its codes and scales): the price every byte count below is built from."""
    return FORMATS[dtype](channels) if isinstance(dtype, str) else channels * dtype.itemsize


def kv_token_bytes(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype | str) -> int:
    """K and V for one more token, all layers: ``2 * L * Hkv * D * bytes per element``, the one
    formula every cache and plan uses. Only the KV heads count: query heads share them under GQA."""
    return 2 * n_layers * n_kv_heads * vector_bytes(head_dim, dtype)


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype | str, batch: int = 1,
                       context: int | None = None) -> int:
    """What one more token adds, for ``batch`` sequences, to a cache of ``context`` (None: past
    every window), stored in ``dtype`` or a format of :data:`FORMATS`, priced by design: layers
    that reuse an earlier layer's K/V (the last ``num_kv_shared_layers``, transformers'
    ``KVSharingDict``) add nothing, nor does a ``sliding_attention`` layer (Gemma 3, gpt-oss) past
    ``sliding_window``; multi-head latent attention (DeepSeek-V2/V3) caches one latent of
    ``kv_lora_rank`` and one RoPE key shared by the heads, no K and V per head; the others,
    :func:`kv_token_bytes`."""
    L = config.num_hidden_layers
    owned = (getattr(config, "layer_types", None) or ["full_attention"] * L)[
        :L - (getattr(config, "num_kv_shared_layers", 0) or 0)]
    grows = context is not None and context < (getattr(config, "sliding_window", None) or 0)
    n = sum(t != "sliding_attention" or grows for t in owned)
    if rank := getattr(config, "kv_lora_rank", None):
        return batch * n * vector_bytes(rank + config.qk_rope_head_dim, dtype)
    return batch * kv_token_bytes(n, kv_heads(config), head_dim(config), dtype)


def kv_bytes(config: PretrainedConfig, dtype: torch.dtype | str, context: int,
             batch: int = 1) -> int:
    """KV of ``context`` tokens: the windowed layers hold ``sliding_window`` of them at most."""
    past, held = (kv_bytes_per_token(config, dtype, batch, c) for c in (None, 0))
    return past * context + (held - past) * min(context, getattr(config, "sliding_window", 0) or 0)
