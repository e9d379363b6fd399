"""The requests a worker holds, in one table and without I/O.

A lane delivery is *held* from the moment this worker reads or claims it until it
starts in a core, then *running* until its final event is published and acked
(docs/architecture.md, "A request's path", steps 3 to 5). Beside each running request
the table keeps who else listens to it (clients that resumed it elsewhere) and since
when nobody has; and, for requests not running here (yet), the cancels and follows
heard for them, applied if they start within ``MEMORY_S``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from streamfleet.shared.logging import get_logger
from streamfleet.shared.schema import AnyTask

__all__ = ["InFlight", "Delivery", "InFlightTable", "MEMORY_S", "MAX_FOLLOWERS"]

log = get_logger("worker")

#: how long a cancel or follow for a request this worker has not seen yet is remembered
MEMORY_S = 300.0
#: most reply channels one request is published to besides its own (resumed clients)
MAX_FOLLOWERS = 8
#: most remembered follows; past it the oldest ``FOLLOW_MEMORY_TRIM`` are forgotten
FOLLOW_MEMORY_MAX = 10_000
FOLLOW_MEMORY_TRIM = 1000


@dataclass(slots=True)
class InFlight:
    """A request running in a core, and the lane delivery that acks it."""

    lane: str
    message_id: bytes
    task: AnyTask
    #: its ack is on its way (the publisher's batch): gone from the lane's pending list
    #: because it finished, not because another worker claimed it
    acking: bool = False


@dataclass(slots=True)
class Delivery:
    """A lane entry read or claimed but not started yet."""

    lane: str
    message_id: bytes
    fields: dict[bytes, bytes]
    #: token ids the request generated before this worker took it over (from its log)
    replay: list[int] | None = None

    @property
    def raw_task(self) -> bytes:
        return self.fields.get(b"task") or b""


class InFlightTable:
    def __init__(self) -> None:
        self.running: dict[str, InFlight] = {}
        #: read beyond the free slots, or reclaimed: started first, oldest first
        self.held: list[Delivery] = []
        #: request id -> reply channels of clients that resumed it elsewhere (sf:attach:{id})
        self.followers: dict[str, set[str]] = {}
        #: request id -> when a PUBLISH for it first reached no subscriber (reset by one that did)
        self._unheard: dict[str, float] = {}
        self._looking_up: set[str] = set()  # follower look-ups in progress
        self._cancel_memory: dict[str, float] = {}
        self._follow_memory: dict[str, tuple[set[str], float]] = {}
        #: called when a delivery is held (an idle worker's wait on its lanes ends for it)
        self.on_hold: Callable[[], None] | None = None

    # -- running requests ------------------------------------------------------------
    def __contains__(self, request_id: object) -> bool:
        return request_id in self.running

    def __len__(self) -> int:
        return len(self.running)

    def get(self, request_id: str) -> InFlight | None:
        return self.running.get(request_id)

    def admit(self, lane: str, message_id: bytes, task: AnyTask) -> bool:
        """``task`` starts running here; the follows remembered for it apply now. Returns
        whether a cancel was heard for it before it started (the caller cancels it)."""
        rid = task.request_id
        self.running[rid] = InFlight(lane, message_id, task)
        remembered = self._follow_memory.pop(rid, None)
        if remembered is not None:
            self.add_followers(rid, remembered[0])
        return rid in self._cancel_memory

    def finish(self, request_id: str, fl: InFlight) -> None:
        """``fl`` was acked: forget it (unless the request started again since, as another
        delivery) and all that listened to it."""
        if self.running.get(request_id) is fl:
            del self.running[request_id]
        self._unheard.pop(request_id, None)
        self.followers.pop(request_id, None)

    def lost(self, lane: str, message_ids: set[bytes]) -> list[tuple[str, InFlight]]:
        """Deliveries of ``lane`` that are no longer this worker's (another worker claimed
        them): drop them, held or running; returns the running ones (the caller abandons
        them in the cores). One being acked is not lost: it left the pending list because
        it finished (the reclaimer's look may cross the publisher's ack)."""
        self.held = [d for d in self.held if not (d.lane == lane and d.message_id in message_ids)]
        dropped = [(rid, fl) for rid, fl in self.running.items()
                   if fl.lane == lane and fl.message_id in message_ids and not fl.acking]
        for rid, _ in dropped:
            del self.running[rid]
        return dropped

    def hand_back(self, abandoned: list[AnyTask]) -> list[tuple[str, bytes, bytes]]:
        """Empty the table for a drain: ``(lane, message id, task)`` of each abandoned
        running request and each held delivery, to requeue."""
        items = [(fl.lane, fl.message_id, fl.task.encode()) for t in abandoned
                 if (fl := self.running.pop(t.request_id, None)) is not None]
        items += [(d.lane, d.message_id, d.raw_task) for d in self.held]
        self.held = []
        return items

    def deliveries(self) -> dict[str, list[bytes]]:
        """Lane -> message ids of every delivery this worker holds, running or held."""
        by_lane: dict[str, list[bytes]] = {}
        for fl in self.running.values():
            by_lane.setdefault(fl.lane, []).append(fl.message_id)
        for d in self.held:
            by_lane.setdefault(d.lane, []).append(d.message_id)
        return by_lane

    def slots(self) -> list[tuple[str, str]]:
        """``(API key id, request id)`` of the running requests that hold a stream slot."""
        return [(fl.task.slot, rid) for rid, fl in self.running.items() if fl.task.slot]

    # -- held deliveries -------------------------------------------------------------------
    def hold(self, delivery: Delivery) -> None:
        self.held.append(delivery)
        if self.on_hold is not None:
            self.on_hold()

    def take_held(self, n: int) -> list[Delivery]:
        taken, self.held = self.held[:n], self.held[n:]
        return taken

    # -- listeners ---------------------------------------------------------------------------
    def channels(self, reply_to: str, request_id: str) -> tuple[str, ...]:
        """Every reply channel of a request: its own and its followers'."""
        followers = self.followers.get(request_id)
        return (reply_to, *followers) if followers else (reply_to,)

    def add_followers(self, request_id: str, channels: set[str]) -> None:
        known = self.followers.setdefault(request_id, set())
        new = channels - known
        if new:
            known.update(new)
            while len(known) > MAX_FOLLOWERS:
                known.pop()
            self._unheard.pop(request_id, None)
            log.info("request followed elsewhere", request_id=request_id, followers=len(known))

    def follow(self, request_id: str, reply_to: str, now: float) -> None:
        """A client follows ``request_id`` on ``reply_to`` (``sf:follow``): at once if it
        runs here, else when it starts (within ``MEMORY_S``)."""
        if request_id in self.running:
            self.add_followers(request_id, {reply_to})
            return
        channels, _ = self._follow_memory.get(request_id, (set(), 0.0))
        if len(channels) < MAX_FOLLOWERS:
            channels.add(reply_to)
        self._follow_memory[request_id] = (channels, now)
        if len(self._follow_memory) > FOLLOW_MEMORY_MAX:  # bounded: the oldest go first
            oldest = sorted(self._follow_memory, key=lambda r: self._follow_memory[r][1])
            for rid in oldest[:FOLLOW_MEMORY_TRIM]:
                del self._follow_memory[rid]

    def heard(self, request_id: str) -> None:
        """A publish for the request reached someone (or its silence was dealt with)."""
        self._unheard.pop(request_id, None)

    def unheard(self, request_id: str, now: float) -> tuple[float, bool]:
        """A publish for the request reached nobody: since when nobody has listened, and
        whether this is the first such publish."""
        since = self._unheard.get(request_id)
        if since is None:
            self._unheard[request_id] = now
            return now, True
        return since, False

    def begin_look_up(self, request_id: str) -> bool:
        """Whether to start a follower look-up for the request (none is in progress)."""
        if request_id in self._looking_up:
            return False
        self._looking_up.add(request_id)
        return True

    def end_look_up(self, request_id: str) -> None:
        self._looking_up.discard(request_id)

    # -- cancels -------------------------------------------------------------------------------
    def remember_cancel(self, request_id: str, now: float) -> None:
        """A cancel for a request that is not running here (yet)."""
        self._cancel_memory[request_id] = now

    def forget_old(self, now: float) -> None:
        """Forget cancels and follows remembered more than ``MEMORY_S`` before ``now``."""
        if self._cancel_memory or self._follow_memory:
            cutoff = now - MEMORY_S
            for rid in [r for r, t in self._cancel_memory.items() if t < cutoff]:
                del self._cancel_memory[rid]
            for rid in [r for r, (_, t) in self._follow_memory.items() if t < cutoff]:
                del self._follow_memory[rid]
