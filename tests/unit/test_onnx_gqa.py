"""The GroupQueryAttention layout (shared/gguf_gqa.py, workers/engines/onnx_gqa.py): the
graph gives the logits of the GGUF import's own graph and of an independent numpy forward
pass; the engine's in-place KV buffers grow, move rows and fork without changing a bit;
every sequence gets bit for bit the logits it gets alone, whatever shares its runs; chunked
prefill and the prefix cache give a prompt the same bits as a whole prefill. On small
random GGUF files (tests/support/gguf_models.py); on SmolLM2-135M in
tests/models/test_smollm2_gqa.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from streamfleet.devkit.greedy import greedy_alone, greedy_scenario, greedy_staggered, random_prompts
from streamfleet.shared.errors import FatalError
from streamfleet.shared.gguf_gqa import GQA_GRAPH_FILE, build_gqa_graph, write_gqa_graph
from streamfleet.shared.ggufimport import import_gguf, read_gguf
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.workers.engines.onnx_gqa import OnnxGqaEngine
from streamfleet.workers.engines.onnxruntime import InvalidSequenceError, OnnxRuntimeEngine
from tests.support.gguf_models import TinyLlama, numpy_logits, write_tiny_gguf
from tests.support.invariance import forced_alone, forced_staggered

PROMPTS = [[5, 77, 140, 33, 200, 9, 61], [18, 250, 3], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]


def _folder(tmp_path: Path, model: TinyLlama, weights: str, name: str = "tiny", max_batch: int = 8):
    """The import's folder (model.onnx) with the GQA graph beside it; returns its spec."""
    src = write_tiny_gguf(tmp_path / f"{name}.gguf", model)
    dest, _ = import_gguf(src, tmp_path / "engines", name, weights=weights, max_batch=max_batch)
    write_gqa_graph(read_gguf(src), dest, weights=weights, max_context=model.context)
    return ModelRepository(tmp_path / "engines").get(name)


@pytest.fixture(scope="module", params=["fp32", "q4", "q4-int8act"])
def pair(request, tmp_path_factory):
    """(GQA engine, current engine) on one tiny model, in each weights mode (q4-int8act,
    what weights = "auto" serves where it is fastest, on four blocks: its first and last
    are fp32, the middle ones 4-bit with 8-bit activations)."""
    model = TinyLlama(seed=3, n_layer=4 if request.param == "q4-int8act" else 2)
    spec = _folder(tmp_path_factory.mktemp("gqa"), model, request.param, request.param, max_batch=16)
    gqa, old = OnnxGqaEngine(spec, threads=1), OnnxRuntimeEngine(spec, threads=1)
    yield gqa, old
    gqa.close()
    old.close()


