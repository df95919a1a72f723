import re
from functools import partial

import numpy as np
import pandas as pd
import pytest

from crag.calibration import (
    RoutingProposal,
    _parsed,
    best_cut,
    calibrate,
    docs_of,
    local_aggregate,
    propose_grade_threshold,
    propose_routing,
    refit_semantic,
    report,
    routing_scores,
)
from crag.evaluation import action_confusion, contained, evaluate, exact_match, f1, normalize_answer, question_scores


def test_english_normalisation_is_squads():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert exact_match("the Eiffel tower.", "Eiffel Tower") == 1.0
    assert exact_match("Eiffel", "Eiffel Tower") == 0.0


def test_token_f1_by_hand():
    # prediction tokens: replace filter every 12 months ; gold: every 12 months -> common 3
    # precision 3/5, recall 3/3 -> F1 = 2*0.6*1/(1.6) = 0.75
    assert f1("Replace the filter every 12 months.", "every 12 months") == pytest.approx(0.75)
    assert f1("nothing alike", "every 12 months") == 0.0


def test_japanese_is_compared_by_character():
    assert normalize_answer("１２か月、です。") == "12か月です"
    # prediction 12か月ごと (6 chars) vs gold 12か月 (4 chars): common 4 -> P 4/6, R 1 -> F1 0.8
    assert f1("12か月ごと", "12か月") == pytest.approx(0.8)
    assert exact_match("１２か月。", "12か月") == 1.0
    assert contained("交換は12か月ごとです。", "12か月") == 1.0


def test_a_japanese_answer_is_scored_by_character_against_a_latin_gold_answer():
    """Without spaces, 品番はHF-713です would be one word that never equals HF-713."""
    # characters 品番はhf713です (10) against hf713 (5): common 5 -> P 1/2, R 1 -> F1 2/3
    assert f1("品番はHF-713です", "HF-713") == pytest.approx(2 / 3)
    assert f1("HF-713", "品番はHF-713です") == pytest.approx(2 / 3)
    assert exact_match("ＨＦ－７１３", "HF-713") == 1.0


def test_a_prediction_is_normalised_as_its_gold_answer_is():
    """An English answer quoting a Chinese title keeps its spaces, so it still contains the English gold
    answer; a Japanese answer holding an English gold answer contains it too."""
    answer = "The museum keeps the Golden Lantern. Its scroll (《春江図》) came later."
    assert contained(answer, "the Golden Lantern") == 1.0
    assert exact_match("Golden  Lantern (《灯》)", "Golden Lantern (灯)") == 1.0
    assert f1(answer, "Golden Lantern") > 0.2
    assert contained("AQ-7は2.4GHzのWi-Fiに接続できます。", "2.4GHz") == 1.0


def test_a_gold_answer_is_contained_only_as_whole_words():
    assert contained("The warranty is 15 years.", "5 years") == 0.0
    assert contained("Released in 19910.", "1991") == 0.0
    assert contained("Released in 1991, then 19910.", "1991") == 1.0  # a later occurrence stands alone
    assert contained("The 5 years warranty.", "5 years") == 1.0
    # Japanese has no spaces: a CJK neighbour ends no word, a digit next to a digit still does
    assert contained("保証期間は15年です。", "5年") == 0.0
    assert contained("保証期間は5年です。", "5年") == 1.0
    assert contained("品番はHF-713です", "HF-713") == 1.0
    assert contained("品番はHF-7131です", "HF-713") == 0.0


def test_contained_needs_a_nonempty_gold():
    assert contained("anything", "") == 0.0 and contained("It is 3,776 metres.", "3,776 metres") == 1.0


