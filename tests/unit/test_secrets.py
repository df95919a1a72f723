"""No secret in any error text, screen line or stored config: credentials inside URLs and every resolved
secret value are scrubbed, whatever the exception or the config key that carries them."""

from __future__ import annotations

import json

import pytest

from crag import secrets
from crag.cli import main
from crag.config import load_config, redacted
from tests.support import LOCAL_CONF, PASSWORD, REPO, databricks_grader, set_args

pytestmark = pytest.mark.usefixtures("fresh_registry")


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


@pytest.mark.parametrize(
    "conf, key",
    [
        ("openai.yaml", "generator.api_key_env"),
        ("openai.yaml", "generator.api_key_secret"),
        # read by a databricks section only: an openai one must refuse them too, not store them
        ("openai.yaml", "generator.token_env"),
        ("openai.yaml", "generator.host_env"),
        ("openai.yaml", "generator.token_secret"),
        ("databricks.yaml", "grader.api_key_env"),
        ("databricks.yaml", "web_search.api_key_env"),
        ("databricks.yaml", "web_search.api_key_secret"),
    ],
)
def test_a_key_typed_where_a_name_belongs_is_refused_unshown(conf, key):
    from crag.errors import ConfigError

    with pytest.raises(ConfigError, match="is the credential itself here") as err:
        load_config(REPO / "conf" / conf, [f"{key}=sk-proj-{PASSWORD}"])
    assert PASSWORD not in str(err.value) and key in str(err.value)


@pytest.mark.parametrize("value", [f"@{PASSWORD}", f"%{PASSWORD}", f"`{PASSWORD}", f"{{{PASSWORD}", f"*{PASSWORD}"])
def test_a_set_value_that_is_not_yaml_is_not_repeated(value, capsys):
    assert main(["ask", "--conf", str(LOCAL_CONF), "--set", f"retriever.kwargs.password={value}", "q?"]) == 2
    err = capsys.readouterr().err
    assert "--set retriever.kwargs.password: its value is not valid YAML" in err and PASSWORD not in err


def test_a_config_file_that_is_not_yaml_is_not_quoted(tmp_path):
    from crag.errors import ConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"retriever:\n  kwargs:\n    password: *{PASSWORD}\n")
    with pytest.raises(
        ConfigError, match=r"is not valid YAML: found undefined alias( …)? \(line 3, column 15\)"
    ) as err:
        load_config(bad, [])
    assert PASSWORD not in str(err.value)


@pytest.mark.parametrize("key", ["generator.api_key_secret", "generator.token_secret"])
def test_a_value_of_the_wrong_type_is_not_shown_when_its_key_is_a_secret(key, capsys):
    conf = REPO / "conf" / "openai.yaml"
    assert main(["ask", "--conf", str(conf), "--set", f"{key}=[4929117730015523]", "q?"]) == 2
    err = capsys.readouterr().err
    assert key.rpartition(".")[0] in err and "4929117730015523" not in err


def test_credential_setting_names_are_masked_in_stored_configs():
    cfg = load_config(
        LOCAL_CONF,
        [
            "retriever.backend=langchain",
            "retriever.factory=tests.langchain_stores:faiss_store",
            f"retriever.kwargs.http_auth=[admin, {PASSWORD}]",
            f"retriever.kwargs.basic_auth=[elastic, {PASSWORD}]",
            f"retriever.kwargs.headers={{Cookie: session={PASSWORD}}}",
            f"retriever.kwargs.passphrase={PASSWORD}",
            f"retriever.kwargs.api_keys=[{PASSWORD}]",
            "retriever.kwargs.max_tokens=5",
        ],
    )
    stored = json.dumps(redacted(cfg.model_dump(mode="json")))
    assert PASSWORD not in stored and '"max_tokens": 5' in stored


