"""Fair share inside a lane (shared/fairshare.py), its scripts run on a real Redis (and a
real Redis Cluster): the order in which tasks of several tenants leave a lane, their cost
in tokens, the share of a tier, the window of unread entries, the refusal threshold, and
the state that is left once the lane is drained."""

from __future__ import annotations

import pytest

from streamfleet.shared.fairshare import ENQUEUE_LUA, FAIR_READ_LUA, enqueue_call, prompt_cost, read_call
from streamfleet.shared.keys import GROUP, Keys

MODEL, LANE = "m", "normal"


class Lane:
    """One lane of a model, fed and read through the fleet's own scripts."""

    def __init__(self, rds, prefix: str, cluster: bool, window: int = 1, threshold: int = 0) -> None:
        self.rds, self.keys = rds, Keys(prefix, cluster)
        self.window, self.threshold = window, threshold
        self.stream = self.keys.lane(MODEL, LANE)
        self.fair = self.keys.fair(MODEL, LANE)
        rds.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        self._enqueue = rds.register_script(ENQUEUE_LUA)
        self._read = rds.register_script(FAIR_READ_LUA)

    def send(self, tenant: str, name: str, tokens: int = 10, share: float = 1.0, cap: int | None = None,
             routed: str = "") -> int:
        """Enqueue task ``name`` (``routed``: to that worker's affinity stream); the lane's
        depth after it (0: the lane is full; -1: the tenant's ``cap`` of waiting tokens
        refused it)."""
        target = self.keys.affinity(MODEL, LANE, routed) if routed else self.stream
        source = f"{LANE}@{routed}" if routed else LANE
        keys, args = enqueue_call(self.keys, MODEL, LANE, target, (), threshold=self.threshold,
                                  task=name.encode(), source=source, tenant=tenant,
                                  cost=prompt_cost(tokens, share), window=self.window, ttl_s=60, tokens=tokens,
                                  max_queued_tokens=cap)
        ok, depth = self._enqueue(keys=list(keys), args=list(args))
        return -1 if ok == 2 else int(depth) if ok else 0

    def take(self, n: int = 1, consumer: str = "w1") -> list[str]:
        """What a worker with ``n`` free slots reads (and finishes at once: XACK + XDEL)."""
        keys, args = read_call(self.keys, MODEL, LANE, consumer, n, window=self.window, ttl_s=60)
        res = self._read(keys=list(keys), args=list(args))
        out = []
        for _stream, entries in res or []:
            for mid, fields in entries:
                self.rds.xack(self.stream, GROUP, mid)
                self.rds.xdel(self.stream, mid)
                out.append(dict(zip(fields[::2], fields[1::2], strict=True))[b"task"].decode())
        return out

    def drain(self) -> list[str]:
        out: list[str] = []
        while got := self.take():
            out += got
        return out

    def waiting(self) -> int:
        return int(self.rds.llen(self.fair.queued))


@pytest.fixture
def lane(rds, broker, key_prefix):
    return Lane(rds, key_prefix, broker.cluster)


@pytest.mark.both_brokers
def test_a_lone_tenant_keeps_its_order_and_is_never_held_back(lane):
    for i in range(8):
        lane.send("key:a", f"a{i}")
    # one released at once (the window an idle worker's read wakes on), the rest wait
    assert lane.rds.xlen(lane.stream) == 1 and lane.waiting() == 7
    assert lane.take(5) == [f"a{i}" for i in range(5)]
    assert lane.take(5) == [f"a{i}" for i in range(5, 8)]
    assert lane.waiting() == 0 and lane.rds.xlen(lane.stream) == 0


@pytest.mark.both_brokers
def test_a_light_tenant_goes_next_however_much_a_heavy_one_queued(lane):
    for i in range(10):
        lane.send("key:heavy", f"h{i}")
    lane.send("key:light", "l0")
    lane.send("key:light", "l1")
    order = lane.drain()
    # h0 left at once (the window); after it the two tenants alternate while both wait
    assert order[:5] == ["h0", "h1", "l0", "h2", "l1"], order
    assert sorted(order) == sorted([f"h{i}" for i in range(10)] + ["l0", "l1"])


@pytest.mark.both_brokers
def test_tenants_share_by_tokens_not_by_requests(lane):
    for i in range(4):
        lane.send("key:long", f"long{i}", tokens=100)
    for i in range(30):
        lane.send("key:short", f"short{i}", tokens=10)
    order = lane.drain()[1:]  # (the first left before the other tenant arrived)
    # each 100-token prompt is worth ten 10-token ones: about ten short ones per long one
    first_long = [i for i, name in enumerate(order) if name.startswith("long")][:2]
    assert 8 <= first_long[1] - first_long[0] <= 12, order


