"""The token loop over a list of requests, in phases read one at a time: check (refuse, before any
cache changes), prefill (in chunks), decode (no host sync but a look for EOS every
``EOS_CHECK_EVERY`` steps), finish. One request is a list of one, unwrapped at the public edge."""

import functools
from dataclasses import dataclass

import torch

from .cat_cache import CatCache
from .contract import Cache, PrefixReuse, Window, at_places, check_ids, offers
from .decoder import check_cache, check_supported, forward_unchecked
from .graphs import StaticStep
from .kv_cache import KVCache
from .latent_cache import LatentCache
from .speculative import check_lookup, lookup
from .timing import StepTimer

__all__ = ["generate", "Generation"]

EOS_CHECK_EVERY = 8  # host syncs to look for EOS: one per this many steps, not one per step


def _pick(logits, temperature: float, top_k, top_p, generator) -> torch.Tensor:
    """Next tokens ``[B, 1]`` from ``[B, V]`` logits, on the device, with no host sync."""
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


@dataclass
class _Request:
    """``ids`` ``[1, n]``: the prompt past the ``cached`` tokens, computed from slot ``start``."""

    ids: torch.Tensor
    cache: Cache
    max_new: int
    cached: int = 0
    start: int = 0
    fed = property(lambda self: self.start + self.ids.shape[1])  # the first new token's slot


def _cache(model, cache, step, max_seq: int) -> Cache:
    """The cache a request runs over: made from a name, a StaticStep's own, or the one passed."""
    if isinstance(step, StaticStep):
        if cache not in ("prealloc", step.cache):
            raise ValueError("a StaticStep brings its own cache: pass cache='prealloc' or "
                             "step.cache")
        return step.cache
    if cache == "prealloc":  # latent attention (MLA) preallocates latents, not K and V
        kind = LatentCache if model.config.model_type == "deepseek_v2" else KVCache
        return kind.for_model(model.config, max_seq, device=model.device, dtype=model.dtype)
    if cache == "cat":
        return CatCache.for_model(model.config, device=model.device, dtype=model.dtype)
    if isinstance(cache, str) or not (offers(cache, Cache) or isinstance(cache, LatentCache)):
        raise ValueError(f"cache must be 'prealloc', 'cat' or a cache object, not {cache!r}")
    return cache


def _decode_step(model, cache: Cache, step, bucket: int):
    """``decode(tokens [B, 1], caches, positions) -> logits [B, V]`` for the chosen kind of step."""
    if step == "eager":
        return lambda tokens, caches, pos: forward_unchecked(model, list(tokens.split(1)),
                                                             caches, pos)
    if isinstance(step, StaticStep) or step in ("static", "graph"):  # one request: B = 1
        static = step if isinstance(step, StaticStep) else StaticStep(model, cache, bucket=bucket,
                                                                       capture=step == "graph")
        return lambda tokens, caches, pos: static(tokens, pos[0])
    raise ValueError(f"step must be 'eager', 'static' or 'graph', not {step!r}")


def _check_prompt(model, ids, m, who: str) -> torch.Tensor:
    """A request's prompt as ``[1, n]`` on the model's device, refused unless it is token ids."""
    if not isinstance(ids, torch.Tensor) or ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise ValueError(f"{who}one prompt per request: input_ids is "
                         f"{list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids)}, "
                         f"expected [1, n] or [n]; pass a list of prompts for a batch")
    if not ids.numel() or not isinstance(m, int) or m < 1:
        raise ValueError(f"{who}need a prompt and max_new_tokens >= 1, got {ids.numel()} prompt "
                         f"tokens, {m}")
    check_ids(model, ids := ids.reshape(1, -1).to(model.device), who)
    return ids


def _check_request(model, r: _Request, prefill_chunk, extrapolate: bool, who: str) -> None:
    """Refuse, with the numbers, a cache the model cannot run over, or a request past the cache's
    slots or the model's positions."""
    n, start, cache = r.ids.shape[1], r.cache.seq_len, r.cache
    check_cache(model, cache, who)
    if not isinstance(cache, LatentCache):
        check_supported(model, window=cache.window if offers(cache, Window) else None)
    end = start + n + r.max_new
    if cache.max_seq is not None and end > cache.max_seq:
        raise ValueError(f"{who}KV overflow: {start} cached + {n} prompt + {r.max_new} new "
                         f"tokens > max_seq={cache.max_seq}")
    trained, last = model.config.max_position_embeddings, end - 2  # the last token is not fed
    if at_places(cache):  # RoPE sees the ring's places only
        step = prefill_chunk or n  # each prefill chunk, then the last decode step
        reads = [(start + c, min(step, n - c)) for c in range(0, n, step)] + [(end - 2, 1)]
        last = min(last, max(len(cache.places(s, k)) for s, k in reads) - 1)
    if last >= trained and not extrapolate:
        raise ValueError(f"{who}{start} cached + {n} prompt + {r.max_new} new tokens reach "
                         f"position {last}, past max_position_embeddings={trained}, the longest "
                         f"this model was trained for; pass extrapolate=True to see what it does "
                         f"there")


