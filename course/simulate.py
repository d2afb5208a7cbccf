"""A simulated card: the token loop on the ``meta`` device, where nothing is allocated, under a
ledger of live bytes: ``memory_allocated`` without the allocator's rounding or caching. The op that
would pass the budget raises an OOM. On ``meta`` SDPA always takes the math path, so
:class:`kvlib.sdpa_choice.Kernels` routes each call as torch's CUDA dispatcher would."""

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvlib.budget import largest, meta_model
from kvlib.cards import Card
from kvlib.cards import card as get_card
from kvlib.cat_cache import CatCache
from kvlib.config import kv_bytes_per_token, size
from kvlib.decoder import check_supported, forward
from kvlib.kv_cache import KVCache
from kvlib.meter import MeteredCache, fill, new_storages
from kvlib.sdpa_choice import Kernels

COMPOSITE = torch._C.DispatchKey.CompositeExplicitAutograd


def _weights(model) -> int:
    """Bytes of the parameters and buffers, each storage once (a tied embedding is one tensor)."""
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}.values())


@cache
def _composite(func) -> bool:
    """Whether a card runs ``func`` as other ops (a composite kernel and no device one), whose
    temporaries are live together: the math path's ``_safe_softmax`` holds scores-sized ones."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(func.name(), "CompositeExplicitAutograd") and not has(func.name(), "CPU")


class Ledger(TorchDispatchMode):
    """Live tensor bytes, op by op, under an optional ``budget``; ``start`` (the weights) is live
    before entering. ``at_peak``: ``by_region``, the live bytes of each region, at the peak."""

    def __init__(self, budget: int | None = None, start: int = 0) -> None:
        super().__init__()
        self.budget, self.live, self.peak, self.step_peak = budget, start, start, start
        self.by_region, self.at_peak = {"weights": start}, {"weights": start}
        self.tokens, self.timeline = 0, {"tokens": [], "live": [], "peak": []}
        self._regions, self._counting = ["other"], True
        self._live: dict[int, list] = {}  # storage address -> [bytes, region]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _composite(func):  # its parts run under the ledger
            try:
                with self:
                    out = func._op_dk(COMPOSITE, *args, **kwargs)
            except RuntimeError as e:  # a composite that wraps a number in a tensor hands it back
                # to this mode as a Python number, which its Tensor overload refuses (int4's
                # ``code & 15``): that op runs whole, refused before anything was allocated
                if "Expected a value of type 'Tensor'" not in str(e):
                    raise
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        new = {k: s for k, s in new_storages(args, kwargs, out).items() if k not in self._live}
        request = sum(s.nbytes() for s in new.values())
        over = self.budget is not None and self.live + request > self.budget
        if request and self._counting and over:
            raise torch.OutOfMemoryError(
                f"simulated OOM at {func}: {size(self.live)} live + {size(request)} requested > "
                f"{size(self.budget)} budget ({self.tokens:,} tokens so far)")
        for key, s in new.items():
            self._live[key] = [s.nbytes(), self._regions[-1]]
            self._move(key, +1)
            weakref.finalize(s, self._free, key)
        return out

    def _move(self, key: int, sign: int) -> None:
        nbytes, region = self._live[key]
        self.by_region[region] = self.by_region.get(region, 0) + sign * nbytes
        self.live += sign * nbytes
        if sign > 0 and self._counting:
            self.step_peak = max(self.step_peak, self.live)
            if self.live > self.peak:
                self.peak, self.at_peak = self.live, dict(self.by_region)

    def _free(self, key: int) -> None:
        self._move(key, -1)
        del self._live[key]

    def relabel(self, t: torch.Tensor, region: str) -> None:
        """Move a live tensor's bytes to ``region`` (a mask is only known as one at SDPA)."""
        if (key := t.untyped_storage()._cdata) in self._live:
            self._move(key, -1)
            self._live[key][1] = region
            self._move(key, +1)

    def push(self, region: str) -> None:  # for module hooks, which cannot hold a ``with``
        self._regions.append(region)

    def pop(self) -> None:  # None: a forward hook's result would replace the module's output
        self._regions.pop()

    @contextmanager
    def region(self, name: str | None = None, counted: bool = True):
        """Attribute the storages made inside the block to ``name``; ``counted=False`` keeps them
        out of the budget check and the peaks (the state a tail run starts from)."""
        self.push(name or self._regions[-1])
        counting, self._counting = self._counting, self._counting and counted
        try:
            yield
        finally:
            self.pop()
            self._counting = counting

    def mark(self, tokens: int) -> None:
        """Close a step: the cache now holds ``tokens``."""
        for key, value in (("tokens", tokens), ("live", self.live), ("peak", self.step_peak)):
            self.timeline[key].append(value)
        self.tokens, self.step_peak = tokens, self.live


@dataclass
class Run:
    """One simulated run: ``timeline`` per step, the peak and its bytes by region, the SDPA
    kernels chosen, and the OOM if there was one."""

    cache: str
    budget: int
    peak: int
    at_peak: dict[str, int]
    timeline: dict[str, list[int]] = field(repr=False)  # a list a step: too long to print
    kernels: dict[str, int]
    oom: torch.OutOfMemoryError | None = None

    fits = property(lambda self: self.oom is None)


# kvlib's caches by name, each ``make(config, slots, device=, dtype=)``, as any factory passed in
MAKE = {"prealloc": lambda config, n, **kw: KVCache.for_model(config, n, **kw),
        "cat": lambda config, n, **kw: CatCache.for_model(config, **kw)}


