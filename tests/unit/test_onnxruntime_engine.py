"""The ONNX Runtime engine against a cache-free reference, alone and in a changing batch;
and the echo engine."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest

from streamfleet.devkit.greedy import greedy_alone, greedy_scenario
from streamfleet.workers.engines import Engine, SequenceError, load_engine
from streamfleet.workers.engines.echo import EchoEngine
from streamfleet.workers.engines.onnxruntime import InvalidSequenceError, OnnxRuntimeEngine

STEPS = 16


@pytest.fixture(scope="module")
def engine(tiny_spec):
    eng = OnnxRuntimeEngine(tiny_spec, threads=1)
    assert eng.batch_invariant  # the default
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def slab_engine(tiny_spec):
    """The padded slab: one run per step for the whole batch (``batch_invariant = false``)."""
    eng = OnnxRuntimeEngine(tiny_spec, threads=1, batch_invariant=False)
    yield eng
    eng.close()


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, n)]


def reference(engine: OnnxRuntimeEngine, ids: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens with no cache: the whole sequence from an empty past at every step."""
    ids, tokens, rows = list(ids), [], []
    for _ in range(steps + 1):
        n = len(ids)
        past = [np.zeros((1, engine.kv_heads, 0, engine.head_dim), np.float32)] * (2 * engine.n_layer)
        logits = engine._run(np.array([ids]), np.ones((1, n), np.int64), np.arange(n)[None], past)[0][0, -1]
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        ids.append(tokens[-1])
    return tokens, rows


