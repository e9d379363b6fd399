"""API keys: issue, list, revoke and verify them, storing only a hash of each key.

A key reads ``sf-<key_id>-<secret>``: ``key_id`` is 12 hex characters and names the
record, ``secret`` is 32 URL-safe characters from :mod:`secrets`. Redis keeps one hash
``{prefix}:keys`` (field ``key_id``, value a JSON record)::

    {"key_id": "3f9a0c1d2e4b", "name": "alice", "tier": "paid",
     "hash": "<sha256 hex of the whole key>", "created_at": "2024-05-01T12:00:00Z",
     "revoked": false}

so neither Redis nor its backups can give a usable key away. Verification looks the
record up by ``key_id`` and compares SHA-256 digests with :func:`hmac.compare_digest`.

Each gateway caches records for ``key_cache_s`` seconds (also "no such key" answers, so
a flood of made-up keys does not reach Redis): a revocation, or a key added after a
failed attempt with its id, takes effect on every gateway within that time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import redis.asyncio as aioredis

from streamfleet.shared.errors import AuthError, ErrorCode, UnavailableError
from streamfleet.shared.keys import Keys
from streamfleet.shared.logging import get_logger
from streamfleet.shared.redis import BROKER_ERRORS
from streamfleet.shared.schema import KeyRecord
from streamfleet.shared.tiers import DEFAULT_TIERS, Tier

__all__ = [
    "Identity",
    "KeyStore",
    "extract_key",
    "parse_key",
    "hash_key",
    "MISSING_KEY_MESSAGE",
    "INVALID_KEY_MESSAGE",
]

log = get_logger("gateway.auth")

MISSING_KEY_MESSAGE = "missing API key: send Authorization: Bearer <key>"
INVALID_KEY_MESSAGE = "invalid API key"
REVOKED_KEY_MESSAGE = "API key has been revoked"

_KEY_RE = re.compile(r"sf-([0-9a-f]{12})-([A-Za-z0-9_-]{32})")
_MAX_NAME = 64
#: compared against when a key id is unknown, so both paths do the same work
_DUMMY_DIGEST = hashlib.sha256(b"streamfleet-no-such-key").hexdigest()


@dataclass(frozen=True, slots=True)
class Identity:
    """Who sent a request: the verified key and its tier."""

    key_id: str
    name: str
    tier: Tier


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_key(presented: str) -> tuple[str, str] | None:
    """``(key_id, secret)`` of a well-formed key, else ``None``."""
    m = _KEY_RE.fullmatch(presented)
    return (m.group(1), m.group(2)) if m else None


def extract_key(authorization_header: str | None, query_api_key: str | None = None) -> str | None:
    """The API key a request presents: ``Authorization: Bearer <key>`` (scheme in any
    case), else the ``?api_key=`` query parameter (browsers cannot set headers on a
    WebSocket); ``None`` when neither carries one."""
    if authorization_header:
        scheme, _, token = authorization_header.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    if query_api_key and query_api_key.strip():
        return query_api_key.strip()
    return None


class KeyStore:
    """API keys in Redis, with a small per-process cache for :meth:`verify`.

    Args:
        redis: an asyncio client (``shared.redis.connect``).
        keys: the key builder of this fleet's prefix.
        tiers: the tier table (``shared.tiers.parse_tiers``); default ``DEFAULT_TIERS``.
        cache_ttl_s: seconds a record (or its absence) is cached; 0 = no cache.
        max_cache_entries: cache bound; the oldest entries go first.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        tiers: Mapping[str, Tier] | None = None,
        cache_ttl_s: float = 5.0,
        max_cache_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.tiers: Mapping[str, Tier] = dict(tiers) if tiers is not None else dict(DEFAULT_TIERS)
        self.cache_ttl_s = cache_ttl_s
        self.max_cache_entries = max_cache_entries
        self._clock = clock
        self._cache: OrderedDict[str, tuple[float, KeyRecord | None]] = OrderedDict()

    # -- administration (the `streamfleet keys` command) ----------------------------
    async def add(self, name: str, tier: str) -> tuple[str, KeyRecord]:
        """Create a key. Returns ``(plaintext_key, record)``; the plaintext is not kept
        anywhere, so it must be handed to its owner now.

        Raises:
            ValueError: unknown tier, a bad name, or an active key already has the name.
        """
        name = name.strip()
        if not name or len(name) > _MAX_NAME or not name.isprintable():
            raise ValueError(f"key name must be 1-{_MAX_NAME} printable characters")
        if tier not in self.tiers:
            raise ValueError(f"unknown tier {tier!r}; known: {', '.join(self.tiers)}")
        if any(r.name == name and not r.revoked for r in await self.list()):
            raise ValueError(f"an active key named {name!r} exists; revoke it first or pick another name")
        created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        while True:
            key_id = secrets.token_hex(6)
            plaintext = f"sf-{key_id}-{secrets.token_urlsafe(24)}"  # 24 bytes -> 32 characters
            record = KeyRecord(key_id=key_id, name=name, tier=tier, hash=hash_key(plaintext), created_at=created)
            if await self.redis.hsetnx(self.keys.api_keys, key_id, record.encode()):
                break  # a key_id collision (1 in 2**48) just draws again
        self._cache.pop(key_id, None)
        return plaintext, record

    async def list(self) -> list[KeyRecord]:
        """Every key, revoked ones included, oldest first. Show ``record.public()``."""
        raw = await self.redis.hgetall(self.keys.api_keys)
        records = []
        for key_id, blob in raw.items():
            try:
                records.append(KeyRecord.decode(blob))
            except ValueError:
                log.warning("unreadable API key record", key_id=_text(key_id))
        return sorted(records, key=lambda r: (r.created_at, r.key_id))

    async def revoke(self, key_id_or_name: str) -> bool:
        """Revoke the key with this id, else the active key with this name.

        Returns:
            True when a key was revoked now; False when none matched or it already was.

        Raises:
            ValueError: the name matches several active keys (revoke them by id).
        """
        target = key_id_or_name.strip()
        record = await self._fetch(target) if re.fullmatch(r"[0-9a-f]{12}", target) else None
        if record is None:
            named = [r for r in await self.list() if r.name == target and not r.revoked]
            if len(named) > 1:
                raise ValueError(f"{len(named)} active keys are named {target!r}: "
                                 f"revoke by key id ({', '.join(r.key_id for r in named)})")
            record = named[0] if named else None
        if record is None or record.revoked:
            return False
        revoked = KeyRecord(**{**asdict(record), "revoked": True})
        await self.redis.hset(self.keys.api_keys, record.key_id, revoked.encode())
        self._cache.pop(record.key_id, None)
        return True

    # -- the request path --------------------------------------------------------------
    async def verify(self, presented: str | None) -> Identity:
        """The identity behind a presented key.

        Raises:
            AuthError: 401 ``unauthorized`` when the key is missing, malformed, unknown,
                wrong or revoked; 403 ``forbidden`` when its tier is not configured.
            UnavailableError: Redis cannot be reached (503 ``broker_unavailable``).
        """
        if not presented:
            raise AuthError(MISSING_KEY_MESSAGE)
        parsed = parse_key(presented)
        if parsed is None:
            raise AuthError(INVALID_KEY_MESSAGE)
        key_id, _ = parsed
        record = await self._lookup(key_id)
        digest = hash_key(presented)
        # constant-time comparison, also against a dummy when the id is unknown
        if not hmac.compare_digest(digest, record.hash if record is not None else _DUMMY_DIGEST) or record is None:
            raise AuthError(INVALID_KEY_MESSAGE)
        if record.revoked:
            raise AuthError(REVOKED_KEY_MESSAGE)
        tier = self.tiers.get(record.tier)
        if tier is None:
            log.warning("API key has an unconfigured tier", key_id=key_id, tier=record.tier)
            raise AuthError(f"API key's tier {record.tier!r} is not configured on this gateway",
                            code=ErrorCode.forbidden)
        return Identity(key_id=record.key_id, name=record.name, tier=tier)

    async def lookup(self, key_id: str) -> KeyRecord | None:
        """A key's record through the cache (None: no such key); for watching keys that
        are in use. Raises ``UnavailableError`` when Redis cannot be reached."""
        return await self._lookup(key_id)

    async def _lookup(self, key_id: str) -> KeyRecord | None:
        now = self._clock()
        hit = self._cache.get(key_id)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            record = await self._fetch(key_id)
        except BROKER_ERRORS as exc:
            raise UnavailableError(f"cannot check the API key: Redis unavailable ({exc})") from exc
        if self.cache_ttl_s > 0:
            self._cache[key_id] = (now + self.cache_ttl_s, record)
            self._cache.move_to_end(key_id)
            while len(self._cache) > self.max_cache_entries:
                self._cache.popitem(last=False)
        return record

    async def _fetch(self, key_id: str) -> KeyRecord | None:
        blob = await self.redis.hget(self.keys.api_keys, key_id)
        if blob is None:
            return None
        try:
            return KeyRecord.decode(blob)
        except ValueError:
            log.warning("unreadable API key record", key_id=key_id)
            return None


def _text(v: bytes | str) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else v
