"""The TensorRT engine's data path without a GPU: device memory emulated in host
memory, and the plan replaced by ONNX Runtime reading and writing that memory.

``HostMem`` implements ``cuda_mem.CudaMem`` over numpy arrays: pointers are fake
addresses, every access is bounds-checked against one allocation, and fresh allocations
are filled with 0xFF bytes (NaN as float32), so reading a slot the engine never wrote
poisons the logits, as uninitialised GPU memory may. ``OrtRunner`` implements
``tensorrt.Runner``: it checks every input shape against the plan's optimization
profile (the limits TensorRT would enforce), reads the inputs at the bound addresses,
runs the graph and writes each output at its address.

Used by tests/unit/test_trt_plan.py and ``scripts/gpu_check.py --dry-run``.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from typing import Any

import numpy as np

from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.workers.engines import trt_plan
from streamfleet.workers.engines.cuda_mem import DeviceBuffer

__all__ = ["HostMem", "OrtRunner", "emulated_engine", "fake_tensorrt"]

_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64",
              "tensor(int32)": "int32"}
_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32}


class _Stream:
    """``cuda_mem.Stream`` with nothing behind it: the host copies are synchronous."""

    handle: int = 0
    native: Any = None

    def synchronize(self) -> None:
        pass


class HostMem:
    """``CudaMem`` over host memory, bounds-checked (see the module docstring)."""

    name = "host-emulation"

    def __init__(self, fill: int = 0xFF) -> None:
        self._fill = fill
        self._bases: list[int] = []
        self._arrays: dict[int, np.ndarray] = {}
        self._next = 1 << 20
        self.calls: Counter[str] = Counter()

    # -- addressing -----------------------------------------------------------------------
    def _find(self, ptr: int, nbytes: int) -> tuple[np.ndarray, int]:
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0:
            raise AssertionError(f"address {ptr:#x} is not in any allocation")
        base = self._bases[i]
        arr = self._arrays[base]
        off = ptr - base
        if off + nbytes > arr.size:
            raise AssertionError(f"access [{ptr:#x}, +{nbytes}) runs past the allocation "
                                 f"[{base:#x}, +{arr.size})")
        return arr, off

    def _view(self, ptr: int, nbytes: int) -> np.ndarray:
        arr, off = self._find(ptr, nbytes)
        return arr[off:off + nbytes]

    def _view2d(self, ptr: int, pitch: int, width: int, height: int) -> np.ndarray:
        assert width <= pitch or height == 1, f"width {width} > pitch {pitch}"
        if height == 0 or width == 0:
            return np.zeros((height, width), dtype=np.uint8)
        arr, off = self._find(ptr, (height - 1) * pitch + width)
        return np.lib.stride_tricks.as_strided(arr[off:], shape=(height, width), strides=(pitch, 1))

    def read(self, ptr: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        if n == 0:
            return np.zeros(shape, dtype=dt)
        return self._view(ptr, n).view(dt).reshape(shape).copy()

    def write(self, ptr: int, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        if data.size:
            self._view(ptr, data.size)[:] = data

    # -- CudaMem ------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DeviceBuffer:
        ptr = self._next
        self._next += (max(nbytes, 1) + 4095) // 4096 * 4096 + 4096  # a gap between allocations
        self._bases.append(ptr)
        self._arrays[ptr] = np.full(max(nbytes, 1), self._fill, dtype=np.uint8)
        self.calls["alloc"] += 1
        return DeviceBuffer(ptr, nbytes)

    def free(self, buf: DeviceBuffer) -> None:
        self._arrays.pop(buf.ptr)
        self._bases.remove(buf.ptr)

    def host_empty(self, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def stream(self) -> _Stream:
        return _Stream()

    def copy_htod(self, dst: int, src: np.ndarray, stream: Any) -> None:
        self.calls["htod"] += 1
        self.write(dst, src)

    def copy_dtoh(self, dst: np.ndarray, src: int, stream: Any) -> None:
        self.calls["dtoh"] += 1
        dst.reshape(-1).view(np.uint8)[:] = self._view(src, dst.nbytes)

    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.calls["dtod"] += 1
        self._view(dst, nbytes)[:] = self._view(src, nbytes).copy()

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: Any) -> None:
        self.calls["copy_2d"] += 1
        self._view2d(dst, dpitch, width, height)[:] = self._view2d(src, spitch, width, height).copy()

    def copy_dtoh_2d(self, dst: np.ndarray, src: int, spitch: int, width: int, height: int, stream: Any) -> None:
        self.calls["dtoh_2d"] += 1
        dst.reshape(-1).view(np.uint8)[: width * height] = self._view2d(src, spitch, width, height).reshape(-1)

    def memset(self, ptr: int, value: int, nbytes: int, stream: Any) -> None:
        self.calls["memset"] += 1
        if nbytes:
            self._view(ptr, nbytes)[:] = value

    def memset_2d(self, ptr: int, pitch: int, value: int, width: int, height: int, stream: Any) -> None:
        self.calls["memset_2d"] += 1
        self._view2d(ptr, pitch, width, height)[:] = value

    def compute_capability(self, device: int = 0) -> tuple[int, int]:
        return (9, 0)

    def close(self) -> None:
        self._arrays.clear()
        self._bases.clear()


class OrtRunner:
    """``tensorrt.Runner`` over ONNX Runtime and ``HostMem`` (see the module docstring)."""

    def __init__(self, spec: ModelSpec, mem: HostMem, options: dict[str, Any] | None = None) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(spec.onnx_path), so, providers=["CPUExecutionProvider"])
        opts = trt_plan.tensorrt_options(spec, options)
        self.info = trt_plan.read_graph_info(spec.onnx_path, opts)
        self.profiles = {p.name: p for p in trt_plan.profiles(spec, self.info, opts)}
        self.vocab_size = self.info.vocab_size
        self.dtypes = {t.name: _ORT_TYPES[t.type] for t in [*self._session.get_inputs(), *self._session.get_outputs()]}
        self._outputs = ["logits", *self.info.present_names]
        self._mem = mem
        self.runs: Counter[str] = Counter()

    def run(self, profile: str, shapes: dict[str, tuple[int, ...]], addresses: dict[str, int], stream: Any) -> None:
        prof = self.profiles[profile]
        for name in self.info.inputs:
            shape = tuple(int(x) for x in shapes[name])
            assert prof.contains(name, shape), f"{name} {shape} is outside the {profile} profile {prof.shape(name)}"
        feed = {name: self._mem.read(addresses[name], tuple(shapes[name]), _NP[self.dtypes[name]])
                for name in self.info.inputs}
        past = shapes[self.info.past_names[0]][2]
        assert shapes["attention_mask"][1] == past + shapes["input_ids"][1], "mask width != past + new tokens"
        for name, out in zip(self._outputs, self._session.run(self._outputs, feed)):
            self._mem.write(addresses[name], out)
        self.runs[profile] += 1

    def close(self) -> None:
        pass


def emulated_engine(spec: ModelSpec, **options: Any) -> Any:
    """A ``TensorRTEngine`` whose GPU is ``HostMem`` and whose plan is ``OrtRunner``."""
    from streamfleet.workers.engines.tensorrt import TensorRTEngine

    mem = HostMem()
    runner = OrtRunner(spec, mem, options)
    return TensorRTEngine(spec, mem=mem, runner=runner, **options)


def fake_tensorrt(mem: HostMem, version: str = "10.8.0.43") -> Any:
    """A stand-in ``tensorrt`` module: the builder records the parsed graph and the
    profiles in a fake plan; the runtime's contexts check what TensorRT checks (profile
    bounds, every I/O bound) and run the graph with ONNX Runtime on ``mem``. Enough of
    the API for ``trt_build.build_plan`` and ``tensorrt.TrtRunner`` to run unchanged."""
    import types

    import onnxruntime as ort

    trt: Any = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.calls = Counter()

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            self.level = level

    class DataType:
        FLOAT, HALF, INT32, INT64 = "FLOAT", "HALF", "INT32", "INT64"

    class TensorIOMode:
        INPUT, OUTPUT = "INPUT", "OUTPUT"

    by_ort = {"tensor(float)": DataType.FLOAT, "tensor(float16)": DataType.HALF,
              "tensor(int64)": DataType.INT64, "tensor(int32)": DataType.INT32}
    np_of = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT64: np.int64,
             DataType.INT32: np.int32}

    class Network:
        def __init__(self, flags: int) -> None:
            self.flags = flags
            self.inputs: list[str] = []
            self.onnx: str | None = None

        @property
        def num_inputs(self) -> int:
            return len(self.inputs)

        def get_input(self, i: int) -> Any:
            return types.SimpleNamespace(name=self.inputs[i])

    class OnnxParser:
        def __init__(self, network: Network, logger: Logger) -> None:
            self.network = network
            self.errors: list[str] = []

        def parse_from_file(self, path: str) -> bool:
            try:
                sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            except Exception as exc:
                self.errors.append(str(exc))
                return False
            self.network.inputs = [i.name for i in sess.get_inputs()]
            self.network.onnx = path
            return True

        @property
        def num_errors(self) -> int:
            return len(self.errors)

        def get_error(self, i: int) -> str:
            return self.errors[i]

    class Profile:
        def __init__(self) -> None:
            self.shapes: dict[str, list[list[int]]] = {}

        def set_shape(self, name: str, lo: Any, opt: Any, hi: Any) -> None:
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), (name, lo, opt, hi)
            self.shapes[name] = [list(lo), list(opt), list(hi)]

    class TimingCache:
        def __init__(self, data: bytes) -> None:
            self.data = data or b"timing:"

        def serialize(self) -> bytes:
            return self.data + b"+"

    class Config:
        def __init__(self) -> None:
            self.profiles: list[dict[str, list[list[int]]]] = []
            self.cleared: list[Any] = []
            self.cache: TimingCache | None = None
            self.pools: dict[int, int] = {}
            self.builder_optimization_level = 3

        def set_memory_pool_limit(self, pool: int, size: int) -> None:
            self.pools[pool] = size

        def clear_flag(self, flag: Any) -> None:
            self.cleared.append(flag)

        def add_optimization_profile(self, p: Profile) -> int:
            self.profiles.append(p.shapes)
            return len(self.profiles) - 1

        def create_timing_cache(self, data: bytes) -> TimingCache:
            return TimingCache(bytes(data))

        def set_timing_cache(self, cache: TimingCache, ignore_mismatch: bool) -> bool:
            self.cache = cache
            return True

        def get_timing_cache(self) -> TimingCache | None:
            return self.cache

    class Builder:
        def __init__(self, logger: Logger) -> None:
            pass

        def create_network(self, flags: int = 0) -> Network:
            trt.calls[f"network-flags-{flags}"] += 1
            return Network(flags)

        def create_builder_config(self) -> Config:
            return Config()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: Config) -> bytes:
            trt.calls["build"] += 1
            plan = {"onnx": network.onnx, "profiles": config.profiles, "inputs": network.inputs}
            return b"FAKEPLAN" + json.dumps(plan).encode()

    class Context:
        def __init__(self, engine: Engine) -> None:
            self.engine, self.profile = engine, 0
            self.shapes: dict[str, tuple[int, ...]] = {}
            self.addresses: dict[str, int] = {}

        def set_optimization_profile_async(self, index: int, stream: int) -> bool:
            if not 0 <= index < engine_profiles(self.engine):
                return False
            self.profile = index
            return True

        def set_input_shape(self, name: str, shape: Any) -> bool:
            lo, _, hi = self.engine.plan["profiles"][self.profile][name]
            if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
                return False
            self.shapes[name] = tuple(int(s) for s in shape)
            return True

        def set_tensor_address(self, name: str, ptr: int) -> bool:
            if name not in self.engine.io:
                return False
            self.addresses[name] = ptr
            return True

        def execute_async_v3(self, stream: int) -> bool:
            eng = self.engine
            if set(eng.inputs) - set(self.shapes) or set(eng.io) - set(self.addresses):
                return False
            feed = {n: mem.read(self.addresses[n], self.shapes[n], np_of[eng.io[n]]) for n in eng.inputs}
            outs = eng.session.run(eng.outputs, feed)
            for n, arr in zip(eng.outputs, outs):
                mem.write(self.addresses[n], arr)
            trt.calls[f"execute-{self.profile}"] += 1
            return True

    def engine_profiles(engine: Engine) -> int:
        return len(engine.plan["profiles"])

    class Engine:
        def __init__(self, plan: dict) -> None:
            self.plan = plan
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            self.session = ort.InferenceSession(plan["onnx"], so, providers=["CPUExecutionProvider"])
            self.inputs = [i.name for i in self.session.get_inputs()]
            self.outputs = [o.name for o in self.session.get_outputs()]
            self.io = {t.name: by_ort[t.type] for t in [*self.session.get_inputs(), *self.session.get_outputs()]}
            self._names = [*self.inputs, *self.outputs]
            self._shapes = {t.name: t.shape for t in [*self.session.get_inputs(), *self.session.get_outputs()]}

        @property
        def num_io_tensors(self) -> int:
            return len(self._names)

        @property
        def num_optimization_profiles(self) -> int:
            return engine_profiles(self)

        def get_tensor_name(self, i: int) -> str:
            return self._names[i]

        def get_tensor_mode(self, name: str) -> str:
            return TensorIOMode.INPUT if name in self.inputs else TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name: str) -> str:
            return self.io[name]

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            return tuple(d if isinstance(d, int) else -1 for d in self._shapes[name])

        def create_execution_context(self) -> Context:
            return Context(self)

    class Runtime:
        def __init__(self, logger: Logger) -> None:
            pass

        def deserialize_cuda_engine(self, data: bytes) -> Engine | None:
            trt.calls["deserialize"] += 1
            if not data.startswith(b"FAKEPLAN"):
                return None
            return Engine(json.loads(data[len(b"FAKEPLAN"):]))

    trt.Logger, trt.DataType, trt.TensorIOMode = Logger, DataType, TensorIOMode
    trt.Builder, trt.OnnxParser, trt.Runtime = Builder, OnnxParser, Runtime
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=5)
    trt.BuilderFlag = types.SimpleNamespace(TF32=7)
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE=0)
    return trt
