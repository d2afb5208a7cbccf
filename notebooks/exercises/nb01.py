"""Exercises of notebook 01 (no cache): checks and reference solutions.

Everything is arithmetic on the shipped configs, so the checks print the same thing on every
machine.
"""

from __future__ import annotations

import torch

from kvlib.bandwidth import decode_bytes
from kvlib.budget import param_count
from kvlib.config import head_dim, load_config

from .checking import attempt, check, expect, hint

# --- 1. multiply-adds of one no-cache step -----------------------------------------------


def step_macs_solution(config, S: int) -> int:
    """Multiply-adds of one forward over S tokens (no cache), logits for all S positions.

    Per token and layer: q and o projections (hidden x Hq*D each), k and v (hidden x
    Hkv*D each), the gated MLP (three hidden x intermediate matrices). Attention:
    every query head scores S keys and mixes S values, D each, for S queries (the full
    S x S, as a plain kernel computes it). The head: hidden x vocab per position.
    Norms, RoPE, softmax, biases and the embedding lookup are left out.
    """
    h, L, D = config.hidden_size, config.num_hidden_layers, head_dim(config)
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    per_token_layer = 2 * h * hq * D + 2 * h * hkv * D + 3 * h * config.intermediate_size
    attention = 2 * L * hq * D * S * S
    head = S * h * config.vocab_size
    return S * L * per_token_layer + attention + head


@check
def check_step_macs(fn) -> str:
    """``fn(config, S)`` -> multiply-adds of one no-cache forward over S tokens.

    When right, a second line compares the count with the notebook's formula: the question the
    exercise asks. Arithmetic on the shipped configs only, so it is the same on every machine.
    """
    for name in ("smollm2-135m", "qwen3-4b"):
        config = load_config(name)
        L, D = config.num_hidden_layers, head_dim(config)
        for S in (1, 100, 4096):
            got = attempt(fn, config, S)
            want = step_macs_solution(config, S)
            attention = 2 * L * config.num_attention_heads * D * S * S
            gqa_attention = 2 * L * config.num_key_value_heads * D * S * S
            expect(got == want,
                   f"{name}, S={S}: you counted {got:,} multiply-adds, expected {want:,} "
                   f"({got / want:.3f}x).",
                   hint(got, {
                       2 * want: "That is FLOPs: count one multiply-add once, not twice.",
                       want - attention: "Attention is missing: Q.K^T and softmax(scores).V, an "
                                         "S x S matrix per query head and layer.",
                       want - attention // 2: "Attention has two products per head: Q.K^T and "
                                              "then softmax(scores).V.",
                       want - attention + gqa_attention: "Scores are computed per *query* head "
                                                         "(GQA shares K/V, not the work).",
                       want - S * config.hidden_size * config.vocab_size:
                           "The output head (hidden x vocab, for every position) is missing.",
                   }))
    ratios = ", ".join(
        f"{name} {2 * fn(load_config(name), 1024) / step_flops(load_config(name), 1024):.4f}"
        for name in ("smollm2-135m", "qwen3-4b")
    )
    return (f"twice your count / (2 x params x S + attention) at S=1024: {ratios} "
            "(params also hold norms, which do no matrix products)")


# --- 2. total FLOPs of n tokens after a prompt of p, in closed form ----------------------


def step_flops(config, S: int) -> int:
    """The notebook's prediction: 2 x params x S, plus attention's 4 x L x Hq x D x S^2."""
    a = 2 * param_count(config)
    b = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim(config)
    return a * S + b * S * S


def total_flops_solution(config, p: int, n: int) -> int:
    """The n forwards run over p, p+1, ..., p+n-1 tokens: sum a*S + b*S^2 in closed form."""
    a = 2 * param_count(config)
    b = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim(config)

    def squares(m: int) -> int:  # 0^2 + 1^2 + ... + m^2
        return m * (m + 1) * (2 * m + 1) // 6

    s1 = n * p + n * (n - 1) // 2  # p + (p+1) + ... + (p+n-1)
    s2 = squares(p + n - 1) - squares(p - 1)
    return a * s1 + b * s2


CASES = [(1, 1), (37, 48), (512, 128), (1, 4096), (30000, 1000)]


@check
def check_total_flops(fn) -> None:
    """``fn(config, p, n)`` -> FLOPs of generating n tokens after p prompt tokens, no cache."""
    for name in ("smollm2-135m", "qwen3-4b"):
        config = load_config(name)
        for p, n in CASES:
            got = attempt(fn, config, p, n)
            want = sum(step_flops(config, S) for S in range(p, p + n))  # the plain sum
            shifted = sum(step_flops(config, S) for S in range(p + 1, p + n + 1))
            expect(abs(got - want) <= 1e-9 * want,
                   f"{name}, p={p}, n={n}: you said {got:.6g} FLOPs, the sum of step_flops over "
                   f"S = p..p+n-1 is {want:.6g} ({got / want:.4f}x).",
                   hint(got, {shifted: "Off by one: the first forward runs over the p prompt "
                                       "tokens, the last over p+n-1."}))


