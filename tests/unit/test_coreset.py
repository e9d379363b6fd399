"""CoreSet: the two cores of a hot reload share max_batch; the old one retires when empty."""

from __future__ import annotations

import time

from streamfleet.shared.schema import SamplingParams, Task
from streamfleet.workers.core import WorkerCore
from streamfleet.workers.coreset import CoreSet, VersionedCore
from streamfleet.workers.engines.echo import EchoEngine


def task(rid: str, n: int = 3) -> Task:
    return Task(request_id=rid, model="tiny-gpt", lane="normal", reply_to="c", client_id=rid,
                prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                created_at=time.time())


def core(spec, version: str) -> VersionedCore:
    return VersionedCore(version, WorkerCore(EchoEngine(spec), None or _tok(spec), max_batch=4))


def _tok(spec):
    from streamfleet.shared.modelrepo import load_tokenizer

    return load_tokenizer(spec)


def test_reload_shares_slots_and_retires_old(tiny_spec):
    cs = CoreSet(core(tiny_spec, "1"), max_batch=4)
    cs.add(task("a", 3))
    cs.add(task("b", 6))
    cs.step()
    cs.switch(core(tiny_spec, "2"))
    assert cs.free_slots == 2  # the old version's sequences still count
    cs.add(task("c", 2))
    assert "a" in cs and "c" in cs and cs.version == "2"
    versions_done = {}
    while cs.has_work():
        for version, out in cs.step():
            for _, ev in out.events:
                if ev.type == "done":
                    versions_done[ev.request_id] = version
        retired = cs.retired()
        if retired is not None:
            assert retired.version == "1" and "b" not in cs
    assert versions_done == {"a": "1", "b": "1", "c": "2"}
    assert cs.retiring is None and cs.free_slots == 4
    assert cs.cancel("zzz") is False


def test_both_kinds_of_core_are_cores():
    """``Core`` names what the process and ``CoreSet`` use; a text and a speech core
    both have all of it (a method renamed on one kind fails here, not in a worker)."""
    import inspect

    from streamfleet.workers.coreset import Core
    from streamfleet.workers.speechcore import SpeechCore

    wanted = {n for n, _ in inspect.getmembers(Core) if not n.startswith("_")} | {"__contains__"}
    wanted |= set(Core.__annotations__)
    for kind in (WorkerCore, SpeechCore):
        init = inspect.getsource(kind.__init__)
        missing = [n for n in wanted if not hasattr(kind, n) and f"self.{n} =" not in init]
        assert not missing, (kind.__name__, missing)


def test_idle_work_is_the_current_versions_and_waits_for_every_core(tiny_spec):
    """A finished reply's blocks are computed into the prefix cache while nothing else
    runs (workers/replykeep.py), on the current version only: a retiring core's cache goes
    with its engine."""
    from streamfleet.workers.engines.onnxruntime import OnnxRuntimeEngine

    def onnx(version: str) -> VersionedCore:
        engine = OnnxRuntimeEngine(tiny_spec, threads=1, prefix_cache_mb=4, prefix_block=4)
        return VersionedCore(version, WorkerCore(engine, _tok(tiny_spec), max_batch=4))

    cs = CoreSet(onnx("1"), max_batch=4)
    cs.add(task("a", 9))
    while cs.has_work():
        cs.step()
    assert cs.idle_work()
    cs.switch(onnx("2"))
    assert not cs.idle_work() and cs.idle_step() == 0  # the old version's reply is not computed
    assert cs.retired() is not None
    cs.add(task("b", 9))
    cs.step()
    assert cs.has_work() and cs.idle_step() == 0  # b runs: idle work waits
    while cs.has_work():
        cs.step()
    assert cs.idle_work() and cs.idle_step() > 0 and not cs.idle_work()
    assert cs.current.core.prefix_cache.stats.reply_tokens > 0
