"""Make tests/fixtures/gguf/tokenizers/: small GGUF files that carry a tokenizer (no tensors)
of each kind the GGUF import builds, and the token ids transformers' own GGUF loader gives
for a few hundred texts, so that tests/unit/test_gguf_tokenizers.py needs neither torch
nor transformers' GGUF reader.

Run it with a venv that has transformers, tokenizers, sentencepiece and gguf (not the
project's): ``/tmp/tvenv/bin/python scripts/make_gguf_tokenizer_fixtures.py``.

The vocabularies are trained here on shared/corpus/alice.txt (public domain) plus a few
lines of other scripts, so they are realistic in shape (merges, scores, byte tokens) but
small:

* ``bpe-<pre>.gguf``: a byte-level BPE (``tokenizer.ggml.model = gpt2``, 1200 tokens with
  merges, control tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and a
  user-defined ``<think>``), written once per pre-tokenizer name (``tokenizer.ggml.pre``);
* ``spm.gguf`` (and ``spm-no-prefix.gguf``, the same without ``add_space_prefix``, and
  ``spm-phi3.gguf``, the same in a phi3 file): a SentencePiece BPE (``tokenizer.ggml.model =
  llama``: scores, token types, ``<0xNN>`` byte-fallback tokens, ``▁`` for spaces, a dummy prefix), trained the way
  Llama's was (identity normalization, digits split, byte fallback, whitespace pieces).

``reference.json`` holds, per file (under ``tokenizers``), transformers' ids of every text (without and with the
special tokens), where its decoding differs from the text, and the chat template's output
and ids; for ``spm.gguf`` also the texts where sentencepiece itself gives other ids. With
``--llama-tokenize BIN`` (llama.cpp's ``llama-tokenize``, built from the llama-cpp-python
source as scripts/llama_server.py builds llama-server) it also holds llama.cpp's ids of each
text (no BOS, special tokens parsed) for the files llama.cpp loads. Id lists are stored once
under their digest (``tables``), the files name them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "gguf" / "tokenizers"
ALICE = ROOT / "shared" / "corpus" / "alice.txt"

#: pre-tokenizer names the byte-level BPE is written with
BPE_PRES = ["default", "gpt2", "gpt-2", "llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen", "smollm"]

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA2 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
          "message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
          "{% endfor %}")

OTHER_SCRIPTS = [
    "Le cœur a ses raisons que la raison ne connaît point. Über den Wolken; señor, año, naïve café.",
    "Привет, как дела? Всё хорошо. Ελληνικά γράμματα. עברית. العربية جميلة.",
    "我们今天去公园散步，天气很好。日本語のテキストも少し。한국어 문장입니다。",
    "def main(argv):\n    for i in range(10):\n        print(f\"{i:>3} -> {i * i}\")\n    return 0\n",
    "if (x != y && z >= 10) { return a[i] + b->c; } // comment\n\tint n = 0x1F;",
    "Numbers: 1 12 123 1234 12345 3.14159 1,000,000 2026-12-07 +44 (0)20 7946 0958",
    "emoji 😀 🎉 👍🏽 🇬🇧 ❤️ and symbols © ® ™ € £ ¥ → ← ∑ ∞ ≠",
]


def texts() -> list[str]:
    """The texts the fixtures are checked on: lines of the corpus, crafted edge cases and
    seeded random mixes of them (unicode, CJK, emoji, code, whitespace runs, numbers)."""
    lines = [ln.strip() for ln in ALICE.read_text(encoding="utf-8").splitlines() if ln.strip()]
    out = lines[:: max(1, len(lines) // 120)][:120]
    out += OTHER_SCRIPTS
    out += [
        "", " ", "  ", "   leading spaces", "trailing spaces   ", "\n", "\n\n\nthree newlines", "a\r\nb\r\n",
        "\ttab\tseparated\tvalues", "multiple     spaces    between   words", " Hello", "  Hello", "Hello world",
        "I'm sure you've seen it, we'll go, they'd say, it's DON'T WON'T I'LL", "'s 're 've",
        "1234567890", "0.000001", "x = 1_000_000", "v1.2.3-rc4", "A1B2C3", "٣٤٥ ٦٧", "１２３ full-width",
        "<|im_start|>user\nhi<|im_end|>", "<think>reasoning</think> answer", "<|endoftext|><|endoftext|>",
        "hello<|im_end|>world", "ﬁ ligature and Å vs Å (composed / decomposed)", "e\u0301 combining accent",
        "zero\u200bwidth joiner\u200d", "\u00a0non-breaking\u00a0space", "\u3000ideographic space",
        "mixed中文English混合123", "😀😀😀", "👨‍👩‍👧‍👦 family", "<0x41> literal byte token text",
        "▁ lower one eighth block",
        "    indented code\n        more indented\n", "x\n \n  \n   \ny", "end with newline\n", "   ", "\t\t\t",
        "ALL CAPS SENTENCE HERE", "snake_case_identifier camelCaseIdentifier kebab-case-id",
        "https://example.com/path?query=1&b=2#frag", "user@example.org", "$100.00 or €85,50", "50% off!!!",
        "...", "?!?!", "--flag=value -x", "((nested (parens)))", "[1, 2, 3]", "{\"key\": \"value\"}",
    ]
    rng = random.Random(50)
    pieces = [w for ln in lines[:80] for w in ln.split()] + ["中", "文", "字", "😀", "é", "ß", "ñ", "12", "345", "6789",
                                                            "\t", "\n", "", ",.;:", "'", '"', "{}"]
    seps = [" ", "  ", "\n", "\t", "", "   ", " \n "]
    while len(out) < 320:
        n = rng.randint(1, 12)
        out.append("".join(rng.choice(pieces) + rng.choice(seps) for _ in range(n)))
    return out


def train_bpe(work: Path) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE trained with GPT-2's split: (tokens, merges, token types)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ALICE.read_text(encoding="utf-8").splitlines() + OTHER_SCRIPTS * 3
    tok.train_from_iterator(corpus, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [3 if t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>") else 1 for t in tokens]
    # a user-defined token (an added, not special, token: llama.cpp's converter marks it 4)
    tokens.append("<think>")
    types.append(4)
    return tokens, merges, types


def train_spm(work: Path):
    """A SentencePiece BPE trained as Llama's was; returns the processor."""
    import sentencepiece as spm

    text = work / "corpus.txt"
    text.write_text(ALICE.read_text(encoding="utf-8") + "\n".join(OTHER_SCRIPTS * 3), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(work / "spm"), vocab_size=1000, model_type="bpe", byte_fallback=True,
        split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, add_dummy_prefix=True, character_coverage=0.9995,
        user_defined_symbols=["<think>"], control_symbols=["<|im_start|>", "<|im_end|>"], minloglevel=2,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, split_by_whitespace=True, max_sentence_length=100000)
    return spm.SentencePieceProcessor(model_file=str(work / "spm.model"))


