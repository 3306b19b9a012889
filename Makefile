# The two commands in README.md: `make demo` and `make test`. Both set up first.
.PHONY: setup demo test bench

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/python examples/demo.py

test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: setup
	@for b in bench/*.py; do echo "== $$b"; .venv/bin/python $$b || exit 1; done
