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

from typing import Protocol, runtime_checkable

import numpy as np

from shared.modelrepo import ModelSpec

__all__ = ["Engine", "SequenceError"]


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

    def close(self) -> None:
        """Free everything."""
        ...
