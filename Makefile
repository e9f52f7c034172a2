# Two commands set everything up on a fresh machine with Python 3.11:
#   make quickstart   train PPO on the synthetic task (CPU, about a minute)
#   make test         run the test suite (fast + end-to-end tests)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1

.PHONY: install quickstart sentiment-demo test test-fast clean

# The package (pyproject.toml: requirements.txt + the `tokenmdp` command) with its test extra
# (requirements-test.txt), editable, in .venv.
$(VENV)/.installed: requirements.txt requirements-test.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))' 2>/dev/null || { \
	  echo "error: Python 3.11 or newer is needed; '$(PYTHON)' is $$($(PYTHON) -c 'import sys; print(sys.version.split()[0])' 2>/dev/null || echo 'not runnable') (try: make PYTHON=python3.11 ...)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(VENV)/bin/tokenmdp train tune_configs/quickstart.yaml

# Offline: review corpus -> warm start -> PPO with VADER reward -> evaluation (CPU, a little over a minute)
sentiment-demo: install
	$(VENV)/bin/tokenmdp demo

test: install
	$(PY) -m pytest -q --durations=25 tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf results .pytest_cache
