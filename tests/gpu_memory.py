"""The GPU check's memory measurements on a real card: the longest context each kvlib cache
reaches under the allocator's budget (a bisection of real runs), and memory against length, row by
row. Maintainers' instruments beside ``gpu_check.py``; the notebooks read what they measured from
``figures/h200/``.
"""

import torch

from course.bench import METERED
from course.simulate import MAKE
from kvlib.budget import largest, plan_budget
from kvlib.decoder import forward
from kvlib.env import resolve
from kvlib.memory import free, memory_stats
from kvlib.meter import fill


class MemoryTrace:
    """One :func:`memory_stats` row per ``record(tokens)``: memory against length."""

    def __init__(self, device: torch.device | str) -> None:
        self.device, self.rows = resolve(device), []

    def record(self, tokens: int) -> dict[str, int]:
        self.rows.append({"tokens": int(tokens), **memory_stats(self.device)})
        return self.rows[-1]

    def column(self, key: str) -> list[int]:
        return [row[key] for row in self.rows]

    def reset_peak(self) -> None:
        """Restart ``peak_*`` from the current usage (CUDA; no-op elsewhere)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


def _runs(model, kind: str, n: int, chunk: int) -> dict:
    """Does a chunked prefill of ``n - 1`` tokens and a decode step (``n`` slots) fit in memory?

    The prefill's last chunk, a full one, and the decode step run for real at the longest context,
    where their transients are largest. The slots before are zeros written straight into the cache:
    they cost what real keys cost, and cat grows ``chunk`` slots per write, layer by layer, as a
    chunked prefill grows it (memory after each chunk in ``grown``).
    """
    device, last, grown = model.device, min(chunk, n - 1), []

    def attempt():  # its cache is gone when it returns or raises, before memory is read
        cache = MAKE[kind](model.config, n, device=device, dtype=model.dtype)
        for end in range(chunk, n - 1 - last + chunk, chunk) if kind == "cat" else ():
            fill(cache, min(end, n - 1 - last))
            grown.append({"tokens": cache.seq_len, **memory_stats(device)})
        ids = torch.zeros(1, max(last, 1), dtype=torch.long, device=device)
        if last:
            forward(model, ids, cache, n - 1 - last)
        forward(model, ids[:, :1], cache, n - 1)

    free(device)
    if device.type == "cuda":  # peaks from here: the weights, not an earlier try
        torch.cuda.reset_peak_memory_stats(device)
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
