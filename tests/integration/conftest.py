"""Integration fixtures: a real redis-server on a free port for the session, and
factories that start real gateway and worker processes (closed at teardown).

Each test gets its own key prefix, so tests share the server without sharing keys.
``fleet`` starts processes for one test (a test that kills, stops or reconfigures them);
``module_fleet`` and ``module_fleets`` share them across a module's tests that only send
requests. ``FleetFactory`` and ``Proc`` are in tests/support/fleet.py.

A test marked ``@pytest.mark.both_brokers`` runs twice: on the single server and on a
real local Redis Cluster (3 primaries, 3 replicas; ``redis_cluster``, started once for
the session when a test first needs it). Its ``fleet`` and ``rds`` follow the broker.
"""

from __future__ import annotations

import pytest

from streamfleet.launcher import EmbeddedCluster, EmbeddedRedis
from tests.support.fleet import Broker, FleetFactory, new_prefix
from tests.support.ports import free_port


@pytest.fixture(scope="session")
def redis_server():
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster():
    """A real Redis Cluster (3 primaries with a replica each) for the session."""
    try:
        cluster = EmbeddedCluster().start()
    except RuntimeError as exc:
        pytest.skip(f"no local Redis Cluster: {exc}")
    yield cluster
    cluster.stop()


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("both_brokers") and "broker" in metafunc.fixturenames:
        metafunc.parametrize("broker", ["single", "cluster"], indirect=True)


@pytest.fixture
def broker(request, redis_server) -> Broker:
    if getattr(request, "param", "single") == "cluster":
        return Broker(request.getfixturevalue("redis_cluster").url, cluster=True)
    return Broker(redis_server.url)


@pytest.fixture
def own_redis():
    """A private redis-server for a test that stops, pauses or reconfigures it."""
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture
def key_prefix(redis_server) -> str:
    return new_prefix()


@pytest.fixture
def rds(broker):
    client = broker.client()
    yield client
    client.close()


@pytest.fixture
def own_cluster():
    """A private 3x2 cluster (cluster-node-timeout 1 s) for a test that kills one of its
    nodes, so that the session's cluster stays whole."""
    try:
        cluster = EmbeddedCluster(node_timeout_ms=1000).start()
    except RuntimeError as exc:
        pytest.skip(f"no local Redis Cluster: {exc}")
    yield cluster
    cluster.stop()


@pytest.fixture
def fleet(broker, key_prefix, tiny_spec, tmp_path):
    factory = FleetFactory(broker.url, key_prefix, tmp_path, cluster=broker.cluster)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def module_fleet(redis_server, tiny_spec, tmp_path_factory):
    """One fleet for a whole module, for tests that only send requests to it (each on a
    key prefix of its own, so no test sees another module's keys)."""
    factory = FleetFactory(redis_server.url, new_prefix(), tmp_path_factory.mktemp("fleet"))
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def module_fleets(redis_server, tiny_spec, tmp_path_factory):
    """More fleets for a whole module: ``module_fleets()`` is a new ``FleetFactory`` on a
    key prefix of its own (so its workers read only its own lanes), closed at the module's
    end. For module-scoped fixtures that each need processes set up their own way."""
    made: list[FleetFactory] = []

    def make() -> FleetFactory:
        made.append(FleetFactory(redis_server.url, new_prefix(), tmp_path_factory.mktemp("fleet")))
        return made[-1]

    yield make
    for factory in made:
        factory.close()


@pytest.fixture
def tls_redis(tmp_path):
    """A redis-server serving TLS only, with a self-signed certificate for localhost
    (skipped where openssl is missing or redis-server was built without TLS)."""
    import shutil
    import subprocess

    from streamfleet.launcher import find_redis_server

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen([find_redis_server(), "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                             "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    import socket
    import time

    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            pytest.skip(f"redis-server without TLS: {proc.stderr.read().decode(errors='replace')[-200:]}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("TLS redis-server did not start")
            time.sleep(0.05)
    yield port, cert
    proc.terminate()
    proc.wait(10)
