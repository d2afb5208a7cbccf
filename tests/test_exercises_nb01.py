"""Notebook 01's exercise checks, and the wrong answers each must catch."""


from exercises import nb01
from helpers import check_tests


def flops_not_macs(config, S):
    return 2 * nb01.step_macs_solution(config, S)


def no_attention(config, S):
    L, D = config.num_hidden_layers, nb01.head_dim(config)
    return nb01.step_macs_solution(config, S) - 2 * L * config.num_attention_heads * D * S * S


def looped(config, p, n):  # a loop is slow but right: the check accepts it
    return sum(nb01.step_flops(config, S) for S in range(p, p + n))


def off_by_one(config, p, n):
    return sum(nb01.step_flops(config, S) for S in range(p + 1, p + n + 1))


def linear_only(config, p, n):
    return sum(2 * nb01.param_count(config) * S for S in range(p, p + n))


def chunk_short_by_one(config, dtype, peak, bandwidth):
    return nb01.min_chunk_solution(config, dtype, peak, bandwidth) - 1


def chunk_from_weights_only(config, dtype, peak, bandwidth):  # 2n / elt >= ridge, K/V left out
    return int(-(-peak / bandwidth * dtype.itemsize // 2))


def chunk_linear_search(config, dtype, peak, bandwidth):  # a plain search: the check accepts it
    n = 1
    while nb01.intensity(config, dtype, n, n) < peak / bandwidth:
        n += 1
    return n


CASES = [
    (nb01.check_step_macs, nb01.step_macs_solution, [flops_not_macs, no_attention]),
    (nb01.check_total_flops, nb01.total_flops_solution, [off_by_one, linear_only]),
    (nb01.check_min_chunk, nb01.min_chunk_solution, [chunk_short_by_one, chunk_from_weights_only]),
]

# the ratio the exercise asks about, printed after "correct"
test_check = check_tests(nb01, CASES, notes={nb01.check_step_macs: "S=1024",
                                             nb01.check_min_chunk: "512-token chunk"})


def test_a_loop_is_accepted(capsys):
    nb01.check_total_flops(looped)
    assert capsys.readouterr().out == "correct\n"


def test_closed_form_equals_sum():
    config = nb01.load_config("qwen3-4b")
    for p, n in nb01.CASES:
        assert nb01.total_flops_solution(config, p, n) == looped(config, p, n)


def test_a_plain_search_is_accepted(capsys):
    nb01.check_min_chunk(chunk_linear_search)
    assert capsys.readouterr().out.splitlines()[0] == "correct"


def test_min_chunk_note_answers_the_guess(capsys):
    """The note names each card's chunk and where 512 falls short: the guess, answered."""
    nb01.check_min_chunk(nb01.min_chunk_solution)
    note = capsys.readouterr().out.splitlines()[1]
    for name, dtype in nb01.CHUNK_MODELS:
        config = nb01.load_config(name)
        needed = [nb01.min_chunk_solution(config, dtype, p, b) for p, b in nb01.CARDS]
        assert f"{name} {str(dtype).removeprefix('torch.')} {', '.join(map(str, needed))}" in note
        for (p, b), n in zip(nb01.CARDS, needed):
            named = f"{name} {str(dtype).removeprefix('torch.')} on the card of ridge {p / b:.4g}"
            assert (named in note) == (n > 512), (named, n)


def test_min_chunk_is_the_first_to_reach_the_ridge():
    for name, dtype in nb01.CHUNK_MODELS:
        config = nb01.load_config(name)
        for peak, bandwidth in nb01.CARDS:
            n = nb01.min_chunk_solution(config, dtype, peak, bandwidth)
            assert nb01.intensity(config, dtype, n, n) >= peak / bandwidth
            assert n == 1 or nb01.intensity(config, dtype, n - 1, n - 1) < peak / bandwidth
