"""Paged KV: many requests share one pool of fixed-size blocks.

A slab per request reserves the longest request for every request; on a pool, a request holds its
length rounded up to a block. One block id spans every layer, ``[L, Hkv, blocks, block, D]``, the
layout paged FlexAttention reads. SDPA cannot follow a block table, so :meth:`PagedCache.view`
gathers the blocks, a copy only a kernel reading the table removes. :meth:`PagedCache.fork` shares
blocks (reference counts, copy on write): a shared prefix is stored once.
"""

import torch

from .cache import bytes_per_token, check_kv, check_view
from .config import head_dim, kv_heads, size
from .env import default_device

__all__ = ["BlockPool", "OutOfBlocks", "PagedCache"]


class OutOfBlocks(RuntimeError):
    """Every block of the pool is held. The policy: refuse the write; the caller frees or waits."""


class BlockPool:
    """The blocks, the free list and the reference counts that requests' block tables point into."""

    def __init__(self, n_layers: int, n_blocks: int, block: int, n_kv_heads: int, head_dim: int,
                 *, device=None, dtype: torch.dtype = torch.bfloat16) -> None:
        if min(n_layers, n_blocks, block, n_kv_heads, head_dim) < 1:
            raise ValueError(f"bad pool: layers={n_layers} blocks={n_blocks} block={block} "
                             f"kv_heads={n_kv_heads} head_dim={head_dim}")
        self.n_blocks, self.block = int(n_blocks), int(block)
        shape = (n_layers, n_kv_heads, self.n_blocks, self.block, head_dim)
        device = default_device() if device is None else device
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
        self.free = list(range(self.n_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first
        self.refs = [0] * self.n_blocks  # requests holding each block

    @classmethod
    def for_model(cls, config, n_blocks: int, block: int, *, device=None, dtype=None):
        return cls(config.num_hidden_layers, n_blocks, block, kv_heads(config), head_dim(config),
                   device=device, dtype=dtype or torch.bfloat16)

    nbytes = property(lambda self: 2 * self.k.numel() * self.k.element_size())
    block_bytes = property(lambda self: self.nbytes // self.n_blocks)  # K and V, all layers
    used = property(lambda self: self.n_blocks - len(self.free))

    def allocate(self, why: str = "") -> int:
        if not self.free:
            raise OutOfBlocks(f"out of KV blocks{why}: all {self.n_blocks} blocks of {self.block} "
                              f"slots are held; reset() finished requests or make the pool bigger")
        b = self.free.pop()
        self.refs[b] = 1
        return b

    def release(self, blocks) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    def copy(self, b: int) -> int:
        """Copy on write: a private copy of shared block ``b``, all layers, for one holder."""
        new = self.allocate()
        self.k[:, :, new], self.v[:, :, new] = self.k[:, :, b], self.v[:, :, b]
        self.release([b])
        return new

    def __repr__(self) -> str:
        return (f"BlockPool({self.n_blocks} blocks x {self.block} slots, {self.used} used, "
                f"{size(self.block_bytes)}/block, {size(self.nbytes)})")


class PagedCache:
    """One request: a block table into a shared :class:`BlockPool`. ``max_seq`` is the whole pool,
    the most one request could get; a write that finds no free block raises :class:`OutOfBlocks`."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool, self.table, self.seq_len, self.max_seq = pool, [], 0, pool.n_blocks * pool.block
        self.n_layers, self.n_kv_heads, _, _, self.head_dim = pool.k.shape
        self._index = torch.empty(0, dtype=torch.long, device=pool.k.device)  # the table, on device
        self._span = self._where = None  # the slots of the step being written, and their blocks

    dtype = property(lambda self: self.pool.k.dtype)
    device = property(lambda self: self.pool.k.device)
    nbytes = property(lambda self: len(self.table) * self.pool.block_bytes)  # shared ones too
    bytes_per_token = property(bytes_per_token)

    def reset(self) -> None:
        """The request is done: its blocks go back to the pool (a shared one with its last)."""
        self.pool.release(self.table)
        self.table, self.seq_len, self._span, self._index = [], 0, None, self._index[:0]

    def fork(self) -> "PagedCache":
        """A new request that starts with this one's ``seq_len`` slots, on the same blocks."""
        child = PagedCache(self.pool)
        child.table, child.seq_len, child._index = list(self.table), self.seq_len, self._index
        for b in self.table:
            self.pool.refs[b] += 1
        self._span = None  # its blocks are shared now: the next write must check
        return child

    def _prepare(self, start: int, end: int) -> None:
        """Before a step's first write: blocks up to ``end``, private ones for the slots written."""
        blk, table = self.pool.block, self.table
        while len(table) * blk < end:
            table.append(self.pool.allocate(f" (slots {start}..{end}, {len(table)} blocks held)"))
        for i in range(start // blk, -(-end // blk)):  # the blocks written: copy the shared ones
            if self.pool.refs[table[i]] > 1:
                table[i] = self.pool.copy(table[i])
        self._index = torch.tensor(table, dtype=torch.long, device=self.device)
        slots = torch.arange(start, end, device=self.device)
        self._span, self._where = (start, end), (self._index[slots // blk], slots % blk)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``[n, Hkv, D]`` into slots ``start..start+n``: one scatter into the request's blocks."""
        if (end := start + k.shape[0]) > self.max_seq:
            raise ValueError(f"KV overflow: writing slots {start}..{end} into a pool of "
                             f"{self.pool.n_blocks} blocks x {self.pool.block} = {self.max_seq} "
                             f"slots")
        check_kv(self, layer, start, k, v)
        if layer == 0 or self._span != (start, end):  # a step writes layer 0 first
            self._prepare(start, end)
        blocks, offsets = self._where
        self.pool.k[layer][:, blocks, offsets] = k.transpose(0, 1)  # [Hkv, n, D]
        self.pool.v[layer][:, blocks, offsets] = v.transpose(0, 1)

    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, Hkv, seq, D]``: the request's blocks gathered in order. A copy, not a view."""
        check_view(self, layer, seq, lambda: len(self.table) * self.pool.block,
                   "a request holding {}")
        index = self._index[: -(-seq // self.pool.block)]  # [Hkv, nb, block, D] -> [1, Hkv, S, D]
        shape = (1, self.n_kv_heads, len(index) * self.pool.block, self.head_dim)
        return tuple(t[layer].index_select(1, index).view(shape)[:, :, :seq]
                     for t in (self.pool.k, self.pool.v))

    def __repr__(self) -> str:
        pool = self.pool
        return (f"PagedCache(seq_len={self.seq_len}, {len(self.table)} blocks of {pool.block} "
                f"slots, {size(self.nbytes)}; pool {pool.used}/{pool.n_blocks} used)")
