"""The launcher's readiness wait and port check, against real sockets."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

from streamfleet.launcher import port_free, wait_ready


class _Fleet(BaseHTTPRequestHandler):
    """Another fleet's gateway: ready, and its /healthz names its own pid; its workers
    are ``workers`` (the gateway is ready without any)."""

    workers: ClassVar[dict] = {"tiny-gpt": 1}

    def do_GET(self):
        body = json.dumps({"status": "ok", "pid": 4242} if self.path == "/healthz"
                          else {"status": "ready", "workers": _Fleet.workers}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_readiness_wait_recognises_its_own_gateway():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fleet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert not wait_ready(base, timeout=0.1, pid=1234), "another process's gateway is not ours"
        assert wait_ready(base, timeout=5.0, pid=4242)
        assert wait_ready(base, timeout=5.0)
        assert not wait_ready(base, timeout=0.1, models=("asr-en",)), "a model without a worker is not ready"
        _Fleet.workers = {"tiny-gpt": 0}
        assert not wait_ready(base, timeout=0.1), "a gateway with no live worker anywhere is not a ready fleet"
    finally:
        _Fleet.workers = {"tiny-gpt": 1}
        server.shutdown()
        server.server_close()


def test_port_check_sees_a_listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not port_free("127.0.0.1", port)
    assert port_free("127.0.0.1", port)


def test_commands_find_the_running_serve_after_flags_and_environment(tmp_path, monkeypatch):
    import os

    from streamfleet.local import ServeRecord, clear_record, record_path, resolve_redis, write_record

    monkeypatch.setenv("SF_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("SF_REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert resolve_redis(None).url == "redis://127.0.0.1:6379/0"

    path = write_record(ServeRecord("redis://127.0.0.1:5555/0", "http://127.0.0.1:8000", os.getpid(), True),
                        record_path(8000))
    assert path == tmp_path / "serve-8000.json", "a serve's record is named by its gateway port"
    assert path.stat().st_mode & 0o077 == 0, "the record is the user's own"
    found = resolve_redis(None)
    assert found.url == "redis://127.0.0.1:5555/0" and f"pid {os.getpid()}" in found.source
    assert str(path) in found.source
    monkeypatch.setenv("REDIS_URL", "redis://r:1/0")
    assert (resolve_redis(None).url, resolve_redis(None).source) == ("redis://r:1/0", "REDIS_URL")
    monkeypatch.setenv("SF_REDIS_URL", "redis://s:1/0")
    assert (resolve_redis(None).url, resolve_redis(None).source) == ("redis://s:1/0", "SF_REDIS_URL")
    assert (resolve_redis("redis://f:1/0").url, resolve_redis("redis://f:1/0").source) == ("redis://f:1/0",
                                                                                              "--redis-url")
    # --state names the serve, before the environment
    assert resolve_redis(None, str(path)).url == "redis://127.0.0.1:5555/0"

    # only its writer removes a record
    clear_record(os.getpid() + 1, path)
    assert path.exists()
    clear_record(os.getpid(), path)
    assert not path.exists()


def test_the_embedding_worker_gets_half_the_cores():
    from streamfleet.launcher import embedding_threads

    assert [embedding_threads(n) for n in (1, 2, 3, 8, 16)] == [1, 1, 1, 4, 8]
    assert embedding_threads() >= 1  # this machine's share
