"""The latent (MLA) cache: greedy parity with transformers in fp32 on a random-weight
DeepSeek-V2-shaped model through ``generate``, expanded and absorbed attention, crop and reset, its
bytes, refusals and storage."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvlib import AllocMeter, KVCache, forward, generate, load_model
from kvlib.config import kv_bytes_per_token, load_config
from kvlib.latent_cache import LatentCache, forward_latent

PROMPT, NEW = 20, 40
F32 = torch.float32


@pytest.fixture(scope="module")
def tiny():
    """The model, a prompt, and transformers' own greedy continuation of it."""
    model, _ = load_model("random:deepseek-v2-tiny", device="cpu", dtype=F32)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT),
                        generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                         do_sample=False, eos_token_id=None, pad_token_id=None)
    return model, ids, ref[0, PROMPT:].tolist()


def cache_of(model, max_seq, absorb=False):
    return LatentCache.for_model(model.config, max_seq, device="cpu", dtype=F32, absorb=absorb)


def greedy(model, ids, new, absorb):
    return generate(model, ids, new, cache=cache_of(model, ids.shape[1] + new, absorb),
                    eos_token_id=None).tokens


@pytest.mark.parametrize("absorb", [False, True])
def test_greedy_parity_with_transformers(tiny, absorb):
    model, ids, ref = tiny
    assert greedy(model, ids, NEW, absorb) == ref


def test_generate_makes_a_latent_cache_for_mla_and_continues_it_in_chunks(tiny):
    model, ids, ref = tiny
    g = generate(model, ids[:, :12], 1, eos_token_id=None)  # "prealloc": latents, not K and V
    assert isinstance(g.cache, LatentCache) and g.cache.max_seq == 13
    cache = cache_of(model, PROMPT + NEW)
    first = generate(model, ids[:, :12], 3, cache=cache, eos_token_id=None, prefill_chunk=5)
    cache.crop(12)  # drop the new tokens: the cache holds the first 12 of the prompt again
    more = generate(model, ids[:, 12:], NEW, cache=cache, eos_token_id=None, prefill_chunk=3)
    assert first.tokens[:1] == g.tokens and more.tokens == ref
    assert cache.seq_len == PROMPT + NEW - 1


def test_crop_and_reset_read_as_if_the_dropped_tokens_were_never_written(tiny):
    model, ids, ref = tiny
    cache = cache_of(model, PROMPT + NEW)
    generate(model, ids, 10, cache=cache, eos_token_id=None)
    before = cache.kv[:, :PROMPT].clone()
    cache.crop(PROMPT)
    assert cache.seq_len == PROMPT and torch.equal(cache.kv[:, :PROMPT], before)
    with pytest.raises(ValueError, match=f"crop to {PROMPT + 1} slots: the cache holds {PROMPT}"):
        cache.crop(PROMPT + 1)
    assert generate(model, torch.tensor([ref[:1]]), NEW - 1, cache=cache,
                    eos_token_id=None).tokens == ref[1:]
    cache.reset()
    assert cache.seq_len == 0 and greedy(model, ids, 5, False) == ref[:5]


def test_what_the_latent_forward_cannot_run_is_refused_before_anything_changes(tiny):
    model, ids, _ = tiny
    caches = [cache_of(model, 64) for _ in range(2)]
    with pytest.raises(ValueError, match="a LatentCache runs one request"):
        generate(model, [ids, ids], 4, cache=caches)
    with pytest.raises(ValueError, match="cache that can crop and score every row"):
        generate(model, ids, 4, cache=caches[0], prompt_lookup_num_tokens=3)
    with pytest.raises(TypeError, match="static shapes need a preallocated cache, not LatentCache"):
        generate(model, ids, 4, cache=caches[0], step="static")
    kv = KVCache(4, 64, 2, 16, device="cpu", dtype=F32)
    with pytest.raises(ValueError, match="KVCache for 'deepseek_v2': a LatentCache is DeepSeek"):
        forward(model, ids, kv, 0)
    small = LatentCache(4, 64, 32, 16, device="cpu", dtype=F32)
    with pytest.raises(ValueError, match=r"kv_lora_rank, qk_rope_head_dim \(4, 32, 16\), "
                       r"torch.float32 on cpu; the model needs \(4, 64, 16\)"):
        forward(model, ids, small, 0)
    assert all(c.seq_len == 0 and not c.kv.any() for c in caches + [small])


@pytest.mark.parametrize("absorb", [False, True])
def test_chunked_prefill_after_cached_slots_then_greedy(tiny, absorb):
    model, ids, ref = tiny
    full = model(ids).logits[0]  # [n, V]: every prompt position, no cache
    cache = cache_of(model, PROMPT + NEW)
    for a, b in ((0, 7), (7, 15), (15, PROMPT)):
        logits = forward_latent(model, ids[:, a:b], cache, a, absorb=absorb)
        torch.testing.assert_close(logits[0], full[b - 1], rtol=0, atol=1e-4)
    assert cache.seq_len == PROMPT
    tokens = [int(logits.argmax())]
    while len(tokens) < NEW:
        logits = forward_latent(model, torch.tensor([[tokens[-1]]]), cache, cache.seq_len,
                                absorb=absorb)
        tokens.append(int(logits.argmax()))
    assert tokens == ref


