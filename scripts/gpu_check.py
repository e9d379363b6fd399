#!/usr/bin/env python3
"""GPU check for the TensorRT backend, in well under 5 minutes on one GPU.

1. generates tiny-gpt and the bench model (``python -m streamfleet.shared.tinymodel --preset bench
   --attention concat``);
2. builds a TensorRT plan for each (and checks that a second build is a cache hit);
3. checks TensorRT greedy tokens against ONNX Runtime's for a set of prompts, each
   alone, all batched, and joining/leaving mid-way (a divergence where ONNX Runtime's
   top two logits were within rounding is reported as a near tie, not a failure);
4. prints decode tokens/s of the bench model at batch 1, 8 and 32 next to the
   memory-bandwidth bound (formula printed; H200 HBM ~4.8 TB/s, ``--bandwidth-tbs``).

``--dry-run`` needs no GPU: the TensorRT engine's data path runs emulated (device
memory in host memory, ONNX Runtime in place of the plan; streamfleet/devkit/trt_emulation.py) and
the throughput table is ONNX Runtime's on this CPU. Exit status: 0 all equal, 1 a
mismatch, 2 the environment lacks something (message says what).

    scripts/gpu_check.sh                     # the entry point (installs missing wheels from $WHEELS)
    python -m scripts.gpu_check --dry-run    # CPU only
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from streamfleet.devkit.greedy import Outcome, compare, greedy_alone, greedy_batched, greedy_staggered, random_prompts  # noqa: E402
from streamfleet.shared.errors import FatalError  # noqa: E402
from streamfleet.shared.modelrepo import ModelRepository, ModelSpec, ensure_artifacts  # noqa: E402
from streamfleet.workers.engines import trt_build, trt_plan  # noqa: E402

T0 = time.perf_counter()
TEXTS = [
    "The old lighthouse stood at the edge of the harbor",
    "Water boils at one hundred degrees",
    "def add(a, b):",
    "你好，世界！",
]


def say(msg: str = "") -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}" if msg else "", flush=True)


# -- environment -----------------------------------------------------------------------


def environment(dry: bool) -> None:
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for mod in ("onnxruntime", "onnx", "tensorrt"):
        try:
            versions[mod] = importlib.import_module(mod).__version__
        except ImportError:
            versions[mod] = "missing"
    say("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        say("gpu: " + (q.stdout.strip() or q.stderr.strip()))
    elif not dry:
        raise FatalError("no NVIDIA GPU here (nvidia-smi not found); use --dry-run on a CPU machine")
    if not dry:
        from streamfleet.workers.engines.cuda_mem import choose

        trt_build.import_tensorrt()
        say(f"cuda library: {choose('auto')[0]}")


def ensure_models(engines_dir: Path | None) -> dict[str, ModelSpec]:
    repo = ModelRepository(engines_dir)
    tiny = repo.get("tiny-gpt")
    ensure_artifacts(tiny)
    bench_dir = repo.root / "bench-gpt"
    if not (bench_dir / "engine.toml").exists() or not (bench_dir / "model.onnx").exists():
        # the with-past layout: TensorRT's ONNX parser does not take GroupQueryAttention
        subprocess.run([sys.executable, "-m", "streamfleet.shared.tinymodel", "--out", str(bench_dir),
                        "--preset", "bench", "--attention", "concat"], check=True)
    bench = ModelRepository(engines_dir).get("bench-gpt")
    ensure_artifacts(bench)
    for spec in (tiny, bench):
        info = trt_plan.read_graph_info(spec.onnx_path)
        say(f"model {spec.name}: {info.n_layer} layers, {info.kv_heads} kv heads x {info.head_dim}, vocab "
            f"{info.vocab_size}, {info.kv_dtype}; max_batch {spec.max_batch}, max_context {spec.max_context}; "
            f"weights {weight_bytes(spec.onnx_path) / 1e6:.1f} MB")
    return {"tiny-gpt": tiny, "bench-gpt": bench}


# -- plans -----------------------------------------------------------------------------


def build_plans(specs: list[ModelSpec]) -> None:
    for spec in specs:
        result = trt_build.build_plan(spec, log=lambda s: say(f"  {s}"))
        say(f"plan {spec.name}: {'built' if result.built else 'found'} {result.path.name} "
            f"({result.path.stat().st_size / 1e6:.1f} MB, build {result.seconds:.1f}s)")
        again = trt_build.build_plan(spec)
        if again.built or again.path != result.path:
            raise FatalError(f"a second build of {spec.name} was not a cache hit")


def make_engine(spec: ModelSpec, dry: bool, cuda: str) -> Any:
    if dry:
        from streamfleet.devkit.trt_emulation import emulated_engine

        return emulated_engine(spec)
    from streamfleet.workers.engines.tensorrt import TensorRTEngine

    return TensorRTEngine(spec, build_if_missing=False, cuda=cuda)


# -- correctness -----------------------------------------------------------------------


def correctness(spec: ModelSpec, dry: bool, cuda: str, lengths: list[int], steps: int, texts: bool) -> Outcome:
    from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

    ort = OnnxRuntimeEngine(spec)
    prompts = random_prompts(11, lengths, ort.vocab_size)
    if texts:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(spec.tokenizer_path))
        prompts.update({f"text{i}": tok.encode(t).ids for i, t in enumerate(TEXTS)})
    t = time.perf_counter()
    ref = {k: greedy_alone(ort, p, steps) for k, p in prompts.items()}
    say(f"{spec.name}: onnxruntime reference, {len(prompts)} prompts x {steps + 1} tokens "
        f"({time.perf_counter() - t:.1f}s)")
    ort.close()

    eng = make_engine(spec, dry, cuda)
    try:
        logits = eng.prefill(list(prompts.items()))
        for k in prompts:
            eng.release(k)
        want = np.array([ref[k][1][0] for k in prompts])
        diff = float(np.abs(logits - want).max())
        say(f"{spec.name}: prefill logits, max |trt - ort| = {diff:.2e} (logit spread {float(want.std()):.2f})")
        outcome = Outcome()
        t = time.perf_counter()
        compare(ref, {k: greedy_alone(eng, p, steps, seq_id=k)[0] for k, p in prompts.items()}, "alone",
                outcome=outcome)
        compare(ref, greedy_batched(eng, prompts, steps), "batched", outcome=outcome)
        compare(ref, greedy_staggered(eng, prompts, steps), "staggered", outcome=outcome)
        say(f"{spec.name}: greedy {'emulated-trt' if dry else 'tensorrt'} vs onnxruntime: {outcome} "
            f"({time.perf_counter() - t:.1f}s)")
        if diff > 5e-2:
            outcome.mismatches.append(f"{spec.name}: prefill logits differ by {diff:.2e}")
        return outcome
    finally:
        eng.close()


# -- throughput ------------------------------------------------------------------------


def weight_bytes(onnx_path: Path) -> int:
    """Bytes of the graph's initializers (the weights read once per decode step)."""
    import onnx

    sizes = {1: 4, 10: 2, 16: 2, 11: 8, 7: 8, 6: 4, 3: 1, 2: 1, 9: 1}
    model = onnx.load(str(onnx_path), load_external_data=False)
    return sum(int(np.prod(t.dims, dtype=np.int64)) * sizes.get(t.data_type, 4) for t in model.graph.initializer)


