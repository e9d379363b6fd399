"""The terminal client behind `streamfleet client`: one completion over the WebSocket
(/v1/stream), the OpenAI SSE endpoints (/v1/chat/completions, /v1/completions) or gRPC
(``Inference.Generate``). The text is sent as one user message when the model has a chat
template (``/v1/models`` says so), else as a raw prompt; ``chat=False`` forces the latter."""

from __future__ import annotations

import sys
import time
from typing import TextIO
from urllib.parse import urlsplit

import grpc
import httpx
import orjson
import websockets
from grpc import aio

from streamfleet.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc

#: the gateway's gRPC port unless SF_GRPC_PORT says otherwise
GRPC_PORT = 50051
#: the temperature these functions send unless told: greedy, as `streamfleet client` (its
#: own default; a request that names none gets the gateway's, ``shared.schema.DEFAULT_TEMPERATURE``)
CLIENT_TEMPERATURE = 0.0
PRIORITIES = {"normal": pb.PRIORITY_NORMAL, "high": pb.PRIORITY_HIGH}


def urls(url: str) -> tuple[str, str]:
    """``(websocket_url, http_base)`` from either a gateway base URL or a ws:// URL."""
    if url.startswith(("ws://", "wss://")):
        ws = url if url.rstrip("/").endswith("/v1/stream") else url.rstrip("/") + "/v1/stream"
        base = ("http" + ws[2:]).removesuffix("/v1/stream")
        return ws, base
    base = url.rstrip("/").removesuffix("/v1/stream")
    return "ws" + base[4:] + "/v1/stream", base


def default_grpc_target(url: str) -> str:
    """``host:50051`` for a gateway URL (http://, https://, ws:// or wss://): its gRPC
    service at the default port."""
    host = urlsplit(url).hostname or "127.0.0.1"
    return f"[{host}]:{GRPC_PORT}" if ":" in host else f"{host}:{GRPC_PORT}"


def fleet_error_code(exc: grpc.RpcError) -> str | None:
    """The fleet's error code of a failed call (its ``streamfleet-error-code`` trailer);
    None for a status the gateway did not set (unreachable, cancelled, ...)."""
    for key, value in exc.trailing_metadata() or ():
        if key == "streamfleet-error-code":
            return value
    return None


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def model_chats(url: str, model: str | None, timeout: float = 5.0, api_key: str | None = None) -> bool:
    """Whether ``model`` (None: the gateway's default model) has a chat template, as the
    gateway's ``/v1/models`` says; False when it cannot be asked."""
    _, base = urls(url)
    try:
        r = httpx.get(base + "/v1/models", timeout=timeout, headers=_auth(api_key))
        entries = r.json().get("data", []) if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return False
    texts = [e for e in entries if isinstance(e, dict) and e.get("kind", "text") == "text"]
    if model:
        chosen = [e for e in texts if e.get("id") == model]
    else:
        chosen = [e for e in texts if e.get("default")] or (texts if len(texts) == 1 else [])
    return bool(chosen and chosen[0].get("chat_template"))


def _summary(finish: str, n: int, t0: float, first: float | None, out: TextIO = sys.stdout) -> None:
    """The reply's last line ends (on ``out``); the figures go to stderr."""
    total = time.perf_counter() - t0
    ttft = (first - t0) * 1000 if first else float("nan")
    out.write("\n")
    out.flush()
    print(f"\n[{finish}] {n} tokens, TTFT {ttft:.0f} ms, {n / total:.1f} tokens/s", file=sys.stderr)


async def stream_sse(url: str, prompt: str, *, max_tokens: int = 64, temperature: float = CLIENT_TEMPERATURE,
                     seed: int | None = None, priority: str = "normal", model: str | None = None,
                     out: TextIO = sys.stdout, chat: bool = False, api_key: str | None = None) -> int:
    """Stream one completion over the OpenAI-compatible SSE endpoint (chat completions
    with ``chat``: ``prompt`` as one user message)."""
    _, base = urls(url)
    body = {"max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if seed is not None:
        body["seed"] = seed
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    first = None
    finish, n = "?", 0
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None)) as http:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            async with http.stream("POST", base + path, json=body,
                                   headers={"X-Priority": priority, **_auth(api_key)}) as r:
                if r.status_code != 200:
                    err = orjson.loads(await r.aread()).get("error", {})
                    print(f"error {r.status_code} {err.get('code')}: {err.get('message')}", file=sys.stderr)
                    return 1
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        err = chunk["error"]
                        print(f"\nerror {err.get('code')}: {err.get('message')}", file=sys.stderr)
                        return 1
                    for choice in chunk.get("choices", []):
                        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        if text:
                            if first is None:
                                first = time.perf_counter()
                            out.write(text)
                            out.flush()
                        if choice.get("finish_reason"):
                            finish = choice["finish_reason"]
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        print(f"cannot reach {base}: {exc}", file=sys.stderr)
        return 2
    _summary(finish, n, t0, first, out)
    return 0


