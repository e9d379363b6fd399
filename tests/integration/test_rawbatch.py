"""streamfleet.shared.redis.RawBatch against a real redis-server: results in order, error replies in
place (not raised), and a retry on a fresh connection when the first one was dropped."""

from __future__ import annotations

import redis
from redis.exceptions import ResponseError

from streamfleet.shared.redis import RawBatch, connect


async def test_results_in_order_with_errors_in_place(redis_server, key_prefix):
    client = connect(redis_server.url)
    b = RawBatch()
    b.add(b"SET", f"{key_prefix}:s", b"x")
    i_bad = b.add(b"XADD", f"{key_prefix}:s", b"*", b"e", b"1")  # WRONGTYPE: a string, not a stream
    b.add(b"XADD", f"{key_prefix}:log", b"MAXLEN", b"~", 100, b"*", b"e", b"\x00\xff payload")
    b.add(b"PUBLISH", f"{key_prefix}:nobody", b"hi")
    b.add(b"GET", f"{key_prefix}:s")
    out = await b.execute(client)
    assert out[0] is True or out[0] == b"OK"
    assert isinstance(out[i_bad], ResponseError) and "WRONGTYPE" in str(out[i_bad])
    assert isinstance(out[2], bytes) and b"-" in out[2]  # the new entry id
    assert out[3] == 0 and out[4] == b"x"
    r = redis.Redis.from_url(redis_server.url)
    assert r.xrange(f"{key_prefix}:log")[0][1] == {b"e": b"\x00\xff payload"}
    # the connection went back to the pool in a usable state
    assert await client.get(f"{key_prefix}:s") == b"x"
    r.close()
    await client.aclose()


async def test_retries_on_a_dropped_connection(redis_server, key_prefix):
    client = connect(redis_server.url, max_connections=1)
    await client.client_setname(f"{key_prefix}-raw")  # names the pool's one connection
    r = redis.Redis.from_url(redis_server.url)
    victims = [c["id"] for c in r.client_list() if c.get("name") == f"{key_prefix}-raw"]
    assert len(victims) == 1
    assert r.client_kill_filter(_id=victims[0]) == 1
    b = RawBatch()
    b.add(b"INCR", f"{key_prefix}:n")
    assert await b.execute(client) == [1]
    assert await RawBatch().execute(client) == []
    r.close()
    await client.aclose()


async def test_coalescer_batches_a_turn_and_routes_errors(redis_server, key_prefix):
    import asyncio

    import pytest
    from redis.exceptions import NoScriptError

    from streamfleet.shared.redis import Coalescer

    client = connect(redis_server.url)
    co = Coalescer(client, max_batch=16)
    await client.set(f"{key_prefix}:str", b"x")
    calls = [co.call(b"INCR", f"{key_prefix}:n") for _ in range(50)]
    calls.append(co.call(b"INCR", f"{key_prefix}:str"))  # an error reply, for this caller only
    calls.append(co.call(b"EVALSHA", "0" * 40, 0))
    out = await asyncio.gather(*calls, return_exceptions=True)
    assert sorted(out[:50]) == list(range(1, 51))
    assert isinstance(out[50], ResponseError) and "not an integer" in str(out[50])
    assert isinstance(out[51], NoScriptError)
    assert await co.call(b"GET", f"{key_prefix}:n") == b"50"
    await client.aclose()
    broken = connect("redis://127.0.0.1:1/0", socket_timeout=0.5)
    from streamfleet.shared.redis import BROKER_ERRORS

    with pytest.raises(BROKER_ERRORS):  # unreachable: what the gateway turns into a 503
        await Coalescer(broken).call(b"PING")
    await broken.aclose()
