"""`streamfleet keys …`: issue, list and revoke API keys (stored in Redis as hashes).

Connection and prefix come from ``--redis-url`` / ``--state`` / ``SF_REDIS_URL`` /
``REDIS_URL`` (``streamfleet/local.py``) and ``SF_KEY_PREFIX``; custom tiers from
``SF_TIERS`` (see ``shared/tiers.py``). Gateways cache key records for
``SF_KEY_CACHE_S`` seconds, so a revocation reaches them within that time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import typer

from streamfleet.clihelp import App
from streamfleet.local import REDIS_FLAG_HELP, STATE_FLAG_HELP

if TYPE_CHECKING:
    from streamfleet.gateway.admission.auth import KeyStore

__all__ = ["keys_app"]

T = TypeVar("T")

keys_app = App(no_args_is_help=True, help="Manage API keys: add, list, revoke (stored hashed in Redis).")



def _run(redis_url: str | None, state: str | None, action: Callable[[KeyStore], Awaitable[T]]) -> T:
    """Run ``action(store)`` against a KeyStore built from the settings."""
    from streamfleet.gateway.admission.auth import KeyStore
    from streamfleet.local import admin_settings, mask_url
    from streamfleet.shared.errors import FatalError
    from streamfleet.shared.redis import BROKER_ERRORS, connect
    from streamfleet.shared.tiers import parse_tiers

    settings = admin_settings(redis_url, state)
    try:
        tiers = parse_tiers(settings.tiers)
    except FatalError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None

    async def main() -> T:
        client = connect(settings.redis_url, cluster=settings.redis_cluster,
                         socket_timeout=settings.redis_socket_timeout_s)
        try:
            return await action(KeyStore(client, settings.keys(), tiers=tiers, cache_ttl_s=0))
        finally:
            await client.aclose()

    try:
        return asyncio.run(main())
    except BROKER_ERRORS as exc:
        typer.echo(f"error: cannot reach Redis at {mask_url(settings.redis_url)}: {exc}", err=True)
        raise typer.Exit(1) from None
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@keys_app.command("add")
def add(
    name: str = typer.Argument(..., help="who the key is for (unique among active keys)"),
    tier: str = typer.Option("free", "--tier", metavar="TIER", help="free | paid | internal (or a tier from SF_TIERS)"),
    redis_url: str | None = typer.Option(None, "--redis-url", metavar="URL", help=REDIS_FLAG_HELP),
    state: str | None = typer.Option(None, "--state", metavar="PATH", help=STATE_FLAG_HELP),
) -> None:
    """Create a key and print it once (stdout); only its hash is stored."""
    plaintext, record = _run(redis_url, state, lambda store: store.add(name, tier))
    typer.echo(f"created key {record.key_id} for {record.name!r} (tier {record.tier})", err=True)
    typer.echo("WARNING: this is the only time the key is shown; it is not stored. Keep it safe.", err=True)
    typer.echo(plaintext)


@keys_app.command("list")
def list_(
    as_json: bool = typer.Option(False, "--json", help="one JSON array instead of a table"),
    redis_url: str | None = typer.Option(None, "--redis-url", metavar="URL", help=REDIS_FLAG_HELP),
    state: str | None = typer.Option(None, "--state", metavar="PATH", help=STATE_FLAG_HELP),
) -> None:
    """List keys (never the keys themselves): key_id, name, tier, created, revoked."""
    records = [r.public() for r in _run(redis_url, state, lambda store: store.list())]
    if as_json:
        typer.echo(json.dumps(records, indent=2))
        return
    if not records:
        typer.echo("no API keys", err=True)
        return
    header = ("KEY_ID", "NAME", "TIER", "CREATED", "REVOKED")
    rows = [(r["key_id"], r["name"], r["tier"], r["created_at"], "yes" if r["revoked"] else "no") for r in records]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        typer.echo("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


@keys_app.command("revoke")
def revoke(
    key_id_or_name: str = typer.Argument(..., help="key id (12 hex characters) or the name of an active key"),
    redis_url: str | None = typer.Option(None, "--redis-url", metavar="URL", help=REDIS_FLAG_HELP),
    state: str | None = typer.Option(None, "--state", metavar="PATH", help=STATE_FLAG_HELP),
) -> None:
    """Revoke a key; gateways stop accepting it within their key cache time (SF_KEY_CACHE_S)."""
    if _run(redis_url, state, lambda store: store.revoke(key_id_or_name)):
        typer.echo(f"revoked {key_id_or_name}")
        return
    typer.echo(f"error: no active key matches {key_id_or_name!r}", err=True)
    raise typer.Exit(1)
