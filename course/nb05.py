"""Notebook 05's machinery: what counts kernels, times the three steps on this CPU and draws their
fit, reads the H200 reference, finds host syncs, and times eager, static and graph decode on a GPU.
The notebook keeps what it teaches (fixed shapes and addresses, buckets, split-KV, the fit)."""

import re
import statistics
import time

import torch
from matplotlib.figure import Figure
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import kvlib
from kvlib import KVCache
from kvlib.bandwidth import decode_bytes
from kvlib.config import load_config
from kvlib.decoder import forward
from kvlib.graphs import StaticStep
from kvlib.meter import count_kernels, decode_kernels, fill
from kvlib.timing import time_fn

from . import plots, say
from .rounds import disturbed, flag_label, report, rounds, shown, timed

aten = torch.ops.aten
H200_LABEL = "H200, allocator capped at 12 GiB"


class ShapeLog:
    """Wraps a cache; notes the shape of every K view layer 0's attention reads (section 1)."""

    def __init__(self, cache):
        self.__dict__.update(cache=cache, shapes=[])  # its own: past __setattr__, which forwards

    def view(self, layer, seq):
        k, v = self.cache.view(layer, seq)  # [1, Hkv, seq, D], views
        if layer == 0:
            self.shapes.append(tuple(k.shape))
        return k, v

    def __getattr__(self, name):  # everything else: the wrapped cache
        return getattr(self.cache, name)

    def __setattr__(self, name, value):  # StaticStep sets attributes on the cache it holds
        setattr(self.cache, name, value)


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


STEPS = ("eager", "static", "compiled")
LAUNCH = re.compile(r"\b(?:cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+)\(")


def three_steps(model, label, context=512, n=5) -> dict:
    """One decode step of ``model`` over ``context`` slots three ways: eager (its own modules),
    static (:class:`kvlib.graphs.StaticStep`, uncaptured) and that step compiled by inductor (once,
    timed apart). Kernels: :func:`kvlib.meter.count_kernels`; for the compiled step, the launches in
    its generated code (fused C++ loops, the matmuls left to ATen). ms in ``n`` rounds; one line."""
    cache, pos = KVCache.for_model(model.config, context, dtype=model.dtype), context - 1
    fill(cache, pos)  # t = context - 1 slots held: the step writes the last and attends over all
    token = torch.zeros(1, 1, dtype=torch.long)
    static, compiled = (StaticStep(model, cache, capture=False, compile=c) for c in (False, True))
    calls = {"eager": lambda: (setattr(cache, "seq_len", pos), forward(model, token, cache, pos)),
             "static": lambda: static(token, pos), "compiled": lambda: compiled(token, pos)}
    start = time.perf_counter()
    code = run_and_get_code(calls["compiled"])[1][-1]
    compile_s = time.perf_counter() - start
    kernels = {m: sum(count_kernels(calls[m]).values()) for m in STEPS[:2]}
    kernels["compiled"] = len(LAUNCH.findall(code.split("def call(", 1)[1]))
    repeats = max(1, round(0.1 / time_fn(calls["eager"], device="cpu").median_s))  # ~0.1 s
    ms = rounds({m: timed(f, "cpu", repeats) for m, f in calls.items()}, n=n, warmup=1)
    ms = {m: [1e3 * s for s in v] for m, v in ms.items()}
    report(f"{label}: ms per step at {context} slots, median (min..max) of {n} rounds: "
           + "; ".join(f"{m} {shown(ms[m], '.2f')}, {kernels[m]:,} kernels" for m in STEPS)
           + f" (compiled in {compile_s:.0f} s)", found := disturbed(ms, ".2f"))
    return {"kernels": kernels, "ms": ms, "compile_s": compile_s, "disturbed": found,
            "bytes": decode_bytes(model.config, model.dtype, context)}


def fit_figure(runs: dict, ms_per_byte: float, ms_per_kernel: float, label: str) -> Figure:
    """Per model, each step's measured ms (median, its rounds' min..max as a bar) on the fit's two
    terms, stacked: ``nb05_cpu_fit``, flagged if a run was disturbed."""
    label = flag_label(label, [d for r in runs.values() for d in r["disturbed"]])
    fig, axes = plots.figure("A decode step on this CPU: its bytes and its kernels",
                             label, "", "ms per step", size=(10, 4.5), panels=len(runs))
    for ax, (name, r) in zip(axes, runs.items()):
        mid, lo, hi = zip(*((statistics.median(v), min(v), max(v)) for v in r["ms"].values()))
        ax.bar(STEPS, r["bytes"] * ms_per_byte, 0.4, color="tab:blue", label="fit: bytes term")
        ax.bar(STEPS, [r["kernels"][m] * ms_per_kernel for m in STEPS], 0.4, color="tab:orange",
               bottom=r["bytes"] * ms_per_byte, label="fit: kernels term")
        spread = [[m - a for m, a in zip(mid, lo)], [b - m for m, b in zip(mid, hi)]]
        ax.errorbar(STEPS, mid, spread, fmt="o", color="k", label="measured: median, min..max")
        ax.set_xticks(STEPS, [f"{m}\n{r['kernels'][m]:,} kernels" for m in STEPS])
        ax.set_title(name, fontsize=9)
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="outside right upper")
    plots.save(fig, "nb05_cpu_fit", label=label, data={"runs": runs, "ms_per_byte": ms_per_byte,
                                                        "ms_per_kernel": ms_per_kernel})
    return fig


