"""The embedding worker's core, without I/O: the ``EmbedTask``s of an embedding model,
embedded together step by step (docs/architecture.md, "A request's path"; docs/openai.md,
"Embeddings").

``EmbeddingCore`` has the shape of ``workers.core.WorkerCore`` (the ``Core`` protocol of
``workers/coreset.py``: ``add``, ``cancel``, ``abandon``, ``step``, ``free_slots``…), so
the worker's parts — intake, publisher, reclaim, dead letters, drain, reload — serve
embedding models unchanged. A task holds one slot from ``add`` to its end.

A task is not one engine call: each ``step`` takes inputs, not tasks, so a request of
2,048 inputs runs over many steps, interleaved with the requests that come after it and
cancellable between them (docs/openai.md, "Embeddings"). A step holds:

* at most the engine's ``max_batch`` inputs and ``max_batch_tokens`` tokens (one input
  longer than that runs alone), and about ``step_ms`` of work: the core keeps a running
  estimate of the engine's time per token and sizes each step's tokens by it, since on a
  CPU a step of 8 inputs already embeds nearly as many a second as one of 64, and a
  shorter step is a shorter wait for whoever comes next;
* the inputs of the tasks that have not started yet, first and alone (a task that came
  while another runs waits for the step under way, then its own), but never two such
  steps in a row, so a stream of new requests cannot stall one that has started;
* otherwise one input of each task in turn (round robin), the turn starting one task
  further each step.

The inputs of a step go to the engine in one ``OnnxEmbeddingEngine.embed`` call (which
sorts them by length and runs them in padded groups itself), and each task gets:

* ``EmbeddingEvent(index, vector)`` for each of its inputs embedded in the step, in order,
  then, in the step of its last input,
* ``DoneEvent`` (``stop``; ``prompt_tokens``: the task's input tokens, ``completion_tokens``
  0);
* or instead ``DoneEvent`` ``cancelled`` (cancelled: it ends at the next step, with the
  vectors sent so far), ``ErrorEvent`` ``timeout`` (its deadline passed before its first
  input ran), ``invalid_request`` (an input the engine refuses, checked before its first
  input runs: the message names its index; never a crash), or ``engine_error`` (the
  engine failed).

A redelivered task (its worker died) is embedded again from its first input: the gateway
drops the indices it delivered already. Thread safety as ``WorkerCore``: ``add``,
``cancel``, ``abandon`` from the event loop take a short lock; ``step`` runs in the
engine thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamfleet.shared.errors import ErrorCode
from streamfleet.shared.logging import get_logger
from streamfleet.shared.schema import AnyTask, DoneEvent, EmbeddingEvent, EmbedTask, ErrorEvent
from streamfleet.workers.core import StepOutput

if TYPE_CHECKING:
    from streamfleet.workers.engines.embedding import OnnxEmbeddingEngine

__all__ = ["EmbeddingCore", "STEP_MS"]

#: about how long an embedding step takes by default (``SF_EMBED_STEP_MS``): on a CPU,
#: long enough to embed nearly as fast as the largest steps, short enough that a request
#: coming in waits little (docs/benchmarks/fairness.md)
STEP_MS = 50.0

log = get_logger("worker.embedding")


@dataclass(slots=True)
class _Job:
    task: EmbedTask
    admitted_at: float
    cancelled: bool = False
    #: inputs embedded so far (their events went out): the next step's first is this one
    cursor: int = 0
    #: when its first vectors went out (its time to first result)
    first_at: float | None = None


class EmbeddingCore:
    """The embedding tasks of one engine.

    Args:
        engine: a ``workers.engines.embedding.OnnxEmbeddingEngine`` (or anything with its
            ``embed``, ``check_input``, ``max_batch`` and ``max_batch_tokens``).
        slots: tasks held at once (default: the engine's ``max_batch``).
        step_ms: about how long a step takes (its tokens sized by the measured time per
            token); 0: as many as the engine's limits allow.
        clock: unix seconds (``created_at`` of a task is on the same scale).
        timer: seconds, for the time steps take.
    """

    def __init__(self, engine: OnnxEmbeddingEngine, *, slots: int | None = None, step_ms: float = STEP_MS,
                 clock: Callable[[], float] = time.time, timer: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.slots = int(slots or engine.max_batch)
        self.step_s = max(0.0, step_ms) / 1000.0
        #: the engine's seconds per token, a running average over steps (None: no step yet)
        self.s_per_token: float | None = None
        self._timer = timer
        self._new_last = False  # the last step held only tasks that had not started
        self._clock = clock
        self._jobs: dict[str, _Job] = {}  # in the order they came
        self._rejected: list[tuple[AnyTask, ErrorCode, str]] = []
        self._lock = threading.Lock()
        self._turn = -1  # the task (by its place in arrival order) whose input leads a step

    # -- the core's shape ---------------------------------------------------------------
    @property
    def max_batch(self) -> int:
        return self.slots

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - len(self._jobs))

    @property
    def active(self) -> int:
        return len(self._jobs)

    def has_work(self) -> bool:
        return bool(self._jobs or self._rejected)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._jobs

    def add(self, task: AnyTask, replay: list[int] | None = None) -> None:
        """Take a task (``replay`` is for text: an embedding is computed again whole). A task
        of another kind ends with an ErrorEvent in the next step.

        Raises:
            ValueError: no free slot, or the task is already here.
        """
        if not isinstance(task, EmbedTask):
            with self._lock:
                self._rejected.append((task, ErrorCode.invalid_request,
                                       f"model {task.model!r} embeds text; this is a {task.kind} task"))
            return
        with self._lock:
            if task.request_id in self._jobs:
                raise ValueError(f"request {task.request_id} is already running")
            if len(self._jobs) >= self.slots:
                raise ValueError("no free slot")
            self._jobs[task.request_id] = _Job(task, admitted_at=self._clock())

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            job = self._jobs.get(request_id)
            if job is None:
                return False
            job.cancelled = True
            return True

    def abandon(self, request_id: str) -> bool:
        """Drop a task without a word (another worker has it now)."""
        with self._lock:
            return self._jobs.pop(request_id, None) is not None

    def abandon_all(self) -> list[AnyTask]:
        """Drop every task (a drain): they are handed back un-acked."""
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
            rejected, self._rejected = self._rejected, []
        return [j.task for j in jobs] + [t for t, _, _ in rejected]

    # -- the step -------------------------------------------------------------------------
    def step(self) -> StepOutput:
        """End what is cancelled, late or malformed; embed the next inputs of the tasks
        here, one from each in turn, up to the engine's limits."""
        out = StepOutput()
        now = self._clock()
        with self._lock:
            rejected, self._rejected = self._rejected, []
            jobs = list(self._jobs.values())
        for task, code, message in rejected:
            out.events.append((task.reply_to, ErrorEvent(task.request_id, str(code), message)))
            out.finished.append(task.request_id)
        live: list[_Job] = []
        for job in jobs:
            t = job.task
            if job.cancelled:
                self._end(job, out, now, "cancelled")
                continue
            if job.cursor == 0:  # not started: its deadline and its inputs are checked once
                if t.deadline is not None and now > t.deadline:
                    self._fail(job, out, ErrorCode.timeout,
                               "the request's deadline passed before a worker could start it")
                    continue
                problem = self._problem(t)
                if problem is not None:
                    self._fail(job, out, ErrorCode.invalid_request, problem)
                    continue
            live.append(job)
        picks = self._pick(live)
        if not picks:
            return out
        order = [(job, i) for job in live for i in range(job.cursor, job.cursor + picks.get(id(job), 0))]
        started = self._timer()
        try:
            vectors = self.engine.embed([job.task.inputs[i] for job, i in order])
        except Exception as exc:  # an engine failure ends these tasks, not the worker
            log.exception("embedding failed", request_ids=[j.task.request_id for j in live if id(j) in picks])
            for job in live:
                if id(job) in picks:
                    self._fail(job, out, ErrorCode.engine_error, f"embedding failed: {exc}")
            return out
        done_at = self._clock()
        out.batch_size, out.prefill_tokens = len(order), sum(len(job.task.inputs[i]) for job, i in order)
        took = (self._timer() - started) / max(1, out.prefill_tokens)
        self.s_per_token = took if self.s_per_token is None else 0.7 * self.s_per_token + 0.3 * took
        row = 0
        for job in live:
            n = picks.get(id(job), 0)
            if not n:
                continue
            t, first = job.task, job.cursor
            rows, row = vectors[row:row + n], row + n
            last = first + n >= len(t.inputs)
            with self._lock:
                if self._jobs.get(t.request_id) is not job:
                    continue  # abandoned meanwhile: another worker has it
                cancelled = job.cancelled
                if not cancelled:
                    job.cursor = first + n
                    if last:  # its last vectors and its end go out together
                        del self._jobs[t.request_id]
            if cancelled:
                self._end(job, out, done_at, "cancelled")
                continue
            if job.first_at is None:
                job.first_at = done_at
            for k in range(n):
                out.events.append((t.reply_to, EmbeddingEvent(t.request_id, first + k, EmbeddingEvent.pack(rows[k]))))
            if last:
                self._done(job, out, done_at, "stop")
        return out

    def step_tokens(self) -> int:
        """The tokens a step may hold: ``max_batch_tokens``, lowered to about ``step_ms``
        of work at the engine's measured time per token (before the first step: one
        input, which measures it)."""
        limit = int(self.engine.max_batch_tokens)
        if not self.step_s:
            return limit
        if self.s_per_token is None:
            return 1
        return max(1, min(limit, int(self.step_s / max(self.s_per_token, 1e-9))))

    def _pick(self, live: list[_Job]) -> dict[int, int]:
        """How many inputs of each task (by ``id``) the step embeds, from each task's
        cursor: the tasks not started yet alone when there are some (not two steps in a
        row), else every task; one input of each in turn while the step holds fewer than
        ``max_batch`` inputs, skipping an input that would take it past the step's tokens
        (``step_tokens``; the first input of a step goes whatever its length)."""
        max_inputs, max_tokens = self.engine.max_batch, self.step_tokens()
        picks: dict[int, int] = {}
        if not live:
            return picks
        new = [job for job in live if job.cursor == 0]
        if new and (not self._new_last or len(new) == len(live)):
            ring, self._new_last = new, len(new) < len(live)
        else:
            self._turn = (self._turn + 1) % len(live)
            ring, self._new_last = live[self._turn:] + live[:self._turn], False
        inputs = tokens = 0
        progressed = True
        while progressed and inputs < max_inputs:  # each round adds an input or ends
            progressed = False
            for job in ring:
                k = picks.get(id(job), 0)
                if job.cursor + k >= len(job.task.inputs):
                    continue
                size = len(job.task.inputs[job.cursor + k])
                if inputs and tokens + size > max_tokens:
                    continue  # this task's next input waits for the next step
                picks[id(job)] = k + 1
                inputs, tokens, progressed = inputs + 1, tokens + size, True
                if inputs >= max_inputs:
                    break
        return picks

    def _problem(self, task: EmbedTask) -> str | None:
        """What the engine would refuse in the task's inputs (naming the input), or None.
        The gateway refused all of it already; a worker trusts no task."""
        if not task.inputs:
            return "the request has no inputs"
        for i, ids in enumerate(task.inputs):
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                return f"input {i} is not a list of token ids (integers)"
            try:
                self.engine.check_input(ids, i)
            except (ValueError, TypeError, OverflowError) as exc:
                return str(exc)
        return None

    def _end(self, job: _Job, out: StepOutput, now: float, reason: str) -> None:
        if self._remove(job):  # (else abandoned meanwhile: another worker has it)
            self._done(job, out, now, reason)

    def _done(self, job: _Job, out: StepOutput, now: float, reason: str) -> None:
        t = job.task
        created = t.created_at
        out.events.append((t.reply_to, DoneEvent(
            t.request_id, reason, prompt_tokens=t.prompt_tokens, completion_tokens=0,
            queue_ms=max(0.0, (job.admitted_at - created) * 1000.0),
            ttft_ms=max(0.0, ((job.first_at or now) - created) * 1000.0),
            total_ms=max(0.0, (now - created) * 1000.0))))
        out.finished.append(t.request_id)

    def _fail(self, job: _Job, out: StepOutput, code: ErrorCode, message: str) -> None:
        if not self._remove(job):
            return
        out.events.append((job.task.reply_to, ErrorEvent(job.task.request_id, str(code), message)))
        out.finished.append(job.task.request_id)

    def _remove(self, job: _Job) -> bool:
        """Whether the job was still this core's (and is no longer)."""
        with self._lock:
            if self._jobs.get(job.task.request_id) is job:
                del self._jobs[job.task.request_id]
                return True
            return False
