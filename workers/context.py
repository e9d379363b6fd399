"""What every part of a worker process shares (docs/architecture.md, "Processes").

``WorkerContext`` carries the Redis connection, the settings, the key names and the
worker's identity; each part (intake, publisher, reclaim, dead letters, reload, the
control channel, heartbeat, drain) subclasses ``Part`` and reads them from there, and
takes only its own collaborators besides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis

from streamfleet.shared.keys import Keys
from streamfleet.shared.settings import WorkerSettings

__all__ = ["WorkerContext", "Part"]


@dataclass(frozen=True, slots=True)
class WorkerContext:
    redis: aioredis.Redis
    settings: WorkerSettings
    keys: Keys
    worker_id: str
    #: lane name -> its stream key, for this worker's model
    lane_keys: dict[str, str] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.settings.model


class Part:
    """A part of the worker process: the shared context under short names."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.redis = ctx.redis
        self.settings = ctx.settings
        self.keys = ctx.keys
        self.model = ctx.model
        self.lane_keys = ctx.lane_keys
        self.worker_id = ctx.worker_id
