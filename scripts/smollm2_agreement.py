#!/usr/bin/env python
"""How each weights mode of the GGUF import answers beside the reference, and what it
costs: the figures of docs/models.md ("Weights").

The reference is ``tests/fixtures/smollm2/reference.json``: transformers (torch, fp32)
loading SmolLM2-135M-Instruct's GGUF file, 64 greedy tokens for each of 10 prompts (chat
and plain; ``scripts/make_smollm2_reference.py`` made it). For each ``--weights`` mode
this imports the same file into a scratch folder and, on the ONNX Runtime engine with
``--threads`` threads:

* greedy tokens of every prompt alone, then all prompts batched with staggered joins
  and leaves (``streamfleet.devkit.greedy.greedy_staggered``), against the reference: prompts equal
  over all 64 tokens, tokens equal up to the first divergence, and where a prompt
  diverges, the index and the reference's top-1/top-2 margin there;
* the time of one decode step at batch 1 and 16 (median of 20), and of the 158-token
  prefill;
* the graph's weights on disk and the process's resident memory once loaded.

    python -m scripts.smollm2_agreement [--weights q4,fp32,int8,q4-int8act] [--threads 2]

It needs the GGUF file in the cache (``streamfleet serve`` fetches it; or
``SF_CACHE_DIR``); nothing else is downloaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from scripts import benchtable
from streamfleet.devkit.greedy import greedy_alone, greedy_staggered
from streamfleet.shared.ggufimport import WEIGHT_MODES, import_gguf
from streamfleet.shared.modelrepo import ModelRepository
from streamfleet.shared.packagefetch import PackageFile, cached_path
from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "tests" / "fixtures" / "smollm2" / "reference.json"


def gguf_file() -> Path:
    spec = ModelRepository(REPO / "engines").get("smollm2-135m")
    path = cached_path(PackageFile.from_table(spec.source, "engines/smollm2-135m/engine.toml"))
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `streamfleet serve` once (it fetches the model)")
    return path


def agreement(ref: dict, got: dict[str, list[int]]) -> tuple[int, int, int, list[str]]:
    """(prompts equal throughout, tokens equal before the first divergence, tokens
    compared, notes on each divergence)."""
    equal = same = total = 0
    notes = []
    for case in ref["cases"]:
        want, tokens = case["greedy_ids"], got[case["name"]]
        n = min(len(want), len(tokens))
        first = next((i for i in range(n) if want[i] != tokens[i]), None)
        total += n
        if first is None:
            equal += 1
            same += n
        else:
            same += first
            notes.append(f"{case['name']}: token {first} (reference margin {case['margins'][first]:.4f})")
    return equal, same, total, notes


def step_ms(engine: OnnxRuntimeEngine, prompt: list[int], batch: int) -> float:
    ids = [f"t{i}" for i in range(batch)]
    rows = engine.prefill([(i, prompt) for i in ids])
    tokens = [int(r.argmax()) for r in rows]
    times = []
    for _ in range(20):
        t = time.perf_counter()
        rows = engine.decode(list(zip(ids, tokens)))
        times.append((time.perf_counter() - t) * 1000)
        tokens = [int(r.argmax()) for r in rows]
    for i in ids:
        engine.release(i)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="q4,fp32,int8,q4-int8act")
    ap.add_argument("--threads", type=int, default=2)
    benchtable.add_argument(ap)
    args = ap.parse_args()
    ref = json.loads(REFERENCE.read_text())
    src = gguf_file()
    prompts = {c["name"]: c["prompt_ids"] for c in ref["cases"]}
    steps = ref["steps"] - 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="sf-agree-") as tmp:
        for weights in args.weights.split(","):
            if weights not in WEIGHT_MODES:
                raise SystemExit(f"unknown weights mode {weights!r}")
            dest, _ = import_gguf(src, Path(tmp), weights, weights=weights, max_batch=32, force=True)
            rss0 = psutil.Process().memory_info().rss
            engine = OnnxRuntimeEngine(ModelRepository(Path(tmp)).get(weights), threads=args.threads)
            rss = (psutil.Process().memory_info().rss - rss0) / 2**20
            alone = {k: greedy_alone(engine, p, steps, seq_id=k)[0] for k, p in prompts.items()}
            staggered = greedy_staggered(engine, prompts, steps)
            # staggered sequences leave early by design: pad to the reference's length with
            # their alone tokens only for counting is wrong; compare what each produced
            a = agreement(ref, alone)
            b = agreement(ref, dict(staggered.items()))
            long_prompt = max(prompts.values(), key=len)
            t = time.perf_counter()
            engine.prefill([("pf", long_prompt)])
            prefill = (time.perf_counter() - t) * 1000
            engine.release("pf")
            d1, d16 = step_ms(engine, prompts["france_chat"], 1), step_ms(engine, prompts["france_chat"], 16)
            size = sum(f.stat().st_size for f in dest.glob("model.onnx*")) / 2**20
            rows.append((weights, a, b, d1, d16, prefill, size, rss))
            engine.close()
            del engine
            print(f"{weights}: alone {a[0]}/{len(prompts)} prompts equal, {a[1]}/{a[2]} tokens; "
                  f"staggered {b[0]}/{len(prompts)}, {b[1]}/{b[2]}", flush=True)
            for note in a[3]:
                print(f"    alone     {note}")
            for note in b[3]:
                print(f"    staggered {note}")
    print(f"\n{'weights':<11} {'alone: prompts / tokens':>24} {'staggered':>18} {'step b=1':>9} {'b=16':>8} "
          f"{'prefill 158':>12} {'on disk':>8} {'RSS':>7}")
    for weights, a, b, d1, d16, prefill, size, rss in rows:
        print(f"{weights:<11} {f'{a[0]}/10 / {100 * a[1] / a[2]:.1f} %':>24} "
              f"{f'{b[0]}/10 / {100 * b[1] / b[2]:.1f} %':>18} "
              f"{d1:>7.1f}ms {d16:>6.1f}ms {prefill:>10.0f}ms {size:>6.0f}MB {rss:>5.0f}MB")
    print(f"\n{psutil.cpu_count()} cores, {args.threads} ONNX Runtime threads; reference: {REFERENCE.name} "
          f"({ref['versions']})")


if __name__ == "__main__":
    sys.exit(benchtable.main(main))