def test_absorbed_and_expanded_logits_agree(tiny):
    model, ids, ref = tiny
    caches = {absorb: cache_of(model, PROMPT + 8) for absorb in (False, True)}
    steps = [ids, *(torch.tensor([[t]]) for t in ref[:8])]
    for start, step in zip([0, *range(PROMPT, PROMPT + 8)], steps):
        expanded, absorbed = (forward_latent(model, step, caches[a], start, absorb=a)
                              for a in (False, True))
        torch.testing.assert_close(absorbed, expanded, rtol=0, atol=1e-4)


def test_bytes_per_token_is_the_planner_s_latent_and_rope_key():
    config = load_config("deepseek-v2-tiny")
    L, R, P = config.num_hidden_layers, config.kv_lora_rank, config.qk_rope_head_dim
    for dtype in (torch.bfloat16, F32):
        cache = LatentCache.for_model(config, 33, device="cpu", dtype=dtype)
        assert cache.bytes_per_token == kv_bytes_per_token(config, dtype)
        assert cache.bytes_per_token == L * (R + P) * dtype.itemsize
        assert cache.nbytes == 33 * cache.bytes_per_token
    assert LatentCache.for_model(config, 1, device="cpu").bytes_per_token == 4 * (64 + 16) * 2


def test_overflow_is_refused_naming_the_numbers_and_changes_nothing(tiny):
    model, ids, _ = tiny
    cache = cache_of(model, PROMPT + 4)
    forward_latent(model, ids, cache, 0)
    before = cache.kv.clone()
    with pytest.raises(ValueError, match=r"KV overflow: writing slots 20\.\.25 into max_seq=24"):
        forward_latent(model, ids[:, :5], cache, PROMPT)
    with pytest.raises(ValueError, match=r"latent is \(2, 63\).*expected \[2, 64\]"):
        cache.write(0, PROMPT, torch.ones(2, 63), torch.ones(2, 16))
    with pytest.raises(ValueError, match="view of 25 slots from a cache of max_seq=24"):
        cache.view(0, 25)
    assert cache.seq_len == PROMPT and torch.equal(cache.kv, before)


def test_views_are_the_preallocated_tensor(tiny):
    model, ids, _ = tiny
    cache = cache_of(model, PROMPT + 4)
    storage = cache.kv.untyped_storage().data_ptr()
    forward_latent(model, ids, cache, 0)
    assert cache.kv.untyped_storage().data_ptr() == storage  # written in place, never grown
    for layer in range(cache.n_layers):
        view = cache.view(layer, PROMPT)
        assert view.untyped_storage().data_ptr() == storage
        assert view.shape == (PROMPT, 64 + 16) and view.abs().sum() > 0
    latent, k_pe = torch.full((1, 64), 3.0), torch.full((1, 16), 5.0)
    with AllocMeter() as meter:
        cache.write(1, PROMPT, latent, k_pe)
    assert meter.total == 0  # slice copies into the preallocated tensor
    assert cache.view(1, PROMPT + 1)[PROMPT].tolist() == [3.0] * 64 + [5.0] * 16


def test_absorbing_allocates_less_than_the_expansion_alone(tiny):
    """One decode step at slot 300: expanding builds every slot's K_nope and V, ``[S, H*(N+Vd)]``
    per layer; absorbing never does, so its whole step allocates less than that expansion."""
    model, _, _ = tiny
    context, c = 300, model.config
    step = {}
    for absorb in (False, True):
        cache = cache_of(model, context + 1)
        cache.seq_len = context
        with AllocMeter() as meter:
            forward_latent(model, torch.zeros(1, 1, dtype=torch.long), cache, context,
                           absorb=absorb)
        step[absorb] = meter.total
    expansion = (c.num_hidden_layers * (context + 1) * c.num_attention_heads
                 * (c.qk_nope_head_dim + c.v_head_dim) * F32.itemsize)
    assert step[True] < expansion <= step[False] - step[True]


def test_query_lora_and_yarn_scaling_keep_parity():
    """DeepSeek-V2 proper: a low-rank query (``q_a``/``q_b``) and YaRN RoPE, whose ``mscale``
    changes the attention's ``scaling``; both come from the model's modules, not recomputed."""
    config = load_config("deepseek-v2-tiny")
    config.q_lora_rank, config.max_position_embeddings = 48, 2048
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 512, "mscale": 0.707,
                              "mscale_all_dim": 0.707}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=F32).eval()
    assert model.model.layers[0].self_attn.scaling != model.config.qk_head_dim ** -0.5
    ids = torch.arange(3, 3 + PROMPT)[None]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                         do_sample=False, eos_token_id=None, pad_token_id=None)[0, PROMPT:]
    for absorb in (False, True):
        assert greedy(model, ids, 12, absorb) == ref.tolist()
