"""Notebook 07's exercise checks, and the wrong answers each must catch."""

import pytest
import torch
from exercises import nb07
from helpers import check_tests

from kvlib.budget import plan_budget
from kvlib.config import GIB, load_config


def cow_never_copies(tables, refs, free, request, slot, block):  # writes into the shared block
    if slot // block == len(tables[request]):
        return nb07.cow_write_solution(tables, refs, free, request, slot, block)
    return None


def cow_always_copies(tables, refs, free, request, slot, block):  # even a block held alone
    table, logical = tables[request], slot // block
    if logical == len(table):
        return nb07.cow_write_solution(tables, refs, free, request, slot, block)
    old, new = table[logical], free.pop()
    refs[old] -= 1
    refs[new] = 1
    table[logical] = new
    return old, new


def cow_keeps_count(tables, refs, free, request, slot, block):  # the old block keeps its holder
    copy = nb07.cow_write_solution(tables, refs, free, request, slot, block)
    if copy:
        refs[copy[0]] += 1
    return copy


def cow_swapped(tables, refs, free, request, slot, block):  # copies the new block onto the old
    copy = nb07.cow_write_solution(tables, refs, free, request, slot, block)
    return copy[::-1] if copy else copy


def cow_table_unchanged(tables, refs, free, request, slot, block):  # copies, but reads the old
    table = list(tables[request])
    copy = nb07.cow_write_solution(tables, refs, free, request, slot, block)
    if copy:
        tables[request][:] = table
    return copy


def fits_by_tokens(slots, budget_tokens, block):  # slots, not whole blocks
    return next((i for i in range(len(slots)) if sum(slots[: i + 1]) > budget_tokens), len(slots))


def fits_floor_blocks(slots, budget_tokens, block):  # forgets the last, partial block
    return nb07.fits_solution([n // block * block for n in slots], budget_tokens, block)


def fits_skips(slots, budget_tokens, block):  # admits later, smaller requests past one that waits
    free, count = budget_tokens // block, 0
    for n in slots:
        if -(-n // block) <= free:
            free, count = free - -(-n // block), count + 1
    return count


def fits_ceil_pool(slots, budget_tokens, block):  # a pool of ceil(budget / block) blocks
    return nb07.fits_solution(slots, -(-budget_tokens // block) * block, block)


def kv_split_fraction(config, dtype, tp):  # a fraction of a head per GPU past Hkv GPUs
    return nb07.kv_per_gpu_solution(config, dtype, 1) / tp


def kv_not_split(config, dtype, tp):
    return nb07.kv_per_gpu_solution(config, dtype, 1)


def kv_floor_heads(config, dtype, tp):  # rounds the heads per GPU down: 0 past Hkv GPUs
    heads = nb07.kv_heads(config) // tp
    return nb07.kv_token_bytes(config.num_hidden_layers, heads, nb07.head_dim(config), dtype)


def kv_never_refuses(config, dtype, tp):  # ceil(Hkv / tp) heads even where they cannot share out
    heads = -(-nb07.kv_heads(config) // tp)
    return nb07.kv_token_bytes(config.num_hidden_layers, heads, nb07.head_dim(config), dtype)


def kv_refuses_vaguely(config, dtype, tp):  # refuses without the numbers
    try:
        return nb07.kv_per_gpu_solution(config, dtype, tp)
    except ValueError:
        raise ValueError("bad tensor parallelism") from None


def kv_refuses_all_past_heads(config, dtype, tp):  # refuses whenever tp exceeds the KV heads
    if tp > nb07.kv_heads(config):
        raise ValueError(f"tp={tp} is more than the {nb07.kv_heads(config)} KV heads")
    return nb07.kv_per_gpu_solution(config, dtype, tp)


CASES = [
    (nb07.check_cow_write, nb07.cow_write_solution, [cow_never_copies, cow_always_copies,
                                                     cow_keeps_count, cow_swapped,
                                                     cow_table_unchanged]),
    (nb07.check_fits, nb07.fits_solution, [fits_by_tokens, fits_floor_blocks, fits_skips,
                                           fits_ceil_pool]),
    (nb07.check_kv_per_gpu, nb07.kv_per_gpu_solution, [kv_split_fraction, kv_not_split,
                                                       kv_floor_heads, kv_never_refuses,
                                                       kv_refuses_vaguely,
                                                       kv_refuses_all_past_heads]),
]

test_check = check_tests(nb07, CASES)


@pytest.mark.parametrize("name, dtype, tp", nb07.TP_CASES)
def test_kv_per_gpu_agrees_with_plan(name, dtype, tp):
    """The solution, the notebook's table and plan_budget price a GPU's KV the same way."""
    config = load_config(name)
    assert nb07.kv_per_gpu_solution(config, dtype, tp) == plan_budget(config, dtype, 12 * GIB,
                                                                        tp=tp).kv_per_token


def test_kv_per_gpu_refuses_what_plan_refuses():
    """SmolLM2's 9 query heads cannot be split over 2 GPUs: both say so, with the numbers."""
    config = load_config("smollm2-135m")
    for fn in (nb07.kv_per_gpu_solution, lambda c, d, tp: plan_budget(c, d, 12 * GIB, tp=tp)):
        with pytest.raises(ValueError, match="tp=2 must divide the 9 query heads"):
            fn(config, torch.float32, 2)


@pytest.mark.parametrize("name, dtype, tp", nb07.REFUSE_CASES)
def test_kv_per_gpu_refuses_uneven_heads(name, dtype, tp):
    """Where tp neither divides the KV heads nor is a multiple, the solution and the plan refuse."""
    config = load_config(name)
    for fn in (nb07.kv_per_gpu_solution, lambda c, d, tp: plan_budget(c, d, 12 * GIB, tp=tp)):
        with pytest.raises(ValueError, match=f"tp={tp} must divide"):
            fn(config, dtype, tp)
