#!/usr/bin/env python3
"""Build the tiny per-architecture ONNX decoder fixtures under ``tests/fixtures/archs/``.

For every architecture below this script builds a tiny random-weight decoder
(seeded; hidden 64, 2 layers, 4 attention heads, intermediate 128, 256 positions,
2 KV heads on every GQA-capable architecture) with a small byte-level BPE
tokenizer trained here on fixed text, exports it with Optimum
(``main_export(..., task="text-generation-with-past")``) and writes, per
architecture, into ``tests/fixtures/archs/<arch>/``:

* the ONNX graph as ONE self-contained file (``model.onnx``, or
  ``decoder_model_merged.onnx`` for ``gpt2-merged``),
* ``config.json``, ``generation_config.json``,
* ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
* ``reference.json``: transformers' own greedy tokens for 7 prompts (see below).

Nothing is downloaded: the models are random, the tokenizer is trained locally.
The repo's tests need none of this; they read the committed fixtures.  Run it
again only to regenerate them: with the versions below two runs give
byte-identical files.  After writing each folder it replays every case with a
plain batch-1 greedy loop on ONNX Runtime (prefill with a zero-length past, then
one token a step feeding the presents back; ``use_cache_branch`` False then True
for the merged graph), records the result as ``ort_verified`` and exits non-zero
on any mismatch.  ``--check`` repeats only that replay and needs nothing but
numpy and onnxruntime.

``gpt2-merged`` is Optimum's legacy layout: optimum 2.x dropped ``legacy=True``
from ``main_export``, so this script swaps in the old decoder / decoder-with-past
split for that one export, and Optimum's own post-processing merges the two with
``optimum.onnx.merge_decoders`` and validates both branches.

Set-up (a venv OUTSIDE the repo; these are the versions the fixtures were made
with -- optimum-onnx 0.1.0 pins optimum~=2.1.0 and transformers<4.58)::

    python3.11 -m venv /work/fixvenv
    /work/fixvenv/bin/pip install --upgrade pip
    /work/fixvenv/bin/pip install torch==2.13.0          # the CPU-only wheel (2.13.0+cpu)
    /work/fixvenv/bin/pip install "optimum-onnx[onnxruntime]==0.1.0" optimum==2.1.0 \\
        transformers==4.57.6 tokenizers==0.22.2 onnx==1.23.2 onnxruntime==1.32.0 numpy==2.4.6

Run (from the repo root)::

    /work/fixvenv/bin/python -m scripts.make_arch_fixtures            # every architecture
    /work/fixvenv/bin/python -m scripts.make_arch_fixtures llama gemma3  # just some
    /work/fixvenv/bin/python -m scripts.make_arch_fixtures --check      # only re-verify the
                                                                         # committed graphs with ORT

``reference.json`` holds::

    {"arch", "model_type", "export_file", "inputs": [graph input names], "outputs",
     "has_position_ids", "has_use_cache_branch", "kv_heads", "head_dim", "n_layer",
     "vocab_size", "kv_dtype", "bos_token_id", "add_bos", "eos_token_ids",
     "versions": {...}, "ort_verified": true,
     "cases": [{"prompt_text", "prompt_ids", "greedy_ids", "greedy_ids_min_new_tokens",
                "stop_at_eos_ids", "stopped_on_eos", "min_logit_margin"}]}

* ``prompt_ids``: ``tokenizer(prompt_text, add_special_tokens=True)`` (so with BOS
  where the tokenizer adds one).
* ``greedy_ids``: 24 new tokens, pure argmax at every step (EOS is an ordinary token
  here: what an engine gives with ``ignore_eos``).  Made with ``model.generate(ids,
  do_sample=False, max_new_tokens=24, min_new_tokens=24)`` run one prompt at a time
  with no padding, with the EOS ids taken out of the generation config so that
  ``min_new_tokens`` has nothing to mask, and checked against a hand-written
  KV-cache argmax loop in torch.
* ``greedy_ids_min_new_tokens``: the same call with the model's real EOS ids, so
  ``min_new_tokens`` masks them (differs from ``greedy_ids`` only where an EOS id
  was the argmax within the 24 steps).
* ``stop_at_eos_ids``: ``generate(do_sample=False, max_new_tokens=24)`` with the
  generation config's EOS ids: stops at (and, as transformers does, includes) the
  first EOS id; ``stopped_on_eos`` is that id or null.
* ``min_logit_margin``: the smallest top-1 minus top-2 logit gap over the 24 greedy
  steps (fp32), i.e. how much numerical slack the argmax has.

The second EOS id in the list-valued ``generation_config.eos_token_id`` is chosen
among tokens that the greedy continuations actually produce, so that stopping on
it is exercised by some cases and not by others.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT_ROOT = REPO / "tests" / "fixtures" / "archs"

SEED = 1234
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTER = 128
MAX_POS = 256
VOCAB = 512
NEW_TOKENS = 24
MIN_MARGIN_WARN = 3e-4  # warn when some greedy step's top1-top2 logit gap is below this

SPECIALS = ["<s>", "</s>", "<unk>", "<pad>"]  # ids 0..3

# Fixed English text the BPE tokenizer is trained on (plain prose written for this script).
TRAIN_TEXT = """
The morning train left the station a little after seven, and most of the people on board
were still half asleep. A woman near the window was reading a newspaper, folding each page
carefully before she turned to the next one. Across the aisle, two students were talking
about an exam they had taken the day before, and whether the last question had been fair.
Outside, the fields were covered in a thin layer of frost, and the sun was just beginning
to rise over the hills in the east.

