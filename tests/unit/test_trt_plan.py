"""TensorRT backend without a GPU: graph layout, optimization profiles, plan keys and
cache invalidation, options, backend and CUDA-library selection, lazy imports; and the
engine's device data path (slab, joins, leaves, compaction, logits copies) with device
memory emulated in host memory and the plan replaced by ONNX Runtime
(streamfleet/devkit/trt_emulation.py), checked against the ONNX Runtime engine."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from streamfleet.devkit.greedy import greedy_alone, greedy_scenario
from streamfleet.devkit.trt_emulation import HostMem, OrtRunner, emulated_engine
from streamfleet.shared.errors import FatalError
from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.workers.engines import cuda_mem, load_engine, trt_build, trt_plan
from streamfleet.workers.engines.onnxruntime import InvalidSequenceError, OnnxRuntimeEngine
from streamfleet.workers.engines.tensorrt import TensorRTEngine, prefill_groups
from streamfleet.workers.engines.trt_plan import DECODE, PREFILL

REPO = Path(__file__).resolve().parents[2]
STEPS = 16


# -- graph layout and profiles ---------------------------------------------------------


def test_graph_info_of_tiny_gpt(tiny_spec):
    info = trt_plan.read_graph_info(tiny_spec.onnx_path)
    b = tiny_spec.build
    assert (info.n_layer, info.kv_heads, info.head_dim, info.vocab_size) == (
        b["n_layer"], b["n_head"], b["d_model"] // b["n_head"], b["vocab_size"])
    assert (info.kv_dtype, info.logits_dtype, info.index_dtype) == ("float32", "float32", "int64")
    assert info.has_position_ids
    assert info.past_names[:2] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert info.present_names[-1] == f"present.{b['n_layer'] - 1}.value"


def test_profiles_of_tiny_gpt(tiny_spec):
    info = trt_plan.read_graph_info(tiny_spec.onnx_path)
    prefill, decode = trt_plan.profiles(tiny_spec, info)
    assert (prefill.name, decode.name) == (PREFILL, DECODE)
    B, C = tiny_spec.max_batch, tiny_spec.max_context  # 16, 256
    H, D = info.kv_heads, info.head_dim
    assert set(prefill.names()) == set(decode.names()) == set(info.inputs)
    assert prefill.shape("input_ids") == ((1, 1), (8, 128), (B, C))
    assert prefill.shape("attention_mask") == ((1, 1), (8, 128), (B, C))
    assert prefill.shape("position_ids") == prefill.shape("input_ids")
    assert prefill.shape("past_key_values.1.value") == ((1, H, 0, D), (8, H, 0, D), (B, H, 0, D))
    assert decode.shape("input_ids") == ((1, 1), (B, 1), (B, 1))
    assert decode.shape("attention_mask") == ((1, 2), (B, C // 2), (B, C))
    assert decode.shape("past_key_values.0.key") == ((1, H, 1, D), (B, H, C // 2 - 1, D), (B, H, C - 1, D))
    for prof in (prefill, decode):
        for _, (lo, opt, hi) in prof.shapes:
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))
    assert decode.contains("attention_mask", (3, C)) and not decode.contains("attention_mask", (3, C + 1))
    assert not prefill.contains("past_key_values.0.key", (1, H, 1, D))


def test_profile_options_move_opt_points(tiny_spec):
    info = trt_plan.read_graph_info(tiny_spec.onnx_path)
    prefill, decode = trt_plan.profiles(tiny_spec, info, {"opt_prefill_batch": 2, "opt_prefill_len": 30,
                                                           "opt_decode_batch": 4, "opt_decode_context": 999})
    assert prefill.shape("input_ids")[1] == (2, 30)
    assert decode.shape("attention_mask")[1] == (4, tiny_spec.max_context)  # clamped to max
    with pytest.raises(FatalError):
        trt_plan.profiles(dataclasses.replace(tiny_spec, max_context=1), info)


def _synthetic_graph(n_layer=3, heads=2, head_dim=16, vocab=77, positions=True, kv_type=TensorProto.FLOAT16,
                     heads_dim: int | str | None = None, extra_input: bool | str = False, ids_type=TensorProto.INT32):
    """A with-past graph with unusual dims (only its I/O matters here)."""
    h = heads if heads_dim is None else heads_dim
    inputs = [helper.make_tensor_value_info("input_ids", ids_type, ["b", "s"]),
              helper.make_tensor_value_info("attention_mask", ids_type, ["b", "t"])]
    if positions:
        inputs.append(helper.make_tensor_value_info("position_ids", ids_type, ["b", "s"]))
    if extra_input:
        name = extra_input if isinstance(extra_input, str) else "token_type_ids"
        inputs.append(helper.make_tensor_value_info(name, ids_type, ["b", "s"]))
    outputs = [helper.make_tensor_value_info("logits", kv_type, ["b", "s", vocab])]
    nodes = []
    for i in range(n_layer):
        for kv in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", kv_type, ["b", h, "p", head_dim]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", kv_type, ["b", h, "t", head_dim]))
            nodes.append(helper.make_node("Identity", [f"past_key_values.{i}.{kv}"], [f"present.{i}.{kv}"]))
    nodes.append(helper.make_node("Identity", ["past_key_values.0.key"], ["logits"]))
    return helper.make_model(helper.make_graph(nodes, "synthetic", inputs, outputs))


def test_profiles_of_a_synthetic_graph(tmp_path):
    info = trt_plan.graph_info_from_model(_synthetic_graph())
    assert (info.n_layer, info.kv_heads, info.head_dim, info.vocab_size) == (3, 2, 16, 77)
    assert (info.kv_dtype, info.index_dtype, info.has_position_ids) == ("float16", "int32", True)
    spec = ModelSpec(name="synth", path=tmp_path, max_batch=4, max_context=64)
    prefill, decode = trt_plan.profiles(spec, info)
    assert set(prefill.names()) == {"input_ids", "attention_mask", "position_ids", *info.past_names}
    assert len(info.past_names) == 6
    assert decode.shape("past_key_values.2.value") == ((1, 2, 1, 16), (4, 2, 31, 16), (4, 2, 63, 16))
    assert prefill.shape("input_ids") == ((1, 1), (4, 64), (4, 64))


def test_synthetic_graph_refusals():
    with pytest.raises(FatalError, match="num_key_value_heads"):
        trt_plan.graph_info_from_model(_synthetic_graph(heads_dim="heads"))
    info = trt_plan.graph_info_from_model(_synthetic_graph(heads_dim="heads"), options={"num_key_value_heads": 2})
    assert info.kv_heads == 2
    with pytest.raises(FatalError, match="token_type_ids"):
        trt_plan.graph_info_from_model(_synthetic_graph(extra_input=True))
    # positions from cache columns would shift under padding: refused, naming the fix
    with pytest.raises(FatalError, match=r"no position_ids input.*onnxruntime"):
        trt_plan.graph_info_from_model(_synthetic_graph(positions=False))
    with pytest.raises(FatalError, match="merged decoder"):
        trt_plan.graph_info_from_model(_synthetic_graph(extra_input="use_cache_branch"))
    with pytest.raises(FatalError, match="input_ids"):
        trt_plan.graph_info_from_model(_synthetic_graph(ids_type=TensorProto.FLOAT))
    g = _synthetic_graph()
    del g.graph.output[-1]
    with pytest.raises(FatalError, match="lacks outputs"):
        trt_plan.graph_info_from_model(g)
    g = _synthetic_graph()
    g.graph.input.pop(1)  # attention_mask
    with pytest.raises(FatalError, match="attention_mask"):
        trt_plan.graph_info_from_model(g)


# -- keys, paths, cache invalidation ---------------------------------------------------


@pytest.fixture
def model_copy(tiny_spec, tmp_path) -> ModelSpec:
    """tiny-gpt's engine.toml and model.onnx in a temporary folder (plans go there)."""
    d = tmp_path / "engines" / "tiny-gpt"
    d.mkdir(parents=True)
    for name in ("engine.toml", tiny_spec.onnx, tiny_spec.tokenizer):
        shutil.copy(tiny_spec.path / name, d / name)
    return ModelSpec.from_toml(d / "engine.toml")


