"""``streamfleet engines import FILE.gguf``: a GGUF file (llama.cpp's format) of a Llama,
Qwen2, Qwen3, Phi-3, Gemma 2 or Gemma 3 model turned into a model folder the ONNX Runtime
engine serves, without torch.

What is read from the file (``gguf``'s reader, numpy only):

* the architecture (``general.architecture``: ``llama``, ``qwen2``, ``qwen3``, ``phi3``,
  ``gemma2``, ``gemma3``: ``_ARCH_KEYS``, docs/models.md "Architectures"; anything else is
  refused by name), layers, hidden size, heads and KV heads, head size, RoPE bases and
  dimensions, the RMSNorm epsilon, soft-capping, the sliding window and the context
  length; any setting the graph below does not apply (RoPE scaling, experts, a sliding
  window pattern...) refuses the file by name;
* the weights, each by its quantization type: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
  Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (``SUPPORTED_TYPES``; any other, the IQ types
  among them, refuses the file by name), each with the values ``gguf``'s own
  ``dequantize`` gives (what transformers loads from the same file), kept packed
  (``--weights q4``, below) or as fp32;
* the tokenizer (``tokenizer.ggml.*``: a GPT-2-style byte-level BPE with its merges and
  the pre-tokenizer named by ``tokenizer.ggml.pre``, or a SentencePiece vocabulary with its
  scores, byte-fallback tokens and space prefix; the control tokens as special tokens;
  docs/models.md, "Tokenizers"), BOS/EOS/PAD/UNK ids, whether BOS is added, and the chat
  template.

The graph (``model.onnx`` + ``model.onnx.data``) is the architecture's decoder in the
layout the engine batches (docs/models.md): ``input_ids``, ``attention_mask``,
``position_ids`` and ``past_key_values.N.key/value`` in; ``logits`` of the last position
and ``present.N.key/value`` out. Attention is grouped-query without copying the KV heads
(the query heads of a group are folded into its rows), RoPE is HF's rotate-half form
(llama.cpp's Q/K row permutation of a llama file is undone at import; the other
architectures are stored unpermuted), the feed-forward is gated (SiLU, or GELU(tanh) for
gemma), and the output layer is tied to the embedding or not, as the file says. What each
architecture adds (biases, Q/K norms, fused matrices cut apart, post-norms,
soft-capping, sliding windows): ``ARCH_NOTES`` and docs/models.md, "Architectures".

Weights (``--weights``, docs/models.md has the measured figures):

``q4`` (default)
    Q4_0/Q4_1 matrices stay 4-bit in ONNX Runtime's ``MatMulNBits`` with fp32
    activations (``accuracy_level`` 0): Q4_0 as itself (zero point 8), Q4_1's ``d*q + m``
    as ``d * (q - 8)`` (zero point 8) plus ``m + 8d`` times each block's sum of the
    activations, and a Q8_0
    matrix as two 4-bit products (its high and low nibbles); the 5- and 6-bit and K
    types likewise (``_block_parts``: a 4-bit product, or two for 5/6-bit values, with
    their blocks' minimums on the block sums; blocks of 16 for Q2_K, Q3_K and Q6_K), and
    F16/BF16 matrices as themselves, widened to fp32 by a ``Cast``. Every weight keeps
    the value it has in the file, so the products are those of the fp32 graph; only the
    order of the sums differs (docs/models.md, "Weight types").
``fp32``
    every matrix dequantized to fp32 (plain ``MatMul``): the reference path, the same
    values transformers computes with when it loads the file.
``int8``
    every matrix requantized to 8 bits per block of 32, with 8-bit activations (ONNX
    Runtime's fast 8-bit path): lossy, kept for comparison.
``q4-int8act``
    as ``q4`` but with 8-bit activations (``accuracy_level`` 4, llama.cpp's own Q4_1
    path; Q5_0, Q5_1, Q5_K and Q6_K as one 8-bit product) in every block but the first
    and the last, which are dequantized to fp32
    (``layer_weights``): faster and lossy; its quality against fp32 is
    measured (shared/quality.py) and it serves by default only where it passes the gate
    of ``weights = "auto"`` (shared/execution.py; docs/models.md).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from streamfleet.shared.errors import FatalError
from streamfleet.shared.packagefetch import sha256_of

if TYPE_CHECKING:
    import onnx
    from gguf import GGUFReader

__all__ = ["AUTO", "AUTO_GRAPH_FILE", "AUTO_MODES", "GgufModel", "WEIGHT_MODES", "DEFAULT_WEIGHTS", "read_gguf",
           "write_model_files", "write_tokenizer_files", "import_gguf", "importer_digest", "build_tokenizer_json",
           "layer_weights"]

#: ``--weights`` choices, the default first
WEIGHT_MODES = ("q4", "fp32", "int8", "q4-int8act")
DEFAULT_WEIGHTS = "q4"
#: ``--weights auto``: a graph for each of ``AUTO_MODES``, the one that serves chosen by
#: measurement on each CPU (shared/execution.py)
AUTO = "auto"
AUTO_MODES = ("q4", "q4-int8act", "fp32")
#: an ``auto`` folder's ``onnx``: its q4 GroupQueryAttention graph (shared/execution.py)
AUTO_GRAPH_FILE = "model.gqa.onnx"
#: the graph's name in a model folder (its weights beside it in ``model.onnx.data``)
GRAPH_FILE = "model.onnx"
#: default context cap: the KV cache of every live sequence is sized by it (as the ONNX import)
DEFAULT_MAX_CONTEXT = 4096
#: the graph's input ``[n]`` (int64): the logits of the last n positions are computed
#: (the engine feeds ``[1]`` but for a prompt's log probabilities)
LOGITS_TO_KEEP = "logits_to_keep"
#: the additive mask of a masked slot: the most negative fp32, as transformers uses
_MASKED = float(np.finfo(np.float32).min)

#: ``tokenizer.ggml.pre`` -> the pre-tokenizer of a byte-level BPE (``tokenizer.ggml.model``
#: ``gpt2``): llama.cpp keeps the name only and splits text by the regular expressions it
#: maps the name to; these are the same splits (docs/models.md, "Tokenizers"), checked on
#: tests/fixtures/gguf/tokenizers/ against transformers' and llama.cpp's ids
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
#: SmolLM / StarCoder: every digit on its own, then GPT-2's split
_DIGITS_FIRST = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]}


def _split_then_bytes(regex: str) -> dict[str, Any]:
    """A split by ``regex`` (each match its own piece), then the byte-level alphabet."""
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


#: Llama 3's split: contractions, letters with one leading non-letter, digits in threes
_LLAMA3_SPLIT = _split_then_bytes(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+")
#: Qwen2's: Llama 3's with every digit on its own
_QWEN2_SPLIT = _split_then_bytes(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+")
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    # GPT-2's split; "default" (a file whose converter named none) as transformers reads it:
    # llama.cpp's own "default" splits punctuation runs first (docs/models.md, "Tokenizers")
    "default": _BYTE_LEVEL,
    "gpt2": _BYTE_LEVEL,
    "gpt-2": _BYTE_LEVEL,
    "smollm": _DIGITS_FIRST,
    "starcoder": _DIGITS_FIRST,
    "refact": _DIGITS_FIRST,
    "command-r": _DIGITS_FIRST,
    "mpt": _BYTE_LEVEL,  # llama.cpp splits MPT's text as GPT-2's
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
#: pre-tokenizers whose words found whole in the vocabulary are one token, merges or not
#: (llama.cpp's ``ignore_merges``; Llama 3's tokenizer.json says the same)
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe"}

#: ``tokenizer.ggml.model`` -> what the import builds (docs/models.md, "Tokenizers")
TOKENIZER_MODELS = {
    "gpt2": "byte-level BPE",
    "llama": "SentencePiece BPE (merges ranked by the file's scores, byte fallback)",
}
#: llama.cpp's token types (``tokenizer.ggml.token_type``)
_UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 2, 3, 4, 6

#: metadata keys of a llama GGUF the graph applies or that change nothing it computes
_LLAMA_KEYS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon", "vocab_size",
    "rope.dimension_count", "attention.key_length", "attention.value_length",
}
#: linear RoPE scaling (positions divided by ``rope.scaling.factor``), which the graph applies
#: (``GgufModel.layer_rope``); any other ``rope.scaling.type`` (yarn, longrope...) is refused
_ROPE_SCALING_KEYS = {"rope.scaling.type", "rope.scaling.factor"}

#: ``general.architecture`` -> the metadata keys (under ``ARCH.``) its graph applies; any other
#: key of the architecture refuses the file by name (docs/models.md, "Architectures")
_ARCH_KEYS: dict[str, set[str]] = {
    "llama": _LLAMA_KEYS | _ROPE_SCALING_KEYS,
    # Llama with biases on the Q/K/V projections, rotate-half RoPE in the file's own row order
    "qwen2": _LLAMA_KEYS | _ROPE_SCALING_KEYS,
    # Llama with a per-head RMSNorm on Q and K before RoPE, the head size from key_length
    "qwen3": _LLAMA_KEYS | _ROPE_SCALING_KEYS,
    # Llama with fused Q/K/V and gate|up matrices; llama.cpp's converter writes the original
    # context (of a LongRoPE model; without its rope_factors tensors it changes nothing) and
    # the sliding window (0: none; else the served context is capped at it: ``context_for``)
    "phi3": _LLAMA_KEYS | {"rope.scaling.original_context_length", "attention.sliding_window"},
    # (1 + weight) RMSNorms (llama.cpp's converter stores the 1 + weight), embeddings times
    # sqrt(hidden), GELU(tanh) gated feed-forward, norms after the attention and the
    # feed-forward, soft-capped attention scores and logits, sliding-window layers
    "gemma2": _LLAMA_KEYS | {"attn_logit_softcapping", "final_logit_softcapping", "attention.sliding_window"},
    # gemma2 without the attention's soft-capping, with a per-head RMSNorm on Q and K and
    # a RoPE base of their own for the sliding-window layers
    "gemma3": _LLAMA_KEYS | _ROPE_SCALING_KEYS | {"final_logit_softcapping", "attention.sliding_window",
                                                  "rope.freq_base_swa"},
}
#: every n-th layer attends to the whole context, the others within the sliding window (set
#: by the architecture, not the file: llama.cpp's and transformers' own patterns)
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
#: llama.cpp's RoPE base of gemma3's sliding-window layers where the file names none
_GEMMA3_SWA_BASE = 10000.0
#: the architectures whose Q/K rows llama.cpp's converter permutes for its interleaved RoPE
#: (undone at import); the others are stored in transformers' order (llama.cpp's "NEOX" RoPE)
_PERMUTED_QK = {"llama"}

# llama.cpp's tensor types (ggml_type numbers) this module handles without gguf's dequantize
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30


@dataclass
class _Tensor:
    name: str
    qtype: int
    qname: str
    #: logical shape, numpy order: (rows = output features, cols = input features)
    shape: tuple[int, ...]
    #: the raw data as gguf's reader maps it (bytes per row for quantized types)
    raw: np.ndarray
    #: served dequantized to fp32 although its type has a packed form (a block whose
    #: weights are not exact as the sum of the packed terms: ``_block_parts``)
    dequantized: bool = False


@dataclass
class GgufTokenizer:
    """The tokenizer fields of a GGUF file (``read_gguf_tokenizer``; ``GgufModel`` has them too)."""

    path: Path
    tokenizer_model: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float]
    pre: str
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None
    #: end-of-turn / end-of-message ids (``tokenizer.ggml.eot_token_id``, ``eom``): llama.cpp
    #: stops on them as on EOS, and so does the fleet
    end_ids: tuple[int, ...]

    def token_text(self, tid: int | None) -> str | None:
        return self.tokens[tid] if tid is not None and 0 <= tid < len(self.tokens) else None


@dataclass
class GgufModel(GgufTokenizer):
    """What a GGUF file holds, as checked."""

    architecture: str
    name: str
    n_layer: int
    hidden: int
    intermediate: int
    n_head: int
    n_kv_head: int
    head_dim: int
    rope_base: float
    rms_eps: float
    context_length: int
    vocab_size: int
    tied: bool
    tensor_types: dict[str, int]
    #: biases on the Q, K and V projections (qwen2)
    qkv_bias: bool = False
    #: a per-head RMSNorm on Q and K before RoPE (qwen3: ``attn_q_norm`` / ``attn_k_norm``)
    qk_norm: bool = False
    #: Q/K rows in llama.cpp's permuted order (llama: undone at import); else transformers' order
    permuted_qk: bool = True
    #: the sliding attention window (``attention.sliding_window``; 0: none): the served
    #: context is capped at it, where the window masks nothing (``context_for``)
    window: int = 0
    #: gemma2 / gemma3: embeddings times sqrt(hidden), GELU(tanh) feed-forward, RMSNorms after
    #: the attention and the feed-forward (``post_attention_norm``, ``post_ffw_norm``)
    gemma: bool = False
    #: the attention's scale where it is not 1/sqrt(head size) (``_gemma_query_scale``)
    query_scale: float | None = None
    #: soft-capping of the attention scores and of the logits (``tanh(z / cap) * cap``; 0: none)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    #: gemma3's RoPE base in its sliding-window layers (``rope.freq_base_swa``)
    rope_base_swa: float | None = None
    #: every ``swa_pattern``-th layer global, the others sliding-window layers (0: none)
    swa_pattern: int = 0
    #: linear RoPE scaling: positions divided by it (``rope.scaling.factor``; gemma3: its
    #: global layers only, as llama.cpp and transformers scale them)
    rope_scale: float = 1.0

    @property
    def attn_scale(self) -> float:
        """The factor of the attention scores (``q . k`` times it)."""
        return self.query_scale if self.query_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends within the sliding window only."""
        return bool(self.window) and (not self.swa_pattern or (layer + 1) % self.swa_pattern != 0)

    def layer_rope(self, layer: int) -> tuple[float, float]:
        """The RoPE base and linear scaling factor of ``layer``: gemma3's sliding-window
        layers have a base of their own, unscaled."""
        if self.rope_base_swa is not None and self.swa_pattern and self.sliding(layer):
            return self.rope_base_swa, 1.0
        return self.rope_base, self.rope_scale
    tensors: dict[str, _Tensor] = field(repr=False, default_factory=dict)

    def describe(self, weights: str, max_context: int, context_note: str) -> str:
        types = ", ".join(f"{n} {k}" for k, n in sorted(self.tensor_types.items(), key=lambda kv: -kv[1]))
        params = sum(int(np.prod(t.shape)) for t in self.tensors.values())
        bos = self.token_text(self.bos_id)
        return "\n".join([
            f"source        {self.path}",
            f"model         {self.name or '(unnamed)'}: {self.architecture}, {params / 1e6:.1f} M parameters "
            f"({types})",
            f"layers        {self.n_layer}, hidden {self.hidden}, heads {self.n_head}, KV heads {self.n_kv_head}, "
            f"head size {self.head_dim}, feed-forward {self.intermediate}",
            f"RoPE          base {self.rope_base:g}"
            + (f", positions / {self.rope_scale:g} (linear scaling"
               + (", global layers)" if self.rope_base_swa is not None else ")") if self.rope_scale != 1.0 else "")
            + (f" ({self.rope_base_swa:g} in the sliding-window layers)" if self.rope_base_swa is not None else "")
            + f"; RMSNorm eps {self.rms_eps:g}"
            + (f"; attention scale {self.attn_scale:g}" if self.query_scale is not None else "")
            + (f"; attention scores soft-capped at {self.attn_softcap:g}" if self.attn_softcap else "")
            + (f"; logits soft-capped at {self.final_softcap:g}" if self.final_softcap else ""),
            f"architecture  {ARCH_NOTES[self.architecture]}"
            + (f"; sliding window {self.window} tokens" + (
                f" in {'every layer' if not self.swa_pattern else f'{self.n_layer - self.n_layer // self.swa_pattern}'}"
                f"{'' if not self.swa_pattern else f' of {self.n_layer} layers'}"
                " (masked by the GroupQueryAttention graph; the with-past graph's context is capped at it)"
                if self.gemma else " (the context is capped at it)") if self.window else ""),
            f"output layer  {'tied to the embedding' if self.tied else 'its own matrix'}",
            f"weights       {weights}: {_WEIGHT_NOTES[weights]}",
            f"matrices      {self.matrix_note(weights)}",
            f"context       {max_context} tokens ({context_note})",
            (f"tokenizer     byte-level BPE, {len(self.tokens)} tokens, {len(self.merges)} merges, "
             f"pre-tokenizer {self.pre!r}" if self.tokenizer_model == "gpt2" else
             f"tokenizer     SentencePiece BPE, {len(self.tokens)} tokens (merges ranked by their scores, byte "
             f"fallback), {'a space before the text' if self.add_space_prefix else 'no space prefix'}"),
            f"BOS           {bos!r} ({self.bos_id}); "
            f"{'added to every prompt' if self.add_bos else 'not added to prompts'}",
            f"EOS ids       {self.stop_ids()} ({', '.join(repr(self.token_text(i)) for i in self.stop_ids())})"
            if self.stop_ids() else "EOS ids       none declared: requests end at max_tokens",
            f"chat template {'from the file (tokenizer.chat_template)' if self.chat_template else 'none in the file'}",
        ])

    def matrix_note(self, weights: str) -> str:
        """What each weight type's matrices become in the graph of ``weights`` (``auto``: its
        q4 graph), with how many were dequantized instead (``_block_parts``)."""
        mode = "q4" if weights == AUTO else weights
        counts: dict[int, list[int]] = {}
        for t in self.tensors.values():
            if len(t.shape) == 2:
                c = counts.setdefault(t.qtype, [0, 0])
                c[0] += 1
                c[1] += int(t.dequantized)
        notes = []
        for qtype, (n, fell) in sorted(counts.items(), key=lambda kv: -kv[1][0]):
            note = f"{SUPPORTED_TYPES.get(qtype, str(qtype))} {n}: {type_note(qtype, mode)}"
            if fell:
                note += (f" ({fell} dequantized to fp32: a weight is a rounded scale x value + minimum, which "
                         f"no sum of terms gives exactly)")
            notes.append(note)
        if mode == "q4-int8act":
            notes.append("the first and last blocks dequantized to fp32")
        return "; ".join(notes)

    def stop_ids(self) -> list[int]:
        """EOS, then the end-of-turn ids, each once."""
        return list(dict.fromkeys(([self.eos_id] if self.eos_id is not None else []) + list(self.end_ids)))



