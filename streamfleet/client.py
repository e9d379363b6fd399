"""The terminal client behind `streamfleet client`."""

from __future__ import annotations

import sys
import time
from typing import TextIO

import orjson
import websockets


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
                    total = time.perf_counter() - t0
                    n = msg["usage"]["completion_tokens"]
                    ttft = (first - t0) * 1000 if first else float("nan")
                    print(f"\n\n[{msg['finish_reason']}] {n} tokens, TTFT {ttft:.0f} ms, "
                          f"{n / total:.1f} tokens/s", file=sys.stderr)
                    return 0
                elif kind == "error":
                    print(f"\nerror {msg.get('status')} {msg.get('code')}: {msg.get('message')}", file=sys.stderr)
                    return 1
    except (OSError, websockets.WebSocketException) as exc:
        print(f"cannot reach {url}: {exc}", file=sys.stderr)
        return 2
    return 1
