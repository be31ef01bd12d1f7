"""``kvturn top``: a live terminal view of a running gateway.

Reads the gateway's Prometheus ``/metrics`` (parsed with ``prometheus_client``'s text parser)
and ``/health`` every ``--interval`` seconds, and ``/kvturn/status`` (a JSON status route)
when the gateway has one; draws, with ``rich``:

- turns by plan (every plan the gateway reports, counted and per second), reuse fallbacks by
  reason, reused vs recomputed prompt tokens;
- TTFT p50/p90 by plan, since the gateway started and over the last interval (estimated from
  the ``kvturn_ttft_seconds`` histogram's buckets, as Prometheus' ``histogram_quantile`` does);
- live conversations; per engine its health and, with the status route, the requests it is
  serving; per decode its leases and leased KV blocks; engine request errors by role;
- the status route's planner settings and learned costs, and whatever else it returns.

``kvturn top --once`` prints one frame and exits (for scripts; ``--interval`` then is the time
between the two scrapes the rates come from).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: The route a gateway may serve its JSON status on.
STATUS_PATH = "/kvturn/status"
#: Plans drawn first, in this order; any other plan the gateway reports follows them.
KNOWN_PLANS = ("recompute", "pull-reuse", "decode-local")


@dataclass
class Histogram:
    """One label set of a Prometheus histogram: cumulative bucket counts by upper bound."""

    buckets: dict[float, float] = field(default_factory=dict)
    count: float = 0.0
    sum: float = 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        """What was observed after ``earlier``."""
        if earlier is None:
            return self
        return Histogram(
            {le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()},
            self.count - earlier.count,
            self.sum - earlier.sum,
        )

    def quantile(self, q: float) -> float | None:
        """``q``-quantile by linear interpolation in its bucket; ``None`` with no samples."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le in sorted(self.buckets):
            cumulative = self.buckets[le]
            if cumulative >= rank:
                if math.isinf(le):
                    return lower  # past the last finite bound: that bound is all we know
                inside = cumulative - below
                return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = le, cumulative
        return lower


@dataclass
class Snapshot:
    """The figures ``kvturn top`` draws, from one scrape."""

    at: float
    turns: dict[str, float] = field(default_factory=dict)
    fallbacks: dict[str, float] = field(default_factory=dict)
    reused_tokens: float = 0.0
    recomputed_tokens: float = 0.0
    ttft: dict[str, Histogram] = field(default_factory=dict)
    live_conversations: float | None = None
    conversations: float | None = None
    decode_leases: dict[str, float] = field(default_factory=dict)
    decode_lease_blocks: dict[str, float] = field(default_factory=dict)
    upstream_errors: dict[str, float] = field(default_factory=dict)
    heartbeats: float = 0.0
    releases: float = 0.0
    #: ``/health``: engine URL → healthy, by role; empty if it did not answer.
    health: dict[str, dict[str, bool]] = field(default_factory=dict)
    #: ``/health``'s engines that are draining (answering, taking no new turns).
    draining: set[str] = field(default_factory=set)
    #: ``/kvturn/status``'s JSON, when the gateway serves it.
    status: Any = None

    @classmethod
    def parse(cls, metrics_text: str, at: float | None = None) -> Snapshot:
        snap = cls(time.monotonic() if at is None else at)
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                name, labels, value = sample.name, sample.labels, float(sample.value)
                snap._take(name, labels, value)
        return snap

    def _take(self, name: str, labels: Mapping[str, str], value: float) -> None:
        if name == "kvturn_turns_total":
            self.turns[labels.get("plan", "?")] = value
        elif name == "kvturn_reuse_fallbacks_total":
            self.fallbacks[labels.get("reason", "?")] = value
        elif name == "kvturn_reused_tokens_total":
            self.reused_tokens = value
        elif name == "kvturn_recomputed_tokens_total":
            self.recomputed_tokens = value
        elif name.startswith("kvturn_ttft_seconds_"):
            histogram = self.ttft.setdefault(labels.get("plan", "?"), Histogram())
            if name.endswith("_bucket"):
                histogram.buckets[float(labels["le"])] = value
            elif name.endswith("_count"):
                histogram.count = value
            elif name.endswith("_sum"):
                histogram.sum = value
        elif name == "kvturn_live_conversations":
            self.live_conversations = value
        elif name == "kvturn_conversations":
            self.conversations = value
        elif name == "kvturn_decode_leases":
            self.decode_leases[labels.get("decode", "?")] = value
        elif name == "kvturn_decode_lease_blocks":
            self.decode_lease_blocks[labels.get("decode", "?")] = value
        elif name == "kvturn_upstream_errors_total":
            self.upstream_errors[labels.get("role", "?")] = value
        elif name == "kvturn_heartbeats_total":
            self.heartbeats = value
        elif name == "kvturn_releases_total":
            self.releases = value

    def in_flight(self) -> dict[str, float]:
        """Requests each engine is serving now (the status route's ``engines``), by URL."""
        engines = self.status.get("engines") if isinstance(self.status, Mapping) else None
        if not isinstance(engines, list):
            return {}
        return {
            str(e["url"]): float(e["in_flight"])
            for e in engines
            if isinstance(e, Mapping) and "url" in e and isinstance(e.get("in_flight"), int | float)
        }

    def plans(self) -> list[str]:
        """Every plan seen, the known ones first (a gateway may add plans)."""
        seen = set(self.turns) | set(self.ttft)
        return [p for p in KNOWN_PLANS if p in seen] + sorted(seen - set(KNOWN_PLANS))


