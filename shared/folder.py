"""What the GGUF import and the execution modes read of a model folder: the fields of
``shared.modelrepo.ModelSpec`` they use, as a protocol, so that they need not import
``shared.modelrepo``, which imports them (docs/architecture.md, "Module map": the arrows
run one way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class ModelFolder(Protocol):
    """A model folder as ``engine.toml`` describes it (``ModelSpec``, frozen, is one)."""

    @property
    def name(self) -> str: ...

    @property
    def path(self) -> Path: ...

    @property
    def onnx(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    @property
    def source(self) -> dict[str, Any]:
        """``[source]``: where the weights come from."""

    @property
    def options(self) -> dict[str, Any]:
        """The rest of ``engine.toml`` (``weights``, ``[execution]``, ...)."""

    @property
    def onnx_path(self) -> Path: ...

    @property
    def tokenizer_path(self) -> Path: ...
