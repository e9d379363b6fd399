#!/usr/bin/env python3
"""Generate a GPT-2-style decoder as an ONNX graph plus a byte-level BPE tokenizer.

Nothing is downloaded and torch is not needed: the graph is written node by node with
``onnx.helper`` and the tokenizer is trained with the ``tokenizers`` library on the
bundled corpus ``shared/corpus/tiny.txt`` plus text embedded below. The weights make a
readable demo: the token embedding, an untied lm_head and its bias are fitted (numpy
Adam, a few seconds) to the smoothed bigram statistics of that corpus, so the model
writes English words; the attention and MLP blocks and the positions keep small seeded
random weights that still move the logits (the KV cache, masks and positions matter).
Same parameters, same bytes.

The graph has the input/output names of Hugging Face Optimum's
``text-generation-with-past`` export, so the engines treat it like a real exported model:

    inputs   input_ids                 [batch_size, sequence_length]                        int64
             attention_mask            [batch_size, past_sequence_length + sequence_length] int64
             position_ids              [batch_size, sequence_length]                        int64
             past_key_values.N.key     [batch_size, n_head, past_sequence_length, head_dim] float32
             past_key_values.N.value   (same)
    outputs  logits                    [batch_size, sequence_length, vocab_size]            float32
             present.N.key             [batch_size, n_head, past_sequence_length + sequence_length, head_dim]
             present.N.value           (same)

The first step passes an empty past (``past_sequence_length`` 0). Only standard opset-17
operators are used (LayerNormalization, Erf-based GELU, Range for the causal mask), so
TensorRT's ONNX parser takes the same file.

``attention = "gqa"`` (``--attention gqa``; engine.toml's ``attention`` key) writes the same
weights in the layout of the GGUF import's GroupQueryAttention graph instead
(shared/gguf_gqa.py: ``input_ids``, ``seqlens_k``, ``total_sequence_length``,
``logits_to_keep`` and KV buffers the op updates in place; ONNX Runtime's
``com.microsoft::GroupQueryAttention`` without rotary embedding, each token's position
taken from ``seqlens_k``), which workers/engines/onnx_gqa.py serves: every row attends
over exactly its own length, so batch invariance costs no extra run (docs/sampling.md).
ONNX Runtime only (TensorRT's parser does not take the contrib op).

Usage::

    python -m streamfleet.shared.tinymodel --model-dir engines/tiny-gpt     # [build] of its engine.toml
    python -m streamfleet.shared.tinymodel --out engines/bench-gpt --preset bench
    python -m streamfleet.shared.tinymodel --out /tmp/m --n-layer 1 --d-model 64 --vocab-size 512
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# Single-threaded training keeps the merges, and so the file, identical from run to run.
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from streamfleet.shared.gguf_gqa import CACHE_ROW_MULTIPLE, CACHE_ROWS_KEY, GQA_GRAPH_FILE, POSITIONS_KEY
from streamfleet.shared.modelrepo import GENERATOR_KEY, generator_digest

OPSET = 17
#: per-element std of what positions and each block add to the residual stream, next to
#: the token embedding's 1.0
BLOCK_MIX = 0.025
EOS_TOKEN = "<|endoftext|>"
#: the graph layouts (``BuildParams.attention``)
ATTENTIONS = ("concat", "gqa")


@dataclass(frozen=True)
class BuildParams:
    seed: int = 1234
    vocab_size: int = 1024
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    max_context: int = 256
    max_batch: int = 16
    #: "concat": Optimum's with-past layout (module docstring); "gqa": GroupQueryAttention
    attention: str = "concat"

    def check(self) -> None:
        if self.attention not in ATTENTIONS:
            raise SystemExit(f"attention must be one of {', '.join(ATTENTIONS)}, not {self.attention!r}")
        if self.d_model % self.n_head:
            raise SystemExit(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if self.vocab_size < 300:
            raise SystemExit("vocab_size must be at least 300 (256 bytes, the EOS token and some merges)")
        if min(self.n_layer, self.n_head, self.d_model, self.max_context, self.max_batch) < 1:
            raise SystemExit("sizes must be positive")


PRESETS: dict[str, BuildParams] = {
    "tiny": BuildParams(),
    # tens of millions of parameters: a CPU throughput benchmark with real compute per token,
    # in the layout the default model serves in (GroupQueryAttention: docs/models.md,
    # "The benchmark model"); `--attention concat` for TensorRT (scripts/gpu_check.py)
    "bench": BuildParams(seed=4321, vocab_size=8192, n_layer=8, n_head=8, d_model=512,
                         max_context=512, max_batch=32, attention="gqa"),
}

# ---------------------------------------------------------------------------------------
# Tokenizer corpus. Hand-written prose (plain English, some Chinese, some emoji), then a
# seeded stream of sentences and made-up words so that even large vocabularies fill up
# with real merges instead of reserved filler tokens.
# ---------------------------------------------------------------------------------------

BASE_CORPUS = """\
The old lighthouse stood at the edge of the harbor, and every evening the keeper climbed
the narrow stairs to light the lamp. Ships came and went with the tide; fishermen mended
their nets on the stones, and children ran along the sea wall shouting at the gulls.
In the morning the town woke slowly. Bakers opened their shutters, the smell of bread
drifted down the street, and the first carts rolled toward the market square. A teacher
unlocked the school, a doctor walked to the clinic, and a letter carrier began her round.

