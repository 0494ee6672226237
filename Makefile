# make demo: set up .venv and run the main job on shards_example/
# make demo-video: write a small video dataset, inspect it and train a tiny Qwen2.5-VL on it
# make test: set up .venv and run the linter and the test suite
# make test-fast: the same without the tests that start processes (no torchrun, server, worker)
# make docs: build the documentation site (MkDocs Material) into site/; any warning fails it
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# PyTorch as `pip install torch torchvision` gives it from PyPI (the default build, which runs
# on CPU too): torchvision-backed processors and the real video processors are what users get.
# `===` keeps pip from taking the CPU-only build (2.13.0+cpu) some machines offer; another build:
# e.g. `make TORCH="torch torchvision" test`.
TORCH ?= torch===2.13.0 torchvision===0.28.0
STAMP := $(VENV)/.wdsvlm-installed

.PHONY: install demo demo-video test test-fast lint docs example clean

# constraints.txt: the versions the tests last passed with (the resolver backtracks for minutes
# without).
# uv installs them (from PyPI, into .venv): the same versions as pip, in about a third of the time.
# --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set, every process would
# otherwise compile torch, transformers and Ray from source at each start.
UV := $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY)
$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt uv
	$(UV) $(TORCH)
	$(UV) -c constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The main job: check the example's shards, train the tiny VLM on them with torchrun (2 ranks,
# gloo, CPU), then measure the data at the same settings and draw it.
DEMO_OUT ?= demo_out
DEMO_SETTINGS := --max-length 1024 --tile-size 128 --max-image-side 256 --tokens-per-tile 16
demo: install
	$(VENV)/bin/wdsvlm verify shards_example
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 \
		scripts/train_ddp.py --data shards_example --out $(DEMO_OUT)/train $(DEMO_SETTINGS)
	HF_HUB_OFFLINE=1 $(VENV)/bin/wdsvlm stats shards_example \
		--tokenizer shards_example/tokenizer --naive-batch-size 8 $(DEMO_SETTINGS) --out $(DEMO_OUT)/stats
	@echo "the pictures: $(DEMO_OUT)/stats/batches.png (naive batches beside packed rows)," \
		"tokens.png and tiles.png; the checkpoints: $(DEMO_OUT)/train/"

demo-video: install
	HF_HUB_OFFLINE=1 $(PY) scripts/demo_video.py --out $(DEMO_OUT)/video

lint: install
	$(VENV)/bin/ruff check wdsvlm tests scripts
	$(VENV)/bin/ruff format --check wdsvlm tests scripts

# The tests side by side in $(TEST_WORKERS) processes (pytest-xdist), a module's tests in one of
# them; TEST_WORKERS=0 runs them in this process, one after the other.
TEST_WORKERS ?= 2
PYTEST := HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS)

test: lint
	$(PYTEST)

test-fast: lint
	$(PYTEST) -m "not processes"

# The pages of docs/ and README.md (the home page) as a site; a broken link or anchor, or a page
# left out of mkdocs.yml's nav, fails the build (--strict).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Rebuild shards_example/ from scratch (seeded: the same bytes again); wdsvlm.testing ships
# the same tokenizer as package data.
example: install
	$(PY) scripts/make_example.py --out shards_example
	cp shards_example/tokenizer/tokenizer.json shards_example/tokenizer/tokenizer_config.json \
		wdsvlm/testing/example_tokenizer/

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info site
