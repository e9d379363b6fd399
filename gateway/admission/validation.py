"""One validation path for every protocol. Validation makes the typed request of its
kind (``gateway/admission/kinds.py``): ``Validator.check`` turns a door's generate
payload (a WebSocket ``generate`` frame; an OpenAI body or a gRPC ``GenerateRequest``
mapped to it) into a ``TextRequest`` with the rules that cost next to nothing, and
``Validator.finish`` prepares an admitted request of any kind (renders, compiles,
tokenizes); only a prepared request becomes a ``Task``. Each rule that can fail raises
``ValidationError`` with its own code and the offending ``param``.

Fields no rule knows are ignored, so clients can send fields newer gateways
understand, except the parameters of the OpenAI API (and vLLM's extensions) that
streamfleet does not implement (``UNSUPPORTED``): asking for what they do (any value
but the one that does nothing) is refused with 400 naming the parameter, because
serving the request without it would be silently wrong (``check_unsupported``).

The ``Validator`` composes the rules here with the model's text handling, which lives
apart (gateway/admission/chat_template.py: rendering a chat template, tokenizing the prompt).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, get_args, overload

import orjson

from streamfleet.gateway.admission.chat_template import PromptTokenizer, encode_prompt, render_chat, template_problem
from streamfleet.gateway.admission.kinds import AnyRequest, EmbeddingsRequest, SpeechRequest, TextRequest
from streamfleet.gateway.admission.tools import Tools, parse_tools
from streamfleet.shared.errors import ErrorCode, FatalError, NotFoundError, ValidationError
from streamfleet.shared.grammar import (
    GrammarError,
    Grammars,
    build_grammar,
    check_constraint,
    depth_problem,
)
from streamfleet.shared.keys import LANES
from streamfleet.shared.logging import get_logger
from streamfleet.shared.modelrepo import (
    BUILTIN_CHAT_TEMPLATE,
    ModelRepository,
    ModelSpec,
    chat_template_source,
    kind_phrase,
    load_tokenizer,
)
from streamfleet.shared.schema import DEFAULT_TEMPERATURE, RANGES, SamplingParams, is_number
from streamfleet.shared.settings import GatewaySettings

__all__ = ["Validator", "GenerateField", "GENERATE_FIELDS", "check_lane", "UNSUPPORTED", "check_unsupported",
           "not_text_message", "encode_texts"]

log = get_logger("gateway.validation")

#: request parameters of the OpenAI API, and of vLLM's extensions to it, that streamfleet
#: does not implement, each with the values that ask for nothing (what a client sends when
#: it spells out the defaults); anything else is refused (``check_unsupported``)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "store": (None, False),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "prompt_cache_key": (None,),
    "prompt_cache_retention": (None,),
}


def check_unsupported(p: dict[str, Any], strict: bool = True) -> list[str]:
    """The parameters of ``p`` in ``UNSUPPORTED`` that ask for something.

    Raises:
        ValidationError: ``invalid_request`` (400) naming the first one, when ``strict``
            (``SF_REFUSE_UNSUPPORTED``); otherwise they are returned, for the caller to
            log and ignore.
    """
    asked = [name for name, inert in UNSUPPORTED.items() if name in p and not _inert(p[name], inert)]
    if asked and strict:
        name = asked[0]
        shown = [v for v in UNSUPPORTED[name] if v is not None]
        default = orjson.dumps(shown[0]).decode() if shown else "null"
        raise ValidationError(f"{name!r} is not supported by streamfleet: leave it out or send its default "
                              f"({default})", code=ErrorCode.invalid_request, param=name)
    return asked


def _inert(value: object, inert: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``inert`` (booleans are not numbers here: ``logprobs: 0``
    asks for something, ``logprobs: false`` does not)."""
    for v in inert:
        if v is None:
            if value is None:
                return True
        elif isinstance(value, bool) == isinstance(v, bool) and type(value) in (type(v), int, float) \
                and value == v:
            return True
    return False

#: every field of a generate payload ``Validator.check`` reads (the WebSocket's ``generate``
#: frame, docs/websocket.md). Each door says how it carries each one, as an exhaustive
#: ``match`` over this type (``openai_carries``, ``responses_carries``, ``grpc_carries``):
#: a field added here is a type error in every door until it does, and
#: tests/unit/test_request_fields.py checks that each door then maps it (docs/architecture.md,
#: "Adding a field to a request")
GenerateField = Literal[
    "id", "model", "priority", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "ignore_eos", "include_stop_str_in_output", "timeout", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "min_p", "stop_token_ids", "min_tokens", "logprobs", "top_logprobs",
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "n", "best_of",
]
#: the names a generate payload may hold: its fields, and the parameters refused by name
#: (``UNSUPPORTED``)
GENERATE_FIELDS = frozenset({*get_args(GenerateField), *UNSUPPORTED})

