"""A benchmark's own fleet: a private Redis, one gateway and real-model workers, as child
processes of the benchmark (``scripts/bench_prefix.py``, ``scripts/bench_embed.py``; the
echo-engine benchmarks have theirs in ``scripts/bench_fleet.py``, which waits with
``wait_fleet`` too).

    with ModelStack([("smollm2-135m", threads(1)), ("smollm2-135m", threads(1))], "smollm2-135m") as st:
        httpx.post(st.url + "/v1/chat/completions", ...)
        st.metrics()  # each worker's /metrics text
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import redis

from streamfleet.launcher import EmbeddedRedis, Fleet, free_port

__all__ = ["ModelStack", "StackLife", "chat_chunks", "clean_env", "threads", "wait_fleet", "wait_until"]


async def chat_chunks(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str] | None = None,
                      ) -> AsyncIterator[dict]:
    """The chunks of one streamed ``/v1/chat/completions`` (``body`` with ``"stream": true``)
    from the gateway at ``url``, as they arrive.

    Raises:
        RuntimeError: the gateway answered other than 200, or the stream carried an error.
    """
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            yield chunk


def wait_until(check: Callable[[], object], timeout: float, what: str,
               dead: Callable[[], list[str]] = list) -> None:
    """Poll ``check`` every 0.1 s until it is true (an exception counts as not yet).

    Raises:
        RuntimeError: ``timeout`` passed, or a process ``dead`` names exited meanwhile.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gone = dead()
        if gone:
            raise RuntimeError(f"{what}: {', '.join(gone)} exited")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def wait_fleet(redis_url: str, workers: dict[str, int], gateways: list[str], dead: Callable[[], list[str]],
               worker_timeout: float, gateway_timeout: float) -> None:
    """Wait until each model of ``workers`` has that many heartbeats in the fleet's Redis,
    then until each gateway (its base URL) answers ``/readyz``.

    Raises:
        RuntimeError: as ``wait_until``.
    """
    r = redis.Redis.from_url(redis_url)
    try:
        for model, n in workers.items():
            wait_until(lambda: r.hlen(f"sf:workers:{model}") >= n, worker_timeout, f"workers of {model}", dead)
    finally:
        r.close()
    for url in gateways:
        wait_until(lambda: httpx.get(f"{url}/readyz", timeout=1).status_code == 200, gateway_timeout,
                   f"gateway {url}", dead)


def clean_env(**values: str) -> dict[str, str]:
    """This process's environment without any streamfleet setting (``SF_*``, ``REDIS_URL``),
    unbuffered, with ``values`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.update(values)
    return env


def threads(n: int) -> dict[str, str]:
    """A worker's settings for ``n`` engine threads."""
    return {"SF_THREADS": str(n), "OMP_NUM_THREADS": str(n)}


class StackLife:
    """The life of a benchmark's fleet, for a dataclass with ``redis`` (None) and ``fleet``
    (a ``Fleet``) fields: ``with`` starts a private Redis, then ``_start`` (the processes,
    and the wait for them); whatever fails on the way stops what was started; the exit
    stops the processes, then Redis."""

    redis: EmbeddedRedis | None
    fleet: Fleet

    def _start(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self.redis = EmbeddedRedis().start()
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.fleet.stop()
        if self.redis is not None:
            self.redis.stop()


@dataclass
class ModelStack(StackLife):
    """A private Redis, one gateway (``default_model``; no gRPC, no metrics port) and one
    worker per ``(model, settings)`` in ``workers``, each with a metrics port of its own;
    ``worker_env`` goes to every worker, ``gateway_env`` to the gateway. Ready once every
    worker has a heartbeat and the gateway answers ``/readyz``."""

    workers: list[tuple[str, dict[str, str]]]
    default_model: str
    worker_env: dict[str, str] = field(default_factory=dict)
    gateway_env: dict[str, str] = field(default_factory=dict)
    redis: EmbeddedRedis | None = None
    fleet: Fleet = field(default_factory=Fleet)
    port: int = 0
    #: (model, metrics port) of each worker, in ``workers``' order
    metrics_ports: list[tuple[str, int]] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        """A child's environment: this fleet's Redis and default model, ``extra`` on top."""
        return clean_env(**{"SF_REDIS_URL": self.redis.url, "SF_LOG_LEVEL": "warning", "SF_MODEL": self.default_model,
                            "SF_DEFAULT_MODEL": self.default_model, "SF_GRPC_PORT": "0", "SF_METRICS_PORT": "0",
                            **extra})

    def _start(self) -> None:
        for model, settings in self.workers:
            port = free_port()
            self.metrics_ports.append((model, port))
            self.fleet.start(f"worker {model}", ["worker"],
                             self.env(**{**self.worker_env, **settings, "SF_MODEL": model,
                                         "SF_METRICS_PORT": str(port)}))
        self.port = free_port()
        self.fleet.start("gateway", ["gateway", "--port", str(self.port)], self.env(**self.gateway_env))
        counts = collections.Counter(m for m, _ in self.workers)
        wait_fleet(self.redis.url, counts, [self.url], self.fleet.dead, worker_timeout=180, gateway_timeout=60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self, model: str | None = None) -> list[str]:
        """The ``/metrics`` text of each worker (of ``model``, when given)."""
        return [httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                for m, port in self.metrics_ports if model is None or m == model]
