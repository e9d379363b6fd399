"""CUDA memory and streams behind one small interface, for the TensorRT backend.

Two implementations, chosen by what is installed (``select``):

* ``cuda-python`` (preferred): the runtime API through ``cuda.bindings.runtime`` (or the
  older ``cuda.cudart`` module name). The runtime API uses the device's primary context,
  the one TensorRT uses too.
* ``pycuda``: the driver API through ``pycuda.driver``, with the context from
  ``pycuda.autoprimaryctx`` (the *primary* context, retained rather than created), so
  pycuda's allocations and TensorRT's kernels live in the same context. The context is
  made current on whichever thread calls in (a worker runs its engine on an executor
  thread).

Nothing here imports either package at module import; ``choose`` probes them with an
injectable import function, so the choice itself is testable on a CPU machine.

Pointers are plain ``int`` device addresses; sizes and pitches are in bytes; every copy
and memset is asynchronous on the given stream (host buffers must come from
``host_empty``, which is page-locked, and stay untouched until the stream is
synchronized).
"""

from __future__ import annotations

import ctypes
import importlib
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from streamfleet.shared.errors import FatalError
from streamfleet.shared.logging import get_logger

__all__ = [
    "IMPLEMENTATIONS",
    "CudaError",
    "CudaMem",
    "DeviceBuffer",
    "Stream",
    "choose",
    "detect_compute_capability",
    "select",
]

#: implementation name -> the modules that must import for it, in order of preference
#: (the first of each inner tuple that imports is used)
_PROBES: dict[str, tuple[str, ...]] = {
    "cuda-python": ("cuda.bindings.runtime", "cuda.cudart"),
    "pycuda": ("pycuda.driver",),
}
#: ``auto`` tries these in order
_PREFERENCE = ("cuda-python", "pycuda")

Importer = Callable[[str], Any]

log = get_logger("cuda")


class CudaError(RuntimeError):
    """A CUDA call failed (the message names the call and CUDA's error string)."""


@dataclass(frozen=True, slots=True)
class DeviceBuffer:
    """A device allocation: its address and size."""

    ptr: int
    nbytes: int


class Stream(Protocol):
    #: the ``cudaStream_t`` as an int, what TensorRT's ``execute_async_v3`` takes
    handle: int
    #: the CUDA library's own stream object (what its asynchronous calls take)
    native: Any

    def synchronize(self) -> None: ...


class CudaMem(Protocol):
    """The few CUDA operations the TensorRT backend needs."""

    name: str

    def alloc(self, nbytes: int) -> DeviceBuffer: ...
    def free(self, buf: DeviceBuffer) -> None: ...
    def host_empty(self, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        """A page-locked host array (valid until ``close``)."""
        ...
    def stream(self) -> Stream: ...
    def copy_htod(self, dst: int, src: np.ndarray, stream: Stream) -> None: ...
    def copy_dtoh(self, dst: np.ndarray, src: int, stream: Stream) -> None: ...
    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: Stream) -> None: ...
    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                stream: Stream) -> None:
        """Device to device: ``height`` rows of ``width`` bytes."""
        ...
    def copy_dtoh_2d(self, dst: np.ndarray, src: int, spitch: int, width: int, height: int,
                     stream: Stream) -> None:
        """Device to host: ``height`` rows of ``width`` bytes, packed into ``dst``."""
        ...
    def memset(self, ptr: int, value: int, nbytes: int, stream: Stream) -> None: ...
    def memset_2d(self, ptr: int, pitch: int, value: int, width: int, height: int,
                  stream: Stream) -> None: ...
    def compute_capability(self, device: int = 0) -> tuple[int, int]: ...
    def close(self) -> None: ...


# -- choosing --------------------------------------------------------------------------


def _probe(name: str, importer: Importer) -> tuple[Any | None, str]:
    """The first importable module for implementation ``name``, or None and why not."""
    reasons = []
    for module in _PROBES[name]:
        try:
            return importer(module), module
        except Exception as exc:  # ImportError, or OSError from a missing libcuda
            reasons.append(f"{module}: {exc}")
    return None, "; ".join(reasons)


