"""deploy/k8s as operated: what an apply, a release, a hang, a Redis restart, an idle hour
or a stray pod does to the fleet.

* An apply never resets the autoscaled counts (no ``replicas:`` under an HPA / KEDA).
* Workers run TensorRT plans built beforehand by a Job that ends (a suspended CronJob is
  its template), mount the models read-only and never build; liveness sees a hang.
* Redis requires a password from a Secret (gateways, workers, the build Job, KEDA and
  redis_exporter get it), and its probes want PONG, not just redis-cli's exit status
  (run here against a real redis-server where one is installed).
* KEDA scales on the lanes' lengths (XLEN = queued + in flight), on streams derived from
  the settings, and may scale to zero (components/scale-to-zero).
* Default-deny NetworkPolicies plus the flows the fleet needs, checked by evaluating the
  policies for concrete pairs of pods.
* Optional kustomize components (storage classes, scale-to-zero, Gateway API, ingress-nginx)
  rendered inside a throw-away overlay.

Offline like test_deploy_configs.py: rendered with the real ``kubectl kustomize``
(tests/support/deploy.py; skipped without kubectl); built-in kinds validated against
kubernetes-validate's schemas, CRD kinds (KEDA, Gateway API) checked field by field.
"""

from __future__ import annotations

import copy
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from streamfleet.shared.keys import LANES, Keys
from streamfleet.shared.settings import CommonSettings, WorkerSettings
from tests.support.deploy import (
    CLUSTER_SCOPED,
    COMPONENTS,
    K8S_BASE,
    REDIS_SECRET,
    TEST_PASSWORD,
    allowed,
    build_cronjobs,
    component_names,
    config,
    container,
    containers,
    env_value,
    find,
    fleet_peers,
    k8s_env,
    known_setting_env_names,
    kubernetes_schema_versions,
    pod,
    render,
    scaled_objects,
    templates,
    workloads,
)

pytestmark = pytest.mark.timeout(180)

GPU = "nvidia.com/gpu"
#: storage classes known to give ReadWriteMany on each cloud
RWX_CLASSES = {
    "aws-efs": {"efs-sc"},
    "gcp-filestore": {"standard-rwx", "premium-rwx", "enterprise-rwx", "zonal-rwx", "enterprise-multishare-rwx"},
    "azure-files": {"azurefile-csi", "azurefile-csi-premium", "azurefile", "azurefile-premium"},
}
GATEWAY_API = "gateway.networking.k8s.io/"


# --------------------------------------------------------------------------- rendering
def worker_deployments(docs: list[dict]) -> list[dict]:
    """The Deployments a KEDA ScaledObject scales: the GPU workers, one per model."""
    return [find(docs, so["spec"]["scaleTargetRef"].get("kind", "Deployment"), so["spec"]["scaleTargetRef"]["name"])
            for so in scaled_objects(docs)]


