"""Which Redis an administrative command uses (streamfleet/local.py) with several
`streamfleet serve`s on one machine, with one that has stopped, and with none: each serve
has a record of its own, a stale record is named and not used, several live ones are
refused unless `--state` picks one, and every command names the Redis it uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamfleet.local import DEFAULT_REDIS_URL, AdminRedisError, ServeRecord, record_path, resolve_redis, write_record


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SF_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("SF_REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    return tmp_path


@pytest.fixture
def other_serve():
    """A live process standing for a second `serve` (its pid is all a record needs)."""
    proc = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _gone_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def _admin(args: list[str], state_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k != "REDIS_URL"}
    env["SF_STATE_DIR"] = str(state_dir)
    return subprocess.run([sys.executable, "-m", "streamfleet", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_two_serves_keep_two_records_and_a_command_refuses_to_guess(state, other_serve, monkeypatch):
    mine = write_record(ServeRecord("redis://127.0.0.1:5001/0", "http://127.0.0.1:8000", os.getpid(), True),
                        record_path(8000))
    theirs = write_record(ServeRecord("redis://127.0.0.1:5002/0", "http://127.0.0.1:8001", other_serve, True),
                          record_path(8001))
    assert mine != theirs and mine.exists() and theirs.exists(), "the second serve does not overwrite the first's"

    with pytest.raises(AdminRedisError) as refused:
        resolve_redis(None)
    message = str(refused.value)
    assert "2 `streamfleet serve`s are running" in message and "--state" in message
    assert str(mine) in message and str(theirs) in message
    assert "5001" in message and "5002" in message

    # --state picks either; the environment still wins over the records
    assert resolve_redis(None, str(mine)).url == "redis://127.0.0.1:5001/0"
    assert resolve_redis(None, str(theirs)).url == "redis://127.0.0.1:5002/0"
    assert str(theirs) in resolve_redis(None, str(theirs)).source
    with pytest.raises(AdminRedisError, match="not both"):
        resolve_redis("redis://x:1/0", str(mine))
    monkeypatch.setenv("SF_REDIS_URL", "redis://env:1/0")
    assert resolve_redis(None).url == "redis://env:1/0"
    monkeypatch.delenv("SF_REDIS_URL")

    # the command says so and stops before touching any Redis
    out = _admin(["status"], state)
    assert out.returncode == 2, out.stderr
    assert "2 `streamfleet serve`s are running" in out.stderr and str(theirs) in out.stderr
    out = _admin(["keys", "list", "--state", str(state / "nowhere.json")], state)
    assert out.returncode == 2 and "no `streamfleet serve` record there" in out.stderr, out.stderr


def test_a_stopped_serve_is_named_and_the_default_is_said(state):
    gone = _gone_pid()
    stale = write_record(ServeRecord("redis://127.0.0.1:5003/0", "http://127.0.0.1:8002", gone, True),
                         record_path(8002))
    found = resolve_redis(None)
    assert found.url == DEFAULT_REDIS_URL
    assert "the default" in found.source and "no `streamfleet serve` is running" in found.source
    [note] = found.notes
    assert str(stale) in note and f"pid {gone}" in note and "no longer running" in note
    assert not stale.exists(), "a stale record is removed"
    assert resolve_redis(None).notes == [], "and said once"

    # --state naming a serve that has stopped is refused, not silently replaced by the default
    write_record(ServeRecord("redis://127.0.0.1:5003/0", "http://127.0.0.1:8002", gone, True), stale)
    with pytest.raises(AdminRedisError) as refused:
        resolve_redis(None, str(stale))
    assert "is stale" in str(refused.value) and f"pid {gone}" in str(refused.value)
    write_record(ServeRecord("redis://127.0.0.1:5003/0", "http://127.0.0.1:8002", gone, True), stale)
    out = _admin(["engines", "list", "--state", str(stale)], state)
    assert out.returncode == 2, out.stderr
    assert f"{stale} is stale" in out.stderr and "Traceback" not in out.stderr


def test_every_administrative_command_names_its_redis(state):
    """With an unreachable Redis named on the command line: the line naming it comes
    first, then the command's own error."""
    url = "redis://127.0.0.1:1/0"
    for args in (["status"], ["keys", "list"], ["engines", "list"], ["reload", "tiny-gpt", "--to", "1"]):
        out = _admin([*args, "--redis-url", url], state)
        assert f"redis: {url} (--redis-url)" in out.stderr.splitlines()[0], (args, out.stderr)
