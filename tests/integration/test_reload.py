"""Hot model reload under load: no request dropped or failed, new requests on the new version."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.versions import two_versions as two_versions_repo
from tests.support.wait import until_async
from tests.support.wsclient import Client

pytestmark = pytest.mark.slow  # a model reloaded under load


@pytest.fixture
def two_versions(tiny_spec, tmp_path):
    """A model repository with tiny-gpt v1 and a v2 beside it (same tokenizer)."""
    return two_versions_repo(Path(tiny_spec.path), tmp_path)


async def test_hot_reload_while_serving(fleet, two_versions):
    engines = str(two_versions)
    gw = fleet.gateway(engines_dir=engines)
    workers = [fleet.worker(engines_dir=engines, backend="echo", echo_delay_ms=15) for _ in range(2)]
    c = await Client.connect(gw.ws)
    results = []
    stop = asyncio.Event()

    async def traffic(k: int):
        i = 0
        while not stop.is_set():
            results.append(await c.generate(f"t{k}-{i}", "Once upon a time", max_tokens=20, ignore_eos=True))
            i += 1

    load = [asyncio.create_task(traffic(k)) for k in range(6)]
    await until_async(lambda: len(results) >= 12, "traffic before the reload", timeout=30)
    before = len(results)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "streamfleet", "reload", "tiny-gpt", "--to", "2", "--timeout", "90",
        env=fleet.env(engines_dir=engines), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    assert b"every live worker serves version 2" in out
    n_at_switch = len(results)
    await until_async(lambda: len(results) >= n_at_switch + 12, "traffic after the reload", timeout=30)
    stop.set()
    await asyncio.gather(*load)
    await c.close()

    assert before > 0 and len(results) > n_at_switch
    for r in results:  # nothing dropped or failed
        assert r.end["type"] == "done" and len(r.tokens) == 20, r.end
    versions = [r.end.get("model_version") for r in results]
    assert versions[0] == "1" and set(versions[n_at_switch:]) == {"2"}
    # the workers took turns: reload windows do not overlap
    windows = []
    for w in workers:
        log = w.log(tail=None)
        assert "model reloaded" in log and "old model version freed" in log
        start = re.search(r'"event":"reloading model".*?"timestamp":"([^"]+)"', log).group(1)
        end = re.search(r'"event":"model reloaded".*?"timestamp":"([^"]+)"', log).group(1)
        windows.append((start, end))
    windows.sort()
    assert windows[0][1] <= windows[1][0], windows
