"""Reading a Prometheus text page in integration tests."""

from __future__ import annotations


def value(text: str, name: str, **labels) -> float:
    """The value of the first sample of ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in metrics")
