"""Tool calls (OpenAI's ``tools`` / ``tool_choice``): what a request offers, the prompt
that tells the model, the constraint that forces a call, and the calls read back out of
the completion (docs/tools.md).

A call is generated as one compact JSON object, ``{"name":"<tool>","arguments":{…}}``.
When a call is forced (``tool_choice: "required"`` or a named function) the output is
constrained to exactly that shape, with the arguments constrained to the tool's
``parameters`` schema (structured outputs, shared/grammar.py), so the arguments always
validate. With ``"auto"`` the model writes what it likes; a completion that is such an
object naming an offered tool (bare, or inside ``<tool_call>…</tool_call>``) is a call,
anything else is text. ``CallStream`` turns the streamed text of a call into OpenAI's
``tool_calls`` deltas: the name once it is known, then the arguments as they grow.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from streamfleet.shared.errors import ErrorCode, ValidationError

__all__ = ["Tools", "parse_tools", "tools_prompt", "parse_call", "CallStream", "MAX_TOOLS"]

#: OpenAI's rule for function names
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
_TAGGED = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>\s*", re.S)
#: the start of a call as the constraint writes it (``Tools.call_schema``, compact JSON)
_CALL_HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]{1,64})","arguments":')


@dataclass(frozen=True, slots=True)
class Tools:
    """What a request offers: ``mode`` is ``none`` (no call), ``auto`` (the model may
    call) or ``forced`` (it must call one of ``choices``)."""

    mode: str
    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"}
    choices: tuple[str, ...]  # the names a forced call may use

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.functions)

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema a forced call's output meets.

        Each tool's ``parameters`` is a schema document of its own, whose local references
        (``#/$defs/Addr``, ``#``) point into itself. Wrapped in the call's shape it would no
        longer be the root, so it goes under the root's ``$defs`` (``call_<name>``), the
        call's ``arguments`` refer to it there, and its local references are re-rooted."""
        by_name = {f["name"]: f for f in self.functions}
        defs = {f"call_{n}": _rerooted(by_name[n]["parameters"], f"#/$defs/call_{n}") for n in self.choices}
        shapes = [{"type": "object", "properties": {"name": {"const": n}, "arguments": {"$ref": f"#/$defs/call_{n}"}},
                   "required": ["name", "arguments"], "additionalProperties": False} for n in self.choices]
        root = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
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
    tools, choice = p.get("tools"), p.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools", ErrorCode.invalid_type)
    functions = []
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
    names = tuple(f["name"] for f in functions)
    if choice is None or choice == "auto":
        return Tools("auto", tuple(functions), names)
    if choice == "none":
        return Tools("none", tuple(functions), ())
    if choice == "required":
        return Tools("forced", tuple(functions), names)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise _bad(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
        return Tools("forced", tuple(functions), (name,))
    raise _bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
               "\"function\": {\"name\": …}}", "tool_choice")


def tools_prompt(tools: Tools) -> str:
    """The system text that offers the tools to a model whose chat template has no place
    for them: one line per tool (its name, parameters and description), then the format
    ``parse_call`` reads back. Short, because such models are small."""
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


def parse_call(text: str, names: frozenset[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` when the completion is one call of an offered tool.

    The arguments are the model's own text where the call has the constrained shape
    (what a stream gave out, byte for byte); otherwise they are re-serialised compactly
    with the standard library, which keeps integers of any size exact (orjson would turn
    one past 64 bits into a float)."""
    m = _TAGGED.fullmatch(text)
    body = m.group(1) if m else text.strip()
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


class CallStream:
    """The streamed text of a forced call, ``{"name":"<n>","arguments":<args>}`` as the
    constraint writes it (compact, in that order), as deltas: ``("name", n)`` once the
    name is complete, then ``("arguments", piece)`` as the arguments grow (the closing
    brace of the call is held back until the end)."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self._sent = 0  # characters of the arguments already given out

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.text += piece
        out: list[tuple[str, str]] = []
        if self.name is None:
            m = _CALL_HEAD.match(self.text)
            if m is None:
                return out
            self.name = m.group(1)
            self._start = m.end()
            out.append(("name", self.name))
        args = self.text[self._start:]
        # everything but a possible closing brace of the call itself
        ready = len(args) - 1 if args.endswith("}") else len(args)
        if ready > self._sent:
            out.append(("arguments", args[self._sent:ready]))
            self._sent = ready
        return out

    def finish(self, complete: bool) -> list[tuple[str, str]]:
        """What is left once the output ended (``complete``: the call is whole, so its
        last character is the call's closing brace)."""
        if self.name is None:
            return []
        args = self.text[self._start:]
        end = len(args) - 1 if complete and args.endswith("}") else len(args)
        if end > self._sent:
            piece, self._sent = args[self._sent:end], end
            return [("arguments", piece)]
        return []
