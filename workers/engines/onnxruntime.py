"""ONNX Runtime (CPU) backend for graphs in Optimum's ``text-generation-with-past`` layout.

The layout (``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.N.key/value`` in, ``logits`` and ``present.N.key/value`` out) is read
from the graph itself: layer count, KV heads, head size, vocabulary and cache dtype, so
any model exported that way runs, not only the generated ``tiny-gpt``.

Batch invariance (``batch_invariant``, the default): a sequence gets bit for bit the
logits it would get alone, whatever else runs with it, so a seeded sampled request draws
the same tokens in any batch (docs/sampling.md, "What a seed guarantees"). ONNX Runtime
computes each row of a run independently of the other rows (MLAS splits its matrix
products over rows and columns, never over the summed dimension), but the attention's
softmax and its product with the values sum over the cache's width, and their vector
kernels group the terms by column: padding a sequence's cache to another width changes
the last bits of its logits (by how much: docs/sampling.md, "What a seed guarantees").
So in this mode nothing about a row's inputs depends on the batch:

* a prompt is prefilled unpadded, in one run with the prompts of exactly its length;
* a decode step gives a sequence of ``n`` cached tokens a past of width
  ``invariant_width(n)`` (a function of ``n`` and the engine's settings only), its
  cache right-aligned after zeros; the sequences whose widths agree share one run.

The price is one run per distinct width in a step (widths are multiples of
``invariant_quantum``, 128 by default, up to 8 of them, then 4 per doubling of the
length) and a copy of the group's caches into its past each step (one gather per input
while the group stays the same).

The padded slab (``batch_invariant = false`` in ``engine.toml``, or the constructor):
sequences of different lengths share one ``session.run``: their pasts are left-padded
to the longest, pad slots carry ``attention_mask`` 0 and each row gets its own
``position_ids``. The slab is kept between decode steps and the ``present.*`` outputs of
one step are the ``past_key_values.*`` of the next, with no copy. Membership changes are
absorbed in place where possible: a released sequence leaves an idle row (fed a pad
token, its new slot masked), a newcomer from prefill is written into an idle row, and a
live sequence left out of a step just gets a masked slot. Only when newcomers do not
fit, or padding grows too large, or idle rows have cost about two steps' work, is a new
slab assembled (one copy of every member's cache, costlier than a decode step); one
made for a newcomer longer than the last one is a quarter wider
than its longest member, so that the longer sequences that join later (a conversation's
next turn) fit into the rows others leave. Prefill runs prompts in groups of similar
length (one run per
group, left-padded) so a short prompt does not pay for a long one's padding. Faster
(one run per step), but a sequence's logits then depend in their last bits on what
shares its slab.

Graphs without ``position_ids`` (Optimum's Gemma, Gemma 2/3, BLOOM, MPT… exports) take
each token's position from its column in the cache, so padding or moving a sequence's
cache would shift its positions and silently change its output. For those the engine
never pads: a prefill runs each prompt alone, and a decode step runs the sequences in
groups of equal length, each with its own cache (docs/models.md, "Your own model: an
ONNX export"). Merged decoders
(``decoder_model_merged.onnx``) get ``use_cache_branch``; any other input the engine
does not know how to feed is refused at load, by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamfleet.shared.errors import FatalError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.shared.prefixhash import block_hashes
from streamfleet.workers.engines.base import (
    PAST_RE,
    SequenceError,
    count_past_layers,
    decodes_like_prefill,
    ort_session,
    prefill_by_extend,
)
from streamfleet.workers.engines.prefill import prefill_groups
from streamfleet.workers.prefixcache import PrefixCache

__all__ = ["InvalidSequenceError", "OnnxRuntimeEngine", "check_decode", "check_extend", "check_fork", "check_prefill",
           "invariant_width"]

log = get_logger("worker.onnxruntime")

_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}
_INDEX_DTYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
#: inputs the engine feeds (besides past_key_values.N.key/value)
_KNOWN_INPUTS = ("input_ids", "attention_mask", "position_ids", "use_cache_branch", "logits_to_keep")
#: ``logits_to_keep`` of a run that needs the last position's logits only
_KEEP_LAST = np.array([1], dtype=np.int64)
#: a prefill group may hold at most this many (padded) tokens
_PREFILL_GROUP_TOKENS = 8192
#: assemble a compact slab when more than this share of its rows sit idle in a step ...
_IDLE_ROW_SHARE = 0.25
#: ... and the idle rows computed since the slab last had none add up to this many whole
#: steps' worth: assembling a slab costs about three decode steps (``_HEADROOM``), so
#: rows that fall idle when sequences end are kept a few steps for the sequences that
#: arrive next (a conversation's next turns) instead of a new slab for each
_IDLE_WASTE = 2.0
#: ... or when its width exceeds the longest member by more than this many slots and half
_SPARE_WIDTH = 32
#: a slab made because a newcomer was longer than the last one's width is this share of
#: its longest member wider (pad slots, masked), so that the sequences that join it later
#: (a conversation's next turn: its earlier turns and a new message) fit into the rows
#: others leave instead of making a new slab each: assembling one copies every member's
#: cache, which costs several decode steps. Only then: every decode step copies the whole
#: width (the graph's present is its past and one more slot), so spare slots cost a share
#: of every step where no newcomer comes
_HEADROOM = 0.25
#: batch-invariant decoding: past widths are multiples of this many slots (and of an
#: eighth of the length's power of two, when larger) unless ``invariant_quantum`` says otherwise
_INVARIANT_QUANTUM = 128


class InvalidSequenceError(SequenceError, ValueError):
    """Some sequences of a call were refused before anything ran: a ``SequenceError``
    (the worker core ends those and retries the rest) and a ``ValueError`` (bad input)."""


def check_prefill(seqs: list[tuple[str, list[int]]], live: dict[str, Any], max_context: int,
                  vocab_size: int, max_batch: int) -> None:
    """Refuse a prefill call, or the sequences of it that cannot start.

    Raises:
        InvalidSequenceError: naming each sequence with a live id, an empty prompt, a
            prompt over ``max_context`` or a token outside ``0..vocab_size-1``.
        ValueError: an id given twice, or more than ``max_batch`` live sequences.
    """
    ids = [seq_id for seq_id, _ in seqs]
    if len(set(ids)) != len(ids):
        raise ValueError("a sequence id appears twice in one prefill call")
    bad: dict[str, str] = {}
    for seq_id, prompt in seqs:
        if seq_id in live:
            bad[seq_id] = "is already live"
        elif len(prompt) == 0:
            bad[seq_id] = "has an empty prompt"
        elif len(prompt) > max_context:
            bad[seq_id] = f"has a prompt of {len(prompt)} tokens; max_context is {max_context}"
        elif min(prompt) < 0 or max(prompt) >= vocab_size:
            bad[seq_id] = f"has a token outside 0..{vocab_size - 1}"
    if bad:
        raise InvalidSequenceError(_describe(bad), list(bad))
    if len(live) + len(seqs) > max_batch:
        raise ValueError(f"{len(live)} live + {len(seqs)} new sequences exceed max_batch {max_batch}")


def check_decode(seqs: list[tuple[str, int]], live: dict[str, Any], max_context: int,
                 vocab_size: int, release: Callable[[str], None]) -> set[str]:
    """Refuse a decode call, or the sequences of it that cannot go on; returns the ids.

    ``live`` maps ids to objects with a ``length``; ``release`` frees a refused one.

    Raises:
        InvalidSequenceError: naming the unknown sequences, those at ``max_context`` and
            those fed a token outside ``0..vocab_size-1`` (the live ones are released).
        ValueError: an id given twice.
    """
    ids = {seq_id for seq_id, _ in seqs}
    if len(ids) != len(seqs):
        raise ValueError("a sequence id appears twice in one decode step")
    bad: dict[str, str] = {}
    for seq_id, token in seqs:
        seq = live.get(seq_id)
        if seq is None:
            bad[seq_id] = "is not live"
        elif seq.length >= max_context:
            bad[seq_id] = f"is at max_context {max_context}"
        elif not 0 <= token < vocab_size:
            bad[seq_id] = f"was fed token {token}, outside 0..{vocab_size - 1}"
    if bad:
        for seq_id in bad:
            release(seq_id)
        raise InvalidSequenceError(_describe(bad), list(bad))
    return ids


def check_extend(seqs: list[tuple[str, list[int]]], live: dict[str, Any], max_context: int, vocab_size: int) -> None:
    """Refuse an extend call, naming the sequences that cannot take their chunk (``live``
    maps ids to objects with a ``length``).

    Raises:
        InvalidSequenceError: unknown sequences, empty chunks, chunks that would pass
            ``max_context``, tokens outside the vocabulary.
        ValueError: an id given twice.
    """
    if len({seq_id for seq_id, _ in seqs}) != len(seqs):
        raise ValueError("a sequence id appears twice in one extend call")
    bad: dict[str, str] = {}
    for seq_id, chunk in seqs:
        seq = live.get(seq_id)
        if seq is None:
            bad[seq_id] = "is not live"
        elif not chunk:
            bad[seq_id] = "was given no tokens"
        elif seq.length + len(chunk) > max_context:
            bad[seq_id] = f"would reach {seq.length + len(chunk)} tokens; max_context is {max_context}"
        elif min(chunk) < 0 or max(chunk) >= vocab_size:
            bad[seq_id] = f"has a token outside 0..{vocab_size - 1}"
    if bad:
        raise InvalidSequenceError(_describe(bad), list(bad))


def check_fork(src_id: str, dst_ids: list[str], live: dict[str, Any], max_batch: int, length: int | None) -> int:
    """Refuse a fork, or return the positions it copies (``length``, default all of the
    source's; ``live`` maps ids to objects with a ``length``).

    Raises:
        InvalidSequenceError: ``src_id`` is not live, or a new id already is.
        ValueError: more than ``max_batch`` live sequences, or a bad length.
    """
    src = live.get(src_id)
    bad = {src_id: "is not live"} if src is None else {}
    bad.update({d: "is already live" for d in dst_ids if d in live})
    if bad or src is None:  # (src None: in ``bad``)
        raise InvalidSequenceError(_describe(bad), list(bad))
    if len(live) + len(dst_ids) > max_batch:
        raise ValueError(f"{len(live)} live + {len(dst_ids)} forked sequences exceed max_batch {max_batch}")
    n = src.length if length is None else int(length)
    if not 0 < n <= src.length:
        raise ValueError(f"cannot fork {n} positions of a sequence of {src.length}")
    return n


def invariant_width(n: int, quantum: int, max_context: int) -> int:
    """The past width a sequence of ``n`` cached tokens decodes with in batch-invariant
    mode: ``n`` rounded up to a multiple of ``quantum``, or of an eighth of the power of two
    at or above ``n`` when that is larger (so padding stays under a quarter of the length),
    at most ``max_context - 1`` (the longest past a decode step can have) and never below
    ``n``. A function of ``n`` and the engine's settings only, never of the batch."""
    step = max(int(quantum), 1 << max(0, (n - 1).bit_length() - 3))
    return max(n, min(-(-n // step) * step, max_context - 1))


def _describe(bad: dict[str, str]) -> str:
    return "; ".join(f"sequence {seq_id!r} {why}" for seq_id, why in bad.items())


@dataclass(slots=True)
class _Seq:
    length: int
    #: own cache, one ``[kv_heads, length, head_dim]`` array per past input; None while in the slab
    kv: list[np.ndarray] | None
    #: row in the slab (meaningful while ``kv`` is None)
    row: int = -1
    #: unslabbed (``_decode_grouped``): the outputs of the run ``kv`` is a row of (its
    #: slots before the sequence's own are zeros) and that row, for a gather of the
    #: whole group at the next step; None when ``kv`` came from elsewhere
    src: list[np.ndarray] | None = None
    src_row: int = -1
    #: the token ids fed so far (prompt, then decoded), for naming its whole blocks
    ids: list[int] | None = None
    #: names of its whole blocks so far (shared/prefixhash.py); the prefix cache holds
    #: each unless it was evicted
    names: list[bytes] | None = None

    def own_kv(self) -> list[np.ndarray]:
        """``kv``, which a sequence has while it is not in the slab."""
        if self.kv is None:
            raise RuntimeError("the sequence's cache is in the slab: take it out first (_unslab)")
        return self.kv


@dataclass(slots=True)
class _Slab:
    """The padded batch of the last decode step, fed back as the next step's past."""

    rows: list[str | None]  # the sequence in each row; None: idle (released)
    past: list[np.ndarray]  # [rows, kv_heads, width, head_dim] each
    mask: np.ndarray        # [rows, width] int64: 1 where a slot holds a real token
    positions: np.ndarray   # [rows] int64: each row's real length = its next position
    #: idle rows computed since the last step without any, in whole slabs (rows / len(rows))
    idle_waste: float = 0.0

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def free_rows(self) -> list[int]:
        return [r for r, seq_id in enumerate(self.rows) if seq_id is None]


class OnnxRuntimeEngine:
    """Runs an Optimum-layout decoder on ONNX Runtime, keeping every sequence's KV cache.

    Args:
        spec: the model folder (``onnx`` graph, ``max_batch``, ``max_context``).
        threads: ``intra_op_num_threads``; None leaves ONNX Runtime's default (all cores).
        batch_invariant: every sequence gets the logits it would get alone, bit for bit
            (see the module docstring); None: ``batch_invariant`` in ``engine.toml``, else true.
            Where the graph cannot have it (``rows_independent`` is false: a 4-bit graph)
            the engine says so in its log and batches in the slab.
        invariant_quantum: the padding granularity of that mode (fewer, wider groups when
            larger); None: ``invariant_quantum`` in ``engine.toml``, else 128. At or above
            ``max_context`` every decode step is one run at full width.
        prefix_cache_mb: memory for the prefix cache (``PrefixCache``): the KV blocks of
            earlier sequences, reused by new ones that start with the same tokens; 0: none.
        prefix_block: tokens per block of that cache.
        options: ``providers`` (a list, default ``["CPUExecutionProvider"]``); others are ignored.

    Raises:
        FatalError: the graph is missing or not in the with-past layout.
    """

    def __init__(self, spec: ModelSpec, *, threads: int | None = None, batch_invariant: bool | None = None,
                 invariant_quantum: int | None = None, prefix_cache_mb: float = 0.0, prefix_block: int = 32,
                 **options: Any) -> None:
        if not spec.onnx_path.exists():
            raise FatalError(f"{spec.onnx_path} is missing; run `python -m streamfleet.shared.tinymodel "
                             f"--model-dir {spec.path}`")
        self._session = ort_session(spec, threads, options)

        self.spec = spec
        self.max_batch = spec.max_batch
        self.max_context = spec.max_context
        if batch_invariant is None:
            batch_invariant = spec.options.get("batch_invariant", True)
        if invariant_quantum is None:
            invariant_quantum = spec.options.get("invariant_quantum", _INVARIANT_QUANTUM)
        if not isinstance(batch_invariant, bool):
            raise FatalError(f"{spec.path}: batch_invariant must be true or false, not {batch_invariant!r}")
        if not (type(invariant_quantum) is int and invariant_quantum >= 1):
            raise FatalError(f"{spec.path}: invariant_quantum must be a positive integer, not {invariant_quantum!r}")
        self.invariant_quantum = invariant_quantum
        self._read_layout()
        self._seqs: dict[str, _Seq] = {}
        self._slab: _Slab | None = None
        #: the KV blocks of earlier sequences (None: no prefix cache)
        self.prefix_cache: PrefixCache | None = None
        if prefix_cache_mb > 0:
            self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20), prefix_block, spec.name, spec.version)
        #: sequences get their solo logits bit for bit, whatever the batch (module
        #: docstring); false where asked, or where the graph's kernels compute a row
        #: differently beside other rows (``rows_independent``)
        self.batch_invariant = batch_invariant and self.rows_independent()
        #: ``extend_all`` can give the logits of every position of a chunk (a prompt's log
        #: probabilities): the graph has ``logits_to_keep`` or outputs every position
        self.every_position = self._every_position()
        if batch_invariant and not self.batch_invariant:
            # info, not a warning: the default model is such a graph, and nothing is wrong with it
            log.info("batch invariance is not possible with this graph: its kernels compute a row differently "
                     "alone and beside other rows (4-bit MatMulNBits has a one-row kernel of its own); "
                     "batching in one padded slab instead, and a seeded sampled request may draw other "
                     "tokens in another batch (docs/sampling.md)", model=spec.name)
        #: blocks that decode steps complete go into the prefix cache as they complete: a
        #: decode step gives a token the K/V bits a prefill gives it (measured: never so far,
        #: a decode's past is padded to another width, and its attention is a one-row
        #: product), whatever shares its run. Where not, none does (``_decoded``)
        self.decoded_blocks = False  # (while it is measured)
        self.decoded_blocks = (self.prefix_cache is not None and self.batch_invariant
                               and decodes_like_prefill(self, lambda seq_id: self._cache_of(self._seqs[seq_id])))

    # -- graph layout ------------------------------------------------------------------

    def _read_layout(self) -> None:
        inputs = {i.name: i for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        where = self.spec.onnx_path
        n_layer = count_past_layers(inputs, where)
        for name in ("input_ids", "attention_mask"):
            if name not in inputs:
                raise FatalError(f"{where} has no {name!r} input")
        extra = sorted(n for n in inputs if n not in _KNOWN_INPUTS and not PAST_RE.match(n))
        if extra:
            raise FatalError(f"{where} has inputs this engine cannot feed: {', '.join(extra)} (it feeds "
                             f"{', '.join(_KNOWN_INPUTS)} and past_key_values.N.key/value); export the "
                             f"model with `optimum-cli export onnx --task text-generation-with-past`")
        self._index_dtypes = {}
        for name in ("input_ids", "attention_mask", "position_ids"):
            if name in inputs:
                dt = _INDEX_DTYPES.get(inputs[name].type)
                if dt is None:
                    raise FatalError(f"{where}: input {name!r} is {inputs[name].type}, expected int64 or int32")
                self._index_dtypes[name] = dt
        if "logits" not in outputs:
            raise FatalError(f"{where} has no 'logits' output")

        self._past_names = [f"past_key_values.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
        self._output_names = ["logits"] + [f"present.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
        missing = [n for n in self._output_names if n not in outputs]
        if missing:
            raise FatalError(f"{where} lacks outputs {missing}")

        first = inputs[self._past_names[0]]
        shape = first.shape
        kv_heads = shape[1] if isinstance(shape[1], int) else self.spec.options.get("num_key_value_heads")
        head_dim = shape[3] if isinstance(shape[3], int) else self.spec.options.get("head_dim")
        if not isinstance(kv_heads, int) or not isinstance(head_dim, int):
            raise FatalError(f"{where}: KV heads / head size are not fixed in the graph; "
                             f"set num_key_value_heads and head_dim in engine.toml")
        self.n_layer, self.kv_heads, self.head_dim = n_layer, kv_heads, head_dim
        self._kv_dtype = _DTYPES.get(first.type)
        if self._kv_dtype is None:
            raise FatalError(f"{where}: unsupported KV cache type {first.type} (ONNX Runtime on CPU serves "
                             f"float32 and float16 caches; re-export with --dtype fp32)")
        self._has_positions = "position_ids" in inputs
        self._has_branch = "use_cache_branch" in inputs
        #: the graph computes the logits of the last ``logits_to_keep`` positions (the GGUF
        #: import's graphs; an input, or an initializer with a default the run may override);
        #: others give every position's (Optimum) or the last one's
        self._has_keep = "logits_to_keep" in inputs or \
            any(i.name == "logits_to_keep" for i in self._session.get_overridable_initializers())
        #: no position_ids: never pad or move a cache (see the module docstring)
        self.solo = not self._has_positions

        vocab = outputs["logits"].shape[-1]
        if not isinstance(vocab, int):
            vocab = self._probe_vocab()
        self.vocab_size = int(vocab)

    def rows_independent(self) -> bool:
        """Whether this graph, on this ONNX Runtime build, gives a row bit for bit the same
        logits in a run of its own and beside other rows (a one-token prefill and one
        decode step, one row against three), which batch invariance rests on. ONNX
        Runtime's float matrix products are (measured: 1 to 16 rows); its 4-bit
        ``MatMulNBits`` (fp32 activations) is not: one row takes a kernel of its own, whose
        sums differ in the last bits from those of two rows or more."""
        v = self.vocab_size
        solo, others = (1 % v, 2 % v)
        results = []
        for tokens in ([solo], [solo, others, solo]):
            rows = len(tokens)
            ids = np.array(tokens, dtype=np.int64)[:, None]
            logits, *presents = self._run(ids, np.ones((rows, 1), np.int64), np.zeros((rows, 1), np.int64),
                                          [self._empty_past(rows)] * len(self._past_names))
            step, *_ = self._run(ids, np.ones((rows, 2), np.int64), np.ones((rows, 1), np.int64), presents)
            results.append((logits[:, -1], step[:, -1]))
        (p1, d1), (p3, d3) = results
        return all(np.array_equal(a[0], b[r]) for a, b in ((p1, p3), (d1, d3)) for r in (0, 2))

    def _every_position(self) -> bool:
        """Whether a run gives the logits of each of its positions (two, from an empty
        past): a GGUF import's graph when asked (``logits_to_keep``), an Optimum export's
        always; a graph that slices the last position itself (a GGUF import from before
        ``logits_to_keep``) does not."""
        ids = np.array([[1 % self.vocab_size, 2 % self.vocab_size]], dtype=np.int64)
        logits = self._run(ids, np.ones((1, 2), np.int64), np.arange(2, dtype=np.int64)[None],
                           [self._empty_past(1)] * len(self._past_names), keep=2)[0]
        return logits.ndim == 3 and logits.shape[1] == 2

    def _probe_vocab(self) -> int:
        ids = np.zeros((1, 1), dtype=np.int64)
        logits = self._run(ids, np.ones((1, 1), dtype=np.int64), np.zeros((1, 1), dtype=np.int64),
                           [self._empty_past(1)] * len(self._past_names))[0]
        return int(logits.shape[-1])

    def _empty_past(self, rows: int) -> np.ndarray:
        return np.zeros((rows, self.kv_heads, 0, self.head_dim), dtype=self._kv_dtype)

    def _run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray | None,
             past: list[np.ndarray], keep: int = 1) -> list[np.ndarray]:
        dt = self._index_dtypes
        feed: dict[str, Any] = {"input_ids": ids.astype(dt["input_ids"], copy=False),
                                "attention_mask": mask.astype(dt["attention_mask"], copy=False)}
        if self._has_positions:
            if positions is None:
                raise ValueError(f"{self.spec.onnx_path} takes position ids: a run needs them")
            feed["position_ids"] = positions.astype(dt["position_ids"], copy=False)
        if self._has_branch:  # a merged decoder: the no-past branch for a prefill
            feed["use_cache_branch"] = np.array([past[0].shape[2] > 0])
        if self._has_keep:
            feed["logits_to_keep"] = _KEEP_LAST if keep == 1 else np.array([keep], dtype=np.int64)
        feed.update(zip(self._past_names, past))
        return self._session.run(self._output_names, feed)

    # -- the Engine interface ------------------------------------------------------------

    def prefill(self, seqs: list[tuple[str, list[int]]]) -> np.ndarray:
        """Start new sequences; see ``Engine.prefill``. The same as ``start`` and then
        ``extend`` with each prompt's part the prefix cache did not have.

        Raises:
            InvalidSequenceError: (a ``SequenceError`` and a ``ValueError``) naming the
                sequences with a live id, an empty prompt, a prompt longer than
                ``max_context`` or a token outside the vocabulary; nothing is started.
            ValueError: an id given twice, or more than ``max_batch`` live sequences.
        """
        return prefill_by_extend(self, seqs)

    def start(self, seqs: list[tuple[str, list[int]]], *, from_cache: bool = True, count: bool = True) -> list[int]:
        """Register new sequences, each with the longest run of its prompt's blocks the
        prefix cache holds (copied into its own cache), and nothing else computed yet;
        ``extend`` feeds them the rest. Returns the tokens each starts with (a multiple of
        the block size, always less than its prompt: the last token's logits are computed).
        ``from_cache=False``: each starts empty, whatever the cache holds (a sequence
        whose prompt's log probabilities are asked for computes every position: a
        position taken from the cache has no logits); its blocks still go to the cache.
        ``count=False``: the lookups are not counted in the cache's statistics (a finished
        reply's blocks computed while idle: workers/replykeep.py).

        Raises:
            InvalidSequenceError, ValueError: as ``prefill``; nothing is started.
        """
        check_prefill(seqs, self._seqs, self.max_context, self.vocab_size, self.max_batch)
        cache = self.prefix_cache if from_cache else None
        out = []
        for seq_id, prompt in seqs:
            names, run = cache.lookup(prompt, count=count) if cache is not None else ([], [])
            if run:
                kv = [np.concatenate([blk[i] for blk in run], axis=1) for i in range(len(self._past_names))]
            else:
                kv = [np.zeros((self.kv_heads, 0, self.head_dim), dtype=self._kv_dtype) for _ in self._past_names]
            n = len(run) * (cache.block if cache is not None else 0)
            self._seqs[seq_id] = _Seq(length=n, kv=kv, ids=list(prompt[:n]), names=names[:len(run)])
            out.append(n)
        return out

    def extend(self, seqs: list[tuple[str, list[int]]]) -> np.ndarray:
        """Feed several tokens to each of some live sequences (the next chunk of a prompt
        being prefilled); returns the logits at each one's last new position.

        Sequences of exactly equal length and chunk share a run (rows are computed
        independently: the same bits as alone); a chunk's result does not depend on how
        the prompt before it was cut into chunks or taken from the prefix cache (measured
        bit for bit on both shipped graphs), except a chunk of one token after a past:
        ONNX Runtime runs one row with kernels of its own, whose last bits differ (the
        worker core never feeds a prompt such a chunk; the prefix cache always leaves two
        tokens to compute). Sequences with nothing cached yet may share a padded run in
        the slab mode, as a prefill of whole prompts always did.

        Raises:
            InvalidSequenceError: naming the unknown sequences, empty chunks, chunks that
                would pass ``max_context`` and tokens outside the vocabulary (nothing runs).
            ValueError: an id given twice.
        """
        out = np.empty((len(seqs), self.vocab_size), dtype=np.float32)
        if not seqs:
            return out
        check_extend(seqs, self._seqs, self.max_context, self.vocab_size)
        unpadded = self.solo or self.batch_invariant
        fresh: list[int] = []
        exact: dict[tuple[int, int], list[int]] = {}
        for i, (seq_id, chunk) in enumerate(seqs):
            seq = self._seqs[seq_id]
            if seq.kv is None:  # in the slab: it takes its cache out
                self._unslab(seq_id, seq)
            if seq.length == 0 and not unpadded:
                fresh.append(i)
            else:
                exact.setdefault((seq.length, len(chunk)), []).append(i)
        groups = list(exact.values())
        if fresh:
            lengths = [len(seqs[i][1]) for i in fresh]
            groups += [[fresh[j] for j in g] for g in self._prefill_groups(lengths)]
        for group in groups:
            out[group] = self._extend_group(seqs, group, unpadded)[:, -1, :]
        return out

    def extend_all(self, seq_id: str, chunk: list[int]) -> np.ndarray:
        """Feed a chunk to one live sequence, as ``extend`` does, in a run of its own, and
        return the logits of every new position: float32 ``[len(chunk), vocab_size]``,
        row ``j`` the next-token logits after ``chunk[j]`` (for a prompt's log
        probabilities: the worker core reduces them at once, chunk by chunk). The
        sequence's cache, and so what it generates next, is the same as after ``extend``;
        its last row is ``extend``'s logits bit for bit, and every row the logits a prefill
        of the prompt up to it gives (measured on float32, int8 and Optimum graphs; a
        4-bit ``MatMulNBits`` head computes one row with a kernel of its own, so on such a
        graph rows differ from a one-row run's in their last bits: docs/sampling.md).

        Raises:
            InvalidSequenceError: as ``extend``; nothing runs.
            RuntimeError: the graph gives the last position's logits only
                (``every_position`` is false).
        """
        if not self.every_position:
            raise RuntimeError(f"{self.spec.onnx_path} gives the logits of the last position only")
        check_extend([(seq_id, chunk)], self._seqs, self.max_context, self.vocab_size)
        seq = self._seqs[seq_id]
        if seq.kv is None:
            self._unslab(seq_id, seq)
        logits = self._extend_group([(seq_id, chunk)], [0], self.solo or self.batch_invariant, keep=len(chunk))
        return np.ascontiguousarray(logits[0, -len(chunk):, :], dtype=np.float32)

    def _extend_group(self, seqs: list[tuple[str, list[int]]], group: list[int], unpadded: bool,
                      keep: int = 1) -> np.ndarray:
        """One run: the chunks of ``group`` (equal past lengths), left-padded to the
        longest; returns the run's logits (``[rows, positions, vocab]``: the last ``keep``
        positions at least)."""
        members = [self._seqs[seqs[i][0]] for i in group]
        past_len = members[0].length
        width = max(len(seqs[i][1]) for i in group)
        rows = len(group)
        ids = np.zeros((rows, width), dtype=np.int64)
        mask = np.zeros((rows, past_len + width), dtype=np.int64)
        positions = np.zeros((rows, width), dtype=np.int64)
        mask[:, :past_len] = 1
        for r, i in enumerate(group):
            chunk = seqs[i][1]
            n = len(chunk)
            ids[r, width - n:] = chunk
            mask[r, past_len + width - n:] = 1
            positions[r, width - n:] = np.arange(past_len, past_len + n)
        if past_len and rows == 1:  # its own cache as the past, not a copy (a view; contiguous if it is)
            past = [np.ascontiguousarray(kv[None]) for kv in members[0].own_kv()]
        elif past_len:
            past = [np.stack([m.own_kv()[k] for m in members]) for k in range(len(self._past_names))]
        else:
            past = [self._empty_past(rows)] * len(self._past_names)
        logits, *presents = self._run(ids, mask, positions, past, keep=keep)
        total = past_len + width
        for r, (i, m) in enumerate(zip(group, members)):
            chunk = seqs[i][1]
            n = len(chunk)
            # views into the run's outputs, its real slots at the right end (only a group
            # with no past pads: chunks after a past share a run only when equally long)
            m.kv = [p[r, :, total - past_len - n:, :] for p in presents]
            m.length += n
            m.src, m.src_row = (presents, r) if unpadded else (None, -1)
            if m.ids is not None:  # (None: its blocks are no longer named, ``_decoded``)
                m.ids.extend(chunk)
            self._keep_blocks(m)
        return logits

    def _keep_blocks(self, seq: _Seq) -> None:
        """Name the sequence's blocks completed since the last call and give the prefix
        cache a copy of those it does not hold."""
        cache, ids, names = self.prefix_cache, seq.ids, seq.names
        if cache is None or ids is None or names is None:  # (ids and names are None together)
            return
        block = cache.block
        done = seq.length // block
        if done <= len(names):
            return
        cached = None
        for k in range(len(names), done):
            chain = names[-1] if names else cache.seed
            name = block_hashes(chain, ids[k * block:(k + 1) * block], block)[0]
            names.append(name)
            if cache.touch(name):
                continue
            if cached is None:
                cached = self._cache_of(seq)
            cache.put(name, [c[:, k * block:(k + 1) * block, :].copy() for c in cached])

    def _decoded(self, seq: _Seq, token: int) -> None:
        """A decode step fed ``seq`` a token. A block in the prefix cache must be exactly
        what a prefill computes, so that a prompt gets the same bits with the cache on or
        off, whatever was cached before (docs/scheduling.md, "Prefix cache"): where a
        decode step computes a token's cache with other numerics (``decoded_blocks``
        false: a past padded to another width, a one-row product), none of its blocks is
        kept from now on; else the block this token completes, if any, is."""
        if self.decoded_blocks and seq.ids is not None:
            seq.ids.append(token)
            self._keep_blocks(seq)
        else:
            seq.ids = seq.names = None

    def _unslab(self, seq_id: str, seq: _Seq) -> None:
        """Give a sequence in the slab its own copy of its cache and free its row."""
        seq.kv = [c.copy() for c in self._cache_of(seq)]
        if self._slab is not None:
            self._slab.rows[seq.row] = None
            self._slab.mask[seq.row] = 0
            self._slab.positions[seq.row] = 0
        seq.row, seq.src, seq.src_row = -1, None, -1

    def decode(self, seqs: list[tuple[str, int]]) -> np.ndarray:
        """Feed one token to each live sequence, all in one run; see ``Engine.decode``.

        Raises:
            InvalidSequenceError: (a ``SequenceError`` and a ``ValueError``) naming the
                unknown sequences, those fed a token outside the vocabulary and those
                already at ``max_context`` (these are released); nothing is run.
            ValueError: an id given twice.
        """
        if not seqs:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        check_decode(seqs, self._seqs, self.max_context, self.vocab_size, self.release)
        if self.solo or self.batch_invariant:
            return self._decode_grouped(seqs)
        slab = self._place(seqs)
        active = np.zeros(len(slab.rows), dtype=bool)
        ids = np.zeros((len(slab.rows), 1), dtype=np.int64)  # idle rows get token 0 ...
        order = []
        for seq_id, token in seqs:
            r = self._seqs[seq_id].row
            order.append(r)
            active[r] = True
            ids[r, 0] = token
        # ... and a masked slot; their position does not matter, it only has to be valid
        positions = np.where(active, slab.positions, 0)
        mask = np.concatenate([slab.mask, active[:, None].astype(np.int64)], axis=1)

        logits, *presents = self._run(ids, mask, positions[:, None], slab.past)

        slab.past, slab.mask = presents, mask
        slab.positions = slab.positions + active
        for seq_id, token in seqs:
            seq = self._seqs[seq_id]
            seq.length += 1
            self._decoded(seq, token)
        return np.ascontiguousarray(logits[order, -1, :], dtype=np.float32)

    def fork(self, src_id: str, dst_ids: list[str], length: int | None = None) -> None:
        """Start ``dst_ids`` with the first ``length`` positions (default: all) of
        ``src_id``'s cache (see ``Engine``): a sequence just prefilled owns its cache,
        which is never written to (a slab copies it in), so the new ones share it; a
        shorter prefix, or a cache already in the slab, is copied out.

        Raises:
            InvalidSequenceError: ``src_id`` is not live, or a new id already is.
            ValueError: more than ``max_batch`` live sequences.
        """
        n = check_fork(src_id, dst_ids, self._seqs, self.max_batch, length)
        src = self._seqs[src_id]
        if src.kv is not None and n == src.length:
            cache = src.kv
        else:
            cache = [c[:, :n, :].copy() for c in self._cache_of(src)]
        block = self.prefix_cache.block if self.prefix_cache is not None else 1
        for d in dst_ids:
            self._seqs[d] = _Seq(length=n, kv=list(cache),
                                 ids=None if src.ids is None else src.ids[:n],
                                 names=None if src.names is None else src.names[:n // block])

    def release(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None and seq.kv is None and self._slab is not None:
            self._slab.rows[seq.row] = None
            self._slab.mask[seq.row] = 0
            self._slab.positions[seq.row] = 0

    def close(self) -> None:
        self._seqs.clear()
        self._slab = None

    # -- internals -----------------------------------------------------------------------

    @staticmethod
    def _equal_groups(lengths: list[int]) -> list[list[int]]:
        """Indices grouped by exactly equal length: nothing is ever padded."""
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault(n, []).append(i)
        return list(groups.values())

    def _past_width(self, n: int) -> int:
        """The past width a sequence of ``n`` cached tokens decodes with, unslabbed."""
        return n if self.solo else invariant_width(n, self.invariant_quantum, self.max_context)

    def _decode_grouped(self, seqs: list[tuple[str, int]]) -> np.ndarray:
        """A decode step in groups of equal past width (``_past_width``), each row its own
        cache right-aligned in that width after zeros: for a graph without ``position_ids``
        the width is the length (never padded); in batch-invariant mode a function of the
        length, so a row's inputs are the same whatever shares its run."""
        out = np.empty((len(seqs), self.vocab_size), dtype=np.float32)
        groups: dict[int, list[int]] = {}
        for i, (seq_id, _) in enumerate(seqs):
            groups.setdefault(self._past_width(self._seqs[seq_id].length), []).append(i)
        for width, group in groups.items():
            members = [self._seqs[seqs[i][0]] for i in group]
            ids = np.array([[seqs[i][1]] for i in group], dtype=np.int64)
            lengths = np.array([m.length for m in members], dtype=np.int64)
            mask = (np.arange(width + 1) >= (width - lengths)[:, None]).astype(np.int64)
            logits, *presents = self._run(ids, mask, lengths[:, None], self._grouped_past(members, width))
            out[group] = logits[:, -1, :]
            for r, (i, m) in enumerate(zip(group, members)):
                m.length += 1
                m.kv = [p[r, :, width + 1 - m.length:, :] for p in presents]
                m.src, m.src_row = presents, r
                self._decoded(m, seqs[i][1])
        return out

    def _grouped_past(self, members: list[_Seq], width: int) -> list[np.ndarray]:
        """The past inputs of one group of ``_decode_grouped``: each member's cache after
        zeros, ``width`` slots. The members that come from one earlier run whose outputs
        are at least that wide (the group of the last step, the usual case) are taken from
        it by one gather per input (none at all when that run was exactly this group at
        this width), the others row by row."""
        rows = len(members)
        by_src: dict[int, tuple[list[np.ndarray], list[int]]] = {}  # id(src) -> (src, its rows here)
        for r, m in enumerate(members):
            if m.src is not None and m.src[0].shape[2] >= width:
                by_src.setdefault(id(m.src), (m.src, []))[1].append(r)
        if len(by_src) == 1 and len((only := next(iter(by_src.values())))[1]) == rows:
            src = only[0]
            cut = src[0].shape[2] - width
            if [m.src_row for m in members] == list(range(src[0].shape[0])):
                return [np.ascontiguousarray(p[:, :, cut:, :]) if cut else p for p in src]
            idx = np.array([m.src_row for m in members], dtype=np.int64)
            return [p[idx, :, cut:, :] for p in src]
        past = [np.zeros((rows, self.kv_heads, width, self.head_dim), dtype=self._kv_dtype)
                for _ in self._past_names]
        for src, rs in by_src.values():
            cut = src[0].shape[2] - width
            idx = np.array([members[r].src_row for r in rs], dtype=np.int64)
            for buf, p in zip(past, src):
                buf[rs] = p[idx, :, cut:, :]
        taken = {r for _, rs in by_src.values() for r in rs}
        for r, m in enumerate(members):
            if r not in taken:
                for buf, kv in zip(past, m.own_kv()):
                    buf[r, :, width - m.length:, :] = kv
        return past

    @staticmethod
    def _prefill_groups(lengths: list[int]) -> list[list[int]]:
        """Indices grouped by similar length, longest first within each group."""
        return prefill_groups(lengths, _PREFILL_GROUP_TOKENS)

    def _place(self, seqs: list[tuple[str, int]]) -> _Slab:
        """The slab for this step: the current one with newcomers written into idle
        rows when they fit and too little is wasted (``_IDLE_ROW_SHARE``,
        ``_IDLE_WASTE``, ``_SPARE_WIDTH``), else a new compact one."""
        slab = self._slab
        if slab is None:
            return self._assemble([seq_id for seq_id, _ in seqs])
        newcomers = [self._seqs[seq_id] for seq_id, _ in seqs if self._seqs[seq_id].kv is not None]
        free = slab.free_rows()
        idle = len(slab.rows) - len(seqs)
        longest = max(self._seqs[seq_id].length for seq_id, _ in seqs)
        slab.idle_waste = slab.idle_waste + idle / len(slab.rows) if idle else 0.0
        longer = any(s.length > slab.width for s in newcomers)
        if (len(newcomers) > len(free) or longer
                or (idle > _IDLE_ROW_SHARE * len(slab.rows) and slab.idle_waste >= _IDLE_WASTE)
                or slab.width - longest > max(_SPARE_WIDTH, longest // 2)):
            return self._assemble([seq_id for seq_id, _ in seqs], headroom=longer)
        width = slab.width
        for seq_id, _ in seqs:
            seq = self._seqs[seq_id]
            if seq.kv is None:
                continue
            r = free.pop(0)
            n = seq.length
            for buf, kv in zip(slab.past, seq.kv):
                buf[r, :, : width - n, :] = 0
                buf[r, :, width - n:, :] = kv
            slab.mask[r] = 0
            slab.mask[r, width - n:] = 1
            slab.positions[r] = n
            slab.rows[r] = seq_id
            seq.kv, seq.row = None, r
        return slab

    def _cache_of(self, seq: _Seq) -> list[np.ndarray]:
        """A sequence's real slots, ``[kv_heads, length, head_dim]`` per past input."""
        if seq.kv is not None:
            return seq.kv
        slab = self._slab
        assert slab is not None
        width, n, row = slab.width, seq.length, seq.row
        if slab.mask[row, width - n:].all():  # the usual case: one run at the right end
            return [p[row, :, width - n:, :] for p in slab.past]
        keep = slab.mask[row].astype(bool)  # it sat out some steps: masked slots inside
        return [p[row][:, keep, :] for p in slab.past]

    def _assemble(self, ids: list[str], headroom: bool = False) -> _Slab:
        """A new slab of exactly ``ids``, left-padded to the longest (and ``_HEADROOM``
        more with ``headroom``). Live sequences of the old slab that are not in ``ids``
        get their own copy of their cache."""
        members = [self._seqs[i] for i in ids]
        longest = max(s.length for s in members)
        width = max(longest, min(longest + int(longest * _HEADROOM), self.max_context - 1)) if headroom else longest
        rows = len(ids)
        chosen = set(ids)
        for seq_id, seq in self._seqs.items():
            if seq.kv is None and seq_id not in chosen:
                seq.kv = [c.copy() for c in self._cache_of(seq)]

        past = [np.zeros((rows, self.kv_heads, width, self.head_dim), dtype=self._kv_dtype)
                for _ in self._past_names]
        mask = np.zeros((rows, width), dtype=np.int64)
        for r, seq in enumerate(members):
            for buf, kv in zip(past, self._cache_of(seq)):
                buf[r, :, width - seq.length:, :] = kv
            mask[r, width - seq.length:] = 1
        for r, seq in enumerate(members):
            seq.kv, seq.row = None, r
        self._slab = _Slab(rows=list(ids), past=past, mask=mask,
                           positions=np.array([s.length for s in members], dtype=np.int64))
        return self._slab