def test_plan_key_and_path(model_copy):
    req = trt_plan.plan_request(model_copy, "10.8.0.43", "90")
    assert re.fullmatch(r"[0-9a-f]{64}", req.key)
    assert req.path == model_copy.path / "plans" / f"10.8-sm90-{req.key[:16]}.plan"
    assert req.sidecar_path == req.path.with_suffix(".json")
    assert req.timing_cache_path == model_copy.path / "plans" / "timing-sm90-trt10.8.cache"
    assert req.key == trt_plan.plan_key("10.8.0.43", "90", req.graph_sha256, req.profiles, req.build)
    assert req.key == trt_plan.plan_request(model_copy, "10.8.0.43", "90").key  # stable
    mat = req.key_material()
    assert mat["graph_sha256"] == req.graph_sha256 and mat["compute_capability"] == "90"
    json.dumps(mat)  # JSON-able, for the sidecar


def test_key_changes_with_what_the_plan_depends_on(model_copy):
    base = trt_plan.plan_request(model_copy, "10.8.0.43", "90")
    keys = {base.key}

    def differs(req):
        assert req.key not in keys and req.path != base.path
        keys.add(req.key)

    differs(trt_plan.plan_request(model_copy, "10.8.0.44", "90"))             # TensorRT patch release
    differs(trt_plan.plan_request(model_copy, "11.0.0.1", "90"))              # TensorRT major
    differs(trt_plan.plan_request(model_copy, "10.8.0.43", "89"))             # GPU architecture
    differs(trt_plan.plan_request(dataclasses.replace(model_copy, max_batch=8), "10.8.0.43", "90"))    # profile
    differs(trt_plan.plan_request(dataclasses.replace(model_copy, max_context=128), "10.8.0.43", "90"))
    differs(trt_plan.plan_request(model_copy, "10.8.0.43", "90", {"opt_decode_batch": 3}))            # opt point
    differs(trt_plan.plan_request(model_copy, "10.8.0.43", "90", {"tf32": True}))                     # builder
    differs(trt_plan.plan_request(model_copy, "10.8.0.43", "90", {"builder_optimization_level": 5}))
    # runtime-only options do not
    assert trt_plan.plan_request(model_copy, "10.8.0.43", "90", {"build_if_missing": False, "cuda": "pycuda",
                                                                  "max_prefill_tokens": 99}).key == base.key
    # the graph: any byte of it
    onnx_path = model_copy.onnx_path
    model = onnx.load(str(onnx_path))
    w = model.graph.initializer[0]
    arr = onnx.numpy_helper.to_array(w).copy()
    arr.flat[0] += 1.0
    w.CopyFrom(onnx.numpy_helper.from_array(arr, w.name))
    onnx.save(model, str(onnx_path))
    differs(trt_plan.plan_request(model_copy, "10.8.0.43", "90"))


