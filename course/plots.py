"""One look for every plot of the course, and the figures they are saved as. Figures are built
with :class:`matplotlib.figure.Figure`, not ``pyplot``: no global state, no backend needed
(Agg-safe in CI), and a notebook shows the returned figure once instead of twice. Every plot
carries a ``label`` saying where its numbers were measured (device, memory cap, dtype, versions),
and :func:`save` refuses a figure that does not show it: a reference figure loaded later must say
where it came from."""

import dataclasses
import json
import os
import statistics
import textwrap
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from kvlib.budget import Budget
from kvlib.config import GIB, MIB

# The repo's figures/, found from the package, so notebooks/ and the repo root agree.
FIGURES = Path(__file__).resolve().parent.parent / "figures"
# Where committed GPU runs sit: the bench's own --out, then the GPU check's (./course.sh gpu-check).
GPU_FOLDERS = (FIGURES, FIGURES / "h200")
# One colour per cache in every figure: the preallocated cache green, the copying cat red.
CACHE_COLORS = {"prealloc": "tab:green", "cat": "tab:red", "hf_dynamic": "tab:purple",
                "hf_static": "tab:brown"}


def figure(title: str, label: str | None = None, xlabel: str = "", ylabel: str = "",
           size=(7.0, 4.0), panels: int = 1, rows: int = 1, **subplots):
    """The course's one figure: a bold title; the run's label small under it (one panel) or along
    the foot (several), wrapped to the width (15 characters an inch at 8 points: never clipped);
    ``panels`` axes side by side (in ``rows`` rows), gridded, open at top and right: ``(fig, ax)``
    or ``(fig, [ax, ...])``."""
    fig = Figure(figsize=size, layout="constrained")
    fig.suptitle(title, fontweight="bold")
    axes = list(fig.subplots(rows, panels, squeeze=False, **subplots).flat)
    for ax in axes:
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    if label:
        (axes[0].set_title if len(axes) == 1 else fig.supxlabel)(
            textwrap.fill(label, int(15 * size[0])), fontsize=8, color="0.35")
    return fig, axes[0] if len(axes) == 1 else axes


def _finish(fig: Figure, ax, **legend) -> Figure:
    """Quantities start at zero: a curve that doubles must look doubled."""
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, **legend)
    return fig


def _unit(nbytes: float) -> tuple[float, str]:
    """GiB once numbers reach a GiB, MiB below: the CPU runs are small, the GPU ones not."""
    return (GIB, "GiB") if nbytes >= GIB else (MIB, "MiB")


def memory_vs_tokens(rows_by_name: dict[str, dict[str, list]], label: str,
                     budget_bytes: int | None = None) -> Figure:
    """Allocated (solid) and reserved (dashed) bytes against tokens, one colour a series
    ``{"tokens", "allocated", "reserved"}``; ``reserved`` may be absent (a CPU has no caching
    allocator), and is never below allocated where it is not."""
    scale, unit = _unit(max([budget_bytes or 0, *(max(r.get("reserved") or r["allocated"])
                                                   for r in rows_by_name.values())]))
    fig, ax = figure("Memory while decoding", label, "tokens", unit)
    for name, rows in rows_by_name.items():
        (line,) = ax.plot(rows["tokens"], [b / scale for b in rows["allocated"]],
                          label=f"{name} allocated")
        if rows.get("reserved"):
            ax.plot(rows["tokens"], [b / scale for b in rows["reserved"]], "--",
                    color=line.get_color(), label=f"{name} reserved")
    if budget_bytes is not None:
        ax.axhline(budget_bytes / scale, color="crimson", lw=1,
                   label=f"budget {budget_bytes / scale:.1f} {unit}")
    return _finish(fig, ax)


def time_per_step(series: dict[str, tuple], label: str, title: str = "Time per decode step",
                  ylabel: str = "ms / step", scale: float = 1.0) -> Figure:
    """One line per series against the context it runs at (ms per decode step unless said
    otherwise): ``(tokens, ys)`` or ``(tokens, ys, (low, high))``, the spread of the rounds drawn
    as a band, so a difference smaller than the noise looks like one."""
    fig, ax = figure(title, label, "context (tokens)", ylabel)
    for name, (xs, ys, *spread) in series.items():
        (line,) = ax.plot(xs, [y / scale for y in ys], "o-" if len(xs) < 20 else "-", ms=4,
                          label=name, color=CACHE_COLORS.get(name))
        if spread:
            ax.fill_between(xs, *spread[0], color=line.get_color(), alpha=0.2, lw=0)
    return _finish(fig, ax)


