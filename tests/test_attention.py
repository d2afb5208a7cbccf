"""Split-KV decode attention and the static step's kernels: exact against SDPA's math path, the same
for every split count, few kernels per layer, weights held once, and a compiled step in one graph
per bucket."""

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel

import kvlib
from kvlib import attention
from kvlib.attention import HIDDEN, MIN_CHUNK, attend, split_kv, splits
from kvlib.graphs import QKV, StaticStep, fuse, unfuse
from kvlib.kv_cache import KVCache
from kvlib.meter import count_kernels, decode_kernels

LIMIT = 24  # kernels per layer of the static step (issue 22)


def _reference(q, keys, values, pos, scale):
    """SDPA's math path in fp32: the folded query over slots 0..pos."""
    visible = torch.arange(keys.shape[2]) <= pos
    mask = torch.zeros(keys.shape[2]).masked_fill(~visible, float("-inf"))
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q[None], keys, values, attn_mask=mask,
                                              scale=scale)[0]


@pytest.mark.parametrize(("heads", "group", "span", "slots"),
                         [(1, 1, 64, 64), (2, 4, 128, 200), (4, 2, 96, 96), (8, 4, 256, 300)])
def test_split_kv_equals_sdpa_math_for_every_split(heads, group, span, slots):
    gen = torch.Generator().manual_seed(span)
    cache_k, cache_v = (torch.randn(1, heads, slots, 16, generator=gen) * 3 for _ in "kv")
    keys, values = cache_k[:, :, :span], cache_v[:, :, :span]  # views, as a cache hands them out
    q = torch.randn(heads, group, 16, generator=gen)
    for pos in (0, 1, span // 2, span - 2, span - 1):
        want = _reference(q, keys, values, pos, 0.25)
        mask = torch.zeros(span).masked_fill(torch.arange(span) > pos, HIDDEN)
        outs = [split_kv(q, keys, values, mask, 0.25, P)
                for P in range(1, span + 1) if span % P == 0]
        for got in outs:  # at pos 0 every chunk but the first is masked whole: no NaN
            assert got.isfinite().all()
            assert (got - want).abs().max() < 1e-5
            assert (got - outs[0]).abs().max() < 1e-5  # the split count does not matter


def test_splits_fill_the_card_with_chunks_of_64_slots_or_more():
    meta = torch.device("meta")  # counts as an H200: 132 SMs
    assert splits(8192, 8, meta) == 32 and splits(16384, 8, meta) == 32  # 256 blocks
    assert splits(320, 8, meta) == 5 and splits(256, 1, meta) == 4  # chunks of 64 at least
    for span in (1, 7, 97, 4352):
        P = splits(span, 8, meta)
        assert span % P == 0 and (P == 1 or span // P >= MIN_CHUNK)


def test_attention_modes_agree():
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, 2, 128, 16, generator=gen) for _ in "kv")
    q, pos = torch.randn(2, 3, 16, generator=gen), torch.tensor([77])
    want = _reference(q, keys, values, 77, 0.25)
    for mode, P in (("split", 4), ("sdpa", 1),
                    (lambda q, k, v, scale, pos: _reference(q, k, v, pos.item(), scale), 1)):
        got = attend(mode, pos, 128, P, torch.float32)(q, keys, values, 0.25)
        assert (got - want).abs().max() < 1e-5
    with pytest.raises(ValueError, match="attention must be one of"):
        attend("fast", pos, 128, 1, torch.float32)


@pytest.mark.parametrize("attention", ["split", "sdpa"])
def test_static_step_gives_eager_tokens_with_either_attention(attention):
    model = tiny_model("qwen3")
    ids = torch.randint(0, 512, (1, 21), generator=torch.Generator().manual_seed(1))
    want = kvlib.generate(model, ids, 12, max_seq=64).tokens
    step = StaticStep(model, KVCache.for_model(model.config, 64, device="cpu", dtype=model.dtype),
                      bucket=16, capture=False, attention=attention)
    assert kvlib.generate(model, ids, 12, step=step).tokens == want
    with pytest.raises(ValueError, match="attention must be one of"):
        StaticStep(model, step.cache, attention="fast")


def test_fused_weights_are_views_of_one_tensor():
    model = tiny_model("qwen2")  # q/k/v with biases
    before = [getattr(model.model.layers[0].self_attn, n).weight.clone() for n in QKV]
    held = sum(p.nbytes for p in model.parameters())
    fuse(model)
    fuse(model)  # again: nothing changes
    attn = model.model.layers[0].self_attn
    weight, bias = attn._kvlib_fused
    for name, old in zip(QKV, before):
        proj = getattr(attn, name)
        assert proj.weight.untyped_storage()._cdata == weight.untyped_storage()._cdata
        assert proj.bias.untyped_storage()._cdata == bias.untyped_storage()._cdata
        assert torch.equal(proj.weight, old)
    mlp = model.model.layers[0].mlp
    gate_up = mlp._kvlib_fused[0].untyped_storage()._cdata
    assert mlp.up_proj.weight.untyped_storage()._cdata == gate_up
    storages = {p.untyped_storage()._cdata: p.untyped_storage() for p in model.parameters()}
    assert sum(s.nbytes() for s in storages.values()) == held  # each byte held once


