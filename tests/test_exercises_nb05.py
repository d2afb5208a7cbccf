"""Notebook 05's exercise checks, and the wrong answers each must catch."""

from exercises import nb05
from helpers import check_tests

from kvlib.config import kv_bytes_per_token


def uncapped(max_seq, bucket, t):  # forgets that the last span stops at max_seq
    return (t // bucket + 1) * bucket, -(-max_seq // bucket)


def floor_graphs(max_seq, bucket, t):  # max_seq // bucket loses the last, partial bucket
    return min(max_seq, (t // bucket + 1) * bucket), max_seq // bucket


def rounds_t(max_seq, bucket, t):  # rounds t up, not t + 1: reads 0 slots at t = 0
    return min(max_seq, -(-t // bucket) * bucket), -(-max_seq // bucket)


def counts_new_slot_twice(max_seq, bucket, t):  # rounds t + 2 up: t = 255 reads 512
    return min(max_seq, ((t + 1) // bucket + 1) * bucket), -(-max_seq // bucket)


def _spans(max_seq, bucket, t0, steps):
    return [min(max_seq, (t // bucket + 1) * bucket) for t in range(t0, t0 + steps)]


def every_graph(config, dtype, max_seq, bucket, t0, steps):  # every bucket, not the trace's
    spans = _spans(max_seq, bucket, t0, steps)
    masked = sum(s - t - 1 for t, s in zip(range(t0, t0 + steps), spans))
    return -(-max_seq // bucket), masked * kv_bytes_per_token(config, dtype)


def new_slot_masked(config, dtype, max_seq, bucket, t0, steps):  # span - t: the new slot as waste
    spans = _spans(max_seq, bucket, t0, steps)
    masked = sum(s - t for t, s in zip(range(t0, t0 + steps), spans))
    return len(set(spans)), masked * kv_bytes_per_token(config, dtype)


def k_only(config, dtype, max_seq, bucket, t0, steps):  # counts K but not V
    graphs, masked = nb05.trace_waste_solution(config, dtype, max_seq, bucket, t0, steps)
    return graphs, masked // 2


def uncapped_trace(config, dtype, max_seq, bucket, t0, steps):  # the last span past max_seq
    spans = [(t // bucket + 1) * bucket for t in range(t0, t0 + steps)]
    masked = sum(s - t - 1 for t, s in zip(range(t0, t0 + steps), spans))
    return len(set(spans)), masked * kv_bytes_per_token(config, dtype)


CASES = [
    (nb05.check_bucket_plan, nb05.bucket_plan_solution,
     [uncapped, floor_graphs, rounds_t, counts_new_slot_twice]),
    (nb05.check_trace_waste, nb05.trace_waste_solution,
     [every_graph, new_slot_masked, k_only, uncapped_trace]),
]

test_check = check_tests(nb05, CASES)


def test_not_a_pair(capsys):
    nb05.check_bucket_plan(lambda max_seq, bucket, t: 256)
    nb05.check_trace_waste(lambda config, dtype, max_seq, bucket, t0, steps: 3)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all("pair" in line for line in out), out
