"""Tool calls (OpenAI's ``tools`` / ``tool_choice``): what a request offers, the prompt
that tells the model, the constraint that forces a call, and the calls read back out of
the completion (docs/tools.md).

A call is generated as one compact JSON object, ``{"name":"<tool>","arguments":{…}}``.
When a call is forced (``tool_choice: "required"`` or a named function) the output is
constrained to exactly that shape, with the arguments constrained to the tool's
``parameters`` schema (structured outputs, shared/grammar.py), so the arguments always
validate; ``"required"`` with ``parallel_tool_calls`` (the default) constrains it to a
JSON array of one to ``MAX_CALLS`` such calls instead. With ``"auto"`` the model writes
what it likes; a completion that is one or several calls of offered tools (one object,
bare or inside ``<tool_call>…</tool_call>``, an array of them, or several tagged calls) is
read back as its calls (``parse_calls``; only the first without ``parallel_tool_calls``),
anything else is text. ``CallStream`` turns the streamed text of a call, or of an array of
calls, into OpenAI's ``tool_calls`` deltas: each call's name once it is known, then its
arguments as they grow.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from streamfleet.shared.errors import ErrorCode, ValidationError

__all__ = ["Tools", "parse_tools", "tools_prompt", "parse_calls", "call_id", "CallStream", "MAX_TOOLS",
           "MAX_CALLS"]

#: OpenAI's rule for function names
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
#: most calls a forced reply of several calls holds (``Tools.call_schema``'s ``maxItems``)
MAX_CALLS = 8
_TAGGED = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>\s*", re.DOTALL)
#: several tagged calls with only whitespace around and between them
_TAGGED_MANY = re.compile(r"(?:\s*<tool_call>(?:(?!</tool_call>).)*</tool_call>)+\s*", re.DOTALL)
_TAG_BODY = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
#: the start of a call as the constraint writes it (``Tools.call_schema``, compact JSON)
_CALL_HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]{1,64})","arguments":')


@dataclass(frozen=True, slots=True)
class Tools:
    """What a request offers: ``mode`` is ``none`` (no call), ``auto`` (the model may
    call) or ``forced`` (it must call one of ``choices``). ``parallel``: a reply may hold
    several calls (``parallel_tool_calls``, true unless the request says false; a named
    ``tool_choice`` forces exactly one call, so it is false there)."""

    mode: str
    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"}
    choices: tuple[str, ...]  # the names a forced call may use
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.functions)

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        """The calls a finished completion holds (``parse_calls``), only the first
        without ``parallel``; None when it is not calls."""
        calls = parse_calls(text, self.names)
        return calls if calls is None or self.parallel else calls[:1]

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema a forced call's output meets: one call object, or with
        ``parallel`` an array of one to ``MAX_CALLS`` of them.

        Each tool's ``parameters`` is a schema document of its own, whose local references
        (``#/$defs/Addr``, ``#``) point into itself. Wrapped in the call's shape it would no
        longer be the root, so it goes under the root's ``$defs`` (``call_<name>``), the
        call's ``arguments`` refer to it there, and its local references are re-rooted."""
        by_name = {f["name"]: f for f in self.functions}
        defs = {f"call_{n}": _rerooted(by_name[n]["parameters"], f"#/$defs/call_{n}") for n in self.choices}
        shapes = [{"type": "object", "properties": {"name": {"const": n}, "arguments": {"$ref": f"#/$defs/call_{n}"}},
                   "required": ["name", "arguments"], "additionalProperties": False} for n in self.choices]
        root: dict[str, Any] = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
        if self.parallel:
            root = {"type": "array", "items": root, "minItems": 1, "maxItems": MAX_CALLS}
        return {**root, "$defs": defs}


#: keywords whose values are data, not schemas: a "$ref" inside them is not a reference
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rerooted(node: Any, base: str) -> Any:
    """``node`` with every local ``$ref`` (``#`` and ``#/...``) moved under ``base``
    (the request's fields were bounded to ``SF_GRAMMAR_MAX_DEPTH`` levels before anything
    walks them, ``Validator.check``, so the recursion is bounded too)."""
    if isinstance(node, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else v if k in _DATA_KEYWORDS else _rerooted(v, base)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rerooted(x, base) for x in node]
    return node


