"""The order test modules go out in with -n (tests/support/schedule.py): longest first by the
stored times, unknown modules after them in collection order, each module's tests in order."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tests.support.schedule import DURATIONS, load_durations, longest_first, module_of


@dataclass
class Item:
    nodeid: str


def test_modules_go_longest_first_and_keep_their_tests_in_order():
    items = [Item(n) for n in ("a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1[x::y]", "c.py::t2", "d.py::t1")]
    got = [it.nodeid for it in longest_first(items, {"b.py": 3.0, "c.py": 40.0, "a.py": 1.0})]
    assert got == ["c.py::t1[x::y]", "c.py::t2", "b.py::t1", "a.py::t1", "a.py::t2", "d.py::t1"]


def test_without_times_the_collection_order_stays():
    items = [Item(n) for n in ("b.py::t", "a.py::t1", "a.py::t2")]
    assert longest_first(items, {}) == items


def test_a_missing_or_broken_file_means_no_times(tmp_path):
    assert load_durations(tmp_path / "none.json") == {}
    (tmp_path / "bad.json").write_text("{not json")
    assert load_durations(tmp_path / "bad.json") == {}
    (tmp_path / "list.json").write_text("[1, 2]")
    assert load_durations(tmp_path / "list.json") == {}
    (tmp_path / "ok.json").write_text(json.dumps({"a.py": 2, "b.py": "x"}))
    assert load_durations(tmp_path / "ok.json") == {"a.py": 2.0}


def test_the_stored_times_name_modules_that_exist():
    """A renamed or deleted module's time would only be dead weight: the file is refreshed
    with --store-durations (README.md, the test commands)."""
    root = DURATIONS.parent.parent
    times = load_durations()
    assert times, f"{DURATIONS} is missing or empty"
    gone = sorted(m for m in times if not (root / m).is_file())
    assert gone == [], f"{DURATIONS.name} names modules that do not exist: {gone}"
    assert module_of("tests/unit/test_x.py::test_y[a::b]") == "tests/unit/test_x.py"
