"""Monitoring files: deploy/k8s/monitoring (PodMonitors, PrometheusRule) and
deploy/grafana/streamfleet.json.

Fast and offline. Every PromQL expression (recording rules, alerts, dashboard targets and
template-variable queries) is parsed by the small PromQL parser below, which infers the
labels each sub-expression carries, so that:

* every metric name exists: in the gateway and worker registries of
  ``streamfleet.shared.metrics`` (the series names prometheus_client exposes, suffixes
  included), among the rules' own recorded series, or in ``EXTERNAL`` (redis_exporter,
  kube-state-metrics, Prometheus' ``up``);
* every label named in a selector, ``by``/``without``, ``on``/``ignoring``,
  ``group_left``/``group_right``, ``label_replace`` exists on the series it applies to, and
  ``histogram_quantile`` keeps ``le``; alert annotations (``$labels.x``) and panel legends
  (``{{x}}``) name only labels their expression yields.

``promtool check rules`` (and ``promtool test rules`` on the alerts' behaviour) run where
promtool is installed; the structural checks of the rules always run. The PodMonitors are
checked against the base manifests (pod labels, the ``metrics`` port), the dashboard for
its structure (unique ids, ``${datasource}``, layout, variables) and the monitoring
kustomization for listing exactly the files beside it.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S_BASE = REPO / "deploy" / "k8s"
MONITORING = K8S_BASE / "monitoring"
DASHBOARD = REPO / "deploy" / "grafana" / "streamfleet.json"
OPERATIONS_MD = REPO / "docs" / "operations.md"

pytestmark = pytest.mark.timeout(120)

#: labels the prometheus-operator gives every series it scrapes through a PodMonitor
#: (job and instance from Prometheus; namespace, pod, container, endpoint from the operator)
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "endpoint"})

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
def registry_series() -> dict[str, frozenset[str]]:
    """Every series name the gateway and worker registries expose, with its label names.

    The registries are the metric namespaces ``gateway`` and ``worker`` of
    ``streamfleet.shared.metrics``. A labelled metric exposes nothing until a child
    exists, so each gets a probe child for the collection, removed right after.
    """
    from prometheus_client.metrics import MetricWrapperBase

    from streamfleet.shared import metrics as sm

    out: dict[str, set[str]] = {}
    for namespace in (sm.gateway, sm.worker):
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
                        out.setdefault(sample.name, set()).update(sample.labels)
            finally:
                if labelnames:
                    metric.remove(*probe)
    return {name: frozenset(labels) for name, labels in out.items()}


def registry_families() -> dict[str, str]:
    """Metric family name -> type, as prometheus_client describes them."""
    from prometheus_client.metrics import MetricWrapperBase

    from streamfleet.shared import metrics as sm

    return {fam.name: fam.type for ns in (sm.gateway, sm.worker) for m in vars(ns).values()
            if isinstance(m, MetricWrapperBase) for fam in m.describe()}


SERIES = registry_series()


# --------------------------------------------------------------------------- PromQL
class PromQLError(ValueError):
    pass


_TOKEN = re.compile(r"""
    (?P<ws>\s+|\#[^\n]*)
  | (?P<str>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
  | (?P<dur>(?:\d+(?:ms|s|m|h|d|w|y))+)(?![\w.])
  | (?P<num>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){}\[\],:@])