# --------------------------------------------------------------------------- 1. replicas
def test_apply_never_resets_autoscaled_replicas(overlays_root):
    """`kubectl apply -k` re-sends whatever `replicas:` the files hold, undoing the HPA's or
    KEDA's count at every apply; without one a first apply starts one pod."""
    for comps in [(), *((c,) for c in component_names())]:
        docs = render(overlays_root, *comps)
        hpas = {d["spec"]["scaleTargetRef"]["name"] for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
        keda = {d["spec"]["scaleTargetRef"]["name"] for d in scaled_objects(docs)}
        assert "streamfleet-gateway" in hpas and "streamfleet-worker" in keda, comps
        assert not hpas & keda, "one autoscaler per Deployment"
        for d in docs:
            if d["kind"] == "Deployment" and d["metadata"]["name"] in hpas | keda:
                assert "replicas" not in d["spec"], \
                    f"{comps}: {d['metadata']['name']} sets replicas under an autoscaler"
    gw = find(render(overlays_root), "HorizontalPodAutoscaler", "streamfleet-gateway")
    assert gw["spec"]["minReplicas"] >= 2


# --------------------------------------------------------------------------- 2. readiness
def test_manifests_do_not_tie_gateway_readiness_to_workers():
    """Gateways are ready with Redis + pub/sub and not draining; no manifest may still say
    they need a live worker (the reason once given for minReplicaCount >= 1)."""
    stale = []
    for p in sorted(K8S_BASE.rglob("*.yaml")):
        if "monitoring" in p.relative_to(K8S_BASE).parts:
            continue
        text = p.read_text()
        for m in re.finditer(r"(?i)ready[^\n]*live worker|live worker[^\n]*ready", text):
            stale.append(f"{p.relative_to(K8S_BASE)}: {m.group(0).strip()}")
    assert not stale, "\n".join(stale)
    worker = (K8S_BASE / "worker.yaml").read_text()
    assert "components/scale-to-zero" in worker, "worker.yaml points at the scale-to-zero component"


def test_scale_to_zero_component(overlays_root, base):
    so = find(base, "ScaledObject", "streamfleet-worker")["spec"]
    assert so["minReplicaCount"] == 1, "the base keeps one worker warm"
    zero_docs = render(overlays_root, "scale-to-zero")
    zero = find(zero_docs, "ScaledObject", "streamfleet-worker")["spec"]
    assert zero["minReplicaCount"] == 0
    assert zero["cooldownPeriod"] >= 300, "the last GPU is released only after the lanes stayed empty a while"
    # one queued task wakes the workers: the composite metric must exceed activationTarget
    mod = zero["advanced"]["scalingModifiers"]
    assert float(mod.get("activationTarget", "0")) == 0
    # a request queued during a cold start must not time out before a worker exists
    assert float(config(zero_docs)["SF_REQUEST_TIMEOUT_S"]) >= 300 > float(config(base)["SF_REQUEST_TIMEOUT_S"])


def test_cooldown_only_where_it_acts(overlays_root):
    """cooldownPeriod only delays 1 -> 0: with minReplicaCount >= 1 it would be a no-op
    that reads like a scale-down delay."""
    for comps in [(), *((c,) for c in component_names())]:
        for so in scaled_objects(render(overlays_root, *comps)):
            spec = so["spec"]
            if spec["minReplicaCount"] >= 1:
                assert "cooldownPeriod" not in spec, f"{comps}: cooldownPeriod with minReplicaCount >= 1"
            else:
                assert "cooldownPeriod" in spec, f"{comps}: scale to zero without a cooldownPeriod"


# --------------------------------------------------------------------------- 3. storage
@pytest.mark.parametrize("component", sorted(RWX_CLASSES))
def test_models_volume_storage_class_component(overlays_root, base, component):
    pvc = find(render(overlays_root, component), "PersistentVolumeClaim", "streamfleet-models")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"].get("storageClassName") in RWX_CLASSES[component], pvc["spec"]
    # the base leaves the choice to the cluster's default class (or the component)
    assert "storageClassName" not in find(base, "PersistentVolumeClaim", "streamfleet-models")["spec"]
    text = (COMPONENTS / component / "kustomization.yaml").read_text()
    assert "StorageClass" in text or "class" in text.lower(), "the component says what it needs"


def test_storage_components_touch_only_the_models_claim(overlays_root, base):
    for component in RWX_CLASSES:
        docs = render(overlays_root, component)
        assert len(docs) == len(base)
        changed = [d for d, b in zip(docs, base) if d != b]
        assert [(d["kind"], d["metadata"]["name"]) for d in changed] == \
            [("PersistentVolumeClaim", "streamfleet-models")], component


# --------------------------------------------------------------------------- 4. plans
def test_gpu_workers_load_plans_and_never_build(base, monkeypatch):
    workers = worker_deployments(base)
    assert workers
    for dep in workers:
        c = container(dep)
        assert c["args"] == ["worker"] and str(c["resources"]["limits"][GPU]) == "1"
        # the TensorRT engine, whatever engine.toml names; no build in the worker
        env = k8s_env(c, base, {REDIS_SECRET: TEST_PASSWORD})
        for name in list(os.environ):
            if name.startswith("SF_") or name == "REDIS_URL":
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        s = WorkerSettings()
        assert s.backend == "tensorrt", "a GPU worker must not fall back to CPU ONNX Runtime"
        assert s.trt_build_if_missing is False, "workers load plans; the engine-build Job builds them"
        assert s.engines_dir and s.model == dep["metadata"]["labels"]["streamfleet.io/model"]
        # the model repository is read-only for everything in the worker pod
        models = {v["name"] for v in pod(dep)["volumes"] if "persistentVolumeClaim" in v}
        assert models
        for v in pod(dep)["volumes"]:
            if v["name"] in models:
                assert v["persistentVolumeClaim"].get("readOnly") is True
        for cc in containers(dep):
            for m in cc.get("volumeMounts", []):
                if m["name"] in models:
                    assert m.get("readOnly") is True, f"{cc['name']} mounts the models writable"
        assert s.engines_dir in {m["mountPath"] for m in c["volumeMounts"] if m["name"] in models}
        # loading a plan takes minutes: the startup probe must allow for it
        sp = c["startupProbe"]
        assert sp["periodSeconds"] * sp["failureThreshold"] >= 900, "startupProbe too short for a plan load"
        assert sp["httpGet"]["port"] == "metrics"


def test_plans_are_built_by_a_job_that_ends(base):
    """Nothing but the autoscaled workers holds a GPU while idle: the builder is a Job,
    started from a suspended CronJob (its template, kept current by every apply)."""
    workers = {d["metadata"]["name"] for d in worker_deployments(base)}
    for d in base:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"):
            gpus = [c for c in containers(d) if GPU in c.get("resources", {}).get("limits", {})]
            if gpus:
                assert d["kind"] == "Deployment" and d["metadata"]["name"] in workers, \
                    f"{d['kind']}/{d['metadata']['name']} holds a GPU while idle"
    crons = build_cronjobs(base)
    models = {env_value(container(w), "SF_MODEL") for w in worker_deployments(base)}
    assert {c["metadata"]["labels"]["streamfleet.io/model"] for c in crons} == models, "one build per served model"
    import typer.main

    from streamfleet.engines_cli import engines_app

    build_cmd = typer.main.get_command(engines_app).commands["build"]
    for cron in crons:
        spec = cron["spec"]
        assert spec["suspend"] is True, "a template: builds start with kubectl create job --from"
        assert spec["concurrencyPolicy"] == "Forbid"
        job = spec["jobTemplate"]["spec"]
        assert job["template"]["spec"]["restartPolicy"] == "Never"
        assert job["backoffLimit"] <= 2 and job["activeDeadlineSeconds"] > 0 and job["ttlSecondsAfterFinished"] > 0
        c = container(cron)
        model = cron["metadata"]["labels"]["streamfleet.io/model"]
        assert c["args"] == ["engines", "build", model], "a local build that exits, not a queue worker"
        assert build_cmd.params[0].name == "model", "`streamfleet engines build MODEL` exists"
        assert str(c["resources"]["limits"][GPU]) == "1"
        worker = next(w for w in worker_deployments(base) if env_value(container(w), "SF_MODEL") == model)
        # the same image (TensorRT version) and the same GPU model (architecture) as the workers
        assert c["image"] == container(worker)["image"]
        for key in ("tolerations", "nodeSelector", "affinity"):
            assert pod(cron).get(key) == pod(worker).get(key), f"{key} differs between the build Job and the workers"
        claims = lambda d: {v["persistentVolumeClaim"]["claimName"] for v in pod(d)["volumes"]  # noqa: E731
                            if "persistentVolumeClaim" in v}
        assert claims(cron) == claims(worker)
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert not mounts[env_value(c, "SF_ENGINES_DIR")].get("readOnly"), "the build writes the plans"
        seed = pod(cron).get("initContainers", [])
        assert seed and seed[0]["command"][:2] == ["cp", "-Rn"], "the Job seeds the models, never overwriting"


def test_build_phase_selection_is_self_sufficient(base):
    """`kubectl apply -k … -l streamfleet.io/phase=build` applies the build Job's template
    and everything it references (besides the Secret), and no workload that holds a GPU."""
    phase = [d for d in base if d["metadata"].get("labels", {}).get("streamfleet.io/phase") == "build"]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in phase}
    assert {k for k, _ in kinds} == {"Namespace", "ServiceAccount", "PersistentVolumeClaim", "ConfigMap", "CronJob"}
    for cron in build_cronjobs(base):
        assert ("CronJob", cron["metadata"]["name"]) in kinds
        p = pod(cron)
        assert ("ServiceAccount", p["serviceAccountName"]) in kinds
        for v in p["volumes"]:
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in kinds
        for c in containers(cron):
            for src in c.get("envFrom", []):
                assert ("ConfigMap", src["configMapRef"]["name"]) in kinds
    assert not [d for d in phase if d["kind"] in ("Deployment", "StatefulSet")]


