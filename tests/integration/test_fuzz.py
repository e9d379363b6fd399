"""Thousands of random frames at a live gateway (hypothesis): the process stays healthy,
every frame gets a valid response, and nothing invalid reaches a lane stream."""

from __future__ import annotations

import json

import httpx
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from streamfleet.shared.schema import Task

FIELDS = ["type", "id", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
          "priority", "model", "request_id", "from_index", "ignore_eos", "timeout"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)
shaped = st.fixed_dictionaries(
    {"type": st.sampled_from(["generate", "cancel", "ping", "resume", "bogus", "", 5, None])},
    optional={f: json_values | st.sampled_from(["hi", "tiny-gpt", "high", "normal", "x", 1, 0.5, -1])
              for f in FIELDS if f != "type"},
)


def _encode(v) -> str:
    return json.dumps(v, allow_nan=False)


frames = st.one_of(
    shaped.map(_encode),
    json_values.map(_encode),
    st.text(max_size=200),
    st.binary(max_size=200),
    st.integers(min_value=1, max_value=3000).map(lambda n: "[" * n + "]" * n),
    st.integers(min_value=1, max_value=3000).map(lambda n: '{"a":' * n + "1" + "}" * n),
)


def test_fuzzed_frames(fleet, rds, key_prefix):
    gw = fleet.gateway(max_inflight_per_connection=1000)
    seen = {"frames": 0, "accepted": 0}
    with connect(gw.ws, max_size=None) as ws:

        def roundtrip(frame) -> dict:
            ws.send(frame)
            while True:
                msg = orjson.loads(ws.recv(timeout=10))
                # a cancelled request may end later, asynchronously: not a reply to this frame
                if msg["type"] in ("token", "done") or (msg["type"] == "error" and msg.get("code") == "timeout"):
                    continue
                return msg

        @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(frames, min_size=1, max_size=8))
        def check(batch):
            for frame in batch:
                reply = roundtrip(frame)
                seen["frames"] += 1
                assert reply["type"] in ("error", "pong", "accepted"), reply
                if reply["type"] == "error":
                    assert isinstance(reply["code"], str) and reply["message"] and 400 <= reply["status"] < 600
                if reply["type"] == "accepted":
                    seen["accepted"] += 1

        check()
        # a flood of pings on the same connection
        for _ in range(500):
            ws.send('{"type":"ping"}')
        pongs = 0
        while pongs < 500:
            msg = orjson.loads(ws.recv(timeout=10))
            assert msg["type"] in ("pong", "done", "token", "error"), msg
            pongs += msg["type"] == "pong"

    assert seen["frames"] >= 1000
    assert httpx.get(gw.http + "/healthz").status_code == 200 and gw.alive()
    # only requests the gateway accepted reached the lanes, and each of them is valid
    total = 0
    for lane in ("high", "normal"):
        key = f"{key_prefix}:{{tiny-gpt}}:tasks:{lane}"
        if not rds.exists(key):
            continue
        info = rds.xinfo_stream(key)
        total += info["entries-added"]
        for _id, fields in rds.xrange(key):
            task = Task.decode(fields[b"task"])
            p = task.params
            assert task.prompt_ids and len(task.prompt_ids) < 256
            assert 1 <= p.max_tokens <= 4096 and 0 <= p.temperature <= 2 and 0 < p.top_p <= 1 and p.top_k >= 0
            assert task.lane == lane and task.model == "tiny-gpt"
    assert total == seen["accepted"]
