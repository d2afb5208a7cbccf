"""kvlib's CUDA-only code, run on the CPU through torch's own Python layer.

Only what lies under that layer is faked (:class:`FakeDriver`): the ``torch._C._cuda_*`` calls,
``cudaMemGetInfo``, the device properties, and, because a CPU build of torch has no CUDA stream,
event or graph classes at all (their C bases are dummies), ``torch.cuda.Stream``, ``Event`` and
``CUDAGraph``. Everything between kvlib and those calls is the real ``torch.cuda``: its argument
checks (a device without an index, a fraction that is not a float), its lazy initialisation guards,
its stream context managers, ``torch.cuda.graph``. So an argument torch would refuse on a GPU is
refused here too, in CI.

The fake graph records the aten ops of the captured call and replays exactly those ops on the same
tensors, so a step that keeps a host value (a Python int, a ``.item()``) in what it captures gives
wrong tokens here, as it would on a GPU; a host sync during capture raises, as CUDA does, and so
does a tensor made from host data (a list index), which CUDA would copy from unpinned memory.

Run on a real GPU too (the GPU check does): then it checks kvlib against that machine's torch.
"""

import contextlib
import pickle
import types

import pytest
import torch
import torch.utils._pytree as pytree
from helpers import SHARED, tiny_model
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

# Imported before a test fakes a card: these look for CUDA as they import (torch._dynamo does).
from transformers.models.llama import modeling_llama  # noqa: F401
from transformers.models.qwen3 import modeling_qwen3  # noqa: F401

import kvlib
from course import bench, memory_trace
from kvlib import env, graphs, loop, memory, timing
from kvlib.kv_cache import KVCache

GIB, MIB = 2**30, 2**20
SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}


