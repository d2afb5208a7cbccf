"""One forward of the token loop, written against the model's own modules (so the weights, RoPE
scaling and numerics are the model's; only the cache and the attention call are ours). A ragged
batch packs every request's tokens into one row ``[1, N]``: the weights are read once for all.

Grouped-query attention is never expanded with a copy. Where a query sees every slot (decode), each
KV head's query heads are folded into rows, ``[1, Hkv, group * n, D]``, a call every fused kernel
takes. A prefill chunk, after cached slots or not, is causal with ``enable_gqa`` by the kernel's own
bottom-right rule where a fused kernel takes it (no mask on CUDA, an ``[n, S]`` bool one on a CPU);
otherwise it is folded with a mask. cuDNN attention is off: it plans every new shape."""

import functools
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from .config import head_dim, kv_heads
from .contract import Cache, Positions, at_places, check_ids, check_start, offers
from .latent_cache import LatentCache, forward_latent

__all__ = ["check_cache", "check_supported", "forward", "forward_unchecked"]

# What the loop computes: a pre-norm decoder of these parts (must have, may have) and nothing else.
# Anything more (extra norms, attention sinks) changes the numbers, so it is refused by name.
_PARTS = {
    "model": ({"embed_tokens", "layers", "norm", "rotary_emb"}, set()),
    "decoder layer": ({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}, set()),
    "attention": ({"q_proj", "k_proj", "v_proj", "o_proj"}, {"q_norm", "k_norm"}),
}
_CONFIG_REFUSED = {  # config attribute -> what the loop would get wrong, unless it is neutral
    "attn_logit_softcapping": "soft-capped attention logits", "clip_qkv": "clipped q/k/v",
    "final_logit_softcapping": "soft-capped logits", "logits_scaling": "scaled logits",
    "embedding_multiplier": "scaled embeddings", "residual_multiplier": "scaled residuals",
}


def parts(module) -> set[str]:
    return {n for n, _ in [*module.named_children(), *module.named_parameters(recurse=False)]}


def check_supported(model, window: int | None = None) -> None:
    """Refuse, naming the part, a model this loop would compute wrongly: any family built of the
    parts above runs. Sliding-window layers need a ``RingCache`` of their ``window``."""
    config, body = model.config, getattr(model, "model", None)
    layer = body.layers[0] if body is not None and len(getattr(body, "layers", ())) else None
    attention = getattr(layer, "self_attn", None)
    who = f"{type(model).__name__} ({config.model_type!r})"
    for where, module in (("model", body), ("decoder layer", layer), ("attention", attention)):
        must, may = _PARTS[where]
        have = set() if module is None else parts(module)
        if extra := sorted(have - must - may):
            raise NotImplementedError(f"{who}: its {where} has {extra}, which kvlib's token loop "
                                      f"does not compute")
        if missing := sorted(must - have):
            raise NotImplementedError(f"{who}: its {where} lacks {missing}, which kvlib's token "
                                      f"loop needs")
    for attr, what in _CONFIG_REFUSED.items():
        if (value := getattr(config, attr, None)) not in (None, 1, 1.0):
            raise NotImplementedError(f"{config.model_type!r} has {what} ({attr}={value}); "
                                      f"kvlib's token loop does not compute them")
    rope_of(type(attention))
    if 0 in (getattr(config, "no_rope_layers", None) or []):
        raise NotImplementedError(f"{config.model_type!r} has layers without RoPE (no_rope_layers="
                                  f"{config.no_rope_layers}); kvlib's token loop rotates every "
                                  f"layer")
    kinds = getattr(config, "layer_types", None) or []
    windowed = [t for t in kinds if t != "full_attention"]
    if windowed and (len(windowed) < len(kinds) or windowed[0] != "sliding_attention"):
        raise NotImplementedError(f"{len(windowed)} of {len(kinds)} layers use {windowed[0]!r}; "
                                  f"kvlib's token loop runs full or sliding-window attention in "
                                  f"every layer")
    sliding = getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", 0)
    if sliding and (windowed or not kinds) and window != sliding:
        have = "a full cache" if window is None else f"a window of {window}"
        raise NotImplementedError(f"sliding_window={sliding}: each layer attends to the last "
                                  f"{sliding} tokens; run it over a RingCache(window={sliding}), "
                                  f"not {have}")