@pytest.mark.both_brokers
def test_a_tier_of_twice_the_share_is_served_twice_the_tokens(lane):
    for i in range(20):
        lane.send("key:gold", f"g{i}", share=2.0)
        lane.send("key:free", f"f{i}", share=1.0)
    order = lane.drain()[1:21]
    gold = sum(1 for name in order if name.startswith("g"))
    assert 12 <= gold <= 15, order  # two of every three


@pytest.mark.both_brokers
def test_a_tenant_that_was_idle_banks_no_credit(lane):
    for i in range(20):  # a alone: served without contention
        lane.send("key:a", f"a{i}")
    assert len(lane.drain()) == 20
    for i in range(5):
        lane.send("key:a", f"A{i}")
    for i in range(5):
        lane.send("key:b", f"b{i}")
    order = lane.drain()
    # b starts level with a, not 20 tasks ahead of it: a is not shut out while b catches up
    assert order[:6].count("A1") + order[:6].count("A2") == 2, order


@pytest.mark.both_brokers
def test_the_refusal_threshold_counts_the_tasks_that_wait(rds, broker, key_prefix):
    lane = Lane(rds, key_prefix, broker.cluster, threshold=5)
    depths = [lane.send("key:a", f"a{i}") for i in range(6)]
    assert depths == [1, 2, 3, 4, 5, 0]  # the sixth refused: 1 in the stream + 4 waiting
    assert lane.waiting() == 4


@pytest.mark.both_brokers
def test_a_key_past_its_cap_of_waiting_tokens_is_refused_before_anything_is_queued(lane):
    assert lane.send("key:a", "a0", tokens=500, cap=300) > 0  # left at once: nothing waits
    assert lane.send("key:a", "a1", tokens=500, cap=300) > 0  # one is taken whatever its size
    assert lane.send("key:a", "a2", tokens=10, cap=300) == -1  # 500 waiting: over the cap
    assert lane.send("key:b", "b0", tokens=10, cap=300) > 0  # another key's own cap
    assert lane.rds.hget(lane.fair.tokens, "key:a") == b"500" and lane.waiting() == 2
    assert lane.take(3) == ["a0", "a1", "b0"]  # (b was lifted to a's counter: a tie, a first)
    assert not lane.rds.exists(lane.fair.tokens)  # nothing waits: nothing counted
    assert lane.send("key:a", "a3", tokens=10, cap=300) > 0


@pytest.mark.both_brokers
def test_routed_tasks_keep_their_worker_until_its_stream_is_full_or_others_wait(lane):
    own = lane.keys.affinity(MODEL, LANE, "w1")
    for i in range(6):  # a burst on one prefix: four go to the worker that holds it
        lane.send("key:a", f"a{i}", routed="w1")
    assert lane.rds.xlen(own) == 4 and lane.rds.xlen(lane.stream) == 1 and lane.waiting() == 1
    lane.rds.xreadgroup(GROUP, "w1", {own: ">"}, count=4)  # w1 takes them
    lane.send("key:b", "b0")  # b waits beside a's last one: from now on routed tasks wait too
    lane.send("key:a", "a6", routed="w1")
    assert lane.rds.xlen(own) == 4 and lane.waiting() == 3  # (a5 and a6, b0)
    order = lane.drain()
    # b level with a (a tie: a's next first), then they alternate: a's routed a6 waited its turn
    assert order == ["a4", "a5", "b0", "a6"], order


@pytest.mark.both_brokers
def test_a_wider_window_leaves_more_unread_for_idle_workers(rds, broker, key_prefix):
    lane = Lane(rds, key_prefix, broker.cluster, window=3)
    for i in range(6):
        lane.send("key:a", f"a{i}")
    assert lane.rds.xlen(lane.stream) == 3 and lane.waiting() == 3
    assert lane.take(2) == ["a0", "a1"]
    assert lane.rds.xlen(lane.stream) == 3  # topped up to the window again


@pytest.mark.both_brokers
def test_a_drained_lane_leaves_only_bounded_expiring_state(lane):
    for t in range(20):
        lane.send(f"key:t{t}", f"x{t}")
    lane.drain()
    r = lane.rds
    assert r.zcard(lane.fair.waiting) == 0 and lane.waiting() == 0
    assert not r.exists(lane.fair.tasks) and not r.exists(lane.fair.ends) and not r.exists(lane.fair.tokens)
    # the counters kept are those above the lane's virtual time, and they expire
    assert r.zcard(lane.fair.seen) <= 20
    assert 0 < r.ttl(lane.fair.seen) <= 60 and 0 < r.ttl(lane.fair.vtime) <= 60
