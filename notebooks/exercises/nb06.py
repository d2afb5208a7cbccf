"""Exercises of notebook 06 (capstone: a 12 GB card): checks and reference solutions.

Everything is arithmetic on shipped configs, so the checks print the same thing on every
machine.
"""

from __future__ import annotations

import sys

import torch

from kvlib import bandwidth as kv_bandwidth
from kvlib import budget as kv_budget
from kvlib.bandwidth import decode_bytes, step_bytes
from kvlib.budget import param_count, plan_budget, run_workspace, weight_bytes, workspace_bytes
from kvlib.cards import CARDS, Card
from kvlib.config import GIB, MIB, kv_bytes_per_token, load_config

from .checking import attempt, check, expect, hint

PREFILL_CHUNK = 512
# What each exercise builds, hidden from the learner's function while a check calls it.
# The reference solutions below are hidden too: the notebook imports this module.
_HERE = sys.modules[__name__]
PLAN = ((kv_budget, "plan_budget"), (kv_budget, "Budget"), (_HERE, "longest_context_solution"))
FLOOR = ((kv_bandwidth, "decode_bytes"), (kv_bandwidth, "step_bytes"),
         (Card, "predicted_ms_per_token"), (_HERE, "read_bytes"),
         (_HERE, "decode_floor_ms_solution"))
CARD = PLAN + FLOOR + ((_HERE, "card_needed_solution"),)
LOST = PLAN + ((_HERE, "tokens_lost_solution"),)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- 1. the longest context on a bigger card ---------------------------------------------


def longest_context_solution(config, dtype: torch.dtype, batch: int, budget_bytes: int) -> int:
    """The largest context with weights + KV + the run's workspace within the budget.

    The workspace grows a little with the context (the prompt's ids stay on the device), so no
    single division gives it: bisect between a context that fits (0) and one whose cache
    alone would not.
    """
    weights = weight_bytes(config, dtype)
    per_token = kv_bytes_per_token(config, dtype, batch)  # all `batch` sequences grow together

    def fits(context: int) -> bool:
        workspace = run_workspace(config, dtype, context, PREFILL_CHUNK, batch)
        return weights + per_token * context + workspace <= budget_bytes

    lo, hi = 0, max(0, budget_bytes - weights) // per_token + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


LONGEST_CASES = [  # (config, dtype, batch, budget GiB): the asked one first
    ("llama-3.2-3b", torch.float16, 4, 24),
    ("qwen3-4b", torch.bfloat16, 1, 12),
    ("qwen2.5-3b", torch.float32, 2, 16),
    ("smollm2-135m", torch.float32, 8, 4),
]


@check
def check_longest_context(fn) -> None:
    """``fn(config, dtype, batch, budget_bytes)`` -> the longest context, as ``plan_budget``."""
    for name, dtype, batch, gib in LONGEST_CASES:
        config = load_config(name)
        got = attempt(fn, config, dtype, batch, gib * GIB, hide=PLAN)
        plan = plan_budget(config, dtype, gib * GIB, batch=batch, prefill_chunk=PREFILL_CHUNK)
        want = plan.max_context
        over = -plan.breakdown(want + 1)["free"]
        at_zero = workspace_bytes(config, dtype, PREFILL_CHUNK, batch)  # a chunk, nothing cached
        fixed = (gib * GIB - plan.weights - at_zero) // plan.kv_per_token
        expect(got is not None and int(got) == want,
               f"{name} in {_name(dtype)}, batch {batch}, {gib} GiB: you said {got}, the plan says "
               f"{want:,} tokens per sequence (weights {plan.weights:,} B, "
               f"KV {plan.kv_per_token:,} B per token for all {batch} sequences, workspace "
               f"{plan.workspace:,} B at that context; one token more is {over:,} B over).",
               hint(got, {fixed: f"Hint: that prices the workspace of a chunk with nothing cached "
                                 f"({at_zero:,} B); it grows with the context, so search for the "
                                 f"largest context that fits."},
                    "Hint: bisect on weights + KV + run_workspace(context) <= budget."))


