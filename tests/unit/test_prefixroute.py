"""Prefix-aware routing's choice, without I/O (gateway/requests/prefixroute.py; docs/architecture.md,
"Prefix-aware routing"): the worker where a task would start soonest wins (the prompt
tokens it would prefill, plus a step's work for each task ahead there), a burst routed in
one loop turn is spread by the gateway's own ledger, and only live, free, advertising
workers are candidates."""

from __future__ import annotations

from streamfleet.gateway.requests.prefixroute import (
    LEDGER_S,
    MAX_ROUTE_BLOCKS,
    Ledger,
    candidates,
    choose,
    held_tokens,
    leading_run,
    lookup_plan,
    sample,
    sample_positions,
)
from streamfleet.shared.prefixhash import block_hashes, namespace
from streamfleet.shared.schema import Heartbeat, Wake

NOW = 1_000_000.0


def hb(wid: str, used: int = 0, max_batch: int = 8, age: float = 0.1, version: str = "1", **kw) -> Heartbeat:
    return Heartbeat(NOW - age, slots_used=used, max_batch=max_batch, version=version, worker_id=wid, **kw)


def test_the_leading_run_stops_at_the_first_miss() -> None:
    assert leading_run([]) == 0
    assert leading_run([0, 1, 1]) == 0  # a later block is no use without the first
    assert leading_run([1, 1, 0, 1]) == 2
    assert leading_run([1, 1, 1]) == 3
    assert leading_run([True, False]) == 1


def test_the_worker_where_the_task_starts_soonest_wins() -> None:
    # the prompt tokens to prefill, plus 256 for each task ahead
    assert choose({"a": 64, "b": 960, "c": 32}, {"a": 0, "b": 0, "c": 0}, 1000, 256) == "b"  # holds most
    assert choose({"a": 64, "b": 960}, {"a": 0, "b": 7}, 1000, 256) == "a"  # ... but 7 tasks ahead cost more
    assert choose({"a": 960, "b": 960}, {"a": 4, "b": 2}, 1000, 256) == "b"  # equal holds: the less busy
    assert choose({"a": 960, "b": 960}, {"a": 2, "b": 2}, 1000, 256) == "a"  # then the lowest id: gateways agree
    assert choose({"a": 0, "b": 0}, {}, 1000, 256) is None  # nobody holds the first block: the shared lane
    assert choose({"a": 0, "b": 960}, {"a": 0, "b": 9}, 1000, 256) == "a"  # a cold worker, when the holder is busy
    assert choose({}, {}, 1000, 256) is None
    assert choose({"a": 64, "b": 960}, {"a": 0, "b": 7}, 1000, 0) == "b"  # no weight on load: the longest run


def test_a_sampled_run_tells_the_tokens_held() -> None:
    assert sample_positions(5, 32) == [0, 1, 2, 3, 4]
    assert sample_positions(100, 3) == [0, 50, 99] and sample_positions(100, 1) == [0]
    assert held_tokens(0, 100, 3, 32) == 0
    assert held_tokens(2, 100, 3, 32) == 51 * 32  # up to block 50
    assert held_tokens(3, 100, 3, 32) == 100 * 32
    assert held_tokens(4, 5, 32, 32) == 4 * 32


def test_the_ledger_counts_a_routed_task_until_a_look_up_can_see_it() -> None:
    ledger = Ledger()
    ledger.chosen("a", "r1")
    ledger.chosen("a", "r2")
    assert ledger.uncounted("a", sent_at=10.0, now=10.0) == 2  # being enqueued: no length counts them yet
    assert ledger.uncounted("b", sent_at=10.0, now=10.0) == 0
    ledger.enqueued("a", "r1", ok=True, now=10.5)
    ledger.enqueued("a", "r2", ok=False, now=10.5)  # refused (overloaded): never there
    assert ledger.uncounted("a", sent_at=10.2, now=10.6) == 1  # sent before r1 was in: it missed r1
    assert ledger.uncounted("a", sent_at=10.6, now=10.7) == 0  # sent after: XLEN counted it
    ledger.enqueued("a", "unknown", ok=True, now=11.0)  # (not routed by this ledger: nothing)
    assert ledger.uncounted("a", sent_at=0.0, now=10.5 + LEDGER_S + 0.1) == 1  # counted once more, then
    assert ledger.uncounted("a", sent_at=0.0, now=20.0) == 0  # forgotten


