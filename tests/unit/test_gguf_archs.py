"""The GGUF import's architectures beyond llama (shared/ggufimport.py, shared/gguf_gqa.py;
docs/models.md, "Architectures"): qwen2 (Q/K/V biases), qwen3 (per-head RMSNorm of Q and
K, a head size of its own), phi3 (fused Q|K|V and gate|up matrices, a sliding window that
caps the context), gemma2 and gemma3 (scaled embeddings, GELU, post-norms, soft-capping,
sliding-window layers masked by the GroupQueryAttention graph, gemma3's Q/K norms and
second RoPE base). Small random files written with ``gguf.GGUFWriter``
(tests/support/gguf_models.py) in every weight type, through both graph layouts (the
with-past graph and the GroupQueryAttention one that ``weights = "auto"`` serves), against
the numpy forward pass written from each architecture's definition, prefilled together
and decoded batched; what the import does not compute is refused by name. No real model
file, no torch, no network."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from streamfleet.shared.errors import FatalError
from streamfleet.shared.gguf_gqa import build_gqa_graph, write_gqa_graph
from streamfleet.shared.ggufimport import context_for, import_gguf, read_gguf
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.workers.engines.onnx_gqa import OnnxGqaEngine
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine
from tests.support.gguf_models import TinyLlama, numpy_logits, write_tiny_gguf

PROMPTS = [[5, 77, 140, 33, 200, 9, 61], [18, 250, 3], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]
ARCHS = ["qwen2", "qwen3", "phi3", "gemma2", "gemma3"]
#: what llama.cpp's converter writes for a phi3 model without LongRoPE (Phi-4's window: none)
PHI3_KEYS = {"phi3.rope.scaling.original_context_length": 128, "phi3.attention.sliding_window": 0}


def _model(arch: str, **kw) -> TinyLlama:
    if arch == "qwen3":  # a head size that is not hidden / heads, as Qwen3's own
        kw.setdefault("head_dim", 32)
    if arch == "gemma2":  # caps small enough to bend the scores and logits (Gemma 2's own: 50 and 30)
        kw.update(attn_softcap=2.0, final_softcap=5.0)
    if arch in ("gemma2", "gemma3"):
        kw.setdefault("window", kw.get("context", 128))  # the context capped at it: the window masks nothing
    if arch == "gemma3":  # six layers: the sixth global (RoPE base 1e6), the others sliding (their own base)
        kw.update(rope_base=1e6, rope_base_swa=10000.0, final_softcap=kw.get("final_softcap", 0.0))
        kw.setdefault("n_layer", 6)
        kw.setdefault("head_dim", 32)
    return TinyLlama(arch=arch, **kw)


def _write(tmp_path: Path, model: TinyLlama, name: str = "m", extra: dict | None = None) -> Path:
    keys = dict(PHI3_KEYS) if model.arch == "phi3" else {}
    keys.update(extra or {})
    return write_tiny_gguf(tmp_path / f"{name}.gguf", model, arch=model.arch, extra=keys)


def _engines(tmp_path: Path, model: TinyLlama, weights: str):
    src = _write(tmp_path, model)
    dest, description = import_gguf(src, tmp_path / "engines", "m", weights=weights, max_batch=8)
    write_gqa_graph(read_gguf(src), dest, weights=weights, max_context=model.context)
    spec = ModelRepository(tmp_path / "engines").get("m")
    return OnnxRuntimeEngine(spec, threads=1), OnnxGqaEngine(spec, threads=1), description


def _check(model: TinyLlama, *engines, atol: float = 2e-4, steps: int = 3) -> None:
    """All prompts prefilled together, then decode steps of all of them batched, in each of
    ``engines`` (fed the same tokens): every row equals the numpy forward pass of its own
    sequence, computed once for all the engines."""
    seqs = {f"s{i}": list(p) for i, p in enumerate(PROMPTS)}
    logits = [engine.prefill(list(seqs.items())) for engine in engines]
    for step in range(steps + 1):
        want = [numpy_logits(model, ids)[-1] for ids in seqs.values()]
        for engine, got in zip(engines, logits, strict=True):
            for r, sid in enumerate(seqs):
                np.testing.assert_allclose(got[r], want[r], atol=atol, rtol=0,
                                           err_msg=f"{model.arch} {type(engine).__name__} {sid} step {step}")
        if step == steps:
            break
        feed = []
        for r, (sid, ids) in enumerate(seqs.items()):
            ids.append(int(np.argmax(logits[0][r])))
            feed.append((sid, ids[-1]))
        logits = [engine.decode(feed) for engine in engines]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("weights", ["fp32", "q4"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_both_graph_layouts_equal_the_numpy_forward_pass(tmp_path, arch, weights, tied):
    model = _model(arch, seed=31, tied=tied)
    concat, gqa, description = _engines(tmp_path, model, weights)
    _check(model, concat, gqa)
    gqa.close()
    assert f"architecture  {arch}:" in description


#: llama.cpp's Q4_K_M mix (Q6_K V, down and output layer) and an fp16/bf16 one
MIXES = {
    "q4_k_m": dict(qtype="Q4_K", head_qtype="Q6_K", overrides={"attn_v": "Q6_K", "ffn_down": "Q6_K"}),
    "halves": dict(qtype="F16", head_qtype="BF16", overrides={"ffn_down": "Q8_0"}),
    # the other block types (phi3's fused matrices by their own names)
    "others": dict(qtype="Q5_K", head_qtype="Q5_0", overrides={"attn_k": "Q5_1", "attn_qkv": "Q5_1", "ffn_up": "Q3_K",
                                                                "ffn_gate": "Q2_K", "attn_output": "Q4_0"}),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mix", list(MIXES))
def test_quantized_mixes_equal_the_numpy_forward_pass(tmp_path, arch, mix):
    kw = dict(MIXES[mix])
    if arch in ("qwen3", "gemma3"):
        kw["head_dim"] = 128  # the output projection's input (heads x head size) a multiple of 256
    model = _model(arch, seed=32, hidden=256, intermediate=256, n_head=4, n_kv_head=2, tied=False, **kw)
    concat, gqa, _ = _engines(tmp_path, model, "q4")
    # logits up to about 36 in size here: fp32 rounding of sums over 256 and 512 terms
    _check(model, concat, gqa, atol=5e-4, steps=1)
    gqa.close()


def test_q4_int8act_stays_close(tmp_path):
    for arch in ARCHS:
        model = _model(arch, seed=33, n_layer=3)
        (tmp_path / arch).mkdir()
        _, gqa, _ = _engines(tmp_path / arch, model, "q4-int8act")
        got = gqa.prefill([("a", PROMPTS[0])])[0]
        assert np.corrcoef(got, numpy_logits(model, PROMPTS[0])[-1])[0, 1] > 0.99, arch
        gqa.close()


def test_qwen3s_query_scale_goes_into_its_norm_not_its_rows(tmp_path):
    # head size 64: 1/8 folded; the Q norm would undo a scale on the rows
    model = _model("qwen3", seed=34, head_dim=64)
    _, gqa, _ = _engines(tmp_path, model, "q4")
    _check(model, gqa, steps=1)
    gqa.close()


def test_phi3s_sliding_window_caps_the_context(tmp_path):
    model = _model("phi3", seed=35, context=128)
    src = _write(tmp_path, model, extra={"phi3.attention.sliding_window": 32})
    m = read_gguf(src)
    assert m.window == 32
    ctx, note = context_for(m, None)
    assert ctx == 32 and "sliding window" in note
    assert context_for(m, 100)[0] == 32 and context_for(m, 16)[0] == 16
    with pytest.raises(FatalError, match="beyond the sliding window of 32 tokens"):
        build_gqa_graph(m, "fp32", max_positions=100)
    dest, description = import_gguf(src, tmp_path / "engines", "w", weights="fp32")
    assert "max_context = 32" in (dest / "engine.toml").read_text()
    assert "sliding window 32 tokens" in description


@pytest.mark.parametrize("arch, case, expect", [
    ("gemma", {}, "architecture 'gemma' is not supported"),
    ("gemma3n", {}, "architecture 'gemma3n' is not supported"),
    ("gemma3", {"extra": {"gemma3.rope.scaling.type": "yarn"}}, "gemma3.rope.scaling.type 'yarn'"),
    ("qwen2", {"extra": {"qwen2.rope.scaling.factor": 4.0}}, "qwen2.rope.scaling.factor 4 without a linear"),
    ("phi3", {"extra": {"phi3.rope.scaling.type": "linear"}}, "phi3.rope.scaling.type"),
    ("gemma2", {"extra": {"gemma2.attention.sliding_window_pattern": 3}}, "gemma2.attention.sliding_window_pattern"),
    ("qwen2", {"extra": {"qwen2.rope.scaling.type": "yarn"}}, "qwen2.rope.scaling.type"),
    ("qwen3", {"extra": {"qwen3.rope.scaling.factor": 4.0}}, "qwen3.rope.scaling.factor"),
    ("qwen2", {"extra": {"qwen2.attention.sliding_window": 64}}, "qwen2.attention.sliding_window"),
    ("phi3", {"extra": {"phi3.rope.scaling.attn_factor": 1.2}}, "phi3.rope.scaling.attn_factor"),
    ("phi3", {"extra_tensors": {"rope_factors_long.weight": np.ones(8)}}, "rope_factors_long.weight"),
    ("qwen3", {"extra_tensors": {"blk.0.attn_q.bias": np.zeros(128)}}, "blk.0.attn_q.bias"),
])
def test_what_an_architecture_does_not_compute_is_refused_by_name(tmp_path, arch, case, expect):
    model = _model(arch if arch in ARCHS else "llama", seed=36, n_layer=1)
    extra = dict(PHI3_KEYS) if arch == "phi3" else {}
    extra.update(case.get("extra", {}))
    src = write_tiny_gguf(tmp_path / "m.gguf", model, arch=arch, extra=extra,
                          extra_tensors=case.get("extra_tensors"))
    with pytest.raises(FatalError, match=expect):
        read_gguf(src)


def test_a_missing_bias_or_norm_is_refused_by_name(tmp_path):
    model = _model("qwen2", seed=37, n_layer=1)
    del model.tensors["blk.0.attn_k.bias"]
    with pytest.raises(FatalError, match=r"tensor blk\.0\.attn_k\.bias is missing"):
        read_gguf(write_tiny_gguf(tmp_path / "a.gguf", model, arch="qwen2"))
    model = _model("qwen3", seed=37, n_layer=1)
    del model.tensors["blk.0.attn_q_norm.weight"]
    with pytest.raises(FatalError, match=r"tensor blk\.0\.attn_q_norm\.weight is missing"):
        read_gguf(write_tiny_gguf(tmp_path / "b.gguf", model, arch="qwen3"))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_the_gqa_graph_masks_gemmas_sliding_window(tmp_path, arch, weights):
    """A window of 4 positions, sequences of up to 14: the GroupQueryAttention graph's
    sliding-window layers (``local_window_size``) see what the numpy pass's window does,
    prefilled together and decoded; the with-past graph's context is capped at the window."""
    model = _model(arch, seed=38, window=4)
    src = _write(tmp_path, model)
    m = read_gguf(src)
    assert context_for(m, None)[0] == 4 and context_for(m, None, gqa=True)[0] == model.context
    dest, description = import_gguf(src, tmp_path / "engines", "m", weights=weights, max_batch=8)
    assert "max_context = 4\n" in (dest / "engine.toml").read_text()
    assert "masked by the GroupQueryAttention graph" in description
    toml = dest / "engine.toml"
    toml.write_text(toml.read_text().replace("max_context = 4\n", f"max_context = {model.context}\n"))
    write_gqa_graph(m, dest, weights=weights, max_context=model.context)
    gqa = OnnxGqaEngine(ModelRepository(tmp_path / "engines").get("m"), threads=1)
    _check(model, gqa)
    # a prompt in chunks (a later chunk of several tokens after a past: the op's other path)
    prompt = PROMPTS[2] + PROMPTS[0]
    gqa.start([("c", prompt)])
    for lo, hi in ((0, 3), (3, 4), (4, 12), (12, len(prompt))):
        last = gqa.extend([("c", prompt[lo:hi])])[0]
        np.testing.assert_allclose(last, numpy_logits(model, prompt[:hi])[-1], atol=2e-4, rtol=0, err_msg=f"{hi}")
    gqa.close()
    graph = build_gqa_graph(m, weights, max_positions=model.context + 1).graph
    import onnx

    windows = [next((onnx.helper.get_attribute_value(a) for a in n.attribute if a.name == "local_window_size"), None)
               for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert windows == [4 if m.sliding(i) else None for i in range(m.n_layer)]
    assert None in windows and 4 in windows
    with pytest.raises(FatalError, match="beyond the sliding window of 4"):
        from streamfleet.shared.ggufimport import write_model_files

        write_model_files(m, tmp_path / "x", weights=weights, max_context=model.context)


def test_a_window_changes_the_numpy_pass(tmp_path):
    # the window test above compares against something that differs from no window
    a = _model("gemma2", seed=38, window=4)
    b = _model("gemma2", seed=38, window=128)
    ids = PROMPTS[2]
    assert np.abs(numpy_logits(a, ids)[-1] - numpy_logits(b, ids)[-1]).max() > 1e-2


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_linear_rope_scaling(tmp_path, arch):
    """``rope.scaling.type`` linear (Gemma 3 4B-27B: factor 8 in the global layers only;
    Llama-family files: every layer) divides the positions by the factor, in both layouts."""
    model = _model(arch, seed=39, rope_scale=8.0) if arch != "llama" else TinyLlama(seed=39, rope_scale=4.0)
    concat, gqa, description = _engines(tmp_path, model, "fp32")
    _check(model, concat, gqa, steps=2)
    gqa.close()
    assert "(linear scaling" in description
    unscaled = _model(arch, seed=39) if arch != "llama" else TinyLlama(seed=39)
    ids = PROMPTS[2]
    assert np.abs(numpy_logits(model, ids)[-1] - numpy_logits(unscaled, ids)[-1]).max() > 1e-2
