"""A model repository holding two versions of one model (hot-reload tests)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

__all__ = ["two_versions"]


def two_versions(spec_path: Path, tmp_path: Path) -> Path:
    """``tmp_path/engines`` with the model folder at ``spec_path`` as version 1 and a
    version 2 beside it in ``versions/2``: the same graph and tokenizer, another version
    (so another prefix cache namespace). Returns the repository's root."""
    root = tmp_path / "engines"
    base = root / spec_path.name
    shutil.copytree(spec_path, base, ignore=shutil.ignore_patterns("plans", "versions"))
    v2 = base / "versions" / "2"
    v2.mkdir(parents=True)
    shutil.copy(base / "model.onnx", v2 / "model.onnx")
    text = (base / "engine.toml").read_text()
    text = re.sub(r'version = "1"', 'version = "2"', text)
    text = text.replace('tokenizer = "tokenizer.json"', 'tokenizer = "../../tokenizer.json"')
    (v2 / "engine.toml").write_text(text)
    return root
