"""A bad setting stops a process at start-up with a line naming it, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("command, env, named", [
    ("gateway", {"SF_VAD": "nope"}, "SF_VAD='nope'"),
    ("gateway", {"SF_GRPC_PORT": "abc"}, "SF_GRPC_PORT='abc'"),
    ("worker", {"SF_EVENT_LOOP": "bad"}, "SF_EVENT_LOOP='bad'"),
])
def test_bad_setting_is_named(command, env, named):
    full = {k: v for k, v in os.environ.items() if not k.startswith("SF_")} | env
    out = subprocess.run([sys.executable, "-m", "streamfleet", command], env=full, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert f"error: invalid setting {named}" in out.stderr and "Traceback" not in out.stderr, out.stderr
