"""The operators' files against the metrics kafold exports (daemon.metric_catalog): the Grafana dashboard, the
Prometheus alert rules and the metric list in the docs name only exported metrics, and every exported metric is
on the dashboard and in the list."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from kafold.daemon import metric_catalog
from kafold.daemon.metrics import DaemonMetrics
from tests.support import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "kafold-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "kafold-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kafold-rules.test.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"
PROMETHEUS_OWN = {"up"}  # series Prometheus makes for each scrape target, not /metrics
PROMETHEUS_OWN_ALERTS = {"KafoldDown"}  # on `up` alone: nothing of kafold's to test it with

# ---- a small PromQL tokenizer: enough to find the metric names a query selects ---------------------------------
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|\{[^}]*\}|\[[^\]]*\]'
                    r"|(?:\d+(?:ms|[smhdwy]))+|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|[a-zA-Z_:][a-zA-Z0-9_:]*|\S")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan",
             # aggregation operators: `sum by (x) (...)` puts the label list between the name and its parenthesis
             "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
             "quantile", "limitk", "limit_ratio"}
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, aggregations, keywords,
    label names (in `by (...)` and the like, or inside `{...}`), strings or durations."""
    tokens = [m.group() for m in _TOKEN.finditer(expr)]
    names: set[str] = set()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok.lower() in _LABEL_LISTS and nxt == "(":
            i = tokens.index(")", i) + 1  # label names up to the closing parenthesis
            continue
        if _IDENT.fullmatch(tok) and tok.lower() not in _KEYWORDS and nxt != "(":
            names.add(tok)
        i += 1
    return names


def test_the_tokenizer_finds_metric_names_and_nothing_else() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, connector) (rate(a_bucket{job="x",le!="1e3"}[5m]))) / '
            'on (connector) group_left (task) b_total > 1e3 and time() - c offset 5m unless max without (x) (d:rec)')
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d:rec"}


# ---- what kafold exports ------------------------------------------------------------------------------------------
@cache
def _registry_families() -> list[Any]:
    return list(DaemonMetrics(lambda: [], lambda: {}, lambda: None).registry.collect())


@cache
def exported_series() -> frozenset[str]:
    """Every sample name /metrics can show: kafold's (from the catalog) and the process and platform collectors'."""
    standard = {s.name for f in _registry_families() for s in f.samples
                if f.name.startswith(metric_catalog.STANDARD_PREFIXES)}
    return frozenset(metric_catalog.series_names(metric_catalog.exported()) | standard)


def test_the_catalog_is_what_the_daemons_registry_exports() -> None:
    """Each family the daemon's collectors make is declared in the catalog with the same kind and help, and each
    declared family is made: the catalog is the list the other tests derive from."""
    made = {f.name: f for f in _registry_families() if f.name.startswith("kafold_")}
    declared = {f.name: f for f in metric_catalog.DAEMON}
    assert set(made) == set(declared)
    for name, family in made.items():
        assert (family.type, family.documentation) == (declared[name].kind, declared[name].help), name
    standard = {f.name for f in _registry_families() if not f.name.startswith("kafold_")}
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "python_info", "python_gc_collections"} <= standard


def test_every_exported_name_follows_the_naming_convention() -> None:
    """kafold_ prefix, snake case, no `_total` in a declared name (the exposition adds it to counters), and a gauge
    or histogram of time says `_seconds`."""
    for f in metric_catalog.exported():
        assert re.fullmatch(r"kafold_[a-z0-9_]+", f.name), f.name
        assert not f.name.endswith("_total"), f.name
        if re.search(r"(duration|age|time|lag)(_|$)", f.name) and f.kind in ("gauge", "histogram"):
            assert f.name.endswith(("_seconds", "_records")), f.name
        assert f.area in metric_catalog.AREAS or f.area == "connectors", f