#: what each architecture's graph computes (the import's summary; docs/models.md, "Architectures")
ARCH_NOTES = {
    "llama": "llama: RMSNorm, rotate-half RoPE (llama.cpp's Q/K row permutation undone), SwiGLU",
    "qwen2": "qwen2: llama with biases on the Q, K and V projections",
    "qwen3": "qwen3: llama with a per-head RMSNorm on Q and K before RoPE",
    "phi3": "phi3: llama with the fused Q|K|V and gate|up matrices cut into their parts",
    "gemma2": "gemma2: (1 + weight) RMSNorms, embeddings times sqrt(hidden), GELU(tanh) feed-forward, norms after "
              "the attention and the feed-forward, soft-capped attention scores and logits",
    "gemma3": "gemma3: gemma2's block without the scores' soft-capping, a per-head RMSNorm on Q and K, the "
              "sliding-window layers' own RoPE base",
}

_WEIGHT_NOTES = {
    "auto": "a GroupQueryAttention graph each for q4, q4-int8act and fp32; the fastest that passes the "
            "quality gate serves (measured on each CPU; docs/models.md)",
    "q4": "each matrix in its own type as exact 4-bit MatMulNBits terms (F16/BF16 as themselves), fp32 "
          "activations",
    "fp32": "dequantized to fp32 (the reference path)",
    "int8": "requantized to 8 bits per block of 32, 8-bit activations (lossy)",
    "q4-int8act": "4-bit weights, 8-bit activations but in the first and last blocks (lossy; its quality is "
                  "measured: docs/models.md)",
}


