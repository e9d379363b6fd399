"""TensorRT on a real GPU: plans for tiny-gpt, greedy tokens equal to ONNX Runtime's,
alone, batched and with sequences joining and leaving; plan cache and refusals.

Skipped unless ``nvidia-smi`` is on PATH and ``tensorrt`` (and cuda-python or pycuda)
are importable. ``scripts/gpu_check.sh`` runs the same checks plus throughput.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil

import numpy as np
import pytest

from streamfleet.devkit.greedy import compare, greedy_alone, greedy_batched, greedy_staggered, random_prompts
from streamfleet.shared.errors import FatalError
from streamfleet.shared.modelrepo import ModelSpec


def _why_skip() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU (nvidia-smi not found)"
    if importlib.util.find_spec("tensorrt") is None:
        return "tensorrt is not installed"
    if importlib.util.find_spec("cuda") is None and importlib.util.find_spec("pycuda") is None:
        return "neither cuda-python nor pycuda is installed"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or "")]

STEPS = 24
LENGTHS = [1, 2, 5, 17, 40, 63, 100, 180]


@pytest.fixture(scope="module")
def plan(tiny_spec):
    from streamfleet.workers.engines.trt_build import build_plan

    return build_plan(tiny_spec, log=print)


@pytest.fixture(scope="module")
def trt_engine(tiny_spec, plan):
    from streamfleet.workers.engines.tensorrt import TensorRTEngine

    eng = TensorRTEngine(tiny_spec, build_if_missing=False)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(tiny_spec):
    from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

    ort = OnnxRuntimeEngine(tiny_spec)
    prompts = random_prompts(7, LENGTHS, ort.vocab_size)
    ref = {k: greedy_alone(ort, p, STEPS) for k, p in prompts.items()}
    ort.close()
    return prompts, ref


def test_plan_is_built_and_cached(tiny_spec, plan):
    from streamfleet.workers.engines.trt_build import build_plan
    from streamfleet.workers.engines.trt_plan import read_sidecar

    assert plan.path.exists() and plan.path.parent == tiny_spec.path / "plans"
    side = read_sidecar(plan.path)
    assert side["key"] == plan.key and [p["name"] for p in side["profiles"]] == ["prefill", "decode"]
    again = build_plan(tiny_spec)
    assert not again.built and again.path == plan.path


def test_layout_and_prefill_logits(trt_engine, reference):
    prompts, ref = reference
    assert (trt_engine.n_layer, trt_engine.kv_heads, trt_engine.head_dim, trt_engine.vocab_size) == (2, 4, 32, 1024)
    got = trt_engine.prefill(list(prompts.items()))
    for k in prompts:
        trt_engine.release(k)
    want = np.array([ref[k][1][0] for k in prompts])
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)


def test_greedy_alone_matches_onnxruntime(trt_engine, reference):
    prompts, ref = reference
    got = {k: greedy_alone(trt_engine, p, STEPS)[0] for k, p in prompts.items()}
    outcome = compare(ref, got, "alone")
    assert outcome.ok, str(outcome)


def test_greedy_batched_matches_onnxruntime(trt_engine, reference):
    prompts, ref = reference
    outcome = compare(ref, greedy_batched(trt_engine, prompts, STEPS), "batched")
    assert outcome.ok, str(outcome)


def test_greedy_with_joins_and_leaves_matches_onnxruntime(trt_engine, reference):
    prompts, ref = reference
    outcome = compare(ref, greedy_staggered(trt_engine, prompts, STEPS), "staggered")
    assert outcome.ok, str(outcome)
    assert not trt_engine._seqs


def test_missing_or_corrupt_plan(tiny_spec, tmp_path, plan):
    from streamfleet.workers.engines.tensorrt import TensorRTEngine

    d = tmp_path / "tiny-gpt"
    d.mkdir()
    for name in ("engine.toml", tiny_spec.onnx, tiny_spec.tokenizer):
        shutil.copy(tiny_spec.path / name, d / name)
    spec = ModelSpec.from_toml(d / "engine.toml")
    with pytest.raises(FatalError, match="no TensorRT plan"):
        TensorRTEngine(spec, build_if_missing=False)
    (d / "plans").mkdir()
    shutil.copy(plan.path, d / "plans" / plan.path.name)        # same graph and profiles: same key
    shutil.copy(plan.path.with_suffix(".json"), d / "plans" / plan.path.with_suffix(".json").name)
    TensorRTEngine(spec, build_if_missing=False).close()
    (d / "plans" / plan.path.name).write_bytes(b"garbage")
    with pytest.raises(FatalError, match="does not deserialize"):
        TensorRTEngine(spec, build_if_missing=False)
    eng = TensorRTEngine(spec)  # rebuilds
    try:
        assert (d / "plans" / plan.path.name).stat().st_size > 1000
        assert eng.prefill([("x", [1, 2, 3])]).shape == (1, eng.vocab_size)
    finally:
        eng.close()


def test_cuda_libraries_agree(tiny_spec, plan, reference):
    """Both CUDA libraries, where both are installed, give the same tokens."""
    from streamfleet.workers.engines.cuda_mem import choose
    from streamfleet.workers.engines.tensorrt import TensorRTEngine

    prompts, ref = reference
    libs = []
    for name in ("cuda-python", "pycuda"):
        try:
            choose(name)
            libs.append(name)
        except FatalError:
            pass
    for name in libs:
        eng = TensorRTEngine(tiny_spec, build_if_missing=False, cuda=name)
        try:
            outcome = compare(ref, greedy_batched(eng, prompts, 8), name)
            assert outcome.ok, str(outcome)
        finally:
            eng.close()


def test_small_max_context(tiny_spec, tmp_path):
    """A model folder with max_context 16: its own plan; sequences hit the end."""
    from streamfleet.workers.engines.onnxruntime import InvalidSequenceError
    from streamfleet.workers.engines.tensorrt import TensorRTEngine

    spec = dataclasses.replace(tiny_spec, max_context=16, max_batch=4,
                               options={"tensorrt": {"plans_dir": str(tmp_path)}})
    eng = TensorRTEngine(spec)
    try:
        eng.prefill([("a", [5] * 15), ("b", [7] * 3)])
        eng.decode([("a", 1), ("b", 1)])            # a reaches 16
        with pytest.raises(InvalidSequenceError):
            eng.decode([("a", 1), ("b", 1)])
        for _ in range(10):
            eng.decode([("b", 2)])
    finally:
        eng.close()
