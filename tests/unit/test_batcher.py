"""Scheduler: waiting → running, cancel, finish, slots."""

from __future__ import annotations

import pytest

from streamfleet.shared.schema import SamplingParams, Task
from streamfleet.workers.batcher import Scheduler, Sequence


def seq(rid: str) -> Sequence:
    task = Task(rid, "m", "normal", "c1", rid, [1, 2], SamplingParams(), 0.0)
    return Sequence(task=task, sampler=None, detokenizer=None, stop=None)  # type: ignore[arg-type]


def ids(seqs):
    return [s.request_id for s in seqs]


def test_lifecycle_waiting_running_finish():
    s = Scheduler(3)
    assert s.free_slots == 3 and len(s) == 0
    s.add(seq("a"))
    s.add(seq("b"))
    assert s.free_slots == 1 and ids(s.waiting) == ["a", "b"] and s.running == []
    plan = s.plan()
    assert ids(plan.prefill) == ["a", "b"] and plan.decode == [] and plan.cancelled == []
    assert ids(s.running) == ["a", "b"] and s.waiting == []
    s.add(seq("c"))
    plan = s.plan()
    assert ids(plan.prefill) == ["c"] and ids(plan.decode) == ["a", "b"]
    assert s.finish("a").request_id == "a"
    assert s.finish("a") is None
    assert s.free_slots == 1 and "a" not in s and "b" in s
    plan = s.plan()
    assert plan.prefill == [] and ids(plan.decode) == ["b", "c"]


def test_add_refuses_full_batch_and_duplicates():
    s = Scheduler(1)
    s.add(seq("a"))
    with pytest.raises(ValueError):
        s.add(seq("b"))
    s2 = Scheduler(2)
    s2.add(seq("a"))
    with pytest.raises(ValueError):
        s2.add(seq("a"))
    with pytest.raises(ValueError):
        Scheduler(0)


def test_cancel_leaves_at_next_plan_and_frees_slot():
    s = Scheduler(2)
    s.add(seq("a"))
    s.plan()
    s.add(seq("b"))
    assert s.cancel("a") and s.cancel("b")
    assert not s.cancel("a")  # already cancelled
    assert not s.cancel("zzz")
    assert s.free_slots == 0  # still there until the step
    plan = s.plan()
    assert ids(plan.cancelled) == ["b", "a"]  # waiting first, then running
    assert plan.prefill == [] and plan.decode == []
    assert s.free_slots == 2 and len(s) == 0
    assert s.get("a") is None