# --- 2. the floor under a decode step ----------------------------------------------------


def read_bytes(config, dtype: torch.dtype, context: int) -> int:
    """What a decode step must read: every weight once (a tied embedding table as the output
    head; an untied one only for the token's row), and the K/V of ``context`` tokens once."""
    table = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    weights = (param_count(config) - table + config.hidden_size) * dtype.itemsize
    return weights + kv_bytes_per_token(config, dtype) * context


def decode_floor_ms_solution(config, dtype: torch.dtype, context: int, bandwidth: float) -> float:
    """Milliseconds to read every weight once and the K/V of ``context`` tokens once."""
    return 1e3 * read_bytes(config, dtype, context) / bandwidth


FLOOR_CASES = [  # (config, dtype, context, bandwidth in bytes/s)
    ("qwen3-4b", torch.bfloat16, 32768, 360e9),  # a 12 GB card's class of bandwidth
    ("llama-3.2-3b", torch.float16, 8192, 1e12),
    ("qwen2.5-3b", torch.bfloat16, 4096, 300e9),
    ("smollm2-135m", torch.float32, 1024, 20e9),  # a laptop CPU
    # as its bigger siblings: the table is not read whole
    ("qwen2.5-3b untied", torch.bfloat16, 4096, 300e9),
]
RTOL = 1e-3


def _config(name: str):
    """A shipped config; "<name> untied" is the same with its own output head (not tied)."""
    config = load_config(name.removesuffix(" untied"))
    if name.endswith(" untied"):
        config.tie_word_embeddings = False
    return config


@check
def check_decode_floor(fn) -> None:
    """``fn(config, dtype, context, bandwidth)`` -> the floor in ms, within 0.1%."""
    for name, dtype, context, bw in FLOOR_CASES:
        config = _config(name)
        got = attempt(fn, config, dtype, context, bw, hide=FLOOR)
        want = decode_floor_ms_solution(config, dtype, context, bw)
        kv = kv_bytes_per_token(config, dtype) * context
        weights = decode_bytes(config, dtype, context) - kv
        head = ("Hint: the tied embedding is read once, as the output head."
                if config.tie_word_embeddings else "Hint: an untied embedding is read for one row.")
        table = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
        known = {want / 1e3: "Hint: milliseconds, not seconds.",
                 want + 1e3 * table * dtype.itemsize / bw: "Hint: the untied embedding table is "
                                                           "not read whole, only one row."}
        near = next((text for wrong, text in known.items()
                     if got is not None and abs(float(got) - wrong) <= RTOL * wrong), head)
        expect(got is not None and abs(float(got) - want) <= RTOL * want,
               f"{name} in {_name(dtype)} at {context:,} tokens, {bw / 1e9:g} GB/s: you said "
               f"{got} ms, the floor is {want:.3f} ms = ({weights:,} B of weights read + {kv:,} B "
               f"of K/V) / bandwidth.", f" {near}")


# --- 3. the card to buy ------------------------------------------------------------------


def card_needed_solution(config, dtype: torch.dtype, context: int, ms: float,
                         cache: str) -> tuple[int, float]:
    """``(memory, bandwidth)``: the fewest bytes under which the plan reaches ``context`` tokens
    with ``cache`` (weights, KV and the workspace at that context; the plan also keeps RoPE's
    4 * head_dim bytes, within the check's slack), and the least bandwidth, in bytes/s, at which
    a decode step at ``context`` meets ``ms`` by the floor."""
    kv = kv_bytes_per_token(config, dtype) * context
    memory = weight_bytes(config, dtype) + kv + run_workspace(config, dtype, context,
                                                              PREFILL_CHUNK, cache=cache)
    moved = read_bytes(config, dtype, context) + (2 * kv if cache == "cat" else 0)  # cat: copy
    return memory, moved / (ms / 1e3)


