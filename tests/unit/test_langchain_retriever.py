"""The `langchain` retriever over real LangChain stores that run offline: FAISS (reference flow 3),
Chroma (reference flow 2) and BM25Retriever, each built by a factory named in the config."""

from __future__ import annotations

import json

import langchain_stores
import pandas as pd
import pytest
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever

from crag.backends import build_backends
from crag.backends.base import Usage
from crag.config import load_config
from crag.errors import ConfigError
from tests.support import LANGCHAIN_LIBRARIES, needs

pytest.importorskip("langchain_community")


STORES = [pytest.param(store, marks=needs(store)) for store in LANGCHAIN_LIBRARIES]


@pytest.mark.parametrize("store", STORES)
def test_each_store_returns_parents_with_their_fields(stores, store):
    backends = build_backends(load_config(None, stores[store]))
    usages = [Usage(), Usage()]
    english, japanese = backends.retriever.search(
        ["How often should the HEPA-13 main filter be replaced?", "保証期間は何年ですか"], 4, usages
    )

    best = english[0]
    assert best["parent_id"] == "filter#p0" and best["doc_id"] == "filter"
    assert best["title"] == "Filter care" and best["source"] == "internal" and best["rank"] == 1
    assert best["text"] == langchain_stores.PARENTS["filter#p0"][3]  # the parent's text, not the child's
    assert best["url"] is None  # the metadata key "url" is absent (the stores keep it under "source")
    if store != "bm25":  # vector stores give scores; BM25Retriever puts none in the metadata
        assert isinstance(best["retrieval_score"], float)
    # Both children of a parent match, yet each parent is returned once, ranked 1, 2, ...
    assert len({d["parent_id"] for d in english}) == len(english)
    assert [d["rank"] for d in english] == list(range(1, len(english) + 1))
    assert japanese[0]["parent_id"] == "warranty#p0" and japanese[0]["title"] == "保証"
    assert [u.search_calls for u in usages] == [1, 1]


@needs("faiss")
def test_metadata_keys_come_from_the_config(stores):
    cfg = load_config(None, [*stores["faiss"], "retriever.metadata.url=source"])
    assert (
        build_backends(cfg).retriever.search(["decibels in sleep mode"], 4)[0][0]["url"] == "https://example.test/noise"
    )
    # Without the id and parent keys, each child chunk is its own document, under its Document id.
    cfg = load_config(
        None, [*stores["faiss"], *(f"retriever.metadata.{key}=null" for key in ("doc_id", "parent_id", "parent_text"))]
    )
    found = build_backends(cfg).retriever.search(["decibels in sleep mode"], 4)[0]
    assert [d["doc_id"] for d in found[:2]] == ["noise#p0#c2", "noise#p0#c3"]
    assert [d["parent_id"] for d in found[:2]] == ["noise#p0#c2", "noise#p0#c3"]
    assert found[0]["text"] == "The purifier runs at 24 decibels in sleep mode"


@needs("faiss", "chroma")
def test_vector_store_scores_raw_or_relevance(stores):
    query = "Replace the HEPA-13 main filter every twelve months."  # the text of a stored child: distance 0
    faiss = build_backends(load_config(None, stores["faiss"])).retriever
    raw = [d["retrieval_score"] for d in faiss.search([query], 4)[0]]
    assert raw[0] == pytest.approx(0.0, abs=1e-6) and raw == sorted(raw) and raw[-1] > 0  # FAISS: L2 distance
    # Chroma over a cosine collection: LangChain's relevance is 1 - cosine distance, best first.
    chroma = build_backends(load_config(None, [*stores["chroma"], "retriever.scores=relevance"])).retriever
    relevance = [d["retrieval_score"] for d in chroma.search([query], 4)[0]]
    assert relevance[0] == pytest.approx(1.0, abs=1e-6) and relevance == sorted(relevance, reverse=True)
    assert all(0 <= r <= 1 + 1e-6 for r in relevance)


@needs("faiss")
def test_a_partitions_questions_are_embedded_in_one_call_when_the_embeddings_offer_it(stores):
    questions = [
        "How often should the HEPA-13 main filter be replaced?",
        "decibels in sleep mode",
        "保証期間は何年ですか",
    ]
    one_by_one = build_backends(load_config(None, stores["faiss"])).retriever.search(questions, 4)
    batched = build_backends(
        load_config(None, [*stores["faiss"], "retriever.factory=langchain_stores:faiss_store_batched"])
    ).retriever
    langchain_stores.BatchedHashedBagOfWords.calls.clear()
    assert batched.search(questions, 4) == one_by_one  # the same documents and distances
    assert langchain_stores.BatchedHashedBagOfWords.calls == [questions]
    # LangChain's relevance scores are the store's own per-question call: no batch there
    relevance = load_config(
        None, [*stores["faiss"], "retriever.factory=langchain_stores:faiss_store_batched", "retriever.scores=relevance"]
    )
    langchain_stores.BatchedHashedBagOfWords.calls.clear()
    build_backends(relevance).retriever.search(questions, 4)
    assert langchain_stores.BatchedHashedBagOfWords.calls == []


