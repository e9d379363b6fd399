"""Redis stops mid-stream and comes back: no hang, clear errors, recovery by itself."""

from __future__ import annotations

import asyncio
import time

import httpx

from streamfleet.launcher import EmbeddedRedis
from tests.integration.conftest import FleetFactory
from tests.integration.wsclient import Client


async def test_redis_outage_ends_requests_and_service_resumes(own_redis, tiny_spec, tmp_path):
    fleet = FleetFactory(own_redis.url, "sfout", tmp_path)
    restarted = None
    try:
        gw = fleet.gateway()
        w = fleet.worker(backend="echo", echo_delay_ms=30)
        c = await Client.connect(gw.ws)
        fut = c.start("r", "Once upon a time", max_tokens=200, ignore_eos=True)
        while len(c.results["r"].tokens) < 5:
            await asyncio.sleep(0.01)

        own_redis.proc.terminate()  # Redis goes away mid-stream
        own_redis.proc.wait(10)
        t0 = time.monotonic()
        res = await asyncio.wait_for(fut, 30)
        ended_after = time.monotonic() - t0
        assert res.end["type"] == "error" and res.end["code"] == "broker_unavailable", res.end
        assert res.end["status"] == 503
        assert ended_after < 10, ended_after

        async with httpx.AsyncClient(timeout=15) as http:
            r = await http.post(gw.http + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "broker_unavailable"
            assert "retry-after" in r.headers
            assert (await http.get(gw.http + "/readyz")).status_code == 503
            assert (await http.get(gw.http + "/healthz")).status_code == 200
        more = await c.generate("during", "hi", max_tokens=2, timeout=15)
        assert more.end["type"] == "error" and more.end["status"] == 503
        assert gw.alive() and w.alive()

        # Redis comes back (empty: it persisted nothing); everyone reconnects by themselves
        restarted = EmbeddedRedis(port=own_redis.port, binary=own_redis.binary).start()
        async with httpx.AsyncClient(timeout=15) as http:
            deadline = time.monotonic() + 30
            while (await http.get(gw.http + "/readyz")).status_code != 200:
                assert time.monotonic() < deadline, gw.log() + w.log()
                await asyncio.sleep(0.2)
        again = await c.generate("after", "Once upon a time", max_tokens=5, ignore_eos=True)
        assert again.end["type"] == "done" and len(again.tokens) == 5, again.end
        await c.close()
    finally:
        fleet.close()
        if restarted is not None:
            restarted.stop()


async def test_worker_told_to_stop_while_redis_is_down_still_stops(own_redis, tiny_spec, tmp_path):
    """SIGTERM to a worker whose Redis went away mid-step: it cannot finish the step (its
    events cannot be published) nor hand its task back, yet it exits once the drain's
    deadline passes, instead of retrying forever; the task stays pending in the lane for
    a live worker to reclaim when Redis is back."""
    fleet = FleetFactory(own_redis.url, "sfstop", tmp_path)
    try:
        gw = fleet.gateway()
        w = fleet.worker(backend="echo", echo_delay_ms=30, drain_timeout_s=1)
        c = await Client.connect(gw.ws)
        c.start("r", "Once upon a time", max_tokens=500, ignore_eos=True)
        while len(c.results["r"].tokens) < 5:
            await asyncio.sleep(0.01)
        own_redis.proc.terminate()
        own_redis.proc.wait(10)
        await asyncio.sleep(0.5)  # the worker's next publish fails: its step is cut short
        t0 = time.monotonic()
        w.popen.terminate()
        code = await asyncio.to_thread(w.popen.wait, 30)
        assert code == 0, w.log()
        assert time.monotonic() - t0 < 15, w.log()
        await c.close()
    finally:
        fleet.close()
