"""docs/backends-retrieval.md's offline LangChain example, run as written: its module is taken from
the page, builds a FAISS store over the sample knowledge base with crag's packaged embedding model,
and serves `retriever.backend: langchain` with the partition's questions embedded in one call."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

from crag.backends.langchain_embeddings import PackagedEmbeddings
from crag.backends.langchain_retriever import LangChainRetriever
from crag.config import load_config
from crag.indexing import build_index
from tests.support import LOCAL_CONF, REPO, SAMPLE

pytest.importorskip("faiss")
pytest.importorskip("langchain_community")

PAGE = REPO / "docs" / "backends-retrieval.md"
MARKER = "<!-- example: my_project/stores.py -->"


def example_module() -> str:
    """The Python block that follows the page's example marker."""
    text = PAGE.read_text(encoding="utf-8")
    found = re.search(re.escape(MARKER) + r"\s*```python\n(.*?)```", text, re.DOTALL)
    assert found, f"{PAGE} has no python block after {MARKER}"
    return found.group(1)


@pytest.fixture
def stores(tmp_path, monkeypatch):
    package = tmp_path / "my_project"
    package.mkdir()
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "stores.py").write_text(example_module(), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("my_project.stores")
    for name in ("my_project.stores", "my_project"):
        sys.modules.pop(name, None)


def test_the_pages_example_builds_an_offline_faiss_store_and_serves_the_retriever(tmp_path, stores, monkeypatch):
    cfg = load_config(LOCAL_CONF, ["indexing.embedding=none"])
    manifest = build_index(SAMPLE / "kb", tmp_path / "kb", cfg.indexing)
    assert stores.build_faiss(str(tmp_path / "kb"), str(tmp_path / "faiss")) == manifest["n_chunks"]

    cfg = load_config(
        LOCAL_CONF,
        [
            "retriever.backend=langchain",
            "retriever.factory=my_project.stores:faiss_store",
            f"retriever.kwargs.path={tmp_path / 'faiss'}",
        ],
    )
    retriever = LangChainRetriever(cfg.retriever)
    calls = []
    batch = PackagedEmbeddings.embed_queries
    monkeypatch.setattr(
        PackagedEmbeddings, "embed_queries", lambda self, texts: calls.append(texts) or batch(self, texts)
    )
    monkeypatch.setattr(PackagedEmbeddings, "embed_query", lambda self, text: pytest.fail("a question embedded alone"))
    questions = [
        "How often should the HEPA-13 main filter be replaced?",
        "What does error code E2 mean on the AQ-7?",
        "フィルターの交換時期は？",
    ]
    found = retriever.search(questions, cfg.retriever.k)

    assert calls == [questions]  # the partition's questions in one call
    assert found[0][0]["doc_id"] == "aq7-filters" and "12" in found[0][0]["text"]
    assert all(len(docs) > 0 and len({d["parent_id"] for d in docs}) == len(docs) for docs in found)
    assert all(isinstance(d["retrieval_score"], float) for docs in found for d in docs)
