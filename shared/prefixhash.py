"""The hash chain that names a prompt's KV blocks, shared by workers and gateways.

A prompt's token ids are cut into blocks of ``block`` tokens; block ``k`` is named by
``h_k = blake2b(h_{k-1} || ids[k*block:(k+1)*block])`` (8 bytes), ``h_{-1}`` being a
digest of the model's name and version. So a block's name stands for every token
before its end, not only its own (two prompts share block ``k``'s name only where they
agree on all of their first ``(k+1)*block`` tokens), and a new model version never
names a block the same as an old one. Only whole blocks are named; a prompt's tail
shorter than a block has no name (docs/architecture.md, "Prefix cache").

Workers key their prefix cache by these names (workers/prefixcache.py) and advertise
the names they hold; gateways compute the same chain over a request's prompt to find
the worker that holds its longest prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["DIGEST_BYTES", "block_hashes", "namespace"]

#: bytes of a block's name: 2^64 names, so a collision between any two of the blocks
#: a fleet ever holds at once is out of reach
DIGEST_BYTES = 8


def namespace(model: str, version: str) -> bytes:
    """The chain's seed for one model version."""
    return hashlib.blake2b(f"{model}\x00{version}".encode(), digest_size=DIGEST_BYTES).digest()


def block_hashes(seed: bytes, ids: Sequence[int] | np.ndarray, block: int, limit: int | None = None) -> list[bytes]:
    """The names of the whole blocks of ``ids`` (at most ``limit`` of them), in order.

    Cost: one pass over the ids (a C conversion to int32 bytes and one blake2b per block).

    Raises:
        ValueError: ``block`` < 1.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    n = len(ids) // block
    if limit is not None:
        n = min(n, max(0, int(limit)))
    if n == 0:
        return []
    raw = np.asarray(ids[: n * block], dtype=np.int64).astype("<i4", copy=False).tobytes()
    step = 4 * block
    out: list[bytes] = []
    h = seed
    for k in range(n):
        h = hashlib.blake2b(h + raw[k * step:(k + 1) * step], digest_size=DIGEST_BYTES).digest()
        out.append(h)
    return out
