"""Multi-head latent attention (DeepSeek-V2) caches no K or V per head: per layer and token, one
latent of ``kv_lora_rank`` numbers, which ``kv_b_proj`` expands into every head's key (the part
without position) and value, and one RoPE key shared by all heads: ``(R + P) * bytes``, where the
same model's K and V would hold ``H * (N + P + Vd) * bytes``.

The bytes saved at rest are paid at attention, one of two ways. Expanding the cached latents is a
``[S, R] x [R, H * (N + Vd)]`` matmul per layer per step: every slot's K and V are built anyway,
for a moment. Absorbing folds ``kv_b_proj``'s key half into each head's query (``q_nope W_UK``
scores the latent itself) and its value half after attention (``W_UV`` times the weighted
latent): no per-head K or V ever exists, and all ``H`` heads read one "KV head" of ``R + P``.

Axes: kvlib's legend, and ``R`` kv_lora_rank, ``P`` qk_rope_head_dim, ``N`` qk_nope_head_dim,
``Vd`` v_head_dim, ``H`` heads. kvlib's decoder moves per-head K/V, which MLA never has: hence
this forward of its own, on the model's own modules, which ``generate`` runs over a LatentCache."""

import torch
import torch.nn.functional as F
from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

from .config import size
from .contract import check_view, crop_slots
from .env import default_device

__all__ = ["LatentCache", "forward_latent"]