def type_note(qtype: int, weights: str) -> str:
    """What a matrix of ``qtype`` becomes in the graph of ``weights`` (docs/models.md,
    "Weight types")."""
    if qtype == _F32:
        return "fp32 (exact)"
    if weights == "fp32":
        return "dequantized to fp32 (exact)"
    if weights == "int8":
        return "requantized to 8 bits (lossy)"
    act = "exact weights" if weights == "q4" else "8-bit activations"
    if qtype in (_F16, _BF16):
        return f"{SUPPORTED_TYPES[qtype].lower()} on disk, widened to fp32 when loaded (exact)"
    block, _, terms = _BLOCK_TYPES.get(qtype, (32, 0, 1))
    where = "" if block == 32 else f", blocks of {block}"
    mins = " + block minimums on the activations' block sums" if qtype in (_Q4_1, _Q5_1, _Q2_K, _Q4_K, _Q5_K) else ""
    if qtype == _Q8_0:
        return f"two 4-bit MatMulNBits terms ({act})"
    if terms == 2 and weights == "q4-int8act":
        return f"one 8-bit MatMulNBits term{where}{mins} ({act})"
    what = "one 4-bit MatMulNBits term" if terms == 1 else "two 4-bit MatMulNBits terms"
    return f"{what}{where}{mins} ({act})"


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_gguf(path: Path) -> GgufModel:
    """Read and check a GGUF file's metadata and tensor directory (the data is mapped,
    not read).

    Raises:
        FatalError: not a GGUF file, or anything the graph cannot compute exactly, by name.
    """
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise FatalError("reading GGUF files needs the gguf package: pip install gguf") from exc
    path = Path(path)
    if not path.is_file():
        raise FatalError(f"{path} is not a file")
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError / struct errors on a bad file
        raise FatalError(f"cannot read {path} as GGUF: {exc}") from exc
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_KEYS:
        raise FatalError(f"{path}: architecture {arch!r} is not supported by the GGUF import (it builds "
                         f"{', '.join(sorted(_ARCH_KEYS))} decoders: docs/models.md, \"Architectures\"); export "
                         f"the model with Optimum and use `streamfleet engines import FOLDER` instead")
    prefix = f"{arch}."
    unknown = sorted(k[len(prefix):] for k in reader.fields if k.startswith(prefix)
                     and k[len(prefix):] not in _ARCH_KEYS[arch])
    if unknown:
        raise FatalError(f"{path}: setting(s) {', '.join(prefix + k for k in unknown)} are not applied by the "
                         f"GGUF import; refusing rather than serving the model approximately")

    def need(key: str) -> Any:
        value = _field(reader, prefix + key)
        if value is None:
            raise FatalError(f"{path}: {prefix}{key} is missing")
        return value

    n_layer, hidden = int(need("block_count")), int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    kv = _field(reader, prefix + "attention.head_count_kv", n_head)
    if isinstance(kv, list):
        if len(set(kv)) != 1:
            raise FatalError(f"{path}: a different number of KV heads per layer ({sorted(set(kv))}) is not supported")
        kv = kv[0]
    n_kv_head = int(kv)
    if n_head % n_kv_head:
        raise FatalError(f"{path}: heads {n_head} / KV heads {n_kv_head} do not divide")
    # the head size: attention.key_length where the file gives one (Qwen3's is not hidden / heads)
    key_length = _field(reader, prefix + "attention.key_length")
    if key_length is None and hidden % n_head:
        raise FatalError(f"{path}: hidden {hidden} / heads {n_head} do not divide and no attention.key_length")
    head_dim = int(key_length) if key_length is not None else hidden // n_head
    for key in ("attention.value_length", "rope.dimension_count"):
        value = _field(reader, prefix + key)
        if value is not None and int(value) != head_dim:
            raise FatalError(f"{path}: {prefix}{key} is {value}, not the head size {head_dim} "
                             f"(partial rotary or unequal head sizes are not supported)")
    scaling = _field(reader, prefix + "rope.scaling.type")
    rope_scale = float(_field(reader, prefix + "rope.scaling.factor", 1.0) or 1.0)
    if scaling not in (None, "none", "linear"):
        raise FatalError(f"{path}: {prefix}rope.scaling.type {scaling!r} is not applied by the GGUF import (it "
                         f"applies linear scaling only); refusing rather than serving the model approximately")
    if scaling in (None, "none"):
        if rope_scale != 1.0:
            raise FatalError(f"{path}: {prefix}rope.scaling.factor {rope_scale:g} without a linear "
                             f"{prefix}rope.scaling.type is not applied by the GGUF import")
    elif rope_scale <= 0:
        raise FatalError(f"{path}: {prefix}rope.scaling.factor {rope_scale:g} is not a positive factor")
    # gemma2's window where the file names none: llama.cpp's default (Gemma 2's own)
    window = int(_field(reader, prefix + "attention.sliding_window", 4096 if arch == "gemma2" else 0) or 0)
    tok = _read_tokenizer(reader, path)
    if tok.tokenizer_model == "llama" and arch in ("gemma2", "gemma3"):
        raise FatalError(f"{path}: a SentencePiece tokenizer (tokenizer.ggml.model 'llama') in a {arch} file is not "
                         f"supported (the import's SentencePiece tokenizer is checked on Llama-style vocabularies "
                         f"only, Gemma's not yet: docs/models.md, \"Tokenizers\")")
    tensors: dict[str, _Tensor] = {}
    types: dict[str, int] = {}
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        # gguf lists dims fastest first (ne0 = input features); numpy order reverses them
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        tensors[t.name] = _Tensor(t.name, qtype, t.tensor_type.name, shape, t.data)
        if qtype not in SUPPORTED_TYPES:
            raise FatalError(f"{path}: tensor {t.name} has quantization type {t.tensor_type.name}, which the GGUF "
                             f"import does not serve (it serves {', '.join(SUPPORTED_TYPES.values())}: "
                             f"docs/models.md, \"Weight types\"); refusing rather than serving the model "
                             f"approximately")
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1

    def tensor(name: str, shape: tuple[int, ...]) -> _Tensor:
        t = tensors.get(name)
        if t is None:
            raise FatalError(f"{path}: tensor {name} is missing")
        if t.shape != shape:
            raise FatalError(f"{path}: tensor {name} has shape {t.shape}, expected {shape}")
        return t

    vocab = len(tok.tokens)
    declared_vocab = _field(reader, prefix + "vocab_size")
    if declared_vocab is not None and int(declared_vocab) != vocab:
        raise FatalError(f"{path}: {prefix}vocab_size {declared_vocab} differs from the {vocab} tokens listed")
    intermediate = int(need("feed_forward_length"))
    tensor("token_embd.weight", (vocab, hidden))
    tensor("output_norm.weight", (hidden,))
    tied = "output.weight" not in tensors
    if not tied:
        tensor("output.weight", (vocab, hidden))
    q_dim, kv_dim = n_head * head_dim, n_kv_head * head_dim
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(n_layer):
        bp = f"blk.{i}"
        if arch == "phi3":
            # one Q|K|V matrix and one gate|up matrix: cut into the Llama matrices by rows
            # (whole rows of blocks), as transformers' Phi3 splits their outputs
            fused = tensor(f"{bp}.attn_qkv.weight", (q_dim + 2 * kv_dim, hidden))
            for name, (r0, r1) in (("attn_q", (0, q_dim)), ("attn_k", (q_dim, q_dim + kv_dim)),
                                   ("attn_v", (q_dim + kv_dim, q_dim + 2 * kv_dim))):
                tensors[f"{bp}.{name}.weight"] = _rows_of(fused, f"{bp}.{name}.weight", r0, r1)
            up = tensor(f"{bp}.ffn_up.weight", (2 * intermediate, hidden))
            tensors[f"{bp}.ffn_gate.weight"] = _rows_of(up, f"{bp}.ffn_gate.weight", 0, intermediate)
            tensors[f"{bp}.ffn_up.weight"] = _rows_of(up, f"{bp}.ffn_up.weight", intermediate, 2 * intermediate)
            del tensors[f"{bp}.attn_qkv.weight"]
        shapes = [(f"{bp}.attn_norm.weight", (hidden,)), (f"{bp}.ffn_norm.weight", (hidden,)),
                  (f"{bp}.attn_q.weight", (q_dim, hidden)), (f"{bp}.attn_k.weight", (kv_dim, hidden)),
                  (f"{bp}.attn_v.weight", (kv_dim, hidden)), (f"{bp}.attn_output.weight", (hidden, q_dim)),
                  (f"{bp}.ffn_gate.weight", (intermediate, hidden)), (f"{bp}.ffn_up.weight", (intermediate, hidden)),
                  (f"{bp}.ffn_down.weight", (hidden, intermediate))]
        if arch == "qwen2":
            shapes += [(f"{bp}.attn_q.bias", (q_dim,)), (f"{bp}.attn_k.bias", (kv_dim,)),
                       (f"{bp}.attn_v.bias", (kv_dim,))]
        if arch in ("qwen3", "gemma3"):
            shapes += [(f"{bp}.attn_q_norm.weight", (head_dim,)), (f"{bp}.attn_k_norm.weight", (head_dim,))]
        if arch in _SWA_PATTERN:
            shapes += [(f"{bp}.post_attention_norm.weight", (hidden,)), (f"{bp}.post_ffw_norm.weight", (hidden,))]
        for name, shape in shapes:
            tensor(name, shape)
            expected.add(name)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise FatalError(f"{path}: tensor(s) {', '.join(extra[:6])}{'...' if len(extra) > 6 else ''} are not part "
                         f"of the {arch} graph the import builds (biases, experts, rope factors or other extensions "
                         f"are not supported)")

    return GgufModel(
        path=path, architecture=arch, name=str(_field(reader, "general.name", "") or ""),
        n_layer=n_layer, hidden=hidden, intermediate=intermediate, n_head=n_head, n_kv_head=n_kv_head,
        head_dim=head_dim, rope_base=float(_field(reader, prefix + "rope.freq_base", 10000.0)),
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        context_length=int(_field(reader, prefix + "context_length", 2048)), vocab_size=vocab, tied=tied,
        qkv_bias=arch == "qwen2", qk_norm=arch in ("qwen3", "gemma3"), permuted_qk=arch in _PERMUTED_QK,
        window=window, gemma=arch in _SWA_PATTERN, query_scale=_gemma_query_scale(arch, n_layer, hidden, n_head),
        attn_softcap=float(_field(reader, prefix + "attn_logit_softcapping", 0.0) or 0.0),
        final_softcap=float(_field(reader, prefix + "final_logit_softcapping", 0.0) or 0.0),
        rope_base_swa=(float(_field(reader, prefix + "rope.freq_base_swa", _GEMMA3_SWA_BASE))
                       if arch == "gemma3" else None),
        swa_pattern=_SWA_PATTERN.get(arch, 0) if window else 0, rope_scale=rope_scale,
        tensor_types=types, tensors=tensors, **{k: v for k, v in vars(tok).items() if k != "path"},
    )


def read_gguf_tokenizer(path: Path) -> GgufTokenizer:
    """The tokenizer of a GGUF file alone (no architecture or tensors read).

    Raises:
        FatalError: the file is not a GGUF file, or its tokenizer is one the import does not build.
    """
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise FatalError(f"{path}: cannot read it as a GGUF file ({exc})") from None
    return _read_tokenizer(reader, path)


def _read_tokenizer(reader: GGUFReader, path: Path) -> GgufTokenizer:
    """``tokenizer.ggml.*`` and ``tokenizer.chat_template``: a byte-level BPE (``gpt2``) with a
    pre-tokenizer of ``_PRE_TOKENIZERS``, or a SentencePiece vocabulary (``llama``) with its
    scores; anything else is refused by name (docs/models.md, "Tokenizers")."""
    model = _field(reader, "tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise FatalError(f"{path}: tokenizer model {model!r} is not supported (the GGUF import builds "
                         f"{', '.join(f'{k!r} ({v})' for k, v in TOKENIZER_MODELS.items())}: docs/models.md, "
                         f"\"Tokenizers\")")
    pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
    if model == "gpt2" and pre not in _PRE_TOKENIZERS:
        raise FatalError(f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not known to the GGUF import "
                         f"(known: {', '.join(sorted(_PRE_TOKENIZERS))}); refusing rather than splitting text "
                         f"differently from the model's own tokenizer")
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens", [])]
    if not tokens:
        raise FatalError(f"{path}: tokenizer.ggml.tokens is missing")
    token_types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))]
    merges = [str(m) for m in _field(reader, "tokenizer.ggml.merges", [])]
    scores = [float(x) for x in _field(reader, "tokenizer.ggml.scores", [])]
    if model == "llama":
        if len(scores) != len(tokens):
            raise FatalError(f"{path}: tokenizer model 'llama' is not supported without tokenizer.ggml.scores "
                             f"(one per token: the SentencePiece merges are ranked by them)")
        if merges:
            raise FatalError(f"{path}: tokenizer model 'llama' with tokenizer.ggml.merges is not supported (the "
                             f"import ranks a SentencePiece vocabulary's merges by its scores)")
        if _BYTE not in token_types:
            raise FatalError(f"{path}: tokenizer model 'llama' without byte tokens (<0xNN>, token type 6) is not "
                             f"supported (the import builds byte-fallback SentencePiece tokenizers)")

    def opt_id(key: str) -> int | None:
        v = _field(reader, key)
        return int(v) if v is not None else None

    template = _field(reader, "tokenizer.chat_template")
    return GgufTokenizer(
        path=path, tokenizer_model=str(model), tokens=tokens, token_types=token_types, merges=merges,
        scores=scores, pre=pre,
        bos_id=opt_id("tokenizer.ggml.bos_token_id"), eos_id=opt_id("tokenizer.ggml.eos_token_id"),
        pad_id=opt_id("tokenizer.ggml.padding_token_id"), unk_id=opt_id("tokenizer.ggml.unknown_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary, and to Llama 3's, whose file does not
        # say otherwise
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", model == "llama" or pre in _IGNORE_MERGES)),
        add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", model == "llama")),
        chat_template=str(template) if template else None,
        end_ids=tuple(i for i in (opt_id("tokenizer.ggml.eot_token_id"), opt_id("tokenizer.ggml.eom_token_id"))
                      if i is not None and 0 <= i < len(tokens)),
    )


def _gemma_query_scale(arch: str, n_layer: int, hidden: int, n_head: int) -> float | None:
    """Gemma's attention scale, ``query_pre_attn_scalar ** -0.5``, which no GGUF key holds:
    llama.cpp takes 1/sqrt(head size) but for the 27B models (46 gemma2 and 62 gemma3
    layers), whose scalar is hidden / heads; None (1/sqrt(head size)) elsewhere."""
    if (arch, n_layer) in (("gemma2", 46), ("gemma3", 62)):
        return 1.0 / math.sqrt(hidden // n_head)
    return None


def _rows_of(t: _Tensor, name: str, r0: int, r1: int) -> _Tensor:
    """Rows ``r0:r1`` of a matrix as a matrix of its own (its raw rows: whole blocks)."""
    return _Tensor(name, t.qtype, t.qname, (r1 - r0, t.shape[1]), t.raw[r0:r1])


def _dequantize(t: _Tensor) -> np.ndarray:
    """A tensor as fp32 in numpy order, exactly as ``gguf.quants.dequantize`` gives it."""
    if t.qtype == _F32:
        return np.asarray(t.raw, dtype=np.float32).reshape(t.shape)
    if t.qtype == _F16:
        return np.asarray(t.raw, dtype=np.float16).astype(np.float32).reshape(t.shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(np.asarray(t.raw), GGMLQuantizationType(t.qtype)), dtype=np.float32).reshape(t.shape)


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's permutation of Q/K rows (its converter's ``permute``): rows of a
    head go back from interleaved pairs to HF's halves (what transformers' GGUF loader
    does). Works on raw quantized rows too: the permutation moves whole rows."""
    n = rows.shape[0]
    half = n // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


# -- packed weights for MatMulNBits -----------------------------------------------------------

def _blocks(t: _Tensor, block_bytes: int) -> np.ndarray:
    raw = np.ascontiguousarray(np.asarray(t.raw, dtype=np.uint8))
    rows, cols = t.shape
    return raw.reshape(rows, cols // 32, block_bytes)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block ([rows, blocks, bytes]), as fp32."""
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _pack4(q: np.ndarray) -> np.ndarray:
    """[rows, blocks, 32] values 0..15 -> [rows, blocks, 16] bytes, element 2i in the low nibble."""
    packed: np.ndarray = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed


