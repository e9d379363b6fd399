"""Chunked prefill and the prefix cache on the real ONNX Runtime engine (tiny-gpt):
a prompt fed in chunks, or started from cached blocks, gives exactly the logits of a
prefill in one piece, and the worker core keeps the running streams decoding while a
long prompt goes in chunk by chunk (docs/scheduling.md, "Prefix cache", "Chunked prefill")."""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest

from streamfleet.shared.modelrepo import load_tokenizer
from streamfleet.shared.schema import DoneEvent, SamplingParams, Task, TokenEvent
from streamfleet.workers.core import WorkerCore
from streamfleet.workers.engines.onnxruntime import InvalidSequenceError, OnnxRuntimeEngine

RNG = np.random.default_rng(7)
SYSTEM = RNG.integers(3, 500, 90).tolist()  # tiny-gpt: 512 tokens, context 256


def greedy(engine: OnnxRuntimeEngine, sid: str, prompt: list[int], steps: int, chunk: int | None = None
           ) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and every step's logits; the prompt in chunks of ``chunk`` after
    whatever the prefix cache had (``start``/``extend``), or in one ``prefill``."""
    if chunk:
        n = engine.start([(sid, prompt)])[0]
        rest = prompt[n:]
        cuts = list(range(0, len(rest), chunk))
        if len(rest) - cuts[-1] == 1 and len(cuts) > 1:  # never a chunk of one token (see extend)
            cuts.pop()
        for a, b in zip(cuts, [*cuts[1:], len(rest)]):
            logits = engine.extend([(sid, rest[a:b])])
    else:
        logits = engine.prefill([(sid, prompt)])
    tokens, rows = [], [logits[0].copy()]
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[0])))
        logits = engine.decode([(sid, tokens[-1])])
        rows.append(logits[0].copy())
    engine.release(sid)
    return tokens, rows


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "slab"])
def test_cache_and_chunks_give_the_bits_of_one_prefill(tiny_spec, invariant):
    """A conversation over four turns, each re-sending the earlier ones: with the cache
    (blocks of 16) and chunks of odd sizes, every logit equals the no-cache engine's."""
    ref = OnnxRuntimeEngine(tiny_spec, threads=1, batch_invariant=invariant)
    on = OnnxRuntimeEngine(tiny_spec, threads=1, batch_invariant=invariant, prefix_cache_mb=16, prefix_block=16)
    history = list(SYSTEM)
    for turn in range(4):
        history += RNG.integers(3, 500, 13).tolist()
        a, ra = greedy(ref, f"r{turn}", history, 20)
        b, rb = greedy(on, f"o{turn}", history, 20, chunk=(None, 37, 5, 64)[turn])
        assert a == b
        assert all(np.array_equal(x, y) for x, y in zip(ra, rb)), f"turn {turn}"
        history += a
    st = on.prefix_cache.stats
    assert st.lookups == 4 and st.hits == 3 and st.cached_tokens >= 3 * 96


def test_only_prefilled_blocks_are_kept(tiny_spec):
    """A block completed by decode steps is not cached: its numbers are not a prefill's."""
    e = OnnxRuntimeEngine(tiny_spec, threads=1, prefix_cache_mb=16, prefix_block=16)
    prompt = SYSTEM[:40]  # 2 whole blocks and 8 tokens
    e.prefill([("a", prompt)])
    assert len(e.prefix_cache) == 2
    for t in range(30):  # takes it to 70 tokens: blocks 2-3 complete while decoding
        e.decode([("a", 5 + t)])
    assert len(e.prefix_cache) == 2
    e.release("a")


def test_extend_refuses_by_name(tiny_spec):
    e = OnnxRuntimeEngine(tiny_spec, threads=1, prefix_cache_mb=16, prefix_block=16)
    e.start([("a", [1, 2, 3])])
    with pytest.raises(InvalidSequenceError, match="'nope' is not live"):
        e.extend([("nope", [1])])
    with pytest.raises(InvalidSequenceError, match="'a' was given no tokens"):
        e.extend([("a", [])])
    with pytest.raises(InvalidSequenceError, match="max_context"):
        e.extend([("a", [1] * (e.max_context + 1))])
    with pytest.raises(InvalidSequenceError, match="outside"):
        e.extend([("a", [e.vocab_size])])
    with pytest.raises(ValueError, match="twice"):
        e.extend([("a", [1]), ("a", [2])])
    assert e.extend([("a", [1, 2, 3])]).shape == (1, e.vocab_size)


