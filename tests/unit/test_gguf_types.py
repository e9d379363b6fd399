"""Every GGUF weight type the import serves (shared/ggufimport.py; docs/models.md,
"Weight types"), projection by projection on random tensors: in the exact modes the
terms a matrix becomes carry the very fp32 weights ``gguf.quants.dequantize`` gives (a
one-hot probe reads every weight back bit for bit through the graph), products on random
activations equal numpy's to fp32 rounding, ``q4-int8act`` stays close, and each type
keeps the size the docs table says; the embedding gathers the file's rows bit for bit;
whole tiny models of mixed types (a Q4_K_M-like mix among them) equal the numpy forward
pass; a type the import does not serve is refused by name. No real model file, no torch,
no network."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from streamfleet.shared.errors import FatalError
from streamfleet.shared.ggufimport import import_gguf, read_gguf
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine
from tests.support.gguf_models import TinyLlama, numpy_logits, random_blocks, write_tiny_gguf

BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
ALL_TYPES = BLOCK_TYPES + ["F16", "BF16", "F32"]
#: bits a weight takes in the q4 graph (4-bit values, fp32 scales and block minimums), the
#: docs table's "in the graph" column; the file's own figure beside it
GRAPH_BITS = {"Q4_0": 5, "Q4_1": 6, "Q5_0": 10, "Q5_1": 11, "Q8_0": 10.125, "Q2_K": 8, "Q3_K": 6, "Q4_K": 6,
              "Q5_K": 11, "Q6_K": 12, "F16": 16, "BF16": 16, "F32": 32}
FILE_BITS = {"Q4_0": 4.5, "Q4_1": 5, "Q5_0": 5.5, "Q5_1": 6, "Q8_0": 8.5, "Q2_K": 2.625, "Q3_K": 3.4375,
             "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "F16": 16, "BF16": 16, "F32": 32}


def _tensor(kind: str, rows: int, cols: int, seed: int, spread: int = 0):
    """A random ``kind`` tensor as the import holds it, and its fp32 values by gguf."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    from streamfleet.shared.ggufimport import _Tensor

    rng = np.random.default_rng(seed)
    if kind in BLOCK_TYPES:
        raw = random_blocks(kind, rows, cols, rng, spread=spread)
    else:
        w = rng.normal(0, 0.15, (rows, cols)).astype(np.float32)
        if spread:
            w *= (2.0 ** rng.integers(-spread, spread + 1, (rows, cols))).astype(np.float32)
        raw = w if kind == "F32" else quantize(w, T[kind])
    want = np.asarray(dequantize(raw, T[kind]) if kind != "F32" else raw, dtype=np.float32).reshape(rows, cols)
    return _Tensor("blk.0.ffn_up.weight", int(T[kind]), kind, (rows, cols), raw), want


def _projection(t, weights: str, permute: int | None = None):
    """An ONNX Runtime session of just ``x @ W^T`` as the import builds it, and its
    initializers' bytes."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from streamfleet.shared.ggufimport import _apply_linear, _Graph, _linear_init

    rows, cols = t.shape
    g = _Graph()
    terms = _linear_init(g, t, weights, "p", permute)
    g.op("Identity", [_apply_linear(g, "x", terms, cols, rows, 4 if weights == "q4-int8act" else 0)], outputs=["y"])
    graph = helper.make_graph(g.nodes, "p", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", cols])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", rows])], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    sizes = {TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2, TensorProto.UINT8: 1,
             TensorProto.INT8: 1}
    stored = sum(int(np.prod(i.dims)) * sizes[i.data_type] for i in g.inits if i.name.startswith("p."))
    return session, stored


def _bits(a: np.ndarray) -> np.ndarray:
    """fp32 bits, a zero's sign aside (a sum of products gives +0 where a weight is -0)."""
    return (np.asarray(a, dtype=np.float32) + np.float32(0)).view(np.uint32)


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_each_type_keeps_the_files_weights_bit_for_bit_in_the_q4_graph(kind):
    """x = the identity reads every weight back through the graph's terms: each is the
    fp32 value gguf's dequantize gives, bit for bit (the terms of a weight add up to it
    exactly); products on random activations are numpy's up to the fp32 sums' order."""
    rows, cols = 48, 512
    t, w = _tensor(kind, rows, cols, seed=ALL_TYPES.index(kind))
    session, stored = _projection(t, "q4")
    probe = session.run(None, {"x": np.eye(cols, dtype=np.float32)})[0]
    assert np.array_equal(_bits(probe), _bits(w.T)), kind
    x = np.random.default_rng(1).standard_normal((5, cols)).astype(np.float32)
    got = session.run(None, {"x": x})[0]
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64)) + 1e-30
    assert (np.abs(got - want) <= bound).all(), (kind, float(np.max(np.abs(got - want) / bound)))
    assert not t.dequantized
    # what each type takes in the graph (the docs table), against the file
    assert stored * 8 <= GRAPH_BITS[kind] * rows * cols, (kind, stored * 8 / (rows * cols))
    assert stored * 8 >= (GRAPH_BITS[kind] - 1) * rows * cols, (kind, stored * 8 / (rows * cols))


