"""A test-only engine that fails on purpose: the echo engine, except that a sequence whose
prompt contains ``FAIL`` makes the engine raise for that sequence on its third step.

Selected by a worker with ``--backend tests.support.faulty_engine:FaultyEngine``."""

from __future__ import annotations

from typing import Any

import numpy as np

from streamfleet.shared.modelrepo import ModelSpec, load_tokenizer
from streamfleet.workers.engines.base import SequenceError
from streamfleet.workers.engines.echo import EchoEngine


class FaultyEngine(EchoEngine):
    def __init__(self, spec: ModelSpec, **options: Any) -> None:
        super().__init__(spec, **options)
        self._tok = load_tokenizer(spec)
        self._doomed: dict[str, int] = {}

    def prefill(self, seqs: list[tuple[str, list[int]]]) -> np.ndarray:
        for seq_id, prompt in seqs:
            if "FAIL" in self._tok.decode(prompt):
                self._doomed[seq_id] = 0
        return super().prefill(seqs)

    def decode(self, seqs: list[tuple[str, int]]) -> np.ndarray:
        failing = []
        for seq_id, _ in seqs:
            if seq_id in self._doomed:
                self._doomed[seq_id] += 1
                if self._doomed[seq_id] >= 2:
                    failing.append(seq_id)
        if failing:
            for seq_id in failing:
                self.release(seq_id)
                self._doomed.pop(seq_id, None)
            raise SequenceError("injected engine failure", failing)
        return super().decode(seqs)
