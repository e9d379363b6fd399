"""Deployment files: Dockerfiles, docker-compose.yml, deploy/nginx, deploy/k8s.

Fast and offline. Each file is checked by the real tool where this machine has it and
by a schema or structural check everywhere:

* docker-compose.yml: ``docker compose config -q`` (or a Compose v2 ``docker-compose``)
  when present (no daemon needed); always the Compose Specification JSON schema
  (``tests/data/compose-spec.json``, vendored from the check-jsonschema package) after
  variable interpolation, and the properties the fleet relies on.
* deploy/k8s: rendered with ``kubectl kustomize`` (the kubectl of the dev extra; skipped
  without one); every built-in kind validated against the Kubernetes OpenAPI schemas
  bundled in ``kubernetes-validate`` (strict: unknown fields fail); the KEDA ScaledObject
  (a CRD, no bundled schema) checked field by field.
* deploy/nginx/nginx.conf: ``nginx -t`` when nginx is installed; the streaming
  directives and the gRPC server always.
* Dockerfile, Dockerfile.gpu: parsed; multi-stage, non-root, ``streamfleet`` entrypoint,
  demo model built in, build context (.dockerignore) complete.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import yaml

from streamfleet.shared.settings import GatewaySettings, WorkerSettings
from streamfleet.v1 import inference_pb2 as pb
from tests.support.deploy import (
    CLUSTER_SCOPED,
    COMPOSE_FILE,
    COMPOSE_SCHEMA,
    K8S_BASE,
    K8S_MIN_VERSION,
    NGINX_CONF,
    REPO,
    find,
    interpolate,
    known_setting_env_names,
    kubernetes_schema_versions,
    kustomize,
    run,
)

DRAIN_TIMEOUT_S = GatewaySettings.model_fields["drain_timeout_s"].default
GRPC_PORT = GatewaySettings.model_fields["grpc_port"].default
#: the service name the gRPC health service reports on (besides "")
GRPC_SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
WORKER_DRAIN_TIMEOUT_S = WorkerSettings.model_fields["drain_timeout_s"].default

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- helpers
def duration_s(value) -> float:
    """Compose durations ("45s", "1m30s", "2m") in seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    total, matched = 0.0, False
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(value)):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
        matched = True
    assert matched, f"not a duration: {value!r}"
    return total


