"""The lexical grader's lower cut for web results and the extractive answerer's sentence choice (the two
changes that cut refusals of answerable questions), and the lexical grader's per-language exponents with
their calibration (README "Quality"). Real scorer, small text made here."""

import numpy as np
import pandas as pd
import pytest

from crag.backends.base import Usage
from crag.backends.extractive import ExtractiveGenerator
from crag.backends.lexical import RATIONALE, LexicalGrader, LexicalScorer, combined_score
from crag.calibration import calibrate, report
from crag.config import load_config
from crag.errors import ConfigError
from crag.text import TermWeights, tokenize
from tests.support import LOCAL_CONF

CORPUS = [
    "Sapporo is the capital of Hokkaido and hosted the 1972 Winter Olympics.",
    "Quarks are never observed alone: free quarks are absent, which is called colour confinement.",
    "The Rhine flows from the Alps to the North Sea.",
    "Steam engines drove the industrial revolution in Britain.",
]


def _scorer() -> LexicalScorer:
    return LexicalScorer(TermWeights.from_tokens([tokenize(t) for t in CORPUS]), "cjk_ngram")


def test_a_web_result_sharing_two_question_terms_is_used_from_the_lower_cut():
    scorer = _scorer()
    question = "What is the term for the lack of observable free quarks in physics experiments?"
    page = {"source": "web", "text": CORPUS[1]}
    (relevance,) = [g.relevance for g in LexicalGrader(scorer, 0.5).grade(question, [page], Usage())]
    assert 0.25 <= relevance < 0.5  # a paraphrase: under the knowledge base's cut
    assert LexicalGrader(scorer, 0.5).grade(question, [page], Usage())[0].grade == "no"
    grader = LexicalGrader(scorer, 0.5, web_threshold=0.25)
    assert grader.grade(question, [page], Usage())[0].grade == "yes"
    # the same text in the knowledge base still needs the full threshold: it decides the route
    assert grader.grade(question, [{**page, "source": "internal"}], Usage())[0].grade == "no"


def test_one_shared_word_is_not_enough_for_the_lower_cut():
    scorer = _scorer()
    question = "What is the capital of Australia?"  # no page answers it; one shares "capital"
    page = {"source": "web", "text": CORPUS[0]}
    grade = LexicalGrader(scorer, 0.5, web_threshold=0.25).grade(question, [page], Usage())[0]
    assert 0.25 <= grade.relevance < 0.5 and grade.rationale.startswith("1 of 2")
    assert grade.grade == "no"


def test_the_shipped_config_sets_the_web_cut_and_the_variants_their_own():
    assert load_config(LOCAL_CONF, [], "lexical").grader.web_threshold == 0.25
    for variant in (None, "semantic_use", "semantic"):
        grader = load_config(LOCAL_CONF, [], variant).grader
        assert grader.web_threshold is not None and grader.web_threshold < grader.threshold


def test_a_name_counts_as_a_phrase_only_where_it_is_written_whole():
    """With character n-grams, 東京 and 大学 on one page cover most of 東京大学's terms; the phrase
    signal tells the page that names 東京大学 from it."""
    scorer = _scorer()
    asked = scorer.question_terms("東京大学が創立されたのは何年？")
    whole = scorer.evidence(asked, None, "東京大学は1877年に創立された。")
    scattered = scorer.evidence(asked, None, "東京には多くの大学があり、1877年に創立された学校もある。")
    assert whole.phrases == 1.0 > scattered.phrases
    assert whole.terms - scattered.terms < whole.phrases - scattered.phrases


