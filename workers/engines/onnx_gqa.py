"""ONNX Runtime (CPU) engine for the GGUF import's ``GroupQueryAttention`` graph
(shared/gguf_gqa.py): one preallocated KV buffer per layer input, shared between past and
present, and decode steps that run over exactly the live rows.

The buffers: ``past_key_values.N.key/value`` are each one numpy array ``[rows, kv_heads,
capacity, head_dim]``. Live sequences hold the first rows, one row each; a sequence's
tokens are the first ``length`` slots of its row. A run binds a contiguous slice of rows
of every buffer (a view: no copy) as both the op's past input and its present output
(ONNX Runtime's ``IOBinding``), and the op writes each row's new K/V in place at the
row's own length (``seqlens_k``) and attends over exactly that row's slots. So:

* a decode step is one run over the rows ``[first, last]`` of the sequences it feeds (the
  live rows, usually all of them); a live row inside that range that is not fed (a prompt
  being prefilled in chunks, a sequence sitting the step out) computes a scratch token
  whose K/V lands in its first free slot, which its next real token overwrites;
* a prompt, or a chunk of one, runs alone in its own row (S tokens, one row): the op
  takes a later chunk after a past ("subsequent prompt") only in a run of one row without
  its ``query_seqlens`` input, and a run of one row keeps the logits of its last position
  only (right-padded prompts in one run would need every position's);
* the buffers hold ``max_batch`` rows of the whole context from the start, and take memory
  only where tokens are written (4 KiB pages of a private mapping, ``_KvBuffer``), so they
  never grow and no cache is copied to grow them (where the system refuses a mapping that
  large, they start at the size a run needs and double, the live rows' slots copied);
  ``release`` moves the last live row into the freed one (a copy of that sequence's
  slots), so the live rows stay first, and gives back the pages the two rows no longer
  use; when the last sequence leaves, the buffers are dropped.

No ``Concat``, no padding, no per-step copy of the cache, no per-width grouping.

Batch invariance (``batch_invariant``): the op computes each row's attention over its own
length only, so a row's logits depend on the rest of its run only through the matrix
products, which ONNX Runtime computes row by row except where one row takes a kernel of
its own. Measured at load (``rows_probe``): fp32 and 8-bit-activation graphs give a row the
same bits in a run of 1 to 32 rows; 4-bit ``MatMulNBits`` with fp32 activations gives a
lone row other bits than 2 rows or more, and the same bits for any 2 or more. For such a
graph the engine runs every one-token run with at least two rows (``min_rows`` 2: a lone
decode or one-token chunk takes a neighbouring row, live or spare, as scratch), which
makes it batch-invariant too, at the price of a second row's work at batch 1.

Prefix cache: supported as in ``OnnxRuntimeEngine`` (a sequence starts from cached blocks
copied into its row; blocks a prefill completes are kept). A chunk of a prompt gives the
same bits as the whole prompt (rows are independent for runs of two or more rows, and the
op's attention does not depend on how the past was filled). Blocks that decode steps
complete are kept only where a decode step gives a token the K/V bits a prefill gives it
(``decoded_blocks``, measured at load: ``decodes_like_prefill``); on x86-64 it does not
(the op's one-row products take kernels of their own), and the worker core computes a
finished reply's blocks by a prefill while idle instead (workers/replykeep.py).
"""

from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamfleet.shared.errors import FatalError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.shared.prefixhash import block_hashes
from streamfleet.workers.engines.base import count_past_layers, decodes_like_prefill, ort_session, prefill_by_extend
from streamfleet.workers.engines.onnxruntime import check_decode, check_extend, check_fork, check_prefill
from streamfleet.workers.prefixcache import PrefixCache

__all__ = ["OnnxGqaEngine"]

log = get_logger("worker.onnx_gqa")

