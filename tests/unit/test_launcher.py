"""The launcher's readiness wait and port check, against real sockets."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from streamfleet.launcher import port_free, wait_ready


class _Fleet(BaseHTTPRequestHandler):
    """Another fleet's gateway: ready, and its /healthz names its own pid; its workers
    are ``workers`` (the gateway is ready without any)."""

    workers: dict = {"tiny-gpt": 1}

    def do_GET(self):  # noqa: N802
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
        assert not wait_ready(base, timeout=1.0, pid=1234), "another process's gateway is not ours"
        assert wait_ready(base, timeout=5.0, pid=4242)
        assert wait_ready(base, timeout=5.0)
        assert not wait_ready(base, timeout=1.0, models=("asr-en",)), "a model without a worker is not ready"
        _Fleet.workers = {"tiny-gpt": 0}
        assert not wait_ready(base, timeout=1.0), "a gateway with no live worker anywhere is not a ready fleet"
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


def test_commands_find_the_running_serve_after_flag_and_environment(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    from streamfleet.local import ServeRecord, clear_record, read_record, resolve_redis, write_record

    monkeypatch.setenv("SF_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("SF_REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert resolve_redis(None)[0] == "redis://127.0.0.1:6379/0"

    write_record(ServeRecord("redis://127.0.0.1:5555/0", "http://127.0.0.1:8000", os.getpid(), True))
    assert (tmp_path / "serve.json").stat().st_mode & 0o077 == 0, "the record is the user's own"
    url, source = resolve_redis(None)
    assert url == "redis://127.0.0.1:5555/0" and f"pid {os.getpid()}" in source
    monkeypatch.setenv("REDIS_URL", "redis://r:1/0")
    assert resolve_redis(None) == ("redis://r:1/0", "REDIS_URL")
    monkeypatch.setenv("SF_REDIS_URL", "redis://s:1/0")
    assert resolve_redis(None) == ("redis://s:1/0", "SF_REDIS_URL")
    assert resolve_redis("redis://f:1/0") == ("redis://f:1/0", "--redis-url")

    # a record whose serve has gone is ignored; only its writer removes it
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_record(ServeRecord("redis://127.0.0.1:6666/0", "", int(gone.stdout), True))
    assert read_record() is None and read_record(check_alive=False).pid == int(gone.stdout)
    clear_record(os.getpid())
    assert (tmp_path / "serve.json").exists()
    clear_record(int(gone.stdout))
    assert not (tmp_path / "serve.json").exists()
