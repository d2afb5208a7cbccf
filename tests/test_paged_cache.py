"""The paged cache: a pool of blocks, a free list, block tables, copy on write.

Blocks are taken as a request grows and given back when it is reset; running out is an error with
the pool's numbers; the tokens equal the preallocated cache's; reading gathers the request's blocks
(a copy, measured exactly); a fork shares blocks until it writes into one.
"""

import functools

import pytest
import torch
from helpers import SHARED, tiny_model

from kvlib import AllocMeter, Cache, KVCache, generate
from kvlib.paged_cache import BlockPool, OutOfBlocks, PagedCache

L, H, D = 2, 2, 4  # layers, kv_heads, head_dim of the bare pools


@functools.cache
def model_of(family):
    return tiny_model(family)


def pool_of(n_blocks=8, block=4, model=None):
    if model is not None:
        return BlockPool.for_model(model.config, n_blocks, block, device="cpu", dtype=torch.float32)
    return BlockPool(L, n_blocks, block, H, D, device="cpu", dtype=torch.float32)


def kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)


def fill(cache, start, n, seed=0):
    k, v = kv(n, seed)
    for layer in range(cache.n_layers):
        cache.write(layer, start, k + layer, v - layer)
    cache.seq_len = start + n
    return k, v


def ids(n, seed=1):
    return torch.randint(0, SHARED["vocab_size"], (1, n),
                         generator=torch.Generator().manual_seed(seed))


# --- the pool and the tables ----------------------------------------------------------------


def test_blocks_are_taken_as_a_request_grows_and_given_back_on_reset():
    pool = pool_of()
    a, b = PagedCache(pool), PagedCache(pool)
    assert isinstance(a, Cache) and a.max_seq == 32 and pool.used == 0
    fill(a, 0, 5)  # 5 slots: 2 blocks of 4
    assert a.table == [0, 1] and pool.used == 2 and a.nbytes == 2 * pool.block_bytes
    fill(b, 0, 1)
    fill(a, 5, 3)  # slots 5..8 fit block 1: nothing new
    assert b.table == [2] and a.table == [0, 1]
    fill(a, 8, 1)  # slot 8 opens a third block
    assert a.table == [0, 1, 3] and pool.used == 4
    a.reset()
    assert a.table == [] and a.seq_len == 0 and pool.used == 1
    assert pool.free[-3:] == [0, 1, 3]  # a stack: freed blocks are the next ones handed out
    assert pool.block_bytes == 2 * L * H * 4 * D * 4 and pool.nbytes == 8 * pool.block_bytes


def test_the_view_is_the_slots_written_in_order_gathered_from_the_blocks():
    pool, prealloc = pool_of(), KVCache(L, 32, H, D, device="cpu", dtype=torch.float32)
    other, paged = PagedCache(pool), PagedCache(pool)
    fill(other, 0, 3, seed=9)  # interleave: the request's blocks are not contiguous
    for start, n in ((0, 6), (6, 1), (7, 4)):
        fill(paged, start, n, seed=start), fill(prealloc, start, n, seed=start)
        fill(other, other.seq_len, 4, seed=start + 1)
    assert paged.table == [1, 2, 5] and other.table == [0, 3, 4, 6]
    for layer in range(L):
        for seq in (0, 1, 4, 11):
            for got, want in zip(paged.view(layer, seq), prealloc.view(layer, seq)):
                assert got.shape == (1, H, seq, D) and torch.equal(got, want)


def test_reading_gathers_whole_blocks_and_a_step_writes_in_place():
    pool = pool_of(n_blocks=16)
    cache = PagedCache(pool)
    fill(cache, 0, 9)
    with AllocMeter() as meter:
        cache.view(1, 9)
    assert meter.by_op == {"aten.index_select.default": 2 * H * 3 * 4 * D * 4}  # K and V, 3 blocks
    k, v = kv(1)
    cache.write(0, 9, k, v)  # a step's first layer finds its block and indexes its slot...
    with AllocMeter() as meter:
        cache.write(1, 9, k, v)  # ...the others only write into the pool
    assert meter.total == 0


def state(pool, *caches):
    return (list(pool.free), list(pool.refs), dict(pool.cached), list(pool.idle),
            [(list(c.table), c.seq_len) for c in caches], pool.k.clone(), pool.v.clone())


def same(x, y):
    return all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(x, y))


