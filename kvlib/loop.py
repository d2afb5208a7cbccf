"""The token loop: prefill, then one token at a time, over any :class:`~kvlib.cache.Cache`, with
host syncs kept off the hot path (EOS is looked for every ``EOS_CHECK_EVERY`` steps)."""

from dataclasses import dataclass

import torch

from .cache import Cache
from .cat_cache import CatCache
from .decoder import check_supported, forward
from .graphs import StaticStep
from .kv_cache import KVCache
from .speculative import lookup
from .timing import StepTimer

__all__ = ["generate", "Generation"]

EOS_CHECK_EVERY = 8  # host syncs to look for EOS: one per this many steps, not one per step


def _pick(logits, temperature: float, top_k, top_p, generator) -> torch.Tensor:
    """Next token ``[1, 1]`` from ``[1, V]`` logits, on the device, with no host sync."""
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
    # argmax of p / Exp(1) draws from p (an exponential race): unlike torch.multinomial on CUDA,
    # it never waits for the device to tell the host anything.
    race = torch.empty_like(logits).exponential_(generator=generator)
    return (logits.softmax(-1) / race).argmax(-1, keepdim=True)


class _NoTimer:
    """What the loop calls when it is not timed: nothing, so the loop has one code path."""

    times_s, start, stop = None, lambda self: None, lambda self: None


@dataclass
class Generation:
    """What :func:`generate` returns. ``step_s[i]`` times decode step i, over ``prompt_len + i + 1``
    slots (``timed=True`` looks for EOS at every step); ``cache`` holds all tokens but the last.
    ``cached_tokens``: prompt tokens a prefix cache held, not computed. Prompt lookup counts its
    ``forwards`` after the prefill, and the guesses ``drafted`` and ``accepted``."""

    tokens: list[int]
    prompt_len: int
    cache: Cache
    prefill_s: float | None = None
    step_s: list[float] | None = None
    logits: list[torch.Tensor] | None = None
    cached_tokens: int = 0
    forwards: int | None = None
    drafted: int | None = None
    accepted: int | None = None


def _cache(model, cache, step, max_seq: int) -> Cache:
    """The cache a request runs over: made from a name, a StaticStep's own, or the one passed."""
    if isinstance(step, StaticStep):
        if cache not in ("prealloc", step.cache):
            raise ValueError("a StaticStep brings its own cache: pass cache='prealloc' or "
                             "step.cache")
        return step.cache
    if cache == "prealloc":
        return KVCache.for_model(model.config, max_seq, device=model.device, dtype=model.dtype)
    if cache == "cat":
        return CatCache.for_model(model.config, device=model.device, dtype=model.dtype)
    if isinstance(cache, str) or not isinstance(cache, Cache):
        raise ValueError(f"cache must be 'prealloc', 'cat' or a cache object, not {cache!r}")
    return cache


def _decode_step(model, cache: Cache, step, bucket: int):
    """``decode(tokens [B, 1], caches, positions) -> logits [B, V]`` for the chosen kind of step."""
    if step == "eager":
        return lambda tokens, caches, pos: forward(model, list(tokens.split(1)), caches, pos)
    if isinstance(step, StaticStep) or step in ("static", "graph"):  # one request: B = 1
        static = step if isinstance(step, StaticStep) else StaticStep(model, cache, bucket=bucket,
                                                                       capture=step == "graph")
        return lambda tokens, caches, pos: static(tokens, pos[0])
    raise ValueError(f"step must be 'eager', 'static' or 'graph', not {step!r}")


