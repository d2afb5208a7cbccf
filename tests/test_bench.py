"""`python -m course.bench --quick`: the command runs and its last line is the promised JSON.

The device is pinned to the CPU: on a GPU machine the default would be Qwen3-4B, which the GPU
check (tests/gpu_check.py) runs instead."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import tiny_model

from course.bench import CACHES, ms_per_token, verdicts
from kvlib.config import kv_bytes_per_token, load_config


def test_quick_bench_prints_one_json_line_and_writes_figures(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "course.bench", "--quick", "--device", "cpu",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=True,
    )
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"device", "model", "dtype", "label", "contexts", "caches", "bandwidth"} <= res.keys()
    assert res["model"] == "smollm2-135m" and res["dtype"] == "float32"
    assert set(res["caches"]) == set(CACHES)
    n = len(res["contexts"])
    for k in CACHES:
        ms = res["caches"][k]["ms_per_token"]
        assert len(ms) == n and all(m > 0 for m in ms)
        spread = res["caches"][k]["spread_ms"]
        assert all(lo <= m <= hi for m, (lo, hi) in zip(ms, spread))
    # The meter's numbers are exact: prealloc allocates nothing for its cache; cat
    # allocates the whole grown cache, K and V of every layer: context + 1 slots.
    per_token = kv_bytes_per_token(load_config("smollm2-135m"), torch.float32)
    assert res["caches"]["prealloc"]["cache_bytes_per_step"] == [0] * n
    cat = [per_token * (c + 1) for c in res["contexts"]]
    assert res["caches"]["cat"]["cache_bytes_per_step"] == cat
    for name in ("bench_time", "bench_bytes", "bench_floor"):
        assert (tmp_path / f"{name}.png").is_file()
        assert json.loads((tmp_path / f"{name}.json").read_text())["label"] == res["label"]
    assert "ms per decode step" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("kind", ["hf_dynamic", "hf_static"])
def test_transformers_rows_run_uncompiled(kind, monkeypatch):
    """On CUDA, generate compiles itself for a StaticCache; the bench's rows must not."""
    model = tiny_model("qwen3")
    asked = []
    auto = type(model)._valid_auto_compile_criteria

    def spy(self, model_kwargs, generation_config):
        asked.append(generation_config.disable_compile)
        return auto(self, model_kwargs, generation_config)

    monkeypatch.setattr(type(model), "_valid_auto_compile_criteria", spy)
    assert ms_per_token(model, torch.tensor([[1, 2, 3, 4]]), kind, steps=2, chunk=4) > 0
    assert asked and all(asked)


def test_a_verdict_is_said_only_where_the_spreads_part():
    spreads = {"prealloc": [(10, 11), (10, 12), None], "cat": [(12, 13), (11, 14), (5, 6)],
               "hf_static": [(8, 9), (13, 15), (5, 6)]}
    caches = {k: {"spread_ms": v} for k, v in spreads.items()}
    res = {"contexts": [512, 2048, 8192], "caches": caches}
    assert verdicts(res) == [
        "512 tokens: prealloc is faster than cat", "512 tokens: prealloc is slower than hf_static",
        "2048 tokens: prealloc is within the spread of cat",
        "2048 tokens: prealloc is faster than hf_static",
    ]
    caches["cat"]["rounds_ms"] = [[12, 13], [11], [5, 6]]  # one round at 2048: no spread
    caches["prealloc"]["rounds_ms"] = caches["hf_static"]["rounds_ms"] = [[0, 0]] * 3
    assert "2048 tokens: prealloc is within the spread of cat" not in verdicts(res)
    assert "512 tokens: prealloc is faster than cat" in verdicts(res)
