"""CatCache: the baseline that grows by ``torch.cat``, and costs exactly what arithmetic says."""

import re

import pytest
import torch

from kvlib import CatCache, KVCache
from kvlib.config import load_config
from kvlib.meter import AllocMeter

L, H, D = 2, 3, 4
F32 = 4


def make(**kw):
    return CatCache(L, H, D, **(dict(device="cpu", dtype=torch.float32) | kw))


def kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g) + 1, torch.randn(n, H, D, generator=g) - 1


def as_attn(t):  # [n, H, D] -> [1, H, n, D], what view returns
    return t.permute(1, 0, 2).unsqueeze(0)


def test_empty_cache():
    c = make()
    assert c.max_seq is None and c.seq_len == 0 and c.nbytes == 0
    assert c.dtype == torch.float32 and c.device == torch.device("cpu")
    assert c.bytes_per_token == 2 * L * H * D * F32
    k, v = c.view(1, 0)
    assert k.shape == v.shape == (1, H, 0, D)


def test_writes_append_and_view_returns_the_contents():
    c = make()
    k1, v1 = kv(3, seed=1)
    k2, v2 = kv(2, seed=2)
    c.write(0, 0, k1, v1)
    c.write(0, 3, k2, v2)
    k, v = c.view(0, 5)
    assert k.shape == v.shape == (1, H, 5, D)
    assert torch.equal(k, as_attn(torch.cat([k1, k2])))
    assert torch.equal(v, as_attn(torch.cat([v1, v2])))
    k, v = c.view(0, 4)  # a prefix
    assert torch.equal(k, as_attn(torch.cat([k1, k2]))[:, :, :4])
    assert c.view(1, 0)[0].shape[2] == 0  # the other layer is untouched
    assert c.seq_len == 0  # the caller owns seq_len


def test_same_contents_as_kvcache():
    cat, pre = make(), KVCache(L, 8, H, D, device="cpu", dtype=torch.float32)
    for start, n in [(0, 5), (5, 1), (6, 2)]:
        for layer in range(L):
            k, v = kv(n, seed=10 * start + layer)
            cat.write(layer, start, k, v)
            pre.write(layer, start, k, v)
    for layer in range(L):
        for a, b in zip(cat.view(layer, 8), pre.view(layer, 8)):
            assert torch.equal(a, b)


def test_each_write_allocates_the_whole_new_cache():
    c = make()
    k0, v0 = kv(5)
    with AllocMeter() as m:
        c.write(0, 0, k0, v0)
    assert m.by_op == {"aten.cat.default": 2 * 5 * H * D * F32}
    t = 5
    for step in range(6):
        n = 1 if step % 2 else 2
        k, v = kv(n, seed=step)
        with AllocMeter() as m:
            c.write(0, t, k, v)
        per_tensor = (t + n) * H * D * F32  # K and V: a new [1, H, t+n, D] each
        assert m.count == 2
        assert m.by_op == {"aten.cat.default": 2 * per_tensor}, (t, n, m.by_op)
        assert m.total == 2 * per_tensor
        t += n
        assert c.view(0, t)[0].shape[2] == t


def test_views_allocate_nothing():
    c = make()
    c.write(0, 0, *kv(4))
    c.write(1, 0, *kv(4, seed=1))
    with AllocMeter() as m:
        for layer in range(L):
            c.view(layer, 4)
            c.view(layer, 2)
    assert m.total == 0 and m.count == 0


def test_write_past_the_end_is_refused_and_writes_nothing():
    c = make()
    c.write(0, 0, *kv(3))
    before = [t.clone() for t in c.view(0, 3)]
    k, v = kv(1, seed=5)
    with pytest.raises(ValueError, match=re.escape(
            "CatCache can only append: writing at slot 5, layer 0 holds 3")):
        c.write(0, 5, k, v)
    with pytest.raises(ValueError, match=re.escape(
            "CatCache can only append: writing at slot 1, layer 1 holds 0")):
        c.write(1, 1, k, v)
    assert c.k[0].shape[2] == 3 and c.k[1].shape[2] == 0
    for a, b in zip(before, c.view(0, 3)):
        assert torch.equal(a, b)


