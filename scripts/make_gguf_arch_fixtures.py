#!/usr/bin/env python3
"""Build the GGUF architecture fixtures under ``tests/fixtures/gguf/<arch>/`` (issue 50,
item 4): a tiny random model per architecture made with transformers, converted by
llama.cpp's own ``convert_hf_to_gguf.py`` and requantized by its ``llama-quantize``, with
transformers' greedy tokens on the very files it wrote (``from_pretrained(dir,
gguf_file=...)``, which dequantizes to fp32 with the ``gguf`` package).

Per architecture (qwen2, qwen3, phi3: hidden 256, 2 layers, 4 query and 2 KV heads,
feed-forward 256, 266 tokens; qwen3 a head size of 128, so 512 query features; gemma2 and
gemma3: 2 query heads and 1 KV head of 256, a sliding window of 64 positions, the whole
context) it writes:

* ``model.Q8_0.gguf`` and ``model.Q4_K_M.gguf`` (``llama-quantize`` from the F32 file the
  converter wrote; the F32 file itself is not kept),
* ``reference.json``: for each file, transformers' greedy ids (16 new tokens, pure
  argmax: EOS is an ordinary token here) for the prompts below, with the smallest gap
  between the chosen and the runner-up logit along the way (``min_margin``).

The suite reads only these files (tests/unit/test_gguf_fixtures.py): it needs neither
torch nor transformers nor llama.cpp.

What is not the stock converter: the tokenizer (and gemma2's vocabulary reader). The model's tokenizer is the byte-level
BPE of tests/support/gguf_models.py (the GPT-2 byte alphabet, three specials and a few
merges), trained by nobody, so the converter's check of the pre-tokenizer by the hash of
its tokens on a fixed text finds no known one; the script names it ``gpt2`` (a plain
byte-level split, what the tokenizer is) by replacing ``get_vocab_base_pre``. Everything
else the converter does (tensor names, Q/K layout, gemma's norm weights stored as 1 +
weight, metadata keys) is its own; gemma2's converter reads only a SentencePiece
vocabulary, so its ``set_vocab`` is the byte-level one the other converters use.

Set-up (a venv OUTSIDE the repo's; llama.cpp's source and build as
``python -m scripts.llama_server build`` leaves them)::

    python3 -m venv /tmp/tvenv
    /tmp/tvenv/bin/pip install torch==2.13.0          # the CPU wheel
    /tmp/tvenv/bin/pip install transformers gguf sentencepiece safetensors   # made with 5.25.0, gguf 0.19.0

Run (from the repo root)::

    /tmp/tvenv/bin/python -m scripts.make_gguf_arch_fixtures            # every architecture
    /tmp/tvenv/bin/python -m scripts.make_gguf_arch_fixtures qwen3      # just some
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "gguf"
LLAMA_CPP = Path("/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
QUANTIZE = Path("/tmp/lcpp-build/bin/llama-quantize")
ARCHS = ("qwen2", "qwen3", "phi3", "gemma2", "gemma3")
TYPES = ("Q8_0", "Q4_K_M")
NEW_TOKENS = 16
PROMPTS = [[5, 77, 140, 33, 200, 9, 61], [18, 250, 3], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110],
           [42], [7, 7, 7, 7, 260, 261, 262, 263]]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or", "hell o"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map. workers/logits.py has the product's copy;
    this script runs in a transformers venv without streamfleet installed, so it keeps its own."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def write_tokenizer(folder: Path, arch: str) -> int:
    """tests/support/gguf_models.py's vocabulary as transformers' tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = SPECIALS + list(_bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    # phi3's converter reads a GPT-2 vocabulary only when the tokenizer class says so (Phi-4's)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer" if arch == "phi3" else "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "pad_token": SPECIALS[0], "add_bos_token": False,
        "model_max_length": 256}))
    return len(tokens)


