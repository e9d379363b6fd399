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

Every cost is bounded (docs/security.md, "Grammars"): a constraint nests at most
``GrammarLimits.max_depth`` levels and carries at most ``MAX_GRAMMAR_BYTES``; llguidance's own
limits (lexer fuel, lexer states, Earley items, grammar size) are set explicitly, so a
pathological regular expression fails with a named limit instead of building millions of
states; the gateway tries each new grammar for a few tokens (``Grammars.trial``) after the
request is admitted, and the worker fails only the sequence whose mask breaks a limit or
its time budget (``Grammars.masks``); the compiled grammars a worker keeps are bounded in
bytes, not in number.

llguidance is imported on first use: a process that never sees a constraint never loads it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import orjson

if TYPE_CHECKING:
    import llguidance
    from transformers import PreTrainedTokenizerFast

    from streamfleet.shared.modelrepo import Tokenizer

__all__ = ["COSTLY", "CONSTRAINTS", "DEFAULT_LIMITS", "MAX_GRAMMAR_BYTES", "GrammarError", "GrammarLimits",
           "build_grammar", "check_constraint", "depth_problem", "grammar_of", "plain_error", "Grammars"]

#: the request fields that constrain the output: OpenAI's, then vLLM's extensions
CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
#: the largest schema or grammar a request may carry (its JSON text)
MAX_GRAMMAR_BYTES = 64 * 1024
#: a cached grammar is charged at least this much (its matcher's own structures)
MIN_GRAMMAR_CHARGE = 64 * 1024
#: tokens the gateway's trial of a new grammar follows (``Grammars.trial``)
TRIAL_TOKENS = 8
#: JSON is generated without optional whitespace unless the schema asks for it
#: (``"x-guidance": {"whitespace_flexible": true}``): a model cannot pad it out forever
_JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint that is malformed or does not compile; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What one constraint may cost (docs/security.md, "Grammars"); the settings
    ``SF_GRAMMAR_*`` (``CommonSettings.grammar_limits``), the same in gateways and workers.

    ``lexer_fuel``, ``step_fuel``, ``step_items``, ``lexer_states`` and ``grammar_size``
    are llguidance's ``LLParserLimits`` (``initial_lexer_fuel``, ``step_lexer_fuel``,
    ``step_max_items``, ``max_lexer_states``, ``max_grammar_size``): its work units, each
    about a microsecond or less. ``mask_budget_ms`` is wall time: a mask that takes longer
    ends its request. ``max_depth`` bounds the nesting of a schema (and of anything else a
    request sends as JSON). ``cache_mb`` bounds the compiled grammars a worker keeps."""

    lexer_fuel: int = 50_000
    step_fuel: int = 50_000
    step_items: int = 50_000
    lexer_states: int = 10_000
    grammar_size: int = 200_000
    mask_budget_ms: float = 50.0
    max_depth: int = 64
    cache_mb: float = 64.0

    def llg(self) -> llguidance.LLParserLimits:
        """The limits as llguidance's ``LLParserLimits`` (errors without parser state)."""
        limits: llguidance.LLParserLimits = _llg().LLParserLimits(
            initial_lexer_fuel=self.lexer_fuel, step_lexer_fuel=self.step_fuel, step_max_items=self.step_items,
            max_lexer_states=self.lexer_states, max_grammar_size=self.grammar_size, verbose_errors=False)
        return limits


DEFAULT_LIMITS = GrammarLimits()

#: llguidance's words for its limits, and the setting that raises each
_LIMIT_ERRORS = (
    ("too many expressions", "SF_GRAMMAR_LEXER_FUEL", "lexer_fuel",
     "its regular expressions expand past the lexer's work limit"),
    ("lexer fuel", "SF_GRAMMAR_STEP_FUEL", "step_fuel", "one token's check exceeds the lexer's work limit"),
    ("max_lexer_states", "SF_GRAMMAR_LEXER_STATES", "lexer_states", "it needs more lexer states than allowed"),
    ("lexer states", "SF_GRAMMAR_LEXER_STATES", "lexer_states", "it needs more lexer states than allowed"),
    ("too many items", "SF_GRAMMAR_STEP_ITEMS", "step_items", "one token's check exceeds the parser's item limit"),
    ("step_max_items", "SF_GRAMMAR_STEP_ITEMS", "step_items", "one token's check exceeds the parser's item limit"),
    ("grammar size", "SF_GRAMMAR_SIZE", "grammar_size", "the compiled grammar is larger than allowed"),
    ("max_grammar_size", "SF_GRAMMAR_SIZE", "grammar_size", "the compiled grammar is larger than allowed"),
)
#: how every "this constraint costs too much" message begins
COSTLY = "the constraint is too costly to enforce"
_STATE_DUMP = re.compile(r"<non-verbose/>|<state>.*?</state>", re.DOTALL)


