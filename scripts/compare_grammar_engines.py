"""llguidance, xgrammar and outlines-core side by side on one JSON schema: what it costs to
compile the schema for a tokenizer, and what one token mask costs per sequence per step.

Why streamfleet uses llguidance (docs/structured-outputs.md, "Choosing the engine"). Each
engine is driven as a worker would: compile, then for ``--sequences`` sequences walk
``--steps`` random allowed tokens, computing every sequence's mask each step (llguidance:
its executor, one call for the batch; xgrammar: ``fill_next_token_bitmask`` per matcher;
outlines-core: ``write_mask_into`` per guide). Engines that are not installed are skipped
(only llguidance is a dependency; xgrammar pulls in torch):

    pip install xgrammar outlines-core
    python -m scripts.compare_grammar_engines [--model-dir engines/tiny-gpt]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from streamfleet.devkit.structured import SCHEMA
from streamfleet.shared.modelrepo import ModelSpec, ensure_artifacts, load_tokenizer
from streamfleet.workers.logits import TokenTable

REPO = Path(__file__).resolve().parent.parent


def walk(masks, advance, sequences: int, steps: int, vocab: int, seed: int = 0) -> list[float]:
    """Seconds per sequence-mask over a random walk: ``masks(active)`` returns a bool
    ``[len(active), vocab]`` array, ``advance(i, token)`` feeds sequence ``i``."""
    rng = np.random.default_rng(seed)
    active = list(range(sequences))
    per = []
    for _ in range(steps):
        if not active:
            break
        t0 = time.perf_counter()
        allowed = masks(active)
        per.append((time.perf_counter() - t0) / len(active))
        still = []
        for row, i in enumerate(active):
            ids = np.flatnonzero(allowed[row][:vocab])
            if ids.size and advance(i, int(rng.choice(ids))):
                still.append(i)
        active = still
    return per


def bits_to_bool(bits: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)


def run_llguidance(tok, vocab, eos, a):
    from streamfleet.shared.grammar import Grammars, grammar_of

    g = Grammars(tok, vocab, [eos])
    grammar = grammar_of({"guided_json": SCHEMA})[0]
    t0 = time.perf_counter()
    first = g._llg.LLMatcher(g.tokenizer, grammar, log_level=0)
    g.masks([first])  # the lexer is built on the first mask
    compile_s = time.perf_counter() - t0
    ms = [g.matcher(grammar) for _ in range(a.sequences)]

    def advance(i, t):
        if t == eos:
            return False
        ms[i].consume_token(t)
        return not ms[i].is_stopped()

    return compile_s, walk(lambda act: g.masks([ms[i] for i in act]), advance, a.sequences, a.steps, vocab)


def run_xgrammar(tok, vocab, eos, a):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    ms = [xgr.GrammarMatcher(compiled) for _ in range(a.sequences)]
    bitmask = xgr.allocate_token_bitmask(a.sequences, vocab)

    def masks(act):
        for row, i in enumerate(act):
            ms[i].fill_next_token_bitmask(bitmask, row)
        return bits_to_bool(bitmask.numpy()[: len(act)].copy(), vocab)

    def advance(i, t):
        if t == eos:
            return False
        ms[i].accept_token(t)
        return not ms[i].is_terminated()

    return compile_s, walk(masks, advance, a.sequences, a.steps, vocab)


def run_outlines(tok, vocab, eos, a):
    from outlines_core import Guide, Index, Vocabulary, json_schema

    table = TokenTable(tok)
    by_bytes: dict[bytes, list[int]] = {}
    for tid in range(len(tok)):
        if tid != eos:
            by_bytes.setdefault(bytes(table.token(tid)[1]), []).append(tid)
    t0 = time.perf_counter()
    regex = json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="")
    index = Index(regex, Vocabulary(eos, by_bytes))
    compile_s = time.perf_counter() - t0
    guides = [Guide(index) for _ in range(a.sequences)]
    words = (vocab + 31) // 32
    bits = np.zeros((a.sequences, words), dtype=np.int32)

    def masks(act):
        for row, i in enumerate(act):
            guides[i].write_mask_into(bits[row].ctypes.data, words, 4)
        return bits_to_bool(bits[: len(act)].copy(), vocab)

    def advance(i, t):
        if t == eos:
            return False
        guides[i].advance(t)
        return not guides[i].is_finished()

    return compile_s, walk(masks, advance, a.sequences, a.steps, vocab)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=REPO / "engines" / "tiny-gpt")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    spec = ModelSpec.from_toml(a.model_dir / "engine.toml")
    ensure_artifacts(spec)
    tok = load_tokenizer(spec)
    vocab, eos = len(tok), int(spec.eos_token_ids[0])
    print(f"{spec.name}: vocabulary {vocab}, {a.sequences} sequences x {a.steps} steps, {os.cpu_count()} cores")
    print(f"{'engine':>13} {'compile ms':>11} {'mask µs/seq p50':>16} {'p99':>8}")
    for name, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar), ("outlines-core", run_outlines)):
        try:
            compile_s, per = fn(tok, vocab, eos, a)
        except ImportError as exc:
            print(f"{name:>13}  not installed ({exc.name})")
            continue
        per_us = sorted(p * 1e6 for p in per)
        print(f"{name:>13} {compile_s * 1000:>11.1f} {statistics.median(per_us):>16.1f} "
              f"{per_us[int(0.99 * (len(per_us) - 1))]:>8.1f}")


if __name__ == "__main__":
    main()
