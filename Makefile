# Two entry points, each bootstrapping its own environment on a fresh machine:
#   make sample   build the sample indexes and run the whole job on the bundled sample
#   make test     run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
CONF := conf/local.yaml

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

.crag/indexes/sample_kb/manifest.json: $(STAMP) $(wildcard data/sample/kb/* data/sample/kb/*/*)
	$(BIN)/crag index --conf $(CONF) --docs data/sample/kb --out .crag/indexes/sample_kb

.crag/indexes/sample_web/manifest.json: $(STAMP) data/sample/web.jsonl
	$(BIN)/crag index --conf $(CONF) --docs data/sample/web.jsonl --out .crag/indexes/sample_web

.PHONY: sample test install
install: $(STAMP)

sample: .crag/indexes/sample_kb/manifest.json .crag/indexes/sample_web/manifest.json
	$(BIN)/crag run --conf $(CONF) --questions data/sample/questions.jsonl --warehouse .crag/warehouse

test: $(STAMP)
	$(BIN)/python -m pytest -q
