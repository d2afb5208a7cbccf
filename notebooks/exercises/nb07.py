"""Exercises of notebook 07 (many requests: batches and paged blocks): checks and solutions.

Checks run on small CPU tensors and shipped configs, so they print the same thing everywhere.
"""

from __future__ import annotations

import torch

from kvlib.config import head_dim, kv_heads, kv_token_bytes, load_config

from .checking import attempt, check, expect, hint

# --- 2. copy on write: the first divergent write into a shared block ----------------------


def cow_write_solution(tables: list[list[int]], refs: list[int], free: list[int], request: int,
                       slot: int, block: int):
    """Request ``request`` is about to write logical slot ``slot``; make that safe, in place.

    ``tables``: a block table per request; ``refs[b]``: how many tables hold block ``b``;
    ``free``: the free list, a stack (the next block is the last). A slot past the table opens a
    new block. A slot in a block that other tables hold too must not be written there: the
    writer takes a new block, points its table at it and lets go of the old one, whose count
    drops; the old block's K/V are copied first. Returns that copy, ``(source, destination)``,
    or ``None`` when the write needs none (a new block, or a block this request holds alone).
    """
    table, logical = tables[request], slot // block
    if logical == len(table):  # the slot opens a new block: nothing in it to copy
        new = free.pop()
        table.append(new)
        refs[new] = 1
        return None
    old = table[logical]
    if refs[old] == 1:  # held by this request alone: write in place
        return None
    new = free.pop()
    refs[old] -= 1
    refs[new] = 1
    table[logical] = new
    return old, new


def _cow_story():
    """A 6-slot prompt in blocks of 4, forked twice, then writes: ``(state, writes)``.

    The state is ``(tables, refs, free)`` after the forks: request 0 holds blocks 0 and 1, and the
    two forks hold the same ones (a fork copies the table, each block's count goes up)."""
    tables, refs, free = [[0, 1], [0, 1], [0, 1]], [3, 3, 0, 0, 0, 0, 0, 0], [7, 6, 5, 4, 3, 2]
    writes = [(1, 6), (1, 7), (1, 8), (2, 6), (0, 6), (2, 7), (2, 8), (0, 7)]  # at the tips
    return (tables, refs, free), writes