# --- 3. the smallest prefill chunk that is compute-bound on a card ----------------------


def intensity(config, dtype: torch.dtype, n: int, S: int) -> float:
    """The notebook's arithmetic intensity: FLOPs of n new tokens over S slots per byte moved.

    FLOPs, as the notebook's ``forward_flops`` counts them for ``kvlib.forward``: every weight but
    the embedding and the head with all n tokens; the head (hidden x vocab) once, since only the
    last position's logits are computed; attention's 4 x L x Hq x D x n x S. Bytes: every weight
    once and the K/V of the S slots (``decode_bytes``), whatever n is.
    """
    L, H, D = config.num_hidden_layers, config.num_attention_heads, head_dim(config)
    head = config.vocab_size * config.hidden_size
    tied = config.tie_word_embeddings  # the embedding is a lookup: no FLOPs
    body = param_count(config) - head * (1 if tied else 2)
    flops = 2 * body * n + 2 * head + 4 * L * H * D * n * S
    return flops / decode_bytes(config, dtype, S)


def min_chunk_solution(config, dtype: torch.dtype, peak_flops: float, bandwidth: float) -> int:
    """Smallest n with ``intensity(config, dtype, n, n) >= peak_flops / bandwidth``.

    The intensity grows with n (more FLOPs for the same weight bytes), so double until the ridge is
    reached, then bisect.
    """
    ridge = peak_flops / bandwidth

    def reaches(n):
        return intensity(config, dtype, n, n) >= ridge

    high = 1
    while not reaches(high):
        high *= 2
    low = high // 2  # does not reach (or is 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if reaches(mid) else (mid, high)
    return high


# imaginary cards: (peak FLOP/s, bandwidth bytes/s); some models need more than 512 on the last
CARDS = [
    (20e12, 300e9), (100e12, 1e12), (400e12, 2e12), (200e9, 20e9), (1000e12, 3e12)]
CHUNK_MODELS = [("qwen3-4b", torch.bfloat16), ("smollm2-135m", torch.float32),
                ("smollm2-135m", torch.bfloat16)]


@check
def check_min_chunk(fn) -> str:
    """``fn(config, dtype, peak_flops, bandwidth)`` -> the smallest compute-bound prefill chunk.

    When right, the note answers the exercise's guess: each card's smallest chunk per model, and
    where a 512-token chunk falls short of the ridge. Arithmetic only: the same on every machine.
    """
    for name, dtype in CHUNK_MODELS:
        config = load_config(name)
        for peak, bandwidth in CARDS:
            got = int(attempt(fn, config, dtype, peak, bandwidth))
            want = min_chunk_solution(config, dtype, peak, bandwidth)
            ridge = peak / bandwidth
            weights_only = -(-ridge * dtype.itemsize // 2)  # 2n / elt >= ridge, K/V left out
            reached = intensity(config, dtype, max(got, 1), max(got, 1))
            expect(got == want,
                   f"{name} in {str(dtype).removeprefix('torch.')} on a card of {peak / 1e12:g} "
                   f"TFLOP/s and {bandwidth / 1e9:g} GB/s (ridge {ridge:.1f} FLOP/B): you said "
                   f"n={got}, whose intensity is {reached:.2f}; the smallest n that reaches the "
                   f"ridge is {want}.",
                   hint(got, {want - 1: "Off by one: the chunk must reach the ridge.",
                              weights_only: "Close: that is 2n / bytes per element; the head (run "
                                            "once), the K/V bytes and the attention FLOPs count "
                                            "too (use intensity)."}))
    return min_chunk_note(CHUNK_MODELS, CARDS, chunk=512)


def min_chunk_note(models, cards, chunk: int) -> str:
    """One line: each card's smallest chunk past its ridge, per model; where ``chunk`` is short."""
    short, rows = [], []
    for name, dtype in models:
        dt = str(dtype).removeprefix("torch.")
        config = load_config(name)
        needed = [min_chunk_solution(config, dtype, peak, bandwidth) for peak, bandwidth in cards]
        rows.append(f"{name} {dt} {', '.join(str(n) for n in needed)}")
        short += [f"{name} {dt} on the card of ridge {peak / bandwidth:.4g}"
                  for (peak, bandwidth), n in zip(cards, needed) if n > chunk]
    ridges = ", ".join(f"{peak / bandwidth:.4g}" for peak, bandwidth in cards)
    return (f"smallest chunk past the ridge, card by card in the exercise's order (ridges {ridges} "
            f"FLOP/B): {'; '.join(rows)}. "
            f"A {chunk}-token chunk is past the ridge in every case"
            + (f" but {', '.join(short)}" if short else ""))
