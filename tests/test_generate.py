"""The course's promise, held strictly: kvlib's token loop gives transformers' tokens and logits.

Tiny random models of each family run in milliseconds; SmolLM2 (real weights) checks real
text up to its EOS. Then the loop's own contract: continuing a cache, EOS, sampling,
refusals, timing, and the per-step allocation the course is about.
"""

import functools
import re

import pytest
import torch
from helpers import FAMILIES, SHARED, assert_same_greedy, tiny_model
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GraniteConfig,
    MistralConfig,
    Olmo2Config,
    Qwen2Config,
    SmolLM3Config,
)

import kvlib.loop
from kvlib import AllocMeter, CatCache, KVCache, MeteredCache, generate
from kvlib.loop import EOS_CHECK_EVERY

N_NEW = 40
PROMPT_LEN = 12
CACHES = [("prealloc", "head"), ("prealloc", "seq"), ("cat", "head")]
CACHE_IDS = ["prealloc-head", "prealloc-seq", "cat"]


@functools.cache
def model_of(family):
    return tiny_model(family)


def prompt(n=PROMPT_LEN, seed=1):
    return torch.randint(0, SHARED["vocab_size"], (1, n),
                         generator=torch.Generator().manual_seed(seed))


def hf_generate(model, ids, max_new_tokens, **kw):
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        output_logits=True, return_dict_in_generate=True, **kw,
    )
    return out.sequences[0, ids.shape[1]:].tolist(), [x[0].float() for x in out.logits]


@functools.cache
def hf_reference(family):
    """transformers' greedy tokens and per-step logits for the tiny model (no EOS)."""
    model = model_of(family)
    assert model.generation_config.eos_token_id is None and model.config.eos_token_id is None
    tokens, logits = hf_generate(model, prompt(), N_NEW)
    assert len(tokens) == N_NEW
    return tokens, logits


def make_cache(kind, model, max_seq=128, layout="head"):
    if kind == "cat":
        return CatCache.for_model(model.config, device="cpu", dtype=torch.float32)
    return KVCache.for_model(model.config, max_seq, device="cpu", dtype=torch.float32,
                             layout=layout)


# Two kernels that add in a different order differ in the last bits: a chunk after earlier
# tokens takes SDPA's masked path, a prompt from empty its causal one, and a decode step folds
# each KV head's query heads into rows where transformers expands K/V. Tokens must be equal;
# logits agree to this (still tight) tolerance.
FOLDED = dict(rtol=1e-4, atol=1e-4)


# --- parity with transformers ---------------------------------------------------------------


@pytest.mark.parametrize("cache, layout", CACHES, ids=CACHE_IDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_match_transformers_generate(family, cache, layout):
    model = model_of(family)
    hf_tokens, hf_logits = hf_reference(family)
    if cache == "prealloc" and layout != "head":  # the seq layout is asked for by passing the cache
        cache = make_cache("prealloc", model, max_seq=PROMPT_LEN + N_NEW, layout=layout)
    g = generate(model, prompt(), N_NEW, cache=cache, eos_token_id=None, return_logits=True)
    assert g.tokens == hf_tokens
    assert g.prompt_len == PROMPT_LEN
    assert len(g.logits) == N_NEW
    for step, (ours, theirs) in enumerate(zip(g.logits, hf_logits)):
        torch.testing.assert_close(ours, theirs, msg=lambda m, step=step: f"step {step}: {m}")
    # the cache holds the prompt and every new token but the last
    assert g.cache.seq_len == PROMPT_LEN + N_NEW - 1
    if isinstance(g.cache, KVCache):
        assert g.cache.layout == layout
        assert g.cache.max_seq == PROMPT_LEN + N_NEW  # default max_seq: exactly what is needed
    else:
        assert isinstance(g.cache, CatCache)
        assert g.cache.nbytes == (PROMPT_LEN + N_NEW - 1) * g.cache.bytes_per_token


def test_one_dimensional_prompt_and_explicit_max_seq():
    model = model_of("llama")
    g = generate(model, prompt()[0], 8, max_seq=100, eos_token_id=None)
    assert g.tokens == hf_reference("llama")[0][:8]
    assert g.cache.max_seq == 100


CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]
SMOL_MAX_NEW = 48