class FakeDriver:
    """Two cards (the current one is 1, so an index silently defaulted to 0 shows), an allocator
    with numbers the test sets, an event clock the test advances, and stream / graph bookkeeping."""

    def __init__(self, capability=(9, 0), total=80 * GIB, count=2, current=1):
        self.capability, self.total, self.count, self.current = capability, total, count, current
        self.fraction = {i: 1.0 for i in range(count)}
        self.allocated, self.cached, self.pools = 0, 0, 0  # bytes, on the current card
        self.peak_allocated = self.peak_reserved = 0
        self.used_outside = 600 * MIB  # the CUDA context and anything not ours
        self.clock_ms, self.synced_at = 0.0, 0.0
        self.stream_ids = iter(range(100, 10**6))
        self.current_stream = {i: 0 for i in range(count)}  # 0: the default stream
        self.config, self.expandable, self.history = "", None, []
        self.calls: list[tuple] = []

    # -- what torch._C and torch.cuda's module globals would reach -----------------------------
    def index(self, i, name):
        assert isinstance(i, int) and 0 <= i < self.count, f"{name} got device {i!r}"
        self.calls.append((name, i))
        return i

    @property
    def reserved(self):
        return self.allocated + self.cached + self.pools

    def mem_get_info(self, i):
        self.index(i, "cudaMemGetInfo")
        return self.total - self.used_outside - self.reserved, self.total

    def memory_stats(self, i):
        self.index(i, "memoryStats")
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        allocated = {"current": self.allocated, "peak": self.peak_allocated}
        reserved = {"current": self.reserved, "peak": self.peak_reserved}
        return {"allocated_bytes": {"all": allocated}, "reserved_bytes": {"all": reserved}}

    def reset_peak(self, i):
        self.index(i, "resetPeakMemoryStats")
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def set_fraction(self, fraction, i):
        assert isinstance(fraction, float) and 0 <= fraction <= 1, fraction
        self.fraction[self.index(i, "setMemoryFraction")] = fraction

    def properties(self, i):
        self.index(i, "getDeviceProperties")
        major, minor = self.capability
        return types.SimpleNamespace(name=f"Fake GPU sm{major}{minor}", major=major, minor=minor,
                                     total_memory=self.total, multi_processor_count=132)

    def snapshot(self, *_):
        segments = [] if self.expandable is None else [
            {"device": self.current, "is_expandable": self.expandable, "total_size": self.reserved}]
        return {"segments": segments, "device_traces": [list(self.history)]}

    def set_stream(self, stream_id, device_index, device_type):
        self.current_stream[self.index(device_index, "setStream")] = stream_id

    def install(self, mp):
        C = torch._C
        stubs = {
            "_cuda_getDeviceCount": lambda: self.count, "_cuda_getDevice": lambda: self.current,
            "_cuda_setMemoryFraction": self.set_fraction,
            "_cuda_getMemoryFraction": lambda i: self.fraction[self.index(i, "getMemoryFraction")],
            "_cuda_memoryStats": self.memory_stats, "_cuda_resetPeakMemoryStats": self.reset_peak,
            "_cuda_emptyCache": lambda: setattr(self, "cached", 0),
            "_host_emptyCache": lambda: None,
            "_cuda_synchronize": lambda: setattr(self, "synced_at", self.clock_ms),
            "_cuda_getCurrentStream": lambda i: (self.current_stream[i], i, 1),
            "_cuda_getDefaultStream": lambda i: (0, i, 1), "_cuda_setStream": self.set_stream,
            "_cuda_getAllocatorBackend": lambda: "native",
            "_accelerator_getAllocatorSettings": lambda: self.config,
            "_cuda_memorySnapshot": self.snapshot,
            "_cuda_record_memory_history": lambda enabled, *a: self.history.append(enabled),
        }
        for name, fn in stubs.items():
            mp.setattr(C, name, fn, raising=False)
        cuda = torch.cuda
        mp.setattr(cuda, "_initialized", True)  # what torch._C._cuda_init() leaves behind
        mp.setattr(cuda, "_cached_device_count", None)
        mp.setattr(cuda, "_device_count_nvml", lambda: -1)  # on a real card NVML would answer
        mp.setattr(cuda, "default_generators", tuple(torch.Generator() for _ in range(self.count)))
        mp.setattr(cuda, "_cudart", types.SimpleNamespace(cudaMemGetInfo=self.mem_get_info))
        mp.setattr(cuda, "_get_device_properties", self.properties, raising=False)
        mp.setattr(cuda, "_exchange_device", lambda i: self.swap(i))
        mp.setattr(cuda, "_maybe_exchange_device", lambda i: self.swap(i))
        mp.setattr(cuda, "Stream", _stream_class(self))
        mp.setattr(cuda, "Event", _event_class(self))
        mp.setattr(cuda, "CUDAGraph", _graph_class(self))
        mp.setattr(cuda.graph, "default_capture_stream", None)

    def swap(self, i):
        previous = self.current
        if i >= 0:
            self.current = self.index(i, "exchangeDevice")
        return previous


def _stream_class(driver):
    class Stream:
        def __init__(self, device=None, priority=0, stream_id=None, device_index=None,
                     device_type=1):
            index = torch._utils._get_device_index(device, optional=True)
            index = index if device_index is None else device_index
            self.device_index = driver.index(index, "Stream")
            self.stream_id = next(driver.stream_ids) if stream_id is None else stream_id
            self.device_type, self.waited = device_type, []

        @property
        def device(self):
            return torch.device("cuda", self.device_index)

        def wait_stream(self, other):
            self.waited.append(other.stream_id)

        def __eq__(self, other):
            return (self.stream_id, self.device_index) == (other.stream_id, other.device_index)

        __hash__ = None

    return Stream


def _event_class(driver):
    class Event:
        """Reads the driver's clock when recorded; its time is known only after a synchronize."""

        def __init__(self, enable_timing=False, **kwargs):
            self.enable_timing, self.at = enable_timing, None

        def record(self, stream=None):
            self.at = driver.clock_ms

        def elapsed_time(self, end):
            assert self.enable_timing and end.enable_timing, "events made without enable_timing"
            if max(self.at, end.at) > driver.synced_at:
                raise RuntimeError("CUDA error: device not ready")  # cudaErrorNotReady
            return end.at - self.at

    return Event


