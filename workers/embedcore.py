"""The embedding worker's core, without I/O: the ``EmbedTask``s of an embedding model,
embedded together step by step (docs/architecture.md, "A request's path"; docs/openai.md,
"Embeddings").

``EmbeddingCore`` has the shape of ``workers.core.WorkerCore`` (the ``Core`` protocol of
``workers/coreset.py``: ``add``, ``cancel``, ``abandon``, ``step``, ``free_slots``…), so
the worker's parts — intake, publisher, reclaim, dead letters, drain, reload — serve
embedding models unchanged. A task holds one slot from ``add`` to its end. Each ``step``
takes the waiting tasks in the order they came, whole, up to the engine's ``max_batch``
inputs and ``max_batch_tokens`` tokens (a larger task goes alone), and embeds all their
inputs in one ``OnnxEmbeddingEngine.embed`` call (which sorts them by length and runs
them in padded groups itself), then emits for each task:

* ``EmbeddingEvent(index, vector)`` for each input, in order, then
* ``DoneEvent`` (``stop``; ``prompt_tokens``: the task's input tokens, ``completion_tokens``
  0), all in the same step, so the publisher sends them in one message;
* or instead ``DoneEvent`` ``cancelled`` (cancelled before its vectors went out),
  ``ErrorEvent`` ``timeout`` (its deadline passed before it ran), ``invalid_request``
  (an input the engine refuses: the message names its index; never a crash), or
  ``engine_error`` (the engine failed).

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

__all__ = ["EmbeddingCore"]

log = get_logger("worker.embedding")


@dataclass(slots=True)
class _Job:
    task: EmbedTask
    admitted_at: float
    cancelled: bool = False


class EmbeddingCore:
    """The embedding tasks of one engine.

    Args:
        engine: a ``workers.engines.embedding.OnnxEmbeddingEngine`` (or anything with its
            ``embed``, ``check_input``, ``max_batch`` and ``max_batch_tokens``).
        slots: tasks held at once (default: the engine's ``max_batch``).
        clock: unix seconds (``created_at`` of a task is on the same scale).
    """

    def __init__(self, engine: OnnxEmbeddingEngine, *, slots: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.slots = int(slots or engine.max_batch)
        self._clock = clock
        self._jobs: dict[str, _Job] = {}  # in the order they came
        self._rejected: list[tuple[AnyTask, ErrorCode, str]] = []
        self._lock = threading.Lock()

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
        """End what is cancelled, late or malformed; embed the next tasks' inputs together."""
        out = StepOutput()
        now = self._clock()
        with self._lock:
            rejected, self._rejected = self._rejected, []
            jobs = list(self._jobs.values())
        for task, code, message in rejected:
            out.events.append((task.reply_to, ErrorEvent(task.request_id, str(code), message)))
            out.finished.append(task.request_id)
        batch: list[_Job] = []
        inputs = tokens = 0
        for job in jobs:
            t = job.task
            if job.cancelled:
                self._end(job, out, now, "cancelled")
                continue
            if t.deadline is not None and now > t.deadline:
                self._fail(job, out, ErrorCode.timeout, "the request's deadline passed before a worker could start it")
                continue
            problem = self._problem(t)
            if problem is not None:
                self._fail(job, out, ErrorCode.invalid_request, problem)
                continue
            n, k = len(t.inputs), t.prompt_tokens
            if batch and (inputs + n > self.engine.max_batch or tokens + k > self.engine.max_batch_tokens):
                continue  # the next step's (whole tasks only; those after it may still fit)
            batch.append(job)
            inputs, tokens = inputs + n, tokens + k
        if not batch:
            return out
        try:
            vectors = self.engine.embed([ids for job in batch for ids in job.task.inputs])
        except Exception as exc:  # an engine failure ends these tasks, not the worker
            log.exception("embedding failed", request_ids=[j.task.request_id for j in batch])
            for job in batch:
                self._fail(job, out, ErrorCode.engine_error, f"embedding failed: {exc}")
            return out
        done_at = self._clock()
        out.batch_size, out.prefill_tokens = inputs, tokens
        row = 0
        for job in batch:
            t, n = job.task, len(job.task.inputs)
            rows, row = vectors[row:row + n], row + n
            with self._lock:
                if self._jobs.get(t.request_id) is not job:
                    continue  # abandoned meanwhile: another worker has it
                cancelled = job.cancelled
                if not cancelled:  # its vectors and end go out together
                    del self._jobs[t.request_id]
            if cancelled:
                self._end(job, out, done_at, "cancelled")
                continue
            for i in range(n):
                out.events.append((t.reply_to, EmbeddingEvent(t.request_id, i, EmbeddingEvent.pack(rows[i]))))
            self._done(job, out, done_at, "stop")
        return out

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
            queue_ms=max(0.0, (job.admitted_at - created) * 1000.0), ttft_ms=max(0.0, (now - created) * 1000.0),
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