# ---- the dashboard ------------------------------------------------------------------------------------------------
def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def test_dashboard_has_the_fields_grafana_requires() -> None:
    """A current schemaVersion, a datasource variable every panel uses, panels with unique ids, a gridPos inside the
    24 columns without overlaps, and targets with a refId and an expr."""
    d = _dashboard()
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36, d["schemaVersion"]
    assert d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("x", "y", "w", "h")) and g["x"] + g["w"] <= 24, p["title"]
        taken = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not taken & cells, f"{p['title']} overlaps another panel"
        cells |= taken
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_dashboard_queries_only_exported_metrics() -> None:
    for title, expr in _queries(_dashboard()):
        names = metric_names(expr)
        assert names, f"{title}: {expr} selects no metric"
        assert names <= exported_series(), f"{title}: {sorted(names - exported_series())} not exported"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: make test-tools (Debian's prometheus)")
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Each panel's expression parses: promtool checks them as recording rules."""
    rules = [{"record": f"kafold:panel_{i}", "expr": expr} for i, (_, expr) in enumerate(_queries(_dashboard()))]
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    res = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_exported_metric_is_on_the_dashboard() -> None:
    shown = {n for _, expr in _queries(_dashboard()) for n in metric_names(expr)}
    missing = [f.name for f in metric_catalog.exported() if not shown & set(f.series())]
    assert not missing, f"no dashboard panel shows {missing}"


def test_dashboard_rows_follow_the_catalogs_areas() -> None:
    """One row per area of the catalog; a panel's metrics belong to the row it sits in."""
    area_of = {s: f.area for f in metric_catalog.exported() for s in f.series()}
    row = None
    rows: set[str] = set()
    for p in _dashboard()["panels"]:
        if p["type"] == "row":
            row = p["title"].lower()
            rows.add(row)
            continue
        areas = {area_of[n] for t in p["targets"] for n in metric_names(t["expr"]) if n in area_of} - {"build"}
        assert areas <= {row}, f"{p['title']} ({areas}) sits in row {row!r}"
    assert {a for a in metric_catalog.AREAS if a != "build"} <= rows


# ---- the alert rules ----------------------------------------------------------------------------------------------
def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_alert_rules_name_only_exported_metrics_and_say_what_to_do() -> None:
    rules = _rules()
    assert rules
    for r in rules:
        names = metric_names(r["expr"])
        assert names and names <= exported_series() | PROMETHEUS_OWN, (r["alert"], names - exported_series())
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["action"], r["alert"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: make test-tools (Debian's prometheus)")
def test_alert_rules_pass_promtool() -> None:
    res = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing: make test-tools (Debian's prometheus)")
def test_alerts_fire_on_the_series_they_are_for_and_not_otherwise() -> None:
    """`promtool test rules`: lag, unaccounted records (not a write in flight), a stalled rebuild (not a moving one),
    parked keys, an open circuit, a stopped aggregate partition, dead letters, a stale snapshot."""
    res = subprocess.run(["promtool", "test", "rules", str(RULE_TESTS)], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    critical = {r["alert"] for r in _rules() if r["labels"]["severity"] == "critical"} - PROMETHEUS_OWN_ALERTS
    assert critical <= tested, f"critical alerts without a promtool test: {critical - tested}"


def test_operations_guide_points_at_each_alert_and_the_files() -> None:
    guide = OPERATIONS.read_text()
    assert "deploy/prometheus/kafold-rules.yaml" in guide and "deploy/grafana/kafold-dashboard.json" in guide
    missing = [r["alert"] for r in _rules() if f"`{r['alert']}`" not in guide]
    assert not missing, f"docs/operations.md does not name {missing}"


def test_metrics_doc_lists_every_exported_metric_as_declared() -> None:
    """docs/metrics.md has one row per family, with its kind, labels and help as the catalog declares them."""
    doc = METRICS_DOC.read_text()
    for f in metric_catalog.exported():
        row = f"| `{f.series()[0]}` | {f.kind} | {', '.join(f.labels) or '—'} | {f.help} |"
        assert row in doc, f"docs/metrics.md: no row {row}"
    listed = set(re.findall(r"^\| `(kafold_[a-z0-9_]+)`", doc, re.M))
    assert listed <= exported_series(), listed - exported_series()