# --------------------------------------------------------------------------- 6. liveness
def test_worker_liveness_sees_a_hang(base):
    """/metrics answers while the engine is stuck; /healthz on the metrics port is 503 once
    work is in flight and no step has finished for SF_WORKER_STALL_S."""
    for dep in worker_deployments(base):
        c = container(dep)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == int(env_value(c, "SF_METRICS_PORT"))
        live = c["livenessProbe"]["httpGet"]
        assert live == {"path": "/healthz", "port": "metrics"}, live
        # restart only after the stall threshold (60 s) has shown up a few times
        lp = c["livenessProbe"]
        assert lp["periodSeconds"] * lp["failureThreshold"] >= 60


# --------------------------------------------------------------------------- 8. Redis probes
def _redis_probe_commands(docs: list[dict]) -> dict[str, list[str]]:
    c = container(find(docs, "StatefulSet", "streamfleet-redis"), "redis")
    return {kind: c[kind]["exec"]["command"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}


def _run_probe(cmd: list[str], bindir: Path, **env: str) -> int:
    full = {"PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}", **env}
    return subprocess.run(cmd, env=full, capture_output=True, timeout=20).returncode


def _fake_cli(bindir: Path, output: str) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    cli = bindir / "redis-cli"
    cli.write_text(f"#!/bin/sh\nprintf '%s\\n' '{output}'\nexit 0\n")
    cli.chmod(0o755)


@pytest.mark.parametrize("answer", ["LOADING Redis is loading the dataset in memory",
                                    "NOAUTH Authentication required.",
                                    "WRONGPASS invalid username-password pair or user is disabled.",
                                    "BUSY Redis is busy running a script.", ""])
def test_redis_probes_fail_unless_pong(base, tmp_path, answer):
    """redis-cli exits 0 whatever Redis replies; the probes must look at the reply."""
    _fake_cli(tmp_path / "bad", answer)
    _fake_cli(tmp_path / "good", "PONG")
    for kind, cmd in _redis_probe_commands(base).items():
        assert _run_probe(cmd, tmp_path / "bad") != 0, f"{kind} passes on {answer!r}"
        assert _run_probe(cmd, tmp_path / "good") == 0, f"{kind} fails on PONG"


@pytest.fixture
def redis_with_password(tmp_path):
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not binary or not cli:
        pytest.skip("redis-server / redis-cli not installed (test_redis_probes_fail_unless_pong covers the logic)")
    from tests.support.ports import free_port

    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--requirepass", TEST_PASSWORD, "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while subprocess.run([cli, "-p", str(port), "--no-auth-warning", "-a", TEST_PASSWORD, "ping"],
                             capture_output=True, text=True).stdout.strip() != "PONG":
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
        # the probes call plain `redis-cli`: this one talks to the test server's port
        bindir = tmp_path / "bin"
        bindir.mkdir()
        (bindir / "redis-cli").write_text(f'#!/bin/sh\nexec {cli} -p {port} "$@"\n')
        (bindir / "redis-cli").chmod(0o755)
        yield bindir
    finally:
        proc.terminate()
        proc.wait(10)


def test_redis_probes_against_a_real_server(base, redis_with_password):
    bindir = redis_with_password
    c = container(find(base, "StatefulSet", "streamfleet-redis"), "redis")
    # the probes authenticate through REDISCLI_AUTH, from the Secret
    auth = next(e for e in c["env"] if e["name"] == "REDISCLI_AUTH")["valueFrom"]["secretKeyRef"]
    assert (auth["name"], auth["key"]) == REDIS_SECRET
    # what the old probe did: exit 0 although Redis refused it
    assert _run_probe(["redis-cli", "ping"], bindir) == 0
    for kind, cmd in _redis_probe_commands(base).items():
        assert _run_probe(cmd, bindir, REDISCLI_AUTH=TEST_PASSWORD) == 0, kind
        assert _run_probe(cmd, bindir, REDISCLI_AUTH="wrong") != 0, f"{kind} passes with a wrong password"
        assert _run_probe(cmd, bindir) != 0, f"{kind} passes without auth (NOAUTH)"


# --------------------------------------------------------------------------- 9. KEDA
def test_keda_scales_on_lane_lengths_of_the_served_model(overlays_root):
    """XLEN of a lane = queued + in flight (workers XACK + XDEL on finish); `lag` can read
    NULL after XDEL and XPENDING fails before the group exists. The streams are the lane
    keys of the target's SF_MODEL under SF_KEY_PREFIX (shared/keys.py), the lists their
    tasks waiting for their tenant's turn (LLEN)."""
    for comps in [(), ("scale-to-zero",)]:
        docs = render(overlays_root, *comps)
        prefix = config(docs)["SF_KEY_PREFIX"]
        for so in scaled_objects(docs):
            spec = so["spec"]
            target = find(docs, "Deployment", spec["scaleTargetRef"]["name"])
            model = env_value(container(target), "SF_MODEL")
            assert so["metadata"]["labels"]["streamfleet.io/model"] == model
            lanes = Keys(prefix).lanes(model)
            waiting = {lane: Keys(prefix).fair(model, lane).queued for lane in LANES}
            streams = [t for t in spec["triggers"] if t["type"] == "redis-streams"]
            lists = [t for t in spec["triggers"] if t["type"] == "redis"]
            assert len(streams) + len(lists) == len(spec["triggers"])
            by_stream = {t["metadata"]["stream"]: t for t in streams}
            assert set(by_stream) == set(lanes.values()), f"streams {set(by_stream)} != lane keys {lanes}"
            # the tasks waiting for their tenant's turn (fair share): LLEN of each lane's list
            by_list = {t["metadata"]["listName"]: t for t in lists}
            assert set(by_list) == set(waiting.values()), f"lists {set(by_list)} != waiting lists {waiting}"
            names = set()
            for t in spec["triggers"]:
                md = t["metadata"]
                assert "consumerGroup" not in md, "with a consumerGroup the scaler reads XPENDING or lag, not XLEN"
                assert set(md) & {"lagCount", "pendingEntriesCount"} == set()
                length = md["streamLength"] if t["type"] == "redis-streams" else md["listLength"]
                assert isinstance(length, str) and length.isdigit()
                assert md["addressFromEnv"] == "KEDA_REDIS_ADDRESS" and "KEDA_REDIS_ADDRESS" in config(docs)
                assert re.fullmatch(r"[a-z_][a-z0-9_]*", t["name"])
                names.add(t["name"])
            assert {by_stream[lanes[lane]]["name"] for lane in LANES} | \
                {by_list[waiting[lane]]["name"] for lane in LANES} == names
            _check_formula(spec, names)


def _check_formula(spec: dict, names: set[str]) -> None:
    mod = spec["advanced"]["scalingModifiers"]
    formula = mod["formula"]
    assert re.fullmatch(r"[a-z0-9_+*() .]+", formula), formula
    assert set(re.findall(r"[a-z_][a-z0-9_]*", formula)) == names, "every lane counts, nothing else"
    target, activation = float(mod["target"]), float(mod.get("activationTarget", "0"))
    assert mod.get("metricType", "AverageValue") == "AverageValue"

    def value(**lens: int) -> float:
        return eval(formula, {"__builtins__": {}}, {n: lens.get(n, 0) for n in names})

    def desired(**lens: int) -> int:
        v = value(**lens)
        if v <= activation:
            return spec["minReplicaCount"]
        return min(max(math.ceil(v / target), spec["minReplicaCount"], 1), spec["maxReplicaCount"])

    lane = sorted(names)
    assert value() == 0 and desired() == spec["minReplicaCount"]
    assert desired(**{lane[0]: 1}) == 1, "one queued task wakes a worker"
    # one worker per `target` slots of work queued or running, whatever the lane
    assert desired(**{lane[0]: int(target)}) == 1
    assert desired(**{lane[0]: int(target), lane[-1]: int(target) + 1}) == 3
    assert desired(**{lane[-1]: int(target) * 100}) == spec["maxReplicaCount"]


def test_keda_authenticates_with_the_redis_secret(base):
    for so in scaled_objects(base):
        for t in so["spec"]["triggers"]:
            ta = find(base, "TriggerAuthentication", t["authenticationRef"]["name"])
            refs = {(r["parameter"], r["name"], r["key"]) for r in ta["spec"]["secretTargetRef"]}
            assert refs == {("password", *REDIS_SECRET)}
            assert "password" not in t["metadata"] and "passwordFromEnv" not in t["metadata"]


# --------------------------------------------------------------------------- 10. Redis auth
def test_redis_password_from_the_secret_reaches_every_client(base, monkeypatch):
    secrets = {REDIS_SECRET: TEST_PASSWORD}
    from redis.connection import parse_url

    base_url = parse_url(config(base)["SF_REDIS_URL"])
    assert "password" not in base_url, "no password in the ConfigMap"
    # the server requires it
    sts = find(base, "StatefulSet", "streamfleet-redis")
    rc = container(sts, "redis")
    env = k8s_env(rc, base, secrets)
    args = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in rc["args"]]
    assert args[args.index("--requirepass") + 1] == TEST_PASSWORD
    # every streamfleet process connects with it, to the ConfigMap's host, port and db
    clients = [d for d in workloads(base) if d["metadata"]["labels"].get("app.kubernetes.io/component")
               in ("gateway", "worker", "engine-build")]
    assert {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in clients} == \
        {"gateway", "worker", "engine-build"}
    for d in clients:
        c = container(d)
        env = k8s_env(c, base, secrets)
        for name in list(os.environ):
            if name.startswith("SF_") or name == "REDIS_URL":
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        url = CommonSettings().redis_url
        got = parse_url(url)
        assert got.pop("password") == TEST_PASSWORD, f"{d['metadata']['name']}: {url}"
        assert got == base_url, f"{d['metadata']['name']} connects elsewhere than SF_REDIS_URL says"
    # no Secret with a value in git
    assert not [d for d in base if d["kind"] == "Secret"]
    assert TEST_PASSWORD not in yaml.safe_dump_all(base)


