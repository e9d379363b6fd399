"""The GroupQueryAttention engine (workers/engines/onnx_gqa.py) beside the current ONNX
Runtime engine (workers/engines/onnxruntime.py) on the same GGUF file, side by side in one
process: decode step times at batch 1 and 16 at a short and a long context, a 512-token
prefill, in each weights mode, and whether the rows of a run are computed independently
(1 to 32 rows).

    python -m scripts.bench_gqa [--weights q4 fp32 q4-int8act] [--threads 2] [--reps 7]

Each figure is the median of ``--reps`` x ``--steps`` timed decode steps (four times as
many at batch 1) or ``--reps`` prefills. The engines take turns, a block of steps each
(one untimed step, then ``--steps`` timed: consecutive steps, as a serving engine runs,
with its weights warm in the caches), the order rotating each repetition, so that load
on the machine falls on all alike. Ratios are the current engine's time over the GQA
engine's (above 1: GQA is faster). Where ``gqa`` and ``gqa-fast`` are the
same engine (a graph whose rows are independent for any number of rows) their ratio is
the run's noise. Engines:

* ``cur``: ``OnnxRuntimeEngine`` as served (``batch_invariant`` true: grouped decode by
  past width where the graph allows it, else the padded slab; a 4-bit graph always slabs);
* ``cur-slab``: the same with ``batch_invariant = false`` (one padded run a step);
* ``gqa``: ``OnnxGqaEngine`` as served (batch-invariant; a 4-bit graph runs one-token runs
  with two rows);
* ``gqa-fast``: ``batch_invariant = false`` (a lone row runs alone).

Columns: ``cur/gqa`` and ``slab/gqa``, the current engine's time over the GQA engine's;
``gqa/fast``, what batch invariance costs the GQA engine (1.00: nothing). ``cur-slab`` is
left out where ``cur`` slabs already (a 4-bit graph).

At batch 16 the sequences' lengths are staggered over the last quarter of the context (row i
keeps ``context - i * context / 64`` tokens), as a serving batch's are; they are forked
from one prefilled prompt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from scripts import benchtable
from streamfleet.shared.gguf_gqa import GQA_GRAPH_FILE, write_gqa_graph
from streamfleet.shared.ggufimport import import_gguf, read_gguf
from streamfleet.shared.modelrepo import REPO_ROOT, ModelRepository
from streamfleet.shared.packagefetch import PackageFile, cached_path

ENGINES = ("cur", "cur-slab", "gqa", "gqa-fast")


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "?").strip()
    flags = set(fields.get("Flags", "").split())
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "avx_vnni") if f in flags]
    return f"{name} ({os.cpu_count()} CPUs visible; {' '.join(simd) or 'no AVX2'})"


def folder(root: Path, gguf: Path, weights: str, max_context: int) -> Path:
    """The current graph and the GQA graph of ``gguf`` in ``weights`` (built once)."""
    dest = root / weights
    if not (dest / GQA_GRAPH_FILE).is_file() or not (dest / "engine.toml").is_file():
        import_gguf(gguf, root, weights, weights=weights, max_batch=32, max_context=max_context, force=True)
        write_gqa_graph(read_gguf(gguf), dest, weights=weights, max_context=max_context)
    return dest


def make(name: str, spec, threads: int):
    from streamfleet.workers.engines.onnx_gqa import OnnxGqaEngine
    from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

    if name == "cur":
        return OnnxRuntimeEngine(spec, threads=threads)
    if name == "cur-slab":
        return OnnxRuntimeEngine(spec, threads=threads, batch_invariant=False)
    if name == "gqa":
        return OnnxGqaEngine(spec, threads=threads)
    return OnnxGqaEngine(spec, threads=threads, batch_invariant=False)


class DecodeCase:
    """``batch`` sequences forked from one prompt of ``context`` tokens (row i keeps
    ``context - i * context / (4 batch)`` of them: staggered over the last quarter),
    decoded ``steps`` steps per repetition."""

    def __init__(self, engine, prompt: list[int], batch: int, context: int) -> None:
        self.engine = engine
        engine.prefill([("src", prompt[:context])])
        self.ids = [f"d{i}" for i in range(batch)]
        for i, d in enumerate(self.ids):
            engine.fork("src", [d], length=context - (i * context) // (4 * batch))
        engine.release("src")
        self.token = 17

    def rep(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            feed = [(d, self.token) for d in self.ids]
            t = time.perf_counter()
            self.engine.decode(feed)
            times.append(time.perf_counter() - t)
        return times

    def close(self) -> None:
        for d in self.ids:
            self.engine.release(d)


def bench_decode(engines: dict, prompt: list[int], batch: int, context: int, reps: int, steps: int) -> dict:
    cases = {n: DecodeCase(e, prompt, batch, context) for n, e in engines.items()}
    for c in cases.values():  # warm-up: kernels, buffers, slabs
        c.rep(2)
    times: dict[str, list[float]] = {n: [] for n in cases}
    order = list(cases)
    for _ in range(reps):
        # engine after engine, a block of steps each (as a serving engine runs: its weights
        # warm in the caches; one untimed step first), the order rotating each repetition
        for n in order:
            cases[n].rep(1)
            times[n] += cases[n].rep(steps)
        order = order[1:] + order[:1]
    for c in cases.values():
        c.close()
    return {n: statistics.median(t) for n, t in times.items()}


def bench_prefill(engines: dict, prompt: list[int], reps: int) -> dict:
    times: dict[str, list[float]] = {n: [] for n in engines}
    for e in engines.values():  # warm-up
        e.prefill([("w", prompt)])
        e.release("w")
    order = list(engines)
    for _ in range(reps):
        for n in order:
            e = engines[n]
            t = time.perf_counter()
            e.prefill([("p", prompt)])
            times[n].append(time.perf_counter() - t)
            e.release("p")
        order = order[1:] + order[:1]
    return {n: statistics.median(t) for n, t in times.items()}


def rows_independence(engine, rows: int = 32, seed: int = 0) -> list[tuple[int, int, int]]:
    """For M = 1..rows: (M, rows of a run of M equal to the row alone, rows equal to a run
    of ``rows``): ``rows`` sequences of lengths 5..100 decode one token each in runs over
    the first M rows (the GQA engine's buffers; a run is repeated as often as needed: it
    writes its token's K/V into the same free slot)."""
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(5, 100, rows)]
    engine.prefill([(f"r{i}", [int(t) for t in rng.integers(1, engine.vocab_size, n)]) for i, n in enumerate(lengths)])
    tokens = rng.integers(1, engine.vocab_size, (rows, 1))
    alone = [engine._run(r, r + 1, tokens[r:r + 1], [lengths[r]])[0, -1] for r in range(rows)]
    runs = {m: engine._run(0, m, tokens[:m], lengths[:m])[:, -1] for m in range(1, rows + 1)}
    for i in range(rows):
        engine.release(f"r{i}")
    full = runs[rows]
    return [(m, sum(np.array_equal(runs[m][r], alone[r]) for r in range(m)),
             sum(np.array_equal(runs[m][r], full[r]) for r in range(m))) for m in range(1, rows + 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", nargs="+", default=["q4", "fp32", "q4-int8act"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="decode steps per repetition")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[30, 1000])
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--rows", type=int, default=32, help="rows for the independence check (0: skip)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "streamfleet" / "bench_gqa")
    ap.add_argument("--gguf", type=Path, default=None)
    benchtable.add_argument(ap)
    args = ap.parse_args(argv)

    import onnxruntime

    spec0 = ModelRepository(REPO_ROOT / "engines").get("smollm2-135m")
    gguf = args.gguf or cached_path(PackageFile.from_table(spec0.source, "engine.toml"))
    print(f"CPU: {cpu_model()}")
    print(f"ONNX Runtime {onnxruntime.__version__}, {args.threads} threads; model {gguf.name}; "
          f"medians of {args.reps} reps x {args.steps} steps (decode), {args.reps} prefills")
    rng = np.random.default_rng(0)
    longest = max(args.contexts + [args.prefill])
    prompt = [int(t) for t in rng.integers(1, 49152, longest)]
    for weights in args.weights:
        spec = ModelRepository(args.work).get(folder(args.work, gguf, weights, 4096).name)
        engines = {n: make(n, spec, args.threads) for n in args.engines}
        if "cur" in engines and "cur-slab" in engines and not engines["cur"].batch_invariant:
            engines["cur-slab"].close()  # the same engine: the graph cannot be invariant, it slabs anyway
            engines["cur-slab"] = engines["cur"]
            del engines["cur-slab"]
        gqa = engines.get("gqa")
        if gqa is not None:
            print(f"\n== weights {weights}: GQA rows probe {gqa.rows_probe!r}, min_rows {gqa.min_rows}; current "
                  f"engine batch_invariant {engines['cur'].batch_invariant if 'cur' in engines else '?'}")
        else:
            print(f"\n== weights {weights}")
        print(f"{'case':<28}" + "".join(f"{n:>11}" for n in engines) + "    cur/gqa  slab/gqa  gqa/fast")
        rows = []
        for ctx in args.contexts:
            for b in args.batches:
                steps = args.steps * (4 if b == 1 else 1)  # cheap steps: more of them
                rows.append((f"decode b={b} ctx~{ctx} (ms)", bench_decode(engines, prompt, b, ctx, args.reps, steps)))
        rows.append((f"prefill {args.prefill} (ms)", bench_prefill(engines, prompt[:args.prefill], args.reps)))
        for label, t in rows:
            line = f"{label:<28}" + "".join(f"{t[n] * 1e3:>11.2f}" for n in engines)
            ratio = lambda a, b: f"{t[a] / t[b]:>9.2f}x" if a in t and b in t else f"{'':>10}"  # noqa: E731
            line += " " + ratio("cur", "gqa") + ratio("cur-slab", "gqa") + ratio("gqa", "gqa-fast")
            print(line, flush=True)
        if args.rows and gqa is not None:
            fast = engines.get("gqa-fast") or make("gqa-fast", spec, args.threads)
            res = rows_independence(fast, args.rows)
            alone = [m for m, a, _ in res if a == m]
            among = [m for m, _, f in res if f == m]
            print(f"rows independent (GQA graph, decode, lengths 5..100): equal to alone for M in "
                  f"{_spans(alone)} of 1..{args.rows}; equal to a run of {args.rows} for M in {_spans(among)}")
        print(f"load average during the mode: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
        for e in engines.values():
            e.close()
    return 0


def _spans(ms: list[int]) -> str:
    if not ms:
        return "none"
    out, start = [], ms[0]
    for a, b in zip(ms, ms[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


if __name__ == "__main__":
    sys.exit(benchtable.main(main))