def test_a_question_that_names_the_title_scores_the_title_signal():
    scorer = _scorer()
    asked = scorer.question_terms("In which year did Sapporo host the Winter Olympics?")
    named = scorer.evidence(asked, "Sapporo", CORPUS[0])
    other = scorer.evidence(asked, "Hokkaido", CORPUS[0])
    untitled = scorer.evidence(asked, None, CORPUS[0])
    assert named.title == 1.0 and other.title == 0.0 and untitled.title is None
    weights = {"terms": 1.0, "phrases": 1.0, "title": 0.5}
    assert combined_score(named, weights) > combined_score(untitled, weights) > combined_score(other, weights)
    # a signal that does not apply is left out of the mean, not counted as 0
    assert combined_score(untitled, weights) == pytest.approx((untitled.terms + untitled.phrases) / 2)
    # terms alone is the term coverage the semantic grader and the answerer use
    assert (
        combined_score(named, {"terms": 1.0, "phrases": 0.0, "title": 0.0})
        == scorer.score(asked.terms, f"Sapporo\n{CORPUS[0]}")[0]
    )


def test_the_grader_separates_a_page_on_the_subject_from_a_page_sharing_its_words():
    """The three signals against term coverage alone: the page about the question's subject gains on
    the page that merely shares words with it."""
    scorer = _scorer()
    question = "When did Sapporo host the Winter Olympics?"
    subject = {"source": "internal", "title": "Sapporo", "text": CORPUS[0]}
    shared = {"source": "internal", "title": "Nagano", "text": "Nagano hosted the Winter Olympics in 1998."}
    terms_only = LexicalGrader(scorer, 0.5, signal_weights={"terms": 1.0, "phrases": 0.0, "title": 0.0})
    combined = LexicalGrader(scorer, 0.5, signal_weights={"terms": 1.0, "phrases": 1.0, "title": 0.5})
    before = [g.relevance for g in terms_only.grade(question, [subject, shared], Usage())]
    after = [g.relevance for g in combined.grade(question, [subject, shared], Usage())]
    assert after[0] - after[1] > before[0] - before[1]
    assert "phrases" in combined.grade(question, [subject], Usage())[0].rationale


def test_the_title_line_is_not_an_answer_sentence():
    """A page's text often starts with its title; the line repeats the question's words and answers nothing."""
    scorer = _scorer()
    context = [{"source": "web", "relevance": 0.9, "title": "Winter_Olympics", "text": f"Winter Olympics\n{CORPUS[0]}"}]
    answer = ExtractiveGenerator(scorer, 1, 0.0, 0.7).generate(
        "Which Winter Olympics did Sapporo host?", context, Usage()
    )
    assert answer.text == CORPUS[0]


def test_the_short_sentence_after_the_match_can_be_the_answer():
    """A Japanese definition often names the thing in a short sentence of its own after the sentence
    that matches the question ("...を感じる。これをテンポという。"). With a minimum coverage per sentence
    that sentence could never be chosen; ranked by coverage and its document's relevance, it is."""
    scorer = _scorer()
    question = "拍の周期の長短によって音楽の速度を感じることを何という？"
    context = [
        {
            "source": "internal",
            "relevance": 0.8,
            "text": "音楽では拍の周期の長短によって速度を感じる。これをテンポという。楽譜には速度記号が書かれる。",
        },
        {
            "source": "internal",
            "relevance": 0.3,
            "text": "周期的な運動は長短の周期で表される。音の高さは周波数で決まる。",
        },
    ]
    strict = ExtractiveGenerator(scorer, 2, 0.2, 0.7).generate(question, context, Usage())
    assert "テンポ" not in strict.text
    answer = ExtractiveGenerator(scorer, 2, 0.0, 0.7).generate(question, context, Usage())
    assert "これをテンポという。" in answer.text and answer.cited == [0]


class _Meaning:
    """A stand-in sentence encoder: a text's vector is the unit vector of the first concept it names."""

    CONCEPTS = (("volcano", "erupt"), ("trail", "path"))

    def _vector(self, text: str) -> np.ndarray:
        hits = [i for i, words in enumerate(self.CONCEPTS) if any(w in text.lower() for w in words)]
        vector = np.zeros(len(self.CONCEPTS), dtype=np.float32)
        vector[hits[:1]] = 1.0
        return vector

    def query(self, text: str) -> np.ndarray:
        return self._vector(text)

    def kept_passages(self, texts: list[str]) -> np.ndarray:
        return np.stack([self._vector(t) for t in texts])


