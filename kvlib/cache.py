"""The contract every cache keeps, written once: a new cache is one module that satisfies it and
plugs into the loop, the meter and the static step without a branch. A step writes ``[n, Hkv, D]``
per layer at ``start``, reads ``[1, Hkv, S, D]``; the loop advances ``seq_len`` after every layer.
Rollback is part of the contract where a cache offers ``crop(seq_len)``: afterwards it reads exactly
as if only its first ``seq_len`` tokens had ever been written (speculative decoding relies on it).
"""

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from .config import kv_token_bytes

__all__ = ["Cache", "bytes_per_token", "check_crop", "check_kv", "check_view"]


@runtime_checkable
class Cache(Protocol):
    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_seq: int | None  # None: grows until memory runs out
    seq_len: int  # valid slots; slots past it are never read

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def nbytes(self) -> int: ...

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def reset(self) -> None: ...


def bytes_per_token(cache: Cache) -> int:
    """KV cost of one more token in ``cache``, all layers, K and V."""
    return kv_token_bytes(cache.n_layers, cache.n_kv_heads, cache.head_dim, cache.dtype)


def check_kv(cache: Cache, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> int:
    """Refuse a write that would be wrong, before anything is written; return its end slot. Shared
    by every cache, so they all refuse the same things with the same words."""
    if not 0 <= layer < cache.n_layers:
        raise IndexError(f"layer {layer} out of range for n_layers={cache.n_layers}")
    if start < 0:
        raise IndexError(f"negative start {start}")
    want = (cache.n_kv_heads, cache.head_dim)
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [n, {want[0]}, "
                             f"{want[1]}] (n new tokens, n_kv_heads, head_dim)")
        if t.dtype != cache.dtype or t.device != cache.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, "
                             f"cache is {cache.dtype} on {cache.device}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree")
    end = start + k.shape[0]
    if cache.max_seq is not None and end > cache.max_seq:
        raise ValueError(f"KV overflow: writing slots {start}..{end} into max_seq={cache.max_seq}")
    return end


def check_view(cache: Cache, layer: int, seq: int, held: Callable[[], int], where: str) -> None:
    """Refuse a view of a layer the cache lacks, or of more than the ``held()`` slots of ``where``
    (a format string for that number)."""
    if not 0 <= layer < cache.n_layers:
        raise IndexError(f"layer {layer} out of range for n_layers={cache.n_layers}")
    if not 0 <= seq <= held():
        raise ValueError(f"view of {seq} slots from {where.format(held())}")


def check_crop(cache: Cache, seq_len: int) -> None:
    """Refuse a crop to more slots than the cache holds, or fewer than none, before any change."""
    if not 0 <= seq_len <= cache.seq_len:
        raise ValueError(f"crop to {seq_len} slots: the cache holds {cache.seq_len}")
