"""The documentation stays exact: every setting is in docs/configuration.md with the
code's default, no page names an `SF_` variable that does not exist, and every relative
link (and anchor) in README.md and docs/*.md leads somewhere."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from streamfleet.shared.settings import CommonSettings, GatewaySettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "docs" / "configuration.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLASSES = (CommonSettings, GatewaySettings, WorkerSettings)

#: environment variables the command-line tools read that are not process settings,
#: with the file that reads each (so a removed one cannot linger in the docs either)
CLI_VARIABLES = {"SF_STATE_DIR": "streamfleet/local.py", "SF_API_KEY": "streamfleet/cli.py",
                 "SF_CACHE_DIR": "shared/packagefetch.py", "SF_PACKAGE_INDEX": "shared/packagefetch.py"}

ROW = re.compile(r"^\|\s*`(SF_[A-Z0-9_]+)`\s*\|([^|]*)\|([^|]*)\|")
SF_NAME = re.compile(r"\bSF_[A-Z0-9_]*[A-Z0-9]")


def env_name(field: str) -> str:
    return "SF_" + field.upper()


def settings_fields() -> dict[str, list[type]]:
    """Env var name -> the settings classes that have that field."""
    out: dict[str, list[type]] = {}
    for cls in CLASSES:
        for name in cls.model_fields:
            out.setdefault(env_name(name), []).append(cls)
    return out


def config_rows() -> list[tuple[str, str, str]]:
    """``(variable, default cell, read-by cell)`` of every table row of configuration.md
    whose first cell is an `SF_` variable."""
    rows = []
    for line in CONFIG.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            rows.append((m.group(1), m.group(2).strip(), m.group(3).strip()))
    return rows


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for name in list(os.environ):
        if name.startswith("SF_") or name == "REDIS_URL":
            monkeypatch.delenv(name)
    return monkeypatch


def test_every_setting_has_exactly_one_row() -> None:
    fields = settings_fields()
    names = [name for name, _, _ in config_rows()]
    missing = sorted(set(fields) - set(names))
    assert not missing, f"settings missing from docs/configuration.md: {missing}"
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"settings listed more than once in docs/configuration.md: {twice}"
    unknown = sorted(set(names) - set(fields) - set(CLI_VARIABLES))
    assert not unknown, f"docs/configuration.md has rows for variables that are not settings: {unknown}"


def test_documented_defaults_are_the_code_defaults(clean_env: pytest.MonkeyPatch) -> None:
    """The default cell's first code span, read from the environment the way a process
    reads it, gives the class's default; `(unset)` stands for None and `""` for empty."""
    fields = settings_fields()
    wrong = []
    for name, cell, _ in config_rows():
        if name not in fields:
            continue
        m = re.match(r"`([^`]*)`", cell)
        assert m, f"{name}: the default cell must start with the value in backticks, got {cell!r}"
        doc = m.group(1)
        for cls in fields[name]:
            field = name[3:].lower()
            default = cls.model_fields[field].default
            if doc == "(unset)":
                ok = default is None
            elif doc == '""':
                ok = default == ""
            else:
                clean_env.setenv(name, doc)
                try:
                    ok = getattr(cls(), field) == default and default is not None
                except Exception as exc:  # a value the process itself would refuse
                    ok = False
                    doc = f"{doc} (refused: {exc})"
                finally:
                    clean_env.delenv(name)
            if not ok:
                wrong.append(f"{name} ({cls.__name__}): documented {doc}, code {default!r}")
    assert not wrong, "docs/configuration.md defaults differ from shared/settings.py:\n" + "\n".join(wrong)


def test_read_by_names_the_processes() -> None:
    fields = settings_fields()
    wrong = []
    for name, _, read_by in config_rows():
        classes = fields.get(name, [])
        if GatewaySettings in classes and CommonSettings not in classes and "gateway" not in read_by:
            wrong.append(f"{name}: a gateway setting, read by {read_by!r}")
        if WorkerSettings in classes and CommonSettings not in classes and "worker" not in read_by:
            wrong.append(f"{name}: a worker setting, read by {read_by!r}")
    assert not wrong, "\n".join(wrong)


def deploy_variables() -> set[str]:
    """`SF_` variables the deployment files define: compose substitutions (`${SF_X:-…}`),
    env-file lines (`SF_X=…`), Kubernetes env entries (`name: SF_X`) and KEDA's
    `…FromEnv: SF_X`."""
    files = [ROOT / "docker-compose.yml", *(p for p in (ROOT / "deploy").rglob("*") if p.is_file())]
    pattern = re.compile(r"\$\{(SF_[A-Z0-9_]+)|^\s*(SF_[A-Z0-9_]+)=|name:\s*(SF_[A-Z0-9_]+)|FromEnv:\s*(SF_[A-Z0-9_]+)",
                         re.MULTILINE)
    found: set[str] = set()
    for p in files:
        for m in pattern.finditer(p.read_text(encoding="utf-8", errors="replace")):
            found.update(g for g in m.groups() if g)
    return found


def test_cli_variables_still_exist() -> None:
    for name, path in CLI_VARIABLES.items():
        assert name in (ROOT / path).read_text(encoding="utf-8"), f"{name} is no longer read by {path}"


def test_every_sf_variable_in_the_docs_exists() -> None:
    known = set(settings_fields()) | set(CLI_VARIABLES) | deploy_variables()
    stale = []
    for page in PAGES:
        for lineno, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for name in SF_NAME.findall(line):
                if name not in known:
                    stale.append(f"{page.relative_to(ROOT)}:{lineno}: {name}")
    assert not stale, "SF_ variables that are neither settings nor deployment variables:\n" + "\n".join(stale)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    out = []
    for ch in text:
        if ch in " -":
            out.append("-")
        elif ch == "_" or unicodedata.category(ch)[0] in "LN":
            out.append(ch)
    return "".join(out)


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        m = None if in_code else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def links(page: Path) -> list[tuple[int, str]]:
    out, in_code = [], False
    for lineno, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            out.extend((lineno, target) for target in LINK.findall(line))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for lineno, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"line {lineno}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"line {lineno}: {target} (no such heading in {dest.name})")
    assert not broken, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(broken)
