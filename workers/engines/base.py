"""The engine interface every backend implements.

An engine owns the model and the KV cache of every live sequence; it knows nothing of
Redis, sampling or text. The worker core calls it from one thread at a time.

A step looks like::

    logits = engine.prefill([("r1", [5, 9, 2]), ("r2", [7])])   # registers r1, r2
    logits = engine.decode([("r1", 17), ("r2", 4)])             # appends one token each
    engine.release("r1")                                       # frees r1's cache

Rows of the returned logits follow the order of the input list.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from streamfleet.shared.errors import FatalError
from streamfleet.shared.modelrepo import ModelSpec

if TYPE_CHECKING:
    from pathlib import Path

    import onnxruntime as ort

    from streamfleet.workers.prefixcache import PrefixCache

__all__ = ["Engine", "SequenceError", "PAST_RE", "count_past_layers", "decodes_like_prefill", "ort_session"]


class SequenceError(Exception):
    """One sequence failed inside the engine; the others in the batch are unaffected.

    Args:
        seq_ids: the sequences that failed (they are already released).
    """

    def __init__(self, message: str, seq_ids: list[str]) -> None:
        super().__init__(message)
        self.seq_ids = seq_ids


@runtime_checkable
class Engine(Protocol):
    spec: ModelSpec
    #: most sequences the engine holds at once
    max_batch: int
    #: most tokens (prompt + generated) one sequence may reach
    max_context: int
    vocab_size: int
    #: optional (default True): a prefill of prompt + generated ids gives the logits a
    #: decode would have given at that point (a language model). A worker that takes a
    #: request over then continues it from its log instead of regenerating it; an engine
    #: whose output depends on where the prompt ends (the echo engine) says False.
    #: replays_exactly: bool

    def prefill(self, seqs: list[tuple[str, list[int]]]) -> np.ndarray:
        """Start new sequences from their prompt ids.

        Args:
            seqs: ``(seq_id, prompt_ids)`` pairs; ids not yet live, prompts non-empty.

        Returns:
            float32 array ``[len(seqs), vocab_size]``: logits at each prompt's last position.
        """
        ...

    def decode(self, seqs: list[tuple[str, int]]) -> np.ndarray:
        """Feed one token to each live sequence.

        Args:
            seqs: ``(seq_id, token_id)`` pairs of live sequences.

        Returns:
            float32 array ``[len(seqs), vocab_size]``: the next-token logits.
        """
        ...

    def release(self, seq_id: str) -> None:
        """Free a sequence's cache; unknown ids are ignored."""
        ...

    # optional: fork(src_id, dst_ids, length=None) starts sequences ``dst_ids`` with the
    # first ``length`` positions (default: all) of the cache of the live sequence
    # ``src_id``: they go on from the same prompt without a prefill of their own (the
    # ``n`` completions of one request; a causal model's cache of the prompt does not
    # change as a sequence decodes on). The worker core prefills each sequence itself
    # when an engine has no ``fork``.

    # optional, chunked prefill: start(seqs, *, from_cache=True) registers sequences with
    # what the engine's prefix cache holds of their prompts (returns the tokens each starts
    # with; ``from_cache=False``: none; ``count=False``: the lookup is not counted in the
    # cache's statistics) and extend(seqs) feeds each a chunk, returning the logits at each
    # chunk's last position (``OnnxRuntimeEngine``).

    # optional, with a prefix cache: ``decoded_blocks: bool`` says whether the blocks that
    # decode steps complete go into the cache as they complete (only where a decode step
    # gives a token a prefill's bits: ``decodes_like_prefill``). Where not, the worker
    # core computes a finished reply's blocks by a prefill while idle
    # (workers/replykeep.py; docs/scheduling.md, "Prefix cache").

    # optional, a prompt's log probabilities: extend_all(seq_id, chunk) feeds one live
    # sequence a chunk, as ``extend`` does (the same cache after it), in a run of its own,
    # and returns float32 ``[len(chunk), vocab_size]``: the logits after each of the
    # chunk's tokens, the last row ``extend``'s. ``every_position: bool`` says whether it
    # can (a graph may give the last position's logits only). A sequence that needs them
    # starts ``from_cache=False`` (a position served from the cache has no logits). The
    # worker core refuses a request for a prompt's log probabilities, naming the engine,
    # on an engine without them.

    def close(self) -> None:
        """Free everything."""
        ...


# The optional parts of an engine, each as a protocol of its own: the worker core asks an
# engine for one (``getattr``/``hasattr``) before it calls it.

class ForkingEngine(Engine, Protocol):
    def fork(self, src_id: str, dst_ids: list[str], length: int | None = None) -> None: ...


class ChunkingEngine(Engine, Protocol):
    """Chunked prefill (``start`` and ``extend``, above), with a prompt's log
    probabilities (``extend_all``) where ``every_position``."""

    def start(self, seqs: list[tuple[str, list[int]]], *, from_cache: bool = True,
              count: bool = True) -> list[int]: ...

    def extend(self, seqs: list[tuple[str, list[int]]]) -> np.ndarray: ...

    def extend_all(self, seq_id: str, chunk: list[int]) -> np.ndarray: ...


