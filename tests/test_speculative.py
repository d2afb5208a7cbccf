"""Prompt lookup: guesses from the text, verified in one forward, the cache cropped back.

The tokens are plain greedy's, and transformers', on every cache that crops (a ring past its window
included), whether every guess is right, none is, or the lookup finds what it finds; EOS and
``max_new_tokens`` stop it where they stop greedy; the counts add up; what it cannot run is refused.
"""

import functools

import pytest
import torch
from helpers import SHARED, tiny_model
from test_generate import hf_generate
from test_ring_cache import hf_reference as ring_reference
from test_ring_cache import model_of as ring_model
from test_ring_cache import prompt as ring_prompt

import kvlib.speculative
from kvlib import CatCache, KVCache, QuantCache, RingCache, generate
from kvlib.graphs import StaticStep
from kvlib.paged_cache import BlockPool, PagedCache
from kvlib.speculative import propose

NEW = 30


@functools.cache
def model_of(family="llama"):
    return tiny_model(family)


def text(seed=3):
    """A prompt that repeats itself, so a lookup has something to find."""
    base = torch.randint(0, SHARED["vocab_size"], (1, 20),
                         generator=torch.Generator().manual_seed(seed))
    return torch.cat([base, base, base[:, :7]], 1)


@functools.cache
def greedy(family="llama", seed=3):
    return generate(model_of(family), text(seed), NEW, eos_token_id=None).tokens


def cache_of(kind, model):
    kw = dict(device="cpu", dtype=torch.float32)
    return {"prealloc": lambda: KVCache.for_model(model.config, 128, **kw),
            "cat": lambda: CatCache.for_model(model.config, **kw),
            "paged": lambda: PagedCache(BlockPool.for_model(model.config, 64, 4, **kw)),
            "ring": lambda: RingCache.for_model(model.config, 128, **kw)}[kind]()


def test_propose_takes_what_followed_the_latest_longest_match():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the latest of two
    assert propose([5, 1, 2, 6, 4, 2], 3) == [6, 4, 2]  # only a 1-gram matches
    assert propose([1, 2, 3, 4], 3) == [] and propose([7], 3) == []
    assert propose([4, 5, 6, 4, 5], 5, ngram=2) == [6, 4, 5]


@pytest.mark.parametrize("k", [1, 4, 10])
@pytest.mark.parametrize("kind", ["prealloc", "cat", "paged", "ring"])
def test_lookup_tokens_equal_plain_greedy_on_every_cache_that_crops(kind, k):
    model = model_of()
    g = generate(model, text(), NEW, cache=cache_of(kind, model), eos_token_id=None,
                 prompt_lookup_num_tokens=k)
    assert g.tokens == greedy()
    assert g.cache.seq_len == text().shape[1] + NEW - 1  # rolled back to what greedy holds
    assert 0 < g.accepted <= g.drafted <= k * g.forwards  # something was found and kept
    assert g.forwards == NEW - 1 - g.accepted  # each forward: its accepted guesses and one more


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_lookup_tokens_equal_transformers(family):
    model = model_of(family)
    hf_tokens, _ = hf_generate(model, text(), NEW)
    assert generate(model, text(), NEW, eos_token_id=None,
                    prompt_lookup_num_tokens=5).tokens == hf_tokens


