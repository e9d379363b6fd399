"""Nothing lost (docs/failures.md): worker crashes, dead letters, resume, cancels everywhere,
graceful drains, engine failures — with real processes and a real redis-server."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import orjson
import pytest
import websockets

from tests.support.wait import until, until_async
from tests.support.wsclient import Client

pytestmark = pytest.mark.slow  # kills, drains and resumes: fresh processes each

SLOW = dict(backend="echo", echo_delay_ms=30)
RECLAIM = dict(claim_idle_ms=1000, reclaim_interval_s=0.2)
PROMPT = "Once upon a time there was a fleet"


def lane_key(prefix: str, lane: str = "normal") -> str:
    return f"{prefix}:{{tiny-gpt}}:tasks:{lane}"


def holder(fleet, rds, prefix: str):
    """The worker process holding the lane's one pending task."""
    pending = rds.xpending_range(lane_key(prefix), "workers", "-", "+", 10)
    assert len(pending) == 1, pending
    info = orjson.loads(rds.hget(f"{prefix}:workers:tiny-gpt", pending[0]["consumer"]))
    return next(p for p in fleet.procs if p.name == "worker" and p.popen.pid == info["pid"])


async def wait_tokens(c: Client, id: str, n: int, timeout: float = 30) -> None:
    def enough() -> bool:
        if len(c.results[id].tokens) >= n:
            return True
        assert c.results[id].end is None, c.results[id].end
        return False

    await until_async(enough, f"{id}: {n} tokens", timeout=timeout, interval=0.005)


def wait_pending(rds, key: str, want: int, timeout: float) -> float:
    t0 = time.monotonic()
    until(lambda: rds.xpending(key, "workers")["pending"] == want, lambda: str(rds.xpending(key, "workers")),
          timeout=timeout, interval=0.005)
    return time.monotonic() - t0


@pytest.mark.both_brokers
async def test_worker_killed_mid_stream_is_seamless(fleet, rds, key_prefix):
    gw = fleet.gateway()
    fleet.worker(**SLOW, **RECLAIM)
    fleet.worker(**SLOW, **RECLAIM)
    c = await Client.connect(gw.ws)
    params = dict(max_tokens=60, ignore_eos=True, seed=11, temperature=0.8)
    ref = await c.generate("ref", PROMPT, **params)
    fut = c.start("r", PROMPT, **params)
    await wait_tokens(c, "r", 10)
    victim = holder(fleet, rds, key_prefix)
    victim.popen.send_signal(signal.SIGKILL)
    res = await asyncio.wait_for(fut, 60)
    assert res.end["type"] == "done", res.end
    assert res.indices == list(range(60))  # every index exactly once, in order
    assert res.text == ref.text  # regenerated with the same seed
    survivor = next(p for p in fleet.procs if p.name == "worker" and p is not victim)
    assert "reclaimed a task" in survivor.log()
    # acked after the done is published: on a cluster the XACK goes to the lanes' shard once
    # the reply's shard has answered (workers/publisher.py), so it may land a moment after
    wait_pending(rds, lane_key(key_prefix), 0, 5)
    await c.close()


async def test_too_many_deliveries_go_to_dead_letters(fleet, rds, key_prefix):
    gw = fleet.gateway()
    fleet.worker(**SLOW, **RECLAIM, max_deliveries=1)
    fleet.worker(**SLOW, **RECLAIM, max_deliveries=1)
    c = await Client.connect(gw.ws)
    fut = c.start("r", PROMPT, max_tokens=60, ignore_eos=True)
    await wait_tokens(c, "r", 3)
    holder(fleet, rds, key_prefix).popen.send_signal(signal.SIGKILL)
    res = await asyncio.wait_for(fut, 60)
    assert res.end["type"] == "error" and res.end["code"] == "delivery_failed", res.end
    dead = rds.xrange(f"{key_prefix}:{{tiny-gpt}}:dead")
    assert len(dead) == 1 and b"delivered 2 times" in dead[0][1][b"reason"]
    assert rds.xlen(lane_key(key_prefix)) == 0
    await c.close()


