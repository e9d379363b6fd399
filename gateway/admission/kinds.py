"""One typed request per kind, from validation to the lane (docs/architecture.md, "A
request's path"): ``TextRequest`` (completions and chat), ``SpeechRequest`` (one
utterance), ``EmbeddingsRequest``. Each door maps its wire to a request through one
validation path (``gateway/admission/validation.py``), admission may lower its defaults
(``gateway/admission/gate.py``), ``Validator.finish`` prepares it (renders, compiles,
tokenizes: ``prepared``), and ``to_task`` makes its one serialized form, the wire's task
(``shared/schema.py``: ``Task``, ``SpeechTask``, ``EmbedTask``). Nothing else carries a
request's fields on the way.

Frozen: a step that changes a request makes a new one (``dataclasses.replace``), so a
request admitted under a tier's ceilings is the one enqueued.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamfleet.shared.errors import ErrorCode, StreamfleetError
from streamfleet.shared.schema import AudioInput, EmbedTask, SamplingParams, SpeechTask, Task

if TYPE_CHECKING:
    from streamfleet.gateway.admission.tools import Tools

__all__ = ["TextRequest", "SpeechRequest", "EmbeddingsRequest", "AnyRequest", "fixed_params"]


def fixed_params() -> SamplingParams:
    """The sampling parameters of a request that samples nothing (speech, embeddings):
    what admission's ceilings read of them (one token)."""
    return SamplingParams(max_tokens=1, temperature=0.0)


def _not_prepared(kind: str) -> StreamfleetError:
    return StreamfleetError(f"a {kind} request reached the lane before Validator.finish prepared it",
                            code=ErrorCode.internal)


def _times(timeout_s: float, trace_id: str | None) -> tuple[float, float, str]:
    now = time.time()
    return now, now + timeout_s, trace_id or uuid.uuid4().hex[:16]


@dataclass(frozen=True, slots=True)
class TextRequest:
    """A completion or a chat request. ``Validator.check`` makes it from a door's payload
    with every rule that costs next to nothing; ``Validator.finish`` (once admitted)
    renders its chat template, compiles and tries its constraint and tokenizes its
    prompt, returning it ``prepared``: ``prompt_ids`` then hold the prompt's tokens.

    ``explicit`` names the limits the client set itself (``max_tokens``, ``timeout``): a
    tier's ceiling refuses those, and lowers the gateway's defaults for the others."""

    client_id: str
    model: str
    lane: str
    params: SamplingParams
    timeout_s: float
    #: the prompt's text: a completion's as sent, a chat's once rendered (``prepared``)
    prompt_text: str
    explicit: frozenset[str] = frozenset()
    #: the text was rendered by a chat template (which carries its own special tokens)
    chat: bool = False
    #: the tools a chat request offers (gateway/admission/tools.py), for reading calls back out
    tools: Tools | None = None
    #: one of the choices of a request (``n``): their shared id, and how many there are
    group: str = ""
    group_size: int = 1
    #: a chat request's messages (checked, normalised), rendered by ``finish``
    messages: tuple[dict[str, Any], ...] | None = None
    #: the prompt's token ids: as the client sent them (checked against the vocabulary),
    #: or, once ``prepared``, as its text tokenized; None before that
    prompt_ids: tuple[int, ...] | None = None
    #: the constraint on the output: ``(param, value)`` of ``shared.grammar.check_constraint``
    #: (or ``("tools", call schema)`` for a forced call), compiled by ``finish`` into
    #: ``params.grammar``
    constraint: tuple[str, Any] | None = None
    #: a completion that returns its prompt before it (the OpenAI door's ``echo``); once
    #: ``prepared``: the prompt's text as the response shows it (a text prompt as sent;
    #: token ids decoded), and where each of its tokens starts in it (``text_offset``)
    echo: bool = False
    echo_text: str | None = None
    echo_offsets: tuple[int, ...] = ()
    #: ``Validator.finish`` ran: rendered, compiled, tokenized, within the context
    prepared: bool = False

    @property
    def input_tokens(self) -> int:
        """The prompt's tokens, once ``prepared`` (what the token rate limit takes)."""
        return len(self.prompt_ids) if self.prompt_ids is not None else 0

    def to_task(self, reply_to: str, *, request_id: str, trace_id: str | None = None, slot: str = "") -> Task:
        if not self.prepared or self.prompt_ids is None:
            raise _not_prepared("text")
        now, deadline, trace_id = _times(self.timeout_s, trace_id)
        return Task(request_id=request_id, model=self.model, lane=self.lane, reply_to=reply_to,
                    client_id=self.client_id, prompt_ids=list(self.prompt_ids), params=self.params, created_at=now,
                    deadline=deadline, trace_id=trace_id, slot=slot, group=self.group, group_size=self.group_size)


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    """One utterance to transcribe (the voice WebSocket, gRPC ``Listen``, a file's
    utterance): its audio arrives apart (``sf:audio:{request_id}``), so there is nothing
    to tokenize and it is ``prepared`` from the start."""

    client_id: str
    model: str
    lane: str
    timeout_s: float
    audio: AudioInput
    explicit: frozenset[str] = frozenset()
    #: what admission's ceilings read (``fixed_params``: a speech task samples nothing)
    params: SamplingParams = field(default_factory=fixed_params)
    prepared: bool = True

    @property
    def input_tokens(self) -> int:
        """Nothing to take before it is queued: its audio is charged by the second when it
        has been transcribed (``shared.tiers.AUDIO_TOKENS_PER_S``)."""
        return 0

    def to_task(self, reply_to: str, *, request_id: str, trace_id: str | None = None,
                slot: str = "") -> SpeechTask:
        now, deadline, trace_id = _times(self.timeout_s, trace_id)
        return SpeechTask(request_id=request_id, model=self.model, lane=self.lane, reply_to=reply_to,
                          client_id=self.client_id, audio=self.audio, created_at=now, deadline=deadline,
                          trace_id=trace_id, slot=slot)


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    """An embeddings request (``gateway/services/embeddings.py``): its inputs, each a text
    or token ids (checked already); ``Validator.finish`` tokenizes the texts and checks
    each input against the model's context, returning it ``prepared`` with every input
    as token ids."""

    client_id: str
    model: str
    lane: str
    timeout_s: float
    inputs: tuple[str | tuple[int, ...], ...]
    explicit: frozenset[str] = frozenset()
    #: what admission's ceilings read (``fixed_params``: embeddings sample nothing)
    params: SamplingParams = field(default_factory=fixed_params)
    prepared: bool = False

    @property
    def input_tokens(self) -> int:
        """The inputs' tokens, once ``prepared`` (what the token rate limit takes)."""
        return sum(len(i) for i in self.inputs if not isinstance(i, str))

    def to_task(self, reply_to: str, *, request_id: str, trace_id: str | None = None, slot: str = "") -> EmbedTask:
        if not self.prepared:
            raise _not_prepared("embeddings")
        now, deadline, trace_id = _times(self.timeout_s, trace_id)
        ids = [list(i) for i in self.inputs if not isinstance(i, str)]
        return EmbedTask(request_id=request_id, model=self.model, lane=self.lane, reply_to=reply_to,
                         client_id=self.client_id, inputs=ids, created_at=now, deadline=deadline,
                         trace_id=trace_id, slot=slot)


#: a request of any kind, as admission, ``ClientRequest`` and the reply channel carry it
AnyRequest = TextRequest | SpeechRequest | EmbeddingsRequest