# --------------------------------------------------------------------------- 10. metrics
def test_redis_exporter_sidecar(base):
    sts = find(base, "StatefulSet", "streamfleet-redis")
    assert container(sts)["name"] == "redis", "Redis stays the first container"
    ex = container(sts, "redis-exporter")
    assert re.fullmatch(r"oliver006/redis_exporter:v\d+\.\d+\.\d+(-alpine)?", ex["image"]), "a pinned version"
    assert {p["name"]: p["containerPort"] for p in ex["ports"]} == {"metrics": 9121}
    env = k8s_env(ex, base, {REDIS_SECRET: TEST_PASSWORD})
    assert env["REDIS_PASSWORD"] == TEST_PASSWORD
    assert env["REDIS_ADDR"] in ("redis://127.0.0.1:6379", "redis://localhost:6379")
    # output buffers per client (a gateway's pub/sub socket falling behind)
    assert env["REDIS_EXPORTER_EXPORT_CLIENT_LIST"] == "true"
    assert env.get("REDIS_EXPORTER_REDACT_CONFIG_METRICS", "true") == "true"
    assert ex["livenessProbe"]["httpGet"]["port"] == "metrics"
    ann = sts["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == "9121" and ann["prometheus.io/scrape"] == "true"


def test_gateway_worker_and_redis_expose_a_metrics_port(base):
    for kind, name in (("Deployment", "streamfleet-gateway"), ("Deployment", "streamfleet-worker"),
                       ("StatefulSet", "streamfleet-redis")):
        d = find(base, kind, name)
        ports = [p for c in pod(d)["containers"] for p in c.get("ports", []) if p["name"] == "metrics"]
        assert len(ports) == 1, name
        ann = d["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/port"] == str(ports[0]["containerPort"]), name


# --------------------------------------------------------------------------- 10. NetworkPolicy
def test_network_policies_default_deny_with_the_needed_flows(base):
    policies = [d for d in base if d["kind"] == "NetworkPolicy"]
    p = fleet_peers(base)
    must = [
        ("ingress", "gateway", 8000), ("ingress", "gateway", 50051), ("outside", "gateway", 8000),
        ("gateway", "redis", 6379), ("worker", "redis", 6379), ("build", "redis", 6379), ("keda", "redis", 6379),
        ("prometheus", "gateway", 9100), ("prometheus", "worker", 9100), ("prometheus", "redis", 9121),
    ]
    for src, dst, port in must:
        assert allowed(policies, p[src], p[dst], port), f"{src} -> {dst}:{port} is blocked"
    for who in ("gateway", "worker", "redis", "build"):
        for proto in ("UDP", "TCP"):
            assert allowed(policies, p[who], p["dns"], 53, proto), f"{who} cannot resolve names ({proto})"
    must_not = [
        ("debug", "redis", 6379), ("outside", "redis", 6379), ("ingress", "redis", 6379),
        ("prometheus", "redis", 6379), ("ingress", "worker", 9100), ("outside", "worker", 9100),
        ("gateway", "worker", 9100), ("debug", "gateway", 9100), ("redis", "gateway", 8000),
        ("worker", "outside", 443), ("gateway", "outside", 443), ("build", "outside", 443),
        ("redis", "outside", 443), ("keda", "gateway", 9100),
    ]
    for src, dst, port in must_not:
        assert not allowed(policies, p[src], p[dst], port), f"{src} -> {dst}:{port} is open"
    # default deny covers every pod of the namespace, both ways
    deny = [d for d in policies if d["spec"]["podSelector"] == {} and not d["spec"].get("ingress")
            and not d["spec"].get("egress")]
    assert deny and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}


