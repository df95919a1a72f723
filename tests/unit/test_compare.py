"""crag.compare's pure functions: the comparison rows, the metric deltas and the summary lines."""

import json

import pandas as pd

from crag.compare import (
    Figures,
    compared,
    config_difference,
    config_line,
    config_values,
    metric_deltas,
    metric_figures,
    render_report,
    summary_lines,
)
from crag.evaluation import METRICS, evaluate


def test_metric_deltas_follow_crag_evals_order_not_the_stored_one():
    stored = ["grader_recall", "web_search_rate", "f1", "refused", "grader_precision", "exact_match"]
    metrics = pd.DataFrame({"metric": stored, "slice": "all", "value": 0.5, "n": 10})
    deltas = metric_deltas(metrics, metrics.iloc[::-1])
    assert deltas["metric"].tolist() == [m for m in METRICS if m in stored]
    assert deltas["metric"].tolist()[:2] == ["exact_match", "f1"] and deltas["metric"].iloc[-1] == "grader_recall"


def test_a_mean_summed_in_another_order_is_no_change_and_no_shared_question_is_said():
    base = pd.DataFrame({"metric": ["f1"], "slice": "all", "value": [0.1 + 0.2 + 0.3], "n": 3})
    candidate = base.assign(value=0.3 + 0.2 + 0.1)  # 0.6000000000000001 against 0.6
    deltas = metric_deltas(base, candidate)
    assert deltas["delta"].tolist() == [0.0] and f"{deltas['delta'][0]:+.3f}" == "+0.000"
    only_base = _run({"a": ("What is one?", "one", "internal", ["one"])})
    only_candidate = _run({"b": ("What is two?", "two", "internal", ["two"])})
    _, figures, deltas, whole = _compared(only_base, only_candidate)
    lines = summary_lines(figures, deltas, whole)
    assert "  answers changed   0 (no question asked alike in both)" in lines and "nan" not in "\n".join(lines)


def _run(questions: dict) -> dict[str, pd.DataFrame]:
    """A run's frames from {question_id: (question, answer, route, gold answers)}; every question is
    expected from the knowledge base, and an answer None is a refusal."""
    answers = pd.DataFrame(
        [
            {
                "question_id": qid,
                "question": question,
                "answer": answer or "I don't know.",
                "route": route,
                "action": "correct",
                "refused": answer is None,
                "web_query": None,
                "n_web": 0,
                "n_relevant": 1,
                "sources": [] if answer is None else [{"source": "internal"}],
            }
            for qid, (question, answer, route, _) in questions.items()
        ]
    )
    grades = pd.DataFrame(
        [
            {
                "question_id": qid,
                "source": "internal",
                "doc_id": "d",
                "parent_id": "d#0",
                "title": "t",
                "grade": grade,
                "relevance": 0.6,
            }
            for qid, (_, answer, _, _) in questions.items()
            for grade in ["yes" if answer else "no"]
        ]
    )
    gold = pd.DataFrame(
        [
            {
                "question_id": qid,
                "answers": golds,
                "is_impossible": False,
                "expected_route": "internal",
                "gold_doc_ids": ["d"],
            }
            for qid, (_, _, _, golds) in questions.items()
        ]
    )
    return {"answers": answers, "grades": grades, "gold": gold, "metrics": evaluate(answers, grades, gold)}


def _compared(base: dict, candidate: dict):
    rows, figures = compared(base, candidate, "base", "cand")
    return rows, figures, *metric_figures(figures, base["metrics"], candidate["metrics"])


