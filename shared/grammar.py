"""Structured outputs: the constraint a request asks for, as an llguidance grammar, and
the token masks that enforce it (docs/structured-outputs.md).

The gateway turns ``response_format`` (OpenAI) or ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (vLLM) into one llguidance grammar string
(``grammar_of``) and checks that it compiles against the model's tokenizer
(``Grammars.problem``), so a bad schema is a 400 naming the parameter and never reaches a
worker. The worker keeps one ``LLMatcher`` per constrained sequence and computes the
batch's masks in one call per step (``Grammars.masks``: llguidance's executor spreads
the matchers over its threads, without the GIL), which the logits step applies to the
constrained rows at once.

llguidance is imported on first use: a process that never sees a constraint never loads it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import orjson

__all__ = ["CONSTRAINTS", "MAX_GRAMMAR_BYTES", "GrammarError", "grammar_of", "Grammars"]

#: the request fields that constrain the output: OpenAI's, then vLLM's extensions
CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
#: the largest schema or grammar a request may carry (its JSON text)
MAX_GRAMMAR_BYTES = 64 * 1024
#: compiled grammars a worker keeps for copying (``Grammars.matcher``)
PRISTINE_GRAMMARS = 64
#: JSON is generated without optional whitespace unless the schema asks for it
#: (``"x-guidance": {"whitespace_flexible": true}``): a model cannot pad it out forever
_JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint that is malformed or does not compile; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _llg():
    import llguidance

    return llguidance


def _size(value: Any, param: str) -> None:
    size = len(value.encode()) if isinstance(value, str) else len(orjson.dumps(value))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"'{param}' is {size} bytes; the limit is {MAX_GRAMMAR_BYTES}", param)


def _json_grammar(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError as exc:
            raise GrammarError(f"'{param}' is not valid JSON: {exc}", param) from exc
    if not isinstance(schema, dict):
        raise GrammarError(f"'{param}' must be a JSON schema (an object)", param)
    _size(schema, param)
    try:
        return _llg().LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
    except ValueError as exc:
        raise GrammarError(f"'{param}' is not a usable JSON schema: {exc}", param) from exc


def grammar_of(p: dict[str, Any]) -> tuple[str, str] | None:
    """``(grammar, param)`` of the constraint ``p`` asks for, None for none.

    Raises:
        GrammarError: a malformed constraint, or more than one.
    """
    asked = [name for name in CONSTRAINTS if p.get(name) is not None
             and not (name == "response_format" and isinstance(p[name], dict) and p[name].get("type") == "text")]
    if not asked:
        return None
    if len(asked) > 1:
        raise GrammarError(f"'{asked[0]}' and '{asked[1]}' both constrain the output; send one", asked[1])
    name = asked[0]
    value = p[name]
    if name == "response_format":
        if not isinstance(value, dict) or value.get("type") not in ("json_object", "json_schema"):
            raise GrammarError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                               "{\"type\": \"json_schema\", \"json_schema\": {\"name\": …, \"schema\": {…}}}", name)
        if value["type"] == "json_object":
            return _json_grammar({"type": "object"}, name), name
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("'response_format.json_schema' must be an object with a 'schema' object", name)
        # OpenAI allows a json_schema without a schema: any JSON object then
        return _json_grammar(spec.get("schema", {"type": "object"}), name), name
    if name == "guided_json":
        return _json_grammar(value, name), name
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise GrammarError("'guided_regex' must be a non-empty string", name)
        _size(value, name)
        return _llg().LLMatcher.grammar_from_regex(value), name
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise GrammarError("'guided_choice' must be a non-empty list of non-empty strings", name)
        _size(value, name)
        return _llg().grammar_from("choice", orjson.dumps(value).decode()), name
    if not isinstance(value, str) or not value.strip():
        raise GrammarError("'guided_grammar' must be a Lark or GBNF grammar (a string)", name)
    _size(value, name)
    try:
        return _llg().grammar_from("grammar", value), name
    except Exception as exc:  # a GBNF grammar that does not convert
        raise GrammarError(f"'guided_grammar' does not parse: {exc}", name) from exc


class Grammars:
    """One model's llguidance tokenizer, matchers and masks.

    Args:
        tokenizer: the model's ``PreTrainedTokenizerFast``.
        vocab_size: the width of the engine's logits (may exceed the tokenizer's size).
        eos_ids: the model's end-of-sequence ids.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:
        llg = _llg()
        import llguidance.hf

        self.vocab_size = int(vocab_size)
        eos = [int(t) for t in eos_ids] or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                      eos_token=eos if eos is None or len(eos) > 1 else eos[0])
        self._executor = None
        self._lock = threading.Lock()
        self._llg = llg
        self._words = (self.vocab_size + 31) // 32
        #: compiled grammars, most recent last: a new sequence's matcher is a copy of its
        #: grammar's pristine one (microseconds, against a compile of about a millisecond)
        self._pristine: dict[str, Any] = {}
        #: seconds the last ``masks`` call took
        self.last_masks_s = 0.0

    def problem(self, grammar: str) -> str | None:
        """Why ``grammar`` cannot constrain this model's output, or None."""
        message = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        return message if message and not message.startswith("WARNING") else None

    def matcher(self, grammar: str):
        """A new matcher for one sequence.

        Raises:
            ValueError: the grammar does not compile (the message says why).
        """
        m = self._pristine.pop(grammar, None)
        if m is None:
            m = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
            if m.is_error():
                raise ValueError(m.get_error())
            if len(self._pristine) >= PRISTINE_GRAMMARS:
                self._pristine.pop(next(iter(self._pristine)))
        self._pristine[grammar] = m
        return m.deep_copy()

    def masks(self, matchers: list) -> np.ndarray:
        """The allowed next tokens of each matcher: bool ``[len(matchers), vocab_size]``,
        computed in parallel by llguidance's executor."""
        if self._executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = self._llg.LLExecutor()
        t0 = time.perf_counter()
        bits = np.zeros((len(matchers), self._words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.ctypes.data,
                                               self._words * 4, len(matchers))
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size].astype(bool)
        self.last_masks_s = time.perf_counter() - t0
        return allowed