def test_graph_hash_covers_external_data(model_copy, tmp_path):
    model = onnx.load(str(model_copy.onnx_path))
    out = tmp_path / "ext" / "model.onnx"
    out.parent.mkdir()
    onnx.save(model, str(out), save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data",
              size_threshold=0)
    first = trt_plan.graph_sha256(out)
    data = out.parent / "model.onnx.data"
    blob = bytearray(data.read_bytes())
    blob[-1] ^= 0xFF
    data.write_bytes(bytes(blob))
    assert trt_plan.graph_sha256(out) != first


def test_options_merge_and_validation(model_copy):
    spec = dataclasses.replace(model_copy, options={"tensorrt": {"build_if_missing": False, "workspace_mb": 512,
                                                                 "cuda": "pycuda"}, "head_dim": 32})
    opts = trt_plan.tensorrt_options(spec, {"cuda": "cuda-python", "threads": 4, "workspace_mb": None})
    assert opts["build_if_missing"] is False and opts["workspace_mb"] == 512
    assert opts["cuda"] == "cuda-python"          # keyword beats engine.toml
    assert opts["head_dim"] == 32                 # the top-level fallback, as for ONNX Runtime
    assert "threads" not in opts                  # other backends' options are ignored
    assert trt_plan.tensorrt_options(spec, {"build_if_missing": "1"})["build_if_missing"] is True
    with pytest.raises(FatalError, match="unknown"):
        trt_plan.tensorrt_options(dataclasses.replace(spec, options={"tensorrt": {"bulid_if_missing": True}}))
    with pytest.raises(FatalError, match="build_if_missing"):
        trt_plan.tensorrt_options(dataclasses.replace(spec, options={"tensorrt": {"build_if_missing": "maybe"}}))


