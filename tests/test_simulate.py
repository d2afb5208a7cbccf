"""The simulated card: exact ledger bytes, the kernel rules, the OOM, and the plan it checks."""

import math

import pytest
import torch
from helpers import TINY

from course.simulate import Ledger, fits_context, longest_context, simulate
from kvlib.bandwidth import decode_bytes, step_bytes
from kvlib.budget import meta_model, plan_budget
from kvlib.cards import CARDS, card
from kvlib.config import GIB, kv_bytes_per_token, load_config
from kvlib.sdpa_choice import fused_sdpa, sdpa_kernel

META, BF16 = torch.device("meta"), torch.bfloat16


def empty(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device=META)


def weights(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def tiny():
    return meta_model(TINY["qwen3"](), BF16)  # L 3, Hq 4, Hkv 2, D 16, d 64, V 512: 384 B/token


@pytest.fixture(scope="module")
def qwen3_4b():
    return meta_model("qwen3-4b", BF16)


def test_ledger_counts_live_storages_exactly():
    with Ledger(start=1000) as led:
        a = empty(100)  # 200 B
        view = a[10:].view(2, 45)  # a view: no new storage
        with led.region("cache"):
            b = torch.cat([a, a])  # 400 B
        assert (led.live, led.by_region) == (1600, {"weights": 1000, "other": 200, "cache": 400})
        del a  # the view keeps the storage alive
        assert led.live == 1600
        del view
        assert (led.live, led.peak) == (1400, 1600)
        led.relabel(b, "mask")
        assert led.by_region == {"weights": 1000, "other": 0, "cache": 0, "mask": 400}
        led.mark(7)
        del b
        c = empty(3, dtype=torch.float32)
        led.mark(8)
    assert led.timeline == {"tokens": [7, 8], "live": [1400, 1012], "peak": [1600, 1400]}
    assert led.at_peak == {"weights": 1000, "other": 200, "cache": 400}
    del c
    assert led.live == 1000  # freed after the ledger closed, still taken off


def test_ledger_raises_at_the_op_that_passes_the_budget():
    with Ledger(budget=1000, start=500) as led:
        a = empty(200)  # 400 B: 900 live
        led.mark(3)
        with pytest.raises(torch.OutOfMemoryError, match=r"^simulated OOM at aten\.cat\.default: "
                           r"900 B live \+ 800 B requested > 1,000 B budget \(3 tokens so far\)$"):
            torch.cat([a, a])
        assert led.live == 900  # the refused tensor is not kept
    assert led.peak == 900


def test_an_unchecked_block_stays_unchecked_inside_named_regions():
    with Ledger(budget=1000) as led:
        with led.region(counted=False), led.region("cache"):
            a = empty(1000)  # 2000 B: past the budget, outside the check and the peak
        assert (led.live, led.peak, led.by_region["cache"]) == (2000, 0, 2000)
        with pytest.raises(torch.OutOfMemoryError, match="2,000 B live"):
            empty(1)
    del a


def test_composite_ops_hold_their_parts_at_once():
    """``_safe_softmax`` runs as softmax, an -inf test and a where: its output and the bool test
    are live together (fp32 [8, 100]: 3200 B, the bool 800 B)."""
    with Ledger() as led:
        torch.ops.aten._safe_softmax(empty(8, 100, dtype=torch.float32), -1)
    assert led.peak >= 3200 + 800


def test_an_op_taking_a_number_runs_whole_under_the_ledger():
    """int4's unpacking, ``code & 15`` and ``code >> 4``, on meta: each result is counted once
    (``&`` with a number has a composite that the ledger cannot run: it runs whole)."""
    code = empty(100, dtype=torch.uint8)
    with Ledger() as led:
        low, high = code & 15, code >> 4
    assert (low.shape, high.dtype, led.live) == (code.shape, torch.uint8, 200)


@pytest.mark.parametrize("sm, dtype, mask, gqa, kernel", [
    (9.0, BF16, False, True, "flash"),  # decode or causal prefill, grouped KV heads
    (8.0, BF16, True, False, "efficient"),  # a masked chunk, query heads folded into rows
    (7.5, torch.float16, True, False, "efficient"),
    (7.5, torch.float16, False, True, "math"),  # efficient takes no grouped heads, flash needs sm80
    (7.5, torch.float16, False, False, "efficient"),  # decode with query heads folded into rows
    (7.5, BF16, False, False, "math"),  # no bf16 below sm80
    (9.0, torch.float32, False, True, "math"),  # flash takes no fp32
])
def test_sdpa_kernel_rules(sm, dtype, mask, gqa, kernel):
    q, k = empty(1, 32, 4, 128, dtype=dtype), empty(1, 8 if gqa else 32, 64, 128, dtype=dtype)
    assert sdpa_kernel(sm, q, k, empty(4, 64) if mask else None, gqa) == kernel


@pytest.mark.parametrize("S, padded", [(64, 0), (61, 12 * 64 * 2)])
def test_fused_kernel_allocates_output_lse_and_a_padded_unaligned_mask(S, padded):
    q, v, mask = empty(1, 8, 12, 128), empty(1, 8, S, 128), empty(12, S)
    with Ledger() as led:
        out = fused_sdpa(q, v, mask)
    assert out.shape == (1, 8, 12, 128)
    assert led.live == out.untyped_storage().nbytes() == 8 * 12 * 128 * 2
    assert led.peak == led.live + 8 * 12 * 4 + padded  # + log-sum-exp, + the mask's copy


def test_prealloc_holds_its_cache_flat_and_exact(tiny):
    r = simulate(tiny, 300, budget=GIB, prefill_chunk=64, decode=6, attention="fused")
    kv = kv_bytes_per_token(tiny.config, BF16)
    assert r.at_peak["cache"] == 2 * 3 * 300 * 2 * 16 * 2 == 300 * kv  # 2 L S Hkv D bytes
    assert r.timeline["tokens"] == [64, 128, 192, 256, 294, 295, 296, 297, 298, 299, 300]
    assert len(set(r.timeline["live"][5:])) == 1  # decode steps keep nothing new
    assert r.kernels == {"flash": 3 * (5 + 6)}  # per layer: every chunk and decode step on flash,
    # the chunks after cached slots too: flash takes the causal rule itself, so no mask is built
    assert "mask" not in r.at_peak


def test_cat_grows_one_token_a_step_and_dies_at_a_cat(tiny):
    kw = dict(cache="cat", prefill_chunk=64, decode=400, attention="fused", tail=True)
    r = simulate(tiny, 600, budget=GIB, **kw)
    assert r.timeline["tokens"] == [192, 200, 599, 600] and r.timeline["peak"][-1] == r.peak
    live, kv = r.timeline["live"], kv_bytes_per_token(tiny.config, BF16)
    assert live[-1] - live[-2] == kv  # the whole cache was copied, one token longer
    dead = simulate(tiny, 600, budget=r.peak - 1, **kw)
    assert str(dead.oom).startswith("simulated OOM at aten.cat.default")
    assert str(dead.oom).endswith("(599 tokens so far)") and dead.timeline["tokens"][-1] == 599


def test_a_cache_that_does_not_fit_dies_as_it_is_allocated(tiny):
    r = simulate(tiny, 1000, budget=weights(tiny) + 1000 * 96, prefill_chunk=64)  # a quarter of it
    assert str(r.oom).startswith("simulated OOM at aten.empty")
    assert str(r.oom).endswith("(0 tokens so far)")
    assert not r.fits and r.timeline["tokens"] == []


@pytest.mark.parametrize("cache", ["prealloc", "cat"])
@pytest.mark.parametrize("attention", ["fused", "math"])
def test_a_tail_run_peaks_as_the_whole_run(tiny, cache, attention):
    for context, decode in ((300, 4), (237, 20)):
        kw = dict(cache=cache, attention=attention, budget=GIB, prefill_chunk=64, decode=decode)
        whole, tail = simulate(tiny, context, **kw), simulate(tiny, context, tail=True, **kw)
        assert (tail.peak, tail.timeline["live"][-1]) == (whole.peak, whole.timeline["live"][-1])


def test_the_math_path_materialises_the_scores_and_the_mask(tiny):
    fused, math_ = (simulate(tiny, 1024, budget=GIB, prefill_chunk=64, attention=a, tail=True)
                    for a in ("fused", "math"))
    assert math_.kernels == {"math": 3 * 4} and fused.kernels == {"flash": 3 * 4}
    scores = 4 * 64 * 960 * 4  # [Hq, n, S] fp32, the last full chunk
    assert math_.at_peak["attention"] > 2 * scores  # the scores and their softmax, at the peak
    # [group * n, S] in bf16, all forward: the last chunk's (60 tokens over 1,020 slots) at the peak
    assert math_.at_peak["mask"] == 2 * 60 * 1020 * 2
    assert math_.peak - fused.peak > scores
    # No fused kernel holds anything that large, nor a mask: flash applies the causal rule of a
    # chunk after cached slots itself. The fused run peaks in Qwen3's q_norm (q in fp32 twice),
    # in the last full chunk, next to the cache, the ids and the last logits.
    assert "mask" not in fused.at_peak and "attention" not in fused.at_peak
    before = weights(tiny) + 1024 * 384 + 1020 * 8 + 1024
    held = 64 * (2 * 64 * 2 + 2 * 16 * 2 + 16)  # x, its norm, cos, sin, positions, packed ids
    norm = 64 * (4 + 2 * 2) * 16 * 2 + 64 * 4 * (16 * 8 + 8)  # q, k, v; q in fp32 twice, [n, Hq]
    assert fused.peak - before == held + norm + 4 * 16  # + RoPE's buffers (inverse frequencies)


def test_the_decoder_asks_the_card_which_kernel_takes_the_causal_rule(tiny):
    """On a card whose kernels take the rule (flash with grouped heads), a chunk after cached slots
    holds no mask; on the math path, or where no fused kernel takes grouped heads (sm 7.5), it
    keeps the folded mask: a materialised rule would copy K and V per query head."""
    kw = dict(budget=GIB, prefill_chunk=64, tail=True)
    assert "mask" not in simulate(tiny, 300, card="RTX 3060", **kw).at_peak
    for run in (simulate(tiny, 300, attention="math", **kw), simulate(tiny, 300, card="T4", **kw)):
        assert run.at_peak["mask"] == 2 * 64 * 256 * 2 and "math" in run.kernels


CHUNKS = [64, 256, 512, 1000, 1024, 2048, 4096]
DECODE = 4  # the decode steps a simulated run takes after its prompt (simulate's default)


def check_plan(model, plan: int, **kw) -> None:
    """The plan runs on the simulated card and 1% more does not; or, where DECODE tokens are more
    than 1% of the plan (a limit of a few hundred tokens), DECODE + 1 more does not. Why: the plan
    prices a prompt of the whole context, since it cannot know how many tokens a run will decode,
    while the simulation prefills ``context - DECODE`` tokens and decodes DECODE, so the plan may
    fall short by the chunk work of those DECODE tokens. Everything else the ledger holds, the
    plan prices to the byte."""
    assert fits_context(model, plan, **kw), f"the plan's {plan:,} tokens do not fit"
    over = max(math.ceil(plan * 1.01), plan + DECODE + 1)
    assert not fits_context(model, over, **kw), f"{over:,} tokens fit: the plan says {plan:,}"


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("cache", ["prealloc", "cat"])
@pytest.mark.parametrize("attention", ["fused", "math"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_plan_never_passes_the_simulated_limit(tiny, chunk, attention, cache, batch):
    budget = weights(tiny) + 6000 * kv_bytes_per_token(tiny.config, BF16)
    plan = plan_budget(tiny.config, BF16, budget, batch, chunk, attention=attention,
                       cache=cache).max_context
    check_plan(tiny, plan, budget=budget, cache=cache, attention=attention, prefill_chunk=chunk,
               batch=batch, decode=DECODE)


def test_the_plan_is_the_simulated_limit_to_the_token_where_the_ledger_peaks_in_a_chunk(tiny):
    """Fused, preallocated, 64-token chunks: the peak is a chunk's q_norm, which the plan prices to
    the byte, so the bisection on the card lands on the plan itself."""
    budget = weights(tiny) + 6000 * kv_bytes_per_token(tiny.config, BF16)
    plan = plan_budget(tiny.config, BF16, budget, prefill_chunk=64).max_context
    kw = dict(budget=budget, prefill_chunk=64, attention="fused")
    assert longest_context(tiny, lo=plan - 64, hi=plan + 64, **kw) == plan


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("cache", ["prealloc", "cat"])
@pytest.mark.parametrize("attention", ["fused", "math"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_qwen3_4b_plan_runs_on_12_gib_and_one_percent_more_does_not(qwen3_4b, chunk, attention,
                                                                    cache, batch):
    plan = plan_budget(load_config("qwen3-4b"), BF16, 12 * GIB, batch, chunk, attention=attention,
                       cache=cache).max_context
    check_plan(qwen3_4b, plan, card="12 GiB", cache=cache, attention=attention,
               prefill_chunk=chunk, batch=batch, decode=DECODE)
    assert plan * 0.01 > DECODE  # the 1% bound, every case: at least 401 tokens


def test_cards_cite_their_sheets_and_read_gb_as_gib():
    assert len(CARDS) == 8 and all(c.source for c in CARDS.values())
    assert card("12 GiB").memory == 12 * GIB and card("A100 80GB").bandwidth == 2039e9
    assert card("T4").sm < 8.0 <= card("RTX 3060").sm and card(card("T4")) is card("T4")
    assert card("T4").memory_gb == 16 and card("T4").memory == 15 * GIB  # ECC holds 1/16
    with pytest.raises(ValueError, match="RTX 3060"):
        card("RTX 9090")


def test_predicted_ms_per_token_is_the_floor_and_cat_moves_its_cache_twice_more():
    config, h100 = load_config("qwen3-4b"), card("H100 80GB")
    kv = kv_bytes_per_token(config, BF16) * 8192
    assert step_bytes(config, BF16, 8192) == decode_bytes(config, BF16, 8192)
    assert step_bytes(config, BF16, 8192, "cat") == decode_bytes(config, BF16, 8192) + 2 * kv
    assert h100.predicted_ms_per_token(config, BF16, 8192, "cat") == pytest.approx(
        1e3 * (decode_bytes(config, BF16, 8192) + 2 * kv) / 3.35e12)




def test_any_cache_runs_from_a_factory_and_an_unknown_name_is_refused(tiny):
    from kvlib import QuantCache

    kw = dict(budget=GIB, prefill_chunk=64, decode=6, attention="fused")
    r = simulate(tiny, 300, cache=QuantCache.for_model, **kw)
    held = QuantCache.for_model(tiny.config, 300, device=META, dtype=BF16).nbytes
    assert r.cache == "QuantCache.for_model" and r.fits
    assert held <= r.at_peak["cache"] < 300 * kv_bytes_per_token(tiny.config, BF16)  # int8 codes
    assert simulate(tiny, 300, cache=QuantCache.for_model, tail=True, **kw).peak == r.peak
    with pytest.raises(ValueError, match="'bogus'"):
        simulate(tiny, 300, cache="bogus")
