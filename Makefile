# Two commands on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# torch is installed on its own and pinned, so that pip never resolves an
# unpinned (multi-GB CUDA) torch. A torch already importable in the venv is kept.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test install clean gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/tierzero demo

# Two workers share the cores for all but the tests timed to the second or measuring peaks
# that hang on the I/O threads' timing (marked serial), which then run alone: 6-7 min on a
# 2-core VM, against 8-10 min in one process.
TEST_WORKERS ?= 2

# A failure in the parallel part still runs the serial part; make fails at the end with the
# first non-zero status (pytest's 5, "no tests collected", included).
test: install
	@parallel=0; serial=0; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" || parallel=$$?; \
	$(BIN)/python -m pytest -q -m serial || serial=$$?; \
	if [ $$parallel -ne 0 ]; then echo "make test: the parallel tests failed (pytest exit $$parallel)"; exit $$parallel; fi; \
	if [ $$serial -ne 0 ]; then echo "make test: the serial tests failed (pytest exit $$serial)"; exit $$serial; fi

# tests/gpu and `bench train --device cuda`, one JSON of results (gpu-check.json); fails
# without CUDA. `make gpu-check DRY_RUN=1` runs the same code on the CPU to check the report.
gpu-check: install
	$(BIN)/tierzero bench gpu-check --out gpu-check.json $(if $(DRY_RUN),--dry-run)

clean:
	rm -rf $(VENV) build *.egg-info
