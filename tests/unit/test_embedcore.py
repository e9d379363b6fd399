"""The embedding worker's core (workers/embedcore.py) on a tiny random BERT
(tests/support/tinybert.py): each task's inputs give the engine's own vectors, alone or
batched with others, one ``EmbeddingEvent`` per input then the ``DoneEvent``; cancels,
deadlines, bad inputs, tasks of other kinds and abandoned tasks end as the module
docstring says, and the wire carries the vectors exactly."""

from __future__ import annotations

import numpy as np
import pytest

from streamfleet.shared.modelrepo import load_tokenizer
from streamfleet.shared.schema import (
    AudioInput,
    DoneEvent,
    EmbeddingEvent,
    EmbedTask,
    ErrorEvent,
    LogEntry,
    SamplingParams,
    SpeechTask,
    Task,
    decode_events,
    decode_task,
    encode_events,
)
from streamfleet.workers.coreset import Core
from streamfleet.workers.embedcore import EmbeddingCore
from streamfleet.workers.engines.embedding import OnnxEmbeddingEngine
from tests.support.tinybert import tiny_embedding_model
from tests.support.toy_core import make_core

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "streams and lanes and workers"]


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = tiny_embedding_model(tmp_path_factory.mktemp("embed") / "engines")
    engine = OnnxEmbeddingEngine(spec, threads=1)
    tok = load_tokenizer(spec)
    return engine, [tok.encode(t) for t in TEXTS]


def _task(rid: str, inputs, *, deadline: float | None = None) -> EmbedTask:
    return EmbedTask(rid, "tiny-embed", "normal", "conn", "c-" + rid, [list(i) for i in inputs], 1000.0,
                     deadline=deadline)


def _vectors(events, rid: str) -> np.ndarray:
    return np.stack([ev.values() for _, ev in events if isinstance(ev, EmbeddingEvent) and ev.request_id == rid])


def test_the_core_has_the_core_shape(tiny):
    engine, _ = tiny
    core = EmbeddingCore(engine, step_ms=0)
    assert isinstance(core, Core) and core.free_slots == engine.max_batch and not core.has_work()


def test_each_input_gets_the_engines_vector_then_the_end(tiny):
    engine, ids = tiny
    core = EmbeddingCore(engine, step_ms=0, clock=Clock())
    core.add(_task("r1", ids))
    assert "r1" in core and core.active == 1
    out = core.step()
    kinds = [type(ev) for _, ev in out.events]
    assert kinds == [EmbeddingEvent] * len(ids) + [DoneEvent]
    assert [ev.index for _, ev in out.events[:-1]] == list(range(len(ids)))
    got = _vectors(out.events, "r1")
    assert got.dtype == np.float32 and got.shape == (len(ids), engine.dimensions)
    assert np.array_equal(got, engine.embed(ids))  # the same call: bit for bit
    done = out.events[-1][1]
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == ("stop", sum(map(len, ids)), 0)
    assert out.finished == ["r1"] and out.batch_size == len(ids) and out.prefill_tokens == sum(map(len, ids))
    assert not core.has_work() and core.free_slots == core.max_batch


def test_tasks_are_embedded_together_and_each_vector_matches_its_input_alone(tiny):
    engine, ids = tiny
    core = EmbeddingCore(engine, step_ms=0)
    core.add(_task("a", ids[:2]))
    core.add(_task("b", ids[2:]))
    out = core.step()
    assert sorted(out.finished) == ["a", "b"] and out.batch_size == len(ids)
    for rid, part in (("a", ids[:2]), ("b", ids[2:])):
        got = _vectors(out.events, rid)
        alone = np.stack([engine.embed([x])[0] for x in part])
        assert (got * alone).sum(1).min() >= 0.99999