# Not in kvlib.cards.CARDS: memory and bandwidth from the vendors' spec sheets.
NEW_CARDS = {
    "L4": Card("L4", 24, 8.9, 300e9,
               "https://www.nvidia.com/en-us/data-center/l4/ (24GB, 300GB/s)"),
    "RTX 4060 Ti 16GB": Card("RTX 4060 Ti 16GB", 16, 8.9, 288e9,
                             "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/"
                             "rtx-4060-4060ti/ (16 GB GDDR6, 128-bit at 18 Gbps: 288 GB/s)"),
    "RTX 4060": Card("RTX 4060", 8, 8.9, 272e9,
                     "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4060-4060ti/"
                     " (8 GB GDDR6, 128-bit at 17 Gbps: 272 GB/s)"),
}
NEEDED_CASES = [  # (config, dtype, context, ms per token, cache): the asked one first
    ("qwen3-4b", torch.bfloat16, 40960, 25.0, "prealloc"),  # its whole window
    ("qwen3-4b", torch.bfloat16, 40960, 25.0, "cat"),  # the same memory, more bytes per step
    ("qwen3-4b", torch.bfloat16, 30000, 40.0, "cat"),  # a partial last chunk: cat's own workspace
    ("llama-3.2-3b", torch.float16, 8192, 10.0, "prealloc"),
    ("qwen2.5-3b", torch.bfloat16, 32768, 30.0, "cat"),
    ("smollm2-135m", torch.float32, 8192, 2.0, "cat"),
]


SLACK = 64 * 1024  # bytes: the plan also keeps RoPE's buffers, 4 * head_dim bytes


@check
def check_card_needed(fn) -> str:
    """``fn(config, dtype, context, ms, cache)`` -> ``(memory, bandwidth)``: the memory within
    SLACK of the plan's least budget, the bandwidth within 0.1%. Its note: the cards that meet
    the asked case."""
    for name, dtype, context, ms, cache in NEEDED_CASES:
        config = load_config(name)
        got = attempt(fn, config, dtype, context, ms, cache, hide=CARD)
        try:
            got_memory, got_bw = int(got[0]), float(got[1])
        except (TypeError, ValueError, IndexError):
            got_memory = got_bw = None
        parts = plan_budget(config, dtype, GIB, prefill_chunk=PREFILL_CHUNK,
                            cache=cache).breakdown(context)
        least = parts["weights"] + parts["kv"] + parts["workspace"]
        # the cat cache priced with prealloc's workspace: the mistake of leaving run_workspace's
        # cache argument at its default
        as_prealloc = parts["weights"] + parts["kv"] + run_workspace(config, dtype, context,
                                                                     PREFILL_CHUNK)
        case = f"{name} in {_name(dtype)}, {cache}, {context:,} tokens at {ms:g} ms/token"
        expect(got_memory is not None and abs(got_memory - least) <= SLACK,
               f"{case}: you said {got_memory} B of memory; the plan needs {least:,} B = weights "
               f"{parts['weights']:,} + KV {parts['kv']:,} + workspace {parts['workspace']:,}.",
               next((f" {text}" for wrong, text in (
                   (parts["weights"] + parts["kv"], "Hint: the workspace too: run_workspace "
                                                    "at that context."),
                   (as_prealloc if cache == "cat" else None,
                    f"Hint: that is the prealloc cache's workspace; call run_workspace(config, "
                    f"dtype, context, {PREFILL_CHUNK}, cache=\"cat\") for the cat cache."),
                   (least / GIB, "Hint: bytes, not GiB."))
                   if got_memory is not None and wrong is not None
                   and abs(got_memory - wrong) <= SLACK), ""))
        moved = step_bytes(config, dtype, context, cache)
        need = moved / (ms / 1e3)
        known = {1e3 * need: "Hint: ms is thousandths of a second.",
                 need / 1e9: "Hint: bytes per second, not GB/s.",
                 decode_bytes(config, dtype, context) / (ms / 1e3):
                     "Hint: a cat step also reads its whole cache and writes it again."}
        near = next((text for wrong, text in known.items()
                     if got_bw is not None and abs(got_bw - wrong) <= RTOL * wrong), "")
        expect(got_bw is not None and abs(got_bw - need) <= RTOL * need,
               f"{case}: you said {got_bw} B/s; a step moves {moved:,} B, which in {ms:g} ms "
               f"takes {need / 1e9:.1f} GB/s.", f" {near}" if near else "")
    name, dtype, context, ms, cache = NEEDED_CASES[0]
    memory, need = card_needed_solution(load_config(name), dtype, context, ms, cache)
    cards = {**CARDS, **NEW_CARDS}
    both = [n for n, c in cards.items() if c.memory >= memory and c.bandwidth >= need]
    roomy = [n for n, c in cards.items() if c.memory >= memory and c.bandwidth < need]
    return (f"{name}'s whole window at {ms:g} ms/token ({cache}) needs {memory / GIB:.2f} GiB and "
            f"{need / 1e9:.0f} GB/s. Of the table's cards and "
            f"{len(NEW_CARDS)} more ({', '.join(NEW_CARDS)}), those that meet both: "
            f"{', '.join(both) or 'none'}; with the memory but too slow: "
            f"{', '.join(roomy) or 'none'} (a PREDICTION from the sheets' numbers, and a floor: "
            f"the H200 reference ran its steps far above it).")