MAX_ID_CHARS = 128
#: most entries of ``logit_bias`` (OpenAI's limit) and of ``stop_token_ids``
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 64
#: an embeddings request whose texts hold at most this many characters in all is tokenized
#: on the event loop (tens of microseconds); a larger one in a thread. A thread for every
#: short text would cost more than it saves: the loop and the thread pass the GIL back and
#: forth, and each of the loop's system calls may then wait out a switch interval.
INLINE_TOKENIZE_CHARS = 4096
ROLES = ("system", "user", "assistant", "tool", "developer")
#: the engine backends that can compute a prompt's log probabilities (``echo`` with
#: ``logprobs``: ``extend_all`` in workers/engines/onnxruntime.py); a request for them on a
#: model of another backend is refused here, naming it. A worker whose own engine cannot
#: (another backend than its model's, a graph that gives the last position's logits only)
#: refuses the task as well (``WorkerCore``)
PROMPT_LOGPROB_BACKENDS = ("onnxruntime",)
#: an ``echo`` of a prompt of token ids longer than this is detokenized in a thread
INLINE_ECHO_TOKENS = 512


def not_text_message(spec: ModelSpec) -> str:
    """Why a text endpoint (completions, chat, the WebSocket's generate) refuses ``spec``,
    naming the model, its kind and where it is served."""
    where = {"asr": "stream audio to /v1/audio/stream or post a file to /v1/audio/transcriptions for it",
             "embedding": "post its inputs to /v1/embeddings (or send a WebSocket embed frame, or call gRPC "
                           "Embed)"}.get(spec.kind, "it cannot generate text")
    return f"model {spec.name!r} is {kind_phrase(spec.kind)}, not a text model; {where}"


def encode_texts(tokenizer: PromptTokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, special tokens included (``encode_prompt``'s, in one batch
    call where the tokenizer allows it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if texts and backend is not None and backend.truncation is None and backend.padding is None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=True)]
    return [encode_prompt(tokenizer, t) for t in texts]


def echo_of(tokenizer: PromptTokenizer, text: str, prompt_ids: tuple[int, ...] | None
            ) -> tuple[str, list[int], list[int]]:
    """``(text shown, token ids, each token's start in that text)`` of a completion's prompt
    that the response echoes: a text prompt as it was sent, tokenized as ``encode_prompt``
    tokenizes it, each token starting where the tokenizer's offsets say (a token it adds,
    such as a BOS, where the text around it is); a prompt of token ids decoded token by
    token, special tokens shown, each starting where its text does (a token that is only
    part of a character where that character starts, as a completion's tokens). Offsets
    never go back, so the text of positions ``[i, j)`` is ``text[offsets[i]:offsets[j]]``."""
    if prompt_ids is not None:
        return _decoded(tokenizer, list(prompt_ids))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        enc = backend.encode(text, add_special_tokens=True)
        ids, spans = enc.ids, enc.offsets
    else:
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        ids, spans = enc["input_ids"], enc["offset_mapping"]
    offsets, at, reached = [], 0, 0
    for begin, end in spans:
        # a token with text of its own starts where it does (overlapping spans: a character
        # split over tokens); one without (an added BOS or EOS) where the text so far ends
        at = max(at, begin if end > begin else reached)
        offsets.append(at)
        reached = max(reached, end)
    return text, list(ids), offsets


#: tokens an ``echo`` of token ids holds back for an incomplete character before it shows
#: them as they decode (no character takes more than 4 bytes: only byte garbage gets there)
_ECHO_HELD = 32


def _decoded(tokenizer: PromptTokenizer, ids: list[int]) -> tuple[str, list[int], list[int]]:
    """``echo_of`` for a prompt of token ids: the text each token adds, as a completion's
    tokens are decoded (vLLM's prefix and read offsets: a window of the tokens before it
    as context), special tokens shown; a token that is only part of a character adds
    nothing, and the one that completes it adds the character."""
    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=False) if part else ""

    parts: list[str] = []
    offsets: list[int] = []
    at = prefix = read = 0  # ids[prefix:read] is the context decoded last
    for i in range(len(ids)):
        offsets.append(at)
        before = decode(ids[prefix:read])
        window = decode(ids[prefix:i + 1])
        if len(window) > len(before) and (not window.endswith("\ufffd") or i + 1 - read >= _ECHO_HELD):
            new = window[len(before):]
            parts.append(new)
            at += len(new)
            prefix, read = read, i + 1
    if read < len(ids):  # a character left incomplete at the end: shown as decoded
        parts.append(decode(ids[prefix:])[len(decode(ids[prefix:read])):])
    return "".join(parts), ids, offsets


def check_lane(value: object) -> str:
    """The lane a request's ``priority`` names (absent or null: ``normal``).

    Raises:
        ValidationError: not one of the lanes.
    """
    if value is None:
        return "normal"
    if value not in LANES:
        raise ValidationError(f"'priority' must be one of {', '.join(LANES)}",
                              code=ErrorCode.out_of_range if isinstance(value, str) else ErrorCode.invalid_type,
                              param="priority")
    assert isinstance(value, str)  # one of LANES
    return value


