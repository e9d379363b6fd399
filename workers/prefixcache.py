"""A worker's prefix cache: the KV blocks of earlier prompts, kept for later prompts that
start the same way (docs/scheduling.md, "Prefix cache").

Pure bookkeeping, no engine: a block is ``block`` tokens' worth of one sequence's cache
(one array per past input, ``[kv_heads, block, head_dim]``), named by the hash chain of
shared/prefixhash.py, so a name stands for all the tokens up to the block's end and for
the model version. Blocks are kept least-recently-used first out under a byte budget.
A sequence that starts from cached blocks takes a copy of them into its own cache (the
engine's past input is one array per layer), so evicting a block never touches a
running sequence, and a block is stored once however many sequences use it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from streamfleet.shared.prefixhash import block_hashes, namespace

__all__ = ["PrefixCache", "PrefixStats"]


@dataclass(slots=True)
class PrefixStats:
    """Counters since the cache was made (a new model version makes a new cache)."""

    #: prompts looked up, and those of them that found at least one block
    lookups: int = 0
    hits: int = 0
    #: prompt tokens looked up, and those found cached (not prefilled again)
    requested_tokens: int = 0
    cached_tokens: int = 0
    #: blocks stored, and dropped to stay under the budget
    stored: int = 0
    evicted: int = 0
    #: tokens computed only to keep finished replies (workers/replykeep.py)
    reply_tokens: int = 0


#: the builtin, under a name ``PrefixCache.bytes`` (a property) does not hide
_Bytes = bytes


class PrefixCache:
    """Named KV blocks under a byte budget, least recently used out first.

    Args:
        budget_bytes: most bytes of blocks held (a block larger than it is not kept).
        block: tokens per block.
        model, version: the model version whose blocks these are (the names' seed).
    """

    def __init__(self, budget_bytes: int, block: int, model: str, version: str) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.budget_bytes = max(0, int(budget_bytes))
        self.block = int(block)
        self.model, self.version = model, version
        self.seed = namespace(model, version)
        self.stats = PrefixStats()
        self._blocks: OrderedDict[bytes, list[np.ndarray]] = OrderedDict()
        self._bytes = 0
        #: changes whenever the set of names does (for advertising them)
        self.generation = 0

    # -- reading -------------------------------------------------------------------------

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, name: object) -> bool:
        return name in self._blocks

    def names(self) -> list[_Bytes]:
        """Every block's name, least recently used first."""
        return list(self._blocks)

    def hashes(self, ids: Sequence[int] | np.ndarray, limit: int | None = None) -> list[_Bytes]:
        """The names of the whole blocks of ``ids`` (at most ``limit``)."""
        return block_hashes(self.seed, ids, self.block, limit)

    def lookup(self, ids: Sequence[int], *, count: bool = True) -> tuple[list[_Bytes], list[list[np.ndarray]]]:
        """The longest run of cached blocks ``ids`` starts with, leaving at least two tokens
        of ``ids`` to compute: the last one's logits are needed, and a run of one token
        takes ONNX Runtime's one-row kernels, whose last bits differ from a prefill's
        (docs/scheduling.md, "Prefix cache"). Marks the blocks used and counts the lookup
        (``count=False``: not, for a finished reply's blocks computed while idle, which
        no request asked for). Returns the names of all of ``ids``' whole blocks and the
        cached run."""
        names = self.hashes(ids)
        usable = max(0, len(ids) - 2) // self.block
        run: list[list[np.ndarray]] = []
        for name in names[:usable]:
            kv = self._blocks.get(name)
            if kv is None:
                break
            self._blocks.move_to_end(name)
            run.append(kv)
        if not count:
            return names, run
        s = self.stats
        s.lookups += 1
        s.requested_tokens += len(ids)
        if run:
            s.hits += 1
            s.cached_tokens += len(run) * self.block
        return names, run

    # -- writing -------------------------------------------------------------------------

    def held(self, names: Sequence[_Bytes]) -> int:
        """How many of ``names`` (a chain, in order) the cache holds from the first on,
        without marking them used."""
        n = 0
        for name in names:
            if name not in self._blocks:
                break
            n += 1
        return n

    def touch(self, name: _Bytes) -> bool:
        """Mark a block used; whether the cache holds it."""
        if name in self._blocks:
            self._blocks.move_to_end(name)
            return True
        return False

    def put(self, name: _Bytes, kv: list[np.ndarray]) -> bool:
        """Keep a block (its arrays are kept as given: pass copies); True when stored,
        False when already there (marked used) or larger than the whole budget."""
        if name in self._blocks:
            self._blocks.move_to_end(name)
            return False
        size = sum(int(a.nbytes) for a in kv)
        if size > self.budget_bytes:
            return False
        while self._bytes + size > self.budget_bytes and self._blocks:
            _, old = self._blocks.popitem(last=False)
            self._bytes -= sum(int(a.nbytes) for a in old)
            self.stats.evicted += 1
        self._blocks[name] = kv
        self._bytes += size
        self.stats.stored += 1
        self.generation += 1  # (covers the evictions above too)
        return True

    def clear(self) -> None:
        """Drop every block (counters are kept)."""
        self._blocks.clear()
        self._bytes = 0
        self.generation += 1
