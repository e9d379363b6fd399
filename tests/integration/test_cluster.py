"""Redis Cluster mode (docs/cluster.md) on a real local cluster of redis-server
processes (3 primaries, 3 replicas): a primary SIGKILLed mid-stream, proof that a token
message touches only the shard owning its channel, and `streamfleet status` per shard.

The fleet's main tests (streaming, batching equality, cancel, worker SIGKILL, resume,
admission) run on both brokers: they are marked ``both_brokers`` in their own modules.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import orjson
import pytest
from redis.crc import key_slot

from streamfleet.launcher import EmbeddedCluster
from streamfleet.shared.keys import Keys
from tests.support.fleet import FleetFactory
from tests.support.wait import until_async
from tests.support.wsclient import Client

pytestmark = pytest.mark.slow  # cluster primaries killed, failovers


def _port_of(client, slot: int) -> int:
    return int(client.nodes_manager.get_node_from_slot(slot).port)


def _stats(cluster: EmbeddedCluster, port: int) -> dict[str, int]:
    """A node's publish counters: commands (INFO commandstats) and cluster-bus messages."""
    import redis

    r = redis.Redis(port=port)
    try:
        cmd = r.info("commandstats")
        bus = dict(r.execute_command("CLUSTER INFO").items())
    finally:
        r.close()
    return {
        "publish": int(cmd.get("cmdstat_publish", {}).get("calls", 0)),
        "spublish": int(cmd.get("cmdstat_spublish", {}).get("calls", 0)),
        "bus_publish": int(bus.get("cluster_stats_messages_publish_sent", 0)),
        "bus_publishshard": int(bus.get("cluster_stats_messages_publishshard_sent", 0)),
    }


def _reset_stats(cluster: EmbeddedCluster) -> None:
    import redis

    for port in cluster.ports:
        r = redis.Redis(port=port)
        try:
            r.config_resetstat()
        finally:
            r.close()


def _reply_channels(r, prefix: str) -> set[str]:
    """The reply channels of ``prefix`` the gateways have subscribed, on every shard."""
    channels = set()
    for node in r.get_primaries():
        channels |= {ch.decode() for ch in r.execute_command("PUBSUB SHARDCHANNELS", f"{prefix}:reply:*",
                                                             target_nodes=node)}
    return channels


async def test_a_token_message_is_handled_only_by_the_shard_owning_its_channel(redis_cluster, tiny_spec,
                                                                               tmp_path):
    prefix = f"sfc{time.monotonic_ns() % 10**8}"
    fleet = FleetFactory(redis_cluster.url, prefix, tmp_path, cluster=True)
    try:
        gw = fleet.gateway()
        fleet.worker(backend="echo", echo_delay_ms=5)
        keys = Keys(prefix, cluster=True)
        r = fleet_client(redis_cluster)
        lanes_port = _port_of(r, key_slot(keys.lane("tiny-gpt", "normal").encode()))
        # a connection whose reply channel lives on another shard than the model's lanes
        for _ in range(20):
            c = await Client.connect(gw.ws)
            warm = await c.generate("warm", max_tokens=2, ignore_eos=True)
            assert warm.end["type"] == "done", warm.end
            channels = _reply_channels(r, prefix)  # the connection's reply channel, as the gateway subscribed it
            assert len(channels) == 1, channels
            channel = channels.pop()
            reply_port = _port_of(r, key_slot(channel.encode()))
            if reply_port != lanes_port:
                break
            await c.close()
            await until_async(lambda: not _reply_channels(r, prefix), "the closed connection's channel gone")
        assert reply_port != lanes_port
        # its requests' logs share its shard
        assert key_slot(channel.encode()) == key_slot(keys.log(warm.accepted["request_id"]).encode())
        _reset_stats(redis_cluster)
        # (CONFIG RESETSTAT leaves the cluster-bus counters alone: those are compared as deltas)
        before = {port: _stats(redis_cluster, port) for port in redis_cluster.primary_ports()}

        n, tokens = 12, 24
        results = await asyncio.gather(*(c.generate(f"r{i}", max_tokens=tokens, ignore_eos=True) for i in range(n)))
        assert all(res.end["type"] == "done" and len(res.tokens) == tokens for res in results)
        await c.close()
        await until_async(lambda: not _reply_channels(r, prefix), "the closed connection's channel gone")
        stats = {port: {k: v - before[port][k] if k.startswith("bus_") else v for k, v in
                        _stats(redis_cluster, port).items()} for port in redis_cluster.primary_ports()}
        # no classic PUBLISH anywhere, so nothing is broadcast over the cluster bus
        assert all(s["publish"] == 0 and s["bus_publish"] == 0 for s in stats.values()), stats
        # every token message went to the one primary owning the reply channel (at least one
        # per request; steps batch the requests' tokens into one message per channel) ...
        assert stats[reply_port]["spublish"] >= tokens, stats
        # ... the lanes' primary published a wake per task an enqueue put in the stream
        # (sharded too; with fair share the one connection's others wait in its queue and the
        # worker's own reads move them in, which needs no wake), and the third handled nothing
        assert 1 <= stats[lanes_port]["spublish"] <= n, stats
        [other] = [p for p in stats if p not in (reply_port, lanes_port)]
        assert stats[other]["spublish"] == 0 and stats[other]["bus_publishshard"] == 0, stats
        # a sharded message crosses the cluster bus only to its own shard's replica: once each
        assert stats[reply_port]["bus_publishshard"] >= stats[reply_port]["spublish"], stats
        r.close()
    finally:
        fleet.close()


