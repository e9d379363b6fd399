"""The GGUF import's tokenizers (docs/models.md, "Tokenizers"), against the ids recorded in
tests/fixtures/gguf/tokenizers/reference.json by scripts/make_gguf_tokenizer_fixtures.py:
transformers' tokenizer loaded from the same GGUF (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``) and llama.cpp's own (``llama-tokenize``), on 320 texts (prose, other
scripts, CJK, emoji, code, whitespace runs, leading spaces, numbers, special tokens).

Where the two references disagree the import follows llama.cpp, which splits as the
model's own tokenizer does: transformers' GGUF loader ignores the ``smollm`` digit split
and SentencePiece's space prefix before text that starts with a space or follows a
special token (and ``add_space_prefix = false``). The tests check that those are the only
disagreements. Neither torch nor transformers' GGUF reader is needed.
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from streamfleet.shared.errors import FatalError
from streamfleet.shared.ggufimport import GgufTokenizer, build_tokenizer_json, read_gguf_tokenizer, write_tokenizer_only

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf" / "tokenizers"
REF = json.loads((FIXTURES / "reference.json").read_text(encoding="utf-8"))
TEXTS: list[str] = REF["texts"]
TABLES: dict[str, list[list[int]]] = REF["tables"]

#: the references each file's ids must equal on every text
HELD_TO = {
    "bpe-default.gguf": ("transformers",),  # llama.cpp's "default" split differs (docs/models.md)
    "bpe-gpt2.gguf": ("transformers",),  # llama.cpp knows the name as "gpt-2" only
    "bpe-gpt-2.gguf": ("transformers", "llamacpp"),
    "bpe-llama-bpe.gguf": ("transformers", "llamacpp"),
    "bpe-llama3.gguf": ("transformers", "llamacpp"),
    "bpe-qwen2.gguf": ("transformers", "llamacpp"),
    "bpe-deepseek-r1-qwen.gguf": ("transformers", "llamacpp"),
    "bpe-smollm.gguf": ("llamacpp",),
    "spm.gguf": ("llamacpp",),
    "spm-no-prefix.gguf": ("llamacpp",),
    # transformers' loader prepends the space to a phi3 file's text as llama.cpp does
    "spm-phi3.gguf": ("transformers", "llamacpp"),
}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>")


@functools.cache
def _read(name: str) -> GgufTokenizer:
    return read_gguf_tokenizer(FIXTURES / name)


def _fields(name: str) -> GgufTokenizer:
    """A fixture file's tokenizer fields, read once for the module's tests (each file is
    read and checked all the same): a copy, which a test may change."""
    return copy.copy(_read(name))


@functools.cache
def _tokenizer_json(name: str) -> str:
    return json.dumps(build_tokenizer_json(_read(name)))


def _tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_str(_tokenizer_json(name))


def test_every_fixture_is_checked():
    assert sorted(REF["tokenizers"]) == sorted(HELD_TO)
    assert len(TEXTS) >= 300


@pytest.mark.parametrize("name", sorted(HELD_TO))
def test_ids_equal_the_references(name):
    tok = _tokenizer(name)
    entry = REF["tokenizers"][name]
    ours = [e.ids for e in tok.encode_batch(TEXTS, add_special_tokens=False)]
    for ref in HELD_TO[name]:
        want = TABLES[entry[ref]]
        bad = [i for i, (a, b) in enumerate(zip(ours, want)) if a != b]
        assert not bad, f"{name} vs {ref}: {[(TEXTS[i], ours[i], want[i]) for i in bad[:3]]}"


@pytest.mark.parametrize("name", ["bpe-smollm.gguf", "spm.gguf"])
def test_transformers_differs_only_where_it_ignores_the_files_split(name):
    tok = _tokenizer(name)
    entry = REF["tokenizers"][name]
    ours = [e.ids for e in tok.encode_batch(TEXTS, add_special_tokens=False)]
    bad = [i for i, (a, b) in enumerate(zip(ours, TABLES[entry["transformers"]])) if a != b]
    assert bad  # the fixtures do show the difference
    for i in bad:
        text = TEXTS[i]
        if name == "bpe-smollm.gguf":  # transformers does not split the digits one by one
            assert any(c.isdigit() for c in text), text
        else:  # transformers' Metaspace adds no "▁" before a space or after a special token
            assert text[:1] in (" ", "\u2581") or any(s in text for s in SPECIALS), text


@pytest.mark.parametrize("name", sorted(HELD_TO))
def test_bos_and_decoding(name):
    m = _fields(name)
    tok = _tokenizer(name)
    entry = REF["tokenizers"][name]
    plain = TABLES[entry[HELD_TO[name][-1]]]
    with_bos = [e.ids for e in tok.encode_batch(TEXTS, add_special_tokens=True)]
    assert with_bos == [([m.bos_id] if m.add_bos else []) + ids for ids in plain]
    if "transformers" in HELD_TO[name]:
        assert with_bos == TABLES[entry["transformers_special"]]
    for text, ids in zip(TEXTS, plain):
        # (a SentencePiece vocabulary spells a space "▁": a "▁" in the text decodes as a space)
        if not any(s in text for s in SPECIALS) and not (m.tokenizer_model == "llama" and "\u2581" in text):
            assert tok.decode(ids, skip_special_tokens=False) == text


def test_the_sentencepiece_file_is_read_as_sentencepiece():
    m = _fields("spm.gguf")
    assert m.tokenizer_model == "llama" and m.add_bos and m.add_space_prefix
    assert not _fields("spm-no-prefix.gguf").add_space_prefix
    tok = _tokenizer("spm.gguf")
    # bytes outside the vocabulary fall back to <0xNN> tokens
    ids = tok.encode("😀", add_special_tokens=False).ids
    assert [m.tokens[i] for i in ids][-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]


@pytest.mark.parametrize("name", sorted(HELD_TO))
def test_the_chat_template_comes_from_the_file(tmp_path, name):
    from streamfleet.shared.modelrepo import _load_tokenizer_cached

    m = _fields(name)
    write_tokenizer_only(m, tmp_path, max_context=64)
    tok = _load_tokenizer_cached(str(tmp_path / "tokenizer.json"))
    # as the fleet loads it: BOS once where the file says so
    plain = tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == ([m.bos_id] if m.add_bos else []) + plain
    for chat in REF["tokenizers"][name]["chat"]:
        text = tok.apply_chat_template(chat["messages"], tokenize=False, add_generation_prompt=True)
        assert text == chat["text"]
        want = chat["llamacpp_ids"] if "llamacpp" in HELD_TO[name] else chat["ids"]
        assert tok.encode(text, add_special_tokens=False) == want
        if "transformers" in HELD_TO[name]:
            assert tok.encode(text, add_special_tokens=False) == chat["ids"]


def _rewrite(src: Path, dest: Path, arch_from: Path | None = None, **changes) -> Path:
    """``src`` with its tokenizer.ggml.* keys changed (None: removed), no tensors; with
    ``arch_from``, that file's architecture and other keys around ``src``'s tokenizer."""
    import gguf

    fields = list(gguf.GGUFReader(str(src)).fields.values())
    arch = "llama"
    if arch_from is not None:
        other = gguf.GGUFReader(str(arch_from))
        arch = str(other.fields["general.architecture"].contents())
        fields = [f for f in fields if f.name.startswith("tokenizer.")]
        fields += [f for f in other.fields.values() if not f.name.startswith("tokenizer.")]
    w = gguf.GGUFWriter(str(dest), arch)
    for f in fields:
        key = f.name
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        short = key.removeprefix("tokenizer.ggml.")
        value = f.contents()
        if short in changes:
            value = changes.pop(short)
            if value is None:
                continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for short, value in changes.items():
        w.add_string(f"tokenizer.ggml.{short}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


@pytest.mark.parametrize("src, changes, expect", [
    ("bpe-qwen2.gguf", {"pre": "deepseek-llm"}, "pre-tokenizer 'deepseek-llm'"),
    ("bpe-qwen2.gguf", {"pre": "tekken"}, "pre-tokenizer 'tekken'"),
    ("bpe-qwen2.gguf", {"model": "bert"}, "tokenizer model 'bert' is not supported"),
    ("spm.gguf", {"model": "t5"}, "tokenizer model 't5' is not supported"),
    ("spm.gguf", {"scores": None}, "without tokenizer.ggml.scores"),
])
def test_a_tokenizer_the_import_does_not_build_is_refused_by_name(tmp_path, src, changes, expect):
    bad = _rewrite(FIXTURES / src, tmp_path / "x.gguf", **changes)
    with pytest.raises(FatalError, match=expect):
        read_gguf_tokenizer(bad)


def test_a_sentencepiece_vocabulary_in_a_gemma_file_is_refused(tmp_path):
    from streamfleet.shared.ggufimport import read_gguf

    arch_file = min((FIXTURES.parent / "gemma2").glob("*.gguf"))
    bad = _rewrite(FIXTURES / "spm.gguf", tmp_path / "g.gguf", arch_from=arch_file)
    with pytest.raises(FatalError, match=r"SentencePiece tokenizer .* in a gemma2 file is not supported"):
        read_gguf(bad)
    # the same keys around a SentencePiece vocabulary in a llama file pass the tokenizer checks
    # (and stop at the missing tensors)
    with pytest.raises(FatalError, match=r"tensor .* is missing"):
        read_gguf(_rewrite(FIXTURES / "spm.gguf", tmp_path / "l.gguf",
                           arch_from=min((FIXTURES.parent / "qwen2").glob("*.gguf"))))


def test_a_llama_file_with_a_sentencepiece_tokenizer_imports_and_says_so(tmp_path):
    """A whole model whose tokenizer is the SentencePiece fixture's: imported, its folder's
    tokenizer gives llama.cpp's ids with BOS, and the summary names the tokenizer."""
    import gguf
    import numpy as np

    from streamfleet.shared.ggufimport import import_gguf
    from streamfleet.shared.modelrepo import ModelRepository, load_tokenizer
    from tests.support.gguf_models import TinyLlama, write_tiny_gguf

    base = gguf.GGUFReader(str(write_tiny_gguf(tmp_path / "base.gguf", TinyLlama(seed=3, n_layer=1, qtype="F32",
                                                                                    head_qtype="F32"))))
    spm = gguf.GGUFReader(str(FIXTURES / "spm.gguf"))
    n_vocab = len(spm.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(tmp_path / "spm-model.gguf"), "llama")
    for f in [f for f in base.fields.values() if not f.name.startswith("tokenizer.")] + \
             [f for f in spm.fields.values() if f.name.startswith("tokenizer.")]:
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value = n_vocab if f.name == "llama.vocab_size" else f.contents()
        w.add_key_value(f.name, value, f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in base.tensors:
        data = np.asarray(t.data)
        if t.name == "token_embd.weight":
            data = np.random.default_rng(0).standard_normal((n_vocab, data.shape[1])).astype(np.float32)
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    _, description = import_gguf(tmp_path / "spm-model.gguf", tmp_path / "engines", "spm", weights="fp32")
    assert "tokenizer     SentencePiece BPE, 1000 tokens" in description
    assert "a space before the text" in description and "added to every prompt" in description
    tok = load_tokenizer(ModelRepository(tmp_path / "engines").get("spm"))
    entry = REF["tokenizers"]["spm.gguf"]
    for text, ids in list(zip(TEXTS, TABLES[entry["llamacpp"]]))[::16]:
        assert tok.encode(text) == [1] + ids


@pytest.mark.parametrize("name", ["spm.gguf", "bpe-qwen2.gguf"])
def test_eos_is_added_when_the_file_says_so(tmp_path, name):
    from streamfleet.shared.modelrepo import _load_tokenizer_cached

    m = _fields(name)
    plain = _tokenizer(name).encode("Hello world", add_special_tokens=False).ids
    m.add_eos = True
    tok = Tokenizer.from_str(json.dumps(build_tokenizer_json(m)))
    assert tok.encode("Hello world").ids == ([m.bos_id] if m.add_bos else []) + plain + [m.eos_id]
    write_tokenizer_only(m, tmp_path, max_context=64)  # as the fleet loads it: each once
    assert _load_tokenizer_cached(str(tmp_path / "tokenizer.json")).encode("Hello world") == (
        [m.bos_id] if m.add_bos else []) + plain + [m.eos_id]
    m.add_bos = False
    tok = Tokenizer.from_str(json.dumps(build_tokenizer_json(m)))
    assert tok.encode("Hello world").ids == plain + [m.eos_id]


def _llamacpp_models() -> Path:
    from scripts.llama_server import DEFAULT_SOURCE_DIR, VERSION

    return DEFAULT_SOURCE_DIR / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp" / "models"


#: llama.cpp's own vocabulary test files (models/ggml-vocab-NAME.gguf with .inp texts and
#: .out ids) of real models' tokenizers
REAL_VOCABS = ["llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2", "mpt", "starcoder", "refact", "command-r"]


@pytest.mark.parametrize("name", REAL_VOCABS)
def test_real_vocabularies_equal_llama_cpps_own_vocabulary_tests(name):
    """Llama 2's, Phi-3's, Llama 3's, Qwen2's, GPT-2's, MPT's, StarCoder's, Refact's and Command-R's
    tokenizers against the ids llama.cpp's own tests expect (the llama-cpp-python source
    scripts/llama_server.py builds from; skipped where it is not unpacked)."""
    src = _llamacpp_models() / f"ggml-vocab-{name}.gguf"
    if not src.with_suffix(".gguf.out").exists():
        pytest.skip(f"{src} is not here (scripts/llama_server.py says how to unpack the source)")
    texts = src.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    want = [[int(x) for x in line.split()] for line in
            src.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")[:len(texts)]]
    tok = Tokenizer.from_str(json.dumps(build_tokenizer_json(read_gguf_tokenizer(src))))
    assert [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)] == want


def test_a_real_vocabulary_the_import_does_not_build_is_refused():
    src = _llamacpp_models() / "ggml-vocab-bert-bge.gguf"
    if not src.exists():
        pytest.skip(f"{src} is not here")
    with pytest.raises(FatalError, match="tokenizer model 'bert' is not supported"):
        read_gguf_tokenizer(src)