def test_a_question_asked_differently_under_the_same_id_is_not_credited_to_the_variant():
    base = _run(
        {
            "same": ("How long is the warranty?", None, "refused", ["5 years"]),
            "spaced": ("How loud is it?", "32 dB.", "internal", ["32 dB"]),
            "reworded": ("How heavy is the AQ-7?", None, "refused", ["6.2 kg"]),
            "regolded": ("Which Wi-Fi band?", "2.4 GHz.", "internal", ["2.4 GHz"]),
        }
    )
    candidate = _run(
        {
            "same": ("How long is the warranty?", "5 years.", "internal", ["5 years"]),
            "spaced": ("how  loud is it?", "32 dB.", "internal", ["32 dB."]),  # case, spaces, punctuation alike
            "reworded": ("How wide is the AQ-7?", "28 cm.", "internal", ["28 cm"]),
            "regolded": ("Which Wi-Fi band?", "5 GHz.", "internal", ["5 GHz"]),
        }
    )
    rows, figures, deltas, whole = _compared(base, candidate)
    rows = rows.set_index("question_id")
    assert rows["question_changed"].to_dict() == {"regolded": False, "reworded": True, "same": False, "spaced": False}
    assert rows["gold_changed"].to_dict() == {"regolded": True, "reworded": True, "same": False, "spaced": False}
    # asked differently: nothing compared; other gold: the answers compared, no metric delta
    assert rows.loc["reworded", ["answer_changed", "route_flip", "n_relevant_delta", "f1_delta"]].isna().all()
    assert rows.loc["reworded", "grade_flips"] == []
    assert rows.loc["regolded", "answer_changed"] and pd.isna(rows.loc["regolded", "answer_contained_delta"])
    assert rows.loc["same", "answer_contained_delta"] == 1.0 and rows.loc["same", "route_flip"]
    lines = summary_lines(figures, deltas, whole)
    assert (
        lines[1]
        == "  set apart         1 asked differently (answers not compared), 1 with other gold (no metric deltas)"
    )
    assert "  route flips       1, refused->internal 1" in lines  # "reworded" flipped too, but is another question
    # the deltas are over the two paired questions; the runs' own figures over all four, apart
    assert deltas.set_index("metric").loc[
        "answer_contained", ["base", "candidate", "n_base", "n_candidate"]
    ].tolist() == [0.5, 1.0, 2, 2]
    assert whole.set_index("metric").loc["answer_contained", ["n_base", "n_candidate"]].tolist() == [4, 4]
    assert "  metrics over the 2 paired questions (in both, asked alike, same gold):" in lines
    assert "  each run over all its questions (different questions: no delta):" in lines


def test_metric_deltas_are_over_the_questions_both_runs_answered():
    """A candidate run over other questions (here one more, answered right) must not look better."""
    questions = {
        "a": ("How long is the warranty?", "5 years.", "internal", ["5 years"]),
        "b": ("How loud is it?", None, "refused", ["32 dB"]),
    }
    extra = {"c": ("Which Wi-Fi band?", "2.4 GHz.", "internal", ["2.4 GHz"])}
    _, figures, deltas, whole = _compared(_run(questions), _run({**questions, **extra}))
    contained = deltas.set_index("metric").loc["answer_contained"]
    assert (contained["delta"], contained["n_base"], contained["n_candidate"]) == (0.0, 2, 2)
    assert whole.set_index("metric").loc["answer_contained", ["n_base", "n_candidate"]].tolist() == [2, 3]
    lines = summary_lines(figures, deltas, whole)
    assert lines[0].endswith("2 questions in both, 0 only in base, 1 only in candidate")
    assert any(line.startswith("  answer_contained     0.500 ->    0.500  (+0.000; n 2 / 2)") for line in lines)
    assert any(line.startswith("  answer_contained     0.500       0.667  (n 2 / 3)") for line in lines)
    # with every question paired, the summary is the one it always was: no second block
    _, figures, deltas, whole = _compared(_run(questions), _run(questions))
    assert whole is None and not any("paired" in line for line in summary_lines(figures, deltas, whole))


def test_the_report_sets_apart_a_question_asked_differently():
    base = _run({"a": ("How heavy is the AQ-7?", None, "refused", ["6.2 kg"])})
    candidate = _run({"a": ("How wide is the AQ-7?", "28 cm.", "internal", ["28 cm"])})
    _, figures, deltas, whole = _compared(base, candidate)
    page = render_report(figures, deltas, whole=whole)
    assert "1 asked differently (answers not compared)" in page and "No answer changed." in page
    assert "No document was graded differently." in page  # its one document flipped, for another question
    assert "Each run over all its questions" in page


def _records(base_cfg: dict, candidate_cfg: dict, hashes=("h1", "h2")):
    return [{"config": json.dumps(c), "config_hash": h} for c, h in zip((base_cfg, candidate_cfg), hashes)]


