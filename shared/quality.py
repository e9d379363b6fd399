"""How closely an execution mode of a model computes what its fp32 path computes, measured
the way llama.cpp's ``llama-perplexity`` measures it (``streamfleet engines quality``,
docs/models.md "Execution modes and their quality").

The text is ``shared/corpus/alice.txt``: chapters I and II of Lewis Carroll's *Alice's
Adventures in Wonderland* (1865; public domain; the plain text of Project Gutenberg's
eBook #11), 22,452 bytes, 5,902 SmolLM2 tokens. It is cut into chunks of ``n_ctx``
tokens (512, llama-perplexity's usual ``-c``), each evaluated from an empty cache; the
first half of a chunk is context and every later position but the last is scored
(llama-perplexity's ``first = n_ctx/2``: 255 tokens a chunk of 512): the log probability
of the next token, and, against the reference mode's distribution at that position,

* **perplexity**: ``exp`` of the mean negative log likelihood of the scored tokens;
* **mean KL divergence** ``sum p_ref * (log p_ref - log p_mode)``, with its standard error;
* **same top-1**: the share of positions whose most likely token is the reference's.

Each mode runs its own GroupQueryAttention graph (``shared/execution.py``, ``graph_file``)
in ONNX Runtime as its engine runs it (``SharedBufferRunner``), with ``logits_to_keep`` set
to the scored half, one chunk at a time, so the memory is one chunk's logits per mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import onnxruntime as ort

__all__ = ["QUALITY_TEXT", "ModeQuality", "SharedBufferRunner", "chunk_windows", "evaluate", "open_graph",
           "log_softmax"]

#: the fixed English text (its provenance: the module docstring)
QUALITY_TEXT = Path(__file__).resolve().parent / "corpus" / "alice.txt"
#: llama-perplexity's default chunk for these figures
DEFAULT_CTX = 512


@dataclass
class ModeQuality:
    """One mode's figures over the scored positions (``reference`` for the fp32 path)."""

    mode: str
    tokens: int = 0
    nll: float = 0.0
    nll2: float = 0.0
    kld: float = 0.0
    kld2: float = 0.0
    kld_max: float = 0.0
    top1_same: int = 0
    seconds: float = 0.0
    #: each chunk's perplexity, for the curious
    chunk_ppl: list[float] = field(default_factory=list)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    @property
    def ppl_stderr(self) -> float:
        """llama-perplexity's error of the perplexity: ``ppl * stderr(nll)``."""
        if self.tokens < 2:
            return float("nan")
        mean = self.nll / self.tokens
        var = max(self.nll2 / self.tokens - mean * mean, 0.0)
        return self.ppl * math.sqrt(var / (self.tokens - 1))

    @property
    def mean_kld(self) -> float:
        return self.kld / self.tokens if self.tokens else float("nan")

    @property
    def kld_stderr(self) -> float:
        if self.tokens < 2:
            return float("nan")
        mean = self.mean_kld
        return math.sqrt(max(self.kld2 / self.tokens - mean * mean, 0.0) / (self.tokens - 1))

    @property
    def top1(self) -> float:
        return self.top1_same / self.tokens if self.tokens else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {"ppl": round(self.ppl, 4), "ppl_stderr": round(self.ppl_stderr, 4),
                "mean_kld": float(f"{self.mean_kld:.6g}"), "kld_stderr": float(f"{self.kld_stderr:.3g}"),
                "max_kld": float(f"{self.kld_max:.4g}"), "same_top1": round(self.top1, 5), "tokens": self.tokens}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (the sums of a 49,152-entry row in fp32 lose digits
    that a KL divergence of 1e-4 needs)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    out: np.ndarray = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return out