def test_a_large_task_runs_over_steps_and_a_later_small_one_goes_next_alone(tiny):
    engine, ids = tiny
    core = EmbeddingCore(engine, slots=8, step_ms=0)  # (steps sized by the engine's limits only)
    big = [ids[1]] * (3 * engine.max_batch)  # three engine batches' worth
    core.add(_task("big", big))
    first = core.step()
    assert first.batch_size == engine.max_batch and not first.finished
    assert [ev.index for _, ev in first.events] == list(range(engine.max_batch))
    core.add(_task("small", ids[:1]))  # came while the big one runs: the next step is its own
    second = core.step()
    assert second.finished == ["small"] and second.batch_size == 1
    core.add(_task("small2", ids[:1]))  # never two such steps in a row: the big one's turn comes, beside it
    third = core.step()
    assert third.batch_size == engine.max_batch and third.finished == ["small2"]
    got_big = [ev.index for _, ev in third.events if ev.request_id == "big" and isinstance(ev, EmbeddingEvent)]
    assert got_big == list(range(engine.max_batch, 2 * engine.max_batch - 1))  # beside small2's one input
    events = first.events + second.events + third.events
    while core.has_work():
        events += core.step().events
    indices = [ev.index for _, ev in events if ev.request_id == "big" and isinstance(ev, EmbeddingEvent)]
    assert indices == list(range(len(big)))  # every input once, in order, then the end
    assert isinstance(events[-1][1], DoneEvent) and events[-1][1].prompt_tokens == sum(map(len, big))
    assert float(_vectors(events, "big")[0] @ engine.embed([ids[1]])[0]) >= 0.99999  # batched as alone


def test_steps_are_sized_by_the_measured_time_per_token(tiny):
    engine, ids = tiny
    class Timer:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    timer = Timer()
    core = EmbeddingCore(engine, slots=8, step_ms=50, timer=timer)
    assert core.step_tokens() == 1  # nothing measured: one input, which measures it
    n = len(ids[1])
    core.add(_task("big", [ids[1]] * 40))
    real_embed = engine.embed

    def timed_embed(inputs):
        timer.now += 0.001 * sum(map(len, inputs))  # 1 ms a token
        return real_embed(inputs)

    engine.embed = timed_embed
    try:
        assert core.step().batch_size == 1
        assert core.s_per_token == pytest.approx(0.001) and core.step_tokens() == 50
        assert core.step().batch_size == 50 // n  # about 50 ms of inputs
    finally:
        del engine.embed
    assert EmbeddingCore(engine, step_ms=0).step_tokens() == engine.max_batch_tokens


def test_a_step_holds_at_most_max_batch_tokens_and_every_task_gets_its_turn(tiny):
    engine, ids = tiny
    core = EmbeddingCore(engine, slots=8, step_ms=0)
    long_one = [2] + [5] * 40 + [3]
    engine_tokens = engine.max_batch_tokens
    try:
        engine.max_batch_tokens = 100
        core.add(_task("long", [long_one] * 6))
        core.add(_task("short", [ids[2]] * 6))
        taken: dict[str, int] = {"long": 0, "short": 0}
        while core.has_work():
            out = core.step()
            assert out.prefill_tokens <= 100 or out.batch_size == 1
            for _, ev in out.events:
                if isinstance(ev, EmbeddingEvent):
                    taken[ev.request_id] += 1
            assert taken["long"] > 0  # never left out: it leads every other step
        assert taken == {"long": 6, "short": 6}
        core.add(_task("huge", [[2] + [5] * 46 + [3]] * 3))  # 48 tokens an input, no two fit in 60
        engine.max_batch_tokens = 60
        sizes = []
        while core.has_work():
            sizes.append(core.step().batch_size)
        assert sizes == [1, 1, 1]  # an input longer than the rest of the step runs alone
    finally:
        engine.max_batch_tokens = engine_tokens


def test_a_task_cancelled_between_steps_ends_with_what_went_out(tiny):
    engine, ids = tiny
    core = EmbeddingCore(engine, slots=8, step_ms=0)
    core.add(_task("big", [ids[0]] * (3 * engine.max_batch)))
    first = core.step()
    assert len(first.events) == engine.max_batch and core.cancel("big")
    (_, done), = core.step().events
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled" and not core.has_work()


def test_a_cancelled_task_ends_cancelled_without_vectors(tiny):
    engine, ids = tiny
    core = EmbeddingCore(engine, step_ms=0)
    core.add(_task("r1", ids))
    assert core.cancel("r1") and not core.cancel("nope")
    (_, done), = core.step().events
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"


