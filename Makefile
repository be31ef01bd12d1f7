# The two commands a newcomer needs are `make demo` and `make test`; both set up .venv first.
PY := .venv/bin/python

.PHONY: setup demo test lint typecheck unit bench

setup:
	@scripts/setup.sh

demo: setup
	$(PY) examples/demo.py

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: setup
	$(PY) -m mypy kvturn client gateway connector

test: lint typecheck
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/idle_pair.py
