"""End to end: real gateway and worker processes, a real redis-server, real WebSockets."""

from __future__ import annotations

import asyncio
import random
import uuid

import httpx
import orjson
import pytest
import websockets

from streamfleet.shared.schema import Wake
from tests.support.wait import until_async
from tests.support.wsclient import Client


@pytest.mark.slow
async def test_health_and_ready(fleet, rds):
    """Readiness is the gateway's (and its Redis'): ready with no worker, listing the
    workers it sees. Requests queue for a worker within SF_NO_WORKER_GRACE_S and are
    refused with 503 no_workers and Retry-After past it."""
    gw = fleet.gateway()
    strict = fleet.gateway(no_worker_grace_s=1)
    body = {"model": "tiny-gpt", "prompt": "Once", "max_tokens": 3}
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await http.get(gw.http + "/healthz")).status_code == 200
        r = await http.get(gw.http + "/readyz")
        assert r.status_code == 200 and r.json()["workers"]["tiny-gpt"] == 0, r.text
        await asyncio.sleep(1.5)  # a real clock window: past the 1 s grace, counted from the gateway's start
        r = await http.post(strict.http + "/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text
        assert r.headers["retry-after"] == "5" and "tiny-gpt" in r.json()["error"]["message"]
        queued = asyncio.ensure_future(http.post(gw.http + "/v1/completions", json=body))
        lane = f"{fleet.prefix}:{{tiny-gpt}}:tasks:normal"
        await until_async(lambda: rds.xlen(lane) >= 1, "the request queued with no worker")
        fleet.worker()  # a worker that comes within the grace serves what waited
        assert (await queued).status_code == 200
        r = await http.get(gw.http + "/readyz")
        assert r.status_code == 200 and r.json()["workers"]["tiny-gpt"] == 1
        async def served() -> bool:
            return (await http.post(strict.http + "/v1/completions", json=body)).status_code == 200

        await until_async(served, "the strict gateway to see the worker")
        # the first burst after a quiet spell longer than the grace: the requests that come
        # while the gateway reads the live workers wait for that read, none is refused
        for _ in range(3):
            await asyncio.sleep(1.5)  # a real clock window: a quiet spell longer than the 1 s grace
            burst = await asyncio.gather(*(http.post(strict.http + "/v1/completions", json=body) for _ in range(12)))
            assert [r.status_code for r in burst] == [200] * 12, [r.text for r in burst if r.status_code != 200]


@pytest.mark.slow
@pytest.mark.both_brokers
async def test_one_request_streams_in_order(fleet, rds, key_prefix):
    gw = fleet.gateway()
    fleet.worker()
    c = await Client.connect(gw.ws)
    res = await c.generate("r1", "Once upon a time", max_tokens=20, temperature=0, seed=1)
    assert res.accepted["request_id"] and res.accepted["queue_depth"] >= 1
    assert res.end["type"] == "done", res.end
    assert res.indices == list(range(len(res.tokens)))
    assert res.end["usage"]["completion_tokens"] == len(res.tokens)
    assert res.end["usage"]["prompt_tokens"] > 0
    assert res.end["finish_reason"] in ("length", "stop")
    if res.end["finish_reason"] == "length":
        assert len(res.tokens) == 20
    t = res.end["timing"]
    assert 0 <= t["queue_ms"] <= t["ttft_ms"] <= t["total_ms"]
    # the worker acked and deleted the task: the lane is empty again
    lane = f"{key_prefix}:{{tiny-gpt}}:tasks:normal"
    await until_async(lambda: rds.xlen(lane) == 0 and rds.xpending(lane, "workers")["pending"] == 0,
                      lambda: f"the task acked and deleted: {rds.xpending(lane, 'workers')}")
    # pings work on the same connection
    await c.send({"type": "ping"})
    assert (await c.next_other())["type"] == "pong"
    await c.close()


@pytest.fixture(scope="module")
def shared_gw(module_fleets):
    """A gateway and a tiny-gpt worker shared by the module's tests that only send requests."""
    fleet = module_fleets()
    gw = fleet.gateway()
    fleet.worker()
    return gw


async def test_same_seed_same_text_and_chat_messages(shared_gw):
    c = await Client.connect(shared_gw.ws)
    a = await c.generate("a", "The fleet", max_tokens=24, temperature=0.9, top_p=0.9, seed=42)
    b = await c.generate("b", "The fleet", max_tokens=24, temperature=0.9, top_p=0.9, seed=42)
    assert a.text == b.text and len(a.tokens) == len(b.tokens)
    m = await c.generate("m", prompt=None, messages=[{"role": "user", "content": "hello"}], max_tokens=5)
    assert m.end["type"] == "done"
    await c.close()


BAD_FRAMES = [
    ("not json at all", "invalid_json"),
    ("[1, 2, 3]", "invalid_frame"),
    ('{"type": 5}', "invalid_frame"),
    ('{"type": "teleport", "id": "x"}', "unknown_type"),
    ('{"type": "generate", "prompt": "hi"}', "missing_field"),
    ('{"type": "generate", "id": "x"}', "missing_field"),
    ('{"type": "generate", "id": "x", "prompt": 12}', "invalid_type"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "max_tokens": "ten"}', "invalid_type"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "max_tokens": true}', "invalid_type"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "max_tokens": 0}', "out_of_range"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "max_tokens": 1e300}', "out_of_range"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "max_tokens": 2.5}', "invalid_type"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "temperature": -1}', "out_of_range"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "temperature": 9}', "out_of_range"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "top_p": 0}', "out_of_range"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "top_k": -3}', "out_of_range"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "seed": -1}', "out_of_range"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "stop": [1]}', "invalid_type"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "priority": "urgent"}', "out_of_range"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "model": "nope"}', "unknown_model"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "model": "../etc"}', "unknown_model"),
    ('{"type": "generate", "id": "x", "prompt": ""}', "invalid_request"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "messages": []}', "missing_field"),
    ('{"type": "generate", "id": "x", "messages": [{"role": "wizard", "content": "hi"}]}', "invalid_request"),
    ('{"type": "generate", "id": "", "prompt": "hi"}', "invalid_type"),
    ('{"type": "cancel", "id": "never-sent"}', "unknown_id"),
    ('{"type": "cancel"}', "missing_field"),
]


