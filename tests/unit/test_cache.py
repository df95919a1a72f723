"""The stage cache knows which service answered: results of one workspace or server never stand in for
another's. Its key holds the service's address, never a credential."""

from __future__ import annotations

import pytest

from crag.cache import endpoint_identity, role_slices, service_url
from crag.config import load_config
from tests.support import LOCAL_CONF, REPO

DBX = REPO / "conf" / "databricks.yaml"
OPENAI = REPO / "conf" / "openai.yaml"


@pytest.fixture
def workspace(monkeypatch):
    def point_at(host: str, token: str = "dapi-1111") -> dict[str, str]:
        monkeypatch.setenv("DATABRICKS_HOST", host)
        monkeypatch.setenv("DATABRICKS_TOKEN", token)
        return role_slices(load_config(DBX))

    return point_at


def test_another_workspace_changes_every_remote_role(workspace):
    first = workspace("https://adb-1.azuredatabricks.net")
    second = workspace("https://adb-2.azuredatabricks.net")
    assert {role for role in first if first[role] != second[role]} == {"retriever", "grader", "rewriter", "generator"}
    assert first["web_search"] == second["web_search"]  # Tavily is not in the workspace


def test_the_same_workspace_however_written_and_whatever_token(workspace):
    plain = workspace("https://adb-1.azuredatabricks.net")
    assert workspace("HTTPS://ADB-1.azuredatabricks.net/", token="dapi-2222") == plain  # a rotated token
    assert workspace("https://token:dapi-3333@adb-1.azuredatabricks.net") == plain  # credentials in the URL


def test_the_workers_credentials_name_the_workspace(monkeypatch):
    # Serverless workers lack the driver's environment: the resolved credentials shipped to them count.
    monkeypatch.delenv("DATABRICKS_HOST", raising=False)
    cfg = load_config(DBX)
    one = role_slices(cfg, {"DATABRICKS_HOST": "https://adb-1.azuredatabricks.net"})
    two = role_slices(cfg, {"DATABRICKS_HOST": "https://adb-2.azuredatabricks.net"})
    assert one["grader"] != two["grader"] and one["retriever"] != two["retriever"]


def test_results_read_by_older_parsers_are_not_reused(monkeypatch):
    """A model's stored output was read into a grade, query or answer when it was cached: once the
    parsers read outputs differently, the model roles' results are asked for again."""
    import crag.cache

    configs = [
        load_config(DBX),  # every role a model
        load_config(OPENAI, ["web_search.verify.backend=openai", "web_search.verify.endpoint=m"]),
        load_config(LOCAL_CONF),  # no model: lexical, keywords, extractive
    ]
    before = [role_slices(cfg) for cfg in configs]
    monkeypatch.setattr(crag.cache, "READING_VERSION", crag.cache.READING_VERSION + 1)
    changed = [{role for role in old if old[role] != new[role]} for old, new in zip(before, map(role_slices, configs))]
    models = {"grader", "rewriter", "generator"}
    assert changed == [models, models | {"source_check"}, set()]  # databricks.yaml has no source check


def test_results_of_older_text_functions_are_not_reused(monkeypatch):
    """The embedded grader, rewriter and answerer compute from sentences and tokens: once those are cut
    differently, their results are made again; a model role's are not (the model sees the same prompt)."""
    import crag.cache

    configs = [load_config(LOCAL_CONF), load_config(DBX)]
    before = [role_slices(cfg) for cfg in configs]
    monkeypatch.setattr(crag.cache, "TEXT_VERSION", crag.cache.TEXT_VERSION + 1)
    changed = [{role for role in old if old[role] != new[role]} for old, new in zip(before, map(role_slices, configs))]
    assert changed == [{"grader", "rewriter", "generator"}, set()]


def test_openai_base_url_counts_from_config_or_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", "http://10.0.0.1:8000/v1")
    cfg = load_config(OPENAI)
    assert endpoint_identity(cfg.generator) == "http://10.0.0.1:8000/v1"  # through ${OPENAI_BASE_URL}
    unset = cfg.generator.model_copy(update={"base_url": None})
    assert endpoint_identity(unset) == "http://10.0.0.1:8000/v1"  # the client reads the variable itself
    monkeypatch.delenv("OPENAI_BASE_URL")
    assert endpoint_identity(unset) == "https://api.openai.com/v1"


def test_tavily_base_url_counts(monkeypatch):
    monkeypatch.setenv("TAVILY_API_BASE_URL", "http://127.0.0.1:8765")
    proxied = role_slices(load_config(DBX))["web_search"]
    monkeypatch.setenv("TAVILY_API_BASE_URL", "")
    assert role_slices(load_config(DBX))["web_search"] != proxied


def test_local_roles_have_no_service(sample_config):
    assert endpoint_identity(sample_config.grader) is None and endpoint_identity(sample_config.retriever) is None


@pytest.mark.parametrize(
    "url, expected",
    [
        ("https://u:p@Host.Example.com:443/x/", "https://host.example.com:443/x"),
        ("host.example.com", "https://host.example.com"),
        ("http://h:notaport", "http://h:notaport"),
    ],
)
def test_service_url(url, expected):
    assert service_url(url) == expected


def test_a_cached_grade_is_stored_without_its_empty_fields_and_read_back_whole():
    """A grade's fields at their None default (an LLM grade's answer weight) are left out of the stored
    row: a version of crag whose Grade lacks them reads the shared stage cache without failing."""
    import json

    from crag.backends.base import Grade, Usage
    from crag.cache import CachedGrader, StageCache

    class Grader:
        def grade(self, question, documents, usage):
            return [Grade(0.9, "yes"), Grade(0.2, "no", rationale="off topic", answer_weight=0.35)]

    cache = StageCache({})
    docs = [{"source": "internal", "doc_id": d, "text": d} for d in ("a", "b")]
    fresh = CachedGrader(Grader(), cache, "grader").grade("q?", docs, Usage())
    (row,) = cache.new
    assert [set(g) for g in json.loads(row["value"])] == [
        {"relevance", "grade", "parse_status"},  # the fields every version has
        {"relevance", "grade", "parse_status", "rationale", "answer_weight"},
    ]
    usage = Usage()
    assert CachedGrader(None, cache, "grader").grade("q?", docs, usage) == fresh and usage.cache_hits == 1
