"""Bad input is refused at the door, with the numbers, and changes nothing.

``generate``, a direct ``forward`` and every cache's entry points check what they are given before
any state changes: ids (in the vocabulary, integral, one request's shape), lengths, starts, chunk
sizes, sampling settings, the cache against the model. Each test snapshots every byte and counter
of every cache involved (tensors, ``seq_len``, block tables, reference counts, the pool's free,
idle and cached blocks and the prefix index) and compares them after the refused call.

The property test draws the cache kind, how far the run has gone (nothing yet, after decode steps,
after a prefix cache found the prompt's first blocks), the prefill chunk, and one bad call of many
kinds placed at random (a bad id in the first chunk or a later one). The regression tests below it
are the issue's cases and the examples hypothesis shrank to while the door was being built.
"""

import functools
import re
from collections import OrderedDict

import pytest
import torch
from helpers import SHARED, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlib import (
    AllocMeter,
    CatCache,
    KVCache,
    LatentCache,
    MeteredCache,
    QuantCache,
    RingCache,
    forward,
    generate,
    load_model,
)
from kvlib.paged_cache import BlockPool, PagedCache

V = SHARED["vocab_size"]  # the tiny models' vocabulary, 0..511
F32 = dict(device="cpu", dtype=torch.float32)
KINDS = ["prealloc-head", "prealloc-seq", "cat", "paged", "paged-prefix", "int8", "int4", "ring",
         "ring-places", "latent", "metered"]


@functools.cache
def model_of(kind):
    if kind == "latent":
        return load_model("random:deepseek-v2-tiny", device="cpu", dtype=torch.float32)[0]
    return tiny_model("llama")


def make(kind, model, max_seq=40):
    c = model.config
    return {
        "prealloc-head": lambda: KVCache.for_model(c, max_seq, **F32),
        "prealloc-seq": lambda: KVCache.for_model(c, max_seq, layout="seq", **F32),
        "cat": lambda: CatCache.for_model(c, **F32),
        "paged": lambda: PagedCache(BlockPool.for_model(c, 10, 4, **F32)),
        "paged-prefix": lambda: PagedCache(BlockPool.for_model(c, 10, 4, prefix_cache=True,
                                                               **F32)),
        "int8": lambda: QuantCache.for_model(c, max_seq, **F32),
        "int4": lambda: QuantCache.for_model(c, max_seq, bits=4, **F32),
        "ring": lambda: RingCache.for_model(c, 8, sinks=1, **F32),
        "ring-places": lambda: RingCache.for_model(c, 8, sinks=1, positions="cache", **F32),
        "latent": lambda: LatentCache.for_model(c, max_seq, **F32),
        "metered": lambda: MeteredCache(KVCache.for_model(c, max_seq, **F32), AllocMeter()),
    }[kind]()


def state(x):
    """Everything ``x`` holds, to compare byte for byte: a tensor's bytes, and recursively the
    numbers, lists and dicts of a cache, its pool included (a meter's own counts left out)."""
    if isinstance(x, torch.Tensor):
        raw = x.detach().contiguous().view(-1).view(torch.uint8).clone() if x.numel() else None
        return ("tensor", x.dtype, tuple(x.shape), raw)
    if isinstance(x, MeteredCache):
        return state(x.cache)
    if isinstance(x, OrderedDict):
        return ("ordered", [(k, state(v)) for k, v in x.items()])  # the LRU order counts
    if isinstance(x, dict):
        return {k: state(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [state(v) for v in x]
    if x is None or isinstance(x, (int, float, str, bool, torch.dtype, torch.device)):
        return x
    names = getattr(type(x), "__slots__", None) or vars(x)
    return {n: state(getattr(x, n)) for n in names}


def same(a, b, where="") -> None:
    if isinstance(a, tuple) and a and a[0] == "tensor":
        assert a[:3] == b[:3] and (a[3] is None or torch.equal(a[3], b[3])), f"{where} changed"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} -> {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a} -> {b}"


def refused(call, caches, match=r"\d") -> str:
    """``call()`` raises a message naming numbers, and every cache is as it was, byte for byte."""
    before = [state(c) for c in caches]
    with pytest.raises((ValueError, IndexError, TypeError)) as e:
        call()
    assert re.search(match, str(e.value)), str(e.value)
    for c, b in zip(caches, before):
        same(b, state(c), type(c).__name__)
    return str(e.value)


def tokens(n, seed):
    return torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(seed))


