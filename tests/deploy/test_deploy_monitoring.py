"""Monitoring files: deploy/k8s/monitoring (PodMonitors, PrometheusRule) and
deploy/grafana/streamfleet.json, checked with Prometheus' own tools.

* ``promtool check rules`` parses every recording rule and alert with Prometheus' PromQL
  parser, and ``promtool test rules`` runs the alert unit tests of
  tests/deploy/alerts.test.yml: every alert fires, with its labels and annotations, where
  it should and stays quiet where it should not, on synthetic series whose names and label
  sets are those the gateway and worker registries (``streamfleet.shared.metrics``) and
  the exporters the rules read (``EXTERNAL``) expose.
* Every dashboard target and template-variable query is parsed by promtool (the
  expression of a throw-away recording rule, Grafana's variables substituted) and
  evaluated by ``promtool test rules`` on one synthetic series of every kind the fleet
  exposes: each returns data, carrying the labels its legend (or variable) names.
* Every metric name in the rules and the dashboard exists: in the registries (the series
  names prometheus_client exposes, suffixes included), among the rules' own recorded
  series, or in ``EXTERNAL`` (redis_exporter, kube-state-metrics, Prometheus' ``up``). The
  names are taken from the expressions with a small regex; promtool has parsed them.

The PodMonitors are checked against the base manifests (pod labels, the ``metrics``
port), the dashboard for its structure (unique ids, ``${datasource}``, layout, variables)
and the monitoring kustomization for listing exactly the files beside it. promtool comes
with Debian's ``prometheus`` package (.ci/run installs it); its tests skip without it.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.support.deploy import K8S_BASE, REPO, kustomize, promtool, run

MONITORING = K8S_BASE / "monitoring"
DASHBOARD = REPO / "deploy" / "grafana" / "streamfleet.json"
OPERATIONS_MD = REPO / "docs" / "operations.md"
ALERT_TESTS = Path(__file__).with_name("alerts.test.yml")

pytestmark = pytest.mark.timeout(120)

#: labels the prometheus-operator gives every series it scrapes through a PodMonitor
#: (job and instance from Prometheus; namespace, pod, container, endpoint from the operator)
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "endpoint"})
#: the target labels of kube-state-metrics' own scrape (its namespace, pod and container
#: labels are those of the pod a sample describes)
KSM_TARGET_LABELS = frozenset({"job", "instance", "service", "endpoint"})
#: the job label of each source's targets (podmonitors.yaml relabels job)
JOBS = {"gateway": "streamfleet-gateway", "worker": "streamfleet-worker", "redis_exporter": "streamfleet-redis",
        "kube-state-metrics": "kube-state-metrics"}

#: metrics of other exporters the rules and the dashboard may use: name -> (source, labels
#: of the metric itself; the scrape's target labels come on top)
EXTERNAL: dict[str, tuple[str, frozenset[str]]] = {
    # oliver006/redis_exporter (sidecar of the Redis pod): INFO fields ...
    "redis_up": ("redis_exporter", frozenset()),
    "redis_memory_used_bytes": ("redis_exporter", frozenset()),            # INFO memory used_memory
    "redis_memory_max_bytes": ("redis_exporter", frozenset()),             # INFO memory maxmemory
    "redis_mem_clients_normal": ("redis_exporter", frozenset()),           # INFO memory mem_clients_normal
    "redis_connected_clients": ("redis_exporter", frozenset()),            # INFO clients
    "redis_blocked_clients": ("redis_exporter", frozenset()),
    "redis_pubsub_clients": ("redis_exporter", frozenset()),               # INFO clients, Redis >= 7.4
    "redis_client_recent_max_output_buffer_bytes": ("redis_exporter", frozenset()),
    "redis_client_output_buffer_limit_disconnections_total": ("redis_exporter", frozenset()),  # INFO stats
    # ... CONFIG GET client-output-buffer-limit ...
    "redis_config_client_output_buffer_limit_bytes": ("redis_exporter", frozenset({"class", "limit"})),
    # ... and CLIENT LIST (only with REDIS_EXPORTER_EXPORT_CLIENT_LIST=true): omem per client
    "redis_connected_client_output_buffer_memory_usage_bytes": ("redis_exporter", frozenset({"id", "name"})),
    # kube-state-metrics
    "kube_pod_container_status_restarts_total": ("kube-state-metrics",
                                                 frozenset({"namespace", "pod", "uid", "container"})),
    # Prometheus: one per scrape target
    "up": ("prometheus", frozenset()),
}


# --------------------------------------------------------------------------- registries
@functools.cache
def registry_samples() -> tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...]:
    """(registry, series name, labels) of every sample the gateway and worker registries
    expose, histogram buckets with their real ``le`` bounds.

    The registries are the metric namespaces ``gateway`` and ``worker`` of
    ``streamfleet.shared.metrics``. A labelled metric exposes nothing until a child
    exists, so each gets a probe child (label values ``probe0``, ``probe1``...) for the
    collection, removed right after.
    """
    from prometheus_client.metrics import MetricWrapperBase

    from streamfleet.shared import metrics as sm

    out = []
    for registry, namespace in (("gateway", sm.gateway), ("worker", sm.worker)):
        for metric in vars(namespace).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            labelnames = metric._labelnames  # no public accessor in prometheus_client
            probe = tuple(f"probe{i}" for i in range(len(labelnames)))
            if labelnames:
                metric.labels(*probe)
            try:
                for family in metric.collect():
                    for sample in family.samples:
                        out.append((registry, sample.name, tuple(sorted(sample.labels.items()))))
            finally:
                if labelnames:
                    metric.remove(*probe)
    return tuple(out)


def registry_series() -> dict[str, frozenset[str]]:
    """Every series name the gateway and worker registries expose, with its label names."""
    out: dict[str, set[str]] = {}
    for _, name, labels in registry_samples():
        out.setdefault(name, set()).update(k for k, _ in labels)
    return {name: frozenset(labels) for name, labels in out.items()}


def registry_of() -> dict[str, str]:
    """Series name -> the registry (gateway or worker) that exposes it."""
    return {name: registry for registry, name, _ in registry_samples()}


def registry_families() -> dict[str, str]:
    """Metric family name -> type, as prometheus_client describes them."""
    from prometheus_client.metrics import MetricWrapperBase

    from streamfleet.shared import metrics as sm

    return {fam.name: fam.type for ns in (sm.gateway, sm.worker) for m in vars(ns).values()
            if isinstance(m, MetricWrapperBase) for fam in m.describe()}


SERIES = registry_series()


# --------------------------------------------------------------------------- PromQL, by regex
#: a Prometheus duration (units in this order, each at most once)
DURATION = re.compile(r"(?=\d)(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?")
#: words of PromQL that are no metric name where they stand outside a call
_KEYWORDS = {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right",
             "offset", "atan2", "inf", "nan", "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
             "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression (already parsed by promtool) selects: what is left
    of its identifiers once strings, label matchers, ranges, label lists, keywords and
    function calls are taken out."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^}]*\}", "{}", s)
    s = re.sub(r"\[[^\]]*\]", "[]", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", s)
    return {m.group(1) for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()", s)
            if m.group(1).lower() not in _KEYWORDS}


# --------------------------------------------------------------------------- files
def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@functools.cache
def _monitoring_docs() -> list[dict]:
    k = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    return [d for res in k["resources"] for d in load_yaml_docs(MONITORING / res)]


def monitoring_docs() -> list[dict]:
    """The objects of deploy/k8s/monitoring's files (a fresh copy each call)."""
    return copy.deepcopy(_monitoring_docs())


