"""Paged KV: many requests share one pool of fixed-size blocks.

A preallocated cache per request reserves the longest request's slots for each; on a pool, a
request holds its length rounded up to a block. One block id spans every layer,
``[L, Hkv, blocks, block, D]``, the layout paged FlexAttention reads. SDPA cannot follow a block
table, so :meth:`PagedCache.view` gathers the blocks, a copy only a kernel reading the table
removes. :meth:`PagedCache.fork` shares blocks (reference counts, copy on write): a shared prefix
is stored once.

With ``prefix_cache=True`` the pool also shares prefixes between requests that arrive apart: the
same tokens at the same positions give the same K and V. A new request holds the longest chain of
cached full blocks its prompt starts with; a finished request's blocks stay cached, held by nobody,
until the pool needs them (least recently used first). The prefix index promises: a key (parent,
tokens) names the exact prefix its block holds, as a parent (block id, times keyed) names one; a
held block is never evicted, a cached one never written (a write copies it); a live request's
``remember`` never fails. A key whose parent is evicted stays true, unreachable: its holder's next
``remember`` keys its block again on the live chain; an idle one is evicted in its turn."""

from collections import OrderedDict

import torch

from .config import head_dim, kv_heads, size
from .contract import bytes_per_token, check_crop, check_kv, check_view
from .env import default_device

__all__ = ["BlockPool", "OutOfBlocks", "PagedCache"]


class OutOfBlocks(RuntimeError):
    """Too few blocks are free or idle. The policy: refuse the write before taking any block, so the
    pool and every request stay as they were; the caller frees or waits."""