def bytes_per_step(series: dict[str, tuple], label: str) -> Figure:
    """Bytes one decode step allocates for the cache, against the context it runs at."""
    scale, unit = _unit(max((max(b, default=0) for _, b in series.values()), default=0))
    return time_per_step(series, label, "Cache bytes allocated per decode step", unit, scale)


_PARTS = (("weights", "weights", "tab:blue"), ("kv", "KV cache", "tab:orange"),
          ("workspace", "workspace", "tab:purple"), ("free", "free", "0.85"))


def budget_bar(budget: Budget | list[tuple[str, Budget]], context: int, label: str) -> Figure:
    """Stacked bars, one per budget: weights, KV at ``context`` tokens, workspace, free; the
    budget a red tick. A context that does not fit still draws every part, past the tick, and says
    by how much all together are over. A part's number (GiB) is drawn only where it fits inside the
    part as drawn, on a patch of its colour, so no number sits on the axis or a neighbour and
    neither the grid nor the tick runs through it. A part too thin to see says so in the legend."""
    named = [("", budget)] if isinstance(budget, Budget) else list(budget)
    fig, ax = figure(f"Memory budget at {context:,} tokens", label, "GiB", "",
                     size=(7.0, 1.4 + 0.6 * len(named)))
    ax.set_axisbelow(True)
    widest, numbers, notes, most = 0.0, [], [], {}
    for y, (_, b) in enumerate(named):
        parts, left = b.breakdown(context), 0.0
        for part, name, color in _PARTS:
            width, most[name] = max(parts[part], 0) / GIB, max(most.get(name, 0), parts[part])
            (bar,) = ax.barh(y, width, left=left, color=color, edgecolor="white", label=name)
            if width > 0:
                text = ax.text(left + width / 2, y, f"{width:.2f}", ha="center", va="center",
                               fontsize=8, bbox=dict(boxstyle="square,pad=0.25", fc=color, lw=0))
                numbers.append((text, bar))
            left += width
        if parts["free"] < 0:
            notes.append(ax.text(left, y, f" over by {-parts['free'] / GIB:.2f} GiB in all",
                                 va="center", color="crimson", fontsize=8))
        ax.plot([b.budget / GIB] * 2, [y - 0.45, y + 0.45], color="crimson", lw=1.5, label="budget")
        widest = max(widest, left, b.budget / GIB)
    ax.set_yticks(range(len(named)), [n for n, _ in named])
    ax.set_xlim(0, 1.05 * widest)
    up_to = "up to " * (len(named) > 1)
    thin = {name: f"{name} ({up_to}{most[name] / MIB:.0f} MiB, too thin to see)"  # under 0.5%
            for name in ("KV cache", "workspace") if 0 < most[name] / GIB < widest / 200}
    handles, labels = ax.get_legend_handles_labels()
    unique = {thin.get(k, k): h for k, h in zip(labels, handles)}  # one entry per part
    fig.legend(unique.values(), unique.keys(), fontsize=8, loc="outside lower center",
               ncols=len(unique) if len(thin) < 2 else 3)  # two long entries: two rows
    _fit_bar_texts(fig, ax, numbers, notes)
    return fig


def _fit_bar_texts(fig: Figure, ax, numbers: list, notes: list) -> None:
    """Widen the axis until every "over by" note ends inside it, then drop each segment number
    that does not fit inside its segment as drawn: both are measured on the laid-out figure."""
    renderer = FigureCanvasAgg(fig).get_renderer()  # a bare Figure has none until it has a canvas
    for _ in range(3):  # the layout moves the axes a little each time the limits change
        fig.draw_without_rendering()
        over = (max((t.get_window_extent(renderer).x1 for t in notes), default=0)
                - ax.get_window_extent(renderer).x1)
        if over <= 0:
            break
        lo, hi = ax.get_xlim()
        ax.set_xlim(lo, hi * (1 + 1.1 * over / ax.get_window_extent(renderer).width))
    fig.draw_without_rendering()
    for text, bar in numbers:
        inside, room = text.get_window_extent(renderer), bar.get_window_extent(renderer)
        if inside.x0 < room.x0 + 2 or inside.x1 > room.x1 - 2:  # 2 px of margin either side
            text.remove()