class Source:
    """Scrapes one gateway: ``/metrics``, ``/health``, and the status route if it answers."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 5.0) -> None:
        base = url.rstrip("/")
        self.url = base[: -len("/v1")] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        #: False once the status route answered 404/405: not asked again.
        self.status_route = True

    def scrape(self) -> Snapshot:
        response = self.http.get("/metrics")
        response.raise_for_status()
        snap = Snapshot.parse(response.text)
        try:
            health = self.http.get("/health").json()
            snap.health = {
                role: {str(k): bool(v) for k, v in health.get(role, {}).items()}
                for role in ("prefill", "decode")
            }
            snap.draining = {str(url) for url in health.get("draining") or ()}
        except (httpx.HTTPError, ValueError, AttributeError, TypeError):
            snap.health = {}
        if self.status_route:
            try:
                status = self.http.get(STATUS_PATH)
                if status.status_code in (404, 405):
                    self.status_route = False
                elif status.status_code == 200:
                    snap.status = status.json()
            except (httpx.HTTPError, ValueError):
                pass
        return snap

    def close(self) -> None:
        self.http.close()


# -- drawing -------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


def _rate(now: float, before: float | None, seconds: float) -> str:
    if before is None or seconds <= 0:
        return "-"
    return f"{max(0.0, now - before) / seconds:,.2f}/s"


def _short(url: str) -> str:
    return url.removeprefix("http://").removeprefix("https://")


def view(snap: Snapshot, previous: Snapshot | None, source: str = "") -> Any:
    """The frame for ``snap`` (rates and recent TTFT against ``previous``), as a rich renderable."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    seconds = snap.at - previous.at if previous is not None else 0.0
    total_turns = sum(snap.turns.values())
    header = Text.assemble(
        ("kvturn top ", "bold"),
        (source, "cyan"),
        f"   turns {total_turns:,.0f}",
        f"   live conversations {_num(snap.live_conversations)}",
        f" (in table {_num(snap.conversations)})",
        f"   heartbeats {snap.heartbeats:,.0f}   releases {snap.releases:,.0f}",
    )

    plans = Table(title="turns by plan", expand=True)
    for column in ("plan", "turns", "share", "rate", "TTFT p50", "TTFT p90", "recent p50",
                   "recent p90"):  # fmt: skip
        plans.add_column(column, justify="left" if column == "plan" else "right")
    for plan in snap.plans():
        count = snap.turns.get(plan, 0.0)
        histogram = snap.ttft.get(plan, Histogram())
        before = previous.ttft.get(plan) if previous is not None else None
        recent = histogram.minus(before) if previous is not None else Histogram()
        plans.add_row(
            plan,
            f"{count:,.0f}",
            f"{100 * count / total_turns:.0f}%" if total_turns else "-",
            _rate(count, previous.turns.get(plan, 0.0) if previous else None, seconds),
            _ms(histogram.quantile(0.5)),
            _ms(histogram.quantile(0.9)),
            _ms(recent.quantile(0.5)),
            _ms(recent.quantile(0.9)),
        )

    tokens = Table(title="prompt tokens", expand=True)
    tokens.add_column("")
    tokens.add_column("total", justify="right")
    tokens.add_column("share", justify="right")
    tokens.add_column("rate", justify="right")
    both = snap.reused_tokens + snap.recomputed_tokens
    for name, value, earlier in (
        ("reused", snap.reused_tokens, previous.reused_tokens if previous else None),
        ("recomputed", snap.recomputed_tokens, previous.recomputed_tokens if previous else None),
    ):
        share = f"{100 * value / both:.0f}%" if both else "-"
        tokens.add_row(name, f"{value:,.0f}", share, _rate(value, earlier, seconds))
    fallbacks = Table(title="reuse fallbacks", expand=True)
    fallbacks.add_column("reason")
    fallbacks.add_column("turns", justify="right")
    for reason, value in sorted(snap.fallbacks.items(), key=lambda kv: -kv[1]):
        fallbacks.add_row(reason, f"{value:,.0f}")
    if not snap.fallbacks:
        fallbacks.add_row("(none)", "0")

    engines = Table(title="engines", expand=True)
    for column in ("role", "engine", "health", "in flight", "leases", "leased blocks"):
        engines.add_column(column, justify="left" if column in ("role", "engine") else "right")
    in_flight = snap.in_flight()
    decodes = list(dict.fromkeys([*snap.health.get("decode", {}), *snap.decode_leases]))
    for role, urls in (("prefill", list(snap.health.get("prefill", {}))), ("decode", decodes)):
        for url in urls:
            healthy = snap.health.get(role, {}).get(url)
            mark = {True: "[green]up[/]", False: "[red]DOWN[/]", None: "?"}[healthy]
            if healthy and url in snap.draining:
                mark = "[yellow]draining[/]"
            leases = _num(snap.decode_leases.get(url)) if role == "decode" else ""
            blocks = _num(snap.decode_lease_blocks.get(url)) if role == "decode" else ""
            busy = _num(in_flight.get(url)) if in_flight else "-"
            engines.add_row(role, _short(url), mark, busy, leases, blocks)
    errors = ", ".join(f"{role} {n:,.0f}" for role, n in sorted(snap.upstream_errors.items()))
    if errors:
        engines.caption = f"engine request errors: {errors}"

    parts: list[Any] = [header, plans, _side_by_side(tokens, fallbacks), engines]
    if snap.status is not None:
        parts.append(Panel(_status_view(snap.status), title=f"status ({STATUS_PATH})"))
    return Group(*parts)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _side_by_side(*tables: Any) -> Any:
    from rich.columns import Columns

    return Columns(tables, expand=True, equal=True)