def fleet_client(cluster: EmbeddedCluster):
    from streamfleet.shared.redis import sync_client

    return sync_client(cluster.url, cluster=True)


def test_status_shows_each_shard_and_where_each_models_lanes_live(redis_cluster, tiny_spec, tmp_path):
    prefix = f"sfs{time.monotonic_ns() % 10**8}"
    fleet = FleetFactory(redis_cluster.url, prefix, tmp_path, cluster=True)
    try:
        fleet.gateway()
        fleet.worker(backend="echo")
        out = subprocess.run([sys.executable, "-m", "streamfleet", "status", "--json", "--model", "tiny-gpt"],
                             env=fleet.env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        st = orjson.loads(out.stdout)
        assert len(st["shards"]) == 3 and sum(sh["slots"] for sh in st["shards"]) == 16384
        assert all(len(sh["replicas"]) == 1 for sh in st["shards"])
        [model] = st["models"]
        r = fleet_client(redis_cluster)
        owner = r.nodes_manager.get_node_from_slot(key_slot(f"{prefix}:{{tiny-gpt}}:tasks:normal".encode()))
        assert model["shard"] == owner.name and model["live_workers"] == 1
        assert [sh["node"] for sh in st["shards"] if "tiny-gpt" in sh["models"]] == [owner.name]
        assert st["gateway_count"] >= 1 and st["cancel_listeners"] >= 1
        text = subprocess.run([sys.executable, "-m", "streamfleet", "status", "--model", "tiny-gpt"],
                              env=fleet.env(), capture_output=True, text=True, timeout=60).stdout
        assert "redis cluster: 3 shards" in text and f"lanes on {owner.name}" in text, text
        r.close()
    finally:
        fleet.close()


async def test_the_lanes_primary_killed_mid_stream_fails_over_without_restarting_anything(own_cluster, tiny_spec,
                                                                                         tmp_path):
    prefix = "sfo"
    fleet = FleetFactory(own_cluster.url, prefix, tmp_path, cluster=True)
    try:
        gw = fleet.gateway()
        worker = fleet.worker(backend="echo", echo_delay_ms=25)
        r = fleet_client(own_cluster)
        lanes_port = _port_of(r, key_slot(f"{prefix}:{{tiny-gpt}}:tasks:normal".encode()))
        r.close()
        clients = [await Client.connect(gw.ws) for _ in range(4)]
        futs = [c.start(f"r{i}", max_tokens=160, ignore_eos=True) for c in clients for i in range(2)]
        deadline = time.monotonic() + 30
        while not all(c.results[k].tokens for c in clients for k in c.results):
            assert time.monotonic() < deadline, "streams did not start"
            await asyncio.sleep(0.02)
        own_cluster.kill(lanes_port)
        killed_at = time.monotonic()
        try:
            results = await asyncio.wait_for(asyncio.gather(*futs), 90)
        except Exception as exc:
            raise AssertionError(f"{exc!r}\n{gw.log(20000)}\n{worker.log(8000)}") from exc
        intact = errors = 0
        for res in results:
            if res.end["type"] == "done":
                # completed intact: every token once, in order, and the count agrees
                assert res.indices == list(range(160)) and res.end["usage"]["completion_tokens"] == 160, res.end
                intact += 1
            else:  # or a clear error naming what happened
                assert res.end["type"] == "error" and res.end["code"] in ("broker_unavailable", "internal"), res.end
                assert res.end["message"], res.end
                errors += 1
        assert intact + errors == len(results)
        # a replica took over; new requests succeed with the same processes
        own_cluster.wait_ok(30)
        async def served():
            res = await clients[0].generate(f"after{time.monotonic_ns()}", max_tokens=8, ignore_eos=True)
            return res if res.end["type"] == "done" else None

        ok = await until_async(served, lambda: "a request served after the failover\n" + gw.log() + worker.log(),
                               timeout=max(1.0, 60 - (time.monotonic() - killed_at)), interval=0.5)
        assert len(ok.tokens) == 8, (gw.log(), worker.log())
        # a new connection too (a fresh reply channel, on whichever shard its tag hashes to)
        fresh = await Client.connect(gw.ws)
        res = await fresh.generate("fresh", max_tokens=8, ignore_eos=True)
        assert res.end["type"] == "done" and len(res.tokens) == 8, res.end
        assert gw.alive() and worker.alive()
        for c in [*clients, fresh]:
            await c.close()
        print(f"failover: {intact} intact, {errors} ended with an error, recovered in "
              f"{time.monotonic() - killed_at:.1f} s;", [r.end for r in results if r.end["type"] != "done"])
    finally:
        fleet.close()


def _migrate_slot(slot: int, src: int, dst: int, ports: list[int]) -> int:
    """Move one slot from primary ``src`` to primary ``dst`` the way `redis-cli --cluster
    reshard` does: IMPORTING/MIGRATING, MIGRATE every key, then SETSLOT NODE everywhere.
    Returns how many keys moved."""
    import redis

    a, b = redis.Redis(port=src), redis.Redis(port=dst)
    try:
        src_id, dst_id = a.execute_command("CLUSTER MYID").decode(), b.execute_command("CLUSTER MYID").decode()
        b.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        a.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        while True:
            keys = a.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
            if not keys:
                break
            a.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
            time.sleep(0.05)  # the fleet keeps writing meanwhile (ASK to the new owner)
        for port in [dst, src, *(p for p in ports if p not in (src, dst))]:
            r = redis.Redis(port=port)
            try:
                r.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
            finally:
                r.close()
        return moved
    finally:
        a.close()
        b.close()


async def test_a_connections_slot_resharded_mid_stream_keeps_its_streams_intact(own_cluster, tiny_spec, tmp_path):
    prefix = "sfm"
    fleet = FleetFactory(own_cluster.url, prefix, tmp_path, cluster=True)
    try:
        gw = fleet.gateway()
        worker = fleet.worker(backend="echo", echo_delay_ms=25)
        c = await Client.connect(gw.ws)
        warm = await c.generate("warm", max_tokens=2, ignore_eos=True)
        assert warm.end["type"] == "done", warm.end
        r = fleet_client(own_cluster)
        [channel] = [ch.decode() for node in r.get_primaries() for ch in
                     r.execute_command("PUBSUB SHARDCHANNELS", f"{prefix}:reply:*", target_nodes=node)]
        slot = key_slot(channel.encode())
        src = _port_of(r, slot)
        primaries = own_cluster.primary_ports()
        dst = next(p for p in primaries if p != src)
        futs = [c.start(f"r{i}", max_tokens=160, ignore_eos=True) for i in range(2)]
        deadline = time.monotonic() + 30
        while not all(c.results[f"r{i}"].tokens for i in range(2)):
            assert time.monotonic() < deadline, "streams did not start"
            await asyncio.sleep(0.02)
        moved = await asyncio.to_thread(_migrate_slot, slot, src, dst, primaries)
        assert moved >= 2  # at least the logs of the running requests went along
        try:
            results = await asyncio.wait_for(asyncio.gather(*futs), 60)
        except Exception as exc:
            raise AssertionError(f"{exc!r}\n{gw.log(20000)}\n{worker.log(8000)}") from exc
        for res in results:  # every token once, in order: the moved slot cost nothing
            assert res.end["type"] == "done" and res.indices == list(range(160)), (res.end, gw.log(8000))
        # the channel now lives on the new owner, and the connection still works
        import redis

        d = redis.Redis(port=dst)
        assert channel.encode() in d.execute_command("PUBSUB SHARDCHANNELS", f"{prefix}:reply:*")
        d.close()
        # (Redis unsubscribed the gateway when the slot left; it subscribed again on the new owner)
        assert "sharded subscriptions restored" in gw.log(None)
        res = await c.generate("after", max_tokens=8, ignore_eos=True)
        assert res.end["type"] == "done" and len(res.tokens) == 8, res.end
        await c.close()
        r.close()
    finally:
        fleet.close()