def chunk_windows(n_tokens: int, n_ctx: int, chunks: int | None = None) -> list[tuple[int, int]]:
    """``(start, end)`` of each whole chunk of ``n_ctx`` tokens (a remainder shorter than
    a chunk is left out, as llama-perplexity does), at most ``chunks`` of them."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4, not {n_ctx}")
    count = n_tokens // n_ctx
    if chunks is not None:
        count = min(count, chunks)
    return [(i * n_ctx, (i + 1) * n_ctx) for i in range(count)]


def open_graph(path: Path, threads: int | None, providers: list[str] | None = None) -> ort.InferenceSession:
    """An ONNX Runtime session on a graph, as every ONNX Runtime engine opens one (their
    ``ort_session``): all graph optimisations, sequential execution, ``threads`` intra-op
    threads (None: the runtime's default, all cores) and one inter-op thread, on
    ``providers`` (default the CPU's)."""
    import onnxruntime as ort  # lazily: a CPU machine's engines only

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if threads is not None:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=providers or ["CPUExecutionProvider"])


class SharedBufferRunner:
    """Runs a GroupQueryAttention graph (shared/gguf_gqa.py) as its engine does: one KV
    buffer per past input, [rows, kv_heads, capacity, head_dim], bound as both the past
    and the present, each run writing its tokens in place at each row's own length."""

    def __init__(self, session: ort.InferenceSession, rows: int, capacity: int) -> None:
        self.session = session
        inputs = {i.name: i for i in session.get_inputs()}
        self.pasts = [n for n in inputs if n.startswith("past_key_values.")]
        self.buffers = []
        for name in self.pasts:
            _, heads, _, dim = inputs[name].shape
            self.buffers.append(np.zeros((rows, int(heads), capacity, int(dim)), dtype=np.float32))
        self.io = session.io_binding()
        self.io.bind_output("logits", "cpu")  # first: output 0
        for name, buf in zip(self.pasts, self.buffers):
            shape = list(buf.shape)
            self.io.bind_input(name, "cpu", 0, np.float32, shape, buf.ctypes.data)
            self.io.bind_output(name.replace("past_key_values.", "present."), "cpu", 0, np.float32, shape,
                                buf.ctypes.data)

    def run(self, ids: np.ndarray, lengths: np.ndarray, keep: int = 1) -> np.ndarray:
        """Feed ``ids`` [rows, S]; ``lengths``: each row's length after the run. Returns the
        logits [rows, keep, vocab]."""
        fed = {"input_ids": np.ascontiguousarray(ids, dtype=np.int64),
               "seqlens_k": np.ascontiguousarray(np.asarray(lengths) - 1, dtype=np.int32),
               "total_sequence_length": np.array(int(np.max(lengths)), dtype=np.int32),
               "logits_to_keep": np.array([keep], dtype=np.int64)}
        for name, value in fed.items():
            self.io.bind_cpu_input(name, value)
        self.io.bind_output("logits", "cpu")
        self.session.run_with_iobinding(self.io)
        return np.array(self.io.get_outputs()[0].numpy(), copy=True)


def _chunk_logits(session: ort.InferenceSession, ids: Sequence[int], keep: int) -> np.ndarray:
    """The logits of the last ``keep`` positions of ``ids`` run from an empty cache:
    ``[keep, vocab]``."""
    n = len(ids)
    rows: np.ndarray = SharedBufferRunner(session, 1, n).run(np.asarray([ids]), np.array([n]), keep)
    first: np.ndarray = rows[0]
    return first


def evaluate(graphs: dict[str, Path], reference: str, ids: Sequence[int], *, n_ctx: int = DEFAULT_CTX,
             chunks: int | None = None, threads: int | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, ModeQuality]:
    """Perplexity, mean KL divergence against ``reference`` and same-top-1 rate of each
    mode's graph over ``ids``, chunk by chunk (module docstring).

    Raises:
        ValueError: ``reference`` is not among ``graphs``, or ``ids`` is shorter than a chunk.
    """
    import time

    if reference not in graphs:
        raise ValueError(f"the reference mode {reference!r} is not among {sorted(graphs)}")
    windows = chunk_windows(len(ids), n_ctx, chunks)
    if not windows:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {n_ctx}")
    first = n_ctx // 2
    # llama-perplexity scores positions first .. n_ctx-2, each predicting the next token;
    # the logits of positions first .. n_ctx-1 are computed and the last is dropped
    keep = n_ctx - first
    sessions = {mode: open_graph(path, threads) for mode, path in graphs.items()}
    out = {mode: ModeQuality(mode) for mode in graphs}
    order = [reference] + [m for m in graphs if m != reference]
    for k, (start, end) in enumerate(windows):
        chunk = list(ids[start:end])
        targets = np.asarray(chunk[first + 1:], dtype=np.int64)
        ref_lp = None
        for mode in order:
            t = time.perf_counter()
            logits = _chunk_logits(sessions[mode], chunk, keep)[:-1]
            out[mode].seconds += time.perf_counter() - t
            lp = log_softmax(logits)
            nll = -lp[np.arange(len(targets)), targets]
            q = out[mode]
            q.tokens += len(targets)
            q.nll += float(nll.sum())
            q.nll2 += float((nll * nll).sum())
            q.chunk_ppl.append(math.exp(float(nll.mean())))
            if ref_lp is None:
                ref_lp, ref_top = lp, lp.argmax(axis=-1)
                q.top1_same += len(targets)
                continue
            kl = (np.exp(ref_lp) * (ref_lp - lp)).sum(axis=-1)
            q.kld += float(kl.sum())
            q.kld2 += float((kl * kl).sum())
            q.kld_max = max(q.kld_max, float(kl.max()))
            q.top1_same += int((lp.argmax(axis=-1) == ref_top).sum())
        if progress is not None:
            progress(f"chunk {k + 1}/{len(windows)}: " + ", ".join(
                f"{m} ppl {out[m].ppl:.3f}" for m in order))
    return out