async def test_invalid_frames_get_errors_and_nothing_is_enqueued(fleet, rds, key_prefix):
    gw = fleet.gateway()
    c = await Client.connect(gw.ws)
    for raw, code in BAD_FRAMES:
        await c.send(raw)
        err = await c.next_other()
        assert err["type"] == "error" and err["code"] == code, (raw, err)
        assert err["message"] and err["status"] in (400, 404)
    # binary frames and a prompt longer than the context
    await c.send(b"\x00\x01binary")
    assert (await c.next_other())["code"] == "binary_frame"
    await c.send({"type": "generate", "id": "long", "prompt": "word " * 2000})
    err = await c.next_other()
    assert err["code"] == "prompt_too_long" and err["id"] == "long"
    # the connection is still healthy
    await c.send({"type": "ping"})
    assert (await c.next_other())["type"] == "pong"
    await c.close()
    # nothing reached Redis: no lane stream was ever written
    for lane in ("high", "normal"):
        assert not rds.exists(f"{key_prefix}:{{tiny-gpt}}:tasks:{lane}")


async def test_duplicate_in_flight_id_is_refused(shared_gw):
    c = await Client.connect(shared_gw.ws)
    fut = c.start("dup", "Once upon a time", max_tokens=60, temperature=0, ignore_eos=True)
    await asyncio.sleep(0)
    await c.send({"type": "generate", "id": "dup", "prompt": "again"})
    err = await c.next_other()
    assert err["code"] == "duplicate_id"
    res = await asyncio.wait_for(fut, 60)
    assert res.end["type"] == "done"
    await c.close()


@pytest.mark.slow
@pytest.mark.both_brokers
async def test_cancel_stops_generation_and_frees_slot(fleet, rds, key_prefix):
    gw = fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=20)  # slow enough to cancel mid-way
    c = await Client.connect(gw.ws)
    fut = c.start("long", "Once upon a time", max_tokens=240, temperature=0.8, seed=3, stop=None,
                  ignore_eos=True)
    for _ in range(2000):
        if c.results["long"].tokens or fut.done():
            break
        await asyncio.sleep(0.005)
    assert c.results["long"].tokens, (c.results["long"], fleet.procs[1].log())
    await c.send({"type": "cancel", "id": "long"})
    res = await asyncio.wait_for(fut, 10)
    assert res.end["type"] == "done" and res.end["finish_reason"] == "cancelled"
    assert len(res.tokens) < 240
    assert res.end["usage"]["completion_tokens"] == len(res.tokens)
    lane = f"{key_prefix}:{{tiny-gpt}}:tasks:normal"
    await until_async(lambda: rds.xpending(lane, "workers")["pending"] == 0, "the cancelled task acked")
    await c.close()


