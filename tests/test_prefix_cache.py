"""The prefix cache: the same tokens give the same K and V, so a request that starts like an
earlier one holds that one's full blocks instead of computing them.

Blocks are keyed by (parent key, tokens); a new request reuses the longest cached chain and
prefills the rest; finished requests' blocks stay cached, idle, until the pool needs them (least
recently used first, never a held one); the tokens equal those without the cache, and
transformers'; running out of blocks changes nothing.
"""

import functools

import pytest
import torch
from helpers import SHARED, tiny_model
from test_generate import hf_generate

from kvlib import generate
from kvlib.paged_cache import BlockPool, OutOfBlocks, PagedCache

BLOCK = 4


@functools.cache
def model_of(family="llama"):
    return tiny_model(family)


def pool_of(n_blocks=64, prefix_cache=True, family="llama"):
    return BlockPool.for_model(model_of(family).config, n_blocks, BLOCK, device="cpu",
                               dtype=torch.float32, prefix_cache=prefix_cache)


def ids(n, seed=1):
    return torch.randint(0, SHARED["vocab_size"], (1, n),
                         generator=torch.Generator().manual_seed(seed))


SYSTEM = ids(11, seed=4)  # 2 full blocks and 3 slots


def turn(user_seed, n=5):
    return torch.cat([SYSTEM, ids(n, seed=user_seed)], 1)


def run(pool, prompt, new=8, family="llama"):
    return generate(model_of(family), prompt, new, cache=PagedCache(pool), eos_token_id=None)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_shared_prefix_is_computed_once_and_the_tokens_equal_transformers(family):
    pool = pool_of(family=family)
    first = run(pool, turn(1), family=family)
    assert first.cached_tokens == 0 and first.prompt_len == 16
    system = first.cache.table[:2]
    first.cache.reset()
    again = run(pool, turn(2), family=family)  # same system prompt, another user turn
    assert again.cached_tokens == 8 and again.prompt_len == 16  # the 2 full blocks of SYSTEM
    hf_tokens, _ = hf_generate(model_of(family), turn(2), 8)
    assert again.tokens == hf_tokens == run(pool_of(prefix_cache=False, family=family),
                                            turn(2), family=family).tokens
    assert again.cache.table[:2] == system  # the very blocks, not copies


def test_a_whole_conversation_is_found_again_and_one_token_is_always_computed():
    pool, model = pool_of(), model_of()
    one = run(pool, turn(1), new=9)
    one.cache.reset()
    # the next turn resends turn 1, its answer and a new user message: all its full blocks hit
    history = torch.cat([turn(1), torch.tensor([one.tokens]), ids(3, seed=7)], 1)
    two = run(pool, history)
    assert two.cached_tokens == (16 + 9 - 1) // BLOCK * BLOCK == 24  # the slots turn 1 held
    assert two.tokens == generate(model, history, 8, eos_token_id=None).tokens
    two.cache.reset()
    exact = torch.cat([history, torch.tensor([two.tokens])], 1)[:, :32]  # 8 cached blocks...
    three = run(pool, exact)
    assert three.cached_tokens == 28  # ...and the last is computed again: its logits are needed
    assert three.tokens == generate(model, exact, 8, eos_token_id=None).tokens


def test_keys_are_whole_prefixes_a_block_matches_only_after_its_parents():
    pool = pool_of()
    run(pool, turn(1)).cache.reset()
    shifted = torch.cat([ids(4, seed=9), turn(1)], 1)  # the same blocks' tokens, other positions
    assert run(pool, shifted).cached_tokens == 0
    other_first = torch.cat([ids(4, seed=10), turn(1)[:, 4:]], 1)  # block 1 equal, block 0 not
    assert run(pool, other_first).cached_tokens == 0


def test_freed_blocks_stay_cached_idle_and_are_evicted_least_recently_used_first():
    pool = pool_of(n_blocks=12)
    a = run(pool, turn(1))  # 16 + 7 slots: 6 blocks, the first 5 full
    table = list(a.cache.table)
    assert pool.used == 6 and sorted(pool.cached.values()) == table[:5] and not pool.idle
    a.cache.reset()
    assert pool.used == 0 and all(pool.refs[b] == 0 for b in table)
    assert list(pool.idle) == table[4::-1]  # the chain's tail is the least recently used
    # another prompt takes the 7 free blocks, then evicts one idle block: the chain's tail
    b = run(pool, ids(20, seed=5), new=13)  # 32 slots: 8 blocks
    assert pool.used == 8 and b.cache.table[-1] == table[4]
    assert list(pool.idle) == table[3::-1] and len(pool.cached) == 4 + 8


def test_eviction_order_is_least_recently_used_and_never_a_held_block():
    pool = pool_of(n_blocks=10)
    first = run(pool, turn(1))  # its 2 system blocks, 3 of its own, a partial one
    system = first.cache.table[:2]
    first.cache.reset()
    held = run(pool, turn(2))  # holds the 2 system blocks again, computes the rest
    assert held.cached_tokens == 8 and held.cache.table[:2] == system
    assert all(b not in pool.idle for b in system)
    assert len(pool.free) == 1 and len(pool.idle) == 3  # the first request's own blocks
    with pytest.raises(OutOfBlocks, match="8 needed, 4 of 10"):  # the held ones are not counted
        run(pool, ids(30, seed=6), new=2)
    big = run(pool, ids(12, seed=6), new=5)  # 16 slots: 4 blocks, the free one and 3 evicted
    assert set(big.cache.table).isdisjoint(held.cache.table) and not pool.idle
    assert [pool.refs[b] for b in held.cache.table] == [1] * 6
    assert all(b in pool.key_of for b in held.cache.table[:5])  # still cached, still held


