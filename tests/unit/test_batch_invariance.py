"""Same seed, same text, batched or alone (docs/sampling.md, "What a seed guarantees").

The ONNX Runtime engine in its default, batch-invariant mode gives a sequence bit for bit
the logits it gets alone, whatever shares its runs (workers/engines/onnxruntime.py); the
logits processing, log probabilities and the sampler work row by row; so a seeded
sampled request draws the same tokens alone and in any batch."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from streamfleet.shared.modelrepo import ModelSpec, load_tokenizer
from streamfleet.shared.schema import SamplingParams
from streamfleet.workers.core import WorkerCore
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine, invariant_width
from streamfleet.workers.logits import Logprobs, Penalties, process
from streamfleet.workers.sampling import Sampler
from tests.support.invariance import forced_alone, forced_staggered, run_alone, run_staggered, seeded_tasks

LLAMA = Path(__file__).resolve().parent.parent / "fixtures" / "archs" / "llama"


@pytest.fixture(scope="module")
def specs(tiny_spec) -> dict[str, ModelSpec]:
    """tiny-gpt, and the committed Llama fixture (rotary positions from position_ids, GQA)."""
    llama = ModelSpec(name="llama", path=LLAMA, max_batch=32, max_context=256, eos_token_ids=(1,))
    return {"tiny-gpt": dataclasses.replace(tiny_spec, max_batch=32), "llama": llama}


@pytest.mark.parametrize("quantum,max_context", [(64, 256), (64, 4096), (16, 512), (1, 300), (256, 256)])
def test_invariant_width_is_a_function_of_the_length(quantum, max_context):
    widths = [invariant_width(n, quantum, max_context) for n in range(1, max_context)]
    for n, w in enumerate(widths, start=1):
        assert n <= w <= max(n, max_context - 1)
        assert w == max_context - 1 or w % quantum == 0
        assert w - n < max(quantum, n / 4 + 1)  # padding: under a quantum, or a quarter
    assert widths == sorted(widths)
    # the runs a step can need: one per distinct width
    bound = -(-min(max_context, 8 * quantum) // quantum) + 4 * max(0, (max_context // (8 * quantum)).bit_length())
    assert len(set(widths)) <= bound


@pytest.mark.parametrize("model", ["tiny-gpt", "llama"])
def test_logits_alone_and_batched_are_bitwise_equal(specs, model):
    """Teacher-forced sequences of different lengths: alone, then all of them joining a few
    at a time, leaving, sitting steps out: every logit of every row, bit for bit."""
    engine = OnnxRuntimeEngine(specs[model], threads=1)
    v = engine.vocab_size
    rng = np.random.default_rng(1)
    lengths = [1, 1, 2, 5, 5, 5, 13, 31, 40, 63, 64, 65, 70, 100, 127, 129]  # equal ones share prefill runs
    prompts = {f"s{i}": [int(t) for t in rng.integers(1, v, n)] for i, n in enumerate(lengths)}
    tokens = {k: [int(t) for t in rng.integers(1, v, int(rng.integers(20, 90)))] for k in prompts}
    alone = {k: forced_alone(engine, k, prompts[k], tokens[k]) for k in prompts}
    for seed in (0, 1):
        batched = forced_staggered(engine, prompts, tokens, seed=seed)
        assert set(batched) == set(prompts) and not engine._seqs
        for k in prompts:
            assert batched[k].shape == alone[k].shape
            same = (batched[k] == alone[k]).all(axis=1)
            assert same.all(), (model, seed, k, f"rows {np.flatnonzero(~same).tolist()} differ by up to "
                                f"{np.abs(batched[k] - alone[k]).max():.3g}")
    engine.close()


def test_the_slab_is_close_but_not_batch_invariant(specs):
    """The opt-out (one padded run per step): the same tokens as far as greedy can tell,
    the logits within float32 rounding of the solo ones, not necessarily equal."""
    engine = OnnxRuntimeEngine(specs["tiny-gpt"], threads=1)
    slab = OnnxRuntimeEngine(specs["tiny-gpt"], threads=1, batch_invariant=False)
    assert engine.batch_invariant and not slab.batch_invariant
    rng = np.random.default_rng(2)
    prompts = {f"s{i}": [int(t) for t in rng.integers(1, slab.vocab_size, n)] for i, n in enumerate((3, 17, 44, 9))}
    tokens = {k: [int(t) for t in rng.integers(1, slab.vocab_size, 30)] for k in prompts}
    batched = forced_staggered(slab, prompts, tokens)
    for k in prompts:
        np.testing.assert_allclose(batched[k], forced_alone(engine, k, prompts[k], tokens[k]), rtol=1e-5, atol=1e-4)
    engine.close()
    slab.close()


@pytest.mark.parametrize("weights,invariant", [("fp32", True), ("int8", True), ("q4", False)])
def test_gguf_imports_batch_invariant_unless_4bit(tmp_path, weights, invariant):
    """A q4 import's 4-bit products (fp32 activations) compute a lone row with a kernel of
    their own: the engine finds it at load and batches in the slab; the fp32 and 8-bit
    activation modes are row-independent, so they get batch invariance, bit for bit."""
    from streamfleet.shared.ggufimport import import_gguf
    from streamfleet.shared.modelrepo import ModelRepository
    from tests.support.gguf_models import TinyLlama, write_tiny_gguf

    src = write_tiny_gguf(tmp_path / "tiny.gguf", TinyLlama(seed=3))
    import_gguf(src, tmp_path / "engines", "tiny", weights=weights, max_batch=16)
    engine = OnnxRuntimeEngine(ModelRepository(tmp_path / "engines").get("tiny"), threads=1)
    assert engine.batch_invariant is invariant and engine.rows_independent() is invariant
    rng = np.random.default_rng(4)
    prompts = {f"s{i}": [int(t) for t in rng.integers(3, engine.vocab_size, n)]
               for i, n in enumerate((1, 6, 9, 20, 33))}
    tokens = {k: [int(t) for t in rng.integers(3, engine.vocab_size, 25)] for k in prompts}
    alone = {k: forced_alone(engine, k, prompts[k], tokens[k]) for k in prompts}
    batched = forced_staggered(engine, prompts, tokens)
    equal = all(np.array_equal(batched[k], alone[k]) for k in prompts)
    assert equal is invariant
    for k in prompts:
        np.testing.assert_allclose(batched[k], alone[k], rtol=1e-3, atol=1e-2)
    engine.close()


def test_engine_toml_settings(specs):
    from streamfleet.shared.errors import FatalError

    spec = specs["tiny-gpt"]
    eng = OnnxRuntimeEngine(dataclasses.replace(spec, options={"batch_invariant": False}), threads=1)
    assert not eng.batch_invariant
    eng = OnnxRuntimeEngine(dataclasses.replace(spec, options={"invariant_quantum": 32}), threads=1)
    assert eng.batch_invariant and eng.invariant_quantum == 32
    assert OnnxRuntimeEngine(spec, threads=1, batch_invariant=False).batch_invariant is False
    for bad in ({"batch_invariant": "yes"}, {"invariant_quantum": 0}, {"invariant_quantum": 1.5}):
        with pytest.raises(FatalError):
            OnnxRuntimeEngine(dataclasses.replace(spec, options=bad), threads=1)


def test_a_decode_step_runs_once_per_width(specs):
    spec = specs["tiny-gpt"]
    engine = OnnxRuntimeEngine(spec, threads=1)
    runs = []
    real = engine._run

    def run(ids, mask, positions, past):
        runs.append((ids.shape[0], past[0].shape[2]))
        assert mask.shape == (ids.shape[0], past[0].shape[2] + 1)
        return real(ids, mask, positions, past)

    lengths = {"a": 3, "b": 40, "c": 64, "d": 65, "e": 200, "f": 5}
    engine.prefill([(k, [7] * n) for k, n in lengths.items()])
    engine._run = run
    for step in range(3):
        engine.decode([(k, 9) for k in lengths])
        widths = collections.Counter(invariant_width(n + step, engine.invariant_quantum, spec.max_context)
                                     for n in lengths.values())
        assert sorted(runs) == sorted((rows, w) for w, rows in widths.items())
        runs.clear()
    engine.close()


def test_processing_and_logprobs_are_row_by_row_bit_for_bit():
    """A row's processed logits, log probabilities and draw are the same, bit for bit,
    computed with the batch or alone."""
    rng = np.random.default_rng(3)
    vocab, n = 1000, 12
    kinds = [{}, {"frequency_penalty": 0.7, "presence_penalty": 0.3}, {"repetition_penalty": 1.3},
             {"logit_bias": [[5, 4.0], [9, -100.0]]}, {"min_p": 0.1}, {"min_tokens": 50, "stop_token_ids": [3]}]
    params = [SamplingParams(temperature=0.8, seed=i, **kinds[i % len(kinds)]) for i in range(n)]
    prompts = [rng.integers(0, vocab, 9).tolist() for _ in range(n)]

    def states():
        return [Penalties(p, pr, frozenset({0})) if p.processed else None for p, pr in zip(params, prompts)]

    batch_states, solo_states = states(), states()
    batch_samplers = [Sampler(p, vocab) for p in params]
    solo_samplers = [Sampler(p, vocab) for p in params]
    for step in range(30):
        logits = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
        lp = Logprobs(logits, list(range(n)), [5] * n)
        got = logits.copy()
        process(got, batch_states, [step] * n)
        for i in range(n):
            row = logits[i:i + 1].copy()
            process(row, [solo_states[i]], [step])
            assert np.array_equal(got[i], row[0]), (step, i)
            assert lp.of(i, 7) == Logprobs(logits[i:i + 1], [0], [5]).of(0, 7)
            t, u = batch_samplers[i].sample(got[i]), solo_samplers[i].sample(row[0])
            assert t == u
            for st in (batch_states[i], solo_states[i]):
                if st is not None:
                    st.push(t)


@pytest.mark.slow
def test_seeded_requests_give_the_same_text_alone_and_in_any_batch(specs):
    """Issue 35, item 6: 100 seeded sampled requests (temperature 0.8, up to 120 tokens)
    alone, then inside batches of 1 to 32 with staggered joins: no text differs, nor any
    token, nor any log probability (which would show a logit differing in its last bit
    even where the draw does not change)."""
    spec = specs["tiny-gpt"]
    engine = OnnxRuntimeEngine(spec, threads=1)
    core = WorkerCore(engine, load_tokenizer(spec), clock=lambda: 1000.0)
    assert core.max_batch == 32
    alone = run_alone(core, seeded_tasks(100, engine.vocab_size))
    sizes = collections.Counter()
    batched = run_staggered(core, seeded_tasks(100, engine.vocab_size), [1, 32, 4, 24, 2, 16, 32, 8],
                            on_step=lambda b: sizes.update([b]))
    engine.close()
    assert len(alone) == len(batched) == 100
    assert sizes[1] and sizes[32] and len(sizes) >= 25, sizes  # batches of every size, 1 to 32
    assert sum(len(o.ids) for o in alone.values()) > 75 * 60
    assert sum(len(o.logprobs) for o in alone.values()) > 20 * 60
    texts = sorted(k for k in alone if batched[k].text != alone[k].text)
    assert texts == [], f"{len(texts)} of 100 texts differ: {texts[:10]}"
    differ = sorted(k for k in alone if batched[k] != alone[k])
    assert differ == [], f"{len(differ)} of 100 requests differ (tokens or log probabilities): {differ[:10]}"
