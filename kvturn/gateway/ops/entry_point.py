"""The ``kvturn`` console script. The command is the gateway's; the base install (``pip install
kvturn``) is the client alone, so the script checks for the ``gateway`` extra's packages before
importing any gateway code, and says what to install instead of failing on an import."""

from __future__ import annotations

import re
import sys
from importlib import metadata

#: The extra whose packages the command needs.
EXTRA = "gateway"


def missing_requirements(distribution: str = "kvturn", extra: str = EXTRA) -> list[str]:
    """The names of ``extra``'s requirements that are not installed (none: unknown extra)."""
    try:
        requirements = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return []
    missing = []
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        if not re.search(rf"""extra\s*==\s*["']{re.escape(extra)}["']""", marker):
            continue
        project = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", name)
        if project is None or project[1] == distribution:
            continue
        try:
            metadata.version(project[1])
        except metadata.PackageNotFoundError:
            missing.append(project[1])
    return missing


def main() -> int:
    missing = missing_requirements()
    if missing:
        print(
            f"kvturn: the kvturn command is the gateway's (serve, up, engine, top), and this "
            f"install has the client only (missing: {', '.join(missing)}). Install the gateway "
            f"with:  pip install 'kvturn[{EXTRA}]'",
            file=sys.stderr,
        )
        return 2
    from kvturn.gateway.ops.cli import main as run

    return run()


if __name__ == "__main__":
    raise SystemExit(main())