def _check_request(model, ids: torch.Tensor, cache: Cache, max_new_tokens: int, prefill_chunk,
                   extrapolate: bool, who: str = "") -> None:
    """Refuse, with the numbers, a request past the cache's slots or the model's positions."""
    n, start = ids.shape[1], cache.seq_len
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"{who}need a prompt and max_new_tokens >= 1, "
                         f"got {n} prompt tokens, {max_new_tokens}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"{who}prefill_chunk must be >= 1, got {prefill_chunk}")
    end = start + n + max_new_tokens
    if cache.max_seq is not None and end > cache.max_seq:
        raise ValueError(f"{who}KV overflow: {start} cached + {n} prompt + {max_new_tokens} new "
                         f"tokens > max_seq={cache.max_seq}")
    trained = getattr(model.config, "max_position_embeddings", None)
    last = end - 2  # the last new token is never fed back
    if getattr(cache, "positions", "absolute") == "cache":  # RoPE sees the ring's places only
        step = prefill_chunk or n  # each prefill chunk, then the last decode step
        reads = [(start + c, min(step, n - c)) for c in range(0, n, step)] + [(end - 2, 1)]
        last = min(last, max(len(cache.places(s, k)) for s, k in reads) - 1)
    if trained and last >= trained and not extrapolate:
        raise ValueError(f"{who}{start} cached + {n} prompt + {max_new_tokens} new tokens reach "
                         f"position {last}, past max_position_embeddings={trained}, the longest "
                         f"this model was trained for; pass extrapolate=True to see what it does "
                         f"there")


