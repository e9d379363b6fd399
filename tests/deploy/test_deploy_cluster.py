"""Redis Cluster deployments: deploy/compose/cluster.yml (a docker compose override) and
the kustomize component deploy/k8s/components/redis-cluster.

Offline like test_deploy_configs.py and test_deploy_k8s_ops.py (their shared helpers are
tests/support/deploy.py):

* the compose override is merged into docker-compose.yml the way Compose merges files
  (``!override`` replaces, mappings merge, ``volumes`` append) and the result checked
  against the Compose schema and for what cluster mode needs: six nodes, a one-shot
  init service, the fleet on a seed list of nodes of the file;
* the component is rendered (the real ``kubectl kustomize``; skipped without it) and
  checked: six nodes, the headless Service with the bus port, the env and KEDA patches,
  the NetworkPolicy flows between the nodes;
* where redis-server >= 7 is installed, both files are run for real: six local
  redis-server processes started as the files start them (their options, the node
  script), the cluster created by the init script of each file, and, for compose, a
  restart of every node with stale peer addresses that the node script repairs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from streamfleet.shared.keys import Keys
from tests.support.deploy import (
    COMPONENTS,
    COMPOSE_FILE,
    COMPOSE_SCHEMA,
    REDIS_SECRET,
    REPO,
    TEST_PASSWORD,
    Peer,
    allowed,
    config,
    container,
    env_value,
    find,
    fleet_peers,
    interpolate,
    k8s_env,
    known_setting_env_names,
    pod,
    render,
    scaled_objects,
)
from tests.support.wait import until

pytestmark = pytest.mark.timeout(120)

CLUSTER_OVERRIDE = REPO / "deploy" / "compose" / "cluster.yml"
COMPONENT = "redis-cluster"
COMPONENT_DIR = COMPONENTS / COMPONENT
NODE_SCRIPT = "redis-cluster-node.sh"
#: the streamfleet processes of docker-compose.yml that must use the cluster
FLEET = ("gateway", "worker-cpu", "worker-gpu0", "worker-gpu1")
NODE_NAME = re.compile(r"redis-(\d+)")
#: added to the nodes started here, to keep the test short: a replica's first sync starts
#: at once instead of after the 5 s Redis waits for more replicas to share the transfer
FAST_SYNC = ["--repl-diskless-sync-delay", "0"]


# --------------------------------------------------------------------------- compose merging
class Override(dict):
    """A mapping tagged ``!override``: replaces the base file's value instead of merging."""


class Reset:
    """A value tagged ``!reset``: removes the base file's value."""


class _ComposeLoader(yaml.SafeLoader):
    pass


def _override(loader: yaml.SafeLoader, node: yaml.Node):
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    raise AssertionError("only mappings are tagged !override here")


_ComposeLoader.add_constructor("!override", _override)
_ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())

#: service sequences Compose appends to (by value) instead of replacing
_APPENDED = {"volumes", "ports", "expose", "secrets", "configs"}


def _merge_service(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, Reset):
            out.pop(key, None)
        elif isinstance(value, Override):
            out[key] = dict(value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value} if key in ("environment", "labels") else _merge_service(out[key], value)
        elif key in _APPENDED and isinstance(out.get(key), list):
            out[key] = out[key] + [v for v in value if v not in out[key]]
        else:
            out[key] = copy.deepcopy(value)
    return out


def compose_merge(base: dict, over: dict) -> dict:
    """``docker compose -f base -f over`` for the parts these files use."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key == "services":
            services = out.setdefault("services", {})
            for name, svc in value.items():
                services[name] = _merge_service(services.get(name, {}), svc)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = copy.deepcopy(value)
    return out


@pytest.fixture(scope="module")
def override_raw() -> dict:
    return yaml.load(CLUSTER_OVERRIDE.read_text(), Loader=_ComposeLoader)  # a SafeLoader


@pytest.fixture(scope="module")
def merged(override_raw) -> dict:
    """docker-compose.yml + cluster.yml as Compose sees them, no variables set."""
    base = yaml.safe_load(COMPOSE_FILE.read_text())
    return interpolate(compose_merge(base, override_raw), {})


def cluster_nodes(services: dict) -> dict[str, dict]:
    return {n: s for n, s in services.items() if NODE_NAME.fullmatch(n)}


def option(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def seed_hosts(url: str) -> list[tuple[str, int]]:
    """``redis[s]://[:password@]host:port,host:port,...`` -> [(host, port), ...]."""
    m = re.fullmatch(r"rediss?://(?:[^@/]*@)?([^/?]+)(/\d*)?", url)
    assert m, f"not a seed list URL: {url}"
    out = []
    for part in m.group(1).split(","):
        host, _, port = part.strip().rpartition(":")
        assert host and port.isdigit(), f"{part!r} in {url} is not host:port"
        out.append((host, int(port)))
    return out


