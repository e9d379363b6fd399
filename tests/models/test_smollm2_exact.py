"""The default model answers as its weights do: SmolLM2-135M-Instruct imported from its
GGUF file gives transformers' own greedy tokens (torch, fp32, the same file; committed in
tests/fixtures/smollm2/reference.json by scripts/make_smollm2_reference.py) for 10
prompts of 64 tokens, alone and batched with staggered joins, with 4-bit weights (the
default) and with fp32 weights; its tokenizer and chat template give the reference's
prompt ids. Skipped where the GGUF file is not in the cache (`streamfleet serve` fetches
it); the suite never downloads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamfleet.devkit.greedy import greedy_alone, greedy_staggered
from streamfleet.shared.ggufimport import import_gguf
from streamfleet.shared.modelrepo import REPO_ROOT, ModelRepository, load_tokenizer
from streamfleet.shared.packagefetch import PackageFile, cached_path
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

REFERENCE = json.loads((Path(__file__).parent.parent / "fixtures" / "smollm2" / "reference.json").read_text())
SPEC = ModelRepository(REPO_ROOT / "engines").get("smollm2-135m")
GGUF = cached_path(PackageFile.from_table(SPEC.source, "engine.toml"))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF} is not cached (streamfleet serve fetches it)")]

PROMPTS = {c["name"]: c["prompt_ids"] for c in REFERENCE["cases"]}
WANT = {c["name"]: c["greedy_ids"] for c in REFERENCE["cases"]}


@pytest.fixture(scope="module", params=["q4", "fp32"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2")
    import_gguf(GGUF, root, request.param, weights=request.param, max_batch=16)
    eng = OnnxRuntimeEngine(ModelRepository(root).get(request.param), threads=2)
    yield eng
    eng.close()


def test_greedy_tokens_equal_transformers_alone(engine):
    steps = REFERENCE["steps"] - 1
    got = {k: greedy_alone(engine, p, steps, seq_id=k)[0] for k, p in PROMPTS.items()}
    assert got == WANT


def test_greedy_tokens_equal_transformers_batched_with_staggered_joins(engine):
    got = greedy_staggered(engine, PROMPTS, REFERENCE["steps"] - 1)
    for name, tokens in got.items():
        assert len(tokens) >= 32 and tokens == WANT[name][:len(tokens)], name


def test_the_tokenizer_and_chat_template_give_the_reference_prompt_ids(tmp_path):
    import_gguf(GGUF, tmp_path, "tok", weights="q4")
    tok = load_tokenizer(ModelRepository(tmp_path).get("tok"))
    for case in REFERENCE["cases"]:
        if case["kind"] == "chat":
            text = tok.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=True)
            assert tok.encode(text, add_special_tokens=False) == case["prompt_ids"], case["name"]
        elif case["prompt_ids"][0] != REFERENCE["bos_token_id"]:
            # the file says add_bos_token false; transformers' GGUF tokenizer adds one anyway
            # (the reference's other plain cases), which llama.cpp and this import do not
            assert tok.encode(case["prompt_text"]) == case["prompt_ids"], case["name"]
    for case in REFERENCE["tokenizer_cases"]:
        got = tok.encode(case["text"], add_special_tokens=False)
        if any(a.isspace() and b.isdigit() for a, b in zip(case["text"], case["text"][1:])):
            # transformers ignores tokenizer.ggml.pre "smollm" (digits split first, as the
            # model's own tokenizer and llama.cpp do): spaces before a digit tokenize apart
            continue
        assert got == case["ids"], case["text"]
    assert tok.encode("x  1", add_special_tokens=False) == [104, 256, 33]
