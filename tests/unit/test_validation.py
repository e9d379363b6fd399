"""The one validation path (gateway/admission/validation.py) with the real tiny-gpt tokenizer."""

from __future__ import annotations

import pytest

from streamfleet.gateway.admission.chat_template import render_chat
from streamfleet.gateway.admission.validation import Validator
from streamfleet.shared.errors import NotFoundError, ValidationError
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.settings import GatewaySettings


@pytest.fixture(scope="module")
def validator(tiny_spec):
    return Validator(GatewaySettings(), ModelRepository(tiny_spec.path.parent))


def test_defaults_and_task(validator):
    v = validator.generate({"id": "a", "prompt": "Once upon a time"})
    assert v.model == "tiny-gpt" and v.lane == "normal" and v.prompt_ids
    p = v.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop, p.ignore_eos) == (64, 1.0, 1.0, 0, [], False)
    assert 0 <= p.seed < 2**63  # drawn by the gateway, so a redelivery regenerates the same text
    task = v.to_task("conn", request_id="rid")
    assert task.reply_to == "conn" and task.request_id == "rid" and task.deadline > task.created_at
    assert task.trace_id


def test_explicit_fields(validator):
    v = validator.generate({"id": "a", "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.5,
                            "top_k": 3, "stop": "\n", "seed": 7, "priority": "high", "timeout": 2,
                            "ignore_eos": True, "future_field": [1, 2]})
    assert v.lane == "high" and v.params.stop == ["\n"] and v.params.seed == 7 and v.timeout_s == 2
    assert v.params.max_tokens == 5 and v.params.ignore_eos


