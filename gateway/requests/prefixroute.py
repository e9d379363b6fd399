"""Prefix-aware routing: send a text task to the live worker where it would start soonest,
weighing the prompt tokens each worker's prefix cache holds against the work each one
already has (docs/architecture.md, "Prefix-aware routing").

Workers advertise the names of the blocks they hold (``sf:{model}:prefix:{worker_id}``,
a set of the 8-byte names of shared/prefixhash.py). For a task whose prompt has at least
one whole block, the gateway computes the prompt's chain once per worker version among
the *candidates* (fresh heartbeat, not draining or reloading, a free slot, a non-empty
advert) and, in one round trip on the coalescer, asks each candidate's set which of the
names it holds (``SMISMEMBER``) and how many tasks its affinity stream of the lane holds
(``XLEN``: routed there, waiting or running). Each candidate's cost is the prompt tokens
it would prefill (the prompt less the leading run it holds) plus ``SF_ROUTE_TASK_TOKENS``
for each task ahead of this one there: the larger of its heartbeat's slots in use and
that stream's length, plus the tasks this gateway routed there that neither had counted
yet (``Ledger``: a burst of tasks in one loop turn sees the same heartbeats and lengths,
and would otherwise all go to one worker). The cheapest wins (ties: the lowest id, so
gateways agree); if it holds none of the prompt, or nobody does, the shared lane, as
without routing (any idle worker starts it soonest).

The pure choice (``leading_run``, ``candidates``, ``choose``, ``lookup_plan``) is apart
from the I/O (``PrefixRouter``). What routing may cost is bounded: at most
``MAX_ROUTE_BLOCKS`` names per worker and ``MAX_ROUTE_LOOKUPS`` per task, and no Redis
round trip on a task's path when routing cannot apply (off, a prompt shorter than a
block, no candidate): the live workers are read in the background, at most every
``VIEW_TTL_S`` per model, and waited for only by the first task after ``STALE_S``
without one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from streamfleet.shared import aio
from streamfleet.shared.keys import Keys, affinity_source
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import gateway as metrics
from streamfleet.shared.prefixhash import block_hashes, namespace
from streamfleet.shared.redis import BROKER_ERRORS, Coalescer
from streamfleet.shared.schema import AnyTask, Heartbeat, Task, live_workers
from streamfleet.shared.settings import GatewaySettings

__all__ = ["FleetView", "Ledger", "PrefixRouter", "candidates", "choose", "held_tokens", "leading_run",
           "lookup_plan", "sample", "sample_positions", "serving", "up", "work_ahead", "LEDGER_S",
           "MAX_ROUTE_BLOCKS", "MAX_ROUTE_LOOKUPS", "MAX_CANDIDATES", "ROUTE_FRESH_S", "STALE_S", "VIEW_TTL_S"]

log = get_logger("gateway.prefixroute")

#: seconds a model's fleet view (live workers, advertisers, affinity streams) is used
#: before the next task starts reading it again (in the background)
VIEW_TTL_S = 0.5
#: a view older than this is read again on the task's path (the first task after a quiet
#: spell waits one round trip for it) rather than routed on
STALE_S = 1.0
#: a worker whose heartbeat is older than this (or ``SF_WORKER_TTL_S``, if shorter) is no
#: candidate: it may be stopped or dead, and its tasks would wait ``SF_AFFINITY_WAIT_MS``
ROUTE_FRESH_S = 2.0
#: most of a prompt's leading block names looked up in one worker's advert
MAX_ROUTE_BLOCKS = 32
#: most names looked up for one task, all candidates together
MAX_ROUTE_LOOKUPS = 256
#: most candidates looked up for one task (those with the fewest slots in use)
MAX_CANDIDATES = 32
#: most workers that hold nothing costed for one task (the least busy)
MAX_COLD = 4
#: seconds a routed task stays in this gateway's ``Ledger`` after its enqueue (by then any
#: look-up sent since counts it in the affinity stream's length)
LEDGER_S = 2.0


@dataclass(frozen=True, slots=True)
class FleetView:
    """What a gateway knows of one model's workers, read in one go."""

    #: monotonic time of the read
    read_at: float
    #: workers with a fresh heartbeat (``SF_WORKER_TTL_S``) at the read
    workers: tuple[Heartbeat, ...] = ()
    #: the workers among them whose advert set is not empty
    advertisers: frozenset[str] = frozenset()
    #: every affinity stream of the model (``sf:{model}:affinity``)
    affinity: frozenset[str] = frozenset()


