"""The GGUF import (shared/ggufimport.py) on small random Llama files written here with
``gguf.GGUFWriter``: the imported graph, run by the ONNX Runtime engine alone and batched
with padding, gives the logits of an independent numpy forward pass in llama.cpp's own
convention, in every weights mode; the tokenizer and chat template come from the
metadata; what the graph cannot compute exactly is refused by name. No real model file,
no torch, no network."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamfleet.shared.errors import FatalError
from streamfleet.shared.ggufimport import build_tokenizer_json, context_for, import_gguf, read_gguf
from streamfleet.shared.modelrepo import ModelRepository, load_tokenizer
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine
from tests.support.gguf_models import TinyLlama, numpy_logits, write_tiny_gguf

PROMPTS = [[5, 77, 140, 33, 200, 9, 61], [18, 250, 3], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]


def _engine(tmp_path: Path, model: TinyLlama, weights: str, name: str = "tiny") -> OnnxRuntimeEngine:
    src = write_tiny_gguf(tmp_path / f"{name}.gguf", model)
    import_gguf(src, tmp_path / "engines", name, weights=weights, max_batch=8)
    return OnnxRuntimeEngine(ModelRepository(tmp_path / "engines").get(name), threads=1)


def _check(engine: OnnxRuntimeEngine, model: TinyLlama, atol: float) -> None:
    """Prefill all prompts in one call (left-padded together), then three decode steps of
    all of them batched; every row equals the numpy forward pass of its own sequence."""
    seqs = {f"s{i}": list(p) for i, p in enumerate(PROMPTS)}
    logits = engine.prefill(list(seqs.items()))
    for step in range(4):
        for r, (sid, ids) in enumerate(seqs.items()):
            want = numpy_logits(model, ids)[-1]
            np.testing.assert_allclose(logits[r], want, atol=atol, rtol=0, err_msg=f"{sid} step {step}")
        if step == 3:
            break
        feed = []
        for r, (sid, ids) in enumerate(seqs.items()):
            token = int(np.argmax(logits[r]))
            ids.append(token)
            feed.append((sid, token))
        logits = engine.decode(feed)


@pytest.mark.parametrize("weights", ["fp32", "q4"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_imported_graph_equals_a_numpy_forward_pass(tmp_path, weights, tied):
    model = TinyLlama(seed=3, tied=tied)
    _check(_engine(tmp_path, model, weights), model, atol=2e-4)


def test_a_head_size_whose_scale_is_not_a_power_of_two(tmp_path):
    # head size 32: 1/sqrt(32) stays a Mul on the scores (64's 1/8 goes into the query rows)
    model = TinyLlama(seed=14, n_head=2, n_kv_head=1)
    _check(_engine(tmp_path, model, "q4"), model, atol=2e-4)


def test_q4_0_weights_and_an_f32_output_layer(tmp_path):
    model = TinyLlama(seed=4, tied=False, qtype="Q4_0", head_qtype="F32")
    _check(_engine(tmp_path, model, "q4"), model, atol=2e-4)


def test_matrices_of_different_types_are_projected_apart(tmp_path):
    # V and up in Q8_0 beside Q4_1 Q, K and gate: no fused projection, the same logits
    model = TinyLlama(seed=12, overrides={"attn_v": "Q8_0", "ffn_up": "Q8_0", "attn_output": "F32"})
    _check(_engine(tmp_path, model, "q4"), model, atol=2e-4)


def test_q4_and_fp32_graphs_agree_and_q4_keeps_the_file_small(tmp_path):
    model = TinyLlama(seed=5, hidden=128, intermediate=256, n_head=4, n_kv_head=2)
    src = write_tiny_gguf(tmp_path / "m.gguf", model)
    sizes = {}
    for weights in ("fp32", "q4"):
        dest, _ = import_gguf(src, tmp_path / "engines", weights, weights=weights)
        sizes[weights] = (dest / "model.onnx.data").stat().st_size
    layer_params = model.n_layer * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256)
    # the layers' matrices take 4 bytes a weight in fp32 and about 5/8 byte in q4
    assert sizes["fp32"] - sizes["q4"] > 3 * layer_params


def test_int8_and_int8_activation_modes_stay_close(tmp_path):
    model = TinyLlama(seed=6)
    for weights in ("int8", "q4-int8act"):
        engine = _engine(tmp_path, model, weights, name=weights)
        got = engine.prefill([("a", PROMPTS[0])])[0]
        want = numpy_logits(model, PROMPTS[0])[-1]
        assert np.corrcoef(got, want)[0, 1] > 0.99, weights


def test_the_tokenizer_chat_template_and_special_tokens_come_from_the_metadata(tmp_path):
    model = TinyLlama(seed=7)
    src = write_tiny_gguf(tmp_path / "m.gguf", model)
    dest, description = import_gguf(src, tmp_path / "engines", "tok")
    spec = ModelRepository(tmp_path / "engines").get("tok")
    assert spec.eos_token_ids == (2,)
    tok = load_tokenizer(spec)
    vocab = {t: i for i, t in enumerate(model.tokens)}
    # the merges apply (hello -> "hello" one token; " world" -> "Ġwor" + "l" + "d")
    assert tok.encode("hello world", add_special_tokens=False) == [vocab["hello"], vocab["Ġwor"], vocab["l"],
                                                                  vocab["d"]]
    # digits one by one (the "smollm" pre-tokenizer), specials as one token each
    assert tok.encode("<|im_start|>12", add_special_tokens=False) == [1, vocab["1"], vocab["2"]]
    assert tok.decode([vocab["hello"], vocab["Ġwor"], vocab["l"], vocab["d"]]) == "hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "chat template from the file" in description and "pre-tokenizer 'smollm'" in description
    toml = (dest / "engine.toml").read_text()
    assert 'weights = "q4"' in toml and "num_key_value_heads = 2" in toml


def test_end_of_turn_ids_end_a_request_as_eos_does(tmp_path):
    model = TinyLlama(seed=13, n_layer=1)
    src = write_tiny_gguf(tmp_path / "m.gguf", model, extra={"tokenizer.ggml.eot_token_id": 0})
    _, description = import_gguf(src, tmp_path / "engines", "eot")
    assert ModelRepository(tmp_path / "engines").get("eot").eos_token_ids == (2, 0)
    assert "EOS ids       [2, 0] ('<|im_end|>', '<|endoftext|>')" in description


def test_bos_is_added_when_the_file_says_so(tmp_path):
    model = TinyLlama(seed=8)
    m = read_gguf(write_tiny_gguf(tmp_path / "m.gguf", model))
    m.add_bos = True
    import json

    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(build_tokenizer_json(m)))
    assert tok.encode("hello").ids[0] == 1


def test_the_context_is_the_files_capped(tmp_path):
    m = read_gguf(write_tiny_gguf(tmp_path / "m.gguf", TinyLlama(seed=9, context=8192)))
    assert context_for(m, None) == (4096, "the file's 8192, capped at 4096; --max-context to change")
    assert context_for(m, 512) == (512, "--max-context")
    assert context_for(m, 9000)[0] == 8192


@pytest.mark.parametrize("case, expect", [
    ({"arch": "falcon"}, "architecture 'falcon' is not supported"),
    ({"extra": {"llama.rope.scaling.type": "yarn"}}, "llama.rope.scaling.type"),
    ({"extra": {"llama.expert_count": 8}}, "llama.expert_count"),
    ({"pre": "deepseek-llm"}, "pre-tokenizer 'deepseek-llm'"),
    ({"tokenizer_model": "llama"}, "tokenizer model 'llama' is not supported"),
    ({"extra_tensors": {"blk.0.attn_q.bias": np.zeros(64)}}, "blk.0.attn_q.bias"),
])
def test_what_the_graph_cannot_compute_exactly_is_refused_by_name(tmp_path, case, expect):
    model = TinyLlama(seed=10, n_layer=1)
    arch = case.pop("arch", "llama")
    if arch != "llama":
        # the writer names the keys by architecture; the import must refuse before reading them
        src = write_tiny_gguf(tmp_path / "m.gguf", model, arch=arch)
    else:
        src = write_tiny_gguf(tmp_path / "m.gguf", model, **case)
    with pytest.raises(FatalError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        read_gguf(src)


def test_not_a_gguf_file_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(FatalError, match="cannot read"):
        read_gguf(bad)


def test_engines_import_takes_a_gguf_file(tmp_path):
    src = write_tiny_gguf(tmp_path / "Tiny-Model.Q4_1.gguf", TinyLlama(seed=11, n_layer=1))
    run = subprocess.run([sys.executable, "-m", "streamfleet", "engines", "import", str(src), "--engines-dir",
                          str(tmp_path / "engines"), "--weights", "fp32"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "imported as 'tiny-model-q4_1'" in run.stdout and "weights       fp32" in run.stdout
    assert (tmp_path / "engines" / "tiny-model-q4_1" / "model.onnx").is_file()
    again = subprocess.run([sys.executable, "-m", "streamfleet", "engines", "import", str(src), "--engines-dir",
                            str(tmp_path / "engines"), "--weights", "q5"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "--weights must be auto or one of" in again.stderr


@pytest.mark.parametrize("qtype", ["Q8_0", "F16", "F32"])
def test_the_embedding_gathers_the_files_rows_exactly_and_stays_compact(qtype):
    """A Q8_0 or F16 table stays in the graph as the file holds it and only the gathered
    rows are widened: the same fp32 bits as ``gguf.quants.dequantize``, for a quarter (or
    half) of an fp32 table's bytes."""
    import onnxruntime as ort
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from onnx import TensorProto, helper

    from streamfleet.shared.ggufimport import _Graph, _Tensor, embedding

    vocab, hidden = 50, 64
    w = np.random.default_rng(7).standard_normal((vocab, hidden)).astype(np.float32)
    kind = GGMLQuantizationType[qtype]
    raw = quantize(w, kind) if qtype != "F32" else w
    code = {"Q8_0": 8, "F16": 1, "F32": 0}[qtype]
    table = _Tensor("token_embd.weight", code, qtype, (vocab, hidden), raw)
    model = type("M", (), {"tensors": {"token_embd.weight": table}, "tied": True})()
    g = _Graph()
    out = embedding(g, model, "input_ids", "q4-int8act")
    g.op("Identity", [out], outputs=["x"])
    graph = helper.make_graph(g.nodes, "e", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [2, 3])],
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, hidden])], g.inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[0, 7, 49], [3, 3, 12]], dtype=np.int64)
    got = session.run(None, {"input_ids": ids})[0]
    want = np.asarray(dequantize(raw, kind) if qtype != "F32" else w, dtype=np.float32)[ids]
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    stored = sum(np.prod(i.dims) * {TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.INT8: 1}[i.data_type]
                 for i in g.inits if i.name.startswith("embed."))
    assert stored <= vocab * hidden * {"Q8_0": 1.2, "F16": 2, "F32": 4}[qtype]