@pytest.mark.both_brokers
async def test_resume_on_another_gateway_after_a_dropped_connection(fleet):
    a, b = fleet.gateway(), fleet.gateway()
    fleet.worker(**SLOW)
    params = dict(max_tokens=80, ignore_eos=True, seed=4, temperature=0.9)
    cb = await Client.connect(b.ws)
    ref = await cb.generate("ref", PROMPT, **params)

    ws = await websockets.connect(a.ws)
    await ws.send(orjson.dumps({"type": "generate", "id": "r", "prompt": PROMPT, **params}).decode())
    accepted = orjson.loads(await ws.recv())
    got = []
    while len(got) < 10:
        msg = orjson.loads(await ws.recv())
        assert msg["type"] == "token"
        got.append(msg)
    ws.transport.abort()  # the network drops: no close frame

    res = await asyncio.wait_for(cb.resume("r", accepted["request_id"], got[-1]["index"] + 1,
                                           accepted["resume_token"]), 60)
    assert res.accepted["resumed_from"] == 10
    assert res.end["type"] == "done" and res.end["usage"]["completion_tokens"] == 80
    indices = [t["index"] for t in got] + res.indices
    assert indices == list(range(80))  # no duplicate, no gap
    assert "".join(t["text"] for t in got) + res.text == ref.text
    # resuming something unknown is a clear error
    bad = await asyncio.wait_for(cb.resume("x", "0" * 32, 0, "0" * 32), 10)
    assert bad.end["code"] == "unknown_request" and bad.end["status"] == 404
    await cb.close()


