# Two commands (see README.md):
#   make quickstart   install quern (a wheel built from this checkout) into .venv and run examples/quickstart.py
#   make test         the same, then lint (ruff), type-check (mypy) and run the test suite against the installed
#                     wheel, from a folder where the checkout is not importable
# and, for the edit-run loop, make test-fast: the wheel and the suite without the tests marked slow (no lint,
# types nor docs).
# VENV may point elsewhere (make test VENV=/tmp/venv): everything this Makefile installs or builds goes there.
PYTHON ?= python3
VENV ?= .venv
PY := $(abspath $(VENV))/bin/python
DIST := $(abspath $(VENV))/dist

.PHONY: install quickstart lint typecheck test test-fast bench clean services docs

# The dependencies, once per change of pyproject.toml: the package's and the test extra's (which has the
# build tools: hatchling, build, twine), read from pyproject.toml; quern itself is not installed here
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
		print(*p["dependencies"], *p["optional-dependencies"]["test"], sep="\n")' >$(VENV)/requirements.txt
	$(PY) -m pip install --quiet -r $(VENV)/requirements.txt
	touch $@

# Every run: the sdist, then the wheel from the sdist (python -m build, without build isolation: the tools
# are in the venv), and the wheel alone reinstalled over any earlier quern. pip compiles its bytecode, so
# every process (each fork server included) imports quern without compiling it.
install: $(VENV)/.installed
	rm -rf $(DIST)
	$(PY) -m build --no-isolation --outdir $(DIST) . >$(DIST).log 2>&1 || { cat $(DIST).log; exit 1; }
	$(PY) -m pip install --quiet --force-reinstall --no-deps $(DIST)/quern-*.whl

quickstart: install
	$(PY) examples/quickstart.py

# lint and typecheck read the checkout (with whatever venv exists: they install nothing once there is one)
lint: | $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy checks the package by its name, quern, which is this folder: a link named quern points here
typecheck: | $(VENV)/.installed
	mkdir -p $(VENV)/typecheck
	ln -sfn $(CURDIR) $(VENV)/typecheck/quern
	cd $(VENV)/typecheck && MYPYPATH=. $(abspath $(VENV))/bin/mypy --config-file $(CURDIR)/pyproject.toml -p quern

# The documentation site (docs/, Sphinx with MyST) built into site/ from the installed wheel's docstrings, strictly:
# a warning (a broken cross-reference, a missing page, an undocumented public name) fails the build
SPHINX = rm -rf site && $(PY) -m sphinx -b html -W --keep-going -n -q -d $(abspath $(VENV))/doctrees docs site
docs: install
	$(SPHINX)

# The suite runs against the installed wheel, from an empty folder (neither the checkout nor its parent is
# on sys.path; --confcutdir: nor is the checkout's __init__.py imported as a package of the tests, which
# fails where the checkout's folder name is no Python name), in TEST_WORKERS processes (pytest-xdist): more
# than the 2 cores, as many tests wait on subprocesses, servers and clusters (4: make test in 4m38s on a clean
# clone of this 2-core machine, against 5m03s with 3; 5 was tried on 2026-12-05: the suite alone took 4m52s
# against 5m05s with 4 run back to back, but in .ci/run, beside the type check and the docs, 5m23s and
# 5m34s against 5m18s with 4). Tests are handed out one at a
# time (--maxschedchunk 1), in the order tests/conftest.py sets: those marked slow first, so that no long
# test starts last while the other workers idle.
TEST_WORKERS ?= 4
PYTEST = $(PY) -m pytest -q -n $(TEST_WORKERS) --maxschedchunk 1 -c $(CURDIR)/pyproject.toml --rootdir $(CURDIR) \
	--confcutdir $(CURDIR)/tests -p no:cacheprovider

