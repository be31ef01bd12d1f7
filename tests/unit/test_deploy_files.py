"""deploy/: the Grafana dashboard queries only metrics the gateway serves, and the Prometheus
example scrapes where ``kvturn up`` listens by default."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from kvturn.gateway.metrics import GatewayMetrics
from kvturn.gateway.ops.cli import build_parser
from kvturn.gateway.ops.up import engine_specs

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _served_sample_names() -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names = set()
    for family in GatewayMetrics().registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_metrics_the_gateway_serves() -> None:
    dashboard = json.loads((DEPLOY / "grafana-kvturn.json").read_text())
    served = _served_sample_names()
    used = {name for e in _exprs(dashboard) for name in re.findall(r"\bkvturn_\w+", e)}
    assert used and used <= served, sorted(used - served)
    # The figures the operator view promises: plans, TTFT quantiles, tokens, leases, engines.
    for name in ("kvturn_turns_total", "kvturn_ttft_seconds_bucket", "kvturn_reused_tokens_total",
                 "kvturn_recomputed_tokens_total", "kvturn_live_conversations",
                 "kvturn_decode_leases", "kvturn_upstream_errors_total"):  # fmt: skip
        assert name in used, name
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {i["name"] for i in dashboard["__inputs"]} == {"DS_PROMETHEUS"}
    # No panel hard-codes the plans: a new plan shows up by its label.
    assert not any(re.search(r"plan\s*=", e) for e in _exprs(dashboard))


def test_prometheus_example_scrapes_kvturn_up_defaults() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    args = build_parser().parse_args(["up", "--model", "tiny"])
    gateway = jobs["kvturn-gateway"]
    assert gateway["metrics_path"] == "/metrics"
    assert gateway["static_configs"][0]["targets"] == [f"127.0.0.1:{args.port}"]
    engines = {
        (group["labels"]["role"], target)
        for group in jobs["vllm-engines"]["static_configs"]
        for target in group["targets"]
    }
    specs = engine_specs(args, Path("/model"), "tiny")
    assert engines == {(s.role, f"127.0.0.1:{s.port}") for s in specs}


#: Gauges every gateway replica reports alike: the shared (Redis) table's counts, and each
#: decode's own lease counts, which every replica polls. Summed over replicas they would be
#: multiplied by the number of replicas.
REPLICATED_GAUGES = (
    "kvturn_live_conversations",
    "kvturn_conversations",
    "kvturn_decode_leases",
    "kvturn_decode_lease_blocks",
    "kvturn_decode_lease_events",
)


def test_dashboard_combines_replicated_gauges_with_max() -> None:
    dashboard = json.loads((DEPLOY / "grafana-kvturn.json").read_text())
    seen = set()
    for expr in _exprs(dashboard):
        for name in REPLICATED_GAUGES:
            if re.search(rf"\b{name}\b", expr):
                seen.add(name)
                pattern = rf"^max( by \([a-z, ]+\) )?\((delta\()?{name}\{{"
                assert re.match(pattern, expr), expr
    assert seen == set(REPLICATED_GAUGES)
