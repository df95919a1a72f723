"""Databricks Vector Search (databricks-vectorsearch) and Tavily (tavily-python), real clients against
the emulator's REST endpoints."""

import pytest

from crag.backends.base import Usage
from crag.backends.tavily_search import TavilySearch
from crag.backends.vector_search import VectorSearchRetriever
from crag.config import load_config
from tests.support import REPO, TOKEN

DBX = REPO / "conf" / "databricks.yaml"
QUESTION = "How often should the HEPA-13 main filter be replaced?"


def vs_cfg(*sets):
    return load_config(
        DBX, ["retriever.policy.timeout_s=1", "retriever.policy.backoff_initial_s=0.01", *sets]
    ).retriever


def test_vector_search_query_and_parent_expansion(emulator):
    retriever = VectorSearchRetriever(vs_cfg("retriever.query_type=HYBRID", 'retriever.filters={"doc_id NOT": "x"}'))
    [docs] = retriever.search([QUESTION], 10, [Usage()])
    describe, query = emulator.of("vector_search")
    assert (describe.method, describe.path) == (
        "GET",
        "/api/2.0/vector-search/endpoints/crag-vector-search/indexes/main.crag.chunks_index",
    )
    assert query.path == "/api/2.0/vector-search/indexes/main.crag.chunks_index/query"
    assert query.headers["Authorization"] == f"Bearer {TOKEN}"
    body = query.body
    assert body["query_text"] == QUESTION and body["num_results"] == 10 and body["query_type"] == "HYBRID"
    assert body["columns"] == ["chunk_text", "parent_id", "parent_text", "doc_id", "title", "url"]
    assert body["filters_json"] == '{"doc_id NOT": "x"}'
    assert docs[0]["doc_id"] == "aq7-filters" and "every 12 months" in docs[0]["text"]
    assert len({d["parent_id"] for d in docs}) == len(docs) <= 10
    assert [d["rank"] for d in docs] == list(range(1, len(docs) + 1))
    assert all(d["source"] == "internal" for d in docs)


@pytest.mark.parametrize("fault", ["429", "500"])  # a hang waits for its time limit: tests/slow/test_timeouts.py
def test_vector_search_faults_are_retried(emulator, fault):
    retriever = VectorSearchRetriever(vs_cfg())
    emulator.behaviour["vector_search"].scripted = [fault]
    usage = Usage()
    [docs] = retriever.search([QUESTION], 5, [usage])
    assert docs and usage.retries == 1


@pytest.mark.parametrize("fault", ["429", "500"])
def test_a_fault_while_the_index_is_opened_is_retried(emulator, fault):
    """The index's describe request (in every Spark worker, when its backends are built) meets the
    same faults as queries; a 429's Retry-After must be one the client accepts (whole seconds: a
    fractional one made urllib3 refuse the header and the run fail)."""
    emulator.behaviour["vector_search"].scripted = [fault]
    retriever = VectorSearchRetriever(vs_cfg())
    assert [r.method for r in emulator.of("vector_search")] == ["GET", "GET"]
    assert retriever.search([QUESTION], 5, [Usage()])[0]


def test_vector_search_missing_token(monkeypatch):
    from crag.errors import ConfigError

    monkeypatch.delenv("DATABRICKS_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="missing credential for Vector Search index 'main.crag.chunks_index'"):
        VectorSearchRetriever(vs_cfg())


def tavily_cfg(*sets):
    return load_config(
        DBX, ["web_search.policy.timeout_s=1", "web_search.policy.backoff_initial_s=0.01", *sets]
    ).web_search


def test_tavily_request_and_results(emulator):
    search = TavilySearch(tavily_cfg("web_search.search_depth=advanced", "web_search.include_domains=[example.org]"))
    results = search.search("Mount Fuji eruption", 3, Usage())
    [request] = emulator.of("tavily")
    assert (request.method, request.path) == ("POST", "/search")
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert request.body["query"] == "Mount Fuji eruption" and request.body["max_results"] == 3
    assert request.body["search_depth"] == "advanced" and request.body["include_domains"] == ["example.org"]
    assert "exclude_domains" not in request.body  # tavily-python sends only what is set
    assert results[0]["url"] == "https://example.org/wiki/Mount_Fuji" and "1707" in results[0]["text"]
    assert all(r["source"] == "web" and 0 <= r["retrieval_score"] <= 1 for r in results)


@pytest.mark.parametrize("fault", ["429", "500"])  # a hang: tests/slow/test_timeouts.py
def test_tavily_faults_are_retried(emulator, fault):
    search = TavilySearch(tavily_cfg())
    emulator.behaviour["tavily"].scripted = [fault]
    usage = Usage()
    assert search.search("Mount Fuji", 3, usage) and usage.retries == 1
