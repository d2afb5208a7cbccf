"""The naive baseline, what ``transformers``' ``DynamicCache`` does: per layer ``[1, Hkv, S, D]``
tensors, and each new token makes new ones of ``S + 1`` slots, copying the old contents across."""

import torch

from .config import MIB, head_dim, kv_heads
from .contract import bytes_per_token, check_crop, check_kv, check_view
from .env import default_device

__all__ = ["CatCache"]


class CatCache:
    """Per-layer K/V replaced by a longer copy on every write; a write at ``start`` drops the slots
    from ``start`` on. Nothing bounds ``max_seq`` but memory, which is the problem."""

    max_seq = None

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        if min(n_layers, n_kv_heads, head_dim) < 1:
            raise ValueError(f"bad shape: layers={n_layers} kv_heads={n_kv_heads} "
                             f"head_dim={head_dim}")
        self.n_layers, self.n_kv_heads, self.head_dim = map(int, (n_layers, n_kv_heads, head_dim))
        self._empty = torch.empty(1, self.n_kv_heads, 0, self.head_dim, dtype=dtype,
                                  device=default_device() if device is None else device)
        self.reset()

    @classmethod
    def for_model(cls, config, *, device=None, dtype=None):
        return cls(config.num_hidden_layers, kv_heads(config), head_dim(config),
                   device=device, dtype=dtype or torch.bfloat16)

    dtype = property(lambda self: self._empty.dtype)
    device = property(lambda self: self._empty.device)
    nbytes = property(lambda self: sum(t.numel() * t.element_size() for t in self.k + self.v))
    mib = property(lambda self: self.nbytes / MIB)
    bytes_per_token = property(bytes_per_token)

    def reset(self) -> None:
        """New request: drop every layer's tensors (the allocator may keep the blocks)."""
        self.k, self.v = [self._empty] * self.n_layers, [self._empty] * self.n_layers
        self.seq_len = 0

    def crop(self, seq_len: int) -> None:
        """Keep the first ``seq_len`` slots of every layer (views: the next write copies them)."""
        check_crop(self, seq_len)
        self.k, self.v = ([t[:, :, :seq_len] for t in kv] for kv in (self.k, self.v))
        self.seq_len = seq_len

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``[n, Hkv, D]``: allocate ``start + n`` slots, copy all."""
        check_kv(self, layer, start, k, v)
        held = self.k[layer].shape[2]
        if start > held:
            raise ValueError(f"CatCache can only append: writing at slot {start}, "
                             f"layer {layer} holds {held}")
        # [n, H, D] -> [1, H, n, D], then the whole-cache copy this course is about.
        for old, new in ((self.k, k), (self.v, v)):
            old[layer] = torch.cat([old[layer][:, :, :start], new.permute(1, 0, 2)[None]], dim=2)

    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_view(self, layer, seq, lambda: self.k[layer].shape[2], "a layer holding {}")
        return self.k[layer][:, :, :seq], self.v[layer][:, :, :seq]

    def __repr__(self) -> str:
        return (f"CatCache(layers={self.n_layers}, kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, {self.mib:.1f} MiB, "
                f"seq_len={self.seq_len})")