def prometheus_rule() -> dict:
    rules = [d for d in monitoring_docs() if d["kind"] == "PrometheusRule"]
    assert len(rules) == 1
    return rules[0]


def all_rules() -> list[dict]:
    return [r for g in prometheus_rule()["spec"]["groups"] for r in g["rules"]]


def alert_names() -> set[str]:
    return {r["alert"] for r in all_rules() if "alert" in r}


def recorded_names() -> set[str]:
    return {r["record"] for r in all_rules() if "record" in r}


def rule_id(rule: dict) -> str:
    return rule.get("alert") or rule.get("record")


def known_names() -> set[str]:
    """The registries' series, the external metrics and the rules' recorded series."""
    return set(SERIES) | set(EXTERNAL) | recorded_names()


@functools.cache
def _dashboard_text() -> str:
    return DASHBOARD.read_text()


def dashboard() -> dict:
    return json.loads(_dashboard_text())


def dashboard_panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels of collapsed rows
    return out


def template_variables() -> dict[str, dict]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


#: Grafana's interval variables, as durations PromQL accepts
GRAFANA_DURATIONS = {"$__rate_interval": "5m", "${__rate_interval}": "5m", "$__interval": "1m",
                     "${__interval}": "1m", "$__range": "1h", "${__range}": "1h"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
#: label values of the synthetic series, where one matters: the namespace the dashboard's
#: $namespace stands for, and a gateway's pub/sub client name (the panels select
#: name=~"sf-gateway-.+-pubsub")
LABEL_VALUES = {"namespace": "sf", "name": "sf-gateway-a1-pubsub"}


def grafana_promql(expr: str) -> str:
    """The PromQL Grafana sends: interval variables as durations, a multi-value (or "All")
    variable as the regex of every value, a single-value one as the synthetic series'
    value of the label it is named after."""
    for var, dur in GRAFANA_DURATIONS.items():
        expr = expr.replace(var, dur)
    variables = template_variables()

    def sub(m: re.Match) -> str:
        v = variables.get(m.group(1) or m.group(2))
        if v is None:
            return m.group(0)
        return ".+" if v.get("multi") or v.get("includeAll") else LABEL_VALUES.get(v["name"], v["name"])

    return _VARIABLE.sub(sub, expr)


def dashboard_targets() -> list[tuple[str, dict]]:
    return [(f"{p['title']}/{t['refId']}", t) for p in dashboard_panels(dashboard()) for t in p.get("targets", [])]


def legend_labels(target: dict) -> set[str]:
    return set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))


