"""Engine backends behind one small interface, imported lazily by name.

``BACKENDS`` maps a backend name to ``"module:Class"``; ``load_engine`` imports only
the chosen one, so a CPU machine never imports TensorRT or CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

from streamfleet.shared.errors import FatalError
from streamfleet.shared.modelrepo import ModelSpec
from streamfleet.workers.engines.base import Engine, SequenceError

__all__ = ["BACKENDS", "Engine", "SequenceError", "import_from_string", "load_engine"]

BACKENDS: dict[str, str] = {
    "onnxruntime": "streamfleet.workers.engines.onnxruntime:OnnxRuntimeEngine",
    "echo": "streamfleet.workers.engines.echo:EchoEngine",
    "tensorrt": "streamfleet.workers.engines.tensorrt:TensorRTEngine",
}
#: ``attention = "gqa"`` in an ``onnxruntime`` model's engine.toml (opt-in, GGUF-imported
#: models): the GroupQueryAttention graph and its engine (docs/models.md); "concat", the
#: default, is the graph the import writes, served by ``OnnxRuntimeEngine``
ATTENTION = {"concat": None, "gqa": "streamfleet.workers.engines.onnx_gqa:OnnxGqaEngine"}


def import_from_string(spec: str) -> Any:
    """Import ``"package.module:Attribute"``.

    Raises:
        FatalError: malformed string, missing module or attribute.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise FatalError(f'import string {spec!r} must be "module:attribute"')
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FatalError(f"cannot import {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise FatalError(f"{module_name!r} has no attribute {attr!r}") from exc


def load_engine(spec: ModelSpec, backend: str | None = None, **options: Any) -> Engine:
    """Instantiate the engine for ``spec`` (backend from ``engine.toml`` unless overridden).

    Raises:
        FatalError: unknown backend, or the backend cannot start.
    """
    name = backend or spec.backend
    target = BACKENDS.get(name, name if ":" in name else None)
    if target is None:
        raise FatalError(f"unknown engine backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    attention = spec.options.get("attention", "concat")
    if name == "onnxruntime" and spec.options.get("weights") == "auto" and attention != "gqa":
        raise FatalError(f"{spec.path / 'engine.toml'}: weights = \"auto\" serves GroupQueryAttention graphs; "
                         f"it needs attention = \"gqa\", not {attention!r}")
    if name == "onnxruntime" and attention != "concat":
        if attention not in ATTENTION:
            raise FatalError(f"{spec.path / 'engine.toml'}: attention must be one of {', '.join(ATTENTION)}, "
                             f"not {attention!r}")
        target = ATTENTION[attention] or target  # (None only for "concat")
    cls = import_from_string(target)
    return cls(spec, **options)
