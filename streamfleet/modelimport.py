"""``streamfleet engines import PATH``: turn a folder exported by
``optimum-cli export onnx --task text-generation-with-past`` into a model folder of the
repository (``engines/<name>/``), after checking everything the fleet relies on, and say
what was found (docs/models.md, "Your own model: an ONNX export").

Checked: the graph's layout (``past_key_values.N.key/value`` in, ``logits`` and
``present.N.*`` out, no input the engines cannot feed), its KV heads and head size
against ``config.json``, the KV cache dtype (fp32/fp16 on ONNX Runtime; bf16 only on
TensorRT), ``position_ids`` (without them the ONNX Runtime engine runs the model
unpadded and TensorRT refuses it), a merged decoder's ``use_cache_branch``, the
context length (``attention_limits``: the engines attend to the whole cache, so a
window of local attention caps the context where that is exact, and a setting no cap
makes exact is refused by name), the tokenizer (``tokenizer.json``; BOS as its
post-processor adds it), the chat template (``chat_template.jinja``, else
``tokenizer_config.json``'s; or none, said so) and every EOS id the folder declares.
Nothing is downloaded; the files are copied.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamfleet.shared.errors import FatalError
from streamfleet.shared.modelrepo import declared_eos, folder_chat_template, read_json

__all__ = ["Imported", "inspect_export", "import_export", "attention_limits", "GRAPH_NAMES", "CONTEXT_KEYS"]

#: graph files of an Optimum export, in order of preference
GRAPH_NAMES = ("model.onnx", "decoder_model_merged.onnx", "decoder_with_past_model.onnx")
#: files copied besides the graph (when present)
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
               "generation_config.json", "chat_template.jinja", "chat_template.json")
#: folders copied besides the graph (when present): transformers' named chat templates
_SIDE_FOLDERS = ("additional_chat_templates",)
#: where configs declare the context they were trained for, by architecture (Llama & co.,
#: GPT-2/GPT-J/CodeGen, MPT, others, ChatGLM/Qwen1, old GPT-2), the first one present wins
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length",
                "n_ctx")
#: rope_scaling types that compute every position's rotation from the position alone, so the
#: exported graph applies them exactly at every length
_STATIC_ROPE = ("default", "linear", "yarn", "llama3", "proportional")
#: layer_types the engines run: full attention, and windowed kinds within their window
_LAYER_TYPES = ("full_attention", "attention", "sliding_attention", "chunked_attention")
#: default context cap: the KV cache of every live sequence is sized by it
DEFAULT_MAX_CONTEXT = 4096


@dataclass
class Imported:
    """What an export holds, as checked."""

    source: Path
    graph: str
    architecture: str
    n_layer: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    vocab_size: int | None
    has_position_ids: bool
    merged: bool
    max_context: int
    context_note: str
    eos_token_ids: tuple[int, ...]
    eos_from: str
    adds_bos: bool
    backend: str
    options: dict[str, Any] = field(default_factory=dict)
    external_data: list[str] = field(default_factory=list)
    #: the file of the folder that holds the chat template ("" when it has none)
    chat_template_from: str = ""

    def describe(self) -> str:
        pos = ("yes" if self.has_position_ids else
               "no: positions follow cache columns, so ONNX Runtime runs it unpadded (batches of equal "
               "length only) and TensorRT refuses it")
        lines = [
            f"source        {self.source}",
            f"architecture  {self.architecture}",
            f"graph         {self.graph}{' (merged decoder: use_cache_branch is fed)' if self.merged else ''}",
            f"layers        {self.n_layer}, KV heads {self.kv_heads}, head size {self.head_dim}",
            f"KV cache      {self.kv_dtype}",
            f"vocabulary    {self.vocab_size or 'symbolic in the graph'}",
            f"position_ids  {pos}",
            f"context       {self.max_context} tokens ({self.context_note})",
            f"EOS ids       {list(self.eos_token_ids) or 'none declared: requests end at max_tokens'}"
            + (f" (from {self.eos_from})" if self.eos_from else ""),
            f"BOS           {'added by the tokenizer to every prompt' if self.adds_bos else 'none added'}",
            f"chat template {self.chat_template_from or _NO_TEMPLATE}",
            f"backend       {self.backend}",
        ]
        return "\n".join(lines)


#: what ``describe`` says of a model without a chat template
_NO_TEMPLATE = ("none: chat requests are refused (completions only); `chat_template` in engine.toml gives it "
                "one (a Jinja template, or \"builtin\": the fleet's generic <|role|> format)")

_WHOLE_CACHE = "the engines attend to the whole cache, which equals {} only within {}"


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _strings(value: object) -> list[str]:
    """Every string in a nest of lists (GPT-Neo's ``attention_types``: ``[[["global", "local"], 12]]``)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def attention_limits(config: dict[str, Any], where: Path | str = "config.json") -> list[tuple[int, str]]:
    """The context limits (tokens, why) within which the graph, run by engines that
    attend to the whole KV cache with the positions they feed, computes exactly what the
    model's attention settings in ``config.json`` say: a window of local attention
    (``sliding_window`` and ``layer_types``, GPT-Neo's ``window_size``, MPT's
    ``attn_config.sliding_window_size``, Llama 4's ``attention_chunk_size``) equals full
    attention while the sequence fits in it; a rotary scaling that changes with the
    sequence's length (``dynamic``, ``longrope``) is the model's own only below the
    length where it changes, since an export traces one branch.

    Raises:
        FatalError: a setting no limit makes exact, named.
    """

    def refuse(setting: str, why: str) -> FatalError:
        return FatalError(f"{where}: {setting} {why}, so the fleet cannot serve this model exactly")

    limits: list[tuple[int, str]] = []
    layer_types = _strings(config.get("layer_types"))
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise refuse(f"layer_types {', '.join(unknown)}",
                     "are layers the engines do not run (they run full attention, and sliding or chunked "
                     "attention within its window)")
    window = _positive(config.get("sliding_window"))
    if "sliding_attention" in layer_types and window is None:
        raise refuse("layer_types sliding_attention", "has no sliding_window")
    # Qwen2/Qwen3 declare a window they use only with use_sliding_window
    if window and (config.get("use_sliding_window") is not False or "sliding_attention" in layer_types):
        limits.append((window, f"sliding_window {window}: " + _WHOLE_CACHE.format("sliding-window attention",
                                                                                  "the window")))
    older = _positive(config.get("interleaved_sliding_window"))  # older Gemma 3 / Cohere2 configs
    if older:
        limits.append((older, f"interleaved_sliding_window {older}: " + _WHOLE_CACHE.format(
            "sliding-window attention", "the window")))
    # GPT-Neo: attention_types / attention_layers mix "global" and "local" layers of window_size
    if "local" in _strings(config.get("attention_layers")) + _strings(config.get("attention_types")):
        size = _positive(config.get("window_size"))
        if size is None:
            raise refuse("attention_layers local", "has no window_size")
        limits.append((size, f"window_size {size} of the local attention layers: " + _WHOLE_CACHE.format(
            "local attention", "the window")))
    chunk = _positive(config.get("attention_chunk_size"))
    if "chunked_attention" in layer_types and chunk is None:
        raise refuse("layer_types chunked_attention", "has no attention_chunk_size")
    if chunk:
        limits.append((chunk, f"attention_chunk_size {chunk}: " + _WHOLE_CACHE.format("chunked attention",
                                                                                     "the first chunk")))
    if config.get("use_bidirectional_attention") in (True, "all"):
        raise refuse("use_bidirectional_attention", "makes attention see later tokens; the engines decode causally")
    # MPT (llm-foundry's attn_config): transformers' MPT, which the export traced, applies
    # none of these; a window equals full attention within it
    raw_attn = config.get("attn_config")
    attn: dict[str, Any] = raw_attn if isinstance(raw_attn, dict) else {}
    if attn.get("prefix_lm"):
        raise refuse("attn_config.prefix_lm", "(attention both ways over the prompt) is in neither the export "
                     "nor the engines")
    if attn.get("rope"):
        raise refuse("attn_config.rope", "is not applied by transformers' MPT, which the export traced")
    if config.get("model_type") == "mpt" and attn.get("alibi") is False:
        raise refuse("attn_config.alibi false", "is not honoured by transformers' MPT (it always applies ALiBi), "
                     "which the export traced")
    mpt_window = _positive(attn.get("sliding_window_size"))
    if mpt_window:
        limits.append((mpt_window, f"attn_config.sliding_window_size {mpt_window}: " + _WHOLE_CACHE.format(
            "sliding-window attention", "the window")))
    # rotary scaling: rope_scaling (transformers 4), rope_parameters (5; per layer type for some)
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if not isinstance(value, dict) or not value:
            continue
        nested = "rope_type" not in value and "type" not in value and all(isinstance(v, dict) for v in value.values())
        for params in (value.values() if nested else [value]):
            kind = params.get("rope_type") or params.get("type") or "default"
            if kind in _STATIC_ROPE:
                continue
            if kind == "dynamic":
                length = _positive(config.get("max_position_embeddings"))
                why = ("past it the rotary base grows with the length, a branch the export traced as not "
                       "taken")
            elif kind in ("longrope", "su"):
                length = (_positive(params.get("original_max_position_embeddings"))
                          or _positive(config.get("original_max_position_embeddings")))
                why = "past it the model switches to its long factors, a branch exports may have traced as not taken"
            else:
                raise refuse(f"{key} type {kind!r}", "is not a rotary scaling the import knows to depend on the "
                             "position alone")
            if length is None:
                raise refuse(f"{key} type {kind!r}", "names no length below which it is the plain rotation")
            limits.append((length, f"{key} {kind}: {why}"))
    return limits


def inspect_export(source: Path, *, backend: str = "onnxruntime", max_context: int | None = None) -> Imported:
    """Check an Optimum export folder.

    Raises:
        FatalError: anything the fleet cannot serve exactly, with the reason.
    """
    import onnx

    from streamfleet.workers.engines.trt_plan import graph_info_from_model

    source = Path(source)
    if not source.is_dir():
        raise FatalError(f"{source} is not a folder")
    graph = next((n for n in GRAPH_NAMES if (source / n).exists()), None)
    if graph is None:
        raise FatalError(f"{source} has none of {', '.join(GRAPH_NAMES)}: export it with `optimum-cli export onnx "
                         f"--task text-generation-with-past --model MODEL {source}`")
    if not (source / "tokenizer.json").exists():
        raise FatalError(f"{source} has no tokenizer.json (a fast tokenizer is required)")
    config = read_json(source / "config.json")
    limits = attention_limits(config, source / "config.json")  # refuses what no cap makes exact, first
    options: dict[str, Any] = {}
    for key in ("num_key_value_heads", "head_dim"):
        if isinstance(config.get(key), int):
            options[key] = config[key]
    if "head_dim" not in options and isinstance(config.get("hidden_size"), int) \
            and isinstance(config.get("num_attention_heads"), int) and config["num_attention_heads"]:
        options["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    try:
        model = onnx.load(str(source / graph), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise FatalError(f"cannot read {source / graph}: {exc}") from exc
    info = graph_info_from_model(model, str(source / graph), options, tensorrt=backend == "tensorrt")
    for key, got in (("num_key_value_heads", info.kv_heads), ("head_dim", info.head_dim)):
        want = options.get(key)
        if isinstance(want, int) and want != got:
            raise FatalError(f"{source / graph}: the graph's KV cache has {key.replace('_', ' ')} {got}, "
                             f"config.json says {want}")
    if backend == "onnxruntime" and info.kv_dtype == "bfloat16":
        raise FatalError(f"{source / graph}: a bfloat16 KV cache does not run on ONNX Runtime's CPU provider; "
                         f"re-export with --dtype fp32 (or fp16), or import with --backend tensorrt")
    external = sorted({e.value for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
                       for e in t.external_data if e.key == "location"})
    for loc in external:
        if not (source / loc).exists():
            raise FatalError(f"{source / graph} keeps weights in {loc}, which is missing")

    # context: the model's, capped by the operator, and where the model's attention is
    # local (a window the engines do not apply: they attend to the whole cache) at the window
    declared = next((k for k in CONTEXT_KEYS if _positive(config.get(k))), None)
    ctx = int(config[declared]) if declared else None
    note = declared or "the model declares none"
    if ctx is None:
        ctx = max_context or 2048
        note = "the model declares none; --max-context or 2048"
    if max_context is not None and max_context < ctx:
        ctx, note = max_context, "--max-context"
    elif max_context is None and ctx > DEFAULT_MAX_CONTEXT:
        ctx, note = DEFAULT_MAX_CONTEXT, f"capped at {DEFAULT_MAX_CONTEXT}; --max-context to change"
    for limit, why in sorted(limits):
        if limit < ctx:
            ctx, note = limit, why

    eos, eos_from = declared_eos(source, "tokenizer.json")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    adds_bos = len(tok.encode("a", add_special_tokens=True).ids) > len(tok.encode("a", add_special_tokens=False).ids)
    _template, template_from = folder_chat_template(source)
    arch = config.get("model_type") or ",".join(config.get("architectures") or []) or "unknown (no config.json)"
    return Imported(source=source, graph=graph, architecture=str(arch), n_layer=info.n_layer,
                    kv_heads=info.kv_heads, head_dim=info.head_dim, kv_dtype=info.kv_dtype,
                    vocab_size=info.vocab_size, has_position_ids=info.has_position_ids,
                    merged="use_cache_branch" in info.inputs, max_context=ctx, context_note=note,
                    eos_token_ids=eos, eos_from=eos_from, adds_bos=adds_bos, backend=backend,
                    options=dict(options), external_data=external,
                    chat_template_from=template_from)


def import_export(source: Path, dest_root: Path, name: str, *, backend: str = "onnxruntime",
                  max_batch: int = 16, max_context: int | None = None, force: bool = False) -> tuple[Path, Imported]:
    """Check ``source`` and copy it into ``dest_root/name`` with an ``engine.toml``.

    Raises:
        FatalError: the export cannot be served exactly, or the destination exists.
    """
    found = inspect_export(source, backend=backend, max_context=max_context)
    dest = Path(dest_root) / name
    if (dest / "engine.toml").exists() and not force:
        raise FatalError(f"{dest} already holds a model; choose another --name or pass --force")
    dest.mkdir(parents=True, exist_ok=True)
    for fname in (found.graph, *found.external_data, *_SIDE_FILES):
        if (source / fname).exists():
            shutil.copy2(source / fname, dest / fname)
        elif fname in _SIDE_FILES and (dest / fname).is_file():  # --force: not the old model's template, EOS...
            (dest / fname).unlink()
    for folder in _SIDE_FOLDERS:
        if (dest / folder).is_dir():
            shutil.rmtree(dest / folder)
        if (source / folder).is_dir():
            shutil.copytree(source / folder, dest / folder)
    header = "\n".join(f"# {line}" for line in found.describe().splitlines())
    lines = [
        "# Imported by `streamfleet engines import`:",
        header,
        f'name = "{name}"',
        'version = "1"',
        f'backend = "{backend}"',
        f'onnx = "{found.graph}"',
        'tokenizer = "tokenizer.json"',
        f"max_batch = {int(max_batch)}",
        f"max_context = {found.max_context}",
        "# EOS ids come from the folder's generation_config.json / config.json / tokenizer_config.json;",
        "# eos_token_ids = [...] here would override them",
        "# the chat template comes from the folder's chat_template.jinja, else tokenizer_config.json's;"
        if found.chat_template_from else
        "# the model has no chat template: chat requests are refused (completions only);",
        '# chat_template = "..." here would override it (a Jinja template, or "builtin": <|role|> turns)',
    ]
    for key, value in sorted(found.options.items()):
        lines.append(f"{key} = {int(value)}")
    (dest / "engine.toml").write_text("\n".join(lines) + "\n")
    return dest, found
