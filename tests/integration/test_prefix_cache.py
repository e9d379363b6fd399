"""The prefix cache and chunked prefill in a real worker process (tiny-gpt, blocks of 16
tokens, 32 tokens a step): a prompt that starts like an earlier one is not prefilled
again, the text is the same as from a worker without the cache, and the workers'
counters, heartbeat and `streamfleet status` say so (docs/scheduling.md)."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import orjson

from tests.support.ports import free_port
from tests.support.wait import until

SYSTEM = [(7 * i + 3) % 500 for i in range(100)]  # tiny-gpt: 512 tokens, context 256


def counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out = {}
    for m in re.finditer(r'^streamfleet_worker_(prompt_tokens_total|prefix_cache_lookups_total)'
                         r'\{model="tiny-gpt",(?:source|result)="(\w+)"\} (\S+)$', text, re.MULTILINE):
        out[m.group(2)] = float(m.group(3))
    return out


def complete(gw, prompt: list[int], cached: list[int] | None = None, **extra) -> str:
    r = httpx.post(gw.http + "/v1/completions", json={"model": "tiny-gpt", "prompt": prompt, "max_tokens": 12,
                                                      "temperature": 1.0, "seed": 5, "ignore_eos": True, **extra},
                   timeout=60)
    assert r.status_code == 200, r.text
    if cached is not None:  # what the SDK reads as usage.prompt_tokens_details.cached_tokens
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return r.json()["choices"][0]["text"]


def test_a_shared_prefix_is_computed_once_and_changes_nothing(module_fleet):
    """A worker with the cache, then one without it, behind one gateway."""
    gw = module_fleet.gateway()
    port = free_port()
    worker = module_fleet.worker(metrics_port=port, prefix_block_tokens=16, max_step_tokens=32)
    try:
        turns = [[*SYSTEM, 1, 2, 3], [*SYSTEM, 1, 2, 3, 40, 41, 42, 43, 44], [*SYSTEM, 9, 9]]
        before = counters(port)
        reported: list[int] = []
        with_cache = [complete(gw, p, reported) for p in turns]
        assert reported == [0, 96, 96]
        after = counters(port)
        computed = after.get("computed", 0) - before.get("computed", 0)
        cached = after.get("cached", 0) - before.get("cached", 0)
        # the first prompt is all computed (103 tokens, in chunks of 32); the others reuse
        # its 6 whole blocks (96 tokens) and compute the rest
        assert cached == 2 * 96 and computed == 103 + (108 - 96) + (102 - 96)
        assert after.get("hit", 0) - before.get("hit", 0) == 2
        def figures() -> list[dict] | None:  # the next heartbeat (every 0.5 s) carries the cache's figures
            out = subprocess.run([sys.executable, "-m", "streamfleet", "status", "--json"], capture_output=True,
                                 text=True, timeout=60, env=module_fleet.env())
            mine = [w for m in orjson.loads(out.stdout)["models"] if m["name"] == "tiny-gpt" for w in m["workers"]
                    if w["pid"] == worker.popen.pid]
            return mine if mine and mine[0]["cache_blocks"] is not None else None

        mine = until(figures, "the cache's figures in the worker's heartbeat", timeout=20)
        assert mine and mine[0]["cache_blocks"] >= 6 and 0 < mine[0]["cache_hit_rate"] <= 1
    finally:
        worker.terminate()
    plain = module_fleet.worker(prefix_cache_mb=0, max_step_tokens=0)
    try:
        assert [complete(gw, p) for p in turns] == with_cache
    finally:
        plain.terminate()
