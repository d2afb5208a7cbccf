"""``python -m course.bench``: every reference figure of the course, from one run.

One process, one model, one prompt, several context lengths: decode time per token for
``kvlib.generate`` with the preallocated and the ``cat`` cache, and for ``transformers``'
``model.generate`` with its Dynamic and Static caches (uncompiled, as kvlib's loop is); the cache
bytes kvlib's caches allocate per decode step (the meter); the bandwidth floor and the fraction of
it reached (MBU); on a GPU, memory, the longest context each kvlib cache reaches under the budget,
and CUDA-graph decode against eager. Speed is compared as ratios, in one run.

A progress bar goes to stderr; the last line on stdout is one JSON object. ``--out DIR`` also writes
the figures (PNG + JSON, labelled) and ``bench.md``.
"""

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import transformers
from packaging import version
from tqdm import tqdm
from transformers import StaticCache, StoppingCriteria, StoppingCriteriaList
from transformers.utils import logging as hf_logging

from kvlib.bandwidth import decode_bytes, floor_s_per_token, measure_bandwidth
from kvlib.budget import largest, plan_budget
from kvlib.cat_cache import CatCache
from kvlib.decoder import forward
from kvlib.env import default_device, describe, label, resolve
from kvlib.kv_cache import KVCache
from kvlib.loop import generate
from kvlib.memory import allocator_budget, cap_memory, free, memory_stats
from kvlib.meter import AllocMeter, MeteredCache, fill
from kvlib.models import load_model
from kvlib.timing import StepTimer

from . import plots
from .memory_trace import MemoryTrace
from .rounds import rounds

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


def hf_static_cache(model, max_cache_len: int) -> dict:
    """``generate`` keyword arguments for a ``StaticCache`` of exactly ``max_cache_len`` slots
    (``cache_implementation="static"`` never sizes a cache below the largest before it)."""
    new = version.parse(transformers.__version__) >= version.parse("5.24")
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    return {"cache" if new else "past_key_values": cache}


def ms_per_token(model, prompt, kind: str, steps: int, chunk: int) -> float:
    """Median decode-step time, in ms, after ``prompt``: the prefill is not counted."""
    if kind in METERED:
        times = generate(model, prompt, steps + 1, cache=kind, eos_token_id=None,
                         prefill_chunk=chunk, timed=True).step_s
    else:
        clock = _Clock(model.device)
        static = hf_static_cache(model, prompt.shape[1] + steps + 1) if kind == "hf_static" else {}
        # disable_compile: on CUDA, generate compiles itself for a StaticCache, once per length;
        # this row is transformers' eager loop, the one kvlib's eager loop is compared with.
        model.generate(prompt, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                       stopping_criteria=StoppingCriteriaList([clock]), pad_token_id=0,
                       disable_compile=True, **static)
        times = clock.timer.times_s
    return 1e3 * statistics.median(times)


def cache_bytes_per_step(model, context: int, kind: str) -> int:
    """Bytes the cache allocates in the decode step that writes slot ``context``, after
    ``context`` slots of zeros: what a step allocates depends on how much the cache holds."""
    config, device, dtype = model.config, model.device, model.dtype
    cache = (KVCache.for_model(config, context + 1, device=device, dtype=dtype)
             if kind == "prealloc" else CatCache.for_model(config, device=device, dtype=dtype))
    fill(cache, context)
    with AllocMeter() as meter:
        forward(model, torch.zeros(1, 1, dtype=torch.long, device=device),
                MeteredCache(cache, meter), context)
    return meter.by_region.get("cache", 0)


def _runs(model, kind: str, n: int, chunk: int) -> dict:
    """Does a chunked prefill of ``n - 1`` tokens and a decode step (``n`` slots) fit in memory?

    The prefill's last chunk, a full one, and the decode step run for real at the longest context,
    where their transients are largest. The slots before are zeros written straight into the cache:
    they cost what real keys cost, and cat grows ``chunk`` slots per write, layer by layer, as a
    chunked prefill grows it (memory after each chunk in ``grown``).
    """
    device, last, grown = model.device, min(chunk, n - 1), []

    def attempt():
        config, dtype = model.config, model.dtype
        if kind == "prealloc":
            cache = KVCache.for_model(config, n, device=device, dtype=dtype)
        else:
            cache = CatCache.for_model(config, device=device, dtype=dtype)
        for end in range(chunk, n - 1 - last + chunk, chunk) if kind == "cat" else ():
            fill(cache, min(end, n - 1 - last))
            grown.append({"tokens": cache.seq_len, **memory_stats(device)})
        ids = torch.zeros(1, max(last, 1), dtype=torch.long, device=device)
        if last:
            forward(model, ids, cache, n - 1 - last)
        forward(model, ids[:, :1], cache, n - 1)

    free(device)
    MemoryTrace(device).reset_peak()
    before = memory_stats(device).get("allocated")  # the weights, and what a library keeps
    try:
        attempt()
        fits = True
    except torch.OutOfMemoryError:
        fits = False
    stats = memory_stats(device)
    free(device)
    return {"tokens": n, "fits": fits, "allocated_before": before, "grown": grown,
            **{k: stats.get(k) for k in ("peak_allocated", "peak_reserved")}}


