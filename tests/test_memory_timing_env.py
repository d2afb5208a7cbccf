"""Instruments that say where they ran, and do not lie about CPU vs CUDA."""

import platform
import time

import pytest
import torch
import transformers
from gpu_memory import MemoryTrace

from kvlib.env import allocator_settings, auto_dtype, default_device, describe, label, resolve
from kvlib.memory import GIB, allocator_budget, cap_memory, free, memory_snapshot, memory_stats
from kvlib.timing import StepTimer, Timing, time_fn

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# --- memory ----------------------------------------------------------------
def test_cpu_cap_is_inactive_and_says_so():
    cap = cap_memory(12, "cpu")
    assert not cap.active and cap.budget_bytes is None and cap.fraction is None
    assert "cpu" in cap.note and "12 GiB" in cap.note


def test_cpu_memory_stats_are_rss_only():
    stats = memory_stats("cpu")
    assert set(stats) == {"rss"} and stats["rss"] > 0


def test_cpu_rss_sees_a_touched_allocation():
    before = memory_stats("cpu")["rss"]
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page written
    assert memory_stats("cpu")["rss"] - before > 32 * 2**20
    del big


def test_trace_rows_and_columns_on_cpu():
    trace = MemoryTrace("cpu")
    for t in (1, 2, 3):
        trace.record(t)
    trace.reset_peak()  # no-op, must not touch torch.cuda
    assert trace.column("tokens") == [1, 2, 3]
    assert all(r["rss"] > 0 for r in trace.rows)


def test_cpu_allocator_settings_and_snapshot_are_no_ops(tmp_path):
    assert allocator_settings("cpu") == {} and allocator_budget("cpu") is None
    free("cpu")  # collects garbage; no allocator to empty
    path = tmp_path / "snap.pickle"
    with memory_snapshot(path, device="cpu") as recording:
        torch.zeros(10)
    assert recording is False and not path.exists()


@needs_cuda
def test_cuda_stats_are_consistent():
    x = torch.empty(256, 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB
    s = memory_stats("cuda")
    assert s["allocated"] >= x.numel() and s["reserved"] >= s["allocated"]
    assert s["peak_allocated"] >= s["allocated"] and s["peak_reserved"] >= s["reserved"]
    assert s["device_used"] >= s["reserved"]
    assert s["outside_allocator"] == s["device_used"] - s["reserved"]


@needs_cuda
@pytest.mark.parametrize("device", ["default", "cuda"])
def test_cuda_cap_budget_and_label(device):
    device = default_device() if device == "default" else device
    cap = cap_memory(1, device)
    try:
        assert cap.active and cap.budget_bytes == GIB
        assert allocator_budget(device, cap) <= GIB
        assert "emulating" in cap.note and "CUDA context" in cap.note
        assert "allocator capped at 1 GiB" in label(device, torch.float16, cap)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * GIB, dtype=torch.uint8, device=device)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, resolve(device))
    assert "backend" in allocator_settings(device)


@needs_cuda
def test_cuda_snapshot_is_written(tmp_path):
    path = tmp_path / "snap.pickle"
    with memory_snapshot(path) as recording:
        torch.zeros(1000, device="cuda")
    assert recording and path.stat().st_size > 0


# --- timing ----------------------------------------------------------------
def test_time_fn_excludes_warmup_and_orders_quantiles():
    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.05 if len(calls) <= 3 else 0.001)  # slow warm-up, fast after

    t = time_fn(fn, device="cpu", warmup=3, repeats=7)
    assert len(calls) == 10 and len(t.samples_s) == 7
    assert t.p10_s <= t.median_s <= t.p90_s
    assert max(t.samples_s) < 0.04  # no warm-up call leaked into the samples
    assert t.ms == pytest.approx(t.median_s * 1e3)
    assert "ms median" in str(t) and "cpu" in str(t)


def test_timing_quantiles_are_real_quantiles():
    t = Timing.from_samples([float(i) for i in range(1, 12)], "cpu")  # 1..11
    assert (t.p10_s, t.median_s, t.p90_s) == (2.0, 6.0, 10.0)
    assert Timing.from_samples([3.0], "cpu").p10_s == 3.0


def test_step_timer_and_bad_inputs():
    timer = StepTimer("cpu")
    for d in (0.002, 0.01):
        timer.start()
        time.sleep(d)
        timer.stop()
    a, b = timer.times_s
    assert a >= 0.002 and b >= 0.01 and len(timer) == 2  # lower bounds: a busy machine only adds
    with pytest.raises(RuntimeError, match="without start"):
        timer.stop()
    with pytest.raises(ValueError, match="meta"):
        StepTimer("meta")
    with pytest.raises(ValueError, match="repeats=0"):
        time_fn(lambda: None, device="cpu", repeats=0)


@needs_cuda
def test_cuda_events_time_the_gpu_not_the_enqueue():
    x = torch.randn(4096, 4096, device="cuda")
    t = time_fn(lambda: x @ x, device="cuda", warmup=2, repeats=5)
    # 2*4096^3 flop: on any card well over 0.05 ms; enqueue alone is ~10 us
    assert t.median_s > 5e-5 and torch.device(t.device).type == "cuda"


# --- env -------------------------------------------------------------------
def test_dtype_and_device_on_cpu():
    assert auto_dtype("cpu") == torch.float32 and resolve("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert default_device() == torch.device("cpu")
    else:  # the current card, named by its index: torch.cuda refuses a bare "cuda" in places
        assert default_device() == torch.device("cuda", torch.cuda.current_device())


def test_label_says_versions_dtype_and_cores():
    cap = cap_memory(12, "cpu")
    line = label("cpu", torch.float32, cap)
    assert f"torch {torch.__version__}" in line
    assert f"transformers {transformers.__version__}" in line
    assert "float32" in line and line.startswith("CPU (") and "cores" in line
    assert "cap" not in line  # no cap to speak of on a CPU
    d = describe("cpu", torch.bfloat16, cap)
    assert d["dtype"] == "bfloat16" and d["cap"] == cap.note and d["cores"] >= 1
    assert d["python"] == platform.python_version()


@needs_cuda
def test_cuda_dtype_follows_capability():
    major, _ = torch.cuda.get_device_capability()
    assert auto_dtype("cuda") == (torch.bfloat16 if major >= 8 else torch.float16)
    assert torch.cuda.get_device_name() in label("cuda")