def test_sidecar_and_local_listing(model_copy):
    req = trt_plan.plan_request(model_copy, "10.8.0.43", "90")
    res = trt_plan.write_plan(req, b"not really a plan", 1.5)
    assert res.built and req.path.read_bytes() == b"not really a plan"
    side = trt_plan.read_sidecar(req.path)
    assert side["key"] == req.key and side["profiles"][0]["name"] == PREFILL and side["built"]["seconds"] == 1.5
    again = trt_plan.BuildResult.from_sidecar(req)
    assert not again.built and again.seconds == 1.5 and again.key == req.key
    rec = again.record(host="gpu-7")
    assert (rec["host"], rec["trt_version"], rec["cc"]) == ("gpu-7", "10.8.0.43", "90")
    listed = trt_plan.list_local_plans(model_copy)
    assert [p["key"] for p in listed] == [req.key] and listed[0]["bytes"] == len(b"not really a plan")
    assert not list(req.path.parent.glob(".*.tmp"))  # atomic writes leave nothing behind


def test_trt_version_helpers():
    assert trt_plan.trt_major_minor("10.8.0.43") == "10.8"
    assert trt_plan.trt_major_minor("11.0") == "11.0"
    assert trt_plan.plan_filename("11.1.0.7", "100", "ab" * 32) == "11.1-sm100-abababababababab.plan"


def test_network_flags_per_version():
    class Flag:
        STRONGLY_TYPED = 1

    class Trt10:
        __version__ = "10.8.0.43"
        NetworkDefinitionCreationFlag = Flag

    class Trt11:
        __version__ = "11.0.0.1"
        NetworkDefinitionCreationFlag = object()

    assert trt_build._network_flags(Trt10) == 2
    assert trt_build._network_flags(Trt11) == 0


# -- backend selection, imports --------------------------------------------------------


