"""The worker's cores during a hot model reload, without I/O.

Normally one ``WorkerCore``. During a reload two: the new version's core takes every new
sequence while the old one finishes what it has, then is dropped (its engine freed).
Together they never hold more than ``max_batch`` sequences, so a reload costs at most one
extra engine in memory and no extra batch slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from streamfleet.shared.schema import AnyTask
from streamfleet.workers.core import StepOutput

__all__ = ["Core", "VersionedCore", "CoreSet"]


@runtime_checkable
class Core(Protocol):
    """What a worker process runs, step by step, for one model version: a text model's
    ``workers.core.WorkerCore``, an embedding model's ``workers.embedcore.EmbeddingCore``
    or a speech model's ``workers.speechcore.SpeechCore`` (which also has ``feed``,
    ``listening`` and ``ready`` for the audio reader, ``workers/audio.py``). No I/O: the
    process owns Redis and the event loop."""

    #: the engine it steps (closed by the process once a reload retires the core)
    engine: Any

    @property
    def active(self) -> int: ...

    @property
    def free_slots(self) -> int: ...

    def has_work(self) -> bool: ...

    def __contains__(self, request_id: object) -> bool: ...

    def add(self, task: AnyTask, replay: list[int] | None = None) -> None: ...

    def cancel(self, request_id: str) -> bool: ...

    def abandon(self, request_id: str) -> bool: ...

    def abandon_all(self) -> list[AnyTask]: ...

    def step(self) -> StepOutput: ...


@dataclass
class VersionedCore:
    version: str
    core: Core


class CoreSet:
    def __init__(self, first: VersionedCore, max_batch: int) -> None:
        self.current = first
        self.retiring: VersionedCore | None = None
        self.max_batch = max_batch

    @property
    def version(self) -> str:
        return self.current.version

    def all(self) -> list[VersionedCore]:
        return [c for c in (self.retiring, self.current) if c is not None]

    @property
    def active(self) -> int:
        return sum(c.core.active for c in self.all())

    @property
    def free_slots(self) -> int:
        return max(0, min(self.current.core.free_slots, self.max_batch - self.active))

    def has_work(self) -> bool:
        return any(c.core.has_work() for c in self.all())

    def __contains__(self, request_id: object) -> bool:
        return any(request_id in c.core for c in self.all())

    def add(self, task: AnyTask, replay: list[int] | None = None) -> None:
        self.current.core.add(task, replay)

    def cancel(self, request_id: str) -> bool:
        return any(c.core.cancel(request_id) for c in self.all())

    def abandon(self, request_id: str) -> bool:
        return any(c.core.abandon(request_id) for c in self.all())

    def switch(self, new: VersionedCore) -> None:
        """New sequences go to ``new`` from now on; the current core retires.

        Raises:
            RuntimeError: a previous switch has not finished retiring yet.
        """
        if self.retiring is not None:
            raise RuntimeError("a reload is already in progress")
        self.retiring, self.current = self.current, new

    def step(self) -> list[tuple[str, StepOutput]]:
        """One step of every core that has work (engine calls: run off the event loop)."""
        return [(c.version, c.core.step()) for c in self.all() if c.core.has_work()]

    def idle_work(self) -> bool:
        """Whether the current core has work for an idle worker (``WorkerCore.idle_step``:
        finished replies to compute into its prefix cache); a retiring core's is dropped
        with it (its cache goes with its engine)."""
        idle = getattr(self.current.core, "idle_work", None)
        return bool(idle is not None and idle())

    def idle_step(self) -> int:
        """One piece of that work, when no core has any other (an engine call: run it off
        the event loop, never beside ``step``). Returns the tokens computed."""
        if self.has_work() or not self.idle_work():
            return 0
        step = getattr(self.current.core, "idle_step", None)  # (a core with idle work has one)
        return int(step()) if step is not None else 0

    def retired(self) -> VersionedCore | None:
        """The retiring core once it is empty (the caller frees its engine), else None."""
        if self.retiring is not None and not self.retiring.core.has_work():
            done, self.retiring = self.retiring, None
            return done
        return None

    def abandon_all(self) -> list[AnyTask]:
        return [t for c in self.all() for t in c.core.abandon_all()]
