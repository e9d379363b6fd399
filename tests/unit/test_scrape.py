"""The gateway's metrics listener (gateway/scrape.py): binding, and the error that names
the setting when the port is taken."""

from __future__ import annotations

import socket

import pytest

from streamfleet.gateway.scrape import MetricsListenError, listen
from streamfleet.shared.settings import GatewaySettings


def test_listen_on_a_free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = listen(GatewaySettings(metrics_port=port))
    try:
        assert sock.getsockname()[:2] == ("127.0.0.1", port)
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # listening already
    finally:
        sock.close()


def test_a_taken_port_names_the_setting():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(MetricsListenError) as e:
            listen(GatewaySettings(metrics_port=port))
    assert "SF_METRICS_PORT" in str(e.value) and f"127.0.0.1:{port}" in str(e.value) and "in use" in str(e.value)


def test_an_address_not_on_this_host_names_the_settings():
    with pytest.raises(MetricsListenError) as e:
        listen(GatewaySettings(metrics_port=9, metrics_host="192.0.2.1"))  # TEST-NET-1: never local
    assert "SF_METRICS_HOST:SF_METRICS_PORT" in str(e.value)
