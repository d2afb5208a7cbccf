"""Notebook 04's machinery: what only draws or measures the layout lesson, one call per cell (the
notebook keeps what it teaches: the write, the permuted view, the fold, ``repeat_kv``'s copy)."""

import re
import statistics
import warnings
from functools import partial
from itertools import product

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

import kvlib
from kvlib.config import head_dim, load_config

from . import plots, say
from .rounds import disturbed, report, rounds, shown, timed


def layouts_figure(slots=6, heads=3, dim=4, t=4, head=1) -> Figure:
    """Both storage orders of one layer, box by box in address order (the offsets read from a
    real KVCache), with what a decode step at ``t`` writes and what SDPA reads for one head."""
    names = {"seq": "seq-major [L, S, Hkv, D]: KVCache(layout='seq'), the order a write wants",
             "head": "head-major [L, Hkv, S, D]: KVCache(layout='head'), kvlib's default"}
    label = (f"drawn from the storage offsets of KVCache(1, {slots}, {heads}, {dim}) in both "
             f"layouts · torch {torch.__version__}")
    fig, axes = plots.figure("One layer's K in memory: a box per key vector (s = slot, h = KV "
                             "head)", "storage address →   (one layer; the layers are stacked "
                             f"outermost in both layouts) · {label}", size=(10, 5.6), rows=4)
    axes, drawn = iter(axes), {}
    for layout, name in names.items():
        k = kvlib.KVCache(1, slots, heads, dim, device="cpu", dtype=torch.float32, layout=layout).k
        base, size = k.untyped_storage().data_ptr(), dim * k.element_size()
        offsets = drawn[layout] = {(s, h): (k[0, s, h].data_ptr() - base) // size
                                   for s in range(slots) for h in range(heads)}
        for marked, what in (({(t, h) for h in range(heads)},  # the step writes slot t of each head
                              f"{name}\n   the step at t={t} writes slot {t} of every head"),
                             ({(s, head) for s in range(t + 1)},  # and reads slots 0..t of one
                              f"   SDPA reads head {head}'s slots 0..{t} through the view "
                              "[1, Hkv, t+1, D]")):
            ax, at = next(axes), sorted(offsets[b] for b in marked)
            runs = 1 + sum(j != i + 1 for i, j in zip(at, at[1:]))  # separate runs of memory
            for (s, h), i in offsets.items():
                on = (s, h) in marked
                ax.add_patch(Rectangle((i, 0), 0.92, 1, facecolor=f"C{h}", alpha=0.9 if on else
                                       0.18, edgecolor="black" if on else "none", lw=1.6))
                ax.text(i + 0.46, 0.5, f"s{s}\nh{h}", ha="center", va="center", fontsize=7,
                        color="white" if on else "0.35")
            ax.set(xlim=(-0.2, slots * heads), ylim=(-0.1, 1.1))
            ax.set_title(f"{what}: {runs} run{'s' * (runs > 1)} of memory", fontsize=9, loc="left")
            ax.axis("off")
    plots.save(fig, "nb04_layouts", label=label, data={
        layout: {f"slot {s}, head {h}": i for (s, h), i in offs.items()}
        for layout, offs in drawn.items()})
    return fig


BACKENDS = ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
CUDA_ONLY = ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
LAYOUTS = ("seq-major view", "head-major view", "contiguous")
MODES = ("GQA", "MHA", "folded", "GQA + mask", "folded + mask")


def three_layouts(seq, max_seq, heads, dim, generator, device, dtype):
    """The same numbers as ``[1, heads, seq, dim]`` in three layouts: a permuted and sliced
    ``[S, Hkv, D]`` store, a sliced ``[Hkv, S, D]`` store, and a fresh contiguous tensor."""
    seq_store = torch.randn(max_seq, heads, dim, generator=generator).to(device, dtype)
    head_store = seq_store.transpose(0, 1).contiguous()
    return dict(zip(LAYOUTS, (seq_store.permute(1, 0, 2).unsqueeze(0)[:, :, :seq],
                              head_store.unsqueeze(0)[:, :, :seq],
                              head_store[:, :seq].unsqueeze(0).contiguous())))


