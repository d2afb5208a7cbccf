"""The contract, run on every cache: each cache claims the capabilities it should (no more), and
keeps every one it claims: the base contract (writes read back, refusals with the numbers that
change nothing, reset), rollback, the positions a query sees, a window, prefix reuse, static
writes. A :class:`MeteredCache` offers exactly what it wraps. ``LatentCache`` keeps rollback and
the bookkeeping, not per-head K/V (see :mod:`kvlib.contract`), and is run through those."""

import pytest
import torch
from helpers import write

from kvlib import AllocMeter, CatCache, KVCache, LatentCache, MeteredCache, QuantCache, RingCache
from kvlib.contract import (
    CAPABILITIES,
    Cache,
    Positions,
    PrefixReuse,
    Rollback,
    StaticWrites,
    Window,
    offers,
)
from kvlib.paged_cache import BlockPool, PagedCache

L, H, D, S = 2, 2, 8, 32  # layers, kv_heads, head_dim, slots of the bare caches
R, P = 12, 4  # a latent cache's rank and RoPE key
F32 = dict(device="cpu", dtype=torch.float32)
MAKE = {
    "prealloc-head": lambda: KVCache(L, S, H, D, layout="head", **F32),
    "prealloc-seq": lambda: KVCache(L, S, H, D, layout="seq", **F32),
    "cat": lambda: CatCache(L, H, D, **F32),
    "paged": lambda: PagedCache(BlockPool(L, 8, 4, H, D, **F32)),
    "paged-prefix": lambda: PagedCache(BlockPool(L, 8, 4, H, D, prefix_cache=True, **F32)),
    "int8": lambda: QuantCache(L, S, H, D, bits=8, **F32),
    "int4": lambda: QuantCache(L, S, H, D, bits=4, **F32),
    "ring": lambda: RingCache(L, 6, H, D, sinks=1, **F32),
    "ring-places": lambda: RingCache(L, 6, H, D, sinks=1, positions="cache", **F32),
    "latent": lambda: LatentCache(L, S, R, P, **F32),
    "metered-prealloc": lambda: MeteredCache(KVCache(L, S, H, D, **F32), AllocMeter()),
}
CLAIMS = {  # what each offers, beyond the base contract
    "prealloc-head": {Rollback, StaticWrites}, "prealloc-seq": {Rollback, StaticWrites},
    "cat": {Rollback}, "paged": {Rollback, PrefixReuse}, "paged-prefix": {Rollback, PrefixReuse},
    "int8": {Rollback}, "int4": {Rollback}, "ring": {Rollback, Positions, Window},
    "ring-places": {Rollback, Positions, Window}, "latent": {Rollback},
    "metered-prealloc": {Rollback, StaticWrites},
}
KINDS = list(MAKE)


