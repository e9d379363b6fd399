"""``streamfleet engines import`` reads what it used to ignore (README: "Engines"): the
attention settings the engines do not apply cap the context where that is exact (a
window of local attention equals full attention within the window) or are refused by
name, every architecture's context key is read, and the chat template is taken where
current exports keep it (``chat_template.jinja``), or its absence is said at import, in
``/v1/models`` and to a chat request. Exports are made on the fly from the committed
fixtures (tests/support/exports.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import orjson
import pytest

from streamfleet.gateway.admission.validation import Validator
from streamfleet.modelimport import import_export, inspect_export
from streamfleet.shared.errors import FatalError, ValidationError
from streamfleet.shared.modelrepo import ModelRepository, chat_template_source, folder_chat_template, load_tokenizer
from streamfleet.shared.settings import GatewaySettings
from tests.support.exports import DROP, copy_export, edit_json

#: a template that spells out only special tokens the llama fixture's tokenizer has
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")
CHAT = [{"role": "user", "content": "Hi"}]


def _context(tmp_path, arch="llama", max_context=None, **config):
    found = inspect_export(copy_export(arch, tmp_path / "export", **config), max_context=max_context)
    return found.max_context, found.context_note


# -- attention settings the engines do not apply ---------------------------------------

def test_gpt_neo_local_layers_cap_the_context_at_their_window(tmp_path):
    src = copy_export("gpt2", tmp_path / "neo", model_type="gpt_neo", attention_types=[[["global", "local"], 1]],
                      attention_layers=["global", "local"], window_size=64)
    dest, found = import_export(src, tmp_path / "engines", "neo", max_context=200)
    assert found.max_context == 64  # below the model's 256 and the operator's 200
    assert "window_size 64" in found.context_note and "local attention" in found.context_note
    assert ModelRepository(tmp_path / "engines").get("neo").max_context == 64
    assert "window_size 64 of the local attention layers" in (dest / "engine.toml").read_text()


def test_gpt_neo_global_only_is_not_capped(tmp_path):
    assert _context(tmp_path, "gpt2", model_type="gpt_neo", attention_types=[[["global"], 2]],
                    attention_layers=["global", "global"], window_size=64) == (256, "n_positions")


@pytest.mark.parametrize("key", ["max_seq_len", "max_sequence_length", "seq_length", "n_ctx"])
def test_each_architectures_context_key_is_read(tmp_path, key):
    """MPT's max_seq_len and the other spellings: the model's context, not a made-up 2048."""
    got = _context(tmp_path, "gpt2", **{"n_positions": DROP, "n_ctx": DROP, key: 128})
    assert got == (128, key)


def test_mpt_max_seq_len_and_its_window(tmp_path):
    mpt = dict(model_type="mpt", n_positions=DROP, n_ctx=DROP, max_seq_len=128)
    assert _context(tmp_path / "a", "gpt2", attn_config={"alibi": True, "sliding_window_size": -1},
                    **mpt) == (128, "max_seq_len")
    ctx, note = _context(tmp_path / "b", "gpt2", attn_config={"alibi": True, "sliding_window_size": 32}, **mpt)
    assert ctx == 32 and note.startswith("attn_config.sliding_window_size 32")


@pytest.mark.parametrize("config,want", [
    (dict(sliding_window=64), (64, "sliding_window 64")),
    # Qwen2/Qwen3 declare a window they only use with use_sliding_window
    (dict(sliding_window=64, use_sliding_window=False), (256, "max_position_embeddings")),
    (dict(sliding_window=100, layer_types=["sliding_attention", "full_attention"]), (100, "sliding_window 100")),
    (dict(sliding_window=64, layer_types=["full_attention", "full_attention"], use_sliding_window=False),
     (256, "max_position_embeddings")),
    (dict(interleaved_sliding_window=48), (48, "interleaved_sliding_window 48")),
    (dict(attention_chunk_size=32), (32, "attention_chunk_size 32")),
    (dict(layer_types=["chunked_attention", "full_attention"], attention_chunk_size=40),
     (40, "attention_chunk_size 40")),
    # a rotation that changes past original_max_position_embeddings: capped there
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                        "original_max_position_embeddings": 128}), (128, "rope_scaling longrope")),
    (dict(original_max_position_embeddings=96, rope_scaling={"type": "su", "short_factor": [1.0] * 8,
                                                               "long_factor": [2.0] * 8}), (96, "rope_scaling su")),
    # ... or past max_position_embeddings, which is the context anyway
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), (256, "max_position_embeddings")),
    # the position alone: exact at every length
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), (256, "max_position_embeddings")),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
     (256, "max_position_embeddings")),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 8.0}}),
     (256, "max_position_embeddings")),
    (dict(use_bidirectional_attention=False), (256, "max_position_embeddings")),
])
def test_attention_settings_cap_the_context_where_that_is_exact(tmp_path, config, want):
    ctx, note = _context(tmp_path, **config)
    assert ctx == want[0] and note.startswith(want[1]), (ctx, note)


def test_the_operator_cannot_lift_a_window_cap(tmp_path):
    ctx, note = _context(tmp_path, max_context=1024, max_position_embeddings=DROP, sliding_window=64)
    assert ctx == 64 and note.startswith("sliding_window 64")


@pytest.mark.parametrize("config,named", [
    (dict(layer_types=["linear_attention", "full_attention"]), "layer_types linear_attention"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=DROP),
     "layer_types sliding_attention has no sliding_window"),
    (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types chunked_attention"),
    (dict(attention_layers=["local", "global"]), "attention_layers local has no window_size"),
    (dict(rope_scaling={"rope_type": "mrope", "mrope_section": [2, 2, 4]}), "rope_scaling type 'mrope'"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "odd"}}),
     "rope_parameters type 'odd'"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}),
     "rope_scaling type 'longrope' names no length"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(attn_config={"prefix_lm": True}), "attn_config.prefix_lm"),
    (dict(attn_config={"rope": True}), "attn_config.rope"),
    (dict(model_type="mpt", attn_config={"alibi": False}), "attn_config.alibi false"),
])
def test_a_setting_no_cap_makes_exact_is_refused_by_name(tmp_path, config, named):
    with pytest.raises(FatalError) as e:
        _context(tmp_path, **config)
    assert named in str(e.value) and "config.json" in str(e.value)
    assert not (tmp_path / "engines").exists()


def test_the_committed_fixtures_keep_their_context(tmp_path):
    """Mistral's and Gemma 3's 4096-token windows are wider than their context; Qwen's
    layer_types say full attention everywhere."""
    for arch in ("mistral", "gemma3", "qwen2", "qwen3", "phi3", "gpt2"):
        ctx, note = _context(tmp_path / arch, arch)
        assert ctx == 256 and note in ("max_position_embeddings", "n_positions"), (arch, note)


# -- the chat template ---------------------------------------------------------------------

def _validator(root, model):
    return Validator(GatewaySettings(models=model, default_model=model), ModelRepository(root))


def test_the_template_is_read_from_chat_template_jinja(tmp_path):
    src = copy_export("llama", tmp_path / "export")
    (src / "chat_template.jinja").write_text(TEMPLATE)
    edit_json(src / "tokenizer_config.json", chat_template="{{ 'older, and overridden' }}")
    found = inspect_export(src)
    assert found.chat_template_from == "chat_template.jinja"
    assert "chat template chat_template.jinja" in found.describe()
    dest, _ = import_export(src, tmp_path / "engines", "templ")
    assert (dest / "chat_template.jinja").read_text() == TEMPLATE
    spec = ModelRepository(tmp_path / "engines").get("templ")
    assert chat_template_source(spec) == "chat_template.jinja"
    assert load_tokenizer(spec).chat_template == TEMPLATE
    v = _validator(tmp_path / "engines", "templ").generate({"id": "a", "messages": CHAT})
    assert v.prompt_text == "<s>user: Hi</s><s>assistant: "


def test_the_template_file_is_used_without_tokenizer_config(tmp_path):
    """transformers reads chat_template.jinja only when it loads the tokenizer from its
    folder (with tokenizer_config.json); the fleet reads it in any case."""
    src = copy_export("llama", tmp_path / "export")
    (src / "chat_template.jinja").write_text(TEMPLATE)
    (src / "tokenizer_config.json").unlink()
    import_export(src, tmp_path / "engines", "bare")
    spec = ModelRepository(tmp_path / "engines").get("bare")
    assert load_tokenizer(spec).chat_template == TEMPLATE


def test_a_processors_chat_template_json_is_read(tmp_path):
    src = copy_export("llama", tmp_path / "export")
    (src / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert folder_chat_template(src) == (TEMPLATE, "chat_template.json")
    dest, found = import_export(src, tmp_path / "engines", "proc")
    assert found.chat_template_from == "chat_template.json" and (dest / "chat_template.json").is_file()
    assert load_tokenizer(ModelRepository(tmp_path / "engines").get("proc")).chat_template == TEMPLATE


def test_a_model_without_a_template_says_so_and_serves_no_chat(tmp_path):
    dest, found = import_export(copy_export("llama", tmp_path / "export"), tmp_path / "engines", "plain")
    assert found.chat_template_from == ""
    assert "chat template none: chat requests are refused" in found.describe()
    assert "the model has no chat template" in (dest / "engine.toml").read_text()
    validator = _validator(tmp_path / "engines", "plain")
    assert validator.chat_template(validator.spec("plain")) is None
    with pytest.raises(ValidationError) as e:
        validator.generate({"id": "a", "messages": CHAT})
    assert (e.value.code, e.value.param, e.value.status) == ("invalid_request", "messages", 400)
    assert "model 'plain' cannot serve chat: it has no chat template" in e.value.message
    assert validator.generate({"id": "b", "prompt": "Hi"}).prompt_text == "Hi"  # completions still work


def test_engine_toml_overrides_the_folder(tmp_path):
    src = copy_export("llama", tmp_path / "export")
    (src / "chat_template.jinja").write_text(TEMPLATE)
    dest, _ = import_export(src, tmp_path / "engines", "over")
    toml = (dest / "engine.toml").read_text()
    own = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    (dest / "engine.toml").write_text(toml + f"chat_template = {json.dumps(own)}\n")
    spec = ModelRepository(tmp_path / "engines").get("over")
    assert chat_template_source(spec) == "engine.toml" and load_tokenizer(spec).chat_template == own
    (dest / "engine.toml").write_text(toml + 'chat_template = "builtin"\n')
    validator = _validator(tmp_path / "engines", "over")
    spec = validator.spec("over")
    assert chat_template_source(spec) == "builtin" and load_tokenizer(spec).chat_template is None
    assert validator.generate({"id": "a", "messages": CHAT}).prompt_text == "<|user|>\nHi\n<|assistant|>\n"
    (dest / "engine.toml").write_text(toml + "chat_template = 3\n")
    with pytest.raises(FatalError, match="chat_template must be a string"):
        ModelRepository(tmp_path / "engines").get("over")


def test_a_forced_reimport_drops_the_old_template(tmp_path):
    src = copy_export("llama", tmp_path / "export")
    (src / "chat_template.jinja").write_text(TEMPLATE)
    import_export(src, tmp_path / "engines", "m")
    (src / "chat_template.jinja").unlink()
    dest, found = import_export(src, tmp_path / "engines", "m", force=True)
    assert not (dest / "chat_template.jinja").exists() and found.chat_template_from == ""
    assert chat_template_source(ModelRepository(tmp_path / "engines").get("m")) is None


def test_the_demo_model_chats_in_the_builtin_format_by_its_own_choice(tiny_spec):
    assert tiny_spec.chat_template == "builtin" and chat_template_source(tiny_spec) == "builtin"


async def test_v1_models_says_where_each_template_comes_from(tmp_path):
    from streamfleet.gateway.doors.openai import models
    from streamfleet.shared.schema import Heartbeat

    src = copy_export("llama", tmp_path / "export")
    import_export(src, tmp_path / "engines", "plain")
    (src / "chat_template.jinja").write_text(TEMPLATE)
    import_export(src, tmp_path / "engines", "templ")

    async def authenticate(_header):
        return None

    async def served_workers():  # heartbeats that name no execution mode
        return [("plain", [Heartbeat(heartbeat=1.0)]), ("templ", [Heartbeat(heartbeat=1.0)] * 2)]

    hub = SimpleNamespace(admission=SimpleNamespace(authenticate=authenticate), served_workers=served_workers,
                          validator=Validator(GatewaySettings(default_model="templ"),
                                              ModelRepository(tmp_path / "engines")))
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(hub=hub)), headers={})
    body = orjson.loads((await models(request)).body)
    assert body["object"] == "list"
    # created: when the model's folder was last written, as OpenAI's is when the model was made
    created = {name: int((tmp_path / "engines" / name).stat().st_mtime) for name in ("plain", "templ")}
    assert body["data"] == [
        {"id": "plain", "object": "model", "created": created["plain"], "owned_by": "streamfleet", "workers": 1,
         "kind": "text", "chat_template": None, "default": False, "execution": None},
        {"id": "templ", "object": "model", "created": created["templ"], "owned_by": "streamfleet", "workers": 2,
         "kind": "text", "chat_template": "chat_template.jinja", "default": True, "execution": None},
    ]
    assert min(created.values()) > 1_600_000_000
