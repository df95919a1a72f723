"""No secret in any error text, screen line or stored config: credentials inside URLs and every resolved
secret value are scrubbed, whatever the exception or the config key that carries them."""

from __future__ import annotations

import json
import socket

import pytest
from deltalake import DeltaTable

from crag import secrets
from crag.cli import main
from crag.config import load_config, redacted
from tests.support import LOCAL_CONF, REPO, SAMPLE, crag_run_args, set_args

PASSWORD = "pw-Zq81-secret"


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(secrets, "_known", set())


# ---------------------------------------------------------------- the scrubber


@pytest.mark.parametrize(
    "text",
    [
        f"API request to http://user:{PASSWORD}@127.0.0.1:9/serving-endpoints/x failed",
        f"connect https://token:{PASSWORD}@adb-1.azuredatabricks.net/api/2.0 refused",
        f"'sc://h:{PASSWORD}@cluster:15002'",
        f'url="postgresql://crag:{PASSWORD}@db/crag"',
        f"HTTPConnectionPool(host='x'): http://{PASSWORD}@x/",  # a token as the user part
        f"http://user:{PASSWORD[:5]}@{PASSWORD[5:]}@host/",  # an unencoded @ inside the password
        f"GET http://h/search?api_key={PASSWORD}&q=1",
        f"GET http://h/search?q=1&access_token={PASSWORD}",
        f"GET https://gw.example/v1?key={PASSWORD}",
        f"GET https://login.example/cb?state=1&code={PASSWORD}",
        f"line one\nhttp://u:{PASSWORD}@h/\nline three",
    ],
)
def test_url_credentials_are_masked(text):
    scrubbed = secrets.scrub(text)
    assert PASSWORD not in scrubbed and PASSWORD[5:] not in scrubbed and PASSWORD[:5] + "@" not in scrubbed
    assert "***" in scrubbed


def test_a_url_without_credentials_is_kept():
    text = "POST http://127.0.0.1:8765/serving-endpoints/chat/invocations?x=1 failed: 503 (user@example.com)"
    assert secrets.scrub(text) == text


def test_resolved_values_are_masked_also_url_encoded():
    secret = "tok/en+with@chars==" + PASSWORD
    secrets.remember([secret])
    for text in (
        f"bad token {secret}!",
        f"Bearer%20{secrets.quote(secret, safe='')}",
        f"k={secrets.quote_plus(secret)}",
    ):
        assert PASSWORD not in secrets.scrub(text)


def test_resolved_values_are_masked_as_repr_and_json_escape_them():
    secret = 'tok"en\\' + PASSWORD  # a quote and a backslash, which both escape
    secrets.remember([secret])
    for text in (repr(f"Bearer {secret}"), json.dumps({"authorization": f"Bearer {secret}"})):
        assert PASSWORD not in secrets.scrub(text), text


def test_a_credential_is_stripped_and_one_with_a_control_character_refused_unshown(monkeypatch):
    from crag.backends.remote import secret
    from crag.errors import ConfigError

    monkeypatch.setenv("CRAG_TEST_KEY", f"  {PASSWORD}\n")  # pasted, or read from a file
    assert secret("CRAG_TEST_KEY", None, "the test") == PASSWORD
    monkeypatch.setenv("CRAG_TEST_KEY", f"{PASSWORD}\r{PASSWORD}")
    with pytest.raises(
        ConfigError, match=r"credential for the test \(CRAG_TEST_KEY\) holds a control character"
    ) as err:
        secret("CRAG_TEST_KEY", None, "the test")
    assert PASSWORD not in str(err.value)
    assert PASSWORD not in secrets.scrub(repr(f"Bearer {PASSWORD}\r{PASSWORD}"))  # its escaped form is known


@pytest.mark.parametrize("env_name, ref", [("sk-proj-" + PASSWORD, None), ("OPENAI_API_KEY", "sk-proj-" + PASSWORD)])
def test_a_key_typed_where_a_name_belongs_is_not_echoed(env_name, ref, monkeypatch):
    from crag.backends.remote import secret
    from crag.errors import ConfigError

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="is the credential itself in a") as err:
        secret(env_name, ref, "generator")
    assert PASSWORD not in str(err.value)


def test_a_url_credential_remembers_only_its_password():
    secrets.remember([f"https://user:{PASSWORD}@workspace.example.com"])
    scrubbed = secrets.scrub(f"calling workspace.example.com with {PASSWORD}")
    assert scrubbed == "calling workspace.example.com with ***"  # the host stays readable


def test_too_short_values_are_not_masked_everywhere():
    secrets.remember(["ab"])
    assert secrets.scrub("a table of about ab") == "a table of about ab"


def test_non_strings_pass():
    assert secrets.scrub(None) is None and secrets.scrub(3) == 3


# ---------------------------------------------------------------- stored configs


