"""Execution chosen by measurement (``weights = "auto"``, shared/execution.py) and the
quality figures it rests on (shared/quality.py), on a small random GGUF model: the
candidates' graphs, the gate, the choice per CPU and its record, pinning, and the graph a
worker then loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamfleet.shared import execution
from streamfleet.shared.errors import FatalError
from streamfleet.shared.ggufimport import AUTO_MODES, import_gguf, importer_digest
from streamfleet.shared.modelrepo import ModelRepository, auto_stamp, onnx_metadata
from streamfleet.shared.quality import chunk_windows, evaluate, log_softmax
from tests.support.gguf_models import TinyLlama, write_tiny_gguf


def _auto_folder(tmp_path: Path, *, max_kld: float | None = None, name: str = "tiny") -> object:
    src = write_tiny_gguf(tmp_path / f"{name}.gguf", TinyLlama(seed=5, n_layer=1))
    execution.import_auto(src, tmp_path / "engines", name, max_batch=8, max_kld=max_kld)
    return ModelRepository(tmp_path / "engines").get(name)


def _stamp(spec) -> str:
    stamp = auto_stamp(spec)
    assert stamp == importer_digest(onnx_metadata(spec.onnx_path)["streamfleet.gguf_sha256"], "auto")
    return stamp


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One auto folder with a generous KLD bound, measured on two 512-token chunks."""
    tmp = tmp_path_factory.mktemp("auto")
    spec = _auto_folder(tmp, max_kld=1.0)
    record = execution.measure(spec, _stamp(spec), threads=1, chunks=2)
    return spec, record


def test_an_auto_folder_holds_a_gqa_graph_for_every_candidate(measured, tmp_path):
    spec, _ = measured
    files = {p.name for p in spec.path.iterdir()}
    assert {"model.gqa.onnx", "model.gqa.onnx.data", "model.gqa.q4-int8act.onnx", "model.gqa.fp32.onnx",
            "model.gqa.fp32.onnx.data"} <= files
    assert "model.onnx" not in files  # GroupQueryAttention graphs only
    toml = (spec.path / "engine.toml").read_text()
    assert 'onnx = "model.gqa.onnx"' in toml and 'attention = "gqa"' in toml
    import onnx

    # q4-int8act: 8-bit activations in every 4-bit product; its first and last blocks are
    # fp32 matrices (one block here: both), the output layer 4-bit
    g = onnx.load(str(spec.path / "model.gqa.q4-int8act.onnx"), load_external_data=False)
    levels = {n.input[1]: a.i for n in g.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "accuracy_level"}
    assert levels and set(levels.values()) == {4} and all(w.startswith("output") for w in levels)
    # in a deeper model the middle blocks are 4-bit, and a pinned q4-int8act import builds the same
    src = write_tiny_gguf(tmp_path / "p.gguf", TinyLlama(seed=5, n_layer=3))
    import_gguf(src, tmp_path / "engines", "pinned", weights="q4-int8act", max_batch=8)
    pinned = onnx.load(str(tmp_path / "engines" / "pinned" / "model.onnx"), load_external_data=False)
    blocks = {n.input[1].split(".")[1] for n in pinned.graph.node if n.op_type == "MatMulNBits"
              and n.input[1].startswith("blk.")}
    assert blocks == {"1"}
    assert "max_kld = 1.0" in (spec.path / "engine.toml").read_text()


def test_the_record_holds_quality_times_and_the_fastest_passing_mode(measured):
    spec, record = measured
    q = record["quality"]["modes"]
    # chunks of the model's context (128 here; 512, llama-perplexity's, for a longer one), the
    # second half of each but its last token scored
    assert record["quality"]["n_ctx"] == 128 and record["quality"]["tokens"] == 2 * 63
    assert set(q) == set(AUTO_MODES)
    assert q["fp32"]["mean_kld"] == 0 and q["fp32"]["same_top1"] == 1.0
    assert q["q4"]["mean_kld"] < 1e-6  # the same weights, sums in another order
    assert q["q4-int8act"]["mean_kld"] > q["q4"]["mean_kld"]  # 8-bit activations round
    (entry,) = record["cpus"].values()
    assert set(entry["timings"]) == set(AUTO_MODES)
    passing = [m for m in AUTO_MODES if record["gate"]["verdicts"][m]["passes"]]

    def score(m):
        return entry["timings"][m]["step_ms_b1"] * entry["timings"][m]["step_ms_b16"]

    assert entry["chosen"] == min(passing, key=score)
    assert entry["cpu"] == execution.cpu_signature() and "fastest passing" in entry["why"]
    served = execution.served(spec)
    assert served.mode == entry["chosen"] and not served.pinned
    assert execution.graph_path(spec) == spec.path / execution.graph_file(entry["chosen"])
    assert json.loads((spec.path / "execution.json").read_text()) == record


def test_a_worker_loads_the_chosen_graph(measured):
    spec, record = measured
    from streamfleet.shared.quality import SharedBufferRunner, open_graph
    from streamfleet.workers.engines import load_engine

    engine = load_engine(spec, threads=1)
    (entry,) = record["cpus"].values()
    assert engine.graph_path == spec.path / execution.graph_file(entry["chosen"])
    prompt = [5, 77, 140, 33]
    got = engine.prefill([("a", prompt)])[0]
    runner = SharedBufferRunner(open_graph(engine.graph_path, 1), 1, 8)
    np.testing.assert_array_equal(got, runner.run(np.array([prompt]), np.array([4]))[0, -1])
    # the concat engine cannot serve these graphs: refused by name
    with pytest.raises(FatalError, match='weights = "auto" serves GroupQueryAttention graphs'):
        load_engine(ModelRepository(spec.path.parent).get(spec.name).__class__(
            **{**{f: getattr(spec, f) for f in spec.__dataclass_fields__},
               "options": {**spec.options, "attention": "concat"}}))