def _writer(path: Path, arch: str = "llama"):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tokenizer fixture")
    return w


def write_bpe(path: Path, pre: str, tokens: list[str], merges: list[str], types: list[int]) -> None:
    w = _writer(path)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(pre in ("llama-bpe", "llama3"))
    w.add_chat_template(CHATML)
    _finish(w)


def write_spm(path: Path, sp, space_prefix: bool = True, arch: str = "llama") -> None:
    w = _writer(path, arch)
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                     else 6 if sp.is_byte(i) else 4 if tokens[-1] == "<think>" else 1)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(space_prefix)
    w.add_chat_template(LLAMA2)
    _finish(w)


def _finish(w) -> None:
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


MESSAGES = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42."},
     {"role": "user", "content": "  And with spaces\nand 中文 😀?"}],
]


def _table(tables: dict, ids: list[list[int]]) -> str:
    key = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]
    tables[key] = ids
    return key


def llamacpp_ids(binary: str, gguf: Path, all_texts: list[str]) -> list[list[int]] | None:
    """llama.cpp's ids of each text (None: llama.cpp does not load the file's tokenizer)."""
    out = []
    for t in all_texts:
        run = subprocess.run([binary, "-m", str(gguf), "--stdin", "--ids", "--no-bos", "--log-disable"],
                             input=t.encode(), capture_output=True, timeout=60)
        if run.returncode != 0:
            return None
        out.append(json.loads(run.stdout.decode().strip().splitlines()[-1]))
    return out