def test_load_engine_tensorrt_without_tensorrt_is_a_clear_fatal_error(tiny_spec, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # "not installed", even where it is
    with pytest.raises(FatalError) as exc:
        load_engine(tiny_spec, "tensorrt")
    assert "'tensorrt' package" in exc.value.message and "streamfleet[gpu]" in exc.value.message


def test_cpu_imports_stay_free_of_gpu_packages():
    code = (
        "import sys\n"
        "import streamfleet.workers.engines, streamfleet.workers.process, streamfleet.workers.engines.tensorrt\n"
        "import streamfleet.workers.engines.trt_plan, streamfleet.workers.engines.trt_build\n"
        "import streamfleet.workers.engines.cuda_mem\n"
        "import streamfleet.workers.enginebuild, streamfleet.cli, streamfleet.engines_cli\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'pycuda', 'cuda', 'arq'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _importer(available: set[str]):
    imported = []

    def imp(name):
        imported.append(name)
        if name in available:
            return f"<module {name}>"
        raise ImportError(f"No module named {name!r}")

    imp.imported = imported
    return imp


def test_cuda_library_choice():
    both = _importer({"cuda.bindings.runtime", "pycuda.driver"})
    assert cuda_mem.choose("auto", both) == ("cuda-python", "<module cuda.bindings.runtime>")
    assert both.imported == ["cuda.bindings.runtime"]  # pycuda is not even probed
    assert cuda_mem.choose("pycuda", both)[0] == "pycuda"
    assert cuda_mem.choose("auto", _importer({"pycuda.driver"}))[0] == "pycuda"
    legacy = cuda_mem.choose("auto", _importer({"cuda.cudart"}))  # cuda-python before cuda.bindings
    assert legacy == ("cuda-python", "<module cuda.cudart>")
    with pytest.raises(FatalError) as exc:
        cuda_mem.choose("auto", _importer(set()))
    assert "cuda-python or pycuda" in exc.value.message and "streamfleet[gpu]" in exc.value.message
    with pytest.raises(FatalError, match="needs pycuda"):
        cuda_mem.choose("pycuda", _importer({"cuda.bindings.runtime"}))
    with pytest.raises(FatalError, match="unknown CUDA library"):
        cuda_mem.choose("cupy", both)


def test_cuda_library_select_constructs_the_choice(monkeypatch):
    made = []

    class Fake:
        def __init__(self, module, importer):
            made.append(module)

    monkeypatch.setitem(cuda_mem.IMPLEMENTATIONS, "pycuda", Fake)
    assert isinstance(cuda_mem.select("auto", _importer({"pycuda.driver"})), Fake)
    assert made == ["<module pycuda.driver>"]

    class Broken:
        def __init__(self, module, importer):
            raise RuntimeError("cuInit failed: no CUDA-capable device is detected")

    monkeypatch.setitem(cuda_mem.IMPLEMENTATIONS, "pycuda", Broken)
    with pytest.raises(FatalError, match="no CUDA-capable device"):
        cuda_mem.select("pycuda", _importer({"pycuda.driver"}))


def test_cuda_library_falls_back_when_the_first_cannot_initialise(monkeypatch, capsys):
    """cuda-python built for CUDA 13 imports on a CUDA 12 driver, then fails to start:
    auto moves on to pycuda and says so; a named library does not."""
    class TooNew:
        def __init__(self, module, importer):
            raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    class Works:
        def __init__(self, module, importer):
            self.module = module

    monkeypatch.setitem(cuda_mem.IMPLEMENTATIONS, "cuda-python", TooNew)
    monkeypatch.setitem(cuda_mem.IMPLEMENTATIONS, "pycuda", Works)
    both = _importer({"cuda.bindings.runtime", "pycuda.driver"})
    mem = cuda_mem.select("auto", both)
    assert isinstance(mem, Works) and mem.module == "<module pycuda.driver>"
    logged = capsys.readouterr()
    assert "falling back" in logged.out + logged.err and "InsufficientDriver" in logged.out + logged.err
    with pytest.raises(FatalError, match="InsufficientDriver"):
        cuda_mem.select("cuda-python", both)
    with pytest.raises(FatalError, match="InsufficientDriver"):  # nothing to fall back to
        cuda_mem.select("auto", _importer({"cuda.bindings.runtime"}))


def test_compute_capability_from_nvidia_smi(monkeypatch):
    monkeypatch.setattr(cuda_mem.shutil, "which", lambda name: None)
    with pytest.raises(FatalError, match="nvidia-smi"):
        cuda_mem.detect_compute_capability()
    assert cuda_mem.detect_compute_capability(HostMem()) == "90"


def test_prefill_groups_respect_the_token_budget():
    lengths = [3, 200, 5, 190, 4, 1, 60, 64]
    groups = prefill_groups(lengths, 399)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * lengths[g[0]] <= 400 and lengths[g[0]] == max(lengths[i] for i in g)
    assert [1] in groups and [3] in groups        # two long ones do not fit together
    assert prefill_groups([300], 256) == [[0]]    # one prompt always fits


# -- the engine's data path, emulated ---------------------------------------------------


@pytest.fixture(scope="module")
def ort_engine(tiny_spec):
    eng = OnnxRuntimeEngine(tiny_spec, threads=1)
    yield eng
    eng.close()


@pytest.fixture
def engine(tiny_spec):
    eng = emulated_engine(tiny_spec)
    yield eng
    eng.close()


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, n)]


def test_emulated_engine_alone_matches_onnxruntime(engine, ort_engine):
    assert (engine.vocab_size, engine.n_layer, engine.kv_heads, engine.head_dim) == (
        ort_engine.vocab_size, ort_engine.n_layer, ort_engine.kv_heads, ort_engine.head_dim)
    for seed, n in ((1, 7), (2, 1), (3, 40)):
        ids = prompt(seed, n, engine.vocab_size)
        want_tokens, want_rows = greedy_alone(ort_engine, ids, STEPS)
        tokens, rows = greedy_alone(engine, ids, STEPS)
        assert tokens == want_tokens
        np.testing.assert_allclose(np.array(rows), np.array(want_rows), atol=1e-4, rtol=1e-4)


