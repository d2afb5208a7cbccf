"""The course's memory recorders for runs on a GPU: memory against length, row by row, and the
allocator's own event history for https://pytorch.org/memory_viz. kvlib's :func:`memory_stats` is
what each row reads; off CUDA they record what a CPU can say (the resident set) or nothing.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvlib.env import default_device, resolve
from kvlib.memory import memory_stats

__all__ = ["MemoryTrace", "memory_snapshot"]


class MemoryTrace:
    """One :func:`memory_stats` row per ``record(tokens)``: memory against length."""

    def __init__(self, device: torch.device | str) -> None:
        self.device, self.rows = resolve(device), []

    def record(self, tokens: int) -> dict[str, int]:
        self.rows.append({"tokens": int(tokens), **memory_stats(self.device)})
        return self.rows[-1]

    def column(self, key: str) -> list[int]:
        return [row[key] for row in self.rows]

    def reset_peak(self) -> None:
        """Restart ``peak_*`` from the current usage (CUDA; no-op elsewhere)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


@contextmanager
def memory_snapshot(path: str | os.PathLike, max_entries: int = 100_000, *,
                    device: torch.device | str | None = None) -> Iterator[bool]:
    """Record the allocator's events in the block into ``path`` for https://pytorch.org/memory_viz,
    even when it raises (an OOM is the best moment). Off CUDA: nothing, and it yields False."""
    if resolve(device or default_device()).type != "cuda":
        yield False
        return
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield True
    finally:
        try:
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