def plain_error(message: str, limits: GrammarLimits = DEFAULT_LIMITS) -> str:
    """llguidance's error in the project's words: a broken limit named with its setting
    and value, anything else on one line without the parser's internal state."""
    low = message.lower()
    for needle, setting, field, what in _LIMIT_ERRORS:
        if needle in low:
            return f"{COSTLY}: {what} ({setting}={getattr(limits, field)})"
    text = _STATE_DUMP.sub("", message)
    text = " ".join(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("WARNING"))
    return text[:300]


def depth_problem(value: object, limit: int) -> int | None:
    """How deep ``value`` nests (objects and arrays) when that is more than ``limit``,
    else None; walks without recursion, and stops at the first level past the limit."""
    level, frontier = 0, [value]
    while frontier:
        nxt: list[Any] = []
        for v in frontier:
            if isinstance(v, dict):
                nxt.extend(v.values())
            elif isinstance(v, list):
                nxt.extend(v)
        if not nxt:
            return None
        level += 1
        if level > limit:
            return level
        frontier = nxt
    return None


def _llg() -> ModuleType:
    import llguidance

    return llguidance


def _size(value: object, param: str, max_depth: int) -> None:
    if isinstance(value, (dict, list)) and depth_problem(value, max_depth) is not None:
        raise GrammarError(f"'{param}' nests deeper than {max_depth} levels; the limit is {max_depth} "
                           f"(SF_GRAMMAR_MAX_DEPTH)", param)
    size = len(value.encode()) if isinstance(value, str) else len(orjson.dumps(value))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"'{param}' is {size} bytes; the limit is {MAX_GRAMMAR_BYTES}", param)


def _schema(schema: object, param: str, max_depth: int) -> dict[str, Any]:
    if isinstance(schema, str):
        if len(schema) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"'{param}' is {len(schema)} characters; the limit is {MAX_GRAMMAR_BYTES}", param)
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError as exc:
            raise GrammarError(f"'{param}' is not valid JSON: {exc}", param) from exc
    if not isinstance(schema, dict):
        raise GrammarError(f"'{param}' must be a JSON schema (an object)", param)
    _size(schema, param, max_depth)
    return schema


def check_constraint(p: dict[str, Any], max_depth: int = DEFAULT_LIMITS.max_depth) -> tuple[str, Any] | None:
    """``(param, value)`` of the constraint ``p`` asks for, None for none: the checks that
    cost next to nothing (one constraint, its shape, its size and nesting), run before the
    request is admitted. ``value`` is a JSON schema (``response_format``, ``guided_json``),
    a regex, a list of choices or a grammar, for ``build_grammar``.

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
            return name, {"type": "object"}
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("'response_format.json_schema' must be an object with a 'schema' object", name)
        # OpenAI allows a json_schema without a schema: any JSON object then
        return name, _schema(spec.get("schema", {"type": "object"}), name, max_depth)
    if name == "guided_json":
        return name, _schema(value, name, max_depth)
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise GrammarError("'guided_regex' must be a non-empty string", name)
    elif name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise GrammarError("'guided_choice' must be a non-empty list of non-empty strings", name)
    elif not isinstance(value, str) or not value.strip():
        raise GrammarError("'guided_grammar' must be a Lark or GBNF grammar (a string)", name)
    _size(value, name, max_depth)
    return name, value


def build_grammar(name: str, value: object) -> str:
    """The llguidance grammar of a constraint ``check_constraint`` passed (about a
    millisecond for a large schema: run after admission).

    Raises:
        GrammarError: a schema or grammar llguidance cannot read.
    """
    llg = _llg()
    try:
        if name in ("response_format", "guided_json"):
            return str(llg.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_DEFAULTS))
        if name == "guided_regex":
            return str(llg.LLMatcher.grammar_from_regex(value))
        if name == "guided_choice":
            return str(llg.grammar_from("choice", orjson.dumps(value).decode()))
        return str(llg.grammar_from("grammar", value))
    except Exception as exc:  # ValueError from the schema reader; a GBNF grammar that does not convert
        what = "is not a usable JSON schema" if name in ("response_format", "guided_json") else "does not parse"
        raise GrammarError(f"'{name}' {what}: {plain_error(str(exc))}", name) from exc


def grammar_of(p: dict[str, Any], max_depth: int = DEFAULT_LIMITS.max_depth) -> tuple[str, str] | None:
    """``(grammar, param)`` of the constraint ``p`` asks for, None for none
    (``check_constraint`` then ``build_grammar``).

    Raises:
        GrammarError: a malformed constraint, or more than one.
    """
    found = check_constraint(p, max_depth)
    return None if found is None else (build_grammar(*found), found[0])


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_reader() -> Callable[[], int] | None:
    """A function returning the bytes malloc has handed out (glibc's ``mallinfo2``:
    llguidance allocates through it), or None where there is no such call."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def used() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return used