# make test: the type check (mypy) and the docs site (make docs) run beside the suite, niced, in the time the
# suite waits; their output follows the suite's, and any of the three failing fails the target. The browser
# tests of the site (tests/test_site_browser.py, run last) wait for the build (QUERN_DOCS_DONE: the file its
# exit status is written to). Beside the wheel's build, tests/rewrite_cache.py writes pytest's rewritten
# bytecode of the test modules once, which each worker would otherwise make itself (about 4 s of CPU each).
test: lint
	@$(PY) tests/rewrite_cache.py & $(MAKE) --no-print-directory install; rc=$$?; wait; exit $$rc
	@logs=$$(mktemp -d); \
	( nice -n 10 $(MAKE) --no-print-directory typecheck >$$logs/typecheck.log 2>&1; echo $$? >$$logs/typecheck.status ) & \
	( { echo '$(SPHINX)'; nice -n 10 sh -c '$(SPHINX)'; } >$$logs/docs.log 2>&1; \
	  echo $$? >$$logs/docs.tmp; mv $$logs/docs.tmp $$logs/docs.status ) & \
	run=$$(mktemp -d); cd $$run && QUERN_DOCS_DONE=$$logs/docs.status $(PYTEST) $(CURDIR)/tests; \
	rc=$$?; cd $(CURDIR); rm -rf $$run; wait; \
	for part in typecheck docs; do \
		echo "--- make $$part (beside the suite):"; cat $$logs/$$part.log; \
		status=$$(cat $$logs/$$part.status 2>/dev/null || echo 1); \
		if [ "$$status" != 0 ]; then echo "make $$part failed (status $$status)"; rc=1; fi; \
	done; \
	rm -rf $$logs; exit $$rc

# make test-fast, for the edit-run loop: the wheel installed, then the suite without the tests marked slow
# (pytest -m 'not slow'); make test runs them all (but those marked optin, as every run: pytest -m optin),
# with lint, types and docs
test-fast: install
	@run=$$(mktemp -d); cd $$run && $(PYTEST) -m 'not slow' $(CURDIR)/tests; \
	rc=$$?; cd $(CURDIR); rm -rf $$run; exit $$rc

