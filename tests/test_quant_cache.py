"""The quantized cache: exact bytes, an error bounded by half a step, and exactly the tokens of
attention over the same rounded K/V; on SmolLM2's real weights, how close int8 stays to fp32.
"""

import functools
import re

import pytest
import torch
from helpers import FAMILIES, SHARED, assert_same_greedy, tiny_model

from kvlib import AllocMeter, KVCache, forward, generate
from kvlib.config import kv_bytes_per_token, load_config
from kvlib.quant_cache import QuantCache, dequantize, quantize

FOLDED = dict(rtol=1e-4, atol=1e-4)  # two SDPA calls over equal K/V, summed in another order
SCHEMES = [(8, 16), (8, 4), (4, 16), (4, 4)]  # (bits, group) on head_dim 16


def keys_like(n=64, D=16, dtype=torch.float32, seed=0):
    """``[2, n, D]`` with a few large channels and one all-zero row, as real keys have."""
    x = torch.randn(2, n, D, generator=torch.Generator().manual_seed(seed))
    x[..., 3] *= 20  # an outlier channel
    x[0, 5] = 0
    return x.to(dtype)


@pytest.mark.parametrize("bits, group", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_at_most_half_a_step(bits, group, dtype):
    x = keys_like(dtype=dtype)
    code, scale = quantize(x, bits, group)
    assert code.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert code.shape == (2, 64, 16 * bits // 8) and scale.shape == (2, 64, 16 // group, 1)
    assert scale.dtype == dtype
    y = dequantize(code, scale, group)
    assert y.shape == x.shape and y.dtype == dtype and not y.isnan().any()
    step = scale.float().expand(-1, -1, -1, group).flatten(-2)  # [2, n, D]: each element's step
    # half a step of rounding, plus the dtype's own rounding of the product (exact in fp32)
    slack = 0 if dtype == torch.float32 else y.float().abs() * 2**-8
    assert ((x.float() - y.float()).abs() <= step / 2 * (1 + 1e-6) + slack).all()
    assert torch.equal(y[0, 5], torch.zeros(16, dtype=dtype))  # an all-zero row comes back as zeros
    if bits == 8:
        assert code.abs().max() == 127  # the largest element of each group uses the full range
    else:
        assert ((code & 15) >= 1).all() and ((code >> 4) >= 1).all()  # nibbles 1..15: codes -7..7


def test_int4_puts_even_channels_in_the_low_nibble():
    x = torch.tensor([[-7.0, 7.0, 1.0, 0.0]])  # group 4: scale 1, codes = x
    code, scale = quantize(x, 4, 4)
    assert scale.item() == 1
    assert code.tolist() == [[(-7 + 8) | (7 + 8) << 4, (1 + 8) | (0 + 8) << 4]]


@pytest.mark.parametrize("bits, group, dtype, want", [
    (8, None, torch.float32, 2 * 30 * 3 * (64 + 4)),
    # int8 codes + one fp32 scale per token and head
    (8, None, torch.bfloat16, 2 * 30 * 3 * (64 + 2)),
    (4, None, torch.bfloat16, 2 * 30 * 3 * (32 + 2 * 2)),
    # two int4 a byte, a scale per 32 channels
    (4, 16, torch.float32, 2 * 30 * 3 * (32 + 4 * 4)),
])
def test_bytes_per_token_are_exact_scales_included(bits, group, dtype, want):
    config = load_config("smollm2-135m")
    cache = QuantCache.for_model(config, 100, bits=bits, group=group, device="meta", dtype=dtype)
    assert cache.bytes_per_token == want
    assert cache.nbytes == 100 * want  # every tensor it holds, counted
    if dtype == torch.bfloat16 and group is None:  # what the budget prices for a bf16 card
        assert kv_bytes_per_token(config, f"int{bits}") == want


def test_the_cache_holds_codes_and_scales_and_a_view_dequantizes_one_layer():
    H, D, S = 2, 16, 32
    cache = QuantCache(3, S, H, D, device="cpu", dtype=torch.float32)
    assert {t.dtype for t in (cache.k, cache.v)} == {torch.int8}
    x = keys_like(n=20).transpose(0, 1)  # [n, Hkv, D]
    cache.write(1, 0, x, -x)
    with AllocMeter() as meter:
        k, v = cache.view(1, 20)
    # exactly one dequantized [1, Hkv, 20, D] copy each of K and V, of this layer only
    assert meter.total == 2 * H * 20 * D * 4 and meter.count == 2
    assert k.shape == (1, H, 20, D) and k.dtype == torch.float32
    want = dequantize(*quantize(x.transpose(0, 1), 8, D), D)
    assert torch.equal(k[0], want) and torch.equal(v[0], -want)


def test_refusals_name_the_numbers():
    cache = QuantCache(2, 8, 2, 16, device="cpu", dtype=torch.float32)
    x = torch.zeros(5, 2, 16)
    with pytest.raises(ValueError,
                       match=re.escape("KV overflow: writing slots 5..10 into max_seq=8")):
        cache.write(0, 5, x, x)
    with pytest.raises(ValueError, match="is torch.bfloat16 on cpu, cache is torch.float32 on cpu"):
        cache.write(0, 0, x.bfloat16(), x.bfloat16())
    with pytest.raises(ValueError, match=re.escape("view of 9 slots from a cache of max_seq=8")):
        cache.view(0, 9)
    with pytest.raises(ValueError, match=re.escape("bits=3 (8 or 4)")):
        QuantCache(2, 8, 2, 16, bits=3)
    with pytest.raises(ValueError, match=re.escape("head_dim=16 group=5 (divides it)")):
        QuantCache(2, 8, 2, 16, group=5)


class RoundedKV(KVCache):
    """A full-precision cache of the values a QuantCache would hand back: the reference."""

    def __init__(self, *args, bits, **kw):
        super().__init__(*args, **kw)
        self.bits, self.group = bits, self.head_dim if bits == 8 else min(32, self.head_dim)

    def write(self, layer, start, k, v):
        rounded = [dequantize(*quantize(x, self.bits, self.group), self.group) for x in (k, v)]
        super().write(layer, start, *rounded)


@functools.cache
def model_of(family):
    return tiny_model(family)


def prompt(n=12, seed=1):
    return torch.randint(0, SHARED["vocab_size"], (1, n),
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_are_those_of_attention_over_the_rounded_kv(family, bits):
    """Quantizing changes the numbers; it must change nothing else (slots, order, scales)."""
    model = model_of(family)
    config, n_new = model.config, 40
    quant = QuantCache.for_model(config, 12 + n_new, bits=bits, device="cpu", dtype=torch.float32)
    rounded = RoundedKV(config.num_hidden_layers, 12 + n_new, SHARED["num_key_value_heads"],
                        SHARED["head_dim"], device="cpu", dtype=torch.float32, bits=bits)
    ours = generate(model, prompt(), n_new, cache=quant, eos_token_id=None, return_logits=True)
    want = generate(model, prompt(), n_new, cache=rounded, eos_token_id=None, return_logits=True)
    assert ours.tokens == want.tokens
    for a, b in zip(ours.logits, want.logits):
        torch.testing.assert_close(a, b, **FOLDED)


def test_continuing_and_chunking_change_nothing():
    """Per-token scales are final when written: a continued or chunked run equals one run."""
    model = model_of("qwen3")
    cache = QuantCache.for_model(model.config, 64, device="cpu", dtype=torch.float32)
    first = generate(model, prompt(10), 8, cache=cache, eos_token_id=None)
    more = torch.tensor([first.tokens[-1:] + [5, 77, 300]])
    second = generate(model, more, 8, cache=cache, eos_token_id=None)
    everything = torch.cat([prompt(10), torch.tensor([first.tokens + [5, 77, 300]])], dim=1)
    fresh = QuantCache.for_model(model.config, 64, device="cpu", dtype=torch.float32)
    single = generate(model, everything, 8, cache=fresh, eos_token_id=None, prefill_chunk=7)
    assert second.tokens == single.tokens
    n = cache.seq_len
    for layer in range(cache.n_layers):  # a projection of 7 rows or 1 sums in another order:
        # an element on a half step may round to the neighbouring code, one step away
        for got, want, scale in zip(cache.view(layer, n), fresh.view(layer, n),
                                    (fresh.k_scale, fresh.v_scale)):
            step = scale[layer, :, :n].expand(-1, -1, -1, cache.group).flatten(-2)  # [Hkv, n, D]
            apart = (got[0] - want[0]).abs()
            assert (apart <= step * (1 + 1e-4) + FOLDED["atol"]).all()
            assert (apart > FOLDED["atol"]).float().mean() < 0.01  # almost every code the same


CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]
INT8_LOGITS = 1.5  # int8's largest logit error at any step: measured 0.7 to 0.9 on two CPUs


def fed_logits(model, ids, tokens, bits):
    """The logits ``[len(tokens), V]`` that pick each of ``tokens``, over a QuantCache fed them:
    fp32's history at every step, so no step's error comes from an earlier near-tie."""
    cache = QuantCache.for_model(model.config, ids.shape[1] + len(tokens), bits=bits, device="cpu",
                                 dtype=torch.float32)
    logits = [forward(model, ids, cache, 0)]
    for step, token in enumerate(tokens[:-1]):
        logits.append(forward(model, torch.tensor([[token]]), cache, ids.shape[1] + step))
    return torch.cat(logits)  # [len(tokens), V]


def test_smollm2_int8_stays_close_to_the_full_precision_cache(smollm2):
    """Real weights: int8's logits stay within INT8_LOGITS of the fp32 cache's at every step, and
    int4's are several times further off. The greedy text is fp32's except at a near-tie, which the
    CPU's arithmetic may tip either way (this chat has top-2 margins of 0.01 logit)."""
    model, tok = smollm2
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    ref = generate(model, ids, 16, eos_token_id=None, return_logits=True)
    want = torch.stack(ref.logits)  # [16, V]
    err = {bits: (fed_logits(model, ids, ref.tokens, bits) - want).abs().amax(-1)
           for bits in (8, 4)}  # [16]: each step's largest logit error
    assert 0 < err[8].max() < INT8_LOGITS and err[8].median() < INT8_LOGITS / 2, err[8]
    assert err[4].median() > 4 * err[8].median(), (err[4], err[8])  # int4: steps 13-16x coarser
    free = generate(model, ids, 16, eos_token_id=None, return_logits=True,
                    cache=QuantCache.for_model(model.config, ids.shape[1] + 16, device="cpu",
                                               dtype=torch.float32))
    assert_same_greedy(free.tokens, free.logits, ref.tokens, ref.logits, rtol=0, atol=INT8_LOGITS)