@torch.no_grad()
def generate(model, input_ids, max_new_tokens, *, cache="prealloc",
             max_seq: int | None = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, eos_token_id="auto",
             prefill_chunk: int | None = None, step="eager", bucket: int = 256, timed: bool = False,
             return_logits: bool = False, on_step=None, extrapolate: bool = False,
             prompt_lookup_num_tokens: int | None = None):
    """Generate up to ``max_new_tokens`` after ``input_ids`` ``[1, n]`` (or ``[n]``).

    ``cache``: ``"prealloc"`` (``max_seq`` slots, default prompt + new tokens), ``"cat"``, or a
    cache object, continued from its ``seq_len``. ``prefill_chunk`` bounds the prefill's workspace.
    A request past ``max_position_embeddings`` is refused unless ``extrapolate``. A list of prompts
    is a ragged batch: each request keeps its own length, EOS, ``max_new_tokens`` and cache.

    ``step``: ``"eager"`` slices attention to the length; ``"static"`` reads fixed spans of
    ``bucket`` slots with a mask; ``"graph"`` replays those as CUDA graphs; a :class:`StaticStep`
    keeps its graphs from one request to the next. These run one request; the eager step's
    unmasked attention may differ from them in the last bits (in bf16 that can flip a token).

    ``prompt_lookup_num_tokens=k``: greedy, one eager request, up to ``k`` tokens guessed from the
    text and verified per forward (:mod:`kvlib.speculative`); the cache must offer ``crop``.
    """
    check_supported(model, window=getattr(cache, "window", None))  # a ring cache has one
    device = model.device
    batch = isinstance(input_ids, (list, tuple))
    for x in input_ids if batch else [input_ids]:
        if x.dim() > 2 or (x.dim() == 2 and x.shape[0] != 1):
            raise ValueError(f"one prompt per request: input_ids is {list(x.shape)}, expected "
                             f"[1, n] or [n]; pass a list of prompts for a batch")
    ids = [x.reshape(1, -1).to(device) for x in (input_ids if batch else [input_ids])]
    B, lens = len(ids), [x.shape[1] for x in ids]
    news = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * B
    given = list(cache) if isinstance(cache, (list, tuple)) else [cache] * B
    if B == 0 or len(news) != B or len(given) != B or (B > 1 and step != "eager"):
        raise ValueError(f"a batch of {B} requests needs {B} max_new_tokens and {B} caches (got "
                         f"{len(news)} and {len(given)}) and step='eager' (got {step!r})")
    caches = [_cache(model, c, step, max_seq or n + max(m, 1))
              for c, n, m in zip(given, lens, news)]
    if len({id(c) for c in caches}) < B:
        raise ValueError(f"the {B} requests of a batch need a cache each: pass {B} caches")
    for r, (x, c, m) in enumerate(zip(ids, caches, news)):
        who = f"request {r}: " if batch else ""
        _check_request(model, x, c, m, prefill_chunk, extrapolate, who)
    decode = _decode_step(model, caches[0], step, bucket)
    if eos_token_id == "auto":
        eos_token_id = model.generation_config.eos_token_id
    eos = torch.tensor([] if eos_token_id is None else eos_token_id, device=device).long().view(-1)
    generator = None
    if temperature > 0:
        generator = torch.Generator(device).manual_seed(0 if seed is None else seed)
    timer = StepTimer(device) if timed else _NoTimer()
    # A prefix cache (a PagedCache on a prefix-caching pool) may hold the prompt's first blocks.
    cached = [c.reuse(x[0].tolist()) if hasattr(c, "reuse") else 0 for c, x in zip(caches, ids)]
    ids, lens = [x[:, k:] for x, k in zip(ids, cached)], [n - k for n, k in zip(lens, cached)]
    if prompt_lookup_num_tokens:
        if B > 1 or temperature or step != "eager" or timed or return_logits or on_step:
            raise ValueError(f"prompt lookup runs one greedy eager request, untimed: got {B} "
                             f"requests, temperature={temperature}, step={step!r}")
        start = caches[0].seq_len
        tokens, stats = lookup(model, ids[0], caches[0], news[0], prompt_lookup_num_tokens,
                               eos.tolist(), prefill_chunk)
        if hasattr(caches[0], "remember"):
            caches[0].remember(ids[0][0].tolist() + tokens, start)
        return Generation(tokens, lens[0] + cached[0], caches[0], cached_tokens=cached[0], **stats)

    # 1. Prefill, in chunks: each chunk's workspace is bounded, whatever the prompt's length. A
    #    batch packs every request's next chunk into one forward.
    starts = [c.seq_len for c in caches]
    chunk, last = prefill_chunk or max(lens), {}
    timer.start()
    for s in range(0, max(lens), chunk):
        live = [r for r in range(B) if s < lens[r]]
        rows = forward(model, [ids[r][:, s : s + chunk] for r in live], [caches[r] for r in live],
                       [starts[r] + s for r in live])
        last.update(zip(live, rows))
    timer.stop()
    logits = torch.stack([last[r] for r in range(B)])  # [B, V]

    # 2. Decode: pick on the device, feed it back; look for EOS every EOS_CHECK_EVERY steps.
    out = torch.full((B, max(news)), -1, dtype=torch.long, device=device)  # -1: not made
    kept_logits = [[] for _ in range(B)] if return_logits else None
    pos = [s + n for s, n in zip(starts, lens)]
    active, made = list(range(B)), 0  # every running request has made `made` tokens
    rows = torch.arange(B, device=device)  # `active` on the device: a list index waits on a copy
    while active:
        nxt = _pick(logits, temperature, top_k, top_p, generator)  # [b, 1]: b requests running
        out[rows, made] = nxt[:, 0]
        made += 1
        for i, r in enumerate(active if kept_logits is not None else ()):
            kept_logits[r].append(logits[i].float().cpu())
        done = [made == news[r] for r in active]
        if eos.numel() and (timed or made % EOS_CHECK_EVERY == 0):
            seen = torch.isin(out[rows, :made], eos).any(1).tolist()
            done = [d or e for d, e in zip(done, seen)]
        if any(done):
            keep = [i for i, d in enumerate(done) if not d]
            nxt, rows, active = nxt[keep], rows[keep], [active[i] for i in keep]
        if not active:
            break
        timer.start()
        logits = decode(nxt, [caches[r] for r in active], [pos[r] for r in active])
        for r in active:
            pos[r] += 1
        timer.stop()
        if on_step:
            on_step(made - 1, [pos[r] for r in active] if batch else pos[0])

    # 3. Drop the steps past an EOS seen late, and their slots.
    stops, times, rows = set(eos.tolist()), timer.times_s, out.tolist()
    gens = []
    for r in range(B):
        tokens = [t for t in rows[r] if t >= 0]
        first = next((i for i, t in enumerate(tokens) if t in stops), None)
        if first is not None:
            tokens = tokens[: first + 1]
            caches[r].seq_len = starts[r] + lens[r] + len(tokens) - 1
        logits = None if kept_logits is None else kept_logits[r][: len(tokens)]
        if hasattr(caches[r], "remember"):  # a prefix cache keeps the full blocks of this request
            caches[r].remember(ids[r][0].tolist() + tokens, starts[r])
        gens.append(Generation(tokens=tokens, prompt_len=lens[r] + cached[r], cache=caches[r],
                               cached_tokens=cached[r], logits=logits,
                               prefill_s=times[0] if times else None,
                               step_s=times[1 : len(tokens)] if times else None))
    return gens if batch else gens[0]
