"""The allocator's own event history on a GPU, for https://pytorch.org/memory_viz (notebook 02
and the GPU check); memory against length, row by row, is the GPU check's ``tests/gpu_memory.py``.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvlib.env import default_device, resolve


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
