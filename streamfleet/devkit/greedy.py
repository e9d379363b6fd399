"""Greedy decoding drivers for any ``Engine``, and a comparison that tells a real
mismatch from a near tie. Shared by tests/gpu/test_tensorrt.py and scripts/gpu_check.py.

A TensorRT plan and ONNX Runtime add floats in different orders, so two logits within
rounding of each other may swap places; greedy decoding then diverges for good. Such a
divergence is reported as a near tie (the reference's top two were within ``tol``), not
as a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Outcome", "compare", "greedy_alone", "greedy_batched", "greedy_staggered", "random_prompts"]


def random_prompts(seed: int, lengths: list[int], vocab: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    return {f"p{i}-{n}": [int(t) for t in rng.integers(1, vocab, n)] for i, n in enumerate(lengths)}


def greedy_alone(engine, prompt: list[int], steps: int, seq_id: str = "solo") -> tuple[list[int], list[np.ndarray]]:
    """``steps + 1`` greedy tokens of one sequence, alone in the engine, and the logits
    each was chosen from."""
    rows = [engine.prefill([(seq_id, prompt)])[0]]
    tokens = [int(rows[-1].argmax())]
    for _ in range(steps):
        rows.append(engine.decode([(seq_id, tokens[-1])])[0])
        tokens.append(int(rows[-1].argmax()))
    engine.release(seq_id)
    return tokens, rows


def greedy_scenario(engine, prompts: dict[str, list[int]], plan: dict, steps: int, turns: int,
                    seed: int = 0) -> tuple[dict[str, list[int]], dict[str, list[np.ndarray]]]:
    """Run a join/leave/pause ``plan`` (step -> sequence names in ``joins``, ``leaves``,
    ``paused``) for ``turns`` steps, decoding in a shuffled order; returns each surviving
    sequence's greedy tokens and the logits they came from."""
    import random

    got: dict[str, list[int]] = {}
    rows: dict[str, list[np.ndarray]] = {}
    rng = random.Random(seed)
    for step in range(turns):
        for k in plan["leaves"].get(step, ""):
            engine.release(k)
            del got[k]
        batch = [(k, got[k][-1]) for k in got if len(got[k]) <= steps and k not in plan["paused"].get(step, "")]
        rng.shuffle(batch)
        if batch:
            for (k, _), row in zip(batch, engine.decode(batch)):
                got[k].append(int(row.argmax()))
                rows[k].append(row)
        new = plan["joins"].get(step, "")
        if new:
            for k, row in zip(new, engine.prefill([(k, prompts[k]) for k in new])):
                got[k], rows[k] = [int(row.argmax())], [row]
    return got, rows


def greedy_batched(engine, prompts: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
    """All prompts prefilled in one call, then decoded together."""
    keys = list(prompts)
    got = {k: [int(r.argmax())] for k, r in zip(keys, engine.prefill([(k, prompts[k]) for k in keys]))}
    for _ in range(steps):
        for k, r in zip(keys, engine.decode([(k, got[k][-1]) for k in keys])):
            got[k].append(int(r.argmax()))
    for k in keys:
        engine.release(k)
    return got


def greedy_staggered(engine, prompts: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
    """Prompts join at different steps (a few per prefill call) and leave after
    different numbers of tokens, so rows are reused, the slab widens and compacts."""
    keys = list(prompts)
    join = {k: (i % 4) * 2 for i, k in enumerate(keys)}
    want = {k: steps - (i % 3) * (steps // 4) for i, k in enumerate(keys)}  # decode steps each
    got: dict[str, list[int]] = {}
    live: list[str] = []
    step = 0
    while len(got) < len(keys) or live:
        new = [k for k in keys if join[k] == step]
        if live:
            for k, r in zip(live, engine.decode([(k, got[k][-1]) for k in live])):
                got[k].append(int(r.argmax()))
        if new:
            for k, r in zip(new, engine.prefill([(k, prompts[k]) for k in new])):
                got[k] = [int(r.argmax())]
            live.extend(new)
        for k in [k for k in live if len(got[k]) > want[k]]:
            engine.release(k)
            live.remove(k)
        step += 1
    return got


@dataclass
class Outcome:
    exact: int = 0
    near_ties: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def __str__(self) -> str:
        s = f"{self.exact} exact, {len(self.near_ties)} near-tie divergences, {len(self.mismatches)} mismatches"
        return s + "".join(f"\n    {m}" for m in self.mismatches + self.near_ties)


def compare(ref: dict[str, tuple[list[int], list[np.ndarray]]], got: dict[str, list[int]], label: str,
            tol: float = 1e-3, outcome: Outcome | None = None) -> Outcome:
    """Check ``got`` against the reference tokens (and logits) sequence by sequence;
    ``got`` may be shorter (a sequence that left early)."""
    out = outcome or Outcome()
    for k, tokens in got.items():
        ref_tokens, ref_rows = ref[k]
        n = min(len(tokens), len(ref_tokens))
        diverge = next((i for i in range(n) if tokens[i] != ref_tokens[i]), None)
        if diverge is None:
            out.exact += 1
            continue
        row = ref_rows[diverge]
        margin = float(row[ref_tokens[diverge]] - row[tokens[diverge]])
        scale = max(1.0, abs(float(row.max())))
        what = (f"{label} {k}: token {diverge} is {tokens[diverge]}, reference {ref_tokens[diverge]} "
                f"(reference margin {margin:.2e})")
        (out.near_ties if margin <= tol * scale else out.mismatches).append(what)
    return out
