"""The stage cache in whole runs on Spark: a run that changes one stage calls that stage's backend only
(counted on the emulators), and results of one workspace never stand in for another's (the cache's keys
are tested in tests/unit/test_cache.py)."""

from crag.job import run
from tests.support import LOCAL_CONF, REPO, SAMPLE_QUESTIONS, databricks_grader, first_questions, run_rows

QUESTIONS = str(SAMPLE_QUESTIONS)


def test_a_run_against_another_host_does_not_reuse_the_first_hosts_results(
    spark, emulator, monkeypatch, tmp_path, sample_indexes, closed_port
):
    """The failure this guards against: after DATABRICKS_HOST was pointed at another workspace that
    refused every call, a run reported no errors and served the first workspace's stored grades."""
    questions = first_questions(tmp_path / "q.jsonl", 4)
    overrides = [*databricks_grader(sample_indexes["kb"], sample_indexes["web"]), "grader.policy.max_attempts=1"]
    first = run(str(LOCAL_CONF), str(questions), str(tmp_path / "wh"), run_id="first", overrides=overrides, spark=spark)
    first_answers = run_rows(first.warehouse, "answers", first.run_id)
    assert first_answers["error"].isna().all() and first_answers["llm_calls"].sum() > 0

    monkeypatch.setenv("DATABRICKS_HOST", f"http://127.0.0.1:{closed_port}")  # a host where nothing answers
    second = run(
        str(LOCAL_CONF), str(questions), str(tmp_path / "wh"), run_id="second", overrides=overrides, spark=spark
    )
    second_answers = run_rows(second.warehouse, "answers", second.run_id)
    graded = second_answers["n_retrieved"] > 0
    assert graded.any()
    errors = second_answers.loc[graded, "error"].fillna("").tolist()
    assert all(e.startswith("grade: ") for e in errors), errors  # asked the new host, which failed


def test_only_the_changed_stage_calls_its_backend(spark, emulator, tmp_path):
    conf = str(REPO / "conf" / "databricks.yaml")
    run(conf, QUESTIONS, str(tmp_path), run_id="v1", spark=spark)

    def queries():
        return [r for r in emulator.of("vector_search") if r.path.endswith("/query")]

    first = {
        "serving": len(emulator.of("serving")),
        "vector_search": len(queries()),
        "tavily": len(emulator.of("tavily")),
    }
    emulator.reset()
    result = run(
        conf,
        QUESTIONS,
        str(tmp_path),
        run_id="v2",
        overrides=["generator.prompt=prompts/answer_strict.yaml"],
        spark=spark,
    )
    serving = emulator.of("serving")
    assert queries() == [] and emulator.of("tavily") == []
    assert [r for r in serving if "inputs" in r.body] == []  # no grading
    generate = [r for r in serving if "<context>" in r.body["messages"][1]["content"]]
    assert len(generate) == len(serving) > 0  # every call left is an answer with the new prompt
    assert all("give it as the documents word it" in r.body["messages"][0]["content"] for r in generate)
    saved = first["serving"] + first["vector_search"] + first["tavily"] - len(serving)
    assert result.counts.cache_hits >= saved > 0
    emulator.reset()
    run(conf, QUESTIONS, str(tmp_path), run_id="v3", overrides=["cache.enabled=false"], spark=spark)
    assert len(emulator.of("serving")) == first["serving"] and len(emulator.of("tavily")) == first["tavily"]
