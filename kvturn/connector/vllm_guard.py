"""Imported first by the connector modules, before any of vLLM's: an engine whose vLLM is not
the release the connector was built for stops here, with both versions in the error, instead
of failing later inside vLLM's internals (:mod:`kvturn.connector.vllm_version`)."""

from kvturn.connector.vllm_version import require_built_for_vllm

require_built_for_vllm()