#: an Optimum with-past KV-cache input name: ``past_key_values.<layer>.<key|value>``
PAST_RE = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


def count_past_layers(input_names: Iterable[str], where: object) -> int:
    """The number of decoder layers of a ``text-generation-with-past`` graph, from its
    input names: every layer 0..N-1 must have both a key and a value input.

    Raises:
        FatalError: the inputs are not that layout (``where`` names the graph).
    """
    layers: dict[int, set[str]] = {}
    for name in input_names:
        m = PAST_RE.match(name)
        if m:
            layers.setdefault(int(m.group(1)), set()).add(m.group(2))
    n_layer = len(layers)
    if not n_layer or sorted(layers) != list(range(n_layer)) or any(v != {"key", "value"} for v in layers.values()):
        raise FatalError(f"{where} is not a text-generation-with-past graph (past_key_values.N.key/value)")
    return n_layer


def ort_session(spec: ModelSpec, threads: int | None, options: dict[str, Any], path: Path | None = None
                ) -> ort.InferenceSession:
    """An ONNX Runtime session on ``spec``'s graph (``path``: another graph of its folder;
    default: the one ``shared/execution.graph_path`` names), as every ONNX Runtime engine
    opens it (``shared/quality.open_graph``: all graph optimisations, sequential
    execution, ``threads`` intra-op threads, None: the runtime's default, all cores),
    on ``options["providers"]`` (default ``["CPUExecutionProvider"]``).

    Raises:
        FatalError: the graph cannot be loaded (the runtime's reason named).
    """
    from streamfleet.shared.execution import graph_path
    from streamfleet.shared.quality import open_graph

    if path is None:
        path = graph_path(spec)  # an ``auto`` folder's: the mode chosen for this CPU (shared/execution.py)
    try:
        return open_graph(path, threads, list(options.get("providers") or ["CPUExecutionProvider"]))
    except Exception as exc:  # onnxruntime raises its own exception types
        raise FatalError(f"cannot load {path}: {exc}") from exc


def prefill_by_extend(engine: ChunkingEngine, seqs: list[tuple[str, list[int]]]) -> np.ndarray:
    """``Engine.prefill`` as ``start`` then ``extend`` with each prompt's part the prefix
    cache did not have (both ONNX Runtime engines'); the sequences are released if the
    extend fails."""
    if not seqs:
        return np.empty((0, engine.vocab_size), dtype=np.float32)
    cached = engine.start(seqs)
    try:
        return engine.extend([(seq_id, prompt[n:]) for (seq_id, prompt), n in zip(seqs, cached)])
    except BaseException:
        for seq_id, _ in seqs:
            engine.release(seq_id)
        raise


class PrefixCachedEngine(Engine, Protocol):
    """An engine with a prefix cache (None: off): what ``decodes_like_prefill`` puts aside
    while it measures (and, where the engine counts them, its copied bytes: optional)."""

    prefix_cache: PrefixCache | None


class CachingEngine(ChunkingEngine, PrefixCachedEngine, Protocol):
    """Chunked prefill from a prefix cache: what ``workers.replykeep.ReplyKeeper`` feeds
    finished replies through."""


#: the optional count of bytes an engine copied (``PrefixCachedEngine``)
_COPIED_BYTES = "copied_bytes"


def decodes_like_prefill(engine: PrefixCachedEngine, kv_of: Callable[[str], list[np.ndarray]]) -> bool:
    """Whether a decode step gives a token the K/V bits a prefill of it gives (measured on
    ``engine``, a batch-invariant ONNX Runtime engine, with its prefix cache put aside):
    four tokens prefilled in one run, against the first two prefilled and the other two
    decoded one at a time, every layer's K/V of the last two positions compared bit for
    bit. Only then may blocks that decode steps complete go into the prefix cache
    (docs/scheduling.md, "Prefix cache"). On x86-64 they do not: ONNX Runtime's matrix
    products take one-row kernels of their own (their sums in another order) for a one-token run's
    attention, so a decoded token's K/V differ in their last bits from layer 1 on.

    ``kv_of(seq_id)`` returns a live sequence's cache, one ``[kv_heads, length, head_dim]``
    array per past input.
    """
    if engine.max_context < 4:
        return False
    v = engine.vocab_size
    ids = [1 % v, 3 % v, 5 % v, 7 % v]
    cache, engine.prefix_cache = engine.prefix_cache, None
    copied = getattr(engine, _COPIED_BYTES, None)
    try:
        engine.prefill([("\x00probe-prefill", ids)])
        want = [np.array(a[:, 2:4]) for a in kv_of("\x00probe-prefill")]
        engine.release("\x00probe-prefill")
        engine.prefill([("\x00probe-decode", ids[:2])])
        for t in ids[2:]:
            engine.decode([("\x00probe-decode", t)])
        got = [np.array(a[:, 2:4]) for a in kv_of("\x00probe-decode")]
        engine.release("\x00probe-decode")
    finally:
        engine.prefix_cache = cache
        if copied is not None:
            setattr(engine, _COPIED_BYTES, copied)
    return all(np.array_equal(a, b) for a, b in zip(want, got))
