"""Notebook 05's machinery: counting kernels, reading the H200 reference, timing, one call a cell.

The notebook keeps what it teaches (fixed addresses and shapes, the bucket arithmetic, split-KV
attention built from its partial sums, the grid arithmetic); this module holds what counts, reads
files, times and draws: the cache wrapper that logs attention's shapes, the kernel counter, the
H200 reference figure and the split-KV step's prediction, the host-sync detector, and the GPU run
of eager, static and graph decode.
"""

import re
import statistics

import torch
from matplotlib.figure import Figure
from torch.utils._python_dispatch import TorchDispatchMode

import kvlib
from kvlib.bandwidth import decode_bytes
from kvlib.config import kv_bytes_per_token, load_config
from kvlib.meter import decode_kernels

from . import plots, say

__all__ = ["HostSyncs", "ShapeLog", "gpu_decode", "h200_figure", "h200_reference",
           "kernels_per_layer", "predict"]

aten = torch.ops.aten
H200_LABEL = "H200, allocator capped at 12 GiB"


class ShapeLog:
    """Wraps a cache; notes the shape of every K view layer 0's attention reads (section 1)."""

    def __init__(self, cache):
        object.__setattr__(self, "cache", cache)
        object.__setattr__(self, "shapes", [])

    def view(self, layer, seq):
        k, v = self.cache.view(layer, seq)  # [1, Hkv, seq, D], views
        if layer == 0:
            self.shapes.append(tuple(k.shape))
        return k, v

    def __getattr__(self, name):  # everything else: the wrapped cache
        return getattr(self.cache, name)

    def __setattr__(self, name, value):  # StaticStep sets attributes on the cache it holds
        setattr(self.cache, name, value)


# --- kernels per layer, before and after -----------------------------------------------------

def kernels_per_layer(name="qwen3-4b", context=8192) -> dict:
    """Kernels of one decode step of ``name`` in bf16 on the ``meta`` device (shapes, no memory,
    no time), counted by :func:`kvlib.meter.decode_kernels`: eager (the model's own modules) and
    kvlib's static step with split-KV and with masked SDPA; one line."""
    layers = load_config(name).num_hidden_layers
    counts = {"eager": decode_kernels(name, "eager", context=context),
              "static, split-KV": decode_kernels(name, "static", context=context),
              "static, masked SDPA": decode_kernels(name, "static", context=context,
                                                    attention="sdpa")}
    say(f"{name}, bf16, one decode step at {context:,} slots, kernels per layer: "
          + "; ".join(f"{what} {sum(c.values()) / layers:.1f} ({sum(c.values()):,} in all)"
                      for what, c in counts.items()))
    return {"layers": layers, **counts}


# --- the H200 reference ----------------------------------------------------------------------

def _decode_line(path):
    """``{mode: ms/token}`` of the decode line of a GPU check log."""
    lines = path.read_text().splitlines()
    line = next((x for x in lines if x.split()[1:2] == ["decode"]), "")
    return {m: float(x) for m, x in re.findall(r"(\w+) ([\d.]+) ms/token", line)}


