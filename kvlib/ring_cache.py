"""A sliding-window cache: a ring of slots, so memory stops growing at the window.

A query at ``p`` sees the keys at ``p - W < q <= p``, so position ``p`` takes the slot of ``p - W``.
Only the slot index wraps: RoPE rotated each key by its position before it was written, and
attention ignores the slots' order. A chunk of ``n > 1`` tokens would overwrite keys its first
queries need, so it copies the held slots first (:meth:`RingCache.visible` says which each query
sees). ``sinks`` keeps the first positions beside the ring (StreamingLLM).

``positions="absolute"`` rotates a key by its position in the text, which ``generate`` refuses past
``max_position_embeddings``; ``"cache"`` (StreamingLLM's) by its place in the cache, sinks
first. A full ring's keys all move down a place per step, so re-rotating on eviction would touch
them all anyway: they are held unrotated and rotated on read, one RoPE per step and layer."""

import torch

from .config import head_dim, kv_heads, size
from .contract import check_crop, check_kv
from .env import default_device

__all__ = ["RingCache"]


class RingCache:
    """``[L, Hkv, sinks + window, D]`` whatever the length; positions are written in order."""

    max_seq = None  # slots never run out; memory does not grow

    def __init__(self, n_layers: int, window: int, n_kv_heads: int, head_dim: int, *,
                 sinks: int = 0, positions: str = "absolute", device=None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        if min(n_layers, window, n_kv_heads, head_dim) < 1 or sinks < 0:
            raise ValueError(f"bad shape: layers={n_layers} window={window} kv_heads={n_kv_heads} "
                             f"head_dim={head_dim} sinks={sinks}")
        if positions not in ("absolute", "cache"):
            raise ValueError(f"positions must be 'absolute' or 'cache', not {positions!r}")
        self.n_layers, self.window, self.sinks = int(n_layers), int(window), int(sinks)
        self.positions = positions
        self.n_kv_heads, self.head_dim = int(n_kv_heads), int(head_dim)
        shape = (self.n_layers, self.n_kv_heads, self.sinks + self.window, self.head_dim)
        device = default_device() if device is None else device
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
        self.reset()

    @classmethod
    def for_model(cls, config, window=None, *, sinks=0, positions="absolute", device=None,
                  dtype=None):
        """A ring of the model's own ``sliding_window``, or of ``window``."""
        if not (window := window or getattr(config, "sliding_window", None)):
            raise ValueError(f"{config.model_type!r} has no sliding_window: pass window=")
        return cls(config.num_hidden_layers, window, kv_heads(config), head_dim(config),
                   sinks=sinks, positions=positions, device=device, dtype=dtype or torch.bfloat16)

    dtype = property(lambda self: self.k.dtype)
    device = property(lambda self: self.k.device)
    nbytes = property(lambda self: 2 * self.k.numel() * self.k.element_size())
    bytes_per_token = property(lambda self: self.nbytes // (self.sinks + self.window))  # held

    def reset(self) -> None:
        self.seq_len, self._ends, self._chunk = 0, [0] * self.n_layers, {}

    def crop(self, seq_len: int) -> None:
        """Roll back to ``seq_len`` positions, while the ring still holds every key a query at
        ``seq_len`` sees; the slots of the positions dropped are the next ones overwritten."""
        check_crop(self, seq_len)
        held = max(self.sinks, self.seq_len - self.window)  # the oldest held past the sinks
        if (needs := max(self.sinks, seq_len - self.window + 1)) < min(held, seq_len):
            raise ValueError(f"crop to {seq_len}: the next query, at position {seq_len}, needs "
                             f"{needs}..{seq_len - 1} (and the sinks), but at {self.seq_len}"
                             f" the ring holds {held}..{self.seq_len - 1}: {needs} was overwritten")
        self.seq_len, self._ends, self._chunk = seq_len, [seq_len] * self.n_layers, {}

    def _held(self, end: int) -> list[int]:
        """The positions held once ``0..end`` are written, in order: the sinks, then the window."""
        recent = range(max(self.sinks, end - self.window), end)
        return list(range(min(self.sinks, end))) + list(recent)

    def _slot(self, p: int) -> int:
        return p if p < self.sinks else self.sinks + (p - self.sinks) % self.window

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``[n, Hkv, D]`` for positions ``start..start+n``, which must follow the last written."""
        check_kv(self, layer, start, k, v)
        if start != self._ends[layer]:
            raise ValueError(f"RingCache writes positions in order: layer {layer} holds "
                             f"0..{self._ends[layer]}, a write at {start} would leave stale slots; "
                             f"reset() for a new request")
        self._ends[layer] = end = start + k.shape[0]
        self._chunk.pop(layer, None)  # a copy no attention read is stale now
        if k.shape[0] == 1:  # a decode step: one slot, written in place
            slot = self._slot(start)
            self.k[layer][:, slot], self.v[layer][:, slot] = k[0], v[0]
            return
        # a chunk: its queries need slots it overwrites, so copy them first, the chunk after them
        k, v, old = k.transpose(0, 1), v.transpose(0, 1), [self._slot(p) for p in self._held(start)]
        self._chunk[layer] = tuple(torch.cat([s[layer][:, old], x], 1).unsqueeze(0)
                                   for s, x in ((self.k, k), (self.v, v)))  # [1, Hkv, held + n, D]
        new = [p for p in self._held(end) if p >= start]  # the chunk's positions held after it
        slots, rows = [self._slot(p) for p in new], [p - start for p in new]
        self.k[layer][:, slots], self.v[layer][:, slots] = k[:, rows], v[:, rows]

    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a query at ``seq - 1`` reads: a chunk's copy (once), else the held slots' views."""
        if not 0 <= layer < self.n_layers or seq != self._ends[layer]:
            raise ValueError(f"a ring holds the latest positions only: layer {layer} of "
                             f"{self.n_layers} holds up to {self._ends[layer % self.n_layers]}, "
                             f"not a view of {seq}")
        if layer in self._chunk:
            return self._chunk.pop(layer)
        held = min(seq, self.sinks + self.window)
        return self.k[layer][:, :held].unsqueeze(0), self.v[layer][:, :held].unsqueeze(0)

    def places(self, start: int, n: int) -> torch.Tensor:
        """``[S]``: the place in the cache of each key that ``n`` tokens at ``start`` read, in the
        order read, the new tokens last (``positions="cache"``). A chunk reads a copy in order; a
        decode step reads the slots, the ring's rotated by the wrap. A chunk's later queries see
        the sinks up to ``n - 1`` places further off than a decode step would put them."""
        end, S = start + 1, self.sinks
        if n > 1 or end <= S + self.window:  # in order: a chunk's copy, a ring not yet wrapped
            return torch.arange(end if n == 1 else len(self._held(start)) + n, device=self.device)
        slots = torch.arange(S + self.window, device=self.device)
        return torch.where(slots < S, slots, S + (slots - end) % self.window)

    def visible(self, start: int, n: int) -> torch.Tensor:
        """``[n, S]`` bool: which keys of a chunk's view each of its ``n`` queries may see."""
        keys = torch.tensor(self._held(start) + list(range(start, start + n)), device=self.device)
        queries = torch.arange(start, start + n, device=self.device).unsqueeze(1)  # [n, 1]
        return (keys <= queries) & ((keys < self.sinks) | (keys > queries - self.window))

    def __repr__(self) -> str:
        where = "" if self.positions == "absolute" else ", positions='cache'"
        return (f"RingCache(window={self.window}, sinks={self.sinks}{where}, layers={self.n_layers}"
                f", {self.dtype}, {size(self.nbytes)}, seq_len={self.seq_len})")
