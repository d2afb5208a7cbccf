"""Ragged batches: many requests in one token loop, each exactly as if it ran alone.

Every request of a batch has its own prompt length, positions, EOS and max_new_tokens. Its tokens
must equal a batch-1 run of the same request, token for token (tiny models of every family, and
SmolLM2 to its EOS), and its attention must never read another request's slots, or slots past its
own length: caches poisoned with NaN everywhere else leave every token and logit unchanged.
"""

import functools
import math

import pytest
import torch
from helpers import FAMILIES, SHARED, tiny_model

from kvlib import CatCache, KVCache, forward, generate
from kvlib.paged_cache import BlockPool, PagedCache

LENGTHS = (5, 17, 1, 9)  # ragged prompts: one token, a few, more than a block
NEWS = (12, 3, 20, 7)  # and ragged max_new_tokens


@functools.cache
def model_of(family):
    return tiny_model(family)


def prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SHARED["vocab_size"], (1, n), generator=g) for n in lengths]


def alone(model, ids, news, **kw):
    return [generate(model, x, n, eos_token_id=None, **kw).tokens for x, n in zip(ids, news)]


def paged_caches(model, n, n_blocks=32, block=4):
    pool = BlockPool.for_model(model.config, n_blocks, block, device="cpu", dtype=torch.float32)
    return pool, [PagedCache(pool) for _ in range(n)]


# --- the same tokens as alone ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["prealloc", "cat", "paged"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_request_of_a_ragged_batch_equals_its_run_alone(family, kind):
    model, ids = model_of(family), prompts()
    cache = paged_caches(model, len(ids))[1] if kind == "paged" else kind
    gens = generate(model, ids, list(NEWS), cache=cache, eos_token_id=None)
    assert [g.tokens for g in gens] == alone(model, ids, NEWS)
    assert [g.prompt_len for g in gens] == list(LENGTHS)
    assert [g.cache.seq_len for g in gens] == [n + m - 1 for n, m in zip(LENGTHS, NEWS)]


@pytest.mark.parametrize("chunk", [1, 4, 6])
def test_a_batch_prefilled_in_chunks_gives_the_same_tokens(chunk):
    model, ids = model_of("qwen2"), prompts()
    gens = generate(model, ids, 8, prefill_chunk=chunk, eos_token_id=None)
    assert [g.tokens for g in gens] == alone(model, ids, [8] * len(ids))


def test_a_request_does_not_depend_on_its_neighbours_or_its_place():
    model, ids = model_of("llama"), prompts()
    order = [2, 0, 3, 1]
    shuffled = generate(model, [ids[i] for i in order], [NEWS[i] for i in order], eos_token_id=None)
    assert [g.tokens for g in shuffled] == [alone(model, [ids[i]], [NEWS[i]])[0] for i in order]
    pair = generate(model, [ids[1], ids[1]], [6, 6], eos_token_id=None)  # the same request twice
    assert pair[0].tokens == pair[1].tokens == alone(model, [ids[1]], [6])[0]


def test_batched_forward_gives_each_request_its_own_logits():
    model, ids = model_of("qwen3"), prompts()
    caches = [KVCache.for_model(model.config, 32, device="cpu", dtype=torch.float32) for _ in ids]
    logits = forward(model, ids, caches, [0] * len(ids))  # [B, V]
    assert logits.shape == (len(ids), SHARED["vocab_size"])
    for x, row, cache in zip(ids, logits, caches):
        one = KVCache.for_model(model.config, 32, device="cpu", dtype=torch.float32)
        torch.testing.assert_close(row, forward(model, x, one, 0)[0], rtol=1e-4, atol=1e-4)
        assert cache.seq_len == x.shape[1]
        torch.testing.assert_close(cache.k[:, : x.shape[1]], one.k[:, : x.shape[1]], rtol=1e-5,
                                   atol=1e-5)


def test_smollm2_chat_batch_equals_each_chat_alone_to_its_eos(smollm2):
    model, tok = smollm2
    questions = ["What is the capital of France?", "Hi!",
                 "In two sentences: what does a KV cache store, and why does it make decoding "
                 "faster?"]
    ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]
           for q in questions]
    assert len({x.shape[1] for x in ids}) == len(ids)  # ragged
    runs = [generate(model, x, 48) for x in ids]  # eos "auto"
    pool = BlockPool.for_model(model.config, 64, 16, device="cpu", dtype=model.dtype)
    for cache in ("prealloc", [PagedCache(pool) for _ in ids]):
        gens = generate(model, ids, 48, cache=cache)
        texts = [tok.decode(g.tokens) for g in gens]
        assert [g.tokens for g in gens] == [r.tokens for r in runs], texts
        assert [g.cache.seq_len for g in gens] == [r.cache.seq_len for r in runs]
    eos = model.generation_config.eos_token_id
    assert sum(r.tokens[-1] == eos for r in runs) >= 2  # most of them end at their own EOS
    assert len({len(r.tokens) for r in runs}) > 1  # and at different steps


# --- isolation: nothing read but the request's own slots ------------------------------------


