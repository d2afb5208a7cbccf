"""The numbers the course quotes in more than one notebook, each from one function here: computed
(the simulated card's longest context) or read from the committed GPU reference
(``figures/h200/gpu_longest.json``), each line naming what its numbers are.
``tests/test_consistency.py`` holds every notebook's printed lines to one value per quantity."""

from kvlib.budget import plan_budget
from kvlib.config import MIB

from .simulate import longest_context

H200 = "H200, allocator capped at 12 GiB"  # how a figure from figures/h200/ is named, always


def short_of(pre: int, cat: int) -> str:
    """``cat``'s longest context against prealloc's, written one way everywhere."""
    return (f"cat {cat:,} tokens, short of prealloc by {pre - cat:,} tokens, "
            f"{(pre - cat) / pre:.1%} of prealloc's {pre:,}")


def simulated_longest(model, card, cache: str = "prealloc") -> int:
    """``cache``'s longest context on the simulated ``card`` (``model`` on ``meta``): the bisection
    of :func:`course.simulate.longest_context`, started 16 tokens either side of the plan (which
    promises at most 1% short) and widened 4x while the simulation refutes a bound."""
    plan = plan_budget(model.config, model.dtype, card.memory, cache=cache).max_context
    half = 16
    while True:
        try:
            return longest_context(model, lo=max(plan - half, 5), hi=plan + half, card=card,
                                   cache=cache)
        except ValueError as e:  # "... tokens fit: not an upper bound" (or not a lower one)
            if "bound" not in str(e):
                raise
            half *= 4


def reached(data: dict) -> str:
    """The H200 reference's prealloc against that run's own plan (``data``: gpu_longest's)."""
    pre, plan = data["prealloc"], data["arithmetic"]
    return (f"prealloc reached {pre:,} tokens, {pre / plan:.1%} of that run's plan ({plan:,}; "
            "the CUDA context outside its cap)")


def reference_caches(data: dict) -> str:
    """Both caches in the H200 reference's longest-context runs: how far cat fell short, and the
    allocator's reserved above allocated (prealloc: at the peak of each trial run that fit; cat:
    after each 512-token prefill chunk of its longest run), not notebook 00's timeline run."""
    fit = [t["peak_reserved"] - t["peak_allocated"] for t in data["tries"]["prealloc"] if t["fits"]]
    cat = max(r["reserved"] - r["allocated"] for r in data["cat_trace"])
    return (f"REFERENCE ({H200}), longest context under the cap: "
            f"{short_of(data['prealloc'], data['cat'])}; reserved above allocated in those runs: "
            f"prealloc {min(fit) / MIB:.0f}–{max(fit) / MIB:.0f} MiB at the peak of each trial "
            f"that fit, cat up to {cat / MIB:,.0f} MiB after a prefill chunk")
