"""Speculative decoding without a draft model: prompt lookup.

A decode step reads every weight to make one token, and the reading, not the arithmetic, sets its
time. A forward over ``1 + g`` tokens reads them once too, so it costs little more, if ``g`` tokens
worth checking can be guessed for free. Prompt lookup guesses them from the text itself: find the
last few tokens earlier in the prompt or the output, and propose what followed them there
(transformers' ``prompt_lookup_num_tokens``). One forward scores every guess; greedy keeps the
guesses the model agrees with, plus the model's own next token, so the tokens are plain greedy's.
The cache then holds the K/V of rejected guesses: ``crop`` rolls it back."""

import torch

from .contract import Rollback, Window, offers
from .decoder import forward_unchecked
from .latent_cache import LatentCache

__all__ = ["NGRAM", "check_lookup", "lookup", "propose"]

NGRAM = 3  # the longest n-gram looked up; shorter ones are tried when it is not found


def propose(history: list[int], k: int, ngram: int = NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n-gram of
    ``history``, the longest n (``ngram`` down to 1) that occurred; none if none did."""
    seq = torch.tensor(history)
    for n in range(min(ngram, len(history) - 1), 0, -1):
        earlier = seq.unfold(0, n, 1)[:-1]  # every n-gram but the last itself, [T - n, n]
        if len(hits := (earlier == seq[-n:]).all(1).nonzero()):
            after = int(hits[-1]) + n
            return history[after : after + k]
    return []


def _room(cache, pos: int, k: int) -> int:
    """Guesses a forward at ``pos`` may write and still be cropped back: all of ``k``, but a ring
    past its window keeps one spare key, so one guess (its rollback needs no overwritten key)."""
    return min(k, max(1, cache.sinks + cache.window - pos - 1)) if offers(cache, Window) else k


def check_lookup(k: int, reqs: list, temperature: float, step, extras) -> None:
    """Refuse what prompt lookup cannot run, before anything changes: one greedy eager request,
    untimed, unobserved, over a cache that crops (not latents: their forward scores one row)."""
    if len(reqs) > 1 or temperature or step != "eager" or extras:
        raise ValueError(f"prompt lookup runs one greedy eager request, untimed: got {len(reqs)} "
                         f"requests, temperature={temperature}, step={step!r}")
    c = reqs[0].cache
    if not isinstance(k, int) or k < 1 or not offers(c, Rollback) or isinstance(c, LatentCache):
        raise ValueError(f"prompt lookup needs k >= 1 (got {k}) and a cache that can crop and "
                         f"score every row (got {type(c).__name__})")


@torch.no_grad()
def lookup(model, request, logits: torch.Tensor, k: int, eos: set[int]) -> tuple[list[int], dict]:
    """Greedy tokens after a prefilled ``request`` (its ``ids``, ``cache`` and ``max_new``; the
    prefill's last ``logits``), up to ``k`` guesses verified per forward, stopping at the first EOS
    made or accepted; and the counts: ``forwards``, guesses ``drafted`` and ``accepted``."""
    cache, ids, max_new = request.cache, request.ids, request.max_new
    history, tokens = ids[0].tolist(), [int(logits.argmax())]
    stats = dict(forwards=0, drafted=0, accepted=0)
    while len(tokens) < max_new and not eos.intersection(tokens):
        pos = cache.seq_len  # the last token's slot: the cache holds everything before it
        left = max_new - len(tokens) - 1  # the forward adds one token of its own
        guess = propose(history + tokens, _room(cache, pos, min(k, left)))
        # row i attends at slot pos+i after rows 0..i-1 wrote theirs; its logits pick token pos+i+1
        feed = [tokens[-1], *guess]
        rows = forward_unchecked(model, [ids.new_tensor([[t]]) for t in feed], [cache] * len(feed),
                                 [pos + i for i in range(len(feed))])
        best = rows.argmax(-1).tolist()
        agree = next((i for i, (g, b) in enumerate(zip(guess, best)) if g != b), len(guess))
        cache.crop(pos + 1 + agree)  # keep the last token and the guesses kept
        tokens += best[: agree + 1]  # the guesses agreed with are the model's own picks
        for key, add in (("forwards", 1), ("drafted", len(guess)), ("accepted", agree)):
            stats[key] += add
    if (stop := next((i for i, t in enumerate(tokens) if t in eos), None)) is not None:
        tokens = tokens[: stop + 1]
        cache.crop(request.fed + len(tokens) - 1)
    return tokens, stats