#: Status fields drawn elsewhere (the engines table) or by their own table here.
_STATUS_SHOWN = {"engines", "costs"}


def _status_view(status: Any) -> Any:
    """The status route's JSON: the planner's learned costs as a table, other objects as
    tables or key/value lines (fields this view does not know are drawn too, generically)."""
    from rich.console import Group
    from rich.table import Table

    if not isinstance(status, Mapping):
        return _cell(status)
    scalars = Table.grid(padding=(0, 2))
    scalars.add_column(style="bold")
    scalars.add_column()
    parts: list[Any] = [scalars]
    costs = status.get("costs")
    if isinstance(costs, Mapping):
        parts.append(_costs_table(costs))
    for key, value in status.items():
        if key in _STATUS_SHOWN:
            continue
        rows = value if isinstance(value, list) else None
        if (
            isinstance(value, Mapping)
            and value
            and all(isinstance(v, Mapping) for v in value.values())
        ):
            rows = [{"": k, **v} for k, v in value.items()]
        if rows and all(isinstance(r, Mapping) for r in rows):
            columns = list(dict.fromkeys(k for r in rows for k in r))
            table = Table(title=f"{key} ({len(rows)})", expand=True)
            for column in columns:
                table.add_column(str(column))
            for row in rows[:20]:
                table.add_row(*(_cell(row.get(c)) for c in columns))
            if len(rows) > 20:
                table.caption = f"{len(rows) - 20} more"
            parts.append(table)
        else:
            scalars.add_row(str(key), _cell(value))
    return Group(*parts)