When the train reached the city, the doors opened and everyone stepped out onto the cold
platform. Some of them walked quickly towards the exit, while others stopped to buy coffee
from a small stand near the stairs. The man who ran the stand had been there for many years.
He knew most of his customers by name, and he often asked them about their families, their
work, and the weather, which was always a safe thing to talk about.

In the afternoon the weather changed. Dark clouds came in from the sea, and by four o'clock
it was raining hard. People hurried along the streets with their umbrellas, and the shops
were full of those who wanted to stay dry for a while. A small dog waited patiently outside
a bakery for its owner, who came out a few minutes later with a bag of warm bread.

Good software is built by people who read the code as often as they write it. They keep
functions short, they give things clear names, and they write tests that explain what the
program is supposed to do. When something breaks, they look for the simplest explanation
first, and they change one thing at a time until the problem is understood. A server that
answers many requests at once must be careful with memory, with time, and with the order in
which work is done, because every small delay is multiplied by the number of users waiting.

The library on the corner of the square opened at nine and closed at six. Inside it was quiet
and warm, with long wooden tables and green lamps. Children came in after school to read
stories about ships, dragons, and distant planets, and older visitors sat by the windows with
books about history, gardening, and cooking. The librarian liked to say that every question
has an answer somewhere on the shelves, if you are patient enough to look for it.

