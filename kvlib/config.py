"""What a model's config says about its KV cache, and the byte units. The course's configs ship in
``kvlib/configs/``, so the arithmetic and the ``meta`` models built from it need no network."""

import json
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

__all__ = ["GIB", "MIB", "head_dim", "kv_bytes", "kv_bytes_per_token", "kv_heads", "kv_token_bytes",
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


def kv_token_bytes(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V for one more token, all layers: ``2 * L * Hkv * D * bytes per element``, the one
    formula every cache and plan uses. Only the KV heads count: query heads share them under GQA."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype, batch: int = 1,
                       context: int | None = None) -> int:
    """What one more token adds, for ``batch`` sequences, to a cache of ``context`` (None: past
    every window), priced by design: layers that reuse an earlier layer's K/V (the last
    ``num_kv_shared_layers``, transformers' ``KVSharingDict``) add nothing, nor does a
    ``sliding_attention`` layer (Gemma 3, gpt-oss) past ``sliding_window``; multi-head latent
    attention (DeepSeek-V2/V3) caches one latent of ``kv_lora_rank`` and one RoPE key shared by the
    heads, no K and V per head; the others, :func:`kv_token_bytes`."""
    L = config.num_hidden_layers
    owned = (getattr(config, "layer_types", None) or ["full_attention"] * L)[
        :L - (getattr(config, "num_kv_shared_layers", 0) or 0)]
    grows = context is not None and context < (getattr(config, "sliding_window", None) or 0)
    n = sum(t != "sliding_attention" or grows for t in owned)
    if rank := getattr(config, "kv_lora_rank", None):
        return batch * n * (rank + config.qk_rope_head_dim) * dtype.itemsize
    return batch * kv_token_bytes(n, kv_heads(config), head_dim(config), dtype)


def kv_bytes(config: PretrainedConfig, dtype: torch.dtype, context: int, batch: int = 1) -> int:
    """KV of ``context`` tokens: the windowed layers hold ``sliding_window`` of them at most."""
    past, held = (kv_bytes_per_token(config, dtype, batch, c) for c in (None, 0))
    return past * context + (held - past) * min(context, getattr(config, "sliding_window", 0) or 0)
