"""Notebook 04's machinery: what only draws or measures the layout lesson, one call per cell.

The notebook keeps what it teaches (the write, the permuted view, the fold, ``repeat_kv``'s copy);
this module holds the picture of both storage orders, the table of SDPA backends, the spy on the
calls kvlib makes, one paired timing of the read order, and the H200 reference's cuDNN finding.
"""

import re
import warnings
from functools import partial

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

import kvlib
from kvlib.config import head_dim, load_config

from . import plots, say
from .rounds import disturbed, report, rounds, timed

__all__ = ["backend_table", "cudnn_reference", "layouts_figure", "read_order", "sdpa_calls",
           "three_layouts"]

HEAD_COLORS = ["tab:blue", "tab:orange", "tab:green"]


# --- the picture: one layer's K in both storage orders --------------------------------------

def _box_offsets(layout, slots, heads, dim):
    """{(slot, head): index of that key vector in the layer's storage}, read from a real KVCache."""
    cache = kvlib.KVCache(1, slots, heads, dim, device="cpu", dtype=torch.float32, layout=layout)
    base, size = cache.k.untyped_storage().data_ptr(), dim * cache.k.element_size()
    return {(s, h): (cache.k[0, s, h].data_ptr() - base) // size
            for s in range(slots) for h in range(heads)}


def _runs(offsets):
    """How many separate runs of memory a set of box offsets makes."""
    ordered = sorted(offsets)
    return 1 + sum(b != a + 1 for a, b in zip(ordered, ordered[1:]))


def _strip(ax, offsets, marked, title, width):
    """One layer's storage as a row of key vectors in address order; the ``marked`` outlined."""
    for (s, h), i in offsets.items():
        on = (s, h) in marked
        ax.add_patch(Rectangle((i, 0), 0.92, 1, facecolor=HEAD_COLORS[h], alpha=0.9 if on else 0.18,
                               edgecolor="black" if on else "none", lw=1.6))
        ax.text(i + 0.46, 0.5, f"s{s}\nh{h}", ha="center", va="center", fontsize=7,
                color="white" if on else "0.35")
    ax.set(xlim=(-0.2, width), ylim=(-0.1, 1.1))
    ax.set_title(title, fontsize=9, loc="left")
    ax.axis("off")


def layouts_figure(slots=6, heads=3, dim=4, t=4, head=1) -> Figure:
    """Both storage orders of one layer, box by box, with what a decode step at ``t`` writes and
    what SDPA reads for one head; saved as ``nb04_layouts``."""
    names = {"seq": "seq-major [L, S, Hkv, D]: KVCache(layout='seq'), the order a write wants",
             "head": "head-major [L, Hkv, S, D]: KVCache(layout='head'), kvlib's default"}
    label = (f"drawn from the storage offsets of KVCache(1, {slots}, {heads}, {dim}) in both "
             f"layouts · torch {torch.__version__}")
    fig, axes = plots.figure("One layer's K in memory: a box per key vector (s = slot, h = KV "
                             "head)", size=(10, 5.6), rows=4)
    axes, drawn = iter(axes), {}
    for layout, name in names.items():
        offsets = drawn[layout] = _box_offsets(layout, slots, heads, dim)
        write = {(t, h) for h in range(heads)}  # the step at t writes slot t of every head
        read = {(s, head) for s in range(t + 1)}  # SDPA reads slots 0..t of each head
        w, r = _runs(offsets[b] for b in write), _runs(offsets[b] for b in read)
        _strip(next(axes), offsets, write, f"{name}\n   the step at t={t} writes slot {t} of "
               f"every head: {w} run{'s' * (w > 1)} of memory", slots * heads)
        _strip(next(axes), offsets, read, f"   SDPA reads head {head}'s slots 0..{t} through the "
               f"view [1, Hkv, t+1, D]: {r} run{'s' * (r > 1)} of memory", slots * heads)
    fig.supxlabel("storage address →   (one layer; the layers are stacked outermost in both "
                  "layouts)\n" + label, fontsize=8, color="0.35")
    plots.save(fig, "nb04_layouts", label=label, data={
        layout: {f"slot {s}, head {h}": i for (s, h), i in offs.items()}
        for layout, offs in drawn.items()})
    return fig


# --- which SDPA backends take which call, on which layout -----------------------------------

BACKENDS = [b for b in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
            if hasattr(SDPBackend, b)]
CUDA_ONLY = ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
LAYOUTS = ("seq-major view", "head-major view", "contiguous")
MODES = ("GQA", "MHA", "folded", "GQA + mask", "folded + mask")