def test_the_cosine_of_question_and_sentence_can_choose_the_sentence():
    """A sentence that shares no word with the question but means what it asks wins once the cosine
    weighs in; without a model, coverage and the document's relevance decide as before."""
    scorer = _scorer()
    question = "When did the mountain last erupt?"
    context = [
        {
            "source": "internal",
            "relevance": 0.9,
            "text": "The mountain trail was last repaired in 2001. Fuji's volcano woke in 1707.",
        }
    ]
    lexical = ExtractiveGenerator(scorer, 1, 0.0, 0.5).generate(question, context, Usage())
    assert lexical.text == "The mountain trail was last repaired in 2001."
    meaning = ExtractiveGenerator(scorer, 1, 0.0, 0.5, cosine=(0.4, _Meaning())).generate(question, context, Usage())
    assert meaning.text == "Fuji's volcano woke in 1707." and meaning.cited == [0]


def test_the_answerers_weights_add_up_to_at_most_one_and_a_cosine_needs_its_model():
    with pytest.raises(ConfigError, match="document_weight \\+ generator.cosine_weight must be at most 1"):
        load_config(LOCAL_CONF, ["generator.document_weight=0.9", "generator.cosine_weight=0.2"], "semantic_use")
    with pytest.raises(ConfigError, match="cosine_weight needs generator.embedding"):
        load_config(LOCAL_CONF, ["generator.embedding=null"], "semantic_use")


def test_the_exponent_of_the_question_language_maps_the_score_to_relevance():
    scorer = _scorer()
    grader = LexicalGrader(scorer, 0.5, exponents={"en": 1.0, "ja": 0.5})
    ja = grader.grade(
        "札幌の冬季オリンピックは何年？", [{"source": "internal", "text": "札幌は北海道の都市です。"}], Usage()
    )[0]
    score = float(RATIONALE.search(ja.rationale)["score"])
    assert 0 < score < 1 and RATIONALE.search(ja.rationale)["language"] == "ja"
    assert ja.relevance == round(score**0.5, 4) > score
    en = grader.grade("Which Winter Olympics did Sapporo host?", [{"source": "internal", "text": CORPUS[0]}], Usage())[
        0
    ]
    assert en.relevance == float(RATIONALE.search(en.rationale)["score"])
    assert RATIONALE.search(en.rationale)["language"] == "en"


def _lexical_run(cuts: dict[str, float]):
    """Grades as the lexical grader stores them: per language, knowledge-base questions whose best
    coverage lies above that language's cut and web questions below it."""
    rng = np.random.default_rng(7)
    grades, gold = [], []
    for lang, cut in cuts.items():
        for q in range(40):
            internal = q % 2 == 0
            best = rng.uniform(cut + 0.02, 0.95) if internal else rng.uniform(0.05, cut - 0.02)
            qid = f"{lang}{q}"
            gold.append({"question_id": qid, "expected_route": "internal" if internal else "web", "gold_doc_ids": []})
            for d, coverage in enumerate((best, best / 2)):
                grades.append(
                    {
                        "question_id": qid,
                        "source": "internal",
                        "doc_id": f"{qid}-{d}",
                        "relevance": round(coverage, 4),
                        "rationale": f"2 of 5 question terms present; terms {coverage:.4f}; score {coverage:.4f}, language {lang}",
                    }
                )
    return pd.DataFrame(grades), pd.DataFrame(gold)


