"""Real decoder architectures, exact against transformers (README: "Engines").

The fixtures under tests/fixtures/archs/ are tiny random-weight models of several
architectures, exported with Optimum and committed with transformers' own greedy
tokens for fixed prompts (made by ``scripts/make_arch_fixtures.py``, run by hand in a
venv with torch and Optimum; nothing here needs torch). Each is imported with
``streamfleet engines import`` and must give exactly the reference tokens on ONNX
Runtime: alone, all prompts batched, and with staggered joins, leaves and skipped steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from streamfleet.devkit.greedy import greedy_alone, greedy_scenario
from streamfleet.gateway.admission.chat_template import encode_prompt
from streamfleet.modelimport import import_export
from streamfleet.shared.modelrepo import ModelRepository, load_tokenizer
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "archs"
ARCHS = sorted(p.parent.name for p in FIXTURES.glob("*/reference.json")) if FIXTURES.is_dir() else []


def reference(arch: str) -> dict:
    return json.loads((FIXTURES / arch / "reference.json").read_text())


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Every fixture imported into one temporary model repository."""
    root = tmp_path_factory.mktemp("engines")
    found = {}
    for arch in ARCHS:
        _dest, info = import_export(FIXTURES / arch, root, arch, max_batch=8)
        found[arch] = info
    return ModelRepository(root), found


def _engine(imported, arch: str) -> OnnxRuntimeEngine:
    repo, _ = imported
    return OnnxRuntimeEngine(repo.get(arch), threads=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_import_reads_the_model_folder(imported, arch):
    repo, found = imported
    ref = reference(arch)
    info, spec = found[arch], repo.get(arch)
    assert (info.n_layer, info.kv_heads, info.head_dim) == (ref["n_layer"], ref["kv_heads"], ref["head_dim"])
    assert info.has_position_ids == ref["has_position_ids"]
    assert info.merged == ("use_cache_branch" in ref["inputs"])
    # every EOS the model declares stops it, from the folder (engine.toml names none)
    assert set(ref["eos_token_ids"]) <= set(spec.eos_token_ids) and spec.eos_from
    # prompts are encoded as transformers encodes them: with the tokenizer's BOS where it adds one
    tok = load_tokenizer(spec)
    for case in ref["cases"]:
        assert encode_prompt(tok, case["prompt_text"]) == case["prompt_ids"], case["prompt_text"]


@pytest.mark.parametrize("arch", ARCHS)
def test_alone_exact(imported, arch):
    engine = _engine(imported, arch)
    for i, case in enumerate(reference(arch)["cases"]):
        want = case["greedy_ids"]
        tokens, _ = greedy_alone(engine, case["prompt_ids"], len(want) - 1, seq_id=f"s{i}")
        assert tokens == want, (arch, case["prompt_text"])
    engine.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_exact(imported, arch):
    """All prompts start in one prefill and decode together, different lengths side by side."""
    engine = _engine(imported, arch)
    cases = reference(arch)["cases"]
    steps = len(cases[0]["greedy_ids"])
    got = {}
    for i, row in enumerate(engine.prefill([(f"s{i}", c["prompt_ids"]) for i, c in enumerate(cases)])):
        got[f"s{i}"] = [int(row.argmax())]
    for _ in range(steps - 1):
        batch = [(k, v[-1]) for k, v in got.items()]
        for (k, _), row in zip(batch, engine.decode(batch)):
            got[k].append(int(row.argmax()))
    for i, case in enumerate(cases):
        assert got[f"s{i}"] == case["greedy_ids"], (arch, case["prompt_text"])
    engine.close()


PLAN = dict(joins={0: "ab", 2: "c", 5: "de", 7: "fg"}, leaves={}, paused={4: "a", 9: "cd", 10: "c"})


@pytest.mark.parametrize("arch", ARCHS)
def test_staggered_joins_and_skipped_steps_exact(imported, arch):
    """Newcomers join a running batch, some sequences sit steps out: each still gets
    exactly transformers' tokens."""
    engine = _engine(imported, arch)
    cases = reference(arch)["cases"]
    names = "abcdefg"[: len(cases)]
    prompts = {k: c["prompt_ids"] for k, c in zip(names, cases)}
    steps = len(cases[0]["greedy_ids"]) - 1
    got, _rows = greedy_scenario(engine, prompts, PLAN, steps, steps + 16)
    for k, case in zip(names, cases):
        assert got[k] == case["greedy_ids"], (arch, k, case["prompt_text"])
    engine.close()


def test_fixtures_cover_the_architectures():
    """The architectures the README lists as exact, plus a merged decoder and graphs
    without position_ids."""
    assert {"gpt2", "llama", "qwen2", "mistral", "phi3", "qwen3", "gemma", "gemma3"} <= set(ARCHS)
    assert any("use_cache_branch" in reference(a)["inputs"] for a in ARCHS)
    assert any(not reference(a)["has_position_ids"] for a in ARCHS)
    assert all(np.unique(np.concatenate([c["greedy_ids"] for c in reference(a)["cases"]])).size > 8
               for a in ARCHS), "a fixture whose outputs barely vary tests little"


def test_a_chat_template_needs_its_special_tokens(imported):
    """A template that spells out a special token the tokenizer does not have as one
    token would feed the model a conversation split into pieces: named and refused."""
    from streamfleet.gateway.admission.chat_template import template_problem

    repo, _ = imported
    tok = load_tokenizer(repo.get("llama"))
    original = tok.chat_template
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    assert template_problem(tok) is None
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    assert "<|im_start|>, <|im_end|>" in template_problem(tok)
    tok.chat_template = original
