"""The memory-bandwidth limit of decoding: a step reads every weight and cached K/V once, so it
cannot take less than ``decode_bytes / bandwidth``, whatever the kernels do."""

import torch
from transformers import PretrainedConfig

from .budget import param_count
from .config import MIB, kv_bytes
from .timing import time_fn

__all__ = ["decode_bytes", "floor_s_per_token", "mbu", "measure_bandwidth", "step_bytes"]


def decode_bytes(config: PretrainedConfig, dtype: torch.dtype, context: int, batch: int = 1) -> int:
    """Bytes one decode step must move: all weights once (an untied embedding only for its
    ``batch`` rows), plus the K/V of ``context`` tokens. A floor: activations are left out."""
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    weights = (param_count(config) - embedding + batch * config.hidden_size) * dtype.itemsize
    return weights + kv_bytes(config, dtype, context, batch)


def step_bytes(config: PretrainedConfig, dtype: torch.dtype, context: int,
               cache: str = "prealloc", batch: int = 1) -> int:
    """Bytes a decode step at ``context`` moves: :func:`decode_bytes`, and for a ``"cat"`` cache
    ``2 * KV`` more, as it reads its whole cache and writes it again into a longer tensor."""
    if cache not in ("prealloc", "cat"):
        raise ValueError(f"cache must be 'prealloc' or 'cat', not {cache!r}")
    copy_bytes = 2 * kv_bytes(config, dtype, context, batch) if cache == "cat" else 0
    return decode_bytes(config, dtype, context, batch) + copy_bytes


def measure_bandwidth(device: torch.device | str) -> float:
    """Achievable bandwidth in bytes/s: a copy far larger than on-chip caches, timed. A stream of
    reads like a decode step, a little under the datasheet number: the fair yardstick. The fastest
    of 9 copies: other work on the machine only ever slows a copy, so a median can catch a busy
    spell (a copy at half speed) where the fastest is the machine's own speed."""
    device = torch.device(device)
    nbytes = (256 if device.type == "cuda" else 64) * MIB
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device=device, warmup=2, repeats=9)
    return 2 * nbytes / min(timing.samples_s)


def floor_s_per_token(bytes_per_step: int, bandwidth: float) -> float:
    """Seconds a step takes if it moves ``bytes_per_step`` at ``bandwidth`` bytes/s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth} bytes/s")
    return bytes_per_step / bandwidth


def mbu(s_per_token: float, bytes_per_step: int, bandwidth: float) -> float:
    """Fraction of the bandwidth limit reached: floor time over measured time."""
    if s_per_token <= 0:
        raise ValueError(f"measured time must be positive, got {s_per_token} s/token")
    return floor_s_per_token(bytes_per_step, bandwidth) / s_per_token