def leading_run(hits: Iterable[object]) -> int:
    """How many of ``hits`` are true before the first false one (``SMISMEMBER``'s 1s and
    0s): the blocks of a prompt's start that a worker holds. A block is usable only after
    every block before it, so a hit after a miss counts for nothing."""
    n = 0
    for hit in hits:
        if not hit:
            break
        n += 1
    return n


def up(hb: Heartbeat, now: float, fresh_s: float) -> bool:
    """The worker takes tasks: heartbeat at most ``fresh_s`` old at ``now`` (unix
    seconds), neither draining nor reloading."""
    return not hb.draining and not hb.reloading and now - hb.heartbeat <= fresh_s


def serving(workers: Iterable[Heartbeat], now: float, fresh_s: float) -> list[Heartbeat]:
    """The workers that would start a task soon: ``up``, with a free slot (``slots_used <
    max_batch``); the least busy first (ties by worker id, so every gateway sees the same
    order)."""
    out = [hb for hb in workers if up(hb, now, fresh_s) and hb.slots_used < hb.max_batch]
    out.sort(key=lambda hb: (hb.slots_used, hb.worker_id))
    return out


def candidates(workers: Iterable[Heartbeat], advertisers: Iterable[str], now: float, fresh_s: float,
               limit: int = MAX_CANDIDATES) -> list[Heartbeat]:
    """The workers a task may be routed to: ``serving`` ones whose advert is not empty; at
    most ``limit`` of them, the least busy first."""
    adv = set(advertisers)
    return [hb for hb in serving(workers, now, fresh_s) if hb.worker_id in adv][:max(0, limit)]


