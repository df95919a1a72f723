"""The whole job on Spark with the production backends (Vector Search, model serving, Tavily; and an
OpenAI-compatible server), every real client pointed at the emulator."""

import json
import time

import pandas as pd
import pytest

from crag import batches as crag_batches
from crag.cli import main
from crag.job import run
from crag.ledger import Ledger
from tests.support import REPO, SAMPLE, TOKEN, crag_run_args, run_rows, uniform_questions

QUESTIONS = SAMPLE / "questions.jsonl"
table = run_rows


def test_databricks_services_end_to_end(spark, emulator, tmp_path):
    warehouse = tmp_path
    run(str(REPO / "conf" / "databricks.yaml"), str(QUESTIONS), str(warehouse), run_id="dbx", spark=spark)
    answers, grades = table(warehouse, "answers"), table(warehouse, "grades")
    assert len(answers) == 49 and answers["question_id"].is_unique and answers["error"].isna().all()
    # one batch-grading request per question that retrieved anything
    batch = [r for r in emulator.of("serving") if "inputs" in r.body]
    assert len(batch) == (answers["n_retrieved"] > 0).sum()
    assert sum(len(r.body["inputs"]) for r in batch) == len(grades) == answers["n_retrieved"].sum()
    # every call is accounted for in the answers table
    assert answers["llm_calls"].sum() == len(emulator.of("serving"))
    vs_queries = [r for r in emulator.of("vector_search") if r.path.endswith("/query")]
    assert answers["search_calls"].sum() == len(vs_queries) + len(emulator.of("tavily"))
    assert answers["prompt_tokens"].sum() > 0 and answers["completion_tokens"].sum() > 0
    assert all(r.headers["Authorization"] == f"Bearer {TOKEN}" for r in emulator.of("serving"))
    # grades carry the model's raw output and the prompt's hash
    assert grades["raw_output"].str.contains('"grade"').all() and grades["prompt_hash"].nunique() == 1
    assert set(grades["grader"]) == {"databricks:crag-batch-grader"}
    runs = table(warehouse, "runs")
    assert dict(runs.loc[0, "counts"])["llm_calls"] == len(emulator.of("serving"))
    fuji = answers.set_index("question_id").loc["q-web-04"]
    assert fuji["route"] in ("web", "mixed") and "3,776" in fuji["answer"]
    # web results are not graded (grade_results: false), so not stored: web_recall counts only the
    # web questions whose search found nothing (misses), never the ones with results it cannot see
    gold = table(warehouse, "gold").set_index("question_id")
    found_nothing = answers[answers["web_query"].notna() & (answers["n_web"] == 0)]["question_id"]
    expected_web = set(gold.index[(gold["expected_route"] == "web") & gold["gold_doc_ids"].map(len).gt(0)])
    metrics = table(warehouse, "metrics").set_index(["metric", "slice"])
    assert expected_web and not (grades["source"] == "web").any()
    if expected_web & set(found_nothing):
        assert metrics.loc[("web_recall", "all"), "n"] == len(expected_web & set(found_nothing))
    else:
        assert ("web_recall", "all") not in metrics.index
    for name in ("answers", "grades", "decisions", "runs", "rejects"):  # no credential reaches a table
        assert TOKEN not in table(warehouse, name).to_csv(), name


def test_the_heartbeat_commits_while_each_batch_holds_its_tasks(spark, emulator, tmp_path, monkeypatch):
    """A batch's tasks keep their task slots until the batch ends (minutes, on real endpoints). The
    heartbeat's commit is a Spark job too: it must find a slot meanwhile, or a live run falls silent
    and, after tables.stale_run_after_s, another process may take it over. So a batch leaves one slot
    free, and no batch is queued behind a running one (its tasks would take that slot)."""
    emulator.behaviour["serving"].latency_s = 0.2  # two batches of about 7 s
    beats: list[float] = []
    batches: list[tuple[float, float]] = []
    record, compute = Ledger.record, crag_batches._compute

    def recorded(self, status, *args, **kwargs):
        record(self, status, *args, **kwargs)
        if status == "running":  # only the heartbeat records "running" (the claim is a MERGE)
            beats.append(time.perf_counter())

    def timed(*args, **kwargs):
        start = time.perf_counter()
        computed = compute(*args, **kwargs)
        batches.append((start, time.perf_counter()))
        return computed

    monkeypatch.setattr(Ledger, "record", recorded)
    monkeypatch.setattr(crag_batches, "_compute", timed)
    overrides = [
        "tables.stale_run_after_s=0.9",  # a beat every 0.3 s
        "spark.batch_questions=32",
        "spark.batch_seconds=null",  # the second batch: the other 32
        "spark.pipelines_per_task=1",
        "spark.questions_per_pipeline=1",  # one question after another in each task
        "cache.enabled=false",
    ]
    questions = uniform_questions(tmp_path / "questions.jsonl", 64)
    run(str(REPO / "conf" / "databricks.yaml"), str(questions), str(tmp_path), "base", "beats", overrides, spark)
    assert len(batches) == 2 and batches[1][0] >= batches[0][1]  # one batch at a time
    for start, end in batches:
        assert end - start > 5  # long enough for several beats
        # a beat committed while every task of the batch ran (one may slip in before they start)
        assert [beat for beat in beats if start + 1.5 < beat < end - 0.75], (beats, batches)