def longest_context(model, budget: int, chunk: int) -> dict:
    """The longest context each kvlib cache reaches under ``budget`` bytes, against the plan.

    ``budget`` is what the allocator may hold, weights included (on a GPU,
    :func:`kvlib.memory.allocator_budget` once the model is loaded). Each cache is bisected from the
    plan, below a cache that alone would overflow what the weights leave; every try (:func:`_runs`)
    is kept in ``tries``. ``cat_trace``: memory as the longest cat that fitted grew.
    """
    plan = plan_budget(model.config, model.dtype, budget, prefill_chunk=chunk)
    held = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    hi = max(0, budget - held) // plan.kv_per_token + 1  # a cache this long could not fit at all
    out = {"arithmetic": plan.max_context, "budget": budget, "chunk": chunk, "tries": {}}
    for kind in METERED:
        tries = out["tries"][kind] = []

        def fits(n, kind=kind, tries=tries):
            tries.append(_runs(model, kind, n, chunk))
            return tries[-1]["fits"]

        out[kind] = largest(fits, hi, plan.max_context)
    cat = out["tries"]["cat"]
    out["cat_trace"] = next((t["grown"] for t in cat if t["tokens"] == out["cat"]), [])
    return out


def run(model_name: str, device, budget_gib: float = 12.0, contexts=None, steps=None, rounds_n=5,
        progress=True) -> dict:
    """Everything above for one model on one device; returns the results dict printed as JSON.

    Each context is timed in ``rounds_n`` rounds (:mod:`course.rounds`), so load on the machine
    hits every cache alike. A cache's ``ms_per_token`` is the median of its rounds
    and ``spread_ms`` their (min, max): two caches differ only where their spreads do not overlap.
    """
    device = resolve(device)
    on_gpu, cap = device.type == "cuda", cap_memory(budget_gib, device)
    model, _ = load_model(model_name, device=device)
    config, dtype = model.config, model.dtype
    # within the model's positions: SmolLM2's end at 8,192, and a run decodes past its context
    contexts = contexts or ([1024, 4096, 16384] if on_gpu else [512, 2048, 7680])
    steps, chunk = steps or (16 if on_gpu else 8), 512
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, max(contexts)), generator=gen).to(device)
    res = {
        "device": describe(device, dtype, cap), "label": label(device, dtype, cap),
        "model": model_name, "dtype": str(dtype).removeprefix("torch."),
        "budget_gib": budget_gib if cap.active else None,
        "cap": cap.note, "contexts": contexts, "steps": steps, "rounds": rounds_n,
        # every per-context list below is aligned with "contexts"; None = not measured (OOM)
        "caches": {k: {"ms_per_token": [], "rounds_ms": []}
                   | ({"cache_bytes_per_step": []} if k in METERED else {}) for k in CACHES},
    }
    def timed(k, c):  # an OOM is recorded as missing, never guessed (course.rounds skips it)
        free(device)
        return ms_per_token(model, prompt[:, :c], k, steps, chunk)

    for c in tqdm(contexts, desc="decode", file=sys.stderr, disable=not progress):
        ms = rounds({k: partial(timed, k, c) for k in CACHES}, rounds_n)
        for k, v in ms.items():
            res["caches"][k]["rounds_ms"].append(v)
    for k, v in res["caches"].items():
        v["ms_per_token"] = [statistics.median(ms) if ms else None for ms in v["rounds_ms"]]
        v["spread_ms"] = [(min(ms), max(ms)) if ms else None for ms in v["rounds_ms"]]
        if k in METERED:
            for c in contexts:
                free(device)
                try:
                    v["cache_bytes_per_step"].append(cache_bytes_per_step(model, c, k))
                except torch.OutOfMemoryError:
                    v["cache_bytes_per_step"].append(None)
    bw = measure_bandwidth(device)
    floor = [1e3 * floor_s_per_token(decode_bytes(config, dtype, c), bw) for c in contexts]
    res["bandwidth"] = {"bytes_per_s": bw, "floor_ms": floor, "mbu": {
        k: [None if m is None else f / m for f, m in zip(floor, v["ms_per_token"])]
        for k, v in res["caches"].items()}}
    if on_gpu:
        c, graph_ms = contexts[-1], None
        try:  # a failed capture is reported, not fatal: the rest of the run still counts
            # no name keeps the run: its cache and graphs must be gone before the longest context
            graph_ms = 1e3 * statistics.median(generate(
                model, prompt[:, :c], steps + 1, eos_token_id=None, prefill_chunk=chunk,
                step="graph", bucket=1024, timed=True).step_s)
        except RuntimeError as e:  # torch.OutOfMemoryError included
            res["cuda_graph_error"] = str(e).splitlines()[0]
        free(device)
        res["cuda_graph"] = {"context": c, "graph_ms": graph_ms,
                             "eager_ms": res["caches"]["prealloc"]["ms_per_token"][-1]}
        res["longest"] = longest_context(model, allocator_budget(device, cap), chunk)
        res["memory"] = memory_stats(device)
    return res


