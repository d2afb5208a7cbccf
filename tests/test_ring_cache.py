"""The sliding-window ring: transformers' tokens for the families it windows, memory fixed at the
window, slots that wrap while positions do not, and refusals where a window would be wrong.
"""

import functools
import re

import pytest
import torch
from helpers import SHARED, TINY, assert_same_greedy, tiny_model
from transformers import AutoModelForCausalLM

from kvlib import AllocMeter, MeteredCache, forward, generate
from kvlib.ring_cache import RingCache

W = 8  # the window: shorter than the 12-token prompt, so even the prefill needs it
N_NEW = 40
# keys in slot order, not position order: another summation order
FOLDED = dict(rtol=1e-4, atol=1e-4)
# How transformers 5.24 windows each family: Mistral and Starcoder2 by `sliding_window` alone,
# Qwen2/3 with `use_sliding_window` from layer `max_window_layers` on (0: every layer).
WINDOWED = {
    "mistral": dict(sliding_window=W),
    "starcoder2": dict(sliding_window=W),
    "qwen2": dict(use_sliding_window=True, sliding_window=W, max_window_layers=0),
    "qwen3": dict(use_sliding_window=True, sliding_window=W, max_window_layers=0),
}


@functools.cache
def model_of(family, windowed=True):
    base = {k: v for k, v in TINY[family]().to_dict().items() if k != "layer_types"}  # recomputed
    config = type(TINY[family]())(**{**base, **(WINDOWED[family] if windowed else {})})
    config.eos_token_id = None
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def prompt(n=12, seed=1):
    return torch.randint(0, SHARED["vocab_size"], (1, n),
                         generator=torch.Generator().manual_seed(seed))


@functools.cache
def hf_reference(family, windowed=True):
    ids = prompt()
    out = model_of(family, windowed).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False,
        output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), [x[0] for x in out.logits]


