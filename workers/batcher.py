"""The continuous-batching scheduler: which sequences run in the next step.

Pure state, no engine and no I/O. A sequence is admitted into
*waiting*, is prefilled by the next step and then *running*, and leaves the batch the
moment it finishes or is cancelled, which frees its slot for the next admission
(docs/scheduling.md, "Continuous batching"). ``WorkerCore`` drives it; the model, sampling and text live there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from streamfleet.shared.schema import Task, TokenEvent

if TYPE_CHECKING:
    import llguidance

    from streamfleet.workers.detokenize import IncrementalDetokenizer, StopMatcher
    from streamfleet.workers.logits import Penalties
    from streamfleet.workers.sampling import Sampler

__all__ = ["Sequence", "StepPlan", "Scheduler"]


@dataclass(eq=False, slots=True)
class Sequence:
    """One request in the batch, with everything its generation needs."""

    task: Task
    sampler: Sampler
    detokenizer: IncrementalDetokenizer
    stop: StopMatcher
    lane: str = ""
    admitted_at: float = 0.0  # unix seconds, when the worker took it
    first_token_at: float | None = None  # unix seconds, when its first token was sampled
    generated: list[int] = field(default_factory=list)  # sampled ids, EOS included
    emitted: int = 0  # TokenEvents produced so far (= next index)
    prefilled: bool = False  # the engine holds a cache for it (release it when it leaves)
    #: prompt (+ replay) tokens the engine has still to be fed before its first token
    #: is sampled (chunked prefill: some steps feed it a chunk); None: none left
    pending: list[int] | None = None
    #: prompt tokens the engine's prefix cache had when it started
    cached: int = 0
    #: the top alternatives of its prompt's log probabilities, computed chunk by chunk as
    #: the prompt is fed (``SamplingParams.prompt_logprobs``); None: not asked for, or
    #: already sent (a takeover that replays tokens)
    prompt_logprobs: int | None = None
    cancelled: bool = False
    #: leaves silently (no event, not acked): another worker took the task over
    abandoned: bool = False
    #: the last TokenEvent, kept back while text is held back after it so that text
    #: can still join it should the sequence end on EOS (no extra index for EOS)
    deferred: TokenEvent | None = None
    #: logits processing state (penalties, bias, min_p, min_tokens); None: none asked for
    penalties: Penalties | None = None
    #: tokens that end it like EOS (``SamplingParams.stop_token_ids``)
    stop_ids: frozenset[int] = frozenset()
    #: the llguidance matcher of a constrained output (``SamplingParams.grammar``),
    #: created by its first step
    matcher: llguidance.LLMatcher | None = None
    #: unix seconds when the worker last said it is computing its prompt (a
    #: ``StartedEvent``; None: not yet)
    announced_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.task.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.task.prompt_ids)

    @property
    def to_feed(self) -> list[int]:
        """``pending`` of a sequence whose prompt is being fed (never None there)."""
        assert self.pending is not None
        return self.pending

    @property
    def decoding(self) -> bool:
        """Its prompt is in the engine and it has sampled: a decode step feeds it on."""
        return self.prefilled and self.pending is None

    @property
    def last_token(self) -> int:
        """The token to feed to the engine next."""
        return self.generated[-1]


@dataclass(slots=True)
class StepPlan:
    """What one step does: prefill ``prefill``, decode ``decode``, drop ``cancelled``."""

    prefill: list[Sequence]
    decode: list[Sequence]
    cancelled: list[Sequence]


class Scheduler:
    """Waiting and running sequences of one worker, up to ``max_batch`` in all.

    Args:
        max_batch: most sequences (waiting + running) at once; at least 1.

    Raises:
        ValueError: ``max_batch < 1``.
    """

    __slots__ = ("max_batch", "_waiting", "_running")

    def __init__(self, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = int(max_batch)
        self._waiting: dict[str, Sequence] = {}
        self._running: dict[str, Sequence] = {}

    def __len__(self) -> int:
        return len(self._waiting) + len(self._running)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting or request_id in self._running

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self)

    @property
    def waiting(self) -> list[Sequence]:
        """Admitted, not yet prefilled, in admission order."""
        return list(self._waiting.values())

    @property
    def running(self) -> list[Sequence]:
        """Prefilled and decoding, in admission order."""
        return list(self._running.values())

    def get(self, request_id: str) -> Sequence | None:
        return self._waiting.get(request_id) or self._running.get(request_id)

    def add(self, seq: Sequence) -> None:
        """Admit a sequence into *waiting*.

        Raises:
            ValueError: no free slot, or the request id is already in the batch.
        """
        rid = seq.request_id
        if rid in self:
            raise ValueError(f"request {rid!r} is already in the batch")
        if self.free_slots <= 0:
            raise ValueError(f"batch is full ({self.max_batch} sequences)")
        self._waiting[rid] = seq

    def cancel(self, request_id: str) -> bool:
        """Mark a sequence cancelled; it leaves at the next ``plan()``.

        Returns:
            whether the sequence was in the batch (and not already cancelled).
        """
        seq = self.get(request_id)
        if seq is None or seq.cancelled:
            return False
        seq.cancelled = True
        return True

    def plan(self) -> StepPlan:
        """The next step.

        Cancelled sequences are removed now (their slots are free at once); waiting
        ones move to running (the step prefills them); running ones are decoded.
        Sequences that end during the step are removed with ``finish``.
        """
        cancelled = [s for s in (*self._waiting.values(), *self._running.values()) if s.cancelled]
        for seq in cancelled:
            self._waiting.pop(seq.request_id, None)
            self._running.pop(seq.request_id, None)
        decode = list(self._running.values())
        prefill = list(self._waiting.values())
        self._running.update(self._waiting)
        self._waiting.clear()
        return StepPlan(prefill=prefill, decode=decode, cancelled=cancelled)

    def finish(self, request_id: str) -> Sequence | None:
        """Remove a sequence that ended; returns it (None if unknown)."""
        return self._waiting.pop(request_id, None) or self._running.pop(request_id, None)
