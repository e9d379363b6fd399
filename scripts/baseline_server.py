#!/usr/bin/env python
"""The smallest server that streams like the fleet: the baseline of its broker overhead.

ONE process, no Redis: a `websockets` server speaking the fleet's frames on /v1/stream
(``generate`` -> ``accepted``, ``token``…, ``done``; ``cancel``; ``ping``), an
``asyncio.Queue`` per request, and the fleet's ``EchoEngine`` driven by a plain
continuous-batching loop with the same per-step delay. Each step mirrors the worker's:
one ``prefill`` call for the sequences admitted since the last step, then one
``decode`` call for the running ones (each call sleeps ``delay_ms`` in a thread, as the
worker runs its engine off the event loop); greedy choice of the next token; the
token's text from the model's tokenizer.

What the fleet adds on top of this (gateway process, validation, Redis Streams,
pub/sub, a second hop of framing) is what ``scripts/bench_fleet.py`` measures.

    python -m scripts.baseline_server --port 9000 --delay-ms 10 --max-batch 64

``EchoBatcher`` is also the generation loop of ``scripts/arq_baseline.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

import numpy as np
import orjson

from streamfleet.shared import aio
from streamfleet.shared.modelrepo import ModelRepository, load_tokenizer
from streamfleet.workers.engines.echo import EchoEngine

__all__ = ["EchoBatcher", "Gen", "serve"]


@dataclass(slots=True)
class Gen:
    """One generation in the batch."""

    rid: str
    prompt_ids: list[int]
    max_tokens: int
    #: called on the event loop with each step's events of this request: a list of dicts
    #: {"type": "token", "index", "text"} and finally {"type": "done", ...} (with
    #: ``on_step`` set, the batcher calls only that; it may call ``emit`` itself)
    emit: Callable[[list[dict]], None]
    last: int = -1
    emitted: int = 0
    prefilled: bool = False
    cancelled: bool = False


@dataclass
class EchoBatcher:
    """A plain continuous-batching loop over an EchoEngine (or any fleet engine:
    ``build_batcher``'s ``backend``).

    ``submit`` queues a generation; the loop admits what fits between steps, runs
    prefill (new sequences) and decode (running ones) in a thread, and hands each
    request its events through its ``emit`` callback. ``on_step`` (optional) gets every
    step's ``[(gen, events)]`` at once instead, for callers that batch their output
    (the arq harness publishes one pipeline per step, as the fleet's worker does).
    """

    engine: EchoEngine
    tokenizer: object
    max_batch: int
    on_step: Callable[[list[tuple[Gen, list[dict]]]], object] | None = None
    waiting: list[Gen] = field(default_factory=list)
    running: dict[str, Gen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._wake = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._task: asyncio.Task | None = None
        self._text: dict[int, str] = {}

    def start(self) -> EchoBatcher:
        self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._pool.shutdown(wait=False)

    def submit(self, gen: Gen) -> None:
        self.waiting.append(gen)
        self._wake.set()

    def cancel(self, rid: str) -> None:
        """End a request at the next step (``done`` with ``finish_reason: cancelled``)."""
        for gen in itertools.chain(self.running.values(), self.waiting):
            if gen.rid == rid:
                gen.cancelled = True
                self._wake.set()
                return

    def _piece(self, token: int) -> str:
        text = self._text.get(token)
        if text is None:
            text = self._text[token] = self.tokenizer.decode([token])
        return text

    def _step(self, new: list[Gen], old: list[Gen]) -> list[tuple[Gen, int]]:
        """Runs in the engine thread: one prefill call, one decode call."""
        out = []
        if new:
            logits = self.engine.prefill([(g.rid, g.prompt_ids) for g in new])
            out += zip(new, np.argmax(logits, axis=1).tolist())
        if old:
            logits = self.engine.decode([(g.rid, g.last) for g in old])
            out += zip(old, np.argmax(logits, axis=1).tolist())
        return out

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
            gone = [g for g in itertools.chain(self.running.values(), self.waiting) if g.cancelled]
            if gone:
                for gen in gone:
                    if self.running.pop(gen.rid, None) is not None:
                        self.engine.release(gen.rid)
                self.waiting = [g for g in self.waiting if not g.cancelled]
                await self._deliver([(g, [{"type": "done", "finish_reason": "cancelled", "completion_tokens": g.emitted,
                                     "prompt_tokens": len(g.prompt_ids)}]) for g in gone])
            free = self.max_batch - len(self.running)
            new, self.waiting = self.waiting[:free], self.waiting[free:]
            old = list(self.running.values())
            for g in new:
                self.running[g.rid] = g
            if not new and not old:
                continue
            results = await loop.run_in_executor(self._pool, self._step, new, old)
            step: list[tuple[Gen, list[dict]]] = []
            for gen, token in results:
                gen.last = token
                events = [{"type": "token", "index": gen.emitted, "text": self._piece(token)}]
                gen.emitted += 1
                if gen.emitted >= gen.max_tokens:
                    events.append({"type": "done", "finish_reason": "length", "completion_tokens": gen.emitted,
                                   "prompt_tokens": len(gen.prompt_ids)})
                    self.running.pop(gen.rid, None)
                    self.engine.release(gen.rid)
                step.append((gen, events))
            await self._deliver(step)

    async def _deliver(self, step: list[tuple[Gen, list[dict]]]) -> None:
        if self.on_step is not None:
            res = self.on_step(step)
            if inspect.isawaitable(res):  # e.g. a Redis pipeline: finish it before the next step
                await res
            return
        for gen, events in step:
            gen.emit(events)


def build_batcher(model: str, delay_ms: float, max_batch: int, engines_dir: str | None = None,
                  on_step=None, backend: str = "echo") -> EchoBatcher:
    """The loop over ``model``'s ``EchoEngine`` (``delay_ms`` per call), or with
    ``backend`` another of the fleet's engines (``onnxruntime``: the model's own weights,
    the same engine class a CPU worker runs)."""
    spec = ModelRepository(engines_dir).get(model)
    if backend == "echo":
        engine = EchoEngine(spec, delay_ms=delay_ms)
    else:
        from streamfleet.workers.engines import load_engine

        engine = load_engine(spec, backend)
    return EchoBatcher(engine=engine, tokenizer=load_tokenizer(spec), max_batch=min(max_batch, engine.max_batch),
                       on_step=on_step)


async def _handler(ws, batcher: EchoBatcher, ids: itertools.count) -> None:
    """One connection: frames in; per request an asyncio.Queue drained by a sender task."""
    tokenizer = batcher.tokenizer
    live: dict[str, str] = {}  # client id -> request id
    senders: set[asyncio.Task] = set()
    send_lock = asyncio.Lock()

    async def sender(cid: str, rid: str, q: asyncio.Queue) -> None:
        while True:
            events = await q.get()
            for ev in events:
                frame = {"type": ev["type"], "id": cid}
                if ev["type"] == "token":
                    frame["index"] = ev["index"]
                    frame["text"] = ev["text"]
                else:
                    frame.update(request_id=rid, finish_reason=ev["finish_reason"],
                                 usage={"prompt_tokens": ev["prompt_tokens"],
                                        "completion_tokens": ev["completion_tokens"]})
                async with send_lock:
                    await ws.send(orjson.dumps(frame).decode())
                if ev["type"] == "done":
                    live.pop(cid, None)
                    return

    try:
        async for raw in ws:
            try:
                msg = orjson.loads(raw)
            except orjson.JSONDecodeError:
                await ws.send(orjson.dumps({"type": "error", "id": None, "code": "invalid_json"}).decode())
                continue
            kind = msg.get("type")
            if kind == "ping":
                await ws.send('{"type":"pong"}')
            elif kind == "cancel":
                rid = live.get(msg.get("id"))
                if rid:
                    batcher.cancel(rid)
            elif kind == "generate":
                cid = msg.get("id")
                rid = f"r{next(ids)}"
                prompt_ids = tokenizer.encode(msg.get("prompt") or " ")
                q: asyncio.Queue = asyncio.Queue()
                live[cid] = rid
                async with send_lock:
                    await ws.send(orjson.dumps({"type": "accepted", "id": cid, "request_id": rid,
                                                "queue_depth": len(batcher.waiting)}).decode())
                t = asyncio.create_task(sender(cid, rid, q))
                senders.add(t)
                t.add_done_callback(senders.discard)
                batcher.submit(Gen(rid, prompt_ids, int(msg.get("max_tokens") or 64), q.put_nowait))
            else:
                await ws.send(orjson.dumps({"type": "error", "id": msg.get("id"), "code": "unknown_type"}).decode())
    except Exception:
        pass
    finally:
        for rid in live.values():
            batcher.cancel(rid)
        for t in senders:
            t.cancel()


async def serve(host: str, port: int, *, model: str = "tiny-gpt", delay_ms: float = 10.0, max_batch: int = 64,
                engines_dir: str | None = None, ready: Callable[[int], None] | None = None) -> None:
    """Run the baseline server until cancelled; ``ready(port)`` once listening."""
    from websockets.asyncio.server import serve as ws_serve

    batcher = build_batcher(model, delay_ms, max_batch, engines_dir).start()
    aio.settle_heap()  # as the fleet's processes do once started
    ids = itertools.count()

    def process_request(connection, request):
        if request.path in ("/healthz", "/readyz"):
            return connection.respond(HTTPStatus.OK, '{"status":"ready"}\n')
        if request.path != "/v1/stream":
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        return None

    async with ws_serve(lambda ws: _handler(ws, batcher, ids), host, port, max_size=None,
                        process_request=process_request, ping_interval=None) as server:
        bound = server.sockets[0].getsockname()[1]
        if ready:
            ready(bound)
        try:
            await asyncio.Future()
        finally:
            await batcher.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000, help="0 = any free port")
    ap.add_argument("--model", default="tiny-gpt", help="model folder (its tokenizer, max_batch, max_context)")
    ap.add_argument("--engines-dir", default=None)
    ap.add_argument("--delay-ms", type=float, default=10.0, help="echo engine: sleep per prefill / decode call")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--port-file", default=None, help="write the bound port here once listening")
    ap.add_argument("--event-loop", default="auto", choices=aio.EVENT_LOOPS,
                    help="the same choice as the fleet's SF_EVENT_LOOP (auto: uvloop when installed)")
    args = ap.parse_args()

    def ready(port: int) -> None:
        print(f"baseline server on ws://{args.host}:{port}/v1/stream", flush=True)
        if args.port_file:
            tmp = Path(args.port_file + ".tmp")
            tmp.write_text(str(port))
            tmp.replace(args.port_file)

    try:
        aio.run(serve(args.host, args.port, model=args.model, delay_ms=args.delay_ms, max_batch=args.max_batch,
                      engines_dir=args.engines_dir, ready=ready), args.event_loop)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