@pytest.fixture(scope="module")
def smol_chat(smollm2):
    model, tok = smollm2
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    tokens, logits = hf_generate(model, ids, SMOL_MAX_NEW)
    eos = model.generation_config.eos_token_id
    # the reference itself must be a real answer that ends at EOS, or the test proves little
    assert tokens[-1] == eos and eos not in tokens[:-1]
    assert 32 <= len(tokens) < SMOL_MAX_NEW
    return ids, tokens, logits


@pytest.mark.parametrize("cache", ["prealloc", "cat"])
def test_smollm2_chat_matches_transformers_to_eos(smollm2, smol_chat, cache):
    model, tok = smollm2
    ids, hf_tokens, hf_logits = smol_chat
    g = generate(model, ids, SMOL_MAX_NEW, cache=cache, return_logits=True)  # eos "auto"
    # this answer has a top-2 margin of 0.0015 logit at one step: another CPU may tip it
    shared = assert_same_greedy(g.tokens, g.logits, hf_tokens, hf_logits, **FOLDED)
    if shared == len(hf_tokens):
        assert g.cache.seq_len == ids.shape[1] + len(hf_tokens) - 1
    assert "sea" in tok.decode(g.tokens).lower()


def test_smollm2_chunked_prefill_gives_the_same_tokens(smollm2, smol_chat):
    """A prompt long enough to split: 16 + 16 + the rest, the later chunks on the masked path."""
    model, _ = smollm2
    ids, hf_tokens, hf_logits = smol_chat
    assert ids.shape[1] > 2 * 16
    g = generate(model, ids, 3, eos_token_id=None, return_logits=True, prefill_chunk=16)
    assert g.tokens == hf_tokens[:3]
    for ours, theirs in zip(g.logits, hf_logits):
        torch.testing.assert_close(ours, theirs, **FOLDED)


@pytest.mark.parametrize("chunk, cache", [(1, "prealloc"), (5, "prealloc"), (50, "prealloc"),
                                          (5, "cat")])
def test_tiny_chunked_prefill(chunk, cache):
    model = model_of("qwen2")
    g = generate(model, prompt(), 10, cache=cache, eos_token_id=None, return_logits=True,
                 prefill_chunk=chunk)
    assert g.tokens == hf_reference("qwen2")[0][:10]
    for ours, theirs in zip(g.logits, hf_reference("qwen2")[1]):
        torch.testing.assert_close(ours, theirs, **FOLDED)


# --- continuing and reusing a cache ---------------------------------------------------------


FOLLOW_UP = [5, 77, 300, 12, 9]


@pytest.mark.parametrize(
    "family, kind, layout",
    [("llama", "prealloc", "head"), ("qwen2", "prealloc", "head"), ("qwen3", "prealloc", "head"),
     ("qwen3", "prealloc", "seq"), ("qwen3", "cat", "head")],
)
def test_continuing_a_cache_equals_one_generate_over_everything(family, kind, layout):
    model = model_of(family)
    ids = prompt(10)
    cache = make_cache(kind, model, max_seq=64, layout=layout)
    first = generate(model, ids, 8, cache=cache, eos_token_id=None)
    assert first.cache is cache and cache.seq_len == 10 + 8 - 1  # the last token is not in it yet
    # feed the last generated token and a multi-token follow-up: the masked path, start > 0, n > 1
    more = torch.tensor([first.tokens[-1:] + FOLLOW_UP])
    second = generate(model, more, 8, cache=cache, eos_token_id=None, return_logits=True)
    assert second.prompt_len == 1 + len(FOLLOW_UP)
    assert cache.seq_len == 10 + 8 + len(FOLLOW_UP) + 8 - 1

    everything = torch.cat([ids, torch.tensor([first.tokens + FOLLOW_UP])], dim=1)
    single = generate(model, everything, 8, eos_token_id=None, return_logits=True)
    assert second.tokens == single.tokens
    for a, b in zip(second.logits, single.logits):
        torch.testing.assert_close(a, b, **FOLDED)
    n = cache.seq_len
    for layer in range(model.config.num_hidden_layers):
        for got, want in zip(cache.view(layer, n), single.cache.view(layer, n)):
            torch.testing.assert_close(got, want, **FOLDED)