def three_layouts(seq, max_seq, heads, dim, generator, device, dtype):
    """The same numbers as ``[1, heads, seq, dim]`` in three layouts: a permuted and sliced
    ``[S, Hkv, D]`` store, a sliced ``[Hkv, S, D]`` store, and a fresh contiguous tensor."""
    seq_store = torch.randn(max_seq, heads, dim, generator=generator).to(device, dtype)
    head_store = seq_store.transpose(0, 1).contiguous()
    return {"seq-major view": seq_store.permute(1, 0, 2).unsqueeze(0)[:, :, :seq],
            "head-major view": head_store.unsqueeze(0)[:, :, :seq],
            "contiguous": head_store[:, :seq].unsqueeze(0).contiguous()}


def _attend(mode, q, k, v, mask):
    """One decode call of the given kind; q is ``[1, Hq, 1, D]`` (``[1, Hkv, 1, D]`` for MHA)."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    masked = mask if "mask" in mode else None
    if mode == "MHA":
        return F.scaled_dot_product_attention(q, k, v)
    if mode.startswith("GQA"):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=masked, enable_gqa=True)
    out = F.scaled_dot_product_attention(q.view(1, hkv, hq // hkv, d), k, v, attn_mask=masked)
    return out.view(1, hq, 1, d)


def _try(backend, mode, q, k, v, mask, device):
    """``("runs", output)``, ``("refuses", reason)`` or ``("n/a", why it was not tried)``."""
    if device.type != "cuda" and backend in CUDA_ONLY:
        return "n/a", "CUDA only"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # keep the "why not" warnings, print none of them
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                return "runs", _attend(mode, q, k, v, mask)
        except RuntimeError as err:
            why = [str(w.message).splitlines()[0] for w in caught] or [str(err).splitlines()[0]]
            return "refuses", "; ".join(dict.fromkeys(why))


def backend_table(device, dtype, heads_from, seq=256):
    """Force every backend on five kinds of decode call over three layouts of the same K/V; print
    which backends ran each, and return ``{"status", "agrees", "outputs", "tol"}`` to check."""
    cfg = load_config(heads_from)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    gen = torch.Generator().manual_seed(0)
    keys = three_layouts(seq, seq + 64, hkv, d, gen, device, dtype)
    values = three_layouts(seq, seq + 64, hkv, d, gen, device, dtype)
    q_gqa = torch.randn(1, hq, 1, d, generator=gen).to(device, dtype)
    q_mha = torch.randn(1, hkv, 1, d, generator=gen).to(device, dtype)
    mask = (torch.arange(seq) < seq - 7).view(1, 1, 1, seq).to(device)  # hide the last 7 slots
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    status, agrees, outputs, refusals = {}, {}, {}, {}
    for layout in LAYOUTS:
        for mode in MODES:
            q = q_mha if mode == "MHA" else q_gqa
            args = (q, keys[layout], values[layout], mask, device)
            outputs[layout, mode] = ref = _try("MATH", mode, *args)[1]
            for backend in BACKENDS:
                result, out = _try(backend, mode, *args)
                status[layout, mode, backend] = result
                if result == "runs":
                    agrees[layout, mode, backend] = torch.allclose(out.float(), ref.float(), **tol)
                elif result == "refuses":
                    refusals.setdefault(backend, set()).add(out)
    short = lambda b: b.removesuffix("_ATTENTION")  # noqa: E731
    say(f"{hq} query / {hkv} KV heads ({heads_from}), one query over {seq} keys, "
          f"{str(dtype).removeprefix('torch.')}: the backends that ran each call")
    print(f"{'call':<15}" + "".join(f"{layout:<24}" for layout in LAYOUTS))
    for mode in MODES:
        ran = [" ".join(short(b) for b in BACKENDS if status[layout, mode, b] == "runs")
               for layout in LAYOUTS]
        print(f"{mode:<15}" + "".join(f"{r:<24}" for r in ran))
    untried = [short(b) for b in BACKENDS if status[LAYOUTS[0], MODES[0], b] == "n/a"]
    if untried:
        print(f"not tried on {device.type}: {', '.join(untried)} (CUDA only)")
    for backend, why in refusals.items():
        say(f"{short(backend)} refused some: {sorted(why)[0][:120]}")
    return {"status": status, "agrees": agrees, "outputs": outputs, "tol": tol}


# --- the calls kvlib's forward makes ---------------------------------------------------------

class _Spy(TorchFunctionMode):
    """Note the first ``F.scaled_dot_product_attention`` call, kvlib's included: the shapes of q,
    k and the mask (or ``lower-right``, a causal rule the kernel applies), and the flags."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[:2]
            m = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append({"q": tuple(q.shape), "k": tuple(k.shape),
                               "mask": None if m is None else tuple(m.shape)
                               if type(m) is torch.Tensor else "lower-right",
                               "is_causal": kwargs.get("is_causal", False),
                               "enable_gqa": kwargs.get("enable_gqa", False)})
        return func(*args, **kwargs)