@torch.no_grad()
def simulate(model, context: int, *, cache="prealloc", card: Card | str = "12 GiB",
             budget: int | None = None, attention: str = "auto", prefill_chunk: int = 512,
             decode: int = 4, tail: bool = False, batch: int = 1) -> Run:
    """Prefill ``context - decode`` tokens in chunks, then ``decode`` steps, on a simulated card
    (``model``: a config, its name, or a model on ``meta``), for ``batch`` requests packed as the
    loop packs them. ``cache``: ``"prealloc"``, ``"cat"``, or ``make(config, context, device=,
    dtype=)`` returning any cache. ``card`` gives the budget and the sm that picks the kernels.
    ``tail`` runs only the last two chunks and decode steps, from the state before them: the same
    peak, since earlier steps hold less, in a fraction of the time."""
    if attention not in ("auto", "fused", "math") or not callable(MAKE.get(cache, cache)):
        raise ValueError(f"attention must be auto/fused/math and cache prealloc/cat or a function "
                         f"making one, not {attention!r}, {cache!r}")
    if not 0 < decode < context:
        raise ValueError(f"need 0 < decode < context, got decode={decode} context={context}")
    model = meta_model(model)
    check_supported(model)
    target, config, dtype, meta = get_card(card), model.config, model.dtype, torch.device("meta")
    ledger = Ledger(target.memory if budget is None else budget, _weights(model))
    kernels = Kernels(ledger, 9.0 if attention == "fused" else target.sm, attention)
    prompt = context - decode
    chunks = list(range(0, prompt, prefill_chunk))[-2 if tail else 0:]
    steps = list(range(prompt, context))[-2 if tail else 0:]  # the last steps hold the most
    named = {m: "mlp" if n.endswith(".mlp") else "logits" for n, m in model.named_modules()
             if n.endswith(".mlp") or n == "lm_head"}
    hooks = [h for m, r in named.items() for h in (
        m.register_forward_pre_hook(lambda m, a, r=r: ledger.push(r)),
        m.register_forward_hook(lambda *_: ledger.pop()))]
    oom, logits = None, None

    def skip(upto: int) -> None:  # the cache as the skipped steps leave it, and their last logits
        nonlocal logits
        with ledger.region(counted=False):
            for kv in kvs if upto > kvs[0].seq_len else ():
                fill(kv, upto)
                ledger.tokens = upto
            if logits is None and upto:
                logits = torch.empty(batch, config.vocab_size, dtype=dtype, device=meta)

    try:
        with ledger, kernels:
            ids = torch.zeros(batch, prompt, dtype=torch.long, device=meta)
            with ledger.region("cache"):
                make = MAKE.get(cache, cache)
                kvs = [MeteredCache(make(config, context, device=meta, dtype=dtype), ledger)
                       for _ in range(batch)]
            skip(chunks[0])
            for s in chunks:  # lists, as the loop calls it: the ids of a batch are packed
                logits = forward(model, list(ids[:, s : s + prefill_chunk].split(1)), kvs,
                                 [s] * batch)
                ledger.mark(kvs[0].seq_len)
            skip(steps[0])
            for pos in steps:
                logits = forward(model, list(logits.argmax(-1, keepdim=True).split(1)), kvs,
                                 [pos] * batch)
                ledger.mark(kvs[0].seq_len)
    except torch.OutOfMemoryError as e:
        oom = e
    finally:
        for h in hooks:
            h.remove()
    return Run(getattr(cache, "__qualname__", cache), ledger.budget, ledger.peak,
               ledger.at_peak, ledger.timeline, kernels.counts, oom)


def fits_context(model, context: int, *, prefill_chunk: int = 512, decode: int = 4, **kw) -> bool:
    """Whether every prompt up to ``context`` tokens, and its decode steps to ``context``, fit: two
    tail runs, the longest prompt and the longest whose last chunk is ``prefill_chunk - 1`` tokens
    (a peak depends on the last chunk's size too: an unaligned mask the kernel must copy)."""
    model = meta_model(model)
    kw.update(prefill_chunk=prefill_chunk, tail=True)
    prompt = context - decode
    partial = prompt - (prompt + 1) % prefill_chunk
    return (simulate(model, context, decode=decode, **kw).fits
            and (partial < 1 or partial == prompt
                 or simulate(model, context, decode=context - partial, **kw).fits))


def longest_context(model, *, lo: int | None = None, hi: int | None = None, **kw) -> int:
    """The longest context that :func:`fits_context`, by bisection between ``lo`` (fits) and ``hi``
    (does not; by default, one token more than the cache alone leaves room for)."""
    model = meta_model(model)
    lo = kw.get("decode", 4) + 1 if lo is None else lo
    if hi is None:
        budget = kw.get("budget") or get_card(kw.get("card", "12 GiB")).memory
        kv = kv_bytes_per_token(model.config, model.dtype, kw.get("batch", 1))
        hi = (budget - _weights(model)) // kv + 1
    elif fits_context(model, hi, **kw):
        raise ValueError(f"{hi:,} tokens fit: not an upper bound")
    if not fits_context(model, lo, **kw):
        raise ValueError(f"{lo:,} tokens do not fit: not a lower bound")
    return largest(lambda n: fits_context(model, n, **kw), hi, lo=lo)
