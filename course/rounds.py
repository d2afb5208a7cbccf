"""Timing in rounds, for every measurement of the course and the bench, and the one rule for a
disturbed run. Each round runs every case once, in an order rotated by one from the round
before, so a slow spell of a shared machine lands on all of them alike. A case is read by the
median of its rounds with their spread (min..max) beside it: two cases differ only where their
spreads part (:func:`compare`). The same work on the same machine takes the same time; only
other programs add to it. So a case whose slowest round took more than ``SPREAD`` times its
fastest was slowed by something else, and the run says so once, in its printed line and its
figure's label (:func:`disturbed`).
"""

import gc
import statistics
from collections.abc import Callable

import torch

from kvlib.timing import time_fn

from . import say

SPREAD = 1.5  # slowest round over fastest beyond which other work took the time
FLAG = "disturbed run: not evidence"


def rounds(calls: dict, n: int = 3, warmup: int = 0) -> dict:
    """``{key: [what calls[key]() returned, one per kept round]}``: ``warmup + n`` rounds in a
    rotating order, the first ``warmup`` dropped. A call that runs out of memory is said once and
    keeps nothing from that round; the other cases go on."""
    keys, out = list(calls), {key: [] for key in calls}
    for r in range(warmup + n):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            try:
                value = calls[key]()
            except torch.OutOfMemoryError:
                print(f"{key}: out of memory in round {r}; nothing kept from it")
                gc.collect()
                torch.cuda.empty_cache()
                continue
            if r >= warmup:
                out[key].append(value)
    return out


def timed(fn: Callable, device, repeats: int = 1, warmup: int = 0) -> Callable[[], float]:
    """A call for :func:`rounds`: the median seconds of ``repeats`` calls of ``fn``."""
    return lambda: time_fn(fn, device=device, warmup=warmup, repeats=repeats).median_s


def shown(values, fmt: str = ".1f") -> str:
    """``median (min..max)`` of one case's rounds."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}..{max(values):{fmt}})"


def compare(ours: tuple, theirs: tuple) -> str:
    """How a time whose rounds span ``ours`` (min, max) stands to one spanning ``theirs``."""
    if ours[1] < theirs[0]:
        return "faster than"
    return "slower than" if ours[0] > theirs[1] else "within the spread of"


def disturbed(samples: dict, fmt: str = ".1f") -> list[str]:
    """``"key: median (min..max)"`` for each case whose rounds lie more than ``SPREAD`` apart."""
    return [f"{key}: {shown(v, fmt)}" for key, v in samples.items()
            if v and max(v) > SPREAD * min(v)]


def flag_line(line: str, found: list) -> str:
    """A printed line, flagged with what was wrong when the run was disturbed."""
    return line + (f" [{FLAG}: {'; '.join(found)}]" if found else "")


def flag_label(label: str, found: list) -> str:
    """A figure's label, flagged when the run was disturbed."""
    return f"{label} · {FLAG} (rounds over {SPREAD}x apart)" if found else label


def report(line: str, found: list) -> None:
    """Print a measurement's line, wrapped, flagged when the run was disturbed."""
    say(flag_line(line, found))
