"""The bandwidth floor's arithmetic, the bandwidth probe, and every plot with its label."""

import json
import subprocess
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.text import Text
from transformers import AutoConfig

import kvlib
from course import plots
from kvlib.bandwidth import decode_bytes, floor_s_per_token, mbu, measure_bandwidth
from kvlib.budget import plan_budget
from kvlib.config import load_config

LABEL = "cpu | test rig | bf16 | torch 2.x"
GIB = 1024**3


def shown(fig) -> list[str]:
    fig.canvas.draw()  # the figure must actually render
    return [t.get_text() for t in fig.findobj(Text)]


def test_decode_bytes_exact():
    c = load_config("qwen3-4b")
    # tied: the table is read once, as the head, plus one embedding row per sequence
    assert decode_bytes(c, torch.bfloat16, 1000) == (4_022_468_096 + 2560) * 2 + 147456 * 1000
    assert decode_bytes(c, torch.bfloat16, 0, batch=2) == (4_022_468_096 + 2 * 2560) * 2
    untied = AutoConfig.for_model(
        "llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
    )
    # untied: the head is read whole, the embedding table only one row
    per_layer = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16 + 2 * 8
    assert decode_bytes(untied, torch.float32, 0) == (per_layer + 8 + 100 * 8 + 8) * 4


def test_floor_and_mbu_arithmetic():
    assert floor_s_per_token(10**9, 1e11) == pytest.approx(0.01)
    assert mbu(0.02, 10**9, 1e11) == pytest.approx(0.5)
    assert mbu(0.01, 10**9, 1e11) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="-1"):
        floor_s_per_token(1, -1)
    with pytest.raises(ValueError, match="0 s/token"):
        mbu(0, 1, 1.0)


def test_measure_bandwidth_on_cpu():
    bw = measure_bandwidth("cpu")
    print(f"cpu copy bandwidth: {bw / 1e9:.1f} GB/s")
    assert 1e8 < bw < 1e13  # between 100 MB/s and 10 TB/s: a real, memory-bound number


def test_figures_default_to_the_repo():
    assert plots.FIGURES == Path(kvlib.__file__).resolve().parent.parent / "figures"


def all_figures():
    b = plan_budget(load_config("qwen3-4b"), torch.bfloat16, 12 * GIB)
    t = [1, 2, 3, 4]
    return {
        "memory": plots.memory_vs_tokens(
            {"cat": {"tokens": t, "allocated": [1e9, 2e9, 3e9, 4e9],
                     "reserved": [2e9, 2e9, 4e9, 4e9]},
             "prealloc": {"tokens": t, "allocated": [3e9] * 4}},
            LABEL, budget_bytes=12 * GIB),
        "time": plots.time_per_step({"cat": (t, [1.0, 1.2, 1.5, 1.9])}, LABEL),
        "bytes": plots.bytes_per_step({"cat": (t, [1e9, 2e9, 3e9, 4e9]),
                                       "prealloc": (t, [0] * 4)}, LABEL),
        "bar": plots.budget_bar([("fits", b), ("tight", b)], 30_000, LABEL),
        "over": plots.budget_bar(b, b.max_context + 10_000, LABEL),
        "floor": plots.against_floor([1024, 8192], [30.0, 40.0], [15.0, 20.0], LABEL),
    }


def test_every_plot_shows_its_label_and_units():
    figs = all_figures()
    for name, fig in figs.items():
        texts = shown(fig)
        assert LABEL in texts, name
        assert isinstance(fig, matplotlib.figure.Figure)
    assert figs["memory"].axes[0].get_ylabel() == "GiB"
    assert "50%" in shown(figs["floor"])
    assert any(t.startswith(" over by") for t in shown(figs["over"]))
    assert not any("over by" in t for t in shown(figs["bar"]))


def test_a_bar_over_budget_draws_every_part_and_fits_on_the_axes():
    b = plan_budget(load_config("qwen3-4b"), torch.float32, 12 * GIB)  # fp32 weights alone are over
    fig = plots.budget_bar(b, 8192, LABEL)
    ax = fig.axes[0]
    parts = b.breakdown(8192)
    widths = sorted(round(p.get_width(), 6) for p in ax.patches if p.get_width() > 0)
    assert widths == sorted(round(parts[k] / GIB, 6) for k in ("weights", "kv", "workspace"))
    assert ax.get_xlim()[1] > (parts["weights"] + parts["kv"] + parts["workspace"]) / GIB


