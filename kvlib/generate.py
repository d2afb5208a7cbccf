"""The course's token loop: prefill, then one token at a time, over any cache.

It is written against the model's own modules (embeddings, norms, q/k/v/o
projections, Qwen3's q/k norms, the rotary embedding, the MLP, the head), so
the weights, the RoPE scaling of the checkpoint and the numerics are the
model's; only the cache and the attention call are ours. Attention is
``scaled_dot_product_attention`` over the cache's views, with grouped-query
attention left to ``enable_gqa`` so K/V are never expanded with a copy.

Shapes (batch 1): hidden ``[1, n, d]``; q ``[1, n, Hq, D]``; k/v written as
``[n, Hkv, D]``; SDPA reads ``[1, H, seq, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cat_cache import CatCache
from .kv_cache import KVCache
from .timing import StepTimer

__all__ = ["generate", "forward", "Generation", "check_supported", "SUPPORTED"]

SUPPORTED = ("llama", "qwen2", "qwen3")
EOS_CHECK_EVERY = 8  # host syncs to look for EOS: one per this many steps, not one per step


def check_supported(model) -> None:
    """Refuse architectures whose attention this loop would get silently wrong."""
    config = model.config
    if config.model_type not in SUPPORTED:
        raise NotImplementedError(
            f"kvlib's token loop supports {SUPPORTED}; {type(model).__name__} is {config.model_type!r}"
        )
    windowed = [t for t in (getattr(config, "layer_types", None) or []) if t != "full_attention"]
    if windowed:
        raise NotImplementedError(f"{len(windowed)} layers use {windowed[0]!r}; kvlib supports full attention only")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half convention of these families. x ``[1, n, H, D]``, cos/sin ``[1, n, D]``."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attention(attn, h, cos, sin, cache, layer: int, start: int) -> torch.Tensor:
    """One layer's self-attention for n new tokens at slots ``start..start+n``."""
    n, D = h.shape[1], attn.head_dim
    q = attn.q_proj(h).view(1, n, -1, D)  # [1, n, Hq, D]
    k = attn.k_proj(h).view(1, n, -1, D)  # [1, n, Hkv, D]
    v = attn.v_proj(h).view(1, n, -1, D)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over head_dim, before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    cache.write(layer, start, k[0], v[0])
    end = start + n
    keys, values = cache.view(layer, end)  # [1, Hkv, end, D], views
    if n == 1:  # decode: the one query sees every slot
        mask, causal = None, False
    elif start == 0:  # prefill from empty: plain causal
        mask, causal = None, True
    else:  # a chunk after earlier tokens: causal, offset by `start`
        mask, causal = torch.ones(n, end, dtype=torch.bool, device=h.device).tril(start), False
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal,
        scale=attn.scaling, enable_gqa=True,
    )  # [1, Hq, n, D]
    return attn.o_proj(o.transpose(1, 2).reshape(1, n, -1))


def forward(model, ids: torch.Tensor, cache, start: int) -> torch.Tensor:
    """Run ``ids`` ``[1, n]`` at positions ``start..start+n``; return the last logits ``[1, vocab]``.

    Every layer writes its K/V for those slots; ``cache.seq_len`` becomes
    ``start + n``. Only the last position goes through the head: the logits of
    the others are never used, and for a long prompt they would be the largest
    tensor of the step.
    """
    body = model.model
    n = ids.shape[1]
    x = body.embed_tokens(ids)  # [1, n, d]
    positions = torch.arange(start, start + n, device=ids.device).unsqueeze(0)
    cos, sin = body.rotary_emb(x, positions)  # the model's own RoPE, scaling included
    for i, layer in enumerate(body.layers):
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, cache, i, start)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    cache.seq_len = start + n
    return model.lm_head(body.norm(x[:, -1:]))[:, -1]