def test_unfuse_gives_the_model_back_as_it_was():
    model, ids = tiny_model("qwen3"), torch.tensor([[3, 1, 4, 1, 5]])
    want = kvlib.generate(model, ids, 8, eos_token_id=None).tokens
    before = {name: p.clone() for name, p in model.named_parameters()}
    kvlib.generate(model, ids, 8, step="static", eos_token_id=None)  # fuses the model
    unfuse(model)
    unfuse(model)  # again: nothing to undo
    params = dict(model.named_parameters())
    assert params.keys() == before.keys()
    assert all(torch.equal(params[name], p) for name, p in before.items())
    storages = {p.untyped_storage()._cdata for p in params.values()}
    assert len(storages) == len(params)  # each weight its own storage again
    assert not [m for m in model.modules() if any(k.startswith("_kvlib") for k in vars(m))]
    assert kvlib.generate(model, ids, 8, eos_token_id=None).tokens == want


def _per_layer(step: str, attention: str) -> float:
    """Kernels per layer of one decode step of Qwen3-4B in bf16 on ``meta``."""
    return sum(decode_kernels("qwen3-4b", step, attention=attention).values()) / 36


def test_kernels_per_layer(capsys):
    """Printed for CI: one decode step of Qwen3-4B in bf16, counted on the meta device."""
    per_layer = {f"{step} ({attention})": _per_layer(step, attention)
                 for step, attention in (("eager", "sdpa"), ("static", "sdpa"),
                                         ("static", "split"))}
    with capsys.disabled():
        print("\nQwen3-4B bf16 kernels per layer: "
              + ", ".join(f"{k} {v:.1f}" for k, v in per_layer.items()))
    assert per_layer["static (split)"] <= LIMIT and per_layer["static (sdpa)"] <= LIMIT
    assert per_layer["eager (sdpa)"] > 2 * LIMIT  # the model's own modules, for comparison


def test_count_kernels_counts_fused_calls_once_and_views_never():
    x, w = torch.randn(4, 8, device="meta"), torch.ones(8, device="meta")
    counts = count_kernels(lambda: (F.rms_norm(x.t().t(), (8,), w, 1e-6) + 1, x[:0].sum(1)))
    assert counts == {"rms_norm": 1, "aten.add": 1}  # the empty sum launches nothing


def test_compiled_step_is_one_graph_per_bucket(monkeypatch, request):
    monkeypatch.setattr(attention, "MIN_CHUNK", 8)  # several chunks even in these short spans
    monkeypatch.setattr(attention.os, "cpu_count", lambda: 16)
    splits.cache_clear()
    request.addfinalizer(splits.cache_clear)
    assert splits(32, 2, torch.device("cpu")) == 4
    model = tiny_model("qwen3")
    ids = torch.randint(0, 512, (1, 21), generator=torch.Generator().manual_seed(1))
    want = kvlib.generate(model, ids, 24, max_seq=64, step="static", bucket=16).tokens
    torch.compiler.reset()
    counters.clear()
    cache = KVCache.for_model(model.config, 64, device="cpu", dtype=model.dtype)
    step = StaticStep(model, cache, bucket=16, capture=False, compile="aot_eager")
    assert kvlib.generate(model, ids, 24, step=step).tokens == want  # fullgraph: no break
    assert counters["stats"]["unique_graphs"] == 2  # positions 21..44: spans 32 and 48


@pytest.mark.parametrize("P", [0, 3, 5, 7])
def test_split_kv_refuses_a_split_that_does_not_divide_the_span(P):
    q, keys = torch.randn(2, 3, 16), torch.randn(1, 2, 64, 16)
    with pytest.raises(ValueError, match=f"P={P} does not divide the 64 slots"):
        split_kv(q, keys, keys, torch.zeros(64), 0.25, P)


def test_the_torch_floor_has_what_split_kv_calls():
    """``torch.bmm(..., out_dtype=)`` (split-KV's fp32 scores in one kernel) came in torch 2.8:
    requirements.txt and pyproject.toml must not accept an older torch."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    floors = {tuple(int(x) for x in re.search(r"torch>=(\d+)\.(\d+)", (root / f).read_text())
                    .groups()) for f in ("requirements.txt", "pyproject.toml")}
    assert floors == {(2, 8)}, floors
    a = torch.ones(1, 2, 2, dtype=torch.bfloat16, device="meta")
    assert torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