def test_continuation_overflow_counts_what_is_cached():
    model = model_of("llama")
    cache = make_cache("prealloc", model, max_seq=24)
    generate(model, prompt(10), 8, cache=cache, eos_token_id=None)  # seq_len 17
    snap = cache.k.clone(), cache.seq_len
    with pytest.raises(ValueError, match=re.escape(
            "KV overflow: 17 cached + 5 prompt + 3 new tokens > max_seq=24")):
        generate(model, prompt(5), 3, cache=cache, eos_token_id=None)
    assert torch.equal(cache.k, snap[0]) and cache.seq_len == snap[1]


@pytest.mark.parametrize("layout", ["head", "seq"])
def test_reset_then_generate_reuses_the_same_memory(layout):
    model = model_of("qwen3")
    cache = make_cache("prealloc", model, max_seq=64, layout=layout)
    ptrs = cache.k.data_ptr(), cache.v.data_ptr()
    a = generate(model, prompt(10, seed=3), 12, cache=cache, eos_token_id=None)
    # continue: dirty
    other = generate(model, prompt(20, seed=4), 12, cache=cache, eos_token_id=None)
    assert cache.seq_len == (10 + 12 - 1) + (20 + 12 - 1)  # the last token of each run is never fed
    cache.reset()
    b = generate(model, prompt(10, seed=3), 12, cache=cache, eos_token_id=None)
    fresh = generate(model, prompt(10, seed=3), 12, eos_token_id=None)
    assert a.tokens == b.tokens == fresh.tokens
    assert other.tokens != a.tokens
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == ptrs
    assert b.cache is cache and cache.seq_len == 10 + 12 - 1


def test_reset_cat_cache_then_generate():
    model = model_of("qwen2")
    cache = make_cache("cat", model)
    a = generate(model, prompt(), 10, cache=cache, eos_token_id=None)
    cache.reset()
    assert cache.nbytes == 0
    b = generate(model, prompt(), 10, cache=cache, eos_token_id=None)
    assert a.tokens == b.tokens == hf_reference("qwen2")[0][:10]


# --- EOS ------------------------------------------------------------------------------------


def first_new_token_at(tokens, k):
    return tokens[k] not in tokens[:k]


def eos_steps(tokens):
    """Steps k whose token appears there first: one before any check, one between checks, one on
    a check."""
    firsts = [k for k in range(len(tokens)) if first_new_token_at(tokens, k)]
    off = [k for k in firsts if (k + 1) % EOS_CHECK_EVERY and k > EOS_CHECK_EVERY]
    on = [k for k in firsts if (k + 1) % EOS_CHECK_EVERY == 0]
    early = [k for k in firsts if k < EOS_CHECK_EVERY - 1]
    assert off and on and early, "the reference run has no usable EOS candidates"
    return [early[0], off[0], on[0]]


@pytest.mark.parametrize("kind", ["prealloc", "cat"])
def test_stops_right_after_eos(kind):
    family = "llama"
    model = model_of(family)
    ref, ref_logits = hf_reference(family)
    for k in eos_steps(ref):
        cache = make_cache(kind, model)
        g = generate(model, prompt(), N_NEW, cache=cache, eos_token_id=ref[k], return_logits=True)
        assert g.tokens == ref[: k + 1], k
        assert len(g.tokens) == k + 1 and g.tokens[-1] == ref[k]
        assert len(g.logits) == k + 1
        torch.testing.assert_close(g.logits[-1], ref_logits[k])
        # slots of steps run past the EOS (it is looked for every 8 steps) are given back
        assert cache.seq_len == PROMPT_LEN + len(g.tokens) - 1, k