def _bad(message: str, param: str, code: ErrorCode = ErrorCode.invalid_request) -> ValidationError:
    return ValidationError(message, code=code, param=param)


def parse_tools(p: dict[str, Any]) -> Tools | None:
    """The tools ``p`` offers (None: none, or ``tool_choice: "none"`` with none).

    Raises:
        ValidationError: malformed ``tools`` or ``tool_choice``, naming which.
    """
    tools, choice, parallel = p.get("tools"), p.get("tool_choice"), p.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", ErrorCode.invalid_type)
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools", ErrorCode.invalid_type)
    functions: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{…}}}}", "tools")
        name, params = f.get("name"), f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise _bad(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'", "tools")
        if any(g["name"] == name for g in functions):
            raise _bad(f"tools[{i}]: a second tool named {name!r}", "tools")
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        description = f.get("description") or ""
        if not isinstance(description, str):
            raise _bad(f"tools[{i}].function.description must be a string", "tools")
        functions.append({"name": name, "description": description, "parameters": params})
    names: tuple[str, ...] = tuple(f["name"] for f in functions)
    if choice is None or choice == "auto":
        return Tools("auto", tuple(functions), names, parallel)
    if choice == "none":
        return Tools("none", tuple(functions), (), parallel)
    if choice == "required":
        return Tools("forced", tuple(functions), names, parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise _bad(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
        return Tools("forced", tuple(functions), (name,), False)
    raise _bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
               "\"function\": {\"name\": …}}", "tool_choice")


def tools_prompt(tools: Tools) -> str:
    """The system text that offers the tools to a model whose chat template has no place
    for them: one line per tool (its name, parameters and description), then the format
    ``parse_calls`` reads back. Short, because such models are small."""
    lines = []
    for f in tools.functions:
        props = f["parameters"].get("properties")
        params = ", ".join(props) if isinstance(props, dict) else ""
        lines.append(f"{f['name']}({params})" + (f": {f['description']}" if f["description"] else ""))
    return ("Tools:\n" + "\n".join(lines) + "\nTo call one, answer "
            "<tool_call>{\"name\": …, \"arguments\": {…}}</tool_call>")


def call_text(name: str, arguments: str) -> str:
    """How an earlier call appears in the history given to a template without tools."""
    return f"<tool_call>{{\"name\":\"{name}\",\"arguments\":{arguments}}}</tool_call>"


def call_id(request_id: str, choice: int = 0, k: int = 0) -> str:
    """The id of call ``k`` of choice ``choice`` of a request: ``call_<id>`` for the first
    call of the first choice, ``call_<id>_<choice>`` for the first of another, and
    ``call_<id>_<choice>_<k>`` for a later call (never one of the others)."""
    base = f"call_{request_id[:24]}"
    if k:
        return f"{base}_{choice}_{k}"
    return base if choice == 0 else f"{base}_{choice}"


def parse_calls(text: str, names: frozenset[str]) -> list[tuple[str, str]] | None:
    """The calls of offered tools a completion is, in order (``[(name, arguments
    JSON)]``, as ``_one_call`` reads each), or None when it is not calls: one call
    object (bare or inside ``<tool_call>…</tool_call>``), a JSON array of one or more
    call objects (bare or tagged), or several tagged calls with only whitespace between
    them."""
    m = _TAGGED.fullmatch(text)
    if m is not None and "<tool_call>" not in m.group(1):
        body = m.group(1)
    elif _TAGGED_MANY.fullmatch(text):
        calls = [_one_call(b, names) for b in _TAG_BODY.findall(text)]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
    else:
        body = text.strip()
    if body.startswith("["):
        items = _array_items(body)
        if not items:
            return None
        calls = [_one_call(item, names) for item in items]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
    call = _one_call(body, names)
    return None if call is None else [call]


def _array_items(text: str) -> list[str] | None:
    """The texts of the elements of the JSON array ``text`` (surrounding whitespace
    off), or None when it is not one whole array. Only the structure is read (depth and
    strings); each element is parsed on its own."""
    scan = _Scan()
    items, start = [], 1
    for i, ch in enumerate(text):
        depth, in_string = scan.depth, scan.in_string
        scan.step(ch)
        if i == 0:
            continue
        if in_string or depth != 1:
            if scan.depth == 0 and i != len(text) - 1:
                return None  # the array closed before the end
            continue
        if ch in ",]":
            items.append(text[start:i].strip())
            start = i + 1
            if ch == "]" and i != len(text) - 1:
                return None
    if scan.depth != 0 or scan.in_string or not text.endswith("]") or any(not x for x in items):
        return None
    return items


def _one_call(body: str, names: frozenset[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one call object's text, of an offered tool, or None.

    The arguments are the model's own text where the call has the constrained shape
    (what a stream gave out, byte for byte); otherwise they are re-serialised compactly
    with the standard library, which keeps integers of any size exact (orjson would turn
    one past 64 bits into a float)."""
    if not body.startswith("{"):
        return None
    head = _CALL_HEAD.match(body)
    if head is not None and head.group(1) in names and body.endswith("}"):
        raw = body[head.end():-1]
        try:
            if isinstance(json.loads(raw), dict):
                return head.group(1), raw
        except ValueError:
            pass
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"} or obj["name"] not in names:
        return None
    args = obj["arguments"]
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, separators=(",", ":"), ensure_ascii=False)


class _Scan:
    """Where a JSON text's characters stand, one at a time: the depth of brackets and
    whether they are inside a string (a backslash escapes the next character)."""

    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


class CallStream:
    """The streamed text of a forced call, ``{"name":"<n>","arguments":<args>}`` as the
    constraint writes it (compact, in that order), or of an array of such calls
    (``[{…},{…}]``), as deltas: for each call in turn, ``("name", n)`` once its name is
    complete (the k-th name delta starts call k), then ``("arguments", piece)`` as its
    arguments grow. Where a call's arguments end is known from the JSON itself (their
    brackets and strings), so nothing is held back: the brace that closes the call is
    never given out, whatever follows it."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None  # the first call's name
        #: ``[name, arguments so far]`` of each call begun
        self.calls: list[list[str]] = []
        self._pos = 0  # characters of the text read
        self._state = "start"  # start, head, args, after, done
        self._array = False
        self._head = 0  # where the call being read starts
        self._scan = _Scan()

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.text += piece
        out: list[tuple[str, str]] = []
        text = self.text
        while self._pos < len(text):
            state = self._state
            if state == "start":
                ch = text[self._pos]
                if ch.isspace():
                    self._pos += 1
                elif ch == "[" and not self._array:
                    self._array = True
                    self._pos += 1
                elif ch == "{":
                    self._head, self._state = self._pos, "head"
                else:
                    self._state = "done"  # not a call: nothing more to give out
            elif state == "head":
                m = _CALL_HEAD.match(text, self._head)
                if m is None:
                    if not _could_be_head(text[self._head:]):
                        self._state = "done"
                    return out
                name = m.group(1)
                if self.name is None:
                    self.name = name
                self.calls.append([name, ""])
                out.append(("name", name))
                self._pos, self._state, self._scan = m.end(), "args", _Scan()
            elif state == "args":
                scan, start, end = self._scan, self._pos, len(text)
                i = start
                while i < end:
                    ch = text[i]
                    if not scan.in_string and scan.depth == 0 and ch == "}":
                        break  # the brace that closes the call
                    scan.step(ch)
                    i += 1
                if i > start:
                    self.calls[-1][1] += text[start:i]
                    out.append(("arguments", text[start:i]))
                self._pos = i
                if i == end:
                    return out
                self._pos += 1
                self._state = "after"
            elif state == "after":
                ch = text[self._pos]
                self._pos += 1
                if ch.isspace():
                    continue
                self._state = "start" if self._array and ch == "," else "done"
            else:
                self._pos = len(text)
        return out

    def finish(self, complete: bool) -> list[tuple[str, str]]:
        """What is left once the output ended (``complete``: it ended where its grammar
        did). Every piece of arguments read was given out by ``feed`` already; kept for
        the callers that ask."""
        return []


_HEAD_START = '{"name":"'


def _could_be_head(text: str) -> bool:
    """Whether ``text`` may still grow into a call's head (``_CALL_HEAD``)."""
    if len(text) <= len(_HEAD_START):
        return _HEAD_START.startswith(text)
    if not text.startswith(_HEAD_START):
        return False
    rest = text[len(_HEAD_START):]
    name = re.match(r"[A-Za-z0-9_-]{0,64}", rest)
    assert name is not None  # (it matches the empty string)
    return '","arguments":'.startswith(rest[name.end():])
