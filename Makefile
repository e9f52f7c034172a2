# Two commands set everything up on a fresh machine with Python 3.11:
#   make quickstart   train PPO on the synthetic task (CPU, a few minutes)
#   make test         run the test suite (fast + end-to-end tests)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export PYTHONPATH := $(CURDIR)

.PHONY: install quickstart sentiment-demo test test-fast clean

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(PY) -m agents.train tune_configs/quickstart.yaml

# Offline: review corpus -> warm start -> PPO with VADER reward -> evaluation (CPU, about 2 minutes)
sentiment-demo: install
	$(PY) -m agents.demo

test: install
	$(PY) -m pytest -q tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf results .pytest_cache
