"""course/rounds.py: the order of the rounds, what they keep, the one disturbed-run rule; the
printed-line width; nb09's decode-only rate."""

import torch

from course import WIDTH, rounds, wrapped
from course.nb09 import decode_rates


def test_rounds_rotate_the_order_and_drop_the_warmup():
    order = []
    calls = {k: (lambda k=k: order.append(k) or len(order)) for k in "abc"}
    out = rounds.rounds(calls, n=2, warmup=1)
    assert "".join(order) == "abcbcacab"  # each round starts one case later
    assert out == {"a": [6, 8], "b": [4, 9], "c": [5, 7]}  # round 0 (values 1..3) dropped


def test_a_round_out_of_memory_keeps_nothing_and_the_rest_go_on(capsys):
    seen = []

    def flaky():
        seen.append(1)
        if len(seen) == 2:
            raise torch.OutOfMemoryError("no room")
        return len(seen)

    out = rounds.rounds({"flaky": flaky, "steady": lambda: 0}, n=3)
    assert out == {"flaky": [1, 3], "steady": [0, 0, 0]}
    assert "flaky: out of memory in round 1" in capsys.readouterr().out


def test_one_threshold_flags_a_case_whose_rounds_lie_too_far_apart():
    found = rounds.disturbed({"calm": [1.0, 1.2, 1.49], "busy": [1.0, 1.1, 1.51], "none": []})
    assert found == ["busy: 1.1 (1.0..1.5)"]
    assert rounds.flag_line("x", found) == f"x [{rounds.FLAG}: busy: 1.1 (1.0..1.5)]"
    assert rounds.flag_line("x", []) == "x" and rounds.flag_label("L", []) == "L"
    assert rounds.FLAG in rounds.flag_label("L", found) and "1.5x" in rounds.flag_label("L", found)


def test_wrapped_lines_fit_the_width_and_break_no_word_or_number():
    text = " ".join(f"{n:,} slots, 1|6,384 tokens" for n in range(10_000, 10_040)) + "\nshort"
    out = wrapped(text)
    assert all(len(line) <= WIDTH for line in out.splitlines())
    assert out.split() == text.split()  # the same words in the same order: none cut in two
    assert out.splitlines()[-1] == "short"  # a line of its own stays one


def test_decode_rate_never_divides_by_a_near_zero_time():
    # a loaded machine: two of three first tokens took nearly as long as a whole request, so a
    # median first token would leave 0.01 s of decode (1,600 tokens/s); the fastest leaves 0.40 s
    rates = decode_rates([0.50, 0.52, 0.60], first_s=[0.10, 0.49, 0.55], tokens=17)
    assert rates == [16 / (0.50 - 0.10), 16 / (0.52 - 0.10), 16 / (0.60 - 0.10)]
    assert decode_rates([0.1, 0.1], [0.2, 0.2, 0.2], 17) == [0.0]  # no decode time to read
