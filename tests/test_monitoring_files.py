"""The monitoring that docker-compose.yml provisions: Prometheus scrapes what
the services serve, Grafana finds its data source and dashboard, the alert
names a metric we export. (Which names we export: tests/test_metrics.py
checks every name these files use against real scrapes.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
_METRIC = re.compile(r"\b((?:roundtable|temporal)_[a-z_]+)\b")


def monitoring_expressions() -> list[str]:
    """Every PromQL expression the dashboard and the alert rules hold."""
    dashboard = json.loads((DEPLOY / "grafana/dashboards/roundtable.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    rules = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    exprs += [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    return exprs


def metric_names() -> set[str]:
    return {name for expr in monitoring_expressions() for name in _METRIC.findall(expr)}


def _mounts(service: str) -> dict[str, str]:
    """Container path → host path (relative to the repository) of bind mounts."""
    pairs = (v.split(":")[:2] for v in SERVICES[service]["volumes"] if v.startswith("./"))
    return {inside: outside for outside, inside in pairs}


def worker_services() -> dict[str, dict]:
    """Every service that runs `roundtable worker`, whatever its role."""
    return {
        name: service
        for name, service in SERVICES.items()
        if service.get("command", [])[:2] == ["roundtable", "worker"]
    }


def test_prometheus_scrapes_every_worker_replica_and_the_api_where_they_listen() -> None:
    mounts = _mounts("prometheus")
    config_dir = ROOT / mounts["/etc/prometheus"]
    config = yaml.safe_load((config_dir / "prometheus.yml").read_text())
    command = " ".join(SERVICES["prometheus"]["command"])
    assert "--config.file=/etc/prometheus/prometheus.yml" in command
    for rule_file in config["rule_files"]:
        assert (config_dir / Path(rule_file).relative_to("/etc/prometheus")).is_file()
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}

    # Replicas share a service name and have no fixed address: Prometheus
    # finds each by DNS (one A record per replica), for every worker
    # service and nothing else.
    workers = worker_services()
    assert {"worker-workflows", "worker-tools"} <= set(workers)
    assert "static_configs" not in jobs["roundtable-worker"]
    (discovery,) = jobs["roundtable-worker"]["dns_sd_configs"]
    assert discovery["type"] == "A"
    assert sorted(discovery["names"]) == sorted(workers)
    for name, service in workers.items():
        assert service["deploy"]["replicas"] >= 2, name
        host, _, port = service["environment"]["ROUNDTABLE_WORKER_METRICS_ADDRESS"].rpartition(":")
        # Bound to every interface of its container: loopback would be
        # unreachable from Prometheus's.
        assert host == "0.0.0.0", name  # noqa: S104 (compared, nothing bound)
        assert int(port) == discovery["port"] and port in service["expose"], name
        assert "ports" not in service, name  # replicas would fight over a host port
        assert name in SERVICES["prometheus"]["depends_on"], name

    (static,) = jobs["roundtable-api"]["static_configs"]
    api_port = SERVICES["api"]["command"][SERVICES["api"]["command"].index("--port") + 1]
    assert static["targets"] == [f"api:{api_port}"]
    # Prometheus sends no token: the API must be told to serve /metrics without one.
    assert SERVICES["api"]["environment"]["ROUNDTABLE_API_METRICS_PUBLIC"] == "true"


def test_grafana_is_provisioned_with_the_data_source_and_the_dashboard() -> None:
    mounts = _mounts("grafana")
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in SERVICES
    (provider,) = yaml.safe_load((provisioning / "dashboards/roundtable.yml").read_text())[
        "providers"
    ]
    dashboards = ROOT / mounts[provider["options"]["path"]]
    dashboard = json.loads((dashboards / "roundtable.json").read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for subject in ("status", "pending", "unknown", "approval wait", "tool", "temporal task"):
        assert subject in titles, subject


def test_the_alert_fires_on_any_unknown_action() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    by_name = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert by_name["RoundtableUnknownActions"]["expr"] == "max(roundtable_unknown_actions) > 0"
    assert metric_names() >= {"roundtable_unknown_actions", "roundtable_approvals_pending"}