def task(rid: str, prompt: list[int], max_tokens: int = 12, temperature: float = 1.0, **params) -> Task:
    # (the seed from the id, the same in every process: ``hash`` of a str is salted per process)
    return Task(request_id=rid, model="tiny-gpt", lane="normal", reply_to="c", client_id=rid, prompt_ids=list(prompt),
                params=SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                      seed=zlib.crc32(rid.encode()) % 1000, ignore_eos=True, **params),
                created_at=time.time())


def run(core: WorkerCore, *tasks: Task, trace: list | None = None) -> dict[str, str]:
    for t in tasks:
        core.add(t)
    texts: dict[str, str] = {}
    while core.has_work():
        out = core.step()
        if trace is not None:
            trace.append(out)
        for _, ev in out.events:
            if isinstance(ev, TokenEvent):
                texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
    return texts


@pytest.fixture(scope="module")
def tokenizer(tiny_spec):
    return load_tokenizer(tiny_spec)


def test_a_long_prompt_goes_in_chunks_beside_the_running_streams(tiny_spec, tokenizer):
    """Budget 40: two streams decode every step while a 200-token prompt goes in over
    several steps; everyone's text is what it is with no budget and no cache."""
    long_prompt = RNG.integers(3, 500, 200).tolist()
    def tasks():
        return [task("s1", SYSTEM[:20], 40), task("s2", SYSTEM[20:50], 40), task("long", long_prompt, 8)]

    plain = WorkerCore(OnnxRuntimeEngine(tiny_spec, threads=1), tokenizer)
    want = run(plain, *tasks())

    engine = OnnxRuntimeEngine(tiny_spec, threads=1, prefix_cache_mb=16, prefix_block=16)
    core = WorkerCore(engine, tokenizer, max_step_tokens=40)
    first = tasks()
    for t in first[:2]:
        core.add(t)
    core.step()
    while core._feeding:  # until both streams decode
        core.step()
    core.add(first[2])
    trace: list = []
    run(core, trace=trace)
    # every step fed both streams a token while the long prompt went in: 200 tokens,
    # 38 a step (40 less the 2 decodes), so 6 steps before its first token
    feeding = [o for o in trace if o.prefill_tokens]
    assert [o.prefill_tokens for o in feeding] == [38, 38, 38, 38, 38, 10]
    streams = [{ev.request_id for _, ev in o.events if isinstance(ev, TokenEvent)} for o in trace]
    last = trace.index(feeding[-1])
    for o in streams[:last]:
        assert {"s1", "s2"} <= o
    # the step that feeds the last chunk sends the long prompt's first token without
    # waiting for the streams' decodes; those make the next step, with the long one's
    # second token and nothing fed
    assert streams[last] == {"long"}
    assert streams[last + 1] == {"s1", "s2", "long"} and trace[last + 1].prefill_tokens == 0
    # the same texts, token for token, as with no budget and no cache
    again = WorkerCore(OnnxRuntimeEngine(tiny_spec, threads=1, prefix_cache_mb=16, prefix_block=16), tokenizer,
                       max_step_tokens=40)
    assert run(again, *tasks()) == want


def test_a_cached_prefix_is_not_prefilled_again(tiny_spec, tokenizer):
    engine = OnnxRuntimeEngine(tiny_spec, threads=1, prefix_cache_mb=16, prefix_block=16)
    core = WorkerCore(engine, tokenizer, max_step_tokens=64)
    trace: list = []
    first = run(core, task("a", [*SYSTEM, 7, 8, 9]), trace=trace)
    assert sum(o.prefill_tokens for o in trace) == 93 and sum(o.cached_tokens for o in trace) == 0
    trace.clear()
    second = run(core, task("b", [*SYSTEM, 7, 8, 9, 10]), trace=trace)
    # 90 + 4 tokens: 5 whole blocks of 16 cached, 14 computed
    assert sum(o.cached_tokens for o in trace) == 80 and sum(o.prefill_tokens for o in trace) == 14
    plain = WorkerCore(OnnxRuntimeEngine(tiny_spec, threads=1), tokenizer)
    assert run(plain, task("a", [*SYSTEM, 7, 8, 9]), task("b", [*SYSTEM, 7, 8, 9, 10])) == {**first, **second}