def test_a_task_past_its_deadline_times_out(tiny):
    engine, ids = tiny
    clock = Clock()
    core = EmbeddingCore(engine, step_ms=0, clock=clock)
    core.add(_task("r1", ids, deadline=1001.0))
    clock.t = 1002.0
    (_, err), = core.step().events
    assert isinstance(err, ErrorEvent) and err.code == "timeout"


@pytest.mark.parametrize("inputs, words", [
    ([[2, 5, 3], []], "input 1 is empty"),
    ([[2, 5, 3], [2, 10**6, 3]], "input 1 holds token id 1000000, outside the vocabulary"),
    ([[2] * 49], "input 0 has 49 tokens, over the model's max_context of 48"),
    ([[2, "x"]], "input 0 is not a list of token ids"),
    ([], "no inputs"),
])
def test_bad_inputs_end_their_task_naming_the_input_and_spare_the_others(tiny, inputs, words):
    engine, ids = tiny
    core = EmbeddingCore(engine, step_ms=0)
    core.add(_task("bad", []))
    core._jobs["bad"].task.inputs = inputs  # as a task from a gateway that checked nothing would read
    core.add(_task("good", ids[:1]))
    out = core.step()
    err = next(ev for _, ev in out.events if ev.request_id == "bad")
    assert isinstance(err, ErrorEvent) and err.code == "invalid_request" and words in err.message
    assert sorted(out.finished) == ["bad", "good"] and len(_vectors(out.events, "good")) == 1


def test_other_kinds_of_task_are_refused_by_name_and_an_embed_task_by_the_other_cores(tiny):
    engine, ids = tiny
    core = EmbeddingCore(engine, step_ms=0)
    core.add(Task("t", "tiny-embed", "normal", "conn", "c", [1, 2], SamplingParams(), 1000.0))
    core.add(SpeechTask("s", "tiny-embed", "normal", "conn", "c", AudioInput(), 1000.0))
    errs = [ev for _, ev in core.step().events]
    assert [e.message for e in errs] == ["model 'tiny-embed' embeds text; this is a text task",
                                         "model 'tiny-embed' embeds text; this is a speech task"]
    text_core, _ = make_core()
    text_core.add(_task("e", ids))
    (_, err), = text_core.step().events
    assert isinstance(err, ErrorEvent) and err.message.endswith("generates text; this is a embed task")


def test_abandoned_tasks_say_nothing_and_abandon_all_hands_them_back(tiny):
    engine, ids = tiny
    core = EmbeddingCore(engine, step_ms=0)
    core.add(_task("a", ids))
    core.add(_task("b", ids))
    assert core.abandon("a") and not core.abandon("a")
    out = core.step()
    assert out.finished == ["b"] and not [ev for _, ev in out.events if ev.request_id == "a"]
    core.add(_task("c", ids))
    assert [t.request_id for t in core.abandon_all()] == ["c"] and not core.has_work()
    with pytest.raises(ValueError, match="already running"):
        core.add(_task("d", ids))
        core.add(_task("d", ids))


def test_a_full_core_refuses_more(tiny):
    engine, ids = tiny
    core = EmbeddingCore(engine, slots=1, step_ms=0)
    core.add(_task("a", ids))
    assert core.free_slots == 0
    with pytest.raises(ValueError, match="no free slot"):
        core.add(_task("b", ids))


def test_the_task_and_the_events_round_trip_the_wire(tiny):
    engine, ids = tiny
    task = _task("r1", ids, deadline=1060.0)
    assert decode_task(task.encode()) == task and task.prompt_tokens == sum(map(len, ids))
    with pytest.raises(ValueError, match="malformed task"):
        decode_task(b'{"kind": "embed", "request_id": "r", "inputs": [1, 2]}')
    core = EmbeddingCore(engine, step_ms=0, clock=Clock())
    core.add(task)
    events = [ev for _, ev in core.step().events]
    back = decode_events(encode_events(events))
    assert back == events
    assert all(LogEntry.decode({b"e": LogEntry(ev).fields()[1]}).event == ev for ev in events)
    assert np.array_equal(np.stack([ev.values() for ev in back[:-1]]), engine.embed(ids))
