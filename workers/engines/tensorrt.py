"""TensorRT (GPU) backend for graphs in Optimum's ``text-generation-with-past`` layout.

The same ONNX graph as the ONNX Runtime backend, built into a plan (what to build:
``trt_plan``; the build: ``trt_build``) with two optimization profiles, each run by its
own execution context: *prefill* (prompts from an empty past) and *decode* (one token
onto a past). A missing plan is built on first start (option ``build_if_missing``,
default on), else the engine refuses to start and says which command builds it.

KV cache on the device. Two preallocated buffers per past input (layer x key/value),
each ``[max_batch, kv_heads, max_context, head_dim]`` elements, hold the *slab*: the
padded batch of the last decode step, ``[rows, kv_heads, width, head_dim]``, each live
sequence owning one row (its slot). A decode step reads the slab from one buffer as
``past_key_values.*`` and writes ``present.*`` (the slab one slot wider) into the other,
so in steady state nothing is copied at all; the two buffers swap roles each step.
Semantics mirror ``OnnxRuntimeEngine``: pasts are left-padded, pad slots carry
``attention_mask`` 0, each row gets its own ``position_ids``; a released sequence
leaves an idle row (token 0, masked), a newcomer takes an idle row, a sequence left
out of a step gets a masked slot.

Membership changes stay on the device: a newcomer's cache is copied from the prefill
run's ``present.*`` outputs into its row (2D device-to-device copies, its pad slots
zeroed); widening the slab for a longer newcomer, cutting masked leading slots, and
compacting away idle rows or masked gaps are device-to-device copies into the other
buffer. Per step only token ids, the mask and positions go to the device and only
last-position logits come back.

CUDA memory and streams go through ``cuda_mem`` (cuda-python or pycuda). Nothing
GPU-related is imported until an engine is constructed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from streamfleet.shared.errors import FatalError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.workers.engines import cuda_mem, trt_build, trt_plan
from streamfleet.workers.engines.cuda_mem import CudaMem, DeviceBuffer, Stream
from streamfleet.workers.engines.onnxruntime import InvalidSequenceError, check_decode, check_prefill
from streamfleet.workers.engines.prefill import prefill_groups
from streamfleet.workers.engines.trt_plan import DECODE, PREFILL, GraphInfo

if TYPE_CHECKING:  # (TensorRT ships no type information: to the checker these are Any)
    from tensorrt import DataType, ICudaEngine, Runtime

__all__ = ["InvalidSequenceError", "Runner", "TensorRTEngine", "TrtRunner", "prefill_groups"]

log = get_logger("worker.tensorrt")

#: dtype names -> (numpy dtype of a host staging buffer, bytes per element); bfloat16
#: has no numpy type and travels as raw uint16
_HOST: dict[str, tuple[Any, int]] = {
    "float32": (np.float32, 4), "float16": (np.float16, 2), "bfloat16": (np.uint16, 2),
    "int32": (np.int32, 4), "int64": (np.int64, 8),
}
#: compact the slab when more than this share of its rows sit idle in a step
_IDLE_ROW_SHARE = 0.25
#: ... or when its width exceeds the longest member by more than this many slots and half
_SPARE_WIDTH = 32


def _runs(mask_row: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of ones."""
    d = np.diff(np.concatenate([[0], (mask_row != 0).astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


class Runner(Protocol):
    """Runs the plan's two profiles; the TensorRT half of the engine, behind a seam so
    the data path around it can be exercised without a GPU."""

    info: GraphInfo
    #: from the plan when its logits have a fixed last dim, else None
    vocab_size: int | None
    #: dtype name of every I/O tensor the plan has
    dtypes: dict[str, str]

    def run(self, profile: str, shapes: dict[str, tuple[int, ...]], addresses: dict[str, int],
            stream: Stream) -> None:
        """Enqueue one run on ``stream`` with these input shapes and tensor addresses."""
        ...

    def close(self) -> None: ...


def _trt_dtype(trt: ModuleType, dt: DataType) -> str:
    table = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT32": "int32", "INT64": "int64"}
    for attr, name in table.items():
        if getattr(trt.DataType, attr, None) == dt:
            return name
    raise FatalError(f"the plan has an I/O tensor of type {dt}, which the tensorrt backend does not handle")


class TrtRunner:
    """The plan, deserialized, with one execution context per profile."""

    def __init__(self, trt: ModuleType, runtime: Runtime, engine: ICudaEngine, info: GraphInfo,
                 profile_index: dict[str, int], stream: Stream) -> None:
        self._trt, self._runtime, self._engine = trt, runtime, engine  # the runtime must outlive the engine
        self.info = info
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self._names = set(names)
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.dtypes = {n: _trt_dtype(trt, engine.get_tensor_dtype(n)) for n in names}
        unknown = sorted(set(self.inputs) - set(info.inputs))
        needed = ["logits"] + info.present_names
        missing = [n for n in needed if n not in self._names]
        if unknown or missing:
            raise FatalError(f"the plan does not match the graph: unknown inputs {unknown}, missing outputs {missing}")
        if engine.num_optimization_profiles < len(profile_index):
            raise FatalError(f"the plan has {engine.num_optimization_profiles} optimization profiles, "
                             f"expected {len(profile_index)} (prefill, decode); rebuild it")
        dims = engine.get_tensor_shape("logits")  # a trt.Dims: -1 where dynamic
        last = int(dims[len(dims) - 1])
        self.vocab_size = last if last > 0 else None
        self._contexts: dict[str, Any] = {}
        for name, index in profile_index.items():
            ctx = engine.create_execution_context()
            if ctx is None:
                raise FatalError("TensorRT could not create an execution context (out of GPU memory?)")
            if ctx.set_optimization_profile_async(index, stream.handle) is False:
                raise FatalError(f"TensorRT refused optimization profile {index} ({name})")
            self._contexts[name] = ctx
        stream.synchronize()
        self._bound: dict[str, dict[str, int]] = {name: {} for name in self._contexts}

    @classmethod
    def load(cls, spec: ModelSpec, opts: dict[str, Any], trt: ModuleType, mem: CudaMem, stream: Stream) -> TrtRunner:
        """Find (or build) the plan for this GPU and TensorRT, deserialize it.

        Raises:
            FatalError: no plan and ``build_if_missing`` off; a plan that does not
                deserialize and may not be rebuilt; a failed build.
        """
        cc = cuda_mem.detect_compute_capability(mem)
        info = trt_plan.read_graph_info(spec.onnx_path, opts)
        request = trt_plan.plan_request(spec, trt.__version__, cc, opts, info=info)
        how = (f"build it with `streamfleet engines build {spec.name}` on this host, or "
               f"`streamfleet engines build {spec.name} --queue sm{cc}` for a build worker; "
               f"or let workers build it (SF_TRT_BUILD_IF_MISSING=1, engine.toml [tensorrt] build_if_missing)")
        if not request.path.exists():
            if not opts["build_if_missing"]:
                raise FatalError(f"no TensorRT plan for {spec.name} (TensorRT {trt.__version__}, sm{cc}, "
                                 f"key {request.key[:16]}) at {request.path}; {how}")
            log.info("building TensorRT plan", model=spec.name, path=str(request.path))
            trt_build.build_plan(spec, options=opts, compute_capability=cc, trt=trt,
                                 log=lambda s: log.info(s, model=spec.name))
        runtime, engine = cls._deserialize(trt, request.path)
        if engine is None:
            if not opts["build_if_missing"]:
                raise FatalError(f"TensorRT plan {request.path} does not deserialize (corrupt, or built by a "
                                 f"different TensorRT / driver); rebuild it with --force: {how}")
            log.warning("plan does not deserialize; rebuilding", model=spec.name, path=str(request.path))
            trt_build.build_plan(spec, force=True, options=opts, compute_capability=cc, trt=trt,
                                 log=lambda s: log.info(s, model=spec.name))
            runtime, engine = cls._deserialize(trt, request.path)
            if engine is None:
                raise FatalError(f"the freshly built plan {request.path} does not deserialize")
        order = [p.get("name") for p in (trt_plan.read_sidecar(request.path) or {}).get("profiles", [])]
        index = {name: order.index(name) if name in order else i for i, name in enumerate((PREFILL, DECODE))}
        log.info("TensorRT plan loaded", model=spec.name, path=str(request.path), trt=trt.__version__, cc=cc)
        return cls(trt, runtime, engine, info, index, stream)

    @staticmethod
    def _deserialize(trt: ModuleType, path: Path) -> tuple[Any, Any]:
        runtime = trt.Runtime(trt_build.trt_logger(trt))
        try:
            engine = runtime.deserialize_cuda_engine(path.read_bytes())
        except Exception as exc:  # TensorRT raises or returns None, depending on the failure
            log.warning("deserialize_cuda_engine failed", path=str(path), error=str(exc))
            engine = None
        return runtime, engine

    def run(self, profile: str, shapes: dict[str, tuple[int, ...]], addresses: dict[str, int],
            stream: Stream) -> None:
        ctx = self._contexts[profile]
        for name in self.inputs:
            if ctx.set_input_shape(name, shapes[name]) is False:
                raise RuntimeError(f"TensorRT refused shape {shapes[name]} for {name} in the {profile} profile")
        bound = self._bound[profile]
        for name, ptr in addresses.items():
            if name in self._names and bound.get(name) != ptr:
                if ctx.set_tensor_address(name, ptr) is False:
                    raise RuntimeError(f"TensorRT refused the address of {name}")
                bound[name] = ptr
        if ctx.execute_async_v3(stream.handle) is False:
            raise RuntimeError(f"TensorRT could not enqueue the {profile} step")

    def close(self) -> None:
        self._contexts.clear()
        self._engine = None
        self._runtime = None


@dataclass(slots=True)
class _Seq:
    length: int
    #: its slot (row in the slab); -1: at max_context already, so never decoded, no cache kept
    row: int


class TensorRTEngine:
    """Runs an Optimum-layout decoder as a TensorRT plan, the KV cache kept on the GPU.

    Args:
        spec: the model folder (``onnx`` graph, ``max_batch``, ``max_context``; a
            ``[tensorrt]`` table in engine.toml for options).
        options: override ``[tensorrt]`` (see ``trt_plan.BUILD_DEFAULTS`` and
            ``RUNTIME_DEFAULTS``): ``build_if_missing``, ``cuda`` (auto | cuda-python |
            pycuda), ``max_prefill_tokens``, ``plans_dir``, builder settings; others are
            ignored. ``mem`` and ``runner`` replace the CUDA library and the plan (tests).

    Raises:
        FatalError: TensorRT or a CUDA library is missing (the message names the
            package), there is no GPU, or no usable plan (see ``TrtRunner.load``).
    """

    def __init__(self, spec: ModelSpec, *, mem: CudaMem | None = None, runner: Runner | None = None,
                 **options: Any) -> None:
        self.spec = spec
        self._opts = trt_plan.tensorrt_options(spec, options)
        self._bufs: list[DeviceBuffer] = []
        self._closed = False
        self._owns_mem = mem is None
        self._runner: Runner | None = None
        self._mem: CudaMem | None = None
        self._stream: Stream | None = None
        trt = None
        if runner is None:
            if not spec.onnx_path.exists():
                raise FatalError(f"{spec.onnx_path} is missing; run `python -m streamfleet.shared.tinymodel "
                                 f"--model-dir {spec.path}`")
            trt = trt_build.import_tensorrt()  # first: the clearer message on a CPU machine
            mem = mem or cuda_mem.select(self._opts["cuda"])
        elif mem is None:
            raise ValueError("a custom runner needs the CudaMem it reads and writes")
        self._mem = mem
        try:
            self._stream = mem.stream()
            if runner is None:
                if trt is None:  # (imported above whenever no runner is given)
                    raise FatalError("TensorRT was not imported")
                runner = TrtRunner.load(spec, self._opts, trt, mem, self._stream)
            self._runner = runner
            self._setup(runner)
        except BaseException:
            self.close()
            raise

    # -- set-up ---------------------------------------------------------------------------

    def _setup(self, runner: Runner) -> None:
        info = runner.info
        self.n_layer, self.kv_heads, self.head_dim = info.n_layer, info.kv_heads, info.head_dim
        self.max_batch, self.max_context = self.spec.max_batch, self.spec.max_context
        vocab = runner.vocab_size or info.vocab_size
        if not vocab:
            raise FatalError(f"{self.spec.onnx_path}: the vocabulary size is not fixed in the graph or the plan")
        self.vocab_size = int(vocab)
        self._past, self._present = info.past_names, info.present_names
        self._has_positions = "position_ids" in runner.dtypes
        dt = runner.dtypes
        self._kv_es = _HOST[dt[self._past[0]]][1]
        self._col = self.head_dim * self._kv_es  # bytes of one slot of one head
        self._ids_np = _HOST[dt["input_ids"]][0]
        self._mask_np = _HOST[dt["attention_mask"]][0]
        self._pos_np = _HOST[dt["position_ids"]][0] if self._has_positions else np.int64
        self._logits_dtype = dt["logits"]
        self._logits_np, self._logits_es = _HOST[self._logits_dtype]

        b, c, v = self.max_batch, self.max_context, self.vocab_size
        tokens = int(self._opts["max_prefill_tokens"]) or min(b * c, 8192)
        self._prefill_tokens = max(c, min(tokens, b * c))
        mem = self._dev_mem
        slab_bytes = b * self.kv_heads * c * self._col
        #: the two slab buffers, one DeviceBuffer per past input each
        self._kv = [[self._alloc(slab_bytes) for _ in self._past] for _ in range(2)]
        for side in self._kv:
            for buf in side:
                mem.memset(buf.ptr, 0, buf.nbytes, self._dev_stream)  # pads must hold finite values
        self._ids_dev = self._alloc(b * c * np.dtype(self._ids_np).itemsize)
        self._mask_dev = self._alloc(b * c * np.dtype(self._mask_np).itemsize)
        self._pos_dev = self._alloc(b * c * np.dtype(self._pos_np).itemsize)
        self._logits_dev = self._alloc(max(self._prefill_tokens, b) * v * self._logits_es)
        self._ids_h = mem.host_empty(b * c, self._ids_np)
        self._mask_h = mem.host_empty(b * c, self._mask_np)
        self._pos_h = mem.host_empty(b * c, self._pos_np)
        self._logits_h = mem.host_empty(b * v, self._logits_np)
        self._dev_stream.synchronize()
        log.info("tensorrt engine ready", model=self.spec.name,
                 kv_cache_mb=round(2 * slab_bytes * len(self._past) / 2**20),
                 logits_mb=round(self._logits_dev.nbytes / 2**20), cuda=getattr(mem, "name", "?"))

        self._cur = 0
        self._rows: list[str | None] = []
        self._mask = np.zeros((0, 0), dtype=np.int64)
        self._positions = np.zeros(0, dtype=np.int64)
        self._seqs: dict[str, _Seq] = {}

    @property
    def _dev_mem(self) -> CudaMem:
        """The CUDA memory API the engine runs on (set before ``_setup``)."""
        if self._mem is None:
            raise RuntimeError("the engine has no CUDA memory API")
        return self._mem

    @property
    def _dev_stream(self) -> Stream:
        """The CUDA stream the engine runs on (set before ``_setup``)."""
        if self._stream is None:
            raise RuntimeError("the engine has no CUDA stream")
        return self._stream

    def _alloc(self, nbytes: int) -> DeviceBuffer:
        buf = self._dev_mem.alloc(nbytes)
        self._bufs.append(buf)
        return buf

    @property
    def _width(self) -> int:
        return int(self._mask.shape[1])

    # -- the Engine interface ------------------------------------------------------------

    def prefill(self, seqs: list[tuple[str, list[int]]]) -> np.ndarray:
        """Start new sequences; see ``Engine.prefill``.

        Raises:
            InvalidSequenceError: (a ``SequenceError`` and a ``ValueError``) naming the
                sequences with a live id, an empty prompt, a prompt longer than
                ``max_context`` or a token outside the vocabulary; nothing is started.
            ValueError: an id given twice, or more than ``max_batch`` live sequences.
        """
        v = self.vocab_size
        out = np.empty((len(seqs), v), dtype=np.float32)
        if not seqs:
            return out
        check_prefill(seqs, self._seqs, self.max_context, v, self.max_batch)
        lengths = [len(p) for _, p in seqs]
        # a prompt of max_context tokens can never decode: its cache is not kept
        joining = [i for i, n in enumerate(lengths) if n < self.max_context]
        rows: dict[int, int] = {}
        if joining:
            self._trim()
            need = max(lengths[i] for i in joining)
            if need > self._width:
                self._reshape(need)
            rows = dict(zip(joining, self._take_rows(len(joining))))
        try:
            for group in prefill_groups(lengths, self._prefill_tokens):
                self._prefill_group(seqs, lengths, group, rows, out)
        except BaseException:
            for r in rows.values():
                self._rows[r] = None
                self._mask[r] = 0
                self._positions[r] = 0
            raise
        width = self._width
        for i, (seq_id, _) in enumerate(seqs):
            n = lengths[i]
            r = rows.get(i, -1)
            if r >= 0:
                self._rows[r] = seq_id
                self._mask[r] = 0
                self._mask[r, width - n:] = 1
                self._positions[r] = n
            self._seqs[seq_id] = _Seq(length=n, row=r)
        return out

    def decode(self, seqs: list[tuple[str, int]]) -> np.ndarray:
        """Feed one token to each live sequence, all in one run; see ``Engine.decode``.

        Raises:
            InvalidSequenceError: (a ``SequenceError`` and a ``ValueError``) naming the
                unknown sequences, those fed a token outside the vocabulary and those
                already at ``max_context`` (these are released); nothing is run.
            ValueError: an id given twice.
        """
        v = self.vocab_size
        if not seqs:
            return np.empty((0, v), dtype=np.float32)
        check_decode(seqs, self._seqs, self.max_context, v, self.release)
        self._compact()
        n, width = len(self._rows), self._width
        active = np.zeros(n, dtype=bool)
        ids = np.zeros(n, dtype=np.int64)  # idle rows get token 0 and a masked slot
        order = []
        for seq_id, token in seqs:
            r = self._seqs[seq_id].row
            order.append(r)
            active[r] = True
            ids[r] = token
        positions = np.where(active, self._positions, 0)
        mask = np.concatenate([self._mask, active[:, None].astype(self._mask.dtype)], axis=1)
        self._upload(ids, mask, positions)
        cur = self._cur
        self._run(DECODE, n, 1, width, self._kv[cur], self._kv[1 - cur])
        host = self._logits_h[: n * v]
        self._dev_mem.copy_dtoh(host, self._logits_dev.ptr, self._dev_stream)
        self._dev_stream.synchronize()
        self._cur = 1 - cur
        self._mask = mask
        self._positions = self._positions + active
        for seq_id, _ in seqs:
            self._seqs[seq_id].length += 1
        return np.ascontiguousarray(self._as_f32(host).reshape(n, v)[order])

    def release(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None and seq.row >= 0:
            self._rows[seq.row] = None
            self._mask[seq.row] = 0
            self._positions[seq.row] = 0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._seqs = {}
        try:
            if self._stream is not None:
                self._stream.synchronize()
            if self._mem is not None:
                for buf in self._bufs:
                    self._mem.free(buf)
        finally:
            self._bufs.clear()
            if self._runner is not None:
                self._runner.close()  # contexts and engine go before the memory and streams
            if self._owns_mem and self._mem is not None:
                self._mem.close()

    # -- steps ---------------------------------------------------------------------------

    def _upload(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> None:
        mem, s = self._dev_mem, self._dev_stream
        for host, values, dev in ((self._ids_h, ids, self._ids_dev), (self._mask_h, mask, self._mask_dev),
                                  (self._pos_h, positions, self._pos_dev)):
            if dev is self._pos_dev and not self._has_positions:
                continue
            view = host[: values.size]
            view[:] = values.ravel()
            mem.copy_htod(dev.ptr, view, s)

    def _run(self, profile: str, rows: int, seq: int, past: int, past_bufs: list[DeviceBuffer],
             present_bufs: list[DeviceBuffer]) -> None:
        h, d = self.kv_heads, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"input_ids": (rows, seq), "attention_mask": (rows, past + seq)}
        addresses = {"input_ids": self._ids_dev.ptr, "attention_mask": self._mask_dev.ptr,
                     "logits": self._logits_dev.ptr}
        if self._has_positions:
            shapes["position_ids"] = (rows, seq)
            addresses["position_ids"] = self._pos_dev.ptr
        for name, buf in zip(self._past, past_bufs):
            shapes[name] = (rows, h, past, d)
            addresses[name] = buf.ptr  # an empty past (prefill) still gets a valid address
        for name, buf in zip(self._present, present_bufs):
            addresses[name] = buf.ptr
        assert self._runner is not None
        self._runner.run(profile, shapes, addresses, self._dev_stream)

    def _prefill_group(self, seqs: list[tuple[str, list[int]]], lengths: list[int], group: list[int],
                       rows: dict[int, int], out: np.ndarray) -> None:
        m, wp = len(group), lengths[group[0]]
        ids = np.zeros((m, wp), dtype=np.int64)
        mask = np.zeros((m, wp), dtype=np.int64)
        positions = np.zeros((m, wp), dtype=np.int64)
        for g, i in enumerate(group):
            n = lengths[i]
            ids[g, wp - n:] = seqs[i][1]
            mask[g, wp - n:] = 1
            positions[g, wp - n:] = np.arange(n)
        self._upload(ids, mask, positions)
        slab, scratch = self._kv[self._cur], self._kv[1 - self._cur]
        self._run(PREFILL, m, wp, 0, slab, scratch)  # presents land in the spare buffer
        mem, s, col, h = self._dev_mem, self._dev_stream, self._col, self.kv_heads
        width = self._width
        for g, i in enumerate(group):
            r = rows.get(i)
            if r is None:
                continue
            n = lengths[i]
            for src_buf, dst_buf in zip(scratch, slab):
                src = src_buf.ptr + g * h * wp * col + (wp - n) * col
                dst = dst_buf.ptr + r * h * width * col
                if width > n:
                    mem.memset_2d(dst, width * col, 0, (width - n) * col, h, s)
                mem.copy_2d(dst + (width - n) * col, width * col, src, wp * col, n * col, h, s)
        v, les = self.vocab_size, self._logits_es
        host = self._logits_h[: m * v]
        mem.copy_dtoh_2d(host, self._logits_dev.ptr + (wp - 1) * v * les, wp * v * les, v * les, m, s)
        s.synchronize()
        out[group] = self._as_f32(host).reshape(m, v)

    def _as_f32(self, host: np.ndarray) -> np.ndarray:
        if self._logits_dtype == "bfloat16":
            return (host.astype(np.uint32) << 16).view(np.float32)
        return host.astype(np.float32, copy=False)

    # -- the slab ------------------------------------------------------------------------

    def _trim(self) -> None:
        """Drop idle rows at the end (free: rows past ``n`` are simply not run)."""
        k = len(self._rows)
        while k and self._rows[k - 1] is None:
            k -= 1
        if k < len(self._rows):
            del self._rows[k:]
            self._mask = self._mask[:k] if k else np.zeros((0, 0), dtype=np.int64)
            self._positions = self._positions[:k]

    def _take_rows(self, count: int) -> list[int]:
        """``count`` rows for newcomers: idle ones first, then new ones at the end."""
        free = [r for r, seq_id in enumerate(self._rows) if seq_id is None][:count]
        extra = count - len(free)
        n = len(self._rows)
        if extra:
            self._rows.extend([None] * extra)
            self._mask = np.concatenate([self._mask, np.zeros((extra, self._width), dtype=np.int64)])
            self._positions = np.concatenate([self._positions, np.zeros(extra, dtype=np.int64)])
        assert len(self._rows) <= self.max_batch
        return free + list(range(n, n + extra))

    def _reshape(self, new_width: int) -> None:
        """Widen (pad on the left) or cut masked leading slots, every row at once: one
        2D copy per past input into the spare buffer, which becomes the slab."""
        n, width = len(self._rows), self._width
        if n and width:
            mem, s, col, h = self._dev_mem, self._dev_stream, self._col, self.kv_heads
            for src, dst in zip(self._kv[self._cur], self._kv[1 - self._cur]):
                if new_width >= width:
                    shift = (new_width - width) * col
                    mem.copy_2d(dst.ptr + shift, new_width * col, src.ptr, width * col, width * col, n * h, s)
                    if shift:
                        mem.memset_2d(dst.ptr, new_width * col, 0, shift, n * h, s)
                else:
                    cut = (width - new_width) * col
                    mem.copy_2d(dst.ptr, new_width * col, src.ptr + cut, width * col, new_width * col, n * h, s)
            self._cur = 1 - self._cur
        if new_width >= width:
            self._mask = np.concatenate([np.zeros((n, new_width - width), dtype=np.int64), self._mask], axis=1)
        else:
            assert not self._mask[:, : width - new_width].any()
            self._mask = np.ascontiguousarray(self._mask[:, width - new_width:])

    def _repack(self) -> None:
        """A compact slab of the live rows only, each right-aligned with no masked gaps,
        as wide as the longest: per row, one 2D copy per run of real slots."""
        live = [r for r, seq_id in enumerate(self._rows) if seq_id is not None]
        lengths = [self._seqs[self._rows[r]].length for r in live]  # type: ignore[index]
        n2, width = len(live), self._width
        new_width = max(lengths)
        mem, s, col, h = self._dev_mem, self._dev_stream, self._col, self.kv_heads
        src_side, dst_side = self._kv[self._cur], self._kv[1 - self._cur]
        for dst in dst_side:
            mem.memset(dst.ptr, 0, n2 * h * new_width * col, s)
        mask = np.zeros((n2, new_width), dtype=np.int64)
        for i, (r, n) in enumerate(zip(live, lengths)):
            off = new_width - n
            runs = _runs(self._mask[r])
            assert sum(b - a for a, b in runs) == n, "mask and length disagree"
            for a, b in runs:
                for src, dst in zip(src_side, dst_side):
                    mem.copy_2d(dst.ptr + i * h * new_width * col + off * col, new_width * col,
                                src.ptr + r * h * width * col + a * col, width * col, (b - a) * col, h, s)
                off += b - a
            mask[i, new_width - n:] = 1
        self._rows = [self._rows[r] for r in live]
        for i, seq_id in enumerate(self._rows):
            self._seqs[seq_id].row = i  # type: ignore[index]
        self._positions = self._positions[live]
        self._mask = mask
        self._cur = 1 - self._cur

    def _compact(self) -> None:
        """Before a decode step: the slab must fit the decode profile (width + 1 <=
        max_context) and not waste too much on idle rows or spare width."""
        c = self.max_context
        for r, seq_id in enumerate(self._rows):
            if seq_id is not None and self._seqs[seq_id].length >= c:
                # at max_context: it can never decode again, its cache is not needed
                self._seqs[seq_id].row = -1
                self._rows[r] = None
                self._mask[r] = 0
                self._positions[r] = 0
        self._trim()
        n = len(self._rows)
        if not n:
            return
        width = self._width
        live = [r for r, seq_id in enumerate(self._rows) if seq_id is not None]
        longest = max(self._seqs[self._rows[r]].length for r in live)  # type: ignore[index]
        first = int(min(np.argmax(self._mask[r] != 0) for r in live))
        need = width - first  # slots from the earliest real one to the end
        spare = max(_SPARE_WIDTH, longest // 2)
        if n - len(live) > _IDLE_ROW_SHARE * n or need - longest > spare or need + 1 > c:
            self._repack()
        elif width + 1 > c or width - longest > spare:
            self._reshape(need)