def _causal_fused(model, device: torch.device) -> bool:
    """Does a fused kernel take a chunk's causal rule itself, grouped heads unfolded, no mask? Asked
    of the chooser that ``scaled_dot_product_attention`` consults (a simulated card answers as its
    dispatcher would): flash takes ``causal_lower_right`` with grouped heads, the memory-efficient
    kernel without them; math would materialise the mask and copy K and V per query head. The CPU's
    flash answers yes, and takes the rule as a ``[n, S]`` bool mask."""
    c, D = model.config, model.model.layers[0].self_attn.head_dim
    probe = torch.empty(D, dtype=model.dtype, device=device)  # the chooser reads shapes, not data
    q, kv = (probe.expand(1, h, 1, D) for h in (c.num_attention_heads, c.num_key_value_heads))
    with no_cudnn_attention(device):
        kind = torch._fused_sdp_choice(q, kv, kv, enable_gqa=True)
    return kind == int(SDPBackend.FLASH_ATTENTION) or (
        kind == int(SDPBackend.EFFICIENT_ATTENTION) and q.shape[1] == kv.shape[1])


@contextmanager
def no_cudnn_attention(device: torch.device):
    """Leave cuDNN attention out for one forward, and whatever else the caller chose untouched."""
    was = device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
    if was:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        if was:
            torch.backends.cuda.enable_cudnn_sdp(True)


@dataclass(frozen=True)
class _Pass:
    """What every layer of one forward shares, per request: its rows of the packed tokens, where
    its K/V go and which slots its queries read."""

    rows: slice  # its n new tokens among the forward's N
    cache: Cache
    start: int  # slots written: start..end
    end: int  # slots read: 0..end
    mask: torch.Tensor | None  # [group * n, end] additive, folded rows; or the causal rule; or None
    causal: bool  # unfolded, enable_gqa, ``mask`` is ``causal_lower_right`` (no mask on CUDA)
    at: int  # the RoPE position of its first new token
    rope: tuple | None  # (cos, sin) [1, S, D] of the slots read, if the cache holds keys unrotated


@functools.cache
def rope_of(attention_class: type) -> Callable:
    """The model's own ``apply_rotary_pos_emb``: rotate-half or interleaved, partial or whole."""
    rope = getattr(sys.modules[attention_class.__module__], "apply_rotary_pos_emb", None)
    if rope is None:
        raise NotImplementedError(f"{attention_class.__name__}'s module has no "
                                  f"apply_rotary_pos_emb; kvlib's token loop applies the model's "
                                  f"own RoPE")
    return rope


def _attend(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, p: _Pass):
    """One request's attention: its queries ``[1, n, Hq, D]`` over its own cache's slots only."""
    n, D = q.shape[1], attn.head_dim
    p.cache.write(layer, p.start, k, v)
    keys, values = p.cache.view(layer, p.end)  # [1, Hkv, S, D]
    if p.rope:  # keys at their places in the cache; the model's RoPE rotates a pair (q: no heads)
        keys = rope_of(type(attn))(keys[:, :0], keys, *p.rope, unsqueeze_dim=1)[1]
    q = q.transpose(1, 2)  # [1, Hq, n, D]; query head h reads KV head h // group
    if p.causal:  # query i sees slots up to end - n + i: the bottom-right causal rule
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=p.mask, scale=attn.scaling,
                                           enable_gqa=True)
    else:  # fold each KV head's group of query heads into rows: [1, Hkv, group * n, D]
        o = F.scaled_dot_product_attention(q.reshape(1, keys.shape[1], -1, D), keys, values,
                                           attn_mask=p.mask, scale=attn.scaling)
        o = o.reshape(1, -1, n, D)  # [1, Hq, n, D]
    return o.transpose(1, 2).reshape(1, n, -1)