async def _warm_fleet(fleet, echo_delay_ms: float) -> tuple[Client, str]:
    """A gateway and an echo worker that served one request, a client of them, and the
    worker's id (other modules' fleets may have workers on the same Redis)."""
    gw = fleet.gateway()
    worker_id = f"w{uuid.uuid4().hex[:12]}"
    fleet.worker(backend="echo", echo_delay_ms=echo_delay_ms, worker_id=worker_id)
    c = await Client.connect(gw.ws)
    warm = await c.generate("warm", "hi", max_tokens=2, ignore_eos=True)
    assert warm.end["type"] == "done", warm.end
    return c, worker_id


def _worker_sockets(rds, worker_id: str, suffix: str) -> list[dict]:
    """The worker's sockets named ``sf-worker-<id><suffix>`` in ``CLIENT LIST``."""
    return [cl for cl in rds.client_list() if cl.get("name", "") == f"sf-worker-{worker_id}{suffix}"]


@pytest.mark.slow
async def test_a_cancel_reaches_a_worker_whose_control_socket_was_killed(fleet, rds):
    c, worker_id = await _warm_fleet(fleet, 20)

    def control_sockets():
        return _worker_sockets(rds, worker_id, "-control")

    [victim] = control_sockets()  # the worker names its subscriber socket (cancels, follows, wakes)
    assert rds.client_kill_filter(_id=victim["id"]) == 1
    for _ in range(200):  # opened again by the worker, subscribed again
        fresh = [cl for cl in control_sockets() if cl["id"] != victim["id"] and int(cl.get("sub", 0)) == 3]
        if fresh:
            break
        await asyncio.sleep(0.02)
    assert fresh, rds.client_list()
    fut = c.start("long", "Once upon a time", max_tokens=240, temperature=0, ignore_eos=True)
    for _ in range(2000):
        if c.results["long"].tokens or fut.done():
            break
        await asyncio.sleep(0.005)
    await c.send({"type": "cancel", "id": "long"})
    res = await asyncio.wait_for(fut, 10)
    assert res.end["type"] == "done" and res.end["finish_reason"] == "cancelled", res.end
    assert len(res.tokens) < 240
    await c.close()


@pytest.mark.slow
async def test_an_idle_worker_waits_on_a_socket_of_its_own_and_survives_its_loss(fleet, rds):
    """An idle worker blocks on its lanes on a socket named ``sf-worker-<id>-reads``
    (its batches keep ``-commands`` to themselves); killed mid-wait, it is opened again
    and the next request is served."""
    c, worker_id = await _warm_fleet(fleet, 5)

    def reads_sockets():
        return _worker_sockets(rds, worker_id, "-reads")

    for _ in range(200):  # idle again: blocked in XREADGROUP on that socket
        blocked = [cl for cl in reads_sockets() if cl.get("cmd") == "xreadgroup" and "b" in cl.get("flags", "")]
        if blocked:
            break
        await asyncio.sleep(0.02)
    assert blocked, rds.client_list()
    assert rds.client_kill_filter(_id=blocked[0]["id"]) == 1
    res = await c.generate("after", "Once upon a time", max_tokens=5, ignore_eos=True, timeout=20)
    assert res.end["type"] == "done" and len(res.tokens) == 5, res.end
    for _ in range(200):  # idle again, on a new socket (opened by the wait after the request's end)
        if [cl for cl in reads_sockets() if cl["id"] != blocked[0]["id"]]:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(rds.client_list())
    await c.close()


@pytest.mark.slow
@pytest.mark.both_brokers
async def test_32_clients_mixed_lanes_match_single_runs(fleet):
    gw = fleet.gateway()
    fleet.worker(max_batch=16)
    rng = random.Random(5)
    prompts = ["Once upon a time", "The quick brown fox", "In the beginning", "Redis streams",
               "你好，世界", "Tokens 🚀 flow", "A", "Streaming fleets scale out"]
    combos = [dict(prompt=p, seed=100 + i, temperature=[0.0, 0.8][i % 2], max_tokens=12 + i)
              for i, p in enumerate(prompts)]
    # references: each combo alone
    solo = await Client.connect(gw.ws)
    ref = {}
    for i, combo in enumerate(combos):
        r = await solo.generate(f"ref{i}", **combo)
        assert r.end["type"] == "done", r.end
        ref[i] = r.text, len(r.tokens)
    await solo.close()

    async def one_client(k: int):
        c = await Client.connect(gw.ws)
        picks = [rng.randrange(len(combos)) for _ in range(3)]
        futs = [c.start(f"c{k}r{j}", priority=rng.choice(["high", "normal"]), **combos[i])
                for j, i in enumerate(picks)]
        results = await asyncio.wait_for(asyncio.gather(*futs), 120)
        await c.close()
        return list(zip(picks, results))

    all_results = await asyncio.gather(*(one_client(k) for k in range(32)))
    n = 0
    for per_client in all_results:
        for i, res in per_client:
            assert res.end["type"] == "done", res.end
            assert res.indices == list(range(len(res.tokens)))
            assert (res.text, len(res.tokens)) == ref[i]
            n += 1
    assert n == 96