def against_floor(contexts: list, measured_ms: list, floor_ms: list, label: str) -> Figure:
    """Measured ms/token against the bandwidth floor, each point annotated with its MBU."""
    fig, ax = figure("Decode time against the bandwidth floor", label, "context (tokens)",
                     "ms / token")
    ax.plot(contexts, measured_ms, "o-", label="measured")
    ax.plot(contexts, floor_ms, "--", color="0.3", label="floor: bytes / bandwidth")
    for x, m, f in zip(contexts, measured_ms, floor_ms):
        ax.annotate(f"{f / m:.0%}", (x, m), textcoords="offset points", xytext=(0, 6), ha="center",
                    fontsize=8)
    return _finish(fig, ax, title="MBU = floor / measured", title_fontsize=8)


def bars(ax, groups: list[str], series: dict[str, list[list[float]]]) -> None:
    """Median bars with min..max whiskers of each group's rounds, one colour a series, the groups
    side by side. Each tick label's lines are wrapped to its group's share of the axis width
    (about 12 characters an inch at 8 points) and the legend sits outside, right of the axis, so
    neither a label nor the legend can run into its neighbour or cover a bar."""
    width = 0.8 / len(series)
    for i, (name, samples) in enumerate(series.items()):
        mid = [statistics.median(s) for s in samples]
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], mid, width,
               label=name, capsize=3, yerr=[[m - min(s) for m, s in zip(mid, samples)],
                                            [max(s) - m for m, s in zip(mid, samples)]])
    room = max(6, int(12 * ax.figure.get_figwidth() * ax.get_position().width / len(groups)))
    ax.set_xticks(range(len(groups)), ["\n".join(textwrap.fill(line, room) for line in
                                                 g.split("\n")) for g in groups], fontsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1), frameon=False)
    ax.grid(False, axis="x")


def _jsonable(obj):
    """``json`` default hook: tensors and numpy values as lists/numbers, dataclasses as dicts."""
    if hasattr(obj, "tolist"):  # torch.Tensor, numpy arrays and scalars
        return obj.tolist()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in a figure's JSON")


def save(fig: Figure, name: str, data: dict, label: str,
         directory: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``name.png`` and ``name.json`` (``{"label", "data"}``: the numbers behind the plot,
    so a notebook prints them with their label instead of typing them in). ``directory``: else
    ``$KVLIB_SAVE_FIGURES``, else ``figures/runs/``, which git ignores: a learner's run never
    rewrites the committed reference figures, written only when asked for (bench's ``--out``)."""
    shown = " ".join(label.split())  # a label may be wrapped onto several lines
    if not any(shown in " ".join(t.get_text().split()) for t in fig.findobj(Text)):
        raise ValueError(f"figure {name!r} does not show its label {label!r}")
    directory = Path(directory or os.environ.get("KVLIB_SAVE_FIGURES") or FIGURES / "runs")
    directory.mkdir(parents=True, exist_ok=True)
    png, js = directory / f"{name}.png", directory / f"{name}.json"
    # Serialise before writing anything, so a bad value leaves no half-saved pair.
    text = json.dumps({"label": label, "data": data}, indent=1, default=_jsonable)
    fig.savefig(png, dpi=120)
    js.write_text(text + "\n")
    return png, js


def load(name: str, directory: str | Path = FIGURES) -> tuple[dict, str]:
    """``(data, label)`` of a saved figure's JSON."""
    path = Path(directory) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no reference figure at {path}; regenerate with: "
                                "python -m course.bench --out figures")
    stored = json.loads(path.read_text())
    return stored["data"], stored["label"]


def gpu_reference(name: str) -> tuple[dict, str, Path] | None:
    """``(data, label, folder)`` of figure ``name`` from the first committed run made on a GPU, or
    None: the machine its label names, never the reader's, so a notebook prints that label."""
    for folder in (f for f in GPU_FOLDERS if (f / f"{name}.json").is_file()):
        data, label = load(name, folder)
        if "NVIDIA" in label or str(data.get("device", {}).get("device", "")).startswith("cuda"):
            return data, label, folder
    return None
