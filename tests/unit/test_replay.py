"""A request taken over mid-way continues from its log (replay) instead of starting
again: on a language-model engine the continuation equals the uninterrupted run."""

from __future__ import annotations

import time

import numpy as np
import pytest

from streamfleet.shared.modelrepo import load_tokenizer
from streamfleet.shared.schema import DoneEvent, SamplingParams, Task, TokenEvent
from streamfleet.workers.core import WorkerCore
from streamfleet.workers.engines.echo import EchoEngine
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine
from streamfleet.workers.sampling import Sampler


def task(rid: str, **params) -> Task:
    return Task(request_id=rid, model="tiny-gpt", lane="normal", reply_to="c", client_id=rid,
                prompt_ids=[5, 17, 99, 3, 250, 41], params=SamplingParams(**params), created_at=time.time())


def run(core: WorkerCore, t: Task, replay=None) -> tuple[list, dict]:
    core.add(t, replay)
    events, ids = [], {}
    while core.has_work():
        out = core.step()
        events += [ev for _, ev in out.events]
        ids.update(out.token_ids)
    return events, ids


@pytest.fixture(scope="module")
def core(tiny_spec):
    eng = OnnxRuntimeEngine(tiny_spec, threads=1)
    yield WorkerCore(eng, load_tokenizer(tiny_spec), max_batch=4)
    eng.close()


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=7),
                                    dict(temperature=1.2, top_k=40, seed=123)])
def test_replay_continues_exactly_where_the_log_ends(core, params):
    n = 24
    ref, ids = run(core, task("ref", max_tokens=n, ignore_eos=True, **params))
    tokens = [ev for ev in ref if isinstance(ev, TokenEvent)]
    assert len(tokens) == n and all(("ref", ev.index) in ids for ev in tokens)
    for k in (1, 9, 23):
        replay = [ids[("ref", i)] for i in range(k)]
        got, _ = run(core, task(f"k{k}", max_tokens=n, ignore_eos=True, **params), replay)
        got_tokens = [ev for ev in got if isinstance(ev, TokenEvent)]
        assert [ev.index for ev in got_tokens] == list(range(k, n))
        assert "".join(ev.text for ev in got_tokens) == "".join(ev.text for ev in tokens[k:])
        done = got[-1]
        assert isinstance(done, DoneEvent) and done.completion_tokens == n


def test_unusable_replay_regenerates_from_the_start(core, tiny_spec):
    t = task("bad", max_tokens=8, ignore_eos=True, temperature=0.0)
    events, _ = run(core, t, [10**9, 1, 2])  # out of the vocabulary
    assert [ev.index for ev in events if isinstance(ev, TokenEvent)] == list(range(8))
    too_long = task("long", max_tokens=3, ignore_eos=True, temperature=0.0)
    events, _ = run(core, too_long, [1, 2, 3])  # already at max_tokens
    assert [ev.index for ev in events if isinstance(ev, TokenEvent)] == [0, 1, 2]


def test_echo_engine_is_never_replayed(tiny_spec):
    core = WorkerCore(EchoEngine(tiny_spec), load_tokenizer(tiny_spec), max_batch=2)
    events, _ = run(core, task("e", max_tokens=6, ignore_eos=True), [5, 17])
    assert [ev.index for ev in events if isinstance(ev, TokenEvent)] == list(range(6))


def test_sampler_skip_matches_drawing():
    p = SamplingParams(temperature=0.8, seed=99)
    a, b = Sampler(p, 50), Sampler(p, 50)
    rows = np.random.default_rng(0).standard_normal((10, 50)).astype(np.float32)
    drawn = [a.sample(r) for r in rows]
    b.skip(6)
    assert [b.sample(r) for r in rows[6:]] == drawn[6:]


@pytest.mark.parametrize("params", [
    dict(temperature=0.9, seed=5, frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.3, min_p=0.05),
    dict(temperature=1.0, seed=8, grammar=None, frequency_penalty=0.3),  # grammar: filled in below
])
def test_replay_restores_penalties_and_the_output_constraint(core, params):
    """A takeover replays the log into the penalty counts and the grammar's matcher: the
    continuation equals the uninterrupted run."""
    from streamfleet.shared.grammar import grammar_of

    if "grammar" in params:
        schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 30}, "b": {"type": "integer"}},
                  "required": ["a", "b"], "additionalProperties": False}
        params = {**params, "grammar": grammar_of({"guided_json": schema})[0]}
    else:
        params = {**params, "ignore_eos": True}
    ref, ids = run(core, task("pref", max_tokens=40, **params))
    tokens = [ev for ev in ref if isinstance(ev, TokenEvent)]
    assert len(tokens) >= 12
    k = 10
    got, _ = run(core, task("pk", max_tokens=40, **params), [ids[("pref", i)] for i in range(k)])
    got_tokens = [ev for ev in got if isinstance(ev, TokenEvent)]
    assert [ev.index for ev in got_tokens] == list(range(k, len(tokens)))
    assert "".join(ev.text for ev in got_tokens) == "".join(ev.text for ev in tokens[k:])
    assert got[-1].finish_reason == ref[-1].finish_reason
