"""Finished replies kept in the prefix cache, computed while the worker is idle
(docs/scheduling.md, "Prefix cache").

A conversation's next turn sends the whole conversation again: the earlier prompt, the
model's reply, and a new message. The prompt's blocks are in the prefix cache (a prefill
keeps them); the reply's are not, because a block in the cache must hold what a prefill
computes (then a prompt gets the same bits with the cache on or off), and a decode step
computes a token's K/V with other numerics: on x86-64, ONNX Runtime's one-row matrix
products in the attention of a one-token run sum in another order than a prefill's
(``workers.engines.base.decodes_like_prefill`` measures it when an engine loads; an engine
that finds them alike keeps decoded blocks itself, ``decoded_blocks``, and needs none of
this).

So the worker computes them: it remembers the token ids of the last replies that ended
(prompt and every generated token, the last sampled one too), and while it has nothing
else to do, feeds the first one whose blocks the cache lacks through the engine's
``start`` / ``extend`` / ``release``, like a prompt: ``start`` copies in the blocks the
cache holds (the earlier prompt's), ``extend`` computes the rest up to the last whole
block, in chunks of at most ``chunk`` tokens (one a call; the next call starts from the
blocks the last one kept), and the engine keeps the whole blocks as a prefill's. A prefill
of those tokens gives them exactly the bits the next turn's own prefill would, so output
does not change; what moves is when the work is done: in the pause before the next turn
instead of after it arrives. A request that arrives meanwhile waits for one chunk at most.

Cost: memory for ``most`` token lists (the newest replies; older ones are dropped), one
hash pass over a reply's ids when its turn comes, and prefill work only while the worker
would otherwise sit idle. A reply whose conversation's prompt blocks the cache no longer
holds is dropped, not recomputed from its start.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

import numpy as np

from streamfleet.shared.logging import get_logger

if TYPE_CHECKING:
    from streamfleet.workers.engines.base import CachingEngine
    from streamfleet.workers.prefixcache import PrefixCache

__all__ = ["CHUNK", "ReplyKeeper"]

log = get_logger("worker.replykeep")

#: most tokens one idle step computes: what a request that arrives meanwhile may wait for
#: (how long that is: docs/scheduling.md, "Prefix cache")
CHUNK = 64
#: the sequence id the engine knows a reply being computed under (never a request id:
#: those are UUIDs)
_SEQ_ID = "\x00reply"


class ReplyKeeper:
    """The finished replies whose blocks the prefix cache lacks, and the idle work that
    computes them (module docstring). No I/O; called from the engine's thread.

    Args:
        engine: the worker's engine (``start``/``extend``/``release`` and a
            ``prefix_cache``: see ``wanted``).
        chunk: most tokens one ``step`` computes, at most ``CHUNK`` (0: ``CHUNK``; rounded
            down to whole blocks, one at least).
        most: most replies remembered; the oldest goes first.
    """

    def __init__(self, engine: CachingEngine, *, chunk: int = 0, most: int = 16) -> None:
        self.engine = engine
        self.chunk = min(CHUNK, int(chunk)) if chunk > 0 else CHUNK
        #: (prompt and generated ids, prompt length), oldest first: the oldest reply's
        #: user has been reading it longest, so its next turn is likely the nearest
        self._todo: deque[tuple[np.ndarray, int]] = deque(maxlen=max(1, int(most)))

    @staticmethod
    def wanted(engine: object) -> TypeGuard[CachingEngine]:
        """Whether ``engine`` needs it: a prefix cache, prompts in chunks (``start``,
        ``extend``), and decoded blocks it does not keep itself."""
        return (getattr(engine, "prefix_cache", None) is not None and not getattr(engine, "decoded_blocks", False)
                and callable(getattr(engine, "start", None)) and callable(getattr(engine, "extend", None)))

    def __len__(self) -> int:
        return len(self._todo)

    @property
    def _cache(self) -> PrefixCache:
        """The engine's prefix cache (there is one: ``wanted``)."""
        cache = self.engine.prefix_cache
        if cache is None:
            raise RuntimeError("the engine's prefix cache is off: it needs no ReplyKeeper (wanted)")
        return cache

    def finished(self, prompt: Sequence[int], generated: Sequence[int]) -> None:
        """A sequence ended with ``generated`` after ``prompt``: remember it if that makes
        a whole block past the prompt's whole blocks."""
        block = self._cache.block
        total = len(prompt) + len(generated)
        if not generated or total // block <= len(prompt) // block:
            return
        ids = np.empty(total, dtype=np.int32)
        ids[:len(prompt)] = prompt
        ids[len(prompt):] = generated
        self._todo.append((ids, len(prompt)))

    def clear(self) -> None:
        self._todo.clear()

    def step(self) -> int:
        """Compute one chunk of the first remembered reply the cache lacks (those it holds
        already, or whose prompt it no longer holds, are dropped on the way). Returns the
        tokens computed (0: nothing was left to do)."""
        cache = self._cache
        block = cache.block
        while self._todo:
            ids, prompt_len = self._todo[0]
            whole = len(ids) // block
            held = cache.held(cache.hashes(ids))
            if held >= whole or held < prompt_len // block:
                # all there already (the next turn came first), or its conversation left the
                # cache (not worth a prefill from its start)
                self._todo.popleft()
                continue
            return self._feed(ids[:whole * block].tolist())
        return 0

    def _feed(self, ids: list[int]) -> int:
        """One chunk of ``ids`` (whole blocks, starting with those the cache holds) through
        the engine; the reply is dropped when it fails or is done."""
        engine, cache = self.engine, self._cache
        block = cache.block
        try:
            n = engine.start([(_SEQ_ID, ids)], count=False)[0]
            # the lookup leaves two tokens at least to compute (n may be a block short of
            # held), and so does every chunk: a one-token run takes other kernels, whose
            # bits must never go into a kept block
            end = min(len(ids), max(n + max(block, self.chunk // block * block), n + 2))
            try:
                engine.extend([(_SEQ_ID, ids[n:end])])
            finally:
                engine.release(_SEQ_ID)
        except Exception:  # a bug here must not take the worker down: the reply is not kept
            log.exception("computing a finished reply's blocks failed", tokens=len(ids))
            self._todo.popleft()
            return 0
        cache.stats.reply_tokens += end - n
        if end >= len(ids):
            self._todo.popleft()
        return end - n
