"""API keys for integration tests: ``streamfleet keys add``, run as an operator would."""

from __future__ import annotations

import subprocess
import sys

#: two tiers for the key tests: ``test`` (1 request a minute after a burst of 6, normal lane
#: at most) and ``solo`` (one stream at a time, any lane); ``free`` is the built-in tier
TIERS = ('{"test": {"requests_per_minute": 1, "burst": 6, "max_streams": null, "max_lane": "normal"},'
         ' "solo": {"requests_per_minute": 600, "burst": 50, "max_streams": 1, "max_lane": "high"}}')


def add_key(fleet, name: str, tier: str, tiers: str = TIERS) -> str:
    """A new API key of ``tier`` (with the fleet's ``SF_TIERS`` = ``tiers``): its secret."""
    out = subprocess.run([sys.executable, "-m", "streamfleet", "keys", "add", name, "--tier", tier],
                         env=fleet.env(tiers=tiers), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()
