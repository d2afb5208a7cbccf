"""Speculative decoding without a draft model: prompt lookup.

A decode step reads every weight to make one token, and the reading, not the arithmetic, sets its
time. A forward over ``1 + g`` tokens reads them once too, so it costs little more, if ``g`` tokens
worth checking can be guessed for free. Prompt lookup guesses them from the text itself: find the
last few tokens earlier in the prompt or the output, and propose what followed them there
(transformers' ``prompt_lookup_num_tokens``). One forward scores every guess; greedy keeps the
guesses the model agrees with, plus the model's own next token, so the tokens are plain greedy's.
The cache then holds the K/V of rejected guesses: ``crop`` rolls it back."""

import torch

from .decoder import forward

__all__ = ["NGRAM", "lookup", "propose"]

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
    window = getattr(cache, "window", None)
    return k if window is None else min(k, max(1, cache.sinks + window - pos - 1))


@torch.no_grad()
def lookup(model, ids: torch.Tensor, cache, max_new_tokens: int, k: int, eos: list[int],
           prefill_chunk: int | None = None) -> tuple[list[int], dict]:
    """Greedy tokens after ``ids`` ``[1, n]``, up to ``k`` guesses verified per forward; and the
    counts: ``forwards`` after the prefill, guesses ``drafted`` and ``accepted``."""
    if not hasattr(cache, "crop") or k < 1:
        raise ValueError(f"prompt lookup needs k >= 1 (got {k}) and a cache that can crop "
                         f"(got {type(cache).__name__})")
    start, n, chunk = cache.seq_len, ids.shape[1], prefill_chunk or ids.shape[1]
    for s in range(0, n, chunk):
        logits = forward(model, ids[:, s : s + chunk], cache, start + s)
    history, tokens = ids[0].tolist(), [int(logits.argmax())]
    stats = dict(forwards=0, drafted=0, accepted=0)
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        pos = cache.seq_len  # the last token's slot: the cache holds everything before it
        left = max_new_tokens - len(tokens) - 1  # the forward adds one token of its own
        guess = propose(history + tokens, _room(cache, pos, min(k, left)))
        # row i attends at slot pos+i after rows 0..i-1 wrote theirs; its logits pick token pos+i+1
        feed = [tokens[-1], *guess]
        rows = forward(model, [ids.new_tensor([[t]]) for t in feed], [cache] * len(feed),
                       [pos + i for i in range(len(feed))])
        best = rows.argmax(-1).tolist()
        agree = next((i for i, (g, b) in enumerate(zip(guess, best)) if g != b), len(guess))
        cache.crop(pos + 1 + agree)  # keep the last token and the guesses kept
        tokens += best[: agree + 1]  # the guesses agreed with are the model's own picks
        for key, add in (("forwards", 1), ("drafted", len(guess)), ("accepted", agree)):
            stats[key] += add
    if (stop := next((i for i, t in enumerate(tokens) if t in eos), None)) is not None:
        tokens = tokens[: stop + 1]
        cache.crop(start + n + len(tokens) - 1)
    return tokens, stats
