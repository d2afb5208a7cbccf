"""The memory-bandwidth limit of decoding.

A decode step does little arithmetic per byte: every weight is read once to produce one token, and every
cached K/V of the context is read once by attention. So a step cannot take less than ``decode_bytes /
bandwidth`` seconds, whatever the kernels do. Measured time over that floor is the memory bandwidth
utilisation (MBU) of the token loop.
"""

import torch
from transformers import PretrainedConfig

from kvlib.config import MIB, kv_bytes_per_token
from kvlib.budget import param_count
from kvlib.timing import time_fn

__all__ = ["decode_bytes", "floor_s_per_token", "mbu", "measure_bandwidth"]


def decode_bytes(config: PretrainedConfig, dtype: torch.dtype, context: int, batch: int = 1) -> int:
    """Bytes one decode step must move: all weights once, plus the K/V of ``context`` tokens.

    The embedding lookup reads one row per sequence, not the table: a tied table is read whole once, as
    the output head; an untied one only for its ``batch`` rows. Activations and the new token's K/V
    write are left out: small, and this is a floor.
    """
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    weights = (param_count(config) - embedding + batch * config.hidden_size) * dtype.itemsize
    return weights + kv_bytes_per_token(config, dtype, batch) * context


def measure_bandwidth(device: torch.device | str, nbytes: int | None = None, repeats: int = 5) -> float:
    """Achievable bandwidth in bytes/s: a large device-to-device copy, timed.

    A copy reads ``nbytes`` and writes ``nbytes``, so it moves ``2 * nbytes``. The buffers (256 MiB on
    CUDA, 64 MiB on CPU by default) are far larger than the processor's on-chip caches, so this is
    memory bandwidth. It is what a copy achieves, a little under the datasheet number, and the fair
    yardstick for a decode step, which is also a stream of reads.
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = (256 if device.type == "cuda" else 64) * MIB
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device=device, warmup=2, repeats=repeats)
    return 2 * nbytes / timing.median_s


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
