import asyncio

import pytest

from streamfleet.shared import aio


async def _loop_type() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop_when_installed():
    pytest.importorskip("uvloop")
    assert aio.run(_loop_type()).startswith("uvloop")


def test_asyncio_opts_out():
    assert aio.run(_loop_type(), "asyncio").startswith("asyncio")


def test_unknown_loop_is_refused():
    with pytest.raises(ValueError, match="unknown event loop"):
        aio.loop_factory("trio")


def test_settings_validate_the_choice(monkeypatch):
    from pydantic import ValidationError

    from streamfleet.shared.settings import WorkerSettings

    monkeypatch.setenv("SF_EVENT_LOOP", "asyncio")
    assert WorkerSettings().event_loop == "asyncio"
    monkeypatch.setenv("SF_EVENT_LOOP", "twisted")
    with pytest.raises(ValidationError):
        WorkerSettings()
