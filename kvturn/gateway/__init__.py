"""kvturn's gateway: an OpenAI-compatible server in front of vLLM prefill and decode pools.

Its rooms (CONTRIBUTING.md's Layout section has the table): :mod:`.api` (the routes
:func:`.app.create_app` mounts), :mod:`.turns` (one turn, by collaborators), :mod:`.state` (the
conversation table, the implicit index, the Responses store), :mod:`.responses` (the Responses
API), :mod:`.http` (the HTTP/1.1 server and the engine client) and :mod:`.ops` (the operator's
tools, which nothing here imports). Nothing is imported here: ``kvturn.gateway.ops.entry_point``
must be able to say which extra is missing before any of the gateway's dependencies loads.
"""
