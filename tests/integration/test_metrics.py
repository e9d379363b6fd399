"""Prometheus metrics on the gateway and the worker, and trace ids in the logs."""

from __future__ import annotations

import httpx
import orjson

from streamfleet.launcher import free_port
from tests.integration.wsclient import Client


def value(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in metrics")


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
        text = (await http.get(gw.http + "/metrics")).text
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
