"""API-key tiers as data: what each tier may do (docs/admission.md, "Tiers"; the
defaults and every field: docs/configuration.md, "Tiers").

A tier names a token-bucket rate (requests per minute, refilled continuously, and a
burst capacity), another of tokens served (tokens per minute), a cap on concurrent
streams and one on open WebSockets (both counted across every gateway), ceilings on
``max_tokens`` and the queue ``timeout`` a request may ask for, the highest priority lane
it may use, a cap on the speech decoder slots its utterances may hold at once
(docs/voice.md, "Fair slots"), and its weight in the fair share inside a lane.

The defaults below can be changed, and tiers added, with a JSON object (setting
``tiers``, env ``SF_TIERS``)::

    SF_TIERS='{"free": {"requests_per_minute": 20}, "gold": {"requests_per_minute": 600,
               "burst": 50, "max_streams": 64, "max_lane": "high"}}'

Fields given for a known tier replace that field of the default; a new tier must name
``requests_per_minute`` (``null`` = unlimited) and, when it is rate limited, ``burst``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from streamfleet.shared.errors import FatalError
from streamfleet.shared.keys import LANES

__all__ = ["Tier", "DEFAULT_TIERS", "parse_tiers", "STREAM_SLOT_TTL_S", "CONNECTION_SLOT_TTL_S",
           "AUDIO_TOKENS_PER_S"]

#: what a second of speech costs in tokens, in the token rate limit and the fair share
#: (OpenAI's Realtime API counts audio input as one token per 100 ms)
AUDIO_TOKENS_PER_S = 10.0

#: a stream slot lapses this long after it was taken or last refreshed (workers refresh
#: the slots of the requests they run), so slots of a fleet that lost track of them return
STREAM_SLOT_TTL_S = 600.0
#: a WebSocket's connection slot lapses this long after its gateway last refreshed it (a
#: third of it), so a gateway that died does not hold its keys' connections for long
CONNECTION_SLOT_TTL_S = 60.0


@dataclass(frozen=True, slots=True)
class Tier:
    """Limits of one tier.

    Args:
        name: the tier's name, as stored with each API key.
        requests_per_minute: token-bucket refill rate; ``None`` = unlimited (no bucket).
        burst: bucket capacity: requests allowed back to back after an idle spell.
        max_streams: concurrent streams per key; ``None`` = no cap.
        max_lane: the highest lane the tier may ask for (``"high"`` or ``"normal"``).
        max_connections: open WebSockets per key, all gateways together; ``None`` = no cap.
        max_tokens: the largest ``max_tokens`` a request may ask for (a request that names
            none gets the gateway's default, lowered to this); ``None`` = the gateway's limit.
        max_timeout_s: the same for the queue ``timeout``, in seconds.
        max_utterances: speech decoder slots the key's utterances may hold at once, all
            gateways together (a further cap, besides the fair share every key gets);
            ``None`` = the fair share alone.
        share: the key's weight in the fair share inside a lane (shared/fairshare.py): a
            key of share 2 is served twice the weighted tokens of a key of share 1 when
            both wait. A number > 0; default 1.
        max_queued_tokens: the most prompt tokens the key's requests may have waiting for
            their turn in one lane of a model (fair share); past it a request is refused
            with 429 ``too_many_requests`` before anything is queued (one request is taken
            whatever its size while none of the key's wait). ``None`` = no cap.
        tokens_per_minute: a second token bucket, of tokens served: a text request's
            prompt tokens (taken before it is queued) and generated tokens (charged when
            it ends, the bucket going into debt if need be), an embeddings request's
            input tokens, ``AUDIO_TOKENS_PER_S`` a second of speech transcribed. A
            request is refused with 429 ``rate_limited`` while the bucket is empty or
            holds fewer tokens than its prompt. ``None`` = no token limit.
        token_burst: that bucket's capacity; ``None`` = a minute's worth
            (``tokens_per_minute``). The largest prompt the key may send at once.

    Raises:
        ValueError: a field is out of range.
    """

    name: str
    requests_per_minute: float | None
    burst: int
    max_streams: int | None
    max_lane: str = "normal"
    max_connections: int | None = None
    max_tokens: int | None = None
    max_timeout_s: float | None = None
    max_utterances: int | None = None
    share: float = 1.0
    max_queued_tokens: int | None = None
    tokens_per_minute: float | None = None
    token_burst: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("tier name must be a non-empty string")
        rpm = self.requests_per_minute
        if rpm is not None:
            if isinstance(rpm, bool) or not isinstance(rpm, (int, float)) or not math.isfinite(rpm) or rpm <= 0:
                raise ValueError(f"tier {self.name}: requests_per_minute must be a number > 0 or null, got {rpm!r}")
            if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
                raise ValueError(f"tier {self.name}: burst must be an integer >= 1, got {self.burst!r}")
        tpm = self.tokens_per_minute
        if tpm is not None and (isinstance(tpm, bool) or not isinstance(tpm, (int, float)) or not math.isfinite(tpm)
                                or tpm <= 0):
            raise ValueError(f"tier {self.name}: tokens_per_minute must be a number > 0 or null, got {tpm!r}")
        for fname in ("max_streams", "max_connections", "max_tokens", "max_utterances", "max_queued_tokens",
                      "token_burst"):
            v = getattr(self, fname)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"tier {self.name}: {fname} must be an integer >= 1 or null, got {v!r}")
        mt = self.max_timeout_s
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, (int, float)) or not math.isfinite(mt)
                               or mt <= 0):
            raise ValueError(f"tier {self.name}: max_timeout_s must be a number > 0 or null, got {mt!r}")
        sh = self.share
        if isinstance(sh, bool) or not isinstance(sh, (int, float)) or not math.isfinite(sh) or sh <= 0:
            raise ValueError(f"tier {self.name}: share must be a number > 0, got {sh!r}")
        if self.max_lane not in LANES:
            raise ValueError(f"tier {self.name}: max_lane must be one of {', '.join(LANES)}, got {self.max_lane!r}")

    @property
    def unlimited(self) -> bool:
        """No rate limit: the limiter does not touch Redis for this tier."""
        return self.requests_per_minute is None

    @property
    def rate_per_s(self) -> float | None:
        return None if self.requests_per_minute is None else self.requests_per_minute / 60.0

    @property
    def token_rate_per_s(self) -> float | None:
        """The token bucket's refill, tokens a second; None: no token limit."""
        return None if self.tokens_per_minute is None else self.tokens_per_minute / 60.0

    @property
    def token_capacity(self) -> int:
        """The token bucket's capacity (``token_burst``, else a minute's worth)."""
        if self.token_burst is not None:
            return self.token_burst
        return max(1, math.ceil(self.tokens_per_minute or 0))

    def allows_lane(self, lane: str) -> bool:
        """Whether a request of this tier may use ``lane`` (lanes rank as in ``LANES``)."""
        if lane not in LANES:
            return False
        return LANES.index(lane) >= LANES.index(self.max_lane)


#: the tiers every gateway knows unless ``tiers`` overrides them
DEFAULT_TIERS: dict[str, Tier] = {
    "free": Tier("free", requests_per_minute=10, burst=5, max_streams=2, max_lane="normal",
                 max_connections=8, max_tokens=1024, max_timeout_s=120.0, tokens_per_minute=20_000),
    "paid": Tier("paid", requests_per_minute=100, burst=20, max_streams=16, max_lane="high",
                 max_connections=256, max_tokens=4096, max_timeout_s=600.0, tokens_per_minute=400_000),
    "internal": Tier("internal", requests_per_minute=None, burst=0, max_streams=None, max_lane="high"),
}

_FIELDS = tuple(f.name for f in fields(Tier) if f.name != "name")


def parse_tiers(spec: str | Mapping[str, Any] | None) -> dict[str, Tier]:
    """The tier table: ``DEFAULT_TIERS`` with the operator's overrides applied.

    Args:
        spec: a JSON object (text) or a mapping ``{tier_name: {field: value}}``; empty
            or ``None`` gives the defaults.

    Raises:
        FatalError: the text is not JSON, not an object, names an unknown field, or a
            value is out of range (the message says which).
    """
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return dict(DEFAULT_TIERS)
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise FatalError(f"tiers: not valid JSON ({exc})") from None
    if not isinstance(spec, Mapping):
        raise FatalError('tiers: expected a JSON object like {"free": {"requests_per_minute": 20}}')
    tiers = dict(DEFAULT_TIERS)
    for name, body in spec.items():
        if not isinstance(name, str) or not name:
            raise FatalError(f"tiers: tier names must be non-empty strings, got {name!r}")
        if not isinstance(body, Mapping):
            raise FatalError(f"tiers: {name} must be an object of fields ({', '.join(_FIELDS)})")
        body = dict(body)
        if body.pop("name", name) != name:
            raise FatalError(f"tiers: {name} has a different 'name' inside")
        unknown = sorted(set(body) - set(_FIELDS))
        if unknown:
            raise FatalError(f"tiers: {name}: unknown field(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
        try:
            if name in tiers:
                tiers[name] = replace(tiers[name], **body)
            else:
                if "requests_per_minute" not in body:
                    raise ValueError(f"tier {name}: a new tier must give requests_per_minute (null = unlimited)")
                body.setdefault("burst", 0)
                body.setdefault("max_streams", None)
                tiers[name] = Tier(name=name, **body)
        except (TypeError, ValueError) as exc:
            raise FatalError(f"tiers: {exc}") from None
    return tiers
