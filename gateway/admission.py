"""Who may send what: API key authentication, the tier's lane, its shared rate limit and
its concurrent-stream cap. One place both adapters call, in this order::

    identity = await admission.authenticate(authorization_header, api_key_param)
    ticket   = await admission.admit(identity, valid_request)   # before enqueueing
    ...
    await admission.release(ticket)                              # when the request ends

With auth off (the default of `streamfleet serve`) every call is a no-op and
``identity`` is ``None``. Lane backpressure is not here: it is enforced atomically by
the enqueue script (``gateway/broker.py``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from shared.errors import AuthError, ErrorCode
from shared.tiers import parse_tiers

from gateway.auth import Identity, KeyStore, extract_key
from gateway.ratelimit import RateLimiter, StreamSlots

__all__ = ["Admission", "Ticket", "owner_of"]


def owner_of(identity: "Identity | None") -> str | None:
    """The tenant a request belongs to: its API key (recorded with the request; resume and
    replay require the same key). None with auth off, where the request id is the only
    credential."""
    return f"key:{identity.key_id}" if identity is not None else None


@dataclass(frozen=True, slots=True)
class Ticket:
    """An admitted request: the id it will be enqueued under, and the stream slot it holds."""

    request_id: str
    key_id: str | None = None
    holds_slot: bool = False


class Admission:
    def __init__(self, settings, broker) -> None:
        self.settings = settings
        self.broker = broker
        self.enabled = settings.auth_enabled
        self.tiers = parse_tiers(settings.tiers)  # FatalError on bad config: refuse to start
        self.store: KeyStore | None = None
        self.limiter: RateLimiter | None = None
        self.slots: StreamSlots | None = None

    def start(self) -> None:
        """Bind to the broker's Redis client (after ``Broker.start``)."""
        r, keys = self.broker.redis, self.broker.keys
        self.store = KeyStore(r, keys, tiers=self.tiers, cache_ttl_s=self.settings.key_cache_s)
        self.limiter = RateLimiter(r, keys)
        self.slots = StreamSlots(r, keys)

    async def authenticate(self, authorization: str | None, api_key: str | None = None) -> Identity | None:
        """The caller's identity, or None with auth off.

        Raises:
            AuthError: missing, unknown or revoked key (401).
        """
        if not self.enabled:
            return None
        return await self.store.verify(extract_key(authorization, api_key))

    async def admit(self, identity: Identity | None, request) -> Ticket:
        """Check the tier's lane, rate limit and stream cap for one request.

        Raises:
            AuthError: ``forbidden`` (403) — the tier may not use the requested lane.
            RefusedError: ``rate_limited`` / ``too_many_requests`` (429, with a retry hint).
        """
        rid = uuid.uuid4().hex
        if identity is None:
            return Ticket(rid)
        tier = identity.tier
        if not tier.allows_lane(request.lane):
            raise AuthError(f"the {tier.name} tier may not use the {request.lane} lane "
                            f"(highest allowed: {tier.max_lane})", code=ErrorCode.forbidden, param="priority")
        await self.limiter.check(identity)
        held = await self.slots.acquire(identity.key_id, rid, tier.max_streams)
        return Ticket(rid, identity.key_id, held)

    async def release(self, ticket: Ticket | None) -> None:
        if ticket is not None and ticket.holds_slot:
            await self.slots.release(ticket.key_id, ticket.request_id)