def figures(res: dict, out: Path) -> None:
    """The reference figures the notebooks load, each with its label and numbers."""
    where, cs, caches = res["label"], res["contexts"], res["caches"]
    def measured(values):
        return tuple(zip(*[(c, x) for c, x in zip(cs, values) if x is not None]))

    series = {}
    for k, v in caches.items():
        tokens, ms = measured(v["ms_per_token"])
        low, high = zip(*[s for s in v["spread_ms"] if s is not None])
        series[k] = (tokens, ms, (low, high))
    plots.save(plots.time_per_step(series, where), "bench_time", res, where, out)
    per_step = {k: caches[k]["cache_bytes_per_step"] for k in METERED}
    fig = plots.bytes_per_step({k: measured(v) for k, v in per_step.items()}, where)
    plots.save(fig, "bench_bytes", per_step | {"contexts": cs}, where, out)
    ms, floor = caches["prealloc"]["ms_per_token"], res["bandwidth"]["floor_ms"]
    ok = [i for i, m in enumerate(ms) if m is not None]  # an OOM context has no point to plot
    fig = plots.against_floor([cs[i] for i in ok], [ms[i] for i in ok], [floor[i] for i in ok],
                              where)
    plots.save(fig, "bench_floor", res["bandwidth"] | {"contexts": cs}, where, out)
    if "longest" in res:
        trace = res["longest"]["cat_trace"]
        rows = {k: [r[k] for r in trace] for k in ("tokens", "allocated", "reserved")}
        fig = plots.memory_vs_tokens({"cat (grown per chunk)": rows}, where,
                                     budget_bytes=res["longest"]["budget"])
        plots.save(fig, "bench_memory", res["longest"], where, out)
    (out / "bench.md").write_text(table(res))


def verdicts(res: dict, base: str = "prealloc") -> list[str]:
    """``base`` against every other cache at each context, said only where the spreads part (a
    cache measured in fewer than two rounds, the others out of memory, has no spread)."""
    out, caches = [], res["caches"]
    for i, c in enumerate(res["contexts"]):
        ours = caches[base]["spread_ms"][i]
        for k, v in caches.items():
            theirs = v["spread_ms"][i]
            spread = all(len(x["rounds_ms"][i]) > 1 for x in (caches[base], v) if "rounds_ms" in x)
            if k == base or ours is None or theirs is None or not spread:
                continue
            if ours[1] < theirs[0]:
                word = "faster than"
            elif ours[0] > theirs[1]:
                word = "slower than"
            else:
                word = "within the spread of"
            out.append(f"{c} tokens: {base} is {word} {k}")
    return out


def table(res: dict) -> str:
    """A Markdown table of ms/token by context, for the README (generated, not typed)."""
    head = "| cache | " + " | ".join(f"{c} tokens" for c in res["contexts"]) + " |"
    rows = [head, "|---" * (len(res["contexts"]) + 1) + "|"]
    for k, v in res["caches"].items():
        cells = [("—" if ms is None else f"{ms:.1f} ({sp[0]:.1f}–{sp[1]:.1f})")
                 + (f", {len(n)} of {res['rounds']} rounds" if 0 < len(n) < res["rounds"] else "")
                 for ms, sp, n in zip(v["ms_per_token"], v["spread_ms"], v["rounds_ms"])]
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    how = (f"Median of {res['rounds']} rounds of {res['steps']} decode steps (each round's median "
           "step), the min–max of the rounds in brackets; the caches in a rotated order each "
           "round. A round out of memory counts for nothing; —: out of memory in every round.")
    return (f"ms per decode step, {res['model']}, {res['label']}\n\n" + "\n".join(rows) + "\n\n"
            + how + "\n\n" + "".join(f"- {v}\n" for v in verdicts(res)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m course.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--model", default=None,
                   help="default: smollm2-135m on CPU, random:qwen3-4b on GPU")
    p.add_argument("--budget-gib", type=float, default=12.0,
                   help="cap a bigger GPU's allocator (GiB)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: two short contexts, few steps")
    p.add_argument("--out", type=Path, default=None, help="write figures, JSON and bench.md here")
    a = p.parse_args(argv)
    hf_logging.set_verbosity_error()
    device = torch.device(a.device or default_device())
    model = a.model or ("random:qwen3-4b" if device.type == "cuda" else "smollm2-135m")
    quick = dict(contexts=[64, 256], steps=3, rounds_n=1) if a.quick else {}
    res = run(model, device, a.budget_gib, **quick)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"label": res["label"], "data": res}, indent=1)
        (a.out / "bench.json").write_text(text + "\n")
        figures(res, a.out)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
