"""TensorRT plans: what to build, decided without TensorRT (pure, testable anywhere).

``read_graph_info`` reads the layout from the ONNX graph (layers, KV heads, head size,
dtypes); ``profiles`` turns it and the model's ``max_batch`` / ``max_context`` into two
optimization profiles; ``plan_key`` hashes everything a plan depends on;
``plan_request`` puts it together with the path the plan lives at; ``write_plan`` /
``read_sidecar`` / ``list_local_plans`` store and find plans and their records::

    engines/MODEL/plans/<trt major.minor>-sm<cc>-<key[:16]>.plan    the serialized engine
    engines/MODEL/plans/<same name>.json                          key material + build record
    engines/MODEL/plans/timing-sm<cc>-trt<major.minor>.cache      timing cache, per GPU arch

The key covers the TensorRT version, the GPU's compute capability, the SHA-256 of the
graph (and its external data files), the profiles and the builder settings, so changing
any of them names a different file: stale plans are never loaded, only left behind.

Profiles (names as in the graph; B = max_batch, C = max_context)::

    prefill  input_ids [1..B, 1..C]   attention_mask [1..B, 1..C]   past [1..B, H, 0, D]
    decode   input_ids [1..B, 1]      attention_mask [1..B, 2..C]   past [1..B, H, 1..C-1, D]

Nothing here imports TensorRT or a CUDA library (``onnx`` only, lazily, to read a
graph): model import, ``streamfleet engines list`` and dry runs use it on machines with
no GPU. The build itself is ``trt_build``.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamfleet.shared.errors import FatalError
from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.workers.engines.base import PAST_RE, count_past_layers

if TYPE_CHECKING:
    from onnx import ModelProto, ValueInfoProto

__all__ = [
    "BUILD_DEFAULTS",
    "BuildResult",
    "DECODE",
    "GraphInfo",
    "PREFILL",
    "PlanRequest",
    "Profile",
    "RUNTIME_DEFAULTS",
    "graph_info_from_model",
    "graph_sha256",
    "list_local_plans",
    "plan_filename",
    "plan_key",
    "plan_request",
    "profiles",
    "read_graph_info",
    "read_sidecar",
    "tensorrt_options",
    "timing_cache_path",
    "trt_major_minor",
    "write_atomic",
    "write_plan",
]


#: bump when the meaning of the key material changes
KEY_FORMAT = 1
PREFILL, DECODE = "prefill", "decode"

#: ONNX TensorProto element types we accept -> names used in keys and by the engine
_ONNX_TYPES = {1: "float32", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int64"}

#: options read at build time; they enter the plan key
BUILD_DEFAULTS: dict[str, Any] = {
    #: TensorRT's builder_optimization_level (0..5; 3 is TensorRT's default)
    "builder_optimization_level": 3,
    #: workspace memory pool limit in MiB (0: TensorRT's default, the whole GPU)
    "workspace_mb": 0,
    #: allow TF32 for float32 matmuls (off: fp32 plans match ONNX Runtime more closely)
    "tf32": False,
    # optimization profile "opt" points (0: derived from max_batch / max_context)
    "opt_prefill_batch": 0,
    "opt_prefill_len": 0,
    "opt_decode_batch": 0,
    "opt_decode_context": 0,
}
#: options only the running engine reads
RUNTIME_DEFAULTS: dict[str, Any] = {
    #: build the plan when it is missing or does not deserialize (else refuse to start)
    "build_if_missing": True,
    #: CUDA library for memory and streams: auto | cuda-python | pycuda
    "cuda": "auto",
    #: where plans live (default: <model folder>/plans)
    "plans_dir": "",
    #: most tokens (rows x padded length) one prefill run may hold (0: min(B*C, 8192), at least C)
    "max_prefill_tokens": 0,
    #: graph fallbacks when the KV dims are symbolic (as for ONNX Runtime, engine.toml top level too)
    "num_key_value_heads": 0,
    "head_dim": 0,
}


# -- options ---------------------------------------------------------------------------


def tensorrt_options(spec: ModelSpec, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The TensorRT options: defaults, then engine.toml's ``[tensorrt]`` table, then
    ``options`` (keyword arguments of the engine; unknown ones are ignored, since a
    worker may pass options meant for other backends).

    Raises:
        FatalError: an unknown key or a badly typed value in ``[tensorrt]``.
    """
    known = {**BUILD_DEFAULTS, **RUNTIME_DEFAULTS}
    merged = dict(known)
    for key in ("num_key_value_heads", "head_dim"):
        if isinstance(spec.options.get(key), int):
            merged[key] = spec.options[key]
    table = spec.options.get("tensorrt", {})
    if not isinstance(table, dict):
        raise FatalError(f"{spec.path / 'engine.toml'}: [tensorrt] must be a table")
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise FatalError(f"{spec.path / 'engine.toml'}: unknown [tensorrt] keys {unknown}; "
                         f"known: {', '.join(sorted(known))}")
    merged.update(table)
    merged.update({k: v for k, v in (options or {}).items() if k in known and v is not None})
    for key, default in known.items():
        value = merged[key]
        try:
            if isinstance(default, bool):
                merged[key] = _as_bool(value)
            elif isinstance(default, int):
                merged[key] = int(value)
            else:
                merged[key] = str(value)
        except (TypeError, ValueError) as exc:
            raise FatalError(f"TensorRT option {key}={value!r}: {exc}") from exc
    return merged