def test_layout_read_from_graph(engine, tiny_spec):
    b = tiny_spec.build
    assert isinstance(engine, Engine)
    assert (engine.n_layer, engine.kv_heads, engine.head_dim, engine.vocab_size) == (
        b["n_layer"], b["n_head"], b["d_model"] // b["n_head"], b["vocab_size"])
    assert engine.max_context == tiny_spec.max_context and engine.max_batch == tiny_spec.max_batch


def test_cache_matches_reference(engine):
    ids = prompt(1, 7, engine.vocab_size)
    ref_tokens, ref_rows = reference(engine, ids, STEPS)
    tokens, rows = greedy_alone(engine, ids, STEPS)
    assert tokens == ref_tokens
    np.testing.assert_allclose(np.array(rows), np.array(ref_rows), atol=1e-3, rtol=1e-4)
    assert len(set(tokens)) > 4


SCENARIOS = {
    # step -> sequences that join (one prefill call) / are released / sit the step out
    "joins-leaves-pause": dict(joins={0: "abc", 3: "d", 6: "e"}, leaves={5: "b", 9: "c"}, paused={11: "d", 12: "d"}),
    # a full slab: one leaves and a newcomer takes its row in place; a paused row keeps
    # a masked slot inside its cache, then a compaction copies it out
    "reuse-rows": dict(joins={0: "abcd", 4: "e"}, leaves={3: "b", 10: "a", 11: "e"}, paused={6: "c"}),
    "one-at-a-time": dict(joins={0: "a", 1: "b", 2: "c", 3: "d", 4: "e"}, leaves={8: "a", 9: "d"}, paused={}),
}


def scenario_prompts(vocab: int, lengths: tuple[int, ...] = (7, 1, 40, 3, 12)) -> dict[str, list[int]]:
    """Prompts a, b, c… of the given lengths."""
    return {k: prompt(i + 1, n, vocab) for i, (k, n) in enumerate(zip("abcde", lengths))}


def check_scenario(engine, reference_engine, prompts: dict[str, list[int]], plan: dict, label: str = "") -> None:
    """Run ``plan`` on ``engine``; every surviving sequence gets exactly the tokens (and
    nearly the logits) it gets alone on ``reference_engine``; then release them."""
    solo = {k: greedy_alone(reference_engine, p, STEPS) for k, p in prompts.items()}
    got, rows = greedy_scenario(engine, prompts, plan, STEPS, STEPS + 8)
    assert got
    for k in got:
        assert got[k] == solo[k][0], (label, k)
        np.testing.assert_allclose(np.array(rows[k]), np.array(solo[k][1]), atol=1e-3, rtol=1e-4)
    for k in list(got):
        engine.release(k)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("mode", ["batch-invariant", "slab"])
def test_batch_with_joins_and_leaves(engine, slab_engine, name, mode):
    """Sequences of different lengths join and leave mid-way, decode order shuffles, some
    sit out a step; each still gets exactly its solo tokens."""
    eng = engine if mode == "batch-invariant" else slab_engine
    check_scenario(eng, engine, scenario_prompts(engine.vocab_size), SCENARIOS[name], name)


def test_prefill_groups_lengths():
    groups = OnnxRuntimeEngine._prefill_groups([3, 200, 5, 190, 4, 1])
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert [1, 3] in groups  # the long pair together, apart from the short ones
    assert all(len(g) >= 1 for g in groups)


def test_refusals(engine, tiny_spec):
    v = engine.vocab_size
    with pytest.raises(InvalidSequenceError) as exc:
        engine.prefill([("ok", [1, 2]), ("long", [1] * (engine.max_context + 1))])
    assert exc.value.seq_ids == ["long"] and isinstance(exc.value, (ValueError, SequenceError))
    engine.prefill([("x", [1, 2, 3])])
    with pytest.raises(InvalidSequenceError):
        engine.prefill([("x", [1])])                      # already live
    with pytest.raises(InvalidSequenceError):
        engine.prefill([("y", [])])
    with pytest.raises(InvalidSequenceError):
        engine.prefill([("y", [v])])
    with pytest.raises(ValueError):
        engine.prefill([("y", [1]), ("y", [2])])
    with pytest.raises(InvalidSequenceError) as exc:
        engine.decode([("x", 1), ("ghost", 1)])
    assert exc.value.seq_ids == ["ghost"]
    engine.decode([("x", 1)])                             # x untouched by the refused call
    engine.release("x")
    engine.release("x")                                   # unknown ids are ignored
    with pytest.raises(InvalidSequenceError):
        engine.decode([("x", 1)])
    with pytest.raises(ValueError):
        engine.prefill([(f"s{i}", [1]) for i in range(engine.max_batch + 1)])
    assert engine.decode([]).shape == (0, v) and engine.prefill([]).shape == (0, v)


def test_max_context(tiny_spec):
    spec = dataclasses.replace(tiny_spec, max_context=8)
    eng = OnnxRuntimeEngine(spec)
    eng.prefill([("full", [5] * 8), ("room", [5] * 6)])
    with pytest.raises(InvalidSequenceError) as exc:
        eng.decode([("full", 1), ("room", 1)])
    assert exc.value.seq_ids == ["full"]                  # and released
    eng.decode([("room", 1)])
    eng.decode([("room", 1)])                             # length 8 now
    with pytest.raises(InvalidSequenceError):
        eng.decode([("room", 1)])
    eng.close()


def test_registry_loads_onnxruntime(tiny_spec):
    eng = load_engine(tiny_spec, threads=1)
    assert isinstance(eng, OnnxRuntimeEngine)
    eng.close()


# -- echo ------------------------------------------------------------------------------


def test_echo_cycles_prompt_and_never_eos(tiny_spec):
    spec = dataclasses.replace(tiny_spec, backend="echo", eos_token_ids=(0, 7))
    eng = load_engine(spec)
    assert isinstance(eng, EchoEngine) and isinstance(eng, Engine)
    assert eng.vocab_size == tiny_spec.build["vocab_size"]  # from tokenizer.json
    logits = eng.prefill([("p", [5, 0, 6, 7]), ("eos-only", [0, 7, 0]), ("q", [9])])
    assert logits.shape == (3, eng.vocab_size) and logits.dtype == np.float32
    out = {"p": [], "eos-only": [], "q": []}
    for _ in range(5):
        for k, row in zip(out, logits):
            out[k].append(int(row.argmax()))
            assert row[0] < -1e8 and row[7] < -1e8
        logits = eng.decode([(k, v[-1]) for k, v in out.items()])
    assert out["p"] == [5, 6, 5, 6, 5]
    assert out["eos-only"] == [1, 1, 1, 1, 1]
    assert out["q"] == [9] * 5
    with pytest.raises(ValueError):
        eng.decode([("nope", 1)])
    eng.close()


def test_echo_delay_and_vocab_option(tiny_spec):
    spec = dataclasses.replace(tiny_spec, backend="echo", options={"vocab_size": 50, "delay_ms": 20})
    eng = EchoEngine(spec)
    assert eng.vocab_size == 50
    t0 = time.perf_counter()
    eng.prefill([("a", [49])])
    eng.decode([("a", 49)])
    assert time.perf_counter() - t0 >= 0.04
    assert EchoEngine(spec, delay_ms=0).delay_s == 0
    with pytest.raises(ValueError):
        eng.prefill([("b", [50])])


def test_steady_batch_feeds_presents_back(slab_engine):
    """While the set of sequences stays the same, no new slab is assembled."""
    engine = slab_engine
    engine.prefill([("s1", [1, 2, 3]), ("s2", [4])])
    engine.decode([("s1", 5), ("s2", 6)])
    slab = engine._slab
    for _ in range(3):
        engine.decode([("s2", 6), ("s1", 5)])  # order may change
        assert engine._slab is slab
    assert slab.width == 3 + 4 and slab.past[0].shape[2] == 7
    engine.prefill([("s3", [7, 8]), ("s4", [9])])
    engine.decode([("s1", 5), ("s2", 6), ("s3", 1), ("s4", 2)])  # too few rows: a new slab
    slab = engine._slab
    assert len(slab.rows) == 4
    engine.release("s1")
    engine.prefill([("s5", [3, 4, 5])])
    engine.decode([("s5", 1), ("s2", 6), ("s3", 1), ("s4", 2)])  # s5 takes s1's row
    assert engine._slab is slab and slab.rows[0] == "s5"
    engine.release("s2")
    engine.release("s3")
    for _ in range(3):  # half the rows idle: kept for newcomers while that wastes under two steps ...
        engine.decode([("s4", 2), ("s5", 1)])
        assert engine._slab is slab
    engine.decode([("s4", 2), ("s5", 1)])  # ... then compacted
    assert engine._slab is not slab and engine._slab.rows == ["s4", "s5"]
    for k in ("s4", "s5"):
        engine.release(k)


def test_a_slab_made_for_a_longer_newcomer_has_room_for_the_next(tiny_spec):
    """A slab is as wide as its longest member (every step copies its whole width), but
    one made because a newcomer did not fit is a quarter wider, so the next longer one (a
    conversation's next turn) takes a free row without a new slab, and its logits are the
    ones it gets alone (to the slab's rounding)."""
    engine = OnnxRuntimeEngine(tiny_spec, threads=1, batch_invariant=False)
    engine.prefill([(f"a{i}", list(range(3, 43 + i))) for i in range(3)])
    engine.decode([(f"a{i}", 5) for i in range(3)])
    assert engine._slab.width == 42 + 1  # (and the step's own slot)
    engine.release("a0")
    engine.prefill([("b", list(range(7, 55)))])  # 48 tokens: longer than the slab
    engine.decode([("b", 9), ("a1", 5), ("a2", 5)])
    slab = engine._slab
    assert slab.width == 48 + 12 + 1 and slab.rows == ["b", "a1", "a2"]
    engine.release("a1")
    later = list(range(11, 67))  # 56 tokens: longer than any member, within the width
    engine.prefill([("c", later)])
    got = engine.decode([("c", 9), ("b", 9), ("a2", 5)])
    assert engine._slab is slab and slab.rows[1] == "c"
    alone = OnnxRuntimeEngine(tiny_spec, threads=1, batch_invariant=False)
    alone.prefill([("c", later)])
    np.testing.assert_allclose(got[0], alone.decode([("c", 9)])[0], rtol=1e-4, atol=1e-4)
    engine.close()
    alone.close()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_graphs_without_position_ids_are_never_padded(engine, tiny_spec, name):
    """A graph with no position_ids takes positions from cache columns: the engine runs
    it unpadded (prefill alone, decode in groups of equal length), and every sequence
    still gets exactly its solo tokens with joins, leaves, pauses and equal lengths."""
    solo_engine = OnnxRuntimeEngine(tiny_spec, threads=1)
    solo_engine.solo = True  # as for a graph without position_ids (tiny-gpt's positions are then arange)
    masks = []
    real_run = solo_engine._run

    def run(ids, mask, positions, past, **kw):
        masks.append(mask)
        return real_run(ids, mask, positions, past, **kw)

    solo_engine._run = run
    check_scenario(solo_engine, engine, scenario_prompts(engine.vocab_size, (7, 7, 40, 3, 7)), SCENARIOS[name],
                   name)
    assert masks and all(m.all() for m in masks)  # no padded or masked slot, ever
    if name != "one-at-a-time":  # a and b join together with equal lengths: they share runs
        assert any(m.shape[0] > 1 for m in masks)
    solo_engine.close()


def _column_position_graph(tiny_spec, tmp_path) -> Path:
    """tiny-gpt rewired the way Optimum exports Gemma and friends: no position_ids input;
    each token's position is its column in the (padded) cache."""
    import onnx
    from onnx import helper

    model = onnx.load(str(tiny_spec.onnx_path))
    g = model.graph
    # the query slots: Range(past, past + S) over cache columns (shared/tinymodel.py)
    at, rng = next((i, n) for i, n in enumerate(g.node) if n.op_type == "Range" and "zero_scalar" not in n.input[0])
    axes = helper.make_tensor("col_axes0", onnx.TensorProto.INT64, [1], [0])
    g.initializer.append(axes)
    g.node.insert(at + 1, helper.make_node("Unsqueeze", [rng.output[0], "col_axes0"], ["position_ids"]))
    keep = [i for i in g.input if i.name != "position_ids"]
    del g.input[:]
    g.input.extend(keep)
    out = tmp_path / "columns.onnx"
    onnx.save(model, str(out))
    return out


def test_a_graph_that_takes_positions_from_cache_columns_is_exact(engine, tiny_spec, tmp_path):
    """Without position_ids, padding or moving a cache would shift positions and change
    the output with no error: such a graph runs unpadded and stays exact, batched."""
    spec = dataclasses.replace(tiny_spec, onnx=str(_column_position_graph(tiny_spec, tmp_path)))
    cols = OnnxRuntimeEngine(spec, threads=1)
    assert cols.solo
    for name, plan in SCENARIOS.items():
        check_scenario(cols, engine, scenario_prompts(engine.vocab_size), plan, name)
    cols.close()
