"""The worker process around the pure core: it owns XREADGROUP on the
lanes, PUBLISH of events, XACK, the cancel channel, heartbeats and signals.

The loop, one continuous-batching step per turn::

    apply cancels heard since the last step
    read up to `free_slots` tasks (weighted across lanes; blocks only when idle)
    step = await run_in_executor(core.step)     # engine off the event loop
    PUBLISH the step's events (one pipeline), XACK + XDEL finished tasks

Acked tasks are deleted from the lane stream, so ``XLEN`` of a lane is its backlog:
queued plus in flight.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import orjson
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from streamfleet.shared.errors import FatalError
from streamfleet.shared.keys import GROUP, LANES, Keys
from streamfleet.shared import aio
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import worker as metrics
from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts, load_tokenizer
from streamfleet.shared.redis import BROKER_ERRORS, RawBatch, connect, refresh_members
from streamfleet.shared.schema import Cancel, DoneEvent, ErrorEvent, Event, Follow, Task, TokenEvent, Wake, encode_events, \
    stream_entry_id
from streamfleet.shared.settings import WorkerSettings
from streamfleet.shared.tiers import STREAM_SLOT_TTL_S

from streamfleet.workers.core import WorkerCore
from streamfleet.workers.coreset import CoreSet, VersionedCore
from streamfleet.workers.engines import load_engine
from streamfleet.workers.lanes import LanePolicy

__all__ = ["WorkerProcess", "run_worker"]

log = get_logger("worker")

#: how long a cancel for a request this worker has not seen yet is remembered
CANCEL_MEMORY_S = 300.0
#: a busy worker reads its lanes at least this often, even with no wake announced
READ_EVERY_S = 0.05
#: most reply channels one request is published to besides its own (resumed clients)
MAX_FOLLOWERS = 8


#: Hand a task back to its lane (drain): re-add it at the tail and drop this worker's
#: delivery, atomically. KEYS[1] lane; ARGV[1] group, ARGV[2] message id, ARGV[3] task.
REQUEUE_LUA = """
redis.call('XADD', KEYS[1], '*', 'task', ARGV[3])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""


@dataclass(slots=True)
class InFlight:
    lane: str
    message_id: bytes
    task: Task


class Takeover:
    """Which other workers are dead, judged by how their heartbeats look to this one
    (no I/O: the reclaim loop feeds it what it reads).

    A worker is dead when its heartbeat entry has not changed for ``dead_after_s`` while
    this worker kept reading it without a gap. A gap in this worker's own reading (a
    Redis stall, its own loop held up) restarts everyone's clock, so that a stall that
    held up every heartbeat alike never makes a live worker look dead. A worker seen
    for the first time (a consumer with no heartbeat entry at all) gets a clock from then.

    Args:
        dead_after_s: silence after which a worker is dead.
    """

    def __init__(self, dead_after_s: float) -> None:
        self.dead_after_s = dead_after_s
        self._seen: dict[str, tuple[bytes, float]] = {}  # worker -> (heartbeat, when it last changed)
        self._last_look: float | None = None

    def observe(self, heartbeats: dict[str, bytes], now: float) -> None:
        """Record one read of the heartbeat hash (worker id -> entry) made at ``now``."""
        if self._last_look is None or now - self._last_look > self.dead_after_s / 2:
            self._seen = {w: (blob, now) for w, (blob, _) in self._seen.items()}
        self._last_look = now
        for worker, blob in heartbeats.items():
            prev = self._seen.get(worker)
            if prev is None or prev[0] != blob:
                self._seen[worker] = (blob, now)
        stale = now - 60 * self.dead_after_s
        for worker in [w for w, (_, t) in self._seen.items() if t < stale and w not in heartbeats]:
            del self._seen[worker]

    def dead(self, worker: str, now: float) -> bool:
        seen = self._seen.get(worker)
        if seen is None:
            self._seen[worker] = (b"", now)
            return False
        return now - seen[1] >= self.dead_after_s


