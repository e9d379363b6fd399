"""WorkerCore over a small deterministic in-memory engine (tests/support/toy_core.py).

The toy model continues every sequence by copying its prompt cyclically (greedy
output of prompt "abc" is "abcabc..."), with seeded noise in the logits so sampled
output varies; a prompt containing EOS therefore ends at that point. Token ids are
bytes (0..255) plus EOS (256) and PAD (257), decoded like a byte-level BPE.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from streamfleet.shared.schema import DoneEvent, ErrorEvent
from tests.support.toy_core import EOS, PAD, ByteTokenizer, Clock, Log, make_core, run, task

# -- basic generation ----------------------------------------------------------


def test_greedy_copies_prompt_and_stops_at_max_tokens():
    core, engine = make_core()
    log = Log()
    core.add(task("r1", "abc", max_tokens=7))
    out = log.feed(core.step())
    assert [type(e).__name__ for _, e in out.events] == ["TokenEvent"]  # token 0 right after prefill
    assert out.batch_size == 1 and out.new_tokens == 1
    run(core, log)
    log.check("r1")
    assert log.text("r1") == "abcabca"
    done = log.end("r1")
    assert done.finish_reason == "length" and done.prompt_tokens == 3 and done.completion_tokens == 7
    assert engine.seqs == {} and core.free_slots == 8


def test_eos_finishes_with_stop_and_is_not_a_token():
    core, engine = make_core()
    log = Log()
    core.add(task("r1", [ord("h"), ord("i"), EOS]))
    run(core, log)
    log.check("r1")
    assert log.text("r1") == "hi"
    assert log.end("r1").finish_reason == "stop" and log.end("r1").completion_tokens == 2
    assert engine.seqs == {}


def test_eos_as_first_token():
    core, _ = make_core()
    log = Log()
    core.add(task("r1", [EOS]))
    run(core, log)
    log.check("r1")
    assert log.tokens("r1") == [] and log.end("r1").finish_reason == "stop"


def test_stop_string_spanning_tokens_is_excluded():
    core, engine = make_core()
    log = Log()
    core.add(task("r1", "ab\n\ncd", stop=["\n\n"], max_tokens=50))
    run(core, log)
    log.check("r1")
    assert log.text("r1") == "ab"
    assert [e.text for e in log.tokens("r1")] == ["a", "b", "", ""]
    assert log.end("r1").finish_reason == "stop" and log.end("r1").completion_tokens == 4
    assert engine.seqs == {}


def test_held_stop_prefix_is_flushed_into_last_event_on_eos():
    core, _ = make_core()
    log = Log()
    core.add(task("r1", [ord("a"), ord("\n"), EOS], stop=["\n\n"]))
    run(core, log)
    log.check("r1")
    assert [e.text for e in log.tokens("r1")] == ["a", "\n"]
    assert log.end("r1").finish_reason == "stop"


def test_held_stop_prefix_is_flushed_on_length():
    core, _ = make_core()
    log = Log()
    core.add(task("r1", "xy\n", stop=["\n\n"], max_tokens=3))
    run(core, log)
    log.check("r1")
    assert log.text("r1") == "xy\n" and log.end("r1").finish_reason == "length"


def test_multibyte_characters_are_held_until_complete():
    core, _ = make_core()
    log = Log()
    core.add(task("r1", ByteTokenizer.encode("你😀") + [EOS]))
    run(core, log)
    log.check("r1")
    texts = [e.text for e in log.tokens("r1")]
    assert texts == ["", "", "你", "", "", "", "😀"]


def test_incomplete_character_at_eos_becomes_replacement_char():
    core, _ = make_core()
    log = Log()
    core.add(task("r1", ByteTokenizer.encode("a你")[:-1] + [EOS]))
    run(core, log)
    log.check("r1")
    assert [e.text for e in log.tokens("r1")] == ["a", "", "\ufffd"]


def test_max_context_ends_with_length():
    core, engine = make_core(max_context=16)
    log = Log()
    core.add(task("r1", "0123456789", max_tokens=100))
    core.add(task("r2", "x" * 15, max_tokens=100))  # the longest prompt allowed: one token
    run(core, log)
    for rid, n in (("r1", 6), ("r2", 1)):
        log.check(rid)
        assert log.end(rid).finish_reason == "length" and log.end(rid).completion_tokens == n
    assert engine.seqs == {}


# -- validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "kw", "code"),
    [
        ([], {}, "invalid_request"),
        ("x" * 16, {}, "prompt_too_long"),
        ([1, 2, 999], {}, "invalid_request"),
        ([1, -1], {}, "invalid_request"),
        ([1, True], {}, "invalid_request"),  # a bool is not a token id
        ([1, 2.0], {}, "invalid_request"),
        ([1, "2"], {}, "invalid_request"),
        ([1, [2]], {}, "invalid_request"),
        ("ok", {"max_tokens": -1}, "invalid_request"),  # 0 is legal: the prompt alone (echo)
        ("ok", {"max_tokens": 0, "prompt_logprobs": 21}, "invalid_request"),
        ("ok", {"prompt_logprobs": 0}, "invalid_request"),  # the toy engine cannot compute them
        ("ok", {"temperature": -1.0}, "invalid_request"),
        ("ok", {"deadline": 999.0}, "timeout"),
    ],
)
def test_invalid_tasks_end_with_error_in_next_step(prompt, kw, code):
    core, engine = make_core(max_context=16, max_batch=1)
    log = Log()
    core.add(task("bad", prompt, **kw))
    assert core.free_slots == 1 and core.active == 0 and core.has_work()
    core.add(task("good", "ok", max_tokens=2))
    out = log.feed(core.step())
    assert "bad" in out.finished
    log.check("bad")
    assert isinstance(log.end("bad"), ErrorEvent) and log.end("bad").code == code
    assert all("bad" not in ids for _, ids in engine.calls)
    run(core, log)
    log.check("good")


def test_add_refuses_duplicates_and_full_batch():
    core, _ = make_core(max_batch=1)
    core.add(task("r1", "a"))
    assert "r1" in core
    with pytest.raises(ValueError):
        core.add(task("r2", "a"))
    core2, _ = make_core()
    core2.add(task("r1", "a"))
    with pytest.raises(ValueError):
        core2.add(task("r1", "a"))


# -- continuous batching and cancel --------------------------------------------


def test_sequences_join_and_leave_between_steps():
    core, engine = make_core(max_batch=3)
    log = Log()
    core.add(task("A", "aaaa", max_tokens=5))
    core.add(task("B", "bb", max_tokens=2))
    assert core.free_slots == 1 and core.active == 2
    log.feed(core.step())
    assert engine.calls == [("prefill", ["A", "B"])]
    core.add(task("C", "c", max_tokens=3))
    out = log.feed(core.step())
    assert engine.calls[1:] == [("prefill", ["C"]), ("decode", ["A", "B"])]
    assert out.finished == ["B"] and out.batch_size == 3 and out.new_tokens == 3
    assert core.free_slots == 1 and set(engine.seqs) == {"A", "C"}  # B left at once
    core.add(task("D", "d", max_tokens=1))
    out = log.feed(core.step())
    assert engine.calls[3:] == [("prefill", ["D"]), ("decode", ["A", "C"])]
    assert out.finished == ["D"]
    run(core, log)
    for rid, text in (("A", "aaaaa"), ("B", "bb"), ("C", "ccc"), ("D", "d")):
        log.check(rid)
        assert log.text(rid) == text
    assert core.free_slots == 3 and engine.seqs == {} and not core.has_work()


def test_cancel_frees_slot_within_one_step():
    core, engine = make_core(max_batch=2)
    log = Log()
    core.add(task("A", "abc", max_tokens=100))
    core.add(task("B", "xyz", max_tokens=100))
    log.feed(core.step())
    log.feed(core.step())
    assert core.free_slots == 0
    assert core.cancel("A") and not core.cancel("A") and not core.cancel("nope")
    out = log.feed(core.step())
    assert out.finished == ["A"] and "A" not in engine.seqs
    assert engine.calls[-1] == ("decode", ["B"])
    assert core.free_slots == 1
    log.check("A")
    assert log.end("A").finish_reason == "cancelled" and log.end("A").completion_tokens == 2


def test_cancel_before_prefill_never_reaches_engine():
    core, engine = make_core()
    log = Log()
    core.add(task("A", "abc"))
    assert core.cancel("A")
    run(core, log)
    log.check("A")
    assert log.end("A") == DoneEvent("A", "cancelled", 3, 0, 0.0, 0.0, 0.0)
    assert engine.calls == []


def test_cancel_with_deferred_event_keeps_index_invariant():
    core, _ = make_core()
    log = Log()
    core.add(task("A", ByteTokenizer.encode("你好"), max_tokens=100))
    log.feed(core.step())  # token 0: first byte of 你, held: event deferred
    assert log.tokens("A") == []
    core.cancel("A")
    run(core, log)
    log.check("A")
    assert [e.text for e in log.tokens("A")] == [""] and log.end("A").completion_tokens == 1


def test_abandon_all_releases_everything_silently():
    core, engine = make_core()
    log = Log()
    core.add(task("A", "abc", max_tokens=100))
    log.feed(core.step())
    core.add(task("B", "abc"))
    core.add(task("bad", []))
    tasks = core.abandon_all()
    assert sorted(t.request_id for t in tasks) == ["A", "B", "bad"]
    assert engine.seqs == {} and core.free_slots == 8 and not core.has_work()


# -- timing --------------------------------------------------------------------


def test_timing_fields_from_clock():
    clock = Clock(1000.5)
    core, _ = make_core(clock=clock)
    log = Log()
    core.add(task("A", "ab", max_tokens=3, created_at=1000.0))
    clock.t = 1000.75
    log.feed(core.step())
    clock.t = 1001.0
    run(core, log)
    done = log.end("A")
    assert done.queue_ms == pytest.approx(500.0)
    assert done.ttft_ms == pytest.approx(750.0)
    assert done.total_ms == pytest.approx(1000.0)


# -- sampling determinism ------------------------------------------------------


def _sampled(rid_prompt_seed, others, stagger):
    core, _ = make_core(max_batch=8)
    log = Log()
    rid, prompt, seed = rid_prompt_seed
    for i, (orid, oprompt) in enumerate(others[: stagger]):
        core.add(task(orid, oprompt, temperature=1.0, seed=i, max_tokens=5 + i))
    log.feed(core.step())
    core.add(task(rid, prompt, temperature=0.9, seed=seed, max_tokens=30))
    for orid, oprompt in others[stagger:]:
        log.feed(core.step())
        core.add(task(orid, oprompt, temperature=1.3, seed=7, max_tokens=4))
    run(core, log)
    log.check(rid)
    return [(e.index, e.text) for e in log.tokens(rid)], log


def test_seeded_sampling_same_alone_and_batched():
    alone, _ = _sampled(("R", "hello world", 123), [], 0)
    others = [(f"o{i}", p) for i, p in enumerate(["zzz", "你好", "q", "abcdefg", "0"])]
    batched, _log = _sampled(("R", "hello world", 123), others, 2)
    assert alone == batched
    assert len(alone) == 30
    other_seed, _ = _sampled(("R", "hello world", 124), [], 0)
    assert other_seed != alone


# -- engine failures -----------------------------------------------------------


def test_sequence_error_ends_only_that_sequence():
    ref_core, _ = make_core()
    ref = Log()
    for rid in "ABC":
        ref_core.add(task(rid, rid.lower() * 3, temperature=1.0, seed=ord(rid), max_tokens=10))
    run(ref_core, ref)

    core, engine = make_core()
    log = Log()
    for rid in "ABC":
        core.add(task(rid, rid.lower() * 3, temperature=1.0, seed=ord(rid), max_tokens=10))
    log.feed(core.step())
    log.feed(core.step())
    engine.fail_ids = {"B"}
    out = log.feed(core.step())
    assert out.finished == ["B"]
    run(core, log)
    for rid in "ABC":
        log.check(rid)
    assert isinstance(log.end("B"), ErrorEvent) and log.end("B").code == "engine_error"
    assert [e.index for e in log.tokens("B")] == [0, 1]
    for rid in "AC":
        assert log.events[rid] == ref.events[rid]
    assert engine.seqs == {}


def test_sequence_error_in_prefill():
    core, engine = make_core()
    log = Log()
    engine.fail_ids = {"B"}
    for rid in "AB":
        core.add(task(rid, "xy", max_tokens=3))
    run(core, log)
    assert isinstance(log.end("B"), ErrorEvent) and log.tokens("B") == []
    assert log.text("A") == "xyx"
    assert engine.seqs == {}


@pytest.mark.parametrize("where", ["crash", "shape"])
def test_engine_crash_ends_call_and_core_stays_usable(where):
    core, engine = make_core()
    log = Log()
    core.add(task("A", "abc", max_tokens=50))
    log.feed(core.step())
    core.add(task("B", "abc", max_tokens=50))
    if where == "shape":
        engine.bad_shape = True
    else:
        engine.crash = RuntimeError("CUDA exploded")
    out = log.feed(core.step())
    engine.bad_shape = False
    # the crash hits the first call of the step (prefill of B); bad shapes both calls
    victims = {"crash": ["B"], "shape": ["B", "A"]}[where]
    assert out.finished == victims
    for rid in victims:
        log.check(rid)
        assert log.end(rid).code == "engine_error"
        assert rid not in engine.seqs
    core.add(task("C", "ok", max_tokens=2))
    run(core, log)
    log.check("C")
    assert log.text("C") == "ok"
    assert engine.seqs == {} and core.free_slots == 8


def test_decode_crash_ends_running_sequences():
    core, engine = make_core()
    log = Log()
    core.add(task("A", "abc", max_tokens=50))
    core.add(task("B", "abc", max_tokens=50))
    log.feed(core.step())
    engine.crash = RuntimeError("boom")
    out = log.feed(core.step())
    assert sorted(out.finished) == ["A", "B"]
    assert engine.seqs == {} and core.free_slots == 8


# -- index invariant under random schedules ------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(
                st.sampled_from([97, 98, 10, 0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x98, 0x80, EOS, PAD]),
                min_size=1,
                max_size=6,
            ),
            st.integers(1, 12),
            st.sampled_from([[], ["\n\n"], ["ab"], ["a", "\n"], ["你"]]),
            st.sampled_from([0.0, 0.7, 1.5]),
            st.integers(0, 3),
        ),
        st.tuples(st.just("cancel"), st.integers(0, 20)),
        st.tuples(st.just("step")),
        st.tuples(st.just("fail"), st.integers(0, 20)),
    ),
    max_size=40,
)


def expected_greedy(prompt: list[int], max_tokens: int, max_context: int) -> str:
    gen: list[int] = []
    while True:
        t = prompt[len(gen) % len(prompt)]
        if t == EOS:
            break
        gen.append(t)
        if len(gen) >= max_tokens or len(prompt) + len(gen) >= max_context:
            break
    return ByteTokenizer().decode(gen, skip_special_tokens=True)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS, st.integers(1, 4), st.integers(6, 24))
def test_property_index_invariant_under_random_schedules(ops, max_batch, max_context):
    core, engine = make_core(max_batch=max_batch, max_context=max_context)
    log = Log()
    added: list[str] = []
    greedy: dict[str, str] = {}  # plain greedy requests (no stop): their exact text
    for op in ops:
        if op[0] == "add" and core.free_slots > 0:
            _, prompt, max_tokens, stop, temp, seed = op
            rid = f"r{len(added)}"
            core.add(task(rid, prompt, max_tokens=max_tokens, stop=stop, temperature=temp, seed=seed))
            added.append(rid)
            if temp == 0.0 and not stop:
                greedy[rid] = expected_greedy(prompt, max_tokens, max_context)
        elif op[0] == "cancel" and added:
            rid = added[op[1] % len(added)]
            core.cancel(rid)
            greedy.pop(rid, None)
        elif op[0] == "fail" and added:
            rid = added[op[1] % len(added)]
            engine.fail_ids.add(rid)
            greedy.pop(rid, None)
        elif op[0] == "step":
            log.feed(core.step())
        assert 0 <= core.free_slots <= max_batch
        assert set(engine.seqs) <= set(added)
    run(core, log)
    for rid in added:
        log.check(rid)
    for rid, text in greedy.items():
        if isinstance(log.end(rid), DoneEvent):
            assert log.text(rid) == text
    assert engine.seqs == {} and core.free_slots == max_batch and not core.has_work()
