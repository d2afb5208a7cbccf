"""One forward of the course's token loop: n new tokens through the model, over a cache.

It is written against the model's own modules (embeddings, norms, q/k/v/o projections, Qwen3's q/k
norms, the rotary embedding, the MLP, the head), so the weights, the RoPE scaling of the checkpoint and
the numerics are the model's; only the cache and the attention call are ours. Attention is
``scaled_dot_product_attention`` over the cache's views, with grouped-query attention left to
``enable_gqa`` so K/V are never expanded with a copy.

Shapes (batch 1): hidden ``[1, n, d]``; q ``[1, n, Hq, D]``; k/v written as ``[n, Hkv, D]``; SDPA reads
``[1, H, seq, D]``.
"""

import torch
import torch.nn.functional as F

__all__ = ["forward", "check_supported", "SUPPORTED"]

SUPPORTED = ("llama", "qwen2", "qwen3")


def check_supported(model) -> None:
    """Refuse architectures whose attention this loop would get silently wrong."""
    config = model.config
    if config.model_type not in SUPPORTED:
        raise NotImplementedError(f"kvlib's token loop supports {SUPPORTED}; "
                                  f"{type(model).__name__} is {config.model_type!r}")
    windowed = [t for t in (getattr(config, "layer_types", None) or []) if t != "full_attention"]
    if windowed:
        raise NotImplementedError(f"{len(windowed)} layers use {windowed[0]!r}; "
                                  f"kvlib supports full attention only")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, as these families use it. x ``[1, n, H, D]``, cos/sin ``[1, n, D]``."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attention(attn, h, cos, sin, cache, layer: int, start, end: int, mask, causal: bool):
    """One layer's self-attention for n new tokens written at ``start``, reading slots ``0..end``."""
    n, D = h.shape[1], attn.head_dim
    q = attn.q_proj(h).view(1, n, -1, D)  # [1, n, Hq, D]
    k = attn.k_proj(h).view(1, n, -1, D)  # [1, n, Hkv, D]
    v = attn.v_proj(h).view(1, n, -1, D)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over head_dim, before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    if isinstance(start, torch.Tensor):
        cache.write_at(layer, start, k[0], v[0])
    else:
        cache.write(layer, start, k[0], v[0])
    keys, values = cache.view(layer, end)  # [1, Hkv, end, D], views
    q = q.transpose(1, 2)  # [1, Hq, n, D]; query head h reads KV head h // group
    if mask is None:
        o = F.scaled_dot_product_attention(q, keys, values, is_causal=causal, scale=attn.scaling,
                                           enable_gqa=True)
    else:  # fold each KV head's group of query heads into rows: [1, Hkv, group * n, D]
        Hkv = keys.shape[1]
        o = F.scaled_dot_product_attention(q.reshape(1, Hkv, -1, D), keys, values, attn_mask=mask,
                                           scale=attn.scaling).reshape(1, -1, n, D)  # [1, Hq, n, D]
    return attn.o_proj(o.transpose(1, 2).reshape(1, n, -1))


@torch.no_grad()  # inference only: a cache must never hold autograd history
def forward(model, ids: torch.Tensor, cache, start, span: int | None = None) -> torch.Tensor:
    """Run ``ids`` ``[1, n]`` at positions ``start..start+n``; return the last logits ``[1, vocab]``.

    Every layer writes its K/V for those slots; ``cache.seq_len`` becomes ``start + n``. Only the last
    position goes through the head: the logits of the others are never used, and for a long prompt they
    would be the largest tensor of the step.

    With ``start`` a device tensor ``[1]`` (one token, a :class:`KVCache`) the step has static shapes,
    as a CUDA graph needs: it reads ``span`` slots whatever the position, masking those past it, and
    leaves ``seq_len`` to the caller, who knows the position on the host (:mod:`kvlib.graphs`).
    """
    body, n = model.model, ids.shape[1]
    static = isinstance(start, torch.Tensor)
    causal, visible = False, None  # visible: [n, end] bool, which slots each new token may read
    if static:  # the position lives on the device
        positions, end = start.view(1, 1), span
        visible = (torch.arange(span, device=ids.device) <= start).view(1, span)
    else:
        positions, end = torch.arange(start, start + n, device=ids.device).unsqueeze(0), start + n
        if n > 1 and start == 0:  # prefill from empty: plain causal
            causal = True
        elif n > 1:  # a chunk after earlier tokens: causal, offset by `start`
            visible = torch.ones(n, end, dtype=torch.bool, device=ids.device).tril(start)
    mask = None  # decode (one query sees every slot) and causal prefill need none
    if visible is not None:
        # With a mask, SDPA's fused kernels refuse enable_gqa and the math kernel copies K/V once per
        # query head. So _attention folds each KV head's query heads into rows, and the mask is
        # repeated to match: [group * n, end]. Additive, in the model's dtype, built once per step,
        # so no layer converts it again.
        group = model.config.num_attention_heads // model.config.num_key_value_heads
        mask = torch.zeros(visible.shape, dtype=model.dtype, device=ids.device)
        mask = mask.masked_fill(~visible, float("-inf")).repeat(group, 1)
    x = body.embed_tokens(ids)  # [1, n, d]
    cos, sin = body.rotary_emb(x, positions)  # the model's own RoPE, scaling included
    for i, layer in enumerate(body.layers):
        h = layer.input_layernorm(x)
        x = x + _attention(layer.self_attn, h, cos, sin, cache, i, start, end, mask, causal)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    if not static:
        cache.seq_len = end
    return model.lm_head(body.norm(x[:, -1:]))[:, -1]