def _attention(attn, h: torch.Tensor, layer: int, cos, sin, passes: list[_Pass]) -> torch.Tensor:
    """One layer's self-attention for the N packed new tokens of ``h`` ``[1, N, d]``."""
    N, D = h.shape[1], attn.head_dim
    q = attn.q_proj(h).view(1, N, -1, D)  # [1, N, Hq, D]
    k = attn.k_proj(h).view(1, N, -1, D)  # [1, N, Hkv, D]
    v = attn.v_proj(h).view(1, N, -1, D)
    if hasattr(attn, "q_norm"):  # RMSNorm over head_dim, before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, turned = rope_of(type(attn))(q, k, cos, sin, unsqueeze_dim=2)  # heads on dim 2
    raw, k = (k if any(p.rope for p in passes) else None), turned  # kept for a ring of places only
    o = [_attend(attn, q[:, p.rows], (raw if p.rope else k)[0, p.rows], v[0, p.rows], layer, p)
         for p in passes]
    return attn.o_proj(o[0] if len(o) == 1 else torch.cat(o, 1))


def _run(model, ids: torch.Tensor, positions: torch.Tensor, passes: list[_Pass]) -> torch.Tensor:
    """The layer loop of a forward over ``passes``; each request's last logits ``[B, V]``."""
    body = model.model
    x = body.embed_tokens(ids)  # [1, N, d]
    cos, sin = body.rotary_emb(x, positions)  # [1, N, D]: the model's own RoPE, scaling included
    with no_cudnn_attention(ids.device):
        for i, layer in enumerate(body.layers):
            x = x + _attention(layer.self_attn, layer.input_layernorm(x), i, cos, sin, passes)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    # Only each request's last position goes through the head: the others' logits are never used,
    # and for a long prompt they would be the largest tensor of the step. Slices, not a list
    # index: a list becomes a host tensor copied to the GPU, which a CUDA graph capture refuses.
    last = [x[0, p.rows.stop - 1 : p.rows.stop] for p in passes]  # each [1, d]
    return model.lm_head(body.norm(last[0] if len(last) == 1 else torch.cat(last)))


def _mask(model, visible: torch.Tensor) -> torch.Tensor:
    """``visible`` ``[n, S]`` bool -> the additive mask of the folded rows, ``[group * n, S]``. In
    the model's dtype and built once per forward, so no layer converts it again."""
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    mask = torch.zeros(visible.shape, dtype=model.dtype, device=visible.device)
    return mask.masked_fill(~visible, float("-inf")).repeat(group, 1)


def _eager_pass(model, cache: Cache, start: int, rows: slice) -> _Pass:
    """A request's new tokens (``rows`` of the batch) at slots ``start..``, attending causally."""
    n, device = rows.stop - rows.start, cache.device
    end = start + n
    # A cache that holds some positions only (a ring) says which of its keys each query sees.
    band = cache.visible if offers(cache, Positions) else None
    causal = n > 1 and band is None and _causal_fused(model, device)
    # The kernel's own rule, a tensor subclass, which no dispatch mode (a simulated card's ledger)
    # lets be made. A decode step (one query sees every slot it reads) needs no mask.
    with _disable_current_modes():
        mask = causal_lower_right(n, end) if causal else None
    if n > 1 and not causal:  # causal, offset by `start`, unless the cache knows better
        mask = _mask(model, band(start, n) if band else torch.ones(n, end, dtype=torch.bool,
                                                                   device=device).tril(start))
    at, rope = start, None
    if at_places(cache):  # StreamingLLM's: RoPE at the keys' places in the cache
        places, probe = cache.places(start, n), torch.empty(0, dtype=model.dtype, device=device)
        at, rope = len(places) - n, model.model.rotary_emb(probe, places[None])
    return _Pass(rows=rows, cache=cache, start=start, end=end, causal=causal, mask=mask, at=at,
                 rope=rope)


