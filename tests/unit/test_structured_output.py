"""Structured output against each kind of OpenAI-compatible server (the emulator answering as vLLM,
llama-cpp-python or llama.cpp), the GBNF grammar generated from each role's schema, requests refused
as permanent errors, and what a server says of itself (context window, slots)."""

import json
import re

import pytest

from crag.backends.base import Usage
from crag.backends.llm_roles import GRADE_SCHEMA, SCORE_SCHEMA, VERDICT_SCHEMA, LLMGrader, LLMRewriter, query_schema
from crag.backends.openai_compat import OpenAICompatible
from crag.backends.remote import RefusedRequest, is_transient
from crag.backends.structured import gbnf, request_fields
from crag.config import load_config
from tests.support import REPO

OAI = REPO / "conf" / "openai.yaml"
FAST = [f"{r}.policy.{k}" for r in ("grader", "rewriter") for k in ("backoff_initial_s=0.01", "timeout_s=2")]
DOC = [{"source": "web", "title": "Mount Fuji", "text": "Mount Fuji is 3,776 metres high."}]


def cfg(*sets):
    return load_config(OAI, [*FAST, *sets])


# ------------------------------------------------------------------ request shapes


def test_each_mode_asks_in_its_own_body_fields():
    schema = GRADE_SCHEMA["schema"]
    assert request_fields("json_schema", GRADE_SCHEMA) == {
        "response_format": {"type": "json_schema", "json_schema": GRADE_SCHEMA}
    }
    assert request_fields("json_object", GRADE_SCHEMA) == {"response_format": {"type": "json_object", "schema": schema}}
    assert request_fields("guided_json", GRADE_SCHEMA) == {"guided_json": schema}
    assert request_fields("grammar", GRADE_SCHEMA) == {"grammar": gbnf(schema)}
    assert request_fields("none", GRADE_SCHEMA) == {}


@pytest.mark.parametrize("mode", ["json_schema", "json_object", "grammar", "guided_json"])
def test_the_grader_sends_the_mode_it_is_set_to(emulator, mode):
    emulator.behaviour["serving"].chat_server = "llama.cpp"  # takes them all
    c = cfg(f"grader.structured_output={mode}").grader
    usage = Usage()
    [grade] = LLMGrader(OpenAICompatible(c), c).grade("How high is Mount Fuji?", DOC, usage)
    [request] = emulator.of("serving")
    sent = {k: request.body[k] for k in ("response_format", "grammar", "guided_json") if k in request.body}
    assert sent == request_fields(mode, GRADE_SCHEMA)
    assert (grade.grade, grade.parse_status, usage.llm_calls) == ("yes", "ok", 1)


# ------------------------------------------------------------------ auto: one probe


def test_auto_takes_json_schema_where_the_server_does(emulator):
    c = cfg().grader
    assert c.structured_output == "auto"
    model, usage = OpenAICompatible(c), Usage()
    grader = LLMGrader(model, c)
    for _ in range(2):
        grader.grade("How high is Mount Fuji?", DOC, usage)
    probe, *grading = emulator.of("serving")
    assert probe.body["response_format"]["json_schema"]["name"] == "probe"
    assert [r.body["response_format"]["type"] for r in grading] == ["json_schema", "json_schema"]
    assert usage.llm_calls == 3  # the probe is a call like any other: the server counts it too


def test_auto_falls_back_to_the_grammar_on_llama_cpp_python(emulator):
    """llama-cpp-python refuses response_format json_schema with HTTP 500 (pydantic's literal_error): the
    refusal is not retried, and crag's grammar is taken (the server names itself as one that takes
    GBNF)."""
    emulator.behaviour["serving"].chat_server = "llama-cpp-python"
    c = cfg().grader
    usage = Usage()
    [grade] = LLMGrader(OpenAICompatible(c), c).grade("How high is Mount Fuji?", DOC, usage)
    refused, probe, grading = emulator.of("serving")
    assert refused.body["response_format"]["type"] == "json_schema"
    assert "grammar" in probe.body and "response_format" not in probe.body
    assert grading.body["grammar"] == gbnf(GRADE_SCHEMA["schema"])
    assert (usage.retries, usage.llm_calls, grade.parse_status) == (0, 2, "ok")


def test_auto_takes_json_object_where_the_grammar_is_not_known(emulator):
    """A server that refuses json_schema and does not say it takes GBNF is asked for json_object
    first: one that does not know `grammar` might ignore the field rather than refuse it."""
    emulator.behaviour["serving"].chat_server = "llama-cpp-python"
    model = OpenAICompatible(cfg().grader)
    model._takes_gbnf, model._described = False, True  # as if its OpenAPI title were another's
    model.chat(
        [{"role": "user", "content": "q"}],
        Usage(),
        max_tokens=5,
        temperature=0,
        json_schema=GRADE_SCHEMA,
        structured="auto",
    )
    refused, probe, _ = emulator.of("serving")
    assert probe.body["response_format"]["type"] == "json_object"


