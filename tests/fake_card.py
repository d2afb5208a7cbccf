"""A fake CUDA card for a CPU-only torch: kvlib's GPU-only Python runs on it in CI.

Two layers. :class:`FakeDriver` fakes only what lies under ``torch.cuda``'s Python (the
``torch._C._cuda_*`` calls, ``cudaMemGetInfo``, the device properties, and the stream, event and
graph classes a CPU build lacks), so torch's own argument checks, lazy-init guards and context
managers run as on a GPU. :func:`fake_card` adds tensors: under ``FakeTensorMode``
``torch.empty(..., device="cuda")`` is a fake tensor on ``cuda:0`` (shape, dtype and device; no
data, no memory), ``.item()`` raises as a CUDA-graph capture would, and a CPU tensor mixed into a
CUDA op is refused. :class:`Route` reruns on ``meta`` the calls a CPU build cannot make for a
``cuda`` tensor (Python indexing and a few bindings take a CUDA device guard) and answers SDPA and
``torch._fused_sdp_choice`` as :func:`kvlib.sdpa_choice.sdpa_kernel` models the card's dispatcher,
counting the kernel each call would get. :func:`fake_model` is a model built on ``meta`` with its
parameters and buffers swapped for fake CUDA tensors, ties kept.

What it proves: keys, shapes, dtypes and devices; no host read inside a step; code only a CUDA
branch reaches runs. What it cannot: numerics, which kernel torch really picks, whether a capture
is legal to the driver, memory and time. Those stay for a real card (``tests/gpu_check.py``).

The fake graph records the aten ops of the captured call and replays exactly those ops on the same
tensors, so a step that keeps a host value (a Python int, a ``.item()``) in what it captures gives
wrong tokens on CPU tensors, as it would on a GPU; a host sync during capture raises, as CUDA does,
and so does a tensor made from host data (a list index), which CUDA would copy from unpinned memory.
"""

import contextlib
import itertools
import types
from dataclasses import dataclass

import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from kvlib import graphs
from kvlib.budget import meta_model
from kvlib.sdpa_choice import BACKEND, SDPA, kernel_of

GIB, MIB = 2**30, 2**20
SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}
META = torch.device("meta")


@dataclass(frozen=True)
class Card:
    name: str
    capability: tuple[int, int]
    total: int  # bytes the card reports
    sms: int
    dtype: torch.dtype  # kvlib.auto_dtype's answer

    @property
    def sm(self) -> float:
        return self.capability[0] + self.capability[1] / 10


CARDS = {c.name: c for c in (
    Card("T4", (7, 5), 15 * GIB, 40, torch.float16),
    Card("RTX 3060", (8, 6), 12 * GIB, 28, torch.bfloat16),
    Card("H200", (9, 0), 141 * GIB, 132, torch.bfloat16),  # capped at 12 GiB by the walk
)}


class FakeDriver:
    """``count`` cards (the current one ``current``, so an index silently defaulted to 0 shows
    when it is 1), an allocator with numbers the test sets, an event clock the test advances, and
    stream / graph bookkeeping."""

    def __init__(self, capability=(9, 0), total=80 * GIB, count=2, current=1, sms=132):
        self.capability, self.total, self.count, self.current = capability, total, count, current
        self.sms = sms
        self.fraction = {i: 1.0 for i in range(count)}
        self.allocated, self.cached = 0, 0  # bytes, on the current card
        self.pools: dict[tuple, int] = {}  # graph pool -> bytes it reserves
        self.peak_allocated = self.peak_reserved = 0
        self.used_outside = 600 * MIB  # the CUDA context and anything not ours
        self.clock_ms, self.synced_at = 0.0, 0.0
        self.tick_ms = 0.0  # the clock's advance per event recorded: times that are not zero
        self.stream_ids = iter(range(100, 10**6))
        self.pool_ids = itertools.count(1)
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
        return self.allocated + self.cached + sum(self.pools.values())

    def mem_get_info(self, i):
        self.index(i, "cudaMemGetInfo")
        return self.total - self.used_outside - self.reserved, self.total

    def memory_stats(self, i):
        self.index(i, "memoryStats")
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        allocated = {"current": self.allocated, "peak": self.peak_allocated}
        reserved = {"current": self.reserved, "peak": self.peak_reserved}
        return {"allocated_bytes": {"all": allocated}, "reserved_bytes": {"all": reserved},
                "requested_bytes": {"all": {"current": self.allocated}}}

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
                                     total_memory=self.total, multi_processor_count=self.sms)

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
            "_cuda_isCurrentStreamCapturing": lambda: getattr(self, "capturing", None) is not None,
            "_cuda_set_sync_debug_mode": lambda mode: setattr(self, "sync_debug", mode),
            "_cuda_get_sync_debug_mode": lambda: getattr(self, "sync_debug", 0),
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
        mp.setattr(cuda.graphs, "_graph_pool_handle", lambda: (0, next(self.pool_ids)))
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

        def synchronize(self):
            driver.synced_at = driver.clock_ms

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
            driver.clock_ms += driver.tick_ms
            self.at = driver.clock_ms

        def synchronize(self):
            driver.synced_at = driver.clock_ms

        def elapsed_time(self, end):
            assert self.enable_timing and end.enable_timing, "events made without enable_timing"
            if max(self.at, end.at) > driver.synced_at:
                raise RuntimeError("CUDA error: device not ready")  # cudaErrorNotReady
            return end.at - self.at

    return Event


