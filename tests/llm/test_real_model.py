"""Every LLM role on a real model: SmolLM2-135M-Instruct served by llama-cpp-python (tests/llm/conftest.py).

The model is small and its answers are poor; what is tested is the machinery around it: each role's
reply is read per its contract under structured output, no question fails, the server survives every
mode crag can send, and the calls and tokens crag counts are the ones the server answered. Documents
are cut short (max_doc_chars) and few (k) to keep the tier within minutes on two shared cores."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from crag import stages
from crag.backends import build_backends
from crag.backends.base import Usage
from crag.backends.llm_roles import LLMGrader, LLMRewriter, LLMSourceCheck
from crag.backends.openai_compat import OpenAICompatible
from crag.backends.parsing import parse_binary, parse_yes_no
from crag.backends.remote import RefusedRequest
from crag.config import load_config
from tests.support import REPO, SAMPLE, crag_run_args, run_rows

OAI = REPO / "conf" / "openai.yaml"
# Every chat role on the model, the web sought for every question (its relevant context is always
# "too short"), so that the rewriter, the web results' grading and the source check all run.
EVERY_ROLE = [
    "web_search.verify.backend=openai",
    "web_search.verify.base_url=${OPENAI_BASE_URL}",
    "web_search.verify.endpoint=${CRAG_MODEL}",
    "web_search.verify.subject=the Hoshi AQ-7 air purifier",
    "web_search.verify.max_doc_chars=400",
    "routing.policy=min_context_chars",
    "routing.min_context_chars=1000000",
]
SHORT = [
    "retriever.k=2",
    "web_search.k=2",
    "generator.max_tokens=48",
    *[f"{role}.max_doc_chars=400" for role in ("grader", "generator")],
]
# the sample's questions, each id once (it repeats one, for the tests of duplicate ids)
QUESTIONS = list(
    {
        q["question_id"]: q for q in map(json.loads, reversed((SAMPLE / "questions.jsonl").read_text().splitlines()))
    }.values()
)


def _questions(ids: list[str]) -> pd.DataFrame:
    chosen = [q for q in QUESTIONS if q["question_id"] in ids]
    return pd.DataFrame(
        {"question_id": [q["question_id"] for q in chosen], "question": [q["question"] for q in chosen]}
    )


def _keys_asked(body: dict) -> set[str]:
    """The keys of the JSON object a request's structured output asks for (its schema's or grammar's)."""
    schema = (body.get("response_format") or {}).get("schema") or {}
    grammar = body.get("grammar") or ""
    return set(schema.get("properties", {})) | {
        k for k in ("grade", "query", "verdict", "score") if f'\\"{k}\\"' in grammar
    }


def test_every_role_on_the_real_model(on_the_server, sample_indexes):
    server = on_the_server
    cfg = load_config(
        OAI,
        [f"retriever.index={sample_indexes['kb']}", f"web_search.index={sample_indexes['web']}", *EVERY_ROLE, *SHORT],
    )
    before, answered, replies = server.relayed.snapshot(), server.answered(), len(server.relayed.replies)
    df = _questions(["q-en-03", "q-ja-01"])
    out = stages.run_pipeline(df, build_backends(cfg, None), cfg)

    assert list(out["question_id"]) == list(df["question_id"])  # one row per question
    assert out["error"].isna().all(), list(out["error"])
    grades = [d for docs in [*out["graded"], *out["web_results"]] for d in docs if "parse_status" in d]
    unreadable = [d["raw_output"] for d in grades if d["parse_status"] == "failed"]
    assert grades and not unreadable, unreadable
    assert all(q and len(q) <= cfg.rewriter.max_query_chars for q in out["web_query"])
    # the source check ran on the questions whose web search found anything (a query may find nothing)
    assert any(d["step"] == "verify_web" for log in out["decisions"] for d in log)

    # each role's replies, as the server gave them, read per the role's contract
    seen = server.relayed.replies[replies:]
    by_role: dict[str, list[str]] = {"grade": [], "query": [], "verdict": []}
    for body, reply in seen:
        for key in _keys_asked(body) & set(by_role):
            by_role[key].append(reply)
    assert all(parse_binary(r).status == "ok" for r in by_role["grade"]) and by_role["grade"]
    assert all(0 < len(json.loads(r)["query"]) <= cfg.rewriter.max_query_chars for r in by_role["query"])
    assert all(parse_yes_no(r) is not None for r in by_role["verdict"]) and by_role["verdict"]
    assert len(by_role["query"]) == len(df)

    # crag's counts are the server's: every completion it answered, and the tokens its replies gave
    completions, prompt, completion = (a - b for a, b in zip(server.relayed.snapshot(), before))
    usage = pd.DataFrame(list(out["usage"]))
    assert usage["llm_calls"].sum() == completions == server.answered() - answered
    assert (usage["prompt_tokens"].sum(), usage["completion_tokens"].sum()) == (prompt, completion)
    assert usage["retries"].sum() == 0
    assert server.alive()


