"""Real gateway and worker processes for integration tests: ``FleetFactory`` starts them
(each a ``Proc``) on a broker's Redis, under one key prefix, and stops them at ``close()``.
The fixtures that hand them out are in tests/integration/conftest.py."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from streamfleet.launcher import stop_processes
from streamfleet.shared.redis import sync_client
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
_prefix_counter = itertools.count()


def new_prefix() -> str:
    """A key prefix no other fleet of this test session uses."""
    return f"sft{os.getpid()}x{next(_prefix_counter)}"


@dataclass(frozen=True)
class Broker:
    """The Redis a test's fleet uses: the session's server, or the session's cluster."""

    url: str
    cluster: bool = False

    def client(self):
        return sync_client(self.url, cluster=self.cluster)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    port: int | None = None
    #: a gateway's Prometheus port (SF_METRICS_PORT)
    metrics_port: int | None = None
    #: a gateway's gRPC port (SF_GRPC_PORT)
    grpc_port: int | None = None
    extra: dict = field(default_factory=dict)
    #: the key prefix of the fleet it belongs to (its lanes: ``{prefix}:{{model}}:tasks:{lane}``)
    prefix: str = ""

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    @property
    def grpc(self) -> str:
        """The gRPC target (``host:port``)."""
        assert self.grpc_port, f"{self.name} has no gRPC port"
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        assert self.metrics_port, f"{self.name} has no metrics port"
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self, tail: int | None = 6000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
            return text[-tail:] if tail else text
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self, sig=signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


# What a gateway says when a port picked for it was taken before it could bind it
# (gateway/scrape.py for metrics, gateway/doors/grpc_server.py for gRPC).
_PORT_RACE = ("cannot listen", "port is taken")


class FleetFactory:
    def __init__(self, redis_url: str, prefix: str, tmp: Path, cluster: bool = False) -> None:
        self.redis_url = redis_url
        self.cluster = cluster
        self.prefix = prefix
        self.tmp = tmp
        self.procs: list[Proc] = []
        self._n = itertools.count()

    def env(self, **extra: object) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
        env.update(SF_REDIS_URL=self.redis_url, SF_REDIS_CLUSTER=str(self.cluster).lower(),
                   SF_KEY_PREFIX=self.prefix, SF_LOG_FORMAT="json",
                   PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        env.update({f"SF_{k.upper()}": str(v) for k, v in extra.items()})
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> Proc:
        log_path = self.tmp / f"{name}-{next(self._n)}.log"
        fh = open(log_path, "wb")  # noqa: SIM115 (the process's log, closed when it is stopped)
        p = subprocess.Popen([sys.executable, "-m", "streamfleet", *args], env=env, cwd=REPO,
                             stdout=fh, stderr=subprocess.STDOUT)
        proc = Proc(name, p, log_path, prefix=self.prefix)
        self.procs.append(proc)
        return proc

    def gateway(self, wait: bool = True, **settings: object) -> Proc:
        """A gateway on a free port, its metrics and its gRPC on others (``metrics_port=0``,
        ``grpc_port=0``: none).

        The metrics and gRPC ports are picked here, so another process (a test running
        beside this one) may take one before the gateway binds it: a gateway that could not
        listen on a port picked here is started again on other ones."""
        picked = [name for name in ("metrics_port", "grpc_port") if name not in settings]
        for attempt in range(3):
            try:
                return self._gateway({**settings, **{name: free_port() for name in picked}})
            except RuntimeError as exc:
                if not picked or attempt == 2 or not any(m in str(exc) for m in _PORT_RACE):
                    raise
        raise AssertionError("unreachable")

    def _gateway(self, settings: dict[str, object]) -> Proc:
        port_file = self.tmp / f"gw-{next(self._n)}.port"
        proc = self._spawn("gateway", ["gateway", "--port", "0", "--port-file", str(port_file)],
                           self.env(**settings))
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if not proc.alive():
                raise RuntimeError(f"gateway died:\n{proc.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{proc.log()}")
            time.sleep(0.05)
        proc.port = int(port_file.read_text())
        proc.metrics_port = int(settings["metrics_port"]) or None
        proc.grpc_port = int(settings["grpc_port"]) or None
        return proc

    def worker(self, model: str = "tiny-gpt", wait: bool = True, **settings: object) -> Proc:
        settings.setdefault("threads", 1)
        proc = self._spawn("worker", ["worker", "--model", model], self.env(model=model, **settings))
        if wait:
            self.wait_worker(proc, model)
        return proc

    def wait_worker(self, proc: Proc, model: str = "tiny-gpt", timeout: float = 60.0) -> None:
        r = sync_client(self.redis_url, cluster=self.cluster)
        key = f"{self.prefix}:workers:{model}"
        deadline = time.monotonic() + timeout
        try:
            while True:
                for blob in r.hvals(key):
                    if f'"pid":{proc.popen.pid},'.encode() in blob:
                        return
                if not proc.alive():
                    raise RuntimeError(f"worker died:\n{proc.log()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker did not register:\n{proc.log()}")
                time.sleep(0.05)
        finally:
            r.close()

    def close(self) -> None:
        stop_processes(p.popen for p in self.procs)