def variable_queries() -> list[tuple[str, str, str]]:
    """(variable, selector, label) of every ``label_values(selector, label)`` variable."""
    out = []
    for v in template_variables().values():
        if v["type"] != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q)
        assert m, f"${v['name']}: {q!r} is not label_values(selector, label)"
        out.append((v["name"], m.group(1), m.group(2)))
    return out


def github_anchors(markdown: str) -> set[str]:
    """The heading anchors GitHub renders for a Markdown file (fenced code left out)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def pod_monitors() -> list[dict]:
    return [d for d in monitoring_docs() if d["kind"] == "PodMonitor"]


def pod_monitor_jobs() -> dict[str, dict]:
    """job label -> PodMonitor, from each endpoint's relabeling of ``job``."""
    jobs = {}
    for pm in pod_monitors():
        for ep in pm["spec"]["podMetricsEndpoints"]:
            for r in ep.get("relabelings", []):
                if r.get("targetLabel") == "job":
                    jobs[r["replacement"]] = pm
    return jobs


def base_workloads() -> list[dict]:
    k = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    docs = [d for res in k["resources"] if (K8S_BASE / res).is_file() for d in load_yaml_docs(K8S_BASE / res)]
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def all_exprs() -> list[tuple[str, str]]:
    """Every PromQL expression of the rules and the dashboard, with where it is."""
    out = [(f"rule {rule_id(r)}", r["expr"]) for r in all_rules()]
    out += [(f"panel {where}", grafana_promql(t["expr"])) for where, t in dashboard_targets()]
    out += [(f"variable ${name}", grafana_promql(selector)) for name, selector, _ in variable_queries()]
    return out


