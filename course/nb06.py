"""Notebook 06's machinery: the cards figure, what is live at the simulated card's peak, and the
budget calculator; it draws and formats. The notebook keeps what it teaches: the plan and the
bandwidth floor per card, the bisection on the simulated card, the H200 run against its plan."""

import torch
from IPython.display import display
from matplotlib.figure import Figure

from course.simulate import simulate
from kvlib.budget import plan_budget
from kvlib.config import GIB, load_config

from . import WIDTH, plots, wrapped  # noqa: F401 (WIDTH: the calculator's width, tested)

CACHES = ("prealloc", "cat")  # kvlib's two caches
SIM_LABEL = ("simulated card (meta device: exact tensor bytes; no allocator, no fragmentation, "
             "no timing)")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CARDS_LABEL = ("PREDICTION: plan_budget on the qwen3-4b config, and the bandwidth floor (bytes a "
               "decode step moves / the datasheet's GB/s, kvlib.cards); nothing ran on these cards")
PLAN_LABEL = "PREDICTION from the qwen3-4b config (plan_budget: arithmetic; nothing ran) · bfloat16"


def card_dtype(card) -> torch.dtype:
    """kvlib.auto_dtype's pick on a card: bf16 from compute capability 8.0, else fp16."""
    return torch.bfloat16 if card.sm >= 8.0 else torch.float16


def cards_figure(table: dict, window: int, label: str) -> Figure:
    """Two panels, one row per card, prealloc against cat: each cache's longest context (the plan,
    capped at the model's window) and its tokens/s ceiling there."""
    fig, axes = plots.figure("Qwen3-4B on each card: how long a conversation, how fast at most",
                             label, size=(9.0, 4.2), panels=2, sharey=True)
    for ax, shown in zip(axes, (lambda r: r["context"], lambda r: 1e3 / r["ms"])):
        for j, cache in enumerate(CACHES):  # prealloc above cat in each card's row
            values = [shown(row[cache]) for row in table.values()]
            bars = ax.barh([i + (j - 0.5) * 0.4 for i in range(len(table))], values, height=0.38,
                           color=plots.CACHE_COLORS[cache], label=cache)
            ax.bar_label(bars, [f"{v:,.0f}" for v in values], padding=2, fontsize=9)
        ax.grid(False, axis="y")
    axes[0].set_yticks(range(len(table)), list(table))
    axes[0].invert_yaxis()
    axes[0].axvline(window, color="0.3", ls="--", lw=1, label=f"the model's window, {window:,}")
    axes[0].set(xlabel="longest context (tokens)", xlim=(0, 1.3 * window))
    axes[1].set(xlabel="tokens/s at most there (bandwidth floor)")
    axes[1].margins(x=0.12)
    axes[1].legend(*axes[0].get_legend_handles_labels(), fontsize=9, loc="upper right")
    return fig


def live_at_peak(meta, tokens: int, cache: str) -> str:
    """What is live at the peak of the simulated 12 GiB card, by region, in MiB: one line. Of the
    two tail runs ``fits_context`` makes (the longest prompt; the longest whose last chunk is 511
    tokens, an unaligned mask), the one whose peak is higher."""
    prompt = tokens - 4
    partial = prompt - (prompt + 1) % 512
    steps = [4] + ([tokens - partial] if 0 < partial < prompt else [])
    run = max((simulate(meta, tokens, cache=cache, tail=True, decode=d) for d in steps),
              key=lambda r: r.peak)
    parts = ", ".join(f"{region} {nbytes / 2**20:,.0f}" for region, nbytes in run.at_peak.items()
                      if nbytes >= 2**20)
    return f"{cache} at {tokens:,} tokens: peak {run.peak / GIB:.2f} GiB; live then, MiB: {parts}"


def calculator_lines(model="qwen3-4b", dtype="bfloat16", batch=1, context=8192, budget_gib=12.0,
                     block=1, tp=1) -> tuple[list[str], object, str]:
    """(lines, budget, bar label) of the calculator: the longest context with the limit that binds
    (memory, the model's positions, or the weights alone), and a note past the window; budget is
    None where the heads cannot be split ``tp`` ways."""
    config = load_config(model)
    window = config.max_position_embeddings
    try:
        b = plan_budget(config, DTYPES[dtype], int(budget_gib * GIB), batch=batch, block=block,
                        tp=tp)
    except ValueError as err:  # a tp the model's heads cannot be split into
        return [wrapped(f"{model}: {err}")], None, ""
    layout = f" · blocks of {block}" * (block > 1) + f" · tp={tp}, per GPU" * (tp > 1)
    head = f"plan_budget · {model} · {dtype} · batch {batch}{layout} · {budget_gib:g} GiB:"
    over = b.weights - b.budget
    if over > 0:
        answer = (f"no context fits: the weights alone, at {b.weights / GIB:.2f} GiB, exceed the "
                  f"budget by {over / GIB:.2f} GiB")
    elif b.max_context == 0:
        answer = (f"no context fits: the weights, at {b.weights / GIB:.2f} GiB, leave "
                  f"{-over / GIB:.2f} GiB, less than one token's KV and the workspace")
    elif b.max_context <= window:
        answer = f"longest context {b.max_context:,} tokens; the limit: memory"
    else:
        answer = (f"longest context {window:,} tokens; the limit: the model's {window:,} positions "
                  f"(memory alone: {b.max_context:,})")
    lines = [f"{head} {answer}"]
    short = -b.breakdown(context)["free"]
    if short > 0:  # what the bar's "over by" measures: every part at the chosen context
        lines.append(f"at {context:,} tokens (the bar): weights, KV and workspace need "
                     f"{(b.budget + short) / GIB:.2f} GiB, over by {short / GIB:.2f} GiB in all")
    if context > window:
        lines.append(f"{context:,} tokens is past {model}'s window of {window:,}: the bar shows "
                     "what it would take, but the model never saw positions that far")
    label = f"PREDICTION from the {model} config (arithmetic) · {dtype} · batch {batch}{layout}"
    return [wrapped(line) for line in lines], b, label


def calculator(model="qwen3-4b", dtype="bfloat16", batch=1, context=8192, budget_gib=12.0, block=1,
               tp=1) -> None:
    """Print the calculator's answer and draw its bar: what the sliders call."""
    lines, b, where = calculator_lines(model, dtype, batch, context, budget_gib, block, tp)
    print("\n".join(lines))
    if b is not None:
        display(plots.budget_bar([(f"{budget_gib:g} GiB", b)], context, label=where))
