# Convenience only: the README's two commands are scripts/demo and scripts/test (no make needed).
.PHONY: setup demo test bench

setup:
	@bash scripts/setup.sh

demo:
	@scripts/demo

test:
	@scripts/test $(PYTEST_ARGS)

bench:
	@scripts/bench
