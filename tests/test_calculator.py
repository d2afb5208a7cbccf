"""Notebook 06's budget calculator: which limit it names, how its lines wrap, and where its bar
puts each segment's number (issue 26: labels ran onto the axis, a neighbour, the "over by" note;
issue 34: two "over" numbers that did not say what each measures, lines through the numbers, a KV
segment too thin to see with nothing saying so)."""

import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from course import nb06, plots
from kvlib.budget import plan_budget
from kvlib.config import GIB, load_config

LABEL = "test label"


def legend(fig) -> list[str]:
    return [t.get_text() for t in fig.legends[0].get_texts()]


def test_weights_over_the_budget_are_named_with_their_size_and_the_excess():
    lines, budget, _ = nb06.calculator_lines("qwen3-4b", "float32", budget_gib=4.0)
    text = " ".join(" ".join(lines).split())
    over = (budget.weights - budget.budget) / GIB
    weights = (f"the weights alone, at {budget.weights / GIB:.2f} GiB, exceed the budget by "
               f"{over:.2f} GiB")
    assert weights in text
    assert "longest context" not in text  # not "longest context 0 tokens"


@pytest.mark.parametrize("args", [dict(dtype="float32"), dict(context=65536)])
def test_the_text_and_the_bar_say_over_by_the_same_number_for_the_same_thing(args):
    lines, b, where = nb06.calculator_lines(**args)
    context = args.get("context", 8192)
    short = -b.breakdown(context)["free"] / GIB
    note = f"over by {short:.2f} GiB in all"
    text = " ".join(" ".join(lines).split())
    assert (f"at {context:,} tokens (the bar): weights, KV and workspace need "
            f"{b.budget / GIB + short:.2f} GiB, {note}") in text
    fig = plots.budget_bar([("12 GiB", b)], context, where)
    assert [t.get_text() for t in fig.axes[0].texts if "over" in t.get_text()] == [f" {note}"]


def test_a_context_that_fits_has_no_over_line():
    lines, _, _ = nb06.calculator_lines(context=8192)
    assert "over by" not in " ".join(lines)


def test_a_part_too_thin_to_see_says_so_with_its_size():
    b = plan_budget(load_config("qwen3-4b"), torch.bfloat16, 12 * GIB)
    thin = plots.budget_bar([("12 GiB", b)], 256, LABEL)
    kv = b.breakdown(256)["kv"] / plots.MIB
    assert f"KV cache ({kv:.0f} MiB, too thin to see)" in legend(thin)
    seen = plots.budget_bar([("12 GiB", b)], 8192, LABEL)
    assert "KV cache" in legend(seen)  # 1.12 GiB: drawn, and named plainly


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


@pytest.mark.parametrize("name, dtype, gib, context, batch", CASES + [
    ("qwen3-4b", torch.bfloat16, 12, 65536, 1)])  # the budget tick crosses the KV's number
def test_no_line_runs_through_a_segment_number(name, dtype, gib, context, batch):
    # Every pixel under a number is its segment's colour, the text's black, or a blend of the two
    # (antialiasing): the grid and the budget tick, lighter or red, would leave other pixels.
    b = plan_budget(load_config(name), dtype, gib * GIB, batch=batch)
    fig = plots.budget_bar([(f"{gib} GiB", b)], context, LABEL)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    image = np.asarray(canvas.buffer_rgba())[..., :3].astype(float)
    ax = fig.axes[0]
    for text in (t for t in ax.texts if "over by" not in t.get_text()):
        x, _ = text.get_position()
        (bar,) = [p for p in ax.patches if p.get_x() < x < p.get_x() + p.get_width()]
        colour = np.array(bar.get_facecolor()[:3]) * 255
        box = text.get_window_extent(canvas.get_renderer())
        rows = slice(image.shape[0] - int(box.y1), image.shape[0] - int(box.y0))
        pixels = image[rows, int(box.x0):int(box.x1)].reshape(-1, 3)
        share = np.clip(pixels @ colour / (colour @ colour), 0, 1)[:, None]  # black 0, colour 1
        off = np.abs(pixels - share * colour).max()
        assert off < 12, f"{text.get_text()}: a pixel {off:.0f}/255 off its segment's colour"
