# make demo: set up .venv and run the main job on shards_example/
# make test: set up .venv and run the linter and the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of PyTorch on this project's machines; on others, e.g. `make TORCH=torch test`.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.wdsvlm-installed

.PHONY: install demo test lint example clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	HF_HUB_OFFLINE=1 $(PY) scripts/demo.py shards_example

lint: install
	$(VENV)/bin/ruff check wdsvlm tests scripts
	$(VENV)/bin/ruff format --check wdsvlm tests scripts

test: lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

# Rebuild shards_example/ from scratch (seeded: the same bytes again).
example: install
	$(PY) scripts/make_example.py --out shards_example

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info