def test_preallocated_caches_poisoned_past_each_length_change_nothing():
    model, ids = model_of("gemma"), prompts()
    clean = generate(model, ids, list(NEWS), eos_token_id=None, return_logits=True)
    caches = [KVCache.for_model(model.config, 64, device="cpu", dtype=torch.float32) for _ in ids]
    for c in caches:  # every slot the request does not write stays NaN
        c.k.fill_(math.nan), c.v.fill_(math.nan)
    gens = generate(model, ids, list(NEWS), cache=caches, eos_token_id=None, return_logits=True)
    assert [g.tokens for g in gens] == [g.tokens for g in clean]
    for g, c in zip(gens, clean):
        assert all(torch.isfinite(x).all() for x in g.logits)
        torch.testing.assert_close(torch.stack(g.logits), torch.stack(c.logits), rtol=1e-4,
                                   atol=1e-4)


def test_a_shared_pool_poisoned_outside_each_request_changes_nothing():
    model, ids = model_of("qwen2"), prompts()
    clean = generate(model, ids, list(NEWS), eos_token_id=None, return_logits=True)
    pool, caches = paged_caches(model, len(ids), n_blocks=40)
    pool.k.fill_(math.nan), pool.v.fill_(math.nan)  # free blocks and block tails: NaN
    bystander = PagedCache(pool)  # another request's blocks in the same pool, full of NaN and 1e30
    bad = torch.full((10, bystander.n_kv_heads, bystander.head_dim), math.nan)
    for layer in range(bystander.n_layers):
        bystander.write(layer, 0, bad, bad.nan_to_num(1e30))
    gens = generate(model, ids, list(NEWS), cache=caches, eos_token_id=None, return_logits=True)
    assert [g.tokens for g in gens] == [g.tokens for g in clean]
    for g, c in zip(gens, clean):
        torch.testing.assert_close(torch.stack(g.logits), torch.stack(c.logits), rtol=1e-4,
                                   atol=1e-4)
    assert len({b for c in caches + [bystander] for b in c.table}) == sum(
        len(c.table) for c in caches + [bystander])  # no block in two tables


# --- each request its own EOS, max_new_tokens, cache; the loop's contract -------------------


def test_each_request_stops_at_its_own_eos_and_keeps_its_slots():
    model, ids = model_of("qwen3"), prompts()
    eos = alone(model, ids[:1], [12])[0][4]  # a token request 0 makes at its 5th step
    runs = [generate(model, x, 12, eos_token_id=eos) for x in ids]
    gens = generate(model, ids, 12, eos_token_id=eos)
    assert [g.tokens for g in gens] == [r.tokens for r in runs]
    assert len(gens[0].tokens) <= 5 and gens[0].tokens[-1] == eos
    assert [g.cache.seq_len for g in gens] == [r.cache.seq_len for r in runs]


def test_on_step_and_timing_follow_the_requests_still_running():
    model, ids = model_of("llama"), prompts(lengths=(3, 6))
    calls = []
    gens = generate(model, ids, [4, 2], eos_token_id=None, timed=True,
                    on_step=lambda step, seq_lens: calls.append((step, seq_lens)))
    assert calls == [(0, [4, 7]), (1, [5]), (2, [6])]  # request 1 leaves after its 2nd token
    assert [len(g.step_s) for g in gens] == [3, 1] and gens[0].step_s[0] == gens[1].step_s[0]
    assert gens[0].prefill_s == gens[1].prefill_s > 0


def test_sampling_a_batch_is_seeded():
    model, ids = model_of("qwen2"), prompts()
    a, b = (generate(model, ids, 8, temperature=1.0, top_k=20, seed=3,
                     eos_token_id=None) for _ in "ab")
    assert [g.tokens for g in a] == [g.tokens for g in b]


def test_batches_that_cannot_run_are_refused_with_the_numbers():
    model, ids = model_of("llama"), prompts()
    shared = KVCache.for_model(model.config, 64, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="the 4 requests of a batch need a cache each"):
        generate(model, ids, 4, cache=shared)
    with pytest.raises(ValueError, match=r"needs 4 max_new_tokens and 4 caches \(got 2 and 4\)"):
        generate(model, ids, [4, 4])
    with pytest.raises(ValueError, match="step='eager' \\(got 'static'\\)"):
        generate(model, ids, 4, step="static")
    small = [KVCache.for_model(model.config, 16, device="cpu", dtype=torch.float32) for _ in ids]
    with pytest.raises(ValueError, match=r"request 1: KV overflow: 0 cached \+ 17 prompt"):
        generate(model, ids, 4, cache=small)
    with pytest.raises(ValueError, match=r"request 2: need a prompt and max_new_tokens >= 1"):
        generate(model, ids, [1, 1, 0, 1])
    with pytest.raises(ValueError, match=r"\[2, 5\]"):
        generate(model, [torch.zeros(2, 5, dtype=torch.long)], 4)
    with pytest.raises(ValueError, match="got 2 prompts, 1 caches, 2 starts"):
        forward(model, ids[:2], [CatCache.for_model(model.config, device="cpu",
                                                    dtype=torch.float32)],
                [0, 0])