@check
def check_cow_write(fn) -> None:
    """``fn(tables, refs, free, request, slot, block)`` -> the copy, the state changed in place."""
    (tables, refs, free), writes = _cow_story()
    want_tables, want_refs, want_free = [list(t) for t in tables], list(refs), list(free)
    for request, slot in writes:
        before = f"tables {want_tables}, refs {want_refs}, free {want_free}"
        shared = slot // 4 < len(want_tables[request])
        old = want_tables[request][slot // 4] if shared else None
        want = cow_write_solution(want_tables, want_refs, want_free, request, slot, 4)
        got = attempt(fn, tables, refs, free, request, slot, 4)
        where = f"with {before}, request {request} writes slot {slot}"
        got = tuple(got) if isinstance(got, (tuple, list)) else got
        known = {None: f"Block {old} is held by {want_refs[old] + 1} tables: a write there would "
                       "change the other requests' K/V. Copy it to a new block first."
                 if want is not None else "",
                 want[::-1] if want else (): "The copy goes from the shared block to the new one."}
        if want is None and got is not None and shared:
            known[got] = "Only a shared block needs a copy: its last holder writes in place."
        expect(got == want, f"{where}: you returned {got}, want {want}.", hint(got, known))
        expect([list(t) for t in tables] == want_tables,
               f"{where}: tables became {tables}, want {want_tables}.",
               " The table must point at the new block." if want else "")
        expect(list(refs) == want_refs, f"{where}: refs became {refs}, want {want_refs}.",
               " The old block lost a holder: its count goes down by one." if want else "")
        expect(list(free) == want_free, f"{where}: free became {free}, want {want_free}.",
               " Take the next block from the free list: free.pop().")


# --- 1. capacity in pages: predict, then count -------------------------------------------------


def fits_solution(slots: list[int], budget_tokens: int, block: int) -> int:
    """How many requests, admitted in order, fit a pool of ``budget_tokens // block`` blocks: each
    holds ``ceil(n / block)`` blocks for its ``n`` slots, and admission stops at the first that
    does not fit (a server does not skip ahead of it)."""
    free = budget_tokens // block
    for count, n in enumerate(slots):
        need = -(-n // block)
        if need > free:
            return count
        free -= need
    return len(slots)


FITS_CASES = [([5, 16, 17, 3, 40], 64, 16), ([10, 40, 3], 48, 16), ([16, 16, 16, 16], 50, 16),
              ([1, 1, 1, 1, 1], 64, 32), ([100, 28, 300, 1], 512, 128), ([7] * 9, 40, 8)]


@check
def check_fits(fn) -> None:
    """``fn(slots, budget_tokens, block)`` -> how many requests of ``slots`` fit, in order."""
    for slots, budget, block in FITS_CASES:
        got = attempt(fn, list(slots), budget, block)
        want = fits_solution(slots, budget, block)
        by_tokens = next((i for i in range(len(slots)) if sum(slots[: i + 1]) > budget),
                         len(slots))
        floored = fits_solution([n // block * block for n in slots], budget, block)
        whole_pool = fits_solution(slots, -(-budget // block) * block, block)
        left, skipping = budget // block, 0  # admits later requests past one that does not fit
        for need in (-(-n // block) for n in slots):
            if need <= left:
                left, skipping = left - need, skipping + 1
        known = {by_tokens: "A request holds whole blocks: ceil(n / block) of them, not n slots.",
                 floored: "A request's last, partial block is held too: round the blocks up.",
                 whole_pool: "The pool holds whole blocks: budget_tokens // block of them.",
                 skipping: "Admission stops at the first request that does not fit: no skipping."}
        expect(got == want,
               f"slots {slots}, {budget} tokens of KV, block {block} "
               f"({budget // block} blocks): you said {got}, want {want}.", hint(got, known))


# --- 3. tensor parallelism: KV bytes per token on each GPU -----------------------------------


def kv_per_gpu_solution(config, dtype: torch.dtype, tp: int) -> int:
    """Each of ``tp`` GPUs holds ``ceil(Hkv / tp)`` KV heads of every layer: the heads are split,
    and past ``Hkv`` GPUs a head is copied, not split further. The ``tp`` values ``plan_budget``
    accepts (dividing the query heads, and dividing the KV heads or a multiple of them), so the
    notebook's table, this and the plan agree."""
    Hq, Hkv = config.num_attention_heads, kv_heads(config)
    if tp < 1 or Hq % tp or (Hkv % tp and tp % Hkv):
        raise ValueError(f"tp={tp} must divide the {Hq} query heads, and divide the {Hkv} KV "
                         f"heads or be a multiple of them")
    heads = -(-Hkv // tp)
    return kv_token_bytes(config.num_hidden_layers, heads, head_dim(config), dtype)


TP_CASES = [  # only tp values plan_budget accepts; most past the KV heads, beyond the tp table
    ("qwen3-4b", torch.bfloat16, 2), ("qwen3-4b", torch.bfloat16, 16),
    ("qwen2.5-3b", torch.bfloat16, 1), ("qwen2.5-3b", torch.bfloat16, 4),
    ("qwen2.5-3b", torch.bfloat16, 8), ("smollm2-135m", torch.float32, 9),
]
REFUSE_CASES = [  # tp divides the query heads, but neither divides the KV heads nor is a multiple
    ("llama-3.2-3b", torch.float16, 3), ("llama-3.2-3b", torch.float16, 12),
]


FRACTION = "A GPU cannot hold a fraction of a head: past Hkv GPUs each still holds one whole head."


@check
def check_kv_per_gpu(fn) -> None:
    """``fn(config, dtype, tp)`` -> KV bytes per token on each GPU, all layers, K and V; a
    ``ValueError`` naming ``tp`` and the KV heads where the heads cannot be shared out evenly."""
    for name, dtype, tp in TP_CASES:
        config = load_config(name)
        want = kv_per_gpu_solution(config, dtype, tp)
        whole = kv_per_gpu_solution(config, dtype, 1)
        try:
            got = attempt(fn, config, dtype, tp)
        except ValueError as err:  # a refusal where the heads do share out: say so, not crash
            expect(False, f"{name} ({kv_heads(config)} KV heads), tp={tp}: you raised "
                          f"ValueError({str(err)!r}), want {want:,} B per token per GPU: "
                          f"{tp} GPUs can share {kv_heads(config)} KV heads.")
        expect(got == want,
               f"{name} ({kv_heads(config)} KV heads) in {str(dtype).removeprefix('torch.')}, "
               f"tp={tp}: you said {got}, want {want:,} B per token per GPU "
               f"({whole:,} B on one GPU).",
               hint(got, {whole / tp: FRACTION, whole // tp: FRACTION,  # split past Hkv
                          whole: "The KV heads are split across the GPUs.",
                          0: "Rounding the heads down leaves a GPU with none: past Hkv GPUs each "
                             "still holds one whole head."}))
    for name, dtype, tp in REFUSE_CASES:
        config = load_config(name)
        Hkv = kv_heads(config)
        where = (f"{name} ({config.num_attention_heads} query heads, {Hkv} KV heads), tp={tp}")
        try:
            got = attempt(fn, config, dtype, tp)
        except ValueError as err:
            expect(f"tp={tp}" in str(err) and str(Hkv) in str(err),
                   f"{where}: your ValueError says {str(err)!r}; it should name tp={tp} and the "
                   f"{Hkv} KV heads, so the reader sees why.")
            continue
        expect(False, f"{where}: you returned {got}, want a ValueError: {tp} GPUs cannot "
                      f"share {Hkv} KV heads evenly ({tp} neither divides {Hkv} nor is a "
                      "multiple of it).")
