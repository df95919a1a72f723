"""Any OpenAI-compatible server through the real openai client, against the emulator's
/v1/chat/completions."""

import pytest

from crag.backends.base import Usage
from crag.backends.llm_roles import LLMGenerator, LLMGrader, LLMRewriter
from crag.backends.openai_compat import OpenAICompatible
from crag.config import load_config
from crag.errors import ConfigError
from tests.support import REPO, TOKEN

OAI = REPO / "conf" / "openai.yaml"
FAST = [
    f"{r}.policy.{k}" for r in ("grader", "rewriter", "generator") for k in ("backoff_initial_s=0.01", "timeout_s=1")
]
# One mode named, not `auto`: these tests count requests, and `auto` adds its probe (test_structured_output.py)
JSON_SCHEMA = ["grader.structured_output=json_schema", "rewriter.structured_output=json_schema"]


def cfg(*sets):
    return load_config(OAI, [*FAST, *JSON_SCHEMA, *sets])


def test_grader_sends_the_json_schema(emulator):
    c = cfg().grader
    usage = Usage()
    grades = LLMGrader(OpenAICompatible(c, regex_key=c.guided_regex_key), c).grade(
        "How high is Mount Fuji?",
        [{"source": "web", "title": "Mount Fuji", "text": "Mount Fuji is 3,776 metres high."}],
        usage,
    )
    assert grades[0].grade == "yes" and grades[0].parse_status == "ok"
    [request] = emulator.of("serving")
    assert (request.method, request.path) == ("POST", "/v1/chat/completions")
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert request.body["model"] == "Qwen/Qwen2.5-7B-Instruct"
    assert request.body["response_format"]["json_schema"]["schema"]["required"] == ["grade"]
    assert "guided_regex" not in request.body
    assert request.body["max_tokens"] == 20 and request.body["temperature"] == 0.0
    assert usage.llm_calls == 1 and usage.prompt_tokens > 0


def test_guided_regex_is_sent_in_place_of_the_schema(emulator):
    """vLLM (guided_regex) and SGLang (regex) refuse a request constrained twice: the regex goes alone."""
    for key in ("guided_regex", "regex"):
        emulator.reset()
        c = cfg("grader.guided_regex=true", "grader.structured_output=none", f"grader.guided_regex_key={key}").grader
        grades = LLMGrader(OpenAICompatible(c, regex_key=c.guided_regex_key), c).grade(
            "How high is Mount Fuji?", [{"source": "web", "text": "Mount Fuji is 3,776 metres high."}], Usage()
        )
        [request] = emulator.of("serving")
        assert request.body[key] == r'\{"grade": "(yes|no)"\}' and "response_format" not in request.body
        assert grades[0].grade == "yes"


def test_a_grader_config_with_two_output_constraints_is_refused():
    with pytest.raises(ConfigError, match="set structured_output: none to send the regex"):
        cfg("grader.guided_regex=true")
    with pytest.raises(ConfigError, match="OpenAI-compatible servers only"):
        load_config(REPO / "conf" / "databricks.yaml", ["grader.guided_regex=true", "grader.structured_output=false"])


def test_the_emulator_refuses_two_output_constraints_as_vllm_does(emulator):
    from openai import BadRequestError, OpenAI

    client = OpenAI(api_key=TOKEN, base_url=f"{emulator.url}/v1", max_retries=0)
    with pytest.raises(BadRequestError, match="only use one kind of guided decoding"):
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "q"}],
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "yes|no"},
        )


def test_rewriter_keeps_the_question_out_of_generation(emulator):
    c = cfg("rewriter.policy_keywords=[Hoshi]").rewriter
    query = LLMRewriter(OpenAICompatible(c), c).rewrite("How high is Mount Fuji?", Usage())
    assert query == "high Mount Fuji Hoshi"
    assert emulator.of("serving")[0].body["max_tokens"] == 100


def test_generator_cites_and_refuses(emulator):
    c = cfg().generator
    gen = LLMGenerator(OpenAICompatible(c), c)
    context = [
        {"source": "web", "title": "Other", "text": "Python was first released in 1991."},
        {"source": "web", "title": "Mount Fuji", "text": "Mount Fuji is 3,776 metres high. It last erupted in 1707."},
    ]
    answer = gen.generate("How high is Mount Fuji?", context, Usage())
    assert "3,776" in answer.text and "[" not in answer.text and answer.cited == [1]
    refusal = gen.generate("Who painted the Sistine Chapel ceiling?", context[:1], Usage())
    assert refusal.text is None
    assert "reply exactly: \"I don't know" in emulator.of("serving")[-1].body["messages"][0]["content"]


def test_reply_language_line(emulator):
    c = cfg("generator.reply_language=Japanese").generator
    LLMGenerator(OpenAICompatible(c), c).generate("q?", [{"source": "web", "text": "x"}], Usage())
    assert "Reply in Japanese." in emulator.of("serving")[0].body["messages"][0]["content"]


@pytest.mark.parametrize("fault", ["429", "500"])  # a hang waits for its time limit: tests/slow/test_timeouts.py
def test_transient_faults_are_retried_and_counted(emulator, fault):
    emulator.behaviour["serving"].scripted = [fault]
    c = cfg().rewriter
    usage = Usage()
    assert LLMRewriter(OpenAICompatible(c), c).rewrite("How high is Mount Fuji?", usage) == "high Mount Fuji"
    assert usage.retries == 1 and len(emulator.of("serving")) == 2


def test_missing_key_is_a_clear_error(monkeypatch):
    from crag.errors import ConfigError

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(
        ConfigError,
        match="missing credential for OpenAI-compatible model .* set the environment variable OPENAI_API_KEY",
    ):
        OpenAICompatible(cfg().grader)


def test_a_reply_given_as_content_blocks_is_read(emulator):
    """gpt-oss models (also behind Databricks' OpenAI-compatible /serving-endpoints) reply with a list of
    content blocks, reasoning first: the text block is the answer."""
    emulator.behaviour["serving"].scripted = ["blocks"]
    c = cfg("grader.on_parse_failure=irrelevant").grader
    usage = Usage()
    grades = LLMGrader(OpenAICompatible(c), c).grade(
        "How high is Mount Fuji?", [{"source": "web", "text": "Mount Fuji is 3,776 metres high."}], usage
    )
    assert emulator.faults_injected["blocks"] == 1 and usage.llm_calls == 1
    assert (grades[0].grade, grades[0].parse_status, grades[0].raw_output) == ("yes", "ok", '{"grade": "yes"}')
