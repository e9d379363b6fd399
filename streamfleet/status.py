"""`streamfleet status`: what the fleet is doing, read straight from Redis.

One snapshot is a handful of read-only commands per model (see ``docs/status.md`` for
the ``redis-cli`` equivalent of every field):

* lanes: ``XLEN`` (backlog: queued + in flight, since workers XDEL what they ack),
  ``XINFO GROUPS`` (``pending`` = in flight, ``lag`` = not yet read; Redis < 7 has no
  ``lag``, so it is derived as ``XLEN - pending``), ``XPENDING``
  (the oldest delivery: its age since enqueue and its idle time) and ``XRANGE`` after
  the group's last-delivered id (the oldest task still waiting for a worker);
* workers: ``HGETALL {prefix}:workers:{model}``; an entry whose heartbeat is older than
  ``worker_ttl_s`` is marked stale (its worker is gone or hung). A lane's consumers are
  the live workers that read it (every live, not draining worker of the model reads all
  its lanes), not ``XINFO GROUPS``' count: Redis adds a consumer to the group only when
  a read first hands it an entry, so a worker that has not had a task yet (a speech
  worker before the first utterance) is missing there, and one that has gone stays
  until deleted. That count is kept as ``group_consumers``;
* affinity streams (prefix-aware routing: the tasks of a lane a gateway sent to one
  worker, ``{prefix}:{model}:tasks:{lane}:@{worker}``, listed in the set
  ``{prefix}:{model}:affinity``): read as the lanes and counted in their lane (backlog,
  queued, in flight, the oldest of each), ``affinity_length`` of the backlog being theirs;
* tasks waiting for their tenant's turn (fair share, shared/fairshare.py): ``LLEN`` of
  ``{prefix}:{model}:fair:{lane}:queued``, counted in their lane's backlog and queue;
  ``ZCARD`` of ``{prefix}:{model}:fair:{lane}`` (the tenants waiting) and ``HGET`` of the
  first 100 of them in ``…:ends`` (their queues' first and last numbers) for the five
  with the most waiting;
* dead letters: ``XLEN`` and ``XREVRANGE … COUNT n`` of ``{prefix}:{model}:dead``;
* gateways: ``PUBSUB CHANNELS {prefix}:gateway:*`` (each gateway holds one control
  subscription), and ``PUBSUB NUMSUB {prefix}:cancel`` (workers listening for cancels).

Models are the folders of the model repository plus any model that has a worker hash;
each one's kind (text, asr, embedding) is its ``engine.toml``'s, where the repository has
it, and says what its workers' figures mean: a text worker's rate is of the tokens it
generates, an embedding worker's of the input tokens it embeds, and a speech worker
reports none; only a text worker has a prefix cache.
``collect`` gathers a ``FleetStatus``; ``render`` draws it as plain text; ``run_status``
is the command (``--watch`` redraws until Ctrl-C, ``--json`` prints JSON).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import orjson
import redis

from streamfleet.local import mask_url
from streamfleet.shared.keys import GROUP, LANES, Keys, split_source
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.redis import SyncRedis, stream_entries, sync_client
from streamfleet.shared.schema import DeadLetter, Heartbeat
from streamfleet.shared.settings import CommonSettings

__all__ = ["LaneStatus", "WorkerStatus", "DeadLetterStatus", "ModelStatus", "FleetStatus", "collect", "render",
           "run_status", "mask_url"]

#: dead letters shown per model
DEAD_SHOWN = 3


@dataclass(slots=True)
class PendingEntry:
    """The oldest delivery of a lane (lowest id in ``XPENDING``)."""

    id: str
    consumer: str
    #: seconds since the task was enqueued (from the entry id's timestamp, Redis clock)
    age_s: float
    #: seconds since its worker last touched it (live workers refresh every second)
    idle_s: float
    deliveries: int


@dataclass(slots=True)
class QueuedEntry:
    """The oldest task no worker has read yet."""

    id: str
    age_s: float


@dataclass(slots=True)
class LaneStatus:
    lane: str
    key: str
    exists: bool
    #: XLEN: queued + in flight
    length: int = 0
    #: queued, not yet read by any worker
    lag: int | None = None
    #: "xinfo" (Redis >= 7 reports it) or "derived" (XLEN - pending)
    lag_source: str = "xinfo"
    #: delivered to a worker, not yet acked
    pending: int = 0
    #: live workers reading the lane (every live, not draining worker of the model)
    consumers: int = 0
    #: XINFO GROUPS' count: consumers Redis has handed an entry of the lane, live or gone
    group_consumers: int = 0
    last_delivered_id: str | None = None
    oldest_pending: PendingEntry | None = None
    oldest_queued: QueuedEntry | None = None
    #: the stream exists but the group "workers" does not (no worker ever started)
    no_group: bool = False
    #: prefix-aware routing: the lane's affinity streams (one per worker gateways sent
    #: tasks to), and the part of the figures above that is theirs: backlog, queued
    affinity_streams: int = 0
    affinity_length: int = 0
    affinity_lag: int = 0
    #: fair share (shared/fairshare.py): tasks waiting for their tenant's turn (counted in
    #: ``length`` and ``lag`` too), how many tenants they belong to, and the tenants with
    #: the most waiting: ``[tenant, tasks]`` (a key's id, never its secret)
    waiting: int = 0
    waiting_tenants: int = 0
    top_waiting: list[list[Any]] = field(default_factory=list)


@dataclass(slots=True)
class WorkerStatus:
    id: str
    slots_used: int | None
    max_batch: int | None
    tokens_per_s: float | None
    heartbeat_age_s: float | None
    pid: int | None
    host: str | None
    draining: bool
    #: heartbeat older than worker_ttl_s, or unreadable
    stale: bool
    #: its prefix cache: blocks, bytes, share of looked-up prompt tokens it had (None: no cache)
    cache_blocks: int | None = None
    cache_bytes: int | None = None
    cache_hit_rate: float | None = None
    #: the execution mode its engine runs and why (shared/execution.py); None: not said
    execution: str | None = None
    execution_why: str | None = None
    #: a text model's step target in ms (``SF_STEP_TARGET_MS``; 0: none) and the step costs
    #: it learned (``shared.schema.Heartbeat.step_costs``); None: not said
    step_target_ms: float | None = None
    step_costs: dict[str, float] | None = None


@dataclass(slots=True)
class DeadLetterStatus:
    id: str
    age_s: float
    reason: str
    lane: str | None
    worker: str | None
    request_id: str | None


@dataclass(slots=True)
class ModelStatus:
    name: str
    #: its engine.toml's kind ("text", "asr", "embedding"); None where the model
    #: repository lacks the model (a worker hash is all there is of it)
    kind: str | None = None
    lanes: list[LaneStatus] = field(default_factory=list)
    workers: list[WorkerStatus] = field(default_factory=list)
    dead_key: str = ""
    dead_count: int = 0
    dead_latest: list[DeadLetterStatus] = field(default_factory=list)
    #: cluster: the primary (host:port) that holds the model's lanes (their hash slot)
    shard: str | None = None
    slot: int | None = None

    @property
    def live_workers(self) -> list[WorkerStatus]:
        return [w for w in self.workers if not w.stale]


@dataclass(slots=True)
class ShardStatus:
    """One primary of a Redis Cluster."""

    node: str
    slots: int
    replicas: list[str]
    keys: int
    used_memory: int
    ops_per_s: int
    #: sharded channels subscribed on it (reply channels, control channels)
    channels: int
    models: list[str] = field(default_factory=list)


@dataclass(slots=True)
class FleetStatus:
    redis_url: str
    key_prefix: str
    #: unix seconds of the snapshot (Redis TIME)
    time: float
    redis_version: str
    gateways: list[str]
    cancel_listeners: int
    worker_ttl_s: float
    models: list[ModelStatus]
    #: cluster mode: one entry per primary (empty on a single server)
    shards: list[ShardStatus] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for m, md in zip(self.models, out["models"]):
            md["live_workers"] = len(m.live_workers)
            md["stale_workers"] = len(m.workers) - len(m.live_workers)
            md["backlog"] = sum(lane.length for lane in m.lanes)
        out["gateway_count"] = len(self.gateways)
        return out


def _s(v: object) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _id_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def _model_names(r: SyncRedis, keys: Keys, repo: ModelRepository) -> list[str]:
    names = set(repo.names())
    head = keys.workers("")
    for key in r.scan_iter(match=head.replace("*", r"\*").replace("?", r"\?") + "*", count=200):
        name = _s(key)[len(head):]
        if name:
            names.add(name)
    return sorted(names)


#: tenants looked at for the ones with the most tasks waiting, and how many are shown
WAITING_LOOKED, WAITING_SHOWN = 100, 5


def _add_waiting(r: SyncRedis, keys: Keys, model: str, st: LaneStatus) -> None:
    """The lane's tasks that wait for their tenant's turn (``LLEN`` of its ``queued``
    list), counted in its backlog and queue, and the tenants with the most of them among
    the ``WAITING_LOOKED`` served least so far (those next in turn)."""
    fair = keys.fair(model, st.lane)
    st.waiting = int(r.llen(fair.queued))
    if not st.waiting:
        return
    st.length += st.waiting
    st.lag = (st.lag or 0) + st.waiting
    st.waiting_tenants = int(r.zcard(fair.waiting))
    tenants = [_s(t) for t in r.zrange(fair.waiting, 0, WAITING_LOOKED - 1)]
    counts = []
    for t in tenants:  # a tenant's queue: its first and last number ("<first> <last>")
        first, _, last = _s(r.hget(fair.ends, t) or "1 0").partition(" ")
        counts.append(int(last) - int(first) + 1)
    st.top_waiting = [[t, n] for n, t in sorted(zip(counts, tenants, strict=True), key=lambda p: -p[0])[:WAITING_SHOWN]]


def _lane(r: SyncRedis, lane: str, key: str, now_ms: int) -> LaneStatus:
    st = LaneStatus(lane=lane, key=key, exists=bool(r.exists(key)))
    if not st.exists:
        st.lag = 0
        return st
    st.length = int(r.xlen(key))
    try:
        groups = r.xinfo_groups(key)
    except redis.ResponseError:
        groups = []
    group = next((g for g in groups if _s(g.get("name")) == GROUP), None)
    if group is None:
        st.no_group = True
        st.lag, st.lag_source = st.length, "derived"
        return st
    st.pending = int(group.get("pending") or 0)
    st.group_consumers = int(group.get("consumers") or 0)
    st.last_delivered_id = _s(group.get("last-delivered-id") or "0-0")
    lag = group.get("lag")
    if lag is None:  # Redis < 7, or a lag Redis cannot compute: backlog minus in flight
        st.lag, st.lag_source = max(0, st.length - st.pending), "derived"
    else:
        st.lag = int(lag)
    if st.pending:
        summary = r.xpending(key, GROUP)
        lowest = summary.get("min")
        if lowest:
            lowest = _s(lowest)
            rows = r.xpending_range(key, GROUP, min=lowest, max=lowest, count=1)
            if rows:
                row = rows[0]
                st.oldest_pending = PendingEntry(
                    id=lowest, consumer=_s(row["consumer"]),
                    age_s=max(0.0, (now_ms - _id_ms(lowest)) / 1000),
                    idle_s=int(row["time_since_delivered"]) / 1000,
                    deliveries=int(row["times_delivered"]))
    if st.lag:
        first = r.xrange(key, min="(" + st.last_delivered_id, max="+", count=1)
        if first:
            fid = _s(first[0][0])
            st.oldest_queued = QueuedEntry(id=fid, age_s=max(0.0, (now_ms - _id_ms(fid)) / 1000))
    return st


def _add_affinity(st: LaneStatus, aff: LaneStatus) -> None:
    """Count one affinity stream of the lane (read like a lane) in the lane's figures."""
    st.affinity_streams += 1
    if not aff.exists:
        return
    st.exists = True
    st.length += aff.length
    st.affinity_length += aff.length
    st.affinity_lag += aff.lag or 0
    st.lag = (st.lag or 0) + (aff.lag or 0)
    if aff.lag_source == "derived":
        st.lag_source = "derived"
    st.pending += aff.pending
    if aff.oldest_pending is not None and (st.oldest_pending is None
                                           or aff.oldest_pending.age_s > st.oldest_pending.age_s):
        st.oldest_pending = aff.oldest_pending
    if aff.oldest_queued is not None and (st.oldest_queued is None
                                          or aff.oldest_queued.age_s > st.oldest_queued.age_s):
        st.oldest_queued = aff.oldest_queued


