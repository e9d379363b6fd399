"""Execution chosen by measurement: ``weights = "auto"`` (docs/models.md, "Execution modes").

A GGUF model folder whose ``engine.toml`` says ``weights = "auto"`` holds a
GroupQueryAttention graph (shared/gguf_gqa.py, served by workers/engines/onnx_gqa.py)
for each candidate mode of the same file:

==============  =============================  ======================================
mode            graph                          what runs
==============  =============================  ======================================
``q4``          ``model.gqa.onnx``             4-bit weights, fp32 activations
``q4-int8act``  ``model.gqa.q4-int8act.onnx``  the same 4-bit weights with 8-bit
                                               activations (llama.cpp's path), the
                                               first and last blocks in fp32
``fp32``        ``model.gqa.fp32.onnx``        dequantized fp32 weights (the reference)
==============  =============================  ======================================

and an ``execution.json`` that records, once per file and importer,

* **quality** (``shared/quality.py``): each mode's perplexity, mean KL divergence and
  same-top-1 rate against ``fp32`` over ``shared/corpus/alice.txt``, and whether it passes
  the gate of ``[execution]`` in ``engine.toml``: mean KLD at most ``max_kld`` (for
  SmolLM2, llama.cpp's own on the same file and text) and perplexity at most
  ``max_ppl_ratio`` times fp32's (1.01). A mode that is not exact in the weights (8-bit
  activations) needs a ``max_kld``; without one it is not a candidate;
* per CPU (model name, the instruction sets that pick ONNX Runtime's kernels, cores):
  each mode's decode step at batch 1 and 16 as its engine runs it, and the mode chosen,
  the fastest passing one (lowest geometric mean of the two), with why.

The choice is made when the folder is imported (first use) and again when a worker
starts on a CPU the record does not hold; ``weights = "q4"`` (or any mode) in
``engine.toml`` pins one and measures nothing. ``served(spec)`` says what serves.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamfleet.shared.errors import FatalError
from streamfleet.shared.folder import ModelFolder
from streamfleet.shared.ggufimport import AUTO, AUTO_GRAPH_FILE, AUTO_MODES as CANDIDATES, GgufModel

if TYPE_CHECKING:
    import onnxruntime as ort

__all__ = ["AUTO", "CANDIDATES", "EXECUTION_FILE", "Served", "cpu_signature", "describe", "graph_file",
           "graph_path", "import_auto", "measure", "needs_measuring", "served", "time_graph",
           "write_auto_graphs"]

REFERENCE = "fp32"
#: modes whose weights and products are those of the file (sums in another order): no
#: KL-divergence bound needed to be a candidate
EXACT = ("q4", "fp32")
EXECUTION_FILE = "execution.json"
#: the record's layout; another is measured again
RECORD_VERSION = 1
#: perplexity at most this many times fp32's, unless ``[execution] max_ppl_ratio`` says
DEFAULT_PPL_RATIO = 1.01
#: the instruction sets that choose ONNX Runtime's (MLAS) and llama.cpp's CPU kernels
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "amx_int8", "amx_bf16", "asimd", "asimddp", "i8mm", "sve")


def cpu_signature() -> dict[str, Any]:
    """This CPU as far as kernel choice and timing go: its model name, the instruction
    sets among ``ISA_FLAGS`` it has and its logical cores."""
    name, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                if name and flags:
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    cores = os.cpu_count() or 1
    return {"model": name, "isa": [f for f in ISA_FLAGS if f in flags], "cores": cores}


def _key(sig: dict[str, Any]) -> str:
    return f"{sig['model']} | {' '.join(sig['isa']) or '-'} | {sig['cores']} cores"


def _read(folder: Path) -> dict[str, Any]:
    try:
        record = json.loads((folder / EXECUTION_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) and record.get("version") == RECORD_VERSION else {}


def _write(folder: Path, record: dict[str, Any]) -> None:
    tmp = folder / (EXECUTION_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(folder / EXECUTION_FILE)


class Served:
    """What serves a model folder on this CPU: ``mode``, its ``graph`` (a file of the
    folder) and ``why`` (one line)."""

    __slots__ = ("mode", "graph", "why", "pinned")

    def __init__(self, mode: str, graph: str, why: str, pinned: bool) -> None:
        self.mode, self.graph, self.why, self.pinned = mode, graph, why, pinned


def served(spec: ModelFolder) -> Served | None:
    """The mode a GGUF folder serves on this CPU: its pinned ``weights``, or the one
    ``execution.json`` chose for this CPU (None for a folder that names no weights mode,
    and for an ``auto`` folder not measured on this CPU yet: ``measure`` first)."""
    weights = spec.options.get("weights")
    if weights is None:
        return None
    if weights != AUTO:
        return Served(str(weights), spec.onnx, f"pinned: weights = \"{weights}\" in engine.toml", True)
    record = _read(spec.path)
    entry = record.get("cpus", {}).get(_key(cpu_signature()))
    if not entry:
        return None
    return Served(entry["chosen"], graph_file(entry["chosen"]), entry["why"], False)


def graph_path(spec: ModelFolder) -> Path:
    """The graph a worker loads for ``spec``: the chosen mode's in an ``auto`` folder,
    else ``engine.toml``'s ``onnx``.

    Raises:
        FatalError: an ``auto`` folder with no choice for this CPU (``ensure_artifacts``
            makes it).
    """
    if spec.options.get("weights") != AUTO:
        return spec.onnx_path
    s = served(spec)
    if s is None:
        raise FatalError(f"{spec.path}: weights = \"auto\" but no mode was chosen for this CPU yet "
                         f"({_key(cpu_signature())}); `streamfleet engines quality {spec.name}` or "
                         f"starting a worker measures it")
    return spec.path / s.graph


# -- the graphs ---------------------------------------------------------------------------------

def graph_file(mode: str) -> str:
    """The graph of ``mode`` in an ``auto`` folder: GroupQueryAttention graphs
    (shared/gguf_gqa.py, served by workers/engines/onnx_gqa.py), ``model.gqa.onnx`` for
    ``q4``, ``model.gqa.MODE.onnx`` for the others, each with its weights in ``.data``."""
    return AUTO_GRAPH_FILE if mode == "q4" else f"model.gqa.{mode}.onnx"


def write_auto_graphs(m: GgufModel, dest: Path, *, max_context: int, sha256: str | None = None,
                      say: Callable[[str], None] = lambda _: None) -> None:
    """Every candidate's GroupQueryAttention graph of the GGUF model ``m`` in ``dest``, and
    the tokenizer and config files, stamped ``auto`` (``importer_digest``)."""
    from streamfleet.shared.gguf_gqa import write_gqa_graph
    from streamfleet.shared.ggufimport import DIGEST_KEY, importer_digest, write_tokenizer_files
    from streamfleet.shared.packagefetch import sha256_of

    dest = Path(dest)
    sha = sha256 or sha256_of(m.path)
    stamp = {DIGEST_KEY: importer_digest(sha, AUTO)}
    write_tokenizer_files(m, dest, max_context=max_context)
    say("writing the q4 graph (4-bit weights, fp32 activations)")
    write_gqa_graph(m, dest, weights="q4", max_context=max_context, source_sha256=sha, graph_file=graph_file("q4"),
                    metadata=stamp)
    say("writing the q4-int8act graph (8-bit activations; its first and last blocks in fp32)")
    write_gqa_graph(m, dest, weights="q4-int8act", max_context=max_context, source_sha256=sha,
                    graph_file=graph_file("q4-int8act"), metadata=stamp)
    say("writing the fp32 graph (the reference: every matrix dequantized)")
    write_gqa_graph(m, dest, weights="fp32", max_context=max_context, source_sha256=sha,
                    graph_file=graph_file("fp32"), metadata=stamp)


def import_auto(source: Path, dest_root: Path, name: str, *, max_batch: int = 16, max_context: int | None = None,
                force: bool = False, max_kld: float | None = None,
                say: Callable[[str], None] = lambda _: None) -> tuple[Path, str]:
    """``streamfleet engines import FILE.gguf --weights auto``: the folder with every
    candidate's graph and an ``engine.toml`` saying ``weights = "auto"`` (measured when a
    worker first starts on it, or by ``measure``)."""
    from streamfleet.shared.ggufimport import import_gguf

    return import_gguf(source, dest_root, name, weights=AUTO, max_batch=max_batch, max_context=max_context,
                       force=force, max_kld=max_kld,
                       write_graphs=lambda m, dest, max_context: write_auto_graphs(m, dest, max_context=max_context,
                                                                                   say=say))


def candidates_present(folder: Path) -> bool:
    return all((folder / graph_file(mode)).exists() for mode in CANDIDATES)


# -- timing -------------------------------------------------------------------------------------

def time_graph(session: ort.InferenceSession, prompt: list[int], batches: tuple[int, ...] = (1, 16), steps: int = 12,
               min_rows: int = 1) -> dict[int, float]:
    """The median decode step (ms) of a GroupQueryAttention graph's session at each batch
    size, run as its engine runs it (the KV buffer updated in place; at least
    ``min_rows`` rows): ``prompt`` prefilled in every row, then ``steps`` steps (after
    two not counted), each row fed its greedy token."""
    from streamfleet.shared.quality import SharedBufferRunner

    out: dict[int, float] = {}
    for batch in batches:
        rows, n = max(batch, min_rows), len(prompt)
        runner = SharedBufferRunner(session, rows, n + steps + 2)
        lengths = np.full(rows, n)
        logits = runner.run(np.tile(np.asarray(prompt, dtype=np.int64), (rows, 1)), lengths)
        times = []
        for step in range(steps + 2):
            lengths = lengths + 1
            t = time.perf_counter()
            logits = runner.run(logits[:, -1].argmax(-1)[:, None], lengths)
            if step >= 2:
                times.append((time.perf_counter() - t) * 1000)
        out[batch] = statistics.median(times)
    return out


# -- the choice ---------------------------------------------------------------------------------

#: rounds of the timing: every mode is timed once a round, in a rotated order, and a mode's
#: figure is the median of its rounds, so that load on the machine while it measures (other
#: workers starting, a test suite) falls on every mode alike rather than on one
TIMING_ROUNDS = 5


def _time_modes(folder: Path, threads: int | None, prompt: list[int],
                say: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """Each candidate's decode step at batch 1 and 16 (every one, so that the record shows
    what a failing mode would gain), ``TIMING_ROUNDS`` rounds taking turns; the GQA engine
    runs a 4-bit graph's lone row beside a second (its kernel computes one row alone
    differently), for batch invariance: timed as it runs."""
    from streamfleet.shared.quality import open_graph

    say(f"timing {', '.join(CANDIDATES)} (decode steps at batch 1 and 16, {TIMING_ROUNDS} rounds taking turns)")
    sessions = {mode: open_graph(folder / graph_file(mode), threads) for mode in CANDIDATES}
    runs: dict[str, list[dict[int, float]]] = {mode: [] for mode in CANDIDATES}
    for r in range(TIMING_ROUNDS):
        order = CANDIDATES[r % len(CANDIDATES):] + CANDIDATES[:r % len(CANDIDATES)]
        for mode in order:
            runs[mode].append(time_graph(sessions[mode], prompt, steps=6, min_rows=2 if mode == "q4" else 1))
    return {mode: {"step_ms_b1": round(statistics.median(t[1] for t in got), 2),
                   "step_ms_b16": round(statistics.median(t[16] for t in got), 2)} for mode, got in runs.items()}


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def gate(spec: ModelFolder) -> tuple[float | None, float]:
    """``[execution]``'s ``max_kld`` (None: not given) and ``max_ppl_ratio``.

    Raises:
        FatalError: a value that is not a positive number.
    """
    table = spec.options.get("execution", {})
    if not isinstance(table, dict):
        raise FatalError(f"{spec.path / 'engine.toml'}: [execution] must be a table")
    out: list[float | None] = []
    for key, default in (("max_kld", None), ("max_ppl_ratio", DEFAULT_PPL_RATIO)):
        value = table.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise FatalError(f"{spec.path / 'engine.toml'}: [execution] {key} must be a positive number, "
                             f"not {value!r}")
        out.append(None if value is None else float(value))
    ratio = out[1]
    assert ratio is not None  # it has a default
    return out[0], ratio


def needs_measuring(spec: ModelFolder, stamp: str) -> bool:
    """Whether an ``auto`` folder lacks this file's and importer's quality figures or a
    choice for this CPU."""
    record = _read(spec.path)
    return (record.get("stamp") != stamp or "quality" not in record
            or _key(cpu_signature()) not in record.get("cpus", {}))


def _passes(q: dict[str, Any], mode: str, ref_ppl: float, max_kld: float | None, max_ratio: float
            ) -> tuple[bool, str]:
    if mode not in EXACT and max_kld is None:
        return False, "not exact in the weights and [execution] max_kld is not set"
    if max_kld is not None and q["mean_kld"] > max_kld:
        return False, f"mean KLD {q['mean_kld']:.5f} > {max_kld:.5f}"
    if q["ppl"] > ref_ppl * max_ratio:
        return False, f"perplexity {q['ppl']:.3f} > {max_ratio:g} x fp32's {ref_ppl:.3f}"
    return True, (f"mean KLD {q['mean_kld']:.5f}" + (f" <= {max_kld:.5f}" if max_kld is not None else "")
                  + f", perplexity {q['ppl'] / ref_ppl:.4f} x fp32's")


def measure(spec: ModelFolder, stamp: str, *, threads: int | None = None, say: Callable[[str], None] = lambda _: None,
            chunks: int | None = None) -> dict[str, Any]:
    """Measure what ``needs_measuring`` says is missing (the quality of every candidate,
    once per file and importer; the step times and the choice, once per CPU) and write
    ``execution.json``; returns the record. The caller holds the folder's import lock.

    Raises:
        FatalError: a graph is missing, or no candidate passes the gate (fp32 always does).
    """
    from tokenizers import Tokenizer

    from streamfleet.shared.quality import DEFAULT_CTX, QUALITY_TEXT, evaluate

    folder = spec.path
    if not candidates_present(folder):
        raise FatalError(f"{folder}: the graphs of weights = \"auto\" are missing "
                         f"({', '.join(map(graph_file, CANDIDATES))})")
    record = _read(folder)
    if record.get("stamp") != stamp:
        record = {"version": RECORD_VERSION, "stamp": stamp}
    max_kld, max_ratio = gate(spec)
    ids = Tokenizer.from_file(str(spec.tokenizer_path)).encode(QUALITY_TEXT.read_text()).ids
    sig = cpu_signature()
    quality = record.get("quality")
    if quality is None:
        # llama-perplexity's chunks of 512 tokens, or the model's context where it is shorter
        n_ctx = min(DEFAULT_CTX, spec.max_context) // 2 * 2
        say(f"measuring each mode's quality against fp32 ({QUALITY_TEXT.name}, chunks of {n_ctx} tokens; "
            f"once per model file)")
        got = evaluate({m: folder / graph_file(m) for m in CANDIDATES}, REFERENCE, ids, n_ctx=n_ctx, chunks=chunks,
                       threads=threads, progress=say)
        quality = {"text": QUALITY_TEXT.name, "n_ctx": n_ctx, "tokens": got[REFERENCE].tokens,
                   "reference": REFERENCE, "measured_on": _key(sig), "modes": {m: q.as_dict() for m, q in got.items()}}
        record["quality"] = quality
    # the gate is engine.toml's now, whatever it was when the figures were taken
    ref_ppl = quality["modes"][REFERENCE]["ppl"]
    verdicts = {m: _passes(quality["modes"][m], m, ref_ppl, max_kld, max_ratio) for m in CANDIDATES}
    record["gate"] = {"max_kld": max_kld, "max_ppl_ratio": max_ratio,
                      "verdicts": {m: {"passes": ok, "why": why} for m, (ok, why) in verdicts.items()}}
    key = _key(sig)
    cpus = record.setdefault("cpus", {})
    if key not in cpus:
        timings = _time_modes(folder, threads, ids[:32], say)
        eligible = [m for m in CANDIDATES if verdicts[m][0]]
        if not eligible:
            raise FatalError(f"{folder}: no execution mode passes the quality gate")

        def score(mode: str) -> float:
            return math.sqrt(timings[mode]["step_ms_b1"] * timings[mode]["step_ms_b16"])

        chosen = min(eligible, key=score)
        others = ", ".join(f"{m} {timings[m]['step_ms_b1']:.1f}/{timings[m]['step_ms_b16']:.1f} ms"
                           for m in CANDIDATES if m != chosen)
        failed = ", ".join(f"{m} ({verdicts[m][1]})" for m in CANDIDATES if not verdicts[m][0])
        why = (f"fastest passing the quality gate on this CPU: step {timings[chosen]['step_ms_b1']:.1f} ms at batch "
               f"1, {timings[chosen]['step_ms_b16']:.1f} ms at 16" + (f" (vs {others})" if others else "")
               + f"; {verdicts[chosen][1]}" + (f"; not eligible: {failed}" if failed else ""))
        cpus[key] = {"cpu": sig, "threads": threads or sig["cores"], "load_average": _load(),
                     "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "timings": timings, "chosen": chosen, "why": why}
        say(f"execution: {chosen}: {why}")
    _write(folder, record)
    return record


def describe(record: dict[str, Any]) -> list[str]:
    """The record as a table: each candidate's quality, its step times on this CPU and its
    verdict; then what serves and why."""
    key = _key(cpu_signature())
    quality = record.get("quality", {})
    verdicts = record.get("gate", {}).get("verdicts", {})
    entry = record.get("cpus", {}).get(key, {})
    timings = entry.get("timings", {})
    lines = [f"{'mode':<11} {'PPL':>8} {'mean KLD':>10} {'same top-1':>11} {'step b=1':>9} {'b=16':>9}  gate"]
    for mode in CANDIDATES:
        q = quality.get("modes", {}).get(mode)
        t = timings.get(mode, {})
        v = verdicts.get(mode, {})
        if q is None:
            continue
        lines.append(f"{mode:<11} {q['ppl']:>8.3f} {q['mean_kld']:>10.5f} {100 * q['same_top1']:>10.1f}% "
                     f"{t.get('step_ms_b1', float('nan')):>7.1f}ms {t.get('step_ms_b16', float('nan')):>7.1f}ms  "
                     f"{'passes' if v.get('passes') else 'fails'}: {v.get('why', '')}")
    gate_ = record.get("gate", {})
    lines.append(f"quality: {quality.get('text')} ({quality.get('tokens')} scored tokens, chunks of "
                 f"{quality.get('n_ctx')}) against {quality.get('reference')}; gate: mean KLD <= "
                 f"{gate_.get('max_kld')}, perplexity <= {gate_.get('max_ppl_ratio')} x fp32's")
    if entry:
        lines.append(f"times:   {key}, {entry.get('threads')} threads, {entry.get('measured_at')}, load average "
                     f"{' '.join(map(str, entry.get('load_average') or ['?']))}")
        lines.append(f"serves:  {entry['chosen']}: {entry['why']}")
    return lines