def _tables():
    answers = pd.DataFrame(
        [
            # internal question answered from the knowledge base
            dict(
                question_id="a",
                question="How often?",
                answer="Every 12 months.",
                route="internal",
                action="correct",
                refused=False,
                web_query=None,
                n_web=0,
                sources=[{"source": "internal"}],
            ),
            # web question wrongly answered from the knowledge base
            dict(
                question_id="b",
                question="How high is Fuji?",
                answer="It is tall.",
                route="internal",
                action="correct",
                refused=False,
                web_query=None,
                n_web=0,
                sources=[{"source": "internal"}],
            ),
            # question nobody can answer, refused
            dict(
                question_id="c",
                question="誰が描いた？",
                answer="I don't know",
                route="refused",
                action="incorrect",
                refused=True,
                web_query="描いた",
                n_web=1,
                sources=[],
            ),
        ]
    )
    grades = pd.DataFrame(
        [
            dict(question_id="a", source="internal", doc_id="d1", grade="yes", relevance=0.9),
            dict(question_id="a", source="internal", doc_id="d2", grade="yes", relevance=0.7),
            dict(question_id="b", source="internal", doc_id="d3", grade="no", relevance=0.2),
        ]
    )
    gold = pd.DataFrame(
        [
            dict(
                question_id="a",
                answers=["12 months"],
                is_impossible=False,
                expected_route="internal",
                gold_doc_ids=["d1"],
            ),
            dict(
                question_id="b",
                answers=["3,776 metres"],
                is_impossible=False,
                expected_route="web",
                gold_doc_ids=["w1"],
            ),
            dict(question_id="c", answers=[], is_impossible=True, expected_route="none", gold_doc_ids=[]),
        ]
    )
    return answers, grades, gold


def _value(metrics: pd.DataFrame, metric: str, slice_: str = "all") -> float:
    """A metric's value in `evaluate`'s rows indexed by (metric, slice)."""
    return metrics.loc[(metric, slice_), "value"]


def test_evaluate_by_hand():
    m = evaluate(*_tables()).set_index(["metric", "slice"])
    value = partial(_value, m)
    assert value("answer_contained") == 0.5 and m.loc[("answer_contained", "all"), "n"] == 2
    assert value("routing_accuracy") == pytest.approx(2 / 3)  # a right, b wrong (no web source), c refused
    assert value("refusal_correct") == 1.0 and value("refused") == pytest.approx(1 / 3)
    assert value("recall_at_k") == 1.0 and m.loc[("recall_at_k", "all"), "n"] == 1
    assert value("grader_precision") == 0.5  # d1 gold, d2 not
    assert value("grader_recall") == 1.0
    assert value("routing_accuracy", "language=ja") == 1.0
    assert value("routing_accuracy", "expected_route=web") == 0.0
    assert ("web_recall", "all") not in m.index  # b never searched the web


def test_documents_not_graded_count_as_retrieved_not_as_grades():
    """A document the grader's call failed on (parse_status not_graded, grade null) was retrieved (it
    counts for recall_at_k) but not graded: it is no miss of the grader's."""
    answers, grades, gold = _tables()
    grades = grades.astype({"grade": object, "relevance": object})
    grades.loc[grades["doc_id"] == "d1", ["grade", "relevance"]] = None
    m = evaluate(answers, grades, gold).set_index(["metric", "slice"])
    assert m.loc[("recall_at_k", "all"), "value"] == 1.0  # d1 was retrieved
    assert m.loc[("grader_precision", "all"), "value"] == 0.0 and m.loc[("grader_precision", "all"), "n"] == 1  # d2
    assert ("grader_recall", "all") not in m.index  # the one gold document was never graded


def test_a_blank_gold_answer_makes_no_question_answerable():
    """SQuAD 2.0 writes `answers: [""]` for a question without an answer: it is scored as one with
    no gold answer, not as an answerable question that every answer misses."""
    answers, grades, gold = _tables()
    gold["answers"] = [["12 months", " "], [""], [" ", ""]]
    gold["expected_route"] = None
    gold["is_impossible"] = None
    scores = question_scores(answers, grades, gold).set_index("question_id")
    assert scores["answerable"].to_dict() == {"a": "yes", "b": "no", "c": "no"}
    assert scores.loc["a", "answer_contained"] == 1.0
    assert scores.loc[["b", "c"], ["exact_match", "f1", "answerable_refused", "refusal_correct"]].isna().all().all()


def test_a_question_without_a_gold_row_counts_in_the_metrics_that_need_no_gold():
    """A JSONL line without gold keys has no gold row; its refusal, web search and action still count,
    as they do for a Parquet row whose gold columns are null."""
    answers, grades, gold = _tables()
    extra = answers[answers["question_id"] == "c"].assign(question_id="d", question="No gold?")
    answers = pd.concat([answers, extra], ignore_index=True)
    m = evaluate(answers, grades, gold).set_index(["metric", "slice"])
    assert m.loc[("refused", "all"), "n"] == 4 and m.loc[("refused", "all"), "value"] == 0.5
    assert m.loc[("web_search_rate", "all"), "n"] == 4 and m.loc[("action_incorrect", "all"), "n"] == 4
    assert m.loc[("answer_contained", "all"), "n"] == 2 and m.loc[("refusal_correct", "all"), "n"] == 3
    with_null_gold = pd.concat([gold, pd.DataFrame([dict(question_id="d")])], ignore_index=True)
    pd.testing.assert_frame_equal(evaluate(answers, grades, with_null_gold).set_index(["metric", "slice"]), m)


