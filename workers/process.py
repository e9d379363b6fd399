"""The worker process around the pure core (STYLE habit 3): it owns XREADGROUP on the
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

from shared.errors import FatalError
from shared.keys import GROUP, LANES, Keys
from shared import aio
from shared.logging import get_logger
from shared.metrics import worker as metrics
from shared.modelrepo import ModelRepository, ensure_artifacts, load_tokenizer
from shared.redis import BROKER_ERRORS, RawBatch, connect
from shared.schema import Cancel, DoneEvent, ErrorEvent, Event, Task, TokenEvent, encode_events
from shared.settings import WorkerSettings

from workers.core import WorkerCore
from workers.coreset import CoreSet, VersionedCore
from workers.engines import load_engine
from workers.lanes import LanePolicy

__all__ = ["WorkerProcess", "run_worker"]

log = get_logger("worker")

#: how long a cancel for a request this worker has not seen yet is remembered
CANCEL_MEMORY_S = 300.0
#: a busy worker reads its lanes at least this often, even with no wake announced
READ_EVERY_S = 0.05


def _entry_id(entry: str) -> tuple[int, int]:
    """A stream entry id ``"<ms>-<seq>"`` as a comparable pair; ``ValueError`` if malformed."""
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)


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
                        for version, out in unpublished:
                            await self._publish(out, version)
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
                if unpublished:
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
        """``b"<lane> <entry id>"`` from a gateway's enqueue: wake unless already read."""
        try:
            lane, entry = data.decode().split(" ", 1)
            entry_id = _entry_id(entry)
        except (UnicodeDecodeError, ValueError):
            self._woken = True
            return
        if entry_id > self._last_read.get(lane, (0, 0)):
            self._woken = True

    async def _read(self, free: int, block: bool) -> list[tuple[str, bytes, dict]]:
        self._woken = False  # before the read: a wake that lands during it is kept
        self._read_at = time.monotonic()
        out = await self._read_lanes(free, block)
        for lane, mid, _ in out:
            entry_id = _entry_id(mid.decode())
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
        if task.request_id in self.cores:
            # the same request delivered twice to this worker (e.g. reclaimed while still running here):
            # the running copy answers; drop the extra delivery without acking the live one
            log.warning("duplicate delivery ignored", request_id=task.request_id, message_id=msg_id.decode())
            return
        self.inflight[task.request_id] = InFlight(lane, msg_id, task)
        self.cores.add(task)
        metrics.admissions.labels(self.model, lane).inc()
        if task.request_id in self._cancel_memory:
            self.cores.cancel(task.request_id)
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
            await asyncio.sleep(self.settings.heartbeat_interval_s / 2)
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
                await self._reclaim()
            except BROKER_ERRORS as exc:
                log.warning("reclaim failed", error=str(exc))
            except ResponseError as exc:
                log.warning("reclaim failed", error=str(exc))

    async def _refresh_own(self) -> None:
        """Reset the idle time of this worker's own deliveries (XCLAIM JUSTID does not
        count a delivery), so a long generation is never taken from a live worker."""
        by_lane: dict[str, list[bytes]] = defaultdict(list)
        for fl in self.inflight.values():
            by_lane[fl.lane].append(fl.message_id)
        for lane, mid, _ in self._held:
            by_lane[lane].append(mid)
        if not by_lane:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for lane, ids in by_lane.items():
                pipe.xclaim(self.lane_keys[lane], GROUP, self.worker_id, 0, ids, justid=True)
            await pipe.execute()

    async def _reclaim(self) -> None:
        s = self.settings
        free = self.cores.free_slots - len(self._held)
        for lane in LANES:
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
                if deliveries > s.max_deliveries:
                    await self._give_up(lane, mid, fields, deliveries)
                    continue
                log.warning("reclaimed a task from a silent worker", message_id=mid.decode(), lane=lane,
                            deliveries=deliveries)
                metrics.reclaimed.labels(self.model).inc()
                self._held.append((lane, mid, fields))
                free -= 1

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
            self._log_events(batch, [ev])
            batch.add(b"PUBLISH", self.keys.reply(task.reply_to), encode_events([ev]))
            await batch.execute(self.redis)

    def _log_events(self, batch: RawBatch, events: list[Event]) -> None:
        """Append events to their request logs (``sf:log:{request_id}``) in ``batch``."""
        s = self.settings
        maxlen, ttl = s.log_maxlen, int(s.log_ttl_s)
        for ev in events:
            key = self.keys.log(ev.request_id)
            batch.add(b"XADD", key, b"MAXLEN", b"~", maxlen, b"*", b"e",
                      orjson.dumps(ev, option=orjson.OPT_SERIALIZE_DATACLASS))
            if not isinstance(ev, TokenEvent) or ev.index % 64 == 0:
                batch.add(b"EXPIRE", key, ttl)

    # -- publishing ----------------------------------------------------------------------
    async def _publish_all(self, outs: list) -> None:
        for version, out in outs:
            await self._publish(out, version)

    async def _publish(self, out, version: str = "") -> None:
        """One pipeline per step: log every event, PUBLISH each connection's events, XACK +
        XDEL finished tasks. The log entries go first, so a gateway that sees a message can
        already find it (and anything before it) in the log."""
        by_channel: dict[str, list[Event]] = defaultdict(list)
        rids_by_channel: dict[str, set[str]] = defaultdict(set)
        for reply_to, ev in out.events:
            if isinstance(ev, DoneEvent):
                ev.model_version = version
            by_channel[reply_to].append(ev)
            rids_by_channel[reply_to].add(ev.request_id)
        channels = list(by_channel)
        acked = []
        batch = RawBatch()
        self._log_events(batch, [ev for _, ev in out.events])
        first_publish = len(batch)
        for ch in channels:
            batch.add(b"PUBLISH", self.keys.reply(ch), encode_events(by_channel[ch]))
        for rid in out.finished:
            fl = self.inflight.pop(rid, None)
            if fl is None:
                continue
            acked.append(fl)
            batch.add(b"XACK", self.lane_keys[fl.lane], GROUP, fl.message_id)
            batch.add(b"XDEL", self.lane_keys[fl.lane], fl.message_id)
        results = await batch.execute(self.redis)
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            metrics.redis_errors.labels("publish").inc()
            log.warning("commands of a publish batch failed", failed=len(failed), first=str(failed[0]))
        ends = {ev.request_id: (ev.finish_reason if isinstance(ev, DoneEvent) else "error")
                for _, ev in out.events if not isinstance(ev, TokenEvent)}
        for fl in acked:
            outcome = ends.get(fl.task.request_id, "unknown")
            metrics.finished.labels(self.model, outcome).inc()
            log.info("task finished", request_id=fl.task.request_id, trace_id=fl.task.trace_id, outcome=outcome)
        for fl in acked:
            self._unheard.pop(fl.task.request_id, None)
        # A PUBLISH that reached nobody: the connection (or its whole gateway) is gone, or the
        # gateway is re-subscribing after its pub/sub socket dropped (it then repairs the gap
        # from the log). Stop the sequence once nobody has listened for orphan_grace_s.
        now = time.monotonic()
        grace = self.settings.orphan_grace_s
        for ch, receivers in zip(channels, results[first_publish:first_publish + len(channels)]):
            for rid in rids_by_channel[ch]:
                if receivers:
                    self._unheard.pop(rid, None)
                    continue
                if rid not in self.inflight:
                    continue
                since = self._unheard.setdefault(rid, now)
                if now - since >= grace:
                    del self._unheard[rid]
                    metrics.cancelled_no_listener.labels(self.model).inc()
                    log.info("nobody listening; cancelling", request_id=rid, unheard_s=round(now - since, 3))
                    self.cores.cancel(rid)

    # -- cancels ---------------------------------------------------------------------------
    def _apply_cancels(self) -> None:
        cancels, self._cancels = self._cancels, []
        for rid in cancels:
            if not self.cores.cancel(rid):
                self._cancel_memory[rid] = time.monotonic()
        if self._cancel_memory:
            cutoff = time.monotonic() - CANCEL_MEMORY_S
            for rid in [r for r, t in self._cancel_memory.items() if t < cutoff]:
                del self._cancel_memory[rid]

    async def _cancel_loop(self) -> None:
        """Hears ``sf:cancel`` and this model's ``sf:wake:{model}`` on one connection."""
        backoff = 0.1
        wake = self.keys.wake(self.model).encode()
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.cancel, wake)
                backoff = 0.1
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is None or msg.get("type") != "message":
                        continue
                    if msg["channel"] == wake:
                        self._on_wake(msg["data"])
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

    async def _heartbeat_loop(self) -> None:
        key = self.keys.workers(self.model)
        while True:
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
