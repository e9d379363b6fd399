"""The worker core: continuous batching over one engine, without any I/O.

``WorkerCore`` turns admitted ``Task``s into the events of their streams. It knows
nothing of Redis, signals or asyncio: the worker process reads tasks
from the lanes and calls ``add``, forwards cancels with ``cancel``, runs ``step()`` in a
thread (the engine call blocks) and publishes ``StepOutput.events``, XACKing
``StepOutput.finished``.

Stream invariants, per request:

* TokenEvents carry index 0, 1, 2, ... with no gap, one per generated token that is
  not EOS; ``text`` may be "" while a character or a possible stop string is held back.
* Exactly one DoneEvent or ErrorEvent ends it; ``DoneEvent.completion_tokens`` equals
  the number of TokenEvents.
* No text is lost and no extra index is made up for it: a TokenEvent after which text
  is held back is itself kept back until the next token (see ``Sequence.deferred``),
  so that if the next token is EOS the held text joins that last event.
* A request that asks for its prompt's log probabilities (``prompt_logprobs``) gets
  ``PromptEvent``s covering prompt positions 0, 1, … in order, all before its first
  TokenEvent (or its DoneEvent): its prompt is computed whole, never taken from the
  prefix cache or another sequence, chunk by chunk, each chunk's logits reduced at once
  to what was asked (``_score``), so memory stays bounded by one chunk.
* A request whose first token does not come out of the step that started it (its prompt
  goes in over several steps, or it waits for another sequence's prefill of the same
  prompt) gets a ``StartedEvent`` in that step, and another every ``ANNOUNCE_EVERY_S``
  while its prompt is still being fed, all before its first TokenEvent: the worker took
  it (docs/admission.md, "Queue deadlines"). They carry no index and reach no client.
* ``max_tokens`` 0 (the OpenAI door's ``echo`` of a prompt alone): nothing is generated;
  the request ends with ``length`` once its prompt's log probabilities are out, or at
  once when it asked for none.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from streamfleet.shared.errors import ErrorCode
from streamfleet.shared.grammar import COSTLY, DEFAULT_LIMITS, GrammarLimits, Grammars, plain_error
from streamfleet.shared.logging import get_logger
from streamfleet.shared.schema import (
    AnyTask,
    DoneEvent,
    ErrorEvent,
    Event,
    FinishReason,
    PromptEvent,
    StartedEvent,
    Task,
    TokenEvent,
    sampling_problem,
)
from streamfleet.workers.batcher import Scheduler, Sequence
from streamfleet.workers.detokenize import IncrementalDetokenizer, StopMatcher
from streamfleet.workers.engines.base import ChunkingEngine, Engine, ForkingEngine, SequenceError
from streamfleet.workers.logits import Logprobs, Penalties, TokenTable, process
from streamfleet.workers.replykeep import ReplyKeeper
from streamfleet.workers.sampling import Sampler
from streamfleet.workers.stepcost import StepCosts, StepShape

if TYPE_CHECKING:
    from streamfleet.shared.modelrepo import Tokenizer
    from streamfleet.workers.prefixcache import PrefixCache

__all__ = ["WorkerCore", "StepOutput", "ANNOUNCE_EVERY_S"]

log = get_logger("worker.core")

#: chunked prefill: the oldest prompt being fed moves by at least this many tokens a
#: step, however many decodes fill ``max_step_tokens``
_MIN_CHUNK = 16
#: every this many steps that feed a prompt, the oldest one's chunk is cut to 3/4 (or, where
#: the time left it less than ``_MIN_CHUNK``, doubled to twice that): with every chunk of
#: one size the learned costs cannot tell
#: what a call costs from what its tokens cost (on a crowded machine a call costs far
#: more than its tokens), and a fit that got it wrong would never see otherwise
_EXPLORE_EVERY = 4
#: a prompt whose log probabilities are asked for goes through the engine in chunks of
#: at most this many tokens, whatever ``max_step_tokens`` allows ...
_PROMPT_CHUNK = 256
#: ... and of at most this many logits (a chunk's logits are ``[tokens, vocab]`` floats:
#: 64 MiB; 256 tokens of a 49,152-token vocabulary take 48)
_PROMPT_LOGITS = 1 << 24
#: a sequence whose prompt is still being fed says so (``StartedEvent``) again after this
#: many seconds: its gateway ends a started request that stays silent for 60 s
#: (``gateway.requests.request_stream``, its stall limit)
ANNOUNCE_EVERY_S = 10.0


@dataclass(slots=True)
class StepOutput:
    """What one step produced.

    Attributes:
        events: ``(reply_to, event)`` in the order they happened; per request the
            order is the stream order.
        finished: request ids that ended this step (done or error): XACK them.
        batch_size: sequences that went through the engine this step.
        new_tokens: TokenEvents produced this step (completion tokens; EOS excluded).
        token_ids: ``(request_id, index) -> token id`` of every TokenEvent in ``events``
            (written to the request log, so a worker that takes the request over can
            continue from there instead of regenerating it).
        audio_s: seconds of audio decoded this step (a speech model's core).
        grammar_s: seconds this step spent on the token masks of constrained sequences.
        shared_prefills: sequences started from another one's prefill (same prompt).
        prefill_tokens: prompt tokens the engine computed this step (chunks included).
        cached_tokens: prompt tokens sequences started with from the prefix cache.
    """

    events: list[tuple[str, Event]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    batch_size: int = 0
    new_tokens: int = 0
    token_ids: dict[tuple[str, int], int] = field(default_factory=dict)
    audio_s: float = 0.0
    grammar_s: float = 0.0
    shared_prefills: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0


class _Prefix:
    """The prompt of a group's first choice, for the choices still to start: its
    sequence (whose cache holds the prompt), the prompt's length and logits."""

    __slots__ = ("seq", "length", "logits", "waiting", "prompt")

    def __init__(self, seq: Sequence, length: int, logits: np.ndarray, waiting: int) -> None:
        self.seq, self.length, self.logits, self.waiting = seq, length, logits, waiting
        self.prompt = list(seq.task.prompt_ids)

    def usable(self, prompt: list[int]) -> bool:
        """The first choice is still running (its cache is there) and has the same prompt."""
        return self.seq.prefilled and not self.seq.cancelled and prompt == self.prompt

    def take(self, prefixes: dict[str, _Prefix], group: str) -> None:
        """One more choice started from it; forgotten after the last."""
        self.waiting -= 1
        if self.waiting <= 0:
            prefixes.pop(group, None)


def _without(seqs: list[Sequence], logits: np.ndarray | None, gone: dict[str, str]
             ) -> tuple[list[Sequence], np.ndarray | None, list[int]]:
    """An engine call's sequences and logits rows without the requests in ``gone``."""
    keep = [i for i, q in enumerate(seqs) if q.request_id not in gone]
    return [seqs[i] for i in keep], logits, keep


class WorkerCore:
    """Continuous batching of one engine.

    Thread safety: ``add``, ``cancel`` and the read-only properties may be called from
    the event loop while ``step()`` runs in a worker thread (they take a short lock;
    a task added or cancelled during a step takes effect at the next one). ``step()``
    must not run concurrently with itself, nor with ``abandon_all()``.

    Args:
        engine: the model backend.
        tokenizer: the model's tokenizer (``PreTrainedTokenizerFast``), for text.
        max_batch: most sequences at once; defaults to, and is capped by,
            ``engine.max_batch``.
        clock: unix-seconds clock (``Task.created_at`` is on the same scale).
        max_step_tokens: most tokens one step feeds the engine, where it can take a
            prompt in chunks (``start``/``extend``): decodes first, then chunks of the
            prompts being prefilled, oldest first (docs/scheduling.md, "Chunked
            prefill"); 0: no limit.
        step_target_ms: the time a step should take: the prompts being fed get what the
            step's decodes leave of it, by the costs the core learns from its own steps
            (``workers/stepcost.py``; ``max_step_tokens`` stays the ceiling); 0: no time
            budget (the costs are learned all the same, for the heartbeat).
        timer: monotonic seconds, to time the steps by (a test's fake clock).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        max_batch: int | None = None,
        clock: Callable[[], float] = time.time,
        grammar_limits: GrammarLimits = DEFAULT_LIMITS,
        max_step_tokens: int = 0,
        step_target_ms: float = 0.0,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.engine = engine
        self.max_step_tokens = max(0, int(max_step_tokens))
        #: the time a step should take, in seconds (0: no time budget)
        self.step_target_s = max(0.0, float(step_target_ms)) / 1000.0
        #: what this core's steps cost (per model version, engine and execution mode)
        self.costs = StepCosts()
        #: prompt tokens the last step that fed any fed (for the heartbeat)
        self.last_chunk = 0
        self._timer = timer
        self._warm = False  # a step ran the engine (the first one, its allocations included, is not learned)
        self._fed_steps = 0  # steps that fed a prompt with a step target (``_EXPLORE_EVERY``)
        #: the engine takes prompts in chunks (and from its prefix cache, when it has one)
        self._chunked = callable(getattr(engine, "start", None)) and callable(getattr(engine, "extend", None))
        #: the engine, where it prefills in chunks (``_chunked``)
        self._chunking = cast(ChunkingEngine, engine)
        #: finished replies whose blocks the prefix cache lacks, computed while idle
        #: (``idle_step``; None: the engine needs none)
        self._replies = ReplyKeeper(engine, chunk=self.max_step_tokens, most=int(engine.max_batch)) \
            if ReplyKeeper.wanted(engine) else None
        #: started sequences whose prompt is still being fed, in start order
        self._feeding: dict[str, Sequence] = {}
        #: a sequence waiting for another one of this worker with the same prompt to
        #: finish its prefill (then it forks that one's cache): follower id -> leader
        self._leader_of: dict[str, Sequence] = {}
        #: followers whose leader left before its prefill ended: started at the next step
        self._orphans: list[Sequence] = []
        #: the last step fed a prompt's last chunk without the decodes: the next one
        #: decodes, and feeds nothing
        self._decode_owed = False
        self.grammar_limits = grammar_limits
        self.tokenizer = tokenizer
        self._clock = clock
        limit = int(engine.max_batch)
        self._sched = Scheduler(min(int(max_batch), limit) if max_batch else limit)
        self._eos = frozenset(int(t) for t in engine.spec.eos_token_ids)
        self._max_context = int(engine.max_context)
        self._vocab_size = int(engine.vocab_size)
        self._lock = threading.Lock()
        self._rejected: list[tuple[AnyTask, ErrorCode, str]] = []
        self._tokens: TokenTable | None = None  # for log probabilities, built on first use
        self._grammars: Grammars | None = None  # for structured outputs, built on first use
        self._masker: ThreadPoolExecutor | None = None  # computes the masks while the engine runs
        #: the prompts of the groups (``Task.group``) whose other choices are still to start
        self._prefixes: dict[str, _Prefix] = {}
        #: why this engine cannot give a prompt's log probabilities (None: it can)
        self._no_prompt_logprobs = self._prompt_logprobs_problem()
        #: most tokens of a chunk of a prompt whose log probabilities are computed
        self._score_chunk = max(_MIN_CHUNK, min(_PROMPT_CHUNK, _PROMPT_LOGITS // max(1, self._vocab_size)))

    # -- admission -----------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self._sched.max_batch

    @property
    def free_slots(self) -> int:
        """Tasks that can be added now."""
        return self._sched.free_slots

    @property
    def active(self) -> int:
        """Sequences in the batch (waiting + running)."""
        return len(self._sched)

    def has_work(self) -> bool:
        """Whether ``step()`` has anything to do."""
        return bool(len(self._sched) or self._rejected)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._sched

    def idle_work(self) -> bool:
        """Whether ``idle_step`` has something to do."""
        return self._replies is not None and len(self._replies) > 0

    def idle_step(self) -> int:
        """Work for a worker with nothing in its batch: one chunk of a finished reply's
        blocks computed into the prefix cache by a prefill, so that its conversation's
        next turn finds them (workers/replykeep.py; docs/scheduling.md, "Prefix cache").
        Returns the tokens computed (0: none, or the batch is not empty). Like ``step()``,
        it must not run concurrently with ``step()``."""
        if self._replies is None or len(self._sched) or self._rejected:
            return 0
        return self._replies.step()

    def add(self, task: AnyTask, replay: list[int] | None = None) -> None:
        """Admit a task; its first token comes out of the next ``step()``.

        ``replay``: token ids the request already generated elsewhere (indices 0..n-1,
        read from its log after a takeover). The sequence continues at index n as if it
        had produced them itself: the sampler skips their draws, the detokenizer and stop
        matcher see them, and the prefill covers prompt + replay. Replay ids that do not
        fit (out of vocabulary, past ``max_tokens`` or the context) are ignored and the
        request is generated from its start.

        A task that cannot run (not text, empty or too long prompt, token ids out of range,
        invalid sampling parameters, deadline passed) does not take a slot and ends
        with an ErrorEvent in the next step's output.

        Raises:
            ValueError: no free slot, or the request is already in the batch (the
                process checks ``free_slots`` and ``request_id in core`` first).
        """
        now = self._clock()
        problem = self._validate(task, now)
        if problem is not None:
            with self._lock:
                self._rejected.append((task, *problem))
            return
        assert isinstance(task, Task)  # _validate refuses the other kinds
        seq = Sequence(
            task=task,
            sampler=Sampler(task.params, self._vocab_size),
            detokenizer=IncrementalDetokenizer(self.tokenizer, task.prompt_ids),
            stop=StopMatcher(task.params.stop, task.params.include_stop_str_in_output),
            lane=task.lane,
            admitted_at=now,
        )
        p = task.params
        if p.processed:
            # a grammar decides when a constrained output may end: min_tokens holds off
            # only the stop tokens then, never the EOS the grammar may be left with
            ends = frozenset() if p.ignore_eos or p.grammar else self._eos
            seq.penalties = Penalties(p, task.prompt_ids, ends)
        seq.stop_ids = frozenset(int(t) for t in p.stop_token_ids)
        if replay and getattr(self.engine, "replays_exactly", True) and self._replayable(task, replay):
            self._fast_forward(seq, replay)
        # a takeover that continues from replayed tokens: the prompt's were sent before them
        seq.prompt_logprobs = p.prompt_logprobs if not seq.generated else None
        with self._lock:
            self._sched.add(seq)

    def _replayable(self, task: Task, replay: list[int]) -> bool:
        vocab = self._vocab_size
        ends = set(task.params.stop_token_ids) | (set() if task.params.ignore_eos else self._eos)
        return (len(replay) < task.params.max_tokens and len(task.prompt_ids) + len(replay) < self._max_context - 1
                and all(type(t) is int and 0 <= t < vocab for t in replay)
                and not any(t in ends for t in replay))

    @staticmethod
    def _fast_forward(seq: Sequence, replay: list[int]) -> None:
        seq.sampler.skip(len(replay))
        for t in replay:
            seq.stop.push(seq.detokenizer.push(t))
            if seq.penalties is not None:
                seq.penalties.push(t)
        seq.generated = list(replay)
        seq.emitted = len(replay)

    def cancel(self, request_id: str) -> bool:
        """Stop a request: it ends with DoneEvent ``cancelled`` at the next step and its
        engine cache is released. Returns whether this core held the request."""
        with self._lock:
            return self._sched.cancel(request_id)

    def abandon(self, request_id: str) -> bool:
        """Drop a request at the next step without emitting anything or reporting it
        finished (its delivery now belongs to another worker, which regenerates it).
        Returns whether this core held it."""
        with self._lock:
            seq = self._sched.get(request_id)
            if seq is None:
                return False
            seq.abandoned = True
            self._sched.cancel(request_id)
            return True

    def abandon_all(self) -> list[AnyTask]:
        """Drop every sequence without emitting anything and release their caches.

        For shutdown: the process leaves these tasks un-ACKed so another worker
        reclaims and regenerates them with the same seed (docs/failures.md).
        """
        with self._lock:
            plan = self._sched.plan()
            seqs = plan.cancelled + plan.decode + plan.prefill
            for seq in seqs:
                self._sched.finish(seq.request_id)
            rejected, self._rejected = self._rejected, []
        for seq in seqs:
            if seq.prefilled:
                self._release(seq)
        self._feeding.clear()
        self._leader_of.clear()
        self._orphans.clear()
        if self._replies is not None:
            self._replies.clear()
        return [s.task for s in seqs] + [t for t, _, _ in rejected]

    def _prompt_logprobs_problem(self) -> str | None:
        """Why this core's engine cannot give a prompt's log probabilities (it needs
        ``start``/``extend`` with ``start(from_cache=False)`` and ``extend_all``, on a graph
        that gives every position's logits), or None."""
        engine = self.engine
        name = f"model {engine.spec.name!r} on the {type(engine).__name__} engine"
        if not self._chunked or not callable(getattr(engine, "extend_all", None)):
            return (f"{name} cannot compute the log probabilities of a prompt's tokens (echo with logprobs): "
                    f"the engine gives the logits of a prompt's last position only")
        if not getattr(engine, "every_position", False):
            return (f"{name} cannot compute the log probabilities of a prompt's tokens (echo with logprobs): its "
                    f"graph gives the logits of the last position only (import the model again: graphs imported "
                    f"since logits_to_keep give every position's)")
        return None

    def _validate(self, task: AnyTask, now: float) -> tuple[ErrorCode, str] | None:
        if not isinstance(task, Task):
            return ErrorCode.invalid_request, f"model {task.model!r} generates text; this is a {task.kind} task"
        ids = task.prompt_ids
        if not ids:
            return ErrorCode.invalid_request, "the prompt is empty"
        limit = self._max_context - 1
        if len(ids) > limit:
            return (
                ErrorCode.prompt_too_long,
                f"the prompt has {len(ids)} tokens; this model takes at most {limit}",
            )
        vocab = self._vocab_size
        # in C, not a generator per id: a long prompt is thousands of them (bool is not int)
        if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab:
            return (ErrorCode.invalid_request,
                    f"prompt token ids must be integers from 0 to {vocab - 1} (the vocabulary size is {vocab})")
        problem = sampling_problem(task.params, vocab)
        if problem is not None:
            return ErrorCode.invalid_request, problem
        if task.params.prompt_logprobs is not None and self._no_prompt_logprobs is not None:
            return ErrorCode.invalid_request, self._no_prompt_logprobs
        if task.deadline is not None and now > task.deadline:
            return ErrorCode.timeout, "the request's deadline passed before a worker could start it"
        return None

    # -- the step ------------------------------------------------------------------

    def step(self) -> StepOutput:
        """One continuous-batching step: drop cancelled sequences, prefill the new
        ones (their token 0), decode the running ones (one token each), sample,
        detokenize, and end the sequences that finished. The step is timed, and what
        it cost teaches the core its costs (``costs``)."""
        t0 = self._timer()
        shape = StepShape()
        out, timed = self._step(shape)
        if timed and out.batch_size:
            if self._warm:
                self.costs.observe(shape, self._timer() - t0)
            self._warm = True
        if shape.tokens:
            self.last_chunk = shape.tokens
        return out

    def _step(self, shape: StepShape) -> tuple[StepOutput, bool]:
        """The step; ``shape`` is filled in with what it puts through the engine. Returns
        its output and whether its time tells the costs anything (not when a prompt's
        log probabilities were computed: their chunks cost what no other step does)."""
        out = StepOutput()
        with self._lock:
            rejected, self._rejected = self._rejected, []
            plan = self._sched.plan()
        for task, code, message in rejected:
            out.events.append((task.reply_to, ErrorEvent(task.request_id, str(code), message)))
            out.finished.append(task.request_id)
        for seq in plan.cancelled:
            if seq.abandoned:
                if seq.prefilled:
                    self._release(seq)
                self._forget(seq)
                continue
            self._finish(seq, FinishReason.cancelled, out)

        new = [seq for seq in (*self._take_orphans(), *plan.prefill)
               if not self._nothing_to_generate(seq, out)
               and (not seq.task.params.grammar or self._start_matcher(seq, out))]
        if self._chunked:
            decode = [seq for seq in plan.decode if seq.decoding]
            forked, forked_logits = self._start(new, out)
            owed, self._decode_owed = self._decode_owed and bool(decode), False
            chunks = [] if owed else self._chunks(decode)
            finishing = {id(seq) for seq, n in chunks if n == len(seq.to_feed)}
            if finishing and decode:
                # a prompt is all in: its first token goes out now, and the running
                # sequences' decodes make the next step, alone (docs/scheduling.md,
                # "Chunked prefill"): their gap stays a chunk and a decode, and the first
                # token does not wait for a decode of everything else
                decode, self._decode_owed = [], True
            for seq, n in chunks:
                shape.chunk(self._fed_so_far(seq), n)
            followers = [f for f, leader in self._leader_of.items() if id(leader) in finishing]
            sampling = [*forked, *(seq for seq, n in chunks if id(seq) in finishing),
                        *(seq for seq in new if seq.request_id in followers), *decode]
            out.batch_size = len(chunks) + len(decode)
        else:
            decode, sampling = plan.decode, [*new, *plan.decode]
            out.batch_size = len(new) + len(plan.decode)
            for seq in new:
                shape.chunk(0, seq.prompt_len + len(seq.generated))
        for seq in decode:
            shape.decode(seq.prompt_len + len(seq.generated))
        timed = not (self._chunked and any(seq.prompt_logprobs is not None for seq, _ in chunks))
        # the constrained sequences' token masks are computed while the engine runs (both
        # leave the GIL): only what the engine call did not cover waits
        constrained = [seq for seq in sampling if seq.matcher is not None]
        masks = self._mask_pool().submit(self._grammar().step_masks,
                                         [q.matcher for q in constrained if q.matcher is not None]) \
            if constrained else None
        if self._chunked:
            calls = [(forked, forked_logits), self._feed(chunks, out),
                     self._engine_call(decode, out, prefill=False)]
        else:
            calls = [self._engine_call(new, out, prefill=True),
                     self._engine_call(decode, out, prefill=False)]
        allowed: dict[str, np.ndarray] = {}
        if masks is not None:
            t0 = time.perf_counter()
            rows, ended = masks.result()
            out.grammar_s += time.perf_counter() - t0
            allowed = {q.request_id: rows[i] for i, q in enumerate(constrained)}
            if ended:  # a constraint that broke a limit ends its own request; the batch goes on
                failed = {constrained[i].request_id: why for i, why in ended.items()}
                for i, why in ended.items():
                    self._constraint_broke(constrained[i], why, out)
                calls = [(kept, None if logits is None else logits[keep])
                         for kept, logits, keep in (_without(seqs, logits, failed) for seqs, logits in calls)]
        now = self._clock()
        for seqs, logits in calls:
            if not seqs:
                continue
            try:
                assert logits is not None  # a call's sequences that are left have their logits
                logits, lps = self._process(seqs, logits, allowed, out)
            except Exception as exc:  # a bug must not take the other call's sequences down
                log.exception("logits processing failed", request_ids=[q.request_id for q in seqs])
                for seq in seqs:
                    self._fail(seq, ErrorCode.internal, f"generation failed: {type(exc).__name__}", out)
                continue
            for i, seq in enumerate(seqs):
                if seq.task.params.max_tokens == 0:  # its prompt's log probabilities are out: done
                    self._finish(seq, FinishReason.length, out, now=now)
                    continue
                try:
                    token = seq.sampler.sample(logits[i])
                    entry = None
                    if lps is not None and i in lps:
                        entry = self._token_table().entry(token, *lps.of(i, token))
                    complete = False
                    if seq.matcher is not None and token not in self._eos:
                        if not seq.matcher.consume_token(token):
                            self._constraint_broke(seq, plain_error(seq.matcher.get_error(), self.grammar_limits),
                                                   out)
                            continue
                        complete = seq.matcher.is_stopped()  # nothing can follow: the output is whole
                    self._advance(seq, token, entry, now, out, complete=complete)
                except Exception as exc:  # a bug or a bad row must not take the batch down
                    log.exception("sampling/detokenizing failed", request_id=seq.request_id,
                                  trace_id=seq.task.trace_id)
                    self._fail(seq, ErrorCode.internal, f"generation failed: {type(exc).__name__}", out)
        if self._chunked:
            self._announce(out)
        return out, timed

    def _nothing_to_generate(self, seq: Sequence, out: StepOutput) -> bool:
        """End a new sequence of ``max_tokens`` 0 that asks nothing of its prompt (the OpenAI
        door's ``echo`` of a prompt alone) with ``length``, without the engine; True if so."""
        if seq.task.params.max_tokens or seq.prompt_logprobs is not None:
            return False
        self._finish(seq, FinishReason.length, out)
        return True

    def _process(self, seqs: list[Sequence], logits: np.ndarray, allowed: dict[str, np.ndarray], out: StepOutput
                 ) -> tuple[np.ndarray, Logprobs | None]:
        """The batch's log probabilities (from the raw logits) where asked, then the token
        masks of the constrained sequences, then every sequence's logits processing, each
        vectorised over the batch (workers/logits.py, shared/grammar.py)."""
        wanted = [(i, top) for i, s in enumerate(seqs) if (top := s.task.params.logprobs) is not None]
        lps = Logprobs(logits, [i for i, _ in wanted], [top for _, top in wanted]) if wanted else None
        states = [s.penalties for s in seqs]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained or any(st is not None for st in states):
            logits = np.array(logits, dtype=np.float32)  # a copy: the engine may reuse its buffer
        if constrained:
            t0 = time.perf_counter()
            mask = np.stack([allowed[seqs[i].request_id] for i in constrained])
            if len(constrained) == len(seqs):
                np.copyto(logits, np.float32(-np.inf), where=~mask)
            else:
                rows = np.asarray(constrained, dtype=np.int64)
                logits[rows] = np.where(mask, logits[rows], np.float32(-np.inf))
            out.grammar_s += time.perf_counter() - t0
        if any(st is not None for st in states):
            process(logits, states, [s.emitted for s in seqs])
        return logits, lps

    def _mask_pool(self) -> ThreadPoolExecutor:
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._masker

    def _grammar(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self._vocab_size, sorted(self._eos), self.grammar_limits)
        return self._grammars

    def _start_matcher(self, seq: Sequence, out: StepOutput) -> bool:
        """Compile a constrained sequence's grammar before its prefill (and replay the
        tokens a taken-over request already has); False when it fails, which ends it."""
        if seq.matcher is not None:
            return True
        try:
            seq.matcher = self._grammar().matcher(seq.task.params.grammar)
        except Exception as exc:  # a grammar the gateway let through but this worker cannot compile
            self._fail(seq, ErrorCode.invalid_request, f"the output constraint cannot be enforced: {exc}"[:300], out)
            return False
        if seq.generated and not seq.matcher.consume_tokens(list(seq.generated)):
            self._fail(seq, ErrorCode.internal, "the tokens generated before the takeover break the constraint", out)
            return False
        return True

    def _constraint_broke(self, seq: Sequence, why: str, out: StepOutput) -> None:
        """End ``seq`` whose constraint broke a limit (``invalid_request``: the request asked
        for more than the fleet enforces, docs/security.md) or failed otherwise (a bug:
        ``internal``); its grammar's compiled copy is dropped, the batch goes on."""
        costly = why.startswith(COSTLY)
        if costly:
            self._grammar().forget(seq.task.params.grammar)
        log.warning("output constraint failed; its request ends", request_id=seq.request_id, reason=why)
        self._fail(seq, ErrorCode.invalid_request if costly else ErrorCode.internal,
                   why if costly else f"the output constraint refused a token it allowed: {why}", out)

    def _token_table(self) -> TokenTable:
        if self._tokens is None:
            self._tokens = TokenTable(self.tokenizer)
        return self._tokens

    def _engine_call(
        self, seqs: list[Sequence], out: StepOutput, *, prefill: bool
    ) -> tuple[list[Sequence], np.ndarray | None]:
        """Run prefill or decode on ``seqs``; returns those that succeeded and their
        logits (a row each). A ``SequenceError`` ends only the sequences it names and the
        call is retried without them (the engine left the others untouched); any
        other error ends every sequence of the call."""
        live = list(seqs)
        kind = "prefill" if prefill else "decode"
        while live:
            try:
                if prefill:
                    logits = self._prefill(live, out)
                else:
                    logits = self.engine.decode([(s.request_id, s.last_token) for s in live])
                logits = np.asarray(logits)
                if logits.ndim != 2 or logits.shape[0] != len(live):
                    raise RuntimeError(
                        f"engine {kind} returned logits of shape {logits.shape} for {len(live)} sequences"
                    )
            except SequenceError as exc:
                live = self._without_failed(live, exc, kind, out)
                continue
            except Exception as exc:
                self._fail_all(live, exc, kind, out)
                return [], None
            if prefill:
                for seq in live:
                    seq.prefilled = True
            return live, logits
        return [], None

    def _prefill(self, live: list[Sequence], out: StepOutput) -> np.ndarray:
        """Prefill ``live``: prompt + what a taken-over request had already generated.

        The choices of one request (``Task.group``) share one prefill when the engine
        can ``fork`` a cache: the first to start is prefilled and its prompt logits kept
        while the others are still to come; each later one starts from the first one's
        cache of the prompt (a causal model's cache of the prompt does not change as it
        decodes on) and those logits, and samples its own tokens. Sequences of the same
        prompt in one step share it too."""
        fork = getattr(self.engine, "fork", None)
        if fork is None:
            return self.engine.prefill([(s.request_id, [*s.task.prompt_ids, *s.generated]) for s in live])
        leader_of: dict[int, int] = {}  # a sequence of this call -> the one of this call it forks from
        earlier: dict[int, _Prefix] = {}  # a sequence of this call -> the earlier prefill it forks from
        first: dict[tuple[str, tuple[int, ...]], int] = {}
        for i, s in enumerate(live):
            if s.generated:
                continue  # a takeover's replay: its own prefill
            t = s.task
            prefix = self._prefixes.get(t.group) if t.group else None
            if prefix is not None and prefix.usable(t.prompt_ids):
                earlier[i] = prefix
                continue
            j = first.setdefault((t.group, tuple(t.prompt_ids)) if t.group else ("", tuple(t.prompt_ids)), i)
            if j != i:
                leader_of[i] = j
        leaders = [i for i in range(len(live)) if i not in leader_of and i not in earlier]
        logits = self.engine.prefill([(live[i].request_id, [*live[i].task.prompt_ids, *live[i].generated])
                                      for i in leaders]) if leaders else np.empty((0, self._vocab_size), np.float32)
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != len(leaders):
            return logits  # the caller reports the bad shape
        row = {j: r for r, j in enumerate(leaders)}
        for r, j in enumerate(leaders):  # a group's first: kept for its choices still to come
            t = live[j].task
            if t.group and t.group_size > 1 and not live[j].generated:
                self._prefixes[t.group] = _Prefix(live[j], len(t.prompt_ids), np.array(logits[r]),
                                                  t.group_size - 1)
        rows: list[np.ndarray] = []
        for i, seq in enumerate(live):
            if i in earlier:
                prefix = earlier[i]
                fork(prefix.seq.request_id, [seq.request_id], length=prefix.length)
                rows.append(prefix.logits)
                prefix.take(self._prefixes, seq.task.group)
            elif i in leader_of:
                j = leader_of[i]
                fork(live[j].request_id, [seq.request_id])
                rows.append(logits[row[j]])
                prefix = self._prefixes.get(seq.task.group)
                if prefix is not None and prefix.seq is live[j]:
                    prefix.take(self._prefixes, seq.task.group)
            else:
                rows.append(logits[row[i]])
        out.shared_prefills += len(leader_of) + len(earlier)
        return np.stack(rows) if rows else logits

    # -- chunked prefill (engines with ``start``/``extend``) ---------------------------

    def _key(self, seq: Sequence) -> tuple[str, tuple[int, ...]]:
        t = seq.task
        return (t.group or "", tuple(t.prompt_ids))

    def _take_orphans(self) -> list[Sequence]:
        """Followers whose leader left before its prefill ended, still in the batch; and,
        as a safety net, any follower whose leader is no longer being fed (it forks its
        followers the moment its prompt is all in, so none should be left waiting on it:
        one that is would wait for ever)."""
        for fid, leader in list(self._leader_of.items()):
            if leader.request_id not in self._feeding:
                del self._leader_of[fid]
                follower = self._sched.get(fid)
                if follower is not None:
                    log.warning("a sequence waited on a prefill that is over; it starts on its own",
                                request_id=fid, leader=leader.request_id)
                    self._orphans.append(follower)
        if not self._orphans:
            return []
        orphans, self._orphans = self._orphans, []
        return [s for s in orphans if not s.cancelled and s.request_id in self._sched]

    def _start(self, new: list[Sequence], out: StepOutput) -> tuple[list[Sequence], np.ndarray]:
        """Start the step's new sequences. A choice whose group's prompt is already
        prefilled forks it and samples from its logits at once (returned); one whose
        prompt another sequence of this worker is prefilling now waits for that one and
        then forks it (``_leader_of``); the others are started in the engine, from the
        longest prefix its prefix cache holds, and fed the rest in chunks."""
        fork = getattr(self.engine, "fork", None)
        forked: list[Sequence] = []
        rows: list[np.ndarray] = []
        leaders: list[Sequence] = []
        prefilling = {self._key(q): q for q in reversed(self._feeding.values()) if not q.generated} \
            if fork is not None else {}
        for seq in new:
            t = seq.task
            if seq.prompt_logprobs is not None:
                # it computes its whole prompt itself, never from another's cache; the
                # sequences after it with the same prompt may fork its cache, though
                if fork is not None:
                    prefilling.setdefault(self._key(seq), seq)
                leaders.append(seq)
                continue
            if fork is not None and not seq.generated:
                prefix = self._prefixes.get(t.group) if t.group else None
                if prefix is not None and prefix.usable(t.prompt_ids):
                    try:
                        fork(prefix.seq.request_id, [seq.request_id], length=prefix.length)
                    except Exception as exc:
                        self._fail(seq, ErrorCode.engine_error, f"the engine failed on this request: {exc}"[:300], out)
                        continue
                    seq.prefilled = True
                    forked.append(seq)
                    rows.append(prefix.logits)
                    prefix.take(self._prefixes, t.group)
                    out.shared_prefills += 1
                    continue
                leader = prefilling.setdefault(self._key(seq), seq)
                if leader is not seq:
                    self._leader_of[seq.request_id] = leader
                    continue
            leaders.append(seq)
        self._start_in_engine([s for s in leaders if s.prompt_logprobs is None], out)
        self._start_in_engine([s for s in leaders if s.prompt_logprobs is not None], out, from_cache=False)
        return forked, (np.stack(rows) if rows else np.empty((0, self._vocab_size), np.float32))

    def _start_in_engine(self, live: list[Sequence], out: StepOutput, *, from_cache: bool = True) -> None:
        """Start ``live`` in the engine (``from_cache=False``: none from the prefix cache)
        and put them in the chunked-prefill bookkeeping."""
        while live:
            try:
                seqs = [(s.request_id, [*s.task.prompt_ids, *s.generated]) for s in live]
                cached = self._chunking.start(seqs) if from_cache else self._chunking.start(seqs, from_cache=False)
            except SequenceError as exc:
                live = self._without_failed(live, exc, "prefill", out)
                continue
            except Exception as exc:
                self._fail_all(live, exc, "prefill", out)
                return
            for seq, n in zip(live, cached):
                seq.prefilled = True
                seq.pending = [*seq.task.prompt_ids, *seq.generated][int(n):]
                self._feeding[seq.request_id] = seq
                seq.cached = min(int(n), len(seq.task.prompt_ids))
                out.cached_tokens += int(n)
            return

    def _chunks(self, decode: list[Sequence]) -> list[tuple[Sequence, int]]:
        """How many tokens of each prompt being fed go through the engine this step,
        oldest prompt first: within ``max_step_tokens`` less the step's decodes, and,
        with a step target, within the time the target leaves once the decodes are
        paid for, by the learned costs (a later chunk of a long prompt costs more a
        token than an early one: ``workers/stepcost.py``), and no more than twice the
        tokens of the last step that fed any (``StepCosts.most_tokens``). The oldest
        always moves by at least ``_MIN_CHUNK`` tokens, however many decodes; where the
        target leaves it fewer than twice that, its tokens get as long as the rest of the
        step takes (its decodes, the engine calls, the cache its chunk reads) and the step
        runs over the target, or a slow machine's or a full batch's prompts would go in at
        a fraction of their speed; and every
        ``_EXPLORE_EVERY`` steps its chunk is another size (docs/scheduling.md, "A step
        budget in time")."""
        budget = self.max_step_tokens - len(decode) if self.max_step_tokens else None
        room: float | None = None  # seconds of the step target left for prompts
        if self.step_target_s and self._feeding:
            decodes = StepShape()
            for seq in decode:
                decodes.decode(seq.prompt_len + len(seq.generated))
            fixed = self.costs.predict(decodes)
            room = self.step_target_s * (1.0 - self.costs.margin) - fixed
            most = self.costs.most_tokens()
            budget = most if budget is None else min(budget, most)
        chunks: list[tuple[Sequence, int]] = []
        for seq in self._feeding.values():
            need = len(seq.to_feed)
            # a prompt whose logits are all kept goes in chunks of ``_score_chunk`` at most
            cap = self._score_chunk if seq.prompt_logprobs is not None else need
            if budget is None:
                take = min(need, cap)
                if take < need and need - take == 1:
                    take -= 1
                chunks.append((seq, take))
                continue
            if budget <= 0:
                if chunks:
                    break
                take = min(need, _MIN_CHUNK, cap)
            else:
                take = min(need, budget, cap)
            if room is not None:
                at = self._fed_so_far(seq)
                fits = self.costs.fit(at, take, room, call=not chunks)
                if not chunks and fits < min(take, 2 * _MIN_CHUNK):
                    # the target leaves the oldest prompt next to nothing: it gets as long as
                    # the rest of the step instead
                    room = max(room, fixed + 2 * self.costs.overhead(at))
                    fits = self.costs.fit(at, take, room)
                if not chunks:
                    self._fed_steps += 1
                    if self._fed_steps % _EXPLORE_EVERY == 0:  # another size now and then (``_EXPLORE_EVERY``)
                        fits = fits * 3 // 4 if fits >= 2 * _MIN_CHUNK else 2 * _MIN_CHUNK if fits < _MIN_CHUNK \
                            else fits
                if fits < take:
                    take = fits if chunks else max(fits, min(need, _MIN_CHUNK, cap))
                    if take <= 0:
                        break
                room -= self.costs.chunk_cost(at, take, call=not chunks)
            # never a chunk of one token, nor one left for later: ONNX Runtime computes a
            # one-token run with one-row kernels whose last bits differ from a prefill's,
            # and a prompt must get the same bits however it is cut (docs/scheduling.md)
            if take < need and need - take == 1:
                take = take - 1 if take > 2 else need
            if take == 1 and need > 1:
                if chunks:
                    break
                take = min(need, 2)
            chunks.append((seq, take))
            budget -= take
        return chunks

    @staticmethod
    def _fed_so_far(seq: Sequence) -> int:
        """Prompt (+ replay) tokens of ``seq`` the engine holds: where its next chunk starts."""
        if seq.pending is None:
            return 0 if not seq.prefilled else seq.prompt_len + len(seq.generated)
        return seq.prompt_len + len(seq.generated) - len(seq.pending)

    def _announce(self, out: StepOutput) -> None:
        """Say that the sequences still waiting for their first token have started (a
        ``StartedEvent``: the gateway stops counting their queue deadline), once, and
        again every ``ANNOUNCE_EVERY_S`` while their prompt is still being fed; a
        sequence that had an event this step (a ``PromptEvent``) needs none."""
        waiting = [*self._feeding.values(), *filter(None, map(self._sched.get, self._leader_of))]
        if not waiting:
            return
        now = self._clock()
        spoke: set[str] | None = None
        for seq in waiting:
            if seq.cancelled or (seq.announced_at is not None and now - seq.announced_at < ANNOUNCE_EVERY_S):
                continue
            if spoke is None:
                spoke = {ev.request_id for _, ev in out.events}
            seq.announced_at = now
            if seq.request_id not in spoke:
                out.events.append((seq.task.reply_to, StartedEvent(
                    seq.request_id, self._fed_so_far(seq), seq.prompt_len + len(seq.generated))))

    def _feed(self, chunks: list[tuple[Sequence, int]], out: StepOutput
              ) -> tuple[list[Sequence], np.ndarray | None]:
        """Feed this step's chunks; returns the sequences whose prompt is now all in
        (they sample their first token), with the sequences that waited for them
        (forked now) and the logits of each."""
        # a prompt whose log probabilities are asked for runs alone, its chunk's logits
        # reduced at once (``_score``); the others share the engine's ``extend``
        fed = [(s, n, row) for s, n in chunks if s.prompt_logprobs is not None
               for row in [self._score(s, n, out)] if row is not None]
        live = [(s, n) for s, n in chunks if s.prompt_logprobs is None]
        while live:
            try:
                logits = np.asarray(self._chunking.extend([(s.request_id, s.to_feed[:n]) for s, n in live]))
                if logits.ndim != 2 or logits.shape[0] != len(live):
                    raise RuntimeError(f"engine extend returned logits of shape {logits.shape} for {len(live)} "
                                       f"sequences")
            except SequenceError as exc:
                kept = {id(s) for s in self._without_failed([s for s, _ in live], exc, "prefill", out)}
                live = [(s, n) for s, n in live if id(s) in kept]
                continue
            except Exception as exc:
                self._fail_all([s for s, _ in live], exc, "prefill", out)
                break
            fed = [*((seq, n, logits[i]) for i, (seq, n) in enumerate(live)), *fed]
            break
        done: list[Sequence] = []
        rows: list[np.ndarray] = []
        for seq, n, row in fed:
            self._fed(seq, n, row, done, rows, out)
        for seq, row in list(zip(done, rows)):
            self._prefilled(seq, row, done, rows, out)
        return done, (np.stack(rows) if rows else np.empty((0, self._vocab_size), np.float32))

    def _fed(self, seq: Sequence, n: int, row: np.ndarray, done: list[Sequence], rows: list[np.ndarray],
             out: StepOutput) -> None:
        """``seq`` took ``n`` more tokens of its prompt, ``row`` the logits after them: once
        its prompt is all in, it joins ``done`` (it samples from ``row``)."""
        out.prefill_tokens += n
        seq.pending = seq.to_feed[n:] or None
        if seq.pending is None:
            del self._feeding[seq.request_id]
            done.append(seq)
            rows.append(row)

    def _score(self, seq: Sequence, n: int, out: StepOutput) -> np.ndarray | None:
        """Feed the next ``n`` tokens of the prompt of ``seq``, which asked for its prompt's
        log probabilities, in a run of its own (``Engine.extend_all``), and put the log
        probabilities of the prompt tokens those positions predict in a ``PromptEvent``
        (position 0's entry, which nothing predicts, has none): each of the chunk's rows
        is reduced at once to the token's log probability and the top alternatives, by the
        code that makes a generated token's (``Logprobs``), so no more than one chunk's
        logits are ever held. Returns the logits after the chunk's last token, or None
        when the engine failed (the request then ended)."""
        prompt = seq.task.prompt_ids
        first = len(prompt) - len(seq.to_feed)  # the chunk's first prompt position
        chunk = seq.to_feed[:n]
        try:
            logits = np.asarray(self._chunking.extend_all(seq.request_id, chunk))
            if logits.shape != (n, self._vocab_size):
                raise RuntimeError(f"engine extend_all returned logits of shape {logits.shape} for a chunk of {n}")
        except Exception as exc:  # it runs alone: whatever failed, failed this sequence only
            log.error("engine call failed", call="prompt logprobs", request_id=seq.request_id, exc_info=exc)
            self._fail(seq, ErrorCode.engine_error,
                       f"the engine failed on this request (prompt log probabilities): {type(exc).__name__}", out)
            return None
        table = self._token_table()
        entries = [table.prompt_entry(prompt[0], None, [])] if first == 0 else []
        # row j predicts prompt position first + j + 1, while that is in the prompt
        rows = [j for j in range(n) if first + j + 1 < len(prompt)]
        if rows:
            top = seq.prompt_logprobs
            assert top is not None  # only such a sequence's chunks come here
            lps = Logprobs(logits, rows, [top] * len(rows))
            for j in rows:
                entries.append(table.prompt_entry(prompt[first + j + 1], *lps.of(j, prompt[first + j + 1])))
        if entries:
            start = first if first == 0 else first + 1
            out.events.append((seq.task.reply_to, PromptEvent(seq.request_id, start, entries)))
        return np.array(logits[-1])

    def _prefilled(self, seq: Sequence, row: np.ndarray, done: list[Sequence], rows: list[np.ndarray],
                   out: StepOutput) -> None:
        """``seq``'s prompt is all in: keep it for its group's choices still to come, and
        fork it for the sequences of this worker that waited for it (appended to
        ``done``/``rows``: they sample from the same logits)."""
        t = seq.task
        if t.group and t.group_size > 1 and not seq.generated:
            self._prefixes[t.group] = _Prefix(seq, len(t.prompt_ids), np.array(row), t.group_size - 1)
        followers = [f for f, leader in self._leader_of.items() if leader is seq]
        if not followers:
            return
        by_id = {s.request_id: s for s in self._sched.running}
        for fid in followers:
            del self._leader_of[fid]
            follower = by_id.get(fid)
            if follower is None or follower.cancelled:
                continue
            try:
                cast(ForkingEngine, self.engine).fork(seq.request_id, [fid])
            except Exception as exc:
                self._fail(follower, ErrorCode.engine_error, f"the engine failed on this request: {exc}"[:300], out)
                continue
            follower.prefilled = True
            done.append(follower)
            rows.append(row)
            out.shared_prefills += 1
            prefix = self._prefixes.get(t.group) if t.group else None
            if prefix is not None and prefix.seq is seq:
                prefix.take(self._prefixes, t.group)

    def _forget(self, seq: Sequence) -> None:
        """``seq`` left the batch: out of the chunked-prefill bookkeeping; the sequences
        that waited for its prefill start on their own at the next step."""
        rid = seq.request_id
        self._feeding.pop(rid, None)
        self._leader_of.pop(rid, None)
        for fid in [f for f, leader in self._leader_of.items() if leader is seq]:
            del self._leader_of[fid]
            follower = self._sched.get(fid)
            if follower is not None:
                self._orphans.append(follower)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The engine's prefix cache (``workers.prefixcache.PrefixCache``), None without."""
        return getattr(self.engine, "prefix_cache", None)

    def _without_failed(self, live: list[Sequence], exc: SequenceError, kind: str, out: StepOutput
                        ) -> list[Sequence]:
        """End the sequences of ``live`` an engine call's ``SequenceError`` names (the
        engine left the others untouched) and return the others, to retry the call with;
        an error naming none of them ends them all (returns [])."""
        failed = set(exc.seq_ids) & {s.request_id for s in live}
        if not failed:
            self._fail_all(live, exc, kind, out)
            return []
        log.warning("engine failed for some sequences", call=kind, request_ids=sorted(failed), error=str(exc))
        for seq in live:
            if seq.request_id in failed:
                self._fail(seq, ErrorCode.engine_error, f"the engine failed on this request: {exc}"[:300], out)
        return [s for s in live if s.request_id not in failed]

    def _fail_all(self, seqs: list[Sequence], exc: BaseException, kind: str, out: StepOutput) -> None:
        log.error("engine call failed", call=kind, sequences=len(seqs), request_ids=[q.request_id for q in seqs],
                  exc_info=exc)
        for seq in seqs:
            self._fail(seq, ErrorCode.engine_error, f"the engine failed ({kind}): {type(exc).__name__}", out)

    def _advance(self, seq: Sequence, token: int, logprobs: dict[str, Any] | None, now: float, out: StepOutput, *,
                 complete: bool = False) -> None:
        """Turn ``seq``'s sampled token into events; ``complete``: the token completed the
        output's grammar, so the sequence ends with it (``stop``)."""
        seq.generated.append(token)
        if seq.penalties is not None:
            seq.penalties.push(token)
        if seq.first_token_at is None:
            seq.first_token_at = now
        if (token in self._eos and not seq.task.params.ignore_eos) or token in seq.stop_ids:
            # EOS is not a token event: held-back text joins the deferred last event
            self._finish(seq, FinishReason.stop, out, tail=self._drain_text(seq)[0], now=now)
            return

        text, hit = seq.stop.push(seq.detokenizer.push(token))
        reason: FinishReason | None = FinishReason.stop if hit else None
        if reason is None and (
            complete or seq.emitted + 1 >= seq.task.params.max_tokens
            or seq.prompt_len + len(seq.generated) >= self._max_context
        ):
            tail, hit = self._drain_text(seq)
            text += tail
            reason = FinishReason.stop if hit or complete else FinishReason.length

        self._emit_deferred(seq, out)
        event = TokenEvent(seq.request_id, seq.emitted, text, logprobs)
        out.token_ids[(seq.request_id, seq.emitted)] = token
        seq.emitted += 1
        out.new_tokens += 1
        if reason is None and (seq.detokenizer.holding or seq.stop.held):
            seq.deferred = event
            return
        out.events.append((seq.task.reply_to, event))
        if reason is not None:
            self._finish(seq, reason, out, now=now)

    @staticmethod
    def _drain_text(seq: Sequence) -> tuple[str, bool]:
        """All text still held back (detokenizer tail, then stop matcher), cut at a stop string."""
        text, hit = seq.stop.push(seq.detokenizer.flush())
        if not hit:
            text += seq.stop.flush()
        return text, hit

    def _emit_deferred(self, seq: Sequence, out: StepOutput, tail: str = "") -> None:
        if seq.deferred is not None:
            seq.deferred.text += tail
            out.events.append((seq.task.reply_to, seq.deferred))
            out.token_ids[(seq.request_id, seq.deferred.index)] = seq.generated[seq.deferred.index]
            seq.deferred = None

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        out: StepOutput,
        *,
        tail: str = "",
        now: float | None = None,
    ) -> None:
        """End ``seq`` with a DoneEvent (after its deferred token event, if any);
        ``tail`` is held-back text that joins that deferred event."""
        self._emit_deferred(seq, out, tail)
        now = self._clock() if now is None else now
        created = seq.task.created_at
        done = DoneEvent(
            request_id=seq.request_id,
            finish_reason=str(reason),
            prompt_tokens=seq.prompt_len,
            completion_tokens=seq.emitted,
            # clamped: created_at comes from the gateway's clock, which may run ahead
            queue_ms=max(0.0, (seq.admitted_at - created) * 1000.0),
            ttft_ms=max(0.0, (seq.first_token_at - created) * 1000.0) if seq.first_token_at is not None else 0.0,
            total_ms=max(0.0, (now - created) * 1000.0),
            cached_tokens=seq.cached,
        )
        out.events.append((seq.task.reply_to, done))
        if self._replies is not None and reason is not FinishReason.cancelled and seq.prefilled:
            self._replies.finished(seq.task.prompt_ids, seq.generated)  # for idle_step
        self._remove(seq, out, release=seq.prefilled)

    def _fail(self, seq: Sequence, code: ErrorCode, message: str, out: StepOutput) -> None:
        """End ``seq`` with an ErrorEvent and release its cache (also after a failed
        prefill: the engine may have registered it before failing)."""
        self._emit_deferred(seq, out)
        out.events.append((seq.task.reply_to, ErrorEvent(seq.request_id, str(code), message)))
        self._remove(seq, out, release=True)

    def _remove(self, seq: Sequence, out: StepOutput, *, release: bool) -> None:
        if release:
            self._release(seq)
        self._forget(seq)
        with self._lock:
            self._sched.finish(seq.request_id)
        out.finished.append(seq.request_id)

    def _release(self, seq: Sequence) -> None:
        prefix = self._prefixes.get(seq.task.group) if seq.task.group else None
        if prefix is not None and prefix.seq is seq:  # its cache goes: the later choices prefill
            del self._prefixes[seq.task.group]
        try:
            self.engine.release(seq.request_id)
        except Exception:
            log.exception("engine release failed", request_id=seq.request_id)
        seq.prefilled = False
