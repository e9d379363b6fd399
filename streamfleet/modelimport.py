"""``streamfleet engines import PATH``: turn a folder exported by
``optimum-cli export onnx --task text-generation-with-past`` into a model folder of the
repository (``engines/<name>/``), after checking everything the fleet relies on, and say
what was found (README: "Engines").

Checked: the graph's layout (``past_key_values.N.key/value`` in, ``logits`` and
``present.N.*`` out, no input the engines cannot feed), its KV heads and head size
against ``config.json``, the KV cache dtype (fp32/fp16 on ONNX Runtime; bf16 only on
TensorRT), ``position_ids`` (without them the ONNX Runtime engine runs the model
unpadded and TensorRT refuses it), a merged decoder's ``use_cache_branch``, the
context length (capped at a sliding window, which the engines do not apply), the
tokenizer (``tokenizer.json``; BOS as its post-processor adds it) and every EOS id the
folder declares. Nothing is downloaded; the files are copied.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamfleet.shared.errors import FatalError
from streamfleet.shared.modelrepo import declared_eos, read_json

__all__ = ["Imported", "inspect_export", "import_export", "GRAPH_NAMES"]

#: graph files of an Optimum export, in order of preference
GRAPH_NAMES = ("model.onnx", "decoder_model_merged.onnx", "decoder_with_past_model.onnx")
#: files copied besides the graph (when present)
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
               "generation_config.json")
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
            f"vocabulary    {self.vocab_size if self.vocab_size else 'symbolic in the graph'}",
            f"position_ids  {pos}",
            f"context       {self.max_context} tokens ({self.context_note})",
            f"EOS ids       {list(self.eos_token_ids) or 'none declared: requests end at max_tokens'}"
            + (f" (from {self.eos_from})" if self.eos_from else ""),
            f"BOS           {'added by the tokenizer to every prompt' if self.adds_bos else 'none added'}",
            f"backend       {self.backend}",
        ]
        return "\n".join(lines)


def inspect_export(source: Path, *, backend: str = "onnxruntime", max_context: int | None = None) -> Imported:
    """Check an Optimum export folder.

    Raises:
        FatalError: anything the fleet cannot serve exactly, with the reason.
    """
    import onnx

    from streamfleet.workers.engines.trt_build import graph_info_from_model

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

    # context: the model's, capped by the operator, and by a sliding window the engines do not apply
    declared = config.get("max_position_embeddings") or config.get("n_positions") or config.get("seq_length")
    ctx = int(declared) if isinstance(declared, int) and declared > 0 else None
    note = "max_position_embeddings" if ctx else "the model declares none"
    if ctx is None:
        ctx = max_context or 2048
        note = "the model declares none; --max-context or 2048"
    if max_context is not None and max_context < ctx:
        ctx, note = max_context, "--max-context"
    elif max_context is None and ctx > DEFAULT_MAX_CONTEXT:
        ctx, note = DEFAULT_MAX_CONTEXT, f"capped at {DEFAULT_MAX_CONTEXT}; --max-context to change"
    window = config.get("sliding_window")
    if isinstance(window, int) and 0 < window < ctx:
        ctx, note = window, ("the sliding window: the engines attend to the whole cache, which equals "
                             "sliding-window attention only within the window")

    eos, eos_from = declared_eos(source, "tokenizer.json")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    adds_bos = len(tok.encode("a", add_special_tokens=True).ids) > len(tok.encode("a", add_special_tokens=False).ids)
    arch = config.get("model_type") or ",".join(config.get("architectures") or []) or "unknown (no config.json)"
    return Imported(source=source, graph=graph, architecture=str(arch), n_layer=info.n_layer,
                    kv_heads=info.kv_heads, head_dim=info.head_dim, kv_dtype=info.kv_dtype,
                    vocab_size=info.vocab_size, has_position_ids=info.has_position_ids,
                    merged="use_cache_branch" in info.inputs, max_context=ctx, context_note=note,
                    eos_token_ids=eos, eos_from=eos_from, adds_bos=adds_bos, backend=backend,
                    options={k: v for k, v in options.items()}, external_data=external)


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
    ]
    for key, value in sorted(found.options.items()):
        lines.append(f"{key} = {int(value)}")
    (dest / "engine.toml").write_text("\n".join(lines) + "\n")
    return dest, found
