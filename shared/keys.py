"""Redis key names (README: "Redis keys"). Every key a process touches is built here.

Keys of one model share the hash tag ``{model}`` so that a multi-lane XREADGROUP
is legal on Redis Cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GROUP", "LANES", "Keys"]

#: consumer group every worker of a model joins on each lane stream
GROUP = "workers"
#: lanes in priority order
LANES: tuple[str, ...] = ("high", "normal")


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder for one key prefix (default ``sf``)."""

    prefix: str = "sf"

    def lane(self, model: str, lane: str) -> str:
        return f"{self.prefix}:{{{model}}}:tasks:{lane}"

    def lanes(self, model: str) -> dict[str, str]:
        return {lane: self.lane(model, lane) for lane in LANES}

    def dead(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:dead"

    def reply(self, connection_id: str) -> str:
        return f"{self.prefix}:reply:{connection_id}"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}:cancel"

    def wake(self, model: str) -> str:
        """Pub/sub channel: a gateway just queued a task for ``model`` (message: a
        ``shared.schema.Wake``, its lane and entry id).
        A hint only; workers that miss one still find the task on their next read."""
        return f"{self.prefix}:wake:{model}"

    def log(self, request_id: str) -> str:
        return f"{self.prefix}:log:{request_id}"

    def audio(self, request_id: str) -> str:
        """Stream (capped, with a TTL): the audio of one utterance, appended by the gateway
        as the client speaks (``shared.schema.AudioChunk``), then an end marker; the
        worker transcribing it reads it as it arrives (docs/voice.md)."""
        return f"{self.prefix}:audio:{request_id}"

    def attach(self, request_id: str) -> str:
        """Sorted set ``connection_id -> expiry ms`` (with a TTL): the reply channels of
        clients that resumed the request and follow it, wherever they are. Workers
        publish the request's events to these too, and keep it running while any
        of them is listened to."""
        return f"{self.prefix}:attach:{request_id}"

    @property
    def follow(self) -> str:
        """Pub/sub channel: a client started following a request on another connection
        (``shared.schema.Follow``); every worker of every model hears it."""
        return f"{self.prefix}:follow"

    def request(self, request_id: str) -> str:
        """String with TTL: the request's record (``shared.schema.RequestRecord``),
        written by the gateway before the task is queued, so a request can be resumed
        while it still waits for a worker."""
        return f"{self.prefix}:req:{request_id}"

    def target_version(self, model: str) -> str:
        """String: the model version every worker should serve (set by `streamfleet reload`)."""
        return f"{self.prefix}:version:{model}"

    def reload_lock(self, model: str) -> str:
        """String with TTL: the worker currently reloading (workers take turns)."""
        return f"{self.prefix}:reload:{model}"

    def workers(self, model: str) -> str:
        return f"{self.prefix}:workers:{model}"

    def ratelimit(self, key_id: str) -> str:
        """Hash ``{tokens, ts}``: the token bucket of one API key."""
        return f"{self.prefix}:rl:{key_id}"

    @property
    def api_keys(self) -> str:
        """Hash ``key_id -> JSON record`` of every API key (only a hash of each key)."""
        return f"{self.prefix}:keys"

    def streams(self, key_id: str) -> str:
        """Sorted set ``request_id -> expiry ms``: streams one API key has open."""
        return f"{self.prefix}:streams:{key_id}"

    def connections(self, key_id: str) -> str:
        """Sorted set ``connection_id -> expiry ms``: WebSockets one API key has open,
        across every gateway."""
        return f"{self.prefix}:conns:{key_id}"