class _Recorder(TorchDispatchMode):
    def __init__(self, graph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:  # the host cannot wait for a stream that is capturing
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing "
                               f"({func})")
        if func is torch.ops.aten.lift_fresh.default:  # a tensor made from host data (a list
            # index, torch.tensor(...)): on a GPU, a copy from unpinned host memory, refused
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture "
                               "unless the CPU tensor is pinned")
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


def _fresh(out, args) -> list[torch.Tensor]:
    """Outputs with storage of their own: not views of, or in-place on, an input."""
    inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(args)
              if isinstance(t, torch.Tensor)}
    return [t if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
            else None for t in pytree.tree_leaves(out)]


def _graph_class(driver):
    class CUDAGraph:
        """Records the captured call's ops; ``replay`` runs exactly those on the same tensors,
        writing each new result into the tensor the capture produced."""

        def __init__(self, *args, **kwargs):
            self.ops, self.pool_bytes, self.recorder = [], 0, None

        def capture_begin(self, *pool, **kwargs):
            self.stream = driver.current_stream[driver.current]
            assert self.stream != 0, "capture on the default stream"
            driver.capturing, self.recorder = self, _Recorder(self)
            self.recorder.__enter__()

        def capture_end(self):
            self.recorder.__exit__(None, None, None)
            driver.capturing = None
            self.pool_bytes = sum(t.nbytes for func, args, kw, out in self.ops
                                  for t in _fresh(out, (args, kw)) if t is not None)
            driver.pools += self.pool_bytes  # the graph's private pool, reserved while it lives

        def replay(self):
            driver.calls.append(("replay", driver.current))
            for func, args, kwargs, out in self.ops:
                new = pytree.tree_leaves(func(*args, **kwargs))
                for old, value in zip(_fresh(out, (args, kwargs)), new, strict=True):
                    if old is not None:
                        old.copy_(value)

    return CUDAGraph


def _forget_side_streams():
    """A fake stream must not outlive the fake driver, nor a real one be handed to it."""
    if hasattr(graphs, "_side_stream"):
        graphs._side_stream.cache_clear()


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    fake.install(monkeypatch)
    _forget_side_streams()
    yield fake
    _forget_side_streams()


CUDA1 = torch.device("cuda", 1)


# --- device index (a bare "cuda" is the current card, with its index) ---------------------------
def test_default_device_names_its_index(driver):
    assert kvlib.default_device() == CUDA1
    assert env.resolve("cuda") == CUDA1 and env.resolve("cuda:0") == torch.device("cuda", 0)
    assert env.resolve("cpu") == torch.device("cpu")


@pytest.mark.parametrize("device", ["default", "cuda", "cuda:1"])
def test_cap_sets_the_fraction_of_the_current_card(driver, device):
    device = kvlib.default_device() if device == "default" else device
    cap = memory.cap_memory(12, device)
    assert driver.fraction == {0: 1.0, 1: 12 / 80}
    assert cap.active and cap.budget_bytes == 12 * GIB and cap.fraction == 12 / 80
    assert "emulating a 12 GiB card on a 80.0 GiB one" in cap.note
    assert memory.cap_memory(100, device).active is False and driver.fraction[1] == 1.0


def test_allocator_settings_and_label(driver):
    memory.cap_memory(12, "cuda")
    driver.config, driver.allocated = "expandable_segments:True", GIB
    settings = env.allocator_settings("cuda")
    assert settings == {"backend": "native", "config": "expandable_segments:True",
                        "memory_fraction": 12 / 80, "expandable_segments": True}
    driver.expandable = False  # live segments say no: the platform did not honour the option
    assert env.allocator_settings(CUDA1)["expandable_segments"] is False
    cap = memory.cap_memory(12, "cuda")
    line = env.label("cuda", torch.bfloat16, cap)
    assert line.startswith("Fake GPU sm90 · allocator capped at 12 GiB") and "bfloat16" in line
    assert "expandable segments off" in line
    d = env.describe("cuda", torch.bfloat16, cap)
    assert d["device"] == "cuda:1" and d["capability"] == "9.0" and d["allocator"]["backend"]


