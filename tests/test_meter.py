"""The meter must count what the arithmetic says, on CPU and on ``meta``."""

import pytest
import torch

from kvlib.meter import AllocMeter, MeteredCache

DEVICES = ["cpu", "meta"]


def metered(fn):
    with AllocMeter() as m:
        fn()
    return m


@pytest.mark.parametrize("device", DEVICES)
def test_cat_counts_exactly_the_result(device):
    a = torch.zeros(3, 4, 5, dtype=torch.float16, device=device)
    b = torch.zeros(2, 4, 5, dtype=torch.float16, device=device)
    m = metered(lambda: torch.cat([a, b]))
    assert m.total == (a.numel() + b.numel()) * 2
    assert m.count == 1
    assert m.by_op == {"aten.cat.default": m.total}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "op",
    [
        lambda x, y: x[2:5],
        lambda x, y: x.permute(1, 0, 2),
        lambda x, y: x.view(-1),
        lambda x, y: x.copy_(x),
        lambda x, y: x[1:3].copy_(y),
        lambda x, y: x.__setitem__(slice(1, 3), y),
        lambda x, y: torch.unbind(x),
    ],
    ids=["slice", "permute", "view", "copy_", "slice-copy_", "setitem", "unbind"],
)
def test_views_and_in_place_writes_count_zero(device, op):
    x = torch.zeros(6, 4, 5, device=device)
    y = torch.ones(2, 4, 5, device=device)
    m = metered(lambda: op(x, y))
    assert (m.total, m.count) == (0, 0), dict(m.by_op)


@pytest.mark.parametrize("device", DEVICES)
def test_factories_and_new_results_are_counted(device):
    m = metered(lambda: (
        torch.empty(7, 3, dtype=torch.int64, device=device),
        torch.ones(5, device=device) * 2,
    ))
    assert m.by_op["aten.empty.memory_format"] == 7 * 3 * 8
    assert m.by_op["aten.mul.Tensor"] == 5 * 4
    assert m.total == 7 * 3 * 8 + 5 * 4 + m.by_op["aten.ones.default"]


def test_an_out_of_place_op_on_a_view_counts_its_result_not_the_base():
    x = torch.zeros(100, 10)
    m = metered(lambda: x[:2] + 1)
    assert m.total == 2 * 10 * 4


def test_two_outputs_on_one_new_storage_count_once():
    x = torch.zeros(4, 6)
    # aten.split of a fresh tensor: the pieces share the clone's storage
    m = metered(lambda: torch.split(x.clone(), 2))
    assert m.total == x.numel() * 4 and m.count == 1


def test_regions_and_steps():
    m = AllocMeter()
    with m:
        torch.zeros(10)  # 40 B outside any region
        with m.region("cache"):
            torch.zeros(5)  # 20 B
        assert m.mark() == 60
        assert m.mark() == 0
        with m.region("cache"):
            torch.zeros(3, dtype=torch.float64)
        assert m.mark() == 24
    assert m.steps == [60, 0, 24]
    assert m.step_regions == [{"other": 40, "cache": 20}, {}, {"cache": 24}]
    assert m.by_region == {"other": 40, "cache": 44}
    assert m.total == sum(m.steps)


@pytest.mark.parametrize("device", DEVICES)
def test_cat_cache_loop_grows_linearly(device):
    # a `cat` cache: step t allocates the whole t+1-token cache again
    layers, heads, hd, elt = 2, 3, 4, 2
    per_token = 2 * layers * heads * hd * elt  # K and V, all layers
    k = [torch.zeros(1, heads, hd, dtype=torch.float16, device=device) for _ in range(layers)]
    v = [t.clone() for t in k]
    new = torch.zeros(1, heads, hd, dtype=torch.float16, device=device)
    with AllocMeter() as m:
        for _ in range(5):
            for i in range(layers):
                k[i] = torch.cat([k[i], new])
                v[i] = torch.cat([v[i], new])
            m.mark()
    assert m.steps == [per_token * (t + 2) for t in range(5)]


class FakeCache:
    """The cache interface MeteredCache relies on, one allocating op in write."""

    def __init__(self):
        self.k = torch.zeros(4, 8)
        self.seq_len = 0
        self.max_seq = 8

    def write(self, layer, start, k, v):
        self.k[layer, start : start + k.shape[0]] = k  # in place: 0 bytes
        self.last = k * 1  # one new [n] float32 tensor

    def view(self, layer, seq):
        return self.k[layer, :seq], self.k[layer, :seq]

    def reset(self):
        self.seq_len = 0


def test_metered_cache_forwards_and_attributes_to_cache():
    inner = FakeCache()
    meter = AllocMeter()
    cache = MeteredCache(inner, meter)
    cache.seq_len = 3
    assert inner.seq_len == 3 and cache.seq_len == 3
    assert cache.max_seq == 8 and cache.k is inner.k
    k_new = torch.ones(2)
    with meter:
        cache.write(1, 0, k_new, None)
        kv = cache.view(1, 2)
        torch.zeros(6)
        meter.mark()
    assert kv[0].tolist() == [1.0, 1.0]
    assert meter.step_regions == [{"cache": 8, "other": 24}]
    cache.reset()
    assert inner.seq_len == 0
    assert "FakeCache" in repr(cache)


def test_meter_is_idle_outside_with():
    m = AllocMeter()
    torch.zeros(100)
    assert m.total == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_meter_agrees_with_the_cuda_allocator_for_a_cat():
    a = torch.zeros(1024, 1024, device="cuda")  # 4 MiB each: multiples of 512 B, no rounding
    b = torch.zeros(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with AllocMeter() as m:
        c = torch.cat([a, b])
    assert m.total == torch.cuda.memory_allocated() - before == c.numel() * 4


def test_fill_writes_zeros_from_seq_len_to_upto_in_the_layers_asked():
    from kvlib import KVCache
    from kvlib.meter import fill

    cache = KVCache(2, 8, 1, 2, device="cpu", dtype=torch.float32)
    cache.k.fill_(7)
    cache.seq_len = 2
    fill(cache, 5)
    k = [cache.view(layer, 8)[0][0, 0, :, 0].tolist() for layer in range(2)]  # [1, H, 8, D]
    assert cache.seq_len == 5 and k[0] == k[1] == [7, 7, 0, 0, 0, 7, 7, 7]
    fill(cache, 6, layers=1)
    assert cache.seq_len == 6 and cache.view(0, 8)[0][0, 0, 5, 0] == 0
    assert cache.view(1, 8)[0][0, 0, 5, 0] == 7  # layer 1 not asked for