@pytest.mark.parametrize("payload,code,param", [
    ({"prompt": "x"}, "missing_field", "id"),
    ({"id": 3, "prompt": "x"}, "invalid_type", "id"),
    ({"id": "a"}, "missing_field", "prompt"),
    ({"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "missing_field", "prompt"),
    ({"id": "a", "prompt": "x", "max_tokens": 0}, "out_of_range", "max_tokens"),
    ({"id": "a", "prompt": "x", "max_tokens": 1.5}, "invalid_type", "max_tokens"),
    ({"id": "a", "prompt": "x", "temperature": float("nan")}, "invalid_type", "temperature"),
    ({"id": "a", "prompt": "x", "top_p": 1.5}, "out_of_range", "top_p"),
    ({"id": "a", "prompt": "x", "stop": ["a"] * 5}, "out_of_range", "stop"),
    ({"id": "a", "prompt": "x", "stop": [""]}, "out_of_range", "stop"),
    ({"id": "a", "prompt": "x", "seed": True}, "invalid_type", "seed"),
    ({"id": "a", "prompt": "x", "ignore_eos": "yes"}, "invalid_type", "ignore_eos"),
    ({"id": "a", "prompt": "x", "priority": 1}, "invalid_type", "priority"),
    ({"id": "a", "messages": "hi"}, "invalid_type", "messages"),
    ({"id": "a", "messages": [{"role": "user", "content": 5}]}, "invalid_type", "messages"),
    ({"id": "a", "prompt": "word " * 1000}, "prompt_too_long", "prompt"),
])
def test_rules(validator, payload, code, param):
    with pytest.raises(ValidationError) as e:
        validator.generate(payload)
    assert e.value.code == code and e.value.param == param and e.value.message


def test_unknown_model(validator):
    with pytest.raises(NotFoundError) as e:
        validator.generate({"id": "a", "prompt": "x", "model": "gpt-5"})
    assert e.value.status == 404 and e.value.code == "unknown_model"


def test_chat_default_template(validator, tiny_spec):
    text = render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                       validator.tokenizer(tiny_spec))
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    v = validator.generate({"id": "a", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert v.prompt_text.endswith("<|assistant|>\n")


def test_prompt_encoding_matches_the_tokenizer(tiny_spec):
    """The gateway's fast path (the Rust tokenizer directly) gives exactly the ids of
    ``PreTrainedTokenizerFast.encode``, also for text that is not ASCII, and a tokenizer
    that configures truncation takes the slow path (which ignores it)."""
    from streamfleet.gateway.admission.chat_template import encode_prompt
    from streamfleet.shared.modelrepo import load_tokenizer

    tok = load_tokenizer(tiny_spec)
    for text in ("Once upon a time", "  spaced\n\nout\t", "héllo wörld", "日本語のテキスト", "emoji 🤖👍🏽 ok",
                 "a" * 3000):
        assert encode_prompt(tok, text) == tok.encode(text, add_special_tokens=False)

    class Truncating:
        backend_tokenizer = type("B", (), {"truncation": {"max_length": 4}, "padding": None})()

        def encode(self, text, add_special_tokens):
            return [len(text)]

    assert encode_prompt(Truncating(), "abcdefgh") == [8]


class _Templated:
    """A tokenizer with a chat template, rendered as transformers renders it (jinja2)."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, tools=None):
        import jinja2

        return jinja2.Template(self.chat_template).render(messages=messages, tools=tools,
                                                          add_generation_prompt=add_generation_prompt)


#: SmolLM2-135M-Instruct's ChatML template: no place for tools or for an assistant's calls
_CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
           "<|im_start|>system\nDefault.<|im_end|>\n{% endif %}"
           "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                              "parameters": {"type": "object", "properties": {"city": {}}}}}]


def test_a_template_without_tools_gets_them_in_the_messages():
    """A chat template that has no place for the offered tools (or an assistant's earlier
    calls) would drop them without a word: they are offered in the system message and the
    calls written into the assistant's turn, as the builtin format does."""
    from streamfleet.gateway.admission.tools import parse_tools, tools_prompt

    tok = _Templated(_CHATML)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    auto = parse_tools({"tools": _WEATHER})
    offer = tools_prompt(auto)
    assert render_chat(ask, tok, auto) == (f"<|im_start|>system\n{offer}<|im_end|>\n<|im_start|>user\nWeather in Paris?"
                                           f"<|im_end|>\n<|im_start|>assistant\n")
    # a system message of the client's keeps its text, the tools after it
    text = render_chat([{"role": "system", "content": "Be brief."}] + ask, tok, auto)
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{offer}<|im_end|>\n<|im_start|>user\n")
    # "none" offers nothing; an earlier call is written in the assistant's turn either way
    history = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"}]
    text = render_chat(history, tok, parse_tools({"tools": _WEATHER, "tool_choice": "none"}))
    assert "Tools:" not in text and text.startswith("<|im_start|>system\nDefault.")
    assert ('<|im_start|>assistant\n<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
            '<|im_end|>\n<|im_start|>tool\n18 C<|im_end|>\n') in text
    assert history[1]["content"] == ""  # the caller's messages are left as they were
    assert render_chat(ask, tok) == render_chat(ask, tok, parse_tools({"tools": _WEATHER, "tool_choice": "none"}))


def test_a_template_with_tools_takes_them_as_they_are():
    tok = _Templated("{% if tools %}[{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
                     "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                     "{% for c in m.tool_calls or [] %}<call {{ c.function.name }}>{% endfor %};{% endfor %}")
    from streamfleet.gateway.admission.tools import parse_tools

    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
    assert render_chat(history, tok, parse_tools({"tools": _WEATHER})) == \
        "[get_weather]user:hi;assistant:<call get_weather>;"


def test_an_explicit_max_tokens_that_does_not_fit_the_context_is_refused(validator, tiny_spec):
    """As OpenAI and vLLM answer: a completion cut to fit would look finished. Left out,
    max_tokens is the gateway's default and the worker stops at the context's end."""
    ctx = tiny_spec.max_context
    prompt_tokens = len(validator.generate({"id": "a", "prompt": "Once upon a time"}).prompt_ids)
    room = ctx - prompt_tokens
    assert validator.generate({"id": "a", "prompt": "Once upon a time", "max_tokens": room}).params.max_tokens == room
    with pytest.raises(ValidationError) as e:
        validator.generate({"id": "a", "prompt": "Once upon a time", "max_tokens": room + 1})
    assert (e.value.code, e.value.param) == ("prompt_too_long", "max_tokens")
    assert e.value.message == (f"model 'tiny-gpt' has a context of {ctx} tokens; this request asks for {ctx + 1}: "
                               f"{prompt_tokens} in the prompt and {room + 1} for the completion (max_tokens). "
                               f"Ask for at most {room}, or leave max_tokens out")
    long = validator.generate({"id": "a", "prompt": "Once upon a time " * 40})
    assert len(long.prompt_ids) + long.params.max_tokens > ctx  # the default: no refusal


def test_every_out_of_vocabulary_id_is_named_with_the_vocabulary_size(validator, tiny_spec):
    from streamfleet.shared.modelrepo import load_tokenizer

    vocab = len(load_tokenizer(tiny_spec))
    with pytest.raises(ValidationError) as e:
        validator.generate({"id": "a", "prompt": "hi", "logit_bias": {"5": 1, str(vocab): 2, "x": 1, "7": 3}})
    assert e.value.param == "logit_bias" and e.value.message == (
        f"'logit_bias' keys '{vocab}', 'x' are not token ids of model 'tiny-gpt', whose vocabulary size is "
        f"{vocab} (ids 0 to {vocab - 1})")
    with pytest.raises(ValidationError) as e:
        validator.generate({"id": "a", "prompt": "hi", "logit_bias": {"5": 1, "6": 500, "7": -101}})
    assert e.value.message == "'logit_bias' values for tokens 6, 7 must be numbers from -100 to 100"
    with pytest.raises(ValidationError) as e:
        validator.generate({"id": "a", "prompt": "hi", "stop_token_ids": [1, vocab, vocab + 5]})
    assert e.value.message == (f"'stop_token_ids' holds {vocab}, {vocab + 5}, not token ids of model 'tiny-gpt', "
                               f"whose vocabulary size is {vocab} (ids 0 to {vocab - 1})")