def run_to(kind, point, first):
    """The model, the cache to misuse and every cache to watch, after the run got to ``point``:
    ``"empty"``, ``"decoded"`` (a request ran prefill and decode steps) or ``"prefix"`` (a
    finished request's blocks are cached, and the next request will find them)."""
    model = model_of(kind)
    cache = make(kind, model)
    if point == "empty":
        return model, cache, [cache]
    generate(model, first, 3, cache=cache, eos_token_id=None)
    if point == "decoded" or not kind.startswith("paged"):
        return model, cache, [cache]
    cache.reset()  # finished: with a prefix cache its full blocks stay cached, held by nobody
    new = PagedCache(cache.pool)
    return model, new, [cache, new]


def bad_calls(model, cache, ids, chunk, at, value):
    """Every bad call, by name: ``ids`` a valid prompt, ``at`` where a bad id goes."""
    def prompt_with(v):
        x = ids.clone()
        x[0, at] = v
        return x

    def gen(x=ids, n=3, **kw):
        return lambda: generate(model, x, n, cache=cache, eos_token_id=None,
                                prefill_chunk=chunk, **kw)

    room = None if cache.max_seq is None else cache.max_seq - cache.seq_len - ids.shape[1] + 1
    latent = isinstance(cache, LatentCache)
    width = (cache.rank if latent else (cache.n_kv_heads, cache.head_dim))
    k = torch.zeros(1, *([width] if latent else width))
    v = torch.zeros(1, cache.rope_dim) if latent else k
    calls = {
        "id past the vocabulary": gen(prompt_with(V + value)),
        "negative id": gen(prompt_with(-1 - value)),
        "float ids": gen(ids.float()),
        "two prompts in one tensor": gen(ids.repeat(2, 1)),
        "three dimensions": gen(ids[None]),
        "empty prompt": gen(ids[:, :0]),
        "max_new_tokens below one": gen(n=-value),
        "max_new_tokens not an int": gen(n=2.5),
        "prefill_chunk below one": lambda: generate(model, ids, 2, cache=cache,
                                                    prefill_chunk=-value, eos_token_id=None),
        "negative temperature": gen(temperature=-0.5 - value),
        "top_p of zero": gen(temperature=1.0, top_p=0.0),
        "top_k below zero": gen(temperature=1.0, top_k=-1 - value),
        "prompt lookup of no guesses": gen(prompt_lookup_num_tokens=-value - 1),
        "forward of a bad id": lambda: forward(model, prompt_with(V + value), cache,
                                               cache.seq_len),
        "forward of float ids": lambda: forward(model, ids.float(), cache, cache.seq_len),
        "forward at a negative start": lambda: forward(model, ids, cache, -1 - value),
        "forward at a float start": lambda: forward(model, ids, cache, float(cache.seq_len)),
        "write to a layer past the last": lambda: cache.write(cache.n_layers + value, 0, k, v),
        "write of the wrong width": lambda: cache.write(0, 0, k[..., :-1], v[..., :-1]),
        "view of a layer past the last": lambda: cache.view(cache.n_layers + value, 0),
        "crop past the length": lambda: cache.crop(cache.seq_len + 1 + value),
    }
    if room is not None:
        calls["more tokens than max_seq"] = gen(n=room + value)
        calls["forward past max_seq"] = lambda: forward(
            model, ids, cache, cache.max_seq - ids.shape[1] + 1 + value)
    return calls


@st.composite
def examples(draw):
    kind = draw(st.sampled_from(KINDS))
    point = draw(st.sampled_from(["empty", "decoded", "prefix"]))
    n = draw(st.integers(2, 12))
    chunk = draw(st.one_of(st.none(), st.integers(1, n)))
    at = draw(st.integers(0, n - 1))  # before `chunk` or past it: the first chunk or a later one
    value = draw(st.integers(0, 3))
    name = draw(st.sampled_from(sorted(bad_calls(*_probe(kind), None, 0, 0))))
    seed = draw(st.integers(0, 3))
    return kind, point, n, chunk, at, value, name, seed


@functools.cache
def _probe(kind):
    """A cache of ``kind`` with ids: for the names of its bad calls."""
    model = model_of(kind)
    return model, make(kind, model), tokens(4, 0)


def check_example(kind, point, n, chunk, at, value, name, seed):
    first = tokens(8, seed)  # the earlier request: two full blocks of 4, and its own tokens
    model, cache, watched = run_to(kind, point, first)
    ids = torch.cat([first[:, : min(n, 8)], tokens(n, seed + 10)], 1)[:, :n]  # starts alike
    refused(bad_calls(model, cache, ids, chunk, at, value)[name], watched)