def lookup_plan(model: str, prompt_ids: Sequence[int], block: int, workers: Sequence[Heartbeat],
                max_blocks: int = MAX_ROUTE_BLOCKS, max_lookups: int = MAX_ROUTE_LOOKUPS) -> dict[str, list[bytes]]:
    """Worker id -> the block names of the prompt to look up in its advert, in order: the
    chain is computed once per version among ``workers`` (its seed is the model's name
    and that version; one hash a block, bounded by the context), and at most
    ``max_blocks`` names per worker and about ``max_lookups`` in all (at least one per
    worker) are looked up: all of them when the prompt has no more blocks, else that many
    spread evenly from its first block to its last (``sample``), the same positions for
    every worker. So a conversation longer than ``max_blocks`` blocks still goes to the
    worker holding most of it, to within one spacing, where the first blocks alone (a
    system prompt every worker holds) would tell the workers apart by nothing. Empty when
    the prompt has no whole block."""
    if not workers or len(prompt_ids) < block:
        return {}
    per = max(1, min(max_blocks, max_lookups // len(workers)))
    chains: dict[str, list[bytes]] = {}
    plan = {}
    for hb in workers:
        chain = chains.get(hb.version)
        if chain is None:
            chain = chains[hb.version] = sample(block_hashes(namespace(model, hb.version), prompt_ids, block), per)
        if chain:
            plan[hb.worker_id] = chain
    return plan


def sample_positions(count: int, n: int) -> list[int]:
    """The block positions ``sample`` takes of ``count`` blocks: ``n`` spread evenly, first
    and last included (all of them when there are no more than ``n``)."""
    if count <= n:
        return list(range(count))
    if n <= 1:
        return [0]
    last = count - 1
    return [round(j * last / (n - 1)) for j in range(n)]


def sample(names: Sequence[bytes], n: int) -> list[bytes]:
    """``n`` of ``names`` spread evenly, first and last included, in order (all of them
    when there are no more than ``n``). A worker's leading run over them is the sampled
    positions it holds before the first it lacks: comparable between workers, as every
    worker is asked the same positions."""
    return [names[i] for i in sample_positions(len(names), n)]


def held_tokens(run: int, count: int, n: int, block: int) -> int:
    """The prompt tokens a worker holds, as far as a leading ``run`` over the ``n`` sampled
    positions of ``count`` blocks tells: the blocks up to the last position in the run."""
    if run <= 0:
        return 0
    positions = sample_positions(count, n)
    return (positions[min(run, len(positions)) - 1] + 1) * block


def work_ahead(hb: Heartbeat, routed: int) -> int:
    """The tasks ahead of a new one at a worker: those routed to it (``routed``, its
    affinity stream's length as just read: waiting or running) and those it took from the
    shared lanes (its heartbeat's ``shared_used``, up to a heartbeat old); from a worker
    whose heartbeat does not say, the larger of its slots in use and ``routed``. (Its
    ``slots_used`` alone lags: a burst that just ended there would still count.)"""
    if hb.shared_used >= 0:
        return routed + hb.shared_used
    return max(hb.slots_used, routed)


def choose(held: Mapping[str, int], backlog: Mapping[str, float], prompt_tokens: int,
           task_tokens: int) -> str | None:
    """The worker where a task of ``prompt_tokens`` would start soonest: the least cost,
    the prompt tokens it would prefill (``prompt_tokens`` less ``held``, the tokens of the
    prompt's start it holds) plus ``task_tokens`` for each task ahead there (``backlog``);
    ties to the lowest worker id, so that every gateway agrees. The cheapest may hold none
    of it (a holder's backlog outweighs the prefill it saves): it is sent there all the
    same, so that the next task of a burst counts it. None (the shared lane) when nobody
    holds any of the prompt, or nobody was asked."""
    if not any(got > 0 for got in held.values()):
        return None
    best, key = None, None
    for wid, got in held.items():
        k = (prompt_tokens - got + task_tokens * backlog.get(wid, 0), wid)
        if key is None or k < key:
            best, key = wid, k
    return best


class Ledger:
    """The tasks this gateway routed to each worker lately, for the choice of the next:
    one counts toward a worker's backlog from its choice until a look-up sent after its
    enqueue returned (which sees it in the affinity stream's length), and is forgotten
    ``LEDGER_S`` after that enqueue (or at once, when the enqueue failed)."""

    def __init__(self) -> None:
        self._routed: dict[str, dict[str, float | None]] = {}  # worker -> request id -> enqueued at

    def chosen(self, worker: str, request_id: str) -> None:
        self._routed.setdefault(worker, {})[request_id] = None

    def enqueued(self, worker: str, request_id: str, ok: bool, now: float) -> None:
        routed = self._routed.get(worker)
        if routed is None or request_id not in routed:
            return
        if ok:
            routed[request_id] = now
        else:
            del routed[request_id]

    def uncounted(self, worker: str, sent_at: float, now: float) -> int:
        """Tasks routed to ``worker`` that a look-up sent at ``sent_at`` did not see: still
        being enqueued, or enqueued after it was sent."""
        routed = self._routed.get(worker)
        if not routed:
            return 0
        n = 0
        for rid, at in list(routed.items()):
            if at is None or at > sent_at:
                n += 1
            if at is not None and now - at > LEDGER_S:
                del routed[rid]
        if not routed:
            del self._routed[worker]
        return n


class PrefixRouter:
    """The gateway's routing: a cached view of each model's workers, the look-up, the
    choice. ``route`` never raises: any trouble means the shared lane."""

    def __init__(self, settings: GatewaySettings, keys: Keys, redis: aioredis.Redis, coalescer: Coalescer) -> None:
        self.settings = settings
        self.keys = keys
        self.redis = redis
        self.coalescer = coalescer
        self.block = settings.prefix_block_tokens
        self.fresh_s = min(settings.worker_ttl_s, ROUTE_FRESH_S)
        self._views: dict[str, FleetView] = {}
        self._reads: dict[str, asyncio.Future[None]] = {}
        self.ledger = Ledger()

    # -- the view --------------------------------------------------------------------------
    def view(self, model: str) -> FleetView | None:
        """The model's last view (None before the first read); starts a read in the
        background when it is older than ``VIEW_TTL_S`` (never waited for here)."""
        view = self._views.get(model)
        if (view is None or time.monotonic() - view.read_at >= VIEW_TTL_S) and model not in self._reads:
            read = asyncio.ensure_future(self._read(model))
            read.add_done_callback(aio.mark_retrieved)
            self._reads[model] = read
        return view

    async def _read(self, model: str) -> None:
        """The model's affinity streams, and with routing on its live workers and which of
        them advertise: two round trips, off any task's path."""
        started = time.monotonic()
        routing = self.settings.prefix_routing
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.smembers(self.keys.affinity_streams(model))
                if routing:
                    pipe.hgetall(self.keys.workers(model))
                streams, *rest = await pipe.execute()
            live = live_workers(rest[0], self.settings.worker_ttl_s, time.time()) if routing else []
            sizes: list[int] = []
            if live:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for hb in live:
                        pipe.scard(self.keys.prefix_advert(model, hb.worker_id))
                    sizes = await pipe.execute()
            self._views[model] = FleetView(
                started, tuple(live), frozenset(hb.worker_id for hb, n in zip(live, sizes) if n),
                frozenset(s.decode() if isinstance(s, bytes) else s for s in streams))
        except BROKER_ERRORS as exc:
            log.debug("could not read the workers for routing", model=model, error=str(exc))
        finally:
            self._reads.pop(model, None)

    def counted(self, model: str, lane: str, target: str) -> list[str]:
        """The streams of ``lane`` besides ``target`` whose backlog counts toward the lane's
        threshold: the shared lane (when ``target`` is an affinity stream) and every
        affinity stream of the lane this gateway knows of, so that a model refuses work at
        the same backlog whether its tasks were routed or not (by this gateway or another).
        Known are the streams of the registry as last read (also with routing off) and
        those of the workers that advertise (a stream is made when a first task is routed
        to its worker, which every gateway sees advertise at about the same time)."""
        view = self.view(model)
        lane_key = self.keys.lane(model, lane)
        head = lane_key + ":@"
        out = [lane_key] if target != lane_key else []
        if view is not None:
            known = {s for s in view.affinity if s.startswith(head)}
            known.update(self.keys.affinity(model, lane, w) for w in view.advertisers)
            known.discard(target)
            out += sorted(known)
        return out

    # -- routing ---------------------------------------------------------------------------
    def applies(self, task: AnyTask) -> bool:
        """Whether routing may apply to ``task`` at all (no I/O): on, a text task, a prompt
        of at least one block."""
        return self.settings.prefix_routing and isinstance(task, Task) and len(task.prompt_ids) >= self.block

    async def route(self, task: AnyTask) -> str | None:
        """The worker to send ``task`` to, or None for the shared lane. Looks Redis up
        (one round trip) only when a candidate exists. A task routed here is reported
        back with ``enqueued`` once its enqueue returned."""
        if not self.applies(task) or not isinstance(task, Task):  # (``applies``: a text task)
            return None
        view = self.view(task.model)
        if view is None or time.monotonic() - view.read_at > STALE_S:
            # the first task after a quiet spell: its heartbeats would all look stale and
            # the adverts may have changed since, so it waits for the read just started
            # (one round trip) instead of going to the shared lane on old news
            read = self._reads.get(task.model)
            if read is not None:
                try:
                    await asyncio.shield(read)
                except Exception:  # (the read logs its own trouble)
                    pass
                view = self._views.get(task.model)
            if view is None:
                return None
        now_s = time.time()
        if sum(1 for hb in view.workers if up(hb, now_s, self.fresh_s)) < 2:
            return None  # one worker (``streamfleet serve``): nothing to choose, no round trip
        cands = candidates(view.workers, view.advertisers, now_s, self.fresh_s)
        plan = lookup_plan(task.model, task.prompt_ids, self.block, cands)
        if not plan:
            return None
        # the least busy serving workers that hold nothing are costed too: one of them may
        # start the task sooner, cold, than a busy holder would
        live = {hb.worker_id: hb for hb in cands if hb.worker_id in plan}
        cold = [hb for hb in serving(view.workers, now_s, self.fresh_s) if hb.worker_id not in view.advertisers]
        live.update((hb.worker_id, hb) for hb in cold[:MAX_COLD])
        sent_at = time.monotonic()
        sends = [(wid,
                  self.coalescer.send(b"SMISMEMBER", self.keys.prefix_advert(task.model, wid), *plan[wid])
                  if wid in plan else None,
                  self.coalescer.send(b"XLEN", self.keys.affinity(task.model, task.lane, wid)))
                 for wid in live]
        count = len(task.prompt_ids) // self.block
        per = len(next(iter(plan.values())))  # (the same for every worker: ``lookup_plan``)
        held: dict[str, int] = {}
        backlog: dict[str, int] = {}
        for wid, hits_fut, len_fut in sends:
            try:
                hits = await hits_fut if hits_fut is not None else []
                queued = await len_fut
            except Exception as exc:  # Redis unreachable: the shared lane (whose enqueue reports it)
                log.debug("prefix look-up failed", worker=wid, error=str(exc))
                continue
            if isinstance(hits, list) and isinstance(queued, int):
                held[wid] = held_tokens(leading_run(hits), count, per, self.block)
                backlog[wid] = work_ahead(live[wid], queued)
        now = time.monotonic()
        for wid in backlog:
            backlog[wid] += self.ledger.uncounted(wid, sent_at, now)
        chosen = choose(held, backlog, len(task.prompt_ids), self.settings.route_task_tokens)
        metrics.prefix_routes.labels(task.model, "routed" if chosen else "shared").inc()
        if chosen is not None:
            self.ledger.chosen(chosen, task.request_id)
            backlog.setdefault(chosen, 0)
            log.debug("routed by prefix", request_id=task.request_id, worker=chosen, held_tokens=held[chosen],
                      backlog=backlog[chosen], source=affinity_source(task.lane, chosen))
        return chosen

    def enqueued(self, worker: str, task: AnyTask, ok: bool) -> None:
        """``task``'s enqueue to ``worker``'s affinity stream returned (``ok``: it is there)."""
        self.ledger.enqueued(worker, task.request_id, ok, time.monotonic())
