"""Decode throughput with 0 %, 50 % and 100 % of the batch constrained by a JSON schema,
side by side in one run, and what the token masks cost per step.

Drives a ``WorkerCore`` on the ONNX Runtime CPU engine directly (no Redis, no gateway:
the worker's step is what constraints change), keeping ``--concurrency`` sequences in
the batch: when one ends, another of the same kind takes its slot. Constrained
sequences use a JSON schema (docs/structured-outputs.md, the benchmark's schema);
unconstrained ones sample freely with ``ignore_eos``. Prints decode tokens/s, the mask's
milliseconds per step (computing the constrained rows' masks with llguidance and
applying them): computing them (masks ms, on a thread while the engine runs), what the
step waited for them and spent applying them (waited ms, its p99), the computing per
constrained row, and the ratio to the unconstrained run.

    python -m scripts.bench_structured                       # the demo model (1,024 tokens)
    python -m streamfleet.shared.tinymodel --out /tmp/v16k --vocab-size 16000 --n-layer 1 --d-model 64
    python -m scripts.bench_structured --model-dir /tmp/v16k  # a 16k vocabulary
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

from scripts import benchtable
from streamfleet.devkit.structured import SCHEMA
from streamfleet.shared.grammar import grammar_of
from streamfleet.shared.modelrepo import ModelSpec, ensure_artifacts, load_tokenizer
from streamfleet.shared.schema import SamplingParams, Task
from streamfleet.workers.core import WorkerCore
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

REPO = Path(__file__).resolve().parent.parent


def run(spec: ModelSpec, tokenizer, concurrency: int, share: float, steps: int, warmup: int,
        free_lengths: list[int]) -> dict:
    engine = OnnxRuntimeEngine(spec, threads=os.cpu_count())
    core = WorkerCore(engine, tokenizer, max_batch=concurrency)
    grammar = grammar_of({"guided_json": SCHEMA})[0]
    prompt = tokenizer.encode("Describe a person as JSON:")
    constrained = round(concurrency * share)
    kinds: dict[str, bool] = {}
    seed = iter(range(1, 10**9))
    free = iter(free_lengths * 1000)

    def add(is_constrained: bool) -> None:
        rid = uuid.uuid4().hex
        params = (SamplingParams(max_tokens=200, temperature=1.0, seed=next(seed), grammar=grammar)
                  if is_constrained else
                  SamplingParams(max_tokens=next(free), temperature=1.0, seed=next(seed), ignore_eos=True))
        core.add(Task(rid, spec.name, "normal", "bench", rid, list(prompt), params, time.time()))
        kinds[rid] = is_constrained

    for i in range(concurrency):
        add(i < constrained)
    tokens, mask_ms, compute_ms, rows, lengths = 0, [], [], [], []
    t0 = None
    for n in range(warmup + steps):
        if n == warmup:
            t0, tokens = time.perf_counter(), 0
        out = core.step()
        tokens += out.new_tokens
        if n >= warmup and constrained:
            mask_ms.append(out.grammar_s * 1000)
            compute_ms.append(core._grammars.last_masks_s * 1000)
            rows.append(sum(1 for rid, c in kinds.items() if c and rid in core))
        done = {ev.request_id: ev.completion_tokens for _, ev in out.events if getattr(ev, "type", "") == "done"}
        for rid in out.finished:
            if kinds[rid] and rid in done:
                lengths.append(done[rid])
            add(kinds.pop(rid))
    wall = time.perf_counter() - t0
    engine.close()
    return {"tok_s": tokens / wall, "mask_ms": statistics.mean(mask_ms) if mask_ms else 0.0,
            "mask_p99": sorted(mask_ms)[int(0.99 * (len(mask_ms) - 1))] if mask_ms else 0.0,
            "per_row_us": 1000 * sum(compute_ms) / max(1, sum(rows)) if mask_ms else 0.0,
            "compute_ms": statistics.mean(compute_ms) if compute_ms else 0.0,
            "step_ms": 1000 * wall / steps, "lengths": lengths}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=REPO / "engines" / "tiny-gpt")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    benchtable.add_argument(ap)
    a = ap.parse_args()
    spec = ModelSpec.from_toml(a.model_dir / "engine.toml")
    ensure_artifacts(spec)
    spec = dataclasses.replace(spec, max_batch=max(spec.max_batch, a.concurrency))
    tokenizer = load_tokenizer(spec)
    print(f"{spec.name}: vocabulary {len(tokenizer)}, c={a.concurrency}, {a.steps} steps, {os.cpu_count()} cores")
    print(f"{'constrained':>11} {'tok/s':>8} {'ratio':>6} {'step ms':>8} {'masks ms':>9} {'waited ms':>10} "
          f"{'p99':>6} {'µs/row':>7}")
    # the constrained outputs' lengths first: the unconstrained sequences then run as long
    # (the same lengths in turn), so that both kinds cost the same prefills per token
    results = {1.0: run(spec, tokenizer, a.concurrency, 1.0, a.steps, a.warmup, [64])}
    lengths = results[1.0]["lengths"]
    for share in (0.0, 0.5):
        results[share] = run(spec, tokenizer, a.concurrency, share, a.steps, a.warmup, lengths)
    base = results[0.0]["tok_s"]
    for share in (0.0, 0.5, 1.0):
        r = results[share]
        print(f"{share:>11.0%} {r['tok_s']:>8.0f} {r['tok_s'] / base:>6.2f} {r['step_ms']:>8.2f} "
              f"{r['compute_ms']:>9.3f} {r['mask_ms']:>10.3f} {r['mask_p99']:>6.2f} {r['per_row_us']:>7.1f}")
    print(f"(constrained outputs: {statistics.mean(lengths):.1f} tokens on average; the unconstrained ones ran "
          f"the same lengths)")

if __name__ == "__main__":
    sys.exit(benchtable.main(main))
