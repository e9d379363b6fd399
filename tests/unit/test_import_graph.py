"""The product's import graph (issue 38): no import circles between its modules, and no
import of the folders that are not installed (``scripts``, ``tests``). Read statically
(``ast``), imports inside functions and ``TYPE_CHECKING`` blocks included: an arrow a
reader follows is an arrow."""

from __future__ import annotations

import ast
import functools
import itertools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: the installed packages and the folders they come from (pyproject.toml's package-dir)
PACKAGES = {"streamfleet": "streamfleet", "streamfleet.gateway": "gateway", "streamfleet.workers": "workers",
            "streamfleet.shared": "shared"}
#: circles known and not yet broken; each goes when it is (issue 38). Nothing may join them
KNOWN_CIRCLES: list[set[str]] = []


def _modules() -> dict[str, Path]:
    found = {}
    for pkg, folder in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([pkg, *parts])
            if pkg == "streamfleet" and parts and parts[0] == "v1":
                continue  # generated gRPC code
            found[name] = path
    return found


def _imports(name: str, path: Path) -> set[str]:
    out = set()
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return out


@functools.cache
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of a module, parsed once for all the tests here (the files do not change
    during a run)."""
    return tuple(ast.walk(ast.parse(path.read_text())))


@functools.cache
def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = _modules()
    edges, raw = {}, {}
    for name, path in mods.items():
        raw[name] = _imports(name, path)
        edges[name] = {m for m in raw[name] if m in mods and m != name}
    return edges, raw


def _circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = itertools.count()
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = next(counter)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = next(counter)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_no_new_import_circle():
    circles = _circles(_graph()[0])
    new = [sorted(c) for c in circles if c not in KNOWN_CIRCLES]
    assert not new, f"import circles: {new}"


def test_the_known_circles_are_still_there_or_the_list_shrinks():
    """A circle broken is taken off ``KNOWN_CIRCLES``, so it cannot come back unseen."""
    circles = _circles(_graph()[0])
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in circles]
    assert not gone, f"no longer circles, take them off KNOWN_CIRCLES: {gone}"


def test_product_code_imports_no_uninstalled_folder():
    _, raw = _graph()
    bad = sorted(f"{name} imports {m}" for name, mods in raw.items() for m in mods
                 if m.split(".")[0] in ("scripts", "tests"))
    assert not bad, bad


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_product_code_runs_no_module_of_an_uninstalled_folder():
    """``python -m scripts.x`` from product code is an import no ``import`` shows: it works in
    a checkout and fails where the package is installed (issue 38: the demo model's
    generator ran as ``scripts.make_tiny_model``)."""
    bad = []
    for name, path in _modules().items():
        for node in _nodes(path):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.split(".")[0] in ("scripts", "tests") and "." in node.value \
                    and " " not in node.value and "/" not in node.value:
                bad.append(f"{name}: {node.value!r}")
    assert not bad, bad


def _test_imports_of(path: Path, text: str) -> list[str]:
    """What one test-tree file imports from a test module or a conftest (issue 38: helpers
    imported from one test file into another): shared helpers live in tests/support/."""
    pkg = list(path.relative_to(REPO).parent.parts) if path.is_relative_to(REPO) else ["tests"]
    bad = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            mods, names = [a.name for a in node.names], []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            mods, names = [mod], [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for m in mods + names:
            parts = m.split(".")
            if parts[0] == "tests" and any(p.startswith("test_") or p == "conftest" for p in parts[1:]):
                bad.append(m)
        for m in mods:  # `from test_core import ...` through pytest's rootdir on sys.path
            if "." not in m and (m.startswith("test_") or m == "conftest"):
                bad.append(m)
    return sorted(set(bad))


def test_no_test_file_imports_from_another_test_file():
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        found = _test_imports_of(path, path.read_text())
        bad += [f"{path.relative_to(REPO)} imports {m}" for m in found]
    assert not bad, "move shared test helpers to tests/support/: " + "; ".join(bad)


def test_the_test_import_check_sees_each_form():
    here = REPO / "tests" / "integration" / "test_x.py"
    assert _test_imports_of(here, "from tests.unit.test_core import make_core") == ["tests.unit.test_core",
                                                                                  "tests.unit.test_core.make_core"]
    assert _test_imports_of(here, "import tests.deploy.test_deploy_configs") == ["tests.deploy.test_deploy_configs"]
    assert _test_imports_of(here, "from tests.integration import test_metrics") == ["tests.integration.test_metrics"]
    assert _test_imports_of(here, "from .test_auth_limits import TIERS") == ["tests.integration.test_auth_limits",
                                                                           "tests.integration.test_auth_limits.TIERS"]
    assert _test_imports_of(here, "from tests.integration.conftest import FleetFactory")
    assert _test_imports_of(here, "from test_core import make_core") == ["test_core"]
    assert _test_imports_of(here, "from tests.support.keys import add_key\nimport pytest") == []


#: the gateway's doors, one adapter per protocol (docs/architecture.md, "Module map")
DOORS = "streamfleet.gateway.doors"
#: the modules that wire the doors into the process: they alone import doors
DOOR_WIRING = {"streamfleet.gateway.app", "streamfleet.gateway.server"}


def _door_of(module: str) -> str | None:
    """The door a module name (or a name imported from it) is, or is inside; None when it
    is no door."""
    parts = module.split(".")
    if parts[:3] == DOORS.split(".") and len(parts) > 3:
        return ".".join(parts[:4])
    return None


def _door_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, mods in graph.items():
        own = _door_of(name)
        for m in mods:
            door = _door_of(m)
            if door is None or door == own:
                continue
            if own is not None:
                bad.append(f"door {name} imports door {door}")
            elif name not in DOOR_WIRING:
                bad.append(f"{name} (not a door) imports door {door}")
    return sorted(set(bad))


def test_no_door_imports_another_door():
    """Issue 51: what several doors use lives in ``gateway/services`` (or ``protocols``,
    ``requests``, ``admission``, ``edge``), never in a door another door imports; and
    nothing but the process's wiring imports a door."""
    bad = _door_imports(_graph()[1])
    assert not bad, bad


def test_the_door_check_sees_a_door_importing_a_door():
    graph = {"streamfleet.gateway.doors.grpc_server": {"streamfleet.gateway.doors.transcriptions.open_transcription",
                                                       "streamfleet.gateway.services.voice"},
             "streamfleet.gateway.services.session": {"streamfleet.gateway.doors.embeddings"},
             "streamfleet.gateway.app": {"streamfleet.gateway.doors.ws"},
             "streamfleet.gateway.doors.ws": {"streamfleet.gateway.doors.ws.WebSocketSession"}}
    assert _door_imports(graph) == [
        "door streamfleet.gateway.doors.grpc_server imports door streamfleet.gateway.doors.transcriptions",
        "streamfleet.gateway.services.session (not a door) imports door streamfleet.gateway.doors.embeddings"]


#: tools for benchmarks, checks and tests, installed with the package (docs/architecture.md,
#: "Layout"); no part of the product
DEVKIT = "streamfleet.devkit"
#: the product's code, which never imports the devkit
PRODUCT = ("streamfleet.gateway", "streamfleet.shared", "streamfleet.workers")


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _devkit_imports(graph: dict[str, set[str]], strings: dict[str, set[str]]) -> list[str]:
    """Each product module that imports the devkit (``import``/``from``, or a module name
    in a string: ``importlib.import_module``, ``python -m``)."""
    bad = []
    for name in graph.keys() | strings.keys():
        if not _in(name, PRODUCT):
            continue
        bad += [f"{name} imports {m}" for m in graph.get(name, ()) if _in(m, (DEVKIT,))]
        bad += [f"{name} names {s!r}" for s in strings.get(name, ()) if _in(s, (DEVKIT,))]
    return sorted(set(bad))


def _strings() -> dict[str, set[str]]:
    """Each module's string constants that are one dotted name (no spaces: prose that
    mentions a module is not an import)."""
    return {name: {n.value for n in _nodes(path) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                   and " " not in n.value and "." in n.value}
            for name, path in _modules().items()}


def test_product_code_imports_no_devkit():
    """Issue 51: the devkit (test speech, greedy drivers, the TensorRT emulation, the
    benchmark's schema) is installed so that ``scripts/`` and ``tests/`` share it, but the
    gateway, the workers and ``shared/`` never import it."""
    bad = _devkit_imports(_graph()[1], _strings())
    assert not bad, bad


def test_the_devkit_check_sees_each_form():
    graph = {"streamfleet.gateway.services.voice": {"streamfleet.devkit.speech", "streamfleet.devkit.speech.wer"},
             "streamfleet.workers.core": {"streamfleet", "streamfleet.devkit"},
             "streamfleet.shared.grammar": {"streamfleet.shared.schema"},
             "streamfleet.cli": {"streamfleet.devkit.greedy"},
             "streamfleet.devkit.trt_emulation": {"streamfleet.devkit.greedy"}}
    strings = {"streamfleet.shared.tinymodel": {"streamfleet.devkit.structured", "streamfleet.devkitchen"},
               "streamfleet.launcher": {"streamfleet.devkit.speech"}}
    assert _devkit_imports(graph, strings) == [
        "streamfleet.gateway.services.voice imports streamfleet.devkit.speech",
        "streamfleet.gateway.services.voice imports streamfleet.devkit.speech.wer",
        "streamfleet.shared.tinymodel names 'streamfleet.devkit.structured'",
        "streamfleet.workers.core imports streamfleet.devkit"]
