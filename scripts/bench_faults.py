#!/usr/bin/env python
"""What a client sees when fleet processes die, measured from outside.

  worker-kill   24 WebSocket streams of 300 tokens (echo engine, 20 ms/step) on 3 workers;
                the worker holding the most is SIGKILLed, then, once they run again, the
                next one. Per stream: complete and identical to an undisturbed run with the
                same seed, and the longest silence between two tokens (the takeover time:
                heartbeat silence until the dead worker is noticed, the claim, and the
                regeneration of the tokens already sent).
  gateway-kill  16 streams of 230 tokens on gateway A; A is SIGKILLed after 20 tokens each
                and every client resumes on gateway B at once. Per stream: complete and
                identical, and the longest silence after the resume.

Nothing here is a test; the figures depend on the machine.

    python -m scripts.bench_faults [--only worker-kill,gateway-kill]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import orjson
import redis
import websockets

SCRIPTS = Path(__file__).resolve().parent

from scripts.bench_fleet import MODEL, Stack, write_model  # noqa: E402
from streamfleet.bench_stats import percentile  # noqa: E402

PROMPT = "Once upon a time there was a fleet"


class Stream:
    def __init__(self, id: str) -> None:
        self.id = id
        self.request_id = ""
        self.resume_token = ""
        self.indices: list[int] = []
        self.text: list[str] = []
        self.end: dict | None = None
        self.last = 0.0
        self.longest = 0.0

    def token(self, msg: dict, now: float) -> None:
        if self.indices:
            self.longest = max(self.longest, now - self.last)
        self.last = now
        self.indices.append(msg["index"])
        self.text.append(msg["text"])


async def pump(ws, streams: dict[str, Stream], until=lambda: False) -> None:
    """Route frames to their streams until every stream ended or ``until()``."""
    try:
        while not until() and any(s.end is None for s in streams.values()):
            msg = orjson.loads(await ws.recv())
            s = streams.get(msg.get("id"))
            if s is None:
                continue
            if msg["type"] == "accepted":
                s.request_id = msg["request_id"]
                s.resume_token = msg.get("resume_token", "")
            elif msg["type"] == "token":
                s.token(msg, time.monotonic())
            elif msg["type"] in ("done", "error"):
                s.end = msg
    except websockets.ConnectionClosed:
        pass


async def run(url: str, n: int, tokens: int, prefix: str) -> dict[str, Stream]:
    ws = await websockets.connect(url, max_size=None)
    streams = {f"{prefix}{i}": Stream(f"{prefix}{i}") for i in range(n)}
    for i, sid in enumerate(streams):
        await ws.send(orjson.dumps({"type": "generate", "id": sid, "prompt": PROMPT, "max_tokens": tokens,
                                    "ignore_eos": True, "seed": i, "temperature": 0.9}).decode())
    return ws, streams


def holders(r: redis.Redis, stack: Stack) -> list:
    """Worker processes ordered by how many tasks they hold, most first."""
    pend = r.xpending_range(f"sf:{{{MODEL}}}:tasks:normal", "workers", "-", "+", 1000)
    counts: dict[str, int] = {}
    for p in pend:
        counts[p["consumer"].decode()] = counts.get(p["consumer"].decode(), 0) + 1
    pids = {k.decode(): orjson.loads(v)["pid"] for k, v in r.hgetall(f"sf:workers:{MODEL}").items()}
    by_pid = {p.pid: p for p in stack.worker_procs}
    order = sorted(counts, key=counts.get, reverse=True)
    return [(by_pid[pids[c]], counts[c]) for c in order if c in pids and pids[c] in by_pid
            and by_pid[pids[c]].poll() is None]


def verdicts(streams: dict[str, Stream], refs: dict[str, Stream], tokens: int, prefix_of=None) -> tuple[int, list]:
    ok, silences = 0, []
    for i, s in enumerate(streams.values()):
        ref = list(refs.values())[i]
        before = prefix_of(s) if prefix_of else ([], [])
        indices, text = before[0] + s.indices, "".join(before[1] + s.text)
        if s.end and s.end["type"] == "done" and indices == list(range(tokens)) and text == "".join(ref.text):
            ok += 1
        silences.append(s.longest)
    return ok, silences


def fmt(silences: list[float]) -> str:
    return (f"longest silence p50 {percentile(silences, 50):.2f} s, p99 {percentile(silences, 99):.2f} s, "
            f"max {max(silences):.2f} s")


async def worker_kill(engines: Path) -> str:
    tokens, n = 300, 24
    with Stack(engines, gateways=1, workers=3, delay_ms=20, max_batch=64) as stack:
        url = stack.urls[0].replace("http", "ws") + "/v1/stream"
        ws, refs = await run(url, n, tokens, "ref")
        await pump(ws, refs)
        await ws.close()
        r = redis.Redis.from_url(stack.redis.url)
        ws, streams = await run(url, n, tokens, "s")
        kills = []

        async def killer():
            await asyncio.sleep(1.0)
            for _ in range(2):
                victim, held = holders(r, stack)[0]
                victim.send_signal(signal.SIGKILL)
                kills.append(held)
                await asyncio.sleep(3.5)  # taken over and streaming again before the next kill

        k = asyncio.ensure_future(killer())
        await asyncio.wait_for(pump(ws, streams), 120)
        await k
        await ws.close()
        r.close()
        ok, silences = verdicts(streams, refs, tokens)
        return (f"worker-kill: {n} streams x {tokens} tokens, 3 workers, two SIGKILLs in a row (holding "
                f"{kills[0]} and {kills[1]} streams): {ok}/{n} complete and identical; {fmt(silences)}")


async def gateway_kill(engines: Path) -> str:
    tokens, n, before = 230, 16, 20
    with Stack(engines, gateways=2, workers=1, delay_ms=20, max_batch=64) as stack:
        a, b = (u.replace("http", "ws") + "/v1/stream" for u in stack.urls)
        ws, refs = await run(b, n, tokens, "ref")
        await pump(ws, refs)
        await ws.close()
        ws, first = await run(a, n, tokens, "s")
        await pump(ws, first, until=lambda: min(len(s.indices) for s in first.values()) >= before)
        stack.gateway_procs[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        wb = await websockets.connect(b, max_size=None)
        rest = {sid: Stream(sid) for sid in first}
        for sid, s in first.items():
            await wb.send(orjson.dumps({"type": "resume", "id": sid, "request_id": s.request_id,
                                        "resume_token": s.resume_token,
                                        "from_index": s.indices[-1] + 1}).decode())
        await asyncio.wait_for(pump(wb, rest), 120)
        took = time.monotonic() - t0
        await wb.close()
        ok, silences = verdicts(rest, refs, tokens, lambda s: (first[s.id].indices, first[s.id].text))
        return (f"gateway-kill: {n} streams x {tokens} tokens, gateway SIGKILLed after {before}, all resumed "
                f"on the other: {ok}/{n} complete and identical ({took:.1f} s to finish); {fmt(silences)}")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="worker-kill,gateway-kill")
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        engines = write_model(Path(tmp))
        runs = {"worker-kill": worker_kill, "gateway-kill": gateway_kill}
        for name in args.only.split(","):
            print(await runs[name](engines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
