"""Rollback, an invariant every cache keeps: after ``crop(n)`` a cache reads exactly as if only its
first ``n`` tokens had ever been written.

Exact bytes for every kind (the preallocated cache in both layouts, cat, int8 and int4, paged, a
ring within what it holds); the tokens of a cropped and continued run equal transformers'; a paged
crop gives back the blocks past the end and never writes through a shared tail block; a crop past
the length, or past what a ring holds, is refused with the numbers and changes nothing.
"""

import functools

import pytest
import torch
from helpers import tiny_model, write
from test_generate import PROMPT_LEN, hf_reference, prompt
from test_ring_cache import hf_reference as ring_reference
from test_ring_cache import model_of as ring_model
from test_ring_cache import prompt as ring_prompt

from kvlib import CatCache, KVCache, QuantCache, RingCache, generate
from kvlib.paged_cache import BlockPool, PagedCache

L, H, D = 2, 2, 8  # layers, kv_heads, head_dim of the bare caches
KINDS = ["prealloc-head", "prealloc-seq", "cat", "int8", "int4", "paged", "ring"]


def make(kind, config=None, window=64, sinks=0):
    """A cache of ``kind``, bare (``L, H, D``) or for ``config``, fp32 on the CPU."""
    shape = (L, H, D) if config is None else (config.num_hidden_layers,
                                              config.num_key_value_heads, config.head_dim)
    n_layers, heads, dim = shape
    kw = dict(device="cpu", dtype=torch.float32)
    if kind.startswith("prealloc"):
        return KVCache(n_layers, 64, heads, dim, layout=kind.removeprefix("prealloc-"), **kw)
    if kind == "cat":
        return CatCache(n_layers, heads, dim, **kw)
    if kind.startswith("int"):
        return QuantCache(n_layers, 64, heads, dim, bits=int(kind[3:]), **kw)
    if kind == "paged":
        return PagedCache(BlockPool(n_layers, 16, 4, heads, dim, **kw))
    return RingCache(n_layers, window, heads, dim, sinks=sinks, **kw)


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)


