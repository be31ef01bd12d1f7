"""The Redis conversation table's Lua scripts, as shipped in ``scripts/`` (package data).

One ``.lua`` file per atomic step of the table (see :mod:`.table_redis`); the writes
share the functions of ``make.lua``, prepended to them here. Standard library only: the Redis
client benchmark (``benchmarks/redis_clients.py``) reads the scripts through this module in a
virtualenv without kvturn's dependencies.
"""

from __future__ import annotations

from importlib import resources

#: The scripts, by name (``scripts/{name}.lua``).
NAMES = ("take", "settling", "record", "lookup", "renewed", "remove")
#: Scripts that call the shared functions of ``make.lua`` (``make`` and ``index``).
_USES_MAKE = frozenset({"settling", "record"})


def script(name: str) -> str:
    """The Lua text of the table's script ``name``, ready for ``register_script``."""
    folder = resources.files(__package__) / "scripts"
    text = (folder / f"{name}.lua").read_text()
    return (folder / "make.lua").read_text() + text if name in _USES_MAKE else text