#: the inputs the engine feeds besides ``past_key_values.N.key/value``
_INPUTS = ("input_ids", "seqlens_k", "total_sequence_length", "logits_to_keep")
#: the first capacity (tokens) of new buffers, unless a sequence needs more
_MIN_CAPACITY = 64
_KEEP_LAST = np.array([1], dtype=np.int64)


@dataclass(slots=True)
class _Seq:
    length: int
    row: int
    #: the token ids fed so far, for naming its whole blocks (None once a token was
    #: decoded, unless the engine keeps decoded blocks: ``decoded_blocks``)
    ids: list[int] | None = None
    #: names of its whole blocks so far (shared/prefixhash.py)
    names: list[bytes] | None = None


#: Linux's MAP_NORESERVE (the mmap module names it from Python 3.13 on)
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0


class _KvBuffer:
    """One KV buffer, fp32 ``[rows, kv_heads, capacity, head_dim]``, whose memory is taken
    only where it is written and can be given back by range.

    The op reads a row's first ``length`` slots only, all written before, so the buffer
    starts unwritten: a private anonymous mapping of 4 KiB pages, faulted in as tokens
    land, that ``trim`` returns to the system (``MADV_DONTNEED``: the pages read as zeros
    again). Not numpy's own allocation, which asks for transparent huge pages: a 2 MiB page
    spans many rows' slots, so the first token of each row made the whole buffer resident
    (docs/models.md, "Speed beside llama.cpp", has the figures). ``MAP_NORESERVE``: a
    mapping this size is address space, not memory, and the kernel's default (heuristic)
    overcommit does not count it.

    Raises:
        OSError: the system refuses the mapping (strict overcommit, a small address space).
    """

    __slots__ = ("map", "array")

    def __init__(self, shape: tuple[int, int, int, int]) -> None:
        count = int(np.prod(shape))
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", _MAP_NORESERVE)
        self.map = mmap.mmap(-1, max(count * 4, 1), flags=flags)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # where transparent huge pages are "always"
            self.map.madvise(mmap.MADV_NOHUGEPAGE)
        self.array = np.frombuffer(self.map, dtype=np.float32, count=count).reshape(shape)

    def trim(self, row: int, keep: int) -> None:
        """Give back the whole pages of ``row`` past each head's first ``keep`` slots."""
        _, heads, cap, dim = self.array.shape
        if keep >= cap:
            return
        page = mmap.PAGESIZE
        for h in range(heads):
            first = ((row * heads + h) * cap + keep) * dim * 4
            last = ((row * heads + h + 1) * cap) * dim * 4
            lo = -(-first // page) * page  # whole pages only: a shared edge page stays
            hi = last // page * page
            if hi > lo:
                self.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class OnnxGqaEngine:
    """Serves a ``model.gqa.onnx`` graph with in-place KV buffers (module docstring).

    Args:
        spec: the model folder; the graph is ``graph`` or ``model.gqa.onnx`` in it, built
            from the folder's GGUF ``[source]`` when missing (shared/gguf_gqa.py).
        threads: ``intra_op_num_threads``; None leaves ONNX Runtime's default.
        batch_invariant: every sequence gets its solo logits bit for bit (None:
            ``batch_invariant`` in ``engine.toml``, else true); where the graph needs it,
            one-token runs take two rows (``min_rows``).
        prefix_cache_mb, prefix_block: the prefix cache, as ``OnnxRuntimeEngine``'s.
        graph: the graph's path (default: the folder's ``model.gqa.onnx``).
        options: ``providers``; others are ignored.

    Raises:
        FatalError: the graph is missing and cannot be built, or not in this layout.
    """

    def __init__(self, spec: ModelSpec, *, threads: int | None = None, batch_invariant: bool | None = None,
                 prefix_cache_mb: float = 0.0, prefix_block: int = 32, graph: Path | str | None = None,
                 **options: Any) -> None:
        from streamfleet.shared.execution import AUTO, graph_path
        from streamfleet.shared.gguf_gqa import ensure_gqa_graph

        if graph is not None:
            path = Path(graph)
        elif spec.options.get("weights") == AUTO:  # the mode measured fastest on this CPU (shared/execution.py)
            path = graph_path(spec)
        else:
            path = ensure_gqa_graph(spec)
        self._session = ort_session(spec, threads, options, path)
        self.spec = spec
        self.graph_path = path
        self.max_batch = spec.max_batch
        self._read_layout(path)
        if batch_invariant is None:
            batch_invariant = spec.options.get("batch_invariant", True)
        if not isinstance(batch_invariant, bool):
            raise FatalError(f"{spec.path}: batch_invariant must be true or false, not {batch_invariant!r}")
        self._kv: list[np.ndarray] | None = None
        self._maps: list[_KvBuffer] | None = None
        #: the first buffers are as large as the engine can need (``_ensure``); false where
        #: the system refused that, or to test growth
        self.whole_buffers = True
        self._order: list[str] = []
        self._seqs: dict[str, _Seq] = {}
        self._io: Any = None
        self._bound: tuple[int, int, int] | None = None
        #: bytes copied by growing, moving and forking (for measurements)
        self.copied_bytes = 0
        #: ``extend_all`` gives every position's logits (the graph takes ``logits_to_keep``)
        self.every_position = True
        self.prefix_cache: PrefixCache | None = None
        if prefix_cache_mb > 0:
            self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20), prefix_block, spec.name, spec.version)
        #: how rows of a run relate: "independent" (1 to N rows alike), "two" (alike from 2 rows on)
        #: or "dependent"
        self.rows_probe = self._probe_rows()
        self.min_rows = 2 if batch_invariant and self.rows_probe == "two" else 1
        self.batch_invariant = batch_invariant and self.rows_probe != "dependent"
        if batch_invariant and not self.batch_invariant:
            log.info("batch invariance is not possible with this graph: its kernels compute a row differently "
                     "beside other rows", model=spec.name)
        #: blocks that decode steps complete go into the prefix cache as they complete: a
        #: decode step gives a token the K/V bits a prefill gives it (measured), whatever
        #: shares its run (``batch_invariant``). Where not, none does (module docstring)
        self.decoded_blocks = False  # (while it is measured)
        self.decoded_blocks = (self.prefix_cache is not None and self.batch_invariant
                               and decodes_like_prefill(self, self._kv_of))

    # -- layout ----------------------------------------------------------------------------

    def _read_layout(self, path: Path) -> None:
        inputs = {i.name: i for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        n_layer = count_past_layers(inputs, path)
        missing = [n for n in _INPUTS if n not in inputs]
        if missing or "logits" not in outputs:
            raise FatalError(f"{path} is not a GroupQueryAttention graph of shared/gguf_gqa.py (it lacks "
                             f"{', '.join(missing or ['logits'])})")
        self._past_names = [f"past_key_values.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
        self._present_names = [f"present.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
        shape = inputs[self._past_names[0]].shape
        if not (isinstance(shape[1], int) and isinstance(shape[3], int)):
            raise FatalError(f"{path}: KV heads / head size are not fixed in the graph")
        self.n_layer, self.kv_heads, self.head_dim = n_layer, int(shape[1]), int(shape[3])
        self.vocab_size = int(outputs["logits"].shape[-1])
        meta = self._session.get_modelmeta().custom_metadata_map
        positions = int(meta.get("streamfleet.gqa.max_positions", 0))
        if positions < 2:
            raise FatalError(f"{path} does not say how many positions its RoPE caches hold")
        # one position is kept for an idle row's scratch slot (a row at its longest still
        # takes a scratch token when it sits out a step)
        self.max_context = min(self.spec.max_context, positions - 1)
        # whole buffers' rows: the context plus the scratch slot, rounded up to whole pages of
        # a head's slots where the RoPE caches reach that far (each head's run of slots then
        # starts on a page of its own, so ``_KvBuffer.trim`` gives back every page of a row)
        per_page = max(1, mmap.PAGESIZE // (self.head_dim * 4))
        aligned = -(-(self.max_context + 1) // per_page) * per_page
        rows = int(meta.get("streamfleet.gqa.cache_rows", positions))  # shared/gguf_gqa.CACHE_ROWS_KEY
        self._whole_slots = aligned if aligned <= rows else self.max_context + 1

    def _probe_rows(self) -> str:
        """Whether a row gets the same logits alone, beside one row and beside two (rows 0
        and 2 of the three-row run hold the same sequence): "independent", "two" (alike
        from two rows on, a lone row differs) or "dependent"."""
        saved = self._kv
        self._kv = [np.zeros((3, self.kv_heads, 8, self.head_dim), np.float32) for _ in self._past_names]
        self._bound = None
        try:
            v = self.vocab_size
            for r, prompt in enumerate(([1 % v, 3 % v], [2 % v, 4 % v, 5 % v], [1 % v, 3 % v])):
                self._run(r, r + 1, np.array([prompt], np.int64), [len(prompt) - 1])
            tok = np.array([[6 % v], [7 % v], [6 % v]], np.int64)
            one = self._run(0, 1, tok[:1], [2])
            two = self._run(0, 2, tok[:2], [2, 3])
            three = self._run(0, 3, tok, [2, 3, 2])
        finally:
            self._kv = saved
            self._bound = None
        alike = np.array_equal(two[0], three[0]) and np.array_equal(three[0], three[2])
        if alike and np.array_equal(one[0], three[0]):
            return "independent"
        return "two" if alike else "dependent"

    # -- buffers and runs -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots per row of the buffers (0 before any)."""
        return 0 if self._kv is None else self._kv[0].shape[2]

    @property
    def rows(self) -> int:
        """Rows of the buffers (0 before any)."""
        return 0 if self._kv is None else self._kv[0].shape[0]

    def _ensure(self, rows: int, slots: int) -> None:
        """Buffers of at least ``rows`` rows and ``slots`` slots a row. The first ones are
        as large as the engine can ever need (``max_batch`` rows of the whole context):
        their memory is taken only as tokens are written (``_KvBuffer``), so they never
        grow, and nothing is copied to grow them. Where the system refuses mappings that
        large (``whole_buffers`` turns false), they are the power of two the run needs and
        double where short, the live rows' slots copied over."""
        rows = max(rows, self.min_rows)
        if self._kv is not None and self.rows >= rows and self.capacity >= slots:
            return
        limit = self.max_context + 1
        if slots > limit:
            raise ValueError(f"{slots} slots exceed the context of {self.max_context} tokens (+1 scratch)")
        most = max(self.max_batch, self.min_rows)
        fresh: list[_KvBuffer] | None = None
        if self.whole_buffers and self._kv is None:
            try:
                fresh = [_KvBuffer((most, self.kv_heads, self._whole_slots, self.head_dim))
                         for _ in self._past_names]
            except (OSError, ValueError, OverflowError) as e:
                self.whole_buffers = False
                log.info("KV buffers of the whole context refused: they grow by doubling", model=self.spec.name,
                         rows=most, slots=limit, error=str(e))
        if fresh is None:
            new_rows = self.rows if self.rows >= rows else max(rows, min(max(2 * self.rows, _pow2(rows)), most))
            cap = self.capacity
            new_cap = cap if cap >= slots else min(max(2 * cap, _pow2(slots), _MIN_CAPACITY), limit)
            fresh = [_KvBuffer((new_rows, self.kv_heads, new_cap, self.head_dim)) for _ in self._past_names]
        if self._kv is not None:
            for seq in self._seqs.values():  # each live row's own slots, not its whole old capacity
                for new, old in zip(fresh, self._kv):
                    new.array[seq.row, :, :seq.length] = old[seq.row, :, :seq.length]
                    self.copied_bytes += old[seq.row, :, :seq.length].nbytes
        self._maps = fresh
        self._kv = [b.array for b in fresh]
        self._bound = None

    def _run(self, lo: int, hi: int, ids: np.ndarray, seqlens: list[int] | np.ndarray, keep: int = 1) -> np.ndarray:
        """One run over rows ``[lo, hi)`` of the buffers: ``ids`` [hi - lo, S], each row's
        length after the run minus one in ``seqlens``; returns the logits [rows, keep, vocab]."""
        io = self._io
        if io is None or self._bound != (lo, hi, id(self._buffers[0])):
            io = self._io = self._session.io_binding()
            io.bind_output("logits", "cpu")  # first: output 0
            for past, present, buf in zip(self._past_names, self._present_names, self._buffers):
                view = buf[lo:hi]
                shape = list(view.shape)
                io.bind_input(past, "cpu", 0, np.float32, shape, view.ctypes.data)
                io.bind_output(present, "cpu", 0, np.float32, shape, view.ctypes.data)
            self._bound = (lo, hi, id(self._buffers[0]))
        # the fed arrays stay referenced here until the run is over
        fed: dict[str, np.ndarray] = {"input_ids": np.ascontiguousarray(ids, dtype=np.int64),
                                      "seqlens_k": np.ascontiguousarray(seqlens, dtype=np.int32)}
        fed["total_sequence_length"] = np.array(int(fed["seqlens_k"].max()) + 1, dtype=np.int32)
        fed["logits_to_keep"] = _KEEP_LAST if keep == 1 else np.array([keep], dtype=np.int64)
        for name, value in fed.items():
            io.bind_cpu_input(name, value)
        io.bind_output("logits", "cpu")
        self._session.run_with_iobinding(io)
        logits = io.get_outputs()[0].numpy()
        assert logits.shape[-1] == self.vocab_size, logits.shape
        return np.array(logits, copy=True)

    @property
    def _buffers(self) -> list[np.ndarray]:
        """The KV buffers, one per past input (``_ensure`` makes them; None while nothing
        is live)."""
        kv = self._kv
        if kv is None:
            raise RuntimeError("no KV buffers: _ensure() makes them")
        return kv

    def _kv_of(self, seq_id: str) -> list[np.ndarray]:
        """A live sequence's slots, ``[kv_heads, length, head_dim]`` per past input (views)."""
        seq = self._seqs[seq_id]
        return [buf[seq.row, :, :seq.length] for buf in self._buffers]

    def _scratch_range(self, lo: int, hi: int) -> tuple[int, int]:
        """``[lo, hi)`` widened to ``min_rows`` rows (a neighbouring row, live or spare)."""
        while hi - lo < self.min_rows:
            if hi < self.rows:
                hi += 1
            else:
                lo -= 1
        return lo, hi

    def _row_lengths(self, lo: int, hi: int) -> np.ndarray:
        """The current length of each row in ``[lo, hi)`` (0 for a spare row)."""
        out = np.zeros(hi - lo, dtype=np.int64)
        for r in range(lo, min(hi, len(self._order))):
            out[r - lo] = self._seqs[self._order[r]].length
        return out

    def _one_token_run(self, rows: list[int], tokens: list[int]) -> np.ndarray:
        """One token for each of ``rows`` in one run over the rows they span (and
        ``min_rows``); the rows between them take a scratch token in their first free
        slot. Returns the logits [len(rows), vocab] in the order given."""
        lo, hi = self._scratch_range(min(rows), max(rows) + 1)
        lengths = self._row_lengths(lo, hi)
        self._ensure(hi, int(lengths.max()) + 1)
        ids = np.zeros((hi - lo, 1), dtype=np.int64)
        for r, t in zip(rows, tokens):
            ids[r - lo, 0] = t
        logits = self._run(lo, hi, ids, lengths)
        return logits[np.asarray(rows) - lo, -1, :]

    # -- the Engine interface ---------------------------------------------------------------

    def prefill(self, seqs: list[tuple[str, list[int]]]) -> np.ndarray:
        """Start new sequences; see ``Engine.prefill`` (``start`` then ``extend``)."""
        return prefill_by_extend(self, seqs)

    def start(self, seqs: list[tuple[str, list[int]]], *, from_cache: bool = True, count: bool = True) -> list[int]:
        """Register new sequences in the next free rows, each with the longest run of its
        prompt's blocks the prefix cache holds copied into its row (none with
        ``from_cache=False``; ``count=False``: the lookups are not counted); returns the
        tokens each starts with (see ``OnnxRuntimeEngine.start``)."""
        check_prefill(seqs, self._seqs, self.max_context, self.vocab_size, self.max_batch)
        cache = self.prefix_cache if from_cache else None
        self._ensure(len(self._order) + len(seqs), max(len(p) for _, p in seqs))
        block = cache.block if cache is not None else 0
        out = []
        for seq_id, prompt in seqs:
            names, run = cache.lookup(prompt, count=count) if cache is not None else ([], [])
            n = len(run) * block
            row = len(self._order)
            if run:
                for k, buf in enumerate(self._buffers):
                    for j, blk in enumerate(run):  # each block straight into its slots
                        buf[row, :, j * block:(j + 1) * block, :] = blk[k]
            self._order.append(seq_id)
            self._seqs[seq_id] = _Seq(length=n, row=row, ids=list(prompt[:n]), names=names[:len(run)])
            out.append(n)
        return out

    def extend(self, seqs: list[tuple[str, list[int]]]) -> np.ndarray:
        """Feed the next chunk of a prompt to each of some live sequences, each in a run
        of its own row; returns the logits at each one's last new position.

        Raises:
            InvalidSequenceError: naming the unknown sequences, empty chunks, chunks that
                would pass ``max_context`` and tokens outside the vocabulary (nothing runs).
            ValueError: an id given twice.
        """
        out = np.empty((len(seqs), self.vocab_size), dtype=np.float32)
        if not seqs:
            return out
        check_extend(seqs, self._seqs, self.max_context, self.vocab_size)
        for i, (seq_id, chunk) in enumerate(seqs):
            out[i] = self._feed(self._seqs[seq_id], chunk)[-1]
        return out

    def extend_all(self, seq_id: str, chunk: list[int]) -> np.ndarray:
        """Feed a chunk to one live sequence as ``extend`` does and return the logits of
        every new position, float32 ``[len(chunk), vocab_size]`` (a prompt's log
        probabilities; ``Engine``): the same run, with ``logits_to_keep`` the chunk's length.

        Raises:
            InvalidSequenceError: as ``extend``; nothing runs.
        """
        check_extend([(seq_id, chunk)], self._seqs, self.max_context, self.vocab_size)
        return np.ascontiguousarray(self._feed(self._seqs[seq_id], chunk, keep=len(chunk)), dtype=np.float32)

    def _feed(self, seq: _Seq, chunk: list[int], keep: int = 1) -> np.ndarray:
        """One run of ``chunk`` in ``seq``'s row; the logits of its last ``keep`` positions."""
        n = len(chunk)
        if n == 1:
            logits = self._one_token_run([seq.row], [chunk[0]])
        else:
            self._ensure(len(self._order), seq.length + n)
            logits = self._run(seq.row, seq.row + 1, np.array([chunk], dtype=np.int64), [seq.length + n - 1],
                               keep=keep)[0, -keep:]
        seq.length += n
        if seq.ids is not None:
            seq.ids.extend(chunk)
            self._keep_blocks(seq)
        return logits

    def decode(self, seqs: list[tuple[str, int]]) -> np.ndarray:
        """Feed one token to each of some live sequences, in one run over the rows they
        span; see ``Engine.decode``.

        Raises:
            InvalidSequenceError: naming the unknown sequences, those fed a token outside
                the vocabulary and those already at ``max_context`` (these are released).
            ValueError: an id given twice.
        """
        if not seqs:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        check_decode(seqs, self._seqs, self.max_context, self.vocab_size, self.release)
        members = [self._seqs[seq_id] for seq_id, _ in seqs]
        logits = self._one_token_run([m.row for m in members], [t for _, t in seqs])
        for m, (_, token) in zip(members, seqs):
            m.length += 1
            if self.decoded_blocks and m.ids is not None:
                m.ids.append(token)
                self._keep_blocks(m)  # names and keeps a block only when this token completes it
            else:  # the blocks decode steps fill are not a prefill's bits: none is kept
                m.ids = m.names = None
        return np.ascontiguousarray(logits, dtype=np.float32)

    def fork(self, src_id: str, dst_ids: list[str], length: int | None = None) -> None:
        """Start ``dst_ids`` with the first ``length`` positions (default: all) of
        ``src_id``'s cache, copied into rows of their own.

        Raises:
            InvalidSequenceError: ``src_id`` is not live, or a new id already is.
            ValueError: more than ``max_batch`` live sequences, or a bad length.
        """
        n = check_fork(src_id, dst_ids, self._seqs, self.max_batch, length)
        src = self._seqs[src_id]
        self._ensure(len(self._order) + len(dst_ids), n)
        block = self.prefix_cache.block if self.prefix_cache is not None else 1
        for d in dst_ids:
            row = len(self._order)
            for buf in self._buffers:
                buf[row, :, :n] = buf[src.row, :, :n]
                self.copied_bytes += buf[row, :, :n].nbytes
            self._order.append(d)
            self._seqs[d] = _Seq(length=n, row=row, ids=None if src.ids is None else src.ids[:n],
                                 names=None if src.names is None else src.names[:n // block])

    def release(self, seq_id: str) -> None:
        """Free a sequence's row: the last live row moves into it (a copy of its slots)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        last = len(self._order) - 1
        if seq.row != last:
            moved = self._seqs[self._order[last]]
            for buf in self._buffers:
                buf[seq.row, :, :moved.length] = buf[last, :, :moved.length]
                self.copied_bytes += buf[last, :, :moved.length].nbytes
            moved.row = seq.row
            self._order[seq.row] = self._order[last]
        self._order.pop()
        if not self._order:  # nothing live: give the memory back
            self._kv, self._maps, self._io, self._bound = None, None, None, None
            return
        # the memory of what the two rows no longer hold goes back: the freed row keeps the
        # moved sequence's slots, the last row none (one more slot: a scratch token's)
        if self._maps is not None:
            kept = self._seqs[self._order[seq.row]].length + 1 if seq.row != last else 0
            for kv_map in self._maps:
                kv_map.trim(seq.row, kept)
                if seq.row != last:
                    kv_map.trim(last, 0)

    def close(self) -> None:
        self._seqs.clear()
        self._order.clear()
        self._kv, self._maps, self._io, self._bound = None, None, None, None

    # -- prefix cache ------------------------------------------------------------------------

    def _keep_blocks(self, seq: _Seq) -> None:
        """Name the sequence's blocks completed since the last call and give the prefix
        cache a copy of those it does not hold."""
        cache, ids, names = self.prefix_cache, seq.ids, seq.names
        if cache is None or ids is None or names is None:  # (ids and names are None together)
            return
        block = cache.block
        done = seq.length // block
        for k in range(len(names), done):
            chain = names[-1] if names else cache.seed
            name = block_hashes(chain, ids[k * block:(k + 1) * block], block)[0]
            names.append(name)
            if cache.touch(name):
                continue
            cache.put(name, [buf[seq.row, :, k * block:(k + 1) * block, :].copy() for buf in self._buffers])
