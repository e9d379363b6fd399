"""Which Redis an administrative command talks to, and where `streamfleet serve` left its own.

`serve` usually starts a private Redis on a random port. So that `streamfleet status`,
`keys`, `reload` and `engines` in another shell find that fleet rather than whatever
answers on 6379, each `serve` writes a small record of its own (``serve-PORT.json``,
named by its gateway port: Redis URL, API URL, its pid) in a per-user state folder while
it runs (or at ``serve --state PATH``), and removes it when it stops.

A command's Redis is, in order: its ``--redis-url`` flag; the record of its ``--state``
flag; ``SF_REDIS_URL`` or ``REDIS_URL``; the record of the one `serve` still running in
the state folder (with several, the command refuses and lists them); else
``redis://127.0.0.1:6379/0``. A record whose `serve` has gone is stale: it is named,
removed and not used. Every command says on stderr which Redis it uses and why.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import orjson

if TYPE_CHECKING:
    from streamfleet.shared.settings import CommonSettings

__all__ = ["ServeRecord", "AdminRedisError", "Resolution", "state_dir", "record_path", "write_record",
           "clear_record", "read_record", "serve_records", "resolve_redis", "admin_settings", "mask_url",
           "REDIS_FLAG_HELP", "STATE_FLAG_HELP", "DEFAULT_REDIS_URL"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: the --redis-url help of every administrative command
REDIS_FLAG_HELP = ("the fleet's Redis (default: SF_REDIS_URL / REDIS_URL, else the Redis of the one "
                   f"`streamfleet serve` running, else {DEFAULT_REDIS_URL})")
#: the --state help of every administrative command
STATE_FLAG_HELP = ("use the Redis of the `streamfleet serve` that records itself in this file (its "
                   "--state, or serve-PORT.json in SF_STATE_DIR); for several serves at once")


class AdminRedisError(Exception):
    """The command cannot tell which Redis to use (a stale or missing ``--state``
    record, several running serves); the message says what to do."""


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


def state_dir() -> Path:
    """``$SF_STATE_DIR``; by default a folder of this user's own in ``$XDG_RUNTIME_DIR``
    (else the temporary folder)."""
    folder = os.environ.get("SF_STATE_DIR")
    if not folder:
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        folder = os.path.join(base, f"streamfleet-{os.getuid()}")
    return Path(folder)


def record_path(port: int) -> Path:
    """Where the `serve` whose gateway listens on ``port`` records itself by default:
    ``serve-PORT.json`` in the state folder, or ``serve-PORT-PID.json`` while another
    running `serve` (on another address) holds that name."""
    path = state_dir() / f"serve-{port}.json"
    held = read_record(path)
    if held is not None and held.pid != os.getpid() and _alive(held.pid):
        return state_dir() / f"serve-{port}-{os.getpid()}.json"
    return path


def write_record(record: ServeRecord, path: Path) -> Path:
    """Write ``record`` at ``path`` (readable by this user only), atomically."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{record.pid}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(orjson.dumps({"redis_url": record.redis_url, "api_url": record.api_url, "pid": record.pid,
                              "embedded": record.embedded}))
    os.replace(tmp, path)
    return path


def clear_record(pid: int, path: Path) -> None:
    """Remove the record at ``path`` if it is still the one ``pid`` wrote."""
    current = read_record(path)
    if current is not None and current.pid == pid:
        _unlink(Path(path))


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_record(path: Path) -> ServeRecord | None:
    """The record at ``path``, whether or not its `serve` still runs; None when there is
    none or it is unreadable."""
    try:
        d: Any = orjson.loads(Path(path).read_bytes())
        return ServeRecord(redis_url=str(d["redis_url"]), api_url=str(d.get("api_url", "")), pid=int(d["pid"]),
                           embedded=bool(d.get("embedded", False)))
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def serve_records() -> tuple[list[tuple[Path, ServeRecord]], list[tuple[Path, ServeRecord]]]:
    """The records in the state folder: ``(live, stale)``, each ``(path, record)`` in
    name order; stale: its `serve` is no longer running."""
    live: list[tuple[Path, ServeRecord]] = []
    stale: list[tuple[Path, ServeRecord]] = []
    try:
        paths = sorted(state_dir().glob("serve*.json"))
    except OSError:
        paths = []
    for path in paths:
        rec = read_record(path)
        if rec is not None:
            (live if _alive(rec.pid) else stale).append((path, rec))
    return live, stale


def _gone(path: Path, rec: ServeRecord) -> str:
    what = f" ({rec.api_url})" if rec.api_url else ""
    return f"{path} is stale: its `streamfleet serve`{what}, pid {rec.pid}, is no longer running"


@dataclass(frozen=True, slots=True)
class Resolution:
    """The Redis a command uses, where it came from, and notes to say first (stale
    records removed)."""

    url: str
    source: str
    notes: list[str] = field(default_factory=list)


def resolve_redis(flag: str | None, state: str | None = None) -> Resolution:
    """The Redis URL a command uses, and why (for the command to say).

    Raises:
        AdminRedisError: both flags given; the ``state`` record is missing or stale;
            several `serve`s are running and neither a flag nor the environment picks one.
    """
    if flag and state:
        raise AdminRedisError("give either --redis-url or --state, not both")
    if flag:
        return Resolution(flag, "--redis-url")
    if state:
        path = Path(state)
        rec = read_record(path)
        if rec is None:
            raise AdminRedisError(f"--state {path}: no `streamfleet serve` record there (is that serve running? "
                                  f"It writes the file while it runs and removes it when it stops)")
        if not _alive(rec.pid):
            _unlink(path)
            raise AdminRedisError(f"--state {_gone(path, rec)}; removed it. Start that serve again, or pass "
                                  f"--redis-url")
        return Resolution(rec.redis_url, f"the `streamfleet serve` of --state {path}, pid {rec.pid}")
    for name in ("SF_REDIS_URL", "REDIS_URL"):
        if os.environ.get(name):
            return Resolution(os.environ[name], name)
    live, stale = serve_records()
    notes = []
    for path, rec in stale:
        _unlink(path)
        notes.append(f"note: {_gone(path, rec)}; not used, and removed")
    if len(live) > 1:
        listed = "\n".join(f"  {path}: API {rec.api_url or '?'}, Redis {mask_url(rec.redis_url)}, pid {rec.pid}"
                           for path, rec in live)
        raise AdminRedisError(f"{len(live)} `streamfleet serve`s are running; name the one to use with "
                              f"--state PATH (or --redis-url URL):\n{listed}")
    if live:
        path, rec = live[0]
        return Resolution(rec.redis_url, f"the running `streamfleet serve`, pid {rec.pid}, recorded in {path}", notes)
    return Resolution(DEFAULT_REDIS_URL, "the default: no `streamfleet serve` is running and neither SF_REDIS_URL "
                                         "nor REDIS_URL is set; pass --redis-url for another", notes)


def admin_settings(flag: str | None, state: str | None = None, *, quiet: bool = False) -> CommonSettings:
    """The command's ``CommonSettings`` with its Redis resolved (``resolve_redis``); says
    on stderr which Redis that is, unless ``quiet``. A Redis it cannot tell ends the
    command with exit status 2 and the reason."""
    from streamfleet.shared.settings import CommonSettings

    try:
        found = resolve_redis(flag, state)
    except AdminRedisError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if not quiet:
        for note in found.notes:
            print(note, file=sys.stderr)
        print(f"redis: {mask_url(found.url)} ({found.source})", file=sys.stderr, flush=True)
    return CommonSettings(redis_url=found.url)
