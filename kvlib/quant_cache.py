"""A quantized KV cache: int8 (or int4) codes and a scale per group, instead of bf16/fp32 values.

Symmetric, one scale per token, KV head and ``group`` channels: ``code = round(x / scale)``,
``scale = max|x| / qmax``. Per token, because a token is written once, so its slot holds its final
bytes (KIVI's per-channel key scales span tokens, and need a full-precision window). SDPA takes
floating-point K/V, so :meth:`QuantCache.view` dequantizes one layer's slots at a time."""

import torch

from .config import head_dim, kv_heads, size
from .contract import check_kv, check_view, crop_slots
from .env import default_device

__all__ = ["QuantCache", "dequantize", "quantize"]


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> codes ``[..., D bits/8]`` (int4: two a byte), scales ``[..., D/g, 1]``."""
    qmax = 2 ** (bits - 1) - 1
    g = x.unflatten(-1, (-1, group))  # [..., D/group, group]
    # the scale is rounded to x's dtype first, so the codes are computed against the one kept
    scale = (g.abs().amax(-1, keepdim=True) / qmax).clamp_min(torch.finfo(x.dtype).tiny)
    code = (g.float() / scale.float()).round_().clamp_(-qmax, qmax).flatten(-2).to(torch.int8)
    if bits == 4:  # offset to 1..15, two to a byte: even channels in the low nibble
        u = (code + 8).to(torch.uint8)
        code = u[..., 0::2] | (u[..., 1::2] << 4)
    return code, scale


def dequantize(code: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Codes ``[..., D bits/8]`` and scales ``[..., D/group, 1]`` -> values ``[..., D]``."""
    if code.dtype == torch.uint8:  # int4: unpack both nibbles, back to -7..7
        code = torch.stack([code & 15, code >> 4], -1).flatten(-2).to(torch.int8) - 8
    return (code.unflatten(-1, (-1, group)) * scale).flatten(-2)  # int8 * scale: scale's dtype


class QuantCache:
    """Preallocated codes ``[L, Hkv, S, D bits/8]`` and scales ``[L, Hkv, S, D/group, 1]``."""

    def __init__(self, n_layers: int, max_seq: int, n_kv_heads: int, head_dim: int, *,
                 bits: int = 8, group: int | None = None, device=None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        group = group or (head_dim if bits == 8 else min(32, head_dim))
        if bits not in (8, 4) or min(n_layers, max_seq, n_kv_heads, group) < 1 or head_dim % group:
            raise ValueError(f"bad shape: bits={bits} (8 or 4) layers={n_layers} max_seq={max_seq} "
                             f"kv_heads={n_kv_heads} head_dim={head_dim} group={group} "
                             f"(divides it)")
        self.n_layers, self.max_seq, self.n_kv_heads = int(n_layers), int(max_seq), int(n_kv_heads)
        self.head_dim, self.bits, self.group, self.seq_len = int(head_dim), bits, group, 0
        device = default_device() if device is None else device
        codes = (n_layers, n_kv_heads, max_seq, head_dim * bits // 8)
        scales = (n_layers, n_kv_heads, max_seq, head_dim // group, 1)
        code_dtype = torch.int8 if bits == 8 else torch.uint8
        self.k, self.v = (torch.zeros(codes, dtype=code_dtype, device=device) for _ in "kv")
        self.k_scale, self.v_scale = (torch.zeros(scales, dtype=dtype, device=device) for _ in "kv")

    @classmethod
    def for_model(cls, config, max_seq: int, *, bits=8, group=None, device=None, dtype=None):
        return cls(config.num_hidden_layers, max_seq, kv_heads(config), head_dim(config),
                   bits=bits, group=group, device=device, dtype=dtype or torch.bfloat16)

    dtype = property(lambda self: self.k_scale.dtype)  # what is written and read
    device = property(lambda self: self.k.device)
    nbytes = property(lambda self: sum(t.numel() * t.element_size()
                                       for t in (self.k, self.v, self.k_scale, self.v_scale)))
    # K and V of a token, all layers, scales included: 2 L Hkv (D bits/8 + D/group scale bytes)
    bytes_per_token = property(lambda self: self.nbytes // self.max_seq)

    def reset(self) -> None:
        self.seq_len = 0  # nothing freed or zeroed: slots past seq_len are never read

    crop = crop_slots  # exactly: each token's scales are its own

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``[n, Hkv, D]`` into slots ``start..start+n``; a refused write writes none."""
        end = check_kv(self, layer, start, k, v)
        for x, code, scale in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            code[layer, :, start:end], scale[layer, :, start:end] = quantize(
                x.transpose(0, 1), self.bits, self.group)

    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, Hkv, seq, D]`` in the compute dtype: a dequantized copy of one layer's slots."""
        check_view(self, layer, seq, lambda: self.max_seq, "a cache of max_seq={}")
        return tuple(dequantize(c[layer, :, :seq], s[layer, :, :seq], self.group).unsqueeze(0)
                     for c, s in ((self.k, self.k_scale), (self.v, self.v_scale)))

    def __repr__(self) -> str:
        return (f"QuantCache(int{self.bits}, group={self.group}, layers={self.n_layers}, "
                f"max_seq={self.max_seq}, {size(self.nbytes)}, "
                f"{self.bytes_per_token} B/token, seq_len={self.seq_len})")