@pytest.mark.parametrize("weights", ["fp32", "q4"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_gqa_graph_equals_a_numpy_forward_pass(tmp_path, weights, tied):
    model = TinyLlama(seed=3, tied=tied)
    engine = OnnxGqaEngine(_folder(tmp_path, model, weights), threads=1)
    seqs = {f"s{i}": list(p) for i, p in enumerate(PROMPTS)}
    logits = engine.prefill(list(seqs.items()))
    for step in range(4):
        for r, (sid, ids) in enumerate(seqs.items()):
            np.testing.assert_allclose(logits[r], numpy_logits(model, ids)[-1], atol=2e-4, rtol=0,
                                       err_msg=f"{sid} step {step}")
        feed = []
        for r, (sid, ids) in enumerate(seqs.items()):
            ids.append(int(np.argmax(logits[r])))
            feed.append((sid, ids[-1]))
        logits = engine.decode(feed)


def test_the_graph_has_no_concat_of_the_cache_and_one_op_per_layer(tmp_path):
    model = TinyLlama(seed=3)
    src = write_tiny_gguf(tmp_path / "m.gguf", model)
    graph = build_gqa_graph(read_gguf(src), "q4", max_positions=129).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("GroupQueryAttention") == model.n_layer
    assert "Concat" not in ops and "Softmax" not in ops and "Transpose" not in ops
    gqa = next(n for n in graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa.attribute}
    assert attrs["do_rotary"] == 1 and attrs["rotary_interleaved"] == 0 and attrs["scale"] == 1.0  # 1/4 folded
    assert list(gqa.input[1:3]) == ["", ""]  # packed QKV (the fused projection)


def test_a_head_size_the_op_cannot_rotate_is_refused(tmp_path):
    model = TinyLlama(seed=3, hidden=64, n_head=8, n_kv_head=2)  # head size 8
    src = write_tiny_gguf(tmp_path / "m.gguf", model)
    with pytest.raises(FatalError, match="multiple of 16"):
        build_gqa_graph(read_gguf(src), "fp32")


def test_what_the_ops_cpu_kernel_takes(tmp_path):
    """ONNX Runtime's CPU kernel (the limits docs/models.md names): right-padded first
    prompts of different lengths share a run; a later chunk of several tokens after a
    past runs only in a run of one row; a decode step takes rows of any lengths."""
    model = TinyLlama(seed=3)
    eng = OnnxGqaEngine(_folder(tmp_path, model, "fp32"), threads=1)
    a, b = [5, 77, 140, 33, 200, 9, 61], [18, 250, 3, 4, 5, 6]
    eng._kv = [np.zeros((2, eng.kv_heads, 32, eng.head_dim), np.float32) for _ in eng._past_names]
    ids = np.zeros((2, 7), np.int64)
    ids[0], ids[1, :6] = a, b
    logits = eng._run(0, 2, ids, [6, 5], keep=7)
    np.testing.assert_allclose(logits[0, 6], numpy_logits(model, a)[-1], atol=2e-4, rtol=0)
    np.testing.assert_allclose(logits[1, 5], numpy_logits(model, b)[-1], atol=2e-4, rtol=0)
    with pytest.raises(Exception, match="batch_size must be 1 when sequence_length > 1 and past context"):
        eng._run(0, 2, np.array([[1, 2], [3, 4]]), [8, 7])
    logits = eng._run(0, 2, np.array([[7], [8]]), [7, 6])
    np.testing.assert_allclose(logits[1, -1], numpy_logits(model, b + [8])[-1], atol=2e-4, rtol=0)


def test_logits_match_the_current_graph_alone_and_staggered(pair):
    gqa, old = pair
    # 8-bit activations round the two graphs' slightly different attention outputs apart
    # where a value sits near a rounding boundary: a looser bound there
    tol = 0.1 if gqa.spec.options["weights"] == "q4-int8act" else 1e-3
    prompts = random_prompts(1, [7, 3, 11, 20, 1, 2, 33, 5], gqa.vocab_size)
    for k, p in list(prompts.items())[:4]:
        a, rows_a = greedy_alone(gqa, p, 20, k)
        b, rows_b = greedy_alone(old, p, 20, k)
        assert a == b, k
        assert max(np.abs(x - y).max() for x, y in zip(rows_a, rows_b)) < tol
    assert greedy_staggered(gqa, prompts, 24) == greedy_staggered(old, prompts, 24)
    assert not gqa._seqs and gqa._kv is None  # all released: buffers dropped


def test_rows_probe_and_invariance_setting(pair, tmp_path):
    gqa, _ = pair
    weights = gqa.spec.options["weights"]
    # fp32 products, and 4-bit ones with 8-bit activations, are row-independent for any
    # number of rows; 4-bit MatMulNBits with fp32 activations gives a lone row other bits
    # than two or more, which it makes alike
    assert gqa.rows_probe == {"fp32": "independent", "q4": "two", "q4-int8act": "independent"}[weights]
    assert gqa.batch_invariant and gqa.min_rows == {"fp32": 1, "q4": 2, "q4-int8act": 1}[weights]
    fast = OnnxGqaEngine(gqa.spec, threads=1, batch_invariant=False)
    assert fast.min_rows == 1 and not fast.batch_invariant


def _forced(engine, n: int = 12, seed: int = 0, steps: int = 12):
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 3, 7, 15, 16, 17, 31, 40, 63, 64, 90][:n]
    prompts = {f"q{i}": [int(t) for t in rng.integers(1, engine.vocab_size, m)] for i, m in enumerate(lengths)}
    tokens = {k: [int(t) for t in rng.integers(1, engine.vocab_size, steps + i % 5)] for i, k in enumerate(prompts)}
    return prompts, tokens


def test_every_row_gets_its_solo_logits_bit_for_bit(pair):
    """Teacher-forced sequences of 12 lengths join a few at a time, sit steps out, leave
    (rows move), and each step decodes the others in a shuffled order: every logit of
    every row equals the sequence's own, alone, bit for bit."""
    gqa, _ = pair
    prompts, tokens = _forced(gqa)
    alone = {k: forced_alone(gqa, k, prompts[k], tokens[k]) for k in prompts}
    for seed in range(3):
        got = forced_staggered(gqa, prompts, tokens, seed=seed, pause=0.2)
        for k in prompts:
            assert np.array_equal(got[k], alone[k]), (seed, k)
    assert gqa._kv is None


class _Poisoned(OnnxGqaEngine):
    """Fresh buffers filled with NaN past every row's tokens: a read of a slot the engine
    never wrote would show."""

    def _ensure(self, rows: int, slots: int) -> None:
        before = None if self._kv is None else self._kv[0]
        super()._ensure(rows, slots)
        if self._kv is not None and self._kv[0] is not before:
            lengths = [self._seqs[k].length for k in self._order]
            for buf in self._kv:
                for r in range(buf.shape[0]):
                    buf[r, :, lengths[r] if r < len(lengths) else 0:] = np.nan


def test_nothing_past_a_rows_tokens_is_read(pair):
    gqa, _ = pair
    poisoned = _Poisoned(gqa.spec, threads=1)
    prompts, tokens = _forced(gqa)
    alone = {k: forced_alone(gqa, k, prompts[k], tokens[k]) for k in prompts}
    got = forced_staggered(poisoned, prompts, tokens, seed=5, pause=0.2)
    for k in prompts:
        assert np.array_equal(got[k], alone[k]), k


def test_a_lone_row_differs_only_where_the_probe_says(pair):
    """Without ``min_rows`` (batch_invariant false), a 4-bit graph's lone decode row gets
    other bits than beside another row; fp32 does not."""
    gqa, _ = pair
    fast = OnnxGqaEngine(gqa.spec, threads=1, batch_invariant=False)
    prompts, tokens = _forced(fast, n=4)
    alone = {k: forced_alone(fast, k, prompts[k], tokens[k]) for k in prompts}
    got = forced_staggered(fast, prompts, tokens, seed=1, pause=0.0)
    same = all(np.array_equal(got[k][1:], alone[k][1:]) for k in prompts)
    assert same == (gqa.rows_probe == "independent")


STEPS = 16
SCENARIOS = {
    # step -> sequences that join (one prefill call) / are released / sit the step out
    "joins-leaves-pause": dict(joins={0: "abc", 3: "d", 6: "e"}, leaves={5: "b", 9: "c"}, paused={11: "d", 12: "d"}),
    "reuse-rows": dict(joins={0: "abcd", 4: "e"}, leaves={3: "b", 10: "a", 11: "e"}, paused={6: "c"}),
    "one-at-a-time": dict(joins={0: "a", 1: "b", 2: "c", 3: "d", 4: "e"}, leaves={8: "a", 9: "d"}, paused={}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_joins_leaves_and_pauses_give_the_solo_tokens(pair, name):
    """Sequences join and leave mid-way (rows move), decode order shuffles, some sit out
    a step (a scratch token in their free slot): each gets its solo tokens and logits."""
    gqa, _ = pair
    rng = np.random.default_rng(1)
    prompts = {k: [int(t) for t in rng.integers(1, gqa.vocab_size, n)] for k, n in zip("abcde", (7, 1, 40, 3, 12))}
    solo = {k: greedy_alone(gqa, p, STEPS) for k, p in prompts.items()}
    got, rows = greedy_scenario(gqa, prompts, SCENARIOS[name], STEPS, STEPS + 8)
    assert got
    for k in got:
        assert got[k] == solo[k][0][:len(got[k])], k
        assert np.array_equal(np.array(rows[k]), np.array(solo[k][1][:len(rows[k])])), k
    for k in list(got):
        gqa.release(k)


def _kv_of(engine: OnnxGqaEngine, seq_id: str) -> list[np.ndarray]:
    seq = engine._seqs[seq_id]
    return [b[seq.row, :, :seq.length].copy() for b in engine._kv]


def test_chunks_of_a_prompt_give_the_whole_prompts_bits(pair):
    gqa, _ = pair
    prompt = random_prompts(4, [50], gqa.vocab_size)["p0-50"]
    whole = gqa.prefill([("w", prompt)])[0]
    kv = _kv_of(gqa, "w")
    gqa.start([("c", prompt)])
    for lo, hi in ((0, 9), (9, 11), (11, 40), (40, 50)):
        last = gqa.extend([("c", prompt[lo:hi])])[0]
    assert np.array_equal(last, whole)
    assert all(np.array_equal(a, b) for a, b in zip(kv, _kv_of(gqa, "c")))
    assert np.array_equal(gqa.decode([("w", 5)])[0], gqa.decode([("c", 5)])[0])
    gqa.release("w")
    gqa.release("c")


def test_the_prefix_cache_gives_the_same_bits_as_none(pair):
    gqa, _ = pair
    cached = OnnxGqaEngine(gqa.spec, threads=1, prefix_cache_mb=4, prefix_block=8)
    base = random_prompts(5, [40], gqa.vocab_size)["p0-40"]
    first, second = base + [7, 8, 9], base + [11, 12]
    cached.prefill([("a", first)])
    cached.release("a")
    assert cached.start([("b", second)]) == [40]  # five blocks from the cache, two tokens left
    got = cached.extend([("b", second[40:])])[0]
    assert np.array_equal(got, gqa.prefill([("ref", second)])[0])
    assert all(np.array_equal(a, b) for a, b in zip(_kv_of(cached, "b"), _kv_of(gqa, "ref")))
    gqa.release("ref")
    cached.close()


def test_fork_copies_a_prefix_into_rows_of_its_own(pair):
    gqa, _ = pair
    prompt = random_prompts(6, [21], gqa.vocab_size)["p0-21"]
    gqa.prefill([("src", prompt)])
    gqa.fork("src", ["f1", "f2"])
    gqa.fork("src", ["short"], length=10)
    assert [gqa._seqs[k].row for k in ("src", "f1", "f2", "short")] == [0, 1, 2, 3]
    rows = gqa.decode([("f1", 3), ("src", 3), ("f2", 4)])
    assert np.array_equal(rows[0], rows[1]) and not np.array_equal(rows[0], rows[2])
    alone = gqa.prefill([("ref", prompt + [3])])[0]
    np.testing.assert_allclose(rows[0], alone, atol=1e-4)
    short = gqa.extend([("short", prompt[10:])])[0]
    np.testing.assert_allclose(short, gqa.prefill([("ref2", prompt)])[0], atol=1e-4)
    for k in ("src", "f1", "f2", "short", "ref", "ref2"):
        gqa.release(k)
    with pytest.raises(InvalidSequenceError):
        gqa.fork("nope", ["x"])


def test_buffers_grow_by_doubling_and_released_rows_are_refilled(tmp_path):
    """Where the system refuses buffers of the whole context (``whole_buffers`` false)."""
    model = TinyLlama(seed=8, context=512)
    eng = OnnxGqaEngine(_folder(tmp_path, model, "fp32", max_batch=16), threads=1)
    eng.whole_buffers = False
    prompts = random_prompts(9, [5, 70, 3, 9, 12], eng.vocab_size)
    keys = list(prompts)
    eng.prefill([(k, prompts[k]) for k in keys[:2]])
    assert (eng.rows, eng.capacity) == (2, 128)  # the longest prompt's power of two
    eng.prefill([(k, prompts[k]) for k in keys[2:]])
    assert eng.rows == 8
    alone_b = forced_alone(OnnxGqaEngine(eng.spec, threads=1), "b", prompts[keys[1]], [5] * 70)
    rows_b = []
    for step in range(70):  # the 70-token sequence passes 128 slots: capacity doubles
        if step == 3:
            eng.release(keys[0])  # row 0 freed: the last row (keys[4]) moves into it
            assert eng._seqs[keys[4]].row == 0 and eng._order == [keys[4], keys[1], keys[2], keys[3]]
        live = list(eng._order)
        rows = eng.decode([(k, 5) for k in live])
        rows_b.append(rows[live.index(keys[1])])
    assert eng.capacity == 256
    assert np.array_equal(np.stack(rows_b), alone_b[1:])
    for k in list(eng._order):
        eng.release(k)
    assert eng._kv is None and eng.copied_bytes > 0


def test_extend_all_gives_every_positions_logits(pair):
    gqa, _ = pair
    prompt = random_prompts(7, [30], gqa.vocab_size)["p0-30"]
    gqa.start([("a", prompt)], from_cache=False)
    gqa.extend([("a", prompt[:10])])
    rows = gqa.extend_all("a", prompt[10:])
    assert rows.shape == (20, gqa.vocab_size) and gqa._seqs["a"].length == 30
    for j in (0, 7, 19):  # the logits a prefill of the prompt up to that token gives
        want = gqa.prefill([("ref", prompt[:11 + j])])[0]
        gqa.release("ref")
        np.testing.assert_allclose(rows[j], want, atol=1e-4, rtol=0)
    gqa.start([("b", prompt)], from_cache=False)
    gqa.extend([("b", prompt[:10])])
    last = gqa.extend([("b", prompt[10:])])[0]  # the same chunks: the same cache, the last row
    assert all(np.array_equal(x, y) for x, y in zip(_kv_of(gqa, "a"), _kv_of(gqa, "b")))
    if gqa.rows_probe == "independent":
        assert np.array_equal(rows[-1], last)
    else:  # a 4-bit head computes one row with a kernel of its own
        np.testing.assert_allclose(rows[-1], last, atol=1e-4, rtol=0)
    for k in ("a", "b"):
        gqa.release(k)


def test_attention_gqa_in_engine_toml_chooses_this_engine(tmp_path):
    from streamfleet.workers.engines import load_engine

    spec = _folder(tmp_path, TinyLlama(seed=3, n_layer=1), "fp32")
    toml = spec.path / "engine.toml"
    toml.write_text(toml.read_text() + 'attention = "gqa"\n')
    engine = load_engine(ModelRepository(tmp_path / "engines").get("tiny"), threads=1, prefix_cache_mb=1.0)
    assert isinstance(engine, OnnxGqaEngine) and engine.prefix_cache is not None
    toml.write_text(toml.read_text().replace('attention = "gqa"', 'attention = "paged"'))
    with pytest.raises(FatalError, match="attention must be one of"):
        load_engine(ModelRepository(tmp_path / "engines").get("tiny"))
    toml.write_text(toml.read_text().replace('attention = "paged"', 'attention = "concat"'))
    assert isinstance(load_engine(ModelRepository(tmp_path / "engines").get("tiny"), threads=1), OnnxRuntimeEngine)
    (spec.path / GQA_GRAPH_FILE).unlink()  # no graph and no [source] to build it from
    with pytest.raises(FatalError, match="gguf_gqa"):
        OnnxGqaEngine(spec, threads=1)


@pytest.mark.parametrize("weights", ["fp32", "q4", "q4-int8act"])
def test_seeded_requests_through_a_worker_core_are_batch_invariant(tmp_path, weights):
    """Seeded sampled requests through a ``WorkerCore`` on this engine (chunked prefill in
    16-token steps, the prefix cache on and hit): alone, then joining batches of 1 to 16
    a few at a time: no token, text or log probability differs."""
    from streamfleet.shared.modelrepo import load_tokenizer
    from streamfleet.workers.core import WorkerCore
    from tests.support.invariance import run_alone, run_staggered, seeded_tasks

    spec = _folder(tmp_path, TinyLlama(seed=5, context=256, n_layer=4 if weights == "q4-int8act" else 2), weights,
                   max_batch=16)
    engine = OnnxGqaEngine(spec, threads=1, prefix_cache_mb=2, prefix_block=8)
    core = WorkerCore(engine, load_tokenizer(spec), clock=lambda: 1000.0, max_step_tokens=16)
    shared = [int(t) for t in np.random.default_rng(9).integers(1, engine.vocab_size, 24)]

    def tasks():  # every other prompt starts with the same 24 tokens (prefix cache hits)
        out = seeded_tasks(40, engine.vocab_size, max_tokens=60)
        for t in out[::2]:
            t.prompt_ids = shared + list(t.prompt_ids)
        return out

    alone = run_alone(core, tasks())
    batched = run_staggered(core, tasks(), [1, 16, 4, 8, 2], epoch=12)
    assert len(alone) == len(batched) == 40
    assert engine.prefix_cache.stats.cached_tokens >= 20 * 16
    differ = sorted(k for k in alone if batched[k] != alone[k])
    assert differ == [], f"{len(differ)} of 40 requests differ: {differ[:10]}"
    assert sum(len(o.ids) for o in alone.values()) > 30 * 40


def test_refusals(pair):
    gqa, _ = pair
    v = gqa.vocab_size
    with pytest.raises(InvalidSequenceError) as exc:
        gqa.prefill([("ok", [1, 2]), ("long", [1] * (gqa.max_context + 1))])
    assert exc.value.seq_ids == ["long"]
    gqa.prefill([("x", [1, 2, 3])])
    with pytest.raises(InvalidSequenceError):
        gqa.prefill([("x", [1])])
    with pytest.raises(InvalidSequenceError):
        gqa.decode([("x", v)])  # a token outside the vocabulary: refused and released
    assert "x" not in gqa._seqs
    with pytest.raises(InvalidSequenceError):
        gqa.extend([("nope", [1, 2])])
    gqa.prefill([("y", [1] * (gqa.max_context - 1))])
    gqa.decode([("y", 2)])
    with pytest.raises(InvalidSequenceError):
        gqa.decode([("y", 2)])  # at max_context
    gqa.close()
    assert gqa._kv is None


# -- SmolLM2-135M -----------------------------------------------------------------------------

def _resident_pages(array: np.ndarray) -> int:
    """How many of the 4 KiB pages under ``array`` (contiguous) are in memory
    (/proc/self/pagemap: bit 63 of each page's entry)."""
    import mmap

    page = mmap.PAGESIZE
    lo = array.ctypes.data // page
    hi = -(-(array.ctypes.data + array.nbytes) // page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo * 8)
        entries = np.frombuffer(f.read((hi - lo) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads /proc/self/pagemap (Linux)")
def test_whole_buffers_take_memory_only_where_tokens_are_and_give_it_back(tmp_path):
    """The first buffers hold ``max_batch`` rows of the whole context and never grow (no
    copy), their pages are taken as tokens land, and a release gives back the rows' pages
    past what they still hold; the output is the one a lone sequence gets."""
    import mmap

    model = TinyLlama(seed=8, context=512)
    eng = OnnxGqaEngine(_folder(tmp_path, model, "fp32", max_batch=8), threads=1)
    prompts = random_prompts(9, [5, 300, 3], eng.vocab_size)
    keys = list(prompts)
    eng.prefill([(k, prompts[k]) for k in keys])
    assert eng.rows == 8 and eng.max_context + 1 <= eng.capacity < eng.max_context + 1 + 4096 // (4 * eng.head_dim)
    buf = eng._kv[0]
    per_token = eng.kv_heads * eng.head_dim * 4  # bytes of one token in one buffer
    row_pages = [_resident_pages(buf[r]) for r in range(eng.rows)]
    # row 1 holds 300 tokens: about 300 tokens' pages (each head's run of slots rounded up)
    assert 300 * per_token // mmap.PAGESIZE <= row_pages[1] <= 300 * per_token // mmap.PAGESIZE + 2 * eng.kv_heads
    assert row_pages[3:] == [0] * 5  # never written
    alone = forced_alone(OnnxGqaEngine(eng.spec, threads=1), keys[2], prompts[keys[2]], [5] * 40)
    got = [eng.decode([(k, 5) for k in keys])[2] for _ in range(40)]
    assert np.array_equal(np.stack(got), alone[1:]) and eng.copied_bytes == 0
    eng.release(keys[1])  # the last row (keys[2], 43 tokens) moves into row 1
    assert eng._seqs[keys[2]].row == 1
    assert _resident_pages(buf[2]) == 0
    assert _resident_pages(buf[1]) <= 44 * per_token // mmap.PAGESIZE + 2 * eng.kv_heads
    more = eng.decode([(keys[2], 5)])[0]
    assert np.array_equal(more, forced_alone(OnnxGqaEngine(eng.spec, threads=1), keys[2], prompts[keys[2]],
                                             [5] * 41)[-1])