def test_every_guess_right_or_every_guess_wrong_still_gives_greedy(monkeypatch):
    model, n = model_of(), text().shape[1]
    int8 = lambda: QuantCache.for_model(model.config, 128, device="cpu", dtype=torch.float32)  # noqa: E731
    want = generate(model, text(), NEW, eos_token_id=None, cache=int8()).tokens
    oracle = lambda history, k, ngram=3: (want + [0] * 9)[len(history) - n :][:k]  # noqa: E731
    monkeypatch.setattr(kvlib.speculative, "propose", oracle)
    right = generate(model, text(), NEW, eos_token_id=None, prompt_lookup_num_tokens=4,
                     cache=int8())
    assert right.tokens == want
    assert right.drafted == right.accepted and right.forwards == -(-(NEW - 1) // 5)
    wrong = lambda history, k, ngram=3: [(t + 1) % 512 for t in oracle(history, k)]  # noqa: E731
    monkeypatch.setattr(kvlib.speculative, "propose", wrong)
    g = generate(model, text(), NEW, eos_token_id=None, prompt_lookup_num_tokens=4, cache=int8())
    assert g.tokens == want and g.accepted == 0 and g.forwards == NEW - 1


def test_a_ring_past_its_window_still_gives_transformers_tokens():
    model = ring_model("mistral")  # a window of 8: every forward past it may guess one token
    tokens = ring_reference("mistral")[0]
    cache = RingCache.for_model(model.config, device="cpu", dtype=torch.float32)
    g = generate(model, ring_prompt(), len(tokens), cache=cache, eos_token_id=None,
                 prompt_lookup_num_tokens=6)
    assert g.tokens == tokens


def test_eos_stops_it_where_it_stops_greedy():
    model, want = model_of(), greedy()
    eos = want[12]  # a token greedy makes: everything after it is dropped, guessed or not
    stop = want.index(eos)
    g = generate(model, text(), NEW, eos_token_id=eos, prompt_lookup_num_tokens=8)
    assert g.tokens == want[: stop + 1]
    assert g.cache.seq_len == text().shape[1] + stop


def test_an_eos_inside_an_accepted_run_stops_it_at_once(monkeypatch):
    """Before: only a forward's last token was looked at, so an EOS among the guesses it accepted
    ran on to ``max_new_tokens`` (6 forwards here, 15-24 seen), the tokens trimmed after."""
    model, want, n = model_of(), greedy(), text().shape[1]
    e = next(i for i in range(1, 5) if want[i] not in want[:i])  # guessed, and accepted, at once
    oracle = lambda history, k, ngram=3: (want + [0] * 9)[len(history) - n :][:k]  # noqa: E731
    monkeypatch.setattr(kvlib.speculative, "propose", oracle)
    g = generate(model, text(), NEW, eos_token_id=want[e], prompt_lookup_num_tokens=4)
    assert g.tokens == want[: e + 1] and g.forwards == 1 and g.accepted == 4
    assert g.cache.seq_len == n + e  # cropped to the EOS: the guesses past it are gone


def test_a_prefix_cache_and_prompt_lookup_together():
    model = model_of()
    pool = BlockPool.for_model(model.config, 64, 4, device="cpu", dtype=torch.float32,
                               prefix_cache=True)
    generate(model, text(), 5, cache=PagedCache(pool), eos_token_id=None).cache.reset()
    g = generate(model, text(), NEW, cache=PagedCache(pool), eos_token_id=None,
                 prompt_lookup_num_tokens=4)
    assert g.cached_tokens == 44 and g.tokens == greedy()


def test_what_it_cannot_run_is_refused():
    model = model_of()
    with pytest.raises(ValueError, match="one greedy eager request, untimed: got 2 requests"):
        generate(model, [text(), text()], 4, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="temperature=0.7"):
        generate(model, text(), 4, temperature=0.7, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="needs k >= 1 \\(got -1\\)"):
        generate(model, text(), 4, prompt_lookup_num_tokens=-1)
    step = StaticStep(model, KVCache.for_model(model.config, 128, device="cpu",
                                               dtype=torch.float32), capture=False)
    with pytest.raises(ValueError, match="step='static'|StaticStep"):
        generate(model, text(), 4, step=step, prompt_lookup_num_tokens=2)


def test_smollm2_asked_to_repeat_code_gives_transformers_tokens(smollm2):
    model, tok = smollm2
    source = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
    chat = [{"role": "user", "content": f"Repeat this code exactly:\n{source}"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    hf_tokens, _ = hf_generate(model, ids, 24)
    g = generate(model, ids, 24, prompt_lookup_num_tokens=10)  # eos "auto"
    assert g.tokens == hf_tokens, (tok.decode(g.tokens), tok.decode(hf_tokens))
    assert g.accepted > 0 and g.forwards + g.accepted == len(g.tokens) - 1