def test_the_summary_and_report_say_what_the_configs_differ_in():
    base_cfg = {"grader": {"threshold": 0.5, "prompt": "p.yaml"}, "routing": {"policy": "any_irrelevant"}, "k": 1}
    same = {"a": ("What is one?", "one", "internal", ["one"])}
    _, figures, deltas, whole = _compared(_run(same), _run(same))
    alike = config_difference(*_records(base_cfg, base_cfg, ("h1", "h1")))
    assert "  config            the same in both runs" in summary_lines(figures, deltas, whole, alike)
    assert not any(line.startswith("  config") for line in summary_lines(figures, deltas, whole))  # not known: not said
    # equal as stored, but the hashes differ: a value the stored configs mask (a store's text_key)
    masked = config_difference(*_records(base_cfg, base_cfg))
    assert "  config            differ in a value stored masked (the config hashes differ)" in summary_lines(
        figures, deltas, whole, masked
    )
    candidate_cfg = {
        "grader": {"threshold": 0.4, "prompt": "p.yaml"},
        "routing": {"policy": "thresholds", "upper": 0.6, "last_resort": None},
        "k": 1,
        "note": "x" * 100,
    }
    changes = config_difference(
        *_records({**base_cfg, "routing": {**base_cfg["routing"], "last_resort": 0.4}}, candidate_cfg)
    )
    keys = [key for key, _, _ in changes.changes]
    assert keys == ["grader.threshold", "note", "routing.last_resort", "routing.policy", "routing.upper"]
    (line,) = [line for line in summary_lines(figures, deltas, whole, changes) if line.startswith("  config")]
    assert line.startswith('  config            5 keys differ: grader.threshold 0.5 -> 0.4; note (absent) -> "xxx')
    # a key set to null is not a missing key
    assert line.endswith(
        '…; routing.last_resort 0.4 -> null; routing.policy "any_irrelevant" -> "thresholds"; and 1 more (in the report)'
    )
    page = render_report(figures, deltas, whole=whole, config=changes)
    assert "5 keys differ (below)" in page and page.count("<tr><td><code>") == 5
    assert "<td><code>&#34;any_irrelevant&#34;</code></td>" in page  # escaped, as every value of a run
    assert "<td><code>(absent)</code></td><td><code>0.6</code></td>" in page


def test_two_long_values_alike_at_first_are_shown_where_they_differ():
    prompt = "# Concise grounded answer, the header every shipped prompt opens with, and more words\nsystem: $question"
    a, b = config_values(prompt, prompt.replace("$question", "$question (x)"))
    assert a != b and len(a) <= 60 and len(b) <= 60 and a.startswith("…") and "(x)" in b
    assert config_values("x" * 100, "y")[0] == '"' + "x" * 58 + "…"  # unlike at once: cut at the end


def test_a_key_with_control_characters_cannot_forge_a_summary_line():
    forged = {"retriever": {"kwargs": {"a\n  answers changed   99\x1b[2J": 1}}}
    line = config_line(config_difference(*_records({}, forged)))
    assert "\n" not in line and "\x1b" not in line and "\\n  answers changed" in line


def test_the_figures_of_parts_add_up_to_the_figures_of_the_whole():
    """`crag compare` compares the runs one Spark partition of questions at a time and adds up each
    part's Figures: they must be the whole comparison's."""
    base = _run(
        {
            "a": ("How long is the warranty?", None, "refused", ["5 years"]),
            "b": ("How loud is it?", "32 dB.", "internal", ["32 dB"]),
            "c": ("How heavy is the AQ-7?", None, "refused", ["6.2 kg"]),
            "d": ("Which Wi-Fi band?", "2.4 GHz.", "internal", ["2.4 GHz"]),
            "e": ("What colour is it?", "White.", "internal", ["white"]),
            "f": ("Only in base?", "Yes.", "internal", ["yes"]),
        }
    )
    candidate = _run(
        {
            "a": ("How long is the warranty?", "5 years.", "internal", ["5 years"]),
            "b": ("How loud is it?", "It is quiet.", "internal", ["32 dB"]),
            "c": ("How wide is the AQ-7?", "28 cm.", "internal", ["28 cm"]),
            "d": ("Which Wi-Fi band?", "5 GHz.", "internal", ["5 GHz"]),
            "e": ("What colour is it?", None, "refused", ["white"]),
            "g": ("Only in candidate?", "No.", "internal", ["no"]),
        }
    )
    _, whole = compared(base, candidate, "base", "cand")

    def only(run, ids):
        return {name: frame[frame["question_id"].isin(ids)] for name, frame in run.items() if name != "metrics"}

    parts = [
        compared(only(base, ids), only(candidate, ids), "base", "cand", with_gold=True)[1]
        for ids in (["a", "c", "e", "g"], ["b", "d", "f"])
    ]
    added = Figures.combined(parts)
    exact = {k: v for k, v in vars(whole).items() if k not in ("similarity_sum", "metric_totals")}
    assert {k: getattr(added, k) for k in exact} == exact
    assert added.changed == 4 and added.grade_flips == 2 and added.first_flips and added.verdict_changes
    assert abs(added.similarity_sum - whole.similarity_sum) < 1e-9
    for run in (0, 1):
        a, w = (f.metrics(run).set_index(["metric", "slice"]).sort_index() for f in (added, whole))
        assert a.index.equals(w.index) and (a["n"] == w["n"]).all() and ((a["value"] - w["value"]).abs() < 1e-9).all()
