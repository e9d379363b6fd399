"""Engine builds as arq jobs, one queue per GPU architecture.

A TensorRT plan only runs on the GPU architecture (and TensorRT version) it was built
for, so builds go to a queue named for the architecture and are run by a worker on a
host with such a GPU::

    streamfleet engines build MODEL --queue sm90   enqueue_job("build_engine", ...) on sf:arq:build:sm90
    streamfleet engines worker --queue sm90        an arq Worker on that queue (on a GPU host): builds the
                                                   plan into engines/MODEL/plans/ and records it in Redis
    streamfleet engines list                       what is built where (HGETALL sf:plans:*)

Redis::

    sf:arq:build:{queue}   arq's queue (a sorted set; arq's own job keys are arq:job:*, arq:result:*)
    sf:plans:{model}       hash: plan key -> JSON {path, host, trt_version, cc, built_at, seconds, key, model}

The build function is injectable (``make_worker(builder=...)``), so the control plane is
tested with a CPU function in place of TensorRT. arq polls its queue (``poll_delay``),
which is fine for jobs that take minutes; the token hot path stays on Redis Streams.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from streamfleet.shared.modelrepo import ModelRepository, ModelSpec, ensure_artifacts
from streamfleet.shared.schema import decode_plan_record, encode_plan_record

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from arq.connections import ArqRedis
    from arq.jobs import Job
    from arq.worker import Worker

    from streamfleet.workers.engines.trt_plan import BuildResult

__all__ = [
    "JOB_NAME",
    "Builder",
    "build_engine",
    "enqueue_build",
    "list_plans",
    "list_queues",
    "make_worker",
    "plans_key",
    "queue_key",
    "tensorrt_builder",
    "validate_queue",
]

#: the arq function name of a build job
JOB_NAME = "build_engine"
_QUEUE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

#: ``builder(spec, force, options) -> BuildResult``; runs in a thread (it blocks for minutes)
Builder = Callable[[ModelSpec, bool, dict[str, Any]], "BuildResult"]


def validate_queue(queue: str) -> str:
    """A queue name (``sm90``, ``sm89``, ...).

    Raises:
        ValueError: empty, too long, or characters other than letters, digits, ``._-``.
    """
    if not _QUEUE_RE.match(queue or ""):
        raise ValueError(f"queue {queue!r} must be 1-64 letters, digits, '.', '_' or '-' (e.g. sm90)")
    return queue


def queue_key(prefix: str, queue: str) -> str:
    """The arq queue of one GPU architecture: ``{prefix}:arq:build:{queue}``."""
    return f"{prefix}:arq:build:{validate_queue(queue)}"


def plans_key(prefix: str, model: str) -> str:
    """The hash of a model's built plans: ``{prefix}:plans:{model}``."""
    return f"{prefix}:plans:{model}"


def tensorrt_builder(spec: ModelSpec, force: bool, options: dict[str, Any]) -> BuildResult:
    """The real build: TensorRT on this host's GPU."""
    from streamfleet.workers.engines.trt_build import build_plan

    return build_plan(spec, force=force, options=options or None)


async def build_engine(ctx: dict[str, Any], model: str, force: bool = False,
                       options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The arq job: build (or find) ``model``'s plan here and record it in Redis.

    Returns:
        The record stored under ``{prefix}:plans:{model}``.

    Raises:
        NotFoundError: no such model in this host's repository.
        FatalError: the graph cannot be generated, or the build fails.
    """
    repo: ModelRepository = ctx["repo"]
    spec = repo.get(model)
    await asyncio.to_thread(ensure_artifacts, spec)
    result = await asyncio.to_thread(ctx["builder"], spec, bool(force), dict(options or {}))
    record = result.record(host=ctx["host"])
    record["queue"] = ctx["queue"]
    record["built"] = bool(result.built)
    await ctx["redis"].hset(plans_key(ctx["prefix"], model), result.key, encode_plan_record(record))
    return record


def make_worker(*, redis_url: str, prefix: str, queue: str, builder: Builder = tensorrt_builder,
                engines_dir: str | None = None, host: str | None = None, burst: bool = False,
                handle_signals: bool = True, poll_delay: float = 0.5, job_timeout: float = 3 * 3600) -> Worker:
    """An arq worker on ``queue``'s build queue, one build at a time (a build uses the
    whole GPU). Run it with ``worker.run()`` or ``await worker.async_run()``."""
    from arq.connections import RedisSettings
    from arq.worker import Worker, func

    return Worker(
        # a build cut short (worker stopped or killed) runs again; one that fails does not
        functions=[func(build_engine, name=JOB_NAME, timeout=job_timeout, max_tries=3)],
        queue_name=queue_key(prefix, queue),
        redis_settings=RedisSettings.from_dsn(redis_url),
        burst=burst,
        handle_signals=handle_signals,
        max_jobs=1,
        job_timeout=job_timeout,
        keep_result=24 * 3600,
        poll_delay=poll_delay,
        ctx={"repo": ModelRepository(engines_dir), "builder": builder, "host": host or socket.gethostname(),
             "prefix": prefix, "queue": queue},
    )


async def enqueue_build(redis: ArqRedis, prefix: str, queue: str, model: str, *, force: bool = False,
                        options: Mapping[str, Any] | None = None) -> Job:
    """Put a build of ``model`` on ``queue`` (``redis`` from ``arq.create_pool``).

    Raises:
        ValueError: a bad queue name.
        RuntimeError: arq refused the job.
    """
    job = await redis.enqueue_job(JOB_NAME, model, bool(force), dict(options or {}),
                                  _queue_name=queue_key(prefix, queue))
    if job is None:  # only with a duplicate _job_id, which we never pass
        raise RuntimeError("arq did not enqueue the build job")
    return job


async def list_plans(redis: aioredis.Redis, prefix: str, model: str | None = None) -> list[dict[str, Any]]:
    """Every recorded plan (of ``model``, or of all models), oldest first per model."""
    keys = [plans_key(prefix, model)] if model else sorted(
        [k async for k in redis.scan_iter(match=f"{prefix}:plans:*", count=200)], key=_text)
    out: list[dict[str, Any]] = []
    for key in keys:
        name = _text(key)[len(f"{prefix}:plans:"):]
        rows = []
        for field, blob in (await redis.hgetall(key)).items():
            try:
                rec = decode_plan_record(blob)
            except ValueError:
                rec = {"error": f"unreadable record {_text(blob)[:80]!r}"}
            rec.setdefault("key", _text(field))
            rec.setdefault("model", name)
            rows.append(rec)
        out.extend(sorted(rows, key=lambda r: (r.get("built_at") or 0)))
    return out


async def list_queues(redis: aioredis.Redis, prefix: str) -> list[dict[str, Any]]:
    """Build queues: jobs waiting, and the worker's last health check (arq writes one
    every ``health_check_interval`` under ``<queue>:health-check``)."""
    base = f"{prefix}:arq:build:"
    suffix = ":health-check"
    queues = set()
    for key in [_text(k) async for k in redis.scan_iter(match=f"{base}*", count=200)]:
        name = key[len(base):]
        if name.endswith(suffix):
            queues.add(name[: -len(suffix)])  # a worker is (or was lately) serving it
        elif _text(await redis.type(key)) == "zset":
            queues.add(name)
    out = []
    for name in sorted(queues):
        key = base + name
        health = await redis.get(key + suffix)
        out.append({"queue": name, "key": key, "queued": int(await redis.zcard(key)),
                    "health": _text(health) if health else None})
    return out


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
