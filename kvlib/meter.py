"""Bytes allocated, counted op by op at the aten dispatch level, not in the CUDA allocator: the
same numbers on CPU, CUDA and ``meta``, so a CPU test can hold them fixed. An output counts when its
storage is no input's (a view or an in-place write counts 0); storages are told apart by their
``StorageImpl``, as ``data_ptr`` is 0 on ``meta``. Not seen: kernels' scratch, allocator rounding.
Kernels are counted there too (:func:`count_kernels`)."""

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .budget import meta_model
from .contract import Cache
from .decoder import forward
from .graphs import StaticStep
from .kv_cache import KVCache

__all__ = ["AllocMeter", "MeteredCache", "count_kernels", "decode_kernels", "fill", "new_storages"]

ONE_KERNEL = {F.scaled_dot_product_attention: "sdpa", F.rms_norm: "rms_norm"}  # fused on CUDA
NO_KERNEL = {getattr(torch.ops.aten, op).default for op in (  # memory or metadata only
    "empty_strided", "_unsafe_view", "detach", "lift_fresh")} | {torch.ops.aten.empty.memory_format}


def _storages(tree) -> Iterator[torch.UntypedStorage]:
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            with suppress(RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
                yield t.untyped_storage()


def new_storages(args, kwargs, out) -> dict[int, torch.UntypedStorage]:
    """The storages of an op's outputs that are no input's, each once, by ``StorageImpl``."""
    seen = {s._cdata for s in _storages((args, kwargs))}
    return {s._cdata: s for s in _storages(out) if s._cdata not in seen}


class AllocMeter(TorchDispatchMode):
    """Sum the storage bytes of every new tensor made while active, in all (``total``), by aten
    overload (``by_op``), by region, and per step (``mark()``). Re-entering starts a new step."""

    def __init__(self) -> None:
        super().__init__()
        self.total = self.count = 0
        self.by_op, self.by_region, self.steps, self.step_regions = {}, {}, [], []
        self._region, self._step = "other", {}  # "other": outside any ``region()``

    def __enter__(self) -> "AllocMeter":
        self._step = {}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op, region = str(func), self._region
        for s in new_storages(args, kwargs, out).values():  # two outputs on one count once
            self.total, self.count = self.total + s.nbytes(), self.count + 1
            for tally, key in ((self.by_op, op), (self.by_region, region), (self._step, region)):
                tally[key] = tally.get(key, 0) + s.nbytes()
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
    """A cache whose ``write``/``view`` are metered under the region ``"cache"``, apart from the
    model's activations; every other attribute, read or written, is the wrapped cache's."""

    def __init__(self, cache: Cache, meter: AllocMeter) -> None:
        vars(self).update(cache=cache, meter=meter)  # not through __setattr__: not the cache's

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


def fill(cache, upto: int, layers: int | None = None) -> None:
    """Zeros into slots ``seq_len..upto`` of the first ``layers`` layers (all by default): a cache
    as ``upto`` tokens leave it, to measure the step after (values change no byte or kernel)."""
    if upto > cache.seq_len:
        zeros = torch.zeros(upto - cache.seq_len, cache.n_kv_heads, cache.head_dim,
                            dtype=cache.dtype, device=cache.device)
        for layer in range(cache.n_layers if layers is None else layers):
            cache.write(layer, cache.seq_len, zeros, zeros)
    cache.seq_len = upto


class _Kernels(TorchDispatchMode):
    """Counts aten ops that launch a kernel: not views, metadata, or work on empty tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels, self.inside = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (self.inside or func.is_view or func in NO_KERNEL or not any(
                t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))):
            self.kernels[str(func.overloadpacket)] += 1
        return out


class _Fused(TorchFunctionMode):
    """Counts a ``ONE_KERNEL`` call once, and none of the ops it decomposes into off CUDA."""

    def __init__(self, kernels: _Kernels) -> None:
        super().__init__()
        self.kernels = kernels

    def __torch_function__(self, func, types, args=(), kwargs=None):
        one = ONE_KERNEL.get(func) if not self.kernels.inside else None
        self.kernels.kernels.update([one] if one else [])
        self.kernels.inside += one is not None
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.kernels.inside -= one is not None


def count_kernels(fn, *args, **kwargs) -> Counter:
    """Kernels one call ``fn(*args, **kwargs)`` launches, by aten op; SDPA and ``F.rms_norm`` are
    one each. On ``meta`` nothing runs, and it is the count a GPU launches."""
    kernels = _Kernels()
    with kernels, _Fused(kernels):
        fn(*args, **kwargs)
    return kernels.kernels


def decode_kernels(model, step: str = "static", *, context: int = 4096,
                   attention="split") -> Counter:
    """:func:`count_kernels` of a decode step at slot ``context`` (``"eager"``, or ``"static"``
    over a bucket short of the cache's end) of a model, or of a config or its name on ``meta``."""
    model = meta_model(model)
    cache = KVCache.for_model(model.config, context + 257, device=model.device, dtype=model.dtype)
    cache.seq_len, token = context, torch.zeros(1, 1, dtype=torch.long, device=model.device)
    if step == "eager":
        return count_kernels(forward, model, token, cache, context)
    return count_kernels(StaticStep(model, cache, capture=False, attention=attention), token,
                         context)
