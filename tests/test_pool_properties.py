"""Properties of the block pool: random programs of requests over one BlockPool, with and without
the prefix cache, every operation checked against transformers and against a snapshot.

A program (a hypothesis state machine) starts requests -- fresh, on a system prompt cut at a block
boundary or not, or on an earlier chat resent -- runs further chat turns on live ones, forks, crops
(and redoes: crop, then the same tokens again) and resets them, and asks for more blocks than the
pool has (a prompt, after a prefix hit too, or a direct write); small pools make it evict. After
every operation:

- a block's reference count is the number of live block tables holding it; free, held and idle
  blocks are disjoint and make up the pool; a request holds its slots rounded up to a block;
- a request not operated on reads exactly the bytes it read before, the one operated on exactly
  the slots it kept: nothing a live request holds is freed, evicted or overwritten;
- every live request holds transformers' K and V for its own tokens, and every prefix-index entry
  transformers' K and V for the token prefix its key names;
- a refused prompt or write leaves the pool and every request exactly as they were, byte for byte
  (a request that runs out in a decode step has lost the turn: the program resets it);
- every turn's tokens equal transformers' greedy ``generate`` over the request's whole history.

Runs are derandomized (the same programs in CI and here); the slow test runs more, longer ones. A
failing program hypothesis shrinks is kept below as an ordinary test that replays it.
"""

from collections import Counter

import pytest
import torch
from helpers import SHARED, tiny_model
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvlib import generate
from kvlib.paged_cache import BlockPool, OutOfBlocks, PagedCache

VOCAB = SHARED["vocab_size"]
_draw = torch.Generator().manual_seed(3)
SYSTEM = torch.randint(0, VOCAB, (24,), generator=_draw).tolist()  # the prompt requests share
FILLER = torch.randint(0, VOCAB, (64,), generator=_draw).tolist()  # makes a prompt too long
TOKENS = st.lists(st.integers(0, VOCAB - 1), max_size=6)
PICK = st.integers(0, 999)  # which live request, modulo how many there are
MODEL = tiny_model("llama")
# kvlib and transformers add in other orders (a prefix cached from another request's chunks); a
# wrong prefix's K and V differ by about their own size
CLOSE = dict(rtol=1e-4, atol=1e-4)
RUNS = Counter()  # programs and operations tried, by kind: the figures the issue asks for

FAST = settings(max_examples=35, stateful_step_count=15, deadline=None, derandomize=True,
                database=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(FAST, max_examples=150, stateful_step_count=30)


class Request:
    """A live request: its cache, the tokens its slots hold, the tokens made but not yet fed."""

    def __init__(self, cache, history=(), pending=()):
        self.cache, self.history, self.pending = cache, list(history), list(pending)


def same(x, y):
    return len(x) == len(y) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(x, y))


