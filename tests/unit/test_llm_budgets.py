"""What a model role may spend: its defaults when --set switches it to a model, the token budget that
cuts its documents to the server's context window, its calls' latency percentiles, and how unreadable
grades are shown. (The in-flight limit and the time calls wait for a slot, which need calls that take
time: tests/slow/test_concurrency_budgets.py.)"""

import pytest

from crag.backends.base import LATENCY_BOUNDS_MS, Usage, latency_percentile_ms
from crag.backends.llm_roles import LLMGenerator, LLMGrader, LLMSourceCheck, PromptTooLong
from crag.backends.openai_compat import ContextOverflow, OpenAICompatible
from crag.config import load_config
from crag.errors import ConfigError
from tests.support import REPO

LOCAL, OAI = REPO / "conf" / "local.yaml", REPO / "conf" / "openai.yaml"
TO_OPENAI = ["grader.backend=openai", "grader.endpoint=m", "grader.base_url=http://127.0.0.1:1/v1"]


# ------------------------------------------------------------------ per-role defaults


def test_a_grader_switched_to_a_model_gets_the_graders_defaults():
    grader = load_config(LOCAL, TO_OPENAI).grader
    assert (grader.max_tokens, grader.temperature, grader.structured_output) == (20, 0.0, "auto")
    assert (
        load_config(
            LOCAL, [*TO_OPENAI, "grader.format=score", "grader.prompt=prompts/grade_score.yaml"]
        ).grader.max_tokens
        == 80
    )
    assert load_config(LOCAL, [*TO_OPENAI, "grader.max_tokens=64"]).grader.max_tokens == 64


def test_each_role_switched_to_a_model_gets_its_own_defaults():
    cfg = load_config(
        LOCAL,
        [
            *[f"{role}.{key}" for role in ("rewriter", "generator") for key in ("backend=openai", "endpoint=m")],
            "web_search.verify.backend=openai",
            "web_search.verify.endpoint=m",
        ],
    )
    assert (cfg.rewriter.max_tokens, cfg.rewriter.max_query_chars, cfg.rewriter.structured_output) == (100, 200, "auto")
    assert (cfg.generator.max_tokens, cfg.generator.temperature) == (300, 0.0)
    assert cfg.web_search.verify is not None and cfg.web_search.verify.max_tokens == 20


@pytest.mark.parametrize(
    "sets, problem",
    [
        # a regex sent as llama.cpp's GBNF `grammar` fails to parse there and takes the server down
        (["grader.guided_regex_key=grammar"], "guided_regex_key"),
        (["grader.structured_output=regex"], "structured_output"),
    ],
)
def test_output_constraints_outside_the_known_ones_are_refused(sets, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(OAI, sets)


def test_structured_output_takes_the_booleans_it_was():
    assert load_config(OAI, ["grader.structured_output=true"]).grader.structured_output == "auto"
    assert load_config(OAI, ["grader.structured_output=false"]).grader.structured_output == "none"


def test_databricks_serving_takes_json_schema_only():
    with pytest.raises(ConfigError, match="structured_output grammar is for OpenAI-compatible servers"):
        load_config(REPO / "conf" / "databricks.yaml", ["grader.structured_output=grammar"])


# ------------------------------------------------------------------ the token budget


class Window:
    """A chat model with a context window, recording the prompts it is sent."""

    name, concurrency = "window", 1

    def __init__(self, tokens: int | None):
        self.tokens, self.sent = tokens, []

    def context_window(self):
        return self.tokens

    def chat(self, messages, usage, **kw):
        self.sent.append(messages)
        return '{"grade": "yes"}' if "<document>" in messages[-1]["content"] else "An answer [1]."


def _prompt_tokens(messages, per_token=3.0) -> float:
    return sum(len(m["content"].encode()) for m in messages) / per_token + 8 * len(messages)


LONG = [{"source": "internal", "title": f"t{i}", "text": "word " * 3000} for i in range(3)]


def test_documents_are_cut_to_fit_the_window():
    cfg = load_config(OAI, ["grader.context_tokens=1024"]).grader
    model = Window(None)
    LLMGrader(model, cfg).grade("How high?", LONG[:1], Usage())
    [messages] = model.sent
    assert _prompt_tokens(messages) + cfg.max_tokens <= 1024
    assert _prompt_tokens(messages) + cfg.max_tokens > 1024 * 0.9  # cut, not emptied
    assert messages[-1]["content"].rstrip("</document>\n").endswith("[truncated]")


def test_the_window_the_server_reports_is_used_when_the_config_has_none():
    cfg = load_config(OAI).generator
    model = Window(2048)
    LLMGenerator(model, cfg).generate("How high?", LONG, Usage())
    [messages] = model.sent
    assert _prompt_tokens(messages) + cfg.max_tokens <= 2048
    assert messages[-1]["content"].count("[truncated]") == 3  # every document cut alike


def test_without_a_window_only_max_doc_chars_cuts():
    cfg = load_config(OAI, ["grader.max_doc_chars=100"]).grader
    model = Window(None)
    LLMGrader(model, cfg).grade("How high?", LONG[:1], Usage())
    inner = model.sent[0][-1]["content"].removeprefix("<document>\n").removesuffix("\n</document>")
    assert inner == ("t0\n" + "word " * 3000)[:100] + " [truncated]"


def test_a_prompt_that_cannot_fit_is_a_clear_error():
    cfg = load_config(OAI, ["web_search.verify.backend=openai", "web_search.verify.endpoint=m"])
    check = cfg.web_search.verify.model_copy(update={"context_tokens": 100})
    with pytest.raises(PromptTooLong, match=r"100-token context window"):
        LLMSourceCheck(Window(None), check).verify("q?", LONG[:1], Usage())


def test_an_overflow_the_server_refuses_is_the_questions_error(emulator):
    emulator.behaviour["serving"].context_tokens = 60
    c = load_config(OAI, ["grader.structured_output=none", "grader.policy.max_attempts=3"]).grader
    usage = Usage()
    with pytest.raises(ContextOverflow) as raised:
        LLMGrader(OpenAICompatible(c), c).grade("How high is Mount Fuji?", LONG[:1], usage)
    assert "context window" in str(raised.value) and "\n" not in str(raised.value)
    assert "context_tokens" in str(raised.value)
    assert len(emulator.of("serving")) == 1 and usage.retries == 0


# ------------------------------------------------------------------ latency


def test_latency_percentiles_come_from_the_histogram():
    usage = Usage()
    for ms in [100] * 90 + [3000] * 9 + [200_000]:
        usage.add_call(ms)
    assert len(usage.call_ms_hist) == len(LATENCY_BOUNDS_MS) + 1
    assert latency_percentile_ms(usage.call_ms_hist, 50) == 250
    assert latency_percentile_ms(usage.call_ms_hist, 95) == 4000
    assert latency_percentile_ms(usage.call_ms_hist, 100) is None  # the slowest bucket has no bound
    assert latency_percentile_ms(Usage().call_ms_hist, 95) is None


# ------------------------------------------------------------------ unreadable grades


def test_crag_ask_shows_an_unreadable_grade_as_unreadable():
    from crag.cli import _grade_shown

    assert _grade_shown({"grade": "no", "relevance": 0.0, "parse_status": "failed"}) == "unreadable"
    assert _grade_shown({"grade": "no", "relevance": 0.0, "parse_status": "ok"}) == " no  0.00"
    assert _grade_shown({"grade": "yes", "relevance": 0.8}) == "yes  0.80"
