"""Sequences run alone and inside changing batches, for the batch-invariance tests
(docs/sampling.md, "What a seed guarantees"): seeded sampled requests through a
``WorkerCore``, and teacher-forced sequences through an engine; in this process, no
Redis, no workers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from streamfleet.shared.schema import DoneEvent, ErrorEvent, SamplingParams, Task, TokenEvent
from streamfleet.workers.core import WorkerCore

__all__ = ["Outcome", "forced_alone", "forced_staggered", "run_alone", "run_staggered", "seeded_tasks"]


class Outcome(NamedTuple):
    """What one request produced."""

    text: str
    ids: list[int]
    finish: str
    #: each token's log probability and its alternatives' (requests that asked): they
    #: come from the raw logits, so they tell a difference in the last bit of a logit
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]]


def seeded_tasks(n: int, vocab: int, *, seed: int = 0, max_tokens: int = 120, temperature: float = 0.8,
                 prompt_lengths: tuple[int, int] = (1, 48)) -> list[Task]:
    """``n`` sampled requests with their own seeds, prompts of random lengths and a mix of
    plain, top-k, top-p and min-p sampling; half of them ignore EOS (full-length streams),
    a third ask for log probabilities."""
    rng = np.random.default_rng(seed)
    tasks = []
    for i in range(n):
        length = int(rng.integers(prompt_lengths[0], prompt_lengths[1] + 1))
        extra = [{}, {"top_k": 40}, {"top_p": 0.9}, {"min_p": 0.05}][i % 4]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=int(rng.integers(2**63)),
                                ignore_eos=i % 2 == 0, logprobs=2 if i % 3 == 0 else None, **extra)
        prompt = [int(t) for t in rng.integers(1, vocab, length)]
        tasks.append(Task(request_id=f"r{i}", model="m", lane="normal", reply_to="c", client_id=f"r{i}",
                          prompt_ids=prompt, params=params, created_at=1000.0))
    return tasks


class _Streams:
    """The events of many requests, gathered per request."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}
        self.ids: dict[str, dict[int, int]] = {}
        self.logprobs: dict[str, dict[int, tuple]] = {}
        self.finish: dict[str, str] = {}

    def feed(self, out) -> None:
        for _, ev in out.events:
            if isinstance(ev, TokenEvent):
                self.texts[ev.request_id] = self.texts.get(ev.request_id, "") + ev.text
                if ev.logprobs is not None:
                    top = tuple((e["id"], e["logprob"]) for e in ev.logprobs["top"])
                    self.logprobs.setdefault(ev.request_id, {})[ev.index] = (ev.logprobs["logprob"], top)
            elif isinstance(ev, DoneEvent):
                self.finish[ev.request_id] = ev.finish_reason
            elif isinstance(ev, ErrorEvent):
                raise AssertionError(f"{ev.request_id} failed: {ev.message}")
        for (rid, index), tid in out.token_ids.items():
            self.ids.setdefault(rid, {})[index] = tid

    def outcomes(self) -> dict[str, Outcome]:
        out = {}
        for rid, reason in self.finish.items():
            got, lps = self.ids.get(rid, {}), self.logprobs.get(rid, {})
            assert sorted(got) == list(range(len(got))), rid
            out[rid] = Outcome(self.texts.get(rid, ""), [got[i] for i in range(len(got))], reason,
                               [lps[i] for i in sorted(lps)])
        return out


def run_alone(core: WorkerCore, tasks: Iterable[Task]) -> dict[str, Outcome]:
    """Each task by itself: the only sequence in the core from its prefill to its end."""
    streams = _Streams()
    for task in tasks:
        core.add(task)
        while core.has_work():
            streams.feed(core.step())
    return streams.outcomes()


def run_staggered(core: WorkerCore, tasks: list[Task], targets: Iterable[int], *, epoch: int = 24,
                  per_step: int = 3, on_step: Callable[[int], None] | None = None) -> dict[str, Outcome]:
    """All ``tasks`` through one core, joining a running batch a few at a time: for
    ``epoch`` steps the core is filled towards the next of ``targets`` (at most
    ``per_step`` joins a step), so batches grow and shrink and every newcomer starts next
    to sequences of other lengths. ``on_step`` gets each step's batch size."""
    streams = _Streams()
    waiting = list(tasks)
    targets = list(targets)
    step = 0
    while waiting or core.has_work():
        target = targets[(step // epoch) % len(targets)]
        joined = 0
        while waiting and core.active < target and core.free_slots and joined < per_step:
            core.add(waiting.pop(0))
            joined += 1
        out = core.step()
        if on_step is not None:
            on_step(out.batch_size)
        streams.feed(out)
        step += 1
    return streams.outcomes()


# -- engine level: teacher-forced logits ---------------------------------------------------


def forced_alone(engine, seq_id: str, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The logits rows of ``prompt`` then each of ``tokens`` fed in turn, the sequence
    alone in ``engine`` (released after): ``[len(tokens) + 1, vocab]``."""
    rows = [np.array(engine.prefill([(seq_id, prompt)])[0])]
    for t in tokens:
        rows.append(np.array(engine.decode([(seq_id, t)])[0]))
    engine.release(seq_id)
    return np.stack(rows)


def forced_staggered(engine, prompts: dict[str, list[int]], tokens: dict[str, list[int]], *, seed: int = 0,
                     join_max: int = 3, pause: float = 0.1) -> dict[str, np.ndarray]:
    """The same rows for every sequence, all in ``engine`` at once: they join a few at a
    time (one prefill call per join), leave when their tokens run out, sit out a step now
    and then (``pause``), and each step decodes the others in a shuffled order."""
    rng = np.random.default_rng(seed)
    waiting = list(prompts)
    rows: dict[str, list[np.ndarray]] = {}
    fed = dict.fromkeys(prompts, 0)
    while waiting or (rows and any(fed[k] < len(tokens[k]) for k in rows)):
        live = [k for k in rows if fed[k] < len(tokens[k])]
        step = [k for k in live if rng.random() >= pause] or live[:1]
        rng.shuffle(step)
        if step:
            for k, row in zip(step, engine.decode([(k, tokens[k][fed[k]]) for k in step])):
                rows[k].append(np.array(row))
                fed[k] += 1
                if fed[k] == len(tokens[k]):
                    engine.release(k)
        n = int(rng.integers(0, join_max + 1))
        new, waiting = waiting[:n], waiting[n:]
        if new:
            for k, row in zip(new, engine.prefill([(k, prompts[k]) for k in new])):
                rows[k] = [np.array(row)]
                if not tokens[k]:
                    engine.release(k)
    return {k: np.stack(v) for k, v in rows.items()}