def test_candidates_are_fresh_free_serving_and_advertising() -> None:
    workers = [hb("ok"), hb("stale", age=5.0), hb("full", used=8), hb("draining", draining=True),
               hb("reloading", reloading=True), hb("silent"), hb("busy", used=3)]
    got = candidates(workers, {"ok", "stale", "full", "draining", "reloading", "busy"}, NOW, fresh_s=2.0)
    assert [w.worker_id for w in got] == ["ok", "busy"]  # least busy first
    assert candidates(workers, set(), NOW, fresh_s=2.0) == []  # nobody advertises: no look-up at all
    many = [hb(f"w{i:02d}", used=i % 4) for i in range(40)]
    top = candidates(many, {w.worker_id for w in many}, NOW, fresh_s=2.0, limit=5)
    assert [w.worker_id for w in top] == ["w00", "w04", "w08", "w12", "w16"]


def test_the_chain_is_computed_per_version_and_bounded() -> None:
    ids = list(range(100, 100 + 64 * 40))
    workers = [hb("a", version="1"), hb("b", version="2"), hb("c", version="1")]
    plan = lookup_plan("m", ids, 64, workers)
    chain1, chain2 = block_hashes(namespace("m", "1"), ids, 64), block_hashes(namespace("m", "2"), ids, 64)
    assert plan["a"] == plan["c"] == sample(chain1, MAX_ROUTE_BLOCKS)
    assert plan["b"] == sample(chain2, MAX_ROUTE_BLOCKS)
    assert plan["a"] != plan["b"]  # another version names its blocks otherwise
    assert len(plan["a"]) == MAX_ROUTE_BLOCKS  # not the prompt's 40 blocks...
    # ... but spread over all of them, first and last included, in order
    assert plan["a"][0] == chain1[0] and plan["a"][-1] == chain1[-1]
    assert [chain1.index(n) for n in plan["a"]] == sorted({chain1.index(n) for n in plan["a"]})
    short = ids[:64 * 5]
    assert lookup_plan("m", short, 64, workers)["a"] == chain1[:5]  # few blocks: every one
    # many candidates share the bound on names looked up, one block each at least
    crowd = [hb(f"w{i}") for i in range(100)]
    sizes = {len(v) for v in lookup_plan("m", ids, 64, crowd, max_lookups=256).values()}
    assert sizes == {2}
    assert {len(v) for v in lookup_plan("m", ids, 64, crowd, max_lookups=10).values()} == {1}
    # shorter than a block: nothing to look up
    assert lookup_plan("m", ids[:63], 64, workers) == {}
    assert lookup_plan("m", ids, 64, []) == {}


def test_a_wake_names_the_worker_a_task_was_routed_to() -> None:
    routed = Wake.decode(b"normal@host-12-ab 1700000000000-3")
    assert routed == Wake("normal@host-12-ab", (1700000000000, 3)) and routed.worker == "host-12-ab"
    assert Wake.decode(routed.encode()) == routed
    assert Wake.decode(b"high 5-0").worker == ""


def test_a_long_conversation_goes_to_the_worker_holding_most_of_it() -> None:
    """Both workers hold a system prompt of 20 blocks; only one holds the 50 blocks of
    history after it: sampled names beyond the first 32 blocks tell them apart."""
    ids = list(range(100, 100 + 64 * 70))
    chain = block_hashes(namespace("m", "1"), ids, 64)
    plan = lookup_plan("m", ids, 64, [hb("a"), hb("b")])
    held = {"a": set(chain[:20]), "b": set(chain)}
    runs = {w: leading_run(n in held[w] for n in names) for w, names in plan.items()}
    assert runs["b"] > runs["a"] > 0
    per = len(plan["a"])
    held_by = {w: held_tokens(r, len(chain), per, 64) for w, r in runs.items()}
    assert held_by["a"] <= 20 * 64 < 64 * 60 <= held_by["b"]
    assert choose(held_by, {"a": 0, "b": 3}, len(ids), 256) == "b"  # 50 blocks to prefill outweigh 3 tasks
    assert sample(chain, 1) == [chain[0]] and sample(chain[:3], 8) == chain[:3]


def test_the_work_ahead_is_the_routed_tasks_read_fresh_and_the_shared_ones() -> None:
    from streamfleet.gateway.requests.prefixroute import work_ahead

    # 4 slots in use by the last heartbeat, but the stream (read just now) holds 1:
    # three routed tasks ended since; one task came from the shared lanes
    assert work_ahead(hb("a", used=4, shared_used=1), routed=1) == 2
    assert work_ahead(hb("a", used=4), routed=1) == 4  # a heartbeat that does not say: the larger
    assert work_ahead(hb("a", used=0), routed=3) == 3
