#!/usr/bin/env python
"""The one-process server a user could write instead of a fleet, for
``scripts/bench_peers.py``: a FastAPI app that runs the continuous-batching loop of
``scripts/baseline_server.py`` (the fleet's ``EchoEngine``, the same step delay) in its
own event loop and streams over both of the fleet's doors:

* ``POST /v1/completions`` with ``"stream": true``: OpenAI SSE chunks, then ``[DONE]``;
* ``GET /v1/stream`` (WebSocket): the fleet's frames (``generate`` → ``accepted``,
  ``token``…, ``done``).

The same ``app`` runs alone under uvicorn (``python -m scripts.peer_app --port 9000``) or
behind Ray Serve (``scripts/bench_peers.py`` wraps it in a deployment: the "same app
behind a proxy" a Ray user would write). Benchmark code: never imported by the product.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time

import orjson
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import StreamingResponse

from scripts.baseline_server import EchoBatcher, Gen, build_batcher

__all__ = ["app", "PeerState"]


class PeerState:
    """The batcher, started on first use in the serving event loop (uvicorn's, or a Ray
    Serve replica's)."""

    def __init__(self) -> None:
        self.batcher: EchoBatcher | None = None
        self.ids = itertools.count()

    def get(self) -> EchoBatcher:
        if self.batcher is None:
            self.batcher = build_batcher(os.environ.get("PEER_MODEL", "tiny-gpt"),
                                         float(os.environ.get("PEER_DELAY_MS", "10")),
                                         int(os.environ.get("PEER_MAX_BATCH", "256")),
                                         os.environ.get("PEER_ENGINES_DIR") or None,
                                         backend=os.environ.get("PEER_BACKEND", "echo")).start()
        return self.batcher


state = PeerState()
app = FastAPI()


def _submit(prompt: str, max_tokens: int) -> tuple[str, asyncio.Queue, EchoBatcher]:
    batcher = state.get()
    q: asyncio.Queue = asyncio.Queue()
    rid = f"r{next(state.ids)}"
    batcher.submit(Gen(rid, batcher.tokenizer.encode(prompt or " "), max_tokens, q.put_nowait))
    return rid, q, batcher


@app.post("/v1/completions")
async def completions(request: Request):
    body = orjson.loads(await request.body())
    rid, q, batcher = _submit(body.get("prompt") or " ", int(body.get("max_tokens") or 16))
    created = int(time.time())
    model = body.get("model") or "tiny-gpt"

    async def chunks():
        try:
            while True:
                for ev in await q.get():
                    if ev["type"] == "token":
                        yield b"data: " + orjson.dumps({
                            "id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": 0, "text": ev["text"], "logprobs": None,
                                         "finish_reason": None}]}) + b"\n\n"
                    else:
                        yield b"data: " + orjson.dumps({
                            "id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": 0, "text": "", "logprobs": None,
                                         "finish_reason": ev["finish_reason"]}]}) + b"\n\n"
                        yield b"data: [DONE]\n\n"
                        return
        finally:
            batcher.cancel(rid)

    return StreamingResponse(chunks(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@app.websocket("/v1/stream")
async def stream(ws: WebSocket):
    await ws.accept()
    lock = asyncio.Lock()
    live: dict[str, str] = {}
    tasks: set[asyncio.Task] = set()

    async def send(frame: dict) -> None:
        async with lock:
            await ws.send_text(orjson.dumps(frame).decode())

    async def relay(cid: str, rid: str, q: asyncio.Queue) -> None:
        while True:
            for ev in await q.get():
                if ev["type"] == "token":
                    await send({"type": "token", "id": cid, "index": ev["index"], "text": ev["text"]})
                else:
                    live.pop(cid, None)
                    await send({"type": "done", "id": cid, "request_id": rid, "finish_reason": ev["finish_reason"],
                                "usage": {"prompt_tokens": ev["prompt_tokens"],
                                          "completion_tokens": ev["completion_tokens"]}})
                    return

    try:
        while True:
            msg = orjson.loads(await ws.receive_text())
            kind = msg.get("type")
            if kind == "ping":
                await send({"type": "pong"})
            elif kind == "generate":
                cid = msg.get("id")
                rid, q, _ = _submit(msg.get("prompt") or " ", int(msg.get("max_tokens") or 16))
                live[cid] = rid
                await send({"type": "accepted", "id": cid, "request_id": rid, "queue_depth": 0})
                t = asyncio.create_task(relay(cid, rid, q))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            elif kind == "cancel" and msg.get("id") in live:
                state.get().cancel(live[msg["id"]])
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        for rid in live.values():
            state.get().cancel(rid)
        for t in tasks:
            t.cancel()


@app.get("/readyz")
async def readyz():
    return {"status": "ready"}


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=9000)
    args = ap.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", ws="websockets-sansio")


if __name__ == "__main__":
    main()