def check_cache(model, cache, who: str = "") -> None:
    """Refuse a cache this model cannot run over (its shape, dtype, device), before any write."""
    c, latent = model.config, isinstance(cache, LatentCache)
    if latent != (c.model_type == "deepseek_v2"):  # MLA caches latents, nothing else does
        raise ValueError(f"{who}{type(cache).__name__} for {c.model_type!r}: a LatentCache is "
                         f"DeepSeek-V2's (latent attention), and DeepSeek-V2 needs one")
    names = "layers, " + ("kv_lora_rank, qk_rope_head_dim" if latent else "kv_heads, head_dim")
    have = (cache.n_layers, *((cache.rank, cache.rope_dim) if latent else (cache.n_kv_heads,
                                                                           cache.head_dim)))
    want = (c.num_hidden_layers, *((c.kv_lora_rank, c.qk_rope_head_dim) if latent else (
        kv_heads(c), head_dim(c))))
    if (have, cache.dtype, cache.device) != (want, model.dtype, model.device):
        raise ValueError(f"{who}the cache has {names} {have}, {cache.dtype} on {cache.device}; "
                         f"the model needs {want}, {model.dtype} on {model.device}")


@torch.no_grad()  # inference only: a cache must never hold autograd history
def forward(model, ids, cache, start) -> torch.Tensor:
    """Run ``ids`` ``[1, n]`` at slots ``start..start+n``, then ``cache.seq_len = start + n``;
    return the last logits ``[1, V]``. A batch passes lists (ids, caches, starts): ``[B, V]``. All
    is checked first (ids, caches, starts), so a refused forward changes nothing."""
    batch = isinstance(cache, (list, tuple))
    ids, caches, starts = (list(ids), list(cache), list(start)) if batch else ([ids], [cache],
                                                                               [start])
    if not len(ids) == len(caches) == len(starts) > 0:
        raise ValueError(f"a batch needs one prompt, cache and start per request: got {len(ids)} "
                         f"prompts, {len(caches)} caches, {len(starts)} starts")
    for r, (x, c, s) in enumerate(zip(ids, caches, starts)):
        who = f"request {r}: " if batch else ""
        check_ids(model, x, who)
        check_cache(model, c, who)
        check_start(c, s, x.shape[1], who)
    if len(caches) > 1 and any(isinstance(c, LatentCache) for c in caches):
        raise ValueError("a LatentCache runs one request a forward")
    return forward_unchecked(model, ids, caches, starts, pack=batch)


def forward_unchecked(model, ids: list, caches: list, starts: list,
                      pack: bool = True) -> torch.Tensor:
    """:func:`forward` unchecked, for the loop (its ids were checked at its door, or the model made
    them: reading them would wait on the device every step). ``pack``: copy even a list of one."""
    if isinstance(caches[0], LatentCache):  # no K or V per head: MLA's own forward
        return forward_latent(model, ids[0], caches[0], starts[0])
    bounds = [0, *accumulate(int(x.shape[-1]) for x in ids)]  # request i: bounds[i]..bounds[i+1]
    passes = [_eager_pass(model, c, s, slice(a, b))
              for c, s, a, b in zip(caches, starts, bounds, bounds[1:])]
    device = ids[0].device
    positions = torch.cat([torch.arange(p.at, p.at + x.shape[-1], device=device)
                           for p, x in zip(passes, ids)])
    packed = torch.cat(ids, 1) if pack else ids[0]
    logits = _run(model, packed, positions.unsqueeze(0), passes)
    for p in passes:
        p.cache.seq_len = p.end
    return logits