def choose(name: str = "auto", importer: Importer | None = None) -> tuple[str, Any]:
    """Pick the implementation: ``auto`` prefers cuda-python, then pycuda.

    Returns:
        ``(implementation name, its imported module)``.

    Raises:
        FatalError: unknown name, or the named (for ``auto``: every) package is missing;
            the message names the packages to install.
    """
    importer = importer or importlib.import_module
    if name != "auto" and name not in _PROBES:
        raise FatalError(f"unknown CUDA library {name!r}; use auto, {', '.join(_PREFERENCE)}")
    candidates = _PREFERENCE if name == "auto" else (name,)
    why = []
    for cand in candidates:
        module, detail = _probe(cand, importer)
        if module is not None:
            return cand, module
        why.append(f"{cand} ({detail})")
    wanted = " or ".join(candidates)
    raise FatalError(f"the TensorRT backend needs {wanted} for CUDA memory "
                     f"(pip install 'streamfleet[gpu]'); not importable: {'; '.join(why)}")


def select(name: str = "auto", importer: Importer | None = None) -> CudaMem:
    """An initialised ``CudaMem`` (touches the GPU). With ``auto``, a library that imports
    but cannot initialise CUDA (cuda-python built for a newer CUDA than the driver
    supports, say) gives way to the next, with a log line saying so.

    Raises:
        FatalError: no usable package (see ``choose``), or CUDA cannot start.
    """
    importer = importer or importlib.import_module
    chosen, module = choose(name, importer)
    # with auto, the importable libraries after the chosen one are the fallbacks, in order
    candidates = _PREFERENCE[_PREFERENCE.index(chosen):] if name == "auto" else (chosen,)
    failed: tuple[str, str] | None = None  # (library, why) of the last that could not start
    for cand in candidates:
        if cand != chosen:
            module, _ = _probe(cand, importer)
            if module is None:
                continue
            if failed is not None:  # (always: the library before this one failed)
                log.warning("CUDA library cannot initialise; falling back", failed=failed[0], error=failed[1],
                            using=cand)
        try:
            return IMPLEMENTATIONS[cand](module, importer)
        except Exception as exc:
            failed = (cand, exc.message if isinstance(exc, FatalError) else f"{cand} cannot initialise CUDA: {exc}")
            cause = exc
    if failed is None:  # (never: ``candidates`` holds at least the chosen library)
        raise FatalError(f"no CUDA library to try for {name!r}")
    raise FatalError(failed[1]) from cause


