"""``python -m course.bench``: every reference figure of the course, from one run.

One process, one model, one prompt, several context lengths: decode time per token for
``kvlib.generate`` with the preallocated and the ``cat`` cache, and for ``transformers``'
``model.generate`` with its Dynamic and Static caches (uncompiled, as kvlib's loop is); the cache
bytes kvlib's caches allocate per decode step (the meter); the bandwidth floor and the fraction of
it reached (MBU); on a GPU, CUDA-graph decode against eager. Speed is compared as ratios, in one
run, timed in rounds (:mod:`course.rounds`). The longest context on a real card is the GPU check's
(``tests/gpu_memory.py``). A progress bar goes to stderr; the last line on stdout is one JSON
object. ``--out DIR`` also writes it (``bench.json``), the figures (PNG + JSON) and ``bench.md``.
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
from transformers import StaticCache, StoppingCriteriaList
from transformers.utils import logging as hf_logging

from kvlib.bandwidth import decode_bytes, floor_s_per_token, measure_bandwidth
from kvlib.decoder import forward
from kvlib.env import default_device, describe, label, resolve
from kvlib.loop import generate
from kvlib.memory import cap_memory, free, memory_stats
from kvlib.meter import AllocMeter, MeteredCache, fill
from kvlib.models import load_model
from kvlib.timing import StepTimer

from . import plots
from .rounds import compare, disturbed, flag_line, rounds
from .simulate import MAKE

CACHES = ("prealloc", "cat", "hf_dynamic", "hf_static")
METERED = ("prealloc", "cat")  # kvlib's own caches: the meter can split their bytes out
STATIC = ("cache" if version.parse(transformers.__version__) >= version.parse("5.24")
          else "past_key_values")  # generate's StaticCache argument, renamed in transformers 5.24


def ms_per_token(model, prompt, kind: str, steps: int, chunk: int) -> float:
    """Median decode-step time, in ms, after ``prompt`` (not counting the prefill), from a freed
    allocator: from what is live, not from what the last measurement left cached."""
    free(model.device)
    if kind in METERED:
        return 1e3 * statistics.median(generate(model, prompt, steps + 1, cache=kind,
                                                eos_token_id=None, prefill_chunk=chunk,
                                                timed=True).step_s)
    timer = StepTimer(model.device)

    def tick(input_ids, scores, **kwargs):  # a stopping criterion: called once per new token
        timer.stop()
        timer.start()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    # exactly the slots it needs: cache_implementation="static" never sizes one below the largest
    static = {} if kind == "hf_dynamic" else {STATIC: StaticCache(
        config=model.config, max_cache_len=prompt.shape[1] + steps + 1)}
    timer.start()
    # disable_compile: on CUDA, generate compiles itself for a StaticCache, once per length;
    # this row is transformers' eager loop, the one kvlib's eager loop is compared with.
    model.generate(prompt, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                   stopping_criteria=StoppingCriteriaList([tick]), pad_token_id=0,
                   disable_compile=True, **static)
    return 1e3 * statistics.median(timer.times_s[1:])  # the first: the prefill and first token


def cache_bytes_per_step(model, context: int, kind: str) -> int:
    """Bytes the cache allocates in the decode step that writes slot ``context``, after
    ``context`` slots of zeros: what a step allocates depends on how much the cache holds."""
    free(model.device)  # as ms_per_token
    cache = MAKE[kind](model.config, context + 1, device=model.device, dtype=model.dtype)
    fill(cache, context)
    with AllocMeter() as meter:
        forward(model, torch.zeros(1, 1, dtype=torch.long, device=model.device),
                MeteredCache(cache, meter), context)
    return meter.by_region.get("cache", 0)


def run(model_name: str, device, budget_gib: float = 12.0, contexts=None, steps=None,
        rounds_n=5) -> dict:
    """Everything above, the dict printed as JSON. A cache's ``rounds_ms`` are its rounds at each
    context (none where all ran out of memory), ``ms_per_token`` their median, ``spread_ms`` their
    (min, max)."""
    device = resolve(device)
    on_gpu, cap = device.type == "cuda", cap_memory(budget_gib, device)
    model, _ = load_model(model_name, device=device)
    config, dtype = model.config, model.dtype
    # within the model's positions: SmolLM2's end at 8,192, and a run decodes past its context
    contexts = contexts or ([1024, 4096, 16384] if on_gpu else [512, 2048, 7680])
    steps, chunk = steps or (16 if on_gpu else 8), 512
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, max(contexts)), generator=gen).to(device)
    # course.rounds keeps nothing from a round out of memory: a missing number, never a guess
    timed = [rounds({k: partial(ms_per_token, model, prompt[:, :c], k, steps, chunk)
                     for k in CACHES}, rounds_n)
             for c in tqdm(contexts, desc="decode", file=sys.stderr)]
    caches = {k: {"rounds_ms": [t[k] for t in timed]} for k in CACHES}
    for k, v in caches.items():
        v["ms_per_token"] = [statistics.median(ms) if ms else None for ms in v["rounds_ms"]]
        v["spread_ms"] = [(min(ms), max(ms)) if ms else None for ms in v["rounds_ms"]]
        if k in METERED:
            got = rounds({c: partial(cache_bytes_per_step, model, c, k) for c in contexts}, 1)
            v["cache_bytes_per_step"] = [b[0] if b else None for b in got.values()]
    bw = measure_bandwidth(device)
    floor = [1e3 * floor_s_per_token(decode_bytes(config, dtype, c), bw) for c in contexts]
    res = {"device": describe(device, dtype, cap), "label": label(device, dtype, cap),
           "model": model_name, "dtype": str(dtype).removeprefix("torch."),
           "budget_gib": budget_gib if cap.active else None, "cap": cap.note,
           "contexts": contexts, "steps": steps, "rounds": rounds_n, "caches": caches,
           "bandwidth": {"bytes_per_s": bw, "floor_ms": floor, "mbu": {
               k: [None if m is None else f / m for f, m in zip(floor, v["ms_per_token"])]
               for k, v in caches.items()}}}
    if on_gpu:
        c, graph_ms = contexts[-1], None
        try:  # a failed capture is reported, not fatal: the rest of the run still counts
            graph_ms = 1e3 * statistics.median(generate(
                model, prompt[:, :c], steps + 1, eos_token_id=None, prefill_chunk=chunk,
                step="graph", bucket=1024, timed=True).step_s)
        except RuntimeError as e:  # torch.OutOfMemoryError included
            res["cuda_graph_error"] = str(e).splitlines()[0]
        res["cuda_graph"] = {"context": c, "graph_ms": graph_ms,
                             "eager_ms": caches["prealloc"]["ms_per_token"][-1]}
        free(device)
        res["memory"] = memory_stats(device)
    return res


def figures(res: dict, out: Path) -> None:
    """The reference figures the notebooks load, each with its label and numbers; ``bench.json``
    (everything) and ``bench.md`` (:func:`table`)."""
    where, cs, caches = res["label"], res["contexts"], res["caches"]

    def measured(*columns):  # (contexts, *columns) where the first was measured: an OOM has none
        kept = [(c, *x) for c, *x in zip(cs, *columns) if x[0] is not None]
        return tuple(zip(*kept)) or ((),) * (1 + len(columns))

    series = {}
    for k, v in caches.items():
        tokens, ms, spread = measured(v["ms_per_token"], v["spread_ms"])
        series[k] = (tokens, ms, tuple(zip(*spread)))
    plots.save(plots.time_per_step(series, where), "bench_time", res, where, out)
    per_step = {k: caches[k]["cache_bytes_per_step"] for k in METERED}
    fig = plots.bytes_per_step({k: measured(v) for k, v in per_step.items()}, where)
    plots.save(fig, "bench_bytes", per_step | {"contexts": cs}, where, out)
    floor = res["bandwidth"]["floor_ms"]
    fig = plots.against_floor(*measured(caches["prealloc"]["ms_per_token"], floor), where)
    plots.save(fig, "bench_floor", res["bandwidth"] | {"contexts": cs}, where, out)
    (out / "bench.json").write_text(json.dumps({"label": where, "data": res}, indent=1) + "\n")
    (out / "bench.md").write_text(table(res))


def verdicts(res: dict, base: str = "prealloc") -> list[str]:
    """``base`` against every other cache at each context, said only where the spreads part
    (:func:`course.rounds.compare`; a cache measured in fewer than two rounds has no spread)."""
    out, caches = [], res["caches"]
    for i, c in enumerate(res["contexts"]):
        for k, v in caches.items():
            pair = (caches[base], v)
            spread = all(len(x["rounds_ms"][i]) > 1 for x in pair if "rounds_ms" in x)
            if k != base and spread and all(x["spread_ms"][i] for x in pair):
                word = compare(caches[base]["spread_ms"][i], v["spread_ms"][i])
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
    how = flag_line(
        f"Median of {res['rounds']} rounds of {res['steps']} decode steps (each round's median "
        "step), the min–max of the rounds in brackets; the caches in a rotated order each round. "
        "A round out of memory counts for nothing; —: out of memory in every round.",
        disturbed({f"{k} at {c} tokens (ms)": ms for k, v in res["caches"].items()
                   for c, ms in zip(res["contexts"], v["rounds_ms"])}))
    return (f"ms per decode step, {res['model']}, {res['label']}\n\n" + "\n".join(rows) + "\n\n"
            + how + "\n\n" + "".join(f"- {v}\n" for v in verdicts(res)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m course.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", help="cuda or cpu (default: cuda if present)")
    p.add_argument("--model", help="default: smollm2-135m on CPU, random:qwen3-4b on GPU")
    p.add_argument("--budget-gib", type=float, default=12.0,
                   help="cap a bigger GPU's allocator (GiB)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: two short contexts, few steps")
    p.add_argument("--out", type=Path, help="write figures, JSON and bench.md here")
    a = p.parse_args(argv)
    hf_logging.set_verbosity_error()
    device = torch.device(a.device or default_device())
    model = a.model or ("random:qwen3-4b" if device.type == "cuda" else "smollm2-135m")
    res = run(model, device, a.budget_gib, **(dict(contexts=[64, 256], steps=3, rounds_n=1)
                                               if a.quick else {}))
    if a.out:
        figures(res, a.out)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