class LatentCache:
    """One preallocated ``[L, S, R + P]`` tensor: per slot the normed latent, then the rotated
    shared key. One tensor, not two, because the absorbed attention's keys are exactly that row:
    a view, where two tensors would need a ``cat`` over every slot at every step. ``absorb``:
    how its forward reads it, absorbing the up-projection or expanding the latents."""

    def __init__(self, n_layers: int, max_seq: int, rank: int, rope_dim: int, *,
                 device=None, dtype: torch.dtype = torch.bfloat16, absorb: bool = False) -> None:
        if min(n_layers, max_seq, rank, rope_dim) < 1:
            raise ValueError(f"bad shape: L={n_layers} S={max_seq} R={rank} P={rope_dim}")
        self.n_layers, self.max_seq, self.rank, self.rope_dim = n_layers, max_seq, rank, rope_dim
        self.absorb = absorb
        device = default_device() if device is None else device
        self.kv = torch.zeros(n_layers, max_seq, rank + rope_dim, dtype=dtype, device=device)
        self.reset()

    @classmethod
    def for_model(cls, config, max_seq: int, *, device=None, dtype=None, absorb=False):
        """Size a cache from a DeepSeek-V2 config (its ``kv_lora_rank``, ``qk_rope_head_dim``)."""
        return cls(config.num_hidden_layers, max_seq, config.kv_lora_rank, config.qk_rope_head_dim,
                   device=device, dtype=dtype or torch.bfloat16, absorb=absorb)

    dtype = property(lambda self: self.kv.dtype)
    device = property(lambda self: self.kv.device)
    nbytes = property(lambda self: self.kv.numel() * self.kv.element_size())
    bytes_per_token = property(lambda self: self.n_layers * self.kv.shape[-1] * self.kv.itemsize)

    def reset(self) -> None:  # new request, same memory
        self.seq_len = 0

    crop = crop_slots

    def write(self, layer: int, start: int, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Write ``latent [n, R]``, ``k_pe [n, P]`` at ``start``, or refuse and change nothing."""
        n, end = latent.shape[0], start + latent.shape[0]
        if not 0 <= layer < self.n_layers or start < 0:
            raise IndexError(f"layer {layer}, start {start}: the cache has {self.n_layers} layers")
        for name, t, width in (("latent", latent, self.rank), ("k_pe", k_pe, self.rope_dim)):
            if t.shape != (n, width) or t.dtype != self.dtype or t.device != self.device:
                raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; expected "
                                 f"[{n}, {width}] {self.dtype} on {self.device}")
        if end > self.max_seq:
            raise ValueError(f"KV overflow: writing slots {start}..{end} into "
                             f"max_seq={self.max_seq}")
        rows = self.kv[layer, start:end]  # [n, R + P]
        rows[:, : self.rank], rows[:, self.rank :] = latent, k_pe

    def view(self, layer: int, seq: int) -> torch.Tensor:
        """``[seq, R + P]``: the latent (``[:, :R]``) then the rotated key, a view. No copy."""
        check_view(self, layer, seq, lambda: self.max_seq, "a cache of max_seq={}")
        return self.kv[layer, :seq]

    def __repr__(self) -> str:
        return (f"LatentCache({self.n_layers} layers x {self.max_seq} slots x ({self.rank} + "
                f"{self.rope_dim}), {self.dtype}, {size(self.nbytes)}, seq_len={self.seq_len})")


def _attention(attn, h, layer: int, freqs, cache: LatentCache, start: int, visible, absorb: bool):
    """One layer's MLA for the ``n`` new tokens of ``h [1, n, d]``, over slots ``0..start+n``."""
    n, H, R = h.shape[1], attn.num_heads, attn.kv_lora_rank
    N, P, Vd = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    q = attn.q_proj(h) if attn.q_lora_rank is None else attn.q_b_proj(
        attn.q_a_layernorm(attn.q_a_proj(h)))
    q_nope, q_pe = q.view(1, n, H, N + P).transpose(1, 2).split([N, P], -1)  # [1, H, n, N | P]
    latent, k_pe = attn.kv_a_proj_with_mqa(h).split([R, P], -1)  # [1, n, R], [1, n, P]
    q_pe, k_pe = apply_rotary_emb(q_pe, k_pe[:, None], freqs)  # the model's interleaved RoPE
    cache.write(layer, start, attn.kv_a_layernorm(latent)[0], k_pe[0, 0])
    kv = cache.view(layer, start + n)  # [S, R + P]
    w_uk, w_uv = attn.kv_b_proj.weight.view(H, N + Vd, R).split([N, Vd], 1)  # [H, N | Vd, R]
    if absorb:  # fold heads into rows: [1, 1, H * n, R + P] queries over one shared "head"
        q = torch.cat([q_nope @ w_uk, q_pe], -1).view(1, 1, H * n, R + P)
        mask = None if visible is None else visible.repeat(H, 1)  # [H * n, S]
        o = F.scaled_dot_product_attention(q, kv[None, None], kv[None, None, :, :R],
                                           attn_mask=mask, scale=attn.scaling)  # [1, 1, H * n, R]
        o = o.view(1, H, n, R) @ w_uv.transpose(1, 2)  # [1, H, n, Vd]
    else:  # every slot's K and V, all heads, rebuilt from the latents at every step
        kv_heads = attn.kv_b_proj(kv[:, :R]).view(-1, H, N + Vd).transpose(0, 1)  # [H, S, N + Vd]
        k_nope, v = kv_heads.split([N, Vd], -1)
        k = torch.cat([k_nope, kv[:, R:].expand(H, -1, -1)], -1)  # [H, S, N + P]
        o = F.scaled_dot_product_attention(torch.cat([q_nope, q_pe], -1), k[None], v[None],
                                           attn_mask=visible, scale=attn.scaling)  # [1, H, n, Vd]
    return attn.o_proj(o.transpose(1, 2).reshape(1, n, H * Vd))


@torch.no_grad()
def forward_latent(model, ids, cache: LatentCache, start: int, *, absorb=None) -> torch.Tensor:
    """Run ``ids [1, n]`` at slots ``start..start+n`` of a DeepSeek-V2 ``model``, then
    ``cache.seq_len = start + n``; the last logits ``[1, V]``. ``absorb`` (default: the cache's)
    picks the attention. Unchecked: :func:`kvlib.forward` checks, then runs this."""
    absorb = cache.absorb if absorb is None else absorb
    body, n, end = model.model, ids.shape[1], start + ids.shape[1]
    x = body.embed_tokens(ids)  # [1, n, d]
    freqs = body.rotary_emb(x, torch.arange(start, end, device=ids.device)[None])  # [1, n, P/2]
    # A chunk after cached slots: query i sees slots up to start + i. One query sees them all.
    visible = torch.ones(n, end, dtype=torch.bool, device=ids.device).tril(start) if n > 1 else None
    for i, layer in enumerate(body.layers):
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), i, freqs, cache, start,
                           visible, absorb)
        x = x + layer.mlp(layer.post_attention_layernorm(x))  # dense or MoE: the model's own
    cache.seq_len = end
    return model.lm_head(body.norm(x[:, -1]))