class BlockPool:
    """The blocks, the free list and the reference counts that requests' block tables point into;
    with ``prefix_cache``, the cached full blocks and the idle ones among them (held by nobody)."""

    def __init__(self, n_layers: int, n_blocks: int, block: int, n_kv_heads: int, head_dim: int,
                 *, device=None, dtype: torch.dtype = torch.bfloat16,
                 prefix_cache: bool = False) -> None:
        if min(n_layers, n_blocks, block, n_kv_heads, head_dim) < 1:
            raise ValueError(f"bad pool: layers={n_layers} blocks={n_blocks} block={block} "
                             f"kv_heads={n_kv_heads} head_dim={head_dim}")
        self.n_blocks, self.block, self.prefix_cache = int(n_blocks), int(block), prefix_cache
        shape = (n_layers, n_kv_heads, self.n_blocks, self.block, head_dim)
        device = default_device() if device is None else device
        self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
        self.free = list(range(self.n_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first
        self.refs = [0] * self.n_blocks  # requests holding each block
        self.cached: dict[tuple, int] = {}  # (parent, tokens) -> the block holding their K/V
        self.key_of: dict[int, tuple] = {}  # block -> its key, for the cached blocks
        self.epoch = [0] * self.n_blocks  # times keyed: a block keyed again is another parent
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, held by nobody: LRU first

    @classmethod
    def for_model(cls, config, n_blocks: int, block: int, *, device=None, dtype=None,
                  prefix_cache: bool = False):
        return cls(config.num_hidden_layers, n_blocks, block, kv_heads(config), head_dim(config),
                   device=device, dtype=dtype or torch.bfloat16, prefix_cache=prefix_cache)

    nbytes = property(lambda self: 2 * self.k.numel() * self.k.element_size())
    block_bytes = property(lambda self: self.nbytes // self.n_blocks)  # K and V, all layers
    used = property(lambda self: self.n_blocks - len(self.free) - len(self.idle))  # held
    available = property(lambda self: len(self.free) + len(self.idle))  # idle ones by eviction

    def allocate(self) -> int:
        """A free block, else the least recently used idle one, evicted (callers check it fits)."""
        if self.free:
            b = self.free.pop()
        else:
            b, _ = self.idle.popitem(last=False)  # never a held block: those are not idle
            del self.cached[self.key_of.pop(b)]
        self.refs[b] = 1
        return b

    def hold(self, b: int) -> None:
        self.refs[b] += 1
        self.idle.pop(b, None)

    def release(self, blocks) -> None:
        idle = []
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                (idle if b in self.key_of else self.free).append(b)
        # a chain's tail goes idle first, so it is evicted before the blocks its key depends on
        self.idle.update(dict.fromkeys(reversed(idle)))

    def copy(self, b: int) -> int:
        """Copy on write: a private copy of block ``b``, all layers, for one holder."""
        new = self.allocate()
        self.k[:, :, new], self.v[:, :, new] = self.k[:, :, b], self.v[:, :, b]
        self.release([b])
        return new

    def __repr__(self) -> str:
        cached = f", {len(self.cached)} cached ({len(self.idle)} idle)" if self.prefix_cache else ""
        return (f"BlockPool({self.n_blocks} blocks x {self.block} slots, {self.used} used{cached}, "
                f"{size(self.block_bytes)}/block, {size(self.nbytes)})")


class PagedCache:
    """One request: a block table into a shared :class:`BlockPool`; ``max_seq``, the whole pool,
    is the most it could get. ``tokens``: its slots' token ids as far as the loop said."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool, self.table, self.seq_len, self.max_seq = pool, [], 0, pool.n_blocks * pool.block
        self.n_layers, self.n_kv_heads, _, _, self.head_dim = pool.k.shape
        self._index = torch.empty(0, dtype=torch.long, device=pool.k.device)  # the table, on device
        self._span = self._where = None  # the slots of the step being written, and their blocks
        self.tokens: list[int] = []

    dtype = property(lambda self: self.pool.k.dtype)
    device = property(lambda self: self.pool.k.device)
    nbytes = property(lambda self: len(self.table) * self.pool.block_bytes)  # shared ones too
    bytes_per_token = property(bytes_per_token)

    def reset(self) -> None:
        """The request is done: its blocks go back to the pool (a shared one with its last)."""
        self.crop(0)

    def crop(self, seq_len: int) -> None:
        """Keep the first ``seq_len`` slots; the blocks past them go back to the pool."""
        check_crop(self, seq_len)
        keep = -(-seq_len // self.pool.block)
        self.pool.release(self.table[keep:])
        self.table, self._index = self.table[:keep], self._index[:keep]
        self.seq_len, self.tokens, self._span = seq_len, self.tokens[:seq_len], None

    def fork(self) -> "PagedCache":
        """A new request that starts with this one's ``seq_len`` slots, on the same blocks."""
        child = PagedCache(self.pool)
        child.table, child.seq_len, child._index = list(self.table), self.seq_len, self._index
        child.tokens = list(self.tokens)
        for b in self.table:
            self.pool.hold(b)
        self._span = None  # its blocks are shared now: the next write must check
        return child

    def _key(self, parent, i: int, tokens: list[int]) -> tuple:
        """Block ``i``'s key: its parent and its tokens (a shallow tuple: one block's compare)."""
        return parent, tuple(tokens[i * self.pool.block : (i + 1) * self.pool.block])

    def reuse(self, tokens: list[int]) -> int:
        """An empty request about to run ``tokens``: hold the longest chain of cached full blocks
        they start with (one token at least is left to compute: its logits pick the next token);
        return how many slots those hold, this request's slots ``0..`` now. Too few blocks for
        the rest of ``tokens``: :class:`OutOfBlocks`, before any block is held."""
        pool, parent, chain = self.pool, None, []
        if self.seq_len or not pool.prefix_cache:
            return 0
        for i in range((len(tokens) - 1) // pool.block):
            if (b := pool.cached.get(self._key(parent, i, tokens))) is None:
                break
            chain.append(b)
            parent = (b, pool.epoch[b])
        n = len(chain) * pool.block  # held idle blocks are no longer available
        self._enough(n, len(tokens), -((n - len(tokens)) // pool.block), len(chain),
                     pool.available - len(pool.idle.keys() & chain))
        for b in chain:
            pool.hold(b)
        self.table, self.seq_len, self.tokens = chain, n, list(tokens[:n])
        self._index = torch.tensor(chain, dtype=torch.long, device=self.device)
        return n

    def remember(self, tokens: list[int], start: int = 0) -> None:
        """``tokens`` are those of slots ``start..``: key each full block of known slots on the
        chain a new request follows (through an equal block keyed first, which it need not hold)."""
        if start > len(self.tokens):
            return  # slots nobody named lie before them: their blocks cannot be keyed
        self.tokens[start:] = tokens
        pool, parent = self.pool, None
        full = min(len(self.tokens), self.seq_len) // pool.block if pool.prefix_cache else 0
        for i in range(full):
            key, b = self._key(parent, i, self.tokens), self.table[i]
            if (found := pool.cached.get(key)) is None:
                pool.cached.pop(pool.key_of.get(b), None)  # keyed onto a parent since evicted
                found = pool.cached[key] = b
                pool.key_of[b], pool.epoch[b] = key, pool.epoch[b] + 1
            parent = (found, pool.epoch[found])

    def _enough(self, start: int, end: int, needed: int, held: int, available: int) -> None:
        if needed > available:
            raise OutOfBlocks(f"out of KV blocks (slots {start}..{end}, {held} blocks held): "
                              f"{needed} needed, {available} of {self.pool.n_blocks} blocks of "
                              f"{self.pool.block} slots free; reset() finished requests or make "
                              f"the pool bigger")

    def _prepare(self, start: int, end: int) -> None:
        """Before a step's first write: blocks up to ``end``, private uncached ones for the slots
        written. All or nothing: too few blocks change nothing."""
        pool, blk, table = self.pool, self.pool.block, self.table
        new = max(0, -(-end // blk) - len(table))
        copies = [i for i in range(start // blk, min(len(table), -(-end // blk)))
                  if pool.refs[table[i]] > 1 or table[i] in pool.key_of]
        self._enough(start, end, new + len(copies), len(table), pool.available)
        for i in copies:
            table[i] = pool.copy(table[i])
        table += [pool.allocate() for _ in range(new)]
        self._index = torch.tensor(table, dtype=torch.long, device=self.device)
        slots = torch.arange(start, end, device=self.device)
        self._span, self._where = (start, end), (self._index[slots // blk], slots % blk)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``[n, Hkv, D]`` into slots ``start..start+n``: one scatter into the request's blocks."""
        end = check_kv(self, layer, start, k, v)  # max_seq: the whole pool
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
        return (f"PagedCache(seq_len={self.seq_len}, {len(self.table)} blocks of {self.pool.block} "
                f"slots, {size(self.nbytes)}; pool {self.pool.used}/{self.pool.n_blocks} used)")
