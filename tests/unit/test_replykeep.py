"""Replies in the prefix cache (docs/scheduling.md, "Prefix cache"; workers/replykeep.py):
a decoded token's K/V is kept only where it is a prefill's bits (measured per engine);
elsewhere a finished reply's blocks are computed by a prefill while the worker is idle,
so a conversation's next turn prefills only what follows its last whole block. Its
output is the same, to the last bit of every log probability, as with the cache off:
greedy and sampled, over several turns, after a takeover and on a new model version.
On the GQA engine (tests/support/gguf_models.py's random GGUF model, in each weights mode)
and the with-past engine (tiny-gpt, batch-invariant and slab)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from streamfleet.shared.gguf_gqa import write_gqa_graph
from streamfleet.shared.ggufimport import import_gguf, read_gguf
from streamfleet.shared.modelrepo import ModelRepository, load_tokenizer
from streamfleet.shared.schema import DoneEvent, ErrorEvent, SamplingParams, Task, TokenEvent
from streamfleet.workers.core import WorkerCore
from streamfleet.workers.engines import onnx_gqa
from streamfleet.workers.engines.onnx_gqa import OnnxGqaEngine
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine
from streamfleet.workers.replykeep import CHUNK, ReplyKeeper
from tests.support.gguf_models import TinyLlama, write_tiny_gguf

BLOCK = 8
RNG = np.random.default_rng(49)


def _gqa_spec(root: Path, weights: str):
    model = TinyLlama(seed=4, n_layer=4 if weights == "q4-int8act" else 2, context=256)
    src = write_tiny_gguf(root / f"{weights}.gguf", model)
    dest, _ = import_gguf(src, root / "engines", weights, weights=weights, max_batch=8)
    write_gqa_graph(read_gguf(src), dest, weights=weights, max_context=model.context)
    return ModelRepository(root / "engines").get(weights)


KINDS = ["gqa-fp32", "gqa-q4", "gqa-q4-int8act", "tiny-gpt", "tiny-gpt-slab"]


@pytest.fixture(scope="module", params=KINDS)
def kind(request, tmp_path_factory, tiny_spec):
    """(name, spec, make): ``make(cache_mb, version="1")`` builds the engine (of that model
    version: the same weights, another cache namespace), with a prefix cache of blocks of
    ``BLOCK`` tokens when ``cache_mb`` > 0."""
    name = request.param
    if name.startswith("gqa-"):
        spec = _gqa_spec(tmp_path_factory.mktemp("replies"), name[4:])
        return name, spec, lambda mb, version="1": OnnxGqaEngine(
            dataclasses.replace(spec, version=version), threads=1, prefix_cache_mb=mb, prefix_block=BLOCK)
    invariant = name == "tiny-gpt"
    return name, tiny_spec, lambda mb, version="1": OnnxRuntimeEngine(
        dataclasses.replace(tiny_spec, version=version), threads=1, batch_invariant=invariant, prefix_cache_mb=mb,
        prefix_block=BLOCK)


def _kv(engine, seq_id: str) -> list[np.ndarray]:
    if isinstance(engine, OnnxGqaEngine):
        return [np.array(a) for a in engine._kv_of(seq_id)]
    return [np.array(a) for a in engine._cache_of(engine._seqs[seq_id])]


def test_decoded_blocks_are_kept_only_where_a_decode_gives_a_prefills_bits(kind):
    """The engine's own measurement agrees with a longer one: a prompt prefilled whole,
    against its first part prefilled and the rest decoded token by token (on x86-64 they
    differ from the second layer on: ONNX Runtime's one-row products)."""
    name, _, make = kind
    engine = make(4)
    prompt = [int(t) for t in RNG.integers(1, engine.vocab_size, 30)]
    engine.prefill([("whole", prompt)])
    whole = _kv(engine, "whole")
    engine.prefill([("dec", prompt[:10])])
    for t in prompt[10:]:
        engine.decode([("dec", t)])
    decoded = _kv(engine, "dec")
    alike = all(np.array_equal(a[:, 10:], b[:, 10:]) for a, b in zip(whole, decoded))
    assert engine.decoded_blocks == (alike and engine.batch_invariant), name
    assert all(np.array_equal(a[:, :10], b[:, :10]) for a, b in zip(whole, decoded))  # the prompt part: a prefill's
    assert not make(0).decoded_blocks  # no cache, nothing to keep
    assert ReplyKeeper.wanted(engine) == (not engine.decoded_blocks)
    engine.close()


def test_blocks_decode_steps_complete_are_named_once_each_and_would_change_a_later_prompt(kind, monkeypatch):
    """With ``decoded_blocks`` forced on, each block a decode step completes is hashed once,
    when its last token is fed (no rehash of the sequence); where a decode's bits are not a
    prefill's, a later prompt served from those blocks gets other logits than with the
    cache off: why the engine measures before it keeps them."""
    name, _, make = kind
    if not name.startswith("gqa-"):
        pytest.skip("the hashing is counted on the GQA engine")
    engine, plain = make(4), make(0)
    engine.decoded_blocks = True
    calls = []
    real = onnx_gqa.block_hashes
    monkeypatch.setattr(onnx_gqa, "block_hashes", lambda *a: calls.append(len(a[1])) or real(*a))
    prompt = [int(t) for t in RNG.integers(1, engine.vocab_size, 12)]  # one whole block and 4 tokens
    engine.prefill([("a", prompt)])
    assert calls == [BLOCK]
    tokens = [int(t) for t in RNG.integers(1, engine.vocab_size, 30)]  # to 42 fed: blocks 1 to 4 complete
    for t in tokens:
        engine.decode([("a", t)])
    assert calls == [BLOCK] * 5 and len(engine.prefix_cache) == 5
    engine.release("a")
    later = prompt + tokens + [5, 6, 7]
    got = engine.prefill([("b", later)])[0]
    want = plain.prefill([("b", later)])[0]
    assert engine.prefix_cache.stats.cached_tokens == 40
    # where decode steps give other bits (x86-64), the forced cache changed the output
    assert np.array_equal(got, want) == make(4).decoded_blocks, name


# -- through a worker core -------------------------------------------------------------------

SYSTEM = [int(t) for t in RNG.integers(3, 250, 37)]


def _task(rid: str, prompt: list[int], *, temperature: float, seed: int, max_tokens: int = 21) -> Task:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True, logprobs=2)
    return Task(request_id=rid, model="m", lane="normal", reply_to="c", client_id=rid, prompt_ids=list(prompt),
                params=params, created_at=1000.0)