def data(cache, n, seed):
    """``n`` tokens of what ``cache`` stores: K and V ``[n, Hkv, D]``, or a latent and a key."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(n, R), (n, P)] if isinstance(cache, LatentCache) else [(n, H, D)] * 2
    return [torch.randn(s, generator=g) for s in shapes]


def views(cache):
    out = [cache.view(layer, cache.seq_len) for layer in range(cache.n_layers)]
    return [t.clone() for v in out for t in (v if isinstance(v, tuple) else (v,))]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", KINDS)
def test_each_cache_claims_what_it_offers_and_no_more(kind):
    cache = MAKE[kind]()
    assert offers(cache, Cache) == (kind != "latent")
    assert {c for c in CAPABILITIES if offers(cache, c)} == CLAIMS[kind]
    assert all(isinstance(cache, c) == offers(cache, c) for c in (Cache, *CAPABILITIES))


@pytest.mark.parametrize("kind", KINDS)
def test_writes_read_back_and_reset_empties(kind):
    cache = MAKE[kind]()
    a, b = data(cache, 5, seed=0)
    write(cache, 0, a, b)
    assert cache.seq_len == 5 and cache.nbytes > 0 and cache.dtype == torch.float32
    got = views(cache)
    if isinstance(cache, LatentCache):
        want = [torch.cat([a + i, b - i], -1) for i in range(L)]
    else:
        want = [t.permute(1, 0, 2)[None] for i in range(L) for t in (a + i, b - i)]
    tolerance = dict(rtol=0, atol={"int8": 0.05, "int4": 0.8}.get(kind, 0))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tolerance)
    cache.reset()
    assert cache.seq_len == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_write_or_view_is_refused_with_the_numbers_and_changes_nothing(kind):
    cache = MAKE[kind]()
    write(cache, 0, *data(cache, 3, seed=0))
    before = views(cache)
    a, b = data(cache, 1, seed=1)
    bad = [(L, 3, a, b, "layer 2"), (0, 3, a[:, :1], b, "1"), (0, 3, a.double(), b, "float64")]
    for layer, start, x, y, words in bad:
        with pytest.raises((ValueError, IndexError), match=words):
            cache.write(layer, start, x, y)
    if cache.max_seq is not None:
        x, y = data(cache, 2, seed=2)
        with pytest.raises(ValueError, match=f"KV overflow: writing slots {cache.max_seq - 1}\\.\\."
                           f"{cache.max_seq + 1} into"):
            cache.write(0, cache.max_seq - 1, x, y)
    with pytest.raises((ValueError, IndexError), match="layer 5|5"):
        cache.view(5, 3)
    assert cache.seq_len == 3 and same(views(cache), before)


@pytest.mark.parametrize("kind", [k for k in KINDS if Rollback in CLAIMS[k]])
def test_rollback_reads_as_if_the_dropped_tokens_were_never_written(kind):
    cropped, fresh = MAKE[kind](), MAKE[kind]()
    first, then = data(cropped, 7, seed=0), data(cropped, 3, seed=1)
    write(cropped, 0, *first)
    before = views(cropped)
    with pytest.raises(ValueError, match="crop to 8 slots: the cache holds 7"):
        cropped.crop(8)
    assert cropped.seq_len == 7 and same(views(cropped), before)
    cropped.crop(5)
    write(cropped, 5, *then)
    write(fresh, 0, *(x[:5] for x in first))
    write(fresh, 5, *then)
    assert cropped.seq_len == fresh.seq_len == 8 and same(views(cropped), views(fresh))


@pytest.mark.parametrize("kind", [k for k in KINDS if Positions in CLAIMS[k]])
@pytest.mark.parametrize("n", [1, 4], ids=["step", "chunk"])
def test_positions_describe_the_view_a_forward_reads(kind, n):
    cache = MAKE[kind]()
    write(cache, 0, *data(cache, 9, seed=0))  # past the sink and the window of 6
    assert cache.positions == ("cache" if kind.endswith("places") else "absolute")
    places = cache.places(9, n)
    seen = cache.visible(9, n) if n > 1 else None  # a step's one query sees all it reads
    k, v = data(cache, n, seed=1)
    cache.write(0, 9, k, v)
    read = cache.view(0, 9 + n)[0].shape[2]
    assert len(places) == read == (7 if n == 1 else 7 + n)
    if seen is not None:  # [n, S]: each query sees the sink, the last 6 and itself
        assert seen.dtype == torch.bool and seen.shape == (n, read)
        assert seen.sum(1).tolist() == [7] * n


@pytest.mark.parametrize("kind", [k for k in KINDS if Window in CLAIMS[k]])
def test_a_window_writes_in_order_and_refuses_anything_else_changing_nothing(kind):
    cache = MAKE[kind]()
    write(cache, 0, *data(cache, 4, seed=0))
    assert (cache.window, cache.sinks) == (6, 1) and cache.max_seq is None  # never overflows
    before = views(cache)
    for start in (2, 5):
        with pytest.raises(ValueError, match=f"layer 0 holds 0\\.\\.4, a write at {start}"):
            cache.write(0, start, *data(cache, 1, seed=1))
    assert same(views(cache), before)


@pytest.mark.parametrize("kind", [k for k in KINDS if PrefixReuse in CLAIMS[k]])
def test_prefix_reuse_holds_the_full_blocks_a_prompt_starts_with(kind):
    cache = MAKE[kind]()
    tokens = list(range(100, 110))
    write(cache, 0, *data(cache, 10, seed=0))
    cache.remember(tokens)
    other = PagedCache(cache.pool)
    held = other.reuse(tokens + [7])
    assert held == (8 if kind == "paged-prefix" else 0)  # full blocks of 4 only
    assert other.seq_len == held and same(views(other), [t[:, :, :held] for t in views(cache)])


@pytest.mark.parametrize("kind", [k for k in KINDS if StaticWrites in CLAIMS[k]])
def test_static_writes_equal_writes(kind):
    by_slot, by_tensor = MAKE[kind](), MAKE[kind]()
    a, b = data(by_slot, 3, seed=0)
    for layer in range(L):
        by_slot.write(layer, 4, a, b)
        by_tensor.write_at(layer, torch.arange(4, 7), a, b)
    by_slot.seq_len = by_tensor.seq_len = 7
    assert same(views(by_slot), views(by_tensor))
