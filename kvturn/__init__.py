"""kvturn: keep an agent conversation's KV cache alive between turns.

This package is the wire contract shared by ``kvturn.client``, ``kvturn.gateway`` and
``kvturn.connector``: header names, control-API models and the ``kv_transfer_params``
model. It depends on the standard library and pydantic only.
"""

from kvturn._version import __version__

__all__ = ["__version__"]
