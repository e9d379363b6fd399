"""Completions of one prompt share its prefill: the engine forks the first one's cache
for the others, and each draws exactly the tokens it would have drawn alone."""

from __future__ import annotations

import time

import pytest

from streamfleet.shared.modelrepo import load_tokenizer
from streamfleet.shared.schema import SamplingParams, Task, TokenEvent
from streamfleet.workers.core import WorkerCore
from streamfleet.workers.engines.echo import EchoEngine
from streamfleet.workers.engines.onnxruntime import InvalidSequenceError, OnnxRuntimeEngine

PROMPT = [5, 17, 99, 3, 250, 41, 7]


def task(rid: str, seed: int, prompt=PROMPT, **params) -> Task:
    return Task(request_id=rid, model="tiny-gpt", lane="normal", reply_to="c", client_id=rid, prompt_ids=list(prompt),
                params=SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True, **params),
                created_at=time.time())


def generate(core: WorkerCore, *tasks: Task) -> tuple[dict[str, str], int]:
    for t in tasks:
        core.add(t)
    texts: dict[str, str] = {}
    shared = 0
    while core.has_work():
        out = core.step()
        shared += out.shared_prefills
        for _, ev in out.events:
            if isinstance(ev, TokenEvent):
                texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
    return texts, shared


@pytest.fixture(scope="module")
def engine(tiny_spec):
    eng = OnnxRuntimeEngine(tiny_spec, threads=1)
    yield eng
    eng.close()


def test_same_prompt_shares_one_prefill_and_each_draws_its_own(engine, tiny_spec):
    core = WorkerCore(engine, load_tokenizer(tiny_spec), max_batch=8)
    alone = {f"a{i}": generate(core, task(f"a{i}", seed=i))[0][f"a{i}"] for i in range(4)}
    calls = []
    real_start = engine.start  # the core starts sequences, then feeds them their prompt (extend)
    engine.start = lambda seqs: calls.append([s for s, _ in seqs]) or real_start(seqs)
    try:
        texts, shared = generate(core, *(task(f"b{i}", seed=i) for i in range(4)),
                                 task("other", seed=9, prompt=[8, 9, 10]))
    finally:
        del engine.start
    assert shared == 3 and calls == [["b0", "other"]]  # one prefill for the four, one for the other prompt
    assert [texts[f"b{i}"] for i in range(4)] == [alone[f"a{i}"] for i in range(4)]
    assert len(set(alone.values())) == 4  # different seeds, different completions


def test_a_takeover_replay_is_not_forked(engine, tiny_spec):
    """A sequence with a replay prefills prompt + replay itself: it is no fresh start."""
    core = WorkerCore(engine, load_tokenizer(tiny_spec), max_batch=8)
    core.add(task("r", seed=3))
    ids = []
    while core.has_work():
        out = core.step()
        ids += [tid for (rid, _), tid in sorted(out.token_ids.items()) if rid == "r"]
    core.add(task("x", seed=5))
    core.add(task("y", seed=3), replay=ids[:5])
    _texts, shared = generate(core)
    assert shared == 0


def test_fork_refuses_what_it_cannot_do(tiny_spec):
    eng = EchoEngine(tiny_spec)
    eng.prefill([("a", [1, 2, 3])])
    eng.fork("a", ["b"])
    assert eng.decode([("a", 1), ("b", 1)]).shape[0] == 2
    with pytest.raises(InvalidSequenceError):
        eng.fork("nope", ["c"])
    with pytest.raises(InvalidSequenceError):
        eng.fork("a", ["b"])


def test_choices_that_start_later_fork_the_first_ones_prompt(engine, tiny_spec):
    """The choices of one request (a group) that reach the worker after the first has
    decoded on still start from its prompt's cache: the first ``length`` positions."""
    core = WorkerCore(engine, load_tokenizer(tiny_spec), max_batch=8)
    alone = {i: generate(core, task(f"s{i}", seed=i))[0][f"s{i}"] for i in range(3)}

    def member(i: int) -> Task:
        t = task(f"g{i}", seed=i)
        t.group, t.group_size = "grp", 3
        return t

    core.add(member(0))
    texts: dict[str, str] = {}
    shared = 0
    for step in range(40):
        if step == 3:
            core.add(member(1))
        if step == 6:
            core.add(member(2))
        if not core.has_work():
            break
        out = core.step()
        shared += out.shared_prefills
        for _, ev in out.events:
            if isinstance(ev, TokenEvent):
                texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
    assert shared == 2 and not core._prefixes  # forgotten once the last choice started
    assert [texts[f"g{i}"] for i in range(3)] == [alone[i] for i in range(3)]
