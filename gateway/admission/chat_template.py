"""The prompt text a model sees for a conversation, and the token ids it encodes to.

``render_chat`` renders a chat request's messages (and the tools it offers) with the
model's own chat template, or with the fleet's builtin format (``DEFAULT_CHAT_TEMPLATE``)
for a model whose ``engine.toml`` chooses it; ``template_problem`` says when a
template cannot be trusted with the model's tokenizer; ``encode_prompt`` turns the
text into the ids the model was trained to see. The gateway's ``Validator``
(gateway/admission/validation.py) checks a model's template before admission (``check``) and
renders and tokenizes an admitted request's prompt (``finish``); where a model's
template comes from is ``shared.modelrepo.chat_template_source``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

from streamfleet.gateway.admission.tools import Tools, call_text, tools_prompt

__all__ = ["DEFAULT_CHAT_TEMPLATE", "PromptTokenizer", "encode_prompt", "render_chat", "template_problem"]


class PromptTokenizer(Protocol):
    """What the gateway asks of a model's tokenizer (``shared.modelrepo.load_tokenizer``'s, a
    transformers ``PreTrainedTokenizerFast``): its ids for a text, a text for ids, its
    vocabulary's size and its chat template rendered. ``backend_tokenizer`` (the Rust
    tokenizer) and ``chat_template`` are read with ``getattr``: a tokenizer may lack them."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def __call__(self, text: str, *, add_special_tokens: bool = ..., return_offsets_mapping: bool = ...) -> Any:
        """a transformers ``BatchEncoding`` (``input_ids``, ``offset_mapping``)"""

    def __len__(self) -> int: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, tokenize: bool,
                            add_generation_prompt: bool, **kwargs: Any) -> str | list[int]: ...


DEFAULT_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
"""The fleet's generic chat format, for models whose ``engine.toml`` says
``chat_template = "builtin"`` (the demo model): each message as
``<|role|>\\ncontent\\n``, then ``<|assistant|>\\n`` to prompt the reply. A model with
no chat template and no such line is served no chat requests (``Validator.check``): the fleet
does not make up a format the model was never trained on."""


def encode_prompt(tokenizer: PromptTokenizer, text: str, special_tokens: bool = True) -> list[int]:
    """The prompt's token ids, with the special tokens the tokenizer's own post-processor
    adds (a BOS for Llama-style tokenizers, none for GPT-2's): what the model was trained
    to see. ``special_tokens=False`` for text a chat template rendered, which carries its
    own. A ``PreTrainedTokenizerFast`` is asked through its Rust tokenizer directly: the
    same ids without the ``BatchEncoding`` that ``tokenizer.encode`` builds per call, since
    this runs on the gateway's event loop."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        ids: list[int] = backend.encode(text, add_special_tokens=special_tokens).ids
        return ids
    # a tokenizer.json that configures truncation or padding: let transformers switch them off
    return tokenizer.encode(text, add_special_tokens=special_tokens)


#: a special token spelled out in a chat template: <|im_start|>, <start_of_turn>, </s>, [INST]
_TEMPLATE_TOKEN = re.compile(r"<\|[^|<>\s]{1,40}\|>|</?[A-Za-z][\w.-]{0,39}>|\[/?[A-Z][A-Z_]{1,20}\]")


def template_problem(tokenizer: PromptTokenizer) -> str | None:
    """Why the tokenizer's chat template cannot be trusted, or None: a special token it
    spells out (``<|im_start|>``…) that the tokenizer does not have as one token would be
    split into pieces, and the model would see a conversation it was never trained on."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    missing = []
    for text in dict.fromkeys(_TEMPLATE_TOKEN.findall(template)):
        ids = encode_prompt(tokenizer, text, special_tokens=False)
        if len(ids) != 1:
            missing.append(text)
    if missing:
        return (f"its chat template uses {', '.join(missing)}, which the tokenizer does not have as single "
                f"tokens")
    return None


#: a chat template that takes the offered tools (``tools``), and one that writes an assistant
#: turn's earlier calls (``message.tool_calls``)
_TAKES_TOOLS = re.compile(r"\btools\b")
_TAKES_CALLS = re.compile(r"\btool_calls\b")


def _template_text(template: str | dict[str, object]) -> str:
    """A tokenizer's chat template as one text (transformers allows several, by name)."""
    return "\n".join(v for v in template.values() if isinstance(v, str)) if isinstance(template, dict) else template


def _generic_tools(messages: list[dict[str, Any]], tools: Tools | None, offer: bool,
                   calls: bool) -> list[dict[str, Any]]:
    """The messages with the tools offered in the first system message (``offer``) and
    earlier calls written into the assistant's turn (``calls``), as the fleet's generic
    format writes them (gateway/admission/tools.py), for a template that has no place for them."""
    out = [{**m, "content": m["content"] + "".join(call_text(c["function"]["name"], c["function"]["arguments"])
                                                   for c in m["tool_calls"])} if calls and m.get("tool_calls") else m
           for m in messages]
    if offer and tools is not None:
        text = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render_chat(messages: list[dict[str, Any]], tokenizer: PromptTokenizer, tools: Tools | None = None) -> str:
    """The prompt of a conversation: the tokenizer's chat template (given the offered
    tools, as templates that know tools take them), or the builtin format
    (``DEFAULT_CHAT_TEMPLATE``; the caller checks the model chooses it), where the tools
    are offered in a system message first and earlier calls are written as the model is
    asked to write them (gateway/admission/tools.py). A template that has no place for the tools
    or for earlier calls (SmolLM2's) gets them the builtin format's way, in the messages:
    it would drop them without a word."""
    offered = tools is not None and tools.mode != "none"
    template = getattr(tokenizer, "chat_template", None)
    if template:
        text = _template_text(template)
        takes_tools = bool(_TAKES_TOOLS.search(text))
        extra = {"tools": [{"type": "function", "function": f} for f in tools.functions]} \
            if tools is not None and offered and takes_tools else {}
        messages = _generic_tools(messages, tools, offered and not takes_tools, not _TAKES_CALLS.search(text))
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        assert isinstance(rendered, str)  # tokenize=False: the rendered text
        return rendered
    parts = [DEFAULT_CHAT_TEMPLATE.format(role="system", content=tools_prompt(tools))] \
        if tools is not None and offered else []
    for m in messages:
        content = m["content"] + "".join(call_text(c["function"]["name"], c["function"]["arguments"])
                                         for c in m.get("tool_calls", ()))
        parts.append(DEFAULT_CHAT_TEMPLATE.format(role=m["role"], content=content))
    return "".join(parts) + "<|assistant|>\n"
