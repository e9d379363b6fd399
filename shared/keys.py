"""Redis key names (docs/operations.md, "Redis keys"). Every key a process touches is built here.

Keys of one model share the hash tag ``{model}`` so that a multi-lane XREADGROUP
is legal on Redis Cluster.

On a Redis Cluster (``Keys(cluster=True)``, docs/cluster.md) a few names change so that
what travels together lands on one shard:

* a connection's reply channel and its requests' logs, records and follower sets share
  a *shard tag*: the first ``TAG_LEN`` characters of the connection id, which every
  request id minted for that connection starts with (``Keys.new_request_id``). A
  worker's step then logs and publishes a request's events on one shard in one
  pipeline, and any gateway finds a request's keys from its id alone (resume);
* the model's wake, cancel and follow channels and its utterances' audio carry the
  ``{model}`` tag of its lanes (the enqueue script publishes the wake on the lanes'
  slot; a worker reads all its utterances' audio in one XREAD);
* channels are sharded (``SPUBLISH``/``SSUBSCRIBE``), so a message is handled only by
  the shard that owns its slot.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

__all__ = ["GROUP", "LANES", "TAG_LEN", "FairKeys", "Keys", "LaneKeys", "affinity_source", "split_source"]

#: characters of a connection id that tag its reply channel, and start its requests' ids
TAG_LEN = 4

#: consumer group every worker of a model joins on each lane stream
GROUP = "workers"
#: lanes in priority order
LANES: tuple[str, ...] = ("high", "normal")


def affinity_source(lane: str, worker_id: str) -> str:
    """The name a worker gives the tasks routed to it on ``lane`` (prefix-aware routing,
    docs/architecture.md): ``"<lane>@<worker id>"``, where a shared lane's tasks are
    named by the lane alone. Wakes, deliveries and acks carry it like a lane's name."""
    return f"{lane}@{worker_id}"


def split_source(source: str) -> tuple[str, str]:
    """``(lane, worker id)`` of a source: the worker id is ``""`` for a shared lane."""
    lane, _, worker = source.partition("@")
    return lane, worker


class LaneKeys(dict[str, str]):
    """Lane name -> its stream key, for one model (``Keys.lanes``), which also finds the
    key of an affinity source (``"normal@w1"``, ``affinity_source``) without listing it:
    iterating gives the shared lanes only."""

    __slots__ = ("_keys", "_model")

    def __init__(self, keys: Keys, model: str) -> None:
        super().__init__((lane, keys.lane(model, lane)) for lane in LANES)
        self._keys, self._model = keys, model

    def __missing__(self, source: str) -> str:
        lane, worker = split_source(source)
        if not worker or lane not in LANES:
            raise KeyError(source)
        return self._keys.affinity(self._model, lane, worker)