@pytest.mark.parametrize("kind", ["Q5_1", "Q2_K", "Q4_K", "Q6_K", "F16", "BF16"])
def test_query_and_key_rows_are_unpermuted_in_every_form(kind):
    from streamfleet.shared.ggufimport import _unpermute_rows

    t, w = _tensor(kind, 64, 256, seed=20)
    session, _ = _projection(t, "q4", permute=4)
    probe = session.run(None, {"x": np.eye(256, dtype=np.float32)})[0]
    assert np.array_equal(_bits(probe), _bits(_unpermute_rows(w, 4).T))


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"])
def test_a_matrix_whose_weights_are_rounded_sums_is_served_dequantized(tmp_path, kind):
    """Scales and minimums 2^+-12 apart: ``D*v + C`` rounds for some weights, which no sum
    of terms would give bit for bit, so the matrix is served dequantized (fp32), exact,
    and the summary says so; Q4_1 keeps its own path, which refuses an inexact ``m + 8d``
    by name."""
    t, w = _tensor(kind, 256, 256, seed=30, spread=12)  # ffn_up of the model below
    if kind == "Q4_1":
        with pytest.raises(FatalError, match="m \\+ 8d is not exact"):
            _projection(t, "q4")
        return
    session, _ = _projection(t, "q4")
    probe = session.run(None, {"x": np.eye(256, dtype=np.float32)})[0]
    assert np.array_equal(_bits(probe), _bits(w.T))
    assert t.dequantized
    model = TinyLlama(seed=31, hidden=256, intermediate=256, n_head=4, n_kv_head=2, n_layer=1, qtype="Q4_K")
    from gguf import GGMLQuantizationType as T

    model.tensors["blk.0.ffn_up.weight"] = (t.raw, T[kind])
    _, description = import_gguf(write_tiny_gguf(tmp_path / "m.gguf", model), tmp_path / "engines", "m")
    assert "(1 dequantized to fp32: a weight is a rounded scale x value + minimum" in description


