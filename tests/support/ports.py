"""Ports for the servers the tests start.

``streamfleet.launcher.free_port`` asks the kernel for a free port, which it hands out
from its ephemeral range (``net.ipv4.ip_local_port_range``). That is the range every
outgoing connection's local port also comes from, so on a busy machine (pytest-xdist
workers each opening Redis, HTTP and gRPC connections) a port picked that way is now and
then taken by somebody's ``connect()`` before the gateway we picked it for binds it.

Here ports come from below the ephemeral range instead, where nothing is handed out
implicitly, and each xdist worker draws from its own slice, so two workers never pick
the same one. A port is checked free by binding it before it is handed out.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

_SLICE = 1000
_FLOOR = 10000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice() -> range:
    """This process's slice: one per xdist worker of a run, and the run's slices shifted by
    a number of its own, so that two runs side by side (a developer's and a helper's)
    seldom share one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
    shift = int(run[:8], 16) if len(run) >= 8 and all(c in "0123456789abcdef" for c in run[:8]) else os.getpid()
    slices = max(1, (_ephemeral_low() - _FLOOR) // _SLICE)
    start = _FLOOR + ((index + shift) % slices) * _SLICE
    return range(start, start + _SLICE)


_ports = _slice()
# Start somewhere in the slice, so runs one after another do not reuse the same ports
# (a port closed a moment ago may still be in TIME_WAIT).
_next = itertools.count(random.randrange(len(_ports)))


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port no process holds now, outside the kernel's ephemeral range."""
    for _ in range(len(_ports)):
        port = _ports[next(_next) % len(_ports)]
        if _bindable(port):
            return port
    with socket.socket() as s:  # the whole slice is busy: fall back on the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
