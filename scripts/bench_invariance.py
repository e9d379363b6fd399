#!/usr/bin/env python
"""What batch invariance costs, engine by engine, side by side in one run.

Drives each ONNX Runtime engine directly (no fleet: the engine's own cost) the way a
worker's continuous batching does: ``--concurrency`` slots, each a seeded random prompt of
4 to 8 tokens followed by ``--tokens`` decode steps, a finished sequence replaced by a new
one at the next step, the slots starting one step apart (staggered lengths, as closed-loop
clients make them). Each engine runs it batch-invariant (the default) and with
``batch_invariant = false``, and prints decoded tokens per CPU-second (process time, one
ONNX Runtime thread: less sensitive to other work on a shared machine than wall time),
the invariant/free ratio, and the batching gain (tokens per CPU-second at the
concurrency against at 1). The benchmark model is generated in both layouts when missing:
``--attention gqa`` (what ``--preset bench`` writes, served by workers/engines/onnx_gqa.py)
and ``concat`` (the with-past layout, workers/engines/onnxruntime.py). docs/sampling.md,
"What a seed guarantees", has the figures.

    python -m scripts.bench_invariance [--concurrency 1,8,32] [--steps 400] [--dir /tmp/sf-bench-invariance]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path

from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.tinymodel import PRESETS, write_model
from streamfleet.workers.engines.onnx_gqa import OnnxGqaEngine
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

ENGINES = {"gqa": OnnxGqaEngine, "concat": OnnxRuntimeEngine}


def folder(root: Path, attention: str) -> Path:
    """The bench preset in ``attention``'s layout under ``root`` (made when missing)."""
    path = root / f"bench-{attention}"
    if not (path / "engine.toml").exists():
        print(f"generating the benchmark model ({attention}) in {path} ...", flush=True)
        write_model(path, dataclasses.replace(PRESETS["bench"], attention=attention), toml=True)
    return path


def run(engine, concurrency: int, steps: int, tokens: int, seed: int = 1) -> dict[str, float]:
    """The staggered continuous-batching loop; decoded tokens and CPU seconds."""
    rng = random.Random(seed)
    vocab = engine.vocab_size
    live: dict[str, int] = {}
    starts = list(range(concurrency))  # the step at which each free slot takes a new sequence
    made = decoded = 0
    t0 = time.process_time()
    for step in range(steps):
        new = []
        while starts and starts[0] <= step:
            starts.pop(0)
            made += 1
            new.append((f"s{made}", [rng.randrange(1, vocab) for _ in range(rng.randrange(4, 9))]))
        if new:
            engine.prefill(new)
            live.update((sid, tokens) for sid, _ in new)
        if not live:
            continue
        engine.decode([(sid, rng.randrange(1, vocab)) for sid in live])
        decoded += len(live)
        for sid in [s for s in live if live[s] == 1]:
            del live[sid]
            engine.release(sid)
            starts.append(step + 1)
        for sid in live:
            live[sid] -= 1
    for sid in live:
        engine.release(sid)
    return {"tokens": decoded, "cpu_s": time.process_time() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--steps", type=int, default=400, help="decode steps per measurement")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per sequence")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/sf-bench-invariance"), help="where the models go")
    ap.add_argument("--layouts", default="gqa,concat")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for attention in args.layouts.split(","):
        repo = ModelRepository(folder(args.dir, attention).parent)
        spec = repo.get(f"bench-{attention}")
        rates: dict[tuple[bool, int], float] = {}
        for invariant in (True, False):
            engine = ENGINES[attention](spec, threads=1, batch_invariant=invariant)
            run(engine, 4, 20, args.tokens)  # warm-up
            for c in levels:
                r = run(engine, c, args.steps, args.tokens)
                rates[invariant, c] = r["tokens"] / r["cpu_s"]
                print(f"  {attention:<6} invariant={invariant!s:<5} concurrency={c:<3} "
                      f"{rates[invariant, c]:8.1f} tokens per CPU-second", flush=True)
            engine.close()
        rows.append((attention, rates))
    print(f"\nbenchmark model (--preset bench), {args.tokens} tokens a sequence, 1 ONNX Runtime thread")
    print(f"{'layout':<7} {'concurrency':>11} | {'invariant tok/cpu-s':>19} {'free tok/cpu-s':>14} | "
          f"{'invariant/free':>14} | {'batching gain (invariant)':>25}")
    for attention, rates in rows:
        for c in levels:
            inv, free = rates[True, c], rates[False, c]
            print(f"{attention:<7} {c:>11} | {inv:19.1f} {free:14.1f} | {inv / free:13.2f}x | "
                  f"{inv / rates[True, levels[0]]:24.2f}x")


if __name__ == "__main__":
    main()