def h200_reference():
    """The H200 run's graph step at 8K (its check) and 16K (the bench), its copy bandwidth, and the
    line through them: ms at zero context and µs per slot; one line. None where not committed."""
    found, log = plots.gpu_reference("bench"), plots.FIGURES / "h200" / "gpu_check.log"
    if found is None or not log.exists():
        print("no H200 reference committed: nothing measured on a GPU to show")
        return None
    bench, config = found[0], load_config("qwen3-4b")
    line = next(x for x in log.read_text().splitlines() if x.split()[1:2] == ["decode"])
    (c8, c16), bw = (8192, 16384), bench["bandwidth"]["bytes_per_s"]
    ms = {c8: float(re.search(r"graph ([\d.]+) ms", line)[1]), c16: bench["cuda_graph"]["graph_ms"]}
    slope = (ms[c16] - ms[c8]) / (c16 - c8)  # ms per slot: a line through the two
    ref = {"bandwidth": bw, "us_per_slot": 1e3 * slope, "intercept_ms": ms[c8] - slope * c8,
           "graph_ms": ms, "weights_ms": 1e3 * decode_bytes(config, torch.bfloat16, 0) / bw}
    say(f"{H200_LABEL} (reference run, figures/h200/): Qwen3-4B bf16 graph step {ms[c8]:.2f} ms "
        f"at {c8:,} slots, {ms[c16]:.2f} ms at {c16:,}: {ref['us_per_slot']:.2f} µs per slot; "
        f"its copy bandwidth {bw / 1e12:.2f} TB/s")
    return ref


class HostSyncs(TorchDispatchMode):
    """Count the ops that make the host wait for the device (a value read back, an output size
    that depends on values, a copy between host and device), and the ops that draw random
    numbers; ``strict`` refuses the first sync instead."""

    def __init__(self, strict=False):
        super().__init__()
        self.strict, self.syncs, self.random_ops = strict, [], 0

    @staticmethod
    def _waits(func, args, kwargs) -> bool:
        if func is aten._to_copy.default and kwargs.get("device") is not None:
            return torch.device(kwargs["device"]).type != args[0].device.type
        if func is aten.copy_.default and isinstance(args[1], torch.Tensor):
            return args[0].device.type != args[1].device.type
        if torch.Tag.data_dependent_output in func.tags:
            return True
        if func is aten.index.Tensor:  # only a boolean index's size depends on its values
            return any(i is not None and i.dtype == torch.bool for i in args[1])
        return torch.Tag.dynamic_output_shape in func.tags and kwargs.get("output_size") is None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._waits(func, args, kwargs):
            if self.strict:
                raise RuntimeError(f"host sync: {func}")
            self.syncs.append(str(func))
        self.random_ops += any(a.name == "generator" for a in func._schema.arguments)
        return func(*args, **kwargs)


def gpu_decode(device, contexts=(2048, 8192), steps=32, bucket=256):
    """On CUDA: Qwen3-4B (random weights) in the card's dtype, ms/token of eager, static and
    graph decode at each context in 3 rounds, one line each. Elsewhere, one line saying so."""
    if device.type != "cuda":
        say(f"no GPU here ({device.type}): the eager, static and graph steps of Qwen3-4B are "
            f"timed when this notebook runs on one")
        return None
    dtype = kvlib.auto_dtype(device)
    label = kvlib.label(device, dtype, kvlib.memory.cap_memory(12, device))
    model, _ = kvlib.load_model("random:qwen3-4b", device=device, dtype=dtype)
    cache = KVCache.for_model(model.config, max(contexts) + steps + 1, device=device, dtype=dtype)
    prompt = (torch.arange(max(contexts), device=device) * 7919 % model.config.vocab_size)[None]
    for s in range(0, max(contexts) - 1, 512):  # prefill once: each mode decodes from its c - 1
        forward(model, prompt[:, s:min(s + 512, max(contexts) - 1)], cache, s)
    times = {}
    for c in contexts:
        def decode(mode, c=c):
            cache.seq_len = c - 1
            return 1e3 * statistics.median(kvlib.generate(
                model, prompt[:, c - 1:c], steps + 1, cache=cache, eos_token_id=None, step=mode,
                bucket=bucket, timed=True).step_s)
        ms = rounds({m: lambda m=m: decode(m) for m in ("eager", "static", "graph")}, warmup=1)
        times.update({(c, m): statistics.median(v) for m, v in ms.items()})
        report(f"{label} · Qwen3-4B at {c:,}, ms/token, median (min..max) of 3 rounds: "
               + ", ".join(f"{m} {shown(v, '.2f')}" for m, v in ms.items()), disturbed(ms, ".2f"))
    return times
