"""kvturn.client stands on the openai SDK's public surface only: an AST scan of ``client/``.

No module or name whose name starts with ``_`` is imported from openai, httpx or httpx2, and no
such attribute is read from them; the client classes (and their mixins), which *are* SDK
objects, neither override nor read the SDK's private methods and state; no private name that
the SDK's own code uses (``_list``, ``_client``, ``_decoder``, ...) is read from any object
that is not kvturn's own ``self``; no bytecode is read, no class swapped, no method replaced on
an object at run time, no attribute set by name. The scan is tested against a snippet of each
kind of breach, so a rule that stops catching anything fails here too.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
from collections.abc import Mapping

import pytest

import kvturn.client

CLIENT_DIR = pathlib.Path(kvturn.client.__file__).parent
SDK_PACKAGES = ("openai", "httpx", "httpx2")
#: Attributes that read code objects or globals: never needed to use an SDK.
CODE_ATTRIBUTES = frozenset({"__code__", "co_names", "co_code", "co_consts", "__globals__"})
#: Attributes whose assignment swaps a class or replaces a method at run time.
REPLACED_ATTRIBUTES = frozenset(
    {"__class__", "__init__", "__new__", "close", "aclose", "read", "aread", "send", "request"}
)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _kvturn_own(name: str) -> bool:
    # What kvturn adds to the SDK's client classes is named so.
    return name.startswith("_kvturn")


@functools.cache
def sdk_private_names() -> frozenset[str]:
    """Every private name the installed SDK packages define or read (their pydantic models
    under ``types/`` aside)."""
    names: set[str] = set()
    for package in SDK_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            continue
        root = pathlib.Path(spec.origin).parent
        for path in root.rglob("*.py"):
            if "types" in path.relative_to(root).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    name = node.name
                elif isinstance(node, ast.Attribute):
                    name = node.attr
                else:
                    continue
                if _private(name):
                    names.add(name)
    return frozenset(names)


def _root(expr: ast.expr) -> str | None:
    """The name an expression such as ``a.b[c].d()`` starts from."""
    while isinstance(expr, ast.Attribute | ast.Subscript | ast.Call):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _is_self(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in ("self", "cls")
    return (
        isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "super"
    )


def _sdk_imports(tree: ast.Module, where: str, breaches: list[str]) -> set[str]:
    """The names a module binds to SDK modules or objects; private imports go to ``breaches``."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in SDK_PACKAGES:
                    if any(map(_private, parts)):
                        breaches.append(f"{where}:{node.lineno}: imports {alias.name}")
                    bound.add(alias.asname or parts[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] not in SDK_PACKAGES:
                continue
            for alias in node.names:
                if any(map(_private, parts)) or _private(alias.name):
                    breaches.append(f"{where}:{node.lineno}: imports {node.module}.{alias.name}")
                bound.add(alias.asname or alias.name)
    return bound


class _Scan(ast.NodeVisitor):
    def __init__(
        self, where: str, sdk_names: set[str], sdk_classes: set[str], breaches: list[str]
    ) -> None:
        self.where = where
        self.sdk_names = sdk_names
        self.sdk_classes = sdk_classes
        self.breaches = breaches
        self.classes: list[str] = []

    def breach(self, node: ast.AST, what: str) -> None:
        self.breaches.append(f"{self.where}:{getattr(node, 'lineno', 0)}: {what}")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if node.name in self.sdk_classes:
            for item in node.body:
                is_method = isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                if is_method and _private(item.name) and not _kvturn_own(item.name):
                    self.breach(item, f"overrides the SDK's private method {item.name}")
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attr, base = node.attr, node.value
        if attr in CODE_ATTRIBUTES:
            self.breach(node, f"reads {attr}")
        if attr == "__new__" and _root(base) == "object":
            self.breach(node, "makes an object without its __init__")
        if _private(attr) and not _kvturn_own(attr):
            in_sdk_class = bool(self.classes) and self.classes[-1] in self.sdk_classes
            if _root(base) in self.sdk_names:
                self.breach(node, f"reads the SDK's private {attr}")
            elif _is_self(base) and in_sdk_class:
                self.breach(node, f"reads the SDK client's private {attr} through self")
            elif not _is_self(base) and attr in sdk_private_names():
                self.breach(node, f"reads {attr}, a private name of the SDK, on another object")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr"):
            self.breach(node, f"{func.id}() on an object")
        if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) > 1:
            name = node.args[1]
            value = name.value if isinstance(name, ast.Constant) else None
            if isinstance(value, str) and _private(value) and not _kvturn_own(value):
                self.breach(node, f"{func.id}() of the private {value}")
        self.generic_visit(node)

    def _assigned(self, targets: list[ast.expr]) -> None:
        for target in targets:
            for node in ast.walk(target):
                if not isinstance(node, ast.Attribute):
                    continue
                if node.attr in REPLACED_ATTRIBUTES:
                    self.breach(node, f"replaces {node.attr} at run time")
                elif _root(node.value) in self.sdk_names:
                    self.breach(node, f"patches {node.attr} onto the SDK")

    def visit_Assign(self, node: ast.Assign) -> None:
        self._assigned(node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._assigned([node.target])
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._assigned([node.target])
        self.generic_visit(node)


def breaches(sources: Mapping[str, str]) -> list[str]:
    """What in ``sources`` (file name -> Python text) goes beyond the SDK's public surface."""
    found: list[str] = []
    trees = {where: ast.parse(text) for where, text in sources.items()}
    sdk_names = {where: _sdk_imports(tree, where, found) for where, tree in trees.items()}
    classes = {
        node.name: (where, node)
        for where, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    # Classes derived from the SDK's, then (to a fixed point) the classes of ours they derive
    # from: a mixin's ``self`` is an SDK object as well.
    sdk_classes = {
        name
        for name, (where, node) in classes.items()
        if any(_root(base) in sdk_names[where] for base in node.bases)
    }
    while True:
        mixins = {
            base.id
            for name in sdk_classes
            for base in classes[name][1].bases
            if isinstance(base, ast.Name) and base.id in classes
        }
        if mixins <= sdk_classes:
            break
        sdk_classes |= mixins
    for where, tree in trees.items():
        _Scan(where, sdk_names[where], sdk_classes, found).visit(tree)
    return found


def test_the_client_uses_only_the_sdks_public_surface() -> None:
    sources = {
        str(path.relative_to(CLIENT_DIR)): path.read_text(encoding="utf-8")
        for path in sorted(CLIENT_DIR.rglob("*.py"))
    }
    assert len(sources) > 10
    assert breaches(sources) == []


@pytest.mark.parametrize(
    "snippet",
    [
        "from openai._models import FinalRequestOptions",
        "import openai._base_client",
        "from openai import _legacy_response",
        "import httpx2\nheaders = httpx2.Headers._list",
        "import openai\nclass C(openai.OpenAI):\n    def _send_request(self, r): ...",
        "import openai\nclass C(openai.OpenAI):\n    def f(self):\n        return self._client",
        "import openai\nclass M:\n    def f(self):\n        return self._custom_headers\n"
        "class C(M, openai.AsyncOpenAI): ...",
        "import openai\nclass C(openai.OpenAI):\n    def f(self):\n"
        "        return super()._build_request",
        "def f(headers):\n    return headers._list",
        "def f(client):\n    return client._client",
        "def f(response, hook):\n    response.close = hook",
        "def f(stream, cls):\n    stream.__class__ = cls",
        "def f(function):\n    return function.__code__.co_names",
        "def f(x):\n    return getattr(x, '_encoding')",
        "def f(x, value):\n    setattr(x, 'stream', value)",
        "import openai\nopenai.OpenAI.request = print",
        "def f(cls):\n    return object.__new__(cls)",
    ],
)
def test_the_scan_catches_each_kind_of_breach(snippet: str) -> None:
    assert breaches({"bad.py": snippet}) != []


def test_the_scan_lets_kvturns_own_names_and_public_ones_pass() -> None:
    snippet = (
        "import openai\n"
        "class C(openai.OpenAI):\n"
        "    def _kvturn_send(self):\n"
        "        return self._kvturn, self.with_options(timeout=1.0), super().copy()\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._lock = None\n"
        "    def f(self, response):\n"
        "        response.stream = self._lock\n"
        "        return openai.DefaultHttpxClient, response.headers\n"
    )
    assert breaches({"good.py": snippet}) == []