@needs("bm25")
def test_documents_without_metadata_get_stable_ids(tmp_path):
    docs = tmp_path / "bare.jsonl"
    docs.write_text(json.dumps({"id": None, "text": "bare text about filters", "metadata": {}}), encoding="utf-8")
    cfg = load_config(
        None,
        [
            "retriever.backend=langchain",
            "retriever.factory=langchain_stores:bm25_retriever",
            f"retriever.kwargs.documents={docs}",
            "web_search.backend=none",
        ],
    )
    first = build_backends(cfg).retriever.search(["filters"], 3)[0]
    again = build_backends(cfg).retriever.search(["filters"], 3)[0]
    assert first[0]["doc_id"].startswith("sha256:") and first[0]["doc_id"] == again[0]["doc_id"]
    assert first[0]["parent_id"] == first[0]["doc_id"] and first[0]["text"] == "bare text about filters"
    assert first[0]["title"] is None and first[0]["retrieval_score"] is None


@needs("chroma")
def test_the_whole_chain_answers_from_the_store(stores):
    from crag.stages import run_pipeline

    cfg = load_config(None, stores["chroma"])
    question = pd.DataFrame(
        {"question_id": ["q1"], "question": ["How often should the HEPA-13 main filter be replaced?"]}
    )
    out = run_pipeline(question, build_backends(cfg), cfg).iloc[0]
    assert out["error"] is None and out["route"] == "internal"
    assert "twelve months" in out["answer"]
    assert out["sources"][0]["doc_id"] == "filter"


class FlakyRetriever(BaseRetriever):
    """A remote retriever that times out on its first call."""

    calls: int = 0

    def _get_relevant_documents(self, query, *, run_manager):
        self.calls += 1
        if self.calls == 1:
            raise TimeoutError("read timed out")
        return [Document(page_content=f"about {query}", metadata={"doc_id": "d1", "score": "0.75"})]


def flaky_retriever():
    return FlakyRetriever()


def test_a_remote_store_gets_the_retry_policy_and_threads():
    cfg = load_config(
        None,
        [
            "retriever.backend=langchain",
            "web_search.backend=none",
            f"retriever.factory={__name__}:flaky_retriever",
            "retriever.policy={max_concurrency: 4, max_attempts: 2, backoff_initial_s: 0}",
        ],
    )
    retriever = build_backends(cfg, concurrent_tasks=2).retriever
    assert retriever.concurrency == 2  # the job-wide budget shared by two tasks
    usage = Usage()
    [found] = retriever.search(["filters"], 3, [usage])
    assert found[0]["doc_id"] == "d1" and found[0]["retrieval_score"] == 0.75
    assert usage.retries == 1 and usage.search_calls == 1


@pytest.mark.parametrize(
    "factory, kwargs, message",
    [
        ("no_such_module_x:make", {}, "cannot import no_such_module_x"),
        ("langchain_stores:no_such_function", {}, "has no function 'no_such_function'"),
        ("langchain_stores:not_a_store", {}, "returned a list, expected a LangChain BaseRetriever or VectorStore"),
        ("langchain_stores:broken_store", {"path": "/nowhere"}, "failed: FileNotFoundError: no store at /nowhere"),
        ("langchain_stores:faiss_store", {"wrong": 1}, "failed: TypeError"),
    ],
)
def test_factory_problems_are_one_line_config_errors(factory, kwargs, message):
    cfg = load_config(
        None,
        [
            "retriever.backend=langchain",
            f"retriever.factory={factory}",
            "web_search.backend=none",
            *(f"retriever.kwargs.{k}={v}" for k, v in kwargs.items()),
        ],
    )
    with pytest.raises(ConfigError) as err:
        build_backends(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_factory_that_is_not_a_dotted_path_fails_at_load():
    with pytest.raises(ConfigError, match=r"retriever.factory.*expected 'package.module:function'"):
        load_config(None, ["retriever.backend=langchain", "retriever.factory=faiss_store"])


def test_cli_reports_a_bad_factory_on_one_line(capsys, tmp_path):
    from crag.cli import main

    conf = tmp_path / "langchain.yaml"
    conf.write_text("retriever:\n  backend: langchain\n", encoding="utf-8")
    code = main(
        [
            "ask",
            "--conf",
            str(conf),
            "--set",
            "retriever.factory=no_such_module_x:make",
            "--set",
            "web_search.backend=none",
            "filters?",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("crag: error: retriever.factory") and err.count("\n") == 1
