"""A small real WebSocket client for the tests (the `websockets` library)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import ClassVar

import orjson
import websockets


@dataclass
class Result:
    id: str
    accepted: dict | None = None
    tokens: list[dict] = field(default_factory=list)
    end: dict | None = None

    @property
    def text(self) -> str:
        return "".join(t["text"] for t in self.tokens)

    @property
    def indices(self) -> list[int]:
        return [t["index"] for t in self.tokens]


#: sentinel: resume with the token an ``accepted`` frame of this test process returned
KNOWN = object()


class Client:
    """One connection; `generate` many requests concurrently; frames routed by id."""

    #: request_id -> resume_token of every ``accepted`` frame any client here received
    tokens: ClassVar[dict[str, str]] = {}

    def __init__(self, ws) -> None:
        self.ws = ws
        self.results: dict[str, Result] = {}
        self.waiters: dict[str, asyncio.Future] = {}
        self.other: asyncio.Queue = asyncio.Queue()
        self.end_order: list[str] = []  # ids in the order their final frame arrived
        self._sending: set[asyncio.Future] = set()
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, url: str, **kw) -> Client:
        return cls(await websockets.connect(url, max_size=None, **kw))

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                msg = orjson.loads(raw)
                rid = msg.get("id")
                res = self.results.get(rid) if rid is not None else None
                if res is None or (msg["type"] == "error" and (res.end is not None or msg["code"] == "duplicate_id")):
                    await self.other.put(msg)
                    continue
                kind = msg["type"]
                if kind == "accepted":
                    res.accepted = msg
                    if msg.get("resume_token"):
                        Client.tokens[msg["request_id"]] = msg["resume_token"]
                elif kind == "token":
                    res.tokens.append(msg)
                elif kind in ("done", "error", "embeddings"):  # (an embed's answer is its end)
                    res.end = msg
                    self.end_order.append(rid)
                    fut = self.waiters.pop(rid, None)
                    if fut and not fut.done():
                        fut.set_result(res)
                else:
                    await self.other.put(msg)
        except websockets.ConnectionClosed:
            pass
        finally:
            for fut in self.waiters.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("connection closed"))

    async def send(self, frame: dict | str | bytes) -> None:
        if isinstance(frame, dict):
            frame = orjson.dumps(frame).decode()
        await self.ws.send(frame)

    def send_soon(self, frame: dict | str | bytes) -> None:
        """Send ``frame`` without waiting for it; the task is held until it is done (the
        event loop keeps only a weak reference to it)."""
        task = asyncio.ensure_future(self.send(frame))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def start(self, id: str, prompt: str = "Once upon a time", **fields) -> asyncio.Future:
        self.results[id] = Result(id)
        fut = asyncio.get_running_loop().create_future()
        self.waiters[id] = fut
        frame = {"type": "generate", "id": id, "prompt": prompt, **fields}
        self.send_soon(frame)
        return fut

    def start_embed(self, id: str, input, model: str, **fields) -> asyncio.Future:
        """Send an ``embed`` frame; the future is its ``Result``, whose ``end`` is the
        ``embeddings`` frame (or ``error``, or ``done`` when cancelled)."""
        self.results[id] = Result(id)
        fut = asyncio.get_running_loop().create_future()
        self.waiters[id] = fut
        self.send_soon({"type": "embed", "id": id, "model": model, "input": input, **fields})
        return fut

    async def embed(self, id: str, input, model: str, timeout: float = 60, **fields) -> Result:
        return await asyncio.wait_for(self.start_embed(id, input, model, **fields), timeout)

    def resume(self, id: str, request_id: str, from_index: int, resume_token=KNOWN) -> asyncio.Future:
        """Resume ``request_id``; by default with the resume token its ``accepted`` frame
        carried (auth off), ``resume_token=None`` sends none."""
        self.results[id] = Result(id)
        fut = asyncio.get_running_loop().create_future()
        self.waiters[id] = fut
        frame = {"type": "resume", "id": id, "request_id": request_id, "from_index": from_index}
        token = Client.tokens.get(request_id) if resume_token is KNOWN else resume_token
        if token is not None:
            frame["resume_token"] = token
        self.send_soon(frame)
        return fut

    async def generate(self, id: str, prompt: str = "Once upon a time", timeout: float = 60, **fields) -> Result:
        return await asyncio.wait_for(self.start(id, prompt, **fields), timeout)

    async def next_other(self, timeout: float = 10) -> dict:
        return await asyncio.wait_for(self.other.get(), timeout)

    async def close(self) -> None:
        await self.ws.close()
        self.reader.cancel()