def views(cache):
    return [t.clone() for layer in range(cache.n_layers) for t in cache.view(layer, cache.seq_len)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_cropped_cache_reads_as_if_the_dropped_tokens_were_never_written(kind):
    first, then = data(10, seed=0), data(4, seed=1)
    cropped, fresh = make(kind), make(kind)
    write(cropped, 0, *first)
    cropped.crop(6)
    assert cropped.seq_len == 6
    write(cropped, 6, *then)
    write(fresh, 0, first[0][:6], first[1][:6])
    write(fresh, 6, *then)
    for got, want in zip(views(cropped), views(fresh), strict=True):
        assert got.shape == (1, H, 10, D) and torch.equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_a_crop_past_the_length_is_refused_with_the_numbers_and_changes_nothing(kind):
    cache = make(kind)
    write(cache, 0, *data(5, seed=0))
    before = views(cache)
    for bad in (6, -1):
        with pytest.raises(ValueError, match=f"crop to {bad} slots: the cache holds 5"):
            cache.crop(bad)
    assert cache.seq_len == 5 and all(torch.equal(a, b) for a, b in zip(views(cache), before))


@functools.cache
def model_of(family):
    return tiny_model(family)


@pytest.mark.parametrize("kind", ["prealloc-head", "cat", "paged", "ring"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_run_cropped_and_continued_gives_transformers_tokens(family, kind):
    model, back = model_of(family), 7
    hf_tokens = hf_reference(family)[0]
    cache = make(kind, model.config, window=128)
    if kind == "paged":
        cache = PagedCache(BlockPool.for_model(model.config, 32, 4, device="cpu",
                                               dtype=torch.float32))
    if kind.startswith("prealloc"):
        cache = KVCache.for_model(model.config, 64, device="cpu", dtype=torch.float32)
    g = generate(model, prompt(), 20, cache=cache, eos_token_id=None)
    assert g.tokens == hf_tokens[:20]
    cache.crop(PROMPT_LEN + back)  # the prompt and the first `back` new tokens
    more = generate(model, torch.tensor([hf_tokens[back : back + 1]]), 20, cache=cache,
                    eos_token_id=None)
    assert more.tokens == hf_tokens[back + 1 : back + 21]


def test_a_quantized_cache_cropped_and_continued_gives_its_own_uncropped_tokens():
    model = model_of("llama")
    runs = []
    for crop in (False, True):
        cache = QuantCache.for_model(model.config, 64, device="cpu", dtype=torch.float32)
        g = generate(model, prompt(), 20, cache=cache, eos_token_id=None)
        if crop:  # back to 5 new tokens, then on again
            cache.crop(PROMPT_LEN + 5)
            g.tokens = g.tokens[:6] + generate(model, torch.tensor([g.tokens[5:6]]), 14,
                                               cache=cache, eos_token_id=None).tokens
        runs.append(g.tokens)
    assert runs[0] == runs[1]


# --- paged: blocks given back, a shared tail copied before it is written ----------------------


def test_a_paged_crop_gives_back_the_blocks_past_the_new_end():
    cache = make("paged")
    write(cache, 0, *data(10, seed=0))  # blocks of 4: 3 blocks
    pool, table = cache.pool, list(cache.table)
    assert pool.used == 3
    cache.crop(5)
    assert cache.table == table[:2] and pool.used == 2 and pool.free[-1] == table[2]
    cache.crop(4)  # a crop to a block boundary keeps no empty block
    assert cache.table == table[:1] and pool.used == 1
    cache.crop(0)
    assert cache.table == [] and pool.used == 0


@pytest.mark.parametrize("back_to", [5, 2], ids=["into-the-partial-tail", "into-a-full-block"])
def test_a_fork_cropped_into_a_shared_block_copies_it_before_writing(back_to):
    parent = make("paged")
    k, v = data(6, seed=0)
    write(parent, 0, k, v)  # blocks 0 (full) and 1 (2 of 4 slots)
    before = views(parent)
    child = parent.fork()
    child.crop(back_to)
    shared = parent.table[back_to // 4]
    assert child.table == parent.table[: -(-back_to // 4)] and parent.pool.refs[shared] == 2
    write(child, back_to, *data(3, seed=5))
    assert child.table[back_to // 4] != shared and parent.pool.refs[shared] == 1
    assert all(torch.equal(a, b) for a, b in zip(views(parent), before))  # the parent's slots
    fresh = make("paged")
    write(fresh, 0, k[:back_to], v[:back_to])
    write(fresh, back_to, *data(3, seed=5))
    assert all(torch.equal(a, b) for a, b in zip(views(child), views(fresh)))


# --- a ring: a crop within what it still holds ------------------------------------------------


def test_a_ring_past_its_window_crops_within_what_it_holds_and_refuses_more():
    cache = make("ring", window=4, sinks=1)
    write(cache, 0, *data(10, seed=0))  # holds position 0 and 6..9
    before = views(cache)
    msg = (r"crop to 8: the next query, at position 8, needs 5\.\.7 \(and the sinks\), but at 10 "
           r"the ring holds 6\.\.9: 5 was overwritten")
    with pytest.raises(ValueError, match=msg):
        cache.crop(8)
    assert cache.seq_len == 10 and all(torch.equal(a, b) for a, b in zip(views(cache), before))
    cache.crop(9)  # a query at 9 sees 6..8 and the sink: all held
    write(cache, 9, *data(2, seed=1))
    fresh = make("ring", window=4, sinks=1)
    write(fresh, 0, *[x[:9] for x in data(10, seed=0)])
    write(fresh, 9, *data(2, seed=1))
    assert all(torch.equal(a, b) for a, b in zip(views(cache), views(fresh)))
    cache.crop(1)  # only the sink is seen there
    assert cache.seq_len == 1


def test_a_windowed_model_on_a_ring_cropped_by_one_gives_transformers_tokens():
    model = ring_model("mistral")
    tokens = ring_reference("mistral")[0]
    cache = RingCache.for_model(model.config, device="cpu", dtype=torch.float32)
    generate(model, ring_prompt(), 20, cache=cache, eos_token_id=None)  # far past the window
    cache.crop(cache.seq_len - 1)
    more = generate(model, torch.tensor([tokens[18:19]]), 10, cache=cache, eos_token_id=None)
    assert more.tokens == tokens[19:29]
