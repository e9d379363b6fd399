"""TokenBucket arithmetic (the Lua script's twin) and the tier table."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from streamfleet.gateway.admission.ratelimit import TokenBucket
from streamfleet.shared.errors import FatalError
from streamfleet.shared.tiers import DEFAULT_TIERS, Tier, parse_tiers
from streamfleet.shared.tokenbucket import EXPIRE_MARGIN_MS

S = 1_000_000  # µs per second


# -- TokenBucket -----------------------------------------------------------------------
def test_new_bucket_allows_exactly_burst_back_to_back():
    b = TokenBucket(rate_per_s=10 / 60, burst=5)
    decisions = [b.take(0) for _ in range(7)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False] * 2
    assert [d.tokens_left for d in decisions[:5]] == [4, 3, 2, 1, 0]
    assert all(d.retry_after_ms == 0 for d in decisions[:5])


def test_refused_take_says_when_one_token_is_back():
    b = TokenBucket(rate_per_s=10 / 60, burst=5)  # one token per 6 s
    for _ in range(5):
        b.take(0)
    d = b.take(0)
    assert not d.allowed and d.retry_after_ms == 6000
    d = b.take(2 * S)  # 2 s later: a third of a token
    assert not d.allowed and d.retry_after_ms == 4000
    assert d.tokens_left == pytest.approx(1 / 3)
    assert b.take(6 * S).allowed  # exactly on time
    assert not b.take(6 * S).allowed


def test_refill_is_continuous_and_capped_at_burst():
    b = TokenBucket(rate_per_s=10, burst=3)  # 600 rpm
    for _ in range(3):
        assert b.take(0).allowed
    assert b.take(S // 10).allowed  # one token after 100 ms
    assert not b.take(S // 10).allowed
    d = b.take(3600 * S)  # an hour idle refills to burst, not beyond
    assert d.allowed and d.tokens_left == pytest.approx(2)
    assert sum(b.take(3600 * S).allowed for _ in range(5)) == 2


def test_retry_after_is_exact_then_allowed():
    b = TokenBucket(rate_per_s=10, burst=1)
    assert b.take(0).allowed
    d = b.take(0)
    assert d.retry_after_ms == 100
    assert not b.take(99_000).allowed
    assert b.take(100_000).allowed


def test_clock_going_back_refills_nothing():
    b = TokenBucket(rate_per_s=1, burst=2)
    b.take(10 * S)
    b.take(10 * S)
    d = b.take(5 * S)
    assert not d.allowed and d.retry_after_ms == 1000
    # the stored time moved back with it: refill counts from there, never twice
    assert b.take(6 * S).allowed
    assert not b.take(6 * S).allowed


def test_cost_above_one_and_ttl_is_time_to_full():
    b = TokenBucket(rate_per_s=2, burst=10)
    d = b.take(0, cost=4)
    assert d.allowed and d.tokens_left == 6
    assert d.ttl_ms == 2000 + EXPIRE_MARGIN_MS  # 4 tokens at 2/s
    d = b.take(0, cost=7)
    assert not d.allowed and d.retry_after_ms == 500
    full = TokenBucket(rate_per_s=2, burst=10)
    assert full.take(0, cost=0).ttl_ms == EXPIRE_MARGIN_MS


def test_invalid_bucket_parameters():
    with pytest.raises(ValueError):
        TokenBucket(0, 5)
    with pytest.raises(ValueError):
        TokenBucket(1, 0)


@settings(max_examples=300, deadline=None)
@given(
    rpm=st.floats(min_value=0.5, max_value=10_000),
    burst=st.integers(min_value=1, max_value=50),
    gaps=st.lists(st.integers(min_value=0, max_value=5 * S), min_size=1, max_size=80),
)
def test_admitted_never_exceeds_burst_plus_refill(rpm, burst, gaps):
    b = TokenBucket(rpm / 60, burst)
    now = admitted = 0
    for gap in gaps:
        now += gap
        d = b.take(now)
        admitted += d.allowed
        assert 0 <= d.tokens_left <= burst
        if not d.allowed:
            # the promised wait is enough, and not more than one ms too long
            probe = TokenBucket(b.rate_per_s, burst, b.tokens, b.ts_us)
            assert probe.take(now + d.retry_after_ms * 1000).allowed
            if d.retry_after_ms > 1:
                probe = TokenBucket(b.rate_per_s, burst, b.tokens, b.ts_us)
                assert not probe.take(now + (d.retry_after_ms - 1) * 1000 - 1).allowed
    assert admitted <= burst + math.floor(now / S * rpm / 60 + 1e-9)


# -- tiers -----------------------------------------------------------------------------
def test_default_tiers():
    t = parse_tiers("")
    assert t == DEFAULT_TIERS
    free, paid, internal = t["free"], t["paid"], t["internal"]
    assert (free.requests_per_minute, free.burst, free.max_streams, free.max_lane) == (10, 5, 2, "normal")
    assert (paid.requests_per_minute, paid.burst, paid.max_streams, paid.max_lane) == (100, 20, 16, "high")
    assert internal.unlimited and internal.rate_per_s is None and internal.max_streams is None
    assert free.rate_per_s == pytest.approx(10 / 60)
    assert parse_tiers(None) == DEFAULT_TIERS


def test_allows_lane():
    free, paid = DEFAULT_TIERS["free"], DEFAULT_TIERS["paid"]
    assert free.allows_lane("normal") and not free.allows_lane("high")
    assert paid.allows_lane("normal") and paid.allows_lane("high")
    assert not paid.allows_lane("urgent")


def test_overrides_merge_into_defaults_and_add_tiers():
    t = parse_tiers('{"free": {"requests_per_minute": 20}, '
                    '"gold": {"requests_per_minute": 600, "burst": 50, "max_streams": 64, "max_lane": "high"},'
                    '"ops": {"requests_per_minute": null}}')
    assert t["free"] == Tier("free", 20, 5, 2, "normal", max_connections=8, max_tokens=1024, max_timeout_s=120.0,
                             tokens_per_minute=20_000)
    assert t["paid"] == DEFAULT_TIERS["paid"]
    assert t["gold"] == Tier("gold", 600, 50, 64, "high")
    assert t["ops"].unlimited and t["ops"].max_streams is None and t["ops"].max_lane == "normal"
    assert parse_tiers({"paid": {"max_streams": None}})["paid"].max_streams is None
    ceil = parse_tiers({"paid": {"max_tokens": 100, "max_timeout_s": 5, "max_connections": None}})["paid"]
    assert (ceil.max_tokens, ceil.max_timeout_s, ceil.max_connections) == (100, 5, None)


@pytest.mark.parametrize("spec, fragment", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"free": 5}', "must be an object"),
    ('{"free": {"rpm": 5}}', "unknown field(s) rpm"),
    ('{"free": {"requests_per_minute": 0}}', "requests_per_minute must be"),
    ('{"free": {"requests_per_minute": "fast"}}', "requests_per_minute must be"),
    ('{"free": {"burst": 0}}', "burst must be"),
    ('{"free": {"burst": 2.5}}', "burst must be"),
    ('{"free": {"max_streams": 0}}', "max_streams must be"),
    ('{"free": {"max_lane": "urgent"}}', "max_lane must be one of high, normal"),
    ('{"free": {"max_connections": 0}}', "max_connections must be"),
    ('{"free": {"max_tokens": 1.5}}', "max_tokens must be"),
    ('{"free": {"max_timeout_s": -1}}', "max_timeout_s must be"),
    ('{"free": {"max_timeout_s": true}}', "max_timeout_s must be"),
    ('{"gold": {"burst": 5}}', "must give requests_per_minute"),
    ('{"gold": {"requests_per_minute": 60}}', "burst must be"),
    ('{"gold": {"name": "silver", "requests_per_minute": null}}', "different 'name'"),
])
def test_bad_tier_config_is_fatal_with_a_reason(spec, fragment):
    with pytest.raises(FatalError) as info:
        parse_tiers(spec)
    assert fragment in info.value.message


def test_tiers_setting_reads_env(monkeypatch):
    from streamfleet.shared.settings import CommonSettings, GatewaySettings

    monkeypatch.setenv("SF_TIERS", '{"free": {"burst": 7}}')
    monkeypatch.setenv("SF_AUTH_ENABLED", "true")
    assert parse_tiers(CommonSettings().tiers)["free"].burst == 7
    g = GatewaySettings()
    assert g.auth_enabled is True and g.key_cache_s == 5.0
    monkeypatch.delenv("SF_AUTH_ENABLED")
    assert GatewaySettings().auth_enabled is False


# -- tokens served: forced takes and debt ---------------------------------------------
def test_a_forced_take_goes_into_debt_and_the_refill_pays_it_back_first():
    b = TokenBucket(rate_per_s=100, burst=1000)  # 6,000 tokens a minute
    assert b.take(0, 600).allowed  # a prompt of 600: 400 left
    d = b.take(0, 900, force=True)  # then it generated 900: 500 in debt
    assert d.allowed and d.tokens_left == -500 and d.retry_after_ms == 0
    assert d.ttl_ms == 15_000 + EXPIRE_MARGIN_MS  # 1,500 tokens short of full, at 100 a second
    refused = b.take(1_000_000, 0)  # 1 s later: still 400 in debt; nothing passes
    assert not refused.allowed and refused.retry_after_ms == 4_000
    assert b.take(5_000_000, 0).allowed  # paid back: a new request may start
    assert not b.take(5_000_000, 1).allowed


def test_a_forced_take_never_fills_past_the_burst_and_a_negative_one_gives_back():
    b = TokenBucket(rate_per_s=1, burst=10)
    assert b.take(0, 8).tokens_left == 2
    assert b.take(0, -5, force=True).tokens_left == 7  # a refund
    assert b.take(0, -50, force=True).tokens_left == 10


def test_the_token_limit_of_a_tier():
    tier = Tier("t", 60, 5, None, tokens_per_minute=6000)
    assert tier.token_rate_per_s == 100 and tier.token_capacity == 6000
    assert Tier("t", 60, 5, None, tokens_per_minute=600, token_burst=50).token_capacity == 50
    assert Tier("t", 60, 5, None).token_rate_per_s is None
    assert DEFAULT_TIERS["free"].tokens_per_minute == 20_000 and DEFAULT_TIERS["internal"].tokens_per_minute is None
    for bad in ({"tokens_per_minute": 0}, {"tokens_per_minute": "1k"}, {"token_burst": 0}, {"token_burst": 1.5}):
        with pytest.raises(FatalError, match="tiers: tier free: token"):
            parse_tiers({"free": bad})
