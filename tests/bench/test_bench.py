"""The benchmarks' code paths at a tiny size: counts and the bound, not timings."""

import pytest

from bench.throughput import LLM_LATENCY_S, SEARCH_LATENCY_S, busy_profile, lower_bound, run_benchmark


def test_lower_bound_is_the_busiest_endpoint():
    calls = {"serving:chat": 100, "serving:grader": 40, "vector_search:idx": 50, "tavily": 50}
    seconds, busiest = lower_bound(calls, capacity=4)
    assert busiest == "serving:chat" and seconds == pytest.approx(100 * LLM_LATENCY_S / 4)
    assert lower_bound({"tavily": 10}, 2)[0] == pytest.approx(10 * SEARCH_LATENCY_S / 2)


def test_busy_profile_spreads_each_request_over_the_seconds_it_spans():
    spans = [("chat", 10.5, 11.5), ("chat", 10.0, 12.0), ("search", 10.0, 12.0), ("chat", 12.25, 12.75)]
    busy, timeline = busy_profile(spans, "chat", start=10.0, seconds=3)
    assert busy == pytest.approx(3.5)
    assert timeline == pytest.approx([1.5, 1.5, 0.5, 0.0])


def test_throughput_benchmark_at_a_tiny_size(spark, tmp_path, restore_env):
    n = 12
    report = run_benchmark(n=n, graph_n=2, capacity=4, workdir=tmp_path, spark=spark, pipelines=4)
    ours = report["ours"]
    assert report["questions"] == n and ours["errors"] == 0
    assert ours["grading_requests_per_question"] == 1.0  # the batch endpoint: one request per question
    assert ours["calls"]["vector_search:main.crag.chunks_index"] == n and ours["calls"]["tavily"] <= n
    seconds, busiest = lower_bound(ours["calls"], 4)
    assert report["lower_bound_s"] == round(seconds, 2) and report["busiest_endpoint"] == busiest
    assert report["ours_over_bound"] == pytest.approx(ours["wall_s"] / seconds, rel=0.01)
    assert max(ours["peak_in_flight"].values()) <= 4  # the budget kept every endpoint within its capacity
    assert 0 < report["busiest_endpoint_utilisation"] <= 1
    assert max(report["busiest_in_flight_per_second"]) <= 4
    timeline = report["busiest_in_flight_per_second"]  # each second's figure rounded to 0.1
    assert sum(timeline) == pytest.approx(
        report["busiest_endpoint_utilisation"] * 4 * ours["wall_s"],  # utilisation rounded to 0.001
        abs=0.05 * len(timeline) + 0.0005 * 4 * ours["wall_s"] + 0.01,
    )
    again = report["ours_next_run"]  # the same questions into the same warehouse: the same calls
    assert again["errors"] == 0 and again["calls"] == ours["calls"]
    assert again["ours_over_bound"] == pytest.approx(again["wall_s"] / seconds, rel=0.01)
    graph = report["graph"]["calls_per_question"]
    assert graph["vector_search:main.crag.chunks_index"] == 1.0 and graph["serving:crag-batch-grader"] == 1.0
    assert report["graph_over_ours"] > 0


def test_scale_benchmark_at_a_tiny_size(spark, tmp_path):
    from bench.datasets import shared_data_dir

    if not (shared_data_dir() / "squad_v2" / "corpus.jsonl").exists():
        pytest.skip(f"shared datasets not found at {shared_data_dir()}")
    from bench.scale import run_scale

    report = run_scale(60, 300, 50, tmp_path, spark=spark, copies=1)
    assert report["questions"] == 60 and report["errors"] == 0 and report["kb_chunks"] > 3000
    assert report["peak_memory_gb"] > 0 and report["answered"] > 0


def test_stage_overhead_benchmark_runs_the_whole_chain():
    from bench.stage_overhead import _Instant, cpu_ms_per_question

    instant = _Instant()
    assert len(instant.search(["q1", "q2"], 10)) == 2 and len(instant.search("web query", 3)) == 3
    assert cpu_ms_per_question(size=2, questions=4) > 0