def _pack_zeros4(zp: np.ndarray) -> np.ndarray:
    """[N, nb] 4-bit zero points -> MatMulNBits' packed bytes [N * ceil(nb/2)]."""
    n, nb = zp.shape
    padded = np.zeros((n, nb + nb % 2), dtype=np.uint8)
    padded[:, :nb] = zp
    packed: np.ndarray = (padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1)
    return packed


def _q4_parts(t: _Tensor, rows: np.ndarray) -> list[tuple[Any, ...]]:
    """Q4_0 / Q4_1 raw rows as exact terms of ONNX Runtime's fast 4-bit kernel (integer
    zero points; a float zero point takes a much slower path: docs/models.md, "Weights"):

    * Q4_0: ``w = d * (q - 8)``: one 4-bit product with the default zero point 8;
    * Q4_1: ``w = d * q + m = d * (q - 8) + (m + 8d)``: a 4-bit product with the default
      zero point 8, plus ``m + 8d`` times the block's sum of the activations (a small
      [.., blocks] x [blocks, N] product)."""
    n = rows.shape[0]
    if t.qtype == _Q4_1:
        blocks = rows.reshape(n, -1, 20)
        d, m, qs = _f16(blocks, 0), _f16(blocks, 2), blocks[..., 4:20]
    else:
        blocks = rows.reshape(n, -1, 18)
        d, m, qs = _f16(blocks, 0), None, blocks[..., 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # gguf: element j low nibble, j+16 high nibble
    if m is None:
        return [("nbits", _pack4(q), d.reshape(-1), None, 4, 32)]
    # Q4_1 centred as d * (q - 8) + (m + 8d): the 4-bit product takes the default zero point
    # 8 (the kernels' symmetric path), and its weights are centred on zero, so the rounding
    # of 8-bit activations (q4-int8act) cancels across a block as in llama.cpp's own Q4_1
    # product instead of adding up over an offset of 7.5d (docs/models.md, "Weights");
    # m + 8d is exact in fp32 (fp16 values, 8d a power-of-two multiple: checked below)
    offset = m + np.float32(8) * d
    if not np.array_equal(offset.astype(np.float64), m.astype(np.float64) + 8 * d.astype(np.float64)):
        raise FatalError(f"{t.name}: a Q4_1 block's m + 8d is not exact in fp32")
    return [("nbits", _pack4(q), d.reshape(-1), None, 4, 32), ("blocksum", np.ascontiguousarray(offset.T), 32)]


def _q8_parts(rows: np.ndarray) -> list[tuple[Any, ...]]:
    """Q8_0 raw rows (``w = d * q``, q int8) as two exact 4-bit products: q = 16*hi + lo
    with lo in 0..15 and hi in -8..7, so ``w = 16d * (hi + 8 - 8) + d * lo`` (ONNX
    Runtime's 8-bit kernel keeps fp32 activations only on a much slower path)."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 34)
    d = _f16(blocks, 0)
    q = blocks[..., 2:34].view(np.int8).astype(np.int16)
    lo = (q & 0x0F).astype(np.uint8)
    hi = ((q - lo) // 16 + 8).astype(np.uint8)
    zeros = _pack_zeros4(np.zeros(d.shape, dtype=np.uint8))
    return [("nbits", _pack4(hi), (d * 16).reshape(-1), None, 4, 32),
            ("nbits", _pack4(lo), d.reshape(-1), zeros, 4, 32)]


def _requant8_parts(w: np.ndarray) -> list[tuple[Any, ...]]:
    """fp32 [N, K] -> 8 bits per block of 32, asymmetric (lossy): the ``int8`` mode."""
    n, k = w.shape
    b = w.reshape(n, k // 32, 32)
    lo = np.minimum(b.min(axis=-1), 0.0)
    hi = np.maximum(b.max(axis=-1), 0.0)
    scale = ((hi - lo) / 255.0).astype(np.float32)
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    zp = np.clip(np.round(-lo / scale), 0, 255).astype(np.uint8)
    q = np.clip(np.round(b / scale[..., None]) + zp[..., None], 0, 255).astype(np.uint8)
    return [("nbits", q, scale.reshape(-1), zp.reshape(-1), 8, 32)]


# -- the other block types: decoded to integer values, per-block scales and minimums -------------
#
# Every supported quantized type holds, per block of B weights (B = 32, or 16 for Q2_K,
# Q3_K and Q6_K's sub-blocks), small integers v with ``w = D * v + C``: D and C one fp32
# each per block, and ``D * v`` exact in fp32 (at most 24 significant bits: an fp16 scale
# times a 6- or 8-bit sub-scale times a value of at most 6 bits), which is how
# ``gguf.quants.dequantize`` computes them (C absent: ``w = D * v``). ``_decode`` reads
# them from the raw blocks; the projection keeps them as 4-bit ``MatMulNBits`` terms
# (``_block_parts``), the embedding as int8 values gathered and widened (``embedding``).

_Q5_0, _Q5_1, _Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K = 6, 7, 10, 11, 12, 13, 14
#: type -> (its block size in the terms, the value subtracted to centre v on zero where a
#: block-sum term carries the rest, the 4-bit terms it takes in the exact modes)
_BLOCK_TYPES: dict[int, tuple[int, int, int]] = {
    _Q5_0: (32, 0, 2), _Q5_1: (32, 16, 2), _Q2_K: (16, 2, 1), _Q3_K: (16, 0, 1),
    _Q4_K: (32, 8, 1), _Q5_K: (32, 16, 2), _Q6_K: (16, 0, 2),
}
#: every type the import serves (llama.cpp's numbering, ``ggml_type``); any other is refused by name
SUPPORTED_TYPES = {_F32: "F32", _F16: "F16", _BF16: "BF16", _Q4_0: "Q4_0", _Q4_1: "Q4_1", _Q5_0: "Q5_0",
                   _Q5_1: "Q5_1", _Q8_0: "Q8_0", _Q2_K: "Q2_K", _Q3_K: "Q3_K", _Q4_K: "Q4_K", _Q5_K: "Q5_K",
                   _Q6_K: "Q6_K"}
#: bytes of one block of 256 weights (K types) or 32 (the others)
_TYPE_BLOCK = {_Q4_0: (32, 18), _Q4_1: (32, 20), _Q5_0: (32, 22), _Q5_1: (32, 24), _Q2_K: (256, 84),
               _Q3_K: (256, 110), _Q4_K: (256, 144), _Q5_K: (256, 176), _Q6_K: (256, 210)}


def _split(b: np.ndarray, *sizes: int) -> list[np.ndarray]:
    """A block's bytes ([n, bytes]) cut into fields of these sizes (the rest last)."""
    out, at = [], 0
    for s in sizes:
        out.append(b[:, at:at + s])
        at += s
    out.append(b[:, at:])
    return out


def _h(b: np.ndarray) -> np.ndarray:
    """An fp16 field ([n, 2] bytes) as fp32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 bytes of 6-bit scales and minimums -> two [n, 8] (as gguf unpacks them)."""
    n = scales.shape[0]
    d, m, m_d = np.split(np.ascontiguousarray(scales).reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape(n, 8)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape(n, 8)
    return sc, mn


def _decode(t: _Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """A Q4_0, Q4_1, Q5_0, Q5_1 or K-type tensor's values v [rows, blocks, B] (int16), scales D and
    minimums C [rows, blocks] (fp32; C None where the type has none) and B, read as
    ``gguf.quants.dequantize`` reads them: ``w = D * v + C`` in fp32 is its result."""
    rows, cols = t.shape
    per, size = _TYPE_BLOCK[t.qtype]
    b = np.ascontiguousarray(np.asarray(t.raw, dtype=np.uint8)).reshape(rows * cols // per, size)
    n = b.shape[0]
    c: np.ndarray | None = None
    if t.qtype in (_Q4_0, _Q4_1):
        if t.qtype == _Q4_0:
            d, qs = _split(b, 2)
        else:
            d, m, qs = _split(b, 2, 2)
            c = _h(m)
        v = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16) - (8 if t.qtype == _Q4_0 else 0)
        scale = _h(d)
    elif t.qtype in (_Q5_0, _Q5_1):
        if t.qtype == _Q5_0:
            d, qh, qs = _split(b, 2, 4)
        else:
            d, m, qh, qs = _split(b, 2, 2, 4)
            c = _h(m)
        high = (np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        v = (low | (high.astype(np.uint8) << 4)).astype(np.int16) - (16 if t.qtype == _Q5_0 else 0)
        scale = _h(d)
    elif t.qtype == _Q2_K:
        sc, qs, d, dmin = _split(b, 16, 64, 2)
        scale = _h(d) * (sc & 0x0F).astype(np.float32)
        c = -(_h(dmin) * (sc >> 4).astype(np.float32))
        v = ((qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3)
        v = v.reshape(n, 16, 16).astype(np.int16)
    elif t.qtype == _Q3_K:
        hmask, qs, sc, d = _split(b, 32, 64, 12)
        low_s = (sc[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
        high_s = (sc[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
        s6 = (low_s & 0x0F) | ((high_s & 0x03) << 4)
        scale = _h(d) * (s6.astype(np.int8) - np.int8(32)).astype(np.float32)
        ql = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        qh = (hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        v = ql.reshape(n, 16, 16).astype(np.int16) - ((qh.reshape(n, 16, 16) ^ 1).astype(np.int16) << 2)
    elif t.qtype in (_Q4_K, _Q5_K):
        if t.qtype == _Q4_K:
            d, dmin, scales, qs = _split(b, 2, 2, 12)
        else:
            d, dmin, scales, qh, qs = _split(b, 2, 2, 12, 32)
        sc, mn = _k_scale_min(scales)
        scale = _h(d) * sc.astype(np.float32)
        c = -(_h(dmin) * mn.astype(np.float32))
        v = ((qs.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F)
        v = v.reshape(n, 8, 32).astype(np.int16)
        if t.qtype == _Q5_K:
            high = (qh.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
            v = v | (high.reshape(n, 8, 32).astype(np.int16) << 4)
    else:  # Q6_K
        ql, qh, sc, d = _split(b, 128, 64, 16)
        scale = _h(d) * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)
        low = ((ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F)
        high = ((qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3)
        v = (low.reshape(n, -1, 32) | (high.reshape(n, -1, 32) << 4)).astype(np.int16) - 32
        v = v.reshape(n, 16, 16)
    block = v.shape[-1]
    nb = cols // block
    v = v.reshape(rows, nb, block)
    scale = scale.astype(np.float32).reshape(rows, nb)
    return v, scale, None if c is None else c.astype(np.float32).reshape(rows, nb), block


def _two_sum_exact(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where ``a + b`` (fp32) is exact: Knuth's TwoSum error term is zero there."""
    with np.errstate(over="ignore", invalid="ignore"):
        s = a + b
        bb = s - a
        err = (a - (s - bb)) + (b - bb)
    exact: np.ndarray = (err == 0) & np.isfinite(s)
    return exact


def _check_decoded(t: _Tensor, v: np.ndarray, scale: np.ndarray, c: np.ndarray | None) -> np.ndarray | None:
    """``w = D * v + C`` as ``gguf.quants.dequantize`` computes it, checked equal to it bit
    for bit, and the fp32 weights [rows, cols] when every weight is that sum exactly
    (so terms that add up to it carry the file's weight); None where a weight is a
    rounded sum (then the matrix is served dequantized)."""
    rows, cols = t.shape
    prod = scale[..., None] * v.astype(np.float32)  # exact: at most 24 significant bits
    w = prod if c is None else prod + np.broadcast_to(c[..., None], prod.shape)
    ref = _dequantize(t)
    if not np.array_equal(w.reshape(rows, cols).view(np.uint32), ref.view(np.uint32)):
        raise FatalError(f"{t.name}: its {t.qname} blocks do not decode to gguf's own dequantized values")
    if c is not None and not _two_sum_exact(prod, np.broadcast_to(c[..., None], prod.shape)).all():
        return None
    return ref


def _block_parts(t: _Tensor, weights: str, permute_heads: int | None) -> list[tuple[Any, ...]] | None:
    """A Q5_0, Q5_1 or K-type matrix as exact ``MatMulNBits`` terms (None where a block's
    weights are not exact as ``D * v + C``: served dequantized). With C (Q5_1, Q2_K,
    Q4_K, Q5_K) v is centred on zero, ``v - c`` (``_BLOCK_TYPES``), and ``C + c*D`` rides
    on each block's sum of the activations, as Q4_1's minimum does; a block where that
    sum is not exact in fp32 keeps ``c = 0`` (and, with one term, a zero point of its own).

    * values within 16 (Q2_K, Q3_K, Q4_K): one 4-bit product ``D * (u - z)``;
    * 5 and 6-bit values (Q5_0, Q5_1, Q5_K, Q6_K): ``v = 16*hi + lo``, two 4-bit products
      ``D * (lo - 8)`` and ``8D * (2*hi + 1)`` (``hi`` in -4..3), both exact;
      in ``q4-int8act`` one 8-bit product ``D * v`` instead (the same weights, one kernel).
    """
    v, scale, c, block = _decode(t)
    if _check_decoded(t, v, scale, c) is None:
        return None
    if permute_heads:
        v, scale = _unpermute_rows(v, permute_heads), _unpermute_rows(scale, permute_heads)
        c = None if c is None else _unpermute_rows(c, permute_heads)
    _, centre, n_terms = _BLOCK_TYPES[t.qtype]
    rows, nb = scale.shape
    shift = np.zeros((rows, nb), dtype=np.int16)
    offset = None
    if c is not None:
        cd = np.float32(centre) * scale  # exact: a small integer times D
        ok = _two_sum_exact(c, cd)
        shift = np.where(ok, centre, 0).astype(np.int16)
        offset = np.where(ok, c + cd, c).astype(np.float32)
    vc = v - shift[..., None]  # v - c per block
    parts: list[tuple[Any, ...]]
    if n_terms == 1:
        # stored u = v - centre + 8 in every block; the zero point 8 (the default) where the
        # block is centred, 8 - centre where it keeps c = 0
        u = (v - centre + 8).astype(np.uint8)
        zeros = (8 - centre + shift).astype(np.uint8)
        packed_zeros = None if (zeros == 8).all() else _pack_zeros4(zeros)
        parts = [("nbits", _pack4(u), scale.reshape(-1), packed_zeros, 4, block)]
    elif weights == "q4-int8act":
        parts = [("nbits", (vc + 128).astype(np.uint8), scale.reshape(-1), None, 8, block)]
    else:
        lo = vc & 0x0F
        hi = (vc - lo) // 16
        parts = [("nbits", _pack4(lo.astype(np.uint8)), scale.reshape(-1), None, 4, block),
                 ("nbits", _pack4((2 * hi + 9).astype(np.uint8)), (scale * np.float32(8)).reshape(-1), None,
                  4, block)]
    if offset is not None:
        parts.append(("blocksum", np.ascontiguousarray(offset.T), block))
    return parts


# -- the graph ------------------------------------------------------------------------------------

class _Graph:
    """A small ONNX graph builder: nodes, initializers, unique names."""

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

    def op(self, op_type: str, inputs: list[str], base: str | None = None, *, domain: str = "",
           outputs: list[str] | None = None, **attrs: Any) -> str:
        """A node; the name of its (first) output."""
        return self.ops(op_type, inputs, base, domain=domain, outputs=outputs, **attrs)[0]

    def ops(self, op_type: str, inputs: list[str], base: str | None = None, *, domain: str = "",
            outputs: list[str] | None = None, n_out: int = 1, **attrs: Any) -> list[str]:
        """A node of ``n_out`` outputs (or ``outputs``); their names."""
        outs = outputs or [self.name(base or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(self.helper.make_node(op_type, inputs, outs, name=self.name(op_type), domain=domain,
                                                **attrs))
        return outs

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(self.numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def init_bf16(self, name: str, bits: np.ndarray) -> str:
        """A bfloat16 initializer from its bits (uint16; numpy has no bfloat16)."""
        from onnx import TensorProto

        bits = np.ascontiguousarray(bits, dtype=np.uint16)
        self.inits.append(self.helper.make_tensor(name, TensorProto.BFLOAT16, bits.shape, bits.tobytes(), raw=True))
        return name

    def const(self, value: ArrayLike, dtype: DTypeLike = np.int64) -> str:
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str + str(array.shape), array.tobytes())
        name = self._consts.get(key)
        if name is None:
            name = self.init(self.name("const"), array)
            self._consts[key] = name
        return name


def embedding(g: _Graph, m: GgufModel, input_ids: str, weights: str) -> str:
    """The token embedding of ``input_ids`` ([B, S] -> [B, S, hidden]), fp32 and exactly the
    file's rows as ``gguf.quants.dequantize`` gives them. A Q8_0 or F16 table stays in the
    graph as it is in the file (int8 values and one scale per block of 32, or fp16) and only
    the gathered rows are widened: ``q * d`` of an int8 and an fp16 scale is exact in fp32,
    so the rows are the same bits, for a quarter (Q8_0) or half (F16) of an fp32 table's
    memory (docs/models.md, "Speed beside llama.cpp"). A BF16 table is gathered as bf16 and
    widened; the other block types (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K ... Q6_K) as int8 values
    with their blocks' fp32 scales and minimums, each row ``D * v + C`` computed as
    ``dequantize`` computes it (an exact product, then one rounded sum). The fp32 mode of a
    tied model keeps the fp32 table, which is its output layer too (``output_layer``); F32
    tables stay fp32."""
    from onnx import TensorProto

    t = m.tensors["token_embd.weight"]
    compact = (_Q8_0, _F16, _BF16, *_TYPE_BLOCK)
    if (weights == "fp32" and m.tied) or t.qtype not in compact:
        g.init("embed.weight", _dequantize(t))
        return g.op("Gather", ["embed.weight", input_ids], axis=0)
    vocab, hidden = t.shape
    if t.qtype == _F16:
        g.init("embed.weight_f16", np.asarray(t.raw, dtype=np.float16).reshape(vocab, hidden))
        return g.op("Cast", [g.op("Gather", ["embed.weight_f16", input_ids], axis=0)], to=TensorProto.FLOAT)
    if t.qtype == _BF16:
        g.init_bf16("embed.weight_bf16", _half_rows(t))
        return g.op("Cast", [g.op("Gather", ["embed.weight_bf16", input_ids], axis=0)], to=TensorProto.FLOAT)
    if t.qtype != _Q8_0:
        v, scale, c, _ = _decode(t)  # [vocab, blocks, B], [vocab, blocks]
        _check_decoded(t, v, scale, c)  # the same bits as gguf's, or refused
        g.init("embed.values", v.astype(np.int8))
        g.init("embed.scales", scale[..., None])
        rows = g.op("Mul", [g.op("Cast", [g.op("Gather", ["embed.values", input_ids], axis=0)], to=TensorProto.FLOAT),
                            g.op("Gather", ["embed.scales", input_ids], axis=0)])  # [B, S, blocks, B]: exact
        if c is not None:
            g.init("embed.mins", c[..., None])
            rows = g.op("Add", [rows, g.op("Gather", ["embed.mins", input_ids], axis=0)])
        return g.op("Reshape", [rows, g.const([0, 0, hidden])])
    blocks = _blocks(t, 34)  # [vocab, hidden / 32, 34]: an fp16 scale, then 32 int8 values
    g.init("embed.q8", np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
    g.init("embed.q8_scale", _f16(blocks, 0)[..., None])  # [vocab, hidden / 32, 1]
    q = g.op("Cast", [g.op("Gather", ["embed.q8", input_ids], axis=0)], to=TensorProto.FLOAT)
    rows = g.op("Mul", [q, g.op("Gather", ["embed.q8_scale", input_ids], axis=0)])  # [B, S, hidden / 32, 32]
    return g.op("Reshape", [rows, g.const([0, 0, hidden])])  # 0: the input's own B and S


def _linear_parts(t: _Tensor, weights: str, permute_heads: int | None = None) -> list[tuple[Any, ...]]:
    """A matrix [N, K] as the terms of one projection, as numpy arrays: ``("matmul", W^T)``
    (fp32), ``("matmul16", W^T, f)`` (fp16) and ``("matmulbf16", W^T, f)`` (bf16 bits as
    uint16), each widened to fp32 and times ``f`` (a power of two) before its product;
    ``("nbits", B, scales, zero points or None, bits, block size)``; ``("blocksum", M^T,
    block size)``; their outputs add up to ``x @ W^T``. In the 4-bit modes each type keeps the weights the file holds
    (docs/models.md, "Weight types"); a block type whose weights are not exact as the sum
    of its terms is dequantized (``t.dequantized``)."""
    if weights in ("q4", "q4-int8act"):
        if t.qtype in (_Q4_0, _Q4_1, _Q8_0):
            rows = _blocks(t, {_Q4_0: 18, _Q4_1: 20, _Q8_0: 34}[t.qtype]).reshape(t.shape[0], -1)
            if permute_heads:
                rows = _unpermute_rows(rows, permute_heads)
            return _q8_parts(rows) if t.qtype == _Q8_0 else _q4_parts(t, rows)
        if t.qtype in _BLOCK_TYPES:
            parts = _block_parts(t, weights, permute_heads)
            if parts is not None:
                return parts
            t.dequantized = True
        elif t.qtype in (_F16, _BF16):
            # fp16 and bf16 widen to fp32 exactly: the product is the fp32 graph's, the file's bytes kept
            half = _half_rows(t)
            if permute_heads:
                half = _unpermute_rows(half, permute_heads)
            return [("matmul16" if t.qtype == _F16 else "matmulbf16", np.ascontiguousarray(half.T), 1.0)]
    w = _dequantize(t)
    if permute_heads:
        w = _unpermute_rows(w, permute_heads)
    if weights != "int8":
        return [("matmul", np.ascontiguousarray(w.T))]
    return _requant8_parts(w)


def _half_rows(t: _Tensor) -> np.ndarray:
    """An F16 tensor as float16 [rows, cols], a BF16 one as its bits (uint16 [rows, cols])."""
    raw = np.ascontiguousarray(np.asarray(t.raw))
    if t.qtype == _F16:
        return raw.view(np.float16).reshape(t.shape)
    return raw.view(np.uint8).view(np.uint16).reshape(t.shape)


def _scaled(parts: list[tuple[Any, ...]], factor: float) -> list[tuple[Any, ...]]:
    """The terms of ``factor`` times the projection (only for a power of two: every
    weight, and so every product and sum, is then scaled without rounding; an fp16 or
    bf16 matrix keeps its bits and is scaled once widened, in fp32, where no weight can
    become subnormal)."""
    out: list[tuple[Any, ...]] = []
    f = np.float32(factor)
    for p in parts:
        if p[0] == "nbits":
            out.append(("nbits", p[1], (p[2] * f).astype(np.float32), *p[3:]))
        elif p[0] in ("matmul16", "matmulbf16"):
            out.append((p[0], p[1], p[2] * factor))
        else:
            out.append((p[0], (p[1] * f).astype(np.float32), *p[2:]))
    return out


def _signature(p: tuple[Any, ...]) -> tuple[Any, ...]:
    if p[0] == "nbits":  # bits, block size, a zero-point input or not
        return p[0], p[4], p[5], p[3] is None
    if p[0] in ("blocksum", "matmul16", "matmulbf16"):  # block size; the widened weights' factor
        return p[0], p[2]
    return (p[0],)


def _fuse(parts: list[list[tuple[Any, ...]]]) -> list[tuple[Any, ...]] | None:
    """Projections of one input side by side (Q, K and V; gate and up) as one wider
    projection, when their terms have the same kinds: each output column is the same dot
    product either way. None when they differ (say, Q4_1 beside Q8_0)."""
    shape = [tuple(_signature(p) for p in ps) for ps in parts]
    if len(set(shape)) != 1:
        return None
    fused: list[tuple[Any, ...]] = []
    for j, first in enumerate(parts[0]):
        terms = [ps[j] for ps in parts]
        if first[0] == "nbits":
            zeros = None if first[3] is None else np.concatenate([t[3] for t in terms])
            fused.append(("nbits", np.concatenate([t[1] for t in terms]), np.concatenate([t[2] for t in terms]),
                          zeros, first[4], first[5]))
        else:  # matmul* (W^T) and blocksum (M^T): [*, N] side by side
            fused.append((first[0], np.concatenate([t[1] for t in terms], axis=1), *first[2:]))
    return fused


def _init_parts(g: _Graph, parts: list[tuple[Any, ...]], prefix: str) -> list[tuple[Any, ...]]:
    """The terms as initializers of the graph (names for ``_apply_linear``)."""
    out: list[tuple[Any, ...]] = []
    for j, part in enumerate(parts):
        name = f"{prefix}.{j}"
        if part[0] == "matmul":
            out.append((part[0], g.init(name + ".weight_t", part[1])))
        elif part[0] == "matmul16":
            out.append((part[0], g.init(name + ".weight_t", part[1]), part[2]))
        elif part[0] == "matmulbf16":
            out.append((part[0], g.init_bf16(name + ".weight_t", part[1]), part[2]))
        elif part[0] == "blocksum":
            out.append(("blocksum", g.init(name + ".block_min_t", part[1]), part[2]))
        else:
            _, packed, scales, zeros, bits, block = part
            out.append(("nbits", g.init(name + ".qweight", packed), g.init(name + ".scales", scales),
                        None if zeros is None else g.init(name + ".zeros", zeros), bits, block))
    return out


def _projections(g: _Graph, tensors: list[_Tensor], weights: str, prefix: str,
                 permute: list[int | None], first_scale: float = 1.0) -> list[list[tuple[Any, ...]]]:
    """One fused projection for matrices that share an input (a list of one), else one
    each; the first matrix times ``first_scale`` (a power of two)."""
    parts = [_linear_parts(t, weights, p) for t, p in zip(tensors, permute)]
    if first_scale != 1.0:
        parts[0] = _scaled(parts[0], first_scale)
    fused = _fuse(parts) if len(parts) > 1 else None
    if fused is not None:
        return [_init_parts(g, fused, prefix)]
    return [_init_parts(g, p, f"{prefix}.{i}") for i, p in enumerate(parts)]


def _linear_init(g: _Graph, t: _Tensor, weights: str, prefix: str,
                 permute_heads: int | None = None) -> list[tuple[Any, ...]]:
    """One matrix's projection as graph initializers."""
    return _init_parts(g, _linear_parts(t, weights, permute_heads), prefix)


def layer_weights(weights: str, layer: int, n_layer: int) -> str:
    """The weights mode of one block's matrices: ``q4-int8act`` keeps its first and last
    blocks dequantized to fp32 (plain ``MatMul``, fp32 activations, and a row's products
    the same alone and beside others, which the 4-bit kernel with fp32 activations does
    not give a lone row); every other mode is the same in every block. The two edge blocks
    are where rounding the activations costs most, for a small share of the weights
    (docs/models.md, "Quality of each mode")."""
    return "fp32" if weights == "q4-int8act" and layer in (0, n_layer - 1) else weights


def _apply_linear(g: _Graph, x: str, terms: list[tuple[Any, ...]], k: int, n: int, accuracy: int) -> str:
    from onnx import TensorProto

    total = None
    for term in terms:
        if term[0] == "matmul":
            y = g.op("MatMul", [x, term[1]])
        elif term[0] in ("matmul16", "matmulbf16"):
            wide = g.op("Cast", [term[1]], to=TensorProto.FLOAT)  # exact; folded into fp32 when loaded
            if term[2] != 1.0:  # a power of two: exact in fp32
                wide = g.op("Mul", [wide, g.const(term[2], np.float32)])
            y = g.op("MatMul", [x, wide])
        elif term[0] == "blocksum":
            # each block's sum of the activations, as one product with a constant 0/1
            # indicator [K, K/block] (exact: the other blocks add zeros), then times M^T
            block = term[2]
            sums = g.op("MatMul", [x, g.const(np.kron(np.eye(k // block), np.ones((block, 1))), np.float32)])
            y = g.op("MatMul", [sums, term[1]])
        else:
            _, b, s, z, bits, block = term
            ins = [x, b, s] + ([z] if z is not None else [])
            acc = 4 if bits == 8 else accuracy  # the 8-bit kernel: 8-bit activations (int8 and q4-int8act)
            y = g.op("MatMulNBits", ins, domain="com.microsoft", K=k, N=n, bits=int(bits), block_size=int(block),
                     accuracy_level=acc)
        total = y if total is None else g.op("Add", [total, y])
    assert total is not None
    return total


def _rms_norm(g: _Graph, x: str, weight: str, eps: float) -> str:
    """transformers' LlamaRMSNorm, x / sqrt(mean(x^2) + eps) * weight, as ONNX Runtime's
    SimplifiedLayerNormalization (one kernel, fp32 throughout)."""
    return g.op("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=float(eps), stash_type=1)


def _rope(g: _Graph, x: str, cos: str, sin: str, head_dim: int) -> str:
    """HF's rotate-half RoPE, ``x * cos + rotate_half(x) * sin``; rotate_half ([x1, x2] ->
    [-x2, x1]) as a product with a constant matrix of one +-1 per column, which is exact
    (one product and zeros added)."""
    half = head_dim // 2
    rot = np.zeros((head_dim, head_dim), dtype=np.float32)
    rot[np.arange(half) + half, np.arange(half)] = -1.0  # out[j] = -x[j + half]
    rot[np.arange(half), np.arange(half) + half] = 1.0   # out[j + half] = x[j]
    rotated = g.op("MatMul", [x, g.const(rot, np.float32)])
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])])


def block_weights(g: _Graph, m: GgufModel, i: int, weights: str, q_scale: float) -> tuple[Any, ...]:
    """Block ``i``'s initializers: its two norms, the fused Q/K/V projection (the query
    rows times ``q_scale``, a power of two), the output projection, the fused gate/up
    projection and the down projection (every graph layout's)."""
    t, pre = m.tensors, f"blk.{i}"
    ln1 = g.init(f"{pre}.attn_norm", _dequantize(t[f"{pre}.attn_norm.weight"]))
    ln2 = g.init(f"{pre}.ffn_norm", _dequantize(t[f"{pre}.ffn_norm.weight"]))
    # a Q norm (qwen3) would undo a scale on the query rows: it goes into the norm's weight
    # instead (``attention_inputs``)
    row_scale = 1.0 if m.qk_norm else q_scale
    permute: list[int | None] = [m.n_head, m.n_kv_head, None] if m.permuted_qk else [None, None, None]
    qkv = _projections(g, [t[f"{pre}.attn_{n}.weight"] for n in "qkv"], weights, f"{pre}.qkv",
                       permute, first_scale=row_scale)
    wo = _linear_init(g, t[f"{pre}.attn_output.weight"], weights, f"{pre}.o")
    gate_up = _projections(g, [t[f"{pre}.ffn_gate.weight"], t[f"{pre}.ffn_up.weight"]], weights, f"{pre}.gate_up",
                           [None, None])
    wd = _linear_init(g, t[f"{pre}.ffn_down.weight"], weights, f"{pre}.down")
    return ln1, ln2, qkv, wo, gate_up, wd


def attention_inputs(g: _Graph, m: GgufModel, i: int, a: str, qkv: list[Any], accuracy: int,
                     q_scale: float) -> list[str]:
    """Block ``i``'s query, key and value before RoPE, from the normed ``a`` and the
    projection(s) of ``block_weights``: ``[packed]`` ([B, S, (heads + 2 kv_heads) * head
    size], the fused projection's) or ``[q, k, v]`` (every graph layout's). With the file's
    Q/K/V biases added (qwen2; the query's times ``q_scale`` as its rows are, a power of
    two: exact), and the per-head RMSNorm of Q and K (qwen3: the query's weight times
    ``q_scale``, which scales its output exactly)."""
    t, pre = m.tensors, f"blk.{i}"
    hd, nh, kvh = m.head_dim, m.n_head, m.n_kv_head
    dims = (nh * hd, kvh * hd, kvh * hd)
    if len(qkv) == 1:
        out = [_apply_linear(g, a, qkv[0], m.hidden, sum(dims), accuracy)]
    else:
        out = [_apply_linear(g, a, w, m.hidden, n, accuracy) for w, n in zip(qkv, dims)]
    if m.qkv_bias:
        biases = [_dequantize(t[f"{pre}.attn_{n}.bias"]) for n in "qkv"]
        biases[0] = (biases[0] * np.float32(1.0 if m.qk_norm else q_scale)).astype(np.float32)
        if len(out) == 1:
            out = [g.op("Add", [out[0], g.init(f"{pre}.qkv_bias", np.concatenate(biases))])]
        else:
            out = [g.op("Add", [y, g.init(f"{pre}.{n}_bias", b)]) for y, n, b in zip(out, "qkv", biases)]
    if m.qk_norm:
        if len(out) == 1:
            out = list(g.ops("Split", [out[0], g.const(list(dims))], axis=-1, n_out=3))
        for j, (n, heads, f) in enumerate((("q", nh, q_scale), ("k", kvh, 1.0))):
            w = (_dequantize(t[f"{pre}.attn_{n}_norm.weight"]) * np.float32(f)).astype(np.float32)
            per_head = g.op("Reshape", [out[j], g.const([0, 0, heads, hd])])
            normed = _rms_norm(g, per_head, g.init(f"{pre}.{n}_norm", w), m.rms_eps)
            out[j] = g.op("Reshape", [normed, g.const([0, 0, heads * hd])])
    return out


def scaled_embedding(g: _Graph, m: GgufModel, x: str) -> str:
    """Gemma's embeddings times sqrt(hidden) (rounded to fp32, as transformers' normalizer);
    the others' as they are (every graph layout's)."""
    if not m.gemma:
        return x
    return g.op("Mul", [x, g.const(np.float32(math.sqrt(m.hidden)), np.float32)])


def _softcap(g: _Graph, x: str, cap: float) -> str:
    """``tanh(x / cap) * cap`` (gemma's soft-capping)."""
    c = g.const(np.float32(cap), np.float32)
    return g.op("Mul", [g.op("Tanh", [g.op("Div", [x, c])]), c])


def attention_residual(g: _Graph, m: GgufModel, i: int, x: str, y: str) -> str:
    """``x`` plus the attention's output ``y`` (gemma: RMS-normed first, ``post_attention_norm``)."""
    if m.gemma:
        w = g.init(f"blk.{i}.post_attention_norm", _dequantize(m.tensors[f"blk.{i}.post_attention_norm.weight"]))
        y = _rms_norm(g, y, w, m.rms_eps)
    return g.op("Add", [x, y])


def _gelu_tanh(g: _Graph, x: str) -> str:
    """GELU's tanh form, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (gemma's
    ``gelu_pytorch_tanh``)."""
    f = np.float32
    cube = g.op("Mul", [g.op("Mul", [x, x]), x])
    inner = g.op("Mul", [g.op("Add", [x, g.op("Mul", [cube, g.const(f(0.044715), f)])]),
                         g.const(f(math.sqrt(2.0 / math.pi)), f)])
    return g.op("Mul", [g.op("Mul", [x, g.const(f(0.5), f)]), g.op("Add", [g.op("Tanh", [inner]), g.const(f(1.0), f)])])


def feed_forward(g: _Graph, m: GgufModel, x: str, norm: str, gate_up: list[Any], down: list[Any],
                 accuracy: int, layer: int | None = None) -> str:
    """A block's gated feed-forward and its residual: ``x + down(silu(gate) * up)`` of the
    RMS-normed ``x`` (gemma: ``gelu_tanh(gate)``, and the output RMS-normed by block
    ``layer``'s ``post_ffw_norm`` before the residual; every graph layout's)."""
    h = m.hidden
    f = _rms_norm(g, x, norm, m.rms_eps)
    if len(gate_up) == 1:
        both = _apply_linear(g, f, gate_up[0], h, 2 * m.intermediate, accuracy)
        gate, up = g.ops("Split", [both, g.const([m.intermediate, m.intermediate])], axis=-1, n_out=2)
    else:
        gate, up = (_apply_linear(g, f, w, h, m.intermediate, accuracy) for w in gate_up)
    if m.gemma:
        act = g.op("Mul", [_gelu_tanh(g, gate), up])
    else:
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
    y = _apply_linear(g, act, down, m.intermediate, h, accuracy)
    if m.gemma:
        assert layer is not None
        w = g.init(f"blk.{layer}.post_ffw_norm", _dequantize(m.tensors[f"blk.{layer}.post_ffw_norm.weight"]))
        y = _rms_norm(g, y, w, m.rms_eps)
    return g.op("Add", [x, y])


def output_layer(g: _Graph, m: GgufModel, x: str, inputs: list[Any], weights: str, accuracy: int) -> None:
    """The final norm and the ``logits`` of the last ``logits_to_keep`` positions ([1]: what
    generation needs; a prompt's log probabilities and perplexity need every position of a
    chunk), an input it adds to ``inputs`` (every graph layout's)."""
    from onnx import TensorProto, helper

    h, t = m.hidden, m.tensors
    x = _rms_norm(g, x, g.init("output_norm", _dequantize(t["output_norm.weight"])), m.rms_eps)
    inputs.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, [1]))
    last = g.op("Slice", [x, g.op("Neg", [LOGITS_TO_KEEP]), g.const([np.iinfo(np.int64).max]),
                          g.const([1])])  # [B, keep, H]
    # the logits soft-capped where the file says so (gemma), else named "logits" as they are
    out = [g.name("raw_logits")] if m.final_softcap else ["logits"]
    if m.tied and weights == "fp32":
        # the fp32 embedding serves as the output layer too: one copy of it
        flat = g.op("Reshape", [last, g.const([-1, h])])
        logits = g.op("Gemm", [flat, "embed.weight"], transB=1)
        lead = g.op("Slice", [g.op("Shape", [last]), g.const([0]), g.const([2])])  # [B, keep]
        g.op("Reshape", [logits, g.op("Concat", [lead, g.const([m.vocab_size])], axis=0)], outputs=out)
    else:
        head = _linear_init(g, t["token_embd.weight"] if m.tied else t["output.weight"], weights, "output")
        g.op("Identity", [_apply_linear(g, last, head, h, m.vocab_size, accuracy)], outputs=out)
    if m.final_softcap:
        g.op("Identity", [_softcap(g, out[0], m.final_softcap)], outputs=["logits"])


def build_graph(m: GgufModel, weights: str = DEFAULT_WEIGHTS, *,
                metadata: dict[str, str] | None = None) -> onnx.ModelProto:
    """The decoder as an ``onnx.ModelProto`` (weights inside; saved with external data).

    Raises:
        FatalError: an unknown weights mode.
    """
    from onnx import TensorProto, helper

    if weights not in WEIGHT_MODES:
        raise FatalError(f"weights mode {weights!r} is not one of {', '.join(WEIGHT_MODES)}")
    accuracy = 4 if weights == "q4-int8act" else 0
    g = _Graph()
    h, hd, nh, kvh = m.hidden, m.head_dim, m.n_head, m.n_kv_head
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "keep", m.vocab_size])]
    for i in range(m.n_layer):
        for kv in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", TensorProto.FLOAT,
                                                        ["batch", kvh, "past", hd]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", TensorProto.FLOAT,
                                                         ["batch", kvh, "total", hd]))

    # lengths: P (past), S (new), T = P + S
    past_shape = g.op("Shape", ["past_key_values.0.key"])
    p_len = g.op("Gather", [past_shape, g.const(2)], axis=0)
    s_len = g.op("Gather", [g.op("Shape", ["input_ids"]), g.const(1)], axis=0)
    t_len = g.op("Add", [p_len, s_len])
    # additive mask [B, 1, S, T]: a key slot is seen when it is real (attention_mask) and not
    # after the query's own slot
    cols = g.op("Range", [g.const(0), t_len, g.const(1)])
    rows = g.op("Range", [p_len, t_len, g.const(1)])
    causal = g.op("LessOrEqual", [g.op("Unsqueeze", [cols, g.const([0])]), g.op("Unsqueeze", [rows, g.const([1])])])
    real = g.op("Cast", [g.op("Unsqueeze", ["attention_mask", g.const([1, 2])])], to=TensorProto.BOOL)
    allowed = g.op("And", [real, causal])
    bias = g.op("Where", [allowed, g.const(0.0, np.float32), g.const(_MASKED, np.float32)])

    # RoPE tables [B, S, 1, hd]: HF's inv_freq, computed as transformers does in fp32 (one
    # pair per RoPE base: gemma3's sliding-window layers have their own)
    pos = g.op("Cast", [g.op("Unsqueeze", ["position_ids", g.const([-1])])], to=TensorProto.FLOAT)
    tables: dict[tuple[float, float], tuple[str, str]] = {}

    def rope_table(base: float, factor: float) -> tuple[str, str]:
        if (base, factor) not in tables:
            exponent = np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / np.float32(hd)
            inv_freq = (1.0 / (np.float32(base) ** exponent)).astype(np.float32)
            if factor != 1.0:  # linear scaling, as transformers divides its inv_freq
                inv_freq = (inv_freq / np.float32(factor)).astype(np.float32)
            inv2 = np.concatenate([inv_freq, inv_freq]).astype(np.float32)
            angles = g.op("Unsqueeze", [g.op("Mul", [pos, g.const(inv2, np.float32)]), g.const([2])])  # [B, S, 1, hd]
            tables[base, factor] = (g.op("Cos", [angles]), g.op("Sin", [angles]))
        return tables[base, factor]

    x = scaled_embedding(g, m, embedding(g, m, "input_ids", weights))
    # the attention's scale (1/sqrt(head size) but for gemma's 27B models): a power of two
    # (head size 4^n, as 64) goes into the query rows, which scales every score exactly as
    # transformers' (q @ k^T) * scale does; any other is a Mul on the scores
    inv_sqrt = m.attn_scale
    folded = math.log2(inv_sqrt).is_integer()
    scale = None if folded else g.const(inv_sqrt, np.float32)
    group = nh // kvh
    # the mask for the grouped rows [B, 1, group*S, T]: row r*S + s is query head r of a
    # group at position s (the layout of ``qg`` below)
    bias_g = g.op("Tile", [bias, g.const([1, 1, group, 1])]) if group > 1 else bias
    model_weights = weights
    for i in range(m.n_layer):
        weights = layer_weights(model_weights, i, m.n_layer)
        ln1, ln2, qkv, wo, gate_up, wd = block_weights(g, m, i, weights, inv_sqrt if folded else 1.0)

        a = _rms_norm(g, x, ln1, m.rms_eps)
        proj = attention_inputs(g, m, i, a, qkv, accuracy, inv_sqrt if folded else 1.0)
        if len(proj) == 1:  # [B, S, (nh + 2 kvh) * hd] -> heads; RoPE on Q and K together
            heads = g.op("Reshape", [proj[0], g.const([0, 0, nh + 2 * kvh, hd])])
            qk, v = g.ops("Split", [heads, g.const([nh + kvh, kvh])], axis=2, n_out=2)
        else:
            q, k, v = (g.op("Reshape", [y, g.const([0, 0, n, hd])]) for y, n in zip(proj, (nh, kvh, kvh)))
            qk = g.op("Concat", [q, k], axis=2)
        qk = _rope(g, qk, *rope_table(*m.layer_rope(i)), hd)
        q, k = g.ops("Split", [qk, g.const([nh, kvh])], axis=2, n_out=2)
        q, k, v = (g.op("Transpose", [z], perm=[0, 2, 1, 3]) for z in (q, k, v))
        k_all = g.op("Concat", [f"past_key_values.{i}.key", k], axis=2, outputs=[f"present.{i}.key"])
        v_all = g.op("Concat", [f"past_key_values.{i}.value", v], axis=2, outputs=[f"present.{i}.value"])
        # grouped-query attention without repeating K/V: the query heads of one KV head
        # become that head's rows, [B, kvh, group*S, hd]
        qg = g.op("Reshape", [q, g.const([0, kvh, -1, hd])])
        scores = g.op("MatMul", [qg, g.op("Transpose", [k_all], perm=[0, 1, 3, 2])])
        if scale is not None:
            scores = g.op("Mul", [scores, scale])
        if m.attn_softcap:
            scores = _softcap(g, scores, m.attn_softcap)
        probs = g.op("Softmax", [g.op("Add", [scores, bias_g])], axis=-1)
        ctx = g.op("Reshape", [g.op("MatMul", [probs, v_all]), g.const([0, nh, -1, hd])])
        ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]), g.const([0, 0, nh * hd])])
        x = attention_residual(g, m, i, x, _apply_linear(g, ctx, wo, nh * hd, h, accuracy))

        x = feed_forward(g, m, x, ln2, gate_up, wd, accuracy, i)

    output_layer(g, m, x, inputs, model_weights, accuracy)
    return model_of(g, m.architecture, inputs, outputs, "streamfleet.shared.ggufimport", metadata or {})


def model_of(g: _Graph, name: str, inputs: list[Any], outputs: list[Any], producer: str,
             metadata: dict[str, str]) -> onnx.ModelProto:
    """The ``onnx.ModelProto`` of a built graph (opset 17 and com.microsoft's), with
    ``metadata`` in its properties (every graph layout's)."""
    from onnx import helper

    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              producer_name=producer)
    model.ir_version = 8
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    return model


# -- the tokenizer -------------------------------------------------------------------------------

def build_tokenizer_json(m: GgufModel | GgufTokenizer) -> dict[str, Any]:
    """A ``tokenizer.json`` (Hugging Face tokenizers) equal to the model's own
    (docs/models.md, "Tokenizers"): for ``gpt2``, byte-level BPE with the file's vocabulary
    and merges, split as its pre-tokenizer says; for ``llama``, SentencePiece as a BPE whose
    merges are ranked by the file's scores, with byte fallback to its ``<0xNN>`` tokens and
    ``▁`` for spaces. Control (and unknown) tokens are special added tokens, user-defined ones
    plain added tokens (each matched whole, as llama.cpp does); BOS and EOS are added by the
    post-processor when the file says so."""
    vocab = {tok: i for i, tok in enumerate(m.tokens)}
    if len(vocab) != len(m.tokens):
        raise FatalError(f"{m.path}: tokenizer.ggml.tokens lists a token twice")
    spm = m.tokenizer_model == "llama"
    added = []
    for i, (tok, kind) in enumerate(zip(m.tokens, m.token_types)):
        if kind in (_CONTROL, _USER_DEFINED) or (spm and kind == _UNKNOWN):
            added.append({"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": kind == _USER_DEFINED and not spm, "special": kind != _USER_DEFINED})
    post: dict[str, Any] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                            "use_regex": True}
    if spm:
        post = {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {}}
    # BOS before and EOS after the text where the file says so, as llama.cpp adds them
    bos = m.token_text(m.bos_id) if m.add_bos else None
    eos = m.token_text(m.eos_id) if m.add_eos else None
    if bos is not None or eos is not None:
        def seq(name: str, type_id: int) -> list[dict[str, Any]]:
            return ([{"SpecialToken": {"id": bos, "type_id": type_id}}] if bos is not None else []) + [
                {"Sequence": {"id": name, "type_id": type_id}}] + (
                [{"SpecialToken": {"id": eos, "type_id": type_id}}] if eos is not None else [])

        post = {"type": "TemplateProcessing", "single": seq("A", 0), "pair": seq("A", 0) + seq("B", 1),
                "special_tokens": {text: {"id": text, "ids": [tid], "tokens": [text]}
                                   for text, tid in ((bos, m.bos_id), (eos, m.eos_id)) if text is not None}}
    if spm:
        # a space before every piece of text between special or user-defined tokens (and the
        # whole text), spaces as "▁": llama.cpp's add_space_prefix, which Llama 2's own
        # tokenizer.json does as this normalizer; no pre-tokenizer (docs/models.md, "Tokenizers")
        normalizer = [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
        if m.add_space_prefix:
            normalizer.insert(0, {"type": "Prepend", "prepend": "\u2581"})
        return {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": normalizer}, "pre_tokenizer": None,
            "post_processor": post,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}] + ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
                                     if m.add_space_prefix else [])},
            "model": {"type": "BPE", "dropout": None, "unk_token": m.token_text(m.unk_id),
                      "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                      "byte_fallback": True, "ignore_merges": False,
                      "vocab": vocab, "merges": sentencepiece_merges(m.tokens, m.scores, m.token_types)},
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZERS[m.pre],
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": m.pre in _IGNORE_MERGES, "vocab": vocab, "merges": m.merges},
    }


def sentencepiece_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[list[str]]:
    """The BPE merges a SentencePiece vocabulary implies: a pair of tokens merges when the
    two together are a (normal or user-defined) token, the pair of the higher-scored token
    first (SentencePiece's BPE and llama.cpp merge the best-scored pair first); ties go to
    the longer left part, then the longer right part, then the token listed first. Pairs,
    not "left right" strings: a token may hold a space."""
    index = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, tok in enumerate(tokens):
        if token_types[i] not in (1, _USER_DEFINED):
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in index and right in index:
                ranked.append((-scores[i], -len(left), -len(right), i, left, right))
    ranked.sort(key=lambda r: r[:4])
    return [[left, right] for *_, left, right in ranked]


# -- the folder ----------------------------------------------------------------------------------

def importer_digest(source_sha256: str, weights: str) -> str:
    """What built a folder: this module's and shared/gguf_gqa.py's code, the GGUF file's
    digest and the weights mode (stamped into the graph, so a changed importer rebuilds
    what it made)."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    # and the GroupQueryAttention graphs' builder (shared/gguf_gqa.py, read, not imported: it imports this module)
    h.update(Path(__file__).with_name("gguf_gqa.py").read_bytes())
    h.update(f"\0{source_sha256}\0{weights}".encode())
    return h.hexdigest()[:32]


#: the graph metadata key holding ``importer_digest``
DIGEST_KEY = "streamfleet.shared.ggufimport"


def context_for(m: GgufModel, max_context: int | None, *, gqa: bool = False) -> tuple[int, str]:
    """The served context: the file's, capped by the operator or by the default cap; and
    by a sliding window the graph does not mask (``masks_window``; ``gqa``: the
    GroupQueryAttention layout's)."""
    ctx, note = m.context_length, f"{m.architecture}.context_length"
    if m.window and m.window < ctx and not masks_window(m, gqa):
        # within the window a sliding-window mask masks nothing: exact without one
        ctx, note = m.window, f"the file's sliding window ({m.architecture}.attention.sliding_window)"
        if max_context is not None and max_context > ctx:
            note += f"; --max-context {max_context} would need the window's mask, which this layout does not build"
    if max_context is not None and max_context < ctx:
        return max_context, "--max-context"
    if max_context is None and ctx > DEFAULT_MAX_CONTEXT:
        return DEFAULT_MAX_CONTEXT, f"the file's {ctx}, capped at {DEFAULT_MAX_CONTEXT}; --max-context to change"
    return ctx, note


def masks_window(m: GgufModel, gqa: bool) -> bool:
    """Whether a graph layout masks ``m``'s sliding window: the GroupQueryAttention one
    does for gemma2/gemma3 (the op's ``local_window_size`` on their sliding-window layers);
    the with-past graph never, and phi3's window is not masked (llama.cpp serves phi3
    without it, transformers with it: the two agree only within it)."""
    return gqa and bool(m.window) and m.gemma


def write_model_files(m: GgufModel, dest: Path, *, weights: str = DEFAULT_WEIGHTS, max_context: int,
                      source_sha256: str | None = None, graph_file: str = GRAPH_FILE, stamp: str | None = None,
                      graph_only: bool = False) -> None:
    """Write the graph, tokenizer and config files of ``m`` into ``dest`` (no engine.toml):
    the graph as ``graph_file`` with its weights in ``graph_file + ".data"``, stamped with
    the importer's digest for ``stamp`` (default: ``weights``; ``"auto"`` for the graphs
    of a folder whose mode is chosen by measurement: shared/execution.py); with
    ``graph_only`` the tokenizer and config files are left as they are.

    Raises:
        FatalError: a weights mode the file cannot use, or the files cannot be written.
    """
    if m.window and max_context > m.window:
        raise FatalError(f"{m.path}: a context of {max_context} tokens is beyond the sliding window of {m.window} "
                         f"({m.architecture}.attention.sliding_window), which the with-past graph does not mask")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    sha = source_sha256 or sha256_of(m.path)
    model = build_graph(m, weights, metadata={DIGEST_KEY: importer_digest(sha, stamp or weights),
                                              "streamfleet.weights": weights, "streamfleet.gguf_sha256": sha})
    save_graph(model, dest, graph_file)
    if not graph_only:
        write_tokenizer_files(m, dest, max_context=max_context)


def save_graph(model: onnx.ModelProto, dest: Path, graph_file: str) -> Path:
    """``dest/graph_file`` with its weights beside it in ``graph_file + ".data"``, written
    under a temporary name first (a reader never sees half a graph)."""
    import onnx

    tmp = dest / (graph_file + ".tmp")
    data_name = graph_file + ".data"
    for stale in (dest / data_name, tmp):
        stale.unlink(missing_ok=True)
    onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_name, size_threshold=1024)
    tmp.replace(dest / graph_file)
    (dest / data_name).chmod(0o644)  # onnx writes it owner-only; the folder's other files are 0644
    return dest / graph_file


def write_tokenizer_only(m: GgufModel | GgufTokenizer, dest: Path, *, max_context: int) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` (the chat template among its keys) and
    ``special_tokens_map.json`` of ``m`` in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(json.dumps(build_tokenizer_json(m), ensure_ascii=False))
    special = {}
    for key, tid in (("bos_token", m.bos_id), ("eos_token", m.eos_id), ("pad_token", m.pad_id),
                     ("unk_token", m.unk_id)):
        text = m.token_text(tid)
        if text is not None:
            special[key] = text
    tok_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": m.add_bos,
                                  "add_eos_token": m.add_eos, "clean_up_tokenization_spaces": False,
                                  "model_max_length": max_context, **special}
    if m.chat_template:
        tok_config["chat_template"] = m.chat_template
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1, ensure_ascii=False))
    (dest / "special_tokens_map.json").write_text(json.dumps(special, indent=1, ensure_ascii=False))


def write_tokenizer_files(m: GgufModel, dest: Path, *, max_context: int) -> None:
    """The tokenizer and config files of ``m`` in ``dest`` (every graph layout's)."""
    dest = Path(dest)
    write_tokenizer_only(m, dest, max_context=max_context)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.hidden,
              "intermediate_size": m.intermediate, "num_hidden_layers": m.n_layer,
              "num_attention_heads": m.n_head, "num_key_value_heads": m.n_kv_head, "head_dim": m.head_dim,
              "rms_norm_eps": m.rms_eps, "rope_theta": m.rope_base, "vocab_size": m.vocab_size,
              "max_position_embeddings": m.context_length, "tie_word_embeddings": m.tied,
              "hidden_act": "silu", "torch_dtype": "float32"}
    generation: dict[str, Any] = {}
    for key, tid in (("bos_token_id", m.bos_id), ("pad_token_id", m.pad_id)):
        if tid is not None:
            config[key] = generation[key] = tid
    stops = m.stop_ids()
    if stops:
        config["eos_token_id"] = generation["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=1))


def import_gguf(source: Path, dest_root: Path, name: str, *, weights: str = DEFAULT_WEIGHTS, max_batch: int = 16,
                max_context: int | None = None, force: bool = False, max_kld: float | None = None,
                write_graphs: Callable[..., object] | None = None) -> tuple[Path, str]:
    """Import ``source`` as ``dest_root/name`` with an ``engine.toml``; returns the folder
    and the description printed by the CLI.

    Raises:
        FatalError: the file cannot be served exactly, or the destination exists.
    """
    m = read_gguf(source)
    ctx, note = context_for(m, max_context, gqa=weights == AUTO)  # auto serves the GroupQueryAttention graph
    if weights not in WEIGHT_MODES and weights != AUTO:
        raise FatalError(f"--weights must be auto or one of {', '.join(WEIGHT_MODES)}, not {weights!r}")
    dest = Path(dest_root) / name
    if (dest / "engine.toml").exists() and not force:
        raise FatalError(f"{dest} already holds a model; choose another --name or pass --force")
    if weights == AUTO:  # shared/execution.py import_auto hands its writer in (write_auto_graphs)
        if write_graphs is None:
            raise FatalError("weights \"auto\" imports through shared/execution.py (import_auto)")
        write_graphs(m, dest, max_context=ctx)
    else:
        write_model_files(m, dest, weights=weights, max_context=ctx)
    description = m.describe(weights, ctx, note)  # after the graphs: which matrices were dequantized
    header = "\n".join(f"# {line}" for line in description.splitlines())
    lines = [
        "# Imported by `streamfleet engines import` from a GGUF file:",
        header,
        f'name = "{name}"',
        'version = "1"',
        'backend = "onnxruntime"',
        f'onnx = "{AUTO_GRAPH_FILE if weights == AUTO else GRAPH_FILE}"',
        'tokenizer = "tokenizer.json"',
        f"max_batch = {int(max_batch)}",
        f"max_context = {ctx}",
        f'weights = "{weights}"',
        f"num_key_value_heads = {m.n_kv_head}",
        f"head_dim = {m.head_dim}",
    ]
    if weights == AUTO:
        lines.insert(lines.index(f'weights = "{weights}"') + 1, 'attention = "gqa"')
        lines += ["", "# the quality gate of weights = \"auto\" (docs/models.md, \"Execution modes\"): a mode serves",
                  "# only if its perplexity is within max_ppl_ratio of fp32's and, unless exact in the",
                  "# weights, its mean KL divergence from fp32 is at most max_kld",
                  "[execution]", "max_ppl_ratio = 1.01"]
        if max_kld is not None:
            lines.append(f"max_kld = {float(max_kld)!r}")
    (dest / "engine.toml").write_text("\n".join(lines) + "\n")
    return dest, description
