"""Exercises of notebook 09 (reuse and rollback): checks and reference solutions.

Checks run on shipped configs and plain lists, so they print the same thing on every machine.
"""

from __future__ import annotations

import torch

from kvlib.config import head_dim, kv_heads, kv_token_bytes, load_config

from .checking import attempt, check, expect, hint

# --- 1. (core) when caching a prefix pays: prefill FLOPs saved against bytes kept ---------------


def prefix_trade_solution(config, dtype: torch.dtype, n: int) -> tuple[int, int]:
    """``(FLOPs a hit on an n-token prefix saves, bytes the cache keeps for it)``.

    The prefill of ``n`` tokens multiplies each by every weight matrix of every layer (2 FLOPs a
    weight a token; the head runs on the last token only, and is needed anyway), and each token
    ``i`` attends over ``i + 1`` keys: ``Q K^T`` and ``A V`` take ``2 D`` FLOPs a key each, per
    query head. The cache keeps K and V of the ``n`` tokens, every layer.

    The prediction: the ratio rises with ``n``, since attention's FLOPs per token grow with the
    prefix and the bytes per token do not. Qwen3-4B in bf16: about 49,300 FLOPs per byte at
    ``n = 1``, about 57,500 at 4,096 (1.17x): attention adds about a sixth.
    """
    L, d, inter = config.num_hidden_layers, config.hidden_size, config.intermediate_size
    hq, hkv, D = config.num_attention_heads, kv_heads(config), head_dim(config)
    weights = L * (d * hq * D + 2 * d * hkv * D + hq * D * d + 3 * d * inter)  # q, k, v, o; MLP
    attention = L * hq * 4 * D * n * (n + 1) // 2  # sum over i of (i + 1) keys
    return 2 * weights * n + attention, n * kv_token_bytes(L, hkv, D, dtype)


TRADE_CASES = [("smollm2-135m", torch.float32, 1), ("smollm2-135m", torch.float32, 600),
               ("qwen3-4b", torch.bfloat16, 4096)]


@check
def check_prefix_trade(fn) -> None:
    """``fn(config, dtype, n)`` -> ``(flops_saved, bytes_kept)``, on two models and three n."""
    for name, dtype, n in TRADE_CASES:
        config = load_config(name)
        flops, nbytes = prefix_trade_solution(config, dtype, n)
        got = attempt(fn, config, dtype, n)
        expect(isinstance(got, tuple) and len(got) == 2,
               f"{name}, n={n}: return (flops_saved, bytes_kept), not {got!r}.")
        expect(got[1] == nbytes, f"{name} in {dtype}, n={n}: bytes kept {got[1]:,}, expected "
               f"{nbytes:,}.", hint(got[1], {nbytes // 2: "K and V: two tensors a layer.",
                                             nbytes // config.num_hidden_layers: "Every layer."}))
        expect(abs(got[0] - flops) <= 1e-6 * flops,
               f"{name}, n={n}: FLOPs saved {got[0]:,.0f}, expected {flops:,.0f}.",
               " Attention grows with n squared: token i reads i + 1 keys." if n > 1 else "")


# --- 2. the verify rule of greedy speculative decoding ------------------------------------------


def kept_solution(guesses: list[int], picks: list[int]) -> list[int]:
    """The tokens one verify forward adds. ``picks[i]`` is the model's greedy token after the last
    token and ``guesses[:i]`` (``len(picks) == len(guesses) + 1``): keep guesses while each equals
    the model's pick there, then add the model's own pick at the first disagreement (or after the
    last guess). Every token kept is one greedy would have made.

    Why a pick after a wrong guess is thrown away: it was computed with the wrong token in its
    context, so it is what the model would say after a text that will not exist. It may equal
    the next guess by chance and still not be greedy's token."""
    agree = next((i for i, (g, p) in enumerate(zip(guesses, picks)) if g != p), len(guesses))
    return picks[: agree + 1]


KEPT_CASES = [([], [7]), ([5, 6, 7], [5, 6, 7, 8]), ([5, 6, 7], [5, 9, 7, 8]),
              ([5, 6, 7], [4, 6, 7, 8]), ([1, 1], [1, 1, 1])]


@check
def check_kept(fn) -> None:
    """``fn(guesses, picks)`` -> the tokens kept, on five verify forwards."""
    for guesses, picks in KEPT_CASES:
        want = kept_solution(guesses, picks)
        got = attempt(fn, list(guesses), list(picks))
        matches = tuple(g for g, p in zip(guesses, picks) if g == p) + tuple(picks[-1:])
        expect(list(got) == want, f"guesses {guesses}, picks {picks}: you kept {got}, expected "
               f"{want}.", hint(tuple(got), {
                   tuple(want[:-1]): "The forward also gives the model's own next token: keep it.",
                   matches: "Stop at the first disagreement: later picks assumed wrong tokens."}))
