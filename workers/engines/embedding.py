"""ONNX Runtime (CPU) engine for embedding models (``kind = "embedding"``; docs/models.md,
"Embedding models").

The graph is the one ``shared/bertimport.py`` writes: ``input_ids`` and
``attention_mask`` (int64, ``[batch, seq]``) in, ``embeddings`` (float32,
``[batch, dimensions]``: pooled and, where the model says so, L2-normalised) out.

The interface, for the worker and the gateway that will serve it::

    spec = ModelRepository().get("minilm-l6-v2")
    ensure_artifacts(spec)                       # fetched and imported on first use
    engine = OnnxEmbeddingEngine(spec, threads=2)
    ids = load_tokenizer(spec).encode(text)      # [CLS] ... [SEP]: the tokenizer adds them
    engine.check_input(ids)                      # ValueError naming what is wrong, or None
    vectors = engine.embed([ids, other_ids])     # np.float32 [2, engine.dimensions]

* ``embed`` is synchronous and CPU-bound (run it in a thread); one call may hold any
  number of inputs. They are sorted by length and run in groups of similar length, each
  padded to its longest (mask 0 on the padding), of at most ``max_batch`` inputs and
  ``max_batch_tokens`` padded tokens (``engine.toml``, default 2048: longer runs are
  slower, the attention's scores leaving the caches; docs/models.md, "Embedding models").
  Row ``i`` of the result is input ``i``'s vector.
* Inputs are token ids, special tokens included (what ``load_tokenizer(spec).encode(text)``
  gives). An empty input, one longer than ``max_context`` tokens, or an id outside the
  vocabulary is refused with a ValueError naming the input's index; nothing is truncated.
  ``check_input`` is the same check for one input, so a caller can refuse one request of
  a batch and embed the others.
* A text's vector does not depend on what shares its batch beyond float rounding
  (padding changes the width the softmax sums over): all-MiniLM-L6-v2 gives cosine
  ≥ 0.99999 between a text alone and in a padded batch (tests/unit/test_bertimport.py,
  tests/integration/test_embedding_model.py); not bit for bit, as the text engine's
  batch-invariant mode is.
* ``dimensions``, ``max_context`` and ``max_batch`` come from ``engine.toml``; the graph's
  own metadata (pooling, normalisation, vector size, vocabulary) is checked against it at
  load, so a stale or foreign graph is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from streamfleet.shared.errors import FatalError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.modelrepo import ModelSpec, onnx_metadata
from streamfleet.workers.engines.base import ort_session

__all__ = ["OnnxEmbeddingEngine"]

log = get_logger("embedding")

#: graph metadata keys bertimport writes (``META_PREFIX`` there)
_META = "streamfleet.embedding."
#: padded tokens one run holds at most, where engine.toml names no ``max_batch_tokens``
DEFAULT_BATCH_TOKENS = 2048


class OnnxEmbeddingEngine:
    """Embeds token-id lists with an embedding model's graph on ONNX Runtime.

    Args:
        spec: an embedding model folder (``kind = "embedding"``), its files present
            (``ensure_artifacts`` first).
        threads: ``intra_op_num_threads``; None leaves ONNX Runtime's default (all cores).
        max_batch_tokens: padded tokens one run holds at most (a longer input runs alone);
            None: ``max_batch_tokens`` in ``engine.toml``, else 2048.
        options: ``providers`` (a list, default ``["CPUExecutionProvider"]``); others are ignored.

    Raises:
        FatalError: not an embedding model, the graph is missing, or it disagrees with
            ``engine.toml``.
    """

    def __init__(self, spec: ModelSpec, threads: int | None = None, *, max_batch_tokens: int | None = None,
                 **options: Any) -> None:
        if spec.kind != "embedding":
            raise FatalError(f"model {spec.name!r} is not an embedding model (kind {spec.kind!r})")
        if not spec.onnx_path.exists():
            raise FatalError(f"{spec.onnx_path} is missing; `streamfleet engines import` the model, or let "
                             f"ensure_artifacts fetch it (a [source] table)")
        self.spec = spec
        self.dimensions = spec.dimensions
        self.max_context = spec.max_context
        self.max_batch = spec.max_batch
        if max_batch_tokens is None:
            max_batch_tokens = spec.options.get("max_batch_tokens", DEFAULT_BATCH_TOKENS)
        if type(max_batch_tokens) is not int or max_batch_tokens < 1:
            raise FatalError(f"{spec.path / 'engine.toml'}: max_batch_tokens must be a positive integer, not "
                             f"{max_batch_tokens!r}")
        self.max_batch_tokens = max_batch_tokens
        try:
            meta = onnx_metadata(spec.onnx_path)
        except (OSError, ValueError) as exc:
            raise FatalError(f"cannot read {spec.onnx_path}: {exc}") from exc
        self.pooling = meta.get(_META + "pooling", spec.pooling)
        self.normalize = meta.get(_META + "normalize", str(spec.normalize).lower()) == "true"
        for key, graph, toml in (("pooling", self.pooling, spec.pooling),
                                 ("normalize", self.normalize, spec.normalize)):
            if graph != toml:
                raise FatalError(f"{spec.onnx_path}: the graph's {key} is {graph!r}, engine.toml says {toml!r}")
        self.pad_token_id = int(meta.get(_META + "pad_token_id", 0))
        positions = int(meta.get(_META + "max_positions", 0))
        if positions and self.max_context > positions:
            raise FatalError(f"{spec.path / 'engine.toml'}: max_context {self.max_context} exceeds the graph's "
                             f"{positions} positions")

        self._session = ort_session(spec, threads, options)
        inputs = {i.name for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        if inputs != {"input_ids", "attention_mask"} or "embeddings" not in outputs:
            raise FatalError(f"{spec.onnx_path} is not an embedding graph (inputs {sorted(inputs)}, outputs "
                             f"{sorted(outputs)}; expected input_ids and attention_mask in, embeddings out)")
        width = outputs["embeddings"].shape[-1]
        if isinstance(width, int) and width != self.dimensions:
            raise FatalError(f"{spec.onnx_path} gives {width}-dimensional vectors, engine.toml says dimensions = "
                             f"{self.dimensions}")
        vocab = meta.get(_META + "vocab_size")
        self.vocab_size = int(vocab) if vocab else self._vocab_from_graph()
        log.info("embedding model loaded", model=spec.name, dimensions=self.dimensions, pooling=self.pooling,
                 normalize=self.normalize, max_context=self.max_context, max_batch=self.max_batch)

    def _vocab_from_graph(self) -> int:
        """The rows of the graph's word-embedding table (a graph without the metadata)."""
        import onnx

        model = onnx.load(str(self.spec.onnx_path), load_external_data=False)
        for init in model.graph.initializer:
            if init.name == "embeddings.word_embeddings.weight":
                return int(init.dims[0])
        raise FatalError(f"{self.spec.onnx_path} names no vocabulary size (metadata {_META}vocab_size)")

    def check_input(self, ids: Sequence[int], index: int | None = None) -> None:
        """Refuse an input ``embed`` would refuse.

        Raises:
            ValueError: it is empty, longer than ``max_context``, not integers, or holds an
                id outside the vocabulary (the message names ``index`` when given).
        """
        which = "input" if index is None else f"input {index}"
        n = len(ids)
        if n == 0:
            raise ValueError(f"{which} is empty (no tokens)")
        if n > self.max_context:
            raise ValueError(f"{which} has {n} tokens, over the model's max_context of {self.max_context} "
                             f"(special tokens included); it is not truncated")
        array = np.asarray(ids)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise ValueError(f"{which} is not a list of token ids (integers)")
        lo, hi = int(array.min()), int(array.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{which} holds token id {bad}, outside the vocabulary of {self.vocab_size}")

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        """One vector per input (float32, ``[len(batch), dimensions]``; see the module docstring).

        Raises:
            ValueError: an input is refused (``check_input``).
        """
        for i, ids in enumerate(batch):
            self.check_input(ids, i)
        n = len(batch)
        out = np.empty((n, self.dimensions), dtype=np.float32)
        if n == 0:
            return out
        for rows in self._runs([len(ids) for ids in batch]):
            width = len(batch[rows[-1]])
            fed = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for r, i in enumerate(rows):
                fed[r, :len(batch[i])] = batch[i]
                mask[r, :len(batch[i])] = 1
            out[rows] = self._session.run(["embeddings"], {"input_ids": fed, "attention_mask": mask})[0]
        return out

    def close(self) -> None:
        """Free the graph's session (the worker closes a reload's old version's engine);
        ``embed`` may not be called after."""
        self._session = None

    def _runs(self, lengths: list[int]) -> list[list[int]]:
        """The inputs' indices in runs: by length, at most ``max_batch`` inputs and
        ``max_batch_tokens`` padded tokens a run (the longest input last in each)."""
        runs: list[list[int]] = []
        run: list[int] = []
        for i in sorted(range(len(lengths)), key=lengths.__getitem__):
            if run and (len(run) == self.max_batch or (len(run) + 1) * lengths[i] > self.max_batch_tokens):
                runs.append(run)
                run = []
            run.append(i)
        if run:
            runs.append(run)
        return runs
