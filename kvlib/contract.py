"""The contract every cache keeps, written once: a new cache is one module that satisfies it and
plugs into the loop, the meter and the static step without a branch. A step writes ``[n, Hkv, D]``
per layer at ``start``, reads ``[1, Hkv, S, D]``; the loop advances ``seq_len`` after every layer.

A cache may offer more: each capability is a protocol below, documented there once, and the loop,
decoder, prompt lookup and static step ask :func:`offers` (``hasattr`` on the object, so a wrapper
that forwards attributes offers what it wraps: under a microsecond a question, where ``isinstance``
on a runtime-checkable protocol costs 15-20, and from Python 3.12 misses forwarded attributes).

:class:`~kvlib.latent_cache.LatentCache` keeps the bookkeeping and :class:`Rollback`, not per-head
``write``/``view``: MLA caches one latent and one shared RoPE key a token, so ``generate`` runs it
through the latent forward, and the eager decoder and the static step refuse it."""

import functools
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from .config import kv_token_bytes

__all__ = ["CAPABILITIES", "Cache", "Positions", "PrefixReuse", "Rollback", "StaticWrites",
           "Window", "at_places", "bytes_per_token", "check_crop", "check_ids", "check_kv",
           "check_start", "check_view", "crop_slots", "offers"]


@runtime_checkable
class Cache(Protocol):
    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_seq: int | None  # None: grows until memory runs out
    seq_len: int  # valid slots; slots past it are never read
    dtype: torch.dtype
    device: torch.device
    nbytes: int

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def reset(self) -> None: ...


@runtime_checkable
class Rollback(Protocol):
    """``crop(seq_len)``: afterwards the cache reads exactly as if only its first ``seq_len``
    tokens had ever been written (speculative decoding relies on it), or it refuses, unchanged."""
    def crop(self, seq_len: int) -> None: ...


@runtime_checkable
class Positions(Protocol):
    """A cache that holds some positions only (a ring), of the view ``n`` tokens at ``start`` read:
    ``visible(start, n)`` ``[n, S]`` bool, the keys each query of a chunk (``n > 1``) sees; and
    ``positions``, what RoPE rotates a key by: ``"absolute"``, its position in the text, or
    ``"cache"``, its place in the cache, ``places(start, n)`` ``[S]`` for each key."""
    positions: str

    def visible(self, start: int, n: int) -> torch.Tensor: ...
    def places(self, start: int, n: int) -> torch.Tensor: ...


@runtime_checkable
class Window(Protocol):
    """Attention over the last ``window`` positions and the first ``sinks``; positions are written
    in order (a write anywhere else is refused)."""
    window: int
    sinks: int


@runtime_checkable
class PrefixReuse(Protocol):
    """A prefix cache: ``reuse(tokens)``, for an empty request, holds the cached slots its prompt
    starts with and says how many; ``remember(tokens, start)``: the tokens of the slots from
    ``start``, once written, so that later requests may reuse them."""
    def reuse(self, tokens: list[int]) -> int: ...
    def remember(self, tokens: list[int], start: int = 0) -> None: ...


@runtime_checkable
class StaticWrites(Protocol):
    """``write_at(layer, pos, k, v)``, the slots a device tensor ``[n]``: a CUDA graph replays the
    write at a new position (the caller checks the range on the host)."""
    def write_at(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


CAPABILITIES = (Rollback, Positions, Window, PrefixReuse, StaticWrites)


@functools.cache
def _members(protocol: type) -> tuple[str, ...]:
    return (*protocol.__annotations__, *(n for n, f in vars(protocol).items()
                                         if callable(f) and not n.startswith("_")))


def offers(cache, capability: type) -> bool:
    """Does ``cache`` offer ``capability`` (:class:`Cache` or one of :data:`CAPABILITIES`)?"""
    return all(hasattr(cache, name) for name in _members(capability))


def at_places(cache) -> bool:
    """Does RoPE rotate this cache's keys by their places in it, not their positions in the text?"""
    return offers(cache, Positions) and cache.positions == "cache"


def bytes_per_token(cache: Cache) -> int:
    """KV cost of one more token in ``cache``, all layers, K and V."""
    return kv_token_bytes(cache.n_layers, cache.n_kv_heads, cache.head_dim, cache.dtype)


def check_ids(model, ids, who: str = "") -> None:
    """Refuse what is not one request's ids ``[1, n]``: torch.long or int, on the model's device,
    in its vocabulary. Reading values waits for the device, so a prompt is checked where it
    enters, never the ids a step feeds back (the model's)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or not ids.numel():
        raise ValueError(f"{who}ids must be [1, n] with n >= 1, got {getattr(ids, 'shape', ids)}")
    if ids.dtype not in (torch.long, torch.int) or ids.device != model.device:
        raise ValueError(f"{who}ids are {ids.dtype} on {ids.device}: token ids are torch.long or "
                         f"torch.int, on the model's {model.device}")
    V = model.get_input_embeddings().num_embeddings
    # one sync, one copy of n flags (a read the fake card answers; meta has no values to read)
    bad = [] if ids.device.type == "meta" else ((ids[0] < 0) | (ids[0] >= V)).tolist()
    if True in bad:
        i = bad.index(True)
        raise ValueError(f"{who}token id {int(ids[0, i])} at index {i} of {ids.shape[1]}: the "
                         f"vocabulary has {V} ids, 0..{V - 1}")


def check_start(cache, start: int, n: int, who: str = "") -> None:
    """Refuse ``n`` tokens at slot ``start`` (a ring or a cat refuses one it cannot continue from
    at the first layer's write, before writing)."""
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"{who}start {start!r}: a forward writes at a slot, an int >= 0")
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


def crop_slots(cache, seq_len: int) -> None:
    """A preallocated cache's crop: its first ``seq_len`` slots are kept as they are (each slot's
    bytes are its own token's); the rest are never read again, so no byte moves."""
    check_crop(cache, seq_len)
    cache.seq_len = seq_len
