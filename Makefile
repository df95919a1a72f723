# Two entry points, each bootstrapping its own environment on a fresh machine:
#   make sample   build the sample indexes and run the main job (jobs/crag_batch.py) on the bundled sample
#   make test     run the test suite
# Set-up (`make install`, run by both): uv, then .venv from uv.lock, then the Delta Lake jars for
# local Spark from Maven Central into .crag/jars.
PYTHON ?= python3
UV_VERSION := 0.13.9
VENV := .venv
BIN := $(VENV)/bin
TOOLS := .crag/tools
UV := $(TOOLS)/bin/uv
JARS := .crag/jars
STAMP := $(VENV)/.installed-stamp
CONF := conf/local.yaml

$(UV):
	@echo "crag: installing uv $(UV_VERSION) into $(TOOLS)"
	@$(PYTHON) -m venv $(TOOLS)
	@$(TOOLS)/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

$(STAMP): $(UV) pyproject.toml uv.lock
	@echo "crag: installing the locked dependencies into $(VENV) (the first time downloads about 1 GB: a minute or two)"
	@$(UV) sync --quiet --frozen --extra local --group dev
	@touch $(STAMP)

$(JARS)/.fetched: conf/spark/pom.xml
	@echo "crag: fetching the Delta Lake jars for Spark from Maven Central into $(JARS)"
	@out=$$(mvn --quiet --batch-mode -f conf/spark/pom.xml dependency:copy-dependencies -DexcludeTransitive=true \
		-DoutputDirectory=$(CURDIR)/$(JARS) 2>&1) || { echo "$$out"; exit 1; }  # Maven's output only when it fails
	@touch $@

.crag/indexes/sample_kb/manifest.json: $(STAMP) $(JARS)/.fetched $(wildcard data/sample/kb/* data/sample/kb/*/*)
	$(BIN)/python jobs/build_index.py --conf $(CONF) --docs data/sample/kb --out .crag/indexes/sample_kb

.crag/indexes/sample_web/manifest.json: $(STAMP) $(JARS)/.fetched data/sample/web.jsonl
	$(BIN)/python jobs/build_index.py --conf $(CONF) --docs data/sample/web.jsonl --out .crag/indexes/sample_web

.PHONY: sample test install lint
install: $(STAMP) $(JARS)/.fetched

lint: $(STAMP)
	$(BIN)/ruff format --check crag jobs bench tests
	$(BIN)/ruff check crag jobs bench tests
	$(BIN)/mypy

sample: .crag/indexes/sample_kb/manifest.json .crag/indexes/sample_web/manifest.json
	$(BIN)/python jobs/crag_batch.py --conf $(CONF) --questions data/sample/questions.jsonl --warehouse .crag/warehouse

test: install
	$(BIN)/python -m pytest -q
