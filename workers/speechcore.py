"""The speech worker's core, without I/O: one utterance per decoder slot, decoded as its
audio arrives (docs/voice.md, "The worker").

``SpeechCore`` has the shape of ``workers.core.WorkerCore`` (``add``, ``cancel``,
``abandon``, ``step``, ``free_slots``…), so the worker's parts — intake, publisher,
reclaim, drain, reload — serve speech models unchanged. The difference is the input: a
text sequence has its prompt, an utterance has audio that is still arriving. The
worker's ``AudioFeed`` (``workers/audio.py``) reads it from Redis and hands it over with
``feed``; ``step`` decodes what was fed and emits:

* ``TranscriptEvent(index, text)`` — a partial: the utterance's hypothesis so far, each
  time it changes (index 0, text "", when the utterance starts: the gateway stops
  counting its slot wait);
* ``TranscriptEvent(index, text, final=True)`` then ``DoneEvent`` — the final transcript,
  after the audio's end marker (or what was heard when the utterance is cancelled);
* ``ErrorEvent`` — the task cannot be transcribed, or its audio stopped arriving.

A redelivered utterance (another worker died) is decoded again from its first byte of
audio: partial indices restart at 0 (the gateway drops those it delivered) and the final
comes once. Thread safety as ``WorkerCore``: ``add``, ``feed``, ``cancel`` from the event
loop take a short lock; ``step`` runs in the engine thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamfleet.shared.errors import ErrorCode
from streamfleet.shared.logging import get_logger
from streamfleet.shared.schema import AnyTask, DoneEvent, ErrorEvent, SpeechTask, TranscriptEvent
from streamfleet.workers.core import StepOutput

if TYPE_CHECKING:
    from streamfleet.workers.engines.speech import SpeechEngine

__all__ = ["SpeechCore", "AUDIO_IDLE_S"]

log = get_logger("worker.speech")

#: an utterance whose audio has not advanced for this long is failed (its gateway is gone:
#: a live one sends its end marker within ``SF_VAD_END_SILENCE_MS`` of the last speech)
AUDIO_IDLE_S = 10.0
#: a step with nothing to do but wait for final passes waits for one this long at most
FINISH_POLL_S = 0.05


@dataclass(slots=True)
class _Utterance:
    task: SpeechTask
    decoder: Any
    admitted_at: float
    inbox: list[bytes] = field(default_factory=list)
    ended: bool = False  # the end marker has been fed
    cancelled: bool = False
    partials: int = 0  # partial events sent (the next one's index)
    hypothesis: str | None = None
    first_partial_at: float | None = None
    fed_at: float = 0.0  # when audio last arrived
    audio_s: float = 0.0  # seconds of audio fed to its decoder (what its tenant is charged)
    begun: bool = False  # the decoder's begin() ran (in the step, never on the event loop)
    finishing: Future[str] | None = None  # the final pass, running on a thread of its own

    @property
    def final_pending(self) -> bool:
        """Its final pass is still running: the decoder is busy, the final not out yet."""
        return self.finishing is not None and not self.finishing.done()


class SpeechCore:
    """Utterances of one speech engine.

    Args:
        engine: a ``workers.engines.speech.SpeechEngine`` (its decoder pool).
        clock: unix seconds (``created_at`` of a task is on the same scale).
    """

    def __init__(self, engine: SpeechEngine, *, clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self._clock = clock
        self._utts: dict[str, _Utterance] = {}
        self._rejected: list[tuple[AnyTask, ErrorCode, str]] = []
        self._dropped: list[_Utterance] = []  # abandoned: their decoders go back in the next step
        self._lock = threading.Lock()
        self._pool = (ThreadPoolExecutor(max_workers=int(engine.slots), thread_name_prefix="speech-slot")
                      if getattr(engine, "concurrent", False) and int(engine.slots) > 1 else None)

    # -- the core's shape ---------------------------------------------------------------
    @property
    def max_batch(self) -> int:
        return int(self.engine.slots)

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self._utts) - len(self._dropped)

    @property
    def active(self) -> int:
        return len(self._utts)

    def has_work(self) -> bool:
        return bool(self._utts or self._rejected or self._dropped)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._utts

    def listening(self) -> list[str]:
        """The utterances whose audio is still to come (the ``AudioFeed`` reads these)."""
        with self._lock:
            return [rid for rid, u in self._utts.items() if not u.ended and not u.cancelled]

    def ready(self) -> bool:
        """Whether ``step`` has something to do now (audio fed, an end, a start to
        announce, a cancel or a refusal), so the audio read need not wait."""
        with self._lock:
            return bool(self._rejected) or any(not u.final_pending for u in self._dropped) \
                or any(u.inbox or u.cancelled or u.partials == 0 or (u.ended and not u.final_pending)
                       for u in self._utts.values())

    def add(self, task: AnyTask, replay: list[int] | None = None) -> None:
        """Start an utterance (``replay`` is for text; an utterance restarts from its
        audio). A task that cannot be transcribed ends with an ErrorEvent next step.

        Raises:
            ValueError: no free slot, or the utterance is already here.
        """
        now = self._clock()
        problem = self._validate(task, now)
        if problem is not None:
            with self._lock:
                self._rejected.append((task, *problem))
            return
        assert isinstance(task, SpeechTask)  # _validate refuses the other kinds
        with self._lock:
            if task.request_id in self._utts:
                raise ValueError(f"request {task.request_id} is already running")
            if len(self._utts) >= self.max_batch:
                raise ValueError("no free decoder slot")
            decoder = self.engine.acquire()
            self._utts[task.request_id] = _Utterance(task, decoder, admitted_at=now, fed_at=now)

    def _validate(self, task: AnyTask, now: float) -> tuple[ErrorCode, str] | None:
        if not isinstance(task, SpeechTask):
            return ErrorCode.invalid_request, f"model {task.model!r} transcribes audio; this is a {task.kind} task"
        if task.audio.sample_rate != self.engine.sample_rate:
            return (ErrorCode.invalid_request, f"model {task.model!r} takes {self.engine.sample_rate} Hz audio, "
                    f"not {task.audio.sample_rate} Hz")
        if task.audio.encoding != "pcm_s16le":
            return ErrorCode.invalid_request, f"unsupported audio encoding {task.audio.encoding!r}"
        if task.deadline is not None and now > task.deadline:
            return ErrorCode.timeout, "the utterance's deadline passed before a worker could start it"
        return None

    def feed(self, request_id: str, pcm: list[bytes], ended: bool) -> None:
        """Audio read from the utterance's stream (and whether its end marker came)."""
        with self._lock:
            u = self._utts.get(request_id)
            if u is None:
                return
            if pcm:
                u.inbox.extend(pcm)
                u.fed_at = self._clock()
            u.ended = u.ended or ended

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            u = self._utts.get(request_id)
            if u is None:
                return False
            u.cancelled = True
            return True

    def abandon(self, request_id: str) -> bool:
        """Drop an utterance without a word (another worker has it now). Its decoder goes
        back to the pool in the next step: a step may be decoding it right now, in the
        engine thread, and a decoder's calls must not overlap."""
        with self._lock:
            u = self._utts.pop(request_id, None)
            if u is None:
                return False
            self._dropped.append(u)
        return True

    def abandon_all(self) -> list[AnyTask]:
        """Drop every utterance (a drain). Like ``step``, it runs in the engine thread."""
        with self._lock:
            utts, self._utts = list(self._utts.values()), {}
            dropped, self._dropped = self._dropped, []
        for u in utts + dropped:
            if u.finishing is not None:
                wait([u.finishing])  # the decoder is busy with the final pass
            self._release(u)
        return [u.task for u in utts]

    # -- the step -------------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Decode the audio fed since the last step; emit changed partials and finals."""
        out = StepOutput()
        now = self._clock()
        with self._lock:
            rejected, self._rejected = self._rejected, []
            dropped, self._dropped = self._dropped, []
            work = []
            for u in self._utts.values():
                work.append((u, u.inbox, u.ended, u.cancelled))
                u.inbox = []
        still_finishing = []  # abandoned during a final pass: released once it is done
        for u in dropped:
            if u.final_pending:
                still_finishing.append(u)
            else:
                self._release(u)
        if still_finishing:
            with self._lock:
                self._dropped.extend(still_finishing)
        for task, code, message in rejected:
            out.events.append((task.reply_to, ErrorEvent(task.request_id, str(code), message)))
            out.finished.append(task.request_id)
        # two passes: every utterance's audio first, then the hypotheses and finals, so
        # that decoders in child processes (speech_process.py) decode side by side
        failed: set[str] = set()
        for u, pcm, _ended, cancelled in work:
            if cancelled or u.finishing is not None:
                continue
            try:
                if not u.begun:  # (a decoder process that died is restarted here, off the event loop)
                    u.decoder.begin()
                    u.begun = True
                if not pcm:
                    continue
                out.batch_size += 1
                for piece in pcm:
                    u.decoder.feed(piece)
                    seconds = len(piece) / (2 * self.engine.sample_rate)
                    out.audio_s += seconds
                    u.audio_s += seconds
            except Exception as exc:  # a decoder failure ends this utterance, not the worker
                self._decoding_failed(u, out, exc)
                failed.add(u.task.request_id)
        todo: list[tuple[_Utterance, list[bytes], bool, bool]] = []
        for u, pcm, ended, cancelled in work:
            if u.task.request_id in failed:
                continue
            if u.finishing is not None:
                if u.finishing.done():
                    self._finished(u, out, now)
            elif ended and not cancelled and self._pool is not None:
                # a final pass takes a while (a quarter of the utterance's length): it runs
                # on its own thread, and its final goes out in the step after it is done
                u.finishing = self._pool.submit(u.decoder.finish)
            else:
                todo.append((u, pcm, ended, cancelled))
        if self._pool is not None and len(todo) > 1:
            # decoders that run side by side: each slot waited for on a thread of its own
            def conclude(w: tuple[_Utterance, list[bytes], bool, bool]) -> None:
                self._conclude(*w, now, out)

            list(self._pool.map(conclude, todo))
        else:
            for w in todo:
                self._conclude(*w, now, out)
        if not out.events and not out.batch_size:
            # nothing to do but wait for final passes: wait here (the event loop is free
            # meanwhile) rather than come straight back
            pending = [u.finishing for u in [w[0] for w in work] + still_finishing
                       if u.final_pending and u.finishing is not None]
            if pending:
                wait(pending, timeout=FINISH_POLL_S, return_when=FIRST_COMPLETED)
        return out

    def _finished(self, u: _Utterance, out: StepOutput, now: float) -> None:
        """The final pass that ran on its own thread is done: the final (or the failure)."""
        assert u.finishing is not None  # (its final pass is done)
        try:
            text = u.finishing.result()
        except Exception as exc:
            self._decoding_failed(u, out, exc)
            return
        if u.cancelled:
            self._end(u, out, now, "cancelled", u.hypothesis or "")
        else:
            self._end(u, out, now, "stop", text)

    def _conclude(self, u: _Utterance, pcm: list[bytes], ended: bool, cancelled: bool, now: float,
                  out: StepOutput) -> None:
        """The second pass for one utterance: its final, its new partial, or its end.
        Events of one utterance come from one thread, so they keep their order."""
        if cancelled:
            self._end(u, out, now, "cancelled", u.hypothesis or "")
            return
        try:
            if ended:
                self._end(u, out, now, "stop", u.decoder.finish())
                return
            text = u.decoder.hypothesis() if pcm else u.hypothesis
            if u.partials == 0 or (text is not None and text != u.hypothesis):
                self._partial(u, out, now, text or "")
            if now - u.fed_at > AUDIO_IDLE_S:
                self._fail(u, out, ErrorCode.timeout, f"no audio for {AUDIO_IDLE_S:g} s and no end of utterance")
        except Exception as exc:  # a decoder failure ends this utterance, not the worker
            self._decoding_failed(u, out, exc)

    def _decoding_failed(self, u: _Utterance, out: StepOutput, exc: Exception) -> None:
        log.error("speech decoding failed", request_id=u.task.request_id, trace_id=u.task.trace_id, exc_info=exc)
        self._fail(u, out, ErrorCode.engine_error, f"speech decoding failed: {exc}")

    def _partial(self, u: _Utterance, out: StepOutput, now: float, text: str) -> None:
        out.events.append((u.task.reply_to, TranscriptEvent(u.task.request_id, u.partials, text)))
        u.partials += 1
        u.hypothesis = text
        if u.first_partial_at is None:
            u.first_partial_at = now

    def _end(self, u: _Utterance, out: StepOutput, now: float, reason: str, text: str) -> None:
        t = u.task
        created = t.created_at
        out.events.append((t.reply_to, TranscriptEvent(t.request_id, u.partials, text, final=True)))
        # completion_tokens counts the transcript events sent, as a text request's counts
        # its tokens: the gateway checks it has every index before it passes the end on
        done = DoneEvent(t.request_id, reason, prompt_tokens=0, completion_tokens=u.partials + 1,
                         queue_ms=max(0.0, (u.admitted_at - created) * 1000.0),
                         ttft_ms=max(0.0, ((u.first_partial_at or now) - created) * 1000.0),
                         total_ms=max(0.0, (now - created) * 1000.0), audio_s=round(u.audio_s, 3))
        out.events.append((t.reply_to, done))
        out.finished.append(t.request_id)
        self._remove(u)

    def _fail(self, u: _Utterance, out: StepOutput, code: ErrorCode, message: str) -> None:
        out.events.append((u.task.reply_to, ErrorEvent(u.task.request_id, str(code), message)))
        out.finished.append(u.task.request_id)
        self._remove(u)

    def _remove(self, u: _Utterance) -> None:
        with self._lock:
            mine = self._utts.get(u.task.request_id) is u
            if mine:
                del self._utts[u.task.request_id]
        if mine:  # else abandoned meanwhile: the next step releases it
            self._release(u)

    def _release(self, u: _Utterance) -> None:
        """Give the decoder back to the pool (which aborts an utterance still open)."""
        self.engine.release(u.decoder)
