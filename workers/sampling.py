"""Per-request token sampling: greedy, temperature, top-k and top-p.

Each request owns its random generator, seeded with ``SamplingParams.seed`` and
advanced by exactly one draw per sampled token. A request's tokens therefore depend
only on its own logits and seed, not on what else shares the batch, and a task that is
redelivered after a worker crash regenerates the same tokens (docs/failures.md).

Hundreds of rows are sampled per step, so no path sorts the whole vocabulary unless
top-p really needs it: probabilities are computed in float32 after subtracting the
max (no overflow), sums and cumulative sums are float64, top-k uses ``argpartition``
and a plain draw finds its token block by block (inverse CDF over block sums).
"""

from __future__ import annotations

import numpy as np

from streamfleet.shared.schema import SamplingParams

__all__ = ["Sampler", "GREEDY_BELOW"]

#: temperatures below this are greedy (dividing by them would overflow float32)
GREEDY_BELOW = 1e-5
#: top-p without top-k looks for the nucleus among this many best tokens first, and
#: sorts the whole vocabulary only when their mass falls short of ``top_p``
_NUCLEUS_PROBES = (256, 4096)
#: block length of the two-level inverse-CDF draw
_BLOCK = 1024


class Sampler:
    """Draws the next tokens of one request from their logits.

    Args:
        params: the request's sampling parameters. ``temperature < GREEDY_BELOW`` is
            greedy; ``top_k == 0`` (or ``>= vocab_size``) and ``top_p >= 1`` switch those
            filters off; ``top_p <= 0`` keeps only the best token.
        vocab_size: length of the logits rows this sampler will see.
    """

    __slots__ = ("greedy", "temperature", "top_k", "top_p", "vocab_size", "_rng")

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)
        self.temperature = float(params.temperature)
        self.greedy = not self.temperature >= GREEDY_BELOW  # NaN is greedy too
        top_k = int(params.top_k)
        self.top_k = top_k if 0 < top_k < self.vocab_size else 0
        self.top_p = float(params.top_p)
        # PCG64 from the request's seed: the same stream on every host and process. A
        # greedy sampler never draws, and seeding one costs more than the rest of a
        # request's admission (SeedSequence hashing): none is made for it
        self._rng = None if self.greedy else np.random.default_rng(int(params.seed) & 0xFFFF_FFFF_FFFF_FFFF)

    def skip(self, n: int) -> None:
        """Advance past ``n`` tokens sampled elsewhere (a request taken over mid-way):
        the next ``sample`` draws what the ``n+1``-th would have."""
        if n > 0 and self._rng is not None:  # (None when greedy)
            self._rng.random(n)

    def sample(self, logits: np.ndarray) -> int:
        """The next token id.

        Args:
            logits: float array ``[vocab]``, one row of the engine's output (not modified).
        """
        if self.greedy or self._rng is None:  # (None exactly when greedy)
            return int(np.argmax(logits))
        u = self._rng.random()  # the one draw of this token, whichever path follows
        x = np.asarray(logits, dtype=np.float32)
        top = x.max()
        if not np.isfinite(top):
            # NaN/+inf from a broken engine row: never pick NaN, never crash
            x = np.nan_to_num(x, nan=-np.inf, posinf=float(np.finfo(np.float32).max), neginf=-np.inf)
            top = x.max()
            if not np.isfinite(top):
                return int(np.argmax(x))
        if self.top_p <= 0.0:
            return int(np.argmax(x))

        n = x.shape[0]
        if self.top_k and self.top_k < n:
            cand = np.argpartition(x, n - self.top_k)[n - self.top_k :]
            p = self._probs(x[cand], top)
            if self.top_p < 1.0:
                return self._nucleus(x, cand, p, self.top_p * p.sum(dtype=np.float64), u)
            return int(cand[_inverse_cdf(p, u)])

        p = self._probs(x, top)
        if self.top_p >= 1.0:
            return _inverse_cdf(p, u)
        threshold = self.top_p * p.sum(dtype=np.float64)
        for k in _NUCLEUS_PROBES:
            if k >= n:
                break
            cand = np.argpartition(x, n - k)[n - k :]
            if p[cand].sum(dtype=np.float64) >= threshold:
                return self._nucleus(x, cand, p[cand], threshold, u)
        return self._nucleus(x, None, p, threshold, u)

    def _probs(self, z: np.ndarray, top: np.floating) -> np.ndarray:
        """Unnormalised float32 probabilities of logits ``z`` (``top`` = the row's max)."""
        return np.exp((z - top) / np.float32(self.temperature))

    @staticmethod
    def _nucleus(x: np.ndarray, cand: np.ndarray | None, p: np.ndarray, threshold: float, u: float) -> int:
        """Draw among the best of ``cand`` (None: the whole row) whose mass first
        reaches ``threshold``, the crossing token included; order: logit, then id."""
        if cand is None:
            order = np.argsort(-x, kind="stable")
            ids = order
        else:
            order = np.lexsort((cand, -x[cand]))
            ids = cand[order]
        cum = np.cumsum(p[order], dtype=np.float64)
        keep = min(int(np.searchsorted(cum, threshold, side="left")) + 1, cum.shape[0])
        kept = cum[:keep]
        return int(ids[_pick(kept, p[order[:keep]], u * kept[-1])])


def _inverse_cdf(p: np.ndarray, u: float) -> int:
    """Index drawn with probability ``p[i] / p.sum()`` for ``u`` in [0, 1).

    Two levels (block sums, then one block's cumulative sum) so a large vocabulary
    costs one pass of block sums instead of a full float64 cumulative sum.
    """
    n = p.shape[0]
    if n <= 2 * _BLOCK:
        cum = np.cumsum(p, dtype=np.float64)
        return _pick(cum, p, u * cum[-1])
    full = n - n % _BLOCK
    sums = p[:full].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
    if full < n:
        sums = np.append(sums, p[full:].sum(dtype=np.float64))
    cb = np.cumsum(sums)
    target = u * cb[-1]
    b = _pick(cb, sums, target)
    lo = b * _BLOCK
    seg = p[lo : lo + _BLOCK]
    before = cb[b - 1] if b else 0.0
    return lo + _pick(before + np.cumsum(seg, dtype=np.float64), seg, target)


def _pick(cum: np.ndarray, w: np.ndarray, target: float) -> int:
    """First index with ``cum > target``: never one of zero weight (adding 0.0 is
    exact). Rounding can put ``target`` past the end: then the last positive weight."""
    i = int(np.searchsorted(cum, target, side="right"))
    if i < cum.shape[0]:
        return i
    nz = np.flatnonzero(w)
    return int(nz[-1]) if nz.size else cum.shape[0] - 1