# System services the tests start themselves on 127.0.0.1 (tests/servers.py): nginx, for the HTTP tests,
# and prometheus, for the Prometheus tests; redis-server, for the Redis tests (tests/redisserver.py); and
# Debian's chromium with chromium-driver, the headless browser of the browser test
# (tests/test_site_browser.py; fonts-liberation with them, the font that
# --no-install-recommends would leave out). .ci/run calls this before `make test`. Each is installed with
# apt-get only where its binary is missing (nothing to do, and no apt-get update, when all are there; one
# apt-get update for all otherwise), with --no-install-recommends, without starting Debian's service of
# it: a policy-rc.d that exits 101 stands in for the install, and the service is stopped and disabled
# after (a process the package started, found by its pid file and /proc/PID/comm, is killed).
# Best effort: where one cannot be installed (no apt-get, not root, no network) one line says why and
# the tests needing it skip with that reason; this target never fails.
services:
	@want=; command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || want=nginx; \
	command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ] || want="$$want prometheus"; \
	command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || want="$$want redis"; \
	{ [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; } || want="$$want chromium"; \
	[ -n "$$want" ] || exit 0; \
	say() { case $$1 in nginx) what=nginx; tests="the HTTP tests";; prometheus) what=prometheus; tests="the Prometheus tests";; \
		redis) what=redis-server; tests="the Redis tests";; \
		*) what="chromium or chromium-driver"; tests="the browser test";; esac; \
		echo "make services: $$what is not installed ($$2); $$tests will skip"; }; \
	skip() { for w in $$want; do say $$w "$$1"; done; exit 0; }; \
	command -v apt-get >/dev/null 2>&1 || skip "apt-get not found"; \
	if [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else skip "apt-get needs root, and sudo -n is not allowed"; fi; \
	log=$$(mktemp); ours=; policy=/usr/sbin/policy-rc.d; saved=$$policy.quern-services-saved; \
	restore() { rm -f $$log; [ -n "$$ours" ] || return 0; $$sudo rm -f $$policy; if [ -e $$saved ]; then $$sudo mv -f $$saved $$policy; fi; }; \
	trap restore EXIT; trap 'exit 1' INT TERM; \
	if [ -e $$policy ]; then $$sudo mv -f $$policy $$saved || skip "cannot set $$policy"; fi; ours=1; \
	printf '#!/bin/sh\nexit 101\n' | $$sudo tee $$policy >/dev/null && $$sudo chmod 755 $$policy || skip "cannot set $$policy"; \
	apt() { $$sudo env DEBIAN_FRONTEND=noninteractive apt-get -qq -y -o DPkg::Lock::Timeout=120 "$$@" >$$log 2>&1 \
		|| { why="apt-get $$1 failed: $$(grep -v '^\s*$$' $$log | tail -n 1)"; return 1; }; }; \
	halt() { if [ -d /run/systemd/system ]; then $$sudo systemctl disable --now $$1 >/dev/null 2>&1 || true; fi; \
		pid=$$(cat $$2 2>/dev/null) || true; \
		if [ -n "$$pid" ] && [ "$$(cat /proc/$$pid/comm 2>/dev/null)" = $$1 ]; then $$sudo kill $$pid || true; fi; }; \
	apt update || skip "$$why"; \
	for w in $$want; do \
	if [ $$w = nginx ]; then \
		pkg=nginx; apt-cache policy nginx 2>/dev/null | grep -q 'Candidate: [0-9]' || pkg=nginx-light; \
		apt install --no-install-recommends $$pkg || { say nginx "$$why"; continue; }; \
		halt nginx /run/nginx.pid; \
		[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null 2>&1 || { say nginx "apt-get install $$pkg gave no nginx binary"; continue; }; \
		echo "make services: installed $$pkg (nginx $$(/usr/sbin/nginx -v 2>&1 | sed 's|.*/||')); its system service is not running"; \
	elif [ $$w = prometheus ]; then \
		apt install --no-install-recommends prometheus || { say prometheus "$$why"; continue; }; \
		halt prometheus /run/prometheus/prometheus.pid; \
		[ -x /usr/bin/prometheus ] || { say prometheus "apt-get install prometheus gave no prometheus binary"; continue; }; \
		echo "make services: installed prometheus (prometheus $$(/usr/bin/prometheus --version 2>&1 | sed -n 's/.*version \([^ ]*\).*/\1/p;q')); its system service is not running"; \
	elif [ $$w = redis ]; then \
		apt install --no-install-recommends redis-server || { say redis "$$why"; continue; }; \
		halt redis-server /run/redis/redis-server.pid; \
		[ -x /usr/bin/redis-server ] || { say redis "apt-get install redis-server gave no redis-server binary"; continue; }; \
		echo "make services: installed redis-server (redis-server $$(/usr/bin/redis-server --version 2>&1 | sed -n 's/.* v=\([^ ]*\).*/\1/p;q')); its system service is not running"; \
	else \
		apt install --no-install-recommends chromium chromium-driver fonts-liberation || { say chromium "$$why"; continue; }; \
		{ [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; } \
			|| { say chromium "apt-get install chromium chromium-driver gave no /usr/bin/chromium or /usr/bin/chromedriver"; continue; }; \
		echo "make services: installed chromium and chromium-driver ($$(/usr/bin/chromium --version 2>/dev/null | sed -n 's/ built on.*//p'), $$(/usr/bin/chromedriver --version 2>&1 | cut -d' ' -f1,2))"; \
	fi; \
	done

bench: install
	$(PY) benchmarks/vs_grain.py
	$(PY) benchmarks/parquet.py
	$(PY) benchmarks/handover.py
	$(PY) benchmarks/mixture.py
	$(PY) benchmarks/packing.py
	$(PY) benchmarks/maxtext.py
	$(PY) benchmarks/prepare.py
	$(PY) benchmarks/remote.py
	$(PY) benchmarks/observability.py
	$(PY) benchmarks/verify.py
	$(PY) benchmarks/redis_stream.py
	$(PY) benchmarks/formats.py
	$(PY) benchmarks/vision.py
	$(PY) benchmarks/vs_torch.py
	$(PY) benchmarks/plan.py
	$(PY) benchmarks/autotune.py

clean:
	rm -rf $(VENV) examples/data benchmarks/data