def test_action_accuracy_and_confusion_by_hand():
    answers, grades, gold = _tables()
    more = pd.DataFrame(
        [
            # internal question: ambiguous, answered from both collections citing the knowledge base.
            # routing_accuracy credits it (it cites internal), action_accuracy does not.
            dict(
                question_id="d",
                question="How loud?",
                answer="32 dB.",
                route="mixed",
                action="ambiguous",
                refused=False,
                web_query="loud",
                n_web=1,
                sources=[{"source": "internal"}],
            ),
            # web question sent to the web only: the right action
            dict(
                question_id="e",
                question="Who founded it?",
                answer="Someone.",
                route="web",
                action="incorrect",
                refused=False,
                web_query="founded",
                n_web=1,
                sources=[{"source": "web"}],
            ),
        ]
    )
    more_gold = pd.DataFrame(
        [
            dict(
                question_id="d", answers=["32 dB"], is_impossible=False, expected_route="internal", gold_doc_ids=["d4"]
            ),
            dict(question_id="e", answers=["Someone"], is_impossible=False, expected_route="web", gold_doc_ids=["w2"]),
        ]
    )
    answers, gold = pd.concat([answers, more], ignore_index=True), pd.concat([gold, more_gold], ignore_index=True)
    m = evaluate(answers, grades, gold).set_index(["metric", "slice"])
    value = partial(_value, m)
    # a correct (right), b correct (wrong: web expected), d ambiguous (wrong), e incorrect (right);
    # c (expected none) has no right action and is left out
    assert value("action_accuracy") == 0.5 and m.loc[("action_accuracy", "all"), "n"] == 4
    assert value("routing_accuracy", "expected_route=internal") == 1.0  # a and d both cite internal
    assert value("action_accuracy", "expected_route=internal") == 0.5
    assert value("action_ambiguous", "expected_route=internal") == 0.5
    assert (
        value("action_correct", "expected_route=web") == 0.5 and value("action_incorrect", "expected_route=web") == 0.5
    )
    assert value("answerable_refused") == 0.0 and m.loc[("answerable_refused", "all"), "n"] == 4
    confusion = action_confusion(question_scores(answers, grades, gold))
    assert list(confusion.index) == ["internal", "web", "none"]
    assert confusion.loc["internal"].tolist() == [1, 1, 0, 0]  # correct, ambiguous, incorrect, none
    assert confusion.loc["web"].tolist() == [1, 0, 1, 0]
    assert confusion.loc["none"].tolist() == [0, 0, 1, 0]


def test_calibration_finds_the_known_best_thresholds():
    rng = np.random.default_rng(7)
    # internal questions score 0.62..1, web ones 0..0.38: any cut in between separates them perfectly
    best = np.r_[rng.uniform(0.62, 1, 300), rng.uniform(0, 0.38, 300)]
    internal = np.r_[np.ones(300, bool), np.zeros(300, bool)]
    p = propose_routing(best, internal)
    assert p.accuracy == 1.0 and p.ambiguous_share == 0.0
    assert best[~internal].max() < p.lower == p.upper <= best[internal].min()
    # a deliberately poor setting scores worse
    assert routing_scores(best, internal, 0.1, 0.9).accuracy < 1.0


def test_calibration_with_overlap_prefers_the_least_wrong_cut():
    best = np.array([0.9, 0.8, 0.55, 0.5, 0.45, 0.1])
    internal = np.array([True, True, False, True, False, False])
    p = propose_routing(best, internal)
    assert p.accuracy == pytest.approx(5 / 6)


