"""The seams stay typed (docs/architecture.md, "Static checks"): parameters and returns
annotated exactly ``Any`` in the package are counted, and their number may only fall."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: the count when issue 51 typed the seams (180 before it); lower it as more get typed
CEILING = 66


def any_annotations(root: Path = REPO) -> list[str]:
    """``path:line name`` of each parameter or return annotated exactly ``Any``
    (``streamfleet/v1`` is generated; the links under ``streamfleet/`` are not followed)."""
    found = []
    for folder in ("gateway", "workers", "shared", "streamfleet"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if rel.parts[:2] == ("streamfleet", "v1"):
                continue
            for fn in ast.walk(ast.parse(path.read_text())):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                a = fn.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
                named = [(p.arg, p.annotation) for p in params] + [("return", fn.returns)]
                found += [f"{rel}:{fn.lineno} {fn.name} {name}" for name, ann in named
                          if ann is not None and ast.unparse(ann) == "Any"]
    return found


def test_no_new_any_seams():
    found = any_annotations()
    assert len(found) <= CEILING, (f"{len(found)} parameters and returns annotated Any (at most {CEILING}): "
                                   "name the real type or a Protocol\n" + "\n".join(found))


def test_the_count_sees_each_form(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "m.py").write_text(
        "def f(a: Any, *b: Any, c: int, **d: Any) -> Any: ...\n"
        "async def g(x: list[Any], y: Any) -> None: ...\n")
    (tmp_path / "streamfleet" / "v1").mkdir(parents=True)
    (tmp_path / "streamfleet" / "v1" / "gen.py").write_text("def h(a: Any) -> Any: ...\n")
    found = any_annotations(tmp_path)
    assert [f.split(" ", 1)[1] for f in found] == ["f a", "f b", "f d", "f return", "g y"]