def _workers(r: SyncRedis, key: str, now: float, ttl_s: float) -> list[WorkerStatus]:
    out = []
    for wid, blob in sorted(r.hgetall(key).items()):
        try:
            hb = Heartbeat.decode(blob, wid)
        except ValueError:
            out.append(WorkerStatus(_s(wid), None, None, None, None, None, None, False, True))
            continue
        age = hb.age(now)
        cached = bool(hb.cache_blocks or hb.cache_bytes or hb.cache_hit_rate)  # (else None: no cache)
        out.append(WorkerStatus(
            id=hb.worker_id, slots_used=hb.slots_used, max_batch=hb.max_batch, tokens_per_s=hb.tokens_per_s,
            heartbeat_age_s=age, pid=hb.pid, host=hb.host, draining=hb.draining, stale=age > ttl_s,
            cache_blocks=hb.cache_blocks if cached else None, cache_bytes=hb.cache_bytes if cached else None,
            cache_hit_rate=hb.cache_hit_rate if cached else None,
            execution=hb.execution or None, execution_why=hb.execution_why if hb.execution else None,
            step_target_ms=hb.step_target_ms if hb.step_costs else None, step_costs=hb.step_costs or None))
    return out


def _dead(r: SyncRedis, key: str, now_ms: int, n: int) -> tuple[int, list[DeadLetterStatus]]:
    count = int(r.xlen(key))
    latest = []
    if count:
        for entry_id, fields in stream_entries(r.xrevrange(key, max="+", min="-", count=n)):
            dead = DeadLetter.decode(fields)
            eid = _s(entry_id)
            latest.append(DeadLetterStatus(id=eid, age_s=max(0.0, (now_ms - _id_ms(eid)) / 1000),
                                           reason=dead.reason or "?", lane=dead.lane or None,
                                           worker=dead.worker or None, request_id=dead.request_id))
    return count, latest