# --- 4. what a real card loses -----------------------------------------------------------


def tokens_lost_solution(config, dtype: torch.dtype, budget_bytes: int, overhead_bytes: int) -> int:
    """Tokens the plan's longest context (batch 1) loses when ``overhead_bytes`` of the budget are
    taken by what it does not count (a CUDA context, libraries' workspaces). At most
    ``overhead_bytes / KV per token``: fewer where the workspace shrinks with the context too
    (a mask per cached token: fp32 with grouped heads, or the math kernel)."""
    longest = longest_context_solution(config, dtype, 1, budget_bytes)
    return longest - longest_context_solution(config, dtype, 1, budget_bytes - overhead_bytes)


LOST_CASES = [  # (config, dtype, budget GiB, overhead MiB): the asked one first
    ("qwen3-4b", torch.bfloat16, 12, 100),
    ("qwen3-4b", torch.bfloat16, 12, 905),  # the H200 reference's: 787 outside, 118 held
    ("llama-3.2-3b", torch.float16, 16, 512),
    ("smollm2-135m", torch.float32, 4, 1024),
]


@check
def check_tokens_lost(fn) -> str:
    """``fn(config, dtype, budget_bytes, overhead_bytes)`` -> the tokens lost, exactly. Its note:
    the asked case (bf16) and the last (fp32, grouped heads) against the KV alone."""
    notes = []
    for name, dtype, gib, mib in LOST_CASES:
        config = load_config(name)
        got = attempt(fn, config, dtype, gib * GIB, mib * MIB, hide=LOST)
        want = tokens_lost_solution(config, dtype, gib * GIB, mib * MIB)
        kv_only = mib * MIB // kv_bytes_per_token(config, dtype)
        expect(got is not None and int(got) == want,
               f"{name} in {_name(dtype)} on {gib} GiB, {mib:,} MiB taken: you said {got}, the "
               f"plan loses {want:,} tokens (the KV alone would say {kv_only:,}).",
               hint(got, {kv_only: "Hint: that is the overhead over the KV per token; here "
                                   "the workspace shrinks with the context too (a mask per "
                                   "cached token), so a token freed gives back more than its KV.",
                          -want: "Hint: tokens lost, a positive number."},
                    "Hint: your plan_longest of exercise 1, with and without the overhead."))
        notes.append(f"{name} in {_name(dtype)}, {mib:,} MiB of {gib} GiB: {want:,} tokens "
                     f"(overhead / KV per token: {kv_only:,})")
    return (f"{notes[0]}; {notes[-1]}. Fewer than the division only where the workspace "
            "shrinks with the context too: fp32 with grouped heads prices a mask per cached token.")