def test_quality_actions_setup_draws_answerable_questions_from_both_halves(tmp_path, monkeypatch):
    import json

    from bench import quality

    data = tmp_path / "shared" / "tiny"
    data.mkdir(parents=True)
    titles = ["Alpha", "Beta", "Gamma", "Delta"]  # sorted: Alpha, Beta, Delta, Gamma -> kb Alpha, Delta
    (data / "corpus.jsonl").write_text(
        "".join(json.dumps({"doc_id": f"{t}-0", "title": t, "text": f"{t} is a letter."}) + "\n" for t in titles),
        encoding="utf-8",
    )
    questions = [
        {
            "question_id": f"{t}-{i}",
            "question": f"What is {t}?",
            "answers": [] if i % 2 else [t],
            "is_impossible": bool(i % 2),
            "doc_id": f"{t}-0",
            "title": t,
        }
        for t in titles
        for i in range(6)
    ]
    (data / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
    monkeypatch.setenv("CRAG_SHARED_DATA", str(tmp_path / "shared"))
    monkeypatch.setitem(quality.URL_BASE, "tiny", "https://example.org/")
    prepared = quality.prepare("tiny", tmp_path / "out", per_dataset=8, seed=0, answerable_only=True)
    drawn = [json.loads(line) for line in (prepared["folder"] / "questions.jsonl").read_text().splitlines()]
    assert len(drawn) == 8 and all(q["answers"] and not q["is_impossible"] for q in drawn)
    routes = {q["question_id"].split("-")[0]: q["expected_route"] for q in drawn}
    assert sum(q["expected_route"] == "internal" for q in drawn) == 4
    assert {t for t, r in routes.items() if r == "internal"} <= {"Alpha", "Delta"}
    with_unanswerable = quality.prepare("tiny", tmp_path / "all", per_dataset=8, seed=0)
    assert with_unanswerable["questions"] == 8


def test_popqa_is_drawn_over_squad_articles_and_scored_as_the_paper_counts(tmp_path, monkeypatch):
    import json

    import pandas as pd

    from bench import quality

    shared = tmp_path / "shared"
    (shared / "squad_v2").mkdir(parents=True)
    (shared / "popqa").mkdir()
    articles = [("Normans", "The Normans lived in Normandy."), ("Oxygen", "Oxygen is a gas. Priestley found it.")]
    (shared / "squad_v2" / "corpus.jsonl").write_text(
        "".join(json.dumps({"doc_id": f"{t}-0", "title": t, "text": x}) + "\n" for t, x in articles), encoding="utf-8"
    )
    (shared / "squad_v2" / "questions.jsonl").write_text("", encoding="utf-8")
    popqa = [  # a subject with an article, a long-tail one whose answer is nowhere, and a popular one
        ("popqa-1", "Who discovered Oxygen?", ["Priestley"], "Oxygen", 5000),
        ("popqa-2", "What is Kathy Saltzman's occupation?", ["politician"], "Kathy Saltzman", 40),
        ("popqa-3", "In what country is Normandy?", ["France"], "Normandy", 900),
    ]
    (shared / "popqa" / "questions.jsonl").write_text(
        "".join(
            json.dumps({"question_id": i, "question": q, "answers": a, "s_wiki_title": t, "s_pop": pop}) + "\n"
            for i, q, a, t, pop in popqa
        ),
        encoding="utf-8",
    )
    monkeypatch.setenv("CRAG_SHARED_DATA", str(shared))
    prepared = quality.prepare("popqa", tmp_path / "out", per_dataset=1000, seed=0)
    assert prepared["questions"] == 3 and prepared["kb_docs"] == 1 and prepared["web_docs"] == 1
    assert prepared["subjects_with_an_article"] == 1 and prepared["answers_in_corpus"] == 1
    drawn = pd.read_json(prepared["folder"] / "questions.jsonl", lines=True)
    assert "expected_route" not in drawn and set(drawn["question_id"]) == {"popqa-1", "popqa-2", "popqa-3"}

    answers = pd.DataFrame(
        {
            "question_id": ["popqa-1", "popqa-2", "popqa-3"],
            "answer": ["Joseph Priestley found it.", "I don't know.", "France is a country."],
            "refused": [False, True, True],  # a refused answer is wrong whatever its text
        }
    )
    popularity = json.loads((prepared["folder"] / "popularity.json").read_text())
    figures = quality.popqa_figures(answers, drawn, popularity)
    assert figures == {
        "accuracy": round(1 / 3, 4),
        "n": 3,
        "long_tail_accuracy": 0.0,
        "long_tail_n": 1,
        "refused": round(2 / 3, 4),
    }


def test_tree_rss_counts_a_helper_the_jvm_spawned_not_as_a_second_jvm():
    from bench.scale import tree_rss

    gb = 2**30
    tree = [(1, 0, "python", 1 * gb), (2, 1, "java", 2 * gb), (3, 2, "python", gb // 2), (4, 3, "python", gb // 2)]
    assert tree_rss(tree) == 4 * gb
    # a chmod the JVM is spawning: before it execs, it reads as the JVM's whole RSS (named after the
    # JVM's thread that spawned it)
    assert tree_rss([*tree, (5, 2, "Executor task l", 2 * gb), (6, 2, "chmod", 0)]) == 4 * gb