class Peak(TorchDispatchMode):
    """The most bytes that tensors made inside the block held at once (what the allocator would
    have to find: a graph's pool, if the block is a captured step)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
        self.live += [(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
                      for t in _fresh(out, (args, kwargs)) if t is not None]
        self.peak = max(self.peak, sum(n for _, n in self.live))
        return out


class _Recorder(Peak):
    """Records a capture's ops, and the most bytes its tensors held at once: its pool's size."""

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
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


def _fresh(out, args) -> list[torch.Tensor]:
    """Outputs with storage of their own: not views of, or in-place on, an input."""
    inputs = {t.untyped_storage()._cdata for t in pytree.tree_leaves(args)
              if isinstance(t, torch.Tensor)}
    return [t if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs
            else None for t in pytree.tree_leaves(out)]


def _graph_class(driver):
    class CUDAGraph:
        """Records the captured call's ops; ``replay`` runs exactly those on the same tensors,
        writing each new result into the tensor the capture produced. Its pool reserves the most
        bytes the capture's tensors held at once; graphs that share a pool (``pool=``) reserve
        the largest of those once."""

        def __init__(self, *args, **kwargs):
            self.ops, self.pool_bytes, self.recorder = [], 0, None

        def capture_begin(self, pool=None, **kwargs):
            self.stream = driver.current_stream[driver.current]
            assert self.stream != 0, "capture on the default stream"
            self.pool = pool if pool is not None else (1, next(driver.pool_ids))  # private
            driver.capturing, self.recorder = self, _Recorder(self)
            self.recorder.__enter__()

        def capture_end(self):
            self.recorder.__exit__(None, None, None)
            driver.capturing = None
            self.pool_bytes = self.recorder.peak
            held = driver.pools.get(self.pool, 0)  # reserved while its graphs live
            driver.pools[self.pool] = max(held, self.pool_bytes)

        def replay(self):
            driver.calls.append(("replay", driver.current))
            for func, args, kwargs, out in self.ops:
                new = pytree.tree_leaves(func(*args, **kwargs))
                for old, value in zip(_fresh(out, (args, kwargs)), new, strict=True):
                    if old is not None:
                        old.copy_(value)

    return CUDAGraph


def forget_side_streams():
    """A fake stream must not outlive the fake driver, nor a real one be handed to it."""
    graphs._side_stream.cache_clear()


# --- tensors on the fake card -----------------------------------------------------------------
_NO_CUDA = "not linked with support for cuda"


def _on_meta(func, args, kwargs):
    """``func`` with every fake CUDA tensor it is given moved to ``meta`` for the call, and its
    new fake tensors put on the card: shapes and dtypes as CUDA would give them."""
    fakes = {id(t): t for t in pytree.tree_leaves((args, kwargs))
             if isinstance(t, FakeTensor) and t.fake_device.type == "cuda"}
    devices = {i: t.fake_device for i, t in fakes.items()}
    card = next(iter(devices.values()), torch.device("cuda", 0))
    for t in fakes.values():
        t.fake_device = META
    try:
        out = func(*args, **kwargs)
    finally:
        for i, t in fakes.items():
            t.fake_device = devices[i]
    for t in pytree.tree_leaves(out):
        if isinstance(t, FakeTensor) and t.fake_device.type == "meta":
            t.fake_device = card
    return out


def _zeros(shape: tuple):
    return 0 if not shape else [_zeros(shape[1:]) for _ in range(shape[0])]


def _on_card(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


_READS = {torch.Tensor.item: 0.0, torch.Tensor.__float__: 0.0, torch.Tensor.__int__: 0,
          torch.Tensor.__bool__: False}


class Route(TorchFunctionMode):
    """Reruns on ``meta`` what a CPU build cannot do for a fake ``cuda`` tensor; routes SDPA and
    torch's chooser as :func:`kvlib.sdpa_choice.sdpa_kernel` at ``sm`` would; ``counts`` tallies the
    kernels SDPA calls would get."""

    def __init__(self, sm: float, driver: FakeDriver, host_reads: bool = False) -> None:
        super().__init__()
        self.sm, self.driver, self.counts, self.host_reads = sm, driver, {}, host_reads
        self.reads = 0  # tolist() calls answered

    def _refuse_past_the_cap(self, args, kwargs) -> None:
        """One allocation larger than the allocator's cap is refused, as CUDA's would be."""
        shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        cap = self.driver.fraction[0] * self.driver.total
        if nbytes > cap:
            raise torch.OutOfMemoryError(f"CUDA out of memory (fake card): {nbytes} bytes past "
                                         f"the cap of {cap:.0f}")

    def tolist(self, t: FakeTensor) -> list:
        """The loop's read of its tokens after the last step: zeros, as a fake has no data.
        ``.item()`` and ``int()`` still raise (``DataDependentOutputException``): in a step they
        are the capture's hazard."""
        if getattr(self.driver, "capturing", None) is not None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                               "(tolist)")
        self.reads += 1
        return _zeros(tuple(t.shape))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SDPA:
            kind, _ = kernel_of(self.sm, args, kwargs)
            if func is torch._fused_sdp_choice:
                return int(BACKEND[kind])
            self.counts[kind] = self.counts.get(kind, 0) + 1
            with _disable_current_modes():  # the math path checks shapes and dtypes; its inner
                out = _on_meta(func, args, kwargs)  # ops, on meta, stay out of a capture
            return torch.empty_like(out)
        if func in _READS and self.host_reads and isinstance(args[0], FakeTensor):
            return _READS[func]  # a rehearsal's numbers: zeros, as a fake has no data
        if func in (torch.empty, torch.zeros, torch.ones) and _on_card(kwargs.get("device")):
            self._refuse_past_the_cap(args, kwargs)
        if func in (torch.tensor, torch.as_tensor) and _on_card(kwargs.get("device")):
            # made on the host, then a fake of it on the card (CPU torch has no CUDA copy)
            host = func(*args, **{**kwargs, "device": "cpu"})
            return torch.empty(host.shape, dtype=host.dtype, device=kwargs["device"])
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:
            if _NO_CUDA not in str(e):
                raise
            return _on_meta(func, args, kwargs)


