"""Promises under faults (docs/failures.md): resume that survives a dead gateway and a
request still queued, takeover of a dead worker's work within seconds (and never of a
live, slow worker's), and Redis stalls ridden out below the configured bound."""

from __future__ import annotations

import asyncio
import signal
import time

import orjson
import pytest
import websockets

from streamfleet.launcher import EmbeddedRedis
from tests.support.fleet import FleetFactory
from tests.support.wait import until_async
from tests.support.wsclient import Client

pytestmark = pytest.mark.slow  # dead gateways, takeovers and Redis stalls: fresh processes each

PROMPT = "Once upon a time there was a fleet"


class Arrivals:
    """Watches a result's tokens and keeps the longest wait between two of them."""

    def __init__(self, result) -> None:
        self.result = result
        self.longest = 0.0
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        seen, at = 0, time.monotonic()
        while self.result.end is None:
            n = len(self.result.tokens)
            now = time.monotonic()
            if n != seen:
                if seen:
                    self.longest = max(self.longest, now - at)
                seen, at = n, now
            await asyncio.sleep(0.002)

    def stop(self) -> float:
        self._task.cancel()
        return self.longest


async def open_raw(url: str):
    return await websockets.connect(url, max_size=None)


async def start_raw(ws, id: str, **params) -> dict:
    await ws.send(orjson.dumps({"type": "generate", "id": id, "prompt": PROMPT, **params}).decode())
    while True:
        msg = orjson.loads(await ws.recv())
        if msg.get("id") == id and msg["type"] == "accepted":
            return msg


@pytest.mark.both_brokers
async def test_resume_after_the_gateway_dies_keeps_the_generation_and_follows_it_live(fleet):
    a, b = fleet.gateway(), fleet.gateway()
    worker = fleet.worker(backend="echo", echo_delay_ms=20)
    n, streams = 120, 8
    params = dict(max_tokens=n, ignore_eos=True, temperature=0.9)
    cb = await Client.connect(b.ws)
    refs = await asyncio.gather(*(cb.generate(f"ref{i}", PROMPT, seed=i, **params) for i in range(streams)))

    ws = await open_raw(a.ws)
    for i in range(streams):
        await ws.send(orjson.dumps({"type": "generate", "id": f"r{i}", "prompt": PROMPT, "seed": i,
                                    **params}).decode())
    accepted: dict[str, dict] = {}
    got: dict[str, list] = {f"r{i}": [] for i in range(streams)}
    while len(accepted) < streams or min(len(v) for v in got.values()) < 10:
        msg = orjson.loads(await ws.recv())
        if msg["type"] == "accepted":
            accepted[msg["id"]] = msg
        elif msg["type"] == "token":
            got[msg["id"]].append(msg)
    a.popen.send_signal(signal.SIGKILL)  # the whole gateway dies; its clients reconnect to b

    futs = {k: cb.resume(f"again-{k}", accepted[k]["request_id"], got[k][-1]["index"] + 1,
                         accepted[k]["resume_token"]) for k in accepted}
    watch = {k: Arrivals(cb.results[f"again-{k}"]) for k in accepted}
    results = await asyncio.wait_for(asyncio.gather(*futs.values()), 60)
    for i, (k, res) in enumerate(zip(futs, results)):
        assert res.end["type"] == "done", res.end
        assert res.end["finish_reason"] == "length" and res.end["usage"]["completion_tokens"] == n
        assert [t["index"] for t in got[k]] + res.indices == list(range(n))
        assert "".join(t["text"] for t in got[k]) + res.text == refs[i].text
    # followed live: no stretch of silence like the log catch-up's 2 s
    assert max(w.stop() for w in watch.values()) < 1.5
    assert "nobody listening" not in worker.log(tail=None)
    assert "request followed elsewhere" in worker.log(tail=None)
    await cb.close()


async def test_resume_of_a_request_still_queued(fleet):
    a, b = fleet.gateway(), fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=20, max_batch=1)
    cb = await Client.connect(b.ws)
    params = dict(max_tokens=30, ignore_eos=True, seed=5, temperature=0.8)
    ref = await cb.generate("ref", PROMPT, **params)
    blocker = cb.start("blocker", PROMPT, max_tokens=60, ignore_eos=True)  # holds the one slot ~1.2 s
    while not cb.results["blocker"].tokens:
        await asyncio.sleep(0.005)

    ws = await open_raw(a.ws)
    accepted = await start_raw(ws, "q", **params)
    ws.transport.abort()  # dropped while its request waits for the slot
    res = await asyncio.wait_for(cb.resume("q-again", accepted["request_id"], 0, accepted["resume_token"]), 30)
    assert res.accepted["resumed_from"] == 0
    assert res.end["type"] == "done", res.end
    assert res.indices == list(range(30)) and res.text == ref.text
    assert (await asyncio.wait_for(blocker, 30)).end["type"] == "done"
    await cb.close()


