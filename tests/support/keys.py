"""API keys for integration tests: ``streamfleet keys add``, run as an operator would."""

from __future__ import annotations

import subprocess
import sys


def add_key(fleet, name: str, tier: str, tiers: str) -> str:
    """A new API key of ``tier`` (with the fleet's ``SF_TIERS`` = ``tiers``): its secret."""
    out = subprocess.run([sys.executable, "-m", "streamfleet", "keys", "add", name, "--tier", tier],
                         env=fleet.env(tiers=tiers), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()
