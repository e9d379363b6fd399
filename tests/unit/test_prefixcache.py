"""The prefix cache's bookkeeping (workers/prefixcache.py) and the hash chain that names
its blocks (shared/prefixhash.py): pure logic, no engine."""

from __future__ import annotations

import numpy as np
import pytest

from streamfleet.shared.prefixhash import DIGEST_BYTES, block_hashes, namespace
from streamfleet.shared.schema import DoneEvent, decode_events, encode_events
from streamfleet.workers.prefixcache import PrefixCache


def kv(nbytes: int = 1024) -> list[np.ndarray]:
    return [np.zeros(nbytes // 4, dtype=np.float32)]


def test_a_name_stands_for_every_token_before_the_blocks_end():
    seed = namespace("m", "1")
    a = block_hashes(seed, list(range(40)), 8)
    assert len(a) == 5 and all(len(h) == DIGEST_BYTES for h in a) and len(set(a)) == 5
    b = block_hashes(seed, [*range(40), 1, 2, 3], 8)  # a longer prompt: same whole blocks, tail unnamed
    assert b == a
    c = block_hashes(seed, [99, *range(1, 40)], 8)  # the first token differs: every name differs
    assert not set(c) & set(a)
    d = block_hashes(seed, [*range(16), 99, *range(17, 40)], 8)  # block 2 differs: blocks 0-1 shared only
    assert d[:2] == a[:2] and not set(d[2:]) & set(a)
    assert block_hashes(seed, list(range(40)), 8, limit=2) == a[:2]
    assert block_hashes(seed, list(range(7)), 8) == []


def test_a_new_model_version_names_no_block_the_same():
    ids = list(range(64))
    assert not set(block_hashes(namespace("m", "1"), ids, 16)) & set(block_hashes(namespace("m", "2"), ids, 16))
    assert not set(block_hashes(namespace("m", "1"), ids, 16)) & set(block_hashes(namespace("n", "1"), ids, 16))
    with pytest.raises(ValueError):
        block_hashes(namespace("m", "1"), ids, 0)


def test_lookup_takes_the_longest_leading_run_and_leaves_a_token_to_compute():
    cache = PrefixCache(1 << 20, 4, "m", "1")
    ids = list(range(12))
    names = cache.hashes(ids)
    for n in names:
        cache.put(n, kv())
    got, run = cache.lookup(ids)  # 12 tokens = 3 whole blocks: reuses 2, the last ones are computed
    assert got == names and len(run) == 2
    _, run = cache.lookup([*ids, 50])  # 13: still 2 (at least two tokens are computed, never one)
    assert len(run) == 2
    _, run = cache.lookup([*ids, 50, 51])
    assert len(run) == 3
    other = [0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12]  # block 1 differs: only block 0
    _, run = cache.lookup(other)
    assert len(run) == 1
    _, run = cache.lookup([7, 7, 7, 7, 7])
    assert run == []
    st = cache.stats
    assert (st.lookups, st.hits) == (5, 4)
    assert st.requested_tokens == 12 + 13 + 14 + 13 + 5 and st.cached_tokens == 4 * (2 + 2 + 3 + 1)


def test_an_uncounted_lookup_and_what_is_held():
    """A finished reply's blocks computed while idle (workers/replykeep.py) look up without
    counting: no request asked; ``held`` says how far a chain is cached, not marking it."""
    cache = PrefixCache(1 << 20, 4, "m", "1")
    names = cache.hashes(list(range(16)))
    for n in names[:2]:
        cache.put(n, kv())
    cache.put(names[3], kv())
    assert cache.held(names) == 2 and cache.held(names[3:]) == 1 and cache.held([]) == 0
    assert cache.names()[0] == names[0]  # (not marked used)
    _, run = cache.lookup(list(range(16)), count=False)
    assert len(run) == 2 and cache.stats.lookups == 0 and cache.stats.requested_tokens == 0
    assert cache.names()[-1] == names[1]  # the run was marked used


def test_a_gap_ends_the_run():
    cache = PrefixCache(1 << 20, 4, "m", "1")
    ids = list(range(17))
    names = cache.hashes(ids)
    cache.put(names[0], kv())
    cache.put(names[2], kv())  # block 1 missing: block 2 cannot be used
    assert len(cache.lookup(ids)[1]) == 1


def test_least_recently_used_go_first_under_the_budget():
    cache = PrefixCache(3 * 1024, 4, "m", "1")
    names = [bytes([i]) * 8 for i in range(5)]
    for n in names[:3]:
        assert cache.put(n, kv())
    assert cache.bytes == 3 * 1024 and len(cache) == 3
    assert cache.touch(names[0])  # used: now the newest
    generation = cache.generation
    assert cache.put(names[3], kv())  # evicts names[1], the least recently used
    assert names[1] not in cache and names[0] in cache and cache.stats.evicted == 1
    assert cache.generation > generation
    assert not cache.put(names[0], kv())  # already held: not stored twice
    assert not cache.put(names[4], kv(4 * 1024))  # larger than the whole budget: not kept, nothing evicted
    assert len(cache) == 3 and cache.stats.stored == 4
    assert cache.names()[-1] == names[0]
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0 and not cache.touch(names[0])


def test_a_zero_budget_keeps_nothing():
    cache = PrefixCache(0, 4, "m", "1")
    assert not cache.put(b"x" * 8, kv())
    assert len(cache) == 0


def test_an_end_carries_its_cached_tokens_only_when_there_were_some():
    plain = DoneEvent("r", "stop", 5, 3, queue_ms=1.0)
    assert b"cached_tokens" not in encode_events([plain])  # the wire as before the cache
    assert decode_events(encode_events([plain])) == [plain] and plain.usage() == {"prompt_tokens": 5,
                                                                                  "completion_tokens": 3}
    hit = DoneEvent("r", "stop", 100, 3, cached_tokens=64)
    assert decode_events(encode_events([hit])) == [hit]
    assert hit.usage() == {"prompt_tokens": 100, "completion_tokens": 3, "cached_tokens": 64}
