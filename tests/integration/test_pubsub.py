"""The gateway's own pub/sub connection (shared/pubsub.py) against a real redis-server:
subscribe acknowledgements, delivery, PING, drops, and authentication."""

from __future__ import annotations

import asyncio

import pytest
import redis
from redis.exceptions import AuthenticationError, ConnectionError as RedisConnectionError

from streamfleet.shared.pubsub import open_pubsub
from streamfleet.shared.resp import pack
from tests.support.ports import free_port


def test_pack_is_resp():
    assert pack("SUBSCRIBE", b"a", 7) == b"*3\r\n$9\r\nSUBSCRIBE\r\n$1\r\na\r\n$1\r\n7\r\n"


async def test_subscribe_receive_ping_unsubscribe(redis_server, key_prefix):
    got: list[tuple[bytes, bytes]] = []
    conn = await open_pubsub(redis_server.url, lambda ch, data: got.append((ch, data)), client_name="sf-test")
    chans = [f"{key_prefix}:c{i}" for i in range(3)]
    await conn.subscribe(*chans, timeout=5)  # acknowledged: what is published now arrives
    r = redis.Redis.from_url(redis_server.url)
    assert r.pubsub_numsub(chans[0])[0][1] == 1
    assert r.publish(chans[0], b"one") == 1
    r.publish(chans[2], b"\x00binary\xff" * 1000)
    for _ in range(100):
        if len(got) == 2:
            break
        await asyncio.sleep(0.01)
    assert got == [(chans[0].encode(), b"one"), (chans[2].encode(), b"\x00binary\xff" * 1000)]
    await conn.ping(timeout=5)
    conn.unsubscribe(chans[0])
    await conn.ping(timeout=5)  # replies come in order: the unsubscribe is done
    assert r.pubsub_numsub(chans[0])[0][1] == 0
    assert any(c.get("name") == "sf-test" for c in r.client_list())
    conn.close()
    assert isinstance(await asyncio.wait_for(conn.lost, 5), RedisConnectionError)
    r.close()


async def test_a_killed_connection_resolves_lost(redis_server, key_prefix):
    conn = await open_pubsub(redis_server.url, lambda ch, data: None, client_name="sf-kill-me")
    await conn.subscribe(f"{key_prefix}:x", timeout=5)
    r = redis.Redis.from_url(redis_server.url)
    assert r.client_kill_filter(_type="pubsub", skipme=True) >= 1
    err = await asyncio.wait_for(conn.lost, 5)
    assert isinstance(err, RedisConnectionError)
    assert not conn.is_open
    with pytest.raises(RedisConnectionError):
        await conn.ping(timeout=1)
    r.close()


async def test_password_and_acl_user(own_redis):
    r = redis.Redis.from_url(own_redis.url)
    r.config_set("requirepass", "s3cret/with:odd@chars")
    r = redis.Redis.from_url(own_redis.url, password="s3cret/with:odd@chars")
    r.acl_setuser("gw", enabled=True, passwords=["+gwpass"], channels=["*"], commands=["+@pubsub", "+ping",
                                                                                       "+client|setname"])
    host_port = own_redis.url.split("//", 1)[1]
    from urllib.parse import quote

    ok = await open_pubsub(f"redis://:{quote('s3cret/with:odd@chars', safe='')}@{host_port}", lambda c, d: None)
    await ok.subscribe("a", timeout=5)
    ok.close()
    user = await open_pubsub(f"redis://gw:gwpass@{host_port}", lambda c, d: None, client_name="sf-gw")
    await user.subscribe("b", timeout=5)
    await user.ping(timeout=5)
    user.close()
    r.acl_setuser("plain", enabled=True, passwords=["+plainpass"], channels=["*"], commands=["+@pubsub", "+ping"])
    plain = await open_pubsub(f"redis://plain:plainpass@{host_port}", lambda c, d: None, client_name="no-perm")
    await plain.subscribe("b", timeout=5)  # CLIENT SETNAME was refused (NOPERM): the socket works anyway
    plain.close()
    with pytest.raises(AuthenticationError):
        await open_pubsub(f"redis://:wrong@{host_port}", lambda c, d: None)
    with pytest.raises(RedisConnectionError):  # no password at all: the first command is refused
        conn = await open_pubsub(f"redis://{host_port}", lambda c, d: None, client_name="x")
        conn.close()
    # without a handshake command the refusal comes as the SUBSCRIBE's answer
    bare = await open_pubsub(f"redis://{host_port}", lambda c, d: None)
    with pytest.raises(redis.exceptions.ResponseError, match="NOAUTH"):
        await bare.subscribe("c", timeout=5)
    bare.close()
    r.close()


async def test_unreachable_redis_is_a_connection_error():
    with pytest.raises(RedisConnectionError):
        await open_pubsub(f"redis://127.0.0.1:{free_port()}/0", lambda c, d: None, timeout=2)


async def test_tls(tls_redis):
    port, cert = tls_redis
    got = []
    verified = await open_pubsub(f"rediss://localhost:{port}/0?ssl_ca_certs={cert}", lambda c, d: got.append(d))
    await verified.subscribe("t", timeout=5)
    r = redis.Redis(host="localhost", port=port, ssl=True, ssl_ca_certs=str(cert))
    assert r.publish("t", b"over tls") == 1
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.01)
    assert got == [b"over tls"]
    verified.close()
    r.close()
    unverified = await open_pubsub(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none", lambda c, d: None)
    await unverified.ping(timeout=5)
    unverified.close()
    with pytest.raises(RedisConnectionError):  # the default context does not trust a self-signed certificate
        await open_pubsub(f"rediss://localhost:{port}/0", lambda c, d: None, timeout=5)