def test_choices_wait_for_their_prompts_chunks_and_fork_it(tiny_spec, tokenizer):
    """n choices of a 150-token prompt, budget 32: one sequence is fed the prompt, the
    others fork its cache when it is all in; each draws what it draws alone."""
    prompt = RNG.integers(3, 500, 150).tolist()
    choices = [task(f"c{i}", prompt, 10) for i in range(3)]
    for t in choices:
        t.group, t.group_size = "g", 3
    alone = {}
    for t in choices:
        solo = Task(**{**t.__dict__, "group": "", "group_size": 1}) if hasattr(t, "__dict__") else t
        alone.update(run(WorkerCore(OnnxRuntimeEngine(tiny_spec, threads=1), tokenizer), solo))
    core = WorkerCore(OnnxRuntimeEngine(tiny_spec, threads=1, prefix_cache_mb=16, prefix_block=16), tokenizer,
                      max_step_tokens=32)
    trace: list = []
    got = run(core, *choices, trace=trace)
    assert got == alone
    assert sum(o.prefill_tokens for o in trace) == 150 and sum(o.shared_prefills for o in trace) == 2


def test_a_choice_whose_leader_is_cancelled_mid_prompt_starts_on_its_own(tiny_spec, tokenizer):
    prompt = RNG.integers(3, 500, 150).tolist()
    lead, follow = task("lead", prompt, 6), task("follow", prompt, 6)
    want = run(WorkerCore(OnnxRuntimeEngine(tiny_spec, threads=1), tokenizer), task("follow", prompt, 6))
    core = WorkerCore(OnnxRuntimeEngine(tiny_spec, threads=1), tokenizer, max_step_tokens=32)
    core.add(lead)
    core.add(follow)
    core.step()
    core.step()  # lead is being fed; follow waits for it
    assert core.cancel("lead")
    texts: dict[str, str] = {}
    ends: dict[str, str] = {}
    while core.has_work():
        for _, ev in core.step().events:
            if isinstance(ev, TokenEvent):
                texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
            elif isinstance(ev, DoneEvent):
                ends[ev.request_id] = ev.finish_reason
    assert ends == {"lead": "cancelled", "follow": "length"} and texts == want
    assert core.active == 0 and not core._feeding and not core._leader_of


def test_a_takeover_replay_reads_the_cache_and_gives_the_same_text(tiny_spec, tokenizer):
    """Greedy: a replay prefills the tokens the dead worker decoded, whose cache then
    differs from theirs in the last bits, so a *sampled* token after it may, rarely,
    differ (docs/failures.md); the greedy text is the same."""
    prompt = [*SYSTEM, 4, 4]
    whole = run(WorkerCore(OnnxRuntimeEngine(tiny_spec, threads=1), tokenizer), task("x", prompt, 12, 0.0))
    engine = OnnxRuntimeEngine(tiny_spec, threads=1, prefix_cache_mb=16, prefix_block=16)
    core = WorkerCore(engine, tokenizer, max_step_tokens=24)
    core.add(task("x", prompt, 12, 0.0))
    ids: list[int] = []
    for _ in range(20):  # run until 5 tokens are out, then "die"
        ids += [tid for (rid, _), tid in sorted(core.step().token_ids.items())]
        if len(ids) >= 5:
            break
    core.abandon_all()
    trace: list = []
    core.add(task("x", prompt, 12, 0.0), replay=ids[:5])
    texts = run(core, trace=trace)
    assert sum(o.cached_tokens for o in trace) == 80  # the prompt's 5 whole blocks
    assert whole["x"].endswith(texts["x"]) and len(texts["x"]) < len(whole["x"])


def test_no_sequence_waits_on_a_prefill_that_is_over(tiny_spec, tokenizer):
    """The safety net: a follower left registered on a leader that is no longer fed (here
    forced by hand) starts on its own at the next step instead of waiting for ever."""
    prompt = RNG.integers(3, 500, 60).tolist()
    want = run(WorkerCore(OnnxRuntimeEngine(tiny_spec, threads=1), tokenizer), task("f", prompt, 5))
    core = WorkerCore(OnnxRuntimeEngine(tiny_spec, threads=1), tokenizer, max_step_tokens=16)
    core.add(task("l", prompt, 5))
    core.add(task("f", prompt, 5))
    core.step()
    assert core._leader_of  # f waits for l's chunks
    import copy

    ghost = copy.copy(core._sched.get("l"))  # as if f waited on a sequence whose prefill is over
    ghost.task = task("ghost", prompt, 5)
    core._leader_of["f"] = ghost
    texts: dict[str, str] = {}
    while core.has_work():
        for _, ev in core.step().events:
            if isinstance(ev, TokenEvent):
                texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
    assert texts["f"] == want["f"] and not core._leader_of
