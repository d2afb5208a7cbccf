"""Notebook 07's exercise checks, and the wrong answers each must catch."""

import torch
from exercises import nb07
from helpers import check_tests


def lookup_logical(table, block, slot):  # forgets the table
    return slot // block, slot % block


def lookup_swapped(table, block, slot):
    return slot % block, table[slot // block]


def lookup_no_offset(table, block, slot):  # the slot, not its offset in the block
    return table[slot // block], slot


def gather_by_number(pool_k, table, seq):  # the right blocks, in the pool's order
    return nb07.gather_solution(pool_k, sorted(table[: -(-seq // pool_k.shape[2])]), seq)


def gather_not_cut(pool_k, table, seq):  # whole blocks: the tail of the last one too
    n = -(-seq // pool_k.shape[2])
    gathered = pool_k.index_select(1, torch.tensor(table[:n]))  # [Hkv, n, block, D]
    return gathered.reshape(1, pool_k.shape[0], -1, pool_k.shape[3])


def gather_first_blocks(pool_k, table, seq):  # blocks 0, 1, ... as if the table were the identity
    return nb07.gather_solution(pool_k, list(range(len(table))), seq)


def kv_split_fraction(config, dtype, tp):  # a fraction of a head per GPU past Hkv GPUs
    return nb07.kv_per_gpu_solution(config, dtype, 1) / tp


def kv_not_split(config, dtype, tp):
    return nb07.kv_per_gpu_solution(config, dtype, 1)


def kv_floor_heads(config, dtype, tp):  # rounds the heads per GPU down: 0 past Hkv GPUs
    heads = nb07.kv_heads(config) // tp
    return nb07.kv_token_bytes(config.num_hidden_layers, heads, nb07.head_dim(config), dtype)


CASES = [
    (nb07.check_lookup, nb07.lookup_solution, [lookup_logical, lookup_swapped, lookup_no_offset]),
    (nb07.check_gather, nb07.gather_solution, [gather_by_number, gather_not_cut,
                                               gather_first_blocks]),
    (nb07.check_kv_per_gpu, nb07.kv_per_gpu_solution, [kv_split_fraction, kv_not_split,
                                                       kv_floor_heads]),
]

test_check = check_tests(nb07, CASES)
