"""The contract every cache keeps, written once: a new cache is one module that satisfies it and
plugs into the loop, the meter and the static step without a branch. A step writes ``[n, Hkv, D]``
per layer at ``start``, reads ``[1, Hkv, S, D]``; the loop advances ``seq_len`` after every layer.

Beyond :class:`Cache`, a cache may offer capabilities, each a protocol below, documented there
once; the loop, the decoder, prompt lookup and the static step ask :func:`offers`, and nothing
else probes a cache. :func:`offers` asks the object (``hasattr``), so a wrapper that forwards
attributes (:class:`~kvlib.meter.MeteredCache`) offers what it wraps; it costs under a
microsecond a question, where ``isinstance`` on a runtime-checkable protocol costs 15-20 (and
from Python 3.12 would not see a forwarded attribute), and the decoder asks once per forward.

:class:`~kvlib.latent_cache.LatentCache` keeps the bookkeeping (``seq_len``, ``max_seq``,
``nbytes``, ``reset``) and :class:`Rollback`, but not ``write``/``view`` of per-head K/V: MLA
caches one latent and one shared RoPE key a token, no K or V per head, so the eager decoder and
the static step cannot read it; ``generate`` runs it through its own latent forward.
"""

import functools
from collections.abc import Callable
from typing import Protocol

import torch

from .config import kv_token_bytes

__all__ = ["CAPABILITIES", "Cache", "Positions", "PrefixReuse", "Rollback", "StaticWrites",
           "Window", "at_places", "bytes_per_token", "check_crop", "check_fits", "check_ids",
           "check_kv", "check_start", "check_view", "offers"]


class Cache(Protocol):
    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_seq: int | None  # None: grows until memory runs out
    seq_len: int  # valid slots; slots past it are never read

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def nbytes(self) -> int: ...

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def reset(self) -> None: ...


class Rollback(Protocol):
    """``crop(seq_len)``: afterwards the cache reads exactly as if only its first ``seq_len``
    tokens had ever been written (speculative decoding relies on it); a crop it cannot keep that
    promise for is refused, changing nothing."""

    def crop(self, seq_len: int) -> None: ...


class Positions(Protocol):
    """A cache that holds some positions only (a ring): ``visible(start, n)`` ``[n, S]`` bool says
    which keys of its view each of ``n`` queries at ``start`` sees; ``positions`` is what RoPE
    rotates a key by: ``"absolute"``, its position in the text, or ``"cache"``, its place in the
    cache, which ``places(start, n)`` ``[S]`` gives for each key read (the new tokens last)."""

    positions: str

    def visible(self, start: int, n: int) -> torch.Tensor: ...

    def places(self, start: int, n: int) -> torch.Tensor: ...


class Window(Protocol):
    """Attention over the last ``window`` positions, and the first ``sinks`` always; positions are
    written in order, so a forward continues at ``seq_len``."""

    window: int
    sinks: int


class PrefixReuse(Protocol):
    """A prefix cache: ``reuse(tokens)``, for an empty request, holds the cached slots its prompt
    starts with and returns how many; ``remember(tokens, start)`` says which tokens fill the slots
    from ``start`` once they are written, so later requests may reuse them."""

    def reuse(self, tokens: list[int]) -> int: ...

    def remember(self, tokens: list[int], start: int = 0) -> None: ...