def init_script_nodes(script: str) -> list[str]:
    m = re.search(r'^\s*nodes="([^"]+)"', script, re.MULTILINE)
    assert m, "the init script lists its nodes in nodes=\"...\""
    return m.group(1).split()


def compose_init_script(services: dict) -> str:
    init = services["redis-cluster-init"]
    assert init["entrypoint"] == ["/bin/sh", "-c"]
    [script] = init["command"]
    return script


# --------------------------------------------------------------------------- compose: structure
def test_compose_override_merges_into_a_valid_compose_file(merged, override_raw):
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(merged), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    # depends_on is replaced, not merged: the fleet no longer waits for (or starts) the single Redis
    for name in FLEET:
        assert isinstance(override_raw["services"][name]["depends_on"], Override), name
    # the single-node default is what it was
    base = yaml.safe_load(COMPOSE_FILE.read_text())
    assert "redis-cluster-init" not in base["services"] and not cluster_nodes(base["services"])
    assert base["x-streamfleet-env"]["SF_REDIS_URL"] == "redis://redis:6379/0"
    assert "SF_REDIS_CLUSTER" not in base["x-streamfleet-env"]


def test_compose_six_cluster_nodes(merged):
    services = merged["services"]
    nodes = cluster_nodes(services)
    assert sorted(nodes) == [f"redis-{i}" for i in range(6)], sorted(nodes)
    commands = set()
    volumes = set()
    for name, svc in nodes.items():
        m = re.fullmatch(r"redis:(\d+)\.(\d+)(?:\.\d+)?-alpine", svc["image"])
        assert m and (int(m.group(1)), int(m.group(2))) >= (7, 0), f"{name}: Redis >= 7.0 (sharded pub/sub)"
        argv = [str(a) for a in svc["command"]]
        assert argv[0] == "redis-server"
        assert option(argv, "--cluster-enabled") == "yes"
        assert option(argv, "--cluster-config-file") == "nodes.conf"
        assert option(argv, "--cluster-node-timeout") == "5000"
        assert option(argv, "--cluster-preferred-endpoint-type") == "hostname"
        assert option(argv, "--appendonly") == "yes" and option(argv, "--appendfsync") == "everysec"
        assert option(argv, "--maxmemory-policy") == "noeviction"
        assert re.fullmatch(r"\d+[kmg]b", option(argv, "--maxmemory"))
        assert "--client-output-buffer-limit pubsub 64mb 16mb 60" in " ".join(argv)
        commands.add(tuple(argv))
        # each node announces its own service name, which the other containers resolve
        assert svc["environment"]["REDIS_CLUSTER_ANNOUNCE_HOSTNAME"] == name
        # started by the node script (mounted from the repository), unprivileged
        assert svc["entrypoint"] == ["/bin/sh", f"/usr/local/bin/{NODE_SCRIPT}"]
        assert f"./deploy/k8s/components/{COMPONENT}/{NODE_SCRIPT}:/usr/local/bin/{NODE_SCRIPT}:ro" in svc["volumes"]
        assert svc["user"] == "redis"
        data = [v for v in svc["volumes"] if str(v).endswith(":" + option(argv, "--dir"))]
        assert len(data) == 1, f"{name}: one volume on its data dir"
        volumes.add(data[0].split(":")[0])
        assert data[0].split(":")[0] in merged["volumes"], f"{name}: a named volume"
        # only PONG is healthy, on the node's own port
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL" and "= PONG" in test[1]
        assert f"redis-cli -p {option(argv, '--port')} ping" in test[1]
        assert "ports" not in svc, "Redis is not published on the host"
    assert len(commands) == 1, "every node runs the same options"
    assert len(volumes) == 6, "each node has its own volume"


def test_compose_cluster_init_service(merged):
    services = merged["services"]
    nodes = cluster_nodes(services)
    init = services["redis-cluster-init"]
    assert init["restart"] == "no", "one-shot"
    assert init["depends_on"] == {n: {"condition": "service_healthy"} for n in nodes}
    script = compose_init_script(services)
    ports = {n: option([str(a) for a in s["command"]], "--port") for n, s in nodes.items()}
    assert init_script_nodes(script) == [f"{n}:{ports[n]}" for n in sorted(nodes)]
    create = next(ln for ln in script.splitlines() if "--cluster create" in ln)
    assert "--cluster-replicas 1" in create and "--cluster-yes" in create
    assert "cluster_state" in script and "exit 0" in script, "skips a cluster that is already up"