SETTINGS = dict(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=80, **SETTINGS)
@given(examples())
def test_any_bad_call_at_any_point_is_refused_and_changes_nothing(example):
    check_example(*example)


@pytest.mark.slow
@settings(max_examples=800, **{**SETTINGS, "derandomize": False})
@given(examples())
def test_many_more_bad_calls_are_refused_and_change_nothing(example):
    check_example(*example)


# --- the cases, and what hypothesis shrank to -----------------------------------------


SHRUNK = [  # each once a failure: (kind, point, n, chunk, at, value, bad call, seed)
    ("cat", "empty", 2, None, 0, 0, "prompt lookup of no guesses", 0),  # k < 1 crashed the check
]


@pytest.mark.parametrize("example", SHRUNK)
def test_the_examples_hypothesis_shrank_to(example):
    check_example(*example)


@pytest.mark.parametrize("kind", ["prealloc-head", "int8", "paged"])
def test_a_bad_id_in_a_later_chunk_is_refused_before_the_first_chunk_runs(kind):
    """Before: torch's ``index out of range in self`` at the second chunk, ``seq_len`` 9 -> 13."""
    model, cache, watched = run_to(kind, "decoded", tokens(7, 0))
    assert cache.seq_len == 9
    bad = tokens(8, 1)
    bad[0, 6] = V
    message = refused(lambda: generate(model, bad, 2, cache=cache, prefill_chunk=4), watched)
    assert message == "token id 512 at index 6 of 8: the vocabulary has 512 ids, 0..511"
    assert cache.seq_len == 9


def test_a_bad_id_after_a_prefix_hit_leaves_the_pool_and_its_index_as_they_were():
    """Before: the request was left holding the cached blocks it had found, the pool changed."""
    first = tokens(9, 0)
    model, cache, watched = run_to("paged-prefix", "prefix", first)
    pool = cache.pool
    assert len(pool.cached) == 2 and len(pool.idle) == 2 and pool.used == 0
    bad = torch.cat([first[:, :8], torch.tensor([[3, V + 7]])], 1)
    assert "token id 519 at index 9 of 10" in refused(
        lambda: generate(model, bad, 2, cache=cache), watched)
    assert cache.table == [] and len(pool.idle) == 2 and pool.refs == [0] * pool.n_blocks
    assert generate(model, bad.clamp(max=V - 1), 2, cache=cache).cached_tokens == 8  # still there


@pytest.mark.parametrize("kind", KINDS)
def test_a_direct_forward_checks_everything_before_any_request_of_a_batch_writes(kind):
    model = model_of(kind)
    caches = [make(kind, model) for _ in range(2)]
    good, bad = tokens(5, 0), tokens(5, 1)
    bad[0, 4] = -3
    args = ([good, bad], caches, [0, 0])
    if kind == "latent":  # one request a forward
        args = (bad, caches[1], 0)
    assert refused(lambda: forward(model, *args), caches, match="id -3 at index 4 of 5|one req")


def test_a_cache_of_another_shape_dtype_or_device_is_refused_before_a_layer_is_written():
    model = model_of("prealloc-head")
    c = model.config
    fewer = KVCache(c.num_hidden_layers - 1, 32, c.num_key_value_heads, c.head_dim, **F32)
    bf16 = KVCache.for_model(c, 32, device="cpu", dtype=torch.bfloat16)
    for cache in (fewer, bf16):
        refused(lambda cache=cache: generate(model, tokens(4, 0), 2, cache=cache), [cache],
                match=r"the cache has layers, kv_heads, head_dim \(\d, 2, 16\), torch\.\w+ on "
                      r"cpu; the model needs \(3, 2, 16\), torch.float32 on cpu")


def test_a_forward_over_a_latent_cache_checks_its_ids_start_and_model():
    model = model_of("latent")
    cache = make("latent", model)
    ids = tokens(3, 0) + V
    refused(lambda: forward(model, ids, cache, 0), [cache],
            match=f"token id {int(ids[0, 0])} at index 0 of 3")
    refused(lambda: forward(model, tokens(3, 0), cache, 39), [cache],
            match=r"KV overflow: writing slots 39\.\.42 into max_seq=40")
    refused(lambda: forward(model_of("prealloc-head"), tokens(3, 0), cache, 0), [cache],
            match="LatentCache for 'llama': a LatentCache is DeepSeek-V2's")
