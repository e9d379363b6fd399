"""API keys, the shared token bucket and stream slots against a real redis-server,
including two OS processes drawing on one bucket and the `streamfleet keys` CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest

from streamfleet.gateway.admission import auth as auth_module
from streamfleet.gateway.admission.auth import INVALID_KEY_MESSAGE, MISSING_KEY_MESSAGE, KeyStore, parse_key
from streamfleet.gateway.admission.ratelimit import RateLimiter, StreamSlots, TokenBucket
from streamfleet.shared.errors import AuthError, ErrorCode, RefusedError
from streamfleet.shared.keys import Keys
from streamfleet.shared.redis import connect
from streamfleet.shared.tiers import DEFAULT_TIERS, Tier
from tests.support.wait import until_async

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
async def ards(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
def keys(key_prefix) -> Keys:
    return Keys(key_prefix)


# -- API keys ------------------------------------------------------------------------
async def test_add_verify_list_revoke(ards, keys, rds):
    store = KeyStore(ards, keys, cache_ttl_s=0)
    plaintext, record = await store.add("alice", "paid")
    key_id, secret = parse_key(plaintext)
    assert record.key_id == key_id and record.tier == "paid" and not record.revoked
    assert len(secret) == 32

    who = await store.verify(plaintext)
    assert (who.key_id, who.name, who.tier) == (key_id, "alice", DEFAULT_TIERS["paid"])

    # Redis holds the record with a hash, never the key or its secret
    raw = rds.hget(f"{keys.prefix}:keys", key_id)
    stored = json.loads(raw)
    assert set(stored) == {"key_id", "name", "tier", "hash", "created_at", "revoked"}
    assert secret.encode() not in raw and plaintext.encode() not in raw
    assert len(stored["hash"]) == 64

    listed = await store.list()
    assert [r.public() for r in listed] == [record.public()]

    with pytest.raises(ValueError, match="active key named 'alice'"):
        await store.add("alice", "free")
    with pytest.raises(ValueError, match="unknown tier"):
        await store.add("bob", "platinum")

    assert await store.revoke("alice") is True
    assert await store.revoke("alice") is False  # no active key by that name now
    assert await store.revoke(key_id) is False  # already revoked
    with pytest.raises(AuthError) as info:
        await store.verify(plaintext)
    assert info.value.status == 401 and info.value.code == ErrorCode.unauthorized
    assert "revoked" in info.value.message
    assert json.loads(rds.hget(f"{keys.prefix}:keys", key_id))["revoked"] is True

    # the name is free again; a new key, a new id
    plaintext2, record2 = await store.add("alice", "free")
    assert record2.key_id != key_id
    assert (await store.verify(plaintext2)).tier.name == "free"
    assert await store.revoke(record2.key_id) is True
    assert await store.revoke("nobody") is False


@pytest.mark.parametrize("presented, message", [
    (None, MISSING_KEY_MESSAGE),
    ("", MISSING_KEY_MESSAGE),
    ("not-a-key", INVALID_KEY_MESSAGE),
    ("sf-0123456789ab-" + "x" * 32, INVALID_KEY_MESSAGE),  # well formed, unknown id
])
async def test_missing_malformed_and_unknown_keys_are_401(ards, keys, presented, message):
    store = KeyStore(ards, keys, cache_ttl_s=0)
    with pytest.raises(AuthError) as info:
        await store.verify(presented)
    err = info.value
    assert (err.status, err.code, err.message) == (401, ErrorCode.unauthorized, message)
    assert err.to_openai()["error"]["type"] == "authentication_error"


async def test_wrong_secret_and_unknown_id_both_take_the_constant_time_path(ards, keys, monkeypatch):
    store = KeyStore(ards, keys, cache_ttl_s=0)
    plaintext, record = await store.add("carol", "free")
    calls = []
    real = auth_module.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", spy)
    forged = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")
    with pytest.raises(AuthError, match="invalid API key"):
        await store.verify(forged)
    unknown = "sf-ffffffffffff-" + plaintext[-32:]
    with pytest.raises(AuthError, match="invalid API key"):
        await store.verify(unknown)
    await store.verify(plaintext)
    assert len(calls) == 3
    assert calls[0][1] == record.hash and calls[2][1] == record.hash
    assert all(len(a) == len(b) == 64 for a, b in calls)


async def test_key_of_unconfigured_tier_is_forbidden(ards, keys):
    gold = Tier("gold", 600, 10, 4, "high")
    plaintext, _ = await KeyStore(ards, keys, tiers={**DEFAULT_TIERS, "gold": gold}).add("dave", "gold")
    assert (await KeyStore(ards, keys, tiers={**DEFAULT_TIERS, "gold": gold}).verify(plaintext)).tier == gold
    with pytest.raises(AuthError) as info:
        await KeyStore(ards, keys).verify(plaintext)
    assert (info.value.status, info.value.code) == (403, ErrorCode.forbidden)


async def test_cache_spares_redis_and_revocation_lands_within_the_ttl(ards, keys):
    now = [100.0]
    gateway_store = KeyStore(ards, keys, cache_ttl_s=5.0, clock=lambda: now[0])
    admin = KeyStore(ards, keys, cache_ttl_s=0)
    plaintext, record = await admin.add("erin", "free")
    await gateway_store.verify(plaintext)

    assert await admin.revoke(record.key_id)  # another process revokes
    now[0] += 4.9
    assert (await gateway_store.verify(plaintext)).key_id == record.key_id  # still cached
    now[0] += 0.2
    with pytest.raises(AuthError, match="revoked"):
        await gateway_store.verify(plaintext)

    # unknown ids are cached too, so a flood of made-up keys does not reach Redis
    unknown = "sf-eeeeeeeeeeee-" + "y" * 32
    with pytest.raises(AuthError):
        await gateway_store.verify(unknown)
    await ards.hset(keys.api_keys, "eeeeeeeeeeee", b"{}")  # would be read if looked up
    with pytest.raises(AuthError, match="invalid API key"):
        await gateway_store.verify(unknown)


# -- token bucket ----------------------------------------------------------------------
TEN_PER_S = Tier("t", requests_per_minute=600, burst=3, max_streams=None)


async def test_bucket_burst_then_refusal_then_refill(ards, keys, rds):
    limiter = RateLimiter(ards, keys)
    for _ in range(3):
        await limiter.check("k1", TEN_PER_S)
    with pytest.raises(RefusedError) as info:
        await limiter.check("k1", TEN_PER_S)
    err = info.value
    assert (err.status, err.code) == (429, ErrorCode.rate_limited)
    assert 0 < err.retry_after_ms <= 100
    assert err.message.startswith("rate limit of 600 requests/min for tier t exceeded; retry in ")
    assert err.message.endswith((f"{err.retry_after_ms} ms", "0.1 s"))
    assert err.to_frame("r1")["retry_after_ms"] == err.retry_after_ms

    # Redis shows the bucket and expires it once it would be full again
    state = rds.hgetall(keys.ratelimit("k1"))
    assert set(state) == {b"tokens", b"ts"} and float(state[b"tokens"]) < 1
    assert 0 < rds.pttl(keys.ratelimit("k1")) <= 300 + 1000

    await asyncio.sleep(err.retry_after_ms / 1000 + 0.01)
    await limiter.check("k1", TEN_PER_S)
    with pytest.raises(RefusedError):
        await limiter.check("k1", TEN_PER_S)
    await limiter.check("k2", TEN_PER_S)  # another key, another bucket

    await asyncio.sleep(0.35)  # a real clock window: longer than a refill to burst, which it does not pass
    decisions = [await limiter.take("k1", TEN_PER_S) for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]


async def test_unlimited_tier_never_touches_redis(ards, keys, rds):
    limiter = RateLimiter(ards, keys)
    internal = DEFAULT_TIERS["internal"]
    for _ in range(100):
        await limiter.check("vip", internal)
    assert await limiter.take("vip", internal) is None
    assert not rds.exists(keys.ratelimit("vip"))


async def test_check_accepts_an_identity(ards, keys):
    store = KeyStore(ards, keys, cache_ttl_s=0)
    plaintext, _ = await store.add("frank", "free")
    who = await store.verify(plaintext)
    limiter = RateLimiter(ards, keys)
    for _ in range(5):
        await limiter.check(who)
    with pytest.raises(RefusedError) as info:
        await limiter.check(who)
    assert "rate limit of 10 requests/min for tier free exceeded; retry in 6.0 s" in info.value.message
    assert 5900 <= info.value.retry_after_ms <= 6000


async def test_lua_script_and_token_bucket_agree(ards, keys):
    """Same times in, same answers out: the script is TokenBucket's transcription."""
    limiter = RateLimiter(ards, keys)
    for tier in [Tier("a", 7, 3, None), Tier("b", 600, 20, None), Tier("c", 0.5, 1, None)]:
        model = TokenBucket(tier.rate_per_s, tier.burst)
        now = 1_700_000_000_000_000
        for i, gap in enumerate([0, 0, 0, 1, 10, 123_457, 3_000_000, 0, 8_571_429, 5, 999_999_999, 0, 0]):
            now += gap
            got = await limiter.take(f"agree-{tier.name}", tier, _now_us=now)
            want = model.take(now)
            assert got == want, (tier.name, i)