def test_compose_fleet_points_at_the_cluster(merged):
    services = merged["services"]
    nodes = cluster_nodes(services)
    for name in FLEET:
        svc = services[name]
        env = svc["environment"]
        assert env["SF_REDIS_CLUSTER"] == "true", name
        seeds = seed_hosts(env["SF_REDIS_URL"])
        assert len(seeds) >= 2 and len(set(seeds)) == len(seeds), f"{name}: a seed list"
        for host, port in seeds:
            assert host in nodes, f"{name}: seed {host} is not a cluster node of the file"
            assert str(port) == option([str(a) for a in nodes[host]["command"]], "--port")
        assert svc["depends_on"] == {"redis-cluster-init": {"condition": "service_completed_successfully"}}, name
    # arq's build queue stays on the single Redis, which now starts with the GPU profile only
    builder = services["engine-builder"]
    assert seed_hosts(builder["environment"]["SF_REDIS_URL"]) == [("redis", 6379)]
    assert "SF_REDIS_CLUSTER" not in builder["environment"]
    assert services["redis"]["profiles"] == ["gpu"]


@pytest.mark.parametrize("profiles", [(), ("cpu",), ("gpu",), ("cpu", "gpu")], ids=lambda p: "+".join(p) or "default")
def test_compose_every_dependency_is_started(merged, profiles):
    services = merged["services"]
    started = {n for n, s in services.items() if not s.get("profiles") or set(s["profiles"]) & set(profiles)}
    assert {"redis-cluster-init", "gateway", "nginx"} | set(cluster_nodes(services)) <= started
    for name in started:
        deps = set(services[name].get("depends_on", {}))
        assert deps <= started, f"{profiles}: {name} depends on {deps - started}, not started"
    assert ("redis" in started) == ("gpu" in profiles)


def test_compose_cluster_settings_are_known(merged):
    known = known_setting_env_names()
    for name, svc in merged["services"].items():
        for key in svc.get("environment", {}):
            # SF_REDIS_CLUSTER arrives with the Python side of cluster mode (shared/settings.py)
            if key.startswith("SF_") and key != "SF_REDIS_CLUSTER":
                assert key in known, f"{name}: {key} is not a streamfleet setting"
    if "SF_REDIS_CLUSTER" in known:
        from streamfleet.shared.settings import CommonSettings

        assert CommonSettings.model_fields["redis_cluster"].annotation is bool


def test_node_script_is_the_same_in_compose_and_k8s():
    # one file: compose mounts the component's script, so the two cannot drift apart
    assert not (REPO / "deploy" / "compose" / NODE_SCRIPT).exists()
    assert (COMPONENT_DIR / NODE_SCRIPT).is_file()
    sh = shutil.which("sh")
    if sh:
        assert subprocess.run([sh, "-n", str(COMPONENT_DIR / NODE_SCRIPT)]).returncode == 0


# --------------------------------------------------------------------------- k8s: structure
@pytest.fixture(scope="module")
def cluster(overlays_root) -> list[dict]:
    return render(overlays_root, COMPONENT)


def redis_sts(docs: list[dict]) -> dict:
    return find(docs, "StatefulSet", "streamfleet-redis")


def redis_conf_files(docs: list[dict]) -> dict[str, str]:
    sts = redis_sts(docs)
    [vol] = [v for v in pod(sts)["volumes"] if "configMap" in v]
    mount = next(m for m in container(sts, "redis")["volumeMounts"] if m["name"] == vol["name"])
    data = find(docs, "ConfigMap", vol["configMap"]["name"])["data"]
    return {f"{mount['mountPath']}/{key}": value for key, value in data.items()}


def pod_dns_names(docs: list[dict], count: int | None = None) -> list[str]:
    """<statefulset>-<i>.<headless service>: the pods' stable names in their namespace."""
    sts = redis_sts(docs)
    n = sts["spec"]["replicas"] if count is None else count
    return [f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}" for i in range(n)]