def bandwidth_bound(weights: int, info: trt_plan.GraphInfo, batch: int, context: float,
                    bandwidth: float) -> tuple[float, float]:
    """(tokens/s bound, bytes per step) with bytes/step = weights + KV read."""
    es = {"float32": 4, "float16": 2, "bfloat16": 2}[info.kv_dtype]
    kv = batch * info.n_layer * 2 * info.kv_heads * context * info.head_dim * es
    per_step = weights + kv
    return batch * bandwidth / per_step, per_step


def throughput(spec: ModelSpec, engine: Any, label: str, batches: list[int], prompt_len: int, warmup: int,
               steps: int, bandwidth: float) -> None:
    info = trt_plan.read_graph_info(spec.onnx_path)
    weights = weight_bytes(spec.onnx_path)
    es = {"float32": 4, "float16": 2, "bfloat16": 2}[info.kv_dtype]
    say(f"{spec.name} decode throughput ({label}); prompt {prompt_len} tokens, {warmup} warm-up steps, "
        f"{steps} timed steps")
    say("  bound: bytes/step = W + B*L*2*H*T*D*s, tokens/s <= B * BW / bytes/step")
    say(f"         W = {weights / 1e6:.1f} MB weights, L = {info.n_layer}, H = {info.kv_heads}, "
        f"D = {info.head_dim}, s = {es} bytes, T = mean context in the timed window, "
        f"BW = {bandwidth / 1e12:.1f} TB/s")
    say("  (the with-past graph also writes present = past + 1 slot each step: with that, "
        "bytes/step = W + 2*B*L*2*H*T*D*s)")
    say(f"  {'batch':>5} {'ms/step':>9} {'tokens/s':>10} {'bound tok/s':>12} {'% of bound':>10} "
        f"{'MB/step':>8} {'T':>6}")
    rng = np.random.default_rng(3)
    for b in batches:
        if b > engine.max_batch or prompt_len + warmup + steps >= engine.max_context:
            say(f"  {b:>5} skipped (max_batch {engine.max_batch}, max_context {engine.max_context})")
            continue
        ids = [f"t{i}" for i in range(b)]
        logits = engine.prefill([(k, [int(x) for x in rng.integers(1, engine.vocab_size, prompt_len)]) for k in ids])
        last = {k: int(r.argmax()) for k, r in zip(ids, logits)}
        for _ in range(warmup):
            out = engine.decode([(k, last[k]) for k in ids])
            last = {k: int(r.argmax()) for k, r in zip(ids, out)}
        t = time.perf_counter()
        for _ in range(steps):
            out = engine.decode([(k, last[k]) for k in ids])
            last = {k: int(r.argmax()) for k, r in zip(ids, out)}
        dt = time.perf_counter() - t
        for k in ids:
            engine.release(k)
        tps = b * steps / dt
        ctx = prompt_len + warmup + steps / 2
        bound, per_step = bandwidth_bound(weights, info, b, ctx, bandwidth)
        say(f"  {b:>5} {1e3 * dt / steps:>9.3f} {tps:>10.0f} {bound:>12.0f} {100 * tps / bound:>9.1f}% "
            f"{per_step / 1e6:>8.1f} {ctx:>6.0f}")


