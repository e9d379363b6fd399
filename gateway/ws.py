"""WebSocket adapter: forwards frames between the socket, the per-connection protocol
state and the broker; all decisions live in ``gateway.protocol``."""

from __future__ import annotations

import asyncio
import uuid

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from shared.errors import StreamfleetError, UnavailableError
from shared.logging import get_logger
from shared.schema import Event

from gateway.protocol import CancelUpstream, ConnectionProtocol, Output, Send, Submit

__all__ = ["websocket_stream"]

log = get_logger("gateway.ws")

#: seconds a cancel may go unanswered before the gateway ends the request itself
CANCEL_GRACE_S = 5.0


class WebSocketSession:
    def __init__(self, ws: WebSocket, hub) -> None:
        self.ws = ws
        self.hub = hub
        self.connection_id = uuid.uuid4().hex
        s = hub.settings
        self.proto = ConnectionProtocol(hub.validator, max_inflight=s.max_inflight_per_connection,
                                        max_frame_bytes=s.max_frame_bytes)
        self.outbox: asyncio.Queue[dict | None] = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()
        self.closed = False

    # -- carrying out the protocol's outputs ----------------------------------------
    def dispatch(self, outputs: list[Output]) -> None:
        for out in outputs:
            if isinstance(out, Send):
                self.outbox.put_nowait(out.frame)
            elif isinstance(out, Submit):
                self._spawn(self._submit(out))
            elif isinstance(out, CancelUpstream):
                self._spawn(self._cancel(out.request_id))

    def on_events(self, events: list[Event]) -> None:
        self.dispatch(self.proto.receive_events(events))

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def _submit(self, sub: Submit) -> None:
        task = sub.request.to_task(self.connection_id, request_id=sub.request_id)
        try:
            depth = await self.hub.broker.submit(task)
        except StreamfleetError as exc:
            self.dispatch(self.proto.submit_failed(sub.request_id, exc))
            return
        log.info("request accepted", request_id=task.request_id, trace_id=task.trace_id, model=task.model,
                 lane=task.lane, prompt_tokens=len(task.prompt_ids), queue_depth=depth)
        self.dispatch(self.proto.submitted(sub.request_id, depth))

    async def _cancel(self, request_id: str) -> None:
        await self.hub.broker.cancel(request_id)
        if self.closed:
            return
        await asyncio.sleep(CANCEL_GRACE_S)
        self.dispatch(self.proto.cancel_expired(request_id))

    async def _send_loop(self) -> None:
        while True:
            frame = await self.outbox.get()
            if frame is None:
                return
            await self.ws.send_text(orjson.dumps(frame).decode())

    # -- the connection's life ----------------------------------------------------------
    async def run(self) -> None:
        await self.ws.accept()
        try:
            await self.hub.broker.register(self.connection_id, self.on_events)
        except UnavailableError as exc:
            await self.ws.send_text(orjson.dumps(exc.to_frame(None)).decode())
            await self.ws.close(code=1011, reason="broker unavailable")
            return
        sender = asyncio.create_task(self._send_loop(), name=f"ws-send-{self.connection_id}")
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
            self.closed = True
            self.dispatch(self.proto.close())
            await self.hub.broker.unregister(self.connection_id)
            self.outbox.put_nowait(None)
            sender.cancel()
            try:
                await sender
            except BaseException:
                pass


async def websocket_stream(ws: WebSocket) -> None:
    await WebSocketSession(ws, ws.app.state.hub).run()
