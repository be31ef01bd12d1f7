"""``kvturn models`` (build kvturn's local models), and what a ``--model`` argument names: one
of those models or a model directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvturn.gateway.ops.launch.local_models import MODEL_NAMES, ensure_model


def resolve_model(name_or_path: str) -> tuple[Path, str]:
    """A ``--model`` argument as (the model's directory, the name it is served as): one of
    kvturn's local models (built on first use) or a model directory."""
    if name_or_path in MODEL_NAMES:
        print(
            f"kvturn: preparing local model {name_or_path!r} (built once, then cached)",
            file=sys.stderr,
            flush=True,
        )
        return ensure_model(name_or_path), name_or_path
    path = Path(name_or_path)
    if not (path / "config.json").exists():
        raise SystemExit(
            f"kvturn: {name_or_path!r} is neither a local model name "
            f"({', '.join(MODEL_NAMES)}) nor a model directory with config.json"
        )
    return path, path.name


def cmd_models(args: argparse.Namespace) -> int:
    for name in args.names or MODEL_NAMES:
        if name not in MODEL_NAMES:
            raise SystemExit(
                f"kvturn: unknown model {name!r}; choose from {', '.join(MODEL_NAMES)}"
            )
        print(f"{name}: {ensure_model(name)}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``kvturn models``."""
    models = sub.add_parser("models", help="build the local models (tiny, smollm2)")
    models.add_argument("names", nargs="*", help=f"any of {', '.join(MODEL_NAMES)} (default all)")
    models.set_defaults(func=cmd_models)