def test_time_per_step_draws_the_spread_as_a_band():
    fig = plots.time_per_step({"a": ([1, 2], [3.0, 4.0], ([2.5, 3.5], [3.5, 4.5]))}, LABEL)
    assert len(fig.axes[0].collections) == 1  # the band


def test_figures_of_a_run_go_to_an_ignored_folder(monkeypatch):
    monkeypatch.delenv("KVLIB_SAVE_FIGURES", raising=False)
    fig = plots.time_per_step({"a": ([1], [1.0])}, LABEL)
    png, js = plots.save(fig, "_test_default_dir", {}, LABEL)
    try:
        assert png.parent == plots.FIGURES / "runs"
        ignored = subprocess.run(["git", "check-ignore", "-q", str(png)], cwd=plots.FIGURES.parent)
        assert ignored.returncode == 0, f"{png} is not ignored by git"
    finally:
        png.unlink(), js.unlink()


def test_save_load_round_trip(tmp_path):
    fig = plots.time_per_step({"a": ([1, 2], [3.0, 4.0])}, LABEL)
    data = {"ms": torch.tensor([3.0, 4.0]), "n": np.int64(7), "dtype": torch.bfloat16,
            "budget": plan_budget(load_config("smollm2-135m"), torch.float32, GIB)}
    png, js = plots.save(fig, "steps", data, LABEL, directory=tmp_path)
    assert png == tmp_path / "steps.png" and png.stat().st_size > 1000
    stored = json.loads(js.read_text())
    assert stored["label"] == LABEL
    got, label = plots.load("steps", directory=tmp_path)
    assert label == LABEL
    assert got["ms"] == [3.0, 4.0] and got["n"] == 7 and got["dtype"] == "torch.bfloat16"
    assert got["budget"]["kv_per_token"] == 46080


def test_save_refuses_a_figure_without_its_label(tmp_path):
    fig = plots.time_per_step({"a": ([1], [1.0])}, LABEL)
    with pytest.raises(ValueError, match="another rig"):
        plots.save(fig, "x", {}, "another rig", directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_load_missing_names_path_and_command(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        plots.load("nothing", directory=tmp_path)
    assert str(tmp_path / "nothing.json") in str(err.value)
    assert "python -m course.bench --out figures" in str(err.value)


def test_a_gpu_reference_is_the_first_run_made_on_a_gpu(tmp_path, monkeypatch):
    """A CPU run in the first folder is passed over; a GPU run in the next is found, with its
    label and folder; no GPU run at all gives None, never a CPU figure posing as one."""
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    fig = plots.time_per_step({"a": ([1], [1.0])}, LABEL)
    plots.save(fig, "bench", {"device": {"device": "cpu"}}, LABEL, directory=cpu)
    monkeypatch.setattr(plots, "GPU_FOLDERS", (cpu, gpu))
    assert plots.gpu_reference("bench") is None
    h200 = "NVIDIA H200 · allocator capped at 12 GiB"
    plots.save(plots.time_per_step({"a": ([1], [1.0])}, h200), "bench", {"ms": 2}, h200,
               directory=gpu)
    assert plots.gpu_reference("bench") == ({"ms": 2}, h200, gpu)
    assert plots.gpu_reference("gpu_longest") is None


def test_every_course_figure_is_built_by_the_one_public_helper():
    """One look: no module of course/ makes its own Figure or calls a private plots helper."""
    course = Path(plots.__file__).parent
    own = [f"{p.name}:{i}" for p in sorted(course.glob("*.py")) if p.name != "plots.py"
           for i, line in enumerate(p.read_text().splitlines(), 1)
           if "Figure(" in line or "plots._" in line]
    assert own == []


@pytest.mark.parametrize("panels", [1, 2])
def test_the_figure_helper_shows_the_label_wrapped_to_the_width(panels, tmp_path):
    label = "where it ran · " + " ".join(["a long label"] * 20)
    fig, axes = plots.figure("title", label, "x", "y", size=(6, 3), panels=panels)
    assert len(fig.axes) == panels
    plots.save(fig, "helper", {}, label, tmp_path)  # refuses a figure that does not show its label
    text = fig.axes[0].get_title() if panels == 1 else fig._supxlabel.get_text()
    assert max(map(len, text.splitlines())) <= 15 * 6 and " ".join(text.split()) == label
