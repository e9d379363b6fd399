"""TensorRT plans: the build itself (GPU).

``build_plan`` finds ``spec``'s plan for this host's TensorRT and GPU (what to build is
``trt_plan.plan_request``) or builds it: it parses the ONNX file with ``OnnxParser`` into
a strongly typed network (the graph's own dtypes decide precision; TensorRT 11 removed
the FP16 / BF16 builder flags), adds the profiles and the timing cache, builds, and
writes the plan and its sidecar atomically (``trt_plan.write_plan``), under a file lock
so two workers on one host build once.

``tensorrt`` is imported lazily (``import_tensorrt``), so this module imports on a
machine without TensorRT or a GPU; only a build needs them.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from streamfleet.shared.errors import FatalError
from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.workers.engines.trt_plan import (
    BuildResult,
    PlanRequest,
    plan_request,
    tensorrt_options,
    write_atomic,
    write_plan,
)

if TYPE_CHECKING:  # (TensorRT ships no type information: to the checker this is Any)
    from tensorrt import ILogger

__all__ = ["build_plan", "build_serialized", "import_tensorrt", "trt_logger"]


#: one logger per tensorrt module object (TensorRT expects a single logger per process)
_LOGGERS: dict[int, Any] = {}


def import_tensorrt() -> ModuleType:
    """``import tensorrt`` (10.x or 11.x).

    Raises:
        FatalError: not installed, or too old; the message says what to install.
    """
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise FatalError("the tensorrt backend needs the 'tensorrt' package (TensorRT 10 or 11, "
                         f"pip install 'streamfleet[gpu]') and an NVIDIA GPU: {exc}") from exc
    try:
        major = int(str(trt.__version__).split(".")[0])
    except ValueError:
        major = 0
    if major < 10:
        raise FatalError(f"TensorRT {trt.__version__} is too old; the tensorrt backend needs 10.x or 11.x")
    return trt


def trt_logger(trt: ModuleType) -> ILogger:
    """One ``trt.Logger`` per process (TensorRT expects a single logger)."""
    logger = _LOGGERS.get(id(trt))
    if logger is None:
        logger = _LOGGERS[id(trt)] = trt.Logger(trt.Logger.WARNING)
    return logger


def _network_flags(trt: ModuleType) -> int:
    major = int(str(trt.__version__).split(".")[0])
    if major >= 11:
        return 0  # every network is strongly typed; the creation flag is gone or ignored
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if flag is None:
        raise FatalError(f"TensorRT {trt.__version__} has no strongly typed networks; use 10.x (recent) or 11.x")
    return 1 << int(flag)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (two workers of one host build a plan once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_serialized(request: PlanRequest, trt: ModuleType, log: Callable[[str], None] = lambda s: None) -> bytes:
    """Parse, configure and build; returns the serialized plan. Updates the timing cache.

    Raises:
        FatalError: the parser or the builder fails (with TensorRT's messages).
    """
    logger = trt_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    onnx_path = request.spec.onnx_path
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise FatalError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors or 'no details'}")

    config = builder.create_builder_config()
    b = request.build
    if int(b.get("workspace_mb") or 0) > 0:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(b["workspace_mb"]) << 20)
    if hasattr(config, "builder_optimization_level"):
        config.builder_optimization_level = int(b.get("builder_optimization_level", 3))
    tf32 = getattr(trt.BuilderFlag, "TF32", None)
    if tf32 is not None and not b.get("tf32"):
        config.clear_flag(tf32)

    net_inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for want_index, prof in enumerate(request.profiles):
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in prof.shapes:
            if name in net_inputs:  # a graph input TensorRT pruned (unused) takes no shape
                p.set_shape(name, lo, opt, hi)
        index = config.add_optimization_profile(p)
        if index != want_index:
            raise FatalError(f"TensorRT refused the {prof.name} profile (index {index}): {prof.as_dict()}")

    cache_path = request.timing_cache_path
    cache = None
    if cache_path.exists():
        try:
            cache = config.create_timing_cache(cache_path.read_bytes())
            if not config.set_timing_cache(cache, ignore_mismatch=False):
                log(f"timing cache {cache_path} does not match this TensorRT/GPU; starting a new one")
                cache = None
        except Exception as exc:  # a corrupt cache is only a slower build
            log(f"timing cache {cache_path} unusable ({exc}); starting a new one")
            cache = None
    if cache is None:
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, ignore_mismatch=False)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise FatalError(f"TensorRT could not build {request.spec.name} (see TensorRT's log above)")
    try:
        write_atomic(cache_path, bytes(config.get_timing_cache().serialize()))
    except Exception as exc:  # the plan is what matters
        log(f"could not save the timing cache {cache_path}: {exc}")
    return bytes(serialized)


def build_plan(spec: ModelSpec, *, force: bool = False, options: Mapping[str, Any] | None = None,
               compute_capability: str | None = None, trt: ModuleType | None = None,
               log: Callable[[str], None] = lambda s: None) -> BuildResult:
    """Build (or find) ``spec``'s plan for this host's TensorRT and GPU.

    Args:
        force: build even when the plan exists.
        options: as ``tensorrt_options`` returns (read from ``spec`` when None).
        compute_capability: e.g. ``"90"``; detected from the GPU when None.

    Raises:
        FatalError: no TensorRT, no GPU, a bad graph, or the build fails.
    """
    trt = trt or import_tensorrt()
    opts = tensorrt_options(spec, options)
    if compute_capability is None:
        from streamfleet.workers.engines.cuda_mem import detect_compute_capability

        compute_capability = detect_compute_capability()
    request = plan_request(spec, trt.__version__, compute_capability, opts)
    with _locked(request.path.with_name(f".{request.path.stem}.lock")):
        if request.path.exists() and not force:
            return BuildResult.from_sidecar(request)
        log(f"building {request.path.name} for {spec.name} (TensorRT {trt.__version__}, sm{compute_capability})")
        t0 = time.perf_counter()
        data = build_serialized(request, trt, log)
        result = write_plan(request, data, time.perf_counter() - t0)
    log(f"built {result.path} in {result.seconds:.1f}s ({len(data) / 1e6:.1f} MB)")
    return result
