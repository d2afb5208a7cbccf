"""Notebook 09's exercise checks, and the wrong answers each must catch."""

from exercises import nb09
from helpers import check_tests


def trade_no_attention(config, dtype, n):  # the weights alone
    flops, nbytes = nb09.prefix_trade_solution(config, dtype, n)
    L, hq, D = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    return flops - L * hq * 4 * D * n * (n + 1) // 2, nbytes


def trade_not_causal(config, dtype, n):  # every token reads all n keys
    flops, nbytes = nb09.prefix_trade_solution(config, dtype, n)
    L, hq, D = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    return flops - L * hq * 4 * D * n * (n + 1) // 2 + L * hq * 4 * D * n * n, nbytes


def trade_k_only(config, dtype, n):  # keys, not values
    flops, nbytes = nb09.prefix_trade_solution(config, dtype, n)
    return flops, nbytes // 2


def trade_one_layer(config, dtype, n):
    flops, nbytes = nb09.prefix_trade_solution(config, dtype, n)
    return flops, nbytes // config.num_hidden_layers


def trade_flops_per_token(config, dtype, n):  # one token's FLOPs, not the prefix's
    flops, nbytes = nb09.prefix_trade_solution(config, dtype, 1)
    return flops, nbytes * n


def kept_no_bonus(guesses, picks):
    return nb09.kept_solution(guesses, picks)[:-1]


def kept_every_match(guesses, picks):  # matches past a disagreement too
    return [g for g, p in zip(guesses, picks) if g == p] + picks[-1:]


def kept_guess_at_mismatch(guesses, picks):  # the wrong guess instead of the model's pick
    kept = nb09.kept_solution(guesses, picks)
    return guesses[: len(kept)] if len(kept) <= len(guesses) else kept


CASES = [
    (nb09.check_prefix_trade, nb09.prefix_trade_solution,
     [trade_no_attention, trade_not_causal, trade_k_only, trade_one_layer, trade_flops_per_token]),
    (nb09.check_kept, nb09.kept_solution, [kept_no_bonus, kept_every_match,
                                           kept_guess_at_mismatch]),
]

test_check = check_tests(nb09, CASES)