def _calibration_frames():
    """Two knowledge-base questions (best internal relevance 0.9 and 0.7) and two web ones (0.45 and 0.1);
    the gold documents score 0.9 and 0.7, the other documents of those questions 0.4 and 0.2."""
    rows = [
        ("q1", "g1", 0.9),
        ("q1", "x1", 0.4),
        ("q2", "g2", 0.7),
        ("q2", "x2", 0.2),
        ("q3", "x3", 0.45),
        ("q4", "x4", 0.1),
    ]
    grades = pd.DataFrame(
        [{"question_id": q, "source": "internal", "doc_id": d, "relevance": r, "rationale": None} for q, d, r in rows]
    )
    gold = pd.DataFrame(
        [
            {"question_id": "q1", "expected_route": "internal", "gold_doc_ids": ["g1"]},
            {"question_id": "q2", "expected_route": "internal", "gold_doc_ids": ["g2"]},
            {"question_id": "q3", "expected_route": "web", "gold_doc_ids": []},
            {"question_id": "q4", "expected_route": "web", "gold_doc_ids": []},
        ]
    )
    return grades, gold


def test_calibrate_shows_the_current_settings_next_to_the_proposal():
    grades, gold = _calibration_frames()
    result = calibrate(grades, gold, 0.3, 0.6, current_threshold=0.3, current_policy="any_irrelevant")
    text = report(result)
    # current routing: q1, q2 correct, q3 (0.45) ambiguous = half credit, q4 incorrect -> 3.5 / 4
    assert re.search(
        r"current +lower 0\.300 upper 0\.600: route accuracy 0\.875, correct P/R 1\.000/1\.000, "
        r"incorrect P/R 1\.000/0\.500, ambiguous 0\.250",
        text,
    ), text
    # proposed: one cut between 0.45 and 0.7 separates them all
    assert re.search(r"proposed lower (0\.\d+) upper \1: route accuracy 1\.000", text), text
    assert "the run routed by policy any_irrelevant" in text
    # current grader threshold 0.3: g1, x1, g2 are yes -> precision 2/3, recall 1, F1 0.8
    assert re.search(r"current +0\.300: precision 0\.667, recall 1\.000, F1 0\.800", text), text
    assert re.search(r"proposed 0\.\d+: precision 1\.000, recall 1\.000, F1 1\.000", text), text
    assert 0.4 < result["grade_threshold"][0] <= 0.7


def test_calibrate_says_what_lower_equal_to_upper_means():
    grades, gold = _calibration_frames()
    text = report(calibrate(grades, gold, 0.3, 0.6, current_threshold=0.5))
    p = propose_routing(np.array([0.9, 0.7, 0.45, 0.1]), np.array([True, True, False, False]))
    assert p.lower == p.upper
    assert (
        f"proposed lower = upper: no ambiguous band. Every question is either internal (best relevance >= {p.upper:.3f}"
        in text
    ), text
    assert "answered from a web search" in text
    assert "routed by policy" not in text  # the default: the run used the thresholds policy
    band = RoutingProposal(
        lower=0.3,
        upper=0.6,
        accuracy=0.9,
        correct_precision=1,
        correct_recall=1,
        incorrect_precision=1,
        incorrect_recall=1,
        ambiguous_share=0.1,
        n=10,
    )
    assert "no ambiguous band" not in report({"routing": band, "routing_current": band})


def test_the_printed_thresholds_give_the_reported_figures():
    """Relevance is stored with 4 decimals. Between 0.4981 (web, not gold) and 0.4989 (knowledge base,
    gold) the cut is 0.4985; printed as 0.498 it would send the web question to the knowledge base."""
    grades = pd.DataFrame(
        [
            {"question_id": "kb", "source": "internal", "doc_id": "g", "relevance": 0.4989, "rationale": None},
            {"question_id": "web", "source": "internal", "doc_id": "x", "relevance": 0.4981, "rationale": None},
        ]
    )
    gold = pd.DataFrame(
        [
            {"question_id": "kb", "expected_route": "internal", "gold_doc_ids": ["g"]},
            {"question_id": "web", "expected_route": "web", "gold_doc_ids": ["w"]},
        ]
    )
    text = report(calibrate(grades, gold, 0.3, 0.6, current_threshold=0.5))
    lower, upper = map(float, re.search(r"routing\.lower=(\S+) --set routing\.upper=(\S+)", text).groups())
    best, internal = np.array([0.4989, 0.4981]), np.array([True, False])
    assert "route accuracy 1.000" in text and routing_scores(best, internal, lower, upper).accuracy == 1.0
    threshold = float(re.search(r"grader\.threshold=(\S+)", text).group(1))
    assert "proposed" in text and "F1 1.000" in text
    assert (best >= threshold).tolist() == [True, False]