def detect_compute_capability(mem: CudaMem | None = None, device: int = 0) -> str:
    """The GPU's compute capability as digits (``"90"`` for sm_90): from ``mem`` when
    given, else from ``nvidia-smi``, else through the CUDA library (``select``).

    Raises:
        FatalError: no GPU found.
    """
    if mem is not None:
        major, minor = mem.compute_capability(device)
        return f"{major}{minor}"
    exe = shutil.which("nvidia-smi")
    if exe is None:
        try:
            probe = select("auto")
        except FatalError as exc:
            raise FatalError(f"no NVIDIA GPU here (nvidia-smi not found; {exc.message})") from exc
        try:
            major, minor = probe.compute_capability(device)
        finally:
            probe.close()
        return f"{major}{minor}"
    try:
        out = subprocess.run([exe, "--query-gpu=compute_cap", "--format=csv,noheader", "-i", str(device)],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        smi_major, _, smi_minor = out.strip().splitlines()[0].strip().partition(".")
        return f"{int(smi_major)}{int(smi_minor or 0)}"
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        raise FatalError(f"cannot read the GPU's compute capability from nvidia-smi: {exc}") from exc


# -- cuda-python -----------------------------------------------------------------------


class _RtStream:
    def __init__(self, mem: CudaPythonMem, native: ModuleType) -> None:
        self._mem, self.native = mem, native
        self.handle = int(native)

    def synchronize(self) -> None:
        self._mem._call("cudaStreamSynchronize", self.native)


class CudaPythonMem:
    """``CudaMem`` over cuda-python's runtime bindings."""

    name = "cuda-python"

    def __init__(self, rt: ModuleType, importer: Importer | None = None) -> None:
        self._rt = rt
        self._h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._d2h = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._d2d = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self._host: list[int] = []
        self._streams: list[Any] = []
        self._call("cudaFree", 0)  # initialises the runtime (primary context) now, not mid-step

    def _call(self, fn: str, *args: Any) -> Any:
        result = getattr(self._rt, fn)(*args)
        err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if err != self._rt.cudaError_t.cudaSuccess:
            try:
                msg = self._rt.cudaGetErrorString(err)[1]
                msg = msg.decode() if isinstance(msg, bytes) else str(msg)
            except Exception:  # the error string is a courtesy
                msg = str(err)
            raise CudaError(f"{fn} failed: {msg}")
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else rest

    def alloc(self, nbytes: int) -> DeviceBuffer:
        return DeviceBuffer(int(self._call("cudaMalloc", max(int(nbytes), 1))), int(nbytes))

    def free(self, buf: DeviceBuffer) -> None:
        self._call("cudaFree", buf.ptr)

    def host_empty(self, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        count = int(np.prod(shape))
        nbytes = max(count * dt.itemsize, 1)
        ptr = int(self._call("cudaMallocHost", nbytes))
        self._host.append(ptr)
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        return np.frombuffer(raw, dtype=dt, count=count).reshape(shape)

    def stream(self) -> _RtStream:
        flags = getattr(self._rt, "cudaStreamNonBlocking", 1)
        native = self._call("cudaStreamCreateWithFlags", flags)
        self._streams.append(native)
        return _RtStream(self, native)

    def copy_htod(self, dst: int, src: np.ndarray, stream: Stream) -> None:
        self._call("cudaMemcpyAsync", dst, src.ctypes.data, src.nbytes, self._h2d, stream.native)

    def copy_dtoh(self, dst: np.ndarray, src: int, stream: Stream) -> None:
        self._call("cudaMemcpyAsync", dst.ctypes.data, src, dst.nbytes, self._d2h, stream.native)

    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        self._call("cudaMemcpyAsync", dst, src, nbytes, self._d2d, stream.native)

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                stream: Stream) -> None:
        self._call("cudaMemcpy2DAsync", dst, dpitch, src, spitch, width, height, self._d2d, stream.native)

    def copy_dtoh_2d(self, dst: np.ndarray, src: int, spitch: int, width: int, height: int,
                     stream: Stream) -> None:
        assert dst.nbytes >= width * height
        self._call("cudaMemcpy2DAsync", dst.ctypes.data, width, src, spitch, width, height, self._d2h,
                   stream.native)

    def memset(self, ptr: int, value: int, nbytes: int, stream: Stream) -> None:
        self._call("cudaMemsetAsync", ptr, value, nbytes, stream.native)

    def memset_2d(self, ptr: int, pitch: int, value: int, width: int, height: int, stream: Stream) -> None:
        self._call("cudaMemset2DAsync", ptr, pitch, value, width, height, stream.native)

    def compute_capability(self, device: int = 0) -> tuple[int, int]:
        attr = self._rt.cudaDeviceAttr
        major = self._call("cudaDeviceGetAttribute", attr.cudaDevAttrComputeCapabilityMajor, device)
        minor = self._call("cudaDeviceGetAttribute", attr.cudaDevAttrComputeCapabilityMinor, device)
        return int(major), int(minor)

    def close(self) -> None:
        for ptr in self._host:
            self._call("cudaFreeHost", ptr)
        for s in self._streams:
            self._call("cudaStreamDestroy", s)
        self._host.clear()
        self._streams.clear()


# -- pycuda ----------------------------------------------------------------------------


class _PyStream:
    def __init__(self, mem: PyCudaMem, native: ModuleType) -> None:
        self._mem, self.native = mem, native
        self.handle = int(native.handle)

    def synchronize(self) -> None:
        self._mem._enter()
        self.native.synchronize()


class PyCudaMem:
    """``CudaMem`` over pycuda's driver bindings, in the device's primary context."""

    name = "pycuda"

    def __init__(self, drv: ModuleType, importer: Importer | None = None) -> None:
        importer = importer or importlib.import_module
        # Retains the primary context (the one the CUDA runtime, and so TensorRT, uses)
        # and makes it current on this thread; pops it at interpreter exit.
        self._ctx = importer("pycuda.autoprimaryctx").context
        self._drv = drv
        self._tls = threading.local()
        self._enter()
        self._allocs: dict[int, Any] = {}
        self._host: list[np.ndarray] = []

    def _enter(self) -> None:
        """Make the primary context current on the calling thread (once per thread)."""
        if getattr(self._tls, "ready", False):
            return
        if self._drv.Context.get_current() is None:
            self._ctx.push()
        self._tls.ready = True

    def alloc(self, nbytes: int) -> DeviceBuffer:
        self._enter()
        alloc = self._drv.mem_alloc(max(int(nbytes), 1))
        self._allocs[int(alloc)] = alloc
        return DeviceBuffer(int(alloc), int(nbytes))

    def free(self, buf: DeviceBuffer) -> None:
        self._enter()
        alloc = self._allocs.pop(buf.ptr, None)
        if alloc is not None:
            alloc.free()

    def host_empty(self, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        self._enter()
        arr = self._drv.pagelocked_empty(shape, dtype)
        self._host.append(arr)
        return arr

    def stream(self) -> _PyStream:
        self._enter()
        return _PyStream(self, self._drv.Stream())

    def copy_htod(self, dst: int, src: np.ndarray, stream: Stream) -> None:
        self._enter()
        self._drv.memcpy_htod_async(dst, src, stream.native)

    def copy_dtoh(self, dst: np.ndarray, src: int, stream: Stream) -> None:
        self._enter()
        self._drv.memcpy_dtoh_async(dst, src, stream.native)

    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        self._enter()
        self._drv.memcpy_dtod_async(dst, src, nbytes, stream.native)

    def _copy2d(self, height: int, width: int, spitch: int, dpitch: int, src: int,
                dst: int | np.ndarray) -> Any:
        c = self._drv.Memcpy2D()
        c.set_src_device(src)
        c.src_pitch = spitch
        if isinstance(dst, np.ndarray):
            c.set_dst_host(dst)
        else:
            c.set_dst_device(dst)
        c.dst_pitch = dpitch
        c.width_in_bytes = width
        c.height = height
        return c

    def copy_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                stream: Stream) -> None:
        self._enter()
        self._copy2d(height, width, spitch, dpitch, src, dst)(stream.native)

    def copy_dtoh_2d(self, dst: np.ndarray, src: int, spitch: int, width: int, height: int,
                     stream: Stream) -> None:
        assert dst.nbytes >= width * height
        self._enter()
        self._copy2d(height, width, spitch, width, src, dst)(stream.native)

    def memset(self, ptr: int, value: int, nbytes: int, stream: Stream) -> None:
        self._enter()
        self._drv.memset_d8_async(ptr, value, nbytes, stream.native)

    def memset_2d(self, ptr: int, pitch: int, value: int, width: int, height: int, stream: Stream) -> None:
        self._enter()
        self._drv.memset_d2d8_async(ptr, pitch, value, width, height, stream.native)

    def compute_capability(self, device: int = 0) -> tuple[int, int]:
        self._enter()
        major, minor = self._drv.Device(device).compute_capability()
        return int(major), int(minor)

    def close(self) -> None:
        self._enter()
        for alloc in self._allocs.values():
            alloc.free()
        self._allocs.clear()
        self._host.clear()


#: implementation name -> class (constructed with the probed module and the importer)
IMPLEMENTATIONS: dict[str, Callable[[Any, Importer], CudaMem]] = {
    "cuda-python": CudaPythonMem,
    "pycuda": PyCudaMem,
}