def reference(folder: Path, name: str, all_texts: list[str], tables: dict, llama_tokenize: str | None) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    plain, special = [], []
    entry: dict = {"decoded": {}, "chat": []}
    for i, t in enumerate(all_texts):
        ids = tok.encode(t, add_special_tokens=False)
        plain.append(ids)
        special.append(tok.encode(t, add_special_tokens=True))
        if tok.decode(ids) != t:
            entry["decoded"][str(i)] = tok.decode(ids)
    entry["transformers"] = _table(tables, plain)
    entry["transformers_special"] = _table(tables, special)
    lc = llamacpp_ids(llama_tokenize, folder / name, all_texts) if llama_tokenize else None
    entry["llamacpp"] = _table(tables, lc) if lc is not None else None
    for msgs in MESSAGES:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        chat = {"messages": msgs, "text": text, "ids": tok.encode(text, add_special_tokens=False)}
        if lc is not None:
            chat["llamacpp_ids"] = llamacpp_ids(llama_tokenize, folder / name, [text])[0]
        entry["chat"].append(chat)
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-tokenize", help="llama.cpp's llama-tokenize binary (adds llama.cpp's ids)")
    args = ap.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    all_texts = texts()
    tables: dict = {}
    # "files" (no model files here) keeps tests/unit/test_gguf_fixtures.py, which runs the model
    # files every folder under tests/fixtures/gguf/ lists there, off these tokenizer-only ones
    ref: dict = {"note": "tokenizer-only GGUF files: their ids are under 'tokenizers'", "files": {},
                 "texts": all_texts, "tokenizers": {}, "tables": tables}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokens, merges, types = train_bpe(work)
        for pre in BPE_PRES:
            name = f"bpe-{pre}.gguf"
            write_bpe(OUT / name, pre, tokens, merges, types)
            ref["tokenizers"][name] = reference(OUT, name, all_texts, tables, args.llama_tokenize)
        sp = train_spm(work)
        write_spm(OUT / "spm.gguf", sp)
        entry = reference(OUT, "spm.gguf", all_texts, tables, args.llama_tokenize)
        entry["sentencepiece_differs"] = [i for i, (t, ids) in enumerate(zip(all_texts, tables[entry["transformers"]]))
                                          if sp.encode(t) != ids]
        ref["tokenizers"]["spm.gguf"] = entry
        # the same vocabulary without the space prefix (tokenizer.ggml.add_space_prefix false),
        # which transformers' loader ignores: llama.cpp's ids are its reference
        write_spm(OUT / "spm-no-prefix.gguf", sp, space_prefix=False)
        ref["tokenizers"]["spm-no-prefix.gguf"] = reference(OUT, "spm-no-prefix.gguf", all_texts, tables,
                                                       args.llama_tokenize)
        # the same vocabulary in a phi3 file, for which transformers' loader prepends the space
        # as llama.cpp does (a normalizer rather than its Metaspace)
        write_spm(OUT / "spm-phi3.gguf", sp, arch="phi3")
        ref["tokenizers"]["spm-phi3.gguf"] = reference(OUT, "spm-phi3.gguf", all_texts, tables, args.llama_tokenize)
    (OUT / "reference.json").write_text(json.dumps(ref, ensure_ascii=False, separators=(",", ":")))
    for name, e in ref["tokenizers"].items():
        tf = tables[e["transformers"]]
        lc = tables[e["llamacpp"]] if e["llamacpp"] else None
        extra = f", llama.cpp differs on {sum(a != b for a, b in zip(tf, lc))} texts" if lc else ", no llama.cpp ids"
        if "sentencepiece_differs" in e:
            extra += f", sentencepiece differs on {len(e['sentencepiece_differs'])}"
        print(f"{name}: {sum(map(len, tf))} ids{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