@pytest.mark.both_brokers
def test_sse_last_event_id_resumes_on_another_gateway(fleet):
    a = fleet.gateway(sse_resume_grace_s=10)
    b = fleet.gateway()
    fleet.worker(**SLOW)
    body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "seed": 8, "stream": True}
    ref = httpx.post(b.http + "/v1/completions", json={**body, "stream": False}, timeout=60).json()
    first, last_id = [], None
    with httpx.stream("POST", a.http + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("id: "):
                last_id = line[4:]
            elif line.startswith("data: ") and last_id:
                first.append(orjson.loads(line[6:])["choices"][0]["text"])
                if len(first) == 10:
                    break
    rest = []
    with httpx.stream("POST", b.http + "/v1/completions", json=body, headers={"Last-Event-ID": last_id},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                rest.append(orjson.loads(line[6:])["choices"][0]["text"])
    assert "".join(first + rest) == ref["choices"][0]["text"]


async def test_gateway_death_frees_the_slot(fleet, rds, key_prefix):
    gw = fleet.gateway()
    worker = fleet.worker(**SLOW, orphan_grace_s=0.5)
    c = await Client.connect(gw.ws)
    c.start("r", PROMPT, max_tokens=200, ignore_eos=True)
    await wait_tokens(c, "r", 3)
    gw.popen.send_signal(signal.SIGKILL)
    # the worker's PUBLISHes reach no subscriber: after the grace it stops the sequence
    freed = wait_pending(rds, lane_key(key_prefix), 0, 5)
    assert 0.4 < freed < 3.0, freed
    assert "nobody listening; cancelling" in worker.log(tail=None)
    await c.close()


async def test_worker_sigterm_hands_back_unfinished_work(fleet, rds, key_prefix):
    gw = fleet.gateway()
    fleet.worker(**SLOW, **RECLAIM, drain_timeout_s=0.3)
    fleet.worker(**SLOW, **RECLAIM, drain_timeout_s=0.3)
    c = await Client.connect(gw.ws)
    params = dict(max_tokens=80, ignore_eos=True, seed=2, temperature=0.7)
    ref = await c.generate("ref", PROMPT, **params)
    fut = c.start("r", PROMPT, **params)
    await wait_tokens(c, "r", 5)
    victim = holder(fleet, rds, key_prefix)
    t0 = time.monotonic()
    assert victim.terminate(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 5
    res = await asyncio.wait_for(fut, 60)
    assert res.end["type"] == "done" and res.indices == list(range(80)) and res.text == ref.text
    assert "handed back unfinished tasks" in victim.log()
    workers = rds.hgetall(f"{key_prefix}:workers:tiny-gpt")
    assert all(orjson.loads(v)["pid"] != victim.popen.pid for v in workers.values())
    await c.close()


async def test_worker_sigterm_finishes_in_flight_work_first(fleet, rds, key_prefix):
    gw = fleet.gateway()
    w = fleet.worker(**SLOW, drain_timeout_s=20)
    c = await Client.connect(gw.ws)
    fut = c.start("r", PROMPT, max_tokens=40, ignore_eos=True)
    await wait_tokens(c, "r", 3)
    w.popen.send_signal(signal.SIGTERM)
    res = await asyncio.wait_for(fut, 30)
    assert res.end["type"] == "done" and res.indices == list(range(40))
    assert w.popen.wait(20) == 0
    await c.close()


async def test_gateway_sigterm_drains_then_closes_1001(fleet):
    gw = fleet.gateway(drain_timeout_s=10)
    fleet.worker(**SLOW)
    c = await Client.connect(gw.ws)
    fut = c.start("r", PROMPT, max_tokens=40, ignore_eos=True)
    await wait_tokens(c, "r", 3)
    gw.popen.send_signal(signal.SIGTERM)

    async def not_listening() -> bool:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        except OSError:
            return True
        writer.close()
        return False

    await until_async(not_listening, "the gateway to stop listening", timeout=5)
    with pytest.raises(OSError):  # it stopped listening
        await websockets.connect(gw.ws, open_timeout=2)
    res = await asyncio.wait_for(fut, 30)  # the stream in flight still finishes
    assert res.end["type"] == "done" and res.indices == list(range(40))
    await asyncio.wait_for(c.reader, 10)
    assert c.ws.close_code == 1001 and "shutting down" in c.ws.close_reason
    assert gw.popen.wait(10) == 0


async def test_gateway_drain_deadline_closes_long_streams(fleet):
    gw = fleet.gateway(drain_timeout_s=0.5)
    fleet.worker(**SLOW)
    c = await Client.connect(gw.ws)
    c.start("r", PROMPT, max_tokens=200, ignore_eos=True)
    await wait_tokens(c, "r", 3)
    gw.popen.send_signal(signal.SIGTERM)
    await asyncio.wait_for(c.reader, 10)
    assert c.ws.close_code == 1001
    assert gw.popen.wait(10) == 0


async def test_engine_failure_ends_only_that_request(fleet):
    gw = fleet.gateway()
    w = fleet.worker(backend="tests.support.faulty_engine:FaultyEngine", echo_delay_ms=5)
    c = await Client.connect(gw.ws)
    futs = [c.start("ok1", "fine", max_tokens=20, ignore_eos=True),
            c.start("bad", "this will FAIL", max_tokens=20, ignore_eos=True),
            c.start("ok2", "also fine", max_tokens=20, ignore_eos=True)]
    ok1, bad, ok2 = await asyncio.wait_for(asyncio.gather(*futs), 30)
    assert bad.end["type"] == "error" and bad.end["code"] == "engine_error", bad.end
    assert ok1.end["type"] == "done" and len(ok1.tokens) == 20
    assert ok2.end["type"] == "done" and len(ok2.tokens) == 20
    again = await c.generate("later", "still fine", max_tokens=5, ignore_eos=True)
    assert again.end["type"] == "done" and w.alive()
    await c.close()


async def test_dropped_subscription_is_repaired_from_the_log(fleet, rds):
    """Redis stays up but drops the gateway's pub/sub connection mid-stream (as a proxy or
    an output-buffer limit would): the gateway resubscribes at once and fills what was
    published meanwhile from the request's log — no error, no gap, no duplicate."""
    gw = fleet.gateway()
    # the worker's PUBLISHes reach nobody while the gateway re-subscribes; a generous grace
    # keeps a slow CI machine from turning that window into a cancel (see orphan_grace_s)
    worker = fleet.worker(backend="echo", echo_delay_ms=10, overlap_io="true", orphan_grace_s=5)
    c = await Client.connect(gw.ws)
    params = dict(max_tokens=150, ignore_eos=True)
    ref = await c.generate("ref", PROMPT, **params)
    fut = c.start("r", PROMPT, **params)
    await wait_tokens(c, "r", 10)
    killed = rds.client_kill_filter(_type="pubsub")
    assert killed >= 1
    res = await asyncio.wait_for(fut, 60)
    assert res.end["type"] == "done", res.end
    assert res.indices == list(range(150)) and res.text == ref.text
    assert "pub/sub connection restored" in gw.log(tail=None)
    assert "nobody listening" not in worker.log(tail=None)
    await c.close()
