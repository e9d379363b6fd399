"""What a `streamfleet bench` run is to do: ``BenchConfig`` (transport, load shape,
request size, lane, limits) and ``BenchError`` for a run that cannot start.

Each request asks for a fixed number of tokens (``ignore_eos: true``), so every run of
the same settings moves the same amount of text. The run itself is ``streamfleet/bench.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BenchConfig", "BenchError", "LANES", "TRANSPORTS"]

TRANSPORTS = ("ws", "sse", "grpc")
LANES = ("high", "normal", "mixed")


class BenchError(Exception):
    """The benchmark could not run at all (bad settings, gateway unreachable)."""


@dataclass
class BenchConfig:
    """What to run. ``requests`` and ``duration`` may both be set (whichever ends
    first); with neither, 100 requests."""

    url: str = "http://127.0.0.1:8000"
    transport: str = "ws"
    #: gRPC host:port; None = the url's host, port 50051 (``run_bench`` fills it in)
    grpc_target: str | None = None
    concurrency: int = 8
    requests: int | None = None
    duration: float | None = None
    #: open loop: mean requests per second (Poisson arrivals); None = closed loop
    rate: float | None = None
    #: approximate prompt length: the word "hello" repeated (ignored when ``prompt`` is set)
    prompt_tokens: int = 32
    prompt: str | None = None
    max_tokens: int = 64
    #: high | normal | mixed (half and half, at random)
    lane: str = "normal"
    model: str | None = None
    temperature: float = 0.0
    api_key: str | None = None
    #: seconds one request may take before it counts as a ``timeout`` error
    timeout: float = 120.0
    #: requests run (closed loop, same concurrency) before measuring; not counted
    warmup: int = 0
    seed: int = 0
    #: per-message deflate on WebSockets (browsers negotiate it); off measures the fleet, not zlib
    compression: bool = False
    #: draw a progress line on stderr
    progress: bool = False

    def check(self) -> None:
        """Raises BenchError for settings that cannot run."""
        if self.transport not in TRANSPORTS:
            raise BenchError(f"transport must be one of {', '.join(TRANSPORTS)}, not {self.transport!r}")
        if self.lane not in LANES:
            raise BenchError(f"lane must be one of {', '.join(LANES)}, not {self.lane!r}")
        if self.concurrency < 1:
            raise BenchError("concurrency must be at least 1")
        if self.requests is not None and self.requests < 1:
            raise BenchError("requests must be at least 1")
        if self.duration is not None and self.duration <= 0:
            raise BenchError("duration must be > 0")
        if self.rate is not None and self.rate <= 0:
            raise BenchError("rate must be > 0")
        if self.max_tokens < 1:
            raise BenchError("max_tokens must be at least 1")
        if self.prompt is None and self.prompt_tokens < 1:
            raise BenchError("prompt_tokens must be at least 1")
        if not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise BenchError(f"url must start with http://, https://, ws:// or wss://, not {self.url!r}")

    @property
    def total_requests(self) -> int | None:
        if self.requests is None and self.duration is None:
            return 100
        return self.requests

    def prompt_text(self) -> str:
        return self.prompt if self.prompt is not None else " ".join(["hello"] * self.prompt_tokens)

    def describe(self) -> str:
        """The load in words: mode, prompt, tokens per request, lane."""
        c = self
        mode = f"open loop at {c.rate:g} req/s" if c.rate else f"closed loop, concurrency {c.concurrency}"
        prompt = f"prompt {len(c.prompt)} chars" if c.prompt is not None else f"prompt ~{c.prompt_tokens} tokens"
        return f"{mode}, {prompt}, {c.max_tokens} max tokens, lane {c.lane}"