# --------------------------------------------------------------------------- 10. ways in
def test_ingress_nginx_component(overlays_root):
    docs = render(overlays_root, "ingress-nginx")
    ingresses = [d for d in docs if d["kind"] == "Ingress"]
    assert len(ingresses) == 2
    svc = find(docs, "Service", "streamfleet-gateway")
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    origins = config(docs)["SF_ALLOWED_ORIGINS"].split(",")
    grpc_seen = False
    for ing in ingresses:
        ann = ing["metadata"]["annotations"]
        spec = ing["spec"]
        tls_hosts = {h for t in spec["tls"] for h in t["hosts"]}
        assert all(t.get("secretName") for t in spec["tls"])
        assert ann.get("nginx.ingress.kubernetes.io/ssl-redirect") == "true"
        for key in ("proxy-read-timeout", "proxy-send-timeout"):
            assert int(ann[f"nginx.ingress.kubernetes.io/{key}"]) >= 3600, key
        for rule in spec["rules"]:
            assert rule["host"] in tls_hosts, f"{rule['host']} without TLS"
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                assert backend["name"] == "streamfleet-gateway"
                port = svc_ports[backend["port"]["name"]]
                if ann.get("nginx.ingress.kubernetes.io/backend-protocol") == "GRPC":
                    grpc_seen = True
                    assert port["appProtocol"] == "kubernetes.io/h2c"
                else:
                    assert port["name"] == "http"
                    assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off", \
                        "SSE tokens would arrive in bursts"
                    assert f"https://{rule['host']}" in origins, "browsers' https origin must be allowed"
    assert grpc_seen, "a gRPC Ingress"