def test_another_cpu_is_timed_again_and_the_quality_is_kept(measured, tmp_path):
    spec, record = measured
    other = json.loads(json.dumps(record))
    (key,) = other["cpus"]
    entry = other["cpus"].pop(key)
    other["cpus"]["Some Other CPU | avx avx2 fma | 64 cores"] = entry  # measured elsewhere
    (spec.path / "execution.json").write_text(json.dumps(other))
    try:
        assert execution.served(spec) is None and execution.needs_measuring(spec, _stamp(spec))
        with pytest.raises(FatalError, match="no mode was chosen for this CPU"):
            execution.graph_path(spec)
        again = execution.measure(spec, _stamp(spec), threads=1)
        assert again["quality"] == record["quality"]  # not measured again
        assert len(again["cpus"]) == 2 and key in again["cpus"]
        assert not execution.needs_measuring(spec, _stamp(spec))
    finally:
        (spec.path / "execution.json").write_text(json.dumps(record))


def test_without_max_kld_only_the_modes_exact_in_the_weights_are_candidates(tmp_path):
    spec = _auto_folder(tmp_path)
    record = execution.measure(spec, _stamp(spec), threads=1, chunks=1)
    v = record["gate"]["verdicts"]
    assert v["q4"]["passes"] and v["fp32"]["passes"]
    assert not v["q4-int8act"]["passes"] and "max_kld is not set" in v["q4-int8act"]["why"]
    assert next(iter(record["cpus"].values()))["chosen"] in ("q4", "fp32")


def test_a_tight_gate_refuses_a_lossy_mode_by_its_figures(tmp_path):
    spec = _auto_folder(tmp_path, max_kld=1e-9)
    record = execution.measure(spec, _stamp(spec), threads=1, chunks=1)
    why = record["gate"]["verdicts"]["q4-int8act"]["why"]
    assert not record["gate"]["verdicts"]["q4-int8act"]["passes"] and why.startswith("mean KLD")


def test_a_pinned_mode_is_served_without_measuring(tmp_path):
    src = write_tiny_gguf(tmp_path / "t.gguf", TinyLlama(seed=5, n_layer=1))
    import_gguf(src, tmp_path / "engines", "pinned", weights="q4-int8act", max_batch=8)
    spec = ModelRepository(tmp_path / "engines").get("pinned")
    served = execution.served(spec)
    assert served.mode == "q4-int8act" and served.pinned and "pinned" in served.why
    assert execution.graph_path(spec) == spec.onnx_path and not (spec.path / "execution.json").exists()


@pytest.mark.parametrize("table, match", [("max_kld = -1", "max_kld must be a positive number"),
                                          ("max_ppl_ratio = \"x\"", "max_ppl_ratio must be a positive number")])
def test_a_bad_gate_is_refused_by_name(tmp_path, table, match):
    spec = _auto_folder(tmp_path)
    toml = spec.path / "engine.toml"
    text = toml.read_text().replace("max_ppl_ratio = 1.01", table)
    toml.write_text(text)
    with pytest.raises(FatalError, match=match):
        execution.gate(ModelRepository(tmp_path / "engines").get("tiny"))


def test_quality_figures_on_known_logits():
    lp = log_softmax(np.array([[0.0, 0.0], [np.log(3.0), 0.0]], dtype=np.float32))
    np.testing.assert_allclose(np.exp(lp), [[0.5, 0.5], [0.75, 0.25]], rtol=1e-7)
    assert chunk_windows(1100, 512) == [(0, 512), (512, 1024)] and chunk_windows(1100, 512, 1) == [(0, 512)]


def test_identical_graphs_have_no_divergence(measured):
    spec, _ = measured
    from tokenizers import Tokenizer

    from streamfleet.shared.quality import QUALITY_TEXT

    ids = Tokenizer.from_file(str(spec.tokenizer_path)).encode(QUALITY_TEXT.read_text()).ids
    got = evaluate({"a": spec.path / "model.gqa.fp32.onnx", "b": spec.path / "model.gqa.fp32.onnx"}, "a", ids,
                   n_ctx=128, chunks=1, threads=1)
    assert got["b"].mean_kld == 0 and got["b"].top1 == 1.0 and got["b"].ppl == got["a"].ppl
    # 63 tokens scored a chunk of 128 (a random model: its perplexity is only finite)
    assert got["a"].tokens == 63 and 1 < got["a"].ppl < float("inf")


def test_engines_quality_refuses_a_pinned_model(tmp_path):
    src = write_tiny_gguf(tmp_path / "t.gguf", TinyLlama(seed=5, n_layer=1))
    import_gguf(src, tmp_path / "engines", "pinned", weights="q4", max_batch=8)
    run = subprocess.run([sys.executable, "-m", "streamfleet", "engines", "quality", "pinned", "--engines-dir",
                          str(tmp_path / "engines")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "one mode pinned" in run.stderr


def test_a_worker_measures_in_a_process_of_its_own_and_says_why_it_failed(tmp_path):
    """``ensure_artifacts`` measures an auto folder in a child process (shared/measuring.py:
    what measuring held is given back), and a failure there is this process's error, by name."""
    from streamfleet.shared.modelrepo import ensure_artifacts

    spec = _auto_folder(tmp_path, max_kld=1.0)
    (spec.path / "model.gqa.fp32.onnx").unlink()
    with pytest.raises(FatalError, match=r'measuring the execution modes of tiny failed: .*graphs of weights = "auto" '
                                         'are missing'):
        ensure_artifacts(spec)
    assert not (spec.path / "execution.json").exists()