def _listed(items: list[Any], most: int = 20) -> str:
    """``items`` for a message: each ``repr``, the first ``most`` of them and how many more."""
    shown = ", ".join(repr(i) for i in items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Validator:
    """Validates generate payloads against the settings and the model repository."""

    def __init__(self, settings: GatewaySettings, repo: ModelRepository) -> None:
        self.settings = settings
        self.repo = repo
        self._allowed = {m.strip() for m in settings.models.split(",") if m.strip()}
        # (model folder, tokenizer file) -> loaded tokenizer
        self._tokenizers: dict[tuple[Path, str], PromptTokenizer] = {}
        self._template_problems: dict[tuple[Path, str | None], str | None] = {}  # (tokenizer, engine.toml template)
        # (folder, tokenizer, engine.toml's) -> source
        self._template_sources: dict[tuple[Path, str, str | None], str | None] = {}
        self._grammars: dict[Path, Grammars] = {}  # tokenizer file -> the model's llguidance tokenizer
        self._grammar_problems: dict[tuple[Path, bytes], str | None] = {}  # recent grammars (digests) checked
        self._limits = settings.grammar_limits()
        self._trials: dict[tuple[Path, bytes], asyncio.Future[str | None]] = {}  # grammars being tried now

    # -- models -----------------------------------------------------------------
    def model_names(self) -> list[str]:
        names = self.repo.names()
        return [n for n in names if not self._allowed or n in self._allowed]

    def spec(self, model: str) -> ModelSpec:
        if self._allowed and model not in self._allowed:
            raise NotFoundError(f"model {model!r} is not served here", param="model")
        return self.repo.get(model)

    def tokenizer(self, spec: ModelSpec) -> PromptTokenizer:
        key = (spec.path, spec.tokenizer)  # the spec's own Path keeps its hash: no new Path per request
        tok = self._tokenizers.get(key)
        if tok is not None:
            return tok
        try:
            loaded: PromptTokenizer = load_tokenizer(spec)  # transformers' tokenizer (untyped: Any)
            tok = self._tokenizers[key] = loaded
        except FatalError as exc:
            raise NotFoundError(f"model {spec.name!r} is not available: {exc.message}", param="model") from exc
        return tok

    def chat_template(self, spec: ModelSpec) -> str | None:
        """Where the model's chat template comes from (``chat_template_source``: a file of
        its folder, ``engine.toml``, ``builtin``), or None when it has none; found once
        per model folder and ``engine.toml`` template.

        Raises:
            NotFoundError: a template file of the folder cannot be read.
        """
        key = (spec.path, spec.tokenizer, spec.chat_template)
        if key not in self._template_sources:
            try:
                self._template_sources[key] = chat_template_source(spec)
            except FatalError as exc:
                raise NotFoundError(f"model {spec.name!r} is not available: {exc.message}", param="model") from exc
        return self._template_sources[key]

    def _chat_problem(self, spec: ModelSpec) -> str | None:
        """Why the model cannot serve chat, or None: it has no chat template, or
        ``template_problem`` of its tokenizer's (found once per tokenizer and template)."""
        source = self.chat_template(spec)
        if source is None:
            return ("it has no chat template (its folder has no chat_template.jinja and no chat_template in "
                    "tokenizer_config.json; `chat_template` in its engine.toml can give it one)")
        if source == BUILTIN_CHAT_TEMPLATE:
            return None
        key = (spec.tokenizer_path, spec.chat_template)
        if key not in self._template_problems:
            self._template_problems[key] = template_problem(self.tokenizer(spec))
        return self._template_problems[key]

    def _constraint(self, p: dict[str, Any], ignore_eos: bool, tools: Tools | None) -> tuple[str, Any] | None:
        """The constraint ``p`` asks for on the output, or the call its ``tool_choice``
        forces (None for none), checked for what costs nothing: one constraint, its shape,
        size and nesting (docs/structured-outputs.md, docs/tools.md). ``finish`` compiles it."""
        depth = self.settings.grammar_max_depth
        try:
            found = check_constraint(p, depth)
            if tools is not None and tools.mode == "forced":
                if found is not None:
                    raise GrammarError(f"a forced tool call and '{found[0]}' both constrain the output; send one",
                                       "tool_choice")
                try:
                    forced = check_constraint({"guided_json": tools.call_schema()}, depth)
                    assert forced is not None  # (a guided_json is a constraint)
                    found = "tools", forced[1]
                except GrammarError as exc:
                    raise GrammarError(str(exc).replace("'guided_json'", "the tools' parameters"), "tools") from exc
        except GrammarError as exc:
            raise ValidationError(str(exc), code=ErrorCode.invalid_request, param=exc.param) from exc
        if found is not None and ignore_eos:
            raise ValidationError(f"'ignore_eos' cannot be combined with '{found[0]}': a constrained output ends "
                                  f"when its grammar is complete", code=ErrorCode.invalid_request, param="ignore_eos")
        return found

    def _grammars_of(self, spec: ModelSpec) -> Grammars:
        grammars = self._grammars.get(spec.tokenizer_path)
        if grammars is None:
            tok = self.tokenizer(spec)
            grammars = self._grammars[spec.tokenizer_path] = Grammars(tok, len(tok), list(spec.eos_token_ids),
                                                                      self._limits)
        return grammars

    def _grammar_key(self, spec: ModelSpec, grammar: str) -> tuple[Path, bytes]:
        return spec.tokenizer_path, hashlib.blake2b(grammar.encode(), digest_size=16).digest()

    def _compile(self, request: TextRequest, spec: ModelSpec) -> str:
        """The llguidance grammar of an admitted request's constraint (``verdict`` says
        whether it can be enforced).

        Raises:
            ValidationError: the schema or grammar cannot be read.
        """
        assert request.constraint is not None
        param, value = request.constraint
        try:
            return build_grammar("guided_json" if param == "tools" else param, value)
        except GrammarError as exc:
            message = str(exc).replace("'guided_json'", "the tools' parameters") if param == "tools" else str(exc)
            raise ValidationError(message, code=ErrorCode.invalid_request, param=param) from exc

    def verdict(self, spec: ModelSpec, grammar: str) -> str | None:
        """Why ``grammar`` cannot constrain the model's output, or None: ``Grammars.trial``
        (the grammar's own check, then its first tokens under the limits), run once per
        grammar; the verdicts on the last 256 are kept, so a repeated schema costs nothing
        and a client cannot grow the cache. Blocking: ``finish_async`` runs the trial in a
        thread."""
        key = self._grammar_key(spec, grammar)
        if key not in self._grammar_problems:
            self._remember(key, self._grammars_of(spec).trial(grammar))
        return self._grammar_problems[key]

    def _remember(self, key: tuple[Path, bytes], problem: str | None) -> None:
        if key in self._grammar_problems:
            return
        if len(self._grammar_problems) >= 256:
            self._grammar_problems.pop(next(iter(self._grammar_problems)))
        self._grammar_problems[key] = problem

    def _checked_grammar(self, request: TextRequest, spec: ModelSpec, grammar: str) -> str:
        problem = self.verdict(spec, grammar)
        if problem is not None:
            assert request.constraint is not None
            param = request.constraint[0]
            raise ValidationError(f"'{param}' cannot constrain model {spec.name!r}: {problem}"[:500],
                                  code=ErrorCode.invalid_request, param=param)
        return grammar

    # -- the rules --------------------------------------------------------------
    def generate(self, p: dict[str, Any]) -> TextRequest:
        """Validate one generate payload completely (``check`` then ``finish``).

        Raises:
            ValidationError: a rule failed (code and param say which).
            NotFoundError: unknown model.
        """
        return self.finish(self.check(p))

    def check(self, p: dict[str, Any], *, echo: bool = False) -> TextRequest:
        """Every rule but the prompt's token count: cheap, run before admission.
        ``echo``: a completion that returns its prompt before it (the OpenAI door's, which
        checked its type): ``max_tokens`` may be 0 (the prompt alone), and with
        ``logprobs`` the prompt's tokens get theirs (``SamplingParams.prompt_logprobs``),
        on a model whose engine can compute them.

        Raises:
            ValidationError: a rule failed (code and param say which).
            NotFoundError: unknown model.
        """
        s = self.settings
        for name, value in p.items():  # before anything walks or serialises the JSON
            if isinstance(value, (dict, list)) and depth_problem(value, s.grammar_max_depth) is not None:
                raise ValidationError(f"'{name}' nests deeper than {s.grammar_max_depth} levels; the limit is "
                                      f"{s.grammar_max_depth} (SF_GRAMMAR_MAX_DEPTH)", code=ErrorCode.invalid_request,
                                      param=name)
        ignored = check_unsupported(p, s.refuse_unsupported)
        if ignored:
            log.warning("unsupported parameters ignored (SF_REFUSE_UNSUPPORTED=false)", params=ignored)
        for name in ("n", "best_of"):  # the OpenAI door spreads them over requests (gateway/doors/openai.py)
            if p.get(name) not in (None, 1):
                raise ValidationError(f"'{name}' is a parameter of the OpenAI API; here, send one request per "
                                      f"completion (with the same prompt, requests that arrive together share "
                                      f"its prefill)", code=ErrorCode.invalid_request, param=name)
        client_id = p.get("id")
        if client_id is None:
            raise ValidationError("field 'id' is required", code=ErrorCode.missing_field, param="id")
        if not isinstance(client_id, str) or not client_id or len(client_id) > MAX_ID_CHARS:
            raise ValidationError(
                f"'id' must be a non-empty string of at most {MAX_ID_CHARS} characters",
                code=ErrorCode.invalid_type, param="id")

        model = p.get("model", s.default_model)
        if model is None:
            model = s.default_model
        if not isinstance(model, str):
            raise ValidationError("'model' must be a string", code=ErrorCode.invalid_type, param="model")
        spec = self.spec(model)
        if spec.kind != "text":
            raise ValidationError(not_text_message(spec), code=ErrorCode.invalid_request, param="model")

        lane = check_lane(p.get("priority"))

        explicit = frozenset(name for name in ("max_tokens", "timeout") if p.get(name) is not None)
        max_tokens = self._int(p, "max_tokens", s.default_max_tokens, 0 if echo else 1, s.max_max_tokens)
        temperature = self._float(p, "temperature", DEFAULT_TEMPERATURE, *RANGES["temperature"])
        top_p = self._float(p, "top_p", 1.0, *RANGES["top_p"])
        if top_p == 0.0:
            raise ValidationError("'top_p' must be greater than 0", code=ErrorCode.out_of_range, param="top_p")
        top_k = self._int(p, "top_k", 0, *RANGES["top_k"])
        seed = self._int(p, "seed", None, *RANGES["seed"])
        if seed is None:
            seed = secrets.randbits(63)
        stop = self._stop(p.get("stop"))
        ignore_eos = self._bool(p, "ignore_eos")
        include_stop = self._bool(p, "include_stop_str_in_output")
        timeout_s = self._float(p, "timeout", s.request_timeout_s, 0.001, 3600.0)

        prompt, messages = p.get("prompt"), p.get("messages")
        if (prompt is None) == (messages is None):
            raise ValidationError("exactly one of 'prompt' or 'messages' is required",
                                  code=ErrorCode.missing_field, param="prompt")
        if echo and messages is not None:
            raise ValidationError("'echo' is a parameter of completions (a 'prompt'), not of chat",
                                  code=ErrorCode.invalid_request, param="echo")
        tools = parse_tools(p)
        if tools is not None and prompt is not None:
            raise ValidationError("'tools' need 'messages' (a chat request)", code=ErrorCode.invalid_request,
                                  param="tools")
        msgs, token_ids = None, None
        if isinstance(prompt, list):  # token ids, as OpenAI's and vLLM's completions take them
            token_ids = self._token_ids(prompt, spec)
            text = ""
        elif prompt is not None:
            if not isinstance(prompt, str):
                raise ValidationError("'prompt' must be a string or a list of token ids", code=ErrorCode.invalid_type,
                                      param="prompt")
            text = prompt
            if not text:
                raise ValidationError("the prompt is empty", code=ErrorCode.invalid_request, param="prompt")
            if len(text) > s.max_prompt_chars:
                raise ValidationError(f"the prompt has {len(text)} characters; the limit is {s.max_prompt_chars}",
                                      code=ErrorCode.prompt_too_long, param="prompt")
        else:
            msgs = self._messages(messages)
            chars = sum(len(m["content"]) + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", ()))
                        for m in msgs) + (len(orjson.dumps(tools.functions)) if tools is not None else 0)
            if chars > s.max_prompt_chars:  # before a template renders them
                raise ValidationError(f"the messages have {chars} characters; the limit is {s.max_prompt_chars}",
                                      code=ErrorCode.prompt_too_long, param="messages")
            problem = self._chat_problem(spec)
            if problem is not None:
                raise ValidationError(f"model {spec.name!r} cannot serve chat: {problem}; send a 'prompt' instead",
                                      code=ErrorCode.invalid_request, param="messages")
            text = ""  # rendered by ``finish``, once admitted
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                stop=stop, seed=seed, ignore_eos=ignore_eos, include_stop_str_in_output=include_stop,
                                **self._processing(p, spec, max_tokens))
        if echo and params.logprobs is not None:
            if spec.backend not in PROMPT_LOGPROB_BACKENDS:
                raise ValidationError(f"model {spec.name!r} runs on the {spec.backend} engine, which cannot compute "
                                      f"the log probabilities of a prompt's tokens ('echo' with 'logprobs'); send "
                                      f"'echo' without 'logprobs', or ask a model served by "
                                      f"{' or '.join(PROMPT_LOGPROB_BACKENDS)}", code=ErrorCode.invalid_request,
                                      param="echo")
            params = replace(params, prompt_logprobs=params.logprobs)
        return TextRequest(client_id=client_id, model=spec.name, lane=lane, params=params, timeout_s=timeout_s,
                     prompt_text=text, explicit=explicit, chat=messages is not None, prompt_ids=token_ids,
                     tools=tools if tools is not None and tools.mode != "none" else None,
                     messages=tuple(msgs) if msgs is not None else None,
                     constraint=self._constraint(p, ignore_eos, tools), echo=echo)

    async def finish_async(self, request: AnyRequest) -> AnyRequest:
        """``finish``, with a new constraint's trial (``verdict``: bounded by the grammar
        limits, but not free) in a thread, off the event loop other clients share; an
        embeddings request's texts are tokenized in a thread too, unless they are short
        (``INLINE_TOKENIZE_CHARS``)."""
        if isinstance(request, EmbeddingsRequest):
            if sum(len(i) for i in request.inputs if isinstance(i, str)) > INLINE_TOKENIZE_CHARS:
                spec = self.spec(request.model)
                self.tokenizer(spec)  # loaded (and cached) on the loop, used in the thread
                return await asyncio.to_thread(self.finish, request)
            return self.finish(request)
        if not isinstance(request, TextRequest) or request.prepared:
            return self.finish(request)
        if request.echo and request.prompt_ids is not None and len(request.prompt_ids) > INLINE_ECHO_TOKENS:
            self.tokenizer(self.spec(request.model))  # loaded (and cached) on the loop, used in the thread
            return await asyncio.to_thread(self.finish, request)
        if request.constraint is not None:
            spec = self.spec(request.model)
            grammar = self._compile(request, spec)
            key = self._grammar_key(spec, grammar)
            if key not in self._grammar_problems:
                grammars = self._grammars_of(spec)  # built once, on the loop (it caches tokenizers)
                trial = self._trials.get(key)
                if trial is None:  # the choices of one request (``n``) share one trial
                    trial = self._trials[key] = asyncio.ensure_future(asyncio.to_thread(grammars.trial, grammar))
                    trial.add_done_callback(lambda _: self._trials.pop(key, None))
                self._remember(key, await asyncio.shield(trial))  # the verdicts change on the loop only
            return self.finish(request, grammar=grammar)
        return self.finish(request)

    @overload
    def finish(self, request: TextRequest, *, grammar: str | None = None) -> TextRequest: ...

    @overload
    def finish(self, request: SpeechRequest, *, grammar: str | None = None) -> SpeechRequest: ...

    @overload
    def finish(self, request: EmbeddingsRequest, *, grammar: str | None = None) -> EmbeddingsRequest: ...

    def finish(self, request: AnyRequest, *, grammar: str | None = None) -> AnyRequest:
        """The costly part of validation, for an admitted request, which it returns
        ``prepared``: a text request's chat template rendered, its constraint compiled
        and tried (``grammar``: already compiled by the caller), its prompt tokenized and
        checked against the model's context; an embeddings request's texts tokenized; a
        speech request as it is (its input is audio, sent separately). A prepared request
        is returned as it is.

        Raises:
            ValidationError: a constraint that cannot be enforced; the prompt is too long,
                encodes to nothing, or leaves no room to generate.
        """
        if request.prepared or isinstance(request, SpeechRequest):
            return request
        if isinstance(request, EmbeddingsRequest):
            inputs = self._embedding_inputs(request.inputs, self.spec(request.model))
            return replace(request, inputs=inputs, prepared=True)
        return self._finish_text(request, grammar)

    def _finish_text(self, request: TextRequest, grammar: str | None) -> TextRequest:
        spec = self.spec(request.model)
        params, text = request.params, request.prompt_text
        if request.constraint is not None:
            grammar = self._checked_grammar(request, spec, grammar or self._compile(request, spec))
            params = replace(params, grammar=grammar)
        if request.messages is not None:
            text = render_chat(list(request.messages), self.tokenizer(spec), request.tools)
            if not text:
                raise ValidationError("the prompt is empty", code=ErrorCode.invalid_request, param="messages")
            if len(text) > self.settings.max_prompt_chars:
                raise ValidationError(f"the prompt has {len(text)} characters; the limit is "
                                      f"{self.settings.max_prompt_chars}", code=ErrorCode.prompt_too_long,
                                      param="messages")
        echo_text: str | None = None
        offsets: Sequence[int] = ()
        ids: Sequence[int]
        if request.echo:
            echo_text, ids, offsets = echo_of(self.tokenizer(spec), text, request.prompt_ids)
        else:
            ids = request.prompt_ids if request.prompt_ids is not None else \
                encode_prompt(self.tokenizer(spec), text, special_tokens=not request.chat)
        if not ids:
            raise ValidationError("the prompt encodes to no tokens", code=ErrorCode.invalid_request, param="prompt")
        if len(ids) >= spec.max_context:
            raise ValidationError(
                f"the prompt has {len(ids)} tokens; model {spec.name!r} has a context of {spec.max_context} "
                f"and needs room for at least one completion token",
                code=ErrorCode.prompt_too_long, param="prompt")
        if "max_tokens" in request.explicit and len(ids) + params.max_tokens > spec.max_context:
            # as OpenAI and vLLM answer: a completion cut short to fit would look finished
            # ("length") and, constrained, would not parse. Left out, max_tokens fills the context
            raise ValidationError(
                f"model {spec.name!r} has a context of {spec.max_context} tokens; this request asks for "
                f"{len(ids) + params.max_tokens}: {len(ids)} in the prompt and {params.max_tokens} for the "
                f"completion (max_tokens). Ask for at most {spec.max_context - len(ids)}, or leave max_tokens out",
                code=ErrorCode.prompt_too_long, param="max_tokens")
        return replace(request, prompt_ids=tuple(ids), params=params, prompt_text=text, echo_text=echo_text,
                       echo_offsets=tuple(offsets), prepared=True)

    def _embedding_inputs(self, inputs: tuple[str | tuple[int, ...], ...], spec: ModelSpec
                          ) -> tuple[tuple[int, ...], ...]:
        """An embeddings request's inputs as token ids: its texts tokenized (special tokens
        included, as the model was trained), each within the model's ``max_context``
        (nothing is truncated: docs/openai.md, "Embeddings")."""
        texts = [(i, t) for i, t in enumerate(inputs) if isinstance(t, str)]
        encoded = dict(zip((i for i, _ in texts), encode_texts(self.tokenizer(spec), [t for _, t in texts])))
        out: list[tuple[int, ...]] = []
        for i, item in enumerate(inputs):
            ids = tuple(encoded[i]) if isinstance(item, str) else item
            if not ids:
                raise ValidationError(f"input {i} encodes to no tokens", code=ErrorCode.invalid_request, param="input")
            if len(ids) > spec.max_context:
                raise ValidationError(f"input {i} has {len(ids)} tokens, over the limit of model {spec.name!r} "
                                      f"({spec.max_context} tokens, special tokens included); it is not truncated",
                                      code=ErrorCode.prompt_too_long, param="input")
            out.append(ids)
        return tuple(out)

    def _token_ids(self, prompt: list[Any], spec: ModelSpec) -> tuple[int, ...]:
        """A prompt of token ids: integers of the model's vocabulary, at most its context
        (the worker checks the same again)."""
        if not prompt:
            raise ValidationError("the prompt is empty", code=ErrorCode.invalid_request, param="prompt")
        if len(prompt) >= spec.max_context:  # first: what follows walks at most a context's worth
            raise ValidationError(f"the prompt has {len(prompt)} tokens; model {spec.name!r} has a context of "
                                  f"{spec.max_context} and needs room for at least one completion token",
                                  code=ErrorCode.prompt_too_long, param="prompt")
        if not all(_is_int(t) for t in prompt):
            raise ValidationError("'prompt' must be a string or a list of token ids (integers)",
                                  code=ErrorCode.invalid_type, param="prompt")
        vocab = len(self.tokenizer(spec))
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValidationError(f"'prompt' holds {_listed(bad)}, not token ids of model {spec.name!r}, whose "
                                  f"vocabulary size is {vocab} (ids 0 to {vocab - 1})", code=ErrorCode.out_of_range,
                                  param="prompt")
        return tuple(int(t) for t in prompt)

    def _processing(self, p: dict[str, Any], spec: ModelSpec, max_tokens: int) -> dict[str, Any]:
        """The logits-processing and log-probability fields of ``SamplingParams``
        (docs/sampling.md)."""
        out: dict[str, Any] = {
            "presence_penalty": self._float(p, "presence_penalty", 0.0, *RANGES["presence_penalty"]),
            "frequency_penalty": self._float(p, "frequency_penalty", 0.0, *RANGES["frequency_penalty"]),
            "repetition_penalty": self._float(p, "repetition_penalty", 1.0, *RANGES["repetition_penalty"]),
            "min_p": self._float(p, "min_p", 0.0, *RANGES["min_p"]),
            "min_tokens": self._int(p, "min_tokens", 0, 0, max_tokens),
        }
        bias, stop_ids = p.get("logit_bias"), p.get("stop_token_ids")
        vocab = len(self.tokenizer(spec)) if bias or stop_ids else 0
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValidationError("'logit_bias' must be an object of token id to bias", code=ErrorCode.invalid_type,
                                      param="logit_bias")
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValidationError(f"'logit_bias' has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS}",
                                      code=ErrorCode.out_of_range, param="logit_bias")
            pairs: dict[int, float] = {}
            low, high = RANGES["logit_bias"]
            bad_keys, bad_values = [], []
            for key, value in bias.items():
                tid = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10 else -1
                if not 0 <= tid < vocab:
                    bad_keys.append(key)
                elif not is_number(value) or not low <= value <= high:
                    bad_values.append(key)
                else:
                    pairs[tid] = pairs.get(tid, 0.0) + float(value)
            if bad_keys:  # every one named (at most MAX_LOGIT_BIAS), so one fix makes the request good
                raise ValidationError(f"'logit_bias' keys {_listed(bad_keys)} are not token ids of model "
                                      f"{spec.name!r}, whose vocabulary size is {vocab} (ids 0 to {vocab - 1})"
                                      if len(bad_keys) > 1 else
                                      f"'logit_bias' key {bad_keys[0]!r} is not a token id of model {spec.name!r}, "
                                      f"whose vocabulary size is {vocab} (ids 0 to {vocab - 1})",
                                      code=ErrorCode.out_of_range, param="logit_bias")
            if bad_values:
                raise ValidationError(f"'logit_bias' values for tokens {', '.join(bad_values)} must be numbers from "
                                      f"{low:g} to {high:g}", code=ErrorCode.out_of_range, param="logit_bias")
            out["logit_bias"] = [[t, b] for t, b in pairs.items()]
        if stop_ids is not None:
            if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
                raise ValidationError("'stop_token_ids' must be a list of token ids", code=ErrorCode.invalid_type,
                                      param="stop_token_ids")
            if len(stop_ids) > MAX_STOP_TOKEN_IDS:
                raise ValidationError(f"'stop_token_ids' has {len(stop_ids)} entries; the limit is "
                                      f"{MAX_STOP_TOKEN_IDS}", code=ErrorCode.out_of_range, param="stop_token_ids")
            bad = [t for t in stop_ids if not 0 <= t < vocab]
            if bad:
                raise ValidationError(f"'stop_token_ids' holds {_listed(bad)}, not token ids of model {spec.name!r}, "
                                      f"whose vocabulary size is {vocab} (ids 0 to {vocab - 1})",
                                      code=ErrorCode.out_of_range, param="stop_token_ids")
            out["stop_token_ids"] = sorted(set(stop_ids))
        logprobs = p.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise ValidationError("'logprobs' must be true or false (a completion's integer 'logprobs' is "
                                  "'top_logprobs' here)", code=ErrorCode.invalid_type, param="logprobs")
        top = self._int(p, "top_logprobs", None, *RANGES["logprobs"])
        if top is not None and not logprobs:
            raise ValidationError("'top_logprobs' needs 'logprobs': true", code=ErrorCode.invalid_request,
                                  param="top_logprobs")
        out["logprobs"] = (top or 0) if logprobs else None
        return out

    # -- field helpers ----------------------------------------------------------
    @staticmethod
    def _bool(p: dict[str, Any], name: str) -> bool:
        v = p.get(name)
        if v is None:
            return False
        if not isinstance(v, bool):
            raise ValidationError(f"'{name}' must be true or false", code=ErrorCode.invalid_type, param=name)
        return v

    @overload
    @staticmethod
    def _int(p: dict[str, Any], name: str, default: int, lo: float, hi: float) -> int: ...

    @overload
    @staticmethod
    def _int(p: dict[str, Any], name: str, default: None, lo: float, hi: float) -> int | None: ...

    @staticmethod
    def _int(p: dict[str, Any], name: str, default: int | None, lo: float, hi: float) -> int | None:
        v = p.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not _is_int(v):
            raise ValidationError(f"'{name}' must be an integer", code=ErrorCode.invalid_type, param=name)
        if not lo <= v <= hi:
            raise ValidationError(f"'{name}' must be between {lo} and {hi}, got {v}",
                                  code=ErrorCode.out_of_range, param=name)
        return v

    @staticmethod
    def _float(p: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
        v = p.get(name)
        if v is None:
            return default
        if not is_number(v):
            raise ValidationError(f"'{name}' must be a number", code=ErrorCode.invalid_type, param=name)
        if not lo <= v <= hi:
            raise ValidationError(f"'{name}' must be between {lo} and {hi}, got {v}",
                                  code=ErrorCode.out_of_range, param=name)
        return float(v)

    def _stop(self, v: object) -> list[str]:
        s = self.settings
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ValidationError("'stop' must be a string or a list of strings",
                                  code=ErrorCode.invalid_type, param="stop")
        if len(v) > s.max_stop_sequences:
            raise ValidationError(f"at most {s.max_stop_sequences} stop sequences are allowed",
                                  code=ErrorCode.out_of_range, param="stop")
        for x in v:
            if not x or len(x) > s.max_stop_chars:
                raise ValidationError(f"each stop sequence must have 1 to {s.max_stop_chars} characters",
                                      code=ErrorCode.out_of_range, param="stop")
        return list(v)

    @staticmethod
    def _messages(v: object) -> list[dict[str, Any]]:
        if not isinstance(v, list) or not v:
            raise ValidationError("'messages' must be a non-empty list", code=ErrorCode.invalid_type,
                                  param="messages")
        out = []
        for i, m in enumerate(v):
            if not isinstance(m, dict):
                raise ValidationError(f"messages[{i}] must be an object", code=ErrorCode.invalid_type,
                                      param="messages")
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise ValidationError(f"messages[{i}].role must be one of {', '.join(ROLES)}",
                                      code=ErrorCode.invalid_request, param="messages")
            calls = Validator._tool_calls(m.get("tool_calls"), i) if role == "assistant" else []
            if content is None and calls:  # an assistant turn that only called tools
                content = ""
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                texts: list[Any] = [c.get("text") for c in content if isinstance(c, dict) and c.get("type") == "text"]
                if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                    raise ValidationError(f"messages[{i}].content parts must all be text",
                                          code=ErrorCode.invalid_type, param="messages")
                content = "".join(texts)
            if not isinstance(content, str):
                raise ValidationError(f"messages[{i}].content must be a string", code=ErrorCode.invalid_type,
                                      param="messages")
            msg: dict[str, Any] = {"role": role, "content": content}
            if calls:
                msg["tool_calls"] = calls
            if role == "tool":
                call_id = m.get("tool_call_id")
                if not isinstance(call_id, str) or not call_id:
                    raise ValidationError(f"messages[{i}] (role tool) needs its 'tool_call_id'",
                                          code=ErrorCode.missing_field, param="messages")
                msg["tool_call_id"] = call_id
            out.append(msg)
        return out

    @staticmethod
    def _tool_calls(v: object, i: int) -> list[dict[str, Any]]:
        """An assistant message's earlier ``tool_calls``, normalised."""
        if v is None:
            return []
        if not isinstance(v, list):
            raise ValidationError(f"messages[{i}].tool_calls must be a list", code=ErrorCode.invalid_type,
                                  param="messages")
        out = []
        for c in v:
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                    or not isinstance(f.get("arguments"), str) or not isinstance(c.get("id"), str):
                raise ValidationError(f"messages[{i}].tool_calls entries need an 'id' and a 'function' with 'name' "
                                      f"and 'arguments' (a string)", code=ErrorCode.invalid_type, param="messages")
            out.append({"id": c["id"], "type": "function",
                        "function": {"name": f["name"], "arguments": f["arguments"]}})
        return out
