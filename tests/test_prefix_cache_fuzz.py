"""Randomized run of a prefix-caching scheduler with a tiny cache and heavy prefix
sharing, driven like an engine (pipelined plans, aborts, stop tokens, preemption).
A fake model reads its "KV" back from the blocks the plans name, so a block shared
wrongly or evicted while in use changes the tokens. Checked at every step: each block's
refcount equals the number of requests holding it, and free + used + cached-free blocks
add up to the cache; at the end, every request finished or was aborted, and every
finished one produced the tokens of an uncached run."""
import hashlib
import random
from collections import Counter

import pytest

from sarathi_rt.scheduler import get_policy, SchedulerConfig, available_policies, create_scheduler

BS, NUM_BLOCKS, VOCAB = 4, 10, 50


def next_token(seq: list[int]) -> int:
    return hashlib.blake2b(bytes(seq), digest_size=2).digest()[0] % VOCAB


def stops(token: int) -> bool:
    return token % 7 == 0


def uncached(prompt: list[int], max_new: int) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_new:
        out.append(next_token(seq))
        seq.append(out[-1])
        if stops(out[-1]):
            break
    return out


def check_blocks(s) -> None:
    holders = {id(r): r for r in s._running.values()}
    holders.update((id(r), r) for reqs in s._pending.values() for r in reqs)  # incl. aborted in flight
    users = Counter(b for r in holders.values() for b in r.blocks)
    refs = [s._blocks.refcount(b) for b in range(NUM_BLOCKS)]
    assert refs == [users[b] for b in range(NUM_BLOCKS)]
    used = sum(1 for r in refs if r > 0)
    cached_free = s.num_cached_free_blocks
    free = s.num_free_blocks - cached_free
    assert free + used + cached_free == NUM_BLOCKS and free >= 0


class Driver:
    """An engine stand-in: request token lists, a fake KV cache, plans in flight."""

    def __init__(self, s) -> None:
        self.s = s
        self.seqs: dict[int, list[int]] = {}
        self.outs: dict[int, list[int]] = {}
        self.kv = [[-1] * BS for _ in range(NUM_BLOCKS)]
        self.in_flight: list[tuple] = []
        self.finished: set[int] = set()

    def submit(self) -> None:
        plan = self.s.schedule()
        self.in_flight.append((plan, {e.request_id: self.s.block_table(e.request_id) for e in plan.entries}))

    def complete(self) -> None:
        """Run the oldest plan: write each chunk's KV, read the prefix back, sample."""
        plan, tables = self.in_flight.pop(0)
        stopped = []
        for e in plan.entries:
            table, seq = tables[e.request_id], self.seqs.get(e.request_id)
            if seq is None:  # aborted while in flight
                continue
            for p in range(e.start_pos, e.start_pos + e.num_tokens):
                self.kv[table[p // BS]][p % BS] = seq[p]
            read = [self.kv[table[p // BS]][p % BS] for p in range(e.start_pos + e.num_tokens)]
            assert read == seq[:len(read)], f"request {e.request_id} read wrong KV"
            if e.emits_token:
                token = next_token(read)
                seq.append(token)
                self.outs[e.request_id].append(token)
                if stops(token):
                    stopped.append(e.request_id)
        for rid in self.s.update(plan, stopped):
            self.finished.add(rid)
            del self.seqs[rid]
        check_blocks(self.s)


def run(policy: str, seed: int, steps: int) -> dict:
    rng = random.Random(seed)
    s = create_scheduler(SchedulerConfig(policy=policy, token_budget=40, max_num_seqs=4,
                                                **({"chunk_size": 6} if get_policy(policy).chunked else {}),
                                         block_size=BS, num_blocks=NUM_BLOCKS, watermark=0.0,
                                         enable_prefix_caching=True))
    d = Driver(s)
    bases = [[rng.randrange(1, VOCAB) for _ in range(16)] for _ in range(3)]
    want: dict[int, list[int]] = {}
    aborted: set[int] = set()
    added = 0
    for _ in range(steps):
        if rng.random() < 0.3 and len(d.seqs) < 8:
            prompt = rng.choice(bases)[:rng.randrange(0, 17)] + \
                [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 5))]
            max_new = rng.randrange(1, 42 - len(prompt))
            s.add_request(added, len(prompt), max_new, prompt_token_ids=prompt)
            d.seqs[added], want[added], d.outs[added] = list(prompt), uncached(prompt, max_new), []
            added += 1
        if d.seqs and rng.random() < 0.04:
            rid = rng.choice(sorted(d.seqs))
            assert s.abort(rid)
            aborted.add(rid)
            del d.seqs[rid]
        if len(d.in_flight) < rng.choice((1, 2)):
            d.submit()
        if d.in_flight and (len(d.in_flight) == 2 or rng.random() < 0.7):
            d.complete()
    while d.in_flight:
        d.complete()
    for _ in range(10_000):
        if not s.has_unfinished():
            break
        d.submit()
        d.complete()
    assert d.finished | aborted == set(range(added)) and not d.finished & aborted
    for rid in d.finished:
        assert d.outs[rid] == want[rid], f"request {rid}"
    assert s.num_free_blocks == NUM_BLOCKS
    return {"added": added, "stats": s.prefix_cache_stats()}


@pytest.mark.parametrize("policy", available_policies())
def test_random_runs_keep_blocks_consistent_and_tokens_exact(policy):
    res = run(policy, 0, 3000)
    st = res["stats"]
    assert res["added"] > 700 and st.hits > 0 and st.evictions > 0, res


@pytest.mark.slow
@pytest.mark.parametrize("policy", available_policies())
def test_long_random_runs(policy):
    for seed in range(1, 5):
        res = run(policy, seed, 20_000)
        assert res["added"] > 4000 and res["stats"].hits > 0, res
