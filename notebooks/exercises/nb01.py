"""Exercises of notebook 01 (no cache): checks and reference solutions.

Everything is arithmetic on the shipped configs, so the checks print the same thing on every
machine.
"""

from __future__ import annotations

from kvlib.config import head_dim, load_config
from kvlib.budget import param_count

from .checking import attempt, check, expect, hint

# --- 1. multiply-adds of one no-cache step -----------------------------------------------


def step_macs_solution(config, t: int) -> int:
    """Multiply-adds of one forward over t tokens (no cache), logits for all t positions.

    Per token and layer: q and o projections (hidden x Hq*D each), k and v (hidden x
    Hkv*D each), the gated MLP (three hidden x intermediate matrices). Attention:
    every query head scores t keys and mixes t values, D each, for t queries (the full
    t x t, as a plain kernel computes it). The head: hidden x vocab per position.
    Norms, RoPE, softmax, biases and the embedding lookup are left out.
    """
    h, L, D = config.hidden_size, config.num_hidden_layers, head_dim(config)
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    per_token_layer = 2 * h * hq * D + 2 * h * hkv * D + 3 * h * config.intermediate_size
    attention = 2 * L * hq * D * t * t
    head = t * h * config.vocab_size
    return t * L * per_token_layer + attention + head


@check
def check_step_macs(fn) -> str:
    """``fn(config, t)`` -> multiply-adds of one no-cache forward at length t.

    When right, a second line compares the count with the notebook's formula: the question the
    exercise asks. Arithmetic on the shipped configs only, so it is the same on every machine.
    """
    for name in ("smollm2-135m", "qwen3-4b"):
        config = load_config(name)
        L, D = config.num_hidden_layers, head_dim(config)
        for t in (1, 100, 4096):
            got = attempt(fn, config, t)
            want = step_macs_solution(config, t)
            attention = 2 * L * config.num_attention_heads * D * t * t
            gqa_attention = 2 * L * config.num_key_value_heads * D * t * t
            expect(got == want,
                   f"{name}, t={t}: you counted {got:,} multiply-adds, expected {want:,} "
                   f"({got / want:.3f}x).",
                   hint(got, {
                       2 * want: "That is FLOPs: count one multiply-add once, not twice.",
                       want - attention: "Attention is missing: Q.K^T and P.V, a t x t matrix "
                                         "per query head and layer.",
                       want - attention // 2: "Attention has two products per head: Q.K^T and "
                                              "then P.V.",
                       want - attention + gqa_attention: "Scores are computed per *query* head "
                                                         "(GQA shares K/V, not the work).",
                       want - t * config.hidden_size * config.vocab_size:
                           "The output head (hidden x vocab, for every position) is missing.",
                   }))
    ratios = ", ".join(
        f"{name} {2 * fn(load_config(name), 1024) / step_flops(load_config(name), 1024):.4f}"
        for name in ("smollm2-135m", "qwen3-4b")
    )
    return (f"twice your count / (2 x params x t + attention) at t=1024: {ratios} "
            "(params also hold norms, which do no matrix products)")


# --- 2. total FLOPs of n tokens after a prompt of p, in closed form ----------------------


def step_flops(config, t: int) -> int:
    """The notebook's prediction: 2 x params x t, plus attention's 4 x L x Hq x D x t^2."""
    a = 2 * param_count(config)
    b = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim(config)
    return a * t + b * t * t


def total_flops_solution(config, p: int, n: int) -> int:
    """The n forwards run over p, p+1, ..., p+n-1 tokens: sum a*t + b*t^2 in closed form."""
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
            want = sum(step_flops(config, t) for t in range(p, p + n))  # the plain sum
            shifted = sum(step_flops(config, t) for t in range(p + 1, p + n + 1))
            expect(abs(got - want) <= 1e-9 * want,
                   f"{name}, p={p}, n={n}: you said {got:.6g} FLOPs, the sum of step_flops over "
                   f"t = p..p+n-1 is {want:.6g} ({got / want:.4f}x).",
                   hint(got, {shifted: "Off by one: the first forward runs over the p prompt "
                                       "tokens, the last over p+n-1."}))
