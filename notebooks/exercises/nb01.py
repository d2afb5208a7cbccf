"""Exercises of notebook 01 (no cache): checks and reference solutions.

Each ``check_*`` prints exactly ``not attempted yet`` when the learner's function
still raises ``NotImplementedError``, ``correct`` when it is right (``check_step_macs``
adds one line comparing the count with the notebook's formula), and otherwise a
message naming the numbers that differ. Everything is arithmetic on the shipped
configs, so the checks print the same thing on every machine.
"""

from __future__ import annotations

from kvlib.config import head_dim, load_config
from kvlib.budget import param_count

NOT_ATTEMPTED = "not attempted yet"


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


def check_step_macs(fn) -> None:
    """``fn(config, t)`` -> multiply-adds of one no-cache forward at length t."""
    for name in ("smollm2-135m", "qwen3-4b"):
        config = load_config(name)
        L, D = config.num_hidden_layers, head_dim(config)
        for t in (1, 100, 4096):
            try:
                got = fn(config, t)
            except NotImplementedError:
                print(NOT_ATTEMPTED)
                return
            want = step_macs_solution(config, t)
            if got == want:
                continue
            attention = 2 * L * config.num_attention_heads * D * t * t
            hint = ""
            if got == 2 * want:
                hint = " That is FLOPs: count one multiply-add once, not twice."
            elif got == want - attention:
                hint = " Attention is missing: Q.K^T and P.V, a t x t matrix per query head and layer."
            elif got == want - attention // 2:
                hint = " Attention has two products per head: Q.K^T and then P.V."
            elif got == want - attention + 2 * L * config.num_key_value_heads * D * t * t:
                hint = " Scores are computed per *query* head (GQA shares K/V, not the work)."
            elif got == want - t * config.hidden_size * config.vocab_size:
                hint = " The output head (hidden x vocab, for every position) is missing."
            print(
                f"{name}, t={t}: you counted {got:,} multiply-adds, expected {want:,} "
                f"({got / want:.3f}x).{hint}"
            )
            return
    print("correct")
    # The question the exercise asks: how close is the layer-by-layer count to the notebook's formula?
    # Arithmetic on the shipped configs only, so this line is the same on every machine.
    ratios = ", ".join(
        f"{name} {2 * fn(load_config(name), 1024) / step_flops(load_config(name), 1024):.4f}"
        for name in ("smollm2-135m", "qwen3-4b")
    )
    print(f"twice your count / (2 x params x t + attention) at t=1024: {ratios} "
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


def check_total_flops(fn) -> None:
    """``fn(config, p, n)`` -> FLOPs of generating n tokens after p prompt tokens, no cache."""
    for name in ("smollm2-135m", "qwen3-4b"):
        config = load_config(name)
        for p, n in CASES:
            try:
                got = fn(config, p, n)
            except NotImplementedError:
                print(NOT_ATTEMPTED)
                return
            want = sum(step_flops(config, t) for t in range(p, p + n))  # the plain sum
            if abs(got - want) <= 1e-9 * want:
                continue
            hint = ""
            if got == sum(step_flops(config, t) for t in range(p + 1, p + n + 1)):
                hint = " Off by one: the first forward runs over the p prompt tokens, the last over p+n-1."
            print(
                f"{name}, p={p}, n={n}: you said {got:.6g} FLOPs, the sum of step_flops over "
                f"t = p..p+n-1 is {want:.6g} ({got / want:.4f}x).{hint}"
            )
            return
    print("correct")
