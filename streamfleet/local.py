"""Which Redis an administrative command talks to, and where `streamfleet serve` left its own.

`serve` usually starts a private Redis on a random port. So that `streamfleet status`,
`keys`, `reload` and `engines` in another shell find that fleet rather than whatever
answers on 6379, `serve` writes a small record (``serve.json``: Redis URL, API URL, its
pid) in a per-user runtime folder while it runs, and removes it when it stops.

A command's Redis is, in order: its ``--redis-url`` flag, ``SF_REDIS_URL`` or
``REDIS_URL``, the record of a `serve` that is still running, else
``redis://127.0.0.1:6379/0``. Every command says on stderr which one it uses and why.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson

__all__ = ["ServeRecord", "record_path", "write_record", "clear_record", "read_record", "resolve_redis",
           "admin_settings", "mask_url", "REDIS_FLAG_HELP"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: the --redis-url help of every administrative command
REDIS_FLAG_HELP = ("the fleet's Redis (default: SF_REDIS_URL / REDIS_URL, else the running `streamfleet serve`'s, "
                   f"else {DEFAULT_REDIS_URL})")


def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


@dataclass(frozen=True, slots=True)
class ServeRecord:
    redis_url: str
    api_url: str
    pid: int
    embedded: bool


def record_path() -> Path:
    """``$SF_STATE_DIR/serve.json``; by default in ``$XDG_RUNTIME_DIR`` (else the temporary
    folder), in a folder of this user's own."""
    folder = os.environ.get("SF_STATE_DIR")
    if not folder:
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        folder = os.path.join(base, f"streamfleet-{os.getuid()}")
    return Path(folder) / "serve.json"


def write_record(record: ServeRecord) -> Path:
    path = record_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{record.pid}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(orjson.dumps({"redis_url": record.redis_url, "api_url": record.api_url, "pid": record.pid,
                              "embedded": record.embedded}))
    os.replace(tmp, path)
    return path


def clear_record(pid: int) -> None:
    """Remove the record if it is still the one ``pid`` wrote (a later `serve` may own it)."""
    current = read_record(check_alive=False)
    if current is not None and current.pid == pid:
        try:
            record_path().unlink()
        except FileNotFoundError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_record(check_alive: bool = True) -> ServeRecord | None:
    """The running `serve`'s record; None when there is none, it is unreadable, or (with
    ``check_alive``) its process has gone."""
    try:
        d: Any = orjson.loads(record_path().read_bytes())
        rec = ServeRecord(redis_url=str(d["redis_url"]), api_url=str(d.get("api_url", "")), pid=int(d["pid"]),
                          embedded=bool(d.get("embedded", False)))
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    if check_alive and not _alive(rec.pid):
        return None
    return rec


def resolve_redis(flag: str | None) -> tuple[str, str]:
    """The Redis URL a command uses and where it came from (for the command to say)."""
    if flag:
        return flag, "--redis-url"
    for name in ("SF_REDIS_URL", "REDIS_URL"):
        if os.environ.get(name):
            return os.environ[name], name
    rec = read_record()
    if rec is not None:
        return rec.redis_url, f"the running `streamfleet serve`, pid {rec.pid}"
    return DEFAULT_REDIS_URL, "default; set SF_REDIS_URL or --redis-url for another"


def admin_settings(flag: str | None, *, quiet: bool = False) -> Any:
    """The command's ``CommonSettings`` with its Redis resolved (``resolve_redis``); says
    on stderr which Redis that is, unless ``quiet``."""
    import sys

    from streamfleet.shared.settings import CommonSettings

    url, source = resolve_redis(flag)
    if not quiet:
        print(f"redis: {mask_url(url)} ({source})", file=sys.stderr, flush=True)
    return CommonSettings(redis_url=url)