It was the best of seasons for travel. The roads were dry, the rivers were calm, and the
inns along the way were glad of company. Travelers told stories of distant cities, of
mountains covered in snow, of deserts where the wind carved the sand into waves.
"Where are you going?" asked the innkeeper. "North," said the traveler, "to see the
river where it begins, and then west, to the sea." She paid for her supper with two
silver coins, thanked him, and went up to bed.

Water boils at one hundred degrees Celsius at sea level. Light travels about three
hundred thousand kilometers per second. The Earth turns once a day and circles the Sun
once a year; the Moon circles the Earth about once a month. Plants turn sunlight, water
and air into sugar, and animals eat the plants. Every number can be written in many
ways: 1, 2, 3, 10, 42, 100, 256, 1024, 2048, 65536, 3.14159, 2.71828, 0.5, -7, 1e9.

A good program does one thing and does it well. Read the input, check it, compute the
answer, and write the output. When something fails, say what failed and why, so that the
person who reads the message can fix it. Tests should be fast, small and honest.
def add(a, b):
    return a + b
for i in range(10):
    print(i, i * i)
if x > 0 and y < 10: return {"name": "value", "items": [1, 2, 3], "ok": true}

Questions and answers. What is the capital of France? Paris. How many days are in a
week? Seven. Which planet is closest to the Sun? Mercury. Who wrote the play about the
prince of Denmark? Shakespeare. Why is the sky blue? Because air scatters blue light
more than red light. Thank you! You're welcome. Please, could you help me with this?
Of course; tell me what you need, and I will do my best.

Once upon a time there was a small fox who lived at the edge of a great forest. The fox
was curious about everything: the sound of the rain, the shape of the clouds, the paths
the deer made through the ferns. One winter night she followed a light through the
trees and found a cottage where an old woman sat by the fire, knitting a long red scarf.
"Come in from the cold," said the woman, and the fox, who had never been inside a house,
stepped carefully over the threshold and lay down beside the warm stones.

天气很好，我们去公园散步吧。今天是星期一，明天是星期二。我喜欢读书，也喜欢听音乐。
你好，世界！欢迎来到这里。学习一种新的语言需要时间和耐心。中国有很多美丽的城市和山水。
春天来了，花开了，鸟儿在树上唱歌。这本书很有意思，我已经读了三遍。谢谢你的帮助。
我们一起吃饭吧。他在学校学习数学和历史。她每天早上跑步。人工智能正在改变世界。
山很高，水很长，路很远。朋友们，新年快乐！请问火车站怎么走？一直往前走，然后向左转。

