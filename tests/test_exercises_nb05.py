"""Notebook 05's exercise checks, and the wrong answers each must catch."""

from exercises import nb05
from helpers import check_tests

from kvlib.config import kv_bytes_per_token


def uncapped(max_seq, bucket, t):  # forgets that the last span stops at max_seq
    return -(-t // bucket) * bucket, -(-max_seq // bucket)


def floor_graphs(max_seq, bucket, t):  # max_seq // bucket loses the last, partial bucket
    return min(max_seq, -(-t // bucket) * bucket), max_seq // bucket


def off_by_one(max_seq, bucket, t):  # rounds the position, not the count: t=256 reads 512
    return min(max_seq, (t // bucket + 1) * bucket), -(-max_seq // bucket)


def k_only(config, dtype, max_seq, t):  # counts K but not V
    return (max_seq - t) * kv_bytes_per_token(config, dtype) // 2


def one_too_many(config, dtype, max_seq, t):  # max_seq - t + 1 slots
    return (max_seq - t + 1) * kv_bytes_per_token(config, dtype)


CASES = [
    (nb05.check_bucket_plan, nb05.bucket_plan_solution, [uncapped, floor_graphs, off_by_one]),
    (nb05.check_mask_extra_bytes, nb05.mask_extra_bytes_solution, [k_only, one_too_many]),
]

test_check = check_tests(nb05, CASES)


def test_not_a_pair(capsys):
    nb05.check_bucket_plan(lambda max_seq, bucket, t: 256)
    assert "pair" in capsys.readouterr().out