async def stream_ws(url: str, prompt: str, *, max_tokens: int = 64, temperature: float = CLIENT_TEMPERATURE,
                    seed: int | None = None, priority: str = "normal", model: str | None = None,
                    out: TextIO = sys.stdout, chat: bool = False, api_key: str | None = None) -> int:
    """Send one generate frame (``prompt`` as one user message with ``chat``) and print
    tokens as they arrive; returns an exit code."""
    frame = {"type": "generate", "id": "cli", "max_tokens": max_tokens, "temperature": temperature,
             "priority": priority}
    if chat:
        frame["messages"] = [{"role": "user", "content": prompt}]
    else:
        frame["prompt"] = prompt
    if seed is not None:
        frame["seed"] = seed
    if model:
        frame["model"] = model
    url, _ = urls(url)
    t0 = time.perf_counter()
    first = None
    try:
        async with websockets.connect(url, max_size=None, additional_headers=_auth(api_key) or None) as ws:
            await ws.send(orjson.dumps(frame).decode())
            async for raw in ws:
                msg = orjson.loads(raw)
                kind = msg.get("type")
                if kind == "token":
                    if first is None:
                        first = time.perf_counter()
                    out.write(msg["text"])
                    out.flush()
                elif kind == "done":
                    _summary(msg["finish_reason"], msg["usage"]["completion_tokens"], t0, first, out)
                    return 0
                elif kind == "error":
                    print(f"\nerror {msg.get('status')} {msg.get('code')}: {msg.get('message')}", file=sys.stderr)
                    return 1
    except websockets.ConnectionClosed as exc:  # the gateway closed it: say why (1008 unauthorized...)
        why = f"{exc.rcvd.code} {exc.rcvd.reason}" if exc.rcvd else "connection closed"
        print(f"\nerror: the gateway closed the connection: {why}", file=sys.stderr)
        return 1
    except (OSError, websockets.WebSocketException) as exc:
        print(f"cannot reach {url}: {exc}", file=sys.stderr)
        return 2
    return 1


async def stream_grpc(target: str, prompt: str, *, max_tokens: int = 64, temperature: float = CLIENT_TEMPERATURE,
                      seed: int | None = None, priority: str = "normal", model: str | None = None,
                      out: TextIO = sys.stdout, chat: bool = False, api_key: str | None = None) -> int:
    """One ``Inference.Generate`` call to ``target`` (host:port); prints tokens as they
    arrive and returns an exit code. A refusal or failure ends the call with a status
    whose trailers carry the fleet's error code."""
    text = {"messages": [pb.ChatMessage(role="user", content=prompt)]} if chat else {"prompt": prompt}
    request = pb.GenerateRequest(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                 priority=PRIORITIES[priority], model=model or "", **text)
    t0 = time.perf_counter()
    first = None
    try:
        async with aio.insecure_channel(target) as channel:
            metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
            async for event in pb_grpc.InferenceStub(channel).Generate(request, metadata=metadata):
                kind = event.WhichOneof("event")
                if kind == "token":
                    if first is None:
                        first = time.perf_counter()
                    out.write(event.token.text)
                    out.flush()
                elif kind == "done":
                    _summary(event.done.finish_reason, event.done.usage.completion_tokens, t0, first, out)
                    return 0
    except aio.AioRpcError as exc:
        code = fleet_error_code(exc)
        if code is None and exc.code() == grpc.StatusCode.UNAVAILABLE:
            print(f"cannot reach {target}: {exc.details()}", file=sys.stderr)
            return 2
        status = exc.code().name
        print(f"\nerror {status} {code or status.lower()}: {exc.details()}", file=sys.stderr)
        return 1
    return 1