@pytest.mark.parametrize("mode", ["grammar", "json_object"])
def test_each_mode_the_server_takes_keeps_every_role_readable(on_the_server, mode):
    cfg = load_config(OAI, [*EVERY_ROLE, *[f"{r}.structured_output={mode}" for r in ("grader", "rewriter")]])
    verify = cfg.web_search.verify.model_copy(update={"structured_output": mode})
    doc = [{"source": "web", "title": "AQ-7 filters", "text": "Replace the HEPA-13 main filter every 12 months."}]
    question, usage = "How often should the HEPA-13 filter be replaced?", Usage()
    [binary] = LLMGrader(OpenAICompatible(cfg.grader), cfg.grader).grade(question, doc, usage)
    query = LLMRewriter(OpenAICompatible(cfg.rewriter), cfg.rewriter).rewrite(question, usage)
    LLMSourceCheck(OpenAICompatible(verify), verify).verify(question, doc, usage)
    assert binary.parse_status == "ok", binary.raw_output
    assert 0 < len(query) <= cfg.rewriter.max_query_chars
    [*_, (body, verdict)] = on_the_server.relayed.replies
    assert _keys_asked(body) == {"verdict"}
    assert parse_yes_no(verdict) is not None, verdict
    assert usage.llm_calls == 3 and on_the_server.alive()


def test_the_score_format_under_the_grammar(on_the_server):
    """The score and its reason as SCORE_SCHEMA's JSON, the score within 0-5. (llama-cpp-python's own
    converter, behind json_object, does not keep an integer to its range: only crag's grammar is
    checked here.)"""
    sets = ["grader.structured_output=grammar", "grader.format=score", "grader.prompt=prompts/grade_score.yaml"]
    scoring = load_config(OAI, [*sets, "grader.max_tokens=80"]).grader  # openai.yaml's 20 is for yes/no
    doc = [{"source": "web", "title": "AQ-7 filters", "text": "Replace the HEPA-13 main filter every 12 months."}]
    [score] = LLMGrader(OpenAICompatible(scoring), scoring).grade("How often is the filter replaced?", doc, Usage())
    assert score.parse_status == "ok", score.raw_output


def test_a_mode_the_server_refuses_is_one_line_and_the_server_lives(on_the_server):
    cfg = load_config(OAI, ["grader.structured_output=json_schema"]).grader
    usage = Usage()
    with pytest.raises(RefusedRequest) as raised:
        LLMGrader(OpenAICompatible(cfg), cfg).grade("q?", [{"source": "web", "text": "x"}], usage)
    assert "HTTP 500" in str(raised.value) and "\n" not in str(raised.value) and "File" not in str(raised.value)
    assert usage.retries == 0 and on_the_server.alive()


def test_crag_run_with_conf_openai(spark, on_the_server, sample_indexes, tmp_path, capsys):
    """conf/openai.yaml as shipped, pointed at the server by its environment variables (documents cut
    short for time), in a real `crag run`."""
    from crag.cli import main

    server = on_the_server
    questions = tmp_path / "questions.jsonl"
    chosen = [q for q in QUESTIONS if q["question_id"] == "q-ja-02"]  # every_role has English and Japanese
    questions.write_text("".join(json.dumps(q) + "\n" for q in chosen))
    before, answered = server.relayed.snapshot(), server.answered()
    overrides = [
        f"retriever.index={sample_indexes['kb']}",
        f"web_search.index={sample_indexes['web']}",
        "mlflow.enabled=false",
        *SHORT,
    ]
    code = main(crag_run_args(tmp_path / "wh", "--run-id", "real", questions=questions, conf=OAI, overrides=overrides))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "errors      0" in out and "latency     p95" in out, out
    answers, grades = run_rows(tmp_path / "wh", "answers"), run_rows(tmp_path / "wh", "grades")
    assert sorted(answers["question_id"]) == sorted(q["question_id"] for q in chosen)
    assert answers["error"].isna().all()
    assert (grades["parse_status"] != "failed").mean() >= 0.95
    completions, prompt, completion = (a - b for a, b in zip(server.relayed.snapshot(), before))
    assert answers["llm_calls"].sum() == completions == server.answered() - answered
    assert (answers["prompt_tokens"].sum(), answers["completion_tokens"].sum()) == (prompt, completion)
    assert server.alive()