@pytest.mark.parametrize("kind", ["prealloc", "cat"])
def test_a_cache_continues_correctly_after_an_eos_seen_late(kind):
    model = model_of("llama")
    ref, _ = hf_reference("llama")
    k = eos_steps(ref)[1]  # between two checks: steps past it ran and wrote slots
    cache = make_cache(kind, model)
    first = generate(model, prompt(), N_NEW, cache=cache, eos_token_id=ref[k])
    assert first.tokens == ref[: k + 1]
    second = generate(model, torch.tensor([first.tokens[-1:] + FOLLOW_UP]), 6, cache=cache,
                      eos_token_id=None)
    everything = torch.cat([prompt(), torch.tensor([first.tokens + FOLLOW_UP])], dim=1)
    assert second.tokens == generate(model, everything, 6, eos_token_id=None).tokens


def test_eos_list_and_auto_from_generation_config():
    model = model_of("qwen3")
    ref, _ = hf_reference("qwen3")
    k = eos_steps(ref)[1]
    never = next(t for t in range(SHARED["vocab_size"]) if t not in ref)
    g = generate(model, prompt(), N_NEW, eos_token_id=[never, ref[k]])
    assert g.tokens == ref[: k + 1]
    fresh = tiny_model("qwen3")
    fresh.generation_config.eos_token_id = ref[k]
    assert generate(fresh, prompt(), N_NEW).tokens == ref[: k + 1]  # eos_token_id="auto"
    assert generate(fresh, prompt(), N_NEW, eos_token_id=None).tokens == ref  # None: never stop


def test_eos_matches_transformers():
    model = model_of("qwen2")
    ref, _ = hf_reference("qwen2")
    k = eos_steps(ref)[1]
    hf_tokens, _ = hf_generate(model, prompt(), N_NEW, eos_token_id=ref[k], pad_token_id=ref[k])
    assert generate(model, prompt(), N_NEW, eos_token_id=ref[k]).tokens == hf_tokens == ref[: k + 1]


# --- sampling -------------------------------------------------------------------------------


def test_sampling_is_seeded():
    model = model_of("llama")
    a = generate(model, prompt(), 64, temperature=1.0, seed=0, eos_token_id=None)
    b = generate(model, prompt(), 64, temperature=1.0, seed=0, eos_token_id=None)
    c = generate(model, prompt(), 64, temperature=1.0, seed=1, eos_token_id=None)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert a.tokens[:N_NEW] != hf_reference("llama")[0]  # it really sampled


def test_top_k_1_and_tiny_top_p_are_greedy():
    model = model_of("qwen3")
    greedy = hf_reference("qwen3")[0]
    sample = dict(temperature=1.5, seed=3, eos_token_id=None)
    assert generate(model, prompt(), N_NEW, top_k=1, **sample).tokens == greedy
    assert generate(model, prompt(), N_NEW, top_p=1e-6, **sample).tokens == greedy


def test_sampled_tokens_stay_inside_top_k_and_top_p():
    model = model_of("qwen2")
    g = generate(model, prompt(), 48, temperature=1.0, top_k=5, seed=7, eos_token_id=None,
                 return_logits=True)
    for token, logits in zip(g.tokens, g.logits):
        assert token in logits.topk(5).indices.tolist()
    g = generate(model, prompt(), 48, temperature=1.0, top_p=0.5, seed=7, eos_token_id=None,
                 return_logits=True)
    for token, logits in zip(g.tokens, g.logits):
        probs, order = logits.softmax(-1).sort(descending=True)
        nucleus = order[: int((probs.cumsum(-1) < 0.5).sum()) + 1].tolist()
        assert token in nucleus


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["prealloc", "prealloc-string"])
def test_too_long_for_max_seq_is_refused_before_any_work(kind, monkeypatch):
    model = model_of("llama")
    calls = []
    monkeypatch.setattr(kvlib.loop, "forward_unchecked", lambda *a, **k: calls.append(1))
    msg = re.escape("KV overflow: 0 cached + 10 prompt + 7 new tokens > max_seq=16")
    if kind == "prealloc":
        cache = make_cache("prealloc", model, max_seq=16)
        with pytest.raises(ValueError, match=msg):
            generate(model, prompt(10), 7, cache=cache, eos_token_id=None)
        assert cache.seq_len == 0 and not cache.k.any() and not cache.v.any()
    else:
        with pytest.raises(ValueError, match=msg):
            generate(model, prompt(10), 7, max_seq=16, eos_token_id=None)
    assert calls == []


