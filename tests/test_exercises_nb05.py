"""Notebook 05's exercise checks, and the wrong answers each must catch."""

from exercises import nb05
from helpers import check_tests

from kvlib import graphs
from kvlib.config import kv_bytes_per_token


def floor_bucket(config, dtype, max_seq, max_graphs, limit):  # rounds down: one graph too many
    bucket = max(1, max_seq // max_graphs)
    masked = (min(bucket, max_seq) - 1) * kv_bytes_per_token(config, dtype)
    return (bucket, masked) if masked <= limit else None


def whole_bucket_masked(config, dtype, max_seq, max_graphs, limit):  # counts the new slot too
    bucket = -(-max_seq // max_graphs)
    masked = min(bucket, max_seq) * kv_bytes_per_token(config, dtype)
    return (bucket, masked) if masked <= limit else None


def _pick(config, dtype, max_seq, max_graphs):
    # The right bucket and its bytes, written here: the check hides nb05's own solution.
    bucket = -(-max_seq // max_graphs)
    return bucket, (min(bucket, max_seq) - 1) * kv_bytes_per_token(config, dtype)


def strict_limit(config, dtype, max_seq, max_graphs, limit):  # < where the limit allows <=
    bucket, masked = _pick(config, dtype, max_seq, max_graphs)
    return (bucket, masked) if masked < limit else None


def ignores_limit(config, dtype, max_seq, max_graphs, limit):  # never says no bucket fits
    return _pick(config, dtype, max_seq, max_graphs)


def biggest_bucket(config, dtype, max_seq, max_graphs, limit):  # fewest graphs, most masked
    masked = (max_seq - 1) * kv_bytes_per_token(config, dtype)
    return (max_seq, masked) if masked <= limit else None


def calls_span(config, dtype, max_seq, max_graphs, limit):  # asks kvlib instead of building it
    graphs.span(0, 1, max_seq)
    return _pick(config, dtype, max_seq, max_graphs)


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
    spans = _spans(max_seq, bucket, t0, steps)
    masked = sum(s - t - 1 for t, s in zip(range(t0, t0 + steps), spans))
    return len(set(spans)), masked * kv_bytes_per_token(config, dtype) // 2


def uncapped_trace(config, dtype, max_seq, bucket, t0, steps):  # the last span past max_seq
    spans = [(t // bucket + 1) * bucket for t in range(t0, t0 + steps)]
    masked = sum(s - t - 1 for t, s in zip(range(t0, t0 + steps), spans))
    return len(set(spans)), masked * kv_bytes_per_token(config, dtype)


CASES = [
    (nb05.check_pick_bucket, nb05.pick_bucket_solution,
     [floor_bucket, whole_bucket_masked, strict_limit, ignores_limit, biggest_bucket]),
    (nb05.check_trace_waste, nb05.trace_waste_solution,
     [every_graph, new_slot_masked, k_only, uncapped_trace]),
]

test_check = check_tests(nb05, CASES, notes={nb05.check_trace_waste: "buckets of 1,024: 2 graphs"})


def test_not_a_pair(capsys):
    nb05.check_pick_bucket(lambda config, dtype, max_seq, max_graphs, limit: 256)
    nb05.check_trace_waste(lambda config, dtype, max_seq, bucket, t0, steps: 3)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all("pair" in line for line in out), out


def test_helpers_hidden(capsys):
    """kvlib's span rule and the reference solutions are what the exercises build: hidden."""
    nb05.check_pick_bucket(calls_span)
    nb05.check_trace_waste(lambda *args: nb05.trace_waste_solution(*args))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2, out
    assert "`span`" in out[0] and "`trace_waste_solution`" in out[1], out
