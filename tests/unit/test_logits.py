"""Batched logits processing against a row-by-row reference, log probabilities, token
bytes, and a request's tokens alone or batched (workers/logits.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from streamfleet.shared.schema import SamplingParams
from streamfleet.workers.logits import Logprobs, Penalties, TokenTable, process
from tests.support.toy_core import EOS, Log, make_core, task

VOCAB = 300


def reference(row: np.ndarray, p: SamplingParams, prompt: list[int], generated: list[int],
              ends: set[int]) -> np.ndarray:
    """One row, the way the definitions read, token by token."""
    x = row.astype(np.float64).copy()
    if len(generated) < p.min_tokens:
        for t in ends | set(p.stop_token_ids):
            x[t] = -np.inf
    for t, b in p.logit_bias:
        x[int(t)] += b
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(generated):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(generated):
        n = generated.count(t)
        x[t] -= p.frequency_penalty * n + p.presence_penalty
    if p.min_p and p.temperature > 0:
        floor = x.max() + p.temperature * math.log(p.min_p)
        x[x < floor] = -np.inf
    return x


def random_params(rng, i: int) -> SamplingParams:
    kinds = [
        {},
        {"frequency_penalty": float(rng.uniform(-2, 2)), "presence_penalty": float(rng.uniform(-2, 2))},
        {"repetition_penalty": float(rng.uniform(0.5, 3))},
        {"logit_bias": [[int(t), float(rng.uniform(-100, 100))] for t in rng.choice(VOCAB, 5, replace=False)]},
        {"min_p": float(rng.uniform(0.01, 0.5)), "temperature": float(rng.uniform(0.3, 2))},
        {"min_tokens": 30, "stop_token_ids": [3, 4]},
        {"frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.1, "logit_bias": [[9, 5.0]],
         "min_tokens": 5},
    ]
    return SamplingParams(**kinds[i % len(kinds)])


def test_batched_processing_equals_the_row_by_row_definitions():
    rng = np.random.default_rng(0)
    n = 21
    params = [random_params(rng, i) for i in range(n)]
    prompts = [rng.integers(0, VOCAB, 12).tolist() for _ in range(n)]
    states = [Penalties(p, pr, frozenset({EOS % VOCAB})) if p.processed else None for p, pr in zip(params, prompts)]
    history: list[list[int]] = [[] for _ in range(n)]
    for step in range(40):  # tokens drawn from a small range: many repeats, some past 16 distinct
        logits = (rng.standard_normal((n, VOCAB)) * 3).astype(np.float32)
        want = np.stack([reference(logits[i], params[i], prompts[i], history[i], {EOS % VOCAB}) for i in range(n)])
        got = logits.copy()
        process(got, states, [len(h) for h in history])
        assert np.allclose(got, want, rtol=1e-5, atol=1e-4, equal_nan=False), step
        assert np.array_equal(np.isinf(got), np.isinf(want))
        for i in range(n):
            t = int(rng.integers(0, 40))
            history[i].append(t)
            if states[i] is not None:
                states[i].push(t)


def test_rows_that_ask_for_nothing_are_untouched():
    logits = np.arange(2 * VOCAB, dtype=np.float32).reshape(2, VOCAB)
    before = logits.copy()
    process(logits, [None, Penalties(SamplingParams(frequency_penalty=1.0), [1, 2], frozenset())], [0, 0])
    assert np.array_equal(logits[0], before[0])


def test_logprobs_are_the_log_softmax_with_the_best_first():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, VOCAB)).astype(np.float32)
    logits[2, [10, 20, 30]] = 9.0  # a tie: lower id first
    lps = Logprobs(logits, [0, 2, 3], [5, 3, 0])
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    lp, top = lps.of(2, 20)
    assert lp == pytest.approx(ref[2, 20], abs=1e-5)
    assert [t for t, _ in top] == [10, 20, 30]
    lp, top = lps.of(0, 7)
    order = np.argsort(-ref[0], kind="stable")[:5]
    assert [t for t, _ in top] == order.tolist()
    assert [v for _, v in top] == pytest.approx(ref[0, order].tolist(), abs=1e-5)
    assert lps.of(3, 1)[1] == [] and 1 not in lps


def test_token_table_gives_each_tokens_bytes(tiny_spec):
    from streamfleet.shared.modelrepo import load_tokenizer

    tok = load_tokenizer(tiny_spec)
    table = TokenTable(tok)
    text = "naïve café — 東京"
    ids = tok.encode(text)
    data = b"".join(bytes(table.token(t)[1]) for t in ids)
    assert data.decode() == tok.decode(ids)
    partial = [t for t in ids if "\\x" in table.token(t)[0]]  # a token that is part of a character
    assert partial, "the test text should split a character over tokens"
    eos = tiny_spec.eos_token_ids[0]
    assert table.token(eos)[0] == "<|endoftext|>"
    entry = table.entry(ids[0], -0.25, [(ids[0], -0.25)])
    assert entry["id"] == ids[0] and entry["logprob"] == -0.25 and entry["top"][0]["token"] == entry["token"]


def generate(core, *tasks) -> tuple[Log, dict[str, list[int]], list]:
    """Run tasks to their end: the log, each request's token ids, the step outputs."""
    log, ids, outs = Log(), {}, []
    for t in tasks:
        core.add(t)
    for _ in range(500):
        if not core.has_work():
            break
        out = log.feed(core.step())
        outs.append(out)
        for (rid, _i), tid in sorted(out.token_ids.items()):
            ids.setdefault(rid, []).append(tid)
    for t in tasks:
        log.check(t.request_id)
    return log, ids, outs


