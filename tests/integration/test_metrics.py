"""Prometheus metrics on the gateway's and the worker's metrics ports (never the API port),
the API docs switch, and trace ids in the logs."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import orjson
import pytest

from tests.support.metrics import value
from tests.support.ports import free_port
from tests.support.wait import until_async
from tests.support.wsclient import Client


@pytest.mark.slow
async def test_metrics_and_trace_ids(fleet):
    gw = fleet.gateway()
    port = free_port()
    w = fleet.worker(metrics_port=port)
    c = await Client.connect(gw.ws)
    res = await c.generate("a", "Once upon a time", max_tokens=6, ignore_eos=True, priority="high")
    await c.send({"type": "generate", "id": "b", "prompt": "x", "model": "nope"})
    await c.next_other()
    async with httpx.AsyncClient() as http:
        await http.post(gw.http + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        text = (await http.get(gw.metrics_url)).text
        wtext = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    assert value(text, "streamfleet_requests_total", transport="ws", outcome="length", lane="high") == 1
    assert value(text, "streamfleet_requests_total", transport="http", outcome="length") == 1
    assert value(text, "streamfleet_tokens_streamed_total", transport="ws") == 6
    assert value(text, "streamfleet_time_to_first_token_seconds_count", transport="ws") == 1
    assert value(text, "streamfleet_inter_token_latency_seconds_count", transport="ws") == 5
    assert value(text, "streamfleet_active_connections") == 1
    assert value(text, "streamfleet_live_workers", model="tiny-gpt") == 1
    assert value(text, "streamfleet_lane_depth", model="tiny-gpt", lane="high") == 0
    assert "streamfleet_queue_time_seconds_bucket" in text
    assert value(wtext, "streamfleet_worker_tokens_generated_total", model="tiny-gpt") == 9
    assert value(wtext, "streamfleet_worker_admissions_total", lane="high") == 1
    assert value(wtext, "streamfleet_worker_slots", model="tiny-gpt") == 16
    assert "streamfleet_worker_batch_size_bucket" in wtext
    await c.close()
    # one trace id follows the request through the gateway's and the worker's log lines
    rid = res.accepted["request_id"]
    lines = [orjson.loads(line) for p in (gw, w) for line in p.log().splitlines() if line.startswith("{")]
    mine = [line for line in lines if line.get("request_id") == rid]
    assert {line["process"] for line in mine} == {"gateway", "worker"}
    assert len({line["trace_id"] for line in mine}) == 1 and mine[0]["trace_id"]
    assert not any("Once upon a time" in str(line) for line in lines)  # prompts are not logged


def test_metrics_only_on_their_own_port(fleet):
    gw = fleet.gateway()
    r = httpx.get(gw.http + "/metrics", timeout=5)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "invalid_request" and r.json()["error"]["type"] == "invalid_request_error"
    m = httpx.get(gw.metrics_url, timeout=5)
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    # the fleet gauges are read from Redis at scrape time: no worker yet
    assert value(m.text, "streamfleet_live_workers", model="tiny-gpt") == 0
    fleet.worker(backend="echo")
    assert value(httpx.get(gw.metrics_url, timeout=5).text, "streamfleet_live_workers", model="tiny-gpt") == 1
    # the metrics port serves nothing else
    base = gw.metrics_url.removesuffix("/metrics")
    for path in ("/", "/healthz", "/v1/models", "/docs"):
        assert httpx.get(base + path, timeout=5).status_code == 404, path
    assert httpx.post(gw.metrics_url, timeout=5).status_code == 405


def test_metrics_port_0_is_none_and_the_default(fleet):
    from streamfleet.shared.settings import GatewaySettings

    assert GatewaySettings.model_fields["metrics_port"].default == 0  # several gateways on one host: each needs its own
    gw = fleet.gateway(metrics_port=0)
    assert gw.metrics_port is None
    assert httpx.get(gw.http + "/metrics", timeout=5).status_code == 404
    assert '"gateway metrics"' not in gw.log()


def test_a_taken_metrics_port_stops_the_gateway_with_the_setting_named(fleet):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = fleet._spawn("gateway", ["gateway", "--port", "0"], fleet.env(metrics_port=port))
        try:
            code = proc.popen.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the gateway kept running with its metrics port taken:\n{proc.log()}")
    assert code == 2, proc.log()
    line = next(orjson.loads(ln) for ln in proc.log().splitlines() if '"gateway cannot start"' in ln)
    assert "SF_METRICS_PORT" in line["error"] and f"127.0.0.1:{port}" in line["error"], line
    assert "Traceback" not in proc.log()


def test_api_docs_off_by_default(fleet):
    gw = fleet.gateway()
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        r = httpx.get(gw.http + path, timeout=5)
        assert r.status_code == 404, path
        assert r.json()["error"]["code"] == "invalid_request", path


def test_api_docs_on_request(fleet):
    gw = fleet.gateway(api_docs=True)
    schema = httpx.get(gw.http + "/openapi.json", timeout=5)
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    for path in ("/docs", "/redoc"):
        r = httpx.get(gw.http + path, timeout=5)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"], path


@pytest.mark.slow
async def test_worker_healthz_sees_a_step_that_does_not_finish(fleet):
    """/metrics answers through a hang (its own thread); /healthz on the same port says
    503 once sequences are in flight and no step has finished for SF_WORKER_STALL_S."""
    import httpx as _httpx

    from tests.support.ports import free_port
    from tests.support.wsclient import Client

    gw = fleet.gateway()
    port = free_port()
    fleet.worker(backend="echo", echo_delay_ms=4000, metrics_port=port, worker_stall_s=1.5)
    base = f"http://127.0.0.1:{port}"
    async with _httpx.AsyncClient(timeout=5) as http:
        r = await http.get(base + "/healthz")
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        c = await Client.connect(gw.ws)
        slow = c.start("slow", "abc", max_tokens=2)
        async def stalled():
            r = await http.get(base + "/healthz")
            return r if r.status_code != 200 else None

        r = await until_async(stalled, "the worker's /healthz to say it stalled", timeout=10)
        assert r.status_code == 503 and r.json()["reason"] == "sequences in flight and no step finished", r.text
        assert r.json()["in_flight"] == 1
        assert (await http.get(base + "/metrics")).status_code == 200  # what a /metrics probe would see
        assert (await asyncio.wait_for(slow, 30)).end["type"] == "done"  # the step ends: healthy again
        assert (await http.get(base + "/healthz")).status_code == 200
        await c.close()
