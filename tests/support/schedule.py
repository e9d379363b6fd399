"""The order test modules run in: the longest first.

With ``-n`` and ``--dist loadscope`` (pyproject.toml) each module goes whole to one process.
xdist's own order is by the number of tests in a module, which puts the parametrized unit
modules (hundreds of tests, a few seconds) first and the integration modules of a few long
tests (cluster failovers, voice, faults: a minute or more) last, where the last of them ran
alone while the other processes had nothing left. Here the order is by time, longest first
(``--no-loadscope-reorder`` keeps it), so the short unit modules fill the gaps at the end (the
greedy longest-processing-time schedule).

The time of each module comes from ``tests/durations.json``, written by a run with
``--store-durations`` (the sum of its tests' setup, call and teardown, in seconds). A module
it does not name (a new one) runs after those it names, in collection order; a stale file
only makes the schedule less even, never a test fail. Within a module the order is kept.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

#: module path (relative to the repository, as pytest's node ids write it) -> seconds
DURATIONS = Path(__file__).resolve().parent.parent / "durations.json"


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    """The stored module times; none where the file is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}


def module_of(nodeid: str) -> str:
    """``tests/unit/test_x.py::test_y[a::b]`` -> ``tests/unit/test_x.py``."""
    return nodeid.split("::", 1)[0]


def longest_first(items: list[pytest.Item], durations: dict[str, float]) -> list[pytest.Item]:
    """``items`` with whole modules ordered by their stored time, longest first; modules of
    equal time (unknown ones: 0) and the tests inside each module keep collection order."""
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(module_of(item.nodeid), i)
    return sorted(items, key=lambda it: (-durations.get(module_of(it.nodeid), 0.0),
                                         first_seen[module_of(it.nodeid)]))


def add_option(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true", default=False,
                     help=f"write each test module's time to {DURATIONS.name} (tests/support/schedule.py)")


def reorder(items: list[pytest.Item]) -> None:
    items[:] = longest_first(items, load_durations())


class DurationStore:
    """Sums the reports of a run per module and writes them when the run ends; registered
    only in the controlling process with -n (``configure``), which receives every report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[module_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        root = DURATIONS.parent.parent
        merged = {k: v for k, v in load_durations().items() if (root / k).is_file()}  # gone modules leave
        merged.update({k: round(v, 2) for k, v in self.seconds.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")


def configure(config: pytest.Config) -> None:
    if config.getoption("--store-durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationStore(), "sf-duration-store")
