"""Notebook 06's budget calculator: which limit it names, how its lines wrap, and where its bar
puts each segment's number (issue 26: labels ran onto the axis, a neighbour, the "over by" note)."""

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from course import nb06, plots
from kvlib.budget import plan_budget
from kvlib.config import GIB, load_config

LABEL = "test label"


def test_weights_over_the_budget_are_named_with_their_size_and_the_excess():
    lines, budget, _ = nb06.calculator_lines("qwen3-4b", "float32", budget_gib=4.0)
    text = " ".join(" ".join(lines).split())
    over = (budget.weights - budget.budget) / GIB
    weights = f"the weights, at {budget.weights / GIB:.2f} GiB, exceed the budget by {over:.2f} GiB"
    assert weights in text
    assert "longest context" not in text  # not "longest context 0 tokens"


def test_the_limit_that_binds_is_named():
    memory = " ".join(nb06.calculator_lines()[0])
    window = " ".join(nb06.calculator_lines("smollm2-135m", "float32", context=16384)[0])
    assert "the limit: memory" in " ".join(memory.split())
    assert "the model's 8,192 positions" in " ".join(window.split())
    assert "past smollm2-135m's window" in " ".join(window.split())


@pytest.mark.parametrize("args", [dict(), dict(model="qwen3-4b", dtype="float32", budget_gib=4.0),
                                  dict(context=65536, block=16, tp=2)])
def test_long_lines_wrap_between_words(args):
    lines, _, _ = nb06.calculator_lines(**args)
    words = set(" ".join(lines).split())
    for line in "\n".join(lines).splitlines():
        assert len(line) <= nb06.WIDTH
        assert set(line.split()) <= words  # every piece of a line is a whole word of the text


CASES = [  # (model, dtype, budget GiB, context, batch): the browser's cases, and plain ones
    ("qwen3-4b", torch.float32, 4, 131072, 16),  # bars 60x past the budget
    ("qwen3-4b", torch.float32, 4, 8192, 1),  # the weights alone over
    ("qwen3-4b", torch.bfloat16, 4, 131072, 1),
    ("qwen3-4b", torch.bfloat16, 12, 30976, 1),
    ("smollm2-135m", torch.float32, 12, 16384, 1),
    ("llama-3.2-3b", torch.bfloat16, 80, 2048, 1),  # thin KV and workspace beside a wide free part
]


@pytest.mark.parametrize("name, dtype, gib, context, batch", CASES)
def test_no_segment_number_is_drawn_outside_its_segment(name, dtype, gib, context, batch):
    b = plan_budget(load_config(name), dtype, gib * GIB, batch=batch)
    fig = plots.budget_bar([(f"{gib} GiB", b)], context, LABEL)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw_without_rendering()
    ax = fig.axes[0]
    bars = [p for p in ax.patches if p.get_width() > 0]
    numbers = [t for t in ax.texts if "over by" not in t.get_text()]
    for text in numbers:
        x, _ = text.get_position()
        (bar,) = [p for p in bars if p.get_x() < x < p.get_x() + p.get_width()]  # its segment
        inside, room = text.get_window_extent(renderer), bar.get_window_extent(renderer)
        assert room.x0 <= inside.x0 and inside.x1 <= room.x1, text.get_text()
    frame = ax.get_window_extent(renderer)
    for note in (t for t in ax.texts if "over by" in t.get_text()):
        assert note.get_window_extent(renderer).x1 <= frame.x1  # the note ends inside the axes
    widest = max((p.get_width() for p in bars), default=0)
    assert any(abs(float(t.get_text()) - widest) < 0.006 for t in numbers)  # the widest is labelled