def test_gateway_api_component(overlays_root, base):
    docs = render(overlays_root, "gateway-api")
    gw_kinds = [d for d in docs if d["apiVersion"].startswith(GATEWAY_API)]
    assert {d["kind"] for d in gw_kinds} == {"Gateway", "HTTPRoute", "GRPCRoute"}
    assert all(d["apiVersion"] == GATEWAY_API + "v1" for d in gw_kinds)
    assert not [d for d in base if d["apiVersion"].startswith(GATEWAY_API)], "CRD kinds stay out of the base"
    gateways = {d["metadata"]["name"]: d for d in gw_kinds if d["kind"] == "Gateway"}
    svc = find(docs, "Service", "streamfleet-gateway")
    svc_ports = {p["port"]: p for p in svc["spec"]["ports"]}
    for g in gateways.values():
        for listener in g["spec"]["listeners"]:
            assert listener["protocol"] == "HTTPS" and listener["tls"]["mode"] == "Terminate"
            assert listener["tls"]["certificateRefs"][0]["name"]
    origins = config(docs)["SF_ALLOWED_ORIGINS"].split(",")
    for route in (d for d in gw_kinds if d["kind"] != "Gateway"):
        for parent in route["spec"]["parentRefs"]:
            g = gateways[parent["name"]]
            [listener] = [li for li in g["spec"]["listeners"] if li["name"] == parent["sectionName"]]
            assert set(route["spec"]["hostnames"]) <= {listener["hostname"]}
            kinds = [k["kind"] for k in listener.get("allowedRoutes", {}).get("kinds", [])]
            assert not kinds or route["kind"] in kinds
        for rule in route["spec"]["rules"]:
            for ref in rule["backendRefs"]:
                assert ref["name"] == "streamfleet-gateway"
                port = svc_ports[ref["port"]]
                if route["kind"] == "GRPCRoute":
                    assert port["appProtocol"] == "kubernetes.io/h2c"
                else:
                    assert port["targetPort"] == "http"
                    # no deadline on a whole streamed response (Envoy defaults to 15 s)
                    assert rule["timeouts"]["request"] == "0s"
        if route["kind"] == "HTTPRoute":
            assert all(f"https://{h}" in origins for h in route["spec"]["hostnames"])