def test_a_block_whose_centred_minimum_would_round_keeps_a_zero_point_of_its_own():
    """Q4_K blocks of d = 1 and dmin = 2^-23 whose values are 0 and 1 only: every weight
    (``-2^-23`` or ``1 - 2^-23``) is exact, but the centred block-sum term ``8D - M`` is
    not; those blocks keep ``c = 0`` with the zero point 0, the others the centred form
    with 8, and every weight reads back bit for bit."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    from streamfleet.shared.ggufimport import _linear_parts, _Tensor

    rows, cols = 32, 256
    rng = np.random.default_rng(70)
    blocks = np.zeros((rows, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16] = 0x01, 0x01, 0x11  # every sub-scale and minimum 1
    blocks[:16, 2:4] = np.array([2.0 ** -23], dtype=np.float16).view(np.uint8)
    blocks[:16, 16:] = rng.integers(0, 2, (16, 128)) | (rng.integers(0, 2, (16, 128)) << 4)
    blocks[16:, 2:4] = np.array([2.0 ** -4], dtype=np.float16).view(np.uint8)
    blocks[16:, 16:] = rng.integers(0, 256, (16, 128))
    t = _Tensor("blk.0.ffn_up.weight", int(T.Q4_K), "Q4_K", (rows, cols), blocks)
    parts = _linear_parts(t, "q4")
    assert [p[0] for p in parts] == ["nbits", "blocksum"] and parts[0][3] is not None  # a zero-point input
    zeros = np.stack([parts[0][3] & 0x0F, parts[0][3] >> 4], axis=-1).reshape(rows, -1)
    assert (zeros[:16] == 0).all() and (zeros[16:] == 8).all()
    session, _ = _projection(t, "q4")
    probe = session.run(None, {"x": np.eye(cols, dtype=np.float32)})[0]
    want = np.asarray(dequantize(blocks, T.Q4_K), dtype=np.float32).reshape(rows, cols)
    assert np.array_equal(_bits(probe), _bits(want.T))


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"])
def test_the_int8_activation_mode_stays_close(kind):
    rows, cols = 48, 512
    t, w = _tensor(kind, rows, cols, seed=40)
    session, _ = _projection(t, "q4-int8act")
    x = np.random.default_rng(2).standard_normal((5, cols)).astype(np.float32)
    got = session.run(None, {"x": x})[0].astype(np.float64)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    # 8-bit activations: an error of about 1/127 of each block's largest activation
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max(), kind
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.9999, kind


@pytest.mark.parametrize("kind", BLOCK_TYPES + ["F16", "BF16", "F32"])
def test_the_embedding_gathers_every_types_rows_exactly(kind):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from streamfleet.shared.ggufimport import _Graph, embedding

    vocab, hidden = 40, 256
    t, w = _tensor(kind, vocab, hidden, seed=50)
    t.name = "token_embd.weight"
    model = type("M", (), {"tensors": {"token_embd.weight": t}, "tied": True})()
    g = _Graph()
    g.op("Identity", [embedding(g, model, "input_ids", "q4")], outputs=["x"])
    graph = helper.make_graph(g.nodes, "e", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [2, 3])],
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, hidden])], g.inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 7, 39], [3, 3, 12]], dtype=np.int64)
    got = session.run(None, {"input_ids": ids})[0]
    assert got.dtype == np.float32 and np.array_equal(_bits(got), _bits(w[ids])), kind
    sizes = {TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2, TensorProto.INT8: 1}
    stored = sum(int(np.prod(i.dims)) * sizes[i.data_type] for i in g.inits if i.name.startswith("embed."))
    # int8 values and fp32 scales (and minimums): at most 1.5 bytes a weight; fp16/bf16 2; F32 4
    assert stored <= vocab * hidden * {"F16": 2, "BF16": 2, "F32": 4}.get(kind, 1.5), kind


def _engine(tmp_path: Path, model: TinyLlama, weights: str, name: str):
    src = write_tiny_gguf(tmp_path / f"{name}.gguf", model)
    dest, description = import_gguf(src, tmp_path / "engines", name, weights=weights, max_batch=4)
    return OnnxRuntimeEngine(ModelRepository(tmp_path / "engines").get(name), threads=1), src, dest, description


MIXES = {
    # llama.cpp's Q4_K_M: Q4_K, with V and the feed-forward's down projection in Q6_K, the output layer Q6_K
    "q4_k_m": dict(qtype="Q4_K", head_qtype="Q6_K", overrides={"attn_v": "Q6_K", "ffn_down": "Q6_K"}),
    "q5_k_q5_0": dict(qtype="Q5_K", head_qtype="Q5_0", overrides={"attn_k": "Q5_1", "ffn_up": "Q3_K",
                                                                  "ffn_gate": "Q2_K"}),
    # the query rows (F16 here) take the attention's 1/8 once widened: fp16 would round the smallest
    "halves": dict(qtype="F16", head_qtype="BF16", overrides={"attn_k": "BF16", "ffn_down": "Q4_0"}),
}
#: the folder's graph against the file: Q4_K_M's mix within 2x; the second mix's Q2_K (8
#: bits a weight in the graph, 2.6 in the file), Q5_K (11 against 5.5) and tied Q5_0 table
#: (an int8 embedding and a two-term output layer, 19 bits against 5.5) over it; fp16 and
#: bf16 as in the file but a tied table, kept twice (embedding and output layer)
FOLDER_RATIO = {"q4_k_m": 2.0, "q5_k_q5_0": 2.3, "halves": 1.15}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_whole_models_of_mixed_types_equal_the_numpy_forward_pass(tmp_path, mix, tied):
    model = TinyLlama(seed=60, hidden=256, intermediate=256, n_head=4, n_kv_head=2, tied=tied, **MIXES[mix])
    engine, src, dest, description = _engine(tmp_path, model, "q4", mix)
    prompts = [[5, 77, 140, 33, 200, 9, 61], [18, 250, 3]]
    logits = engine.prefill([(f"s{i}", p) for i, p in enumerate(prompts)])
    for r, p in enumerate(prompts):
        np.testing.assert_allclose(logits[r], numpy_logits(model, p)[-1], atol=2e-4, rtol=0)
    feed = [(f"s{i}", int(np.argmax(logits[i]))) for i in range(len(prompts))]
    logits = engine.decode(feed)
    for r, p in enumerate(prompts):
        np.testing.assert_allclose(logits[r], numpy_logits(model, p + [feed[r][1]])[-1], atol=2e-4, rtol=0)
    # no fp32 copy of any matrix: the graph within FOLDER_RATIO of the file
    folder = sum(f.stat().st_size for f in dest.iterdir() if f.name.startswith("model.onnx"))
    assert folder <= FOLDER_RATIO[mix] * src.stat().st_size, (folder, src.stat().st_size)
    import onnx

    graph = onnx.load(str(dest / "model.onnx"), load_external_data=False).graph
    wide = [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2
            and i.name.endswith(".weight_t")]  # a matrix as fp32 (not its block minimums, not a constant)
    assert wide == [], wide  # no matrix, the query rows' (scaled by 1/8) among them, became fp32
    assert "dequantized" not in description.split("matrices", 1)[1].split("\n", 1)[0]


def test_a_q4_k_m_mix_stays_close_with_8_bit_activations(tmp_path):
    model = TinyLlama(seed=61, hidden=256, intermediate=256, n_head=4, n_kv_head=2, n_layer=3, **MIXES["q4_k_m"])
    engine, *_ = _engine(tmp_path, model, "q4-int8act", "int8act")
    got = engine.prefill([("a", [5, 77, 140, 33, 200, 9, 61])])[0]
    want = numpy_logits(model, [5, 77, 140, 33, 200, 9, 61])[-1]
    assert np.corrcoef(got, want)[0, 1] > 0.999


def test_the_summary_says_what_each_type_becomes(tmp_path):
    model = TinyLlama(seed=62, hidden=256, intermediate=256, n_head=4, n_kv_head=2, n_layer=1, **MIXES["q4_k_m"])
    src = write_tiny_gguf(tmp_path / "m.gguf", model)
    _, description = import_gguf(src, tmp_path / "engines", "m", weights="q4")
    line = next(x for x in description.splitlines() if x.startswith("matrices"))
    assert "Q4_K 5: one 4-bit MatMulNBits term" in line and "Q6_K 3: two 4-bit MatMulNBits terms" in line, line
    assert "exact" in line
    _, fp32 = import_gguf(src, tmp_path / "engines", "f", weights="fp32")
    assert "dequantized to fp32" in next(x for x in fp32.splitlines() if x.startswith("matrices"))


@pytest.mark.parametrize("kind", ["IQ4_NL", "IQ2_XXS", "TQ1_0"])
def test_a_type_the_import_does_not_serve_is_refused_by_name(tmp_path, kind):
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES

    model = TinyLlama(seed=63, hidden=256, intermediate=256, n_head=4, n_kv_head=2, n_layer=1)
    per, size = GGML_QUANT_SIZES[T[kind]]
    rows, cols = model.tensors["blk.0.ffn_up.weight"][0].shape[0], 256
    model.tensors["blk.0.ffn_up.weight"] = (np.zeros((rows, cols // per * size), dtype=np.uint8), T[kind])
    src = write_tiny_gguf(tmp_path / "m.gguf", model)
    with pytest.raises(FatalError, match=f"tensor blk.0.ffn_up.weight has quantization type {kind}, which the GGUF "
                                         f"import does not serve"):
        read_gguf(src)


@pytest.mark.parametrize("mix", ["q4_k_m", "halves"])
def test_the_group_query_attention_graph_of_a_mix_equals_the_numpy_forward_pass(tmp_path, mix):
    """The layout weights = "auto" serves (shared/gguf_gqa.py) reuses the same terms."""
    from streamfleet.shared.gguf_gqa import write_gqa_graph
    from streamfleet.workers.engines.onnx_gqa import OnnxGqaEngine

    model = TinyLlama(seed=64, hidden=256, intermediate=256, n_head=4, n_kv_head=2, **MIXES[mix])
    src = write_tiny_gguf(tmp_path / "m.gguf", model)
    dest, _ = import_gguf(src, tmp_path / "engines", "m", weights="q4", max_batch=4)
    write_gqa_graph(read_gguf(src), dest, weights="q4", max_context=model.context)
    engine = OnnxGqaEngine(ModelRepository(tmp_path / "engines").get("m"), threads=1)
    prompts = [[5, 77, 140, 33, 200, 9, 61], [18, 250, 3]]
    logits = engine.prefill([(f"s{i}", p) for i, p in enumerate(prompts)])
    for r, p in enumerate(prompts):
        np.testing.assert_allclose(logits[r], numpy_logits(model, p)[-1], atol=2e-4, rtol=0)
    engine.close()
