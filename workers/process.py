"""The worker process, one per GPU: the composition root around the pure cores
(docs/architecture.md, "A request's path", steps 3 to 5).

``WorkerProcess`` connects, loads the engine, builds its parts around one table of the
requests it holds (``inflight``) and runs them: the aux loops (``heartbeat``, the
``control`` channel, ``reclaim``, ``reload``) and the main loop, one continuous-batching
step per turn::

    apply the cancels heard since the last step
    read at the step boundary                 (intake: when woken, or without overlap)
    start the engine step                     (in a thread, off the event loop)
    publish the previous step meanwhile       (publisher: log, PUBLISH, XACK + XDEL)
    admit what has arrived                    (intake)
    finish the step

On SIGTERM it reads no more and hands unfinished work back (``drain``). Acked tasks are
deleted from the lane stream, so ``XLEN`` of a lane is its backlog: queued plus in flight.
Whatever Redis does meanwhile (gone, or not answering), a worker told to stop exits
within its drain's deadline plus ``STOP_GRACE_S`` twice, and at once when it runs
nothing (``_bound_stop``): what it could not hand back stays pending in its lanes.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.exceptions import ReadOnlyError, ResponseError

from streamfleet.shared import aio
from streamfleet.shared.errors import FatalError, NotFoundError
from streamfleet.shared.keys import GROUP, LANES, split_source
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import worker as metrics
from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts, load_tokenizer
from streamfleet.shared.redis import BROKER_ERRORS, connect
from streamfleet.shared.schema import Heartbeat
from streamfleet.shared.settings import WorkerSettings
from streamfleet.workers.affinity import Affinity
from streamfleet.workers.audio import AudioFeed
from streamfleet.workers.context import WorkerContext
from streamfleet.workers.control import ControlChannel
from streamfleet.workers.core import StepOutput, WorkerCore
from streamfleet.workers.coreset import CoreSet, VersionedCore
from streamfleet.workers.deadletters import DeadLetters
from streamfleet.workers.drain import Drain
from streamfleet.workers.engines import load_engine
from streamfleet.workers.health import Liveness, serve_metrics_and_health
from streamfleet.workers.heartbeat import HeartbeatLoop, TokenRate
from streamfleet.workers.inflight import InFlightTable
from streamfleet.workers.intake import Intake, WakeState
from streamfleet.workers.lanes import LanePolicy
from streamfleet.workers.prefixadvert import PrefixAdvert
from streamfleet.workers.publisher import Publisher
from streamfleet.workers.reclaim import Reclaimer, Takeover
from streamfleet.workers.reload import Reloader, target_version

if TYPE_CHECKING:
    from streamfleet.workers.prefixcache import PrefixCache

__all__ = ["WorkerProcess", "run_worker", "Takeover"]

log = get_logger("worker")


#: seconds the loop waits at most for the engine thread to take up a step it was handed
#: (``WorkerProcess._start_step``)
STEP_HANDOFF_S = 0.002
#: the heartbeat's ``step_ms`` is the longest of this many recent steps
STEP_WINDOW = 16

#: seconds a stopping worker gives Redis past what it waits for anyway: the main loop
#: past the drain's deadline (or, running nothing, past one idle read's ``block_ms``)
#: before it is cut short, then the hand-back and deregistration together
#: (``WorkerProcess._bound_stop``, ``_finish``)
STOP_GRACE_S = 1.0

#: seconds an idle worker waits between tries when events wait to go out to a shard
#: that failed (a cluster primary failing over), instead of its blocking read
PENDING_RETRY_S = 0.05

#: the longest back-off of the main loop after a Redis error: on one server, and on a
#: cluster (where only an idle worker's read backs off, and a failover is over in seconds)
MAX_BACKOFF_S = 5.0
MAX_BACKOFF_CLUSTER_S = 1.0


@dataclass(slots=True)
class StepState:
    """What the main loop carries from one turn to the next."""

    running: asyncio.Future[list[tuple[str, StepOutput]]] | None = None  # the engine step in the executor
    started_at: float = 0.0  # perf_counter() when it started
    #: (version, StepOutput) of the last finished step
    unpublished: list[tuple[str, StepOutput]] = field(default_factory=list)
    just_read: bool = False  # tasks were just read: the next step starts without another read
    idle_read: bool = False  # the loop waits on an idle worker's blocking read (nothing to lose if cut)
    redis_failed: bool = False  # the last turn failed on Redis (the loop is backing off)


class WorkerProcess:
    # the parts, built by _compose once Redis is connected and the engine loaded
    intake: Intake
    publisher: Publisher
    dead_letters: DeadLetters
    reclaimer: Reclaimer
    reloader: Reloader
    control: ControlChannel
    heartbeat: HeartbeatLoop
    drain: Drain
    affinity: Affinity | None = None  # a text model's (prefix-aware routing)
    # connected and loaded by run, before anything else uses them
    redis: aioredis.Redis
    cores: CoreSet

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.keys = settings.keys()
        self.model = settings.model
        self.liveness = Liveness(settings.worker_stall_s)
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.lane_keys = self.keys.lanes(self.model)
        self.policy = LanePolicy(settings.lane_weights)
        self.table = InFlightTable()
        self.wake = WakeState(self.worker_id)
        self.tokens = TokenRate()
        self.max_batch = 0
        self.overlap_io = True
        self.audio: AudioFeed | None = None  # a speech model's audio input
        self._embedding = False  # an embedding model's worker (tokens_per_s counts input tokens)
        self._bg: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()
        self._cut_short = False  # the main loop was cancelled by _bound_stop
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._step_began = threading.Event()  # set by the engine thread as a step begins
        m = self.model
        self._m_step = metrics.step_time.labels(m)
        self._steps_ms: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)  # for the heartbeat
        self._m_batch = metrics.batch_size.labels(m)
        self._m_grammar = metrics.grammar_mask.labels(m)
        self._m_shared = metrics.shared_prefills.labels(m)
        self._m_tokens = metrics.tokens.labels(m)
        self._m_audio = metrics.audio.labels(m)
        self._m_computed = metrics.prompt_tokens.labels(m, "computed")
        self._m_cached = metrics.prompt_tokens.labels(m, "cached")
        #: the prefix cache whose counters the metrics last took, and those counters
        self._cache_seen: tuple[object, int, int, int, int] = (None, 0, 0, 0, 0)
        #: the execution mode the engine runs and why (``shared/execution.py``; empty for
        #: models without one), said in the heartbeat
        self._execution: tuple[str, str] = ("", "")

    # -- start-up -------------------------------------------------------------------
    def _load(self, version: str | None = None) -> VersionedCore:
        repo = ModelRepository(self.settings.engines_dir)
        spec = repo.get(self.model, version)
        ensure_artifacts(spec)
        if spec.kind == "asr":  # a speech model: decoder slots fed by the AudioFeed
            from streamfleet.workers.engines.speech_loader import load_speech_engine
            from streamfleet.workers.speechcore import SpeechCore

            speech = load_speech_engine(spec, **({"slots": self.settings.max_batch} if self.settings.max_batch else {}))
            return VersionedCore(spec.version, SpeechCore(speech))
        if spec.kind == "embedding":  # an embedding model: whole tasks embedded together (workers/embedcore.py)
            from streamfleet.workers.embedcore import EmbeddingCore
            from streamfleet.workers.engines.embedding import OnnxEmbeddingEngine

            embedder = OnnxEmbeddingEngine(spec, threads=self.settings.threads or None)
            return VersionedCore(spec.version, EmbeddingCore(embedder, slots=self.settings.max_batch or None,
                                                               step_ms=self.settings.embed_step_ms))
        options: dict[str, Any] = {}
        backend = self.settings.backend or spec.backend
        if backend == "onnxruntime" and self.settings.threads:
            options["threads"] = self.settings.threads
        if backend == "onnxruntime":
            options["prefix_cache_mb"] = self.settings.prefix_cache_mb
            options["prefix_block"] = self.settings.prefix_block_tokens
        if backend == "echo":
            options["delay_ms"] = self.settings.echo_delay_ms
            options["max_batch"] = self.settings.max_batch
        if backend == "tensorrt":
            options["build_if_missing"] = self.settings.trt_build_if_missing
            options["cuda"] = self.settings.trt_cuda
        engine = load_engine(spec, self.settings.backend, **options)
        if backend == "onnxruntime":  # the mode a GGUF model runs, for the heartbeat (status, /v1/models)
            from streamfleet.shared.execution import served

            mode = served(spec)
            self._execution = (mode.mode, mode.why) if mode is not None else ("", "")
        tokenizer = load_tokenizer(spec)
        max_batch = self.settings.max_batch or spec.max_batch
        return VersionedCore(spec.version, WorkerCore(engine, tokenizer, max_batch=max_batch,
                                                     grammar_limits=self.settings.grammar_limits(),
                                                     max_step_tokens=self.settings.max_step_tokens,
                                                     step_target_ms=self.settings.step_target_ms))

    async def _load_async(self, version: str | None) -> VersionedCore:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._load, version)

    async def _ensure_groups(self) -> None:
        """The lanes' streams and group, and this worker's affinity streams once it has any."""
        for lane in LANES:
            try:
                await self.redis.xgroup_create(self.lane_keys[lane], GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        if self.affinity is not None:
            await self.affinity.ensure()

    async def _wait_for_redis(self) -> bool:
        """Until Redis answers (True), or the worker is told to stop (False)."""
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                await self._ensure_groups()
                return True
            except BROKER_ERRORS as exc:
                log.warning("redis unreachable; retrying", error=str(exc), retry_in_s=backoff)
                await self._back_off(backoff)
                backoff = min(backoff * 2, 5.0)
        return False

    async def _back_off(self, seconds: float) -> None:
        """Wait between tries at Redis: ``seconds``, cut short by the stop signal; a
        stopping worker waits no longer than its drain's deadline."""
        if self._stopping.is_set():
            if getattr(self, "drain", None) is not None:  # (not yet before the parts are built)
                seconds = min(seconds, max(self.drain.start() - time.monotonic(), 0.01))
            await asyncio.sleep(seconds)
            return
        try:
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        except TimeoutError:
            pass

    def _compose(self, kind: str) -> None:
        """Build the parts around the connection, the cores and the in-flight table, for a
        model of ``kind`` (``ModelSpec.kind``)."""
        ctx = WorkerContext(self.redis, self.settings, self.keys, self.worker_id, self.lane_keys)
        table = self.table
        text, speech = kind == "text", kind == "asr"
        # prefix-aware routing (docs/architecture.md): text models only
        self.affinity = Affinity(ctx, self.cores, table, self._stopping) if text else None
        if self.affinity is not None:  # (the intake hears this worker's own wakes: Intake._own_wake)
            self.wake.on_other = self.affinity.on_wake
        self.publisher = Publisher(ctx, self.cores, table, self._spawn)
        self.dead_letters = DeadLetters(ctx, self.publisher)
        self.intake = Intake(ctx, self.policy, self.cores, table, self.wake, self.dead_letters, self._spawn,
                             affinity=self.affinity)
        self.reclaimer = Reclaimer(ctx, self.cores, table, self.dead_letters, self._stopping, affinity=self.affinity)
        self.reloader = Reloader(ctx, self.cores, self._load_async, self._stopping)
        self.control = ControlChannel(ctx, table, self.wake)
        advert = PrefixAdvert(ctx, self._prefix_cache) if text else None
        self.heartbeat = HeartbeatLoop(ctx, table, self._heartbeat, advert=advert, affinity=self.affinity)
        self.drain = Drain(ctx, self.cores, table, self._executor)
        self.audio = AudioFeed(ctx, self.cores) if speech else None

    # -- main -------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._stopping.set)
            except (NotImplementedError, RuntimeError):
                pass
        self.redis = connect(self.settings.redis_url, cluster=self.settings.redis_cluster,
                             socket_timeout=self.settings.redis_socket_timeout_s,
                             command_name=f"sf-worker-{self.worker_id}-commands")
        if not await self._wait_for_redis():  # told to stop before Redis ever answered
            log.info("worker stopped before Redis answered", worker_id=self.worker_id)
            await self._close_redis()
            self._executor.shutdown(wait=True)
            return 0
        try:
            first = await self._load_async(await target_version(self.redis, self.keys, self.model))
        except NotFoundError:  # no such model folder: say which exist, in one line
            log.error("worker cannot start", error=ModelRepository(self.settings.engines_dir).missing(self.model))
            await self.redis.aclose()
            return 2
        except FatalError as exc:
            log.error("worker cannot start", error=exc.message)
            await self.redis.aclose()
            return 2
        self.max_batch = first.core.free_slots
        self.cores = CoreSet(first, self.max_batch)
        spec = ModelRepository(self.settings.engines_dir).get(self.model)
        backend = self.settings.backend or spec.backend
        # overlapping Redis I/O with the step pays off when the engine leaves the CPU free (GPU, echo);
        # a CPU engine (ONNX Runtime, a CPU speech decoder) needs those cores itself
        self.overlap_io = self.settings.overlap_io if self.settings.overlap_io is not None \
            else backend not in ("onnxruntime", "pocketsphinx")
        if self.settings.metrics_port:
            # /metrics and /healthz (the liveness that sees a hang: workers/health.py)
            serve_metrics_and_health(self.settings.metrics_host, self.settings.metrics_port, self.liveness)
            log.info("worker metrics", url=f"http://{self.settings.metrics_host}:{self.settings.metrics_port}/metrics",
                     health=f"http://{self.settings.metrics_host}:{self.settings.metrics_port}/healthz")
        log.info("worker ready", worker_id=self.worker_id, model=self.model, max_batch=self.max_batch,
                 version=self.cores.version, frozen_objects=aio.settle_heap())
        self._compose(spec.kind)
        self._embedding = spec.kind == "embedding"
        aux = [asyncio.create_task(self.liveness.tick(), name="liveness"),
               asyncio.create_task(self.heartbeat.run(), name="heartbeat"),
               asyncio.create_task(self.control.run(), name="cancels"),
               asyncio.create_task(self.reclaimer.run(), name="reclaim"),
               asyncio.create_task(self.reloader.run(), name="reload")]
        if self.affinity is not None:
            aux.append(asyncio.create_task(self.affinity.run(), name="affinity"))
        try:
            await self._serve()
        finally:
            self.intake.close()
            for t in aux:
                t.cancel()
            await asyncio.gather(*aux, return_exceptions=True)
            await self._close_redis()
            self._executor.shutdown(wait=True)
        log.info("worker stopped", worker_id=self.worker_id)
        return 0

    async def _close_redis(self) -> None:
        try:
            async with asyncio.timeout(STOP_GRACE_S):
                await self.redis.aclose()
        except (TimeoutError, *BROKER_ERRORS):
            pass

    async def _serve(self) -> None:
        """The main loop until it stops (its drain is over, or ``_bound_stop`` cut it
        short), then the last step's events and the hand-back (``_finish``)."""
        st = StepState()
        main = asyncio.create_task(self._main_loop(st), name="main")
        bound = asyncio.create_task(self._bound_stop(main, st), name="stop-bound")
        try:
            await asyncio.wait({main, bound}, return_when=asyncio.FIRST_COMPLETED)
            if not main.done():  # cut short: a moment to unwind (a publish it awaits is cancelled below)
                await asyncio.wait({main}, timeout=STOP_GRACE_S / 2)
            failure = main.exception() if main.done() and not main.cancelled() else None
            if failure is not None:
                raise failure
            await self._finish(st)
        finally:
            bound.cancel()
            main.cancel()

    async def _bound_stop(self, main: asyncio.Task[None], st: StepState) -> None:
        """Bound a stopping worker's main loop whatever Redis does. Told to stop, the loop
        gets until the drain's deadline (its clock starts now) plus ``STOP_GRACE_S``;
        running nothing (no sequence, no step, no unsent events), until an idle read
        that began before the signal has had ``block_ms`` plus ``STOP_GRACE_S`` to
        answer. Past that Redis is not answering (a host gone without a reset, a paused
        or partitioned server: each command would wait the socket timeout) and the loop
        is cancelled where it waits."""
        await self._stopping.wait()
        told = time.monotonic()
        deadline = self.drain.start()
        idle_until = told + self.settings.block_ms / 1000 + STOP_GRACE_S
        while not main.done():
            now = time.monotonic()
            idle = st.running is None and not st.unpublished and not self.publisher.pending \
                and not self.cores.has_work()
            if now >= deadline + STOP_GRACE_S or (idle and (st.idle_read or st.redis_failed) and now >= idle_until):
                log.warning("stopping: Redis does not answer in time; cutting the wait short",
                            in_flight=self.cores.active, waited_s=round(now - told, 2))
                self._cut_short = True
                main.cancel()
                return
            await asyncio.wait({main}, timeout=0.05)

    async def _main_loop(self, st: StepState) -> None:
        """Run steps until a drain is over. A Redis error backs off and resumes where the
        step stood (an engine step in flight is finished, unsent events go out first); a
        lane stream or group that vanished is recreated. On a Redis Cluster a shard that
        fails does not get here (docs/cluster.md, "When a shard fails"): the publisher
        keeps that shard's share of each step and the intake reads nothing from it, while
        the steps go on; only an idle worker's read, with nothing running, backs off."""
        backoff = 0.1
        max_backoff = MAX_BACKOFF_CLUSTER_S if self.keys.cluster else MAX_BACKOFF_S
        regroup = False  # a lane's stream or group vanished: recreate them before the next step
        while True:
            if st.running is None and not self.cores.has_work():
                self.liveness.idle()
            stopping = self._stopping.is_set()
            # a step cut short by a Redis error is finished first, unless Redis stays away
            # past the drain's deadline: then the worker stops all the same (what it held
            # stays pending in the lanes, and a live worker reclaims it)
            if stopping and (st.running is None or self.drain.overdue()) and self.drain.due():
                return
            try:
                if regroup:  # (here, so that Redis failing meanwhile backs off like any step)
                    await self._ensure_groups()
                    regroup = False
                await self._step(st, stopping)
                backoff = 0.1
                st.redis_failed = False
            except (*BROKER_ERRORS, ReadOnlyError) as exc:  # (READONLY: a primary turned replica)
                metrics.redis_errors.labels("main_loop").inc()
                log.warning("redis error in worker loop", error=str(exc))
                st.redis_failed = True
                await self._back_off(backoff)
                backoff = min(backoff * 2, max_backoff)
            except ResponseError as exc:
                # NOGROUP: a read found a lane's group gone (Redis restarted empty, the key
                # deleted); UNBLOCKED: the stream an idle worker waited on was deleted
                if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                    raise
                log.warning("lane stream or group vanished; recreating", error=str(exc))
                regroup = True

    async def _step(self, st: StepState, stopping: bool) -> None:
        """One continuous-batching step. The previous step's events are published while
        the engine computes this one, so publishing overlaps the model instead of adding
        to every step; without overlap (a CPU engine, whose cores the engine needs) the
        step finishes before any I/O."""
        publishing: asyncio.Future[Any] | None = None
        if st.running is None:  # else a Redis error cut the last turn short mid-step
            self._apply_cancels()
            publishing = await self._boundary_read(st, stopping)
            if self.audio is not None:  # a speech model: what its utterances said since
                await self.audio.read()
            await self._start_step(st)
        if publishing is not None:
            await publishing
        await self._publish_previous(st)
        await self._admit_arrivals(st, stopping)
        await self._finish_step(st)
        await self._free_retired()

    def _apply_cancels(self) -> None:
        """Cancel what was asked since the last step; remember cancels for requests not
        running here (yet)."""
        now = time.monotonic()
        for rid in self.control.take_cancels():
            if not self.cores.cancel(rid):
                self.table.remember_cancel(rid, now)
        self.table.forget_old(now)

    async def _boundary_read(self, st: StepState, stopping: bool) -> asyncio.Future[Any] | None:
        """The step boundary: tasks that arrived while the last step computed (and held
        ones) join this step. With overlapped I/O the read is made only when a gateway
        announced a task not read yet (``sf:wake:{model}``), and the last step's events go
        out on another connection meanwhile, so neither round trip waits for the other.
        Returns that publish, still running."""
        read_now = self.wake.woken or not self.overlap_io
        wanted = not stopping and self.cores.has_work() and self.cores.free_slots > 0 and not st.just_read \
            and (read_now or bool(self.table.held))
        st.just_read = False
        if not wanted:
            return None
        publishing = None
        if st.unpublished and self.overlap_io and read_now:
            outs, st.unpublished = st.unpublished, []
            publishing = asyncio.ensure_future(self.publisher.publish_all(outs))
        try:
            await self.intake.admit(block=False, read=read_now)
        except BaseException:
            if publishing is not None:
                await asyncio.gather(publishing, return_exceptions=True)
            raise
        return publishing

    async def _start_step(self, st: StepState) -> None:
        if not self.cores.has_work():
            return
        st.started_at = time.perf_counter()
        began = self._step_began
        began.clear()
        st.running = asyncio.get_running_loop().run_in_executor(self._executor, self._run_step)
        if not self.overlap_io:  # finish the step before any I/O
            await self._finish_step(st)
        else:
            # The engine thread first (docs/architecture.md, "A request's path"): block until it
            # runs, so that it holds the GIL through the step's own Python up to the engine
            # call; only then does this loop build and send the last step's publish beside
            # it. Otherwise the engine thread waits for the GIL until that Python is done
            # (the step's start delayed by as long).
            began.wait(STEP_HANDOFF_S)

    def _run_step(self) -> list[tuple[str, StepOutput]]:
        """The step, in the engine thread."""
        self._step_began.set()
        return self.cores.step()

    async def _publish_previous(self, st: StepState) -> None:
        """The last finished step's events, after any whose publish failed before."""
        if st.unpublished or self.publisher.pending:
            outs, st.unpublished = st.unpublished, []
            await self.publisher.publish_all(outs)

    async def _admit_arrivals(self, st: StepState, stopping: bool) -> None:
        """While the engine computes, start what has arrived (read only when woken, or
        ``READ_EVERY_S`` after the last read), and then what gateways announce until the
        step returns; an idle worker blocks on the read instead."""
        if stopping or self.cores.free_slots <= 0:
            return
        if st.running is not None:
            await self.intake.admit(block=False, read=self.wake.should_read())
            await self._admit_while_computing(st.running)
        elif not self.cores.has_work():
            if self.publisher.pending:  # a shard's events wait (failing over): back soon to send them
                await self.intake.admit(block=False)
                st.just_read = True
                await self._back_off(PENDING_RETRY_S)
                return
            if self.cores.idle_work():  # finished replies into the prefix cache, a chunk at a time
                await self._idle_step()
                st.just_read = True
                return
            st.idle_read = True  # (a stopping worker may cut this wait short: _bound_stop)
            try:
                await self.intake.admit(block=True)
            finally:
                st.idle_read = False
            st.just_read = True

    async def _idle_step(self) -> None:
        """Nothing to run: what has arrived first (a read that does not block), else one
        chunk of a finished reply's blocks computed into the prefix cache, in the engine's
        thread (docs/scheduling.md, "Prefix cache"): a task that arrives meanwhile waits
        for that chunk at most, and is read by the next turn of the loop."""
        await self.intake.admit(block=False)
        if not self.cores.has_work():
            await asyncio.get_running_loop().run_in_executor(self._executor, self.cores.idle_step)
            self._cache_metrics()

    async def _admit_while_computing(self, running: asyncio.Future[list[tuple[str, StepOutput]]]) -> None:
        """Read and start the tasks gateways announce while the engine computes, until it
        returns (docs/architecture.md, "A request's path"): they are in the cores when
        the step ends, so the next one starts at once with them, instead of after a read
        at the boundary; and a worker whose sequences all end in this step starts the
        next with what arrived meanwhile, its events published beside it, instead of
        publishing first and then blocking on a read. A burst of enqueues is read in a
        few reads (``WakeState.settle``)."""
        wake = self.wake
        while not running.done() and self.cores.free_slots > 0 and not self._stopping.is_set():
            if not wake.woken:
                await asyncio.wait((running, wake.next_wake()), return_when=asyncio.FIRST_COMPLETED)
                if running.done() or not wake.woken or self._stopping.is_set():
                    break
            await self.intake.admit(block=False, read=True)

    async def _finish_step(self, st: StepState) -> None:
        if st.running is None:
            return
        outs = await st.running
        st.running = None
        st.unpublished += outs
        took = time.perf_counter() - st.started_at
        self._m_step.observe(took)
        self._steps_ms.append(took * 1000.0)
        self.liveness.stepped(self.cores.active)
        for _version, out in outs:
            if out.batch_size:
                self._m_batch.observe(out.batch_size)
            if out.new_tokens:
                self._m_tokens.inc(out.new_tokens)
            if out.audio_s:
                self._m_audio.inc(out.audio_s)
            if out.grammar_s:
                self._m_grammar.observe(out.grammar_s)
            if out.shared_prefills:
                self._m_shared.inc(out.shared_prefills)
            if out.prefill_tokens:
                self._m_computed.inc(out.prefill_tokens)
            if out.cached_tokens:
                self._m_cached.inc(out.cached_tokens)
            # an embedding model generates nothing: its rate is of the input tokens it embeds
            self.tokens.add(out.prefill_tokens if self._embedding else out.new_tokens)
        self._cache_metrics()

    def _prefix_cache(self) -> PrefixCache | None:
        """The current version's prefix cache (None: none)."""
        cores: CoreSet | None = getattr(self, "cores", None)  # (None before run loaded them)
        return getattr(cores.current.core, "prefix_cache", None) if cores is not None else None

    def _cache_metrics(self) -> None:
        cache = self._prefix_cache()
        if cache is None:
            return
        seen, lookups, hits, evicted, replies = self._cache_seen
        if seen is not cache:  # a new version's cache counts from zero
            lookups = hits = evicted = replies = 0
        st, m = cache.stats, self.model
        if st.hits > hits:
            metrics.prefix_lookups.labels(m, "hit").inc(st.hits - hits)
        if st.lookups - st.hits > lookups - hits:
            metrics.prefix_lookups.labels(m, "miss").inc((st.lookups - st.hits) - (lookups - hits))
        if st.evicted > evicted:
            metrics.prefix_evicted.labels(m).inc(st.evicted - evicted)
        if st.reply_tokens > replies:
            metrics.prefix_reply_tokens.labels(m).inc(st.reply_tokens - replies)
        metrics.prefix_bytes.labels(m).set(cache.bytes)
        metrics.prefix_blocks.labels(m).set(len(cache))
        self._cache_seen = (cache, st.lookups, st.hits, st.evicted, st.reply_tokens)

    async def _free_retired(self) -> None:
        """Free the old engine once a reload's old core has finished its sequences."""
        retired = self.cores.retired()
        if retired is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, retired.core.engine.close)
            log.info("old model version freed", version=retired.version, now=self.cores.version)

    async def _finish(self, st: StepState) -> None:
        """The drain is over: publish the last step, hand back what is left and
        deregister, within what is left of the drain's deadline or ``STOP_GRACE_S``,
        whichever is longer. Redis unreachable (the main loop cut short or backing off,
        the hand-back failed), the worker stops all the same: what it holds stays pending
        in its lanes, and its heartbeat entry expires."""
        until = max(self.drain.start(), time.monotonic() + STOP_GRACE_S)
        reachable = not (self._cut_short or st.redis_failed)
        if reachable and (st.unpublished or self.publisher.pending):
            try:
                async with asyncio.timeout(max(until - time.monotonic(), 0.01)):
                    await self.publisher.publish_all(st.unpublished)
                    while self.publisher.pending:  # (a cluster shard failing over: until it is back)
                        await asyncio.sleep(PENDING_RETRY_S)
                        await self.publisher.publish_all([])
            except (TimeoutError, *BROKER_ERRORS) as exc:
                log.warning("could not publish the last step", error=str(exc) or type(exc).__name__)
                reachable = False
        # (Redis known unreachable: one short try, in case it is back)
        within = max(until - time.monotonic(), 0.01)
        reachable = await self.drain.hand_back(within if reachable else min(within, STOP_GRACE_S / 2)) and reachable
        if reachable:
            try:
                async with asyncio.timeout(max(until - time.monotonic(), 0.01)):
                    await self.heartbeat.deregister()
            except TimeoutError:
                pass

    # -- for the parts --------------------------------------------------------------------
    def _heartbeat(self) -> Heartbeat:
        cache = self._prefix_cache()
        st = cache.stats if cache is not None else None
        return Heartbeat(heartbeat=time.time(), slots_used=self.cores.active, max_batch=self.max_batch,
                         version=self.cores.version, reloading=self.reloader.reloading,
                         draining=self._stopping.is_set(), tokens_per_s=round(self.tokens.per_s(), 1),
                         pid=os.getpid(), host=socket.gethostname(),
                         cache_blocks=len(cache) if cache is not None else 0,
                         cache_bytes=cache.bytes if cache is not None else 0,
                         cache_hit_rate=round(st.cached_tokens / st.requested_tokens, 4)
                         if st is not None and st.requested_tokens else 0.0,
                         step_ms=round(max(self._steps_ms, default=0.0), 1),
                         shared_used=sum(1 for fl in self.table.running.values() if not split_source(fl.lane)[1]),
                         execution=self._execution[0], execution_why=self._execution[1], **self._step_costs())

    def _step_costs(self) -> dict[str, Any]:
        """The heartbeat's step target and learned step costs (a text model's core; the
        current version's), and the prompt tokens its last prefill step took."""
        core = self.cores.current.core
        costs = getattr(core, "costs", None)
        if costs is None or not isinstance(core, WorkerCore):
            return {}
        return {"step_target_ms": round(core.step_target_s * 1000.0, 1),
                "step_costs": costs.describe() | {"chunk": float(core.last_chunk)}}

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)


def run_worker(settings: WorkerSettings) -> int:
    return aio.run(WorkerProcess(settings).run(), settings.event_loop)
