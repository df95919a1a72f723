"""A request that a service never answers ends at its policy's time limit (one second here) and is sent
again, for each remote backend through its real client: Databricks model serving, any OpenAI-compatible
server, Vector Search and Tavily. (Their 429s and 500s, which answer at once: tests/unit.)"""

from crag.backends.base import Usage
from crag.backends.databricks_serving import DatabricksServing
from crag.backends.llm_roles import LLMGrader, LLMRewriter
from crag.backends.openai_compat import OpenAICompatible
from crag.backends.tavily_search import TavilySearch
from crag.backends.vector_search import VectorSearchRetriever
from crag.config import load_config
from tests.support import REPO

DBX, OAI = REPO / "conf" / "databricks.yaml", REPO / "conf" / "openai.yaml"
QUESTION = "How often should the HEPA-13 main filter be replaced?"


def within_a_second(role: str) -> list[str]:
    """The `--set` values that give a role's calls one second, and a retry at once."""
    return [f"{role}.policy.timeout_s=1", f"{role}.policy.backoff_initial_s=0.01"]


def test_databricks_serving_retries_a_request_that_hangs(emulator):
    cfg = load_config(DBX, [*within_a_second("grader"), "grader.policy.max_attempts=3"]).grader
    emulator.behaviour["serving"].scripted = ["hang"]
    usage = Usage()
    docs = [
        {"source": "internal", "title": "Filters", "text": "Replace the HEPA-13 main filter every 12 months."},
        {"source": "internal", "title": "Sapporo", "text": "Sapporo hosted the 1972 Winter Olympics."},
    ]
    assert [g.grade for g in LLMGrader(DatabricksServing(cfg), cfg).grade(QUESTION, docs, usage)] == ["yes", "no"]
    assert usage.retries == 1 and emulator.faults_injected["hang"] == 1


def test_an_openai_compatible_server_is_asked_again_when_a_request_hangs(emulator):
    cfg = load_config(OAI, [*within_a_second("rewriter"), "rewriter.structured_output=json_schema"]).rewriter
    emulator.behaviour["serving"].scripted = ["hang"]
    usage = Usage()
    assert LLMRewriter(OpenAICompatible(cfg), cfg).rewrite("How high is Mount Fuji?", usage) == "high Mount Fuji"
    assert usage.retries == 1 and len(emulator.of("serving")) == 2


def test_vector_search_retries_a_query_that_hangs(emulator):
    retriever = VectorSearchRetriever(load_config(DBX, within_a_second("retriever")).retriever)
    emulator.behaviour["vector_search"].scripted = ["hang"]  # the query's, not the index's opening
    usage = Usage()
    [docs] = retriever.search([QUESTION], 5, [usage])
    assert docs and usage.retries == 1


def test_tavily_retries_a_search_that_hangs(emulator):
    search = TavilySearch(load_config(DBX, within_a_second("web_search")).web_search)
    emulator.behaviour["tavily"].scripted = ["hang"]
    usage = Usage()
    assert search.search("Mount Fuji", 3, usage) and usage.retries == 1
