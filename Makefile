# Two commands (see README.md):
#   make quickstart   install quern into .venv and run examples/quickstart.py
#   make test         install quern with test extras into .venv; lint (ruff), type-check (mypy), run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install quickstart lint typecheck test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# An editable install writes no bytecode, and with PYTHONDONTWRITEBYTECODE set nothing ever
# does: every process (each fork server included) would compile quern again. Compile it here.
install: $(VENV)/.installed
	$(PY) -m compileall -q __init__.py pipeline sharding transforms prepare

quickstart: install
	$(PY) examples/quickstart.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy checks the package by its name, quern, which is this folder: a link named quern points here
typecheck: install
	mkdir -p $(VENV)/typecheck
	ln -sfn $(CURDIR) $(VENV)/typecheck/quern
	cd $(VENV)/typecheck && MYPYPATH=. $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p quern

test: install lint typecheck
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/vs_grain.py
	$(PY) benchmarks/parquet.py
	$(PY) benchmarks/handover.py
	$(PY) benchmarks/mixture.py
	$(PY) benchmarks/packing.py
	$(PY) benchmarks/prepare.py

clean:
	rm -rf $(VENV) examples/data benchmarks/data