def test_the_refitted_semantic_relevance_is_the_one_the_printed_weights_give():
    """The thresholds are proposed on the refitted relevance, so it must come from the weights as
    printed (3 decimals), not from the unrounded fit (7 of these 40 differed in the 4th decimal)."""
    rng = np.random.default_rng(3)
    features = [(rng.uniform(0.2, 0.9), rng.uniform(0.7, 0.9)) for _ in range(40)]
    grades = pd.DataFrame(
        [
            {
                "question_id": f"q{i}",
                "source": "internal",
                "doc_id": f"d{i}",
                "relevance": 0.5,
                "rationale": f"lexical {lex:.4f}, cosine {cos:.4f}, language en",
            }
            for i, (lex, cos) in enumerate(features)
        ]
    )
    noise = rng.normal(0, 0.1, len(features))
    gold = pd.DataFrame(
        {
            "question_id": [f"q{i}" for i in range(len(features))],
            "expected_route": None,
            "gold_doc_ids": [
                [f"d{i}"] if lex + cos + e > 1.3 else ["other"]
                for i, ((lex, cos), e) in enumerate(zip(features, noise))
            ],
        }
    )
    docs = docs_of(grades, gold)
    weights, relevance = refit_semantic(local_aggregate(docs))
    w = weights["en"]
    lex, cos = (np.array([float(f"{v:.4f}") for v in column]) for column in zip(*features))
    printed = np.round(1 / (1 + np.exp(-(w["bias"] + w["lexical"] * lex + w["semantic"] * cos))), 4)
    assert relevance(_parsed(docs)).tolist() == printed.tolist()


def test_the_semantic_refit_fits_the_best_cosine_term_on_the_routes():
    """Questions whose route the best document's logit does not tell alone: those whose nearest
    knowledge-base document comes close (its cosine) are expected from the knowledge base more often.
    The refit finds the best_cosine term over the document weights it fitted, and the relevance it
    gives carries the term for knowledge-base documents only."""
    rng = np.random.default_rng(7)
    rows, routes = [], []
    for i in range(2000):
        lex, cos, closeness = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0, 1)
        logit = -4.0 + 3.0 * lex + 5.0 * cos  # the gold document's odds, as the refit will find them
        gold = rng.uniform() < 1 / (1 + np.exp(-logit))
        route_logit = 3.0 * (logit + 6.0 * (closeness - 0.5))  # sharper than a document's odds
        routes.append("internal" if rng.uniform() < 1 / (1 + np.exp(-route_logit)) else "web")
        for j, (a, b, source) in enumerate(
            [(lex, cos, "internal"), (lex / 2, closeness, "internal"), (lex, cos / 2, "web")]
        ):
            rows.append(
                {
                    "question_id": f"q{i}",
                    "source": source,
                    "doc_id": f"d{i}-{j}",
                    "relevance": 0.5,
                    "rationale": f"lexical {a:.4f}, cosine {b:.4f}, language en",
                    "gold": gold and j == 0,
                }
            )
    grades = pd.DataFrame(rows)
    gold = pd.DataFrame(
        {
            "question_id": [f"q{i}" for i in range(2000)],
            "expected_route": routes,
            "gold_doc_ids": [
                list(grades.loc[grades["question_id"].eq(f"q{i}") & grades["gold"], "doc_id"]) or ["other"]
                for i in range(2000)
            ],
        }
    )
    # a tenth of the web questions are answerable from nowhere: no gold documents, routed all the same
    nowhere = (gold["expected_route"] == "web") & (np.arange(2000) % 10 == 0)
    gold.loc[nowhere, "expected_route"] = "none"
    gold.loc[nowhere, "gold_doc_ids"] = pd.Series([[] for _ in range(int(nowhere.sum()))], index=gold.index[nowhere])
    docs = docs_of(grades.drop(columns="gold"), gold)
    weights, relevance = refit_semantic(local_aggregate(docs))
    w = weights["en"]
    assert w["best_cosine"] > 1 and 0 < w["best_cosine_center"] < 1, w
    parsed = _parsed(docs)
    got = relevance(parsed)
    best = parsed["cosine"].where(parsed["source"] == "internal").groupby(parsed["question_id"]).transform("max")
    documents = w["bias"] + w["lexical"] * parsed["lexical"] + w["semantic"] * parsed["cosine"]
    term = (w["best_cosine"] * (best - w["best_cosine_center"])).where(parsed["source"] == "internal", 0.0)
    assert got.tolist() == np.round(1 / (1 + np.exp(-(documents + term))), 4).tolist()
    # and routing on it beats routing on the documents' own odds
    table = parsed.assign(with_term=got, without=1 / (1 + np.exp(-documents)))
    internal = (
        table[table["source"] == "internal"]
        .groupby("question_id")
        .agg(with_term=("with_term", "max"), without=("without", "max"), route=("expected_route", "first"))
    )
    expected = (internal["route"] == "internal").to_numpy()
    accuracy = {k: best_cut(internal[k].to_numpy(), expected)[1] for k in ("with_term", "without")}
    assert accuracy["with_term"] > accuracy["without"], accuracy


