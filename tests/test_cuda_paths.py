"""kvlib's CUDA-only code, run on the CPU through torch's own Python layer.

Only what lies under that layer is faked (:class:`fake_card.FakeDriver`): the ``torch._C._cuda_*``
calls, ``cudaMemGetInfo``, the device properties, and the stream, event and graph classes a CPU
build lacks. Everything between kvlib and those calls is the real ``torch.cuda``: its argument
checks (a device without an index, a fraction that is not a float), its lazy initialisation guards,
its stream context managers, ``torch.cuda.graph``. So an argument torch would refuse on a GPU is
refused here too, in CI. The tensors here are real CPU tensors: the fake graph replays their ops,
so a host value frozen into a capture gives wrong tokens. ``test_fake_card.py`` walks the same
code with fake CUDA tensors at three cards.

Run on a real GPU too (the GPU check does): then it checks kvlib against that machine's torch.
"""

import contextlib
import pickle

import gpu_memory
import pytest
import torch
from fake_card import GIB, MIB, SYNCS, FakeDriver, _fresh, forget_side_streams
from gpu_memory import MemoryTrace, longest_context
from helpers import SHARED, tiny_model
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

# Imported before a test fakes a card: these look for CUDA as they import (torch._dynamo does).
from transformers.models.llama import modeling_llama  # noqa: F401
from transformers.models.qwen3 import modeling_qwen3  # noqa: F401

import kvlib
from kvlib import env, graphs, loop, memory, timing
from kvlib.kv_cache import KVCache

CUDA1 = torch.device("cuda", 1)


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    fake.install(monkeypatch)
    forget_side_streams()
    yield fake
    forget_side_streams()


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
    trace = MemoryTrace("cuda")
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
        with memory.memory_snapshot(path, max_entries=123) as recording:
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
    runs = gpu_memory._runs

    def capped(model, kind, n, chunk):
        with _Cap(1_000_000):
            return runs(model, kind, n, chunk)

    monkeypatch.setattr(gpu_memory, "_runs", capped)
    monkeypatch.setattr(gpu_memory, "free", lambda device: None)  # no cache to empty: gc is slow
    held = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    per_token = 2 * 3 * 2 * 16 * 4
    out = longest_context(model, held + 2000 * per_token, chunk=16)
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
    assert longest_context(model, held, chunk=16)["prealloc"] == 0  # nothing left


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