def ring(model, window=W, sinks=0):
    return RingCache.for_model(model.config, window, sinks=sinks, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("chunk", [None, 5, 1], ids=["one-prefill", "chunks-of-5",
                                                     "token-by-token"])
@pytest.mark.parametrize("family", list(WINDOWED))
def test_windowed_families_match_transformers(family, chunk):
    model = model_of(family)
    tokens, logits = hf_reference(family)
    assert tokens != hf_reference(family, windowed=False)[0]  # the window changes the answer
    g = generate(model, prompt(), N_NEW, cache=ring(model), eos_token_id=None, return_logits=True,
                 prefill_chunk=chunk)
    assert_same_greedy(g.tokens, g.logits, tokens, logits, **FOLDED)  # a near-tie may tip
    assert g.cache.seq_len == 12 + N_NEW - 1  # positions keep counting past the window


def test_continuing_a_ring_equals_one_run():
    model = model_of("qwen2")
    cache = ring(model)
    first = generate(model, prompt(), 10, cache=cache, eos_token_id=None)
    second = generate(model, torch.tensor([first.tokens[-1:]]), N_NEW - 10, cache=cache,
                      eos_token_id=None)
    assert first.tokens + second.tokens == hf_reference("qwen2")[0]


def test_memory_is_the_window_and_decode_steps_allocate_nothing():
    model = model_of("mistral")
    cache = ring(model)
    layers, heads = SHARED["num_hidden_layers"], SHARED["num_key_value_heads"]
    D = SHARED["head_dim"]
    assert cache.nbytes == 2 * layers * heads * W * D * 4
    ptr = cache.k.data_ptr()
    meter, lengths = AllocMeter(), []
    with meter:
        g = generate(model, prompt(), N_NEW, cache=MeteredCache(cache, meter), eos_token_id=None,
                     on_step=lambda step, n: (lengths.append(n), meter.mark()))
    assert g.tokens == hf_reference("mistral")[0]
    assert lengths[-1] == 12 + N_NEW - 1 > 5 * W
    # step 0 holds the prefill's copy of the chunk; every decode step after it: 0 cache bytes
    assert meter.step_regions[0]["cache"] > 0
    assert all(r.get("cache", 0) == 0 for r in meter.step_regions[1:]), meter.step_regions
    assert cache.nbytes == 2 * layers * heads * W * D * 4 and cache.k.data_ptr() == ptr


@pytest.mark.parametrize("window, sinks", [(4, 0), (4, 2), (3, 1)])
def test_slots_wrap_and_positions_do_not(window, sinks):
    cache = RingCache(1, window, 1, 2, sinks=sinks, device="cpu", dtype=torch.float32)
    for p in range(11):  # position p writes the value p, one decode step at a time
        x = torch.full((1, 1, 2), float(p))
        cache.write(0, p, x, -x)
        held = sorted(cache.k[0, 0, : min(p + 1, sinks + window), 0].tolist())
        recent = list(range(max(sinks, p + 1 - window), p + 1))
        assert held == list(range(min(sinks, p + 1))) + recent  # sinks, then the last window
        slot = p if p < sinks else sinks + (p - sinks) % window
        assert cache.k[0, 0, slot, 0] == p  # the slot index: only it wraps
        k, v = cache.view(0, p + 1)
        assert k.shape == (1, 1, len(held), 2) and torch.equal(v, -k)
        assert k.data_ptr() == cache.k.data_ptr()  # a decode step reads the ring itself


@pytest.mark.parametrize("window, sinks, start, n", [(4, 0, 0, 7), (4, 0, 9, 3), (4, 2, 9, 6),
                                                     (3, 1, 2, 5)])
def test_a_chunk_sees_its_window_and_the_sinks(window, sinks, start, n):
    cache = RingCache(1, window, 1, 1, sinks=sinks, device="cpu", dtype=torch.float32)
    for p in range(start):
        cache.write(0, p, torch.full((1, 1, 1), float(p)), torch.zeros(1, 1, 1))
    chunk = torch.arange(start, start + n, dtype=torch.float32).view(n, 1, 1)
    cache.write(0, start, chunk, chunk)
    # the copy: held positions, then the chunk
    keys = cache.view(0, start + n)[0][0, 0, :, 0].tolist()
    visible = cache.visible(start, n)
    assert visible.shape == (n, len(keys))
    for i, q in enumerate(range(start, start + n)):  # the definition, query by query
        want = [kp <= q and (kp < sinks or kp > q - window) for kp in keys]
        assert visible[i].tolist() == want
        assert set(range(max(0, q - window + 1), q + 1)) <= {kp for kp, ok in zip(keys, want) if ok}
    # the copy is handed out once
    assert cache.view(0, start + n)[0].data_ptr() == cache.k.data_ptr()


def test_sinks_run_a_full_attention_model_past_the_window():
    """A window on a model trained without one is the caller's choice: it runs, and differs."""
    model = model_of("qwen2", windowed=False)
    plain = generate(model, prompt(), N_NEW, cache=ring(model), eos_token_id=None)
    sinks = generate(model, prompt(), N_NEW, cache=ring(model, sinks=2), eos_token_id=None)
    full = hf_reference("qwen2", windowed=False)[0]
    assert plain.tokens != full and sinks.tokens != plain.tokens
    assert sinks.cache.k.shape[2] == W + 2


def test_a_windowed_model_refuses_a_full_cache_or_another_window():
    model = model_of("mistral")
    for cache, what in (("prealloc", "a full cache"), ("cat", "a full cache"),
                        (ring(model, window=16), "a window of 16")):
        with pytest.raises(NotImplementedError, match=re.escape(
                f"sliding_window={W}: each layer attends to the last {W} tokens; run it over a "
                f"RingCache(window={W}), not {what}")):
            generate(model, prompt(), 4, cache=cache, eos_token_id=None)


def test_a_ring_cannot_go_back():
    model = model_of("mistral")
    cache = ring(model)
    generate(model, prompt(), 20, cache=cache, eos_token_id=None)  # positions 0..30 written
    cache.seq_len = 25  # as if an EOS had been found late
    with pytest.raises(ValueError, match=re.escape(
            "RingCache writes positions in order: layer 0 holds 0..31, a write at 25 would leave "
            "stale slots; reset() for a new request")):
        generate(model, prompt(3), 4, cache=cache, eos_token_id=None)
    with pytest.raises(ValueError,
                       match=re.escape("layer 1 of 3 holds up to 31, not a view of 20")):
        cache.view(1, 20)
    cache.reset()
    tokens = generate(model, prompt(), N_NEW, cache=cache, eos_token_id=None).tokens
    assert tokens == hf_reference("mistral")[0]


def test_bad_shapes_and_a_model_without_a_window():
    with pytest.raises(ValueError, match=re.escape("bad shape: layers=2 window=0")):
        RingCache(2, 0, 2, 16)
    with pytest.raises(ValueError, match="'qwen2' has no sliding_window: pass window="):
        RingCache.for_model(model_of("qwen2", windowed=False).config)


@pytest.mark.parametrize("positions", ["absolute", "cache"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "helium", "glm"])
def test_positions_against_transformers_over_the_held_tokens(family, positions):
    """In a one-layer model a key depends on its token and position alone, so a decode step over a
    ring equals transformers' forward over the tokens the ring holds (sinks, then the window): at
    their positions in the text, or numbered 0.. by their places in the cache (StreamingLLM)."""
    model, window, sinks, ids = tiny_model(family, num_hidden_layers=1), 6, 2, prompt(24)
    cache = RingCache.for_model(model.config, window, sinks=sinks, positions=positions,
                                device="cpu", dtype=torch.float32)
    for p in range(ids.shape[1]):
        ours = forward(model, ids[:, p:p + 1], cache, p)
        held = [*range(min(sinks, p + 1)), *range(max(sinks, p + 1 - window), p + 1)]
        at = torch.tensor([held]) if positions == "absolute" else None  # None: 0, 1, ...
        with torch.no_grad():
            theirs = model(ids[:, held], position_ids=at).logits[:, -1]
        torch.testing.assert_close(ours, theirs, **FOLDED)


@pytest.mark.parametrize("chunk", [None, 5, 1], ids=["one-prefill", "chunks-of-5",
                                                     "token-by-token"])
def test_cache_positions_move_only_the_sinks(chunk):
    """RoPE is relative: without sinks, places in the cache give what positions in the text give;
    with sinks, the answer changes once the first token leaves the window, and not before."""
    model = model_of("llama", windowed=False)
    runs = {(at, sinks): generate(model, prompt(), N_NEW, eos_token_id=None, return_logits=True,
                                  prefill_chunk=chunk, cache=RingCache.for_model(
                                      model.config, W, sinks=sinks, positions=at, device="cpu",
                                      dtype=torch.float32))
            for at in ("absolute", "cache") for sinks in (0, 2)}
    plain, moved = runs["absolute", 0], runs["cache", 0]
    assert_same_greedy(moved.tokens, moved.logits, plain.tokens, plain.logits, **FOLDED)
    a, c = runs["absolute", 2], runs["cache", 2]  # 12 prompt tokens: past W + 2 slots already
    assert c.tokens != a.tokens or any(not torch.allclose(x, y, **FOLDED)
                                       for x, y in zip(a.logits, c.logits))


def test_a_stream_at_cache_positions_passes_the_models_positions():
    """Positions past ``max_position_embeddings`` are refused; places in a ring never get there,
    and the ring's memory, and what a decode step allocates, stay flat all the way."""
    model = tiny_model("llama", max_position_embeddings=32)
    with pytest.raises(ValueError, match=re.escape(
            "0 cached + 12 prompt + 60 new tokens reach position 70, past "
            "max_position_embeddings=32")):
        generate(model, prompt(), 60, cache=ring(model, sinks=2), eos_token_id=None)
    cache = RingCache.for_model(model.config, W, sinks=2, positions="cache", device="cpu",
                                dtype=torch.float32)
    nbytes, meter = cache.nbytes, AllocMeter()
    with meter:
        g = generate(model, prompt(), 60, cache=cache, eos_token_id=None,
                     on_step=lambda step, n: meter.mark())
    assert len(g.tokens) == 60 and cache.seq_len == 71 and cache.nbytes == nbytes
    assert len(set(meter.steps[1:])) == 1, meter.steps  # every decode step the same bytes


def test_cache_positions_refuse_a_window_past_the_models_positions():
    model = tiny_model("llama", max_position_embeddings=32)
    cache = RingCache.for_model(model.config, 40, positions="cache", device="cpu",
                                dtype=torch.float32)
    with pytest.raises(ValueError, match="reach position 39, past max_position_embeddings=32"):
        generate(model, prompt(), 60, cache=cache, eos_token_id=None)
    with pytest.raises(ValueError, match="positions must be 'absolute' or 'cache', not 'text'"):
        RingCache(2, 4, 2, 16, positions="text")