def test_calibrate_fits_no_threshold_to_a_binary_grader():
    """An LLM grader of format binary stores relevance 1 (yes) or 0 (no): its grades are scored, and no
    threshold is proposed, since none would change them."""
    grades, gold = _calibration_frames()
    grades["relevance"] = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]  # g1 yes, x1 yes, g2 no, x2 no, x3 yes, x4 no
    result = calibrate(grades, gold, 0.3, 0.6, current_threshold=0.6, binary_grader=True)
    assert "grade_threshold" not in result
    text = report(result)
    # over q1 and q2 (the questions with gold documents): yes = g1, x1 -> precision 1/2, recall 1/2
    assert "no threshold to fit; its grades against gold_doc_ids: precision 0.500, recall 0.500, F1 0.500" in text
    assert "grader.threshold" not in text


def test_grade_threshold():
    t, precision, recall, score = propose_grade_threshold(
        np.array([0.9, 0.8, 0.3, 0.2]), np.array([True, True, False, False])
    )
    assert 0.3 < t <= 0.8 and (precision, recall, score) == (1.0, 1.0, 1.0)


def test_web_recall_counts_only_where_web_results_were_stored():
    """Web results are stored (as grades) only when they are graded: ungraded ones are no miss."""
    answers = pd.DataFrame(
        [
            dict(
                question_id=q,
                question="How high is Fuji?",
                answer="3,776 m.",
                route="web",
                action="incorrect",
                refused=False,
                web_query="Fuji height",
                sources=[{"source": "web"}],
                n_web=n,
            )
            for q, n in (("graded", 3), ("ungraded", 3), ("nothing found", 0))
        ]
    )
    grades = pd.DataFrame([dict(question_id="graded", source="web", doc_id="w1", grade="yes", relevance=0.9)])
    gold = pd.DataFrame(
        [
            dict(question_id=q, answers=["3,776"], is_impossible=False, expected_route="web", gold_doc_ids=["w1"])
            for q in ("graded", "ungraded", "nothing found")
        ]
    )
    m = evaluate(answers, grades, gold).set_index(["metric", "slice"])
    assert m.loc[("web_recall", "all"), "value"] == 0.5 and m.loc[("web_recall", "all"), "n"] == 2


def test_calibrate_scores_the_grader_with_its_web_rule():
    """The lexical grader also says yes to a web result below its threshold (web_threshold and two
    question terms): the current figures are the run's own grades, and the proposal keeps that rule."""
    grades, gold = _calibration_frames()
    grades["grade"] = np.where(grades["relevance"] >= 0.5, "yes", "no")
    web = pd.DataFrame(
        [{"question_id": "q3", "source": "web", "doc_id": "w3", "relevance": 0.3, "grade": "yes", "rationale": None}]
    )
    grades = pd.concat([grades, web], ignore_index=True)
    gold.loc[gold["question_id"] == "q3", "gold_doc_ids"] = pd.Series(
        [["w3"]], index=gold.index[gold["question_id"] == "q3"]
    )
    result = calibrate(grades, gold, 0.3, 0.6, current_threshold=0.5)
    # the run said yes to g1, g2 (>= 0.5) and w3 (web rule): all three gold
    assert result["grade_threshold_current"][1:3] == (1.0, 1.0)
    assert result["grade_threshold"][1:3] == (1.0, 1.0)  # w3 stays yes whatever the threshold