def _first_call(run):
    with _Spy() as spy:
        run()
    return spy.calls[0]


def sdpa_calls(model, device, dtype):
    """Spy on the first layer's attention call of three forwards through ``kvlib.forward``: a
    prefill of 8 tokens, a chunk of 4 after them, one decode step. Print them; return them."""
    cfg = model.config
    cache = kvlib.KVCache.for_model(cfg, 16, device=device, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size, (1, 13), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    runs = {"prefill, 8 tokens at t=0": (0, 8), "chunk, 4 tokens at t=8": (8, 12),
            "decode step at t=12": (12, 13)}
    calls = {what: _first_call(lambda a=a, b=b: kvlib.forward(model, ids[:, a:b], cache, a))
             for what, (a, b) in runs.items()}
    print(f"{'forward':<26}{'q':<16}{'k':<16}{'mask':<14}{'is_causal':<11}enable_gqa")
    for what, c in calls.items():
        print(f"{what:<26}{str(c['q']):<16}{str(c['k']):<16}{str(c['mask']):<14}"
              f"{str(c['is_causal']):<11}{c['enable_gqa']}")
    return calls


# --- one timing of the read order ------------------------------------------------------------

def read_order(device, dtype, label, rounds_n=9):
    """kvlib's decode call (folded, no mask) over the seq-major view and the head-major view of
    the same K/V, in rounds (:mod:`course.rounds`): the ratio of the fastest rounds."""
    on_gpu = device.type == "cuda"
    cfg = load_config("qwen3-4b" if on_gpu else "smollm2-135m")
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    seq = 16384 if on_gpu else 4096
    gen = torch.Generator().manual_seed(0)
    keys = three_layouts(seq, 2 * seq, hkv, d, gen, device, dtype)
    values = three_layouts(seq, 2 * seq, hkv, d, gen, device, dtype)
    q = torch.randn(1, hkv, hq // hkv, d, generator=gen).to(device, dtype)  # folded rows
    ms = rounds({name: timed(partial(F.scaled_dot_product_attention, q, keys[name], values[name]),
                             device, repeats=5, warmup=1) for name in LAYOUTS[:2]}, rounds_n)
    ms = {name: [s * 1e3 for s in v] for name, v in ms.items()}
    seq_ms, head_ms = ms["seq-major view"], ms["head-major view"]
    ratio = min(seq_ms) / min(head_ms)  # the fastest round of each: the least disturbed
    slower = sum(a > b for a, b in zip(seq_ms, head_ms))
    layers = cfg.num_hidden_layers
    report(f"{label}\none layer's attention call for a decode step over {seq:,} slots "
           f"({hq} query / {hkv} KV heads), fastest of {rounds_n} rounds: seq-major view "
           f"{min(seq_ms):.3f} ms, head-major view {min(head_ms):.3f} ms\n"
           f"seq-major / head-major = {ratio:.2f}x; seq-major slower in {slower} of {rounds_n} "
           f"rounds; x {layers} layers = {layers * min(seq_ms):.1f} ms against "
           f"{layers * min(head_ms):.1f} ms of attention per decode step",
           disturbed({f"{k} (ms)": v for k, v in ms.items()}, ".3f"))
    return ratio


# --- the H200 reference's finding on cuDNN ---------------------------------------------------

def cudnn_reference():
    """One line from the committed H200 run's README: what a new length cost cuDNN attention."""
    readme = plots.FIGURES / "h200" / "README.md"
    text = " ".join(readme.read_text().split()) if readme.exists() else ""
    found = re.search(r"costs it ([\d.]+) ms per decode call \(([\d.]+) ms at a length seen "
                      r"before; flash: ([\d.]+)", text)
    torch_ref = re.search(r"torch ([\w.+]+)", text)
    if not (found and torch_ref):
        print("no H200 reference committed: the cost of cuDNN's plans is not shown here")
        return None
    new, seen, flash = (float(x) for x in found.groups())
    say(f"H200 reference, allocator capped at 12 GiB, torch {torch_ref[1]} "
          f"(figures/h200/README.md): "
          f"cuDNN attention, a length it had not seen {new} ms per decode call, a length seen "
          f"before {seen} ms; flash {flash} ms either way")
    return new, seen, flash