class PoolPrograms(RuleBasedStateMachine):
    @initialize(n_blocks=st.integers(4, 20), block=st.sampled_from([2, 3, 4]),
                prefix_cache=st.booleans())
    def make_pool(self, n_blocks, block, prefix_cache):
        self.pool = BlockPool.for_model(MODEL.config, n_blocks, block, device="cpu",
                                        dtype=torch.float32, prefix_cache=prefix_cache)
        self.live, self.chats = [], []  # chats: every history seen, to resend
        self.hf_kv, self.serials = {}, {}  # tokens -> transformers' K/V; parent -> its prefix
        allocate = self.pool.allocate

        def counted():  # counts the evictions
            RUNS["evictions"] += not self.pool.free
            return allocate()

        self.pool.allocate = counted
        RUNS["programs"] += 1

    # --- what is compared ---------------------------------------------------------------------

    def snapshot(self):
        pool = self.pool
        return (list(pool.free), list(pool.refs), dict(pool.cached), dict(pool.key_of),
                list(pool.idle), list(pool.epoch), pool.k.clone(), pool.v.clone(),
                [(list(r.cache.table), r.cache.seq_len, list(r.cache.tokens)) for r in self.live])

    def reads(self):
        return {id(r): [torch.cat(r.cache.view(layer, r.cache.seq_len))
                        for layer in range(r.cache.n_layers)] for r in self.live}

    def hf_greedy(self, tokens, new):
        """transformers' greedy tokens after ``tokens``; its K and V are kept for reference()."""
        ids = torch.tensor([tokens])
        out = MODEL.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, return_dict_in_generate=True)
        made = out.sequences[0].tolist()
        self.hf_kv[tuple(made[:-1])] = torch.stack([torch.stack([x.keys[0], x.values[0]])
                                                    for x in out.past_key_values.layers])
        return made[len(tokens):]

    def reference(self, tokens):
        """transformers' K and V for ``tokens``, ``[L, 2, Hkv, S, D]``: causal, so those of any
        sequence kept that starts with them."""
        n = len(tokens)
        for seq, kv in self.hf_kv.items():
            if len(seq) >= n and list(seq[:n]) == tokens:
                return kv[..., :n, :]
        self.hf_greedy(tokens + [0], 1)  # K and V of exactly `tokens`
        return self.reference(tokens)

    def prefix_of(self, key):
        """The tokens a prefix-index key names: its parent's prefix, then its own tokens."""
        parent, tokens = key
        if parent is not None and parent not in self.serials:
            b, epoch = parent
            assert self.pool.key_of.get(b) and self.pool.epoch[b] == epoch, (
                f"key {key} names parent {parent}, never a keyed block")
            self.serials[parent] = self.prefix_of(self.pool.key_of[b])
        return (self.serials[parent] if parent else []) + list(tokens)

    def check(self, before, touched=None, kept=0):
        """Every invariant of the module docstring; ``touched`` kept its first ``kept`` slots."""
        pool, blk = self.pool, self.pool.block
        held = Counter(b for r in self.live for b in r.cache.table)
        assert pool.refs == [held[b] for b in range(pool.n_blocks)]
        free, idle = set(pool.free), set(pool.idle)
        assert len(free) == len(pool.free) and not (free & idle) and not (free | idle) & set(held)
        assert len(free) + len(held) + len(idle) == pool.n_blocks == len(free | idle | set(held))
        assert pool.used == len(held) and idle <= set(pool.key_of)
        assert {b: k for k, b in pool.cached.items()} == pool.key_of
        assert pool.prefix_cache or not pool.cached
        for r in self.live:
            c, n = r.cache, r.cache.seq_len
            assert n == len(r.history) and c.tokens[:n] == r.history
            assert len(c.table) == -(-n // blk)
            now = [torch.cat(c.view(layer, n)) for layer in range(c.n_layers)]
            if n:
                torch.testing.assert_close(torch.stack(now), self.reference(r.history), **CLOSE)
            if id(r) in before:
                keep = kept if r is touched else n
                assert all(torch.equal(a[..., :keep, :], b[..., :keep, :])
                           for a, b in zip(before[id(r)], now)), "a held slot was changed"
        for key, b in pool.cached.items():
            prefix = self.prefix_of(key)
            assert len(prefix) % blk == 0 and len(key[1]) == blk
            block = torch.stack([pool.k[:, :, b], pool.v[:, :, b]], 1)  # [L, 2, Hkv, blk, D]
            torch.testing.assert_close(block, self.reference(prefix)[..., -blk:, :], **CLOSE)
            serial = (b, pool.epoch[b])
            assert self.serials.setdefault(serial, prefix) == prefix, f"{serial} changed prefix"

    # --- the operations -----------------------------------------------------------------------

    def turn(self, r, prompt, new):
        """One chat turn of ``r``: generate, then compare with transformers and the snapshot."""
        before, state, n0 = self.reads(), self.snapshot(), len(r.history)
        try:
            gen = generate(MODEL, torch.tensor([prompt]), new, cache=r.cache, eos_token_id=None)
        except (OutOfBlocks, ValueError) as e:
            assert isinstance(e, OutOfBlocks) or "KV overflow" in str(e), e
            if r.cache.seq_len < n0 + len(prompt):  # refused before the prompt was in
                RUNS["refused prompts" if isinstance(e, OutOfBlocks) else "KV overflows"] += 1
                assert same(self.snapshot(), state), "a refused prompt changed the pool"
                assert r in self.live or not r.cache.table
                return self.check(before, r, n0)
            RUNS["ran out decoding"] += 1  # its tokens are lost: a server frees the request
            r.cache.reset()
            self.live = [x for x in self.live if x is not r]
            return self.check(before)
        RUNS["turns"] += 1
        assert gen.tokens == self.hf_greedy(r.history + prompt, new)
        assert gen.cached_tokens % self.pool.block == 0 and gen.cached_tokens < len(prompt)
        assert self.pool.prefix_cache or not gen.cached_tokens
        r.history, r.pending = r.history + prompt + gen.tokens[:-1], gen.tokens[-1:]
        if r not in self.live:
            self.live.append(r)
        self.chats.append(r.history + r.pending)
        self.check(before, r, n0)

    @rule(source=st.sampled_from(["fresh", "system", "chat"]), cut=st.integers(0, 30),
          pick=PICK, suffix=TOKENS, long=st.booleans(), new=st.integers(1, 4))
    def start(self, source, cut, pick, suffix, long, new):
        """A new request: a fresh prompt, a shared one cut anywhere, or a chat resent."""
        chats = self.chats or [SYSTEM]
        prefix = {"fresh": [], "system": SYSTEM, "chat": chats[pick % len(chats)]}[source][:cut]
        prompt = prefix + suffix or [0]
        if long:  # the most the pool could hold: refused unless nearly all of it is free
            prompt += FILLER[: self.pool.n_blocks * self.pool.block - new - len(prompt)]
        self.turn(Request(PagedCache(self.pool)), prompt, new)

    @precondition(lambda self: self.live)
    @rule(pick=PICK, suffix=TOKENS, new=st.integers(1, 4))
    def chat(self, pick, suffix, new):
        """The next turn of a live request: its last token, then the user's."""
        r = self.live[pick % len(self.live)]
        self.turn(r, r.pending + suffix or [0], new)

    @precondition(lambda self: self.live)
    @rule(pick=PICK)
    def fork(self, pick):
        before, r = self.reads(), self.live[pick % len(self.live)]
        self.live.append(Request(r.cache.fork(), r.history, r.pending))
        RUNS["forks"] += 1
        self.check(before)

    @precondition(lambda self: self.live)
    @rule(pick=PICK, to=st.integers(0, 999))
    def crop(self, pick, to):
        before, r = self.reads(), self.live[pick % len(self.live)]
        n = to % (r.cache.seq_len + 1)
        r.cache.crop(n)
        r.history, r.pending = r.history[:n], []
        RUNS["crops"] += 1
        self.check(before, r, n)

    @precondition(lambda self: self.live)
    @rule(pick=PICK, to=st.integers(0, 999), new=st.integers(1, 4))
    def redo(self, pick, to, new):
        """Back to slot ``to``, then the same tokens again (as a rejected draft's rollback does):
        its new blocks equal the ones it dropped, which the prefix index may still hold."""
        r = self.live[pick % len(self.live)]
        n = to % (r.cache.seq_len + 1)
        again = r.history[n:] + r.pending
        self.crop(pick, n)
        self.turn(r, again or [0], new)

    @precondition(lambda self: self.live)
    @rule(pick=PICK)
    def reset(self, pick):
        before, r = self.reads(), self.live.pop(pick % len(self.live))
        r.cache.reset()
        RUNS["resets"] += 1
        self.check(before)

    @rule(pick=PICK)
    def overfill(self, pick):
        """A direct write of every slot left in the pool, into a live request or a new one,
        where fewer blocks are available than it needs: refused, nothing changed."""
        r = ([*self.live, None])[pick % (len(self.live) + 1)]
        cache = PagedCache(self.pool) if r is None else r.cache
        n = cache.max_seq - cache.seq_len
        if self.pool.available >= self.pool.n_blocks - len(cache.table):
            return  # the write would fit
        before, state = self.reads(), self.snapshot()
        k = torch.zeros(n, cache.n_kv_heads, cache.head_dim)
        with pytest.raises(OutOfBlocks, match=rf"{self.pool.available} of {self.pool.n_blocks}"):
            cache.write(0, cache.seq_len, k, k)
        assert same(self.snapshot(), state) and (r is not None or not cache.table)
        RUNS["refused writes"] += 1
        self.check(before)


def report(name):
    print(f"{name}: {dict(RUNS)}, {sum(v for k, v in RUNS.items() if k != 'programs')} operations")


def test_random_programs_over_a_block_pool_keep_every_invariant():
    RUNS.clear()
    run_state_machine_as_test(PoolPrograms, settings=FAST)
    report("fast")


@pytest.mark.slow
def test_more_and_longer_random_programs_keep_every_invariant():
    RUNS.clear()
    run_state_machine_as_test(PoolPrograms, settings=SLOW)
    report("slow")


# --- the programs hypothesis shrank to, kept as ordinary tests --------------------------------


def test_a_prompt_refused_after_a_prefix_hit_holds_no_block():
    # it held the cached block it found, then its prefill ran out: the pool kept the hold
    state = PoolPrograms()
    state.make_pool(n_blocks=4, prefix_cache=True, block=2)
    state.start(cut=3, long=False, new=1, pick=0, source="system", suffix=[])
    state.start(cut=21, long=True, new=1, pick=0, source="chat", suffix=[])
    state.teardown()


def test_a_redone_turn_chained_onto_its_own_evicted_block_keeps_its_next_turn():
    # issue 33's item 2, as hypothesis found it: the redone blocks chain onto the idle ones they
    # equal; those are evicted; the next remember raised KeyError and lost the turn
    state = PoolPrograms()
    state.make_pool(n_blocks=14, prefix_cache=True, block=2)
    state.start(cut=0, long=True, new=1, pick=0, source="fresh", suffix=[])
    state.chat(new=1, pick=0, suffix=[])
    state.crop(pick=0, to=776)
    state.redo(new=1, pick=0, to=971)
    state.redo(new=1, pick=0, to=14)
    state.teardown()