def _costs_table(costs: Mapping[str, Any]) -> Any:
    """``{"pull": fit, "prefill": {url: fit}, ...}`` (a fit: ``fixed_ms``,
    ``per_1k_tokens_ms``, ``observations``) as one row per path and engine."""
    from rich.table import Table

    table = Table(title="planner's learned costs", expand=True)
    for column in ("path", "engine", "fixed", "per 1k tokens", "observations"):
        table.add_column(column, justify="left" if column in ("path", "engine") else "right")

    def add(path: str, engine: str, fit: Mapping[str, Any]) -> None:
        fixed, per_1k = fit.get("fixed_ms"), fit.get("per_1k_tokens_ms")
        table.add_row(
            path,
            engine,
            "-" if fixed is None else f"{fixed:,.1f} ms",
            "-" if per_1k is None else f"{per_1k:,.1f} ms",
            _cell(fit.get("observations")),
        )

    for path, value in costs.items():
        if not isinstance(value, Mapping):
            table.add_row(path, "", _cell(value), "", "")
        elif "fixed_ms" in value or "per_1k_tokens_ms" in value:
            add(path, "", value)
        else:
            for engine, fit in value.items():
                add(path, _short(str(engine)), fit if isinstance(fit, Mapping) else {})
    return table


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".")
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    return "-" if value is None else str(value)


# -- the command ---------------------------------------------------------------------------


def run(url: str, interval_s: float, once: bool, api_key: str | None, console: Any = None) -> int:
    """Draw the gateway at ``url`` every ``interval_s`` seconds until interrupted (a gateway
    that does not answer is waited for), or one frame with ``once``."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = console or Console()
    source = Source(url, api_key)
    try:
        if once:
            first = source.scrape()
            time.sleep(interval_s)
            console.print(view(source.scrape(), first, source.url))
            return 0
        previous: Snapshot | None = None
        waiting = Text(f"kvturn top: waiting for {source.url}")
        with Live(waiting, console=console, auto_refresh=False) as live:
            while True:
                try:
                    snap = source.scrape()
                except httpx.HTTPError as error:
                    live.update(Text(f"kvturn top: {source.url}: {error} (retrying)"), refresh=True)
                else:
                    live.update(view(snap, previous, source.url), refresh=True)
                    previous = snap
                time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0
    except httpx.HTTPError as error:
        console.print(f"kvturn top: {source.url}: {error}")
        return 1
    finally:
        source.close()


def cmd_top(args: argparse.Namespace) -> int:
    return run(args.url, args.interval, args.once, args.api_key)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``kvturn top`` on the CLI's subcommands."""
    top = sub.add_parser("top", help="live view of a running gateway (metrics, leases, engines)")
    top.add_argument(
        "--url",
        default=os.environ.get("KVTURN_URL", "http://127.0.0.1:8000"),
        help="the gateway (its root or its /v1 base URL; default $KVTURN_URL or :8000)",
    )
    top.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument(
        "--api-key",
        default=os.environ.get("KVTURN_API_KEY"),
        help="a key of the gateway's, for /kvturn/status: an operator key where it has them "
        "(default $KVTURN_API_KEY)",
    )
    top.set_defaults(func=cmd_top)
