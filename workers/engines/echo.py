"""A model-free engine for measuring the fleet itself: no weights, no compute.

Each sequence echoes its prompt, token by token, round and round: the token chosen
after ``k`` generated tokens is ``prompt[k % len(prompt)]``. EOS ids are never chosen
(they are skipped in the prompt and pushed far down in the logits), so a request runs
until its ``max_tokens`` or ``max_context``; a prompt of nothing but EOS ids counts up
from its last token instead. The logits are one-hot-ish (the chosen token ``+30``, EOS
ids ``-1e9``, the rest 0), so greedy and temperature sampling alike pick it. An
optional ``delay_ms`` sleeps once per ``prefill`` / ``decode`` call to stand in for a
model's step time.

Options (keyword arguments, else top-level keys of ``engine.toml``): ``delay_ms``
(default 0), ``vocab_size`` (default: the tokenizer's, when the folder has one, else 1024).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamfleet.shared.modelrepo import ModelSpec

# the shared argument checks (that module imports onnxruntime itself only when an engine is built)
from streamfleet.workers.engines.onnxruntime import InvalidSequenceError, check_decode, check_prefill

__all__ = ["EchoEngine"]

_CHOSEN_LOGIT = 30.0
_EOS_LOGIT = -1e9


@dataclass(slots=True)
class _Seq:
    cycle: list[int]  # the prompt without EOS ids (never empty)
    generated: int
    length: int


class EchoEngine:
    """Echoes each prompt back; see the module docstring.

    Args:
        spec: the model folder (``max_batch``, ``max_context``, ``eos_token_ids``).
        delay_ms: sleep per ``prefill`` / ``decode`` call; None reads ``spec.options``.
        options: ``vocab_size``; others are ignored.
    """

    #: it echoes what it was prefilled with, so prompt + generated is another prompt
    replays_exactly = False

    def __init__(self, spec: ModelSpec, *, delay_ms: float | None = None, **options: Any) -> None:
        self.spec = spec
        # no model memory to size it: the batch may be as large as the worker asks
        self.max_batch = int(options.get("max_batch") or spec.max_batch)
        self.max_context = spec.max_context
        if delay_ms is None:
            delay_ms = spec.options.get("delay_ms", 0.0)
        self.delay_s = max(0.0, float(delay_ms)) / 1000.0
        vocab = options.get("vocab_size", spec.options.get("vocab_size"))
        self.vocab_size = int(vocab) if vocab is not None else _tokenizer_vocab(spec) or 1024
        self._eos = sorted({int(e) for e in spec.eos_token_ids if 0 <= int(e) < self.vocab_size})
        if len(self._eos) >= self.vocab_size:
            raise ValueError("every token of the vocabulary is an EOS id")
        self._seqs: dict[str, _Seq] = {}

    def prefill(self, seqs: list[tuple[str, list[int]]]) -> np.ndarray:
        """Start new sequences; see ``Engine.prefill``.

        Raises:
            InvalidSequenceError: see ``workers.engines.onnxruntime.check_prefill``.
            ValueError: an id given twice, or more than ``max_batch`` live sequences.
        """
        check_prefill(seqs, self._seqs, self.max_context, self.vocab_size, self.max_batch)
        self._sleep()
        chosen = []
        eos = set(self._eos)
        for seq_id, prompt in seqs:
            cycle = [t for t in prompt if t not in eos] or [self._after(prompt[-1])]
            seq = self._seqs[seq_id] = _Seq(cycle=cycle, generated=0, length=len(prompt))
            chosen.append(seq.cycle[0])
        return self._logits(chosen)

    def decode(self, seqs: list[tuple[str, int]]) -> np.ndarray:
        """Advance each sequence by one token; see ``Engine.decode``.

        Raises:
            InvalidSequenceError: see ``workers.engines.onnxruntime.check_decode``.
            ValueError: an id given twice.
        """
        check_decode(seqs, self._seqs, self.max_context, self.vocab_size, self.release)
        self._sleep()
        chosen = []
        for seq_id, _ in seqs:
            seq = self._seqs[seq_id]
            seq.generated += 1
            seq.length += 1
            chosen.append(seq.cycle[seq.generated % len(seq.cycle)])
        return self._logits(chosen)

    def fork(self, src_id: str, dst_ids: list[str], length: int | None = None) -> None:
        """Start ``dst_ids`` where ``src_id`` started, or is (see ``Engine``)."""
        src = self._seqs.get(src_id)
        bad = {src_id: "is not live"} if src is None else {}
        bad.update({d: "is already live" for d in dst_ids if d in self._seqs})
        if bad:
            raise InvalidSequenceError("; ".join(f"sequence {k!r} {v}" for k, v in bad.items()), list(bad))
        assert src is not None  # (else it is in bad)
        if len(self._seqs) + len(dst_ids) > self.max_batch:
            raise ValueError(f"forked sequences exceed max_batch {self.max_batch}")
        for d in dst_ids:
            if length is None:
                self._seqs[d] = _Seq(cycle=list(src.cycle), generated=src.generated, length=src.length)
            else:  # the prompt's end: as just prefilled
                self._seqs[d] = _Seq(cycle=list(src.cycle), generated=0, length=int(length))

    def release(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def close(self) -> None:
        self._seqs.clear()

    def _after(self, token: int) -> int:
        nxt = (token + 1) % self.vocab_size
        while nxt in self._eos:
            nxt = (nxt + 1) % self.vocab_size
        return nxt

    def _logits(self, chosen: list[int]) -> np.ndarray:
        out = np.zeros((len(chosen), self.vocab_size), dtype=np.float32)
        out[np.arange(len(chosen)), chosen] = _CHOSEN_LOGIT
        out[:, self._eos] = _EOS_LOGIT
        return out

    def _sleep(self) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)


def _tokenizer_vocab(spec: ModelSpec) -> int | None:
    """The vocabulary size of ``tokenizer.json``, read without loading transformers."""
    try:
        data = json.loads(spec.tokenizer_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = [int(i) for i in vocab.values()] if isinstance(vocab, dict) else [len(vocab) - 1]  # BPE / Unigram
    ids += [int(t["id"]) for t in data.get("added_tokens") or ()]
    return max(ids) + 1 if ids else None