def test_k8s_component_six_cluster_nodes(cluster, base):
    sts = redis_sts(cluster)
    assert sts["spec"]["replicas"] == 6
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    c = container(sts, "redis")
    assert c["image"].startswith("redis:7.")
    files = redis_conf_files(cluster)
    assert c["command"][0] == "sh" and c["command"][1] in files and c["command"][1].endswith(NODE_SCRIPT)
    args = c["args"]
    assert args[:2] == ["redis-server", "/etc/redis/redis.conf"] and args[1] in files
    included = option(args, "--include")
    conf = {ln.split(None, 1)[0]: ln.split(None, 1)[1] for ln in files[included].splitlines()
            if ln.strip() and not ln.startswith("#")}
    assert conf["cluster-enabled"] == "yes"
    assert conf["cluster-config-file"] == "nodes.conf"
    assert conf["cluster-preferred-endpoint-type"] == "hostname"
    assert int(conf["cluster-node-timeout"]) <= 15000
    bus = int(conf.get("cluster-port", 16379))
    assert bus == 16379
    # the Secret's password for clients (requirepass) and for replicas logging in to their primary
    assert option(args, "--requirepass") == "$(REDIS_PASSWORD)" == option(args, "--masterauth")
    env = {e["name"]: e for e in c["env"]}
    assert (env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"],
            env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"]) == REDIS_SECRET
    names = [e["name"] for e in c["env"]]
    # announced: the pod's FQDN under the headless Service ($(VAR)s defined before use)
    announce = env["REDIS_CLUSTER_ANNOUNCE_HOSTNAME"]["value"]
    assert announce == f"$(POD_NAME).{sts['spec']['serviceName']}.$(POD_NAMESPACE).svc.cluster.local"
    assert names.index("POD_NAME") < names.index("REDIS_CLUSTER_ANNOUNCE_HOSTNAME")
    assert names.index("POD_NAMESPACE") < names.index("REDIS_CLUSTER_ANNOUNCE_HOSTNAME")
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"redis": 6379, "cluster-bus": bus}
    # the data dir is on the node's own claim, a new one (not the single Redis' data-*)
    [vct] = sts["spec"]["volumeClaimTemplates"]
    assert vct["metadata"]["name"] in {m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/data"}
    assert vct["metadata"]["name"] != redis_sts(base)["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    # liveness and startup as in the base (PONG); the exporter sidecar stays
    for probe in ("livenessProbe", "startupProbe"):
        assert c[probe] == container(redis_sts(base), "redis")[probe]
    assert "master_link_status" in c["readinessProbe"]["exec"]["command"][2]
    assert container(sts, "redis-exporter") == container(redis_sts(base), "redis-exporter")
    # the base is untouched: one node, no cluster
    assert redis_sts(base)["spec"]["replicas"] == 1
    assert "--include" not in container(redis_sts(base), "redis")["args"]
    assert "SF_REDIS_CLUSTER" not in config(base)


def test_k8s_headless_service_exposes_client_and_bus_ports(cluster):
    sts = redis_sts(cluster)
    svc = find(cluster, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True, "nodes and the init Job resolve pods before they are ready"
    ports = {p["port"]: p["targetPort"] for p in svc["spec"]["ports"]}
    assert set(ports) == {6379, 16379}
    container_ports = {p["name"]: p["containerPort"] for p in container(sts, "redis")["ports"]}
    for port, target in ports.items():
        assert container_ports.get(target, target) == port
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_fleet_env_points_at_the_cluster(cluster, base, monkeypatch):
    secrets = {REDIS_SECRET: TEST_PASSWORD}
    seeds = [(h, 6379) for h in pod_dns_names(cluster, 3)]
    assert seed_hosts(config(cluster)["SF_REDIS_URL"]) == seeds
    assert "@" not in config(cluster)["SF_REDIS_URL"], "no password in the ConfigMap"
    clients = [d for d in cluster if d["metadata"].get("labels", {}).get("app.kubernetes.io/component")
               in ("gateway", "worker", "engine-build") and d["kind"] in ("Deployment", "CronJob")]
    assert {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in clients} == \
        {"gateway", "worker", "engine-build"}
    for d in clients:
        c = container(d)
        env = k8s_env(c, cluster, secrets)
        assert env["SF_REDIS_CLUSTER"] == "true", d["metadata"]["name"]
        url = env["SF_REDIS_URL"]
        assert url.startswith(f"redis://:{TEST_PASSWORD}@"), f"{d['metadata']['name']}: the password in the URL"
        assert seed_hosts(url) == seeds, d["metadata"]["name"]
        # the index-addressed patch replaced SF_REDIS_URL and nothing else
        twin = find(base, d["kind"], d["metadata"]["name"])
        before, after = container(twin)["env"], c["env"]
        assert [e["name"] for e in before] == [e["name"] for e in after]
        changed = [a["name"] for a, b in zip(after, before, strict=True) if a != b]
        assert changed == ["SF_REDIS_URL"], f"{d['metadata']['name']}: {changed}"
        if "SF_REDIS_CLUSTER" in known_setting_env_names():
            from streamfleet.shared.settings import CommonSettings

            for name in [n for n in os.environ if n.startswith("SF_") or n == "REDIS_URL"]:
                monkeypatch.delenv(name)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            assert CommonSettings().redis_cluster is True


def test_k8s_keda_uses_the_cluster_scaler(cluster, base):
    [so] = scaled_objects(cluster)
    [so_base] = scaled_objects(base)
    data = config(cluster)
    ns = next(d for d in cluster if d["kind"] == "Namespace")["metadata"]["name"]
    target = find(cluster, "Deployment", so["spec"]["scaleTargetRef"]["name"])
    model = env_value(container(target), "SF_MODEL")
    lanes = set(Keys(data["SF_KEY_PREFIX"]).lanes(model).values())
    assert lanes == {"sf:{tiny-gpt}:tasks:high", "sf:{tiny-gpt}:tasks:normal"}
    waiting = {Keys(data["SF_KEY_PREFIX"]).fair(model, lane).queued for lane in ("high", "normal")}
    assert {t["metadata"]["stream"] for t in so["spec"]["triggers"] if "stream" in t["metadata"]} == lanes
    assert {t["metadata"]["listName"] for t in so["spec"]["triggers"] if "listName" in t["metadata"]} == waiting
    for t, t0 in zip(so["spec"]["triggers"], so_base["spec"]["triggers"], strict=True):
        md = t["metadata"]
        # the streams' scaler, and the lists' (fair share: the tasks waiting for their turn)
        assert t["type"] == ("redis-cluster-streams" if "stream" in md else "redis-cluster")
        assert "address" not in md and "addressFromEnv" not in md, "the single-node scaler's keys"
        addresses = md.get("addresses") or data[md["addressesFromEnv"]]
        # KEDA's operator resolves names from its own namespace: fully qualified
        want = [f"{h}.{ns}.svc.cluster.local:6379" for h in pod_dns_names(cluster, 3)]
        assert [a.strip() for a in addresses.split(",")] == want
        # the rest as in the base: XLEN mode, same trigger names and auth
        assert t["name"] == t0["name"] and t["authenticationRef"] == t0["authenticationRef"]
        assert {k: v for k, v in md.items() if k != "addressesFromEnv"} == \
            {k: v for k, v in t0["metadata"].items() if k != "addressFromEnv"}
        assert "consumerGroup" not in md
    assert so["spec"]["advanced"] == so_base["spec"]["advanced"]


def test_k8s_network_policies_let_the_nodes_talk(cluster):
    policies = [d for d in cluster if d["kind"] == "NetworkPolicy"]
    p = fleet_peers(cluster)
    job = find(cluster, "Job", "streamfleet-redis-cluster-init")
    p["init"] = Peer(p["redis"].namespace, job["spec"]["template"]["metadata"]["labels"])
    for port in (6379, 16379):
        assert allowed(policies, p["redis"], p["redis"], port), f"redis -> redis:{port} is blocked"
    must = [("gateway", "redis", 6379), ("worker", "redis", 6379), ("build", "redis", 6379), ("keda", "redis", 6379),
            ("init", "redis", 6379), ("prometheus", "redis", 9121)]
    for src, dst, port in must:
        assert allowed(policies, p[src], p[dst], port), f"{src} -> {dst}:{port} is blocked"
    for proto in ("UDP", "TCP"):
        assert allowed(policies, p["init"], p["dns"], 53, proto), "the init Job cannot resolve the pods"
    must_not = [("gateway", "redis", 16379), ("worker", "redis", 16379), ("keda", "redis", 16379),
                ("init", "redis", 16379), ("debug", "redis", 6379), ("debug", "redis", 16379),
                ("outside", "redis", 16379), ("redis", "outside", 443), ("init", "outside", 443),
                ("redis", "gateway", 8000), ("init", "gateway", 8000)]
    for src, dst, port in must_not:
        assert not allowed(policies, p[src], p[dst], port), f"{src} -> {dst}:{port} is open"


def test_k8s_init_job(cluster):
    job = find(cluster, "Job", "streamfleet-redis-cluster-init")
    spec = job["spec"]
    assert spec["backoffLimit"] >= 1 and spec["activeDeadlineSeconds"] > 0 and spec["ttlSecondsAfterFinished"] > 0
    p = pod(job)
    assert p["restartPolicy"] == "Never"
    c = container(job)
    assert c["image"] == container(redis_sts(cluster), "redis")["image"]
    assert c["command"] == ["/bin/sh", "-c"]
    [script] = c["args"]
    # `$$` is Kubernetes' escape for `$`: the script must mean what it says
    assert "$$" not in script
    sts = redis_sts(cluster)
    assert init_script_nodes(script) == [f"{h}:6379" for h in pod_dns_names(cluster)]
    create = next(ln for ln in script.splitlines() if "--cluster create" in ln)
    assert "--cluster-replicas 1" in create and "--cluster-yes" in create
    auth = next(e for e in c["env"] if e["name"] == "REDISCLI_AUTH")["valueFrom"]["secretKeyRef"]
    assert (auth["name"], auth["key"]) == REDIS_SECRET
    # a Job's template is immutable: it must not name a generated (hash-suffixed) ConfigMap
    assert "configMap" not in json.dumps(p)
    assert p["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"] is True
    # the same script as the compose file's, but for the node names
    compose = compose_init_script(interpolate(yaml.load(CLUSTER_OVERRIDE.read_text(), Loader=_ComposeLoader),
                                              {})["services"])

    def strip(s: str) -> list[str]:
        return [ln.strip() for ln in s.strip().splitlines() if not ln.strip().startswith("nodes=")]

    assert strip(script) == strip(compose)
    pdb = find(cluster, "PodDisruptionBudget", "streamfleet-redis")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_component_is_documented():
    readme = (COMPONENT_DIR / "README.md").read_text()
    assert f"components/{COMPONENT}" in readme and "SF_REDIS_CLUSTER" in readme
    assert "redis-cluster-streams" in readme


# --------------------------------------------------------------------------- real clusters
def redis_bindir() -> Path:
    """The folder of the newest redis-server at hand (and its redis-cli), >= 7."""
    from streamfleet.launcher import find_redis_server, redis_server_version

    server = find_redis_server()
    if not server or not (Path(server).parent / "redis-cli").exists():
        pytest.skip("redis-server / redis-cli are not installed")
    if redis_server_version(server)[:1] < (7,):
        pytest.skip("Redis Cluster with hostnames and sharded pub/sub needs redis-server >= 7")
    return Path(server).parent


def with_path(bindir: Path, **env: str) -> dict[str, str]:
    """The environment with ``bindir`` first on PATH: the scripts' plain ``redis-server``
    and ``redis-cli`` are that Redis."""
    return {**os.environ, **env, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"}


def _wait(what: str, check, timeout: float = 20.0) -> None:
    until(check, what, timeout=timeout, interval=0.1)


class LocalNodes:
    """Six redis-server processes started the way a file starts them: ``argv`` (the node
    script, then redis-server and its options) with the port, bus port, data dir and
    bind address made local."""

    def __init__(self, tmp: Path, bindir: Path, password: str | None = None):
        from tests.support.ports import free_port

        self.tmp = tmp
        self.bindir = bindir
        self.password = password
        self.ports = [free_port() for _ in range(6)]
        self.bus = [free_port() for _ in range(6)]
        self.procs: list[subprocess.Popen | None] = [None] * 6
        self.argv: list[list[str]] = [[]] * 6
        self.env: list[dict[str, str]] = [{}] * 6

    def dir(self, i: int) -> Path:
        d = self.tmp / f"node{i}"
        d.mkdir(exist_ok=True)
        return d

    def start(self, i: int, argv: list[str], env: dict[str, str]) -> None:
        self.argv[i], self.env[i] = argv, env
        log = open(self.dir(i) / "log", "ab")  # noqa: SIM115 (closed with the process)
        self.procs[i] = subprocess.Popen(argv, env=with_path(self.bindir, **env), cwd=self.dir(i), stdout=log,
                                         stderr=log)
        log.close()

    def restart(self, i: int) -> None:
        self.start(i, self.argv[i], self.env[i])

    def cli(self, i: int, *args: str) -> str:
        env = with_path(self.bindir, **({"REDISCLI_AUTH": self.password} if self.password else {}))
        p = subprocess.run(["redis-cli", "-p", str(self.ports[i]), *args], capture_output=True, text=True,
                           timeout=10, env=env)
        return p.stdout.replace("\r", "")

    def info(self, i: int, *args: str) -> dict[str, str]:
        return dict(ln.split(":", 1) for ln in self.cli(i, *args).splitlines() if ":" in ln and not ln.startswith("#"))

    def stop(self, i: int) -> None:
        proc = self.procs[i]
        if proc and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def stop_all(self) -> None:
        for i in range(6):
            self.stop(i)

    def links_up(self) -> bool:
        """Every node sees the other five connected, and none failing."""
        for i in range(6):
            lines = [ln.split() for ln in self.cli(i, "cluster", "nodes").splitlines() if ln.strip()]
            if len(lines) != 6 or any(f[7] != "connected" or "fail" in f[2] for f in lines):
                return False
        return True

    def check_cluster(self, endpoint: str | list[str]) -> None:
        """3 primaries with every slot between them, one replica each, in sync; clients
        are sent to ``endpoint`` (the announced hostnames)."""
        _wait("cluster_state:ok on every node", lambda: all(self.info(i, "cluster", "info").get("cluster_state") == "ok"
                                                            for i in range(6)))
        _wait("all links up", self.links_up)
        roles = [self.info(i, "info", "replication") for i in range(6)]
        primaries = [r for r in roles if r["role"] == "master"]
        replicas = [r for r in roles if r["role"] == "slave"]
        assert len(primaries) == 3 and len(replicas) == 3
        assert {r["master_port"] for r in replicas} == {str(self.ports[i]) for i in range(6)
                                                        if roles[i]["role"] == "master"}, "one replica per primary"
        _wait("replicas in sync", lambda: all(self.info(i, "info", "replication").get("master_link_status") == "up"
                                              for i in range(6) if roles[i]["role"] == "slave"))
        info = self.info(0, "cluster", "info")
        assert info["cluster_slots_assigned"] == "16384" and info["cluster_size"] == "3"
        # CLUSTER SLOTS names the hostnames (cluster-preferred-endpoint-type hostname)
        lines = self.cli(0, "cluster", "slots").splitlines()
        hosts = {lines[j] for j, ln in enumerate(lines[:-1]) if lines[j + 1].strip().isdigit()
                 and int(lines[j + 1]) in self.ports}
        wanted = {endpoint} if isinstance(endpoint, str) else set(endpoint)
        assert hosts and hosts <= wanted, f"endpoints {hosts}, not {wanted}"
        # a model's lanes share a slot; sharded pub/sub (Redis 7) is there
        slots = {self.cli(0, "cluster", "keyslot", k).strip() for k in ("sf:{tiny-gpt}:tasks:high",
                                                                        "sf:{tiny-gpt}:tasks:normal")}
        assert len(slots) == 1
        replies = [self.cli(i, "spublish", "sf:{tiny-gpt}:reply:x", "m").strip() for i in range(6)]
        assert replies.count("0") == 2, replies  # the shard that owns the slot: its primary and replica
        for r in replies:
            # the others redirect to it by name
            assert r == "0" or (re.fullmatch(r"MOVED \d+ (\S+):\d+", r) and r.split()[2].rsplit(":", 1)[0] in wanted), r


def run_init(script: str, nodes: LocalNodes, local: list[str], env: dict[str, str] | None = None):
    env = with_path(nodes.bindir, REDIS_CLUSTER_INIT_TIMEOUT_S="60", **(env or {}))
    if nodes.password:
        env["REDISCLI_AUTH"] = nodes.password
    m = re.search(r'^(\s*nodes=")[^"]+(")', script, re.MULTILINE)
    script = script[:m.start()] + m.group(1) + " ".join(local) + m.group(2) + script[m.end():]
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=90, env=env)


@pytest.fixture
def local_nodes(tmp_path):
    made: list[LocalNodes] = []

    def make(password: str | None = None) -> LocalNodes:
        made.append(LocalNodes(tmp_path, redis_bindir(), password))
        return made[-1]

    yield make
    for n in made:
        n.stop_all()


def test_compose_cluster_forms_and_survives_new_addresses(merged, local_nodes):
    """The compose nodes' options, node script and health check, and the init service's
    script, run here; then every node restarts with its peers' addresses gone stale in
    nodes.conf (as after `down` + `up` with new container IPs): the node script points
    them at what the hostnames resolve to, and the links come back."""
    services = merged["services"]
    nodes = local_nodes()
    mounts = {}
    for v in services["redis-0"]["volumes"]:
        src, dst = str(v).split(":")[:2]
        mounts[dst] = src
    for i in range(6):
        svc = services[f"redis-{i}"]
        argv = [str(a) for a in svc["command"]]
        for flag, value in (("--port", nodes.ports[i]), ("--dir", nodes.dir(i))):
            argv[argv.index(flag) + 1] = str(value)
        argv += ["--cluster-port", str(nodes.bus[i]), "--bind", "127.0.0.1", "--maxmemory", "64mb", *FAST_SYNC]
        entry = [str(a) for a in svc["entrypoint"]]
        entry[1] = str(REPO / mounts[entry[1]])  # the script as mounted from the repository
        # "redis-N" resolves in the compose network only; localhost plays its part here
        env = {"REDIS_CLUSTER_ANNOUNCE_HOSTNAME": "localhost", "REDIS_NODES_CONF": str(nodes.dir(i) / "nodes.conf")}
        assert svc["environment"]["REDIS_CLUSTER_ANNOUNCE_HOSTNAME"] == f"redis-{i}"
        nodes.start(i, entry + argv, env)
    health = services["redis-0"]["healthcheck"]["test"][1]
    for i in range(6):
        check = health.replace("-p 6379", f"-p {nodes.ports[i]}")
        _wait(f"redis-{i} healthy", lambda c=check: subprocess.run(["sh", "-c", c], capture_output=True,
                                                                   env=with_path(nodes.bindir)).returncode == 0)

    script = compose_init_script(services)
    local = [f"localhost:{p}" for p in nodes.ports]
    first = run_init(script, nodes, local)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "cluster_state:ok on every node" in first.stdout
    nodes.check_cluster("localhost")
    again = run_init(script, nodes, local)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr

    # every node down; their nodes.conf now name addresses nobody listens on
    nodes.stop_all()
    for i in range(6):
        conf = nodes.dir(i) / "nodes.conf"
        conf.write_text(conf.read_text().replace("127.0.0.1:", "127.0.0.9:"))
    for i in range(6):
        nodes.restart(i)
    _wait("all links up again", nodes.links_up, timeout=30)
    nodes.check_cluster("localhost")
    for i in range(6):
        assert "127.0.0.9" not in (nodes.dir(i) / "nodes.conf").read_text()


def test_k8s_cluster_forms_with_the_rendered_config(cluster, local_nodes):
    """The StatefulSet's command, args and env (password, announced FQDN) and its
    ConfigMap (redis.conf + cluster.conf + the node script) start six nodes here; the
    init Job's script creates the cluster through the password; the readiness probe
    passes once each replica is in sync."""
    sts = redis_sts(cluster)
    c = container(sts, "redis")
    nodes = local_nodes(TEST_PASSWORD)
    etc = nodes.tmp / "etc"
    etc.mkdir()
    files = redis_conf_files(cluster)
    local_path = {}
    for path, text in files.items():
        local_path[path] = str(etc / Path(path).name)
        # Redis changes into `dir` while it reads the file, before --dir applies: the
        # node's working directory (its own folder here) stands in for the volume
        Path(local_path[path]).write_text(re.sub(r"^dir /data$", "dir .", text, flags=re.MULTILINE))

    def localize(s: str) -> str:
        for path, here in local_path.items():
            s = s.replace(path, here)
        return s

    ns = next(d for d in cluster if d["kind"] == "Namespace")["metadata"]["name"]
    fqdns = [f"{h}.{ns}.svc.cluster.local" for h in pod_dns_names(cluster)]

    def expand(value: str, env: dict[str, str]) -> str:
        """Kubernetes' $(VAR): replaced when VAR is defined, else left as written."""
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)

    for i in range(6):
        # what the kubelet gives the container: fieldRefs, the Secret, then $(VAR) expansion
        env: dict[str, str] = {}
        for e in c["env"]:
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            elif "fieldRef" in e["valueFrom"]:
                env[e["name"]] = {"metadata.name": f"{sts['metadata']['name']}-{i}",
                                  "metadata.namespace": ns}[e["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                ref = e["valueFrom"]["secretKeyRef"]
                env[e["name"]] = {REDIS_SECRET: TEST_PASSWORD}[(ref["name"], ref["key"])]
        assert env["REDIS_CLUSTER_ANNOUNCE_HOSTNAME"] == fqdns[i]
        args = [expand(a, env) for a in c["args"]]
        assert "$(" not in " ".join(args)
        argv = [localize(a) for a in c["command"] + args]
        argv += ["--port", str(nodes.ports[i]), "--cluster-port", str(nodes.bus[i]), "--dir", str(nodes.dir(i)),
                 "--bind", "127.0.0.1", "--maxmemory", "64mb", *FAST_SYNC]
        env["REDIS_NODES_CONF"] = str(nodes.dir(i) / "nodes.conf")
        nodes.start(i, argv, env)

    # the probes call plain `redis-cli`: a wrapper per node points it at that node's port
    def probe_ok(i: int, kind: str) -> bool:
        bindir = nodes.tmp / f"bin{i}"
        if not bindir.exists():
            bindir.mkdir()
            cli = nodes.bindir / "redis-cli"
            (bindir / "redis-cli").write_text(f'#!/bin/sh\nexec {cli} -p {nodes.ports[i]} "$@"\n')
            (bindir / "redis-cli").chmod(0o755)
        env = {"PATH": f"{bindir}:{os.environ['PATH']}", "REDISCLI_AUTH": TEST_PASSWORD}
        return subprocess.run(c[kind]["exec"]["command"], env=env, capture_output=True, timeout=10).returncode == 0

    for i in range(6):
        _wait(f"node {i} ready", lambda i=i: probe_ok(i, "readinessProbe"))
    assert "NOAUTH" in subprocess.run([str(nodes.bindir / "redis-cli"), "-p", str(nodes.ports[0]), "ping"],
                                      capture_output=True, text=True).stdout, "the nodes require the password"

    job = find(cluster, "Job", "streamfleet-redis-cluster-init")
    [script] = container(job)["args"]
    result = run_init(script, nodes, [f"localhost:{p}" for p in nodes.ports])
    assert result.returncode == 0, result.stdout + result.stderr
    nodes.check_cluster(fqdns)
    for i in range(6):
        _wait(f"node {i} ready in the cluster", lambda i=i: probe_ok(i, "readinessProbe"))
        assert probe_ok(i, "livenessProbe")
