# `make demo` and `make test` work on a fresh machine with Python 3 and make: each creates .venv if
# needed, installs what it needs once (stamp files make the second run fast), then does its job.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The torch release the project is tested with; on Linux/x86_64 pip may pick a CUDA build of
# several GB from PyPI. Override with e.g. `make test TORCH_SPEC='torch>=2.6'`.
TORCH_SPEC ?= torch==2.13.0
# Test files run in parallel (pytest-xdist; a file's tests stay in one worker so its module fixtures
# are built once); the slowest tests are printed at the end. One worker more than the cores: part of
# the time a worker only waits on its child processes (torchrun ranks, vLLM's engine, the external
# venvs' interpreters), and the extra worker fills it (measured on 2 cores: 2 workers kept 1.66 cores
# busy, 12 min 13 s; 3 workers 1.95 cores, 10 min 22 s).
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print((os.cpu_count() or 1) + 1)")

.PHONY: demo test docs docs-serve clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

# The loss's Triton kernel is tested on the CPU under Triton's interpreter (tests/test_loss_triton.py).
# PyPI's CUDA torch wheels bring their own triton; the +cpu wheel does not: install the tested release
# only where none imports. Where it cannot be installed the tests say so and are skipped.
$(VENV)/.triton: $(VENV)/.torch
	$(PY) -c "import triton, numpy" 2>/dev/null || $(PY) -m pip install --quiet "triton==3.7.1" numpy || \
		echo "make: triton could not be installed here; tests/test_loss_triton.py will be skipped"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/dflash-train demo

test: $(VENV)/.installed-test $(VENV)/.triton
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/lint-imports
	@# Where PYTHONDONTWRITEBYTECODE is set (these machines), no process writes bytecode, so every Python
	@# process the suite starts compiled the package's modules again (0.24 CPU-s per start, measured):
	@# compile them once here, before the parallel run (pip already compiled everything it installed).
	$(PY) -m compileall -q src/dflash_trainer tests > /dev/null
	@# pytest's assertion rewriting of the test files is bytecode too, which it caches only where it may
	@# write bytecode: with the variable set, each xdist worker rewrote every test file at collection, in
	@# every run (8.6 CPU-s of collection against 5.6 with the cache, measured). The suite runs with it
	@# unset, so pytest keeps its cache (and a process the suite starts may write bytecode too).
	PYTHONDONTWRITEBYTECODE= DFLASH_TEST_CPU_REPORT=$(VENV)/test-cpu.jsonl \
		$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# The docs site (mkdocs.yml): strict, so a broken link fails; tests/test_docs.py builds it in `make test` too.
$(VENV)/.installed-docs: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $@

docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) runs build site src/*.egg-info