def collect(r: SyncRedis, settings: CommonSettings, models: list[str] | None = None) -> FleetStatus:
    """One snapshot of the fleet (read-only commands only).

    Args:
        r: a synchronous client of the fleet's Redis.
        settings: key prefix, model repository and worker TTL.
        models: only these models; default: the repository's and any with a worker hash.

    Raises:
        redis.RedisError: Redis is unreachable or answered with an error.
    """
    keys = settings.keys()
    sec, usec = r.time()
    now_ms = int(sec) * 1000 + int(usec) // 1000
    now = time.time()  # heartbeats are written with the workers' clocks, like the gateways read them
    repo = ModelRepository(settings.engines_dir)
    names = models or _model_names(r, keys, repo)
    out = []
    for name in names:
        m = ModelStatus(name=name, kind=repo.kind(name), dead_key=keys.dead(name))
        m.workers = _workers(r, keys.workers(name), now, settings.worker_ttl_s)
        readers = sum(1 for w in m.live_workers if not w.draining)
        routed = sorted(_s(k) for k in r.smembers(keys.affinity_streams(name)))
        for lane in LANES:
            st = _lane(r, lane, keys.lane(name, lane), now_ms)
            for key in routed:
                source = keys.affinity_source_of(name, key)
                if source is not None and split_source(source)[0] == lane:
                    _add_affinity(st, _lane(r, lane, key, now_ms))
            _add_waiting(r, keys, name, st)
            st.consumers = readers
            m.lanes.append(st)
        m.dead_count, m.dead_latest = _dead(r, m.dead_key, now_ms, DEAD_SHOWN)
        out.append(m)
    head = f"{keys.prefix}:gateway:"
    if settings.redis_cluster:
        return _collect_cluster(r, settings, keys, head, now_ms, out)
    gateways = sorted(_s(c)[len(head):] for c in r.pubsub_channels(head + "*"))
    numsub = r.pubsub_numsub(keys.cancel(""))
    info = r.info("server")
    return FleetStatus(redis_url=mask_url(settings.redis_url), key_prefix=keys.prefix, time=now_ms / 1000,
                       redis_version=str(info.get("redis_version", "?")), gateways=gateways,
                       cancel_listeners=int(numsub[0][1]) if numsub else 0,
                       worker_ttl_s=settings.worker_ttl_s, models=out)


