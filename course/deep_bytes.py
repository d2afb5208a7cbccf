"""The deep dive "fewer bytes by design": the KV formats priced from their configs on one chart, a
long stream of text over full, windowed and sink caches scored stretch by stretch (``python -m
course.deep_bytes``), and the latent cache's bytes against the same model's K and V. The notebook
keeps what it teaches: the formulas, the ring's positions, the latent cache's parity.
"""

import argparse
import time
from functools import partial
from pathlib import Path
from pydoc_data.topics import topics  # the stream: every section of Python's help text, in order

import torch
import torch.nn.functional as F
from IPython.display import Image
from matplotlib.figure import Figure
from matplotlib.patches import Patch

import kvlib
from kvlib import KVCache, RingCache
from kvlib.budget import Budget, meta_model, run_workspace
from kvlib.config import GIB, kv_bytes, kv_bytes_per_token, load_config

from . import plots, say
from .nb08 import chunk_logits

BF16, KIB = torch.bfloat16, 1024
DESIGNS = {"llama-2-7b": "MHA", "llama-3-8b": "GQA", "qwen3-4b": "GQA",  # how layers store K, V
           "gemma-3-4b": "GQA, 5 of 34 layers global", "deepseek-v2-lite": "MLA"}
THREADS = {"by design": "tab:blue", "by quantizing": "tab:orange", "by forgetting": "tab:green"}


def _longest(config, budget: int, weights: int, kv=None) -> int | None:
    """The plan's longest context, priced as :func:`kvlib.budget.plan_budget` prices it (weights,
    KV and the token loop's workspace); ``kv(tokens)``: the KV of that many (default: the config's,
    whose windowed layers stop growing). None if the weights alone do not fit; -1 if the KV stops
    growing (a ring): no length runs it out."""
    if weights >= budget:
        return None
    kv = kv or partial(kv_bytes, config, BF16)
    if not (per_token := kv(10**9 + 1) - kv(10**9)):  # past every window
        return -1
    return Budget(weights, per_token, budget, partial(run_workspace, config, BF16),
                  kv_at=kv).max_context


def formats(context: int = 32_768, budget: int = 12 * GIB, window: int = 1_020,
            sinks: int = 4) -> list[dict]:
    """One row per way of storing a token's KV, in bf16 unless quantized: bytes per token of a
    ``context``-token sequence, the plan's longest context on ``budget``, and the model's positions
    (None for a ring numbered by places in the cache, which never runs out of them)."""
    rows = []
    for name, design in DESIGNS.items():
        config = load_config(name)
        model = meta_model(config)  # the weights and RoPE's buffers, as the plan counts them
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        rows.append(dict(name=name, how=design, thread="by design", weights=weights,
                         per_token=kv_bytes(config, BF16, context) / context,
                         longest=_longest(config, budget, weights),
                         positions=config.max_position_embeddings))
    qwen, base = load_config("qwen3-4b"), rows[2]
    longest = partial(_longest, qwen, budget, base["weights"])
    for kv in ("int8", "int4"):
        per = kv_bytes_per_token(qwen, kv)
        rows.append(dict(base, how=f"{kv} codes + scales", thread="by quantizing", per_token=per,
                         longest=longest(lambda c, p=per: p * c)))
    ring = (window + sinks) * kv_bytes_per_token(qwen, BF16)  # held whatever the length
    rows.append(dict(base, how=f"ring {window} + {sinks} sinks", thread="by forgetting",
                     per_token=ring / context, positions=None, longest=longest(lambda c: ring)))
    return rows


