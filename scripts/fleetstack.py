"""A benchmark's own fleet: a private Redis, one gateway and real-model workers, as child
processes of the benchmark (``scripts/bench_prefix.py``, ``scripts/bench_embed.py``; the
echo-engine benchmarks have theirs in ``scripts/bench_fleet.py``, which waits with
``wait_until`` too).

    with ModelStack([("smollm2-135m", threads(1)), ("smollm2-135m", threads(1))], "smollm2-135m") as st:
        httpx.post(st.url + "/v1/chat/completions", ...)
        st.metrics()  # each worker's /metrics text
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
import redis

from streamfleet.launcher import EmbeddedRedis, Fleet, free_port

__all__ = ["ModelStack", "clean_env", "threads", "wait_until"]


def wait_until(check: Callable[[], object], timeout: float, what: str,
               dead: Callable[[], list[str]] = lambda: []) -> None:
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


@dataclass
class ModelStack:
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

    def __enter__(self) -> "ModelStack":
        self.redis = EmbeddedRedis().start()
        try:
            for model, settings in self.workers:
                port = free_port()
                self.metrics_ports.append((model, port))
                self.fleet.start(f"worker {model}", ["worker"],
                                 self.env(**{**self.worker_env, **settings, "SF_MODEL": model,
                                             "SF_METRICS_PORT": str(port)}))
            self.port = free_port()
            self.fleet.start("gateway", ["gateway", "--port", str(self.port)], self.env(**self.gateway_env))
            r = redis.Redis.from_url(self.redis.url)
            try:
                for model in {m for m, _ in self.workers}:
                    n = sum(1 for m, _ in self.workers if m == model)
                    wait_until(lambda: r.hlen(f"sf:workers:{model}") >= n, 180, f"workers of {model}",
                               self.fleet.dead)
            finally:
                r.close()
            wait_until(lambda: httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200, 60, "gateway",
                       self.fleet.dead)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.fleet.stop()
        if self.redis is not None:
            self.redis.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self, model: str | None = None) -> list[str]:
        """The ``/metrics`` text of each worker (of ``model``, when given)."""
        return [httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                for m, port in self.metrics_ports if model is None or m == model]