def test_a_refused_mode_is_a_permanent_one_line_error(emulator):
    emulator.behaviour["serving"].chat_server = "llama-cpp-python"
    c = cfg("grader.structured_output=json_schema", "grader.policy.max_attempts=5").grader
    usage = Usage()
    with pytest.raises(RefusedRequest) as raised:
        LLMGrader(OpenAICompatible(c), c).grade("How high is Mount Fuji?", DOC, usage)
    message = str(raised.value)
    assert "\n" not in message and "HTTP 500" in message and "Input should be 'text' or 'json_object'" in message
    assert "response_format" in message
    assert len(emulator.of("serving")) == 1 and usage.retries == 0 and usage.llm_calls == 0


def test_only_a_refusal_of_the_request_itself_is_permanent():
    class Failure(Exception):
        def __init__(self, status, message):
            super().__init__(message)
            self.status_code, self.body = status, {"message": message}

    assert not is_transient(Failure(500, "1 validation error for X\n  Input should be 'text' [type=literal_error]"))
    assert not is_transient(Failure(400, "only one kind of guided decoding"))
    assert is_transient(Failure(500, "CUDA out of memory"))
    assert is_transient(Failure(503, "loading the model"))


# ------------------------------------------------------------------ what the server says of itself


def test_llama_cpp_python_is_sent_one_request_at_a_time(emulator):
    emulator.behaviour["serving"].chat_server = "llama-cpp-python"
    model = OpenAICompatible(cfg("grader.policy.max_concurrency=16").grader)
    assert model.context_window() is None  # it does not say
    assert model.concurrency == 1


def test_llama_cpp_gives_its_context_window_and_slots(emulator):
    behaviour = emulator.behaviour["serving"]
    behaviour.chat_server, behaviour.context_tokens, behaviour.slots = "llama.cpp", 2048, 4
    model = OpenAICompatible(cfg("grader.policy.max_concurrency=16").grader)
    assert (model.context_window(), model.concurrency) == (2048, 4)


# ------------------------------------------------------------------ the grammar


def _as_regex(grammar: str) -> re.Pattern:
    """A GBNF grammar without recursion as a Python regex: each rule's body with the rules it names put
    in its place, literals escaped; character classes and {m,n} read the same in both."""
    rules = dict(line.split(" ::= ", 1) for line in grammar.strip().splitlines())
    token = re.compile(r'"((?:[^"\\]|\\.)*)"|(\[(?:[^\]\\]|\\.)*\])|([A-Za-z][A-Za-z0-9-]*)|(\{\d*,\d*\}|[()|?*+])|\s+')

    def expand(body: str) -> str:
        out = []
        for literal, klass, name, operator in token.findall(body):
            if literal:
                out.append(re.escape(json.loads(f'"{literal}"')))
            elif klass:
                out.append(klass)
            elif name:
                out.append(f"(?:{expand(rules[name])})")
            elif operator:
                out.append(operator)
        return "".join(out)

    return re.compile(expand(rules["root"]))


@pytest.mark.parametrize(
    "schema, valid, invalid",
    [
        (
            GRADE_SCHEMA,
            ['{"grade": "yes"}', '{"grade":"no"}'],
            ['{"grade": "maybe"}', '{"grade": "yes", "x": 1}', "yes"],
        ),
        (
            SCORE_SCHEMA,
            ['{"score": 4, "reason": "it says so"}', '{"score":0,"reason":""}'],
            ['{"score": 6, "reason": "x"}', '{"reason": "x", "score": 4}', '{"score": 4}'],
        ),
        (VERDICT_SCHEMA, ['{"verdict": "YES"}', '{"verdict": "NO"}'], ['{"verdict": "yes"}', "YES"]),
    ],
)
def test_the_grammar_takes_exactly_what_the_schema_does(schema, valid, invalid):
    pattern = _as_regex(gbnf(schema["schema"]))
    for text in valid:
        assert pattern.fullmatch(text), text
        json.loads(text)
    for text in invalid:
        assert not pattern.fullmatch(text), text


def test_the_query_grammar_keeps_the_length_limit():
    pattern = _as_regex(gbnf(query_schema(cfg("rewriter.max_query_chars=10").rewriter)["schema"]))
    assert pattern.fullmatch('{"query": "Mount Fuji"}')
    assert pattern.fullmatch('{"query": "a \\"b\\" c"}')  # escapes are JSON's
    assert not pattern.fullmatch('{"query": "Mount Fuji h"}')  # 11 characters
    assert not pattern.fullmatch('{"query": ""}')  # minLength 1
    assert not pattern.fullmatch('{"query": "a\nb"}')  # a raw control character is no JSON


@pytest.mark.parametrize(
    "schema, problem",
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": []}, "every property"),
        ({"type": "integer"}, "minimum and a maximum"),
        ({"type": "array", "items": {"type": "string"}}, "no grammar"),
    ],
)
def test_a_schema_the_grammar_cannot_state_is_refused(schema, problem):
    with pytest.raises(ValueError, match=problem):
        gbnf(schema)


def test_the_rewriter_query_is_cut_to_its_limit(emulator):
    c = cfg("rewriter.structured_output=grammar", "rewriter.max_query_chars=12").rewriter
    query = LLMRewriter(OpenAICompatible(c), c).rewrite("How high is the summit of Mount Fuji in Japan?", Usage())
    assert 0 < len(query) <= 12 and query == query.strip()
    [request] = emulator.of("serving")
    assert "char{1,12}" in request.body["grammar"]