def _collect_cluster(r, settings: CommonSettings, keys: Keys, head: str, now_ms: int,
                     models: list[ModelStatus]) -> FleetStatus:
    """A cluster's status: every primary asked for its own part (sharded channels, key
    count, memory), each model placed on the primary owning its lanes' slot."""
    from redis.crc import key_slot

    primaries = r.get_primaries()
    replicas_of: dict[str, list[str]] = {}
    slots_of: dict[str, int] = {}
    for start, end, primary, *replicas in (_slot_ranges(r)):
        slots_of[primary] = slots_of.get(primary, 0) + end - start + 1
        replicas_of.setdefault(primary, [])
        replicas_of[primary] += [x for x in replicas if x not in replicas_of[primary]]
    shards = []
    gateways: set[str] = set()
    version = "?"
    for node in sorted(primaries, key=lambda n: n.name):
        chans = [_s(c) for c in r.execute_command("PUBSUB SHARDCHANNELS", target_nodes=node)]
        gateways.update(c[len(head):] for c in chans if c.startswith(head))
        info = r.info(target_nodes=node)
        version = str(info.get("redis_version", version))
        shards.append(ShardStatus(node=node.name, slots=slots_of.get(node.name, 0),
                                  replicas=sorted(replicas_of.get(node.name, [])),
                                  keys=int(r.execute_command("DBSIZE", target_nodes=node)),
                                  used_memory=int(info.get("used_memory", 0)),
                                  ops_per_s=int(info.get("instantaneous_ops_per_sec", 0)), channels=len(chans)))
    by_name = {sh.node: sh for sh in shards}
    listeners = 0
    for m in models:
        m.slot = key_slot(keys.lane(m.name, "high").encode())
        node = r.nodes_manager.get_node_from_slot(m.slot)
        m.shard = node.name
        if node.name in by_name:
            by_name[node.name].models.append(m.name)
        numsub = r.execute_command("PUBSUB SHARDNUMSUB", keys.cancel(m.name), target_nodes=node)
        listeners += sum(int(count) for _, count in numsub)
    return FleetStatus(redis_url=mask_url(settings.redis_url), key_prefix=keys.prefix, time=now_ms / 1000,
                       redis_version=version, gateways=sorted(gateways), cancel_listeners=listeners,
                       worker_ttl_s=settings.worker_ttl_s, models=models, shards=shards)


