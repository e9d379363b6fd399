"""Prefix-aware routing in tests (docs/architecture.md, "Prefix-aware routing"): what a
worker's log says it admitted, and a worker's advert written by hand (for workers
without a prefix cache, such as the echo engine, whose advert nothing else touches)."""

from __future__ import annotations

import time

import orjson

from streamfleet.shared.keys import Keys
from streamfleet.shared.prefixhash import block_hashes, namespace
from tests.support.fleet import Proc


def admissions(proc: Proc) -> dict[str, dict]:
    """Request id -> the worker's ``task admitted`` log line (``routed_to``: the worker a
    gateway routed it to, absent for a shared lane's task)."""
    out = {}
    for line in proc.log(None).splitlines():
        if b"task admitted" not in line.encode():
            continue
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if rec.get("event") == "task admitted":
            out[rec["request_id"]] = rec
    return out


def served_by(procs: dict[str, Proc], request_id: str, timeout: float = 10.0) -> tuple[str, dict]:
    """``(name, log line)`` of the worker among ``procs`` (name -> process) that admitted
    the request last (a takeover admits it again elsewhere)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [(rec["timestamp"], name, rec) for name, p in procs.items()
                 if (rec := admissions(p).get(request_id)) is not None]
        if found:
            _, name, rec = max(found)
            return name, rec
        if time.monotonic() > deadline:
            raise AssertionError(f"no worker admitted {request_id}")
        time.sleep(0.05)


def prompt_names(ids: list[int], block: int, model: str = "tiny-gpt", version: str = "1") -> list[bytes]:
    """The block names of a prompt, as workers and gateways compute them."""
    return block_hashes(namespace(model, version), ids, block)


def advertise(r, prefix: str, worker_id: str, names: list[bytes], model: str = "tiny-gpt", ttl_s: int = 300) -> None:
    """Write ``worker_id``'s advert by hand (a worker without a prefix cache never
    rewrites it)."""
    key = Keys(prefix).prefix_advert(model, worker_id)
    r.delete(key)
    r.sadd(key, *names)
    r.expire(key, ttl_s)


def holders(r, prefix: str, worker_ids: list[str], name: bytes, model: str = "tiny-gpt") -> list[str]:
    """The workers whose advert holds ``name``."""
    keys = Keys(prefix)
    return [w for w in worker_ids if r.sismember(keys.prefix_advert(model, w), name)]