def test_write_before_the_end_crops_then_appends():
    c = make()
    k5, v5 = kv(5, seed=1)
    c.write(0, 0, k5, v5)
    k, v = kv(1, seed=2)
    c.write(0, 2, k, v)  # as DynamicCache.crop(2) then append
    assert c.k[0].shape[2] == c.v[0].shape[2] == 3
    kk, vv = c.view(0, 3)
    assert torch.equal(kk, as_attn(torch.cat([k5[:2], k])))
    assert torch.equal(vv, as_attn(torch.cat([v5[:2], v])))
    with pytest.raises(ValueError, match="view of 4 slots from a layer holding 3"):
        c.view(0, 4)


def test_nbytes_grows_with_what_is_held():
    c = make()
    per_slot = H * D * F32
    c.write(0, 0, *kv(4))
    assert c.nbytes == 2 * 4 * per_slot
    c.write(1, 0, *kv(4))
    assert c.nbytes == 2 * 8 * per_slot
    c.write(1, 4, *kv(1))
    assert c.nbytes == 2 * 9 * per_slot
    assert c.mib == c.nbytes / 2**20
    assert c.nbytes == 9 * c.bytes_per_token // L


def test_reset_drops_the_tensors():
    c = make()
    c.write(0, 0, *kv(4))
    c.write(1, 0, *kv(4))
    c.seq_len = 4
    old = c.k[0]
    c.reset()
    assert c.seq_len == 0 and c.nbytes == 0
    assert all(t.shape == (1, H, 0, D) for t in c.k + c.v)
    assert all(t is not old for t in c.k)
    c.write(0, 0, *kv(2, seed=7))  # and it is usable again
    assert c.view(0, 2)[0].shape == (1, H, 2, D)


def test_refusals_share_kvcache_words():
    c = make()
    k, v = kv(2)
    with pytest.raises(IndexError, match=re.escape(f"layer {L} out of range for n_layers={L}")):
        c.write(L, 0, k, v)
    with pytest.raises(IndexError, match=re.escape(f"layer -1 out of range for n_layers={L}")):
        c.view(-1, 0)
    with pytest.raises(IndexError, match="negative start -1"):
        c.write(0, -1, k, v)
    with pytest.raises(ValueError,
                       match=re.escape(f"k has shape (2, 2, 4), expected [n, {H}, {D}]")):
        c.write(0, 0, torch.ones(2, 2, 4), v)
    with pytest.raises(ValueError, match=re.escape(
            "k is torch.float16 on cpu, cache is torch.float32 on cpu")):
        c.write(0, 0, k.half(), v)
    with pytest.raises(ValueError, match=re.escape(
            "v is torch.float32 on meta, cache is torch.float32 on cpu")):
        c.write(0, 0, k, v.to("meta"))
    with pytest.raises(ValueError, match=re.escape("k (2, 3, 4) and v (1, 3, 4) disagree")):
        c.write(0, 0, k, v[:1])
    with pytest.raises(ValueError, match=re.escape("bad shape: layers=0 kv_heads=3 head_dim=4")):
        CatCache(0, H, D, device="cpu")
    assert c.nbytes == 0  # none of it wrote anything


def test_for_model_and_repr():
    c = CatCache.for_model(load_config("qwen3-4b"), device="cpu")
    assert (c.n_layers, c.n_kv_heads, c.head_dim) == (36, 8, 128)
    assert c.dtype == torch.bfloat16 and c.bytes_per_token == 144 * 1024
    r = repr(c)
    assert "\n" not in r
    for part in ("layers=36", "kv_heads=8", "head_dim=128", "torch.bfloat16", "0.0 MiB",
                 "seq_len=0"):
        assert part in r, (part, r)


def test_default_device_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert CatCache(1, 1, 2).device == torch.device("cpu")