Emoji everywhere 😀 😃 😄 😁 😆 😂 🤣 😊 😇 🙂 🙃 😉 😍 🥰 😘 🤔 🤗 🤩 😎 🥳 😭 😡 👍 👎 👏
🙏 💪 🎉 🎂 🎁 🌍 🌎 🌏 🌞 🌙 ⭐ 🔥 💧 🌊 🍎 🍕 🍔 🍣 ☕ 🍵 🚀 ✈️ 🚗 🚲 ❤️ 💙 💚 💛 💜 🖤 ✅ ❌
Great job! 👍 See you soon 😊 Happy birthday 🎂🎉 Good night 🌙⭐ Let's go 🚀🚀🚀 I love it ❤️❤️
Naïve café, résumé, façade, jalapeño, über, São Paulo, Zürich, Ærø, smörgåsbord, crème brûlée.
"""

_WORDS = sorted(set(BASE_CORPUS.replace("\n", " ").split(" ")) - {""})
_ONSETS = ["", "b", "br", "c", "ch", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "l", "m",
           "n", "p", "pl", "qu", "r", "s", "sh", "sl", "st", "t", "th", "tr", "v", "w", "y", "z"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "ie", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "ng", "nd", "st", "ck", "rt", "sh", "th"]
_CJK = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可里后小"
    "么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知"
    "民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间"
    "新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼"
    "体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或"
    "司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认"
    "算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运"
    "武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取"
    "设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观"
    "争究包组造落视济喜离虽坏兴切具夜医"
)
_EMOJI = ("😀😃😄😁😆😂🤣😊😇🙂🙃😉😍🥰😘🤔🤗🤩😎🥳😭😡👍👎👏🙏💪🎉🎂🎁🌍🌎🌏🌞🌙⭐🔥💧"
          "🌊🍎🍕🍔🍣☕🍵🚀🚗🚲💙💚💛💜🖤✅❌")


def _synthetic_corpus(rng: np.random.Generator, n_chars: int) -> str:
    """Seeded filler: sentences mixing real and made-up words, numbers, Chinese and emoji."""
    out: list[str] = []
    size = 0
    while size < n_chars:
        kind = rng.integers(10)
        if kind < 6:  # English-ish sentence
            words = []
            for _ in range(int(rng.integers(4, 14))):
                if rng.random() < 0.55:
                    words.append(str(_WORDS[rng.integers(len(_WORDS))]))
                else:
                    sylls = int(rng.integers(1, 4))
                    words.append("".join(
                        _ONSETS[rng.integers(len(_ONSETS))] + _NUCLEI[rng.integers(len(_NUCLEI))]
                        + _CODAS[rng.integers(len(_CODAS))] for _ in range(sylls)))
            line = " ".join(words)
            line = line[:1].upper() + line[1:] + str(rng.choice([".", ".", "?", "!", ",", ";"]))
        elif kind < 8:  # Chinese phrase
            n = int(rng.integers(4, 16))
            line = "".join(_CJK[rng.integers(len(_CJK))] for _ in range(n)) + "。"
        elif kind < 9:  # numbers
            line = " ".join(str(int(rng.integers(0, 10 ** int(rng.integers(1, 6))))) for _ in range(6))
        else:  # emoji
            line = " ".join(_EMOJI[rng.integers(len(_EMOJI))] * int(rng.integers(1, 3)) for _ in range(5))
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)


def build_tokenizer(params: BuildParams) -> str:
    """Train a byte-level BPE with exactly ``vocab_size`` entries; returns its JSON text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = np.random.default_rng(params.seed)
    # The language-model corpus first, so its words become whole tokens; then enough
    # distinct words that the merges reach vocab_size (BPE stops when words run out).
    corpus = ([BASE_CORPUS] * 4 + ["\n".join(load_corpus())] * 8
              + [_synthetic_corpus(rng, 60 * params.vocab_size)])

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=params.vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],  # id 0: the EOS (engine.toml eos_token_ids = [0])
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    if tok.token_to_id(EOS_TOKEN) != 0:
        raise SystemExit(f"{EOS_TOKEN} did not get id 0")
    got = tok.get_vocab_size()
    if got != params.vocab_size:
        raise SystemExit(f"tokenizer training reached {got} tokens, wanted {params.vocab_size}")
    return tok.to_str(pretty=False)


# ---------------------------------------------------------------------------------------
# Weights fitted to the corpus
# ---------------------------------------------------------------------------------------

#: the language-model corpus (plain English prose written for this repository)
CORPUS_PATH = Path(__file__).resolve().parent / "corpus" / "tiny.txt"
#: probability the fitted model leaves, in total, to tokens the corpus never uses (the
#: 256 byte tokens, Chinese, emoji, made-up words): reachable, but rarely drawn
UNSEEN_MASS = 2e-3
#: bigram targets back off to the unigram distribution with this many pseudo-counts
BACKOFF = 0.5
#: Adam steps of the fit, and its learning rate
FIT_STEPS = 120
FIT_LR = 0.1


def load_corpus(path: Path = CORPUS_PATH) -> list[str]:
    """The corpus's paragraphs: ``#`` lines are comments, blank lines end a paragraph and
    the lines of one are joined with spaces."""
    paragraphs: list[str] = []
    lines: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines() + [""]:
        if line.startswith("#"):
            continue
        if line.strip():
            lines.append(line.strip())
        elif lines:
            paragraphs.append(" ".join(lines))
            lines = []
    return paragraphs