# --------------------------------------------------------------------------- promtool
def write_rules(path: Path, groups: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def rules_file(folder: Path) -> Path:
    """The PrometheusRule's groups as the plain rules file alerts.test.yml names."""
    rule_files = yaml.safe_load(ALERT_TESTS.read_text())["rule_files"]
    return write_rules(folder / rule_files[0], copy.deepcopy(prometheus_rule()["spec"]["groups"]))


def check_rules(path: Path):
    return run([promtool(), "check", "rules", str(path)])


def promtool_test(folder: Path, tests: dict | str, name: str = "streamfleet.test.yml"):
    """``promtool test rules`` on ``tests`` (a document or its text), written to ``folder``."""
    text = tests if isinstance(tests, str) else yaml.safe_dump(tests, sort_keys=False)
    (folder / name).write_text(text)
    return run([promtool(), "test", "rules", name], cwd=folder)


def seconds(duration: str) -> float:
    """A Prometheus duration as promtool prints it ("1h30m", "25m", "0s") in seconds."""
    units = {"y": 31536000, "w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    parts = re.findall(r"(\d+)(ms|[ywdhms])", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * units[u] for n, u in parts)


def failed_alert_tests(output: str) -> Counter:
    """(alertname, seconds) of each failed alert_rule_test in promtool's output."""
    return Counter((name, seconds(t)) for name, t in re.findall(r"alertname: (\w+), time: (\w+),", output))


# --------------------------------------------------------------------------- synthetic series
def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"


def synthetic_series(exprs: list[str]) -> list[dict]:
    """promtool input series: every series the registries and EXTERNAL name, each label
    set to one value (``LABEL_VALUES`` or ``<label>-a``; buckets with their real bounds)
    plus variants with the values the equality matchers of ``exprs`` want (each alone,
    and those of one expression together), under the target labels of its scrape;
    increasing by 1 every 30 s."""
    wanted = [dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', expr)) for expr in exprs]
    single = [{k: v} for w in wanted for k, v in w.items()]

    def target(job: str, port: int) -> dict[str, str]:
        component = job.removeprefix("streamfleet-")
        return {"job": job, "namespace": LABEL_VALUES["namespace"], "pod": f"{job}-0",
                "instance": f"10.0.0.1:{port}", "container": component, "endpoint": "metrics"}

    samples: list[tuple[str, dict[str, str], dict[str, str]]] = []  # name, own labels, target labels
    for registry, name, labels in registry_samples():
        own = {k: v if k == "le" else LABEL_VALUES.get(k, f"{k}-a") for k, v in labels}
        samples.append((name, own, target(JOBS[registry], 9100)))
    for name, (source, labels) in EXTERNAL.items():
        own = {k: LABEL_VALUES.get(k, f"{k}-a") for k in labels}
        if source == "prometheus":
            samples += [(name, own, target(JOBS[c], 9100)) for c in ("gateway", "worker")]
            samples.append((name, own, target(JOBS["redis_exporter"], 9121)))
        elif source == "kube-state-metrics":
            samples.append((name, own, {"job": JOBS[source], "instance": "10.0.9.1:8080", "service": source,
                                        "endpoint": "http"}))
        else:
            samples.append((name, own, target(JOBS[source], 9121)))
    out: dict[str, dict] = {}
    for name, own, tgt in samples:
        variants = [own] + [{**own, **{k: v for k, v in w.items() if k in own and k != "le"}} for w in single + wanted]
        for labels in variants:
            s = _series(name, {**tgt, **labels})
            out[s] = {"series": s, "values": "0+1x40"}
    return list(out.values())


def evaluate(folder: Path, checks: list[tuple[str, str, set[str]]]) -> dict[str, str]:
    """Each (where, PromQL, labels) check: the expression (the PromQL Grafana sends) is
    parsed by ``promtool check rules`` as a recording rule's, then evaluated by ``promtool
    test rules`` at 10m on the synthetic series. Returns where -> why for each that
    returns no data or a series without one of the labels (non-empty)."""
    rules = [{"record": f"dashboard:check_{i}", "expr": expr} for i, (_, expr, _) in enumerate(checks)]
    path = write_rules(folder / "dashboard.rules.yml", [{"name": "dashboard", "rules": rules}])
    p = check_rules(path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(rules)} rules found" in p.stdout, p.stdout
    expr_tests = []
    for i, (_, _, labels) in enumerate(checks):
        matchers = ", ".join(f'{label}!=""' for label in sorted(labels))
        selector = f"dashboard:check_{i}" + (f"{{{matchers}}}" if matchers else "")
        # 1 where the expression returns series and every one has the labels; nothing or
        # 0 otherwise
        expr_tests.append({"expr": f"count({selector}) == bool count(dashboard:check_{i})", "eval_time": "10m",
                           "exp_samples": [{"labels": "{}", "value": 1}]})
    p = promtool_test(folder, {"rule_files": [path.name], "evaluation_interval": "30s", "tests": [
        {"interval": "30s", "input_series": synthetic_series([e for _, e, _ in checks]),
         "promql_expr_test": expr_tests}]})
    failed = {int(i) for i in re.findall(r'expr: "count\(dashboard:check_(\d+)\b', p.stdout + p.stderr)}
    assert (p.returncode == 0) == (not failed), p.stdout + p.stderr
    return {checks[i][0]: f"{checks[i][1]!r} returns no series with {sorted(checks[i][2])}" for i in sorted(failed)}


# --------------------------------------------------------------------------- registries
def test_registry_series_follow_prometheus_client_naming():
    """The series names taken from the registries are what the client library exposes:
    a counter family ``x`` as ``x_total``, a histogram as ``x_bucket`` (with ``le``),
    ``x_sum`` and ``x_count``, a gauge as itself; never the bare counter/histogram name."""
    families = registry_families()
    assert len(families) >= 30, families
    expected: set[str] = set()
    for name, kind in families.items():
        assert name.startswith("streamfleet_"), name
        expected |= {"counter": {f"{name}_total", f"{name}_created"},
                     "histogram": {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"},
                     "gauge": {name}}[kind]
    assert set(SERIES) == expected
    assert "streamfleet_requests_total" in SERIES and "streamfleet_requests" not in SERIES
    assert "streamfleet_queue_time_seconds" not in SERIES
    assert SERIES["streamfleet_queue_time_seconds_bucket"] == {"model", "lane", "le"}
    assert SERIES["streamfleet_queue_time_seconds_count"] == {"model", "lane"}
    assert SERIES["streamfleet_requests_total"] == {"model", "lane", "transport", "outcome", "code"}
    assert SERIES["streamfleet_active_connections"] == frozenset()
    assert registry_of()["streamfleet_lane_lag"] == "gateway"
    assert registry_of()["streamfleet_worker_slots"] == "worker"
    # the probe children are gone again
    from streamfleet.shared.metrics import gateway

    assert not [s for fam in gateway.requests.collect() for s in fam.samples if "probe0" in s.labels.values()]


# --------------------------------------------------------------------------- metric names
@pytest.mark.parametrize("where,expr", all_exprs(), ids=[w for w, _ in all_exprs()])
def test_metric_names_exist(where, expr):
    names = metric_names(expr)
    assert names, f"{where}: no metric in {expr!r}"
    unknown = names - known_names()
    assert not unknown, f"{where}: unknown metrics {sorted(unknown)}"


@pytest.mark.parametrize("expr,names", [
    ("sum by (model, lane) (rate(streamfleet_requests_total{model=~\"a|b\", lane!='x'}[5m] offset 1h))",
     {"streamfleet_requests_total"}),
    ("histogram_quantile(0.95,\n  sum by (le) (rate(streamfleet_queue_time_seconds_bucket[$__rate_interval])))",
     {"streamfleet_queue_time_seconds_bucket"}),
    ("namespace_model_lane:streamfleet_lane_lag:max > on (namespace, model) group_left (pod) "
     "namespace_model:streamfleet_worker_slots:sum", {"namespace_model_lane:streamfleet_lane_lag:max",
                                                      "namespace_model:streamfleet_worker_slots:sum"}),
    ("absent(up{job=\"streamfleet-gateway\"} == 1) or vector(1e3) unless sum(x) by (y) > bool 2",
     {"up", "x"}),
    ("max_over_time(streamfleet_lane_depth[10m:1m]) * -Inf + NaN", {"streamfleet_lane_depth"}),
])
def test_metric_names_regex(expr, names):
    assert metric_names(expr) == names


@pytest.mark.parametrize("expr,unknown", [
    ("rate(streamfleet_requests[5m])", "streamfleet_requests"),                       # a counter without _total
    ("streamfleet_queue_time_seconds > 1", "streamfleet_queue_time_seconds"),         # a histogram
    ("streamfleet_lane_depht", "streamfleet_lane_depht"),
    ("sum by (model) (redis_memory_usage_bytes)", "redis_memory_usage_bytes"),
])
def test_metric_name_check_catches_mistakes(expr, unknown):
    assert metric_names(expr) - known_names() == {unknown}


def test_dashboard_uses_no_recorded_series():
    """The dashboard works without the PrometheusRule: raw series only (and the
    evaluation of test_dashboard_queries_return_their_labels has no rules but its own)."""
    for where, target in dashboard_targets():
        used = metric_names(grafana_promql(target["expr"])) & recorded_names()
        assert not used, f"{where}: reads recorded series {sorted(used)}"


def test_job_names_match_pod_monitors():
    """Every job the rules and panels select is one a PodMonitor gives its targets."""
    jobs = set(pod_monitor_jobs())
    assert jobs == {JOBS["gateway"], JOBS["worker"], JOBS["redis_exporter"]}
    for where, expr in all_exprs():
        for used in re.findall(r'\bjob\s*=~?\s*"([^"]*)"', expr):
            assert used in jobs, f"{where}: job {used!r} is no PodMonitor's"


# --------------------------------------------------------------------------- dashboard queries
def dashboard_checks() -> list[tuple[str, str, set[str]]]:
    out = [(f"panel {where}", grafana_promql(t["expr"]), legend_labels(t)) for where, t in dashboard_targets()]
    out += [(f"variable ${name}", grafana_promql(selector), {label}) for name, selector, label in variable_queries()]
    return out


def test_dashboard_queries_return_their_labels(tmp_path):
    """Each panel's query and each variable's selector parses (promtool) and, on the
    series the fleet exposes, returns data with every label its legend or variable names."""
    assert {name for name, _, _ in variable_queries()} >= {"model", "lane"}
    for v in template_variables().values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}", v["name"]
    failed = evaluate(tmp_path, dashboard_checks())
    assert not failed, "\n".join(f"{where}: {why}" for where, why in failed.items())


def test_dashboard_query_check_catches_mistakes(tmp_path):
    good = [("good", "sum by (model) (rate(streamfleet_requests_total[5m]))", {"model"}),
            ("good variable", 'streamfleet_live_workers{namespace="sf"}', {"model"})]
    bad = [
        ("counter without _total", "sum(rate(streamfleet_requests[5m]))", set()),
        ("misspelt label", 'streamfleet_lane_depth{modle="tiny-gpt"}', set()),
        ("legend label aggregated away", "sum by (model) (streamfleet_worker_slots)", {"lane"}),
        ("legend label that no series has", "sum by (gpu) (streamfleet_worker_slots)", {"gpu"}),
        ("histogram_quantile without le",
         "histogram_quantile(0.9, sum by (model) (rate(streamfleet_worker_step_seconds_bucket[5m])))", set()),
        ("a label of another histogram", 'streamfleet_inter_token_latency_seconds_count{lane="high"}', set()),
        ("a namespace the fleet is not in", 'streamfleet_live_workers{namespace="elsewhere"}', set()),
    ]
    assert set(evaluate(tmp_path, good + bad)) == {where for where, _, _ in bad}


# --------------------------------------------------------------------------- promtool: parsing
def test_promtool_check_rules(tmp_path):
    path = rules_file(tmp_path)
    p = check_rules(path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(all_rules())} rules found" in p.stdout, p.stdout


@pytest.mark.parametrize("expr", [
    "sum(up",                                           # unbalanced
    "rate(streamfleet_requests_total)",                 # an instant vector where a range belongs
    "rated(streamfleet_requests_total[5m])",            # no such function
    "streamfleet_lane_depth{model=tiny}",               # unquoted matcher value
    "streamfleet_lane_depth[5x]",                       # not a duration
    "streamfleet_lane_depth and 1",                     # set operator with a scalar
    "sum by (model) (streamfleet_lane_depth) > on (model) group_left (lane) 2",  # matching with a scalar
])
def test_promtool_rejects_malformed_promql(tmp_path, expr):
    """The parse is not vacuous: promtool fails a rule with a malformed expression."""
    path = write_rules(tmp_path / "bad.rules.yml", [{"name": "x", "rules": [{"alert": "X", "expr": expr}]}])
    p = check_rules(path)
    assert p.returncode != 0, p.stdout


# --------------------------------------------------------------------------- (c): the rules
RULE_KEYS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}


def test_prometheus_rule_structure():
    pr = prometheus_rule()
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["metadata"]["name"]
    groups = pr["spec"]["groups"]
    assert len({g["name"] for g in groups}) == len(groups), "group names are unique"
    anchors = github_anchors(OPERATIONS_MD.read_text())
    sources = {r["record"]: metric_names(r["expr"]) for r in all_rules() if "record" in r}
    alerts, records = [], []
    for g in groups:
        assert g["rules"], g["name"]
        if "interval" in g:
            assert DURATION.fullmatch(g["interval"]), g["interval"]
        for rule in g["rules"]:
            assert set(rule) <= RULE_KEYS, f"{rule_id(rule)}: unknown keys {set(rule) - RULE_KEYS}"
            assert ("alert" in rule) != ("record" in rule), rule
            assert isinstance(rule["expr"], str) and rule["expr"].strip(), rule_id(rule)
            if "record" in rule:
                records.append(rule["record"])
                # level:metric:operations (Prometheus' naming practice for recording rules)
                assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", rule["record"]), rule["record"]
                assert not {"for", "annotations"} & set(rule), rule["record"]
                continue
            alerts.append(rule["alert"])
            name = rule["alert"]
            assert re.fullmatch(r"Streamfleet[A-Z][A-Za-z0-9]+", name), name
            for key in ("for", "keep_firing_for"):
                if key in rule:
                    assert isinstance(rule[key], str) and DURATION.fullmatch(rule[key]), f"{name}.{key}"
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
            ann = rule["annotations"]
            for key in ("summary", "description", "runbook_url"):
                assert isinstance(ann.get(key), str) and ann[key].strip(), f"{name}: annotation {key}"
            path, _, anchor = ann["runbook_url"].partition("#")
            assert path == "docs/operations.md", f"{name}: runbook_url {ann['runbook_url']}"
            assert anchor in anchors, f"{name}: no heading #{anchor} in docs/operations.md"
            # each alert's description names the metrics it reads (through recording rules
            # too) and, for another exporter's, that exporter
            names = metric_names(rule["expr"])
            raw = set().union(*(sources.get(n, {n}) for n in names)) - {"up"}
            assert not raw or any(n in ann["description"] for n in raw), \
                f"{name}: the description names none of {sorted(raw)}"
            for n in raw & set(EXTERNAL):
                assert EXTERNAL[n][0] in ann["description"], f"{name}: say that {n} comes from {EXTERNAL[n][0]}"
    assert len(set(alerts)) == len(alerts) and len(set(records)) == len(records)
    # the alerts the operators were promised
    assert {"StreamfleetLaneBacklogGrowing", "StreamfleetNoLiveWorker", "StreamfleetDeadLetters",
            "StreamfleetWorkerHeartbeatStale", "StreamfleetRedisMemoryNearMax",
            "StreamfleetPubSubOutputBufferGrowing"} <= set(alerts)


def test_recorded_series_are_defined_before_use():
    """A recording rule reads only the recorded series above it (one evaluation, no lag)."""
    defined: set[str] = set()
    recorded = {r["record"] for r in all_rules() if "record" in r}
    for rule in all_rules():
        used = metric_names(rule["expr"]) & recorded
        if "record" in rule:
            assert used <= defined, f"{rule['record']} reads {used - defined} before it is recorded"
            defined.add(rule["record"])
    assert defined == recorded


# --------------------------------------------------------------------------- promtool: alerts
def alert_tests() -> dict:
    return yaml.safe_load(ALERT_TESTS.read_text())


def alert_cases() -> list[dict]:
    """Every alert_rule_test of alerts.test.yml."""
    return [t for group in alert_tests()["tests"] for t in group.get("alert_rule_test", [])]


def test_alert_unit_tests(tmp_path):
    """promtool test rules runs tests/deploy/alerts.test.yml against the PrometheusRule."""
    rules_file(tmp_path)
    p = promtool_test(tmp_path, ALERT_TESTS.read_text(), ALERT_TESTS.name)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout, p.stdout


def test_every_alert_fires_and_stays_quiet_in_a_test():
    cases = alert_cases()
    named = {c["alertname"] for c in cases}
    assert named <= alert_names(), f"tests of unknown alerts {sorted(named - alert_names())}"
    assert named == alert_names(), f"no test for {sorted(alert_names() - named)}"
    for alert in sorted(alert_names()):
        mine = [c for c in cases if c["alertname"] == alert]
        firing = [c for c in mine if c.get("exp_alerts")]
        assert firing, f"{alert}: no test in which it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{alert}: no test in which it stays quiet"
        for c in firing:
            for exp in c["exp_alerts"]:
                assert exp.get("exp_labels", {}).get("severity"), f"{alert} at {c['eval_time']}: its labels"
                assert set(exp.get("exp_annotations", {})) == {"summary", "description", "runbook_url"}, \
                    f"{alert} at {c['eval_time']}: its annotations"
    # the healthy fleet: nothing fires
    [first] = alert_tests()["tests"][:1]
    assert {c["alertname"] for c in first["alert_rule_test"] if not c["exp_alerts"]} == alert_names()


def test_alert_annotations_name_labels_the_alert_has():
    """``$labels.x`` in an annotation renders empty where the alert has no label x: the
    alert tests' expected labels (the alert's whole label set, as promtool compares it)
    hold every label its annotations name."""
    rules = {r["alert"]: r for r in all_rules() if "alert" in r}
    for c in alert_cases():
        rule = rules[c["alertname"]]
        used = {u for text in rule["annotations"].values() for u in re.findall(r"\$labels\.(\w+)", text)}
        for exp in c.get("exp_alerts") or []:
            missing = used - set(exp["exp_labels"])
            assert not missing, f"{c['alertname']}: annotations name {sorted(missing)}, not labels of the alert"


_SERIES_NOTATION = re.compile(r"([a-zA-Z_:][\w:]*)\{(.*)\}")
_LABEL_PAIR = re.compile(r'\s*(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def parse_series(notation: str) -> tuple[str, dict[str, str]]:
    """``name{a="x", b="y"}`` (promtool's input series) -> (name, labels)."""
    m = _SERIES_NOTATION.fullmatch(notation.strip())
    assert m, f"not name{{labels}}: {notation}"
    labels, pos, body = {}, 0, m.group(2)
    while pos < len(body):
        pair = _LABEL_PAIR.match(body, pos)
        assert pair and pair.end() > pos, f"labels of {notation}"
        labels[pair.group(1)] = json.loads(f'"{pair.group(2)}"')
        pos = pair.end()
    return m.group(1), labels


def test_alert_test_series_are_real():
    """The alert tests feed the series the fleet exposes: a registry's (its labels exactly,
    under a scrape of that registry's job) or an exporter's of EXTERNAL; never a recorded
    series (the rules compute those) nor an invented one."""
    jobs = set(pod_monitor_jobs())
    registry = registry_of()
    for group in alert_tests()["tests"]:
        for inp in group["input_series"]:
            name, labels = parse_series(inp["series"])
            where = inp["series"]
            if name in SERIES:
                own = SERIES[name]
                assert set(labels) - TARGET_LABELS == own, f"{where}: the registry's labels {sorted(own)}"
                assert labels.get("job") == JOBS[registry[name]], f"{where}: scraped as {JOBS[registry[name]]}"
            elif name in EXTERNAL:
                source, own = EXTERNAL[name]
                targets = KSM_TARGET_LABELS if source == "kube-state-metrics" else TARGET_LABELS
                assert set(labels) - targets == own, f"{where}: {source}'s labels {sorted(own)}"
                assert labels.get("job") in ({JOBS[source]} if source in JOBS else jobs), f"{where}: job"
            else:
                pytest.fail(f"{where}: {name} is neither a registry's series nor in EXTERNAL")
            assert labels.get("namespace") == "sf", f"{where}: in the fleet's namespace"


def _mutated(mutate_firing, quiet_alert: dict | None = None) -> dict:
    tests = alert_tests()
    for c in (t for group in tests["tests"] for t in group.get("alert_rule_test", [])):
        if c.get("exp_alerts"):
            for exp in c["exp_alerts"]:
                mutate_firing(exp)
        elif quiet_alert is not None:
            c["exp_alerts"] = [copy.deepcopy(quiet_alert)]
    return tests


def test_alert_unit_tests_can_fail(tmp_path):
    """Every test of alerts.test.yml fails when its expectation is wrong: a firing alert's
    labels, or its annotations, or an alert expected where none fires."""
    rules_file(tmp_path)
    cases = alert_cases()
    firing = Counter((c["alertname"], seconds(c["eval_time"])) for c in cases if c.get("exp_alerts"))
    quiet = Counter((c["alertname"], seconds(c["eval_time"])) for c in cases if not c.get("exp_alerts"))

    def labels(exp):
        exp["exp_labels"]["severity"] += "-mutated"

    def annotations(exp):
        exp["exp_annotations"]["summary"] += " (mutated)"

    p = promtool_test(tmp_path, _mutated(labels, {"exp_labels": {"severity": "warning"}}), "labels.test.yml")
    assert p.returncode != 0
    assert failed_alert_tests(p.stdout + p.stderr) == firing + quiet, p.stdout + p.stderr
    p = promtool_test(tmp_path, _mutated(annotations), "annotations.test.yml")
    assert p.returncode != 0
    assert failed_alert_tests(p.stdout + p.stderr) == firing, p.stdout + p.stderr


# --------------------------------------------------------------------------- (d): the dashboard
def test_dashboard_structure():
    d = dashboard()
    assert 36 <= d["schemaVersion"] <= 41
    assert d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    panels = dashboard_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    boxes = []
    for p in panels:
        gp = p["gridPos"]
        assert gp["x"] >= 0 and gp["w"] > 0 and gp["x"] + gp["w"] <= 24 and gp["h"] > 0, p["title"]
        boxes.append((gp["x"], gp["y"], gp["x"] + gp["w"], gp["y"] + gp["h"], p["title"]))
        if p["type"] == "row":
            assert not p.get("targets"), f"row {p['title']} has no queries"
            continue
        assert p["title"] and p.get("description"), p["id"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        targets = p["targets"]
        assert targets, f"{p['title']}: no targets"
        assert len({t["refId"] for t in targets}) == len(targets), p["title"]
        for t in targets:
            assert isinstance(t.get("expr"), str) and t["expr"].strip(), p["title"]
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            for m in _VARIABLE.finditer(t["expr"]):
                var = m.group(1) or m.group(2)
                assert var in variables or var.startswith("__"), f"{p['title']}: ${var} is not defined"
            # multi-value variables expand to regexes: only =~ may take them
            for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', t["expr"]):
                for m in _VARIABLE.finditer(value):
                    var = m.group(1) or m.group(2)
                    if variables.get(var, {}).get("multi"):
                        assert op in ("=~", "!~"), f"{p['title']}: {label}{op}\"{value}\" needs =~"
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            overlap = a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
            assert not overlap, f"panels {a[4]!r} and {b[4]!r} overlap"
    # what the README and docs/operations.md promise to see
    text = json.dumps(d)
    for metric in ("streamfleet_requests_total", "streamfleet_time_to_first_token_seconds_bucket",
                   "streamfleet_inter_token_latency_seconds_bucket", "streamfleet_queue_time_seconds_bucket",
                   "streamfleet_tokens_streamed_total", "streamfleet_worker_batch_size",
                   "streamfleet_worker_step_seconds_bucket", "streamfleet_lane_depth", "streamfleet_lane_lag",
                   "streamfleet_active_connections", "streamfleet_active_streams", "streamfleet_refusals_total",
                   "streamfleet_live_workers", "streamfleet_dead_letters", "streamfleet_worker_grammar_mask_seconds",
                   "streamfleet_worker_shared_prefills_total", "streamfleet_worker_audio_seconds_total",
                   "redis_memory_used_bytes"):
        assert metric in text, f"the dashboard shows no {metric}"


# --------------------------------------------------------------------------- (e): kustomization
def test_monitoring_kustomization_lists_its_files():
    k = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    listed = k["resources"]
    assert len(set(listed)) == len(listed)
    for res in listed:
        assert (MONITORING / res).is_file(), f"{res} is listed but missing"
    on_disk = {p.name for p in MONITORING.iterdir() if p.suffix in (".yaml", ".yml")} - {"kustomization.yaml"}
    assert on_disk == set(listed), f"not listed: {on_disk - set(listed)}"
    base = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    assert k["namespace"] == base["namespace"], "monitors select pods of their own namespace"
    assert not any("monitoring" in r for r in base["resources"]), "the base must not need the operator's CRDs"
    kinds = sorted(d["kind"] for d in monitoring_docs())
    assert kinds == ["PodMonitor", "PodMonitor", "PodMonitor", "PrometheusRule"]


def test_monitoring_kustomization_renders():
    docs = kustomize(MONITORING)
    base_ns = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())["namespace"]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in monitoring_docs())
    for d in docs:
        assert d["metadata"]["namespace"] == base_ns
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "streamfleet"
    # the selectors are left alone by the labels transformer
    for d in docs:
        if d["kind"] == "PodMonitor":
            assert "app.kubernetes.io/part-of" not in d["spec"]["selector"]["matchLabels"]


def test_pod_monitors_select_the_fleet():
    workloads = {w["metadata"]["labels"]["app.kubernetes.io/component"]: w for w in base_workloads()
                 if w["metadata"]["name"] in ("streamfleet-gateway", "streamfleet-worker", "streamfleet-redis")}
    assert set(workloads) == {"gateway", "worker", "redis"}
    jobs = pod_monitor_jobs()
    for component, w in workloads.items():
        pm = jobs[f"streamfleet-{component}"]
        assert pm["apiVersion"] == "monitoring.coreos.com/v1"
        spec = pm["spec"]
        assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels"}
        pod_labels = w["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= pod_labels.items(), component
        others = [o for o in base_workloads() if o["metadata"]["name"] != w["metadata"]["name"]
                  and spec["selector"]["matchLabels"].items() <= o["spec"]["template"]["metadata"]["labels"].items()]
        assert not others, f"{pm['metadata']['name']} also selects {[o['metadata']['name'] for o in others]}"
        (ep,) = spec["podMetricsEndpoints"]
        assert ep["port"] == "metrics" and ep.get("path", "/metrics") == "/metrics"
        assert DURATION.fullmatch(ep["interval"]) and DURATION.fullmatch(ep["scrapeTimeout"])
        ports = {p["name"]: p["containerPort"] for c in w["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", []) if "name" in p}
        if component == "redis":
            # the redis_exporter sidecar (oliver006/redis_exporter listens on 9121); until
            # it is in redis.yaml there is nothing to compare
            if "metrics" in ports:
                assert ports["metrics"] == 9121
        else:
            env = {e["name"]: e.get("value") for c in w["spec"]["template"]["spec"]["containers"]
                   for e in c.get("env", [])}
            assert ports["metrics"] == int(env["SF_METRICS_PORT"]) == 9100, component
            assert env["SF_METRICS_HOST"] == "0.0.0.0", f"{component}: metrics must listen beyond localhost"


# --------------------------------------------------------------------------- the anchors helper
def test_github_anchors():
    md = "# Title\n## 4.1 A worker died\n```\n# not a heading\n```\n### Redis (`a.yml`, `b/c.conf`)\n## Dup\n## Dup\n"
    assert github_anchors(md) == {"title", "41-a-worker-died", "redis-ayml-bcconf", "dup", "dup-1"}
    assert {"43-a-lane-is-stuck", "redis-memory", "6-metrics"} <= github_anchors(OPERATIONS_MD.read_text())
