"""Run every query of ``grafana-kvturn.json`` against a Prometheus that scrapes a kvturn gateway.

    python deploy/check_dashboard.py --prometheus http://127.0.0.1:9090

Each panel's PromQL goes to Prometheus' HTTP API (``/api/v1/query``) with Grafana's variables
filled in (``$__rate_interval`` → ``--rate-interval``, ``$job`` → ``.*``); prints how many
series each returned. Exits 1 if Prometheus rejected a query, or (``--require-data``) if a
query of a panel listed there returned nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).with_name("grafana-kvturn.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--rate-interval", default="1m")
    parser.add_argument(
        "--require-data", nargs="*", default=[], help="panel titles that must return series"
    )
    args = parser.parse_args()
    dashboard = json.loads(DASHBOARD.read_text())
    failed = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            query = (
                target["expr"]
                .replace("$__rate_interval", args.rate_interval)
                .replace("$__range", "1h")
                .replace('"$job"', '".*"')
            )
            answer = httpx.get(
                f"{args.prometheus}/api/v1/query", params={"query": query}, timeout=30
            ).json()
            if answer.get("status") != "success":
                print(f"ERROR  {panel['title']}: {answer.get('error')}\n       {query}")
                failed += 1
                continue
            series = answer["data"]["result"]
            print(f"{len(series):>5}  {panel['title']}: {query}")
            if not series and panel["title"] in args.require_data:
                print(f"ERROR  {panel['title']}: no data")
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
