"""Memory now, and the 12 GiB emulation: a smaller card emulated on a bigger one.

``allocated`` is what live tensors hold; ``reserved`` what the caching allocator took from the
driver, the number that runs out; ``peak_*`` the high-water mark. A CPU has no allocator to ask:
there the honest number is the resident set size. Nothing here touches ``torch.cuda`` off CUDA.
``memory_snapshot`` records the allocator's own event history, for https://pytorch.org/memory_viz."""

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .config import GIB
from .env import default_device, resolve

__all__ = ["Cap", "allocator_budget", "cap_memory", "free", "memory_snapshot", "memory_stats"]


def _rss() -> int:
    try:
        import psutil
    except ImportError:  # Linux without psutil: pages resident, 2nd field of statm
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return psutil.Process().memory_info().rss


def memory_stats(device: torch.device | str) -> dict[str, int]:
    """Bytes, now: ``rss`` off CUDA. ``outside_allocator``, the driver's ``total - free`` less
    ``reserved``, is the CUDA context, workspaces and other processes: ``nvidia-smi``'s surplus."""
    device = resolve(device)
    if device.type != "cuda":
        return {"rss": _rss()}
    unused, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": reserved,
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device),
            "device_used": total - unused, "outside_allocator": total - unused - reserved}


def free(device: torch.device | str) -> None:
    """Collect garbage, then hand the allocator's cached blocks back (CUDA), so that the next
    measurement starts from what is live, not from what the last one left cached."""
    gc.collect()
    if resolve(device).type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Cap:
    """The memory budget a run works under, and a sentence saying what it is."""

    gib: float
    total_bytes: int | None  # the card's memory; None on CPU
    fraction: float | None  # passed to set_per_process_memory_fraction, if active
    active: bool
    note: str
    # the cap, else the whole card, else None (CPU)
    budget_bytes = property(lambda self: int(self.gib * GIB) if self.active else self.total_bytes)

    @property
    def label(self) -> str:
        if self.active:
            return f"allocator capped at {self.gib:g} GiB (emulating a {self.gib:g} GB card)"
        if self.total_bytes is None:
            return "no memory cap (CPU)"
        return f"uncapped ({self.total_bytes / GIB:.1f} GiB card)"


def cap_memory(gib: float, device: torch.device | str) -> Cap:
    """Emulate a ``gib``-GiB card on a bigger one: the allocator raises OOM once ``reserved`` would
    pass the cap. A little generous: the CUDA context is outside it (:func:`allocator_budget`)."""
    device = resolve(device)
    if device.type != "cuda":
        return Cap(gib, None, None, False, f"no {gib:g} GiB cap on {device.type}: no GPU allocator")
    total = torch.cuda.mem_get_info(device)[1]
    fraction = gib * GIB / total
    active = fraction < 1
    torch.cuda.set_per_process_memory_fraction(min(fraction, 1.0), device)  # 1.0 lifts an old cap
    note = (f"emulating a {gib:g} GiB card on a {total / GIB:.1f} GiB one: the caching allocator "
            f"is capped at {gib:g} GiB; the CUDA context and memory allocated outside PyTorch are "
            "not" if active
            else f"cap not applied: the card's {total / GIB:.1f} GiB <= {gib:g} GiB is the limit")
    return Cap(gib, total, fraction if active else None, active, note)


def allocator_budget(device: torch.device | str, cap: Cap | None = None) -> int | None:
    """What the allocator holds plus what the driver says is free, within an active cap: the budget
    to plan against once the model is loaded, the CUDA context already taken. ``None`` off CUDA."""
    device = resolve(device)
    if device.type != "cuda":
        return None
    usable = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
    return min(usable, cap.budget_bytes) if cap is not None and cap.active else usable


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
