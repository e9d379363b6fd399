"""The default model, SmolLM2-135M-Instruct (engines/smollm2-135m), for the tests that
serve it: where its GGUF file is cached (the suite never downloads it), and a private
model repository holding its folder as version 1 and a copy as version 2 (hot reloads),
so no test writes into the repository's engines/."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from streamfleet.shared.modelrepo import REPO_ROOT, ModelRepository, ModelSpec, ensure_artifacts
from streamfleet.shared.packagefetch import PackageFile, cached_path

__all__ = ["MODEL", "SPEC", "GGUF", "private_repository"]

MODEL = "smollm2-135m"
SPEC: ModelSpec = ModelRepository(REPO_ROOT / "engines").get(MODEL)
#: the file `streamfleet serve` fetches on first use; tests that need it skip without it
GGUF: Path = cached_path(PackageFile.from_table(SPEC.source, "engine.toml"))

#: what a copy of the folder leaves out: the import's lock, other versions, TensorRT plans
_SKIP = shutil.ignore_patterns(".import.lock", "versions", "plans")


def _link_or_copy(src: str, dst: str) -> str:
    """A hard link where the file system allows it (the weights are 230 MB), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def private_repository(root: Path, weights: str = "q4") -> Path:
    """``root/smollm2-135m``: the model's folder (built from the cached file first, as a
    worker would: its graphs imported and their execution modes measured, about two
    minutes once), and ``versions/2`` beside it, the same files as version "2". Both pin
    ``weights`` (default ``q4``, exact in the weights: the tests that read the model's
    answers read the reference's, whichever mode ``weights = "auto"`` would choose on
    this CPU; ``"auto"`` keeps the choice). Returns ``root``, for ``SF_ENGINES_DIR``."""
    ensure_artifacts(SPEC)
    base = root / MODEL
    shutil.copytree(SPEC.path, base, ignore=_SKIP, copy_function=_link_or_copy)
    v2 = base / "versions" / "2"
    shutil.copytree(SPEC.path, v2, ignore=_SKIP, copy_function=_link_or_copy)
    for folder, version in ((base, "1"), (v2, "2")):
        toml = folder / "engine.toml"
        text, n = re.subn(r'(?m)^version = "1"$', f'version = "{version}"', toml.read_text())
        assert n == 1, "engines/smollm2-135m/engine.toml no longer says version = \"1\""
        text, n = re.subn(r'(?m)^weights = "auto"$', f'weights = "{weights}"', text)
        assert n == 1, "engines/smollm2-135m/engine.toml no longer says weights = \"auto\""
        toml.unlink()  # a link to the original: write a file of its own
        toml.write_text(text)
    return root
