"""Who may send what: API key authentication, the tier's lane and ceilings, its shared
rate limit, its concurrent-stream and connection caps, and who owns a request
(docs/security.md, "Tenants"). One place the gateway calls, in this order (``authenticate`` by each
adapter, the rest by ``gateway.requests.lifecycle.ClientRequest``)::

    identity = await admission.authenticate(authorization_header, api_key_param)
    request  = validator.check(payload)               # cheap rules only: a TextRequest
    ticket, request = await admission.admit(identity, request, request_id)  # lane, ceilings, rate, slot
    request  = validator.finish(request)              # tokenize: only what was admitted
    ...                                                # enqueue with ticket.owner, ticket.slot
    await admission.release(ticket)                    # once the gateway saw the request end

A resume goes through ``admit_resume`` (the rate limit, and the owner it must match).

With auth off (the default of ``streamfleet serve``) nothing is limited and a request
belongs to whoever holds its ``resume_token`` (returned in ``accepted``, needed to
resume). With auth on it belongs to its API key. Lane backpressure is not here: it is
enforced atomically by the enqueue script (``gateway/requests/broker.py``).

Open connections and streams of a key are watched: when the key is revoked, every
gateway ends them within its key cache time (``key_cache_s``).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar, overload

from streamfleet.gateway.admission.auth import REVOKED_KEY_MESSAGE, Identity, KeyStore, extract_key
from streamfleet.gateway.admission.kinds import AnyRequest
from streamfleet.gateway.admission.ratelimit import (
    ConnectionSlots,
    RateLimiter,
    StreamSlots,
    TokensLimited,
    rate_limited,
    tokens_limited,
)
from streamfleet.shared import aio
from streamfleet.shared.errors import AuthError, ErrorCode, RefusedError, StreamfleetError, ValidationError
from streamfleet.shared.logging import get_logger
from streamfleet.shared.tiers import CONNECTION_SLOT_TTL_S, Tier, parse_tiers

if TYPE_CHECKING:
    from streamfleet.gateway.requests.broker import Broker
    from streamfleet.shared.settings import GatewaySettings

__all__ = ["Admission", "Ticket", "owner_of", "token_owner"]

log = get_logger("gateway.admission")

#: a typed request of any kind (``gateway/admission/kinds.py``), kept as its own type
R = TypeVar("R", bound=AnyRequest)

OnRevoked = Callable[[], Awaitable[None]]


@overload
def owner_of(identity: Identity) -> str: ...


@overload
def owner_of(identity: None) -> None: ...


def owner_of(identity: Identity | None) -> str | None:
    """The tenant of an authenticated caller: its API key. None with auth off."""
    return f"key:{identity.key_id}" if identity is not None else None


def token_owner(resume_token: str) -> str:
    """The owner recorded for a request submitted with auth off: a digest of its resume
    token (the token itself is never stored)."""
    return "tok:" + hashlib.sha256(resume_token.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Ticket:
    """What admission granted a request: the id it will be enqueued under, its owner, the
    stream slot it holds. Not a shape of the request: the request itself travels as its
    typed kind (``gateway/admission/kinds.py``)."""

    request_id: str
    owner: str
    key_id: str | None = None
    holds_slot: bool = False
    #: with auth off: the secret that lets its client resume it (sent in ``accepted``)
    resume_token: str | None = None

    @property
    def slot(self) -> str:
        """The key id whose stream slot the task carries ("" for none)."""
        return self.key_id if self.holds_slot and self.key_id else ""


class Admission:
    def __init__(self, settings: GatewaySettings, broker: Broker) -> None:
        self.settings = settings
        self.broker = broker
        self.enabled = settings.auth_enabled
        self.tiers = parse_tiers(settings.tiers)  # FatalError on bad config: refuse to start
        self.store: KeyStore | None = None
        self.limiter: RateLimiter | None = None
        self.slots: StreamSlots | None = None
        self.connections: ConnectionSlots | None = None
        #: key id -> callbacks of this process's open connections and streams of that key
        self._watched: dict[str, dict[int, OnRevoked]] = {}
        #: connection slots this process holds: (key id, connection id)
        self._held_connections: set[tuple[str, str]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._handles = itertools.count(1)
        #: key id -> monotonic time until which its bucket is known empty (``spent``)
        self._spent: dict[str, tuple[float, bool]] = {}

    def start(self) -> None:
        """Bind to the broker's Redis client (after ``Broker.start``)."""
        r, keys = self.broker.redis, self.broker.keys
        assert r is not None, "Broker.start first"
        self.store = KeyStore(r, keys, tiers=self.tiers, cache_ttl_s=self.settings.key_cache_s)
        self.limiter = RateLimiter(r, keys)
        self.slots = StreamSlots(r, keys)
        self.connections = ConnectionSlots(r, keys)
        if self.enabled:
            self._watcher = asyncio.create_task(self._watch(), name="admission-watch")

    async def stop(self) -> None:
        await aio.cancel_and_wait(self._watcher)

    # -- who ------------------------------------------------------------------------
    async def authenticate(self, authorization: str | None, api_key: str | None = None) -> Identity | None:
        """The caller's identity, or None with auth off.

        Raises:
            AuthError: missing, unknown or revoked key (401).
        """
        if not self.enabled:
            return None
        assert self.store is not None, "Admission.start first"
        return await self.store.verify(extract_key(authorization, api_key))

    # -- requests ---------------------------------------------------------------------
    def spent(self, identity: Identity | None) -> None:
        """Refuse at once, without a Redis round trip or reading the request, a key this
        gateway saw run out of its rate limit, until its next request is due (the refusal's
        ``retry_after_ms``): a flood of refused requests costs the gateway next to nothing
        (docs/security.md). Other gateways only take tokens, so the bucket cannot refill
        sooner (a refused request of several choices gives some back; it is then seen at
        most ``retry_after_ms`` late).

        Raises:
            RefusedError: 429 ``rate_limited``, with the time left as its retry hint.
        """
        if identity is None or not self._spent:
            return
        spent = self._spent.get(identity.key_id)
        if spent is None:
            return
        until, of_tokens = spent
        left = until - asyncio.get_running_loop().time()
        if left <= 0:
            del self._spent[identity.key_id]
            return
        refusal = tokens_limited if of_tokens else rate_limited
        raise refusal(identity.tier, max(1, int(left * 1000)))

    async def _take(self, identity: Identity, cost: int = 1, *, tokens: bool = True) -> None:
        """``cost`` requests from the key's bucket (``RateLimiter.check``) and, with
        ``tokens``, a look at its token bucket (refused while it is in debt: the tokens
        of its earlier requests are not paid back yet), remembering when either is empty
        (``spent``)."""
        self.spent(identity)
        assert self.limiter is not None, "Admission.start first"
        try:
            if tokens and identity.tier.tokens_per_minute is not None:
                await asyncio.gather(self.limiter.check(identity, cost=cost), self._tokens(identity, 0))
            else:
                await self.limiter.check(identity, cost=cost)
        except RefusedError as exc:
            # a refusal of several requests at once (choices) leaves the key the ones it has
            one = cost == 1 or isinstance(exc, TokensLimited)
            if exc.code == ErrorCode.rate_limited and exc.retry_after_ms and one:
                now = asyncio.get_running_loop().time()
                if len(self._spent) >= 10_000:  # bounded: drop what has lapsed
                    self._spent = {k: t for k, t in self._spent.items() if t[0] > now}
                if len(self._spent) < 10_000:
                    self._spent[identity.key_id] = (now + exc.retry_after_ms / 1000,
                                                        isinstance(exc, TokensLimited))
            raise

    async def admit(self, identity: Identity | None, request: R, request_id: str, *,
                    charged: bool = False) -> tuple[Ticket, R]:
        """Check the tier's lane, ceilings, rate limit and stream cap for one request
        (a typed request, ``gateway/admission/kinds.py``), before its prompt is tokenized.
        Returns the ticket and the request as admitted (a tier's ceilings may have
        lowered its defaults). ``request_id``:
        minted by ``shared.keys.Keys.new_request_id`` (its shard tag is the reply
        channel's; there is no other way to make one). ``charged``: the
        rate limit was taken already (``charge``: the choices of one request).

        Raises:
            AuthError: ``forbidden`` (403) — the tier may not use the requested lane.
            ValidationError: ``out_of_range`` — ``max_tokens`` or ``timeout`` above the tier's ceiling.
            RefusedError: ``rate_limited`` / ``too_many_requests`` (429, with a retry hint).
        """
        rid = request_id
        if identity is None:
            token = secrets.token_hex(16)
            return Ticket(rid, token_owner(token), resume_token=token), request
        tier = identity.tier
        if not tier.allows_lane(request.lane):
            raise AuthError(f"the {tier.name} tier may not use the {request.lane} lane "
                            f"(highest allowed: {tier.max_lane})", code=ErrorCode.forbidden, param="priority")
        request = self._within_ceilings(tier, request)
        if not charged:
            await self._take(identity)
        assert self.slots is not None, "Admission.start first"
        held = await self.slots.acquire(identity.key_id, rid, tier.max_streams)
        return Ticket(rid, owner_of(identity), identity.key_id, held), request

    @staticmethod
    def _within_ceilings(tier: Tier, draft: R) -> R:
        """Refuse a ``max_tokens`` or ``timeout`` the client set above the tier's ceiling;
        lower the gateway's defaults to it when the client set none."""
        params, timeout_s = draft.params, draft.timeout_s
        if tier.max_tokens is not None and params.max_tokens > tier.max_tokens:
            if "max_tokens" in draft.explicit:
                raise ValidationError(f"'max_tokens' of {params.max_tokens} exceeds the limit of the {tier.name} "
                                      f"tier ({tier.max_tokens})", code=ErrorCode.out_of_range, param="max_tokens")
            params = replace(params, max_tokens=tier.max_tokens)
        if tier.max_timeout_s is not None and timeout_s > tier.max_timeout_s:
            if "timeout" in draft.explicit:
                raise ValidationError(f"'timeout' of {timeout_s:g} s exceeds the limit of the {tier.name} tier "
                                      f"({tier.max_timeout_s:g} s)", code=ErrorCode.out_of_range, param="timeout")
            timeout_s = tier.max_timeout_s
        if params is draft.params and timeout_s == draft.timeout_s:
            return draft
        return replace(draft, params=params, timeout_s=timeout_s)

    async def charge(self, identity: Identity | None, choices: int, param: str = "n") -> None:
        """Take the rate limit of a request of several ``choices`` (``n``, ``best_of``) at
        once, all or nothing (docs/security.md): a refusal takes nothing. Its choices are
        then admitted with ``charged=True``; ``refund`` gives back all but one when the
        request is refused after this.

        Raises:
            ValidationError: ``out_of_range`` — more choices than the tier's burst or its
                concurrent streams could ever admit together.
            RefusedError: ``rate_limited``.
        """
        if identity is None:
            return
        tier = identity.tier
        if not tier.unlimited and choices > tier.burst:
            raise ValidationError(f"{choices} choices need {choices} requests at once; the {tier.name} tier allows "
                                  f"{tier.burst} at once (its burst)", code=ErrorCode.out_of_range, param=param)
        if tier.max_streams is not None and choices > tier.max_streams:
            raise ValidationError(f"{choices} choices need {choices} streams at once; the {tier.name} tier allows "
                                  f"{tier.max_streams}", code=ErrorCode.out_of_range, param=param)
        await self._take(identity, choices)

    async def _tokens(self, identity: Identity, cost: int) -> None:
        """Take ``cost`` tokens from the key's token bucket, or refuse.

        Raises:
            RefusedError: ``rate_limited``, naming the tier's ``tokens_per_minute``.
        """
        assert self.limiter is not None, "Admission.start first"
        decision = await self.limiter.take_tokens(identity.key_id, identity.tier, cost)
        if decision is not None and not decision.allowed:
            raise tokens_limited(identity.tier, decision.retry_after_ms, cost)

    async def charge_tokens(self, identity: Identity | None, request: AnyRequest) -> int:
        """Take a prepared request's prompt (or input) tokens from its key's token bucket
        (its tier's ``tokens_per_minute``), once it is tokenized and before it is queued.
        Returns the tokens taken (``refund_tokens`` gives them back if it is not queued).

        Raises:
            ValidationError: ``out_of_range`` — more tokens than the bucket ever holds.
            RefusedError: ``rate_limited``, with the time until they are there.
        """
        if identity is None or identity.tier.tokens_per_minute is None:
            return 0
        tier, n = identity.tier, request.input_tokens
        if n <= 0:
            return 0
        if n > tier.token_capacity:
            raise ValidationError(f"the request's {n} input tokens are more than the {tier.name} tier's token rate "
                                  f"limit ever allows at once ({tier.token_capacity} tokens)",
                                  code=ErrorCode.out_of_range)
        await self._tokens(identity, n)
        return n

    async def refund_tokens(self, identity: Identity | None, tokens: int) -> None:
        """Give back what ``charge_tokens`` took for a request that was then not queued."""
        if identity is None or tokens <= 0:
            return
        assert self.limiter is not None, "Admission.start first"
        try:
            await self.limiter.take_tokens(identity.key_id, identity.tier, -tokens, force=True)
        except StreamfleetError as exc:  # Redis away: the charge stays
            log.warning("could not give a refused request's tokens back to its rate limit", error=str(exc))

    async def refund(self, identity: Identity | None, choices: int) -> None:
        """A request of several choices was refused after ``charge``: it keeps the charge
        of one request (its checks cost the gateway work), the rest goes back."""
        if identity is not None and choices > 1:
            self._spent.pop(identity.key_id, None)
            assert self.limiter is not None, "Admission.start first"
            try:
                await self.limiter.refund(identity, choices - 1)
            except StreamfleetError as exc:  # Redis away: the charge stays, as it would for a request
                log.warning("could not give a refused request's choices back to its rate limit", error=str(exc))

    async def admit_resume(self, identity: Identity | None, resume_token: str | None) -> str:
        """Admit a resume (or an SSE ``Last-Event-ID`` replay): it is charged to the key's
        rate limit like a request. Returns the owner the request must have.

        Raises:
            ValidationError: ``missing_field`` — auth is off and no ``resume_token`` was sent.
            RefusedError: ``rate_limited``.
        """
        if identity is None:
            if not resume_token:
                raise ValidationError("resuming needs the 'resume_token' of the request's 'accepted' frame",
                                      code=ErrorCode.missing_field, param="resume_token")
            return token_owner(resume_token)
        await self._take(identity, tokens=False)
        return owner_of(identity)

    async def release(self, ticket: Ticket | None) -> None:
        """Give a request's stream slot back (the gateway saw it end). A request whose
        client left before its end keeps the slot until the worker gives it back."""
        if ticket is not None and ticket.holds_slot and ticket.key_id is not None:
            assert self.slots is not None, "Admission.start first"
            await self.slots.release(ticket.key_id, ticket.request_id)

    # -- connections --------------------------------------------------------------------
    async def connect(self, identity: Identity | None, connection_id: str) -> bool:
        """Take one of the key's connection slots (all gateways together).

        Returns:
            True when a slot is held (``disconnect`` it), False when there is no cap.

        Raises:
            RefusedError: ``too_many_requests`` — the key has ``max_connections`` open.
        """
        if identity is None or identity.tier.max_connections is None:
            return False
        assert self.connections is not None, "Admission.start first"
        held = await self.connections.acquire(identity.key_id, connection_id, identity.tier.max_connections)
        self._held_connections.add((identity.key_id, connection_id))
        return held

    async def disconnect(self, identity: Identity | None, connection_id: str) -> None:
        if identity is None or (identity.key_id, connection_id) not in self._held_connections:
            return
        self._held_connections.discard((identity.key_id, connection_id))
        assert self.connections is not None, "Admission.start first"
        await self.connections.release(identity.key_id, connection_id)

    # -- revocation ---------------------------------------------------------------------
    def watch(self, identity: Identity | None, on_revoked: OnRevoked) -> int | None:
        """Call ``on_revoked`` once if the key is revoked (or deleted) while this
        connection or stream is open. Returns a handle for ``unwatch``."""
        if identity is None:
            return None
        handle = next(self._handles)
        self._watched.setdefault(identity.key_id, {})[handle] = on_revoked
        return handle

    def unwatch(self, identity: Identity | None, handle: int | None) -> None:
        if identity is None or handle is None:
            return
        watchers = self._watched.get(identity.key_id)
        if watchers is not None:
            watchers.pop(handle, None)
            if not watchers:
                del self._watched[identity.key_id]

    async def _watch(self) -> None:
        """Every key cache period: look up each key with something open here (one read per
        key, through the cache) and end what a revoked key holds; refresh this process's
        connection slots."""
        period = max(0.5, min(self.settings.key_cache_s, CONNECTION_SLOT_TTL_S / 3))
        refresh_every = CONNECTION_SLOT_TTL_S / 3
        loop = asyncio.get_running_loop()
        next_refresh = loop.time() + refresh_every
        assert self.store is not None and self.connections is not None, "Admission.start first"
        while True:
            await aio.sleep_unless_cancelled(period)
            try:
                for key_id in list(self._watched):
                    record = await self.store.lookup(key_id)
                    if record is not None and not record.revoked:
                        continue
                    watchers = self._watched.pop(key_id, {})
                    log.info("API key revoked; ending what it holds here", key_id=key_id, open=len(watchers))
                    for on_revoked in watchers.values():
                        try:
                            await on_revoked()
                        except Exception:
                            log.exception("revocation handler failed", key_id=key_id)
                if loop.time() >= next_refresh:
                    next_refresh = loop.time() + refresh_every
                    await self.connections.touch_many(sorted(self._held_connections))
            except StreamfleetError as exc:  # Redis away: try again next period
                log.debug("key watch skipped a round", error=str(exc))
            except Exception:
                log.exception("key watch round failed")


def revoked_error() -> AuthError:
    return AuthError(REVOKED_KEY_MESSAGE)