@pytest.mark.both_brokers
async def test_dead_worker_is_taken_over_within_seconds(fleet, rds, key_prefix):
    """No idle-threshold wait: the default claim_idle_ms (10 s) is left as it is, so only
    the heartbeat-based takeover can be this fast."""
    gw = fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=20)
    fleet.worker(backend="echo", echo_delay_ms=20)
    c = await Client.connect(gw.ws)
    params = dict(max_tokens=150, ignore_eos=True, seed=3, temperature=0.8)
    ref = await c.generate("ref", PROMPT, **params)
    fut = c.start("r", PROMPT, **params)
    while len(c.results["r"].tokens) < 10:
        await asyncio.sleep(0.005)
    watch = Arrivals(c.results["r"])
    pending = rds.xpending_range(f"{key_prefix}:{{tiny-gpt}}:tasks:normal", "workers", "-", "+", 10)
    info = orjson.loads(rds.hget(f"{key_prefix}:workers:tiny-gpt", pending[0]["consumer"]))
    victim = next(p for p in fleet.procs if p.name == "worker" and p.popen.pid == info["pid"])
    victim.popen.send_signal(signal.SIGKILL)
    res = await asyncio.wait_for(fut, 60)
    silence = watch.stop()
    assert res.end["type"] == "done" and res.indices == list(range(150)) and res.text == ref.text
    survivor = next(p for p in fleet.procs if p.name == "worker" and p is not victim)
    assert "took over the tasks of a dead worker" in survivor.log(tail=None)
    # dead after 1.5 s of heartbeat silence, claimed within the next 0.25 s round, then the
    # 10 tokens already sent are regenerated (~0.2 s): well under the 10 s of the idle fallback
    assert silence < 3.0, silence
    await c.close()


async def test_a_slow_worker_is_not_robbed(fleet, rds, key_prefix):
    """Each engine step takes 2.5 s, longer than the dead-after threshold: the worker still
    heartbeats (the step runs off its event loop), so nobody takes its task."""
    gw = fleet.gateway()
    slow = fleet.worker(backend="echo", echo_delay_ms=2500, max_batch=1)
    c = await Client.connect(gw.ws)
    fut = c.start("r", PROMPT, max_tokens=3, ignore_eos=True)
    lane = f"{key_prefix}:{{tiny-gpt}}:tasks:normal"
    await until_async(lambda: rds.xpending(lane, "workers")["pending"] == 1, "the slow worker to take it")
    # now a fast one joins
    fast = fleet.worker(backend="echo")
    res = await asyncio.wait_for(fut, 30)
    assert res.end["type"] == "done" and res.indices == [0, 1, 2]
    assert "took over" not in fast.log(tail=None) and "reclaimed" not in fast.log(tail=None)
    assert "taken over by another" not in slow.log(tail=None)
    await c.close()


async def _stall(server: EmbeddedRedis, seconds: float) -> None:
    server.proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        server.proc.send_signal(signal.SIGCONT)


async def test_a_redis_stall_below_the_bound_only_delays(own_redis, tiny_spec, tmp_path):
    fleet = FleetFactory(own_redis.url, "sfstall", tmp_path)
    try:
        gw = fleet.gateway()
        w1 = fleet.worker(backend="echo", echo_delay_ms=20)
        w2 = fleet.worker(backend="echo", echo_delay_ms=20)
        c = await Client.connect(gw.ws)
        futs = [c.start(f"r{i}", PROMPT, max_tokens=100, ignore_eos=True, seed=i) for i in range(4)]
        while min(len(c.results[f"r{i}"].tokens) for i in range(4)) < 10:
            await asyncio.sleep(0.005)
        await _stall(own_redis, 8.0)  # as a fork, a slow disk or a network blip would (bound: 10 s)
        results = await asyncio.wait_for(asyncio.gather(*futs), 60)
        for res in results:
            assert res.end["type"] == "done", res.end
            assert res.indices == list(range(100))
        # nobody mistook the stall for dead workers
        assert "took over" not in w1.log(tail=None) + w2.log(tail=None)
        again = await c.generate("after", PROMPT, max_tokens=5, ignore_eos=True)
        assert again.end["type"] == "done"
        await c.close()
    finally:
        fleet.close()


async def test_a_redis_stall_past_the_bound_fails_clearly_and_recovers(own_redis, tiny_spec, tmp_path):
    fleet = FleetFactory(own_redis.url, "sfstall2", tmp_path)
    try:
        gw = fleet.gateway(redis_socket_timeout_s=1.5)
        fleet.worker(backend="echo", echo_delay_ms=50, redis_socket_timeout_s=1.5)  # 240 tokens: 12 s
        c = await Client.connect(gw.ws)
        fut = c.start("r", PROMPT, max_tokens=240, ignore_eos=True)
        while len(c.results["r"].tokens) < 10:
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
        stall = asyncio.ensure_future(_stall(own_redis, 9.0))
        res = await asyncio.wait_for(fut, 30)
        failed_after = time.monotonic() - t0
        assert res.end["type"] == "error" and res.end["code"] == "broker_unavailable", res.end
        assert failed_after < 8.5, failed_after
        await stall
        async def served() -> bool:
            again = await c.generate(f"after{time.monotonic()}", PROMPT, max_tokens=5, ignore_eos=True)
            return again.end["type"] == "done"

        await until_async(served, "a request served once Redis is back", timeout=30, interval=0.5)
        await c.close()
    finally:
        fleet.close()