""", re.X)

#: a Prometheus duration (units in this order, each at most once)
DURATION = re.compile(r"(?=\d)(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?")

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
#: aggregations whose result keeps the input's labels (they select series, not combine them)
SELECTING_AGGREGATIONS = {"topk", "bottomk", "limitk", "limit_ratio"}
V, M, S, STR = "vector", "matrix", "scalar", "string"
AGGREGATION_PARAM = {"count_values": STR, "bottomk": S, "topk": S, "quantile": S, "limitk": S, "limit_ratio": S}
_OVER_TIME = ("avg", "min", "max", "sum", "count", "stddev", "stdvar", "last", "present")
#: function -> (argument types, "?" marking optional ones, result type)
FUNCTIONS: dict[str, tuple[list[str], str]] = {
    **{f: ([V], V) for f in ("abs", "absent", "ceil", "exp", "floor", "ln", "log2", "log10", "sgn", "sort",
                             "sort_desc", "sqrt", "timestamp")},
    **{f: ([M], V) for f in ("absent_over_time", "changes", "delta", "deriv", "idelta", "increase", "irate",
                             "rate", "resets")},
    **{f"{a}_over_time": ([M], V) for a in _OVER_TIME},
    **{f: ([V + "?"], V) for f in ("day_of_month", "day_of_week", "day_of_year", "days_in_month", "hour",
                                   "minute", "month", "year")},
    "quantile_over_time": ([S, M], V),
    "clamp": ([V, S, S], V), "clamp_max": ([V, S], V), "clamp_min": ([V, S], V),
    "round": ([V, S + "?"], V),
    "histogram_quantile": ([S, V], V),
    "holt_winters": ([M, S, S], V),
    "predict_linear": ([M, S], V),
    "label_replace": ([V, STR, STR, STR, STR], V),
    "scalar": ([V], S), "vector": ([S], V), "time": ([], S),
}
_PRECEDENCE = [("or",), ("and", "unless"), ("==", "!=", "<=", "<", ">=", ">"), ("+", "-"),
               ("*", "/", "%", "atan2"), ("^",)]
_SET_OPS = {"and", "or", "unless"}
_COMPARISONS = {"==", "!=", "<=", "<", ">=", ">"}


@dataclass
class Result:
    type: str
    labels: frozenset[str] | None  # None: unknown (an unknown metric, already reported)
    selector: tuple[str, dict[str, str]] | None = None  # a plain instant selector: name, equality matchers


@dataclass
class Analysis:
    expr: str
    names: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    type: str = ""
    labels: frozenset[str] | None = None


class PromQL:
    """A recursive-descent parser for the PromQL the rules and dashboards use, which
    checks names and labels as it goes (``series``: name -> label names)."""

    def __init__(self, expr: str, series: dict[str, frozenset[str]]):
        self.series = series
        self.a = Analysis(expr)
        self.toks: list[tuple[str, str]] = []
        pos = 0
        while pos < len(expr):
            m = _TOKEN.match(expr, pos)
            if not m:
                raise PromQLError(f"unexpected character {expr[pos]!r} at {pos}: {expr!r}")
            pos = m.end()
            if m.lastgroup != "ws":
                self.toks.append((m.lastgroup, m.group()))
        self.i = 0

    # ---- token helpers
    def peek(self, k: int = 0) -> tuple[str, str]:
        return self.toks[self.i + k] if self.i + k < len(self.toks) else ("eof", "")

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        k, v = self.peek()
        if (value is not None and v != value) or (kind is not None and k != kind):
            raise PromQLError(f"expected {value or kind}, got {v or 'end'!r} in {self.a.expr!r}")
        self.i += 1
        return v

    def at(self, *values: str) -> bool:
        k, v = self.peek()
        return k in ("op", "ident") and v in values

    def err(self, msg: str) -> None:
        self.a.errors.append(msg)

    # ---- entry
    def run(self) -> Analysis:
        r = self.expr(0)
        if self.peek()[0] != "eof":
            raise PromQLError(f"trailing {self.peek()[1]!r} in {self.a.expr!r}")
        self.a.type, self.a.labels = r.type, r.labels
        return self.a

    def label_list(self) -> list[str]:
        self.take("(")
        out = []
        while not self.at(")"):
            out.append(self.take(kind="ident"))
            if not self.at(")"):
                self.take(",")
        self.take(")")
        return out

    def check_labels(self, labels: list[str], have: frozenset[str] | None, where: str) -> None:
        if have is None:
            return
        for label in labels:
            if label not in have:
                self.err(f"{where}: label {label!r} is not on the series it applies to ({sorted(have)})")

    # ---- binary operators, by precedence
    def expr(self, level: int) -> Result:
        if level == len(_PRECEDENCE):
            return self.unary()
        lhs = self.expr(level + 1)
        while self.at(*_PRECEDENCE[level]):
            op = self.take()
            returns_bool = False
            if self.at("bool"):
                self.take()
                returns_bool = True
                if op not in _COMPARISONS:
                    raise PromQLError(f"bool after {op!r} in {self.a.expr!r}")
            on = ignoring = None
            card, include = "one-to-one", []
            if self.at("on", "ignoring"):
                kw = self.take()
                labels = self.label_list()
                on, ignoring = (labels, None) if kw == "on" else (None, labels)
            if self.at("group_left", "group_right"):
                card = self.take()
                if self.at("("):
                    include = self.label_list()
            # ^ is right-associative
            rhs = self.expr(level) if op == "^" else self.expr(level + 1)
            lhs = self.binary(op, lhs, rhs, returns_bool, on, ignoring, card, include)
        return lhs

    def binary(self, op, lhs: Result, rhs: Result, returns_bool, on, ignoring, card, include) -> Result:
        where = f"{op!r}"
        for side in (lhs, rhs):
            if side.type not in (V, S):
                raise PromQLError(f"{where}: operand is a {side.type} in {self.a.expr!r}")
        if lhs.type == S and rhs.type == S:
            if op in _SET_OPS or (op in _COMPARISONS and not returns_bool):
                raise PromQLError(f"{where} between scalars needs bool in {self.a.expr!r}")
            return Result(S, frozenset())
        if lhs.type == S or rhs.type == S:
            if op in _SET_OPS or on is not None or ignoring is not None or card != "one-to-one":
                raise PromQLError(f"{where}: vector matching with a scalar in {self.a.expr!r}")
            return Result(V, (rhs if lhs.type == S else lhs).labels)
        matching = on if on is not None else ignoring or []
        self.check_labels(matching, lhs.labels, f"{where} on/ignoring (left)")
        self.check_labels(matching, rhs.labels, f"{where} on/ignoring (right)")
        if op in _SET_OPS:
            if card != "one-to-one":
                raise PromQLError(f"{card} with {op!r} in {self.a.expr!r}")
            if op == "or":
                both = None if lhs.labels is None or rhs.labels is None else lhs.labels | rhs.labels
                return Result(V, both)
            return Result(V, lhs.labels)
        if card == "group_left":
            self.check_labels(include, rhs.labels, f"{where} group_left (right)")
            return Result(V, None if lhs.labels is None else lhs.labels | set(include))
        if card == "group_right":
            self.check_labels(include, lhs.labels, f"{where} group_right (left)")
            return Result(V, None if rhs.labels is None else rhs.labels | set(include))
        if lhs.labels is None:
            return Result(V, None)
        if on is not None:  # one-to-one matching on(): only those labels remain
            return Result(V, frozenset(on))
        return Result(V, lhs.labels - set(ignoring or ()))

    def unary(self) -> Result:
        if self.at("-", "+"):
            self.take()
            r = self.unary()
            if r.type not in (V, S):
                raise PromQLError(f"unary minus on a {r.type} in {self.a.expr!r}")
            return Result(r.type, r.labels)
        return self.postfix(self.primary())

    def postfix(self, r: Result) -> Result:
        while True:
            if self.at("["):
                self.take()
                rng = self.take(kind="dur")
                if not DURATION.fullmatch(rng):
                    raise PromQLError(f"bad duration {rng!r} in {self.a.expr!r}")
                if self.at(":"):  # subquery
                    self.take()
                    if not self.at("]"):
                        self.take(kind="dur")
                    self.take("]")
                    if r.type != V:
                        raise PromQLError(f"subquery of a {r.type} in {self.a.expr!r}")
                    r = Result(M, r.labels)
                else:
                    self.take("]")
                    if r.selector is None:
                        raise PromQLError(f"range of something not a selector in {self.a.expr!r}")
                    r = Result(M, r.labels)
            elif self.at("offset"):
                self.take()
                if self.at("-"):
                    self.take()
                self.take(kind="dur")
                r = Result(r.type, r.labels, r.selector)
            else:
                return r

    def primary(self) -> Result:
        kind, value = self.peek()
        if kind == "num":
            self.take()
            return Result(S, frozenset())
        if kind == "str":
            self.take()
            return Result(STR, frozenset())
        if value == "(" and kind == "op":
            self.take()
            r = self.expr(0)
            self.take(")")
            return Result(r.type, r.labels)
        if value == "{" and kind == "op":
            return self.selector(None)
        if kind == "ident":
            if value.lower() in ("inf", "nan"):
                self.take()
                return Result(S, frozenset())
            if value in AGGREGATIONS and (self.peek(1)[1] in ("(", "by", "without")):
                return self.aggregation()
            if self.peek(1)[1] == "(":
                return self.call()
            return self.selector(self.take())
        raise PromQLError(f"unexpected {value or 'end'!r} in {self.a.expr!r}")

    def selector(self, name: str | None) -> Result:
        matchers: list[tuple[str, str, str]] = []
        if self.at("{"):
            self.take()
            while not self.at("}"):
                label = self.take(kind="ident")
                op = self.take()
                if op not in ("=", "!=", "=~", "!~"):
                    raise PromQLError(f"bad matcher operator {op!r} in {self.a.expr!r}")
                matchers.append((label, op, self.take(kind="str")[1:-1]))
                if not self.at("}"):
                    self.take(",")
            self.take("}")
        if name is None:
            name = next((v for lbl, op, v in matchers if lbl == "__name__" and op == "="), None)
            if name is None:
                raise PromQLError(f"selector without a metric name in {self.a.expr!r}")
        self.a.names.add(name)
        labels = self.series.get(name)
        if labels is None:
            self.err(f"unknown metric {name!r}")
        else:
            self.check_labels([lbl for lbl, _, _ in matchers if lbl != "__name__"], labels, f"selector {name}")
        equal = {lbl: v for lbl, op, v in matchers if op == "=" and lbl != "__name__"}
        return Result(V, labels, (name, equal))

    def aggregation(self) -> Result:
        op = self.take()
        grouping, without = None, False

        def modifier():
            nonlocal grouping, without
            if self.at("by", "without"):
                without = self.take() == "without"
                grouping = self.label_list()

        modifier()
        self.take("(")
        counted_label = None
        if AGGREGATION_PARAM.get(op) == STR:  # count_values("label", v)
            counted_label = self.take(kind="str")[1:-1]
            self.take(",")
        elif op in AGGREGATION_PARAM:
            param = self.expr(0)
            self.take(",")
            if param.type != AGGREGATION_PARAM[op]:
                raise PromQLError(f"{op}: parameter is a {param.type} in {self.a.expr!r}")
        inner = self.expr(0)
        self.take(")")
        if grouping is None:
            modifier()
        if inner.type != V:
            raise PromQLError(f"{op} of a {inner.type} in {self.a.expr!r}")
        self.check_labels(grouping or [], inner.labels, f"{op} {'without' if without else 'by'}")
        if op in SELECTING_AGGREGATIONS:
            return Result(V, inner.labels)
        if inner.labels is None:
            out = None
        elif without:
            out = inner.labels - set(grouping or ())
        else:
            out = frozenset(grouping or ())
        if counted_label is not None and out is not None:
            out = out | {counted_label}
        return Result(V, out)

    def call(self) -> Result:
        name = self.take()
        if name not in FUNCTIONS:
            raise PromQLError(f"unknown function {name!r} in {self.a.expr!r}")
        want, returns = FUNCTIONS[name]
        self.take("(")
        args: list[Result] = []
        strings: list[str] = []
        while not self.at(")"):
            if self.peek()[0] == "str" and self.peek(1)[1] in (",", ")"):
                strings.append(self.take()[1:-1])
                args.append(Result(STR, frozenset()))
            else:
                args.append(self.expr(0))
            if not self.at(")"):
                self.take(",")
        self.take(")")
        required = [t for t in want if not t.endswith("?")]
        if not len(required) <= len(args) <= len(want):
            raise PromQLError(f"{name} takes {len(want)} arguments, got {len(args)} in {self.a.expr!r}")
        for arg, t in zip(args, want, strict=False):  # optional arguments may be left out
            if arg.type != t.rstrip("?"):
                raise PromQLError(f"{name}: a {arg.type} where a {t.rstrip('?')} belongs in {self.a.expr!r}")
        if returns == S:
            return Result(S, frozenset())
        vec = next((a for a in args if a.type in (V, M)), None)
        if name == "vector" or vec is None:
            return Result(V, frozenset())
        labels = vec.labels
        if name == "histogram_quantile":
            if labels is not None and "le" not in labels:
                self.err(f"histogram_quantile: its input has no 'le' label ({sorted(labels)})")
            return Result(V, None if labels is None else labels - {"le"})
        if name == "label_replace":
            dst, _, src, _ = strings
            if src:
                self.check_labels([src], labels, "label_replace source")
            return Result(V, None if labels is None else labels | {dst})
        if name in ("absent", "absent_over_time"):
            # absent() of a plain selector carries its equality matchers' labels
            sel = args[0].selector
            return Result(V, frozenset(sel[1]) if sel else frozenset())
        return Result(V, labels)


def analyze(expr: str, series: dict[str, frozenset[str]]) -> Analysis:
    return PromQL(expr, series).run()


# --------------------------------------------------------------------------- files
def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def monitoring_docs() -> list[dict]:
    k = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    return [d for res in k["resources"] for d in load_yaml_docs(MONITORING / res)]


def prometheus_rule() -> dict:
    rules = [d for d in monitoring_docs() if d["kind"] == "PrometheusRule"]
    assert len(rules) == 1
    return rules[0]


def all_rules() -> list[dict]:
    return [r for g in prometheus_rule()["spec"]["groups"] for r in g["rules"]]


def rule_id(rule: dict) -> str:
    return rule.get("alert") or rule.get("record")


@functools.cache
def known_series() -> dict[str, frozenset[str]]:
    """The code's registries with the target labels, the external metrics, and the rules'
    recorded series with the labels their expressions yield (in rule order). Read only."""
    series = {name: labels | TARGET_LABELS for name, labels in SERIES.items()}
    for name, (source, labels) in EXTERNAL.items():
        series[name] = labels | (frozenset({"job", "instance", "service", "endpoint"})
                                 if source == "kube-state-metrics" else TARGET_LABELS)
    for rule in all_rules():
        if "record" in rule:
            a = analyze(rule["expr"], series)
            series[rule["record"]] = a.labels if a.labels is not None else frozenset()
    return series


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels of collapsed rows
    return out


#: Grafana's interval variables, as durations PromQL accepts
GRAFANA_DURATIONS = {"$__rate_interval": "5m", "${__rate_interval}": "5m", "$__interval": "1m",
                     "${__interval}": "1m", "$__range": "1h", "${__range}": "1h"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def grafana_promql(expr: str) -> str:
    for var, dur in GRAFANA_DURATIONS.items():
        expr = expr.replace(var, dur)
    return expr


def dashboard_targets() -> list[tuple[str, dict]]:
    return [(f"{p['title']}/{t['refId']}", t) for p in dashboard_panels(dashboard()) for t in p.get("targets", [])]


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
    return out


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
    # the probe children are gone again
    from streamfleet.shared.metrics import gateway

    assert not [s for fam in gateway.requests.collect() for s in fam.samples if "probe0" in s.labels.values()]


# --------------------------------------------------------------------------- (a), (b): names and labels
@pytest.mark.parametrize("where,expr", all_exprs(), ids=[w for w, _ in all_exprs()])
def test_metric_names_and_labels_exist(where, expr):
    a = analyze(expr, known_series())
    assert not a.errors, f"{where}: {a.errors}"
    assert a.names, f"{where}: no metric in {expr!r}"
    assert a.type in (V, S), f"{where}: evaluates to a {a.type}"


def test_dashboard_uses_no_recorded_series():
    """The dashboard works without the PrometheusRule: raw series only."""
    series = {n: lb | TARGET_LABELS for n, lb in SERIES.items()}
    series.update({n: lb | TARGET_LABELS for n, (_, lb) in EXTERNAL.items()})
    for where, target in dashboard_targets():
        a = analyze(grafana_promql(target["expr"]), series)
        assert not a.errors, f"{where}: {a.errors}"


def test_alert_annotations_and_legends_name_existing_labels():
    series = known_series()
    for rule in all_rules():
        if "alert" not in rule:
            continue
        labels = analyze(rule["expr"], series).labels | set(rule.get("labels", {}))
        for key, text in rule["annotations"].items():
            for used in re.findall(r"\$labels\.(\w+)", text):
                assert used in labels, f"{rule['alert']}.{key}: $labels.{used} not in {sorted(labels)}"
    for where, target in dashboard_targets():
        labels = analyze(grafana_promql(target["expr"]), series).labels
        for used in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
            assert used in labels, f"{where}: legend {{{{{used}}}}} not in {sorted(labels)}"


def test_dashboard_variable_queries():
    series = known_series()
    variables = dashboard()["templating"]["list"]
    queries = [v for v in variables if v["type"] == "query"]
    assert {v["name"] for v in queries} >= {"model", "lane"}
    for v in queries:
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q)
        assert m, f"${v['name']}: {q!r} is not label_values(selector, label)"
        a = analyze(grafana_promql(m.group(1)), series)
        assert not a.errors, f"${v['name']}: {a.errors}"
        assert m.group(2) in a.labels, f"${v['name']}: {m.group(2)!r} not on {m.group(1)}"
        assert v["datasource"]["uid"] == "${datasource}"


def test_job_names_match_pod_monitors():
    """Every job the rules and panels select is one a PodMonitor gives its targets."""
    jobs = set(pod_monitor_jobs())
    assert jobs == {"streamfleet-gateway", "streamfleet-worker", "streamfleet-redis"}
    for where, expr in all_exprs():
        for used in re.findall(r'\bjob\s*=~?\s*"([^"]*)"', expr):
            assert used in jobs, f"{where}: job {used!r} is no PodMonitor's"


# --------------------------------------------------------------------------- (f): the checks can fail
@pytest.mark.parametrize("expr,error", [
    ("rate(streamfleet_requests[5m])", "unknown metric 'streamfleet_requests'"),            # counter w/o _total
    ("streamfleet_queue_time_seconds > 1", "unknown metric 'streamfleet_queue_time_seconds'"),  # a histogram
    ("streamfleet_lane_depht", "unknown metric 'streamfleet_lane_depht'"),
    ("redis_memory_usage_bytes", "unknown metric 'redis_memory_usage_bytes'"),
    ('streamfleet_lane_depth{modle="tiny-gpt"}', "label 'modle'"),
    ("sum by (gpu) (streamfleet_worker_slots)", "label 'gpu'"),
    ("sum by (model) (streamfleet_worker_slots) > on (lane) sum by (model) (streamfleet_worker_slots)",
     "label 'lane'"),
    ("histogram_quantile(0.9, sum by (model) (rate(streamfleet_worker_step_seconds_bucket[5m])))",
     "no 'le' label"),
    ('streamfleet_inter_token_latency_seconds_count{lane="high"}', "label 'lane'"),
])
def test_metric_check_catches_mistakes(expr, error):
    a = analyze(expr, known_series())
    assert any(error in e for e in a.errors), a.errors


@pytest.mark.parametrize("expr", [
    "rate(streamfleet_requests_total)",                 # an instant vector where a range belongs
    "sum(rate(streamfleet_requests_total[5m])",         # unbalanced
    "rated(streamfleet_requests_total[5m])",            # no such function
    "streamfleet_lane_depth{model=tiny}",               # unquoted matcher value
    "streamfleet_lane_depth[5x]",                       # not a duration
    "streamfleet_lane_depth and 1",                     # set operator with a scalar
])
def test_parser_rejects_malformed_promql(expr):
    with pytest.raises(PromQLError):
        analyze(expr, known_series())


def test_parser_infers_labels():
    s = known_series()
    assert analyze("sum by (model) (rate(streamfleet_requests_total[5m]))", s).labels == {"model"}
    assert analyze("histogram_quantile(0.9, sum by (le, lane) (rate(streamfleet_queue_time_seconds_bucket[5m])))",
                   s).labels == {"lane"}
    assert analyze("streamfleet_lane_lag > on (model) group_left () sum by (model) (streamfleet_worker_slots)",
                   s).labels == SERIES["streamfleet_lane_lag"] | TARGET_LABELS
    assert analyze("streamfleet_lane_lag > on (model, lane) streamfleet_lane_depth", s).labels == {"model", "lane"}
    assert analyze('absent(up{job="streamfleet-gateway"})', s).labels == {"job"}
    assert analyze('absent(up{job="streamfleet-gateway"} == 1)', s).labels == frozenset()
    assert analyze("sum without (pod) (streamfleet_worker_slots)", s).labels == \
        {"model"} | TARGET_LABELS - {"pod"}
    assert analyze("2 * 3", s).type == S
    assert analyze("1 + -streamfleet_active_connections offset 5m", s).labels == TARGET_LABELS


# --------------------------------------------------------------------------- (c): the rules
RULE_KEYS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}


def test_prometheus_rule_structure():
    pr = prometheus_rule()
    assert pr["apiVersion"] == "monitoring.coreos.com/v1"
    assert pr["metadata"]["name"]
    groups = pr["spec"]["groups"]
    assert len({g["name"] for g in groups}) == len(groups), "group names are unique"
    anchors = github_anchors(OPERATIONS_MD.read_text())
    series = known_series()
    sources = {r["record"]: analyze(r["expr"], series).names for r in all_rules() if "record" in r}
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
            names = analyze(rule["expr"], series).names
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
        used = analyze(rule["expr"], known_series()).names & recorded
        if "record" in rule:
            assert used <= defined, f"{rule['record']} reads {used - defined} before it is recorded"
            defined.add(rule["record"])
    assert defined == recorded


def rules_file(tmp_path: Path, strip_annotations: bool = False) -> Path:
    groups = json.loads(json.dumps(prometheus_rule()["spec"]["groups"]))
    if strip_annotations:
        for g in groups:
            for r in g["rules"]:
                r.pop("annotations", None)
    path = tmp_path / "streamfleet.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def test_promtool_check_rules(tmp_path):
    if not shutil.which("promtool"):
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    path = rules_file(tmp_path)
    p = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(all_rules())} rules found" in p.stdout, p.stdout
    # and promtool does fail on a broken rule
    bad = tmp_path / "bad.rules.yaml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "X", "expr": "sum(up"}]}]}))
    assert subprocess.run(["promtool", "check", "rules", str(bad)], capture_output=True, timeout=60).returncode != 0


# The alerts' behaviour, on synthetic series (promtool test rules). Two gateways report the
# same fleet gauges; sf = the namespace.
GW = 'job="streamfleet-gateway", namespace="sf"'
WK = 'job="streamfleet-worker", namespace="sf"'
RD = 'job="streamfleet-redis", namespace="sf", instance="10.0.0.9:9121", pod="streamfleet-redis-0"'
MIB = 1024 * 1024
PROMTOOL_TESTS = [
    {   # no live worker: every gateway says 0; one gateway's stale 1 does not hide it
        "interval": "30s",
        "input_series": [
            {"series": f'streamfleet_live_workers{{{GW}, pod="gw-a", model="tiny-gpt"}}', "values": "1 1 0x20"},
            {"series": f'streamfleet_live_workers{{{GW}, pod="gw-b", model="tiny-gpt"}}', "values": "1 1 0x20"},
            {"series": f'streamfleet_live_workers{{{GW}, pod="gw-a", model="other"}}', "values": "0x20"},
            {"series": f'streamfleet_live_workers{{{GW}, pod="gw-b", model="other"}}', "values": "1x20"},
        ],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "StreamfleetNoLiveWorker", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "StreamfleetNoLiveWorker", "exp_alerts": [
                {"exp_labels": {"severity": "critical", "namespace": "sf", "model": "tiny-gpt"}}]},
        ],
    },
    {   # the normal lane's lag grows, the high lane's stays level
        "interval": "30s",
        "input_series": [
            {"series": f'streamfleet_lane_lag{{{GW}, pod="gw-a", model="tiny-gpt", lane="normal"}}',
             "values": "0+3x60"},
            {"series": f'streamfleet_lane_lag{{{GW}, pod="gw-b", model="tiny-gpt", lane="normal"}}',
             "values": "0+3x60"},
            {"series": f'streamfleet_lane_lag{{{GW}, pod="gw-a", model="tiny-gpt", lane="high"}}',
             "values": "40x60"},
            {"series": f'streamfleet_worker_slots{{{WK}, pod="w-1", model="tiny-gpt"}}', "values": "16x60"},
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "StreamfleetLaneBacklogGrowing", "exp_alerts": []},
            {"eval_time": "25m", "alertname": "StreamfleetLaneBacklogGrowing", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "sf", "model": "tiny-gpt", "lane": "normal"}}]},
            {"eval_time": "25m", "alertname": "StreamfleetLaneBacklogHigh", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "sf", "model": "tiny-gpt", "lane": "high"}},
                {"exp_labels": {"severity": "warning", "namespace": "sf", "model": "tiny-gpt", "lane": "normal"}}]},
        ],
    },
    {   # a worker dead-letters a task at 3m; the gateways' gauge follows
        "interval": "30s",
        "input_series": [
            {"series": f'streamfleet_worker_dead_letters_total{{{WK}, pod="w-1", model="tiny-gpt"}}',
             "values": "0x5 1x40"},
            {"series": f'streamfleet_dead_letters{{{GW}, pod="gw-a", model="tiny-gpt"}}', "values": "0x5 1x40"},
        ],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "StreamfleetDeadLetters", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "StreamfleetDeadLetters", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "sf", "model": "tiny-gpt"}}]},
            {"eval_time": "19m", "alertname": "StreamfleetDeadLetters", "exp_alerts": []},
        ],
    },
    {   # two worker processes scraped, one fresh heartbeat; the worker metrics of a third are down
        "interval": "30s",
        "input_series": [
            {"series": f'streamfleet_worker_slots{{{WK}, pod="w-1", model="tiny-gpt"}}', "values": "16x40"},
            {"series": f'streamfleet_worker_slots{{{WK}, pod="w-2", model="tiny-gpt"}}', "values": "16x40"},
            {"series": f'streamfleet_live_workers{{{GW}, pod="gw-a", model="tiny-gpt"}}', "values": "2 2 1x40"},
            {"series": f'up{{{WK}, pod="w-3", instance="10.0.0.3:9100"}}', "values": "1 0x40"},
        ],
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "StreamfleetWorkerHeartbeatStale", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "StreamfleetWorkerHeartbeatStale", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "sf", "model": "tiny-gpt"}}]},
            {"eval_time": "5m", "alertname": "StreamfleetNoLiveWorker", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "StreamfleetWorkerMetricsDown", "exp_alerts": []},
            {"eval_time": "15m", "alertname": "StreamfleetWorkerMetricsDown", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "job": "streamfleet-worker", "namespace": "sf", "pod": "w-3",
                                "instance": "10.0.0.3:9100"}}]},
        ],
    },
    {   # Redis at 90 % of maxmemory; one gateway subscriber 8 MiB behind, another 1 MiB;
        # a subscriber disconnected at 4m; the exporter exports the client list
        "interval": "30s",
        "input_series": [
            {"series": f"redis_up{{{RD}}}", "values": "1x40"},
            {"series": f"redis_memory_used_bytes{{{RD}}}", "values": f"{int(0.9 * 2048 * MIB)}x40"},
            {"series": f"redis_memory_max_bytes{{{RD}}}", "values": f"{2048 * MIB}x40"},
            {"series": f'redis_config_client_output_buffer_limit_bytes{{{RD}, class="pubsub", limit="soft"}}',
             "values": f"{16 * MIB}x40"},
            {"series": f'redis_config_client_output_buffer_limit_bytes{{{RD}, class="pubsub", limit="hard"}}',
             "values": f"{64 * MIB}x40"},
            {"series": f'redis_connected_client_output_buffer_memory_usage_bytes{{{RD}, id="7", '
                       f'name="sf-gateway-a1-pubsub"}}', "values": f"{8 * MIB}x40"},
            {"series": f'redis_connected_client_output_buffer_memory_usage_bytes{{{RD}, id="8", '
                       f'name="sf-gateway-b2-pubsub"}}', "values": f"{1 * MIB}x40"},
            {"series": f'redis_connected_client_output_buffer_memory_usage_bytes{{{RD}, id="9", name=""}}',
             "values": f"{32 * MIB}x40"},
            {"series": f"redis_client_output_buffer_limit_disconnections_total{{{RD}}}", "values": "0x8 1x32"},
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "StreamfleetRedisMemoryNearMax", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "job": "streamfleet-redis", "namespace": "sf",
                                "instance": "10.0.0.9:9121", "pod": "streamfleet-redis-0"}}]},
            {"eval_time": "10m", "alertname": "StreamfleetRedisMemoryCritical", "exp_alerts": []},
            {"eval_time": "3m", "alertname": "StreamfleetPubSubOutputBufferGrowing", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "job": "streamfleet-redis", "namespace": "sf",
                                "instance": "10.0.0.9:9121", "pod": "streamfleet-redis-0", "id": "7",
                                "name": "sf-gateway-a1-pubsub"}}]},
            {"eval_time": "6m", "alertname": "StreamfleetRedisOutputBufferDisconnects", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "job": "streamfleet-redis", "namespace": "sf",
                                "instance": "10.0.0.9:9121", "pod": "streamfleet-redis-0"}}]},
            {"eval_time": "20m", "alertname": "StreamfleetRedisClientListNotExported", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "StreamfleetRedisDown", "exp_alerts": []},
        ],
    },
    {   # an exporter without the client list, Redis unreachable at 2m; no gateway target at all
        "interval": "30s",
        "input_series": [
            {"series": f"redis_up{{{RD}}}", "values": "1x3 0x40"},
            {"series": f'up{{{RD}}}', "values": "1x40"},
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "StreamfleetRedisDown", "exp_alerts": [
                {"exp_labels": {"severity": "critical", "job": "streamfleet-redis", "namespace": "sf",
                                "instance": "10.0.0.9:9121", "pod": "streamfleet-redis-0"}}]},
            {"eval_time": "10m", "alertname": "StreamfleetGatewayMetricsAbsent", "exp_alerts": [
                {"exp_labels": {"severity": "critical"}}]},
            {"eval_time": "10m", "alertname": "StreamfleetRedisExporterAbsent", "exp_alerts": []},
        ],
    },
    {   # the exporter answers without the client list for 20 minutes
        "interval": "30s",
        "input_series": [{"series": f"redis_up{{{RD}}}", "values": "1x60"}],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "StreamfleetRedisClientListNotExported", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "StreamfleetRedisClientListNotExported", "exp_alerts": [
                {"exp_labels": {"severity": "info", "job": "streamfleet-redis", "namespace": "sf",
                                "instance": "10.0.0.9:9121", "pod": "streamfleet-redis-0"}}]},
        ],
    },
    {   # overload refusals on the SSE door, Redis errors on a worker, a crash-looping worker
        "interval": "30s",
        "input_series": [
            {"series": f'streamfleet_refusals_total{{{GW}, pod="gw-a", transport="sse", code="overloaded"}}',
             "values": "0+10x40"},
            {"series": f'streamfleet_refusals_total{{{GW}, pod="gw-a", transport="ws", code="rate_limited"}}',
             "values": "0+10x40"},
            {"series": f'streamfleet_worker_redis_errors_total{{{WK}, pod="w-1", operation="main_loop"}}',
             "values": "0+30x40"},
            {"series": 'kube_pod_container_status_restarts_total{job="kube-state-metrics", namespace="sf", '
                       'pod="streamfleet-worker-5d9-x", uid="u1", container="worker"}', "values": "0 1 2 3 4x30"},
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "StreamfleetOverloadRefusals", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "sf", "transport": "sse"}}]},
            {"eval_time": "10m", "alertname": "StreamfleetWorkerRedisErrors", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "sf", "operation": "main_loop"}}]},
            {"eval_time": "5m", "alertname": "StreamfleetWorkerRestarting", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "job": "kube-state-metrics", "namespace": "sf",
                                "pod": "streamfleet-worker-5d9-x", "uid": "u1", "container": "worker"}}]},
            {"eval_time": "10m", "alertname": "StreamfleetGatewayRedisErrors", "exp_alerts": []},
        ],
    },
]


def test_promtool_alert_behaviour(tmp_path):
    """The alerts fire (and stay quiet) as intended, fleet gauges counted once however
    many gateways report them. Annotations are left out: check rules covers them."""
    if not shutil.which("promtool"):
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    rules = rules_file(tmp_path, strip_annotations=True)
    tests = tmp_path / "streamfleet.test.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "30s",
                                     "tests": PROMTOOL_TESTS}, sort_keys=False))
    p = subprocess.run(["promtool", "test", "rules", tests.name], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    tested = {t["alertname"] for case in PROMTOOL_TESTS for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for r in all_rules() if "alert" in r}, "every alert has a promtool case"


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
    if not shutil.which("kubectl"):
        pytest.skip("kubectl is not installed")
    p = subprocess.run(["kubectl", "kustomize", str(MONITORING)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    docs = [d for d in yaml.safe_load_all(p.stdout) if d]
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