def _layer_norm(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """LayerNormalization without gain and bias (what the graph's LN computes, eps aside),
    and 1/std for the backward pass."""
    c = u - u.mean(axis=-1, keepdims=True)
    inv = 1.0 / np.sqrt((c * c).mean(axis=-1, keepdims=True) + 1e-5)
    return c * inv, inv


@dataclass
class Fit:
    """The output layer of a smoothed bigram model of the corpus.

    ``logits(b | a) ~= layer_norm(wte[a]) @ lm_head + lm_bias``: ``wte`` rows are zero-mean
    with unit variance, so the final LayerNorm of a residual stream dominated by the
    token embedding hands them through nearly unchanged.
    """

    wte: np.ndarray      # [vocab, d]
    lm_head: np.ndarray  # [d, vocab]
    lm_bias: np.ndarray  # [vocab]
    loss: float          # cross-entropy (nats) of the fit against the smoothed targets
    target_entropy: float


def corpus_ids(tokenizer_json: str) -> list[int]:
    """The corpus as token ids, every paragraph preceded and the last followed by EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    ids: list[int] = []
    for paragraph in load_corpus():
        ids += [0] + tok.encode(paragraph).ids
    return ids + [0]


def fit_bigram(params: BuildParams, tokenizer_json: str, rng: np.random.Generator) -> Fit:
    """Fit token embedding, unembedding and bias to the corpus's smoothed bigram
    distribution by full-batch Adam on the cross-entropy (float64, a seeded start and a
    fixed number of steps: the same bytes every run).

    Only tokens the corpus uses get their own rows and columns; every other token shares
    one input row (the corpus's unigram distribution follows it) and one output logit
    (``UNSEEN_MASS`` spread over all of them).
    """
    d, v = params.d_model, params.vocab_size
    ids = np.array(corpus_ids(tokenizer_json), dtype=np.int64)
    seen = np.unique(ids)                    # sorted token ids the corpus uses (EOS included)
    n = len(seen)
    n_other = v - n
    index = np.full(v, n, dtype=np.int64)    # token id -> row; unseen tokens share row n
    index[seen] = np.arange(n)

    counts = np.zeros((n, n))
    np.add.at(counts, (index[ids[:-1]], index[ids[1:]]), 1.0)
    unigram = counts.sum(axis=0) / counts.sum()
    row_n = counts.sum(axis=1, keepdims=True)
    keep = 1.0 - (UNSEEN_MASS if n_other else 0.0)
    target = np.zeros((n + 1, n + 1))        # rows: contexts + "unseen"; cols: tokens + "unseen"
    target[:n, :n] = (counts + BACKOFF * unigram) / (row_n + BACKOFF) * keep
    target[n, :n] = unigram * keep
    target[:, n] = 1.0 - keep
    weight = np.concatenate([row_n[:, 0] + 1.0, [4.0]])
    weight /= weight.sum()
    # the unseen column stands for n_other tokens with one logit each
    log_other = np.log(n_other) if n_other else -1e9

    u = rng.standard_normal((n + 1, d))
    w = rng.standard_normal((d, n)) * (0.1 / np.sqrt(d))
    b = np.log(unigram)
    b_other = np.array(np.log(max(1.0 - keep, 1e-12) / max(n_other, 1)))
    state = [u, w, b, b_other]
    m = [np.zeros_like(p) for p in state]
    s = [np.zeros_like(p) for p in state]
    b1, b2 = 0.9, 0.99
    loss = float("nan")
    for step in range(1, FIT_STEPS + 1):
        h, inv = _layer_norm(u)
        z = np.empty((n + 1, n + 1))
        z[:, :n] = h @ w + b
        z[:, n] = b_other + log_other
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        loss = float(-(weight[:, None] * target * np.log(np.maximum(p, 1e-300))).sum())
        dz = (p - target) * weight[:, None]
        dh = dz[:, :n] @ w.T
        du = inv * (dh - dh.mean(axis=1, keepdims=True) - h * (dh * h).mean(axis=1, keepdims=True))
        grads = [du, h.T @ dz[:, :n], dz[:, :n].sum(axis=0), dz[:, n].sum()]
        lr = FIT_LR * (0.5 + 0.5 * np.cos(np.pi * (step - 1) / FIT_STEPS))  # cosine decay
        for i, (param, grad) in enumerate(zip(state, grads)):
            m[i] = b1 * m[i] + (1 - b1) * grad
            s[i] = b2 * s[i] + (1 - b2) * grad * grad
            update = lr * (m[i] / (1 - b1 ** step)) / (np.sqrt(s[i] / (1 - b2 ** step)) + 1e-8)
            param -= update  # in place: state[i] is the same array
    entropy = float(-(weight[:, None] * target * np.log(np.maximum(target, 1e-300))).sum())

    h, _ = _layer_norm(u)
    lm_head = rng.standard_normal((d, v)) * 0.01  # unseen columns: a little seeded noise
    lm_head[:, seen] = w
    lm_bias = np.full(v, float(b_other))
    lm_bias[seen] = b
    return Fit(wte=h[index], lm_head=lm_head, lm_bias=lm_bias, loss=loss, target_entropy=entropy)


# ---------------------------------------------------------------------------------------
# ONNX graph
# ---------------------------------------------------------------------------------------


class _Graph:
    """A tiny node/initializer accumulator with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const_i64(self, name: str, values: list[int]) -> str:
        return self.init(name, np.array(values, dtype=np.int64))

    def op(self, op_type: str, inputs: list[str], name: str | None = None,
           outputs: list[str] | None = None, **attrs: Any) -> str:
        """A node; the name of its (first) output."""
        return self.ops(op_type, inputs, name, outputs=outputs, **attrs)[0]

    def ops(self, op_type: str, inputs: list[str], name: str | None = None, n_out: int = 1,
            outputs: list[str] | None = None, **attrs: Any) -> list[str]:
        """A node of ``n_out`` outputs (or ``outputs``); their names."""
        self._n += 1
        base = name or f"{op_type.lower()}_{self._n}"
        outs = outputs or ([base] if n_out == 1 else [f"{base}_{i}" for i in range(n_out)])
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"n{self._n}_{base}", **attrs))
        return outs