def _slot_ranges(r) -> list[tuple]:
    """``CLUSTER SLOTS`` as ``(start, end, primary host:port, replica host:port...)``."""
    out = []
    for (start, end), where in (r.execute_command("CLUSTER SLOTS", target_nodes=r.get_random_node()) or {}).items():
        primary = where["primary"]
        names = [f"{_s(h)}:{p}" for h, p in [primary, *where.get("replicas", [])]]
        out.append((int(start), int(end), *names))
    return out


# -- text ---------------------------------------------------------------------------

def _age(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _table(headers: list[str], rows: list[list[str]], right: set[int], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(parts)).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def step_costs_line(target_ms: float, costs: dict[str, float]) -> str:
    """A worker's step target and learned costs, in a line (docs/status.md)."""
    c = costs.get
    target = f"target {target_ms:g} ms" if target_ms else "no target (SF_STEP_TARGET_MS 0)"
    steps = int(c("steps", 0))
    if not steps:
        return f"{target}; no step timed yet"
    return (f"{target}; learned over {steps} steps: {c('call_ms', 0):.1f} ms an engine call"
            f" + {c('seq_ms', 0):.2f} ms a decoding sequence + {c('kpos_ms', 0):.2f} ms per 1k positions of cache"
            f" + {c('token_ms', 0):.3f} ms a prompt token (+{c('token_kpos_ms', 0):.3f} per 1k positions before it);"
            f" last chunk {int(c('chunk', 0))} tokens")


def render(st: FleetStatus) -> str:
    """The snapshot as a plain-text report."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.time))
    lines = [f"streamfleet status  {stamp}  redis {st.redis_url} (v{st.redis_version}, prefix {st.key_prefix})"]
    gws = ", ".join(st.gateways) if st.gateways else "none"
    lines.append(f"gateways: {len(st.gateways)} connected ({gws})   cancel listeners: {st.cancel_listeners}")
    if st.shards:
        lines.append("")
        lines.append(f"redis cluster: {len(st.shards)} shards")
        rows = [[sh.node, str(sh.slots), ", ".join(sh.replicas) or "none", str(sh.keys),
                 f"{sh.used_memory / 2**20:.1f} MiB", str(sh.ops_per_s), str(sh.channels),
                 ", ".join(sh.models) or "-"] for sh in st.shards]
        lines += _table(["primary", "slots", "replicas", "keys", "memory", "ops/s", "channels", "model lanes"],
                        rows, right={1, 3, 4, 5, 6})
    if not st.models:
        lines.append("\nno models found (no model folder and no worker hash)")
    for m in st.models:
        live = len(m.live_workers)
        stale = len(m.workers) - live
        backlog = sum(lane.length for lane in m.lanes)
        lines.append("")
        kind = f" ({m.kind})" if m.kind not in (None, "text") else ""
        lines.append(f"model {m.name}{kind}: backlog {backlog}, {live} live worker{'s' if live != 1 else ''}"
                     + (f", {stale} stale" if stale else "") + f", {m.dead_count} dead letter"
                     + ("s" if m.dead_count != 1 else "")
                     + (f"; lanes on {m.shard} (slot {m.slot})" if m.shard else ""))
        rows = []
        for lane in m.lanes:
            if not lane.exists:
                rows.append([lane.lane, "0", "0", "0", str(lane.consumers), "-", "-", "(no stream yet)"])
                continue
            op = lane.oldest_pending
            oq = lane.oldest_queued
            note = "no group 'workers' yet" if lane.no_group else ("lag derived: XLEN-pending"
                                                                    if lane.lag_source == "derived" else "")
            if lane.affinity_length:
                routed = f"{lane.affinity_length} routed ({lane.affinity_lag} queued)"
                note = f"{note}; {routed}" if note else routed
            if lane.waiting:
                most = ", ".join(f"{t} {n}" for t, n in lane.top_waiting)
                turn = (f"{lane.waiting} waiting their tenant's turn ({lane.waiting_tenants} "
                        f"tenant{'s' if lane.waiting_tenants != 1 else ''}; most: {most})")
                note = f"{note}; {turn}" if note else turn
            rows.append([lane.lane, str(lane.length), str(lane.lag if lane.lag is not None else "?"),
                         str(lane.pending), str(lane.consumers), _age(oq.age_s) if oq else "-",
                         f"{_age(op.age_s)} (idle {_age(op.idle_s)}, {op.consumer}, x{op.deliveries})" if op else "-",
                         note])
        lines += _table(["lane", "backlog", "queued", "in flight", "consumers", "oldest queued",
                         "oldest in flight", "note"], rows, right={1, 2, 3, 4})
        if m.workers:
            lines.append("")
            # what a worker's figures mean depends on its model's kind: a text worker's rate
            # is of tokens generated and it may have a prefix cache; an embedding worker's
            # rate is of input tokens embedded, and it has no cache; a speech worker has neither
            rate = {"embedding": "input tokens/s", "asr": None}.get(m.kind or "text", "tokens/s")
            cached = m.kind in (None, "text")
            headers = ["worker", "state", "slots", *([rate] if rate else []), *(["prefix cache"] if cached else []),
                       "heartbeat", "pid", "host"]
            rows = []
            for w in m.workers:
                slots = f"{w.slots_used}/{w.max_batch}" if w.max_batch is not None else "?"
                tps = f"{w.tokens_per_s:.1f}" if isinstance(w.tokens_per_s, (int, float)) else "?"
                hb = f"{_age(w.heartbeat_age_s)} ago" if w.heartbeat_age_s is not None else "?"
                state = "STALE" if w.stale else ("draining" if w.draining else "live")
                cache = (f"{w.cache_blocks} blocks, {w.cache_bytes / 2**20:.0f} MiB, hit {w.cache_hit_rate:.0%}"
                         if w.cache_blocks is not None and w.cache_bytes is not None else "-")  # (set together)
                rows.append([w.id, state, slots, *([tps] if rate else []), *([cache] if cached else []), hb,
                             str(w.pid or "?"), str(w.host or "?")])
            right = {headers.index(h) for h in ("slots", rate, "heartbeat", "pid") if h}
            lines += _table(headers, rows, right=right)
            # the execution modes the workers run, each once with why (shared/execution.py)
            modes: dict[tuple[str, str], list[str]] = {}
            for w in m.workers:
                if w.execution:
                    modes.setdefault((w.execution, w.execution_why or ""), []).append(w.id)
            for (mode, why), ids in modes.items():
                who = "every worker" if len(ids) == len(m.workers) else ", ".join(ids)
                lines.append(f"  execution ({who}): {mode}: {why}")
            # each text worker's step target and the step costs it learned (workers/stepcost.py)
            for w in m.workers:
                if w.step_costs:
                    lines.append(f"  steps ({w.id}): {step_costs_line(w.step_target_ms or 0.0, w.step_costs)}")
        else:
            lines.append("  workers: none registered")
        if m.dead_latest:
            lines.append(f"  latest dead letters ({m.dead_key}):")
            for d in m.dead_latest:
                rid = f" request {d.request_id}" if d.request_id else ""
                lines.append(f"    {d.id}  {_age(d.age_s)} ago  lane {d.lane or '?'}{rid}: {d.reason}")
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------

CLEAR = "\x1b[H\x1b[2J"


def run_status(settings: CommonSettings, *, model: str | None = None, watch: bool = False,
               interval: float = 2.0, as_json: bool = False, out: TextIO = sys.stdout,
               err: TextIO = sys.stderr) -> int:
    """Print the fleet's status once, or every ``interval`` seconds until Ctrl-C.

    Returns the exit code: 0, or 2 when Redis cannot be reached (once mode).
    """
    try:
        r = sync_client(settings.redis_url, cluster=settings.redis_cluster, socket_timeout=5.0)
    except (redis.RedisError, OSError) as exc:
        print(f"cannot read the fleet from Redis at {mask_url(settings.redis_url)}: {exc}", file=err)
        return 2
    models = [model] if model else None
    try:
        while True:
            try:
                st = collect(r, settings, models)
                text = (orjson.dumps(st.to_dict()).decode() if as_json else render(st))
            except (redis.RedisError, OSError) as exc:
                if not watch:
                    print(f"cannot read the fleet from Redis at {mask_url(settings.redis_url)}: {exc}", file=err)
                    return 2
                text = (orjson.dumps({"error": str(exc)}).decode() if as_json else
                        f"streamfleet status: Redis at {mask_url(settings.redis_url)} unreachable: {exc}")
            if watch and not as_json:
                out.write(CLEAR + text + f"\n\n(every {interval:g} s; Ctrl-C to stop)\n")
            else:
                out.write(text + "\n")
            out.flush()
            if not watch:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        r.close()