def _as_bool(value: object) -> bool:
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {value!r}")
    return bool(value)


# -- the graph -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GraphInfo:
    """What a with-past decoder graph looks like, read from its inputs and outputs."""

    n_layer: int
    kv_heads: int
    head_dim: int
    #: None when the logits' last dim is symbolic
    vocab_size: int | None
    kv_dtype: str
    logits_dtype: str
    #: dtype of input_ids / attention_mask / position_ids
    index_dtype: str
    has_position_ids: bool
    inputs: tuple[str, ...]

    @property
    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kv}" for i in range(self.n_layer) for kv in ("key", "value")]

    @property
    def present_names(self) -> list[str]:
        return [f"present.{i}.{kv}" for i in range(self.n_layer) for kv in ("key", "value")]


def _dims(value_info: ValueInfoProto) -> list[int | str]:
    out: list[int | str] = []
    for d in value_info.type.tensor_type.shape.dim:
        out.append(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?"))
    return out


def graph_info_from_model(model: ModelProto, where: str = "graph", options: Mapping[str, Any] | None = None, *,
                          tensorrt: bool = True) -> GraphInfo:
    """``GraphInfo`` from an ``onnx.ModelProto`` (weights need not be loaded). With
    ``tensorrt=False`` (any backend: ``streamfleet engines import``) a merged decoder's
    ``use_cache_branch`` and a missing ``position_ids`` are accepted.

    Raises:
        FatalError: not the with-past layout, an unsupported input or dtype, or KV dims
            that are symbolic with no ``num_key_value_heads`` / ``head_dim`` option.
    """
    options = options or {}
    inputs = {i.name: i for i in model.graph.input}
    init_names = {t.name for t in model.graph.initializer}
    inputs = {k: v for k, v in inputs.items() if k not in init_names}  # old exports list weights as inputs
    outputs = {o.name: o for o in model.graph.output}
    n_layer = count_past_layers(inputs, where)
    for name in ("input_ids", "attention_mask"):
        if name not in inputs:
            raise FatalError(f"{where} has no {name!r} input")
    allowed = {"input_ids", "attention_mask", "position_ids"} | (set() if tensorrt else {"use_cache_branch"})
    extra = sorted(n for n in inputs if n not in allowed and not PAST_RE.match(n))
    if "use_cache_branch" in extra:
        raise FatalError(f"{where} is a merged decoder (input use_cache_branch), which the TensorRT backend does "
                         f"not build; export without --legacy (one model.onnx), or serve it with "
                         f'backend = "onnxruntime"')
    if extra:
        raise FatalError(f"{where} has inputs the TensorRT backend does not feed: {extra}")
    if tensorrt and "position_ids" not in inputs:
        # the graph would take positions from cache columns, which batching pads and moves
        raise FatalError(f"{where} has no position_ids input, so its positions follow cache columns and the "
                         f"TensorRT backend's padded batches would silently change its output; re-export it "
                         f"with position_ids (an Optimum ONNX config whose inputs include them), or serve it "
                         f'with backend = "onnxruntime", which runs such graphs unpadded')
    info_out = ["logits"] + [f"present.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
    missing = [n for n in info_out if n not in outputs]
    if missing:
        raise FatalError(f"{where} lacks outputs {missing}")

    def elem(vi: ValueInfoProto) -> str:
        t = vi.type.tensor_type.elem_type
        if t not in _ONNX_TYPES:
            raise FatalError(f"{where}: {vi.name} has an unsupported element type ({t})")
        return _ONNX_TYPES[t]

    past0 = inputs["past_key_values.0.key"]
    dims = _dims(past0)
    if len(dims) != 4:
        raise FatalError(f"{where}: past_key_values.0.key has rank {len(dims)}, "
                         f"expected 4 [batch, heads, past, head_dim]")
    kv_heads = dims[1] if isinstance(dims[1], int) else int(options.get("num_key_value_heads") or 0)
    head_dim = dims[3] if isinstance(dims[3], int) else int(options.get("head_dim") or 0)
    if kv_heads <= 0 or head_dim <= 0:
        raise FatalError(f"{where}: KV heads / head size are not fixed in the graph; "
                         f"set num_key_value_heads and head_dim in engine.toml")
    for name in (n for n in inputs if PAST_RE.match(n)):
        d = _dims(inputs[name])
        if len(d) != 4 or (isinstance(d[1], int) and d[1] != kv_heads) or (isinstance(d[3], int) and d[3] != head_dim):
            raise FatalError(f"{where}: {name} has shape {d}, unlike past_key_values.0.key {dims}")
    kv_dtype = elem(past0)
    if kv_dtype not in ("float32", "float16", "bfloat16"):
        raise FatalError(f"{where}: KV cache type {kv_dtype} is not a float type")
    index_dtype = elem(inputs["input_ids"])
    if index_dtype not in ("int32", "int64"):
        raise FatalError(f"{where}: input_ids is {index_dtype}, expected int32 or int64")
    logits_dims = _dims(outputs["logits"])
    vocab = logits_dims[-1] if logits_dims and isinstance(logits_dims[-1], int) else None
    return GraphInfo(n_layer=n_layer, kv_heads=int(kv_heads), head_dim=int(head_dim), vocab_size=vocab,
                     kv_dtype=kv_dtype, logits_dtype=elem(outputs["logits"]), index_dtype=index_dtype,
                     has_position_ids="position_ids" in inputs, inputs=tuple(inputs))


def read_graph_info(onnx_path: Path, options: Mapping[str, Any] | None = None, *, tensorrt: bool = True,
                    ) -> GraphInfo:
    """``GraphInfo`` of an ONNX file (external weight files are not read).

    Raises:
        FatalError: the file is missing, unreadable or not in the with-past layout.
    """
    import onnx  # lazily: only plan computations need it

    if not onnx_path.exists():
        raise FatalError(f"{onnx_path} is missing; run `python -m streamfleet.shared.tinymodel "
                         f"--model-dir {onnx_path.parent}`")
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise FatalError(f"cannot read {onnx_path}: {exc}") from exc
    return graph_info_from_model(model, str(onnx_path), options, tensorrt=tensorrt)


def graph_sha256(onnx_path: Path) -> str:
    """SHA-256 over the graph file and, in name order, the external data files it names."""
    import onnx

    h = hashlib.sha256()
    _hash_file(h, onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    locations = set()
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for entry in t.external_data:
                if entry.key == "location":
                    locations.add(entry.value)
    for loc in sorted(locations):
        h.update(b"\0" + loc.encode() + b"\0")
        _hash_file(h, onnx_path.parent / loc)
    return h.hexdigest()


def _hash_file(h: Any, path: Path) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)


# -- profiles --------------------------------------------------------------------------

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Profile:
    """One optimization profile: ``(min, opt, max)`` shapes per input name."""

    name: str
    shapes: tuple[tuple[str, tuple[Shape, Shape, Shape]], ...]

    def shape(self, name: str) -> tuple[Shape, Shape, Shape]:
        for n, s in self.shapes:
            if n == name:
                return s
        raise KeyError(name)

    def names(self) -> list[str]:
        return [n for n, _ in self.shapes]

    def contains(self, name: str, shape: Shape) -> bool:
        lo, _, hi = self.shape(name)
        return len(shape) == len(lo) and all(a <= s <= b for a, s, b in zip(lo, shape, hi))

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name,
                "shapes": {n: {"min": list(s[0]), "opt": list(s[1]), "max": list(s[2])} for n, s in self.shapes}}


def profiles(spec: ModelSpec, info: GraphInfo, options: Mapping[str, Any] | None = None) -> list[Profile]:
    """The prefill and decode profiles for ``spec``'s ``max_batch`` / ``max_context``.

    Prefill: prompts of 1..C tokens from an empty past; decode: one token onto a past
    of 1..C-1 slots. ``opt`` points default to a mid-sized prefill (128 tokens) and a
    full decode batch at half the context; ``options`` may move them.

    Raises:
        FatalError: max_batch < 1 or max_context < 2.
    """
    opts = {**BUILD_DEFAULTS, **(options or {})}
    b, c = int(spec.max_batch), int(spec.max_context)
    if b < 1 or c < 2:
        raise FatalError(f"{spec.name}: max_batch must be >= 1 and max_context >= 2 for TensorRT profiles")
    h, d = info.kv_heads, info.head_dim

    def clamp(v: int, lo: int, hi: int) -> int:
        return max(lo, min(hi, v))

    p_len = clamp(int(opts["opt_prefill_len"]) or min(c, 128), 1, c)
    p_batch = clamp(int(opts["opt_prefill_batch"]) or max(1, min(b, 1024 // p_len)), 1, b)
    d_batch = clamp(int(opts["opt_decode_batch"]) or b, 1, b)
    d_ctx = clamp(int(opts["opt_decode_context"]) or max(2, c // 2), 2, c)

    def build(name: str, ids: tuple[Shape, Shape, Shape], mask: tuple[Shape, Shape, Shape],
              past: tuple[Shape, Shape, Shape]) -> Profile:
        shapes: list[tuple[str, tuple[Shape, Shape, Shape]]] = []
        for n in info.inputs:
            if n in ("input_ids", "position_ids"):
                shapes.append((n, ids))
            elif n == "attention_mask":
                shapes.append((n, mask))
            else:
                shapes.append((n, past))
        return Profile(name, tuple(shapes))

    prefill = build(PREFILL,
                    ((1, 1), (p_batch, p_len), (b, c)),
                    ((1, 1), (p_batch, p_len), (b, c)),
                    ((1, h, 0, d), (p_batch, h, 0, d), (b, h, 0, d)))
    decode = build(DECODE,
                   ((1, 1), (d_batch, 1), (b, 1)),
                   ((1, 2), (d_batch, d_ctx), (b, c)),
                   ((1, h, 1, d), (d_batch, h, d_ctx - 1, d), (b, h, c - 1, d)))
    return [prefill, decode]


# -- keys and paths --------------------------------------------------------------------


def trt_major_minor(version: str) -> str:
    """``"10.8.0.43"`` -> ``"10.8"``."""
    parts = version.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else version


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def key_material(trt_version: str, compute_capability: str, graph_sha256: str, profiles: list[Profile],
                 build: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything a plan depends on, as JSON-able data (stored in the sidecar)."""
    return {
        "format": KEY_FORMAT,
        "trt_version": str(trt_version),
        "compute_capability": str(compute_capability),
        "graph_sha256": str(graph_sha256),
        "profiles": [p.as_dict() for p in profiles],
        "build": dict(sorted((build or {}).items())),
    }


def plan_key(trt_version: str, compute_capability: str, graph_sha256: str, profiles: list[Profile],
             build: Mapping[str, Any] | None = None) -> str:
    """SHA-256 (hex) of the key material: any change to the TensorRT version, the GPU
    architecture, the graph, the profiles or the builder settings changes it."""
    return hashlib.sha256(_canonical(key_material(trt_version, compute_capability, graph_sha256, profiles,
                                                  build))).hexdigest()


def plan_filename(trt_version: str, compute_capability: str, key: str) -> str:
    """``<trt major.minor>-sm<cc>-<key[:16]>.plan``."""
    return f"{trt_major_minor(trt_version)}-sm{compute_capability}-{key[:16]}.plan"


def timing_cache_path(plans_dir: Path, trt_version: str, compute_capability: str) -> Path:
    """One timing cache per GPU architecture (and TensorRT version, which must match)."""
    return plans_dir / f"timing-sm{compute_capability}-trt{trt_major_minor(trt_version)}.cache"


def plans_dir_of(spec: ModelSpec, options: Mapping[str, Any]) -> Path:
    custom = str(options.get("plans_dir") or "")
    if not custom:
        return spec.path / "plans"
    p = Path(custom)
    return p if p.is_absolute() else spec.path / p


@dataclass(frozen=True)
class PlanRequest:
    """A plan to find or build: its inputs, key and path."""

    spec: ModelSpec
    info: GraphInfo
    profiles: list[Profile]
    graph_sha256: str
    trt_version: str
    compute_capability: str
    build: dict[str, Any]
    key: str
    path: Path

    @property
    def sidecar_path(self) -> Path:
        return self.path.with_suffix(".json")

    @property
    def timing_cache_path(self) -> Path:
        return timing_cache_path(self.path.parent, self.trt_version, self.compute_capability)

    def key_material(self) -> dict[str, Any]:
        return key_material(self.trt_version, self.compute_capability, self.graph_sha256, self.profiles, self.build)


def plan_request(spec: ModelSpec, trt_version: str, compute_capability: str,
                 options: Mapping[str, Any] | None = None, *, info: GraphInfo | None = None,
                 graph_hash: str | None = None) -> PlanRequest:
    """The plan ``spec`` needs on this TensorRT version and GPU architecture.

    ``options`` override engine.toml's ``[tensorrt]`` table (see ``tensorrt_options``).

    Raises:
        FatalError: the graph is missing or not in the with-past layout.
    """
    opts = tensorrt_options(spec, options)  # idempotent on already merged options
    info = info or read_graph_info(spec.onnx_path, opts)
    profs = profiles(spec, info, opts)
    sha = graph_hash or graph_sha256(spec.onnx_path)
    build = {k: opts[k] for k in BUILD_DEFAULTS if not k.startswith("opt_")}  # opt_* live in the profiles
    key = plan_key(trt_version, compute_capability, sha, profs, build)
    path = plans_dir_of(spec, opts) / plan_filename(trt_version, compute_capability, key)
    return PlanRequest(spec, info, profs, sha, str(trt_version), str(compute_capability), build, key, path)


# -- files -----------------------------------------------------------------------------


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` so a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_sidecar(plan_path: Path) -> dict[str, Any] | None:
    """The JSON next to a plan, or None when missing or unreadable."""
    try:
        data = json.loads(plan_path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class BuildResult:
    """A plan on disk, freshly built (``built``) or found."""

    model: str
    key: str
    path: Path
    trt_version: str
    compute_capability: str
    seconds: float
    built_at: float
    built: bool
    host: str = field(default_factory=socket.gethostname)

    def record(self, host: str | None = None) -> dict[str, Any]:
        """The JSON stored in Redis under ``sf:plans:{model}`` (field: the plan key)."""
        return {"path": str(self.path), "host": host or self.host, "trt_version": self.trt_version,
                "cc": self.compute_capability, "built_at": self.built_at, "seconds": round(self.seconds, 3),
                "key": self.key, "model": self.model}

    @classmethod
    def from_sidecar(cls, request: PlanRequest) -> BuildResult:
        side = read_sidecar(request.path) or {}
        built = side.get("built", {})
        try:
            mtime = request.path.stat().st_mtime
        except OSError:
            mtime = 0.0
        return cls(model=request.spec.name, key=request.key, path=request.path, trt_version=request.trt_version,
                   compute_capability=request.compute_capability, seconds=float(built.get("seconds", 0.0)),
                   built_at=float(built.get("at", mtime)), built=False,
                   host=str(built.get("host", socket.gethostname())))


def write_plan(request: PlanRequest, data: bytes, seconds: float,
               extra: Mapping[str, Any] | None = None) -> BuildResult:
    """Store a serialized plan and its sidecar (the plan first: the sidecar is a record)."""
    now = time.time()
    host = socket.gethostname()
    write_atomic(request.path, data)
    side = {"key": request.key, "model": request.spec.name, **request.key_material(),
            "plan": request.path.name, "bytes": len(data),
            "built": {"at": now, "seconds": round(seconds, 3), "host": host, **(extra or {})}}
    write_atomic(request.sidecar_path, json.dumps(side, indent=2, sort_keys=True).encode())
    return BuildResult(model=request.spec.name, key=request.key, path=request.path, trt_version=request.trt_version,
                       compute_capability=request.compute_capability, seconds=seconds, built_at=now, built=True,
                       host=host)


def list_local_plans(spec: ModelSpec, options: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Plans on this host for ``spec``: one dict per ``.plan`` file (sidecar merged in)."""
    opts = {**RUNTIME_DEFAULTS, **(options or {})}
    out = []
    d = plans_dir_of(spec, opts)
    for p in sorted(d.glob("*.plan")) if d.is_dir() else []:
        side = read_sidecar(p) or {}
        out.append({"model": spec.name, "path": str(p), "bytes": p.stat().st_size, "key": side.get("key"),
                    "trt_version": side.get("trt_version"), "cc": side.get("compute_capability"),
                    "built_at": side.get("built", {}).get("at"), "seconds": side.get("built", {}).get("seconds")})
    return out