def h200_reference():
    """The H200 run's decode times (its check at 8K, the bench at 16K), its copy bandwidth, and
    what they imply per slot of context; one line. None where the files are not committed."""
    found = plots.gpu_reference("bench")
    folder = plots.FIGURES / "h200"
    if found is None or not (folder / "gpu_check.log").exists():
        print("no H200 reference committed: nothing measured on a GPU to show")
        return None
    bench, label, _ = found
    check = _decode_line(folder / "gpu_check.log")
    recheck = _decode_line(folder / "gpu_check_recheck.log")
    graph = bench["cuda_graph"]
    config = load_config("qwen3-4b")
    bw = bench["bandwidth"]["bytes_per_s"]
    slot = kv_bytes_per_token(config, torch.bfloat16)
    ctx8, ctx16 = 8192, graph["context"]
    per_slot_ms = (graph["graph_ms"] - check["graph"]) / (ctx16 - ctx8)  # a line through 2 points
    rest = label.split(" · ", 2)[-1]  # the bench's label after the card and its cap
    ref = {"label": f"{H200_LABEL} · reference run, figures/h200/ · {rest}", "bandwidth": bw,
           "slot_bytes": slot, "check": check, "recheck": recheck, "bench": graph,
           "contexts": (ctx8, ctx16), "graph_ms": (check["graph"], graph["graph_ms"]),
           "us_per_slot": 1e3 * per_slot_ms, "floor_us_per_slot": 1e6 * slot / bw,
           "intercept_ms": check["graph"] - per_slot_ms * ctx8,
           "weights_ms": 1e3 * decode_bytes(config, torch.bfloat16, 0) / bw}
    say(f"{H200_LABEL}: Qwen3-4B bf16 graph step {check['graph']:.2f} ms at {ctx8:,} slots "
          f"and {graph['graph_ms']:.2f} ms at {ctx16:,}: {ref['us_per_slot']:.2f} µs "
          f"per slot of context; reading one slot's {slot:,} B at the measured "
          f"{bw / 1e12:.2f} TB/s takes {ref['floor_us_per_slot']:.3f} µs, "
          f"{ref['us_per_slot'] / ref['floor_us_per_slot']:.0f}x less")
    return ref


def predict(ref, kernels_now, kernels_after, contexts=(8192, 16384)) -> dict:
    """PREDICTION for the H200 graph step by context, in ms: its bytes at the measured bandwidth
    plus ``kernels_after`` kernels at the cost per kernel that the measured line's intercept
    implies over ``kernels_now`` (the intercept less the weights' bytes, shared among them)."""
    per_kernel_ms = (ref["intercept_ms"] - ref["weights_ms"]) / kernels_now
    config = load_config("qwen3-4b")
    return {c: 1e3 * decode_bytes(config, torch.bfloat16, c) / ref["bandwidth"]
            + kernels_after * per_kernel_ms for c in contexts}


def h200_figure(ref) -> Figure:
    """The H200's graph and eager steps against the bytes' floor, by context, with the split-KV
    step's PREDICTION (:func:`predict`, kernels counted on ``meta``); ``nb05_h200_gap``."""
    config = load_config("qwen3-4b")
    xs = list(range(0, 16385, 512))
    floor = [1e3 * decode_bytes(config, torch.bfloat16, x) / ref["bandwidth"] for x in xs]
    title = ref["label"].replace("expandable segments off · ", "")
    fig, ax = plots.figure("Qwen3-4B decode on the H200: the graph step far above the bytes' floor",
                           title, "context (slots attended)", "ms per token", size=(9, 6))
    ax.plot(xs, floor, color="0.3", ls="--",
            label=f"bytes floor: weights + KV at the measured bandwidth, "
                  f"+{ref['floor_us_per_slot']:.3f} µs per slot")
    c8, c16 = ref["contexts"]
    for lo, hi, ls, what in ((0, c8, ":", "extrapolated from 2 contexts"),
                             (c8, c16, "-", "through its points")):
        x = [lo, hi]
        ax.plot(x, [ref["intercept_ms"] + 1e-3 * ref["us_per_slot"] * v for v in x],
                color="tab:blue", lw=1, ls=ls,
                label=f"graph line, {what}: +{ref['us_per_slot']:.2f} µs per slot")
    runs = "measured (2 runs at 8K, 1 at 16K)"
    points = {f"graph step of that run (masked SDPA, memory-efficient kernel), {runs}":
              ([c8, c8, c16], [ref["check"]["graph"], ref["recheck"]["graph"],
                               ref["bench"]["graph_ms"]], "tab:blue"),
              f"eager step, {runs}":
              ([c8, c8, c16], [ref["check"]["eager"], ref["recheck"]["eager"],
                               ref["bench"]["eager_ms"]], "tab:red")}
    for name, (x, y, color) in points.items():
        ax.plot(x, y, "o", color=color, label=name)
    now, after = (sum(decode_kernels("qwen3-4b", s, context=c8).values())
                  for s in ("eager", "static"))
    guess = predict(ref, now, after, ref["contexts"])
    ax.plot(list(guess), list(guess.values()), "o", mfc="none", color="tab:green",
            label=f"PREDICTION: kvlib's split-KV graph step ({after:,} kernels), "
                  "estimated (section 6)")
    ax.set_ylim(bottom=0)
    fig.legend(fontsize=8, loc="outside lower center", ncols=1, frameon=False)
    plots.save(fig, "nb05_h200_gap", label=title,
               data={**{k: v for k, v in ref.items() if k != "label"},
                     "prediction_ms": {str(c): v for c, v in guess.items()}})
    return fig


