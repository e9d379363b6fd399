"""Random frames at a live gateway (hypothesis): the process stays healthy, every frame
gets a valid response over the socket, and only what the gateway accepted reaches a lane
stream, each task valid."""

# Moved to unit tests: what each frame is answered is the protocol's and the validator's
# decision, fuzzed in memory with the same strategies (tests/support/fuzzframes.py) and as
# many examples. Removed -> replaced by:
# - test_fuzzed_frames: 340 of its 400 examples (it runs 60 here now, about 270 frames) and
#   its per-frame rules (one answer, a well-formed error, only valid tasks) ->
#   tests/unit/test_protocol.py::
#   test_random_frames_each_get_one_valid_answer_and_only_valid_requests_become_tasks
#   (400 examples through ConnectionProtocol, Validator.check and Validator.finish)

from __future__ import annotations

import httpx
import orjson
from hypothesis import HealthCheck, given, settings, strategies as st
from websockets.sync.client import connect

from streamfleet.shared.schema import Task
from tests.support.fuzzframes import frames


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

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
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

    assert seen["frames"] >= 60
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
