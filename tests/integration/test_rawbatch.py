"""streamfleet.shared.redis.RawBatch against a real redis-server: results in order, error replies in
place (not raised), every batch on one pipelined socket (concurrent callers, a cancelled caller, a
stalled server), and a retry on a fresh socket when the first one was dropped."""

from __future__ import annotations

import asyncio

import pytest
import redis
from redis.exceptions import ResponseError

from streamfleet.shared.redis import RawBatch, RawScript, connect


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


async def test_a_raw_script_runs_its_calls_in_one_batch_and_loads_itself_again_after_a_flush(own_redis):
    client = connect(own_redis.url)
    script = RawScript("return {KEYS[1], ARGV[1], redis.call('INCR', KEYS[1])}")
    calls = [(["k1"], ["a"]), (["k2"], ["b"])]
    assert await script.run(client, calls) == [[b"k1", b"a", 1], [b"k2", b"b", 1]]
    sha = script.sha
    await client.script_flush()  # a restarted or flushed server: NOSCRIPT, then loaded again
    assert await script.run(client, calls) == [[b"k1", b"a", 2], [b"k2", b"b", 2]]
    assert script.sha == sha
    push = RawScript("return redis.call('LPUSH', KEYS[1], 'x')")
    bad, good = await push.run(client, [(["k1"], []), (["list"], [])])  # k1 holds a string: in place
    assert isinstance(bad, ResponseError) and "WRONGTYPE" in str(bad) and good == 1
    await client.aclose()


async def _link_client_id(client) -> int:
    """The CLIENT ID of the socket RawBatch sends on (shared.command_socket.CommandLink)."""
    b = RawBatch()
    b.add(b"CLIENT", b"ID")
    (cid,) = await b.execute(client)
    return int(cid)


async def test_batches_share_one_pipelined_socket_not_the_pool(redis_server, key_prefix):
    client = connect(redis_server.url, command_name=f"{key_prefix}-commands")
    first = await _link_client_id(client)
    named = [c for c in await client.client_list() if c.get("name") == f"{key_prefix}-commands"]
    assert [int(c["id"]) for c in named] == [first]  # CLIENT LIST tells it from the pool's sockets
    await client.set(f"{key_prefix}:warm", b"1")  # the pool's own connection is another socket
    assert int(await client.client_id()) != first

    async def one(i):
        b = RawBatch()
        b.add(b"INCR", f"{key_prefix}:n")
        b.add(b"RPUSH", f"{key_prefix}:order", i)
        b.add(b"CLIENT", b"ID")
        return await b.execute(client)

    out = await asyncio.gather(*[one(i) for i in range(300)])
    # every caller got its own replies: the counter's values are those of its INCR, all
    # on the one socket, and the server ran the batches in the order they were sent
    assert sorted(r[0] for r in out) == list(range(1, 301))
    assert {int(r[2]) for r in out} == {first}
    assert [r[0] for r in out] == [r[1] for r in out]
    await client.aclose()


async def test_retries_on_a_dropped_connection(redis_server, key_prefix):
    client = connect(redis_server.url, max_connections=1)
    victim = await _link_client_id(client)
    r = redis.Redis.from_url(redis_server.url)
    assert r.client_kill_filter(_id=victim) == 1
    b = RawBatch()
    b.add(b"INCR", f"{key_prefix}:n")
    assert await b.execute(client) == [1]  # sent on the dead socket, then again on a fresh one
    assert await _link_client_id(client) != victim
    assert await RawBatch().execute(client) == []
    r.close()
    await client.aclose()


async def test_a_cancelled_batch_leaves_the_socket_in_step(redis_server, key_prefix):
    client = connect(redis_server.url)
    await _link_client_id(client)
    r = redis.Redis.from_url(redis_server.url)
    r.client_pause(300, all=False)  # writes wait: the batch below is sent, its replies come late
    slow = RawBatch()
    slow.add(b"SET", f"{key_prefix}:a", b"1")
    slow.add(b"GET", f"{key_prefix}:a")
    task = asyncio.ensure_future(slow.execute(client))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    b = RawBatch()
    b.add(b"SET", f"{key_prefix}:b", b"2")
    b.add(b"GET", f"{key_prefix}:b")
    b.add(b"GET", f"{key_prefix}:a")
    assert await b.execute(client) == [b"OK", b"2", b"1"]  # its own replies, not the cancelled one's
    r.close()
    await client.aclose()


async def test_a_stalled_server_times_the_batch_out_then_recovers(redis_server, key_prefix):
    from redis.exceptions import TimeoutError as RedisTimeoutError

    client = connect(redis_server.url, socket_timeout=0.3)
    await _link_client_id(client)
    r = redis.Redis.from_url(redis_server.url)
    r.client_pause(1500, all=False)
    b = RawBatch()
    b.add(b"INCR", f"{key_prefix}:n")
    started = asyncio.get_running_loop().time()
    with pytest.raises(RedisTimeoutError):  # its try and its one retry each waited the socket timeout
        await b.execute(client)
    assert asyncio.get_running_loop().time() - started < 1.4
    r.client_unpause()
    assert await b.execute(client) in ([2], [3])  # a timed-out INCR may have run once the pause ended
    r.close()
    await client.aclose()


async def test_the_url_database_and_credentials_apply(own_redis):
    from urllib.parse import quote

    admin = redis.Redis.from_url(own_redis.url)
    admin.config_set("requirepass", "pw/odd:@")
    host_port = own_redis.url.split("//", 1)[1].split("/")[0]
    client = connect(f"redis://:{quote('pw/odd:@', safe='')}@{host_port}/3")
    b = RawBatch()
    b.add(b"SET", b"in-db-3", b"yes")
    assert await b.execute(client) == [b"OK"]
    check = redis.Redis.from_url(f"redis://{host_port}/3", password="pw/odd:@")
    assert check.get(b"in-db-3") == b"yes"
    other = redis.Redis.from_url(f"redis://{host_port}/0", password="pw/odd:@")
    assert other.get(b"in-db-3") is None
    other.close()
    await client.aclose()
    wrong = connect(f"redis://:wrong@{host_port}/0", socket_timeout=2)
    from streamfleet.shared.redis import BROKER_ERRORS

    with pytest.raises(BROKER_ERRORS):
        await RawBatch().execute(wrong) or await _link_client_id(wrong)
    await wrong.aclose()
    check.config_set("requirepass", "")
    check.close()
    admin.close()


async def test_tls(tls_redis):
    port, cert = tls_redis
    client = connect(f"rediss://localhost:{port}/0?ssl_ca_certs={cert}")
    b = RawBatch()
    b.add(b"SET", b"over-tls", b"1")
    b.add(b"GET", b"over-tls")
    assert await b.execute(client) == [b"OK", b"1"]
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