# --------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("components", [(), *((c,) for c in component_names()),
                                        ("aws-efs", "scale-to-zero", "gateway-api")],
                         ids=lambda c: "+".join(c) or "base")
def test_every_rendering_matches_the_schemas(overlays_root, components):
    from kubernetes_validate.utils import ValidationError, validate

    docs = render(overlays_root, *components)
    known = known_setting_env_names()
    [ns] = [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"]
    for d in docs:
        # a component's objects land in the fleet's namespace too, not in kubectl's current one
        if d["kind"] not in CLUSTER_SCOPED:
            assert d["metadata"].get("namespace") == ns, f"{components}: {d['kind']}/{d['metadata']['name']}"
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "streamfleet", d["metadata"]["name"]
        group = d["apiVersion"].split("/")[0]
        if group == "keda.sh":
            assert d["kind"] in ("ScaledObject", "TriggerAuthentication") and d["apiVersion"] == "keda.sh/v1alpha1"
            continue
        if d["apiVersion"].startswith(GATEWAY_API):
            assert "gateway-api" in components, f"{d['kind']} needs the Gateway API CRDs"
            continue
        for version in kubernetes_schema_versions():
            try:
                validate(copy.deepcopy(d), version, strict=True)
            except ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{components}: {d['kind']}/{d['metadata']['name']} ({version}): {path}: {e.message}")
        for c in (containers(d) if templates(d) else []):
            for e in c.get("env", []):
                if e["name"].startswith("SF_"):
                    assert e["name"] in known, f"{d['metadata']['name']}: {e['name']} is not a setting"
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "streamfleet-config":
            for key in d["data"]:
                assert not key.startswith("SF_") or key in known, key