@pytest.mark.parametrize(("capability", "dtype"), [((7, 5), torch.float16),
                                                    ((8, 0), torch.bfloat16),
                                                    ((9, 0), torch.bfloat16)])
def test_auto_dtype_by_capability(driver, capability, dtype):
    driver.capability = capability
    assert kvlib.auto_dtype("cuda") == dtype and kvlib.auto_dtype(CUDA1) == dtype
    assert ("getDeviceProperties", 1) in driver.calls


# --- memory: stats, timeline, budget, snapshot ------------------------------------------------
def test_memory_stats_and_trace(driver):
    driver.allocated, driver.cached = 3 * GIB, GIB
    trace = memory_trace.MemoryTrace("cuda")
    assert trace.device == CUDA1
    row = trace.record(10)
    assert row == {"tokens": 10, "allocated": 3 * GIB, "reserved": 4 * GIB,
                   "peak_allocated": 3 * GIB, "peak_reserved": 4 * GIB,
                   "device_used": 4 * GIB + 600 * MIB, "outside_allocator": 600 * MIB}
    driver.allocated = GIB
    trace.record(20)
    assert trace.column("peak_allocated") == [3 * GIB, 3 * GIB]  # the high-water mark stays
    trace.reset_peak()
    assert trace.record(30)["peak_allocated"] == GIB
    assert ("resetPeakMemoryStats", 1) in driver.calls and ("memoryStats", 0) not in driver.calls


def test_allocator_budget_is_free_plus_ours_within_the_cap(driver):
    driver.allocated, driver.cached = 8 * GIB, GIB  # the model, and a cached block
    uncapped = memory.allocator_budget("cuda")
    assert uncapped == 80 * GIB - 600 * MIB  # all but what is not ours
    cap = memory.cap_memory(12, "cuda")
    assert memory.allocator_budget("cuda", cap) == 12 * GIB
    driver.used_outside = 75 * GIB  # another process took most of the card: less than the cap
    assert memory.allocator_budget("cuda", cap) == 80 * GIB - 75 * GIB
    assert memory.allocator_budget("cpu") is None


@pytest.mark.parametrize("raises", [False, True])
def test_snapshot_records_then_dumps_even_on_error(driver, tmp_path, raises):
    path = tmp_path / "snap.pickle"
    with pytest.raises(torch.OutOfMemoryError) if raises else contextlib.nullcontext():
        with memory_trace.memory_snapshot(path, max_entries=123) as recording:
            assert recording is True and driver.history == ["all"]
            if raises:
                raise torch.OutOfMemoryError("CUDA out of memory")
    assert driver.history == ["all", None]  # recording switched off again
    assert pickle.loads(path.read_bytes())["device_traces"] == [["all"]]  # dumped while on


# --- timing: events, one synchronize, only when read --------------------------------------------
def test_step_timer_reads_events_after_one_sync(driver):
    timer = timing.StepTimer("cuda")
    assert timer.device == CUDA1
    for ms in (2.5, 4.0):
        timer.start()
        driver.clock_ms += ms  # the GPU works
        timer.stop()
    assert driver.synced_at == 0.0  # nothing waited on the GPU while the loop ran
    assert timer.times_s == [0.0025, 0.004] and driver.synced_at == driver.clock_ms
    t = timing.time_fn(lambda: setattr(driver, "clock_ms", driver.clock_ms + 1.0), device="cuda",
                       warmup=1, repeats=3)
    assert t.samples_s == [0.001] * 3 and t.device == "cuda:1"


# --- graphs: one side stream, memory from an emptied cache, replays that see new inputs ---------
def _graph_step(model, cache, bucket=16):
    """A StaticStep set to capture on the fake card 1 while its tensors stay on the CPU."""
    step = graphs.StaticStep(model, cache, bucket=bucket, capture=False)
    step.capture, step.device = True, CUDA1
    return step