def build_graph(params: BuildParams, tokenizer_json: str) -> onnx.ModelProto:
    """The decoder graph (see the module docstring for the I/O): token embedding,
    unembedding and its bias fitted to the corpus (``fit_bigram``), small seeded random
    weights everywhere else; the same weights in either ``params.attention`` layout."""
    gqa = params.attention == "gqa"
    rng = np.random.default_rng(params.seed + 1)
    fit = fit_bigram(params, tokenizer_json, rng)
    d, h, v, n_ctx = params.d_model, params.n_head, params.vocab_size, params.max_context
    hd = d // h
    f32 = np.float32

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(f32)

    g = _Graph()
    # The token embedding (zero-mean rows of unit variance) dominates the residual
    # stream, so the final LayerNorm hands it to the fitted lm_head nearly unchanged and
    # the logits are the corpus's bigram model. Positions and the blocks add a seeded
    # random BLOCK_MIX of their own: attention over the whole context (the KV cache),
    # positions and the MLPs all move the logits, enough that a wrong cache, mask or
    # position changes tokens, not enough to garble the text.
    wte = g.init("transformer.wte.weight", fit.wte.astype(f32))
    pe = normal((n_ctx, d), 1.0)
    wpe = g.init("transformer.wpe.weight", (BLOCK_MIX * (pe - pe.mean(axis=1, keepdims=True))).astype(f32))
    in_std = 2.2 / np.sqrt(d)  # fan-in scaled: sharp attention, GELU past its linear part
    # c_proj outputs of about BLOCK_MIX per element: attention mixes values of std ~2,
    # the MLP's GELU outputs are ~1 over 4d inputs
    attn_proj_std = BLOCK_MIX / (2.0 * np.sqrt(d))
    mlp_proj_std = BLOCK_MIX / np.sqrt(4 * d)

    # --- masks shared by every layer -----------------------------------------------------
    one_s = g.init("one_scalar", np.array(1, dtype=np.int64))
    seq_s = g.op("Gather", [g.op("Shape", ["input_ids"]), one_s], axis=0)         # scalar S
    if gqa:
        positions = _gqa_positions(g, seq_s, one_s)
    else:
        positions = "position_ids"
        attn_bias = _attention_bias(g, seq_s, one_s)

    # --- embeddings ----------------------------------------------------------------------
    x = g.op("Add", [g.op("Gather", [wte, "input_ids"], axis=0),
                     g.op("Gather", [wpe, positions], axis=0)], name="embed")

    if not gqa:  # the with-past layout's attention, written out op by op
        heads_shape = g.const_i64("heads_shape", [0, 0, h, hd])
        model_shape = g.const_i64("model_shape", [0, 0, d])
        split_sizes = g.const_i64("qkv_split", [d, d, d])
        scale = g.init("attn_scale", np.array(1.0 / np.sqrt(hd), dtype=f32))
    half = g.init("half", np.array(0.5, dtype=f32))
    one_f = g.init("one_f", np.array(1.0, dtype=f32))
    inv_sqrt2 = g.init("inv_sqrt2", np.array(1.0 / np.sqrt(2.0), dtype=f32))

    def layer_norm(inp: str, prefix: str, gain: float = 1.0) -> str:
        gamma = g.init(f"{prefix}.weight", np.full(d, gain, dtype=f32))
        beta = g.init(f"{prefix}.bias", np.zeros(d, dtype=f32))
        return g.op("LayerNormalization", [inp, gamma, beta], axis=-1, epsilon=1e-5)

    def linear(inp: str, prefix: str, n_in: int, n_out: int, std: float, bias_std: float = 0.02) -> str:
        w = g.init(f"{prefix}.weight", normal((n_in, n_out), std))
        b = g.init(f"{prefix}.bias", normal((n_out,), bias_std))
        return g.op("Add", [g.op("MatMul", [inp, w]), b])

    cache_dims: list[str | int] = ["batch", h, "capacity", hd]
    if gqa:  # shared/gguf_gqa.py's inputs; logits_to_keep is added with the output layer
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        ]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "keep", v])]
    else:
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                          ["batch_size", "past_sequence_length + sequence_length"]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        ]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                 ["batch_size", "sequence_length", v])]

    for i in range(params.n_layer):
        p = f"transformer.h.{i}"
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        pres_k, pres_v = f"present.{i}.key", f"present.{i}.value"
        if gqa:
            for name in (past_k, past_v):
                inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, cache_dims))
            for name in (pres_k, pres_v):
                outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, cache_dims))
        else:
            for name in (past_k, past_v):
                inputs.append(helper.make_tensor_value_info(
                    name, TensorProto.FLOAT, ["batch_size", h, "past_sequence_length", hd]))
            for name in (pres_k, pres_v):
                outputs.append(helper.make_tensor_value_info(
                    name, TensorProto.FLOAT, ["batch_size", h, "past_sequence_length + sequence_length", hd]))

        a = layer_norm(x, f"{p}.ln_1")
        qkv = linear(a, f"{p}.attn.c_attn", d, 3 * d, in_std)
        if gqa:
            # packed [B, S, 3d] (query, key and value heads in that order, as c_attn makes
            # them); the op writes the new K/V into the buffers at each row's length
            ctx = g.op("GroupQueryAttention", [qkv, "", "", past_k, past_v, "seqlens_k", "total_sequence_length"],
                       domain="com.microsoft", outputs=[f"{p}.attn.out", pres_k, pres_v],
                       num_heads=h, kv_num_heads=h, do_rotary=0, scale=float(1.0 / np.sqrt(hd)))
        else:
            q, k, vv = g.ops("Split", [qkv, split_sizes], n_out=3, axis=-1)

            def heads(t: str) -> str:  # [B, S, D] -> [B, H, S, hd]
                return g.op("Transpose", [g.op("Reshape", [t, heads_shape])], perm=[0, 2, 1, 3])

            q = g.op("Mul", [heads(q), scale])
            g.op("Concat", [past_k, heads(k)], outputs=[pres_k], axis=2)
            g.op("Concat", [past_v, heads(vv)], outputs=[pres_v], axis=2)
            scores = g.op("MatMul", [q, g.op("Transpose", [pres_k], perm=[0, 1, 3, 2])])  # [B, H, S, T]
            probs = g.op("Softmax", [g.op("Add", [scores, attn_bias])], axis=-1)
            ctx = g.op("MatMul", [probs, pres_v])                                         # [B, H, S, hd]
            ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]), model_shape])
        x = g.op("Add", [x, linear(ctx, f"{p}.attn.c_proj", d, d, attn_proj_std, BLOCK_MIX)])

        m = layer_norm(x, f"{p}.ln_2")
        m = linear(m, f"{p}.mlp.c_fc", d, 4 * d, in_std)
        # GELU, the exact (Erf) form; ORT fuses this pattern into one Gelu kernel.
        gelu = g.op("Mul", [g.op("Mul", [m, half]),
                            g.op("Add", [g.op("Erf", [g.op("Mul", [m, inv_sqrt2])]), one_f])])
        x = g.op("Add", [x, linear(gelu, f"{p}.mlp.c_proj", 4 * d, d, mlp_proj_std, BLOCK_MIX)])

    x = layer_norm(x, "transformer.ln_f")
    if gqa:  # the logits of the last logits_to_keep positions only, as shared/gguf_gqa.py's
        inputs.append(helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1]))
        x = g.op("Slice", [x, g.op("Neg", ["logits_to_keep"]),
                           g.const_i64("slice_end", [int(np.iinfo(np.int64).max)]), g.const_i64("slice_axis", [1])])
    # an untied lm_head with a bias: logits = x @ lm_head + lm_bias
    lm_head = g.init("lm_head.weight", fit.lm_head.astype(f32))
    lm_bias = g.init("lm_head.bias", fit.lm_bias.astype(f32))
    g.op("Add", [g.op("MatMul", [x, lm_head]), lm_bias], outputs=["logits"])

    graph = helper.make_graph(g.nodes, "tiny_gpt", inputs, outputs, initializer=g.inits)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid("com.microsoft", 1)] if gqa else [])
    model = helper.make_model(graph, opset_imports=opsets,
                              producer_name="streamfleet.shared.tinymodel", producer_version="1")
    model.ir_version = 8  # readable by older runtimes and TensorRT's parser
    # which generator made it: a checkout with a newer generator regenerates the files
    # (streamfleet.shared.modelrepo.ensure_artifacts)
    props = {GENERATOR_KEY: generator_digest()}
    if gqa:
        # the positions the table holds (no RoPE caches bound the KV buffers' length; the
        # rows are rounded up to whole 4 KiB pages of a head's slots as the import's are)
        rows = -(-n_ctx // CACHE_ROW_MULTIPLE) * CACHE_ROW_MULTIPLE
        props |= {POSITIONS_KEY: str(n_ctx), CACHE_ROWS_KEY: str(rows)}
    helper.set_model_props(model, props)
    # the contrib op has no schema in onnx's checker: a GQA graph is checked without
    # shape inference
    onnx.checker.check_model(model, full_check=not gqa)
    return model


def _attention_bias(g: _Graph, seq_s: str, one_s: str) -> str:
    """The with-past layout's additive mask [B, 1, S, T]: causal, and 0 where
    ``attention_mask`` keeps a slot."""
    total_s = g.op("Gather", [g.op("Shape", ["attention_mask"]), one_s], axis=0)  # scalar T = past + S
    past_s = g.op("Sub", [total_s, seq_s])
    q_pos = g.op("Range", [past_s, total_s, one_s])                      # [S]: absolute query slots
    k_pos = g.op("Range", [g.init("zero_scalar", np.array(0, dtype=np.int64)), total_s, one_s])  # [T]
    q_col = g.op("Unsqueeze", [q_pos, g.const_i64("axes1", [1])])         # [S, 1]
    k_row = g.op("Unsqueeze", [k_pos, g.const_i64("axes0", [0])])                           # [1, T]
    causal = g.op("LessOrEqual", [k_row, q_col])                          # [S, T] key <= query
    keep = g.op("Cast", ["attention_mask"], to=TensorProto.BOOL)          # [B, T]
    keep = g.op("Unsqueeze", [keep, g.const_i64("axes12", [1, 2])])       # [B, 1, 1, T]
    allowed = g.op("And", [causal, keep])                                 # [B, 1, S, T]
    # A large finite negative: a fully masked row (a pad) softmaxes to uniform, not NaN.
    return g.op("Where", [allowed, g.init("zero_f", np.array(0.0, dtype=np.float32)),
                          g.init("neg_big", np.array(-1e9, dtype=np.float32))], name="attn_bias")


def _gqa_positions(g: _Graph, seq_s: str, one_s: str) -> str:
    """The GroupQueryAttention layout's position ids [B, S]: a row's ``seqlens_k`` is its
    length after the run minus one, so its tokens sit at ``seqlens_k + 1 - S + s``."""
    last = g.op("Cast", ["seqlens_k"], to=TensorProto.INT64)              # [B]
    first = g.op("Sub", [g.op("Add", [last, one_s]), seq_s])               # [B]
    steps = g.op("Range", [g.init("zero_s_gqa", np.array(0, dtype=np.int64)), seq_s, one_s])  # [S]
    return g.op("Add", [g.op("Unsqueeze", [first, g.const_i64("axes1", [1])]),
                        g.op("Unsqueeze", [steps, g.const_i64("axes0", [0])])])  # [B, S]


def param_count(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT)


# ---------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------


def _write_atomic(path: Path, data: bytes) -> None:
    # A reader (another process's ensure_artifacts) never sees a half-written file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def graph_file(params: BuildParams) -> str:
    """The graph's file name in a model folder: the GroupQueryAttention layout's is the
    name workers/engines/onnx_gqa.py looks for."""
    return GQA_GRAPH_FILE if params.attention == "gqa" else "model.onnx"


def engine_toml(name: str, params: BuildParams) -> str:
    graph = graph_file(params)
    attention = f'attention = "{params.attention}"\n' if params.attention != "concat" else ""
    return (
        f"# Generated by streamfleet.shared.tinymodel; {graph} and tokenizer.json are rebuilt\n"
        f"# from [build] when missing.\n"
        f'name = "{name}"\n'
        f'version = "1"\n'
        f'backend = "onnxruntime"\n'
        f'onnx = "{graph}"\n'
        f"{attention}"
        f'tokenizer = "tokenizer.json"\n'
        f"max_batch = {params.max_batch}\n"
        f"max_context = {params.max_context}\n"
        f"eos_token_ids = [0]\n"
        f"\n[build]\n"
        f"seed = {params.seed}\n"
        f"vocab_size = {params.vocab_size}\n"
        f"n_layer = {params.n_layer}\n"
        f"n_head = {params.n_head}\n"
        f"d_model = {params.d_model}\n"
    )


def write_model(out_dir: Path, params: BuildParams, *, onnx_name: str | None = None,
                tokenizer_name: str = "tokenizer.json", toml: bool = False) -> dict[str, float]:
    """Write the tokenizer and graph (and ``engine.toml`` when ``toml``) into ``out_dir``;
    the graph is ``onnx_name``, by default ``graph_file(params)``."""
    params.check()
    onnx_name = onnx_name or graph_file(params)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok_json = build_tokenizer(params)
    t1 = time.perf_counter()
    model = build_graph(params, tok_json)
    t2 = time.perf_counter()
    if toml:
        _write_atomic(out_dir / "engine.toml", engine_toml(out_dir.resolve().name, params).encode())
    _write_atomic(out_dir / tokenizer_name, tok_json.encode())
    _write_atomic(out_dir / onnx_name, model.SerializeToString(deterministic=True))  # last: marks done
    t3 = time.perf_counter()
    return {"params": param_count(model), "tokenizer_s": t1 - t0, "graph_s": t2 - t1, "write_s": t3 - t2}


def params_from_model_dir(model_dir: Path) -> tuple[BuildParams, str, str]:
    toml_path = model_dir / "engine.toml"
    try:
        data = tomllib.loads(toml_path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SystemExit(f"cannot read {toml_path}: {exc}") from exc
    build = data.get("build")
    if not build:
        raise SystemExit(f"{toml_path} has no [build] table")
    known = set(BuildParams.__dataclass_fields__)
    unknown = set(build) - known
    if unknown:
        raise SystemExit(f"{toml_path}: unknown [build] keys {sorted(unknown)}")
    params = replace(BuildParams(), **{k: int(v) for k, v in build.items()},
                     max_context=int(data.get("max_context", 256)),
                     max_batch=int(data.get("max_batch", 16)),
                     attention=str(data.get("attention", "concat")))
    return params, str(data.get("onnx", graph_file(params))), str(data.get("tokenizer", "tokenizer.json"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--model-dir", type=Path, help="existing folder: read [build] from its engine.toml")
    where.add_argument("--out", type=Path, help="write a complete model folder, engine.toml included")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="with --out (default tiny)")
    for fld in BuildParams.__dataclass_fields__:
        if fld != "attention":
            ap.add_argument(f"--{fld.replace('_', '-')}", type=int, dest=fld, default=None,
                            help="with --out: override the preset")
    ap.add_argument("--attention", choices=ATTENTIONS, default=None,
                    help="with --out: the graph layout (default concat: the with-past layout; gqa: "
                         "GroupQueryAttention, served by the onnx_gqa engine)")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    if args.model_dir is not None:
        overrides = [f for f in BuildParams.__dataclass_fields__ if getattr(args, f) is not None]
        if overrides:
            ap.error("--model-dir takes its parameters from engine.toml; drop " +
                     ", ".join(f"--{f.replace('_', '-')}" for f in overrides))
        params, onnx_name, tok_name = params_from_model_dir(args.model_dir)
        stats = write_model(args.model_dir, params, onnx_name=onnx_name, tokenizer_name=tok_name)
        out = args.model_dir
    else:
        params = replace(PRESETS[args.preset], **{f: getattr(args, f) for f in BuildParams.__dataclass_fields__
                                                   if getattr(args, f) is not None})
        stats = write_model(args.out, params, toml=True)
        out = args.out
    if not args.quiet:
        print(f"wrote {out}: {stats['params'] / 1e6:.2f}M parameters, {asdict(params)}; "
              f"tokenizer {stats['tokenizer_s']:.2f}s, graph {stats['graph_s']:.2f}s, "
              f"write {stats['write_s']:.2f}s, total {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