def test_secret_bearing_keys_are_masked_and_only_those():
    stored = redacted(
        {
            "max_tokens": 300,
            "prompt_tokens": 4,
            "token_env": "DATABRICKS_TOKEN",
            "api_key_env": "K",
            "access_token": "abc123",
            "client_secret": "s3cr3t",
            "apiKey": "k-123",
            "password": "pw1234",
            "token_secret": "scope/key",
            "guided_regex_key": "guided_regex",
            "x-api-key": "hk-1234",
            "nested": [{"auth_token": "zz99"}],
            "aws_secret_access_key": "AWSSECRET/abcd",
            "azure_search_key": "AZKEY9988",
            "headers": {"Authorization": "Bearer LIVE9988"},
            "connection_string": "Endpoint=x;AccountKey=ACCKEY55==",
        }
    )
    assert stored == {
        "max_tokens": 300,
        "prompt_tokens": 4,
        "token_env": "DATABRICKS_TOKEN",
        "api_key_env": "K",
        "access_token": "***",
        "client_secret": "***",
        "apiKey": "***",
        "password": "***",
        "token_secret": "***",
        "guided_regex_key": "guided_regex",
        "x-api-key": "***",
        "nested": [{"auth_token": "***"}],
        "aws_secret_access_key": "***",
        "azure_search_key": "***",
        "headers": {"Authorization": "***"},
        "connection_string": "***",
    }


def test_a_secret_in_a_tavily_base_url_is_not_stored(monkeypatch):
    monkeypatch.setenv("TAVILY_API_BASE_URL", f"https://proxy:{PASSWORD}@tavily.example.com")
    cfg = load_config(REPO / "conf" / "databricks.yaml")
    assert PASSWORD in cfg.web_search.api_base_url  # the config itself holds it, for the client ...
    stored = json.dumps(redacted(cfg.model_dump(mode="json")))
    assert PASSWORD not in stored  # ... the stored copy does not
    assert "https://***@tavily.example.com" in stored


def test_a_secret_value_under_any_key_is_not_stored(monkeypatch):
    # The key named by api_key_env is a secret wherever its value appears: in a query string, in a
    # subject line, in a URL's path.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-live-" + PASSWORD)
    monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:8000/v1/sk-live-{PASSWORD}")
    cfg = load_config(REPO / "conf" / "openai.yaml", [f"generator.refusal_message=see sk-live-{PASSWORD}"])
    stored = json.dumps(redacted(cfg.model_dump(mode="json")))
    assert PASSWORD not in stored
    assert "OPENAI_API_KEY" in stored  # where the secret comes from is kept


# ---------------------------------------------------------------- error texts, end to end


def _databricks_grader(kb: str, web: str) -> list[str]:
    return [
        f"retriever.index={kb}",
        f"web_search.index={web}",
        "mlflow.enabled=false",
        "grader.backend=databricks",
        "grader.endpoint=grader-x",
        "grader.prompt=prompts/grade_binary.yaml",
        "grader.policy.max_attempts=2",
        "grader.policy.backoff_initial_s=0.01",
        "grader.policy.timeout_s=5",
    ]


def test_crag_ask_shows_no_credential_of_an_unreachable_host(monkeypatch, capfd, closed_port, sample_indexes):
    monkeypatch.setenv("DATABRICKS_HOST", f"http://user:{PASSWORD}@127.0.0.1:{closed_port}")
    monkeypatch.setenv("DATABRICKS_TOKEN", "dapi-" + PASSWORD[::-1])
    overrides = _databricks_grader(sample_indexes["kb"], sample_indexes["web"])
    args = [
        "ask",
        "--conf",
        str(LOCAL_CONF),
        *set_args(overrides),
        "How often should the HEPA-13 main filter be replaced?",
    ]
    assert main(args) == 0
    out, err = capfd.readouterr()
    assert "[grade] error: grade: " in out and "Connection refused" in out  # the error is there ...
    assert f"127.0.0.1:{closed_port}" in out  # ... naming the host ...
    assert PASSWORD not in out + err and PASSWORD[::-1] not in out + err  # ... and no credential


def test_crag_run_stores_no_credential_in_errors_reasons_or_config(
    spark, monkeypatch, capfd, tmp_path, closed_port, sample_indexes
):
    monkeypatch.setenv("DATABRICKS_HOST", f"http://user:{PASSWORD}@127.0.0.1:{closed_port}")
    monkeypatch.setenv("DATABRICKS_TOKEN", "dapi-" + PASSWORD[::-1])
    questions = tmp_path / "q.jsonl"
    lines = [line for line in (SAMPLE / "questions.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()][:4]
    questions.write_text("\n".join(lines) + "\n", encoding="utf-8")
    warehouse = tmp_path / "wh"
    overrides = [
        o.replace("mlflow.enabled=false", "mlflow.enabled=true")
        for o in _databricks_grader(sample_indexes["kb"], sample_indexes["web"])
    ]
    code = main(crag_run_args(warehouse, "--run-id", "leak", questions=questions, overrides=overrides))
    assert code == 0
    out, err = capfd.readouterr()
    answers = DeltaTable(str(warehouse / "answers")).to_pandas()
    assert answers["error"].notna().sum() >= 1  # the grader's calls failed, and said so
    assert answers["error"].str.contains(f"127.0.0.1:{closed_port}").any()
    decisions = DeltaTable(str(warehouse / "decisions")).to_pandas()
    assert decisions["reason"].str.contains("Connection refused").any()
    for path in [p for p in warehouse.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        assert PASSWORD.encode() not in data and PASSWORD[::-1].encode() not in data, path
    assert PASSWORD not in out + err