# -- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: emulated TensorRT data path, CPU throughput")
    ap.add_argument("--engines-dir", type=Path, default=None, help="model repository (default: <repo>/engines)")
    ap.add_argument("--cuda", default="auto", help="auto | cuda-python | pycuda")
    ap.add_argument("--steps", type=int, default=24, help="greedy tokens per prompt (tiny-gpt)")
    ap.add_argument("--bench-steps", type=int, default=64, help="timed decode steps per batch size")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes for the throughput table")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="GPU memory bandwidth, TB/s (H200: 4.8)")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args(argv)
    dry = args.dry_run
    try:
        environment(dry)
        specs = ensure_models(args.engines_dir)
        if not dry:
            build_plans(list(specs.values()))
        outcomes = [
            correctness(specs["tiny-gpt"], dry, args.cuda, [1, 2, 5, 17, 40, 63, 100, 180], args.steps, texts=True),
            correctness(specs["bench-gpt"], dry, args.cuda, [3, 31, 150, 300], max(8, args.steps // 2), texts=False),
        ]
        if not args.skip_throughput:
            batches = [int(b) for b in args.batches.split(",") if b]
            bench = specs["bench-gpt"]
            if dry:
                from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

                eng: Any = OnnxRuntimeEngine(bench)
                label = "onnxruntime on this CPU; the bound is the GPU's"
            else:
                eng = make_engine(bench, dry, args.cuda)
                label = f"tensorrt, {getattr(eng._mem, 'name', '?')}"
            try:
                throughput(bench, eng, label, batches, 64, 8, args.bench_steps, args.bandwidth_tbs * 1e12)
            finally:
                eng.close()
    except FatalError as exc:
        say(f"error: {exc.message}")
        return 2
    bad = [m for o in outcomes for m in o.mismatches]
    ties = sum(len(o.near_ties) for o in outcomes)
    say(f"{'FAIL' if bad else 'OK'}: {sum(o.exact for o in outcomes)} sequences equal, {ties} near ties, "
        f"{len(bad)} mismatches{' (dry run: TensorRT emulated)' if dry else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