def test_running_out_of_blocks_changes_neither_the_pool_nor_any_other_request():
    pool = pool_of(n_blocks=8)
    done = run(pool, turn(1))
    done.cache.reset()  # 5 idle cached blocks
    live = run(pool, turn(2), new=3)  # holds 2 of them and 3 more
    before = (list(pool.free), list(pool.refs), dict(pool.cached), list(pool.idle),
              list(live.cache.table), live.cache.seq_len, pool.k.clone())
    new = PagedCache(pool)
    with pytest.raises(OutOfBlocks, match=r"\(slots 0\.\.30, 0 blocks held\): 8 needed, 3 of 8"):
        generate(model_of(), ids(30, seed=8), 2, cache=new, eos_token_id=None)
    hit = torch.cat([SYSTEM, ids(19, seed=8)], 1)  # finds the 2 blocks live holds, then runs out
    with pytest.raises(OutOfBlocks, match=r"\(slots 8\.\.30, 2 blocks held\): 6 needed, 3 of 8"):
        generate(model_of(), hit, 2, cache=new, eos_token_id=None)
    after = (list(pool.free), list(pool.refs), dict(pool.cached), list(pool.idle),
             list(live.cache.table), live.cache.seq_len, pool.k.clone())
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(before, after))
    assert new.table == [] and new.seq_len == 0


def test_a_batch_shares_the_cached_blocks_and_equals_each_request_alone():
    pool, model = pool_of(), model_of()
    run(pool, turn(1)).cache.reset()
    prompts = [turn(2), turn(3, n=9)]
    batch = generate(model, prompts, 6, cache=[PagedCache(pool), PagedCache(pool)],
                     eos_token_id=None)
    assert [g.cached_tokens for g in batch] == [8, 8]
    assert batch[0].cache.table[:2] == batch[1].cache.table[:2]
    assert all(pool.refs[b] == 2 for b in batch[0].cache.table[:2])
    assert [g.tokens for g in batch] == [generate(model, p, 6, eos_token_id=None).tokens
                                         for p in prompts]


def test_a_cached_block_is_never_written_a_write_into_it_copies_it():
    pool = pool_of()
    a = run(pool, turn(1))
    cached = dict(pool.cached)
    k0 = pool.k.clone()
    a.cache.crop(6)  # back into cached block 1, held by this request alone
    generate(model_of(), ids(3, seed=11), 2, cache=a.cache, eos_token_id=None)
    assert a.cache.table[1] not in cached.values()  # the write copied the block
    assert all(pool.cached[key] == b for key, b in cached.items())  # the new block is keyed too
    for b in cached.values():
        assert torch.equal(pool.k[:, :, b], k0[:, :, b])


def test_without_the_prefix_cache_nothing_is_cached():
    pool = pool_of(prefix_cache=False)
    run(pool, turn(1)).cache.reset()
    assert run(pool, turn(1)).cached_tokens == 0 and not pool.cached and not pool.idle
    assert pool.used == 6 and "cached" not in repr(pool)


def test_smollm2_second_chat_on_a_cached_system_prompt_gives_transformers_tokens(smollm2):
    model, tok = smollm2
    system = {"role": "system", "content": "You are a concise assistant who answers in one line."}
    pool = BlockPool.for_model(model.config, 32, 16, device="cpu", dtype=torch.float32,
                               prefix_cache=True)
    gens = []
    for question in ("What is the capital of France?", "Name a prime number."):
        ids = tok.apply_chat_template([system, {"role": "user", "content": question}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        gens.append(generate(model, ids, 24, cache=PagedCache(pool)))
        gens[-1].cache.reset()
        assert gens[-1].tokens == hf_generate(model, ids, 24)[0]
    assert gens[0].cached_tokens == 0 and gens[1].cached_tokens >= 16


def test_a_chat_chained_onto_a_block_since_evicted_keeps_its_next_turn():
    # Both requests of a batch compute SYSTEM's two full blocks; the first to finish caches its
    # own, so the other's third block is keyed onto the first's second block. When that one is
    # evicted, the other's next turn must still keep its tokens, and its blocks be keyed again.
    pool, model = pool_of(n_blocks=12), model_of()
    a, b = generate(model, [turn(1), turn(2)], 3, cache=[PagedCache(pool), PagedCache(pool)],
                    eos_token_id=None)
    assert a.cache.table[1] != b.cache.table[1]
    assert pool.key_of[b.cache.table[2]][0][0] == a.cache.table[1]
    a.cache.reset()
    run(pool, ids(28, seed=12), new=1).cache.reset()  # 7 blocks: 3 free, then all of a's evicted
    assert all(blk not in pool.key_of for blk in a.cache.table[:2])
    more = generate(model, torch.tensor([b.tokens[-1:] + [7, 8]]), 5, cache=b.cache,
                    eos_token_id=None)
    history = [*turn(2)[0].tolist(), *b.tokens, 7, 8, *more.tokens]
    assert b.cache.tokens == history and more.tokens == generate(
        model, torch.tensor([history[:-5]]), 5, eos_token_id=None).tokens
    again = run(pool, torch.tensor([history[:-1]]), new=1)  # the whole chat is found again
    assert again.cached_tokens == (len(history) - 2) // BLOCK * BLOCK
    assert again.cache.table[:6] == b.cache.table[:6]