def test_graph_decode_gives_the_static_tokens(driver):
    model = tiny_model("qwen3")
    ids = torch.randint(0, 512, (1, 21), generator=torch.Generator().manual_seed(1))
    want = kvlib.generate(model, ids, 24, max_seq=64, step="static", bucket=16).tokens
    step = _graph_step(model, KVCache.for_model(model.config, 64, device="cpu", dtype=model.dtype))
    driver.cached = 64 * MIB  # blocks cached before the capture: torch.cuda.graph empties them
    got = kvlib.generate(model, ids, 24, step=step).tokens
    assert got == want
    assert sorted(step.graphs) == [32, 48]  # one graph per bucket reached (positions 21..44)
    assert driver.calls.count(("replay", 1)) == 23
    streams = {g.stream for g, _ in step.graphs.values()}
    assert len(streams) == 1 and streams != {0}  # one side stream for every capture
    for span, (graph, _) in step.graphs.items():
        assert step.memory[span] == {"allocated": 0, "reserved": graph.pool_bytes}
        assert graph.pool_bytes > 0


def test_a_host_sync_in_a_captured_step_is_refused(driver):
    buf = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        graphs.capture_graph(lambda: buf + int(buf.sum().item()), "cuda")


def test_capture_reuses_one_stream_and_measures_its_pool(driver):
    x = torch.ones(4)
    g1, out1, mem1 = graphs.capture_graph(lambda: x * 2, "cuda")
    g2, out2, mem2 = graphs.capture_graph(lambda: x + 1, CUDA1)
    assert g1.stream == g2.stream and mem1 == mem2 == {"allocated": 0, "reserved": 16}
    x.fill_(5)
    g1.replay()
    g2.replay()
    assert out1.tolist() == [10.0] * 4 and out2.tolist() == [6.0] * 4