Once upon a time there was a small village at the edge of a great forest. The people of the
village grew apples and wheat, and in the autumn they held a festival with music and dancing
that lasted for three days. One year a traveller arrived during the festival and told them
about a city by the ocean where the houses were painted in every colour of the rainbow.
"""

# 7 prompts of ordinary text, from a couple of tokens to ~60 tokens.
PROMPTS = [
    "The train",
    "The morning train",
    "She opened the book and read the first page.",
    "When it rains, people stay in the shops and wait for the weather to change.",
    "A small dog waited outside the bakery while its owner bought a bag of warm bread.",
    "Good software is written by people who read the code, keep functions short, and test what "
    "the program should do.",
    "When a server answers many requests at the same time, it has to decide which work to do "
    "first, how much memory each request may use, and how long to wait.",
]

# arch -> how to build it.  add_bos: llama/gemma-style tokenizers prepend <s>.
# seed: picked once among SEED..SEED+11 (initializer_range left at 0.02) so that the greedy
# continuations depend on the prompt, are not one token repeated, and every argmax wins by a
# top1-top2 logit gap of at least ~3e-4 (see MIN_MARGIN_WARN); llama and mistral get different
# seeds because with the same one they would be the very same network.
# eos_list: generation_config.eos_token_id is a list [</s>, other] (else the int </s>).
ARCHS: dict[str, dict] = {
    "gpt2": {"model_type": "gpt2", "seed": SEED + 8, "add_bos": False, "eos_list": False},
    "llama": {"model_type": "llama", "seed": SEED + 8, "add_bos": True, "eos_list": True},
    "qwen2": {"model_type": "qwen2", "seed": SEED + 7, "add_bos": False, "eos_list": True},
    "mistral": {"model_type": "mistral", "seed": SEED, "add_bos": True, "eos_list": True},
    "phi3": {"model_type": "phi3", "seed": SEED + 11, "add_bos": False, "eos_list": True},
    "qwen3": {"model_type": "qwen3", "seed": SEED + 5, "add_bos": False, "eos_list": True},
    "gemma": {"model_type": "gemma", "seed": SEED + 11, "add_bos": True, "eos_list": False},
    "gemma3": {"model_type": "gemma3_text", "seed": SEED, "add_bos": True, "eos_list": True},
    # the same weights as "gpt2" (same seed), exported in Optimum's legacy merged-decoder layout
    "gpt2-merged": {"model_type": "gpt2", "seed": SEED + 8, "add_bos": False, "eos_list": False, "merged": True,
                        "same_as": "gpt2"},
}


# --------------------------------------------------------------------------- tokenizer

def build_tokenizer(add_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TRAIN_TEXT], trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    bos_id = tok.token_to_id("<s>")
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        add_bos_token=add_bos,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POS,
    )
    return fast


# --------------------------------------------------------------------------- configs

def make_config(model_type: str, tok):
    import transformers as tf

    ids = {
        "bos_token_id": tok.convert_tokens_to_ids("<s>"),
        "eos_token_id": tok.convert_tokens_to_ids("</s>"),
        "pad_token_id": tok.convert_tokens_to_ids("<pad>"),
    }
    vocab = len(tok)
    common = dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        tie_word_embeddings=False,
        **ids,
    )
    if model_type == "gpt2":
        # untied: with tied tiny random embeddings the greedy output ignores the prompt
        return tf.GPT2Config(
            vocab_size=vocab, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTER,
            n_positions=MAX_POS, n_ctx=MAX_POS, tie_word_embeddings=False, **ids,
        )
    if model_type == "llama":
        return tf.LlamaConfig(head_dim=HEAD_DIM, **common)
    if model_type == "qwen2":
        return tf.Qwen2Config(use_sliding_window=False, **common)
    if model_type == "mistral":
        return tf.MistralConfig(head_dim=HEAD_DIM, sliding_window=4096, **common)
    if model_type == "phi3":
        return tf.Phi3Config(**common)
    if model_type == "qwen3":
        return tf.Qwen3Config(head_dim=HEAD_DIM, use_sliding_window=False, **common)
    if model_type == "gemma":
        # untied (real Gemma ties): tied, this tiny model repeats one token whatever the prompt
        return tf.GemmaConfig(head_dim=HEAD_DIM, hidden_activation="gelu_pytorch_tanh", **common)
    if model_type == "gemma3_text":
        common["tie_word_embeddings"] = True
        # one local (sliding, rope_local_base_freq) and one global layer, like the real 5:1 mix;
        # the 4096 window never binds at 256 positions
        return tf.Gemma3TextConfig(
            head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=4096,
            layer_types=["sliding_attention", "full_attention"], **common
        )
    raise ValueError(model_type)


def build_model(model_type: str, tok, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = make_config(model_type, tok)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    return model


# --------------------------------------------------------------------------- reference

def argmax_loop_torch(model, prompt_ids: list[int], n: int) -> tuple[list[int], float]:
    """Hand-written batch-1 greedy loop with the KV cache (no generate()); also the min top1-top2 gap."""
    import torch

    out_ids: list[int] = []
    margin = float("inf")
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        past = None
        total = len(prompt_ids)
        for _ in range(n):
            res = model(input_ids=ids, attention_mask=torch.ones(1, total, dtype=torch.long),
                        past_key_values=past, use_cache=True)
            logits = res.logits[0, -1].float()
            top2 = torch.topk(logits, 2).values
            margin = min(margin, float(top2[0] - top2[1]))
            nxt = int(torch.argmax(logits))
            out_ids.append(nxt)
            past = res.past_key_values
            ids = torch.tensor([[nxt]])
            total += 1
    return out_ids, margin


def run_generate(model, prompt_ids, eos, min_new: bool):
    import torch

    gc = copy.deepcopy(model.generation_config)
    gc.do_sample = False
    gc.max_new_tokens = NEW_TOKENS
    gc.min_new_tokens = NEW_TOKENS if min_new else None
    gc.eos_token_id = eos
    gc.pad_token_id = model.config.pad_token_id
    gc.temperature = None
    gc.top_p = None
    gc.top_k = None
    ids = torch.tensor([prompt_ids])
    # generate() fills unset (None) fields of a passed config from model.generation_config, so
    # "no EOS" only sticks if the model's own generation config says so too: swap it for the call
    saved_gc, saved_eos = model.generation_config, model.config.eos_token_id
    model.generation_config = copy.deepcopy(gc)
    if eos is None:
        model.config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    finally:
        model.generation_config, model.config.eos_token_id = saved_gc, saved_eos
    return out[0, len(prompt_ids):].tolist()


def pick_second_eos(greedy: list[list[int]], real_eos: int, specials: set[int]) -> int:
    """A token produced by some greedy continuations (not at step 0) and absent from others."""
    n = len(greedy)
    best = None
    for tokid in sorted({t for g in greedy for t in g}):
        if tokid == real_eos or tokid in specials:
            continue
        hits = [g.index(tokid) for g in greedy if tokid in g]
        if not hits or min(hits) == 0:
            # stopping before any token is a corner case, not the common path: avoid it
            continue
        # prefer: in roughly half of the cases, first hit late enough to produce some text
        score = (abs(len(hits) - n / 2), -min(hits), tokid)
        if best is None or score < best[0]:
            best = (score, tokid)
    if best is None:  # no suitable token: any non-special id not in the continuations
        for tokid in range(len(specials), VOCAB):
            if all(tokid not in g for g in greedy):
                return tokid
    return best[1]


# --------------------------------------------------------------------------- export

def _legacy_decoder_models_for_export(model, config):
    """Optimum's pre-2.0 ``legacy=True`` split: decoder_model + decoder_with_past_model.

    Optimum 2.x dropped the ``legacy`` switch from ``main_export``, but its
    ``TextDecoderOnnxConfig.post_process_exported_models`` still merges these two
    graphs with ``optimum.onnx.merge_decoders`` into ``decoder_model_merged.onnx``
    (with the ``use_cache_branch`` input) and validates both branches.
    """
    from optimum.exporters.utils import DECODER_NAME, DECODER_WITH_PAST_NAME

    kw = {"task": config.task, "int_dtype": config.int_dtype, "float_dtype": config.float_dtype}
    no_past = config.__class__(model.config, use_past=config.use_past, use_past_in_inputs=False, **kw)
    with_past = config.__class__(model.config, use_past=True, use_past_in_inputs=True, **kw)
    return {DECODER_NAME: (model, no_past), DECODER_WITH_PAST_NAME: (model, with_past)}


def export(model_dir: Path, out_dir: Path, merged: bool) -> Path:
    import optimum.exporters.utils as oeu
    from optimum.exporters.onnx import main_export

    saved = oeu.get_decoder_models_for_export
    if merged:
        oeu.get_decoder_models_for_export = _legacy_decoder_models_for_export
    try:
        main_export(
            str(model_dir),
            output=str(out_dir),
            task="text-generation-with-past",
            device="cpu",
            local_files_only=True,
            do_validation=True,
            model_kwargs=None,
        )
    finally:
        oeu.get_decoder_models_for_export = saved
    name = "decoder_model_merged.onnx" if merged else "model.onnx"
    path = out_dir / name
    if not path.is_file():
        raise RuntimeError(f"export produced {sorted(p.name for p in out_dir.iterdir())}, no {name}")
    return path


def save_single_file(src: Path, dst: Path) -> None:
    """Copy an ONNX graph as ONE file, pulling any external-data tensors inside."""
    import onnx

    m = onnx.load(str(src), load_external_data=True)
    onnx.save_model(m, str(dst), save_as_external_data=False)
    onnx.checker.check_model(str(dst))


# --------------------------------------------------------------------------- ORT check

_ORT_NP = {
    "tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
    "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool",
}


def graph_info(onnx_path: Path) -> dict:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    ins = sess.get_inputs()
    pkv = [i for i in ins if i.name.startswith("past_key_values.")]
    kv_dtype = _ORT_NP[pkv[0].type] if pkv else None
    return {
        "inputs": [i.name for i in ins],
        "outputs": [o.name for o in sess.get_outputs()],
        "has_position_ids": any(i.name == "position_ids" for i in ins),
        "has_use_cache_branch": any(i.name == "use_cache_branch" for i in ins),
        "kv_dtype": kv_dtype,
        "n_layer": len(pkv) // 2,
    }


def ort_greedy(onnx_path: Path, prompt_ids: list[int], n: int, kv_heads: int, head_dim: int) -> list[int]:
    """Plain batch-1 greedy loop on ONNX Runtime: prefill with an empty past, then 1 token a step."""
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    ins = {i.name: i for i in sess.get_inputs()}
    out_names = [o.name for o in sess.get_outputs()]
    past_names = [k for k in ins if k.startswith("past_key_values.")]
    past = {k: np.zeros((1, kv_heads, 0, head_dim), dtype=_ORT_NP[ins[k].type]) for k in past_names}
    int_t = lambda name: _ORT_NP[ins[name].type]  # noqa: E731
    step_ids = list(prompt_ids)
    past_len = 0
    gen: list[int] = []
    for step in range(n):
        feed = {
            "input_ids": np.array([step_ids], dtype=int_t("input_ids")),
            "attention_mask": np.ones((1, past_len + len(step_ids)), dtype=int_t("attention_mask")),
        }
        if "position_ids" in ins:
            feed["position_ids"] = np.arange(past_len, past_len + len(step_ids), dtype=int_t("position_ids"))[None, :]
        if "use_cache_branch" in ins:
            feed["use_cache_branch"] = np.array([step > 0], dtype=bool)
        feed.update(past)
        res = dict(zip(out_names, sess.run(out_names, feed)))
        nxt = int(np.argmax(res["logits"][0, -1]))
        gen.append(nxt)
        past = {k: res[k.replace("past_key_values.", "present.")] for k in past_names}
        past_len += len(step_ids)
        step_ids = [nxt]
    return gen


def ort_verify(folder: Path) -> tuple[bool, list[str]]:
    ref = json.loads((folder / "reference.json").read_text())
    problems = []
    for i, case in enumerate(ref["cases"]):
        got = ort_greedy(folder / ref["export_file"], case["prompt_ids"], len(case["greedy_ids"]),
                         ref["kv_heads"], ref["head_dim"])
        if got != case["greedy_ids"]:
            problems.append(f"case {i}: ORT {got} != reference {case['greedy_ids']}")
    return not problems, problems


# --------------------------------------------------------------------------- driver

def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime", "tokenizers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def make_arch(arch: str, spec: dict, out_root: Path, cache: dict) -> dict:
    import torch

    torch.set_num_threads(2)
    model_type = spec["model_type"]
    tok = build_tokenizer(spec["add_bos"])
    assert len(tok) == VOCAB
    model = build_model(model_type, tok, spec["seed"])
    if spec.get("same_as") in cache:
        # same seed/config as the sibling: the weights (and so the references) must match
        sib = cache[spec["same_as"]]
        for (na, a), (nb, b) in zip(model.state_dict().items(), sib.state_dict().items()):
            assert na == nb and torch.equal(a, b), na
    cache[arch] = model

    bos = tok.convert_tokens_to_ids("<s>")
    eos = tok.convert_tokens_to_ids("</s>")
    specials = {tok.convert_tokens_to_ids(t) for t in SPECIALS}

    prompts = []
    for text in PROMPTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        assert (ids[0] == bos) == spec["add_bos"], (arch, ids[:3])
        prompts.append((text, ids))

    # pure-argmax continuations (EOS just another token), checked against a hand loop
    greedy, margins = [], []
    for text, ids in prompts:
        g = run_generate(model, ids, eos=None, min_new=True)
        h, margin = argmax_loop_torch(model, ids, NEW_TOKENS)
        assert g == h, (arch, text, g, h)
        assert len(g) == NEW_TOKENS
        greedy.append(g)
        margins.append(margin)

    if min(margins) < MIN_MARGIN_WARN or min(len(set(g)) for g in greedy) < 3:
        print(f"WARNING {arch}: weak reference (min top1-top2 gap {min(margins):.2e}, "
              f"min distinct tokens {min(len(set(g)) for g in greedy)}): consider another seed",
              flush=True)

    eos_ids: int | list[int] = eos
    if spec["eos_list"]:
        eos_ids = [eos, pick_second_eos(greedy, eos, specials)]
    model.generation_config.bos_token_id = bos
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = tok.convert_tokens_to_ids("<pad>")
    eos_set = eos_ids if isinstance(eos_ids, list) else [eos_ids]

    cases = []
    for (text, ids), g, margin in zip(prompts, greedy, margins):
        masked = run_generate(model, ids, eos=eos_set, min_new=True)
        stop = run_generate(model, ids, eos=eos_set, min_new=False)
        # stop_at_eos must be the greedy continuation cut after its first EOS id
        first = next((k for k, t in enumerate(g) if t in eos_set), None)
        expect = g if first is None else g[: first + 1]
        assert stop == expect, (arch, text, stop, expect)
        cases.append({
            "prompt_text": text,
            "prompt_ids": ids,
            "greedy_ids": g,
            "greedy_ids_min_new_tokens": masked,
            "stop_at_eos_ids": stop,
            "stopped_on_eos": None if first is None else g[first],
            "min_logit_margin": round(margin, 6),
        })

    dest = out_root / arch
    with tempfile.TemporaryDirectory(prefix=f"fix-{arch}-") as tmp:
        tmp = Path(tmp)
        model_dir, onnx_dir = tmp / "hf", tmp / "onnx"
        model.save_pretrained(model_dir, safe_serialization=True)
        tok.save_pretrained(model_dir)
        onnx_src = export(model_dir, onnx_dir, merged=spec.get("merged", False))

        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        save_single_file(onnx_src, dest / onnx_src.name)
        # configs: the model's own (generation_config carries the EOS list)
        model.config.save_pretrained(dest)
        model.generation_config.save_pretrained(dest)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (model_dir / name).is_file():
                shutil.copy(model_dir / name, dest / name)
        # PreTrainedTokenizerFast does not write add_bos_token/add_eos_token itself; llama-style
        # readers look for them (the BOS itself comes from tokenizer.json's post-processor)
        tc_path = dest / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text())
        tc["add_bos_token"] = spec["add_bos"]
        tc["add_eos_token"] = False
        tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")

    info = graph_info(dest / onnx_src.name)
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert info["n_layer"] == cfg.num_hidden_layers
    ref = {
        "arch": arch,
        "model_type": model_type,
        "export_file": onnx_src.name,
        "inputs": info["inputs"],
        "outputs": info["outputs"],
        "has_position_ids": info["has_position_ids"],
        "has_use_cache_branch": info["has_use_cache_branch"],
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "n_layer": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "kv_dtype": info["kv_dtype"],
        "bos_token_id": bos,
        "add_bos": spec["add_bos"],
        "eos_token_ids": eos_set,
        "versions": versions(),
        "ort_verified": False,
        "cases": cases,
    }
    (dest / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    ok, problems = ort_verify(dest)
    ref["ort_verified"] = ok
    (dest / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    size = sum(p.stat().st_size for p in dest.iterdir())
    return {"arch": arch, "ok": ok, "problems": problems, "size": size, "inputs": info["inputs"],
                "has_position_ids": info["has_position_ids"], "kv_dtype": info["kv_dtype"],
                "eos": eos_set, "min_margin": min(margins),
                "prompt_lens": [len(c["prompt_ids"]) for c in cases],
                "stopped": [c["stopped_on_eos"] for c in cases]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("archs", nargs="*", help=f"subset of {list(ARCHS)} (default: all)")
    ap.add_argument("--out", type=Path, default=OUT_ROOT)
    ap.add_argument("--check", action="store_true", help="only re-run the ORT check on existing fixtures")
    args = ap.parse_args(argv)
    archs = args.archs or list(ARCHS)
    for a in archs:
        if a not in ARCHS:
            ap.error(f"unknown arch {a!r}")
    if args.check:
        bad = 0
        for a in archs:
            ok, problems = ort_verify(args.out / a)
            print(f"{a:12s} {'OK' if ok else 'MISMATCH'}", *problems, sep="\n  " if problems else " ")
            bad += not ok
        return 1 if bad else 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cache: dict = {}
    results, failed = [], []
    for a in archs:
        spec = ARCHS[a]
        if spec.get("same_as") and spec["same_as"] not in cache:
            # build the sibling in memory only, to assert identical weights
            sib = ARCHS[spec["same_as"]]
            cache[spec["same_as"]] = build_model(sib["model_type"], build_tokenizer(sib["add_bos"]), sib["seed"])
        try:
            r = make_arch(a, spec, args.out, cache)
        except Exception as exc:  # report and go on with the others
            import traceback

            traceback.print_exc()
            failed.append((a, f"{type(exc).__name__}: {exc}"))
            continue
        results.append(r)
        print(f"== {a}: ORT {'OK' if r['ok'] else 'MISMATCH'}  size={r['size']/1e6:.2f} MB  "
              f"pos_ids={r['has_position_ids']} kv={r['kv_dtype']} eos={r['eos']} "
              f"prompt_lens={r['prompt_lens']} stopped={r['stopped']} min_margin={r['min_margin']:.4g}",
              flush=True)
        print(f"   inputs={r['inputs']}", flush=True)
        for p in r["problems"]:
            print("   " + p, flush=True)
    for a, why in failed:
        print(f"== {a}: FAILED {why}")
    return 1 if failed or not all(r["ok"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