def test_calibrate_fits_one_exponent_per_language_so_that_one_cut_serves_both():
    grades, gold = _lexical_run({"en": 0.6, "ja": 0.4})
    raw = calibrate(grades.assign(rationale=None), gold, 0.5, 0.5, current_threshold=0.5)
    assert "lexical" not in raw and raw["routing"].accuracy < 1.0  # no single cut on coverage fits both
    result = calibrate(grades, gold, 0.5, 0.5, current_threshold=0.5)
    en, ja = result["lexical"]["en"], result["lexical"]["ja"]
    assert 0.55 < en["cut"] < 0.65 and 0.35 < ja["cut"] < 0.45
    assert en["exponent"] > 1 > ja["exponent"]
    assert en["cut"] ** en["exponent"] == pytest.approx(0.5, abs=0.01)
    assert result["routing"].accuracy == 1.0  # on the refitted relevance one cut separates both languages
    text = report(result)
    assert f"--set grader.exponents.en={en['exponent']}" in text and "--set grader.exponents.ja=" in text


def test_a_lexical_refit_whose_thresholds_score_below_the_current_settings_is_dropped(monkeypatch):
    """The refit moves each language's routing cut onto the threshold, and only for languages with
    questions of both routes: the thresholds fitted over it can lose to the current settings."""
    import crag.calibration

    grades, gold = _lexical_run({"en": 0.5})
    kept = calibrate(grades, gold, 0.5, 0.5, current_threshold=0.5)
    assert "lexical" in kept and "lexical_dropped" not in kept
    assert kept["routing"].accuracy >= kept["routing_current"].accuracy
    real = crag.calibration.refit_lexical

    def upside_down(aggregate, threshold):  # a refit that ranks every document the wrong way round
        fitted = real(aggregate, threshold)
        return fitted and (fitted[0], lambda docs: 1 - fitted[1](docs))

    monkeypatch.setattr(crag.calibration, "refit_lexical", upside_down)
    result = calibrate(grades, gold, 0.5, 0.5, current_threshold=0.5)
    plain = calibrate(grades.assign(rationale=None), gold, 0.5, 0.5, current_threshold=0.5)  # no refit at all
    assert result["lexical_dropped"] == ["en"] and "lexical" not in result
    assert result["routing"] == plain["routing"] and result["routing"].accuracy >= result["routing_current"].accuracy
    text = report(result)
    assert "a refit (en) was tried and dropped" in text and "--set grader.exponents" not in text


def test_the_stage_cache_keeps_apart_answers_from_the_same_documents_graded_otherwise():
    """The extractive answer weighs each sentence by its document's relevance, or its answer weight
    where the grader gives one: a grader variant that returns the same documents with other relevances
    or weights gets an answer of its own, not the cached one."""
    from crag.cache import CachedGenerator, StageCache

    question = "Which city hosted the Olympics, and where does the Rhine flow?"
    docs = [{"source": "internal", "doc_id": f"d{i}", "text": CORPUS[i]} for i in (0, 2)]
    first = [{**docs[0], "relevance": 0.9}, {**docs[1], "relevance": 0.1}]
    second = [{**docs[0], "relevance": 0.1}, {**docs[1], "relevance": 0.9}]
    # the first's relevances, the second's weights: the weight is what the answer reads
    weighed = [{**first[0], "answer_weight": 0.1}, {**first[1], "answer_weight": 0.9}]
    generator = ExtractiveGenerator(_scorer(), 1, 0.0, 0.7)
    fresh = [generator.generate(question, context, Usage()).text for context in (first, second, weighed)]
    assert fresh[0] != fresh[1] == fresh[2]  # the relevances decide which sentence answers, else the weights
    cached = CachedGenerator(generator, StageCache({}), "generator")
    assert [cached.generate(question, context, Usage()).text for context in (first, second, weighed)] == fresh
    # without a document weight the relevances are not read, and an LLM's prompt holds no grades:
    # their answers stay shared across grader variants
    from crag.backends.llm_roles import LLMGenerator

    assert not ExtractiveGenerator(_scorer(), 1, 0.0, 0.0).reads_relevance and not LLMGenerator.reads_relevance