def _pick(logits, temperature: float, top_k, top_p, generator) -> torch.Tensor:
    """Next token ``[1, 1]`` from ``[1, vocab]`` logits, on the device, with no host sync."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the ones before it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


@dataclass
class Generation:
    """What :func:`generate` returns.

    ``step_s[i]`` is the time of decode step i, which attends over
    ``prompt_len + i + 1`` slots (``timed=True`` only: it synchronises each step).
    ``cache`` holds the prompt and every new token but the last.
    """

    tokens: list[int]
    prompt_len: int
    cache: object
    prefill_s: float | None = None
    step_s: list[float] | None = None
    logits: list[torch.Tensor] | None = None


def _make_cache(kind, model, max_seq: int, layout: str):
    device, dtype = model.device, model.dtype
    if kind == "prealloc":
        return KVCache.for_model(model.config, max_seq, device=device, dtype=dtype, layout=layout)
    if kind == "cat":
        return CatCache.for_model(model.config, device=device, dtype=dtype)
    if isinstance(kind, str):
        raise ValueError(f"cache must be 'prealloc', 'cat' or a cache object, not {kind!r}")
    return kind


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    cache="prealloc",
    max_seq: int | None = None,
    layout: str = "head",
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id="auto",
    prefill_chunk: int | None = None,
    timed: bool = False,
    return_logits: bool = False,
    on_step=None,
) -> Generation:
    """Generate up to ``max_new_tokens`` after ``input_ids`` ``[1, n]`` (or ``[n]``).

    ``cache``: ``"prealloc"`` (a :class:`KVCache` of ``max_seq`` slots, default
    prompt + new tokens), ``"cat"`` (a :class:`CatCache`), or a cache object,
    which is continued from its ``seq_len`` (``reset()`` it for a new request).
    Greedy unless ``temperature > 0``; then top-k / top-p sampling from a
    generator seeded with ``seed``. Stops after an EOS token (``"auto"``: the
    model's generation config; ``None``: never). ``prefill_chunk`` splits a long
    prompt so the prefill's workspace stays bounded. ``on_step(step, seq_len)``
    is called after each decode step (for memory traces and meters).
    """
    check_supported(model)
    ids = input_ids.reshape(1, -1).to(model.device)
    n = ids.shape[1]
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"need a prompt and max_new_tokens >= 1, got {n} prompt tokens, {max_new_tokens}")
    cache = _make_cache(cache, model, max_seq or n + max_new_tokens, layout)
    start = cache.seq_len
    if cache.max_seq is not None and start + n + max_new_tokens > cache.max_seq:
        raise ValueError(
            f"KV overflow: {start} cached + {n} prompt + {max_new_tokens} new tokens "
            f"> max_seq={cache.max_seq}"
        )
    if eos_token_id == "auto":
        eos_token_id = model.generation_config.eos_token_id
    eos = torch.tensor(
        [] if eos_token_id is None else eos_token_id, device=model.device, dtype=torch.long
    ).reshape(-1)
    generator = None
    if temperature > 0:
        generator = torch.Generator(model.device)
        generator.manual_seed(0 if seed is None else seed)

    timer = StepTimer(model.device) if timed else None
    if timer:
        timer.start()
    chunk = prefill_chunk or n
    for s in range(0, n, chunk):
        logits = forward(model, ids[:, s : s + chunk], cache, start + s)
    if timer:
        timer.stop()

    out = torch.empty(max_new_tokens, dtype=torch.long, device=model.device)
    kept_logits = [] if return_logits else None
    pos, produced = start + n, 0
    while True:
        nxt = _pick(logits, temperature, top_k, top_p, generator)  # [1, 1]
        out[produced] = nxt[0, 0]
        produced += 1
        if kept_logits is not None:
            kept_logits.append(logits[0].float().cpu())
        done = produced == max_new_tokens
        if eos.numel() and (done or timed or produced % EOS_CHECK_EVERY == 0):
            done = done or bool(torch.isin(out[:produced], eos).any())
        if done:
            break
        if timer:
            timer.start()
        logits = forward(model, nxt, cache, pos)
        pos += 1
        if timer:
            timer.stop()
        if on_step:
            on_step(produced - 1, pos)

    tokens = out[:produced].tolist()
    if eos.numel():  # steps past an EOS seen late are dropped, and so are their slots
        stops = set(eos.tolist())
        hits = [i for i, t in enumerate(tokens) if t in stops]
        if hits:
            tokens = tokens[: hits[0] + 1]
            cache.seq_len = start + n + len(tokens) - 1
            if kept_logits is not None:
                kept_logits = kept_logits[: len(tokens)]
    times = timer.times_s if timer else None
    return Generation(
        tokens=tokens,
        prompt_len=n,
        cache=cache,
        prefill_s=times[0] if times else None,
        step_s=times[1 : len(tokens)] if times else None,
        logits=kept_logits,
    )
