"""scripts/make_tiny_model.py: deterministic files, a valid graph, a round-tripping tokenizer."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import onnx
import pytest

from streamfleet.shared.modelrepo import REPO_ROOT, load_tokenizer

SCRIPT = REPO_ROOT / "scripts" / "make_tiny_model.py"
SMALL = ["--seed", "7", "--vocab-size", "512", "--n-layer", "1", "--n-head", "2", "--d-model", "32",
         "--max-context", "64", "--max-batch", "4"]


def make(out: Path, *args: str) -> None:
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "-q", *args], check=True)


def test_same_seed_same_bytes(tmp_path):
    make(tmp_path / "a", *SMALL)
    make(tmp_path / "b", *SMALL)  # a separate process: another hash seed, same files
    for name in ("model.onnx", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    toml = tomllib.loads((tmp_path / "a" / "engine.toml").read_text())
    assert toml["name"] == "a" and toml["max_context"] == 64 and toml["eos_token_ids"] == [0]
    assert toml["build"] == {"seed": 7, "vocab_size": 512, "n_layer": 1, "n_head": 2, "d_model": 32}
    # --model-dir rebuilds the same files from that engine.toml
    (tmp_path / "a" / "model.onnx").unlink()
    subprocess.run([sys.executable, str(SCRIPT), "--model-dir", str(tmp_path / "a"), "-q"], check=True)
    assert (tmp_path / "a" / "model.onnx").read_bytes() == (tmp_path / "b" / "model.onnx").read_bytes()


def test_other_seed_other_weights(tmp_path):
    make(tmp_path / "a", *SMALL)
    make(tmp_path / "c", *SMALL[:1], "8", *SMALL[2:])
    assert (tmp_path / "a" / "model.onnx").read_bytes() != (tmp_path / "c" / "model.onnx").read_bytes()


def test_graph_layout(tiny_spec):
    model = onnx.load(str(tiny_spec.onnx_path))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 17
    build = tiny_spec.build
    hd = build["d_model"] // build["n_head"]

    def dims(vi):
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    ins = {i.name: dims(i) for i in model.graph.input}
    outs = {o.name: dims(o) for o in model.graph.output}
    assert ins["input_ids"] == ["batch_size", "sequence_length"]
    assert ins["position_ids"] == ["batch_size", "sequence_length"]
    assert ins["attention_mask"] == ["batch_size", "past_sequence_length + sequence_length"]
    assert outs["logits"] == ["batch_size", "sequence_length", build["vocab_size"]]
    for i in range(build["n_layer"]):
        for kv in ("key", "value"):
            assert ins[f"past_key_values.{i}.{kv}"] == ["batch_size", build["n_head"], "past_sequence_length", hd]
            assert outs[f"present.{i}.{kv}"] == ["batch_size", build["n_head"],
                                                 "past_sequence_length + sequence_length", hd]
    assert len(ins) == 3 + 2 * build["n_layer"] and len(outs) == 1 + 2 * build["n_layer"]
    ops = {n.op_type for n in model.graph.node}
    assert ops <= {"Gather", "Shape", "Sub", "Range", "Unsqueeze", "LessOrEqual", "Cast", "And", "Where",
                   "Add", "Mul", "MatMul", "Split", "Reshape", "Transpose", "Concat", "Softmax",
                   "LayerNormalization", "Erf"}


@pytest.mark.parametrize("text", [
    "The old lighthouse stood at the edge of the harbor.",
    "Hello , world !  Two  spaces,\ttabs\nand newlines. Don't stop!",
    "天气很好，我们去公园散步吧。你好，世界！",
    "Great job! 👍 🧑‍🚀 ❤️ 🎉🎉",
    "Naïve café — ÆØÅ \x00 \x7f ￿",
])
def test_tokenizer_round_trips(tiny_spec, text):
    tok = load_tokenizer(tiny_spec)
    ids = tok.encode(text)
    assert all(0 <= i < tiny_spec.build["vocab_size"] for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_vocab_and_eos(tiny_spec):
    tok = load_tokenizer(tiny_spec)
    assert len(tok) == tiny_spec.build["vocab_size"]
    assert tok.convert_ids_to_tokens(0) == "<|endoftext|>"
    assert tok.encode("<|endoftext|>") == [0]
    # merges learned from the corpus: common English words are single tokens
    assert len(tok.encode(" the")) == 1
    assert len(tok.encode("天气很好")) < len("天气很好".encode())


def test_greedy_decoding_is_varied(tiny_spec):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tiny_spec.onnx_path), providers=["CPUExecutionProvider"])
    ids = load_tokenizer(tiny_spec).encode("Once upon a time")
    for _ in range(24):  # no cache: the whole prefix each step
        n = len(ids)
        feed = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.arange(n)[None]}
        for i in sess.get_inputs()[3:]:
            feed[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
        logits = sess.run(["logits"], feed)[0][0, -1]
        assert np.isfinite(logits).all() and logits.std() > 0.5
        ids.append(int(logits.argmax()))
    generated = ids[-24:]
    assert len(set(generated)) >= 8, generated
