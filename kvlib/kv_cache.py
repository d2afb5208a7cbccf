"""Preallocated KV: ``k, v: [L, S, Hkv, D]``, written in place and never grown, because a ``cat``
on every step copies the whole cache and a card runs out well before the arithmetic says. The
``layout`` changes strides, never results: ``"head"`` stores ``[L, Hkv, S, D]``, so the ``[S, D]``
block SDPA reads is contiguous; ``"seq"`` makes the write contiguous instead.
"""

import torch

from .config import MIB, head_dim, kv_heads
from .contract import bytes_per_token, check_kv, check_view, crop_slots
from .env import default_device

__all__ = ["KVCache", "LAYOUTS"]

LAYOUTS = ("head", "seq")


class KVCache:
    """Two fixed ``[L, S, Hkv, D]`` tensors; slots past ``seq_len`` are zeros, read only masked.
    ``device=None``: CUDA when there is one, else the CPU, so the default runs on a laptop too."""

    __slots__ = ("k", "v", "n_layers", "max_seq", "n_kv_heads", "head_dim", "layout", "seq_len",
                 "_k", "_v", "_k_attn", "_v_attn")

    def __init__(self, n_layers: int, max_seq: int, n_kv_heads: int, head_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16,
                 layout: str = "head") -> None:
        if min(n_layers, max_seq, n_kv_heads, head_dim) < 1:
            raise ValueError(f"bad shape: layers={n_layers} max_seq={max_seq} "
                             f"kv_heads={n_kv_heads} head_dim={head_dim}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
        L, S, H, D = map(int, (n_layers, max_seq, n_kv_heads, head_dim))
        self.n_layers, self.max_seq, self.n_kv_heads, self.head_dim = L, S, H, D
        self.layout, self.seq_len = layout, 0
        stored = (L, H, S, D) if layout == "head" else (L, S, H, D)
        device = default_device() if device is None else device
        # zeros, not empty: a fixed-shape step reads the unwritten tail under a mask, where a NaN
        # would poison softmax; pages paid up front keep memory flat. [L, S, H, D] either way.
        k, v = (torch.zeros(stored, dtype=dtype, device=device) for _ in "kv")
        self.k, self.v = (k.transpose(1, 2), v.transpose(1, 2)) if layout == "head" else (k, v)
        # Per-layer views, built once (`self.k[layer]` would be a new view every layer of every
        # token): [S, H, D] to write, [1, H, S, D] for SDPA, so the token path only slices.
        self._k, self._v = [self.k[i] for i in range(L)], [self.v[i] for i in range(L)]
        self._k_attn, self._v_attn = ([t.permute(1, 0, 2).unsqueeze(0) for t in views]
                                      for views in (self._k, self._v))

    @classmethod
    def for_model(cls, config, max_seq: int, *, device=None, dtype=None, layout: str = "head"):
        """Size a cache from a ``transformers`` config (the model's own numbers)."""
        return cls(config.num_hidden_layers, max_seq, kv_heads(config), head_dim(config),
                   device=device, dtype=dtype or torch.bfloat16, layout=layout)

    dtype = property(lambda self: self.k.dtype)
    device = property(lambda self: self.k.device)
    nbytes = property(lambda self: 2 * self.k.numel() * self.k.element_size())
    mib = property(lambda self: self.nbytes / MIB)
    bytes_per_token = property(bytes_per_token)

    def reset(self) -> None:
        """New request, same memory. Nothing is freed and nothing is zeroed."""
        self.seq_len = 0

    crop = crop_slots

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``[n, Hkv, D]`` into slots ``start..start+n``: one slice copy each, no allocation. The
        offset is fixed into the kernel: a captured step uses :meth:`write_at`."""
        end = check_kv(self, layer, start, k, v)
        self._k[layer][start:end] = k
        self._v[layer][start:end] = v

    def write_at(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``[n, Hkv, D]`` at the slots in ``pos``, a device tensor ``[n]``, so a CUDA graph
        replays it at a new position. A range check would sync: the caller checks on the host."""
        check_kv(self, layer, 0, k, v)
        self._k[layer].index_copy_(0, pos, k)
        self._v[layer].index_copy_(0, pos, v)

    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, Hkv, seq, D]`` views for SDPA. No copy."""
        check_view(self, layer, seq, lambda: self.max_seq, "a cache of max_seq={}")
        return self._k_attn[layer][:, :, :seq], self._v_attn[layer][:, :, :seq]

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.n_layers}, max_seq={self.max_seq}, "
                f"kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"layout={self.layout}, {self.mib:.1f} MiB, "
                f"{self.bytes_per_token / 1024:.0f} KiB/token, seq_len={self.seq_len})")
