# One command each: `make serve` sets up and serves the default model; `make test` sets up and
# runs the CPU test suite (what CI runs).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup serve test test-slow gpu-test

# A line per stage, and pip's own progress (the first setup downloads ~1 GB: about 3 minutes).
$(BIN)/mtpserve: pyproject.toml
	@echo "setup 1/4: a virtualenv in $(VENV)"
	$(PY) -m venv $(VENV)
	@echo "setup 2/4: the latest pip"
	$(BIN)/pip install --upgrade pip
	@echo "setup 3/4: torch (the CPU build first, so nothing below pulls a CUDA build)"
	$(BIN)/pip install "torch==2.13.0"
	@echo "setup 4/4: mtpserve and its dependencies, editable, with the test tools"
	$(BIN)/pip install -e ".[test]"
	touch $(BIN)/mtpserve
	@echo "setup done: $(BIN)/mtpserve"

setup: $(BIN)/mtpserve

serve: setup
	@echo "starting: mtpserve serve (the URL is printed once the model is loaded and warm)"
	$(BIN)/mtpserve serve

# Run again where Triton cannot be imported, as on macOS and Windows (no Triton builds there).
NO_TRITON_TESTS := tests/test_no_triton.py tests/deploy/test_cli.py tests/deploy/test_serve_cli.py \
	tests/deploy/test_batch_job.py tests/parallel/test_tp_greedy.py

test: setup
	RAY_AUTH_MODE=disabled TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not gpu and not slow" tests
	PYTHONPATH=.ci/no-triton RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q -m no_triton \
		$(NO_TRITON_TESTS)

# The longer CPU tiers (e.g. 44 more configs of the config family, ~1.5 min on 2 cores).
test-slow: setup
	RAY_AUTH_MODE=disabled TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m slow tests

gpu-test:
	python3 -m pytest -q -m gpu tests