@dataclass
class FakeCard:
    card: Card
    driver: FakeDriver
    route: Route
    mode: FakeTensorMode
    device: torch.device = torch.device("cuda", 0)


@contextlib.contextmanager
def fake_card(name: str, host_reads: bool = False):
    """The card ``name`` of :data:`CARDS` faked for the block: its driver, fake tensors on it, the
    SDPA routing. ``host_reads``: ``.item()`` and the like answer zero (a rehearsal of the GPU
    check), where by default they raise. Patches are undone on exit."""
    card = CARDS[name]
    driver = FakeDriver(card.capability, card.total, count=1, current=0, sms=card.sms)
    driver.tick_ms = 0.01
    route, mode = Route(card.sm, driver, host_reads), FakeTensorMode(allow_non_fake_inputs=True)
    mp = pytest.MonkeyPatch()
    try:
        driver.install(mp)
        mp.setattr(FakeTensor, "tolist", lambda t: route.tolist(t))
        forget_side_streams()
        _caches_clear()
        with mode, route:
            yield FakeCard(card, driver, route, mode)
    finally:
        mp.undo()
        forget_side_streams()
        _caches_clear()


def _caches_clear():
    """kvlib's per-device caches must not carry one card's answers to the next."""
    from kvlib.attention import splits

    splits.cache_clear()


def fake_model(config, dtype: torch.dtype):
    """``config`` (or a shipped one's name) built on ``meta``, its parameters and buffers swapped
    for fake CUDA tensors, ties kept; call inside :func:`fake_card`."""
    model = meta_model(config, dtype)
    swapped: dict[int, torch.Tensor] = {}

    def fake(t, parameter):
        if id(t) not in swapped:
            new = torch.empty(t.shape, dtype=t.dtype, device="cuda")
            swapped[id(t)] = torch.nn.Parameter(new, requires_grad=False) if parameter else new
        return swapped[id(t)]

    for module in model.modules():
        for store, parameter in ((module._parameters, True), (module._buffers, False)):
            for name, t in store.items():
                if t is not None:
                    store[name] = fake(t, parameter)
    return model