async def test_the_token_buckets_forced_takes_agree_with_the_model_and_keep_their_debt(ards, keys, rds):
    """Tokens served: a prompt taken if it fits, generated tokens forced into debt, a
    refund; the script and ``TokenBucket`` give the same answers, and the debt keeps the
    key (its expiry counts the time to pay it back)."""
    limiter = RateLimiter(ards, keys)
    tier = Tier("t", None, 0, None, tokens_per_minute=600)  # 10 tokens a second, 600 at once
    model = TokenBucket(tier.token_rate_per_s, tier.token_capacity)
    now = 1_700_000_000_000_000
    for gap, cost, force in [(0, 500, False), (0, 300, True), (0, 0, False), (1_000_000, 0, False),
                             (30_000_000, 0, False), (0, 40, False), (0, -40, True), (5, 900, True)]:
        now += gap
        got = await limiter.take_tokens("debt", tier, cost, force=force, _now_us=now)
        want = model.take(now, cost, force=force)
        assert got == want, (gap, cost, force)
    assert got.tokens_left < -300 and rds.pttl(keys.token_ratelimit("debt")) > 90_000
    assert await limiter.take_tokens("debt", Tier("u", None, 0, None), 5) is None  # no token limit: no call


TWO_PROCESS_SNIPPET = textwrap.dedent("""
    import asyncio, sys
    import redis
    from streamfleet.gateway.admission.ratelimit import RateLimiter
    from streamfleet.shared.errors import RefusedError
    from streamfleet.shared.keys import Keys
    from streamfleet.shared.redis import connect
    from streamfleet.shared.tiers import Tier

    url, prefix, attempts = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tier = Tier("tiny", requests_per_minute=0.0001, burst=20, max_streams=None)

    async def main():
        client = connect(url)
        limiter = RateLimiter(client, Keys(prefix))
        await client.ping()
        print("ready", flush=True)
        redis.Redis.from_url(url).blpop(prefix + ":go", timeout=30)

        async def one():
            try:
                await limiter.check("shared-key", tier)
                return 1
            except RefusedError:
                return 0

        results = await asyncio.gather(*(one() for _ in range(attempts)))
        print("allowed", sum(results), flush=True)
        await client.aclose()

    asyncio.run(main())
""")