def formats_figure(rows: list[dict], context: int, label: str) -> Figure:
    """KV bytes per token of a ``context``-token sequence, each way of saving them on one chart."""
    fig, ax = plots.figure(f"KV bytes per token of a {context:,}-token sequence (its cache / "
                           f"{context:,})", label, "KiB per token (log scale)", size=(7.5, 3.8))
    kib = [r["per_token"] / KIB for r in rows]
    bars = ax.barh([f"{r['name']}: {r['how']}" for r in rows], kib,
                   color=[THREADS[r["thread"]] for r in rows])
    ax.bar_label(bars, [f"  {v:,.1f}" for v in kib], fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")  # 4 KiB to 512 KiB: every bar readable
    ax.set_xlim(1, 3 * max(kib))
    ax.grid(False, axis="y")
    ax.legend(handles=[Patch(color=c, label=t) for t, c in THREADS.items()], fontsize=8,
              loc="lower right")
    plots.save(fig, "deep_bytes_formats", label=label, data={
        "context": context, "rows": [{k: r[k] for k in ("name", "how", "thread", "per_token")}
                                     for r in rows]})
    return fig


@torch.no_grad()
def _nll(model, cache, ids, chunk: int) -> torch.Tensor:
    """``[N - 1]``: each next token's negative log-likelihood over ``cache``, chunk by chunk (a
    stream's logits at every position would not fit in memory)."""
    return torch.cat([F.cross_entropy(logits[:len(t)], t, reduction="none") for t, logits in
                      zip(ids[0, 1:].split(chunk), chunk_logits(model, cache, ids, chunk))])


def stream(model, ids, window: int = 1_020, sinks: int = 4, chunk: int = 64) -> dict:
    """``{cache's name: per-token NLL}`` of ``ids [1, N]`` through each of four caches."""
    cfg, kw = model.config, dict(device=model.device, dtype=model.dtype)
    trained = cfg.max_position_embeddings
    sunk = partial(RingCache.for_model, cfg, window, sinks=sinks, **kw)
    caches = {"full cache": (KVCache.for_model(cfg, trained, **kw), trained),
              f"window {window + sinks}": (RingCache.for_model(cfg, window + sinks, **kw), None),
              f"{sinks} sinks + {window}, positions in the text": (sunk(), None),
              f"{sinks} sinks + {window}, places in the cache": (sunk(positions="cache"), None)}
    return {name: _nll(model, cache, ids[:, :n], chunk) for name, (cache, n) in caches.items()}


def stream_figure(runs: dict, label: str, trained: int, window: int, bucket: int = 512,
                  directory=None) -> Figure:
    """Perplexity by stretch of ``bucket`` tokens along the stream, each cache a line; saved with
    each cache's perplexity from the full window to the model's last position, and past it."""
    series = {name: [nll[s:s + bucket].mean().exp().item()
                     for s in range(0, len(nll) - bucket + 1, bucket)]
              for name, nll in runs.items()}
    spans = {name: [nll[a:b].mean().exp().item() if len(nll) > a else None
                    for a, b in ((window, trained), (trained, len(nll)))]
             for name, nll in runs.items()}
    fig, ax = plots.figure(f"A stream past the model's {trained:,} positions: perplexity every "
                           f"{bucket} tokens", label, "position in the stream", "perplexity",
                           size=(7.5, 4.6))
    for name, ppl in series.items():
        ax.plot([bucket * i + bucket // 2 for i in range(len(ppl))], ppl, marker="o", ms=3,
                label=name, **(dict(color="k", ls="--", lw=2) if name == "full cache" else {}))
    ax.axvline(trained, color="0.5", lw=1, ls=":", label=f"the model's positions end ({trained:,})")
    ax.axvline(window, color="0.7", lw=1, ls="--", label="the window is full")
    ax.set_ylim(0, 1.1 * max(max(v) for v in series.values()))
    ax.legend(fontsize=8, ncols=2, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    plots.save(fig, "deep_bytes_stream", label=label, directory=directory, data=dict(
        bucket=bucket, trained=trained, window=window, perplexity=series, spans=spans,
        tokens=max(map(len, runs.values())) + 1))
    return fig


def stream_reference(directory=plots.FIGURES) -> Image:
    """The committed long stream: its label, one line per cache, and its figure."""
    data, label = plots.load("deep_bytes_stream", directory)
    say(f"reference run: {label}")
    for name, (within, past) in data["spans"].items():
        print(f"{name:>44}: {within:6.2f} from {data['window']:,} to {data['trained']:,}"
              + ("" if past is None else f", {past:9.2f} past {data['trained']:,}"))
    return Image(filename=str(Path(directory) / "deep_bytes_stream.png"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m course.deep_bytes",
                                description="Run the long stream once; save it as a figure.")
    for flag, default in (("tokens", 12_288), ("window", 1_020), ("sinks", 4), ("chunk", 64)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--out", default=None, help="folder (default: figures/runs/)")
    a = p.parse_args(argv)
    model, tok = kvlib.load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids, start = tok(text, return_tensors="pt")["input_ids"][:, :a.tokens], time.time()
    runs = stream(model, ids, a.window, a.sinks, a.chunk)
    label = (f"{kvlib.label('cpu', torch.float32)} · smollm2-135m · Python's help text, "
             f"{ids.shape[1]:,} tokens in chunks of {a.chunk}")
    stream_figure(runs, label, model.config.max_position_embeddings, a.window + a.sinks,
                  directory=a.out)
    print(f"{label}: {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
