"""KVCache: in-place writes into fixed storage, free views, exact accounting, checked refusals.

Every test runs on both storage layouts: the layout may change strides, never results.
"""

import re

import pytest
import torch
from transformers import LlamaConfig

from kvlib import KVCache
from kvlib.config import load_config
from kvlib.meter import AllocMeter

L, S, H, D = 3, 16, 2, 4  # layers, max_seq, kv heads, head_dim
F32 = 4

pytestmark = pytest.mark.parametrize("layout", ["head", "seq"])


def make(layout, **kw):
    kw = dict(device="cpu", dtype=torch.float32, layout=layout) | kw
    return KVCache(L, S, H, D, **kw)


def kv(n, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, D, generator=g) + 1  # +1: never zero, so a stray write shows
    v = torch.randn(n, H, D, generator=g) - 1
    return k.to(dtype=dtype, device=device), v.to(dtype=dtype, device=device)


def snapshot(cache):
    return cache.k.clone(), cache.v.clone(), cache.seq_len


def assert_unchanged(cache, snap):
    k, v, seq_len = snap
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v), "a refused write wrote something"
    assert cache.seq_len == seq_len


def base_ptr(t):
    return t.untyped_storage().data_ptr()


# --- shape and layout -------------------------------------------------------------------------


def test_logical_shape_and_storage_order(layout):
    c = make(layout)
    assert c.layout == layout
    assert c.k.shape == c.v.shape == (L, S, H, D)
    assert c.dtype == torch.float32 and c.device == torch.device("cpu")
    assert c.seq_len == 0
    assert not c.k.any() and not c.v.any()  # zeros, not garbage
    # the bytes really sit in the order the layout names
    stored_k = c.k.transpose(1, 2) if layout == "head" else c.k
    stored_v = c.v.transpose(1, 2) if layout == "head" else c.v
    assert stored_k.is_contiguous() and stored_v.is_contiguous()
    assert c.k.untyped_storage().nbytes() == L * S * H * D * F32
    assert base_ptr(c.k) != base_ptr(c.v)


def test_defaults_are_the_seeds(layout):
    c = KVCache(L, S, H, D, device="cpu")  # layout and dtype not given
    assert c.layout == "head"
    assert c.dtype == torch.bfloat16


# --- writes -------------------------------------------------------------------------------------


def test_write_lands_in_exactly_the_slots_asked(layout):
    c = make(layout)
    k, v = kv(3)
    c.write(1, 5, k, v)
    assert torch.equal(c.k[1, 5:8], k) and torch.equal(c.v[1, 5:8], v)
    written = torch.zeros(L, S, dtype=torch.bool)
    written[1, 5:8] = True
    assert not c.k[~written].any(), "K written outside layer 1, slots 5..8"
    assert not c.v[~written].any(), "V written outside layer 1, slots 5..8"
    assert c.seq_len == 0  # the caller owns seq_len


def test_writes_to_every_layer_and_the_last_slot(layout):
    c = make(layout)
    for layer in range(L):
        k, v = kv(S, seed=layer)
        c.write(layer, 0, k[: S - 1], v[: S - 1])
        c.write(layer, S - 1, k[S - 1 :], v[S - 1 :])  # the very last slot is allowed
        assert torch.equal(c.k[layer], k) and torch.equal(c.v[layer], v)


def test_a_rewrite_overwrites(layout):
    c = make(layout)
    c.write(0, 0, *kv(4, seed=1))
    k, v = kv(2, seed=2)
    c.write(0, 1, k, v)
    k1, v1 = kv(4, seed=1)
    assert torch.equal(c.k[0, 0], k1[0]) and torch.equal(c.k[0, 3], k1[3])
    assert torch.equal(c.k[0, 1:3], k)
    assert torch.equal(c.v[0, 1:3], v)


def test_write_takes_non_contiguous_inputs(layout):
    c = make(layout)
    k, v = kv(3)
    kt = k.transpose(0, 1).contiguous().transpose(0, 1)  # same values, strided
    assert not kt.is_contiguous()
    c.write(2, 4, kt, v)
    assert torch.equal(c.k[2, 4:7], k)


# --- views --------------------------------------------------------------------------------------


def test_view_shape_and_contents(layout):
    c = make(layout)
    k, v = kv(5)
    c.write(2, 0, k, v)
    kk, vv = c.view(2, 5)
    assert kk.shape == vv.shape == (1, H, 5, D)
    assert torch.equal(kk[0], k.permute(1, 0, 2)) and torch.equal(vv[0], v.permute(1, 0, 2))
    assert c.view(0, 0)[0].shape == (1, H, 0, D)
    assert c.view(0, S)[0].shape == (1, H, S, D)