def make_model(arch: str, folder: Path, vocab: int, seed: int):
    """A random transformers model of ``arch``, weights about the size of a trained one's
    relative to each other (norm weights near 1, matrices N(0, 0.1)), saved to ``folder``."""
    import torch
    import transformers as tf

    common = {"vocab_size": vocab, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                  "rms_norm_eps": 1e-6,
                  "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"}
    if arch == "qwen2":
        config = tf.Qwen2Config(**common, rope_theta=100000.0, tie_word_embeddings=True)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=128, rope_theta=1000000.0, tie_word_embeddings=False)
        cls = tf.Qwen3ForCausalLM
    elif arch == "phi3":
        config = tf.Phi3Config(**common, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None,
                               original_max_position_embeddings=256)
        cls = tf.Phi3ForCausalLM
    else:
        # transformers' GGUF loader maps neither the soft-capping values nor
        # query_pre_attn_scalar from the file: the model keeps its config's defaults for them
        # (gemma2's caps 50 and 30; the scalar 256, so the head size is 256, whose 1/sqrt is
        # llama.cpp's scale) and a window of 64 positions, the whole context
        gemma = dict(common, num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                     max_position_embeddings=64, sliding_window=64, hidden_activation="gelu_pytorch_tanh",
                     tie_word_embeddings=True)
        if arch == "gemma2":
            config = tf.Gemma2Config(**gemma, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
            cls = tf.Gemma2ForCausalLM
        else:  # two layers: both sliding-window layers (every 6th is global), RoPE base 10000
            config = tf.Gemma3TextConfig(**gemma)
            cls = tf.Gemma3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # gemma's RMSNorm multiplies by 1 + weight
                if not arch.startswith("gemma"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:  # its blocks' outputs, normed, 4 in size: not drowned by the scaled embedding;
                    # the final norm 10: logits of a few units with the small tied table
                    base = 3.0 if ".post_" in name else 9.0 if name == "model.norm.weight" else 0.0
                    p.copy_(base + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in name or name == "lm_head.weight":
                # gemma's embeddings are scaled by sqrt(hidden) = 16 and its blocks' outputs
                # normed: a small table keeps the blocks from being drowned by the input token
                p.copy_((0.02 if arch.startswith("gemma") else 0.5) * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def convert(folder: Path, out: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py (its own gguf-py) to an F32 file, the tokenizer's
    pre-tokenizer named ``gpt2`` (see the module docstring)."""
    runner = (
        "import sys\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(folder)!r}, '--outfile', {str(out)!r}, '--outtype', 'f32']\n"
        "import convert_hf_to_gguf as c\n"
        "import conversion.base as b\n"
        "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt2'\n"
        # gemma2's converter reads only a SentencePiece vocabulary; this one is byte-level BPE
        "import conversion.gemma as gm\n"
        "gm.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()\n"
        "c.main()\n"
    )
    # the converter's folder is the child's working directory, which ``-c`` puts first on its
    # import path, and PYTHONPATH names it too
    subprocess.run([sys.executable, "-c", runner], check=True, cwd=str(LLAMA_CPP),
                   env={**os.environ, "PYTHONPATH": str(LLAMA_CPP)})


def reference(gguf_path: Path) -> list[dict]:
    """transformers' greedy ids on the GGUF file alone in its folder (its own loader: the
    configuration from the metadata, the weights dequantized to fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32).eval()
    cases = []
    for prompt in PROMPTS:
        ids = list(prompt)
        margin = float("inf")
        with torch.no_grad():
            for _ in range(NEW_TOKENS):  # no cache: every step a whole forward pass from position 0
                logits = model(torch.tensor([ids])).logits[0, -1]
                top = torch.topk(logits, 2).values
                margin = min(margin, float(top[0] - top[1]))
                ids.append(int(torch.argmax(logits)))
        cases.append({"prompt_ids": prompt, "greedy_ids": ids[len(prompt):], "min_margin": margin})
    return cases


def build(arch: str, seed: int) -> None:
    import gguf
    import torch
    import transformers

    dest = OUT / arch
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / f"tiny-random-{arch}"  # the converter names the model after its folder
        work.mkdir()
        vocab = write_tokenizer(work, arch)
        make_model(arch, work, vocab, seed)
        f32 = work / "model.F32.gguf"
        convert(work, f32)
        ref = {"arch": arch, "seed": seed, "new_tokens": NEW_TOKENS,
               "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                            "gguf": getattr(gguf, "__version__", "?"), "llama.cpp": "llama-cpp-python 0.3.36 vendor"},
               "files": {}}
        for qtype in TYPES:
            name = f"model.{qtype}.gguf"
            alone = work / qtype
            alone.mkdir()
            subprocess.run([str(QUANTIZE), str(f32), str(alone / name), qtype], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            ref["files"][name] = reference(alone / name)
            (dest / name).write_bytes((alone / name).read_bytes())
            print(arch, name, (dest / name).stat().st_size, "bytes;",
                  "min margin", min(c["min_margin"] for c in ref["files"][name]))
    (dest / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("archs", nargs="*", metavar="ARCH", help=f"some of {', '.join(ARCHS)} (default: all)")
    args = ap.parse_args(argv)
    unknown = set(args.archs) - set(ARCHS)
    if unknown:
        ap.error(f"unknown architecture(s) {', '.join(sorted(unknown))}")
    args.archs = args.archs or list(ARCHS)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for n, arch in enumerate(ARCHS):
        if arch in args.archs:
            build(arch, seed=50 + n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