_heap_bytes = _heap_reader()


class Grammars:
    """One model's llguidance tokenizer, matchers and masks, under ``limits``.

    Args:
        tokenizer: the model's ``PreTrainedTokenizerFast``.
        vocab_size: the width of the engine's logits (may exceed the tokenizer's size).
        eos_ids: the model's end-of-sequence ids.
        limits: what one constraint may cost (``GrammarLimits``).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int],
                 limits: GrammarLimits = DEFAULT_LIMITS) -> None:
        llg = _llg()
        import llguidance.hf

        self.vocab_size = int(vocab_size)
        self.limits = limits
        self._llg_limits = limits.llg()
        eos = [int(t) for t in eos_ids] or None
        self._eos = set(eos or ())
        # (llguidance reads a transformers tokenizer's own parts: the worker's is one,
        # ``load_tokenizer``'s; the Tokenizer protocol names what the worker itself calls)
        hf = cast("PreTrainedTokenizerFast", tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                                      eos_token=eos if eos is None or len(eos) > 1 else eos[0])
        self._executor: llguidance.LLExecutor | None = None
        self._lock = threading.Lock()
        self._llg = llg
        self._words = (self.vocab_size + 31) // 32
        #: compiled grammars, least recently used first, with the bytes each is charged: a
        #: new sequence's matcher is a copy of its grammar's pristine one (microseconds,
        #: against a compile and a first mask of about a millisecond), and copies share the
        #: lexer their masks build, so the pristine one holds that memory until evicted
        self._pristine: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.cached_bytes = 0
        #: masks computed one matcher at a time on the next call: the last call broke the
        #: time budget with several matchers, and the one to blame is not known
        self._probe = False
        #: seconds the last ``masks`` call took
        self.last_masks_s = 0.0

    @property
    def _budget_s(self) -> float:
        return self.limits.mask_budget_ms / 1000

    def problem(self, grammar: str) -> str | None:
        """Why ``grammar`` cannot constrain this model's output, or None (the grammar's
        own check, under the limits; ``trial`` follows it for a few tokens)."""
        message = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=self._llg_limits)
        return plain_error(message, self.limits) if message and not message.startswith("WARNING") else None

    def trial(self, grammar: str) -> str | None:
        """Why ``grammar`` cannot constrain this model's output, or None: ``problem``, then
        its first ``TRIAL_TOKENS`` masks, following the first allowed token that is not an
        end of sequence, each under the limits and the time budget. A regular expression
        that would build millions of lexer states breaks a limit here, in the gateway, and
        costs about the lexer fuel (tens of ms); a constraint that only breaks one deeper
        in the output is stopped by the worker (``masks``)."""
        problem = self.problem(grammar)
        if problem is not None:
            return problem
        m = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._llg_limits)
        if m.is_error():
            return plain_error(m.get_error(), self.limits)
        bits = np.zeros(self._words, dtype=np.int32)
        for _ in range(TRIAL_TOKENS):
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(bits.ctypes.data, self._words * 4)
            took = time.perf_counter() - t0
            if m.is_error():
                return plain_error(m.get_error(), self.limits)
            if took > self._budget_s:
                return self._too_slow(took)
            allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.vocab_size])
            nxt = next((int(t) for t in allowed if int(t) not in self._eos), None)
            if nxt is None or m.is_stopped():
                return None
            if not m.consume_token(nxt):
                return plain_error(m.get_error(), self.limits) if m.is_error() else None
        return None

    def _too_slow(self, took_s: float) -> str:
        return (f"{COSTLY}: one token's check took {took_s * 1000:.0f} ms; the "
                f"limit is {self.limits.mask_budget_ms:g} ms (SF_GRAMMAR_MASK_BUDGET_MS)")

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A new matcher for one sequence: a copy of the grammar's cached pristine matcher,
        compiled (and its first mask built) on a miss, the cache then trimmed to
        ``limits.cache_mb`` by the memory that compile allocated.

        Raises:
            ValueError: the grammar does not compile or breaks a limit on its first mask
                (the message says why, in the project's words).
        """
        entry = self._pristine.get(grammar)
        if entry is not None:
            self._pristine.move_to_end(grammar)
            copy: llguidance.LLMatcher = entry[0].deep_copy()
            return copy
        before = _heap_bytes() if _heap_bytes is not None else 0
        m = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._llg_limits)
        if m.is_error():
            raise ValueError(plain_error(m.get_error(), self.limits))
        bits = np.zeros(self._words, dtype=np.int32)
        t0 = time.perf_counter()
        m.unsafe_compute_mask_ptr(bits.ctypes.data, self._words * 4)  # builds the lexer the copies share
        took = time.perf_counter() - t0
        if m.is_error():
            raise ValueError(plain_error(m.get_error(), self.limits))
        if took > self._budget_s:
            raise ValueError(self._too_slow(took))
        if _heap_bytes is not None:
            charge = max(MIN_GRAMMAR_CHARGE, _heap_bytes() - before)
        else:  # no allocator statistics: the most the limits let a grammar's lexer take (~1 KiB a state)
            charge = max(MIN_GRAMMAR_CHARGE, self.limits.lexer_states * 1024)
        self._pristine[grammar] = (m, charge)
        self.cached_bytes += charge
        budget = self.limits.cache_mb * (1 << 20)
        while self.cached_bytes > budget and len(self._pristine) > 1:
            _, (_, freed) = self._pristine.popitem(last=False)
            self.cached_bytes -= freed
        fresh: llguidance.LLMatcher = m.deep_copy()
        return fresh

    def forget(self, grammar: str) -> None:
        """Drop a grammar's pristine matcher (a sequence of it broke a limit: the lexer it
        built is not worth keeping)."""
        entry = self._pristine.pop(grammar, None)
        if entry is not None:
            self.cached_bytes -= entry[1]

    def masks(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """The allowed next tokens of each matcher: bool ``[len(matchers), vocab_size]``,
        computed in parallel by llguidance's executor."""
        return self.step_masks(matchers)[0]

    def step_masks(self, matchers: list[llguidance.LLMatcher]) -> tuple[np.ndarray, dict[int, str]]:
        """``masks``, and the matchers that must end (index -> why, in the project's words):
        those that broke a limit of llguidance's, and those whose mask took longer than
        ``limits.mask_budget_ms``. The executor computes the batch's masks in one call;
        when that call breaks the budget with several matchers, the next call computes
        them one at a time, timed, to find the one to blame."""
        if self._executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = self._llg.LLExecutor()
        t0 = time.perf_counter()
        n = len(matchers)
        bits = np.zeros((n, self._words), dtype=np.int32)
        ended: dict[int, str] = {}
        if self._probe or n == 1:
            self._probe = False
            for i, m in enumerate(matchers):
                t1 = time.perf_counter()
                m.unsafe_compute_mask_ptr(bits[i].ctypes.data, self._words * 4)
                took = time.perf_counter() - t1
                if took > self._budget_s:
                    ended[i] = self._too_slow(took)
        else:
            self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.ctypes.data,
                                                   self._words * 4, n)
            if time.perf_counter() - t0 > self._budget_s:
                self._probe = True
        for i, m in enumerate(matchers):
            if m.is_error():
                ended[i] = plain_error(m.get_error(), self.limits)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size].astype(bool)
        self.last_masks_s = time.perf_counter() - t0
        return allowed, ended
