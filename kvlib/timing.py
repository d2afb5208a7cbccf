"""One way to time things, on every device: ``perf_counter`` around a CUDA call times the enqueue,
so on CUDA events go around each call and are read after one synchronize. Warm-up calls run
uncounted; results are medians with a p10..p90 spread."""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .env import resolve

__all__ = ["StepTimer", "Timing", "time_fn"]


def _device(device: torch.device | str) -> torch.device:
    device = resolve(device)
    if device.type not in ("cpu", "cuda"):  # elsewhere perf_counter might time the enqueue
        raise ValueError(f"can only time cpu or cuda, not {device.type!r}")
    return device


@dataclass(frozen=True)
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    samples_s: list[float]
    device: str

    @classmethod
    def from_samples(cls, samples_s: list[float], device: torch.device | str) -> "Timing":
        if not samples_s:
            raise ValueError("no samples to summarise: 0 timed calls")
        if len(samples_s) == 1:
            p10 = p90 = samples_s[0]
        else:  # "inclusive" interpolates between samples, so p10 <= median <= p90
            cuts = statistics.quantiles(samples_s, n=10, method="inclusive")
            p10, p90 = cuts[0], cuts[-1]
        return cls(statistics.median(samples_s), p10, p90, list(samples_s), str(device))

    ms = property(lambda self: self.median_s * 1e3)

    def __str__(self) -> str:
        return (f"{self.ms:.3f} ms median (p10 {self.p10_s * 1e3:.3f}, p90 {self.p90_s * 1e3:.3f}; "
                f"n={len(self.samples_s)}, {self.device})")


def time_fn(fn: Callable[[], object], *, device: torch.device | str, warmup: int = 2,
            repeats: int = 10) -> Timing:
    """Call ``fn()`` ``warmup`` times untimed, then ``repeats`` times timed."""
    device = _device(device)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1, warmup >= 0; got repeats={repeats} warmup={warmup}")
    for _ in range(warmup):
        fn()
    timer = StepTimer(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # warm-up work must not leak into the first sample
    for _ in range(repeats):
        timer.start()
        fn()
        timer.stop()
    return timer.timing()


class StepTimer:
    """``start()``/``stop()`` around each step of a loop; read ``times_s`` after. On CUDA nothing
    synchronizes until then, so timing a decode loop does not stall the host every token."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = _device(device)
        self._start, self._pending, self._times = None, [], []  # CUDA: (start, end) events unread

    def _now(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        if self._start is None:
            raise RuntimeError(f"stop() without start() after {len(self)} steps")
        end, start, self._start = self._now(), self._start, None
        if self.device.type == "cuda":
            self._pending.append((start, end))
        else:
            self._times.append(end - start)

    @property
    def times_s(self) -> list[float]:
        if self._pending:
            torch.cuda.synchronize(self.device)  # the only host sync, and only on read
            self._times += [s.elapsed_time(e) / 1e3 for s, e in self._pending]
            self._pending.clear()
        return list(self._times)

    def timing(self) -> Timing:
        return Timing.from_samples(self.times_s, self.device)

    def __len__(self) -> int:
        return len(self._times) + len(self._pending)