REMOTE_ROLES = ("retriever", "grader", "rewriter", "generator", "web_search")


@pytest.mark.parametrize(("budget", "tasks"), [(4, 3), (2, 3)])
def test_every_endpoint_stays_within_its_budget_whatever_the_tasks(spark, emulator, tmp_path, budget, tasks):
    """max_concurrency is the requests in flight to an endpoint across the whole job. The tasks that
    run at once share it out exactly (a ceil(budget / tasks) each would overshoot it: 3 x 2 for a
    budget of 4), and a job runs no more tasks than its smallest budget, since every task keeps one
    request in flight at least."""
    emulator.behaviour["serving"].latency_s = 0.05
    overrides = [
        f"spark.partitions={tasks}",
        "spark.pipelines_per_task=4",  # more requests ready than the budget lets through
        "spark.questions_per_pipeline=1",
        "cache.enabled=false",
        *[f"{role}.policy.max_concurrency={budget}" for role in REMOTE_ROLES],
    ]
    # three copies of the sample: its questions take every route, and each task has ~50 to answer
    lines = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "".join(json.dumps({**q, "question_id": f"{q['question_id']}-{i}"}) + "\n" for i in range(3) for q in lines)
    )
    run(str(REPO / "conf" / "databricks.yaml"), str(questions), str(tmp_path), "base", "budget", overrides, spark)
    # the endpoints the questions are answered by (the Vector Search endpoint itself is only described)
    peaks = {e: n for e, n in emulator.peak_in_flight.items() if e.startswith(("serving:", "vector_search:main."))}
    assert len(peaks) == 3 and all(n <= budget for n in peaks.values()), peaks
    assert peaks[max(peaks, key=peaks.get)] == budget, peaks  # and the budget is used, not left idle
    assert emulator.peak_in_flight["tavily"] <= budget


def test_openai_config_from_the_cli(spark, emulator, tmp_path, sample_indexes, capsys):
    code = main(
        crag_run_args(
            tmp_path,
            "--run-id",
            "oai",
            questions=QUESTIONS,
            conf=REPO / "conf" / "openai.yaml",
            overrides=[f"retriever.index={sample_indexes['kb']}", f"web_search.index={sample_indexes['web']}"],
        )
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "questions   51: 49 accepted, 2 rejected" in out and "errors      0" in out
    answers = table(tmp_path, "answers")
    grades = table(tmp_path, "grades")
    # per-document grading over chat completions, one call per graded document
    assert answers["llm_calls"].sum() == len(emulator.of("serving"))
    asked = [(r.body.get("response_format") or {}).get("json_schema", {}).get("name") for r in emulator.of("serving")]
    assert asked.count("relevance_grade") == len(grades)
    # structured_output auto: one probe per client, which the emulator (as vLLM) takes in json_schema
    assert asked.count("probe") >= 1  # once per Python worker: the roles share one client per endpoint
    expected = (
        pd.read_json(QUESTIONS, lines=True).drop_duplicates("question_id").set_index("question_id")["expected_route"]
    )
    web = answers[answers["question_id"].map(expected) == "web"]
    assert (web["route"] == "web").all()


def test_missing_credential_fails_before_any_work(spark, emulator, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TAVILY_API_KEY")
    code = main(crag_run_args(tmp_path, questions=QUESTIONS, conf=REPO / "conf" / "databricks.yaml"))
    assert code == 2
    err = capsys.readouterr().err
    assert err == (
        "crag: error: missing credential for web_search (Tavily): set the environment variable "
        "TAVILY_API_KEY (secret 'crag/tavily_api_key' is read only on Databricks)\n"
    )
    assert emulator.requests == [] and not (tmp_path / "results").exists()