class _HostWaits(TorchDispatchMode):
    """Logs, in order, what makes the host wait for the GPU or copy to it: a sync (``.item()``,
    ``nonzero``) or a tensor made from host data (a list index); the test adds ``.tolist()`` and
    a mark before each decode step."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCS or func is torch.ops.aten.lift_fresh.default:
            self.log.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("step", ["eager", "graph"])
def test_nothing_waits_on_the_host_between_decode_steps(driver, monkeypatch, step):
    model = tiny_model("qwen3")
    ids = torch.randint(0, 512, (1, 21), generator=torch.Generator().manual_seed(1))
    waits, tolist, make = _HostWaits(), torch.Tensor.tolist, loop._decode_step
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: waits.log.append("tolist") or tolist(t))

    def marked(*args):
        decode = make(*args)
        return lambda *a: waits.log.append("step") or decode(*a)

    monkeypatch.setattr(loop, "_decode_step", marked)
    if step == "eager":  # a batch of two, which stop together
        prompts, stepper = [ids, ids[:, :9]], "eager"
    else:
        cache = KVCache.for_model(model.config, 64, device="cpu", dtype=model.dtype)
        prompts, stepper = ids, _graph_step(model, cache)
    with waits:
        kvlib.generate(model, prompts, 10, step=stepper, eos_token_id=None)
    marks = [i for i, e in enumerate(waits.log) if e == "step"]
    assert len(marks) == 9 and set(waits.log[marks[0] : marks[-1] + 1]) == {"step"}, waits.log


@pytest.mark.parametrize("rope", ["dynamic", "longrope"])
def test_static_steps_refuse_rope_that_waits_on_the_host(rope):
    model = tiny_model("llama")
    model.model.rotary_emb.rope_type = rope  # what a checkpoint's rope_parameters would set
    cache = KVCache.for_model(model.config, 32, device="cpu", dtype=model.dtype)
    with pytest.raises(NotImplementedError, match=f"rope_type '{rope}' .* use step='eager'"):
        graphs.StaticStep(model, cache, capture=False)
    with pytest.raises(NotImplementedError, match=rope):
        kvlib.generate(model, torch.tensor([[1, 2, 3]]), 2, step="static")


def test_dynamic_rope_from_the_config_is_refused():
    config = LlamaConfig(**SHARED, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                    "rope_theta": 10000.0})
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = KVCache.for_model(config, 32, device="cpu", dtype=model.dtype)
    with pytest.raises(NotImplementedError, match="'dynamic'"):
        graphs.StaticStep(model, cache, capture=False)
    assert len(kvlib.generate(model, torch.tensor([[1, 2, 3]]), 2).tokens) == 2  # eager runs


# --- the longest context: bisection, and the tries it runs --------------------------------------
def test_largest_bisects_from_the_plan():
    for limit in (0, 1, 7, 500, 999):
        for first in (None, 0, 3, 600, 999, 5000):
            calls = []
            fits = lambda n: calls.append(n) or n <= limit  # noqa: B023, E731
            assert memory.largest(fits, 1000, first) == limit
            assert len(calls) <= 12  # log2(1000) + the plan
            if first is not None and 0 < first < 1000:
                assert calls[0] == first
    assert memory.largest(lambda n: True, 1) == 0  # nothing to try


class _Cap(TorchDispatchMode):
    """A CPU allocator that runs out: OOM once the tensors made in the block that are still alive
    hold more than ``limit`` bytes."""

    def __init__(self, limit):
        super().__init__()
        self.limit, self.live = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
        self.live += [(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
                      for t in _fresh(out, (args, kwargs)) if t is not None]
        used = sum(n for _, n in self.live)
        if used > self.limit:
            raise torch.OutOfMemoryError(f"CPU test cap: {used} > {self.limit} bytes live")
        return out


def test_longest_context_finds_the_limit_of_each_cache(monkeypatch):
    model = tiny_model("qwen3")
    runs = bench._runs

    def capped(model, kind, n, chunk):
        with _Cap(1_000_000):
            return runs(model, kind, n, chunk)

    monkeypatch.setattr(bench, "_runs", capped)
    monkeypatch.setattr(bench, "free", lambda device: None)  # no cache to empty; gc.collect is slow
    held = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    per_token = 2 * 3 * 2 * 16 * 4
    out = bench.longest_context(model, held + 2000 * per_token, chunk=16)
    assert out["budget"] == held + 2000 * per_token and out["chunk"] == 16
    for kind in ("prealloc", "cat"):
        limit, tries = out[kind], out["tries"][kind]
        assert tries[0]["tokens"] == out["arithmetic"]  # the plan first
        assert 32 < limit < 2000 and len(tries) <= 13
        assert {t["tokens"]: t["fits"] for t in tries}.get(limit + 1) is False
        assert capped(model, kind, limit, 16)["fits"]
        assert not capped(model, kind, limit + 1, 16)["fits"]
    assert out["cat"] < out["prealloc"]  # every regrowth is a new allocation
    assert out["cat_trace"][-1]["tokens"] == out["cat"] - 1 - 16  # zeros up to the last chunk
    assert bench.longest_context(model, held, chunk=16)["prealloc"] == 0  # nothing left


# --- on a real card (the GPU check runs these; skipped elsewhere) -------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_real_graphs_give_the_static_tokens_and_hold_their_pools():
    model = tiny_model("qwen3").to("cuda")
    ids = torch.randint(0, 512, (1, 21), generator=torch.Generator().manual_seed(1))
    want = kvlib.generate(model, ids, 24, max_seq=64, step="static", bucket=16).tokens
    cache = KVCache.for_model(model.config, 64, device="cuda", dtype=model.dtype)
    step = graphs.StaticStep(model, cache, bucket=16)
    assert step.capture and kvlib.generate(model, ids, 24, step=step).tokens == want
    assert sorted(step.memory) == [32, 48]
    assert all(m["reserved"] > 0 and m["allocated"] >= 0 for m in step.memory.values())