def test_running_out_of_blocks_is_an_error_with_the_numbers_that_changes_nothing():
    pool = pool_of(n_blocks=3)
    a, b = PagedCache(pool), PagedCache(pool)
    fill(a, 0, 8)
    before = state(pool, a, b)
    with pytest.raises(OutOfBlocks, match=r"out of KV blocks \(slots 0\.\.5, 0 blocks held\): "
                                          r"2 needed, 1 of 3 blocks of 4 slots free"):
        fill(b, 0, 5)  # one block is free, so the old pool took it before it failed
    assert same(state(pool, a, b), before)
    b.reset(), a.reset()
    assert pool.used == 0 and sorted(pool.free) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"KV overflow: writing slots 10\.\.13 into max_seq=12"):
        a.write(0, 10, *kv(3))
    with pytest.raises(ValueError, match="view of 5 slots from a request holding 0"):
        a.view(0, 5)
    with pytest.raises(ValueError, match="bad pool"):
        BlockPool(1, 0, 4, 1, 1)


def test_generate_refuses_a_request_longer_than_the_pool_and_runs_out_in_a_batch():
    model = model_of("llama")
    pool = pool_of(n_blocks=4, block=4, model=model)
    with pytest.raises(ValueError,
                       match=r"KV overflow: 0 cached \+ 12 prompt \+ 8 new tokens > max_seq=16"):
        generate(model, ids(12), 8, cache=PagedCache(pool), eos_token_id=None)
    with pytest.raises(OutOfBlocks, match="of 4 blocks of 4 slots free"):  # each fits, not all
        generate(model, [ids(6), ids(7, seed=2)], 6, cache=[PagedCache(pool), PagedCache(pool)],
                 eos_token_id=None)


@pytest.mark.parametrize("block", [1, 3, 16])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_paged_tokens_equal_the_preallocated_cache_tokens(family, block):
    model = model_of(family)
    prealloc = generate(model, ids(13), 24, eos_token_id=None)
    pool = pool_of(n_blocks=64, block=block, model=model)
    paged = generate(model, ids(13), 24, cache=PagedCache(pool), eos_token_id=None, prefill_chunk=5)
    assert paged.tokens == prealloc.tokens
    assert len(paged.cache.table) == -(-(13 + 23) // block) == pool.used


# --- prefix sharing: fork, reference counts, copy on write ----------------------------------


def test_a_fork_shares_blocks_until_it_writes_then_copies_the_block_it_writes():
    pool = pool_of()
    parent = PagedCache(pool)
    k, v = fill(parent, 0, 6)  # blocks 0 (full) and 1 (2 of 4 slots)
    child = parent.fork()
    assert child.table == parent.table == [0, 1] and child.seq_len == 6 and pool.refs[:2] == [2, 2]
    assert pool.used == 2
    fill(child, 6, 1, seed=5)  # into shared block 1: copied first
    assert child.table == [0, 2] and pool.refs[:3] == [2, 1, 1]
    for layer in range(L):  # the parent still reads its own slots 6.., the child its new one
        pk, _ = parent.view(layer, 6)
        ck, _ = child.view(layer, 7)
        assert torch.equal(pk[0].transpose(0, 1), k + layer)
        assert torch.equal(ck[0, :, :6].transpose(0, 1), k + layer)
        assert torch.equal(ck[0, :, 6], kv(1, seed=5)[0][0] + layer)
    parent.reset()
    assert pool.refs[:3] == [1, 0, 1] and pool.used == 2  # block 0 lives on with the child
    child.reset()
    assert pool.used == 0


def test_forked_requests_share_a_prompt_and_give_the_tokens_of_unshared_ones():
    model = model_of("qwen2")
    system, users = ids(11, seed=4), [ids(n, seed=10 + n) for n in (3, 6, 2)]
    pool = pool_of(n_blocks=64, block=4, model=model)
    root = PagedCache(pool)
    generate(model, system, 1, cache=root, eos_token_id=None)  # prefill the shared prompt: 3 blocks
    assert root.seq_len == 11 and pool.used == 3
    forks = [root.fork() for _ in users]
    shared = generate(model, users, 8, cache=forks, eos_token_id=None)
    alone = []
    for u in users:  # the same, each from its own prefill of the prompt
        c = PagedCache(pool)
        generate(model, system, 1, cache=c, eos_token_id=None)
        alone.append(generate(model, u, 8, cache=c, eos_token_id=None))
    assert [g.tokens for g in shared] == [g.tokens for g in alone]
    # the two full blocks of the prompt are held once by all four; the third was copied by each fork
    assert all(f.table[:2] == root.table[:2] for f in forks)
    assert all(pool.refs[b] == len(users) + 1 for b in root.table[:2])
    assert len({f.table[2] for f in forks} | {root.table[2]}) == len(users) + 1
