"""The lexical grader's lower cut for web results and the extractive answerer's sentence choice, the two
changes that cut refusals of answerable questions (README "Quality"). Real scorer, small text made here."""

from crag.backends.base import Usage
from crag.backends.extractive import ExtractiveGenerator
from crag.backends.lexical import LexicalGrader, LexicalScorer
from crag.config import load_config
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


def test_the_shipped_config_sets_the_web_cut_and_the_semantic_variant_clears_it():
    assert load_config(LOCAL_CONF).grader.web_threshold == 0.25
    assert load_config(LOCAL_CONF, [], "semantic").grader.web_threshold is None


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
