"""The Grafana dashboard shipped with the Helm chart queries only metrics that Tandem exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tandem.common.telemetry import metrics as m

DASHBOARD = Path(__file__).resolve().parents[3] / "helm" / "tandem" / "dashboards" / "tandem.json"


def exported_series() -> set[str]:
    """Every sample name a router, prefill and decode worker can expose (each metric observed once)."""
    router = m.RouterMetrics()
    router.watch(lambda: [m.WorkerSample("w", "decode", True, 0, 0, 0, "open", kv_total_tokens=1)], lambda: 0,
                 lambda: 0)
    router.request.start().finish("stop", 1, 1)
    router.rejected.labels("queue_full").inc()
    router.sent_to("w", "prefill")
    router.http_requests.labels("/v1/completions", "200").inc()
    names = set()
    registries = [router.registry]
    for role, role_metrics in (("prefill", m.PrefillMetrics), ("decode", m.DecodeMetrics)):
        worker = m.WorkerMetrics(role)
        worker.watch_scheduler(lambda: m.SchedulerStats(queues={"waiting": 0}))
        role_metrics(worker.registry).transfer.failed("peer_lost")
        registries.append(worker.registry)
    for registry in registries:
        for family in text_string_to_metric_families(m.render(registry).decode()):
            names.update(sample.name for sample in family.samples)
    return names


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 20
    used = {name for e in exprs for name in re.findall(r"\btandem_[a-z0-9_]+", e)}
    missing = used - exported_series()
    assert not missing, f"the dashboard queries metrics Tandem does not export: {sorted(missing)}"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_every_panel_filters_by_namespace_instance_and_model():
    """Two releases (or two models) in one Prometheus are never summed together: each selector names all three."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for name, label in (("namespace", "namespace"), ("instance", "instance"), ("model", "model_name")):
        assert variables[name]["type"] == "query" and f", {label})" in variables[name]["definition"], name
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    selectors = [m for p in dashboard["panels"] for t in p.get("targets", [])
                 for m in re.finditer(r"\btandem_[a-z0-9_]+(\{[^}]*\})?", t["expr"])]
    assert len(selectors) > 40
    for match in selectors:
        labels = match.group(1) or ""
        for wanted in ('namespace=~"$namespace"', 'instance=~"$instance"', 'model_name=~"$model"'):
            assert wanted in labels, f"{match.group(0)} does not filter by {wanted}"
