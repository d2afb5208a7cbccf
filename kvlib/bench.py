"""``python -m kvlib.bench``: every reference figure of the course, from one run.

One process, one model, one prompt, several context lengths: decode time per token for ``kvlib.generate``
with the preallocated and the ``cat`` cache, and for ``transformers``' ``model.generate`` with its Dynamic
and Static caches; the cache bytes kvlib's caches allocate per decode step (the meter); the bandwidth
floor and the fraction of it reached (MBU); on a GPU, memory, the longest context each kvlib cache
reaches under the budget, and CUDA-graph decode against eager. Speed is compared as ratios, in one run.

A progress bar goes to stderr; the last line on stdout is one JSON object. ``--out DIR`` also writes the
figures (PNG + JSON, labelled) and ``bench.md``.
"""

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.utils import logging as hf_logging

from . import plots
from .bandwidth import decode_bytes, floor_s_per_token, measure_bandwidth
from .config import GIB
from .budget import plan_budget
from .cat_cache import CatCache
from .decoder import forward
from .env import default_device, describe, label
from .loop import generate
from .kv_cache import KVCache
from .memory import cap_memory, memory_stats
from .meter import cache_bytes_per_step
from .models import hf_static_cache, load_model
from .timing import StepTimer

CACHES = ("prealloc", "cat", "hf_dynamic", "hf_static")
METERED = ("prealloc", "cat")  # kvlib's own caches: the meter can split their bytes out


class _Clock(StoppingCriteria):
    """Times each of ``model.generate``'s steps: it is called once per new token."""

    def __init__(self, device):
        self.timer, self.started = StepTimer(device), False

    def __call__(self, input_ids, scores, **kwargs):
        if self.started:
            self.timer.stop()
        self.timer.start()
        self.started = True
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def ms_per_token(model, prompt, kind: str, steps: int, chunk: int) -> float:
    """Median decode-step time, in ms, after ``prompt``: the prefill is not counted."""
    if kind in METERED:
        times = generate(model, prompt, steps + 1, cache=kind, eos_token_id=None, prefill_chunk=chunk,
                         timed=True).step_s
    else:
        clock = _Clock(model.device)
        static = hf_static_cache(model, prompt.shape[1] + steps + 1) if kind == "hf_static" else {}
        model.generate(prompt, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                       stopping_criteria=StoppingCriteriaList([clock]), pad_token_id=0, **static)
        times = clock.timer.times_s
    return 1e3 * statistics.median(times)


def longest_context(model, budget: int, chunk: int) -> dict:
    """GPU: the longest context each kvlib cache reaches under the cap, against the arithmetic.

    prealloc: the largest cache that can be made and decoded into, trying the arithmetic limit and then
    1% less at a time (slots past the prompt are zeros, which cost the same reads as real keys). cat:
    grown ``chunk`` tokens per write until the allocator gives up, recording memory as it grows.
    """
    device, config = model.device, model.config
    limit = plan_budget(config, model.dtype, budget, prefill_chunk=chunk).max_context
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    out = {"arithmetic": limit, "prealloc": 0, "cat": 0, "cat_trace": []}
    for frac in [1 - i / 100 for i in range(11)]:
        _free(device)
        try:
            cache = KVCache.for_model(config, int(limit * frac), device=device, dtype=model.dtype)
            forward(model, token, cache, cache.max_seq - 1)
            out["prealloc"] = cache.max_seq
            break
        except torch.OutOfMemoryError:
            cache = None
    del cache
    _free(device)
    cat = CatCache.for_model(config, device=device, dtype=model.dtype)
    ids = torch.zeros(1, chunk, dtype=torch.long, device=device)
    try:
        while True:
            forward(model, ids, cat, cat.seq_len)
            out["cat"] = cat.seq_len
            out["cat_trace"].append({"tokens": cat.seq_len, **memory_stats(device)})
    except torch.OutOfMemoryError:
        out["cat_died_reserved"] = torch.cuda.memory_reserved(device)
    del cat
    _free(device)
    return out