class StaticWrites(Protocol):
    """``write_at(layer, pos, k, v)``: the slots are a device tensor ``[n]``, so a CUDA graph
    replays the write at a new position; the caller checks the range on the host."""

    def write_at(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


CAPABILITIES = (Rollback, Positions, Window, PrefixReuse, StaticWrites)


@functools.cache
def _members(protocol: type) -> tuple[str, ...]:
    return (*protocol.__annotations__,
            *(n for n, f in vars(protocol).items() if callable(f) and not n.startswith("_")),
            *(n for n, f in vars(protocol).items() if isinstance(f, property)))


def offers(cache, capability: type) -> bool:
    """Does ``cache`` offer ``capability`` (:class:`Cache` or one of :data:`CAPABILITIES`)?"""
    return all(hasattr(cache, name) for name in _members(capability))


def at_places(cache) -> bool:
    """Does RoPE rotate this cache's keys by their places in it, not their positions in the text?"""
    return offers(cache, Positions) and cache.positions == "cache"


def check_ids(model, ids, who: str = "") -> None:
    """Refuse what is not one request's token ids: ``[1, n]``, ``n >= 1``, ``torch.long`` or
    ``int``, on the model's device, each in ``0..V-1``. Reading the values waits for the device,
    so a prompt is checked once, where it enters; never the ids a step feeds back (the model's)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or not ids.numel():
        what = list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{who}ids must be [1, n] with n >= 1 (one request), got {what}")
    if ids.dtype not in (torch.long, torch.int) or ids.device != model.device:
        raise ValueError(f"{who}ids are {ids.dtype} on {ids.device}: token ids are torch.long or "
                         f"torch.int, on the model's {model.device}")
    V = model.get_input_embeddings().num_embeddings
    if ids.device.type != "meta":  # shapes only there: no values to read
        lo, hi = torch.stack(ids.aminmax()).tolist()
        if lo < 0 or hi >= V:
            i = int(((ids[0] < 0) | (ids[0] >= V)).nonzero()[0])
            raise ValueError(f"{who}token id {int(ids[0, i])} at index {i} of {ids.shape[1]}: "
                             f"the vocabulary has {V} ids, 0..{V - 1}")


def check_fits(model, cache, names: str, have: tuple, want: tuple, who: str = "") -> None:
    """Refuse a cache this model cannot run over, before anything is written: its numbers
    (``names``: the cache's ``have``, the model's ``want``), dtype and device are the model's."""
    if have != want or (cache.dtype, cache.device) != (model.dtype, model.device):
        raise ValueError(f"{who}the cache has {names} {have}, {cache.dtype} on {cache.device}; "
                         f"the model needs {want}, {model.dtype} on {model.device}")


def bytes_per_token(cache: Cache) -> int:
    """KV cost of one more token in ``cache``, all layers, K and V."""
    return kv_token_bytes(cache.n_layers, cache.n_kv_heads, cache.head_dim, cache.dtype)


def check_start(cache, start: int, n: int, held: int | None = None, who: str = "") -> None:
    """Refuse ``n`` tokens at ``start`` before anything is written: a forward reads every slot
    before ``start``, so it continues from the ``held`` slots (``seq_len``) or rewrites some."""
    held = cache.seq_len if held is None else held
    if not isinstance(start, int) or not 0 <= start <= held:
        raise ValueError(f"{who}start {start!r}: the cache holds {held} slots, so a forward "
                         f"starts at 0..{held} (past them it would read slots never written)")
    if offers(cache, Window) and start != held:
        raise ValueError(f"{who}a ring writes positions in order: start {start}, it holds "
                         f"0..{held}; crop({start}) first")
    if cache.max_seq is not None and start + n > cache.max_seq:
        raise ValueError(f"{who}KV overflow: writing slots {start}..{start + n} into "
                         f"max_seq={cache.max_seq}")


def check_kv(cache: Cache, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> int:
    """Refuse a write that would be wrong, before anything is written; return its end slot. Shared
    by every cache, so they all refuse the same things with the same words."""
    if not 0 <= layer < cache.n_layers:
        raise IndexError(f"layer {layer} out of range for n_layers={cache.n_layers}")
    if start < 0:
        raise IndexError(f"negative start {start}")
    want = (cache.n_kv_heads, cache.head_dim)
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [n, {want[0]}, "
                             f"{want[1]}] (n new tokens, n_kv_heads, head_dim)")
        if t.dtype != cache.dtype or t.device != cache.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, "
                             f"cache is {cache.dtype} on {cache.device}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree")
    end = start + k.shape[0]
    if cache.max_seq is not None and end > cache.max_seq:
        raise ValueError(f"KV overflow: writing slots {start}..{end} into max_seq={cache.max_seq}")
    return end


def check_view(cache: Cache, layer: int, seq: int, held: Callable[[], int], where: str) -> None:
    """Refuse a view of a layer the cache lacks, or of more than the ``held()`` slots of ``where``
    (a format string for that number)."""
    if not 0 <= layer < cache.n_layers:
        raise IndexError(f"layer {layer} out of range for n_layers={cache.n_layers}")
    if not 0 <= seq <= held():
        raise ValueError(f"view of {seq} slots from {where.format(held())}")


def check_crop(cache, seq_len: int) -> None:
    """Refuse a crop to more slots than the cache holds, or fewer than none, before any change."""
    if not 0 <= seq_len <= cache.seq_len:
        raise ValueError(f"crop to {seq_len} slots: the cache holds {cache.seq_len}")