# --------------------------------------------------------------------------- Dockerfiles
@dataclass
class Instruction:
    cmd: str
    args: str
    stage: int


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined, comments dropped, and the index of the
    build stage each belongs to (ARGs before the first FROM are stage -1)."""
    out: list[Instruction] = []
    stage = -1
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        cmd, _, args = buf.strip().partition(" ")
        cmd = cmd.upper()
        if cmd == "FROM":
            stage += 1
        out.append(Instruction(cmd, args.strip(), stage))
        buf = ""
    assert not buf, f"{path.name}: dangling line continuation"
    return out


def stages(instrs: list[Instruction]) -> list[list[Instruction]]:
    n = max(i.stage for i in instrs) + 1
    return [[i for i in instrs if i.stage == s] for s in range(n)]


def copy_sources(ins: Instruction) -> tuple[list[str], dict[str, str]]:
    """Sources and --flags of a COPY/ADD instruction."""
    if ins.args.startswith("["):
        parts = json.loads(ins.args)
    else:
        parts = shlex.split(ins.args)
    flags = {}
    while parts and parts[0].startswith("--"):
        k, _, v = parts.pop(0)[2:].partition("=")
        flags[k] = v
    return parts[:-1], flags


def _dockerignore_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether the build context leaves ``path`` out (Docker's rules: the last matching
    pattern wins, ``!`` re-includes, a pattern that matches a folder covers its contents)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pat in patterns:
        negate = pat.startswith("!")
        rx = _dockerignore_regex(pat.lstrip("!").strip("/"))
        if any(rx.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


DOCKERFILES = ["Dockerfile", "Dockerfile.gpu"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_multi_stage(name):
    instrs = parse_dockerfile(REPO / name)
    st = stages(instrs)
    assert len(st) >= 2, f"{name}: a builder stage and a runtime stage"
    froms = [s[0].args for s in st]
    assert re.search(r"\bAS\s+builder$", froms[0], re.IGNORECASE), f"{name}: first stage is the builder: {froms[0]}"
    final = st[-1]
    assert any(i.cmd == "COPY" and "--from=builder" in i.args and "/opt/venv" in i.args for i in final), \
        f"{name}: the runtime stage takes the virtualenv from the builder"
    # build tooling stays in the builder
    final_runs = " ".join(i.args for i in final if i.cmd == "RUN")
    for tool in ("pip wheel", "build-essential", "pip install", "streamfleet.shared.tinymodel"):
        assert tool not in final_runs, f"{name}: {tool!r} belongs in the builder stage"
    builder_runs = " ".join(i.args for i in st[0] if i.cmd == "RUN")
    assert "pip wheel" in builder_runs, f"{name}: the builder builds the project's wheel"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_non_root_and_entrypoint(name):
    final = stages(parse_dockerfile(REPO / name))[-1]
    users = [i.args for i in final if i.cmd == "USER"]
    assert users, f"{name}: the runtime stage sets USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{name}: runs as root"
    assert any(i.cmd == "RUN" and ("useradd" in i.args or "adduser" in i.args) and user in i.args for i in final), \
        f"{name}: user {user} is created in the runtime stage"

    entry = [i.args for i in final if i.cmd == "ENTRYPOINT"]
    assert entry, f"{name}: ENTRYPOINT"
    argv = json.loads(entry[-1])  # exec form: signals reach streamfleet (SIGTERM drains)
    assert "streamfleet" in argv, f"{name}: the entrypoint runs streamfleet: {argv}"
    assert argv[-1] == "streamfleet", f"{name}: roles are passed as arguments after streamfleet"
    cmd = [i.args for i in final if i.cmd == "CMD"]
    assert cmd and json.loads(cmd[-1])[0] in ("gateway", "worker"), f"{name}: a default role"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_demo_model_and_offline(name):
    st = stages(parse_dockerfile(REPO / name))
    builder_runs = " ".join(i.args for i in st[0] if i.cmd == "RUN")
    assert "streamfleet.shared.tinymodel --model-dir engines/tiny-gpt" in builder_runs, \
        f"{name}: tiny-gpt is generated at build time"
    assert "ensure_artifacts(ModelRepository('engines').get('smollm2-135m'))" in builder_runs, \
        f"{name}: the default model is fetched and imported at build time, never in a container"
    assert any(i.cmd == "COPY" and "engines/smollm2-135m/engine.toml" in i.args for i in st[0])
    final = st[-1]
    env = " ".join(i.args for i in final if i.cmd == "ENV")
    for var in ("SF_ENGINES_DIR=/app/engines", "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1"):
        assert var in env, f"{name}: ENV {var}"
    assert any(i.cmd == "COPY" and "--from=builder" in i.args and "/app/engines" in i.args for i in final)
    assert any(i.cmd == "HEALTHCHECK" for i in final), f"{name}: HEALTHCHECK"
    assert any(i.cmd == "STOPSIGNAL" and i.args == "SIGTERM" for i in final)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_exposes_gateway_ports(name):
    final = stages(parse_dockerfile(REPO / name))[-1]
    exposed = {p.split("/")[0] for i in final if i.cmd == "EXPOSE" for p in i.args.split()}
    assert {"8000", str(GRPC_PORT), "9100"} <= exposed, f"{name}: EXPOSE {exposed}"
    env = " ".join(i.args for i in final if i.cmd == "ENV")
    assert "SF_HOST=0.0.0.0" in env and f"SF_GRPC_PORT={GRPC_PORT}" in env, \
        f"{name}: the gateway's HTTP and gRPC ports listen on every address of the container"


def test_dockerfile_cpu_base_and_healthcheck():
    instrs = parse_dockerfile(REPO / "Dockerfile")
    st = stages(instrs)
    args = {i.args.split("=")[0]: i.args.split("=", 1)[1] for i in instrs if i.cmd == "ARG" and "=" in i.args}
    py = args.get("PYTHON_VERSION")
    assert py, "ARG PYTHON_VERSION with a default"
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert tuple(int(x) for x in py.split(".")) >= tuple(int(x) for x in requires.lstrip(">=").split(".")), \
        f"python {py} vs requires-python {requires}"
    for s in st:
        assert s[0].args.startswith("python:${PYTHON_VERSION}-slim"), s[0].args
    hc = [i.args for i in st[-1] if i.cmd == "HEALTHCHECK"][-1]
    assert "urllib" in hc and "/healthz" in hc, "gateway health check with python's urllib"
    assert "curl" not in hc and "wget" not in hc, "the slim image has neither curl nor wget"


def test_dockerfile_gpu_base_and_extra():
    instrs = parse_dockerfile(REPO / "Dockerfile.gpu")
    for s in stages(instrs):
        assert re.match(r"nvcr\.io/nvidia/tensorrt:\$\{TRT_TAG\}-py3\b", s[0].args), s[0].args
    tag = [i.args.split("=", 1)[1] for i in instrs if i.cmd == "ARG" and i.args.startswith("TRT_TAG=")]
    assert tag and re.fullmatch(r"\d\d\.\d\d", tag[0]), "ARG TRT_TAG=<yy.mm>"
    # 24.12 and later have Python 3.12; older releases ship 3.10, below requires-python
    assert tag[0] >= "24.12", f"TensorRT {tag[0]}-py3 ships a Python older than 3.11"
    runs = " ".join(i.args for i in instrs if i.cmd == "RUN")
    assert "['optional-dependencies']['gpu']" in runs, "installs the project's gpu extra"
    assert "--system-site-packages" in runs, "the base image's TensorRT bindings stay visible"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_build_context(name):
    """Every COPY source exists and is in the build context; the context leaves out
    virtualenvs, tests and generated model files."""
    patterns = dockerignore_patterns()
    for ins in parse_dockerfile(REPO / name):
        if ins.cmd not in ("COPY", "ADD"):
            continue
        srcs, flags = copy_sources(ins)
        if "from" in flags:
            continue
        for src in srcs:
            rel = src.rstrip("/")
            assert (REPO / rel).exists(), f"{name}: COPY {src}: no such path"
            assert not dockerignore_excludes(patterns, rel), f"{name}: COPY {src} is excluded by .dockerignore"
            if (REPO / rel).is_dir():
                py = sorted(p for p in (REPO / rel).rglob("*.py") if "__pycache__" not in p.parts)
                for p in py:
                    assert not dockerignore_excludes(patterns, str(p.relative_to(REPO))), p
    for out in (".venv", "tests/unit/test_core.py", "engines/tiny-gpt/model.onnx", "engines/tiny-gpt/tokenizer.json",
                "engines/bench-gpt/engine.toml", ".git", "scripts/bench_fleet.py",
                "gateway/__pycache__/app.cpython-311.pyc", "docs/operations.md"):
        assert dockerignore_excludes(patterns, out), f".dockerignore lets {out} into the build context"


# --------------------------------------------------------------------------- compose
@pytest.fixture(scope="module")
def compose_raw() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def compose(compose_raw) -> dict:
    """The file as Compose sees it with no variables set: defaults filled in, and the
    environment as a mapping of strings."""
    return interpolate(copy.deepcopy(compose_raw), {})


def compose_cli() -> list[str] | None:
    """``docker compose`` (the plugin) or a Compose v2 ``docker-compose``; neither needs a
    daemon for ``config``."""
    if shutil.which("docker"):
        p = run(["docker", "compose", "version"])
        if p.returncode == 0 and "version" in p.stdout.lower():
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        p = run(["docker-compose", "version"])
        if p.returncode == 0 and re.search(r"v2\.|version 2\.", p.stdout):
            return ["docker-compose"]
    return None


def test_compose_config_with_docker_compose():
    cli = compose_cli()
    if cli is None:
        pytest.skip("no Docker Compose v2 here (checked against the Compose schema instead)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    base = [*cli, "--project-directory", str(REPO), "-f", str(COMPOSE_FILE)]
    p = run([*base, "--profile", "cpu", "--profile", "gpu", "config", "-q"], env=env)
    assert p.returncode == 0, p.stderr
    p = run([*base, "--profile", "cpu", "--profile", "gpu", "config", "--services"], env=env)
    assert p.returncode == 0, p.stderr
    assert set(p.stdout.split()) == {"redis", "gateway", "nginx", "worker-cpu", "worker-gpu0", "worker-gpu1",
                                     "engine-builder"}
    # the default profile: the stateless tier only; --profile cpu adds the CPU worker alone
    p = run([*base, "config", "--services"], env=env)
    assert set(p.stdout.split()) == {"redis", "gateway", "nginx"}, p.stdout
    p = run([*base, "--profile", "cpu", "config", "--services"], env=env)
    assert set(p.stdout.split()) == {"redis", "gateway", "nginx", "worker-cpu"}, p.stdout


def test_compose_matches_compose_spec_schema(compose):
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_compose_schema_catches_mistakes(compose):
    """The schema check is not vacuous: a misspelt key or a wrong type fails it."""
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    bad = copy.deepcopy(compose)
    bad["services"]["gateway"]["healthcheck"]["intervall"] = "5s"
    assert list(validator.iter_errors(bad))
    bad = copy.deepcopy(compose)
    bad["services"]["redis"]["depends_on"] = 3
    assert list(validator.iter_errors(bad))


def test_compose_uses_extension_fields(compose_raw):
    assert "x-streamfleet-env" in compose_raw
    text = COMPOSE_FILE.read_text()
    assert "&sf-env" in text and text.count("*sf-env") >= 3, "the shared environment is one anchor"


def test_compose_redis(compose):
    redis_svc = compose["services"]["redis"]
    assert redis_svc["image"].startswith("redis:7"), "Redis >= 7 (XINFO GROUPS lag, used by KEDA)"
    cmd = " ".join(str(c) for c in redis_svc["command"])
    for flag in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction",
                 "--client-output-buffer-limit pubsub 64mb 16mb 60"):
        assert flag in cmd, f"redis: {flag}"
    assert re.search(r"--maxmemory \d+[kmg]b", cmd), "redis: a maxmemory"
    assert redis_svc["healthcheck"]["test"][0] == "CMD-SHELL" and "PONG" in redis_svc["healthcheck"]["test"][1]
    assert any(str(v).endswith(":/data") for v in redis_svc["volumes"]), "AOF on a volume"
    assert "ports" not in redis_svc, "Redis is not published on the host"


def test_compose_gateways_scalable_behind_nginx(compose):
    services = compose["services"]
    gw = services["gateway"]
    assert "container_name" not in gw and "ports" not in gw, "a fixed name or host port prevents --scale"
    assert gw["deploy"]["replicas"] == 2
    assert gw["command"] == ["gateway"]
    assert gw["environment"]["SF_HOST"] == "0.0.0.0" and gw["environment"]["SF_PORT"] == "8000"
    # gRPC on the same address (SF_HOST), for nginx's gRPC server
    assert gw["environment"]["SF_GRPC_PORT"] == str(GRPC_PORT)
    # metrics on their own port, reachable by a Prometheus on the compose network, never via nginx
    assert gw["environment"]["SF_METRICS_PORT"] == "9100" and gw["environment"]["SF_METRICS_HOST"] == "0.0.0.0"
    assert [str(p) for p in gw["expose"]] == ["8000", str(GRPC_PORT), "9100"]
    assert "/healthz" in " ".join(gw["healthcheck"]["test"])
    assert gw["depends_on"]["redis"]["condition"] == "service_healthy"

    ngx = services["nginx"]
    assert ngx["image"].startswith("nginx:1.28"), "open-source nginx >= 1.27.3 for `server ... resolve`"
    assert any(v.startswith("./deploy/nginx/nginx.conf:/etc/nginx/nginx.conf") for v in ngx["volumes"])
    assert ngx["depends_on"]["gateway"]["condition"] == "service_healthy"
    assert ngx["ports"] and "healthcheck" in ngx
    # published on loopback: HTTP on 80 and gRPC on 50051 inside the container
    published = {str(p).rsplit(":", 1)[1]: str(p) for p in ngx["ports"]}
    assert set(published) == {"80", str(GRPC_PORT)}, ngx["ports"]
    assert published[str(GRPC_PORT)] == f"127.0.0.1:{GRPC_PORT}:{GRPC_PORT}"


def test_compose_workers(compose):
    services = compose["services"]
    cpu = services["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and cpu["command"] == ["worker"]
    assert "deploy" not in cpu or "reservations" not in cpu["deploy"].get("resources", {})
    for i in (0, 1):
        w = services[f"worker-gpu{i}"]
        assert w["profiles"] == ["gpu"] and w["command"] == ["worker"]
        dev = w["deploy"]["resources"]["reservations"]["devices"]
        assert dev == [{"driver": "nvidia", "device_ids": [str(i)], "capabilities": ["gpu"]}], dev
        # the one GPU a container is given is device 0 inside it
        assert w["environment"]["CUDA_VISIBLE_DEVICES"] == "0"
        assert w["build"]["dockerfile"] == "Dockerfile.gpu"
    for name in ("worker-cpu", "worker-gpu0", "worker-gpu1"):
        env = services[name]["environment"]
        assert env["SF_METRICS_PORT"] == "9100" and env["SF_METRICS_HOST"] == "0.0.0.0"
        assert "9100/healthz" in " ".join(services[name]["healthcheck"]["test"]), "the liveness that sees a hang"
        assert "container_name" not in services[name]
    builder = services["engine-builder"]
    assert builder["command"] == ["engines", "worker", "--queue", "sm90"]
    assert builder["profiles"] == ["gpu"]
    assert builder["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


def test_compose_stop_grace_above_drain(compose):
    services = compose["services"]
    streamfleet = [n for n, s in services.items() if str(s.get("image", "")).startswith("streamfleet")]
    assert set(streamfleet) >= {"gateway", "worker-cpu", "worker-gpu0", "worker-gpu1", "engine-builder"}
    for name in streamfleet:
        svc = services[name]
        drain = float(svc["environment"].get("SF_DRAIN_TIMEOUT_S", DRAIN_TIMEOUT_S))
        assert duration_s(svc["stop_grace_period"]) > drain, f"{name}: stop_grace_period <= drain timeout"
        assert "healthcheck" in svc, f"{name}: a health check (or an explicit disable)"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    shutdown = re.search(r"worker_shutdown_timeout\s+(\d+)s;", NGINX_CONF.read_text())
    assert shutdown and duration_s(services["nginx"]["stop_grace_period"]) > int(shutdown.group(1))
    assert int(shutdown.group(1)) > DRAIN_TIMEOUT_S


def test_compose_settings_are_known(compose):
    known = known_setting_env_names()
    for name, svc in compose["services"].items():
        for key in svc.get("environment", {}):
            if key.startswith("SF_"):
                assert key in known, f"{name}: {key} is not a streamfleet setting (shared/settings.py)"


# --------------------------------------------------------------------------- nginx
def nginx_text() -> str:
    return re.sub(r"#[^\n]*", "", NGINX_CONF.read_text())


def test_nginx_streaming_directives():
    conf = nginx_text()
    upstream = re.search(r"upstream\s+(\w+)\s*\{(.*?)\}", conf, re.DOTALL)
    assert upstream, "an upstream block"
    name, body = upstream.groups()
    assert re.search(r"^\s*least_conn;", body, re.MULTILINE)
    assert re.search(r"^\s*server\s+gateway:8000\b[^;]*\bresolve\b", body, re.MULTILINE), \
        "re-resolves the compose service"
    assert re.search(r"^\s*resolver\s+127\.0\.0\.11\b", conf, re.MULTILINE), "Docker's embedded DNS"
    assert re.search(r"^\s*zone\s+\w+\s+\d+[km];", body, re.MULTILINE), "`resolve` needs a shared zone"
    assert re.search(r"^\s*keepalive\s+\d+;", body, re.MULTILINE)
    assert re.search(rf"proxy_pass\s+http://{name};", conf)

    for directive in ("proxy_http_version 1.1;", "proxy_buffering off;", "proxy_set_header Upgrade $http_upgrade;",
                      "proxy_set_header Connection $connection_upgrade;", "map $http_upgrade $connection_upgrade"):
        assert directive in conf, directive
    for directive in ("proxy_read_timeout", "proxy_send_timeout"):
        m = re.search(rf"{directive}\s+(\d+)s;", conf)
        assert m, directive
        # above the 20 s WebSocket heartbeat and the 15 s SSE keepalive, with room
        assert int(m.group(1)) >= 3600, f"{directive} {m.group(1)}s"
    assert "text/event-stream" not in re.search(r"gzip_types([^;]*);", conf).group(1), "SSE is never compressed"
    assert not re.search(r"proxy_ignore_headers[^;]*X-Accel-Buffering", conf), "X-Accel-Buffering is honoured"
    assert "non_idempotent" not in conf, "a POST that reached a gateway is never replayed on another"
    assert re.search(r"location\s+=\s+/nginx-health", conf), "a health endpoint for the container check"
    # the gateway's same-origin check compares Origin with Host: the port must reach it
    assert re.search(r"^\s*proxy_set_header\s+Host\s+\$http_host;", conf, re.MULTILINE)
    assert "9100" not in conf, "the gateways' metrics port is not proxied"


def nginx_blocks(conf: str, keyword: str) -> list[tuple[str, str]]:
    """``(arguments, body)`` of every ``keyword ... { ... }`` block (braces matched)."""
    out = []
    for m in re.finditer(rf"(?<![\w$]){keyword}\b([^;{{}}]*)\{{", conf):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(conf[i], 0)
            i += 1
        out.append((m.group(1).strip(), conf[m.end():i - 1]))
    return out


def test_nginx_grpc_server():
    """gRPC has a server of its own on 50051: cleartext HTTP/2 passed to the gateways'
    gRPC ports, with timeouts that never cut a long stream."""
    conf = nginx_text()
    servers = [body for _, body in nginx_blocks(conf, "server")]
    grpc = [body for body in servers if re.search(rf"^\s*listen\s+{GRPC_PORT}\b", body, re.MULTILINE)]
    assert len(grpc) == 1 and len(servers) == 2, "one server for HTTP, one for gRPC"
    [grpc] = grpc
    assert re.search(r"^\s*http2\s+on;", grpc, re.MULTILINE), "gRPC needs HTTP/2 (cleartext: `http2 on`)"
    m = re.search(r"^\s*grpc_pass\s+grpc://(\w+);", grpc, re.MULTILINE)
    assert m, "grpc_pass grpc://<upstream>"
    upstream = dict(nginx_blocks(conf, "upstream"))[m.group(1)]
    assert re.search(rf"^\s*server\s+gateway:{GRPC_PORT}\b[^;]*\bresolve\b", upstream, re.MULTILINE), \
        "the gateways' gRPC port, re-resolved as they scale"
    assert re.search(r"^\s*zone\s+\w+\s+\d+[km];", upstream, re.MULTILINE)
    assert re.search(r"^\s*least_conn;", upstream, re.MULTILINE)
    # a Stream call's client half may be silent as long as its requests run
    for directive in ("grpc_read_timeout", "grpc_send_timeout", "client_body_timeout"):
        m = re.search(rf"^\s*{directive}\s+(\d+)s;", grpc, re.MULTILINE)
        assert m and int(m.group(1)) >= 3600, directive
    assert "non_idempotent" not in grpc, "a call that reached a gateway is never replayed on another"
    [http] = [body for body in servers if body is not grpc]
    assert "grpc_pass" not in http and "proxy_pass" not in grpc


def nginx_version(binary: str) -> tuple[int, ...]:
    p = run([binary, "-v"])
    m = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", p.stderr + p.stdout)
    assert m, p.stderr
    return tuple(int(x) for x in m.groups())


def test_nginx_conf_syntax(tmp_path):
    binary = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                            if os.access(p, os.X_OK)), None)
    if binary is None:
        pytest.skip("nginx is not installed (directives checked by test_nginx_streaming_directives)")
    conf = NGINX_CONF.read_text()
    # "gateway" only resolves inside the compose network
    conf = conf.replace("server gateway:", "server 127.0.0.1:")
    version = nginx_version(binary)
    if version < (1, 27, 3):
        # upstream `resolve` / `resolver` are open source since 1.27.3 (the image is 1.28);
        # check everything else with the nginx at hand
        conf = re.sub(r"^[ \t]*resolver(_timeout)?[ \t][^;\n]*;.*$", "", conf, flags=re.MULTILINE)
        conf = re.sub(r"(server 127\.0\.0\.1:\d+)\s+resolve\b", r"\1", conf)
    if version < (1, 25, 1):
        # before `http2 on`, HTTP/2 was a parameter of `listen`
        conf = re.sub(r"^[ \t]*http2 on;\n", "", conf, flags=re.MULTILINE)
        conf = conf.replace(f"listen {GRPC_PORT} ", f"listen {GRPC_PORT} http2 ")
    (tmp_path / "logs").mkdir()
    path = tmp_path / "nginx.conf"
    path.write_text(conf)
    p = run([binary, "-t", "-p", str(tmp_path), "-c", str(path), "-g", f"pid {tmp_path}/nginx.pid;"])
    assert p.returncode == 0, p.stderr


# --------------------------------------------------------------------------- Kubernetes
@pytest.fixture(scope="module")
def k8s_docs() -> list[dict]:
    """deploy/k8s as ``kubectl kustomize`` renders it (generated names hash-suffixed)."""
    return kustomize(K8S_BASE)


def config_data(docs: list[dict]) -> dict[str, str]:
    cms = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("streamfleet-config")]
    assert len(cms) == 1
    return cms[0]["data"]


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def test_k8s_manifests_match_kubernetes_schemas(k8s_docs):
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError, validate

    checked = 0
    for doc in k8s_docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: test_keda_scaled_object checks it
        for version in kubernetes_schema_versions():
            try:
                validate(doc, version, strict=True)
            except ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {path}: {e.message}")
            except SchemaNotFoundError as e:
                pytest.fail(e.message)
        checked += 1
    kinds = {d["kind"] for d in k8s_docs}
    assert {"Namespace", "ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "StatefulSet", "ScaledObject"} <= kinds, kinds
    assert checked >= 12


def test_k8s_schema_check_catches_mistakes(k8s_docs):
    from kubernetes_validate.utils import ValidationError, validate

    bad = copy.deepcopy(find(k8s_docs, "Deployment", "streamfleet-gateway"))
    pod_spec(bad)["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/readyz"}
    with pytest.raises(ValidationError):
        validate(bad, K8S_MIN_VERSION, strict=True)


def test_k8s_namespace_and_labels(k8s_docs):
    namespaces = [d for d in k8s_docs if d["kind"] == "Namespace"]
    assert len(namespaces) == 1
    ns = namespaces[0]["metadata"]["name"]
    for d in k8s_docs:
        if d["kind"] not in CLUSTER_SCOPED:
            assert d["metadata"]["namespace"] == ns, f"{d['kind']}/{d['metadata']['name']}"
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "streamfleet"


def test_k8s_config_settings(k8s_docs):
    data = config_data(k8s_docs)
    known = known_setting_env_names()
    for key in data:
        if key.startswith("SF_"):
            assert key in known, f"ConfigMap: {key} is not a streamfleet setting (shared/settings.py)"
    for d in k8s_docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in pod_spec(d)["containers"]:
                for e in c.get("env", []):
                    if e["name"].startswith("SF_"):
                        assert e["name"] in known, f"{d['metadata']['name']}: {e['name']}"
    assert float(data["SF_DRAIN_TIMEOUT_S"]) == DRAIN_TIMEOUT_S
    redis_host = re.match(r"redis://([^:/]+):(\d+)", data["SF_REDIS_URL"]).group(1)
    find(k8s_docs, "Service", redis_host)
    # KEDA's operator resolves the address from its own namespace: it must be qualified
    ns = next(d for d in k8s_docs if d["kind"] == "Namespace")["metadata"]["name"]
    assert data["KEDA_REDIS_ADDRESS"] == f"{redis_host}.{ns}.svc.cluster.local:6379"


def _container(doc: dict, name: str | None = None) -> dict:
    cs = pod_spec(doc)["containers"]
    return cs[0] if name is None else next(c for c in cs if c["name"] == name)


def _secure(doc: dict) -> None:
    spec = pod_spec(doc)
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, doc["metadata"]["name"]
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert sc.get("readOnlyRootFilesystem") is True, c["name"]
        assert "resources" in c and "requests" in c["resources"], c["name"]
    assert spec.get("automountServiceAccountToken") is False


def test_k8s_gateway(k8s_docs):
    dep = find(k8s_docs, "Deployment", "streamfleet-gateway")
    c = _container(dep)
    assert c["args"] == ["gateway"]
    # liveness over HTTP: gRPC health (for "" too) is SERVING only while the gateway is ready
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # readiness over gRPC health: what /readyz says, and the gRPC port serving
    assert c["readinessProbe"]["grpc"] == {"port": GRPC_PORT, "service": GRPC_SERVICE}
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    grace = pod_spec(dep)["terminationGracePeriodSeconds"]
    # preStop counts against the grace period; then the drain, then ~3 s closing sockets
    assert grace > int(sleep[1]) + DRAIN_TIMEOUT_S + 3, grace
    assert {"cpu", "memory"} <= set(c["resources"]["requests"]), "the CPU HPA needs a CPU request"
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    _secure(dep)
    assert any(e.get("configMapRef", {}).get("name", "").startswith("streamfleet-config") for e in c["envFrom"])

    hpa = find(k8s_docs, "HorizontalPodAutoscaler", "streamfleet-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "streamfleet-gateway"}
    assert hpa["spec"]["minReplicas"] >= 2
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])
    assert "streamfleet_active_connections" in (K8S_BASE / "gateway.yaml").read_text(), \
        "the custom-metric alternative is described"
    # Prometheus scrapes the metrics port, which the Service leaves out
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["SF_METRICS_PORT"] == "9100" and env["SF_METRICS_HOST"] == "0.0.0.0"
    assert env["SF_HOST"] == "0.0.0.0" and env["SF_GRPC_PORT"] == str(GRPC_PORT)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": GRPC_PORT, "metrics": 9100}, ports
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == env["SF_METRICS_PORT"]
    assert annotations["prometheus.io/path"] == "/metrics"
    svc = find(k8s_docs, "Service", "streamfleet-gateway")
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http", "grpc"]
    grpc = next(p for p in svc["spec"]["ports"] if p["targetPort"] == "grpc")
    # the name tells meshes the protocol; appProtocol is Kubernetes' name for cleartext HTTP/2
    assert grpc["name"] == "grpc" and grpc["port"] == GRPC_PORT and grpc["appProtocol"] == "kubernetes.io/h2c"


def test_k8s_worker(k8s_docs):
    dep = find(k8s_docs, "Deployment", "streamfleet-worker")
    c = _container(dep)
    assert c["args"] == ["worker"]
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1", "one GPU per worker pod"
    grace = pod_spec(dep)["terminationGracePeriodSeconds"]
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
    assert grace > int(pre_stop[-1]) + WORKER_DRAIN_TIMEOUT_S, "SIGKILL only after the worker's drain"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["SF_METRICS_PORT"] == "9100" and env["SF_METRICS_HOST"] == "0.0.0.0"
    assert c["livenessProbe"]["httpGet"]["port"] in ("metrics", 9100)
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, "no spare GPU needed for a rollout"
    _secure(dep)


def test_keda_scaled_object(k8s_docs):
    so = find(k8s_docs, "ScaledObject", "streamfleet-worker")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    assert spec["scaleTargetRef"]["name"] == "streamfleet-worker"
    find(k8s_docs, "Deployment", spec["scaleTargetRef"]["name"])
    assert spec["minReplicaCount"] >= 1 and spec["maxReplicaCount"] > spec["minReplicaCount"]
    triggers = spec["triggers"]
    model = "tiny-gpt"
    lanes = {f"sf:{{{model}}}:tasks:high", f"sf:{{{model}}}:tasks:normal"}
    waiting = {f"sf:{{{model}}}:fair:high:queued", f"sf:{{{model}}}:fair:normal:queued"}
    # XLEN of a lane = queued + in flight (workers XDEL what they finish)
    lengths = [t for t in triggers if "streamLength" in t["metadata"]]
    assert {t["metadata"]["stream"] for t in lengths} == lanes, "one stream-length trigger per lane"
    # LLEN of a lane's list of tasks waiting for their tenant's turn (fair share)
    lists = [t for t in triggers if "listLength" in t["metadata"]]
    assert {t["metadata"]["listName"] for t in lists} == waiting, "one list-length trigger per lane"
    names = set()
    for t in triggers:
        md = t["metadata"]
        assert (t["type"], "stream" in md) in (("redis-streams", True), ("redis", False))
        assert "consumerGroup" not in md, "a consumerGroup turns the scaler from XLEN to XPENDING / lag"
        assert md.get("stream", md.get("listName")) in lanes | waiting
        assert md.get("addressFromEnv") == "KEDA_REDIS_ADDRESS" or "address" in md
        for count in ("streamLength", "listLength"):
            if count in md:
                assert isinstance(md[count], str) and int(md[count]) > 0, f"{count} is a string of digits"
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", t["name"]), "trigger names are formula identifiers"
        names.add(t["name"])
    assert len(names) == len(triggers)
    # the env var KEDA reads must exist in the target's environment
    target = find(k8s_docs, "Deployment", spec["scaleTargetRef"]["name"])
    assert "KEDA_REDIS_ADDRESS" in config_data(k8s_docs)
    assert any(e.get("configMapRef") for e in _container(target)["envFrom"])

    mod = spec["advanced"]["scalingModifiers"]
    identifiers = set(re.findall(r"[a-z_][a-z0-9_]*", mod["formula"]))
    assert identifiers <= names, f"formula names unknown triggers: {identifiers - names}"
    assert {t["name"] for t in lengths} <= identifiers, "every lane's length counts"
    assert float(mod["target"]) > 0 and mod.get("metricType", "AverageValue") == "AverageValue"
    assert isinstance(mod["target"], str)


def test_k8s_disruption_budgets(k8s_docs):
    for comp in ("gateway", "worker"):
        pdb = find(k8s_docs, "PodDisruptionBudget", f"streamfleet-{comp}")
        dep = find(k8s_docs, "Deployment", f"streamfleet-{comp}")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        assert "maxUnavailable" in pdb["spec"] or "minAvailable" in pdb["spec"]


def test_k8s_services_select_pods(k8s_docs):
    workloads = [d for d in k8s_docs if d["kind"] in ("Deployment", "StatefulSet")]
    for svc in (d for d in k8s_docs if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        pods = [w for w in workloads if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in pods:
                ports = [p for c in pod_spec(w)["containers"] for p in c.get("ports", [])]
                assert any(target in (p.get("name"), p["containerPort"]) for p in ports), \
                    f"Service {svc['metadata']['name']}: targetPort {target} not on {w['metadata']['name']}"
    for w in workloads:
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_redis(k8s_docs):
    sts = find(k8s_docs, "StatefulSet", "streamfleet-redis")
    find(k8s_docs, "Service", sts["spec"]["serviceName"])
    assert find(k8s_docs, "Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    c = _container(sts)
    assert c["image"].startswith("redis:7")
    probe = c["livenessProbe"]["exec"]["command"]  # PONG, not just redis-cli's exit code
    assert probe[:2] == ["sh", "-c"] and "redis-cli ping" in probe[2] and "= PONG" in probe[2], probe
    conf = next(d for d in k8s_docs if d["kind"] == "ConfigMap"
                and d["metadata"]["name"].startswith("streamfleet-redis-config"))["data"]["redis.conf"]
    lines = {ln.split(None, 1)[0]: ln for ln in conf.splitlines() if ln.strip() and not ln.startswith("#")}
    assert lines["appendonly"] == "appendonly yes"
    assert lines["appendfsync"] == "appendfsync everysec"
    assert lines["maxmemory-policy"] == "maxmemory-policy noeviction"
    assert "client-output-buffer-limit pubsub 64mb 16mb 60" in conf
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] in {
        m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/data"}
    _secure(sts)


def test_k8s_engine_builder(k8s_docs):
    cron = find(k8s_docs, "CronJob", "streamfleet-engine-build")  # the template of a build Job
    dep = {"metadata": cron["metadata"], "spec": cron["spec"]["jobTemplate"]["spec"]}
    c = _container(dep)
    assert c["args"] == ["engines", "build", "tiny-gpt"]
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    # builder and workers share the model repository
    worker = find(k8s_docs, "Deployment", "streamfleet-worker")
    claims = lambda d: {v["persistentVolumeClaim"]["claimName"] for v in pod_spec(d)["volumes"]  # noqa: E731
                        if "persistentVolumeClaim" in v}
    assert claims(dep) & claims(worker)
    for d in (dep, worker):
        env = {e["name"]: e.get("value") for e in _container(d)["env"]}
        mounts = {m["mountPath"] for m in _container(d)["volumeMounts"]}
        assert env["SF_ENGINES_DIR"] in mounts
    _secure(dep)


def test_compose_redis_healthcheck_fails_unless_pong(compose_raw, tmp_path):
    """`redis-cli ping` exits 0 on NOAUTH (and LOADING) replies: the healthcheck runs
    here, as compose runs it (`$$` is compose's `$`), against a private redis-server that
    answers PONG and one that answers NOAUTH."""
    if not shutil.which("redis-cli") or not shutil.which("redis-server"):
        pytest.skip("redis-cli/redis-server are not installed")
    test = compose_raw["services"]["redis"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    from tests.support.ports import free_port

    def check(port: int, command: str) -> int:
        shell = command.replace("$$", "$").replace("redis-cli", f"redis-cli -p {port}")
        return subprocess.run(["sh", "-c", shell], capture_output=True, timeout=10).returncode

    servers = []
    try:
        ports = {}
        for name, extra in (("open", []), ("auth", ["--requirepass", "s3cret"])):
            port = ports[name] = free_port()
            servers.append(subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                                             "--dir", str(tmp_path), *extra], stdout=subprocess.DEVNULL))
        for port in ports.values():
            deadline = time.monotonic() + 10
            while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode != 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert check(ports["auth"], "redis-cli ping") == 0, "the old check passes a server it cannot use"
        assert check(ports["open"], test[1]) == 0
        assert check(ports["auth"], test[1]) != 0
    finally:
        for p in servers:
            p.terminate()
            p.wait(10)


def test_nginx_access_log_never_holds_an_api_key():
    """Browsers' WebSockets send the key as ?api_key=: the access log's format logs the
    request line and Referer through maps that replace such a query by REDACTED."""
    conf = NGINX_CONF.read_text()
    fmt = re.search(r"log_format\s+(\w+)\s+((?:'[^']*'\s*)+);", conf)
    assert fmt, "a log_format of its own"
    name, body = fmt.group(1), "".join(re.findall(r"'([^']*)'", fmt.group(2)))
    assert re.search(rf"^\s*access_log\s+\S+\s+{name}\s*;", conf, re.MULTILINE), "the access log uses it"
    assert not re.findall(r"^\s*access_log\s+\S+\s+combined\s*;", conf, re.MULTILINE)
    for raw in ("$request ", "$request_uri", "$args", "$query_string", "$arg_api_key", "$http_referer"):
        assert raw not in body, f"the log format logs {raw.strip()}"
    maps = {dst: src for src, dst in re.findall(r"map\s+\$(\w+)\s+\$(\w+)\s*\{", conf)}
    for var in re.findall(r"\$(sf_\w+)", body):
        source = maps.get(var)
        assert source in ("request_uri", "http_referer"), var
        block = re.search(rf"map\s+\${source}\s+\${var}\s*\{{(.*?)\n\s*\}}", conf, re.DOTALL).group(1)
        (pattern, repl), = re.findall(r'"~\*(.*?)"\s+"(.*?)";', block)
        # nginx's PCRE and Python's re agree on this pattern: apply it as nginx would
        rx = re.compile(pattern.replace("(?<", "(?P<"), re.IGNORECASE)
        for uri, logged in (("/v1/stream?api_key=sk-live-123", "/v1/stream?REDACTED"),
                            ("/v1/stream?x=1&API_KEY=sk-live-123&y=2", "/v1/stream?REDACTED"),
                            ("/v1/stream?api_key=a&api_key=b", "/v1/stream?REDACTED"),
                            ("/v1/completions", None), ("/v1/stream?model=tiny-gpt", None)):
            m = rx.search(uri)
            got = re.sub(r"\$\{(\w+)\}", lambda g, m=m: m.group(g.group(1)), repl) if m else None
            assert got == logged, (var, uri, got)
            assert got is None or "sk-live" not in got