def _call(mode, q, k, v, mask):
    """One decode call of the given kind; q is ``[1, Hq, 1, D]`` (``[1, Hkv, 1, D]`` for MHA)."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    mask = mask if "mask" in mode else None
    if not mode.startswith("folded"):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=mode != "MHA")
    return F.scaled_dot_product_attention(q.view(1, hkv, hq // hkv, d), k, v,
                                          attn_mask=mask).view(1, hq, 1, d)


def backend_table(device, dtype, heads_from, seq=256):
    """Force every backend on five kinds of decode call over three layouts of the same K/V; print
    which backends ran each, and why one refused; return their outputs and the tolerance."""
    cfg = load_config(heads_from)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    gen = torch.Generator().manual_seed(0)
    keys, values = (three_layouts(seq, seq + 64, hkv, d, gen, device, dtype) for _ in "kv")
    q_gqa, q_mha = (torch.randn(1, h, 1, d, generator=gen).to(device, dtype) for h in (hq, hkv))
    mask = (torch.arange(seq) < seq - 7).view(1, 1, 1, seq).to(device)  # hide the last 7 slots
    tried = [b for b in BACKENDS if device.type == "cuda" or b not in CUDA_ONLY]
    ran, refused = {}, {}
    for layout, mode, backend in product(LAYOUTS, MODES, tried):
        q = q_mha if mode == "MHA" else q_gqa
        with warnings.catch_warnings(record=True) as why, sdpa_kernel(getattr(SDPBackend, backend)):
            warnings.simplefilter("always")  # keep the "why not" warnings, print none of them
            try:
                ran[layout, mode, backend] = _call(mode, q, keys[layout], values[layout], mask)
            except RuntimeError as err:
                refused[backend] = str(why[0].message if why else err).splitlines()[0]
    short = {b: b.removesuffix("_ATTENTION") for b in BACKENDS}
    say(f"{hq} query / {hkv} KV heads ({heads_from}), one query over {seq} keys, "
        f"{str(dtype).removeprefix('torch.')}: the backends that ran each call")
    print(f"{'call':<15}" + "".join(f"{layout:<24}" for layout in LAYOUTS))
    for mode in MODES:
        names = [" ".join(short[b] for b in tried if (lay, mode, b) in ran) for lay in LAYOUTS]
        print(f"{mode:<15}" + "".join(f"{n:<24}" for n in names))
    if len(tried) < len(BACKENDS):
        print(f"not tried on {device.type}: "
              f"{', '.join(short[b] for b in BACKENDS if b not in tried)} (CUDA only)")
    for backend, why in refused.items():
        say(f"{short[backend]} refused some: {why[:120]}")
    return ran, dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


class _Spy(TorchFunctionMode):
    """The first ``F.scaled_dot_product_attention`` call's arguments, kvlib's. A mode, not a
    patched function: a causal rule's own dispatch (``causal_lower_right``) knows SDPA by name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:  # the first layer's call: the first one
            self.__dict__.setdefault("first", (args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def sdpa_calls(model, device, dtype):
    """The first layer's attention call of a prefill, a chunk and a decode step through
    ``kvlib.forward`` (mask ``lower-right``: a causal rule the kernel applies, no tensor)."""
    cache = kvlib.KVCache.for_model(model.config, 16, device=device, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, 13),
                        generator=torch.Generator().manual_seed(0)).to(device)
    print(f"{'forward':<26}{'q':<16}{'k':<16}{'mask':<14}{'is_causal':<11}enable_gqa")
    for what, (a, b) in {"prefill, 8 tokens at t=0": (0, 8), "chunk, 4 tokens at t=8": (8, 12),
                         "decode step at t=12": (12, 13)}.items():
        with _Spy() as spy:
            kvlib.forward(model, ids[:, a:b], cache, a)
        (q, k, *_), kw = spy.first
        m = kw.get("attn_mask")
        m = None if m is None else tuple(m.shape) if type(m) is torch.Tensor else "lower-right"
        print(f"{what:<26}{str(tuple(q.shape)):<16}{str(tuple(k.shape)):<16}{str(m):<14}"
              f"{str(kw.get('is_causal', False)):<11}{kw.get('enable_gqa', False)}")


def read_order(device, dtype, label, rounds_n=9):
    """kvlib's decode call (folded, no mask) over the seq-major and the head-major view of the
    same K/V, the two taking turns in rounds (:mod:`course.rounds`): the ratio of the medians."""
    cfg = load_config("qwen3-4b" if device.type == "cuda" else "smollm2-135m")
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    seq, gen = 16384 if device.type == "cuda" else 4096, torch.Generator().manual_seed(0)
    keys, values = (three_layouts(seq, 2 * seq, hkv, d, gen, device, dtype) for _ in "kv")
    q = torch.randn(1, hkv, hq // hkv, d, generator=gen).to(device, dtype)  # folded rows
    calls = {name: timed(partial(F.scaled_dot_product_attention, q, keys[name], values[name]),
                         device, repeats=5, warmup=1) for name in LAYOUTS[:2]}
    ms = {name: [s * 1e3 for s in v] for name, v in rounds(calls, rounds_n).items()}
    (seq_ms, head_ms), n = (statistics.median(v) for v in ms.values()), cfg.num_hidden_layers
    report(f"{label}\none layer's attention call for a decode step over {seq:,} slots ({hq} query "
           f"/ {hkv} KV heads), median (min..max) of {rounds_n} rounds: "
           + ", ".join(f"{k} {shown(v, '.3f')} ms" for k, v in ms.items())
           + f"\nseq-major / head-major = {seq_ms / head_ms:.2f}x; seq-major slower in "
           f"{sum(a > b for a, b in zip(*ms.values()))} of {rounds_n} rounds; x {n} layers = "
           f"{n * seq_ms:.1f} ms against {n * head_ms:.1f} ms of attention per decode step",
           disturbed({f"{k} (ms)": v for k, v in ms.items()}, ".3f"))
    return seq_ms / head_ms


def cudnn_reference() -> None:
    """One line from the committed H200 run's README: what a new length cost cuDNN attention."""
    text = " ".join((plots.FIGURES / "h200" / "README.md").read_text().split())
    new, seen, flash = re.search(r"costs it ([\d.]+) ms per decode call \(([\d.]+) ms at a length "
                                 r"seen before; flash: ([\d.]+)", text).groups()
    version = re.search(r"torch ([\w.+]+)", text)[1]
    say(f"H200 reference, allocator capped at 12 GiB, torch {version} (figures/h200/README.md): "
        f"cuDNN attention, a length it had not seen {new} ms per decode call, a length seen "
        f"before {seen} ms; flash {flash} ms either way")
