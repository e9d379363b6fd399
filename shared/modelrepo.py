"""The model repository: ``engines/<name>/engine.toml`` plus its files.

``engine.toml``::

    name = "tiny-gpt"
    version = "1"
    backend = "onnxruntime"        # onnxruntime | tensorrt | echo
    onnx = "model.onnx"            # Optimum text-generation-with-past layout
    tokenizer = "tokenizer.json"   # loaded through transformers' PreTrainedTokenizerFast
    max_batch = 16
    max_context = 256              # prompt + completion tokens
    eos_token_ids = [0]

    [build]                        # optional: how scripts/make_tiny_model.py makes the files
    seed = 1234
    ...
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from shared.errors import FatalError, NotFoundError

__all__ = ["ModelSpec", "ModelRepository", "load_tokenizer", "ensure_artifacts", "REPO_ROOT"]

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model folder, as described by its ``engine.toml``."""

    name: str
    path: Path
    backend: str = "onnxruntime"
    version: str = "1"
    onnx: str = "model.onnx"
    tokenizer: str = "tokenizer.json"
    max_batch: int = 16
    max_context: int = 256
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    build: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def onnx_path(self) -> Path:
        return self.path / self.onnx

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.tokenizer

    @classmethod
    def from_toml(cls, toml_path: Path) -> "ModelSpec":
        """Parse ``engine.toml``.

        Raises:
            FatalError: the file is missing or malformed.
        """
        try:
            data = tomllib.loads(toml_path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise FatalError(f"cannot read {toml_path}: {exc}") from exc
        known = {"name", "backend", "version", "onnx", "tokenizer", "max_batch", "max_context",
                 "eos_token_ids", "chat_template", "build"}
        try:
            return cls(
                name=str(data.get("name", toml_path.parent.name)),
                path=toml_path.parent,
                backend=str(data.get("backend", "onnxruntime")),
                version=str(data.get("version", "1")),
                onnx=str(data.get("onnx", "model.onnx")),
                tokenizer=str(data.get("tokenizer", "tokenizer.json")),
                max_batch=int(data.get("max_batch", 16)),
                max_context=int(data.get("max_context", 256)),
                eos_token_ids=tuple(int(x) for x in data.get("eos_token_ids", ())),
                chat_template=data.get("chat_template"),
                build=dict(data.get("build", {})),
                options={k: v for k, v in data.items() if k not in known},
            )
        except (TypeError, ValueError) as exc:
            raise FatalError(f"invalid {toml_path}: {exc}") from exc

    def artifacts_present(self) -> bool:
        if self.backend == "echo":
            return True
        return self.onnx_path.exists() and self.tokenizer_path.exists()


class ModelRepository:
    """All model folders under one directory (default ``<repo>/engines``)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root else REPO_ROOT / "engines"
        self._specs: dict[str, ModelSpec] = {}

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.parent.name for p in self.root.glob("*/engine.toml"))

    def get(self, name: str, version: str | None = None) -> ModelSpec:
        """The spec of model ``name``: its base folder, or with ``version`` the folder
        ``<root>/<name>/versions/<version>`` (used by hot reloads), unless the base
        folder itself is that version.

        Raises:
            NotFoundError: no such folder with an ``engine.toml``.
        """
        key = f"{name}@{version}" if version else name
        spec = self._specs.get(key)
        if spec is None:
            if not _safe(name) or (version is not None and not _safe(version)):
                raise NotFoundError(f"model {name!r} does not exist", param="model")
            toml_path = self.root / name / "engine.toml"
            if not toml_path.is_file():
                raise NotFoundError(f"model {name!r} does not exist", param="model")
            spec = ModelSpec.from_toml(toml_path)
            if version is not None and spec.version != version:
                vpath = self.root / name / "versions" / version / "engine.toml"
                if not vpath.is_file():
                    raise NotFoundError(f"model {name!r} has no version {version!r} "
                                        f"(expected {vpath.relative_to(self.root)})", param="model")
                spec = dataclasses.replace(ModelSpec.from_toml(vpath), name=name)
            self._specs[key] = spec
        return spec

    def versions(self, name: str) -> list[str]:
        base = self.get(name)
        folder = self.root / name / "versions"
        found = {base.version}
        if folder.is_dir():
            found |= {p.parent.name for p in folder.glob("*/engine.toml")}
        return sorted(found)


def _safe(part: str) -> bool:
    return bool(part) and "/" not in part and not part.startswith(".") and len(part) <= 128


@lru_cache(maxsize=16)
def _load_tokenizer_cached(path: str) -> Any:
    from transformers import PreTrainedTokenizerFast  # heavy import, only when needed

    return PreTrainedTokenizerFast(tokenizer_file=path)


def load_tokenizer(spec: ModelSpec) -> Any:
    """The model's tokenizer (a ``PreTrainedTokenizerFast``), cached per file.

    Raises:
        FatalError: the tokenizer file is missing.
    """
    if not spec.tokenizer_path.exists():
        raise FatalError(
            f"{spec.tokenizer_path} is missing; run `python scripts/make_tiny_model.py "
            f"--model-dir {spec.path}` (or `streamfleet serve`, which does it for you)"
        )
    return _load_tokenizer_cached(str(spec.tokenizer_path))


def ensure_artifacts(spec: ModelSpec) -> None:
    """Generate a model's ONNX graph and tokenizer when they are missing and the
    ``engine.toml`` says how (a ``[build]`` table); the project's own script does
    the work, nothing is downloaded.

    Raises:
        FatalError: the files are missing and cannot be generated.
    """
    if spec.artifacts_present():
        return
    if not spec.build:
        raise FatalError(f"model {spec.name!r} lacks {spec.onnx} / {spec.tokenizer} and has no [build] table")
    script = REPO_ROOT / "scripts" / "make_tiny_model.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--model-dir", str(spec.path)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or not spec.artifacts_present():
        raise FatalError(f"building {spec.name} failed: {proc.stderr.strip()[-2000:]}")