def _check(model, prompts: list, news, caches, max_seq, step, chunk, extrapolate) -> list:
    """Every request checked whole, before any cache changes: a refusal changes nothing."""
    B = len(prompts)
    news = list(news) if isinstance(news, (list, tuple)) else [news] * B
    caches = list(caches) if isinstance(caches, (list, tuple)) else [caches] * B
    if B == 0 or len(news) != B or len(caches) != B or (B > 1 and step != "eager"):
        raise ValueError(f"a batch of {B} requests needs {B} max_new_tokens and {B} caches (got "
                         f"{len(news)} and {len(caches)}) and step='eager' (got {step!r})")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"prefill_chunk must be an int >= 1, got {chunk!r}")
    who = [f"request {r}: " if B > 1 else "" for r in range(B)]
    ids = [_check_prompt(model, x, m, w) for x, m, w in zip(prompts, news, who)]
    reqs = [_Request(x, _cache(model, c, step, max_seq or x.shape[1] + m), m)
            for x, c, m in zip(ids, caches, news)]
    if len({id(r.cache) for r in reqs}) < B:
        raise ValueError(f"the {B} requests of a batch need a cache each: pass {B} caches")
    if B > 1 and any(isinstance(r.cache, LatentCache) for r in reqs):
        raise ValueError(f"a LatentCache runs one request (the latent forward): got {B}")
    for r, w in zip(reqs, who):
        _check_request(model, r, chunk, extrapolate, w)
    return reqs


def _sampler(device, temperature: float, top_k, top_p, seed):
    """``pick(logits [B, V]) -> [B, 1]``, refusing settings that mean nothing."""
    if temperature < 0 or (top_k or 0) < 0 or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1: got "
                         f"{temperature}, {top_k}, {top_p}")
    generator = torch.Generator(device).manual_seed(seed or 0) if temperature > 0 else None
    return functools.partial(_pick, temperature=temperature, top_k=top_k, top_p=top_p,
                             generator=generator)


def _prefill(model, reqs: list[_Request], chunk, timer) -> torch.Tensor:
    """Every prompt in chunks, each chunk's workspace bounded whatever the prompt's length; a
    batch packs every request's next chunk into one forward. The last logits ``[B, V]``."""
    lens = [r.ids.shape[1] for r in reqs]
    chunk, last = chunk or max(lens), {}
    timer.start()
    for s in range(0, max(lens), chunk):
        live = [i for i, n in enumerate(lens) if s < n]
        rows = forward_unchecked(model, [reqs[i].ids[:, s : s + chunk] for i in live],
                                 [reqs[i].cache for i in live], [reqs[i].start + s for i in live])
        last.update(zip(live, rows))
    timer.stop()
    return torch.stack([last[i] for i in range(len(reqs))])


def _decode(decode, pick, logits, reqs: list[_Request], eos, every: int, timer, kept, on_step):
    """One token a step for every running request: picked on the device and fed back; EOS is
    looked for every ``every`` steps. The tokens ``[B, max_new]``, -1 where none was made."""
    out = torch.full((len(reqs), max(r.max_new for r in reqs)), -1, device=logits.device)
    active, made = list(range(len(reqs))), 0  # every running request has made `made` tokens
    rows = torch.arange(len(reqs), device=logits.device)  # `active` on the device, no copies
    while active:
        nxt = pick(logits)  # [b, 1]: b requests running
        out[rows, made] = nxt[:, 0]
        made += 1
        for i, r in enumerate(active if kept is not None else ()):
            kept[r].append(logits[i].float().cpu())
        done = [made == reqs[r].max_new for r in active]
        if eos.numel() and made % every == 0:
            seen = torch.isin(out[rows, :made], eos).any(1).tolist()
            done = [d or e for d, e in zip(done, seen)]
        if any(done):
            keep = [i for i, d in enumerate(done) if not d]
            nxt, rows, active = nxt[keep], rows[keep], [active[i] for i in keep]
        if not active:
            break
        timer.start()
        logits = decode(nxt, [reqs[r].cache for r in active],
                        [reqs[r].fed + made - 1 for r in active])
        timer.stop()
        if on_step:
            on_step(made - 1, [reqs[r].fed + made for r in active])
    return out


