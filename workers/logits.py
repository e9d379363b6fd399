"""Logits processing for the whole batch, and log probabilities.

Between the engine's logits and the per-request ``Sampler``, one step applies every
request's penalties, biases and filters to the batch's logits matrix at once
(``process``): each feature is one fancy-indexed numpy operation over all the rows that
use it, never a Python loop over tokens. The per-sequence state (``Penalties``) keeps
the generated tokens' counts as numpy arrays, updated in O(1) per sampled token, so
gathering them for a step costs one concatenation per feature.

Order, as vLLM applies them: ``min_tokens`` (EOS and ``stop_token_ids`` masked),
``logit_bias``, the repetition penalty (CTRL's: prompt and output tokens), the
frequency and presence penalties (OpenAI's: output tokens only), then ``min_p`` (on
the temperature-scaled distribution; the Sampler applies temperature, top-k, top-p).
A row's result depends on that row alone, so a request's tokens are the same whether
it runs alone or batched with others (docs/sampling.md).

Log probabilities (``logprobs``) are those of the model's own distribution (the
log-softmax of the engine's logits, before any processing: vLLM's default), computed
for the rows that ask in one vectorised pass (``Logprobs``) and rendered with the
token's text and bytes (``TokenTable``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from streamfleet.shared.schema import SamplingParams

if TYPE_CHECKING:
    from streamfleet.shared.modelrepo import Tokenizer

__all__ = ["Penalties", "process", "Logprobs", "TokenTable"]


class Penalties:
    """One sequence's processing state: what it asked for, and the counts of the tokens
    it generated (and, for the repetition penalty, the prompt's tokens).

    Args:
        params: the request's sampling parameters (``params.processed`` is true).
        prompt_ids: the prompt.
        end_ids: EOS ids (masked with ``stop_token_ids`` while ``min_tokens`` is unmet).
    """

    __slots__ = ("p", "ids", "counts", "_slot", "rep_ids", "_rep_n", "_rep_seen", "bias_ids", "bias",
                 "ban_ids", "log_min_p")

    def __init__(self, params: SamplingParams, prompt_ids: list[int], end_ids: frozenset[int]) -> None:
        self.p = params
        self.ids = np.zeros(16, dtype=np.int64)  # distinct generated ids [: len(_slot)]
        self.counts = np.zeros(16, dtype=np.float32)
        self._slot: dict[int, int] = {}
        # the ids the repetition penalty applies to ([: _rep_n]), and them as a set (None:
        # the sequence has no repetition penalty, and the array stays empty)
        self._rep_seen: set[int] | None
        if params.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(prompt_ids, dtype=np.int64))
            self._rep_seen = set(seen.tolist())
            self.rep_ids = np.concatenate([seen, np.zeros(16, dtype=np.int64)])
            self._rep_n = seen.shape[0]
        else:
            self._rep_seen, self.rep_ids, self._rep_n = None, np.zeros(0, dtype=np.int64), 0
        self.bias_ids = np.asarray([int(t) for t, _ in params.logit_bias], dtype=np.int64)
        self.bias = np.asarray([b for _, b in params.logit_bias], dtype=np.float32)
        self.ban_ids = np.asarray(sorted(end_ids | {int(t) for t in params.stop_token_ids}), dtype=np.int64)
        self.log_min_p = math.log(params.min_p) if params.min_p > 0 else None

    def push(self, token: int) -> None:
        """Count a token the sequence generated (or replayed after a takeover)."""
        i = self._slot.get(token)
        if i is None:
            i = self._slot[token] = len(self._slot)
            if i == self.ids.shape[0]:
                self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            self.ids[i] = token
        self.counts[i] += 1.0
        if self._rep_seen is not None and token not in self._rep_seen:
            self._rep_seen.add(token)
            if self._rep_n == self.rep_ids.shape[0]:
                self.rep_ids = np.concatenate([self.rep_ids, np.zeros_like(self.rep_ids)])
            self.rep_ids[self._rep_n] = token
            self._rep_n += 1

    @property
    def generated_ids(self) -> np.ndarray:
        return self.ids[: len(self._slot)]

    @property
    def generated_counts(self) -> np.ndarray:
        return self.counts[: len(self._slot)]

    @property
    def repeated_ids(self) -> np.ndarray:
        return self.rep_ids[: self._rep_n]


def _gather(rows: list[int], arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Row indices and column indices of ``arrays`` (one per row in ``rows``) as two flat
    arrays, for one fancy-indexed operation over the batch."""
    cols = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    lens = [a.shape[0] for a in arrays]
    return np.repeat(np.asarray(rows, dtype=np.int64), lens), cols


def process(logits: np.ndarray, states: list[Penalties | None], emitted: list[int]) -> None:
    """Apply every row's processing to ``logits`` (float32 ``[batch, vocab]``, in place).

    Args:
        logits: the batch's logits, one row per sequence.
        states: each row's ``Penalties``, None for a row that asks for none.
        emitted: each row's tokens so far (for ``min_tokens``).
    """
    live = [(i, s) for i, s in enumerate(states) if s is not None]
    if not live:
        return
    ninf = np.float32(-np.inf)
    # min_tokens: no end before it
    ban = [(i, s) for i, s in live if emitted[i] < s.p.min_tokens and s.ban_ids.size]
    if ban:
        r, c = _gather([i for i, _ in ban], [s.ban_ids for _, s in ban])
        logits[r, c] = ninf
    bias = [(i, s) for i, s in live if s.bias_ids.size]
    if bias:
        r, c = _gather([i for i, _ in bias], [s.bias_ids for _, s in bias])
        np.add.at(logits, (r, c), np.concatenate([s.bias for _, s in bias]))
    rep = [(i, s) for i, s in live if s.p.repetition_penalty != 1.0]
    if rep:
        r, c = _gather([i for i, _ in rep], [s.repeated_ids for _, s in rep])
        if r.size:
            penalty = np.asarray([s.p.repetition_penalty for _, s in rep], dtype=np.float32)
            per = np.repeat(penalty, [s.repeated_ids.shape[0] for _, s in rep])
            v = logits[r, c]
            logits[r, c] = np.where(v > 0, v / per, v * per)
    freq = [(i, s) for i, s in live if (s.p.frequency_penalty or s.p.presence_penalty) and s.generated_ids.size]
    if freq:
        r, c = _gather([i for i, _ in freq], [s.generated_ids for _, s in freq])
        lens = [s.generated_ids.shape[0] for _, s in freq]
        fp = np.repeat(np.asarray([s.p.frequency_penalty for _, s in freq], dtype=np.float32), lens)
        pp = np.repeat(np.asarray([s.p.presence_penalty for _, s in freq], dtype=np.float32), lens)
        counts = np.concatenate([s.generated_counts for _, s in freq])
        logits[r, c] -= counts * fp + pp
    minp = [(i, s, lmp) for i, s in live if (lmp := s.log_min_p) is not None and s.p.temperature > 0]
    if minp:
        # one masked write over the batch (a floor of -inf for rows without min_p): no copy
        # of the rows, which costs more than the comparison
        floor = np.full((logits.shape[0], 1), ninf, dtype=np.float32)
        rows = np.asarray([i for i, _, _ in minp], dtype=np.int64)
        temp = np.asarray([s.p.temperature * lmp for _, s, lmp in minp], dtype=np.float32)
        if 2 * len(minp) > logits.shape[0]:
            top = logits.max(axis=1)[rows]
        else:  # a few rows: their maxima alone
            top = np.asarray([logits[i].max() for i in rows.tolist()], dtype=np.float32)
        floor[rows, 0] = top + temp
        np.copyto(logits, ninf, where=logits < floor)


class Logprobs:
    """The log-softmax facts of the rows that asked for log probabilities, taken from
    the raw logits before ``process`` changes them.

    Args:
        logits: the batch's raw logits ``[batch, vocab]``.
        rows: the rows that asked.
        k: each of those rows' ``top_logprobs``.
    """

    __slots__ = ("raw", "lse", "top_ids", "top_lps", "k", "_row")

    def __init__(self, logits: np.ndarray, rows: list[int], k: list[int]) -> None:
        self._row = {r: j for j, r in enumerate(rows)}
        self.k = k
        raw = np.asarray(logits[np.asarray(rows, dtype=np.int64)], dtype=np.float32)
        self.raw = raw
        top = raw.max(axis=1, keepdims=True)
        self.lse = (top + np.log(np.exp(raw - top).sum(axis=1, keepdims=True, dtype=np.float64))
                    .astype(np.float32))[:, 0]
        kmax = max(k)
        if kmax:
            part = _top_k(raw, kmax)
            vals = np.take_along_axis(raw, part, axis=1)
            order = np.lexsort((part, -vals), axis=1)  # most likely first, then lower id
            self.top_ids = np.take_along_axis(part, order, axis=1)
            self.top_lps = np.take_along_axis(vals, order, axis=1) - self.lse[:, None]
        else:  # (no row asked for alternatives: ``of`` never reads them)
            self.top_ids = np.zeros((raw.shape[0], 0), dtype=np.int64)
            self.top_lps = np.zeros((raw.shape[0], 0), dtype=np.float32)

    def __contains__(self, row: int) -> bool:
        return row in self._row

    def of(self, row: int, token: int) -> tuple[float, list[tuple[int, float]]]:
        """The chosen token's log probability and the row's ``k`` best ``(id, logprob)``."""
        j = self._row[row]
        lp = float(self.raw[j, token] - self.lse[j])
        k = self.k[j]
        top = [] if not k else list(zip(self.top_ids[j, :k].tolist(), self.top_lps[j, :k].tolist()))
        return lp, top


#: block length of ``_top_k``'s first pass
_TOP_BLOCK = 256


def _top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Column indices of each row's ``k`` largest values (in no order), ``[rows, k]``.

    A full-width ``argpartition`` costs about a millisecond per 128k-token row, so the
    rows are first cut into blocks of ``_TOP_BLOCK``: the ``k`` largest values lie in the
    ``k`` blocks with the largest maxima (a block whose maximum is below the k-th largest
    block maximum holds nothing above k values), so only those blocks (and the ragged
    tail) are searched. With equal values at the cut, which of them is kept is arbitrary.
    """
    rows, vocab = x.shape
    k = min(k, vocab)
    nb = vocab // _TOP_BLOCK
    if nb <= 2 * k:  # a small vocabulary: one pass
        return np.argpartition(x, vocab - k, axis=1)[:, vocab - k:] if k < vocab else \
            np.tile(np.arange(vocab), (rows, 1))
    full = nb * _TOP_BLOCK
    maxima = x[:, :full].reshape(rows, nb, _TOP_BLOCK).max(axis=2)
    blocks = np.argpartition(maxima, nb - k, axis=1)[:, nb - k:]
    cand = (blocks[:, :, None] * _TOP_BLOCK + np.arange(_TOP_BLOCK)).reshape(rows, -1)
    if full < vocab:
        cand = np.concatenate([cand, np.broadcast_to(np.arange(full, vocab), (rows, vocab - full))], axis=1)
    vals = np.take_along_axis(x, cand, axis=1)
    pick = np.argpartition(vals, vals.shape[1] - k, axis=1)[:, vals.shape[1] - k:]
    return np.take_along_axis(cand, pick, axis=1)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character map (byte-level BPE writes each byte as one)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class TokenTable:
    """Each token id's bytes and the text OpenAI shows for it, built on first use.

    Byte-level BPE tokens map back through GPT-2's byte table, SentencePiece pieces
    through ``▁`` and ``<0xNN>`` byte fallback, special tokens are their content; any
    other tokenizer's token is what ``decode`` gives for it alone. A token that is not
    whole UTF-8 (part of a character) shows its bytes as ``\\xNN`` escapes, as OpenAI's.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = type(backend.decoder).__name__ if backend is not None and backend.decoder is not None else ""
        self._byte_level = decoder == "ByteLevel"
        self._unbyte = {c: b for b, c in _bytes_to_unicode().items()} if self._byte_level else {}
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._backend = backend

    def token(self, tid: int) -> tuple[str, list[int]]:
        hit = self._cache.get(tid)
        if hit is None:
            data = self._bytes(tid)
            hit = self._cache[tid] = (data.decode("utf-8", errors="backslashreplace"), list(data))
        return hit

    def _bytes(self, tid: int) -> bytes:
        piece = self._backend.id_to_token(tid) if self._backend is not None else None
        if piece is None:
            return self._tok.decode([tid]).encode()
        if tid in self._special:
            return piece.encode()
        if self._byte_level:
            try:
                return bytes(self._unbyte[c] for c in piece)
            except KeyError:  # an added token written in plain text
                return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if "▁" in piece:
            return piece.replace("▁", " ").encode()
        return self._tok.decode([tid]).encode()

    def entry(self, tid: int, lp: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        """A token's ``logprobs`` field (``TokenEvent.logprobs``)."""
        text, data = self.token(tid)
        return {"id": tid, "token": text, "bytes": data, "logprob": _finite(lp),
                "top": [{"id": t, "token": (tt := self.token(t))[0], "bytes": tt[1], "logprob": _finite(v)}
                        for t, v in top]}

    def prompt_entry(self, tid: int, lp: float | None, top: list[tuple[int, float]]) -> dict[str, Any]:
        """A prompt token's entry of a ``PromptEvent``: ``entry`` without the bytes (the
        completions API, the only one that shows a prompt's, has no use for them: a
        prompt's entries are many). ``lp`` None: the prompt's first token, which nothing
        predicts (``id`` and ``token`` only)."""
        if lp is None:
            return {"id": tid, "token": self.token(tid)[0]}
        return {"id": tid, "token": self.token(tid)[0], "logprob": _finite(lp),
                "top": [{"id": t, "token": self.token(t)[0], "logprob": _finite(v)} for t, v in top]}


def _finite(v: float) -> float:
    """-inf (a token the model gives no chance) as the most negative float32, as JSON can carry."""
    return v if math.isfinite(v) else -9999.0