def test_a_sequences_tokens_do_not_depend_on_its_batch():
    """Penalties, bias and min_p at temperature 1: the same tokens alone and with others."""
    params = {"frequency_penalty": 0.9, "presence_penalty": 0.4, "repetition_penalty": 1.4, "min_p": 0.05,
              "logit_bias": [[ord("a"), 3.0]], "min_tokens": 4}

    def with_params(t, **kw):
        for k, v in kw.items():
            setattr(t.params, k, v)
        t.params.temperature = 1.0
        return t

    core, _ = make_core(max_batch=8)
    _, alone, _ = generate(core, with_params(task("alone", "hello world", max_tokens=30, seed=5), **params))
    core, _ = make_core(max_batch=8)
    others = [with_params(task(f"o{i}", f"other {i}", max_tokens=40, seed=i)) for i in range(5)]
    _, batched, _ = generate(core, *others, with_params(task("batched", "hello world", max_tokens=30, seed=5),
                                                        **params))
    assert batched["batched"] == alone["alone"]
    core, _ = make_core()
    _, plain, _ = generate(core, with_params(task("plain", "hello world", max_tokens=30, seed=5)))
    assert plain["plain"] != alone["alone"]  # the parameters did something


def test_stop_token_ids_end_like_eos_and_logprobs_ride_on_the_token_events():
    core, _ = make_core()
    _, greedy, _ = generate(core, task("a", "abcabc", max_tokens=20))
    greedy = greedy["a"]
    core, _ = make_core()
    t = task("b", "abcabc", max_tokens=20)
    t.params.stop_token_ids = [greedy[2]]
    t.params.logprobs = 2
    log, ids, _ = generate(core, t)
    assert ids["b"] == greedy[:greedy.index(greedy[2])]  # the stop token is not output
    assert len(log.tokens("b")) == greedy.index(greedy[2]) and log.end("b").finish_reason == "stop"
    events = log.tokens("b")
    assert events and all(ev.logprobs is not None and len(ev.logprobs["top"]) == 2 for ev in events)
    assert all(ev.logprobs["id"] == tid for ev, tid in zip(events, greedy))


def test_bad_processing_parameters_are_refused_by_the_worker():
    core, _ = make_core()
    tasks = []
    for rid, field, value in (("a", "logit_bias", [[VOCAB * 10, 1.0]]), ("b", "min_p", 2.0),
                              ("c", "stop_token_ids", [-1]), ("d", "logprobs", 99)):
        t = task(rid, "abc")
        setattr(t.params, field, value)
        tasks.append(t)
    log, _, _ = generate(core, *tasks)
    for rid in "abcd":
        assert log.end(rid).code == "invalid_request"


@pytest.mark.parametrize("vocab", [100, 1024, 5000, 32003, 128000])
def test_top_k_by_blocks_finds_the_largest(vocab):
    from streamfleet.workers.logits import _top_k

    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal((5, vocab)) * 3).astype(np.float32)
    x[0, -3:] = 50.0  # the best in the ragged tail
    x[1, :20] = 40.0  # all in one block
    for k in (1, 5, 20):
        got = np.sort(np.take_along_axis(x, _top_k(x, k), axis=1), axis=1)
        assert np.array_equal(got, np.sort(x, axis=1)[:, -k:]), k
