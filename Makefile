# Two commands (see README.md):
#   make quickstart   install quern into .venv and run examples/quickstart.py
#   make test         install quern with test extras into .venv; lint (ruff), type-check (mypy), run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install quickstart lint typecheck test bench clean services

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

# System services the tests start themselves on 127.0.0.1 (tests/servers.py): nginx, for the HTTP tests.
# .ci/run calls this before `make test`. Installed with apt-get only where the nginx binary is missing
# (nothing to do, and no apt-get update, when it is there), without starting Debian's nginx service: a
# policy-rc.d that exits 101 stands in for the install, and the service is stopped and disabled after.
# Best effort: where it cannot be installed (no apt-get, not root, no network) one line says why and the
# HTTP tests skip with that reason; this target never fails.
services:
	@if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then exit 0; fi; \
	skip() { echo "make services: nginx is not installed ($$1); the HTTP tests will skip"; exit 0; }; \
	command -v apt-get >/dev/null 2>&1 || skip "apt-get not found"; \
	if [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else skip "apt-get needs root, and sudo -n is not allowed"; fi; \
	log=$$(mktemp); ours=; policy=/usr/sbin/policy-rc.d; saved=$$policy.quern-services-saved; \
	restore() { rm -f $$log; [ -n "$$ours" ] || return 0; $$sudo rm -f $$policy; if [ -e $$saved ]; then $$sudo mv -f $$saved $$policy; fi; }; \
	trap restore EXIT; trap 'exit 1' INT TERM; \
	if [ -e $$policy ]; then $$sudo mv -f $$policy $$saved || skip "cannot set $$policy"; fi; ours=1; \
	printf '#!/bin/sh\nexit 101\n' | $$sudo tee $$policy >/dev/null && $$sudo chmod 755 $$policy || skip "cannot set $$policy"; \
	apt() { $$sudo env DEBIAN_FRONTEND=noninteractive apt-get -qq -y -o DPkg::Lock::Timeout=120 "$$@" >$$log 2>&1 \
		|| skip "apt-get $$1 failed: $$(grep -v '^\s*$$' $$log | tail -n 1)"; }; \
	apt update; \
	pkg=nginx; apt-cache policy nginx 2>/dev/null | grep -q 'Candidate: [0-9]' || pkg=nginx-light; \
	apt install --no-install-recommends $$pkg; \
	if [ -d /run/systemd/system ]; then $$sudo systemctl disable --now nginx >/dev/null 2>&1 || true; fi; \
	pid=$$(cat /run/nginx.pid 2>/dev/null) || true; \
	if [ -n "$$pid" ] && [ "$$(cat /proc/$$pid/comm 2>/dev/null)" = nginx ]; then $$sudo kill $$pid || true; fi; \
	[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null 2>&1 || skip "apt-get install $$pkg gave no nginx binary"; \
	echo "make services: installed $$pkg (nginx $$(/usr/sbin/nginx -v 2>&1 | sed 's|.*/||')); its system service is not running"

bench: install
	$(PY) benchmarks/vs_grain.py
	$(PY) benchmarks/parquet.py
	$(PY) benchmarks/handover.py
	$(PY) benchmarks/mixture.py
	$(PY) benchmarks/packing.py
	$(PY) benchmarks/prepare.py
	$(PY) benchmarks/remote.py

clean:
	rm -rf $(VENV) examples/data benchmarks/data