@pytest.mark.slow
async def test_requests_on_closed_connection_are_cancelled(fleet, rds, key_prefix):
    gw = fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=20)  # slow enough to cancel mid-way
    ws = await websockets.connect(gw.ws)
    await ws.send(orjson.dumps({"type": "generate", "id": "x", "prompt": "Once", "max_tokens": 240,
                                 "ignore_eos": True}).decode())
    first = orjson.loads(await ws.recv())
    assert first["type"] == "accepted"
    await ws.recv()  # a token: the request is running
    await ws.close()
    lane = f"{key_prefix}:{{tiny-gpt}}:tasks:normal"
    for _ in range(100):
        if rds.xpending(lane, "workers")["pending"] == 0:
            break
        await asyncio.sleep(0.05)
    assert rds.xpending(lane, "workers")["pending"] == 0


@pytest.mark.slow
async def test_enqueue_survives_a_script_flush_and_wakes_busy_workers(fleet, rds, key_prefix):
    """The gateway queues through EVALSHA; a Redis that lost its scripts (restart, SCRIPT
    FLUSH) gets the script again instead of refusing work. Every queued task is announced
    on sf:wake:{model} with its lane and entry id, so a busy worker reads again at its next
    step."""
    gw = fleet.gateway()
    fleet.worker(backend="echo")
    c = await Client.connect(gw.ws)
    assert (await c.generate("a", "Once upon a time", max_tokens=3, ignore_eos=True)).end["type"] == "done"
    wake = rds.pubsub(ignore_subscribe_messages=True)
    wake.subscribe(f"{key_prefix}:wake:tiny-gpt")
    rds.script_flush()
    res = await c.generate("b", "Once upon a time", max_tokens=3, ignore_eos=True, priority="high")
    assert res.end["type"] == "done", res.end
    msg = None
    for _ in range(50):
        msg = wake.get_message(timeout=0.1)
        if msg is not None:
            break
    assert msg is not None and Wake.decode(msg["data"]).lane == "high", msg
    wake.close()
    await c.close()


@pytest.mark.slow
async def test_connections_submit_on_their_process_shared_channel(fleet, rds, key_prefix):
    """The requests that WebSocket connections submit are answered on one channel per
    gateway process (docs/architecture.md, "Reply channels"): a worker's step reaches
    them in one message, and a connection that goes away still cancels its own requests
    only."""
    from streamfleet.shared.keys import Keys
    from streamfleet.shared.schema import RequestRecord

    keys = Keys(key_prefix)
    gw = fleet.gateway()
    fleet.worker(backend="echo", echo_delay_ms=50)  # a's long request would take 12 s
    a, b = await Client.connect(gw.ws), await Client.connect(gw.ws)
    ra, rb = await a.generate("x", max_tokens=4), await b.generate("y", max_tokens=4)
    assert ra.end["type"] == rb.end["type"] == "done"
    channels = {RequestRecord.decode(rds.get(keys.request(r.accepted["request_id"]))).reply_to for r in (ra, rb)}
    assert len(channels) == 1, channels
    (channel,) = channels
    assert rds.pubsub_numsub(keys.reply(channel))[0][1] == 1

    long_a = a.start("long", max_tokens=240, ignore_eos=True)
    long_b = b.start("long", max_tokens=50, ignore_eos=True)
    await until_async(lambda: a.results["long"].tokens and b.results["long"].tokens, "both long requests' tokens")
    assert a.results["long"].tokens and not long_a.done(), a.results["long"]  # it runs
    await a.close()  # a clean close: a's request is cancelled at once, b's runs on
    res_b = await long_b
    assert res_b.end["type"] == "done" and res_b.end["finish_reason"] == "length" and len(res_b.tokens) == 50
    lane = keys.lane("tiny-gpt", "normal")
    await until_async(lambda: not (rds.xlen(lane) or rds.xpending(lane, "workers")["pending"]),
                      lambda: f"nothing left running or queued: {rds.xpending(lane, 'workers')}", timeout=5)
    await b.close()
