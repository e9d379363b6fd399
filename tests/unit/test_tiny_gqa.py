"""The generator's GroupQueryAttention layout (shared/tinymodel.py, ``attention = "gqa"``):
the same weights as the with-past graph, the same logits, served by the onnx_gqa engine,
where batch invariance costs no extra run (docs/sampling.md, "What a seed guarantees")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts
from streamfleet.shared.tinymodel import PRESETS, BuildParams, params_from_model_dir, write_model
from streamfleet.workers.engines import load_engine
from streamfleet.workers.engines.onnx_gqa import OnnxGqaEngine
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine
from tests.support.invariance import forced_alone, forced_staggered

SMALL = BuildParams(seed=7, vocab_size=400, n_layer=2, n_head=2, d_model=32, max_context=160, max_batch=16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """One model in both layouts, each a folder with its engine.toml."""
    root = tmp_path_factory.mktemp("tiny-gqa")
    for name, attention in (("concat", "concat"), ("gqa", "gqa")):
        write_model(root / name, dataclasses.replace(SMALL, attention=attention), toml=True)
    return root


def test_the_gqa_folder_names_its_layout_and_round_trips(folders):
    text = (folders / "gqa" / "engine.toml").read_text()
    assert 'onnx = "model.gqa.onnx"' in text and 'attention = "gqa"' in text
    assert (folders / "gqa" / "model.gqa.onnx").is_file() and not (folders / "gqa" / "model.onnx").exists()
    params, graph, _ = params_from_model_dir(folders / "gqa")
    assert params == dataclasses.replace(SMALL, attention="gqa") and graph == "model.gqa.onnx"
    assert "attention" not in (folders / "concat" / "engine.toml").read_text()
    assert PRESETS["bench"].attention == "gqa"  # the CPU benchmark model (docs/models.md)


def test_an_unknown_layout_is_refused_by_name():
    with pytest.raises(SystemExit, match="attention must be one of concat, gqa, not 'mha'"):
        dataclasses.replace(SMALL, attention="mha").check()


def test_the_engine_factory_serves_it_on_the_gqa_engine(folders):
    repo = ModelRepository(folders)
    engine = load_engine(repo.get("gqa"), threads=1)
    try:
        assert isinstance(engine, OnnxGqaEngine)
        assert engine.rows_probe == "independent" and engine.batch_invariant and engine.min_rows == 1
        # one position of the table is kept for an idle row's scratch slot
        assert engine.max_context == SMALL.max_context - 1
    finally:
        engine.close()


def test_same_logits_as_the_with_past_layout(folders):
    """Prompts of several lengths, then 40 greedy steps: both graphs pick the same tokens
    and their logits agree to float32 rounding (the op sums in another order)."""
    repo = ModelRepository(folders)
    gqa = OnnxGqaEngine(repo.get("gqa"), threads=1)
    ref = OnnxRuntimeEngine(repo.get("concat"), threads=1)
    rng = np.random.default_rng(3)
    prompts = [(f"s{n}", [int(t) for t in rng.integers(1, SMALL.vocab_size, n)]) for n in (1, 4, 17, 60)]
    got, want = gqa.prefill(prompts), ref.prefill(prompts)
    worst = float(np.abs(got - want).max())
    for _ in range(40):
        assert (got.argmax(axis=1) == want.argmax(axis=1)).all()
        feed = [(sid, int(t)) for (sid, _), t in zip(prompts, want.argmax(axis=1))]
        got, want = gqa.decode(feed), ref.decode(feed)
        worst = max(worst, float(np.abs(got - want).max()))
    assert worst < 1e-4, worst
    gqa.close()
    ref.close()


def test_alone_and_batched_bit_for_bit(folders):
    """Teacher-forced sequences joining a few at a time, leaving and sitting steps out:
    every row's logits equal its logits alone, bit for bit."""
    engine = OnnxGqaEngine(ModelRepository(folders).get("gqa"), threads=1)
    rng = np.random.default_rng(5)
    prompts = {f"s{i}": [int(t) for t in rng.integers(1, SMALL.vocab_size, n)]
               for i, n in enumerate([1, 2, 5, 5, 13, 31, 40, 64, 65, 90])}
    tokens = {k: [int(t) for t in rng.integers(1, SMALL.vocab_size, int(rng.integers(10, 60)))] for k in prompts}
    alone = {k: forced_alone(engine, k, prompts[k], tokens[k]) for k in prompts}
    batched = forced_staggered(engine, prompts, tokens, seed=0)
    for k in prompts:
        same = (batched[k] == alone[k]).all(axis=1)
        assert same.all(), (k, np.flatnonzero(~same).tolist())
    engine.close()


def test_a_missing_graph_is_regenerated_from_build(folders, tmp_path):
    folder = tmp_path / "gqa"
    folder.mkdir()
    (folder / "engine.toml").write_text((folders / "gqa" / "engine.toml").read_text())
    spec = ModelRepository(tmp_path).get("gqa")
    ensure_artifacts(spec)
    assert (folder / "model.gqa.onnx").read_bytes() == (folders / "gqa" / "model.gqa.onnx").read_bytes()