def _run(core: WorkerCore, task: Task, replay: list[int] | None = None) -> tuple[list[int], list, int]:
    """One request alone through ``core`` (continuing after ``replay``, as a worker that
    took it over does): all its token ids, the log probabilities of those it generated
    (the logits' last bits show in them) and the tokens its DoneEvent says were cached."""
    core.add(task, replay=replay)
    got: dict[int, int] = dict(enumerate(replay or []))
    lps, cached = [], None
    while core.has_work():
        out = core.step()
        for _, ev in out.events:
            assert not isinstance(ev, ErrorEvent), ev.message
            if isinstance(ev, TokenEvent) and ev.logprobs is not None:
                top = tuple((e["id"], e["logprob"]) for e in ev.logprobs["top"])
                lps.append((ev.index, ev.logprobs["logprob"], top))
            if isinstance(ev, DoneEvent):
                cached = ev.cached_tokens
        got.update({index: token for (_, index), token in out.token_ids.items()})
    assert sorted(got) == list(range(len(got)))
    return [got[i] for i in range(len(got))], lps, cached


def _idle(core: WorkerCore) -> int:
    """The idle steps until nothing is left; the tokens they computed."""
    total = 0
    while core.idle_work():
        n = core.idle_step()
        assert n <= CHUNK
        total += n
    return total


def _conversation(make, *, cache: bool, temperature: float, turns: int = 4, idle: bool = True):
    """``turns`` turns, each prompt the last one, its whole reply and a new message of 5
    tokens; per turn: (prompt, tokens, log probabilities, cached tokens)."""
    engine = make(4 if cache else 0)
    core = WorkerCore(engine, load_tokenizer(engine.spec), clock=lambda: 1000.0, max_step_tokens=16)
    history, out = list(SYSTEM), []
    for t in range(turns):
        history += [int(x) for x in np.random.default_rng(t).integers(3, 250, 5)]
        ids, lps, cached = _run(core, _task(f"turn{t}", history, temperature=temperature, seed=7 + t))
        out.append((list(history), ids, lps, cached))
        if idle:
            _idle(core)
        history += ids
    engine.close()
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_a_conversation_gives_the_same_bits_with_the_replies_cached(kind, temperature):
    """Four turns: each turn's tokens and log probabilities equal the cache-off ones, and
    each turn after the first starts from every whole block of the last prompt and reply
    (sampled: the blocks hold the tokens fed, whatever chose them)."""
    name, _, make = kind
    off = _conversation(make, cache=False, temperature=temperature)
    on = _conversation(make, cache=True, temperature=temperature)
    for t, ((p_off, ids_off, lp_off, _), (p_on, ids_on, lp_on, cached)) in enumerate(zip(off, on)):
        assert p_on == p_off and ids_on == ids_off and lp_on == lp_off, (name, t)
        if t:
            before = len(off[t - 1][0]) + len(off[t - 1][1])  # the last prompt and its reply
            assert cached == before // BLOCK * BLOCK, (name, t, cached, before)


def test_without_the_idle_steps_only_prompts_are_cached(kind):
    _, _, make = kind
    on = _conversation(make, cache=True, temperature=0.0, turns=3, idle=False)
    for t in (1, 2):
        assert on[t][3] == len(on[t - 1][0]) // BLOCK * BLOCK  # the last prompt's whole blocks, not its reply's


