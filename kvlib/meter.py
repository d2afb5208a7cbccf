"""Bytes allocated, counted op by op, on any device.

The course's claim about a ``cat`` cache is arithmetic: step ``t`` allocates a new ``[..., t+1, ...]``
tensor and copies the old one into it. To check that claim on a laptop and in CI, not only on a GPU, the
meter sits at the aten dispatch level (a ``TorchDispatchMode``) instead of reading the CUDA allocator:
every op's outputs pass through it on CPU, CUDA and ``meta`` alike, so the same numbers come out
everywhere and a CPU test can hold them fixed.

An output counts when its storage is *new*: not the storage of any input. So a view (``slice``,
``permute``) or an in-place write (``copy_``, ``index_put_``) counts 0 and ``torch.cat`` counts its
whole result. Storages are told apart by their ``StorageImpl`` address (``untyped_storage()._cdata``),
not by ``data_ptr``, which is 0 for every ``meta`` tensor.

What it does not see: scratch memory a kernel allocates for itself and never returns as an op output
(cuBLAS workspaces, SDPA temporaries inside a fused kernel), and anything the caching allocator does
with the bytes -- rounding to 512 B blocks, caching freed blocks, growing ``reserved``. Those are
``kvlib.memory``'s job; this meter counts what the *program* asked for.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .cache import Cache
from .cat_cache import CatCache
from .decoder import forward
from .kv_cache import KVCache

__all__ = ["AllocMeter", "MeteredCache", "cache_bytes_per_step"]

OTHER = "other"  # region name for bytes allocated outside any ``region()``


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """``(identity, nbytes)`` of a tensor's storage, or None if it has none."""
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
        return None
    return s._cdata, s.nbytes()


class AllocMeter(TorchDispatchMode):
    """Sum the storage bytes of every new tensor produced while active.

    ``total``/``count`` cover the meter's whole life; ``by_op`` and ``by_region`` split the same bytes
    by aten overload name and by region; ``mark()`` closes a step and records its bytes in ``steps`` and
    ``step_regions``. Re-entering keeps the totals and starts a fresh step.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = self.count = 0
        self.by_op: dict[str, int] = {}
        self.by_region: dict[str, int] = {}
        self.steps: list[int] = []
        self.step_regions: list[dict[str, int]] = []
        self._region, self._step = OTHER, {}

    def __enter__(self) -> "AllocMeter":
        self._step = {}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = (_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        seen = {s[0] for s in inputs if s is not None}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or (s := _storage(t)) is None or s[0] in seen:
                continue
            seen.add(s[0])  # two outputs on one new storage count once
            self.total += s[1]
            self.count += 1
            op, region = str(func), self._region
            self.by_op[op] = self.by_op.get(op, 0) + s[1]
            self.by_region[region] = self.by_region.get(region, 0) + s[1]
            self._step[region] = self._step.get(region, 0) + s[1]
        return out

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Attribute allocations inside the block to ``name`` (not nestable)."""
        previous, self._region = self._region, name
        try:
            yield
        finally:
            self._region = previous

    def mark(self) -> int:
        """Close a step: bytes allocated since the last mark (or since entering)."""
        step, self._step = self._step, {}
        self.step_regions.append(step)
        self.steps.append(sum(step.values()))
        return self.steps[-1]

    def __repr__(self) -> str:
        return (f"AllocMeter({self.total} B in {self.count} new storages, "
                f"{len(self.steps)} steps, regions={self.by_region})")


class MeteredCache:
    """A cache whose ``write``/``view`` are metered under the region ``"cache"``.

    ``generate(model, ids, n, cache=MeteredCache(cache, meter))`` under ``with meter:`` separates what
    the *cache* allocates per decode step (0 for the preallocated ``KVCache``, the whole cache for a
    ``cat`` cache) from the model's activations. Everything else, reads and writes alike (``seq_len`` is
    advanced by the token loop), goes straight to the wrapped cache.
    """

    def __init__(self, cache: Cache, meter: AllocMeter) -> None:
        object.__setattr__(self, "cache", cache)
        object.__setattr__(self, "meter", meter)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        with self.meter.region("cache"):
            self.cache.write(layer, start, k, v)

    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.meter.region("cache"):
            return self.cache.view(layer, seq)

    def __getattr__(self, name: str) -> Any:
        if name == "cache":  # not set yet (copy, unpickle): don't recurse
            raise AttributeError(name)
        return getattr(self.cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.cache, name, value)

    def __repr__(self) -> str:
        return f"MeteredCache({self.cache!r})"


def cache_bytes_per_step(model, context: int, kind: str) -> int:
    """Bytes the cache allocates in the decode step that writes slot ``context`` (the meter).

    The cache is filled with ``context`` slots of zeros first: what a step allocates depends on how much
    the cache holds, not on what.
    """
    config, device, dtype = model.config, model.device, model.dtype
    if kind == "prealloc":
        cache = KVCache.for_model(config, context + 1, device=device, dtype=dtype)
    else:
        cache = CatCache.for_model(config, device=device, dtype=dtype)
        zeros = torch.zeros(context, cache.n_kv_heads, cache.head_dim, device=device, dtype=dtype)
        for layer in range(cache.n_layers):
            cache.write(layer, 0, zeros, zeros)
    cache.seq_len = context
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    with AllocMeter() as meter:
        forward(model, token, MeteredCache(cache, meter), context)
    return meter.by_region.get("cache", 0)