def test_exactly_max_seq_fits():
    model = model_of("llama")
    cache = make_cache("prealloc", model, max_seq=16)
    g = generate(model, prompt(10), 6, cache=cache, eos_token_id=None)
    assert g.tokens == generate(model, prompt(10), 6, eos_token_id=None).tokens
    assert cache.seq_len == 15


@pytest.mark.parametrize("n", [0, -1])
def test_max_new_tokens_below_one_is_refused(n):
    with pytest.raises(ValueError, match=re.escape(
            f"need a prompt and max_new_tokens >= 1, got 10 prompt tokens, {n}")):
        generate(model_of("llama"), prompt(10), n)


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="got 0 prompt tokens"):
        generate(model_of("llama"), torch.zeros(1, 0, dtype=torch.long), 4)


def test_a_batch_of_prompts_is_refused_not_flattened():
    # [2, 5] is two prompts; reshape(1, -1) would silently run them as one prompt of 10
    with pytest.raises(ValueError, match="2, 5"):
        generate(model_of("llama"), prompt(10).reshape(2, 5), 3, eos_token_id=None)


@pytest.mark.parametrize("chunk", [-1, -32])
def test_a_negative_prefill_chunk_is_refused(chunk):
    with pytest.raises(ValueError, match="prefill_chunk"):
        generate(model_of("llama"), prompt(10), 3, eos_token_id=None, prefill_chunk=chunk)


def test_unknown_cache_kind_is_refused():
    with pytest.raises(ValueError, match=re.escape(
            "cache must be 'prealloc', 'cat' or a cache object, not 'paged'")):
        generate(model_of("llama"), prompt(), 4, cache="paged")


def tiny_from(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    "config, message",
    [
        (GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64),
         "GPT2LMHeadModel ('gpt2'): its model lacks "
         "['embed_tokens', 'layers', 'norm', 'rotary_emb']"),
        (Olmo2Config(**SHARED), "Olmo2ForCausalLM ('olmo2'): its decoder layer has "
                                "['post_feedforward_layernorm'], which kvlib's token loop does "
                                "not compute"),
        (GraniteConfig(**SHARED, residual_multiplier=0.5),
         "'granite' has scaled residuals (residual_multiplier=0.5)"),
        (SmolLM3Config(**SHARED, no_rope_layers=[1, 0, 1]),
         "'smollm3' has layers without RoPE (no_rope_layers=[1, 0, 1])"),
        (MistralConfig(**SHARED),
         "sliding_window=4096: each layer attends to the last 4096 tokens; "
                                  "run it over a RingCache(window=4096), not a full cache"),
    ],
    ids=["gpt2", "olmo2", "granite-scaled", "smollm3-nope", "mistral-windowed"],
)
def test_what_the_loop_cannot_compute_is_refused_by_what_it_is(config, message):
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        generate(tiny_from(config), torch.tensor([[1, 2, 3]]), 2)


def test_the_same_families_are_accepted_where_nothing_is_unusual():
    for config in (GraniteConfig(**SHARED), SmolLM3Config(**SHARED, no_rope_layers=[1, 1, 1])):
        # no error: neutral values compute the same
        kvlib.decoder.check_supported(tiny_from(config))