def test_two_processes_share_one_budget_exactly(redis_server, key_prefix, rds):
    env = {**os.environ, "PYTHONPATH": REPO}
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROCESS_SNIPPET, redis_server.url, key_prefix, "30"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        rds.rpush(f"{key_prefix}:go", 1, 1)  # release both at once
        allowed = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            allowed.append(int(out.split()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sum(allowed) == 20, allowed


# -- stream slots ----------------------------------------------------------------------
async def test_stream_slots_acquire_release_and_refuse(ards, keys, rds):
    slots = StreamSlots(ards, keys)
    assert await slots.acquire("k", "r1", 2) is True
    assert await slots.acquire("k", "r2", 2) is True
    assert await slots.acquire("k", "r2", 2) is True  # idempotent for a held request
    with pytest.raises(RefusedError) as info:
        await slots.acquire("k", "r3", 2)
    err = info.value
    assert (err.status, err.code) == (429, ErrorCode.too_many_requests)
    assert err.retry_after_ms and "2 of 2" in err.message
    assert await slots.count("k") == 2
    assert sorted(rds.zrange(keys.streams("k"), 0, -1)) == [b"r1", b"r2"]
    assert 0 < rds.pttl(keys.streams("k")) <= 600_000

    await slots.release("k", "r1")
    await slots.release("k", "r1")  # releasing twice is harmless
    assert await slots.acquire("k", "r3", 2) is True
    assert await slots.acquire("other", "r1", 2) is True  # per key

    assert await slots.acquire("k", "r9", None) is False  # no cap: nothing held, no Redis
    assert not rds.zscore(keys.streams("k"), "r9")

    async with slots.hold("h", "x", 1):
        with pytest.raises(RefusedError):
            await slots.acquire("h", "y", 1)
    assert await slots.count("h") == 0


async def test_stream_slots_of_a_dead_gateway_lapse(ards, keys, rds):
    slots = StreamSlots(ards, keys, ttl_s=1.0)
    await slots.acquire("k", "r1", 2)
    await slots.acquire("k", "r2", 2)
    with pytest.raises(RefusedError):
        await slots.acquire("k", "r3", 2)
    await asyncio.sleep(0.6)  # a real clock window: r2's touch must come well after r1's last word
    await slots.touch("k", "r2")  # a live stream keeps its slot

    async def one_left() -> bool:
        return await slots.count("k") == 1

    await until_async(one_left, "r1's slot lapsed", timeout=5)
    assert await slots.acquire("k", "r3", 2) is True
    await slots.touch("k", "r1")  # a lapsed slot is not revived
    assert sorted(rds.zrange(keys.streams("k"), 0, -1)) == [b"r2", b"r3"]
    await until_async(lambda: not rds.exists(keys.streams("k")), "the idle key expired", timeout=2)


# -- CLI -------------------------------------------------------------------------------
def _cli(redis_url: str, prefix: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
    env.update(SF_REDIS_URL=redis_url, SF_KEY_PREFIX=prefix)
    return subprocess.run([sys.executable, "-m", "streamfleet", "keys", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


async def test_cli_round_trip(redis_server, key_prefix, ards):
    url = redis_server.url
    added = _cli(url, key_prefix, "add", "grace", "--tier", "paid")
    assert added.returncode == 0, added.stderr
    plaintext = added.stdout.strip()
    key_id, _ = parse_key(plaintext)
    assert "only time the key is shown" in added.stderr and key_id in added.stderr

    store = KeyStore(ards, Keys(key_prefix), cache_ttl_s=0)
    assert (await store.verify(plaintext)).tier.name == "paid"

    table = _cli(url, key_prefix, "list")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.strip().splitlines()
    assert header.split() == ["KEY_ID", "NAME", "TIER", "CREATED", "REVOKED"]
    assert row.split()[:3] == [key_id, "grace", "paid"] and row.split()[-1] == "no"
    assert plaintext not in table.stdout

    listed = json.loads(_cli(url, key_prefix, "list", "--json").stdout)
    assert [(r["key_id"], r["name"], r["tier"], r["revoked"]) for r in listed] == [(key_id, "grace", "paid", False)]
    assert all("hash" not in r for r in listed)

    bad = _cli(url, key_prefix, "add", "heidi", "--tier", "platinum")
    assert bad.returncode == 2 and "unknown tier" in bad.stderr

    revoked = _cli(url, key_prefix, "revoke", "grace")
    assert revoked.returncode == 0, revoked.stderr
    with pytest.raises(AuthError):
        await store.verify(plaintext)
    assert json.loads(_cli(url, key_prefix, "list", "--json").stdout)[0]["revoked"] is True
    again = _cli(url, key_prefix, "revoke", key_id)
    assert again.returncode == 1 and "no active key" in again.stderr

    unreachable = subprocess.run([sys.executable, "-m", "streamfleet", "keys", "list", "--redis-url",
                                  "redis://127.0.0.1:1/0"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert unreachable.returncode == 1 and "cannot reach Redis" in unreachable.stderr
