"""The ``kvturn`` command: ``up`` (local engines and gateway), ``serve`` (the gateway in front
of running engines), ``engine`` (one engine on a host of a deployment), ``models`` (build local
models), ``top`` (watch a gateway)."""

from __future__ import annotations

import argparse

from kvturn.gateway.ops import engine, models, serve, top, up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvturn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (up, serve, engine, models, top):  # each module adds its own parser
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
