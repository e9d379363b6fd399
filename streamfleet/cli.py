"""The `streamfleet` command."""

from __future__ import annotations

import asyncio
import sys
from typing import Optional

import typer

from streamfleet.keys_cli import keys_app

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="streamfleet: token-streaming LLM serving over Redis Streams.")
app.add_typer(keys_app, name="keys", help="Manage API keys: add, list, revoke (stored hashed in Redis).")


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="gateway bind address"),
    port: int = typer.Option(8000, help="gateway port (0 = any free port)"),
    model: str = typer.Option("tiny-gpt", help="model folder under engines/"),
    redis_url: Optional[str] = typer.Option(None, help="use this Redis (default: REDIS_URL, else embedded)"),
    log_format: str = typer.Option("console", help="console | json"),
) -> None:
    """Run the whole fleet locally: Redis (embedded if needed), one gateway, one CPU worker."""
    from streamfleet.launcher import serve as run

    raise typer.Exit(run(host, port, model, redis_url, log_format))


@app.command()
def gateway(
    host: Optional[str] = typer.Option(None, help="bind address [SF_HOST]"),
    port: Optional[int] = typer.Option(None, help="port, 0 = any free port [SF_PORT]"),
    redis_url: Optional[str] = typer.Option(None, help="[SF_REDIS_URL / REDIS_URL]"),
    port_file: Optional[str] = typer.Option(None, help="write the bound port to this file once listening"),
) -> None:
    """Run one gateway process (WebSocket /v1/stream, health endpoints)."""
    from shared.logging import configure_logging
    from shared.settings import GatewaySettings

    overrides = {k: v for k, v in {"host": host, "port": port, "redis_url": redis_url}.items() if v is not None}
    settings = GatewaySettings(**overrides)
    configure_logging(settings.log_level, settings.log_format, process="gateway")
    from gateway.server import run_gateway

    run_gateway(settings, port_file)


@app.command()
def worker(
    model: Optional[str] = typer.Option(None, help="model folder under engines/ [SF_MODEL]"),
    backend: Optional[str] = typer.Option(None, help="onnxruntime | tensorrt | echo [SF_BACKEND]"),
    max_batch: Optional[int] = typer.Option(None, help="override engine.toml max_batch [SF_MAX_BATCH]"),
    redis_url: Optional[str] = typer.Option(None, help="[SF_REDIS_URL / REDIS_URL]"),
    threads: Optional[int] = typer.Option(None, help="ONNX Runtime intra-op threads [SF_THREADS]"),
) -> None:
    """Run one worker process (one per GPU, or per CPU engine)."""
    from shared.logging import configure_logging
    from shared.settings import WorkerSettings

    overrides = {k: v for k, v in {"model": model, "backend": backend, "max_batch": max_batch,
                                   "redis_url": redis_url, "threads": threads}.items() if v is not None}
    settings = WorkerSettings(**overrides)
    configure_logging(settings.log_level, settings.log_format, process="worker")
    from workers.process import run_worker

    raise typer.Exit(run_worker(settings))


@app.command()
def client(
    prompt: str = typer.Argument(..., help="the prompt"),
    url: str = typer.Option("http://127.0.0.1:8000", help="gateway URL (http://host:port or ws://…/v1/stream)"),
    transport: str = typer.Option("ws", help="ws (WebSocket /v1/stream) | sse (OpenAI /v1/completions)"),
    max_tokens: int = typer.Option(64),
    temperature: float = typer.Option(0.7),
    seed: Optional[int] = typer.Option(None),
    priority: str = typer.Option("normal", help="high | normal"),
    model: Optional[str] = typer.Option(None),
) -> None:
    """Stream a completion to the terminal."""
    from streamfleet.client import stream_sse, stream_ws

    if transport not in ("ws", "sse"):
        raise typer.BadParameter("--transport must be ws or sse")
    fn = stream_ws if transport == "ws" else stream_sse
    code = asyncio.run(fn(url, prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                 priority=priority, model=model, out=sys.stdout))
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
