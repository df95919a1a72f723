"""Databricks model serving through the real mlflow deployments client, against the emulator speaking
the serving REST protocol: chat completions and reference flow 1's batch grading shape."""

import json

import pytest
import requests

from crag.backends.base import Usage
from crag.backends.databricks_serving import DatabricksServing, message_text
from crag.backends.llm_roles import LLMGrader
from crag.config import load_config
from crag.errors import ConfigError
from tests.support import REPO, TOKEN

DBX = REPO / "conf" / "databricks.yaml"
FAST = ["grader.policy.backoff_initial_s=0.01", "grader.policy.timeout_s=1", "grader.policy.max_attempts=3"]

DOCS = [
    {"source": "internal", "title": "Filters", "text": "Replace the HEPA-13 main filter every 12 months."},
    {"source": "internal", "title": "Sapporo", "text": "Sapporo hosted the 1972 Winter Olympics."},
]
QUESTION = "How often should the HEPA-13 main filter be replaced?"


def grader(*sets):
    cfg = load_config(DBX, [*FAST, *sets]).grader
    return LLMGrader(DatabricksServing(cfg), cfg)


def test_batch_grading_is_one_request_per_question(emulator):
    usage = Usage()
    grades = grader().grade(QUESTION, DOCS, usage)
    assert [g.grade for g in grades] == ["yes", "no"] and {g.parse_status for g in grades} == {"ok"}
    [request] = emulator.of("serving")
    assert (request.method, request.path) == ("POST", "/serving-endpoints/crag-batch-grader/invocations")
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    body = request.body
    assert [i["prompt"].splitlines()[0] for i in body["inputs"]] == ["<document>", "<document>"]
    assert "HEPA-13 main filter every 12 months" in body["inputs"][0]["prompt"]
    params = body["params"]
    assert QUESTION in params["system_prompt"] and params["temperature"] == 0.0 and params["max_tokens"] == 512
    assert json.loads(params["json_schema"])["properties"]["grade"]["enum"] == ["yes", "no"]
    assert usage.llm_calls == 1 and usage.retries == 0


def test_chat_grading_sends_the_json_schema(emulator):
    usage = Usage()
    grades = grader("grader.batch=false").grade(QUESTION, DOCS, usage)
    assert [g.grade for g in grades] == ["yes", "no"]
    requests = emulator.of("serving")
    assert len(requests) == 2 and usage.llm_calls == 2
    body = requests[0].body
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["name"] == "relevance_grade"
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0


def test_score_format_is_normalised(emulator):
    usage = Usage()
    grades = grader("grader.batch=false", "grader.format=score", "grader.prompt=prompts/grade_score.yaml").grade(
        QUESTION, DOCS, usage
    )
    for g in grades:
        assert g.raw_output.startswith("Score: ") and g.parse_status == "ok" and g.rationale
        assert g.relevance == int(g.raw_output.split()[1]) / 5
    assert grades[0].grade == "yes" and grades[0].relevance >= 0.6
    assert grades[1].grade == "no" and grades[1].relevance < 0.6


def test_429_with_retry_after_is_retried(emulator):
    emulator.behaviour["serving"].scripted = ["429"]
    grades = grader().grade(QUESTION, DOCS, Usage())
    assert [g.grade for g in grades] == ["yes", "no"]
    assert len(emulator.of("serving")) == 2  # the Databricks SDK under mlflow honours Retry-After itself


def test_500_is_retried_and_counted(emulator):
    emulator.behaviour["serving"].scripted = ["500", "500"]
    usage = Usage()
    assert [g.grade for g in grader().grade(QUESTION, DOCS, usage)] == ["yes", "no"]
    assert usage.retries == 2 and len(emulator.of("serving")) == 3


def test_persistent_failure_raises_after_max_attempts(emulator):
    emulator.behaviour["serving"].scripted = ["500"] * 3
    with pytest.raises(requests.HTTPError, match="500 Server Error") as failed:
        grader().grade(QUESTION, DOCS, Usage())
    assert failed.value.response.status_code == 500
    assert len(emulator.of("serving")) == 3


def test_malformed_output_is_a_failed_parse_kept_raw(emulator):
    emulator.behaviour["serving"].scripted = ["malformed"]
    grades = grader().grade(QUESTION, DOCS, Usage())
    assert {(g.grade, g.parse_status) for g in grades} == {("no", "failed")}
    assert grades[0].raw_output == "I am not sure how to answer in the requested format."


def test_failed_parse_can_be_retried_once(emulator):
    emulator.behaviour["serving"].scripted = ["malformed"]
    usage = Usage()
    grades = grader("grader.on_parse_failure=retry").grade(QUESTION, DOCS, usage)
    assert [(g.grade, g.parse_status) for g in grades] == [("yes", "ok"), ("no", "ok")]
    assert usage.llm_calls == 2


def test_prose_wrapped_json_is_repaired(emulator):
    emulator.behaviour["serving"].scripted = ["prose"]
    grades = grader().grade(QUESTION, DOCS, Usage())
    assert [(g.grade, g.parse_status) for g in grades] == [("yes", "repaired"), ("no", "repaired")]


