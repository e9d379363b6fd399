"""The GGUF import against transformers on files llama.cpp's own tools made (issue 50,
item 4; docs/models.md, "Architectures"): for each architecture a tiny random model made
with transformers, converted by llama.cpp's ``convert_hf_to_gguf.py`` and requantized by
its ``llama-quantize`` to Q8_0 and Q4_K_M, with transformers' greedy tokens on the same
files (``tests/fixtures/gguf/<arch>/``, made by scripts/make_gguf_arch_fixtures.py). The
imported graphs, both layouts, in the exact weights modes, give the same greedy tokens,
each prompt alone and all of them batched. Needs neither torch nor llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamfleet.shared.gguf_gqa import write_gqa_graph
from streamfleet.shared.ggufimport import import_gguf, read_gguf
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.workers.engines.onnx_gqa import OnnxGqaEngine
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "gguf"
CASES = [(arch.name, name) for arch in sorted(FIXTURES.iterdir()) if arch.is_dir()
         for name in sorted(json.loads((arch / "reference.json").read_text())["files"])]


def _greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` argmax tokens for every prompt, all of them in one batch."""
    import numpy as np

    out: list[list[int]] = [[] for _ in prompts]
    logits = engine.prefill([(f"s{i}", list(p)) for i, p in enumerate(prompts)])
    for step in range(n):
        feed = []
        for r in range(len(prompts)):
            out[r].append(int(np.argmax(logits[r])))
            feed.append((f"s{r}", out[r][-1]))
        if step < n - 1:
            logits = engine.decode(feed)
    for r in range(len(prompts)):
        engine.release(f"s{r}")
    return out


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{f}" for a, f in CASES])
def folder(request, tmp_path_factory):
    arch, name = request.param
    src = FIXTURES / arch / name
    root = tmp_path_factory.mktemp(f"{arch}-{name}")
    ref = json.loads((FIXTURES / arch / "reference.json").read_text())["files"][name]
    return src, root, ref, arch


@pytest.mark.parametrize("weights", ["fp32", "q4"])
@pytest.mark.parametrize("layout", ["concat", "gqa"])
def test_greedy_tokens_equal_transformers_on_the_same_file(folder, weights, layout):
    src, root, ref, arch = folder
    m = read_gguf(src)
    assert m.architecture == arch
    name = f"{weights}-{layout}"
    dest, _ = import_gguf(src, root, name, weights=weights, max_batch=8)
    spec = ModelRepository(root).get(name)
    if layout == "gqa":
        write_gqa_graph(m, dest, weights=weights, max_context=spec.max_context)
        engine = OnnxGqaEngine(spec, threads=1)
    else:
        engine = OnnxRuntimeEngine(spec, threads=1)
    prompts = [c["prompt_ids"] for c in ref]
    want = [c["greedy_ids"] for c in ref]
    n = len(want[0])
    assert _greedy(engine, prompts, n) == want  # batched
    for p, w in zip(prompts, want):  # alone
        assert _greedy(engine, [p], n) == [w]
    if layout == "gqa":
        engine.close()