@pytest.mark.parametrize("layer", [0, 1, L - 1])
def test_view_shares_storage_at_the_layers_slot_0(layout, layer):
    c = make(layout)
    kk, vv = c.view(layer, 7)
    assert base_ptr(kk) == base_ptr(c.k) and base_ptr(vv) == base_ptr(c.v)
    # the layer's block starts S*H*D elements per layer in, whichever the layout
    assert kk.data_ptr() == base_ptr(c.k) + layer * S * H * D * F32
    assert vv.data_ptr() == base_ptr(c.v) + layer * S * H * D * F32
    assert kk.data_ptr() == c.k[layer, 0, 0, 0].data_ptr()
    if layout == "head":  # each head's [seq, D] block contiguous
        assert kk.stride()[1:] == (S * D, D, 1) and vv.stride()[1:] == (S * D, D, 1)
    else:  # logical order: keys H*D apart
        assert kk.stride()[1:] == (D, H * D, 1) and vv.stride()[1:] == (D, H * D, 1)
    # and a write after the view is seen through it: no copy was taken
    k, v = kv(1, seed=3)
    c.write(layer, 6, k, v)
    assert torch.equal(kk[0, :, 6], k[0]) and torch.equal(vv[0, :, 6], v[0])


def test_write_and_view_allocate_nothing(layout):
    c = make(layout)
    k, v = kv(4)
    k1, v1 = kv(1, seed=1)
    with AllocMeter() as m:
        c.write(0, 0, k, v)
        c.write(2, 4, k1, v1)
        for layer in range(L):
            c.view(layer, 5)
    assert m.total == 0 and m.count == 0, dict(m.by_op)


def test_reset_frees_and_zeroes_nothing(layout):
    c = make(layout)
    k, v = kv(4)
    c.write(1, 0, k, v)
    c.seq_len = 4
    kp, vp = c.k.data_ptr(), c.v.data_ptr()
    with AllocMeter() as m:
        c.reset()
    assert m.total == 0
    assert c.seq_len == 0
    assert (c.k.data_ptr(), c.v.data_ptr()) == (kp, vp)
    assert torch.equal(c.k[1, :4], k) and torch.equal(c.v[1, :4], v)  # not zeroed
    assert c.view(1, 4)[0].data_ptr() == kp + 1 * S * H * D * F32


# --- accounting -----------------------------------------------------------------------------


def test_accounting_exact(layout):
    c = make(layout)
    assert c.nbytes == 2 * L * S * H * D * F32 == 3072
    assert c.mib == 3072 / 2**20
    assert c.bytes_per_token == 2 * L * H * D * F32 == 192
    assert c.nbytes == c.bytes_per_token * S
    assert c.nbytes == c.k.untyped_storage().nbytes() + c.v.untyped_storage().nbytes()


def test_accounting_and_repr_at_qwen3_4b_scale(layout):
    # Qwen3-4B: 36 layers, 8 KV heads, head_dim 128, bf16: 144 KiB a token. On `meta`: no memory.
    c = KVCache(36, 1024, 8, 128, device="meta", layout=layout)
    assert c.dtype == torch.bfloat16
    assert c.bytes_per_token == 147456 == 144 * 1024
    assert c.nbytes == 150994944 == 144 * 2**20
    assert c.mib == 144.0
    c.seq_len = 7
    r = repr(c)
    assert "\n" not in r and r.startswith("KVCache(")
    for part in ("layers=36", "max_seq=1024", "kv_heads=8", "head_dim=128", "torch.bfloat16",
                 f"layout={layout}", "144.0 MiB", "144 KiB/token", "seq_len=7"):
        assert part in r, (part, r)


def test_default_device_is_cpu_without_cuda(layout, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    c = KVCache(1, 4, 1, 2, layout=layout)
    assert c.device == torch.device("cpu") and c.k.device.type == "cpu"


# --- for_model ------------------------------------------------------------------------------


def test_for_model_sizes_from_a_config(layout):
    config = load_config("qwen3-4b")  # head_dim 128 is set, and is not hidden/heads
    c = KVCache.for_model(config, 512, device="meta", layout=layout)
    assert (c.n_layers, c.max_seq, c.n_kv_heads, c.head_dim) == (36, 512, 8, 128)
    assert c.k.shape == (36, 512, 8, 128)
    assert c.dtype == torch.bfloat16 and c.layout == layout
    assert c.bytes_per_token == 144 * 1024

    small = load_config("smollm2-135m")
    c = KVCache.for_model(small, 64, device="cpu", dtype=torch.float32, layout=layout)
    assert c.k.shape == (30, 64, 3, 64) and c.dtype == torch.float32
    assert c.bytes_per_token == 2 * 30 * 3 * 64 * 4


def test_for_model_without_head_dim_uses_hidden_over_heads(layout):
    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                         num_hidden_layers=2)
    config.head_dim = None
    c = KVCache.for_model(config, 8, device="cpu", layout=layout)
    assert c.k.shape == (2, 8, 2, 16)


