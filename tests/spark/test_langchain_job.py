"""A LangChain store as the retriever of a Spark job: each worker builds it from the factory."""

import json

from tests.support import REPO, needs, run_rows


@needs("faiss")
def test_a_spark_job_builds_the_store_in_its_workers(spark, stores, tmp_path):

    from crag.job import run

    # Workers import the factory's module: ship it as a job would ship its own code.
    spark.sparkContext.addPyFile(str(REPO / "tests" / "langchain_stores.py"))
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "\n".join(
            json.dumps(q, ensure_ascii=False)
            for q in [
                {"question_id": "filter", "question": "How often should the HEPA-13 main filter be replaced?"},
                {"question_id": "noise", "question": "How many decibels in sleep mode?"},
                {"question_id": "warranty", "question": "保証期間は何年ですか"},
            ]
        ),
        encoding="utf-8",
    )
    warehouse = tmp_path / "warehouse"
    conf = tmp_path / "langchain.yaml"  # the embedded defaults, with the store as the retriever
    conf.write_text("spark:\n  master: local[2]\n", encoding="utf-8")
    run(str(conf), str(questions), str(warehouse), run_id="lc-1", overrides=stores["faiss"], spark=spark)
    grades = run_rows(warehouse, "grades")
    best = grades[grades["rank"] == 1].set_index("question_id")["parent_id"].to_dict()
    assert best == {"filter": "filter#p0", "noise": "noise#p0", "warranty": "warranty#p0"}
    answers = run_rows(warehouse, "answers")
    assert answers["error"].isna().all() and (answers["search_calls"] == 1).all()