def test_layers_of_mixed_attention_are_refused():
    config = Qwen2Config(**SHARED, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert "sliding_attention" in config.layer_types
    with pytest.raises(NotImplementedError, match="2 of 3 layers use 'sliding_attention'; kvlib's "
                       "token loop runs full or sliding-window attention in every layer"):
        generate(tiny_from(config), torch.tensor([[1, 2, 3]]), 2)


def test_positions_past_what_the_model_was_trained_for_are_refused_unless_asked():
    model = model_of("llama")  # max_position_embeddings=512
    msg = re.escape("0 cached + 500 prompt + 20 new tokens reach position 518, past "
                    "max_position_embeddings=512")
    with pytest.raises(ValueError, match=msg):
        generate(model, prompt(500), 20, eos_token_id=None)
    # position 511: fits
    assert len(generate(model, prompt(500), 13, eos_token_id=None).tokens) == 13
    assert len(generate(model, prompt(500), 20, eos_token_id=None, extrapolate=True).tokens) == 20


# --- timing and callbacks -------------------------------------------------------------------


def test_timed_reports_prefill_and_every_decode_step():
    model = model_of("llama")
    g = generate(model, prompt(), 12, eos_token_id=None, timed=True)
    assert len(g.tokens) == 12
    assert isinstance(g.prefill_s, float) and g.prefill_s > 0
    assert g.step_s is not None and len(g.step_s) == len(g.tokens) - 1
    assert all(isinstance(s, float) and s > 0 for s in g.step_s)
    assert g.tokens == hf_reference("llama")[0][:12]  # timing changes nothing


def test_timed_with_eos_times_only_the_kept_steps():
    model = model_of("llama")
    ref, _ = hf_reference("llama")
    k = eos_steps(ref)[1]
    g = generate(model, prompt(), N_NEW, eos_token_id=ref[k], timed=True)
    assert g.tokens == ref[: k + 1]
    assert g.step_s is not None and len(g.step_s) == k and all(s > 0 for s in g.step_s)
    assert g.prefill_s is not None and g.prefill_s > 0


def test_untimed_has_no_times():
    g = generate(model_of("llama"), prompt(), 4, eos_token_id=None)
    assert g.prefill_s is None and g.step_s is None and g.logits is None


def test_on_step_once_per_decode_step_with_the_cache_length():
    model = model_of("qwen2")
    cache = make_cache("prealloc", model)
    calls = []
    g = generate(model, prompt(), 20, cache=cache, eos_token_id=None,
                 on_step=lambda step, seq_len: calls.append((step, seq_len, cache.seq_len)))
    assert len(calls) == len(g.tokens) - 1 == 19
    assert [c[0] for c in calls] == list(range(19))
    assert [c[1] for c in calls] == [PROMPT_LEN + i + 1 for i in range(19)]
    # called after the step wrote its slot
    assert all(seq_len == held for _, seq_len, held in calls)


# --- the meter: what a decode step allocates ------------------------------------------------


STEPS = 62  # marks 0..60


def metered_run(model, cache, n_new=STEPS):
    meter = AllocMeter()
    lengths = []

    def on_step(step, seq_len):
        lengths.append(seq_len)
        meter.mark()

    with meter:
        g = generate(model, prompt(), n_new, cache=MeteredCache(cache, meter), eos_token_id=None,
                     on_step=on_step)
    assert len(meter.steps) == len(lengths) == n_new - 1
    return g, meter, lengths


def test_prealloc_decode_steps_allocate_nothing_in_the_cache_and_stay_flat():
    model = model_of("qwen3")
    cache = make_cache("prealloc", model, max_seq=PROMPT_LEN + STEPS)
    g, meter, lengths = metered_run(model, cache)
    assert g.tokens[:N_NEW] == hf_reference("qwen3")[0]  # same tokens, metered
    assert all(r.get("cache", 0) == 0 for r in meter.step_regions), meter.step_regions
    assert meter.by_region.get("cache", 0) == 0
    assert meter.steps[5] > 0  # the model's activations are counted...
    assert meter.steps[60] == meter.steps[5]  # ...and do not grow with the context
    assert len(set(meter.steps[1:])) == 1


def test_cat_cache_step_allocates_exactly_the_whole_new_cache():
    model = model_of("qwen3")
    cfg = model.config
    # K+V, all layers, fp32
    per_slot = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    cache = make_cache("cat", model)
    g, meter, lengths = metered_run(model, cache)
    assert lengths == [PROMPT_LEN + i + 1 for i in range(STEPS - 1)]
    # step 0 also holds the prefill, which grew every layer to the prompt's length
    assert meter.step_regions[0]["cache"] == per_slot * (PROMPT_LEN + PROMPT_LEN + 1)
    for i in range(1, STEPS - 1):
        assert meter.step_regions[i]["cache"] == per_slot * lengths[i], i
    assert meter.steps[60] - meter.steps[5] == per_slot * (lengths[60] - lengths[5])
    assert meter.by_op["aten.cat.default"] >= sum(r["cache"] for r in meter.step_regions)


# --- static shapes (the step a CUDA graph captures, run eagerly) ------------------------------


@pytest.mark.parametrize("bucket", [1, 8, 4096])  # a span per slot, buckets, the whole buffer
@pytest.mark.parametrize("family", FAMILIES)
def test_static_step_matches_transformers(family, bucket):
    """Position on the device, fixed spans, masked tail: the same tokens as HF."""
    model = model_of(family)
    g = generate(model, prompt(), N_NEW, step="static", bucket=bucket, max_seq=64,
                 eos_token_id=None, return_logits=True)
    tokens, logits = hf_reference(family)
    assert g.tokens == tokens
    assert g.cache.seq_len == PROMPT_LEN + N_NEW - 1
    for ours, theirs in zip(g.logits, logits):
        torch.testing.assert_close(ours, theirs, **FOLDED)


def test_static_step_reads_whole_buckets_and_never_moves():
    from kvlib.graphs import StaticStep

    model = model_of("qwen3")
    cache = make_cache("prealloc", model, max_seq=40)
    step = StaticStep(model, cache, bucket=16, capture=False)
    assert [step.span(p) for p in (0, 15, 16, 39)] == [16, 16, 32, 40]

    def addresses():
        return step.token.data_ptr(), step.pos.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr()

    before = addresses()
    token = torch.zeros(1, 1, dtype=torch.long)
    for pos in range(20):
        token = step(token, pos).argmax(-1, keepdim=True)
        assert cache.seq_len == pos + 1
    assert addresses() == before
    with pytest.raises(ValueError, match=r"KV overflow: writing slots 40\.\.41 into max_seq=40"):
        step(torch.zeros(1, 1, dtype=torch.long), 40)


def test_static_steps_refuse_a_cat_cache_and_graphs_refuse_the_cpu():
    model = model_of("llama")
    with pytest.raises(TypeError, match="static shapes need a preallocated cache, not CatCache"):
        generate(model, prompt(), 4, cache=make_cache("cat", model), step="static")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; the cache is on cpu"):
            generate(model, prompt(), 4, step="graph", eos_token_id=None)
    with pytest.raises(ValueError, match="step must be 'eager', 'static' or 'graph', not 'fast'"):
        generate(model, prompt(), 4, step="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_matches_eager():
    model = model_of("qwen3").cuda()
    ids = prompt().cuda()
    eager = generate(model, ids, N_NEW, eos_token_id=None)
    graph = generate(model, ids, N_NEW, step="graph", bucket=16, eos_token_id=None)
    assert graph.tokens == eager.tokens
    model.cpu()


def test_a_static_step_is_reused_across_requests_with_its_cache():
    from kvlib.graphs import StaticStep

    model = model_of("qwen2")
    step = StaticStep(model, make_cache("prealloc", model, max_seq=64), bucket=8, capture=False)
    first = generate(model, prompt(), N_NEW, step=step, eos_token_id=None)
    assert first.cache is step.cache and first.tokens == hf_reference("qwen2")[0]
    step.cache.reset()
    assert generate(model, prompt(), N_NEW, step=step, eos_token_id=None).tokens == first.tokens
    with pytest.raises(ValueError, match="a StaticStep brings its own cache"):
        generate(model, prompt(), 4, step=step, cache=make_cache("prealloc", model))
