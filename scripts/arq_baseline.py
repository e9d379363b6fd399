#!/usr/bin/env python
"""The fleet's echo workload with arq as the task queue instead of Redis Streams.

Why the hot path uses Streams: a worker blocked in XREADGROUP is woken by the XADD
itself, while an arq worker finds new jobs by polling its queue (a sorted set) every
``poll_delay`` seconds (0.5 s by default) and then takes several round trips per job
(in-progress key, job fetch, result). This harness measures what that costs in time to
first token, with everything else the same:

* worker (``python -m scripts.arq_baseline worker``): an arq ``Worker`` whose job
  ``generate(rid, prompt, max_tokens)`` hands the request to the same continuous-batching
  loop over ``EchoEngine`` as ``scripts/baseline_server.py`` (``EchoBatcher``, same
  per-step delay); each step's events are PUBLISHed in one pipeline, one message per
  request on ``arqbench:reply:{rid}``, as the fleet's worker does per connection;
* client (``run_arq_bench``, used by ``scripts/bench_fleet.py``): one pub/sub
  connection routing messages to requests; per request it subscribes to the request's
  channel, then enqueues the arq job and times the tokens, like ``streamfleet bench``.

The client talks to Redis directly (no gateway hop), which favours arq.

    python -m scripts.arq_baseline worker --redis-url redis://127.0.0.1:6379/0 --poll-delay 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time

import orjson

from streamfleet.bench_config import BenchConfig
from streamfleet.bench_stats import BenchResult, RequestRecord

__all__ = ["run_arq_bench", "worker_main", "QUEUE", "CHANNEL"]

QUEUE = "arqbench:queue"
CHANNEL = "arqbench:reply:"


# -- worker ----------------------------------------------------------------------------

async def generate(ctx, rid: str, prompt: str, max_tokens: int) -> int:
    """The arq job: run one generation on the shared batcher; returns tokens made."""
    from scripts.baseline_server import Gen

    batcher = ctx["batcher"]
    done = asyncio.get_running_loop().create_future()

    def emit(events: list[dict]) -> None:
        if not done.done() and events and events[-1]["type"] == "done":
            done.set_result(events[-1]["completion_tokens"])

    batcher.submit(Gen(rid, ctx["tokenizer"].encode(prompt or " "), int(max_tokens), emit))
    return await done


def worker_main(redis_url: str, *, delay_ms: float, max_batch: int, poll_delay: float, model: str = "tiny-gpt",
                engines_dir: str | None = None) -> None:
    from arq.connections import RedisSettings
    from arq.worker import Worker

    from scripts.baseline_server import build_batcher

    async def startup(ctx) -> None:
        r = ctx["redis"]

        async def publish(step) -> None:
            async with r.pipeline(transaction=False) as pipe:
                for gen, events in step:
                    pipe.publish(CHANNEL + gen.rid, orjson.dumps(events))
                await pipe.execute()
            for gen, events in step:
                gen.emit(events)

        batcher = build_batcher(model, delay_ms, max_batch, engines_dir, on_step=publish).start()
        ctx["batcher"] = batcher
        ctx["tokenizer"] = batcher.tokenizer

    async def shutdown(ctx) -> None:
        if "batcher" in ctx:
            await ctx["batcher"].stop()

    worker = Worker(functions=[generate], redis_settings=RedisSettings.from_dsn(redis_url), queue_name=QUEUE,
                    max_jobs=max_batch, poll_delay=poll_delay, keep_result=0, on_startup=startup,
                    on_shutdown=shutdown, handle_signals=True, job_timeout=600)
    worker.run()


# -- client ----------------------------------------------------------------------------

async def run_arq_bench(redis_url: str, *, concurrency: int, requests: int, max_tokens: int, prompt: str,
                        warmup: int = 0, timeout: float = 120.0) -> BenchResult:
    """Closed-loop clients: enqueue an arq job per request and time its tokens."""
    import redis.asyncio as aioredis
    from arq import create_pool
    from arq.connections import RedisSettings

    pool = await create_pool(RedisSettings.from_dsn(redis_url), default_queue_name=QUEUE)
    sub = aioredis.Redis.from_url(redis_url)
    ps = sub.pubsub(ignore_subscribe_messages=True)
    await ps.subscribe(CHANNEL + "_")  # keep the pub/sub connection open
    live: dict[bytes, tuple[RequestRecord, asyncio.Future]] = {}

    async def reader() -> None:
        perf = time.perf_counter
        while True:
            msg = await ps.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is None:
                continue
            now = perf()
            item = live.get(msg["channel"])
            if item is None:
                continue
            rec, fut = item
            for ev in orjson.loads(msg["data"]):
                if ev["type"] == "token":
                    rec.token_times.append(now)
                elif ev["type"] == "done":
                    rec.end = now
                    rec.tokens = ev["completion_tokens"]
                    if not fut.done():
                        fut.set_result(None)

    ids = itertools.count()
    records: list[RequestRecord] = []
    counter = {"left": 0}

    async def one(keep: bool) -> None:
        rid = f"q{next(ids)}-{time.monotonic_ns()}"
        channel = CHANNEL + rid
        rec = RequestRecord(lane="normal", start=0.0)
        fut = asyncio.get_running_loop().create_future()
        live[channel.encode()] = (rec, fut)
        await ps.subscribe(channel)
        rec.start = time.perf_counter()
        await pool.enqueue_job("generate", rid, prompt, max_tokens, _job_id=rid)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            rec.error = "timeout"
        live.pop(channel.encode(), None)
        await ps.unsubscribe(channel)
        if keep:
            records.append(rec)

    async def client(keep: bool) -> None:
        while counter["left"] > 0:
            counter["left"] -= 1
            await one(keep)

    rt = asyncio.create_task(reader())
    try:
        if warmup:
            counter["left"] = warmup
            await asyncio.gather(*(client(False) for _ in range(min(concurrency, warmup))))
        counter["left"] = requests
        t0 = time.perf_counter()
        await asyncio.gather(*(client(True) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    finally:
        rt.cancel()
        try:
            await rt
        except asyncio.CancelledError:
            pass
        await ps.aclose()
        await sub.aclose()
        await pool.aclose()
    cfg = BenchConfig(url=redis_url, transport="arq", concurrency=concurrency, requests=requests,
                      max_tokens=max_tokens, prompt=prompt)
    return BenchResult(config=cfg, records=records, wall_s=wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="run the arq worker")
    w.add_argument("--redis-url", required=True)
    w.add_argument("--delay-ms", type=float, default=10.0)
    w.add_argument("--max-batch", type=int, default=64)
    w.add_argument("--poll-delay", type=float, default=0.5, help="arq's poll_delay (its default is 0.5 s)")
    w.add_argument("--model", default="tiny-gpt")
    w.add_argument("--engines-dir", default=None)
    c = sub.add_parser("client", help="run closed-loop clients and print TTFT/ITL")
    c.add_argument("--redis-url", required=True)
    c.add_argument("--concurrency", type=int, default=1)
    c.add_argument("--requests", type=int, default=20)
    c.add_argument("--max-tokens", type=int, default=32)
    c.add_argument("--prompt", default=" ".join(["hello"] * 32))
    args = ap.parse_args()
    if args.cmd == "worker":
        worker_main(args.redis_url, delay_ms=args.delay_ms, max_batch=args.max_batch, poll_delay=args.poll_delay,
                    model=args.model, engines_dir=args.engines_dir)
    else:
        res = asyncio.run(run_arq_bench(args.redis_url, concurrency=args.concurrency, requests=args.requests,
                                        max_tokens=args.max_tokens, prompt=args.prompt))
        print(res.render())


if __name__ == "__main__":
    main()
