# The two commands a newcomer needs are `make demo` and `make test`; both set up .venv first.
PY := .venv/bin/python

.PHONY: setup demo test lint typecheck unit bench client-compat client-only gateway-compat resolve-check image-check mutation

setup:
	@scripts/setup.sh

# The example agent `make demo` runs: openai (default), agents or langgraph.
AGENT ?= openai

demo: setup
	$(PY) examples/demo.py --agent $(AGENT)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: setup
	$(PY) -m mypy kvturn

# kvturn.client against the oldest and the newest openai release pyproject.toml admits, each in
# a small venv of its own (.venv-compat-*: no vLLM, no adapters); made once, then reused.
client-compat:
	@scripts/client_compat.sh

# `pip install .` (no extras) in .venv-client-only: the client alone, none of the gateway's
# packages, tests/client passing against it with nothing of kvturn.gateway imported.
client-only:
	@scripts/client_only.sh

# The gateway extra's ranges at both ends (.venv-compat-gateway-*), on the tests using them.
gateway-compat:
	@scripts/gateway_compat.sh

# setup.sh's package set resolves from the registries alone, this machine's wheel folder,
# mirrors and pip configuration hidden (a dry run: metadata only).
resolve-check:
	@scripts/resolve_check.sh

# deploy/Dockerfile's gateway image built with buildah (Debian's package) on a Debian base made
# from Debian's packages, and `kvturn --help` run in it (needs root; says so and skips if not).
image-check:
	@scripts/image_check.sh

# Mutation testing of the planner, the conversation table, validation and auth against the unit
# tests (mutmut; scripts/mutation.sh): fails below a 90% kill rate per module or on a survivor
# not listed in benchmarks/results/mutation.md. Not part of `make test`: a fresh run takes about 11
# minutes on 2 cores; later runs retest only the functions that changed.
mutation: setup
	@scripts/mutation.sh

test: lint typecheck client-compat client-only gateway-compat resolve-check image-check
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/idle_pair.py
