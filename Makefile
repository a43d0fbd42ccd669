# Two commands (see README.md):
#   make quickstart   install quern into .venv and run examples/quickstart.py
#   make test         install quern with test extras into .venv and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install quickstart test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(PY) examples/quickstart.py

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/vs_grain.py
	$(PY) benchmarks/parquet.py
	$(PY) benchmarks/handover.py

clean:
	rm -rf $(VENV) examples/data benchmarks/data