def test_wrong_token_is_not_retried(emulator, monkeypatch):
    monkeypatch.setenv("DATABRICKS_TOKEN", "wrong")
    with pytest.raises(requests.HTTPError, match="401 Client Error.*UNAUTHENTICATED") as refused:
        grader().grade(QUESTION, DOCS, Usage())
    assert refused.value.response.status_code == 401
    assert len(emulator.of("serving")) == 1


def test_content_blocks_reply():
    reply = {
        "choices": [{"message": {"content": [{"type": "reasoning", "summary": []}, {"type": "text", "text": "ok"}]}}]
    }
    assert message_text(reply) == "ok"


RUNTIME_HOST = "https://adb-1234567890123456.7.azuredatabricks.net"


@pytest.fixture
def on_databricks(monkeypatch):
    """A Databricks driver as crag sees one: the runtime's variable, a secret scope (dbutils) that knows
    scope/key pairs, the runtime's own authentication as databricks-sdk reads it (the job's workspace
    and token), no token in the environment. Returns the scope's secrets."""
    import sys
    import types

    stored = {"crag/grader_token": "dapi-GRADER", "crag/chat_token": "dapi-CHAT", "crag/tavily_api_key": "tvly-KEY"}
    runtime = types.ModuleType("databricks.sdk.runtime")
    runtime.dbutils = types.SimpleNamespace(
        secrets=types.SimpleNamespace(get=lambda scope, key: stored[f"{scope}/{key}"])
    )
    runtime.init_runtime_native_unified = runtime.init_runtime_repl_auth = runtime.init_runtime_legacy_auth = None
    runtime.init_runtime_native_auth = lambda: (RUNTIME_HOST, lambda: {"Authorization": "Bearer dapi-RUNTIME"})
    monkeypatch.setitem(sys.modules, "databricks.sdk.runtime", runtime)
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "16.4")
    for name in ("DATABRICKS_TOKEN", "TAVILY_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return stored


def test_each_section_keeps_its_own_secret_on_the_way_to_the_workers(on_databricks, monkeypatch):
    """Every Databricks section names DATABRICKS_TOKEN by default: a token_secret of one section must
    neither be lost nor handed to another section."""
    from crag.backends import resolve_credentials
    from crag.backends.remote import secret

    serving = [f"{role}.token_secret=crag/chat_token" for role in ("grader", "rewriter", "generator")]
    cfg = load_config(DBX, [*serving, "retriever.token_secret=crag/grader_token"])
    shipped = resolve_credentials(cfg)
    # mlflow's client takes its token from the process environment: the serving sections share one
    with pytest.raises(ConfigError, match=r"serving sections \(grader, rewriter, generator\) resolve to different"):
        resolve_credentials(load_config(DBX, [*serving, "grader.token_secret=crag/grader_token"]))
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION")  # a worker: no secret scope, only what was shipped
    for role, expected in (("retriever", "dapi-GRADER"), ("rewriter", "dapi-CHAT"), ("generator", "dapi-CHAT")):
        section = getattr(cfg, role)
        assert secret(section.token_env, section.token_secret, role, shipped) == expected, role
    assert secret("TAVILY_API_KEY", cfg.web_search.api_key_secret, "tavily", shipped) == "tvly-KEY"


def test_a_token_without_its_workspace_is_refused(on_databricks, monkeypatch):
    """Given a token but no workspace URL, the clients would drop the token silently and call with the
    runtime's own identity."""
    from crag.backends.vector_search import vector_search_client

    monkeypatch.delenv("DATABRICKS_HOST", raising=False)
    cfg = load_config(DBX, ["grader.token_secret=crag/grader_token", "retriever.token_secret=crag/chat_token"])
    with pytest.raises(ConfigError, match="has a token .* but no workspace URL: set DATABRICKS_HOST"):
        DatabricksServing(cfg.grader)
    with pytest.raises(ConfigError, match="has a token .* but no workspace URL: set DATABRICKS_HOST"):
        vector_search_client(cfg.retriever, None)
    DatabricksServing(cfg.generator)  # no token either: the runtime's own authentication, as documented


def test_a_secret_the_config_names_but_that_cannot_be_read_is_an_error_on_databricks_too(on_databricks):
    """A mistyped token_secret must not quietly become the runtime's own identity."""
    from crag.backends import resolve_credentials

    with pytest.raises(ConfigError, match="secret 'crag/grader_tokn' could not be read \\(KeyError\\)"):
        resolve_credentials(
            load_config(DBX, [f"{r}.token_secret=crag/grader_tokn" for r in ("grader", "rewriter", "generator")])
        )


def test_building_a_client_leaves_mlflow_retries_to_the_rest_of_the_process(emulator, monkeypatch):
    """The driver builds the clients to check them; its MLflow logging keeps mlflow's HTTP retries."""
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    serving = DatabricksServing(load_config(DBX, FAST).grader)
    import os

    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ
    LLMGrader(serving, load_config(DBX, FAST).grader).grade(QUESTION, DOCS, Usage())
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"  # a client's own requests: crag retries them


def test_sections_left_to_the_runtime_get_the_jobs_own_credentials_for_the_workers(
    emulator, on_databricks, monkeypatch
):  # on_databricks after emulator: it takes the emulator's token out of the environment
    """No token configured: the driver resolves the runtime's own authentication (through the real
    databricks-sdk) and ships the workspace URL and token to the workers, which cannot resolve it."""
    from crag.backends import resolve_credentials
    from crag.backends.remote import secret
    from crag.secrets import scrub

    # DATABRICKS_HOST is the emulator's workspace URL (databricks-sdk asks it for its metadata)
    shipped = resolve_credentials(load_config(DBX, ["retriever.token_secret=crag/grader_token"]))
    assert secret("DATABRICKS_TOKEN", "crag/grader_token", "retriever", shipped) == "dapi-GRADER"
    assert secret("DATABRICKS_TOKEN", None, "generator", shipped) == "dapi-RUNTIME"
    monkeypatch.delenv("DATABRICKS_HOST")
    shipped = resolve_credentials(load_config(DBX, []))
    # a section's own token (another identity) goes to the job's workspace when no URL is set
    own = resolve_credentials(load_config(DBX, ["retriever.token_secret=crag/grader_token"]))
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION")  # a worker
    for section in ("retriever", "grader", "generator"):
        auth = getattr(load_config(DBX, []), section)
        assert secret(auth.host_env, None, section, shipped) == RUNTIME_HOST
        assert secret(auth.token_env, auth.token_secret, section, shipped) == "dapi-RUNTIME"
    assert "dapi-RUNTIME" not in scrub("Authorization: Bearer dapi-RUNTIME")  # masked like any credential
    assert secret("DATABRICKS_HOST", None, "retriever", own) == RUNTIME_HOST
    assert secret("DATABRICKS_TOKEN", "crag/grader_token", "retriever", own) == "dapi-GRADER"


def test_the_databricks_sdk_reads_the_emulators_host_metadata(emulator, caplog):
    """databricks-sdk asks a workspace for /.well-known/databricks-config before anything else (mlflow's
    default path builds a client per request): the emulator answers as a workspace does, not with a
    failure the SDK logs as a warning each time."""
    import logging

    from databricks.sdk.core import Config

    from crag.emulators.server import WORKSPACE_ID

    with caplog.at_level(logging.WARNING, logger="databricks.sdk"):
        config = Config(host=emulator.url, token=TOKEN)
    assert config.workspace_id == WORKSPACE_ID
    assert not [r for r in caplog.records if r.name.startswith("databricks.sdk")]


def test_mlflow_asks_for_its_request_context_once_per_task(emulator, monkeypatch):
    """Before every request mlflow asks whether it runs in a Databricks notebook, job or cluster, and
    sends what it finds as headers. crag has it asked once per Spark task: the headers stay mlflow's,
    and the next task (of another job run, perhaps) asks again."""
    from mlflow.tracking.request_header.databricks_request_header_provider import DatabricksRequestHeaderProvider

    from crag.backends.remote import running_task

    asked, context = [], {"job_id": "7", "job_run_id": "1"}
    monkeypatch.setattr(DatabricksRequestHeaderProvider, "in_context", lambda self: asked.append(1) or True)
    monkeypatch.setattr(DatabricksRequestHeaderProvider, "request_headers", lambda self: dict(context))
    graded = grader()
    running_task(0)  # a task starts
    try:
        for _ in range(3):
            graded.grade(QUESTION, DOCS, Usage())
        assert len(asked) == 1
        sent = emulator.of("serving")
        assert [(r.headers["job_id"], r.headers["job_run_id"]) for r in sent] == [("7", "1")] * 3
        assert all(r.headers["User-Agent"].startswith("mlflow-python-client/") for r in sent)  # the other provider's
        running_task(0)  # the worker's next task
        context["job_run_id"] = "2"
        graded.grade(QUESTION, DOCS, Usage())
        assert len(asked) == 2 and emulator.of("serving")[-1].headers["job_run_id"] == "2"
    finally:
        running_task(0)  # this test's made-up job is not the next test's context


def test_requests_off_databricks_do_not_try_the_failing_imports_again(emulator, monkeypatch):
    """Off Databricks, mlflow's own answer to "in a notebook, job or cluster?" is nine imports that fail
    (IPython, dbruntime), at every request and under Python's import lock. Once the task has asked,
    no request tries them again."""
    import builtins

    from crag.backends.remote import running_task

    graded = grader()
    running_task(0)
    graded.grade(QUESTION, DOCS, Usage())  # the task's first request asks
    imported, real_import = [], builtins.__import__

    def recording(name, *args, **kwargs):
        imported.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", recording)
    for _ in range(3):
        graded.grade(QUESTION, DOCS, Usage())
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert len(emulator.of("serving")) == 4
    assert not [n for n in imported if n.startswith(("IPython", "dbruntime"))], sorted(set(imported))
