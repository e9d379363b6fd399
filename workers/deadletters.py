"""Dead letters: tasks a worker refuses to run go to ``sf:{model}:dead`` (one
``shared.schema.DeadLetter`` each) and leave their lane: a malformed task, or one
delivered more than ``max_deliveries`` times without finishing, whose client is told
(docs/architecture.md, "Invariants": nothing invalid reaches a worker).
"""

from __future__ import annotations

from streamfleet.shared.keys import GROUP, split_source
from streamfleet.shared.logging import get_logger
from streamfleet.shared.metrics import worker as metrics
from streamfleet.shared.redis import BROKER_ERRORS
from streamfleet.shared.schema import DeadLetter, ErrorEvent, decode_task
from streamfleet.workers.context import Part, WorkerContext
from streamfleet.workers.publisher import Publisher

__all__ = ["DeadLetters"]

log = get_logger("worker")


class DeadLetters(Part):
    def __init__(self, ctx: WorkerContext, publisher: Publisher) -> None:
        super().__init__(ctx)
        self.publisher = publisher

    async def send(self, lane: str, msg_id: bytes, raw: bytes | None, reason: str) -> None:
        """Move one delivery from its lane to the dead letters (failures are logged)."""
        metrics.dead_letters.labels(self.model).inc()
        # (``lane`` may be an affinity source, "normal@w1": the letter names the lane)
        letter = DeadLetter(raw or b"", reason, split_source(lane)[0], self.worker_id)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.keys.dead(self.model), letter.fields(), maxlen=self.settings.dead_maxlen,
                          approximate=True)
                pipe.xack(self.lane_keys[lane], GROUP, msg_id)
                pipe.xdel(self.lane_keys[lane], msg_id)
                await pipe.execute()
        except BROKER_ERRORS as exc:
            log.warning("dead-lettering failed", error=str(exc))

    async def give_up(self, lane: str, msg_id: bytes, fields: dict[bytes, bytes], deliveries: int) -> None:
        """A task delivered ``deliveries`` times without finishing: dead-letter it and end
        the request with a ``delivery_failed`` error.

        Raises:
            BROKER_ERRORS: the error event could not be logged or published.
        """
        raw = fields.get(b"task", b"")
        reason = f"delivered {deliveries} times without finishing (max {self.settings.max_deliveries})"
        try:
            task = decode_task(raw)
        except ValueError:
            task = None
        await self.send(lane, msg_id, raw, reason)
        if task is not None:
            log.error("task dead-lettered", request_id=task.request_id, trace_id=task.trace_id, reason=reason)
            ev = ErrorEvent(task.request_id, "delivery_failed",
                            f"the request failed on {deliveries} workers in a row and was given up")
            await self.publisher.announce(task, ev)
