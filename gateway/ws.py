"""WebSocket adapter: forwards frames between the socket, the per-connection protocol
state and the connection's reply channel; decisions live in ``gateway.protocol`` and
``gateway.streams``."""

from __future__ import annotations

import asyncio

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from shared.errors import StreamfleetError
from shared.logging import get_logger

from gateway.protocol import Cancel, ConnectionProtocol, Output, Send, Submit, accepted_frame, render
from gateway.streams import ReplyChannel, RequestStream

__all__ = ["websocket_stream"]

log = get_logger("gateway.ws")


class WebSocketSession:
    def __init__(self, ws: WebSocket, hub) -> None:
        self.ws = ws
        self.hub = hub
        s = hub.settings
        self.proto = ConnectionProtocol(hub.validator, max_inflight=s.max_inflight_per_connection,
                                        max_frame_bytes=s.max_frame_bytes)
        self.channel = ReplyChannel(hub.broker)
        self.streams: dict[str, RequestStream] = {}
        self.cancel_early: set[str] = set()  # cancelled before the submit finished
        self.outbox: asyncio.Queue[dict | None] = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()

    def send(self, frame: dict) -> None:
        self.outbox.put_nowait(frame)

    def dispatch(self, outputs: list[Output]) -> None:
        for out in outputs:
            if isinstance(out, Send):
                self.send(out.frame)
            elif isinstance(out, Submit):
                t = asyncio.create_task(self._run_request(out.request))
                self.tasks.add(t)
                t.add_done_callback(self.tasks.discard)
            elif isinstance(out, Cancel):
                stream = self.streams.get(out.client_id)
                if stream is None:
                    self.cancel_early.add(out.client_id)
                else:
                    self.channel.cancel(stream)

    async def _run_request(self, request) -> None:
        cid = request.client_id
        try:
            try:
                stream, depth = await self.channel.submit(request)
            except StreamfleetError as exc:
                self.send(exc.to_frame(cid))
                return
            self.streams[cid] = stream
            self.send(accepted_frame(cid, stream.request_id, depth))
            if cid in self.cancel_early:
                self.cancel_early.discard(cid)
                self.channel.cancel(stream)
            async for ev in stream:
                self.send(render(cid, stream.request_id, ev))
        finally:
            self.streams.pop(cid, None)
            self.proto.finished(cid)

    async def _send_loop(self) -> None:
        while True:
            frame = await self.outbox.get()
            if frame is None:
                return
            await self.ws.send_text(orjson.dumps(frame).decode())

    async def run(self) -> None:
        await self.ws.accept()
        try:
            await self.channel.open()
        except StreamfleetError as exc:
            await self.ws.send_text(orjson.dumps(exc.to_frame(None)).decode())
            await self.ws.close(code=1011, reason="broker unavailable")
            return
        sender = asyncio.create_task(self._send_loop())
        try:
            while True:
                receiver = asyncio.ensure_future(self.ws.receive())
                done, _ = await asyncio.wait({receiver, sender}, return_when=asyncio.FIRST_COMPLETED)
                if sender in done:  # the socket failed while sending
                    receiver.cancel()
                    break
                msg = receiver.result()
                if msg["type"] == "websocket.disconnect":
                    break
                if msg.get("text") is not None:
                    self.dispatch(self.proto.receive_text(msg["text"]))
                elif msg.get("bytes") is not None:
                    self.dispatch(self.proto.receive_bytes(msg["bytes"]))
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            await self.channel.close()
            for t in list(self.tasks):
                t.cancel()
            self.outbox.put_nowait(None)
            sender.cancel()
            try:
                await sender
            except BaseException:
                pass


async def websocket_stream(ws: WebSocket) -> None:
    await WebSocketSession(ws, ws.app.state.hub).run()
