"""`streamfleet serve` and `streamfleet client` as a new user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from streamfleet.launcher import free_port


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_serve_runs_everything_and_stops_cleanly(tiny_spec, tmp_path):
    port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
    env["REDIS_URL"] = "redis://127.0.0.1:1/0"  # unreachable: serve must fall back to an embedded Redis
    env["SF_THREADS"] = "1"
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "streamfleet", "serve", "--port", str(port),
                             "--metrics-port", str(metrics_port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        ready = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                pass
            if ready:
                break
            time.sleep(0.2)
        assert ready, (tmp_path / "serve.log").read_text()
        children = _descendants(proc.pid)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and "gateway" in names and "worker" in names
        # the banner says where the metrics are; they are there, and not on the API port
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        deadline = time.monotonic() + 10
        while metrics_url not in (tmp_path / "serve.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metrics_url in (tmp_path / "serve.log").read_text()
        assert "streamfleet_live_workers" in httpx.get(metrics_url, timeout=5).text
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 404

        out = subprocess.run([sys.executable, "-m", "streamfleet", "client", "Once upon a time",
                              "--url", f"ws://127.0.0.1:{port}/v1/stream", "--max-tokens", "12", "--seed", "1"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "tokens" in out.stderr and out.stdout.strip()
        sse = subprocess.run([sys.executable, "-m", "streamfleet", "client", "Once upon a time", "--transport", "sse",
                              "--url", f"http://127.0.0.1:{port}", "--max-tokens", "12", "--seed", "1"],
                             capture_output=True, text=True, timeout=60)
        assert sse.returncode == 0, sse.stderr
        assert "tokens" in sse.stderr and sse.stdout.strip()

        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [c.cmdline() for c in alive]
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in _descendants(proc.pid):
            c.kill()
