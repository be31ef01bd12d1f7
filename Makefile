# The two commands a newcomer needs are `make demo` and `make test`; both set up .venv first.
PY := .venv/bin/python

.PHONY: setup demo test lint typecheck unit bench client-compat

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
	$(PY) -m mypy kvturn client gateway connector

# kvturn.client against the oldest and the newest openai release pyproject.toml admits, each in
# a small venv of its own (.venv-compat-*: no vLLM, no adapters); made once, then reused.
client-compat:
	@scripts/client_compat.sh

test: lint typecheck client-compat
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/idle_pair.py