def _takeover(make, spec, *, cache: bool):
    """Six turns: 1-2 on worker A; turn 3 on A, and then again on worker B, which took it
    over after A's first 6 tokens (its replay; B's cache holds nothing of this
    conversation); turn 4 on B; turns 5-6 on a worker of a new version of the model (the
    same weights, another cache namespace). Per turn: (tokens, log probabilities, cached)."""
    mb = 4 if cache else 0
    cores = {k: WorkerCore(make(mb, version), load_tokenizer(spec), clock=lambda: 1000.0, max_step_tokens=16)
             for k, version in (("a", "1"), ("b", "1"), ("v2", "2"))}
    history, out = list(SYSTEM), []
    for t, where in enumerate(["a", "a", "a", "b", "v2", "v2"]):
        history += [int(x) for x in np.random.default_rng(t).integers(3, 250, 5)]
        task = _task(f"turn{t}", history, temperature=0.9, seed=7 + t)
        ids, lps, cached = _run(cores[where], task)
        if t == 2:  # A dies after 6 tokens: B takes the task over and replays them
            ids, lps, cached = _run(cores["b"], _task(f"turn{t}", history, temperature=0.9, seed=7 + t),
                                    replay=ids[:6])
            _idle(cores["a"])
            where = "b"
        _idle(cores[where])
        out.append((ids, lps, cached))
        history += ids
    if cache:
        assert cores["a"].engine.prefix_cache.seed != cores["v2"].engine.prefix_cache.seed
    for c in cores.values():
        c.engine.close()
    return out


def test_a_takeover_and_a_new_version_give_the_same_bits(kind):
    """The same turns, cache on and off: every token and log probability alike; with the
    cache, B's turn 4 starts from the blocks of turn 3 as B computed it (prompt and replay
    by a prefill, the rest of the reply at idle), and the new version's first turn from
    nothing of the old one's."""
    name, spec, make = kind
    off = _takeover(make, spec, cache=False)
    on = _takeover(make, spec, cache=True)
    assert [o[:2] for o in on] == [o[:2] for o in off], name
    cached = [o[2] for o in on]
    assert cached[2] == 0 and cached[3] > 0 and cached[4] == 0 and cached[5] > 0, cached


def test_idle_steps_wait_for_an_empty_batch(kind):
    _, spec, make = kind
    engine = make(4)
    core = WorkerCore(engine, load_tokenizer(spec), clock=lambda: 1000.0, max_step_tokens=16)
    _run(core, _task("a", SYSTEM, temperature=0.0, seed=1))
    assert core.idle_work()
    core.add(_task("b", SYSTEM[:20], temperature=0.0, seed=1))
    assert core.idle_step() == 0 and core.idle_work()  # a request is in the batch
    while core.has_work():
        core.step()
    assert core.idle_step() > 0
    core.abandon_all()
    assert not core.idle_work()
    engine.close()


# -- the keeper's bookkeeping ------------------------------------------------------------------


def test_the_keeper_computes_a_chunk_a_call_and_counts_no_lookup(tiny_spec):
    engine = OnnxRuntimeEngine(tiny_spec, threads=1, prefix_cache_mb=4, prefix_block=BLOCK)
    cache = engine.prefix_cache
    keeper = ReplyKeeper(engine, chunk=20, most=2)
    assert keeper.chunk == 20
    prompt = SYSTEM[:21]  # 2 whole blocks and 5 tokens
    engine.prefill([("p", prompt)])
    engine.release("p")
    lookups = cache.stats.lookups
    reply = [int(t) for t in RNG.integers(3, 250, 60)]  # to 81 tokens: 10 whole blocks
    keeper.finished(prompt, reply[:2])  # 23 tokens: no whole block past the prompt's
    assert len(keeper) == 0
    keeper.finished(prompt, reply)
    done = []
    while len(keeper):
        done.append(keeper.step())
    # from block 2 on, 16 tokens (two blocks) a call: 64 tokens in 4 calls
    assert done == [16, 16, 16, 16] and len(cache) == 10
    assert cache.stats.reply_tokens == 64 and cache.stats.lookups == lookups
    keeper.finished(prompt, reply)  # all held already: nothing computed
    assert keeper.step() == 0 and len(keeper) == 0
    for k in range(3):  # at most ``most`` remembered, the newest
        keeper.finished([*prompt, k], reply)
    assert len(keeper) == 2 and [int(ids[21]) for ids, _ in keeper._todo] == [1, 2]
    cache.clear()  # the conversation's prompt left the cache: not recomputed from its start
    assert keeper.step() == 0 and len(keeper) == 0
    assert ReplyKeeper(engine, chunk=0).chunk == CHUNK and ReplyKeeper(engine, chunk=1000).chunk == CHUNK