def test_the_config_hash_cannot_confirm_a_guess_at_a_masked_value():
    """runs.config stores the config masked and runs.config_hash beside it: were the hash taken over the
    config unmasked, a reader could try passwords until the hash matched."""

    def config(password):
        return load_config(
            LOCAL_CONF,
            [
                "retriever.backend=langchain",
                "retriever.factory=tests.langchain_stores:faiss_store",
                f"retriever.kwargs.password={password}",
                f"mlflow.tracking_uri=https://user:{password}@mlflow.example.com",
            ],
        )

    cfg = config(PASSWORD)
    assert PASSWORD in json.dumps(cfg.model_dump(mode="json"))
    assert cfg.hash() == config("another-" + PASSWORD).hash()  # the hash does not depend on it
    assert cfg.hash() != load_config(LOCAL_CONF, []).hash()  # yet it tells configs apart
    remote = [load_config(LOCAL_CONF, [f"spark.remote=sc://h:15002/;token={t};user_id=me"]) for t in ("ab12", "cd34")]
    assert remote[0].hash() == remote[1].hash()


@pytest.mark.parametrize(
    "setting, values",
    [
        ("retriever.kwargs.text_key", ["text", "page_content"]),  # a vector store's column, not a credential
        ("retriever.kwargs.filter", ["docs code=7", "docs code=8"]),
        ("mlflow.tracking_uri", ["https://mlflow.example.com/?region=eu", "https://mlflow.example.com/?region=us"]),
    ],
)
def test_configs_that_differ_in_what_they_compute_still_hash_apart(setting, values):
    """Masking for the hash is narrower than for the stored config: a store's `text_key` is masked in
    runs.config (it looks like a key), but a run with another one computes something else."""
    from crag.backends import _identity
    from crag.cache import role_slices

    base = ["retriever.backend=langchain", "retriever.factory=tests.langchain_stores:faiss_store"]
    first, second = (load_config(LOCAL_CONF, [*base, f"{setting}={v}"]) for v in values)
    assert first.hash() != second.hash() and _identity(first) != _identity(second)
    if setting.startswith("retriever."):
        assert role_slices(first, {})["retriever"] != role_slices(second, {})["retriever"]


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


def test_crag_ask_shows_no_credential_of_an_unreachable_host(monkeypatch, capfd, closed_port, sample_indexes):
    monkeypatch.setenv("DATABRICKS_HOST", f"http://user:{PASSWORD}@127.0.0.1:{closed_port}")
    monkeypatch.setenv("DATABRICKS_TOKEN", "dapi-" + PASSWORD[::-1])
    overrides = databricks_grader(sample_indexes["kb"], sample_indexes["web"])
    args = [
        "ask",
        "--conf",
        str(LOCAL_CONF),
        *set_args(overrides),
        "How often should the HEPA-13 main filter be replaced?",
    ]
    assert main(args) == 2  # the question failed
    out, err = capfd.readouterr()
    assert "[grade] error: grade: " in out and "Connection refused" in out  # the error is there ...
    assert err.startswith("crag: error: grade: ")
    assert f"127.0.0.1:{closed_port}" in out  # ... naming the host ...
    assert PASSWORD not in out + err and PASSWORD[::-1] not in out + err  # ... and no credential


@pytest.mark.parametrize(
    "url, problem",
    [
        (f"sc://127.0.0.1:15999;token=dapi{PASSWORD}", "the port of the Spark Connect URL is not a number"),
        (f"sc://127.0.0.1:15999/;token={PASSWORD}==", "is not name=value with one '='"),
        (f"sc://127.0.0.1:15999/path;token={PASSWORD}", "the Spark Connect URL has a path"),
        (f"https://127.0.0.1:15999/?token={PASSWORD}", "not a Spark Connect URL (sc://host:port) or local[N]"),
    ],
)
def test_a_spark_connect_url_pyspark_would_refuse_is_one_line_without_its_token(url, problem, tmp_path, capsys):
    """pyspark's client raised a bare ValueError (a traceback) on the first, and quoted the token in the
    second; each is refused with the config now, its token masked."""
    assert main(["eval", "--warehouse", str(tmp_path), "--run", "r", "--set", f"spark.remote={url}"]) == 2
    err = capsys.readouterr().err
    assert problem in err and PASSWORD not in err and len(err.strip().splitlines()) == 1


def test_a_token_in_a_message_that_quotes_the_parameter_alone_is_masked():
    assert secrets.scrub(f"Parameter 'token={PASSWORD}' should be a pair") == "Parameter 'token=***' should be a pair"
    ordinary = "max_tokens=512 Response(status_code=503) exit code=137 index_key=abc: must be key=value"
    assert secrets.scrub(ordinary) == ordinary  # free text: only names that are nothing but a credential's