# --- refusals: each with its words, and nothing written -------------------------------------


def refused(c, exc, match, fn):
    c.write(0, 0, *kv(2, seed=9))  # something in the cache, so a change is visible
    c.seq_len = 2
    snap = snapshot(c)
    with pytest.raises(exc, match=match):
        fn()
    assert_unchanged(c, snap)


def test_overflow(layout):
    c = make(layout)
    k, v = kv(10)
    refused(c, ValueError, re.escape("KV overflow: writing slots 10..20 into max_seq=16"),
            lambda: c.write(1, 10, k, v))
    refused(c, ValueError, re.escape("KV overflow: writing slots 16..17 into max_seq=16"),
            lambda: c.write(0, 16, k[:1], v[:1]))


@pytest.mark.parametrize(
    "k_shape, v_shape, msg",
    [
        ((3, 3, D), (3, H, D),
         "k has shape (3, 3, 4), expected [n, 2, 4] (n new tokens, n_kv_heads, head_dim)"),
        ((3, H, 5), (3, H, D), "k has shape (3, 2, 5), expected [n, 2, 4]"),
        ((3, H, D), (3, H, 8), "v has shape (3, 2, 8), expected [n, 2, 4]"),
        ((H, D), (H, D), "k has shape (2, 4), expected [n, 2, 4]"),
        ((1, 3, H, D), (1, 3, H, D), "k has shape (1, 3, 2, 4), expected [n, 2, 4]"),
    ],
)
def test_wrong_shape(layout, k_shape, v_shape, msg):
    c = make(layout)
    k, v = torch.ones(k_shape), torch.ones(v_shape)
    refused(c, ValueError, re.escape(msg), lambda: c.write(0, 3, k, v))


def test_k_and_v_disagree(layout):
    c = make(layout)
    k, _ = kv(3)
    _, v = kv(2)
    refused(c, ValueError, re.escape("k (3, 2, 4) and v (2, 2, 4) disagree"), lambda: c.write(0, 2,
                                                                                              k, v))


def test_wrong_dtype(layout):
    c = make(layout)
    k, v = kv(2)
    refused(c, ValueError, re.escape("k is torch.float16 on cpu, cache is torch.float32 on cpu"),
            lambda: c.write(0, 2, k.half(), v))
    refused(c, ValueError, re.escape("v is torch.bfloat16 on cpu, cache is torch.float32 on cpu"),
            lambda: c.write(0, 2, k, v.bfloat16()))


def test_wrong_device(layout):
    c = make(layout)
    k, v = kv(2)
    km, vm = k.to("meta"), v.to("meta")
    refused(c, ValueError, re.escape("k is torch.float32 on meta, cache is torch.float32 on cpu"),
            lambda: c.write(0, 2, km, v))
    refused(c, ValueError, re.escape("v is torch.float32 on meta, cache is torch.float32 on cpu"),
            lambda: c.write(0, 2, k, vm))


@pytest.mark.parametrize("layer", [L, L + 5, -1])
def test_layer_out_of_range(layout, layer):
    c = make(layout)
    k, v = kv(2)
    msg = re.escape(f"layer {layer} out of range for n_layers={L}")
    refused(c, IndexError, msg, lambda: c.write(layer, 2, k, v))
    with pytest.raises(IndexError, match=msg):
        c.view(layer, 2)


def test_negative_start(layout):
    c = make(layout)
    k, v = kv(2)
    refused(c, IndexError, re.escape("negative start -1"), lambda: c.write(0, -1, k, v))
    refused(c, IndexError, re.escape("negative start -3"), lambda: c.write(0, -3, k, v))


@pytest.mark.parametrize("seq", [S + 1, 100, -1])
def test_view_longer_than_max_seq(layout, seq):
    c = make(layout)
    with pytest.raises(ValueError,
                       match=re.escape(f"view of {seq} slots from a cache of max_seq={S}")):
        c.view(0, seq)


@pytest.mark.parametrize(
    "shape, msg",
    [
        ((0, 16, 2, 4), "bad shape: layers=0 max_seq=16 kv_heads=2 head_dim=4"),
        ((2, 0, 2, 4), "bad shape: layers=2 max_seq=0 kv_heads=2 head_dim=4"),
        ((2, 16, -1, 4), "bad shape: layers=2 max_seq=16 kv_heads=-1 head_dim=4"),
        ((2, 16, 2, 0), "bad shape: layers=2 max_seq=16 kv_heads=2 head_dim=0"),
    ],
)
def test_bad_constructor_shape(layout, shape, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        KVCache(*shape, device="cpu", layout=layout)


def test_bad_layout(layout):
    bad = layout + "-major"
    with pytest.raises(ValueError,
                       match=re.escape(f"layout {bad!r} is not one of ('head', 'seq')")):
        KVCache(L, S, H, D, device="cpu", layout=bad)
