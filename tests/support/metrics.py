"""Reading a Prometheus text page in integration tests."""

from __future__ import annotations


def value(text: str, name: str, **labels) -> float:
    """The value of the first sample of ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in metrics")
