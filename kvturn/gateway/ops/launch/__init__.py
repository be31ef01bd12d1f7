"""Starting engines on this machine (``kvturn up``, the tests): the vLLM engine processes with
kvturn's connector, and the local models they serve. Not on any request's path."""
