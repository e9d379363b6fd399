"""Optimum exports made on the fly for import tests: a committed fixture of
tests/fixtures/archs/ copied into a temporary folder, its config.json edited."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

ARCH_FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "archs"

#: a config.json value that ``copy_export`` removes instead of setting
DROP = object()


def copy_export(arch: str, dest: Path, **config: Any) -> Path:
    """``tests/fixtures/archs/<arch>`` copied to ``dest`` (without its reference.json),
    with ``config`` merged into its config.json (``DROP`` removes a key)."""
    shutil.copytree(ARCH_FIXTURES / arch, dest, ignore=shutil.ignore_patterns("reference.json"))
    edit_json(dest / "config.json", **config)
    return dest


def edit_json(path: Path, **changes: Any) -> None:
    """Merge ``changes`` into the JSON object file ``path`` (``DROP`` removes a key)."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is DROP:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, indent=2))
