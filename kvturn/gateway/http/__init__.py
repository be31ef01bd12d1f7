"""The gateway's HTTP plumbing, at the edge: its HTTP/1.1 server (:mod:`.server`, serving any
ASGI app), its small HTTP/1.1 client (:mod:`.client`, its connections in :mod:`.pool`) and the
JSON engine client on top of it (:mod:`.upstream`). Nothing here reads the gateway's
configuration or state: limits and timeouts come in as arguments."""