def _finish(r: _Request, made: list[int], stops: set, logits=None, times=None, **counts):
    """The tokens up to the first EOS, the slots past it given back; a prefix cache remembers."""
    tokens = [t for t in made if t >= 0]
    if (first := next((i for i, t in enumerate(tokens) if t in stops), None)) is not None:
        tokens = tokens[: first + 1]
        r.cache.seq_len = r.fed + len(tokens) - 1
    if offers(r.cache, PrefixReuse):
        r.cache.remember(r.ids[0].tolist() + tokens, r.start)
    return Generation(tokens, r.cached + r.ids.shape[1], r.cache, cached_tokens=r.cached,
                      logits=None if logits is None else logits[: len(tokens)],
                      prefill_s=times[0] if times else None,
                      step_s=times[1 : len(tokens)] if times else None, **counts)


@torch.no_grad()
def generate(model, input_ids, max_new_tokens, *, cache="prealloc",
             max_seq: int | None = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, eos_token_id="auto",
             prefill_chunk: int | None = None, step="eager", bucket: int = 256, timed: bool = False,
             return_logits: bool = False, on_step=None, extrapolate: bool = False,
             prompt_lookup_num_tokens: int | None = None):
    """Generate up to ``max_new_tokens`` after ``input_ids`` ``[1, n]`` (or ``[n]``); a list of
    prompts is a ragged batch, each request with its own length, EOS, ``max_new_tokens``, cache.
    All is checked first: a refused call changes no cache.

    ``cache``: ``"prealloc"`` (``max_seq`` slots, default prompt + new tokens; latents for MLA),
    ``"cat"``, or a cache object, continued from its ``seq_len``. ``prefill_chunk`` bounds the
    prefill's workspace. Positions past ``max_position_embeddings`` need ``extrapolate``.
    ``step``: ``"eager"`` slices attention to the length; ``"static"`` reads fixed spans of
    ``bucket`` slots with a mask; ``"graph"`` replays those as CUDA graphs; a :class:`StaticStep`
    keeps its graphs from one request to the next. These run one request; the eager step's
    unmasked attention may differ from them in the last bits (in bf16 that can flip a token).
    ``prompt_lookup_num_tokens=k``: greedy, one eager request, up to ``k`` tokens guessed from the
    text and verified per forward (:mod:`kvlib.speculative`) over a cache that offers ``crop``.
    """
    batch = isinstance(input_ids, (list, tuple))  # the public edge: one request is a list of one
    reqs = _check(model, list(input_ids) if batch else [input_ids], max_new_tokens, cache,
                  max_seq, step, prefill_chunk, extrapolate)
    pick = _sampler(model.device, temperature, top_k, top_p, seed)
    eos_token_id = model.generation_config.eos_token_id if eos_token_id == "auto" else eos_token_id
    eos = torch.tensor([] if eos_token_id is None else eos_token_id, device=model.device).long()
    if prompt_lookup_num_tokens:
        check_lookup(prompt_lookup_num_tokens, reqs, temperature, step, timed or return_logits
                     or on_step)
    decode = _decode_step(model, reqs[0].cache, step, bucket)
    timer = StepTimer(model.device) if timed else _NoTimer()
    for r in reqs:  # a prefix cache may hold the prompt's first blocks
        r.cached = r.cache.reuse(r.ids[0].tolist()) if offers(r.cache, PrefixReuse) else 0
        r.ids, r.start = r.ids[:, r.cached :], r.cache.seq_len
    logits, stops = _prefill(model, reqs, prefill_chunk, timer), set(eos.view(-1).tolist())
    if prompt_lookup_num_tokens:
        made, counts = lookup(model, reqs[0], logits, prompt_lookup_num_tokens, stops)
        return _finish(reqs[0], made, stops, **counts)
    kept = [[] for _ in reqs] if return_logits else None
    if on_step and not batch:
        on_step = functools.partial(lambda f, i, pos: f(i, pos[0]), on_step)
    out = _decode(decode, pick, logits, reqs, eos.view(-1), 1 if timed else EOS_CHECK_EVERY,
                  timer, kept, on_step)
    gens = [_finish(r, row, stops, kept and kept[i], timer.times_s)
            for i, (r, row) in enumerate(zip(reqs, out.tolist()))]
    return gens if batch else gens[0]