# --- host syncs ------------------------------------------------------------------------------

class HostSyncs(TorchDispatchMode):
    """Count the ops that make the host wait for the device (a value read back, an output size
    that depends on values, a copy between host and device), and the ops that draw random
    numbers; ``strict`` refuses the first sync instead."""

    def __init__(self, strict=False):
        super().__init__()
        self.strict, self.syncs, self.random_ops = strict, [], 0

    @staticmethod
    def _waits(func, args, kwargs):
        if torch.Tag.data_dependent_output in func.tags:
            return True
        if torch.Tag.dynamic_output_shape not in func.tags:
            return False
        if func is aten.index.Tensor:  # only a boolean index's size depends on its values
            return any(i is not None and i.dtype == torch.bool for i in args[1])
        return kwargs.get("output_size") is None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        crosses = False
        if func is aten._to_copy.default and kwargs.get("device") is not None:
            crosses = torch.device(kwargs["device"]).type != args[0].device.type
        elif func is aten.copy_.default and isinstance(args[1], torch.Tensor):
            crosses = args[0].device.type != args[1].device.type
        if crosses or self._waits(func, args, kwargs):
            if self.strict:
                raise RuntimeError(f"host sync: {func}")
            self.syncs.append(str(func))
        if any(a.name == "generator" for a in func._schema.arguments):
            self.random_ops += 1
        return func(*args, **kwargs)


# --- on a GPU: eager, static and graph decode of the 12 GB model -----------------------------

def gpu_decode(device, contexts=(2048, 8192), steps=32, bucket=256):
    """On CUDA: Qwen3-4B (random weights) in the card's dtype, ms/token of eager, static and
    graph decode at each context, one line each. Elsewhere, one line saying so."""
    if device.type != "cuda":
        say(f"no GPU here ({device.type}): the eager, static and graph steps of Qwen3-4B are "
              f"timed when this notebook runs on one")
        return None
    dtype = kvlib.auto_dtype(device)
    label = kvlib.label(device, dtype, kvlib.memory.cap_memory(12, device))
    model, _ = kvlib.load_model("random:qwen3-4b", device=device, dtype=dtype)
    cache = kvlib.KVCache.for_model(model.config, max(contexts) + steps + 1, device=device,
                                    dtype=dtype)
    prompt = (torch.arange(max(contexts), device=device) * 7919 % model.config.vocab_size)
    prompt, filled, times = prompt.view(1, -1), 0, {}
    for c in contexts:
        for s in range(filled, c - 1, 512):  # prefill once; every mode continues from c - 1
            kvlib.forward(model, prompt[:, s:min(s + 512, c - 1)], cache, s)
        filled = c - 1
        for mode in ("eager", "static", "graph"):
            cache.seq_len = c - 1
            out = kvlib.generate(model, prompt[:, c - 1:c], steps + 1, cache=cache,
                                 eos_token_id=None, step=mode, bucket=bucket, timed=True)
            times[c, mode] = 1e3 * statistics.median(out.step_s)
        say(f"{label} · Qwen3-4B at {c:,}: " + ", ".join(
            f"{m} {times[c, m]:.2f}" for m in ("eager", "static", "graph")) + " ms/token")
    return times