def run(model_name: str, device, budget_gib: float = 12.0, contexts=None, steps=None, rounds=2,
        progress=True) -> dict:
    """Everything above for one model on one device; returns the results dict printed as JSON.

    Each context is timed in ``rounds`` rounds, the caches in a rotated order each round, and a cache's
    ``ms_per_token`` is its best round: noise from the rest of the machine only ever adds time.
    """
    device = torch.device(device)
    on_gpu, cap = device.type == "cuda", cap_memory(budget_gib, device)
    model, _ = load_model(model_name, device=device)
    config, dtype = model.config, model.dtype
    contexts = contexts or ([1024, 4096, 16384] if on_gpu else [512, 2048, 8192])
    steps, chunk = steps or (16 if on_gpu else 8), 512
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, max(contexts)), generator=gen).to(device)
    res = {
        "device": describe(device, dtype, cap), "label": label(device, dtype, cap), "model": model_name,
        "dtype": str(dtype).removeprefix("torch."), "budget_gib": budget_gib if cap.active else None,
        "cap": cap.note, "contexts": contexts, "steps": steps, "rounds": rounds,
        # every per-context list below is aligned with "contexts"; None = not measured (OOM)
        "caches": {k: {"ms_per_token": [], "rounds_ms": []}
                   | ({"cache_bytes_per_step": []} if k in METERED else {}) for k in CACHES},
    }
    jobs = [(c, r) for c in contexts for r in range(rounds)]
    for c, r in tqdm(jobs, desc="decode", file=sys.stderr, disable=not progress):
        if r == 0:
            for k in CACHES:
                res["caches"][k]["rounds_ms"].append([])
        for k in CACHES[r % len(CACHES):] + CACHES[:r % len(CACHES)]:
            _free(device)
            try:  # an OOM is recorded as missing, never guessed
                res["caches"][k]["rounds_ms"][-1].append(ms_per_token(model, prompt[:, :c], k, steps, chunk))
            except torch.OutOfMemoryError:
                pass
    for k, v in res["caches"].items():
        v["ms_per_token"] = [min(ms, default=None) for ms in v["rounds_ms"]]
        if k in METERED:
            for c in contexts:
                _free(device)
                try:
                    v["cache_bytes_per_step"].append(cache_bytes_per_step(model, c, k))
                except torch.OutOfMemoryError:
                    v["cache_bytes_per_step"].append(None)
    bw = measure_bandwidth(device)
    floor = [1e3 * floor_s_per_token(decode_bytes(config, dtype, c), bw) for c in contexts]
    res["bandwidth"] = {
        "bytes_per_s": bw, "floor_ms": floor,
        "mbu": {k: [None if m is None else f / m for f, m in zip(floor, v["ms_per_token"])]
                for k, v in res["caches"].items()},
    }
    if on_gpu:
        c, graph_ms = contexts[-1], None
        try:  # a failed capture is reported, not fatal: the rest of the run still counts
            graph = generate(model, prompt[:, :c], steps + 1, eos_token_id=None, prefill_chunk=chunk,
                             step="graph", bucket=1024, timed=True)
            graph_ms = 1e3 * statistics.median(graph.step_s)
        except RuntimeError as e:  # torch.OutOfMemoryError included
            res["cuda_graph_error"] = str(e).splitlines()[0]
        _free(device)
        res["cuda_graph"] = {"context": c, "eager_ms": res["caches"]["prealloc"]["ms_per_token"][-1],
                             "graph_ms": graph_ms}
        res["longest"] = longest_context(model, cap.budget_bytes, chunk)
        res["memory"] = memory_stats(device)
    return res


def figures(res: dict, out: Path) -> None:
    """The reference figures the notebooks load, each with its label and numbers."""
    where, cs, caches = res["label"], res["contexts"], res["caches"]
    measured = lambda values: tuple(zip(*[(c, x) for c, x in zip(cs, values) if x is not None]))  # noqa: E731
    series = {k: measured(v["ms_per_token"]) for k, v in caches.items()}
    plots.save(plots.time_per_step(series, where), "bench_time", res, where, out)
    fig = plots.bytes_per_step({k: measured(caches[k]["cache_bytes_per_step"]) for k in METERED}, where)
    plots.save(fig, "bench_bytes", {k: caches[k]["cache_bytes_per_step"] for k in METERED} | {"contexts": cs},
               where, out)
    ms, floor = caches["prealloc"]["ms_per_token"], res["bandwidth"]["floor_ms"]
    ok = [i for i, m in enumerate(ms) if m is not None]  # an OOM context has no point to plot
    fig = plots.against_floor([cs[i] for i in ok], [ms[i] for i in ok], [floor[i] for i in ok], where)
    plots.save(fig, "bench_floor", res["bandwidth"] | {"contexts": cs}, where, out)
    if "longest" in res:
        trace = res["longest"]["cat_trace"]
        rows = {k: [r[k] for r in trace] for k in ("tokens", "allocated", "reserved")}
        budget = int(res["budget_gib"] * GIB) if res["budget_gib"] else None
        fig = plots.memory_vs_tokens({"cat (grown per chunk)": rows}, where, budget_bytes=budget)
        plots.save(fig, "bench_memory", res["longest"], where, out)
    (out / "bench.md").write_text(table(res))


def table(res: dict) -> str:
    """A Markdown table of ms/token by context, for the README (generated, not typed)."""
    head = "| cache | " + " | ".join(f"{c} tokens" for c in res["contexts"]) + " |"
    rows = [head, "|---" * (len(res["contexts"]) + 1) + "|"]
    for k, v in res["caches"].items():
        cells = ["—" if ms is None else f"{ms:.1f}" for ms in v["ms_per_token"]]
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    return f"ms per decode step, {res['model']}, {res['label']}\n\n" + "\n".join(rows) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvlib.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--model", default=None, help="default: smollm2-135m on CPU, random:qwen3-4b on GPU")
    p.add_argument("--budget-gib", type=float, default=12.0, help="cap a bigger GPU's allocator (GiB)")
    p.add_argument("--quick", action="store_true", help="a smoke run: two short contexts, few steps")
    p.add_argument("--out", type=Path, default=None, help="write figures, JSON and bench.md here")
    a = p.parse_args(argv)
    hf_logging.set_verbosity_error()
    device = torch.device(a.device or default_device())
    model = a.model or ("random:qwen3-4b" if device.type == "cuda" else "smollm2-135m")
    quick = dict(contexts=[64, 256], steps=3, rounds=1) if a.quick else {}
    res = run(model, device, a.budget_gib, **quick)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench.json").write_text(json.dumps({"label": res["label"], "data": res}, indent=1) + "\n")
        figures(res, a.out)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