@dataclass(frozen=True, slots=True)
class FairKeys:
    """The fair-share state of one lane (shared/fairshare.py, docs/operations.md "Redis
    keys"), on the lanes' slot: ``waiting`` the tenants with tasks waiting, sorted by
    counter; ``seen`` the counters of tenants served lately; ``queued`` a list of one
    element per task waiting (``LLEN``: how many); ``vtime`` the lane's virtual time;
    ``tasks`` the waiting tasks (hash, field ``<tenant> <n>``) and ``ends`` each waiting
    tenant's first and last ``n`` (hash): a queue per tenant; ``tokens`` each waiting
    tenant's prompt tokens waiting (hash; the tier's ``max_queued_tokens``)."""

    base: str

    @property
    def waiting(self) -> str:
        return self.base

    @property
    def seen(self) -> str:
        return f"{self.base}:seen"

    @property
    def queued(self) -> str:
        return f"{self.base}:queued"

    @property
    def vtime(self) -> str:
        return f"{self.base}:vt"

    @property
    def tasks(self) -> str:
        return f"{self.base}:tasks"

    @property
    def ends(self) -> str:
        return f"{self.base}:ends"

    @property
    def tokens(self) -> str:
        return f"{self.base}:tokens"

    @property
    def script_keys(self) -> tuple[str, str, str, str, str, str, str]:
        """The keys the scripts take after the lane's stream (``shared.fairshare.FAIR_LIB``)."""
        return self.waiting, self.seen, self.queued, self.vtime, self.tasks, self.ends, self.tokens


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder for one key prefix (default ``sf``), for a single server or a
    Redis Cluster."""

    prefix: str = "sf"
    cluster: bool = False

    @staticmethod
    def new_request_id(connection_id: str) -> str:
        """A fresh request id (32 hex characters) that starts with the connection's
        shard tag, so its logs share the shard of the connection's reply channel."""
        return connection_id[:TAG_LEN] + uuid.uuid4().hex[TAG_LEN:]

    def _tagged(self, kind: str, ident: str) -> str:
        if self.cluster:
            return f"{self.prefix}:{kind}:{{{ident[:TAG_LEN]}}}:{ident}"
        return f"{self.prefix}:{kind}:{ident}"

    @property
    def publish(self) -> bytes:
        """The publish command for the fleet's channels: ``SPUBLISH`` on a cluster."""
        return b"SPUBLISH" if self.cluster else b"PUBLISH"

    def lane(self, model: str, lane: str) -> str:
        return f"{self.prefix}:{{{model}}}:tasks:{lane}"

    def lanes(self, model: str) -> LaneKeys:
        """Lane -> stream key (``LaneKeys``: an affinity source's key is found too)."""
        return LaneKeys(self, model)

    def affinity(self, model: str, lane: str, worker_id: str) -> str:
        """Stream, group ``workers``: the tasks of ``lane`` a gateway sent to one worker for
        the prompt prefix it holds (prefix-aware routing, docs/architecture.md). On the
        lanes' slot: the enqueue script counts it with the lane's backlog."""
        return f"{self.lane(model, lane)}:@{worker_id}"

    def affinity_streams(self, model: str) -> str:
        """Set: the key of every affinity stream of ``model`` (written by the enqueue
        script that creates one), so workers find them after their owner is gone."""
        return f"{self.prefix}:{{{model}}}:affinity"

    def affinity_source_of(self, model: str, key: str | bytes) -> str | None:
        """The source (``"normal@w1"``) of an affinity stream's key; None for another key."""
        key = key.decode() if isinstance(key, bytes) else key
        for lane in LANES:
            head = f"{self.lane(model, lane)}:@"
            if key.startswith(head) and len(key) > len(head):
                return affinity_source(lane, key[len(head):])
        return None

    def prefix_advert(self, model: str, worker_id: str) -> str:
        """Set with a TTL: the 8-byte names of the prefix-cache blocks one worker holds
        (shared/prefixhash.py), rewritten with its heartbeat when they change; gateways
        look a prompt's names up in it (SMISMEMBER)."""
        return f"{self.prefix}:{{{model}}}:prefix:{worker_id}"

    def stream(self, model: str, source: str) -> str:
        """The stream key of a source: a lane, or an affinity stream (``"normal@w1"``)."""
        return self.lanes(model)[source]

    def fair(self, model: str, lane: str) -> FairKeys:
        """The fair-share state of a lane (``FairKeys``): the tasks that wait for their
        tenant's turn before they join the lane's stream."""
        return FairKeys(f"{self.prefix}:{{{model}}}:fair:{lane}")

    def dead(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}:dead"

    def reply(self, connection_id: str) -> str:
        return self._tagged("reply", connection_id)

    def cancel(self, model: str) -> str:
        """Pub/sub channel: cancellations (``shared.schema.Cancel``), heard by every
        worker of ``model`` (``sf:cancel`` for all models on a single server)."""
        return f"{self.prefix}:cancel:{{{model}}}" if self.cluster else f"{self.prefix}:cancel"

    def wake(self, model: str) -> str:
        """Pub/sub channel: a gateway just queued a task for ``model`` (message: a
        ``shared.schema.Wake``, its lane and entry id).
        A hint only; workers that miss one still find the task on their next read."""
        return f"{self.prefix}:wake:{{{model}}}" if self.cluster else f"{self.prefix}:wake:{model}"

    def log(self, request_id: str) -> str:
        return self._tagged("log", request_id)

    def audio(self, request_id: str, model: str) -> str:
        """Stream (capped, with a TTL): the audio of one utterance, appended by the gateway
        as the client speaks (``shared.schema.AudioChunk``), then an end marker; the
        worker transcribing it reads it as it arrives (docs/voice.md)."""
        if self.cluster:
            return f"{self.prefix}:audio:{{{model}}}:{request_id}"
        return f"{self.prefix}:audio:{request_id}"

    def attach(self, request_id: str) -> str:
        """Sorted set ``connection_id -> expiry ms`` (with a TTL): the reply channels of
        clients that resumed the request and follow it, wherever they are. Workers
        publish the request's events to these too, and keep it running while any
        of them is listened to."""
        return self._tagged("attach", request_id)

    def follow(self, model: str) -> str:
        """Pub/sub channel: a client started following a request on another connection
        (``shared.schema.Follow``); every worker of ``model`` hears it (of every model on
        a single server)."""
        return f"{self.prefix}:follow:{{{model}}}" if self.cluster else f"{self.prefix}:follow"

    def request(self, request_id: str) -> str:
        """String with TTL: the request's record (``shared.schema.RequestRecord``),
        written by the gateway before the task is queued, so a request can be resumed
        while it still waits for a worker."""
        return self._tagged("req", request_id)

    def response(self, response_id: str) -> str:
        """String with TTL: a stored response of the Responses API
        (``shared.schema.StoredResponse``, ``gateway/doors/responses.py``), ``response_id`` as
        the API names it (``resp_…``). One key per command, so no hash tag: on a cluster
        the responses spread over the slots by their ids."""
        return f"{self.prefix}:resp:{response_id}"

    def target_version(self, model: str) -> str:
        """String: the model version every worker should serve (set by `streamfleet reload`)."""
        return f"{self.prefix}:version:{model}"

    def reload_lock(self, model: str) -> str:
        """String with TTL: the worker currently reloading (workers take turns)."""
        return f"{self.prefix}:reload:{model}"

    def workers(self, model: str) -> str:
        return f"{self.prefix}:workers:{model}"

    def voice_slots(self, model: str) -> tuple[str, str, str]:
        """The fair sharing of ``model``'s speech decoder slots (docs/voice.md, "Fair
        slots"; ``gateway/admission/voiceslots.py``), three keys on the slot of its lanes: sorted
        sets ``tenant|utterance -> expiry ms`` of the slots granted and of the utterances
        waiting for one, and a hash ``tenant|utterance -> "since_ms cap"`` of the waiting
        ones' places in turn."""
        base = f"{self.prefix}:{{{model}}}:voice"
        return f"{base}:held", f"{base}:waiting", f"{base}:turns"

    def ratelimit(self, key_id: str) -> str:
        """Hash ``{tokens, ts}``: the request bucket of one API key."""
        return f"{self.prefix}:rl:{key_id}"

    def token_ratelimit(self, key_id: str) -> str:
        """Hash ``{tokens, ts}``: the bucket of tokens served of one API key (its tier's
        ``tokens_per_minute``)."""
        return f"{self.prefix}:rlt:{key_id}"

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
