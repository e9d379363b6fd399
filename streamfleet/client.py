"""The terminal client behind `streamfleet client`."""

from __future__ import annotations

import sys
import time
from typing import TextIO

import httpx
import orjson
import websockets


def urls(url: str) -> tuple[str, str]:
    """``(websocket_url, http_base)`` from either a gateway base URL or a ws:// URL."""
    if url.startswith(("ws://", "wss://")):
        ws = url if url.rstrip("/").endswith("/v1/stream") else url.rstrip("/") + "/v1/stream"
        base = ("http" + ws[2:]).removesuffix("/v1/stream")
        return ws, base
    base = url.rstrip("/").removesuffix("/v1/stream")
    return "ws" + base[4:] + "/v1/stream", base


def _summary(finish: str, n: int, t0: float, first: float | None) -> None:
    total = time.perf_counter() - t0
    ttft = (first - t0) * 1000 if first else float("nan")
    print(f"\n\n[{finish}] {n} tokens, TTFT {ttft:.0f} ms, {n / total:.1f} tokens/s", file=sys.stderr)


async def stream_sse(url: str, prompt: str, *, max_tokens: int = 64, temperature: float = 0.7,
                     seed: int | None = None, priority: str = "normal", model: str | None = None,
                     out: TextIO = sys.stdout) -> int:
    """Stream one completion over the OpenAI-compatible SSE endpoint."""
    _, base = urls(url)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    first = None
    finish, n = "?", 0
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None)) as http:
            async with http.stream("POST", base + "/v1/completions", json=body,
                                   headers={"X-Priority": priority}) as r:
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
                        if choice.get("text"):
                            if first is None:
                                first = time.perf_counter()
                            out.write(choice["text"])
                            out.flush()
                        if choice.get("finish_reason"):
                            finish = choice["finish_reason"]
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        print(f"cannot reach {base}: {exc}", file=sys.stderr)
        return 2
    _summary(finish, n, t0, first)
    return 0


async def stream_ws(url: str, prompt: str, *, max_tokens: int = 64, temperature: float = 0.7,
                    seed: int | None = None, priority: str = "normal", model: str | None = None,
                    out: TextIO = sys.stdout) -> int:
    """Send one generate frame and print tokens as they arrive; returns an exit code."""
    frame = {"type": "generate", "id": "cli", "prompt": prompt, "max_tokens": max_tokens,
             "temperature": temperature, "priority": priority}
    if seed is not None:
        frame["seed"] = seed
    if model:
        frame["model"] = model
    url, _ = urls(url)
    t0 = time.perf_counter()
    first = None
    try:
        async with websockets.connect(url, max_size=None) as ws:
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
                    _summary(msg["finish_reason"], msg["usage"]["completion_tokens"], t0, first)
                    return 0
                elif kind == "error":
                    print(f"\nerror {msg.get('status')} {msg.get('code')}: {msg.get('message')}", file=sys.stderr)
                    return 1
    except (OSError, websockets.WebSocketException) as exc:
        print(f"cannot reach {url}: {exc}", file=sys.stderr)
        return 2
    return 1