SCENARIOS = {
    # step -> sequences that join (one prefill call) / are released / sit the step out
    "joins-leaves-pause": dict(joins={0: "abc", 3: "d", 6: "e"}, leaves={5: "b", 9: "c"}, paused={11: "d", 12: "d"}),
    "reuse-rows": dict(joins={0: "abcd", 4: "e"}, leaves={3: "b", 10: "a", 11: "e"}, paused={6: "c"}),
    "one-at-a-time": dict(joins={0: "a", 1: "b", 2: "c", 3: "d", 4: "e"}, leaves={8: "a", 9: "d"}, paused={}),
    # the longest leaves early: spare width is cut; a long newcomer later widens the slab
    "long-leaves-then-long-joins": dict(joins={0: "cab", 12: "f"}, leaves={2: "c"}, paused={}),
    # pauses everywhere: masked gaps inside rows, then a compaction that must skip them
    "gappy": dict(joins={0: "abcde"}, leaves={7: "abd"}, paused={1: "ac", 2: "e", 4: "ab", 5: "c"}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_emulated_batch_with_joins_and_leaves(engine, ort_engine, name):
    """As for ONNX Runtime: sequences join and leave mid-way, the decode order shuffles,
    some sit out steps; each gets exactly its solo tokens (and logits)."""
    plan = SCENARIOS[name]
    v = engine.vocab_size
    prompts = {"a": prompt(1, 7, v), "b": prompt(2, 1, v), "c": prompt(3, 90, v), "d": prompt(4, 3, v),
               "e": prompt(5, 12, v), "f": prompt(6, 120, v)}
    solo = {k: greedy_alone(ort_engine, p, STEPS) for k, p in prompts.items()}
    got, rows = greedy_scenario(engine, prompts, plan, STEPS, STEPS + 16)
    assert got
    for k in got:
        assert got[k] == solo[k][0], k
        np.testing.assert_allclose(np.array(rows[k]), np.array(solo[k][1]), atol=1e-4, rtol=1e-4)


def test_steady_decode_copies_nothing_on_the_device(engine):
    """In a steady batch the presents of one step are the pasts of the next: no device
    copies, only the small uploads and the logits download."""
    v = engine.vocab_size
    engine.prefill([("s1", prompt(1, 5, v)), ("s2", prompt(2, 9, v))])
    engine.decode([("s1", 5), ("s2", 6)])
    calls = engine._mem.calls
    before = dict(calls)
    for _ in range(5):
        engine.decode([("s2", 6), ("s1", 5)])
    delta = {k: calls[k] - before.get(k, 0) for k in calls}
    assert delta.get("copy_2d", 0) == delta.get("memset", 0) == delta.get("memset_2d", 0) == 0
    assert delta["htod"] == 5 * 3 and delta["dtoh"] == 5
    assert engine._width == 9 + 6


def test_emulated_slab_reuses_rows_and_compacts(engine):
    v = engine.vocab_size
    engine.prefill([(f"s{i}", prompt(i, 3 + i, v)) for i in range(4)])
    engine.decode([(f"s{i}", 1) for i in range(4)])
    assert engine._rows == ["s0", "s1", "s2", "s3"]
    engine.release("s1")
    engine.prefill([("s9", prompt(9, 2, v))])
    assert engine._rows == ["s0", "s9", "s2", "s3"]        # the newcomer takes the idle row
    engine.release("s3")
    engine.decode([("s0", 1), ("s9", 1), ("s2", 1)])
    assert engine._rows == ["s0", "s9", "s2"]              # a trailing idle row is just dropped
    engine.release("s0")
    engine.release("s9")
    engine.decode([("s2", 1)])
    assert engine._rows == ["s2"]                          # mostly idle: compacted
    assert engine._width == engine._seqs["s2"].length


def test_emulated_max_context(tiny_spec):
    spec = dataclasses.replace(tiny_spec, max_context=8)
    eng = emulated_engine(spec)
    ort = OnnxRuntimeEngine(spec, threads=1)
    try:
        want = ort.prefill([("full", [5] * 8), ("room", [5] * 6)])
        got = eng.prefill([("full", [5] * 8), ("room", [5] * 6)])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        assert eng._seqs["full"].row == -1                 # can never decode: no cache kept
        with pytest.raises(InvalidSequenceError) as exc:
            eng.decode([("full", 1), ("room", 1)])
        assert exc.value.seq_ids == ["full"]
        ort.release("full")
        for tok in (1, 2):
            np.testing.assert_allclose(eng.decode([("room", tok)]), ort.decode([("room", tok)]), atol=1e-4, rtol=1e-4)
        with pytest.raises(InvalidSequenceError):
            eng.decode([("room", 1)])                      # length 8 now
        # a sequence at max_context that sits out does not stop the others
        eng.prefill([("p", [1, 2, 3, 4, 5, 6, 7]), ("q", [3])])
        eng.decode([("p", 1), ("q", 1)])                   # p reaches 8
        for _ in range(5):
            eng.decode([("q", 2)])
        assert eng._seqs["p"].row == -1 and eng._width + 1 <= 8
    finally:
        eng.close()
        ort.close()


def test_emulated_refusals(engine):
    v = engine.vocab_size
    with pytest.raises(InvalidSequenceError) as exc:
        engine.prefill([("ok", [1, 2]), ("long", [1] * (engine.max_context + 1))])
    assert exc.value.seq_ids == ["long"]
    engine.prefill([("x", [1, 2, 3])])
    with pytest.raises(InvalidSequenceError):
        engine.prefill([("x", [1])])
    with pytest.raises(InvalidSequenceError):
        engine.decode([("x", 1), ("ghost", 1)])
    with pytest.raises(InvalidSequenceError):
        engine.decode([("x", v)])                          # refused and released
    assert "x" not in engine._seqs
    with pytest.raises(ValueError):
        engine.prefill([(f"s{i}", [1]) for i in range(engine.max_batch + 1)])
    assert engine.decode([]).shape == (0, v) and engine.prefill([]).shape == (0, v)


def test_emulated_full_batch_and_small_prefill_budget(tiny_spec, ort_engine):
    """max_batch sequences at once, prefilled in several groups (small token budget)."""
    eng = emulated_engine(tiny_spec, max_prefill_tokens=64)
    try:
        v = eng.vocab_size
        prompts = {f"r{i}": prompt(100 + i, 1 + (i * 7) % 50, v) for i in range(eng.max_batch)}
        logits = eng.prefill(list(prompts.items()))
        assert eng._runner.runs[PREFILL] > 1
        want = {k: greedy_alone(ort_engine, p, 3) for k, p in prompts.items()}
        got = {k: [int(row.argmax())] for k, row in zip(prompts, logits)}
        for _ in range(3):
            out = eng.decode([(k, t[-1]) for k, t in got.items()])
            for (_k, t), row in zip(got.items(), out):
                t.append(int(row.argmax()))
        assert got == {k: w[0] for k, w in want.items()}
    finally:
        eng.close()


def test_profile_limits_are_enforced_by_the_emulation(tiny_spec):
    mem = HostMem()
    runner = OrtRunner(tiny_spec, mem)
    eng = TensorRTEngine(tiny_spec, mem=mem, runner=runner)
    try:
        shapes = {"input_ids": (1, 1), "attention_mask": (1, 1), "position_ids": (1, 1)}
        shapes.update(dict.fromkeys(runner.info.past_names, (1, eng.kv_heads, 0, eng.head_dim)))
        with pytest.raises(AssertionError, match="outside the decode profile"):
            runner.run(DECODE, shapes, {}, None)             # decode needs a past of >= 1
    finally:
        eng.close()


def test_custom_runner_needs_its_memory(tiny_spec):
    with pytest.raises(ValueError):
        TensorRTEngine(tiny_spec, runner=object())


def test_emulated_greedy_drivers_agree_with_onnxruntime(engine, ort_engine):
    """The drivers the GPU check uses (streamfleet/devkit/greedy.py), run on the emulation."""
    from streamfleet.devkit.greedy import compare, greedy_alone, greedy_batched, greedy_staggered, random_prompts

    prompts = random_prompts(7, [1, 2, 5, 17, 40, 63, 100, 180], engine.vocab_size)
    ref = {k: greedy_alone(ort_engine, p, 12) for k, p in prompts.items()}
    for label, got in (("batched", greedy_batched(engine, prompts, 12)),
                       ("staggered", greedy_staggered(engine, prompts, 12))):
        outcome = compare(ref, got, label)
        assert outcome.ok and outcome.exact == len(prompts) and not outcome.near_ties, str(outcome)
    assert not engine._seqs
    # a forged divergence: a mismatch, or a near tie when the reference was torn
    tokens, rows = ref["p0-1"]
    wrong = [*tokens[:3], (tokens[3] + 1) % engine.vocab_size]
    assert compare(ref, {"p0-1": wrong}, "forged").mismatches
    tied = [r.copy() for r in rows]
    tied[3][wrong[3]] = tied[3][tokens[3]]
    assert compare({"p0-1": (tokens, tied)}, {"p0-1": wrong}, "tied").near_ties


# -- the TensorRT calls, against a stand-in tensorrt module ------------------------------


@pytest.fixture
def fake_trt(monkeypatch):
    from streamfleet.devkit.trt_emulation import fake_tensorrt

    mem = HostMem()
    trt = fake_tensorrt(mem)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    return trt, mem


def test_build_plan_drives_the_builder(model_copy, fake_trt):
    trt, _ = fake_trt
    res = trt_build.build_plan(model_copy, compute_capability="90")
    req = trt_plan.plan_request(model_copy, trt.__version__, "90")
    assert res.built and res.path == req.path and res.key == req.key
    assert trt.calls["network-flags-32"] == 1                    # 1 << STRONGLY_TYPED on 10.x
    plan = json.loads(res.path.read_bytes()[len(b"FAKEPLAN"):])
    assert plan["profiles"] == [{n: [list(x) for x in s] for n, s in p.shapes} for p in req.profiles]
    assert req.timing_cache_path.read_bytes() == b"timing:+"
    assert trt_plan.read_sidecar(res.path)["key"] == res.key
    assert not trt_build.build_plan(model_copy, compute_capability="90").built and trt.calls["build"] == 1
    assert trt_build.build_plan(model_copy, compute_capability="90", force=True).built
    assert req.timing_cache_path.read_bytes() == b"timing:++"  # the cache is fed back and grows
    trt.__version__ = "11.0.1.2"
    res11 = trt_build.build_plan(model_copy, compute_capability="90")
    assert res11.path.name.startswith("11.0-sm90-") and trt.calls["network-flags-0"] == 1


def test_engine_over_the_real_runner(model_copy, fake_trt, ort_engine):
    """TensorRTEngine with its own TrtRunner (plan lookup, build, deserialize, contexts,
    shapes and addresses) on the stand-in module: same tokens as ONNX Runtime."""
    from streamfleet.devkit.greedy import compare, greedy_alone, greedy_batched, greedy_staggered, random_prompts

    trt, mem = fake_trt
    with pytest.raises(FatalError, match=r"no TensorRT plan for tiny-gpt .*streamfleet engines build tiny-gpt"):
        TensorRTEngine(model_copy, mem=mem, build_if_missing=False)
    eng = TensorRTEngine(model_copy, mem=mem)                    # builds the plan, then loads it
    try:
        assert trt.calls["build"] == 1 and trt.calls["deserialize"] == 1
        prompts = random_prompts(3, [1, 4, 30, 77], eng.vocab_size)
        ref = {k: greedy_alone(ort_engine, p, 8) for k, p in prompts.items()}
        for label, got in (("batched", greedy_batched(eng, prompts, 8)),
                           ("staggered", greedy_staggered(eng, prompts, 8))):
            outcome = compare(ref, got, label)
            assert outcome.ok and outcome.exact == len(prompts), str(outcome)
        assert trt.calls["execute-0"] > 0 and trt.calls["execute-1"] > 0   # prefill and decode contexts
    finally:
        eng.close()
    plan = next((model_copy.path / "plans").glob("*.plan"))
    plan.write_bytes(b"corrupt")
    with pytest.raises(FatalError, match="does not deserialize"):
        TensorRTEngine(model_copy, mem=mem, build_if_missing=False)
    TensorRTEngine(model_copy, mem=mem).close()                  # rebuilt
    assert trt.calls["build"] == 2 and plan.read_bytes().startswith(b"FAKEPLAN")