class WorkerProcess:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.model = settings.model
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.lane_keys = self.keys.lanes(self.model)
        self.policy = LanePolicy(settings.lane_weights)
        self.redis: aioredis.Redis | None = None
        self.cores: CoreSet | None = None
        self._reloading = False
        self.inflight: dict[str, InFlight] = {}
        self._held: list[tuple[str, bytes, dict]] = []  # read beyond free slots; admitted first
        self._cancels: list[str] = []
        self._cancel_memory: dict[str, float] = {}
        #: request id -> when a PUBLISH for it first reached no subscriber (reset by one that did)
        self._unheard: dict[str, float] = {}
        #: request id -> reply channels of clients that resumed it elsewhere (sf:attach:{id})
        self._followers: dict[str, set[str]] = {}
        #: follows heard for requests not running here (yet): applied when they start
        self._follow_memory: dict[str, tuple[set[str], float]] = {}
        self._looking_up: set[str] = set()  # follower look-ups in progress
        self._takeover = Takeover(settings.worker_dead_after_s)
        #: request id -> token ids it generated before this worker took it over
        self._replay: dict[str, list[int]] = {}
        self._unsent: list = []  # (version, StepOutput) whose publish failed: first out next time
        self._bg: set[asyncio.Task] = set()
        #: a gateway announced a task (sf:wake:{model}) newer than any read so far
        self._woken = False
        self._read_at = 0.0  # monotonic time of the last read
        self._last_read: dict[str, tuple[int, int]] = {}  # lane -> newest entry id read
        self._stopping = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._tokens_window: list[tuple[float, int]] = []
        self.max_batch = 0
        m = self.model
        self._m_step = metrics.step_time.labels(m)
        self._m_batch = metrics.batch_size.labels(m)
        self._m_tokens = metrics.tokens.labels(m)

    # -- start-up -------------------------------------------------------------------
    def _load(self, version: str | None = None) -> VersionedCore:
        repo = ModelRepository(self.settings.engines_dir)
        spec = repo.get(self.model, version)
        ensure_artifacts(spec)
        options = {}
        backend = self.settings.backend or spec.backend
        if backend == "onnxruntime" and self.settings.threads:
            options["threads"] = self.settings.threads
        if backend == "echo":
            options["delay_ms"] = self.settings.echo_delay_ms
            options["max_batch"] = self.settings.max_batch
        if backend == "tensorrt":
            options["build_if_missing"] = self.settings.trt_build_if_missing
            options["cuda"] = self.settings.trt_cuda
        engine = load_engine(spec, self.settings.backend, **options)
        tokenizer = load_tokenizer(spec)
        max_batch = self.settings.max_batch or spec.max_batch
        return VersionedCore(spec.version, WorkerCore(engine, tokenizer, max_batch=max_batch))

    async def _ensure_groups(self) -> None:
        for key in self.lane_keys.values():
            try:
                await self.redis.xgroup_create(key, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # -- main -------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._stopping.set)
            except (NotImplementedError, RuntimeError):
                pass
        self.redis = connect(self.settings.redis_url, socket_timeout=self.settings.redis_socket_timeout_s)
        await self._wait_for_redis()
        try:
            target = await self._target_version()
            first = await loop.run_in_executor(self._executor, self._load, target)
        except FatalError as exc:
            log.error("worker cannot start", error=exc.message)
            await self.redis.aclose()
            return 2
        self.max_batch = first.core.free_slots
        self.cores = CoreSet(first, self.max_batch)
        backend = self.settings.backend or ModelRepository(self.settings.engines_dir).get(self.model).backend
        # overlapping Redis I/O with the step pays off when the engine leaves the CPU free (GPU, echo);
        # a CPU engine (ONNX Runtime) needs those cores itself
        self.overlap_io = self.settings.overlap_io if self.settings.overlap_io is not None \
            else backend != "onnxruntime"
        if self.settings.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(self.settings.metrics_port, addr=self.settings.metrics_host)
            log.info("worker metrics", url=f"http://{self.settings.metrics_host}:{self.settings.metrics_port}/metrics")
        log.info("worker ready", worker_id=self.worker_id, model=self.model, max_batch=self.max_batch,
                 version=self.cores.version, frozen_objects=aio.settle_heap())
        self._requeue = self.redis.register_script(REQUEUE_LUA)
        aux = [asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
               asyncio.create_task(self._cancel_loop(), name="cancels"),
               asyncio.create_task(self._reclaim_loop(), name="reclaim"),
               asyncio.create_task(self._reload_loop(), name="reload")]
        try:
            await self._main_loop()
        finally:
            for t in aux:
                t.cancel()
            await asyncio.gather(*aux, return_exceptions=True)
            await self._deregister()
            await self.redis.aclose()
            self._executor.shutdown(wait=True)
        log.info("worker stopped", worker_id=self.worker_id)
        return 0

    async def _wait_for_redis(self) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                await self._ensure_groups()
                return
            except BROKER_ERRORS as exc:
                log.warning("redis unreachable; retrying", error=str(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _main_loop(self) -> None:
        """One continuous-batching step per turn: start the engine step, publish the
        previous step's events while it computes (publishing overlaps the model instead of
        adding to every step), and read new tasks. A busy worker reads only when a gateway
        has announced a task it has not read yet (``sf:wake:{model}``, at most
        ``READ_EVERY_S`` apart otherwise), and then at the step boundary too, so that a task
        arriving mid-step joins the very next step. An idle worker blocks on XREADGROUP.
        Without overlap (a CPU engine) every boundary reads."""
        loop = asyncio.get_running_loop()
        core = self.cores
        backoff = 0.1
        drain_deadline: float | None = None
        running: asyncio.Future | None = None  # the engine step in the executor
        t_step = 0.0
        unpublished: list = []  # (version, StepOutput) of the last finished step
        just_read = False  # tasks were just read: the next step starts without another read
        while True:
            stopping = self._stopping.is_set()
            if stopping and running is None:
                if drain_deadline is None:
                    drain_deadline = time.monotonic() + self.settings.drain_timeout_s
                    log.info("draining: no new tasks", in_flight=core.active,
                             drain_timeout_s=self.settings.drain_timeout_s)
                if not core.has_work() or time.monotonic() >= drain_deadline:
                    try:
                        await self._publish_all(unpublished)
                    except BROKER_ERRORS as exc:
                        log.warning("could not publish the last step", error=str(exc))
                    await self._hand_back()
                    return
            try:
                publishing: asyncio.Future | None = None
                if running is None:
                    self._apply_cancels()
                    read_now = self._woken or not self.overlap_io
                    if not stopping and core.has_work() and core.free_slots > 0 and not just_read and \
                            (read_now or self._held):
                        # The step boundary: tasks that arrived while the last step computed
                        # join this one. With overlapped I/O this round trip is made only
                        # when a gateway announced a task not read yet (sf:wake:{model}).
                        # The last step's events go out on another connection meanwhile, so
                        # neither round trip waits for the other.
                        if unpublished and self.overlap_io and read_now:
                            outs, unpublished = unpublished, []
                            publishing = asyncio.ensure_future(self._publish_all(outs))
                        try:
                            await self._admit(block=False, read=read_now)
                        except BaseException:
                            if publishing is not None:
                                await asyncio.gather(publishing, return_exceptions=True)
                            raise
                    just_read = False
                    if core.has_work():
                        t_step = time.perf_counter()
                        running = loop.run_in_executor(self._executor, core.step)
                        if not self.overlap_io:  # finish the step before any I/O
                            unpublished += await running
                            running = None
                            self._after_step(unpublished, t_step)
                # while the engine computes: publish the previous step, take what has arrived
                if publishing is not None:
                    await publishing
                if unpublished or self._unsent:
                    outs, unpublished = unpublished, []
                    await self._publish_all(outs)
                if running is not None and not stopping and core.free_slots > 0:
                    await self._admit(block=False, read=self._should_read())
                if not stopping and core.free_slots > 0 and running is None and not core.has_work():
                    await self._admit(block=True)  # idle: wait for work
                    just_read = True
                if running is not None:
                    unpublished = await running
                    running = None
                    self._after_step(unpublished, t_step)
                if running is None:
                    retired = core.retired()
                    if retired is not None:
                        await loop.run_in_executor(self._executor, retired.core.engine.close)
                        log.info("old model version freed", version=retired.version, now=core.version)
                backoff = 0.1
            except BROKER_ERRORS as exc:
                metrics.redis_errors.labels("main_loop").inc()
                log.warning("redis error in worker loop", error=str(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("lane stream or group vanished; recreating", error=str(exc))
                await self._ensure_groups()

    def _after_step(self, outs: list, t_step: float) -> None:
        self._m_step.observe(time.perf_counter() - t_step)
        for _version, out in outs:
            if out.batch_size:
                self._m_batch.observe(out.batch_size)
            self._count_tokens(out.new_tokens)

    # -- reading tasks ------------------------------------------------------------------
    async def _admit(self, block: bool, read: bool = True) -> None:
        """Start held tasks (read earlier, or reclaimed), then, with ``read``, read more."""
        free = self.cores.free_slots
        entries = self._held[:free]
        self._held = self._held[free:]
        free -= len(entries)
        if free > 0 and read:
            entries += await self._read(free, block and not entries)
        for lane, msg_id, fields in entries:
            self._start(lane, msg_id, fields)

    def _should_read(self) -> bool:
        """A busy worker reads only when a gateway announced a task it has not read yet
        (``sf:wake:{model}``), or when ``READ_EVERY_S`` has passed (in case a wake was
        lost, say while its pub/sub connection was re-established). An idle worker blocks
        on XREADGROUP instead."""
        return self._woken or time.monotonic() - self._read_at >= READ_EVERY_S

    def _on_wake(self, data: bytes) -> None:
        """A gateway's enqueue announced a task (``shared.schema.Wake``): wake unless it
        was already read. An unreadable message wakes too (reading costs little)."""
        try:
            wake = Wake.decode(data)
        except ValueError:
            log.warning("unreadable wake message", data=data[:64])
            self._woken = True
            return
        if wake.is_new(self._last_read):
            self._woken = True

    async def _read(self, free: int, block: bool) -> list[tuple[str, bytes, dict]]:
        self._woken = False  # before the read: a wake that lands during it is kept
        self._read_at = time.monotonic()
        out = await self._read_lanes(free, block)
        for lane, mid, _ in out:
            entry_id = stream_entry_id(mid.decode())
            if entry_id > self._last_read.get(lane, (0, 0)):
                self._last_read[lane] = entry_id
        return out

    async def _read_lanes(self, free: int, block: bool) -> list[tuple[str, bytes, dict]]:
        asked = self.policy.split(free)
        got: dict[str, list] = {lane: [] for lane in LANES}
        async with self.redis.pipeline(transaction=False) as pipe:
            lanes = [lane for lane in LANES if asked.get(lane, 0) > 0]
            for lane in lanes:
                pipe.xreadgroup(GROUP, self.worker_id, {self.lane_keys[lane]: ">"}, count=asked[lane])
            results = await pipe.execute() if lanes else []
        for lane, res in zip(lanes, results):
            got[lane] = self._entries(res)
        n = sum(len(v) for v in got.values())
        if n < free:  # give unused share to lanes that still had backlog
            for lane in LANES:
                short = free - n
                if short <= 0:
                    break
                if asked.get(lane, 0) and len(got[lane]) < asked[lane]:
                    continue  # this lane is drained
                res = await self.redis.xreadgroup(GROUP, self.worker_id, {self.lane_keys[lane]: ">"}, count=short)
                more = self._entries(res)
                got[lane].extend(more)
                n += len(more)
        self.policy.record({lane: len(v) for lane, v in got.items()}, asked)
        out = [(lane, mid, f) for lane in LANES for mid, f in got[lane]]
        if not out and block:
            res = await self.redis.xreadgroup(
                GROUP, self.worker_id, {self.lane_keys[lane]: ">" for lane in LANES},
                count=1, block=self.settings.block_ms)
            key_to_lane = {v.encode(): k for k, v in self.lane_keys.items()}
            for key, items in res or []:
                lane = key_to_lane[key if isinstance(key, bytes) else key.encode()]
                out.extend((lane, mid, f) for mid, f in items)
            if len(out) > free:
                self._held.extend(out[free:])
                out = out[:free]
        return out

    @staticmethod
    def _entries(res) -> list[tuple[bytes, dict]]:
        if not res:
            return []
        return [(mid, fields) for _key, items in res for mid, fields in items]

    def _start(self, lane: str, msg_id: bytes, fields: dict) -> None:
        raw = fields.get(b"task")
        try:
            task = Task.decode(raw or b"")
        except ValueError as exc:
            log.error("malformed task; dead-lettering", message_id=msg_id.decode(), error=str(exc))
            asyncio.create_task(self._dead_letter(lane, msg_id, raw, f"malformed task: {exc}"))
            return
        now = time.time()
        replay = self._replay.pop(task.request_id, None)
        if task.request_id in self.cores:
            # the same request delivered twice to this worker (e.g. reclaimed while still running here):
            # the running copy answers; drop the extra delivery without acking the live one
            log.warning("duplicate delivery ignored", request_id=task.request_id, message_id=msg_id.decode())
            return
        self.inflight[task.request_id] = InFlight(lane, msg_id, task)
        self.cores.add(task, replay)
        metrics.admissions.labels(self.model, lane).inc()
        if task.request_id in self._cancel_memory:
            self.cores.cancel(task.request_id)
        remembered = self._follow_memory.pop(task.request_id, None)
        if remembered is not None:
            self._add_followers(task.request_id, remembered[0])
        log.info("task admitted", request_id=task.request_id, trace_id=task.trace_id, lane=lane,
                 queue_ms=round((now - task.created_at) * 1000, 2))

    async def _dead_letter(self, lane: str, msg_id: bytes, raw: bytes | None, reason: str) -> None:
        metrics.dead_letters.labels(self.model).inc()
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.keys.dead(self.model), {"task": raw or b"", "reason": reason,
                                                       "lane": lane, "worker": self.worker_id},
                          maxlen=self.settings.dead_maxlen, approximate=True)
                pipe.xack(self.lane_keys[lane], GROUP, msg_id)
                pipe.xdel(self.lane_keys[lane], msg_id)
                await pipe.execute()
        except BROKER_ERRORS as exc:
            log.warning("dead-lettering failed", error=str(exc))

    # -- hot reload --------------------------------------------------------------------------
    async def _target_version(self) -> str | None:
        raw = await self.redis.get(self.keys.target_version(self.model))
        return raw.decode() if raw else None

    async def _reload_loop(self) -> None:
        """Follow ``sf:version:{model}``: when it names another version, take the fleet's
        reload lock (so workers take turns and at most one extra engine is in memory at a
        time), load the new engine beside the old, send new sequences to it, let the old
        one's finish, free it, release the lock."""
        loop = asyncio.get_running_loop()
        lock_key = self.keys.reload_lock(self.model)
        while True:
            await asyncio.sleep(1.0)
            if self._stopping.is_set():
                continue
            try:
                target = await self._target_version()
                if not target or target == self.cores.version:
                    continue
                if not await self.redis.set(lock_key, self.worker_id, nx=True, px=120_000):
                    continue  # another worker is reloading: wait for our turn
            except BROKER_ERRORS:
                continue
            self._reloading = True
            t0 = time.monotonic()
            log.info("reloading model", model=self.model, old=self.cores.version, new=target)
            try:
                new = await loop.run_in_executor(self._executor, self._load, target)
                self.cores.switch(new)
                while self.cores.retiring is not None:
                    await asyncio.sleep(0.05)
                    await self.redis.pexpire(lock_key, 120_000)
                log.info("model reloaded", model=self.model, version=target,
                         seconds=round(time.monotonic() - t0, 2))
            except FatalError as exc:
                log.error("reload failed; staying on the current version", version=target, error=exc.message)
                await asyncio.sleep(10)
            except BROKER_ERRORS as exc:
                log.warning("redis error during reload", error=str(exc))
            finally:
                self._reloading = False
                try:
                    if (await self.redis.get(lock_key)) == self.worker_id.encode():
                        await self.redis.delete(lock_key)
                except BROKER_ERRORS:
                    pass

    # -- drain ---------------------------------------------------------------------------
    async def _hand_back(self) -> None:
        """Give every unfinished task back to its lane so another worker runs it."""
        loop = asyncio.get_running_loop()
        tasks = await loop.run_in_executor(self._executor, self.cores.abandon_all)
        items = [(fl.lane, fl.message_id, fl.task.encode()) for t in tasks
                 if (fl := self.inflight.pop(t.request_id, None)) is not None]
        items += [(lane, mid, fields.get(b"task", b"")) for lane, mid, fields in self._held]
        self._held = []
        for lane, mid, raw in items:
            try:
                await self._requeue(keys=[self.lane_keys[lane]], args=[GROUP, mid, raw])
            except BROKER_ERRORS as exc:  # it stays pending here and is reclaimed after the idle threshold
                log.warning("hand-back failed", message_id=mid.decode(), error=str(exc))
        if items:
            log.info("handed back unfinished tasks", count=len(items))

    # -- reclaiming tasks of dead workers ---------------------------------------------------
    async def _reclaim_loop(self) -> None:
        s = self.settings
        while True:
            await asyncio.sleep(s.reclaim_interval_s)
            if self._stopping.is_set():
                continue
            try:
                await self._refresh_own()
                await self._take_over_dead()
                await self._reclaim()
            except BROKER_ERRORS as exc:
                log.warning("reclaim failed", error=str(exc))
            except ResponseError as exc:
                log.warning("reclaim failed", error=str(exc))

    async def _refresh_own(self) -> None:
        """Reset the idle time of this worker's own deliveries (XCLAIM JUSTID does not
        count a delivery), so a long generation is never taken from a live worker by the
        idle fallback. A delivery no longer ours (another worker judged this one dead,
        say after a long pause) is dropped here without a word: its new holder
        regenerates it, and gateways drop the indices they already have."""
        by_lane: dict[str, list[bytes]] = defaultdict(list)
        for fl in self.inflight.values():
            by_lane[fl.lane].append(fl.message_id)
        for lane, mid, _ in self._held:
            by_lane[lane].append(mid)
        if not by_lane:
            return
        lanes = list(by_lane)
        async with self.redis.pipeline(transaction=False) as pipe:
            for lane in lanes:
                pipe.xpending_range(self.lane_keys[lane], GROUP, "-", "+", len(by_lane[lane]) + 64,
                                    consumername=self.worker_id)
            owned = await pipe.execute()
        keep: dict[str, list[bytes]] = {}
        for lane, pending in zip(lanes, owned):
            mine = {p["message_id"] for p in pending}
            keep[lane] = [m for m in by_lane[lane] if m in mine]
            lost = set(by_lane[lane]) - mine
            if lost:
                self._drop_lost(lane, lost)
        async with self.redis.pipeline(transaction=False) as pipe:
            for lane, ids in keep.items():
                if ids:
                    pipe.xclaim(self.lane_keys[lane], GROUP, self.worker_id, 0, ids, justid=True)
            await pipe.execute()

    def _drop_lost(self, lane: str, lost: set[bytes]) -> None:
        self._held = [h for h in self._held if not (h[0] == lane and h[1] in lost)]
        for rid, fl in list(self.inflight.items()):
            if fl.lane == lane and fl.message_id in lost:
                del self.inflight[rid]
                self.cores.abandon(rid)
                log.warning("a task of this worker was taken over by another; dropping it", request_id=rid,
                            message_id=fl.message_id.decode())

    async def _take_over_dead(self) -> None:
        """Claim the deliveries of workers that stopped heartbeating (see ``Takeover``),
        as many as this worker has free slots for; the rest go to other workers or the
        next round."""
        s = self.settings
        now = time.monotonic()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.workers(self.model))
            for lane in LANES:
                pipe.xinfo_consumers(self.lane_keys[lane], GROUP)
            heartbeats, *consumers = await pipe.execute()
        self._takeover.observe({k.decode(): v for k, v in heartbeats.items()}, now)
        min_idle = int(s.worker_dead_after_s * 500)  # a racing claimer's XCLAIM just reset it to 0
        for lane, infos in zip(LANES, consumers):
            for info in infos:
                name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
                if name == self.worker_id or not info.get("pending") or not self._takeover.dead(name, now):
                    continue
                free = self.cores.free_slots - len(self._held)
                if free <= 0:
                    return
                key = self.lane_keys[lane]
                pending = await self.redis.xpending_range(key, GROUP, "-", "+", min(free, info["pending"]),
                                                          consumername=name)
                if not pending:
                    continue
                deliveries = {p["message_id"]: p["times_delivered"] + 1 for p in pending}
                claimed = await self.redis.xclaim(key, GROUP, self.worker_id, min_idle, list(deliveries))
                if claimed:
                    log.warning("took over the tasks of a dead worker", dead_worker=name, lane=lane,
                                count=len(claimed))
                for mid, fields in claimed:
                    await self._adopt(lane, mid, fields, deliveries.get(mid, 2), "dead worker")

    async def _adopt(self, lane: str, mid: bytes, fields: dict | None, deliveries: int, source: str) -> None:
        """A delivery this worker just claimed: run it, or dead-letter it after too many."""
        if fields is None:
            return
        if deliveries > self.settings.max_deliveries:
            await self._give_up(lane, mid, fields, deliveries)
            return
        try:
            task = Task.decode(fields.get(b"task") or b"")
        except ValueError:
            task = None
        if task is not None:
            ended, replay = await self._read_progress(task.request_id)
            if ended:  # it finished, but its holder died before the ack got through
                log.info("reclaimed task had already ended; acknowledging it", request_id=task.request_id)
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.xack(self.lane_keys[lane], GROUP, mid)
                    pipe.xdel(self.lane_keys[lane], mid)
                    await pipe.execute()
                return
            if replay:
                self._replay[task.request_id] = replay
        else:
            replay = []
        log.warning("reclaimed a task", message_id=mid.decode(), lane=lane, deliveries=deliveries, source=source,
                    replay_tokens=len(replay))
        metrics.reclaimed.labels(self.model).inc()
        self._held.append((lane, mid, fields))

    async def _read_progress(self, rid: str) -> tuple[bool, list[int]]:
        """From the request's log: whether it already ended, and the ids of the tokens
        it generated (indices 0..n-1, as far as they run without a hole)."""
        try:
            entries = await self.redis.xrange(self.keys.log(rid), "-", "+", count=self.settings.log_maxlen)
        except BROKER_ERRORS:
            return False, []
        by_index: dict[int, int] = {}
        for _, f in entries:
            raw = f.get(b"e", b"")
            if b'"type":"token"' not in raw:
                if b'"type":"done"' in raw or b'"type":"error"' in raw:
                    return True, []
                continue
            try:
                by_index[int(orjson.loads(raw)["index"])] = int(f[b"t"])
            except (KeyError, ValueError, TypeError, orjson.JSONDecodeError):
                continue
        replay = []
        while len(replay) in by_index:
            replay.append(by_index[len(replay)])
        return False, replay

    async def _reclaim(self) -> None:
        """Fallback: deliveries idle past ``claim_idle_ms`` (their holder stopped refreshing
        them, whatever its heartbeat says)."""
        s = self.settings
        for lane in LANES:
            free = self.cores.free_slots - len(self._held)
            if free <= 0:
                return
            key = self.lane_keys[lane]
            res = await self.redis.xautoclaim(key, GROUP, self.worker_id, s.claim_idle_ms, "0-0", count=free)
            entries = res[1] if res else []
            for mid, fields in entries:
                if fields is None:
                    continue
                info = await self.redis.xpending_range(key, GROUP, min=mid, max=mid, count=1)
                deliveries = info[0]["times_delivered"] if info else 1
                await self._adopt(lane, mid, fields, deliveries, "silent worker")

    async def _give_up(self, lane: str, mid: bytes, fields: dict, deliveries: int) -> None:
        raw = fields.get(b"task", b"")
        reason = f"delivered {deliveries} times without finishing (max {self.settings.max_deliveries})"
        try:
            task = Task.decode(raw)
        except ValueError:
            task = None
        await self._dead_letter(lane, mid, raw, reason)
        if task is not None:
            log.error("task dead-lettered", request_id=task.request_id, trace_id=task.trace_id, reason=reason)
            ev = ErrorEvent(task.request_id, "delivery_failed",
                            f"the request failed on {deliveries} workers in a row and was given up")
            batch = RawBatch()
            self._log_events(batch, [ev], tasks={task.request_id: task})
            for ch in {task.reply_to, *await self._followers_of(task.request_id)}:
                batch.add(b"PUBLISH", self.keys.reply(ch), encode_events([ev]))
            await batch.execute(self.redis)

    def _log_events(self, batch: RawBatch, events: list[Event], token_ids: dict | None = None,
                    tasks: dict[str, Task] | None = None) -> None:
        """Append events to their request logs (``sf:log:{request_id}``) in ``batch``; a
        token's entry also carries its id (field ``t``), for a takeover's replay. A
        request's end also gives back the API key's stream slot it holds (README: "Tenants"),
        whatever became of its client."""
        s = self.settings
        maxlen, ttl = s.log_maxlen, int(s.log_ttl_s)
        ids = token_ids or {}
        for ev in events:
            key = self.keys.log(ev.request_id)
            body = orjson.dumps(ev, option=orjson.OPT_SERIALIZE_DATACLASS)
            tid = ids.get((ev.request_id, ev.index)) if isinstance(ev, TokenEvent) else None
            if tid is None:
                batch.add(b"XADD", key, b"MAXLEN", b"~", maxlen, b"*", b"e", body)
            else:
                batch.add(b"XADD", key, b"MAXLEN", b"~", maxlen, b"*", b"e", body, b"t", tid)
            if not isinstance(ev, TokenEvent) or ev.index % 64 == 0:
                batch.add(b"EXPIRE", key, ttl)
            if not isinstance(ev, TokenEvent):  # the request's record lives as long as its log
                batch.add(b"EXPIRE", self.keys.request(ev.request_id), ttl)
                task = (tasks or {}).get(ev.request_id)
                if task is None and (fl := self.inflight.get(ev.request_id)) is not None:
                    task = fl.task
                if task is not None and task.slot:
                    batch.add(b"ZREM", self.keys.streams(task.slot), ev.request_id)

    # -- publishing ----------------------------------------------------------------------
    async def _publish_all(self, outs: list) -> None:
        """Publish steps in order. A step whose batch failed (Redis stalled past the socket
        timeout, or down) stays queued and goes out first next time, so no event is ever
        skipped; repeating part of one is harmless (gateways drop indices they have)."""
        self._unsent.extend(outs)
        while self._unsent:
            version, out = self._unsent[0]
            await self._publish(out, version)
            self._unsent.pop(0)

    def _channels(self, reply_to: str, rid: str) -> tuple[str, ...]:
        followers = self._followers.get(rid)
        return (reply_to, *followers) if followers else (reply_to,)

    async def _publish(self, out, version: str = "") -> None:
        """One pipeline per step: log every event, PUBLISH each connection's events (the
        request's own connection and any that resumed it elsewhere), XACK + XDEL finished
        tasks. The log entries go first, so a gateway that sees a message can already find
        it (and anything before it) in the log.

        Raises:
            BROKER_ERRORS: the batch did not get through; nothing was acknowledged.
        """
        by_channel: dict[str, list[Event]] = defaultdict(list)
        rids_by_channel: dict[str, set[str]] = defaultdict(set)
        for reply_to, ev in out.events:
            if isinstance(ev, DoneEvent):
                ev.model_version = version
            for ch in self._channels(reply_to, ev.request_id):
                by_channel[ch].append(ev)
                rids_by_channel[ch].add(ev.request_id)
        channels = list(by_channel)
        acked = [(rid, fl) for rid in out.finished if (fl := self.inflight.get(rid)) is not None]
        batch = RawBatch()
        self._log_events(batch, [ev for _, ev in out.events], out.token_ids)
        first_publish = len(batch)
        for ch in channels:
            batch.add(b"PUBLISH", self.keys.reply(ch), encode_events(by_channel[ch]))
        for _, fl in acked:
            batch.add(b"XACK", self.lane_keys[fl.lane], GROUP, fl.message_id)
            batch.add(b"XDEL", self.lane_keys[fl.lane], fl.message_id)
        results = await batch.execute(self.redis)
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            metrics.redis_errors.labels("publish").inc()
            log.warning("commands of a publish batch failed", failed=len(failed), first=str(failed[0]))
        ends = {ev.request_id: (ev.finish_reason if isinstance(ev, DoneEvent) else "error")
                for _, ev in out.events if not isinstance(ev, TokenEvent)}
        for rid, fl in acked:
            if self.inflight.get(rid) is fl:
                del self.inflight[rid]
            self._unheard.pop(rid, None)
            self._followers.pop(rid, None)
            outcome = ends.get(rid, "unknown")
            metrics.finished.labels(self.model, outcome).inc()
            log.info("task finished", request_id=rid, trace_id=fl.task.trace_id, outcome=outcome)
        self._check_heard(channels, rids_by_channel, results[first_publish:first_publish + len(channels)])

    def _check_heard(self, channels: list[str], rids_by_channel: dict[str, set[str]], receivers: list) -> None:
        """A request whose PUBLISHes reach nobody on any of its channels: its connection
        (or its whole gateway) is gone, or a gateway is re-subscribing after its pub/sub
        socket dropped (it then repairs the gap from the log). First see whether a client
        follows it elsewhere (a resume this worker did not hear of); stop it once nobody
        has listened for ``orphan_grace_s``."""
        heard: set[str] = set()
        unheard: set[str] = set()
        for ch, n in zip(channels, receivers):
            (heard if n and not isinstance(n, Exception) else unheard).update(rids_by_channel[ch])
        now = time.monotonic()
        grace = self.settings.orphan_grace_s
        for rid in heard:
            self._unheard.pop(rid, None)
        for rid in unheard - heard:
            if rid not in self.inflight:
                continue
            since = self._unheard.get(rid)
            if since is None:  # first unheard publish: maybe a resume this worker did not hear of
                since = self._unheard[rid] = now
                if rid not in self._looking_up:
                    self._looking_up.add(rid)
                    self._spawn(self._look_up_followers(rid))
            if now - since >= grace:
                del self._unheard[rid]
                metrics.cancelled_no_listener.labels(self.model).inc()
                log.info("nobody listening; cancelling", request_id=rid, unheard_s=round(now - since, 3))
                self.cores.cancel(rid)

    async def _followers_of(self, rid: str) -> set[str]:
        """Connections that follow ``rid`` now (``sf:attach:{id}``, unexpired); empty when
        Redis cannot say."""
        try:
            members = await self.redis.zrangebyscore(self.keys.attach(rid), int(time.time() * 1000), "+inf")
        except BROKER_ERRORS:
            return set()
        return {m.decode() for m in members}

    async def _look_up_followers(self, rid: str) -> None:
        try:
            followers = await self._followers_of(rid)
        finally:
            self._looking_up.discard(rid)
        if followers and rid in self.inflight:
            self._add_followers(rid, followers)

    def _add_followers(self, rid: str, channels: set[str]) -> None:
        known = self._followers.setdefault(rid, set())
        new = channels - known
        if new:
            known.update(new)
            while len(known) > MAX_FOLLOWERS:
                known.pop()
            self._unheard.pop(rid, None)
            log.info("request followed elsewhere", request_id=rid, followers=len(known))

    def _on_follow(self, data: bytes) -> None:
        try:
            f = Follow.decode(data)
        except ValueError:
            return
        if f.request_id in self.inflight:
            self._add_followers(f.request_id, {f.reply_to})
            return
        channels, _ = self._follow_memory.get(f.request_id, (set(), 0.0))
        if len(channels) < MAX_FOLLOWERS:
            channels.add(f.reply_to)
        self._follow_memory[f.request_id] = (channels, time.monotonic())
        if len(self._follow_memory) > 10_000:  # bounded: the oldest go first
            for rid in sorted(self._follow_memory, key=lambda r: self._follow_memory[r][1])[:1000]:
                del self._follow_memory[rid]

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    # -- cancels ---------------------------------------------------------------------------
    def _apply_cancels(self) -> None:
        cancels, self._cancels = self._cancels, []
        for rid in cancels:
            if not self.cores.cancel(rid):
                self._cancel_memory[rid] = time.monotonic()
        if self._cancel_memory or self._follow_memory:
            cutoff = time.monotonic() - CANCEL_MEMORY_S
            for rid in [r for r, t in self._cancel_memory.items() if t < cutoff]:
                del self._cancel_memory[rid]
            for rid in [r for r, (_, t) in self._follow_memory.items() if t < cutoff]:
                del self._follow_memory[rid]

    async def _cancel_loop(self) -> None:
        """Hears ``sf:cancel``, ``sf:follow`` and this model's ``sf:wake:{model}`` on one
        connection."""
        backoff = 0.1
        wake = self.keys.wake(self.model).encode()
        follow = self.keys.follow.encode()
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.cancel, wake, follow)
                backoff = 0.1
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is None or msg.get("type") != "message":
                        continue
                    if msg["channel"] == wake:
                        self._on_wake(msg["data"])
                        continue
                    if msg["channel"] == follow:
                        self._on_follow(msg["data"])
                        continue
                    try:
                        self._cancels.append(Cancel.decode(msg["data"]).request_id)
                    except ValueError:
                        continue
            except asyncio.CancelledError:
                await pubsub.aclose()
                raise
            except BROKER_ERRORS as exc:
                log.warning("cancel channel lost; resubscribing", error=str(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass

    # -- heartbeat --------------------------------------------------------------------------
    def _count_tokens(self, n: int) -> None:
        if n:
            self._m_tokens.inc(n)
        now = time.monotonic()
        self._tokens_window.append((now, n))
        while self._tokens_window and self._tokens_window[0][0] < now - 10:
            self._tokens_window.pop(0)

    def tokens_per_s(self) -> float:
        if not self._tokens_window:
            return 0.0
        span = max(time.monotonic() - self._tokens_window[0][0], 1.0)
        return sum(n for _, n in self._tokens_window) / span

    async def _refresh_slots(self) -> None:
        """Push the expiry of the stream slots of the requests running here, so a request
        that runs longer than ``STREAM_SLOT_TTL_S`` keeps its key's slot to its end."""
        held = [(self.keys.streams(fl.task.slot), rid) for rid, fl in self.inflight.items() if fl.task.slot]
        try:
            await refresh_members(self.redis, held, int((time.time() + STREAM_SLOT_TTL_S) * 1000),
                                  int(STREAM_SLOT_TTL_S * 1000))
        except BROKER_ERRORS as exc:
            log.warning("could not refresh stream slots", count=len(held), error=str(exc))

    async def _heartbeat_loop(self) -> None:
        key = self.keys.workers(self.model)
        slots_due = time.monotonic() + STREAM_SLOT_TTL_S / 10
        while True:
            if time.monotonic() >= slots_due:
                slots_due = time.monotonic() + STREAM_SLOT_TTL_S / 10
                await self._refresh_slots()
            metrics.slots_in_use.labels(self.model).set(self.cores.active)
            metrics.slots.labels(self.model).set(self.max_batch)
            info = {
                "heartbeat": time.time(),
                "slots_used": self.cores.active,
                "version": self.cores.version,
                "reloading": self._reloading,
                "max_batch": self.max_batch,
                "tokens_per_s": round(self.tokens_per_s(), 1),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "draining": self._stopping.is_set(),
            }
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.hset(key, self.worker_id, orjson.dumps(info))
                    pipe.expire(key, int(self.settings.worker_ttl_s * 3) + 1)
                    await pipe.execute()
            except BROKER_ERRORS as exc:
                log.warning("heartbeat failed", error=str(exc))
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def _deregister(self) -> None:
        try:
            await self.redis.hdel(self.keys.workers(self.model), self.worker_id)
        except BROKER_ERRORS:
            pass


def run_worker(settings: WorkerSettings) -> int:
    return aio.run(WorkerProcess(settings).run(), settings.event_loop)
