"""The semantic signal: the packaged multilingual-e5-small model, dense vectors written by crag index,
the hybrid retriever, the semantic grader and its per-language calibration, and the extractive
answerer's answer from the best document. Real model, small data made here."""

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from crag.backends.base import Usage
from crag.backends.bm25 import BM25Retriever, load_index
from crag.backends.embedding import load_embedder
from crag.backends.extractive import ExtractiveGenerator
from crag.backends.hybrid import HybridRetriever
from crag.backends.lexical import LexicalScorer
from crag.backends.semantic import RATIONALE, SemanticGrader
from crag.calibration import calibrate, fit_logistic, logistic_moments, newton, report
from crag.config import (
    HybridRetrieverConfig,
    IndexingConfig,
    LanguageCalibration,
    SemanticGraderConfig,
    SemanticLanguages,
    load_config,
)
from crag.errors import UnusableIndexError
from crag.indexing import build_index
from crag.text import TermWeights
from tests.support import assert_nearest_passages, write_embedding_docs

MODEL = "multilingual-e5-small"


@pytest.fixture(scope="module")
def dense_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    build_index(write_embedding_docs(root / "docs.jsonl"), root / "index", IndexingConfig(embedding=MODEL))
    return root


def test_the_packaged_model_embeds_english_and_japanese():
    # each question is closest to the passage that answers it, across languages too
    assert_nearest_passages(
        MODEL,
        [
            ("Where does the feline nap?", 0),
            ("Why did shares drop?", 1),
            ("How tall is Mount Fuji?", 2),
            ("猫はどこで寝ていますか？", 0),
        ],
    )


def test_crag_index_writes_dense_vectors_and_a_rebuild_without_them_removes_them(dense_index, tmp_path):
    manifest = json.loads((dense_index / "index" / "manifest.json").read_text())
    assert manifest["embedding"] == MODEL
    index = load_index(str(dense_index / "index"))
    assert index.dense.shape == (manifest["n_chunks"], load_embedder(MODEL).dim)
    plain = tmp_path / "plain"
    build_index(dense_index / "docs.jsonl", plain, IndexingConfig(embedding=MODEL))
    build_index(dense_index / "docs.jsonl", plain, IndexingConfig())
    from crag.backends.bm25 import index_data

    assert not (index_data(plain) / "dense.npy").exists()
    with pytest.raises(UnusableIndexError, match="needs dense vectors"):
        HybridRetriever(HybridRetrieverConfig(backend="hybrid"), str(plain))


def test_hybrid_retriever_finds_a_paraphrase_that_bm25_misses(dense_index):
    path = str(dense_index / "index")
    question = "Where does the feline nap?"  # no word in common with the cat document
    lexical = BM25Retriever(path).search([question], 10)[0]
    assert "cat" not in [d["doc_id"] for d in lexical]
    usage = Usage()
    hybrid = HybridRetriever(HybridRetrieverConfig(backend="hybrid", candidates=3), path).search(
        [question, "interest rates"], 10, [usage, None]
    )
    assert hybrid[0][0]["doc_id"] == "cat" and hybrid[0][0]["source"] == "internal"
    assert hybrid[1][0]["doc_id"] == "market"  # a lexical match still ranks first
    assert [d["rank"] for d in hybrid[0]] == list(range(1, len(hybrid[0]) + 1)) and usage.search_calls == 1


def _grader(dense_index, languages=None, threshold=0.5, embedding="use-multilingual-v3"):
    index = load_index(str(dense_index / "index"))
    cfg = SemanticGraderConfig(
        backend="semantic",
        threshold=threshold,
        embedding=embedding,
        **({"languages": SemanticLanguages(**languages)} if languages else {}),
    )
    return SemanticGrader(LexicalScorer(index.term_weights, index.tokenizer), cfg, {"internal": index}), index


def test_semantic_grader_combines_lexical_and_cosine_per_language(dense_index):
    weights = {
        "en": LanguageCalibration(lexical=2.0, semantic=20.0, bias=-17.0),
        "ja": LanguageCalibration(lexical=1.0, semantic=10.0, bias=-9.0),
    }
    grader, index = _grader(dense_index, weights)
    docs = index.search(["cat sofa stock prices 富士山"], 10, source="internal")[0]
    assert {d["doc_id"] for d in docs} == {"cat", "market", "volcano"}
    for question, lang, best in (("Where does the feline nap?", "en", "cat"), ("富士山の高さは？", "ja", "volcano")):
        grades = grader.grade(question, docs, Usage())
        by_doc = {d["doc_id"]: g for d, g in zip(docs, grades)}
        assert max(by_doc, key=lambda k: by_doc[k].relevance) == best, question
        for g in grades:  # the relevance is the language's formula over the recorded lexical and cosine
            found = RATIONALE.search(g.rationale)
            assert found["language"] == lang
            w = weights[lang]
            z = w.bias + w.lexical * float(found["lexical"]) + w.semantic * float(found["cosine"])
            assert g.relevance == pytest.approx(1 / (1 + np.exp(-z)), abs=1e-3)  # both recorded to 4 places
            assert g.grade == ("yes" if g.relevance >= 0.5 else "no")
            # the answerer's weight: the same logit in lexical-relevance units, 0.5 at the probability's 0.5
            assert g.answer_weight == pytest.approx(0.5 + z / w.lexical, abs=1e-3)
    # a document that is not in the index (a refined strip, a Tavily result) is embedded when graded
    strip = {**docs[0], "text": "The cat sleeps."}
    indexed = grader.cosine("Where does the feline nap?", next(d for d in docs if d["doc_id"] == "cat"))
    assert grader.cosine("Where does the feline nap?", strip) != indexed
    assert grader.cosine("Where does the feline nap?", strip) > grader.cosine(
        "Where does the feline nap?", docs[1] if docs[1]["doc_id"] == "market" else docs[0]
    )


def test_the_best_cosine_term_lifts_a_questions_knowledge_base_documents_alike_and_no_web_result(dense_index):
    """best_cosine adds best_cosine * (best - center) to each knowledge-base document's logit, `best`
    the highest cosine among the knowledge-base documents graded together; a web result graded in the
    same call gets no such term (and its rationale records none)."""
    plain = LanguageCalibration(lexical=2.0, semantic=20.0, bias=-17.0)
    termed = plain.model_copy(update={"best_cosine": 3.0, "best_cosine_center": 0.2})
    grader, index = _grader(dense_index, {"en": termed, "ja": plain})
    docs = index.search(["cat sofa stock prices"], 10, source="internal")[0]
    question = "Where does the feline nap?"
    # the closest text of all, so that a web result counted in `best` would move every term
    web = {**docs[0], "source": "web", "doc_id": "web-cat", "text": question, "parent_id": None}
    grades = grader.grade(question, [*docs, web], Usage())
    found = [RATIONALE.search(g.rationale) for g in grades]
    best = max(float(f["cosine"]) for f in found[:-1])
    for g, f in zip(grades[:-1], found[:-1]):
        z = plain.bias + plain.lexical * float(f["lexical"]) + plain.semantic * float(f["cosine"])
        assert float(f["term"]) == pytest.approx(3.0 * (best - 0.2), abs=1e-4)
        assert g.relevance == pytest.approx(1 / (1 + np.exp(-(z + 3.0 * (best - 0.2)))), abs=1e-3)
        assert g.answer_weight == pytest.approx(0.5 + (z + 3.0 * (best - 0.2)) / plain.lexical, abs=1e-3)
    assert found[-1]["term"] is None and "best cosine" not in grades[-1].rationale
    z = plain.bias + plain.lexical * float(found[-1]["lexical"]) + plain.semantic * float(found[-1]["cosine"])
    assert grades[-1].relevance == pytest.approx(1 / (1 + np.exp(-z)), abs=1e-3)
    # without the term (the default), the same documents' relevances are the plain formula's
    unchanged = _grader(dense_index, {"en": plain, "ja": plain})[0].grade(question, docs, Usage())
    assert all("best cosine" not in g.rationale for g in unchanged)
    for g, f in zip(unchanged, found[:-1]):
        z = plain.bias + plain.lexical * float(f["lexical"]) + plain.semantic * float(f["cosine"])
        assert g.relevance == pytest.approx(1 / (1 + np.exp(-z)), abs=1e-3)


def test_logistic_fit_recovers_known_weights():
    rng = np.random.default_rng(3)
    x = rng.uniform(0, 1, (4000, 2))
    true = np.array([-4.0, 3.0, 5.0])
    y = (rng.uniform(size=4000) < 1 / (1 + np.exp(-(true[0] + x @ true[1:])))).astype(float)
    assert fit_logistic(x, y) == pytest.approx(true, abs=0.6)


def test_the_languages_regressions_step_together_each_as_if_fitted_alone():
    """newton() fits one regression per language, every step's sums made in one pass over the data (a
    Spark job in crag calibrate): as many passes as the slowest language needs, not their sum."""
    rng = np.random.default_rng(4)
    data = {}
    for key, true in (("en", np.array([-4.0, 3.0, 5.0])), ("ja", np.array([-1.0, 6.0, 0.0]))):
        x = rng.uniform(0, 1, (2000, 2))
        data[key] = (x, (rng.uniform(size=2000) < 1 / (1 + np.exp(-(true[0] + x @ true[1:])))).astype(float))
    passes = []

    def moments(weights):
        passes.append(sorted(weights))
        return {key: logistic_moments(*data[key], w) for key, w in weights.items()}

    together = newton(moments, ["en", "ja"])
    for key, (x, y) in data.items():
        assert together[key] == pytest.approx(fit_logistic(x, y), abs=1e-9)
    alone = {key: len([p for p in passes if key in p]) for key in data}
    assert passes[0] == ["en", "ja"] and len(passes) == max(alone.values()) < sum(alone.values())


def test_calibrate_fits_each_language_and_proposes_thresholds_on_the_refit_relevance():
    rng = np.random.default_rng(5)
    grades, gold = [], []
    for q in range(200):
        lang = "ja" if q % 2 else "en"
        offset = 0.1 if lang == "ja" else 0.0  # Japanese cosines sit higher for the same relevance
        internal = q < 100
        gold.append(
            {
                "question_id": f"q{q}",
                "expected_route": "internal" if internal else "web",
                "gold_doc_ids": [f"q{q}-gold"] if internal else [f"w{q}"],
            }
        )
        for d in range(5):
            is_gold = internal and d == 0
            cosine = (0.85 if is_gold else 0.75) + offset + rng.normal(0, 0.02)
            grades.append(
                {
                    "question_id": f"q{q}",
                    "source": "internal",
                    "doc_id": f"q{q}-gold" if is_gold else f"q{q}-{d}",
                    "relevance": 0.5,
                    "rationale": f"lexical {rng.uniform(0, 1):.4f}, cosine {cosine:.4f}, language {lang}",
                }
            )
    result = calibrate(pd.DataFrame(grades), pd.DataFrame(gold), 0.3, 0.6, current_threshold=0.5)
    # the run's own settings are scored on the relevance it stored (0.5 everywhere), not on the refit
    assert result["routing_current"].ambiguous_share == 1.0
    assert result["grade_threshold_current"][1:3] == (pytest.approx(0.1), 1.0)  # every document yes, 1 in 5 gold
    en, ja = result["semantic"]["en"], result["semantic"]["ja"]
    assert en["semantic"] > 10 and ja["semantic"] > 10
    assert ja["bias"] < en["bias"]  # the same probability needs a higher Japanese cosine
    assert result["routing"].accuracy > 0.95  # one pair of thresholds serves both languages after the refit
    text = report(result)
    assert "--set grader.languages.ja.bias=" in text and "routing.lower=" in text


def test_a_japanese_question_under_the_english_model_is_graded_and_weighed_as_the_lexical_grader_does(dense_index):
    """all-MiniLM-L6-v2 gives Japanese text no vector and its fitted Japanese weights no cosine: the
    probability crosses the threshold where the lexical relevance does, and the answer weight is the
    lexical relevance itself, so a Japanese question is answered as with the lexical grader."""
    from crag.backends import _lexical_grader
    from crag.config import LexicalGraderConfig

    grader, index = _grader(dense_index, embedding="all-minilm-l6-v2")  # the model's fitted weights
    assert grader.cfg.languages.ja.semantic == 0 and grader.cfg.languages.ja.best_cosine == 0
    # the lexical grader as `grader.backend: lexical` builds it, with its default exponents and signals
    plain = _lexical_grader(SimpleNamespace(scorer=grader.scorer), LexicalGraderConfig())
    docs = index.search(["富士山 cat sofa stock prices"], 10, source="internal")[0]
    question = "富士山の高さは？"
    grades, lexical = grader.grade(question, docs, Usage()), plain.grade(question, docs, Usage())
    assert len({g.relevance for g in lexical}) > 1  # documents the lexical grader tells apart
    assert [g.answer_weight for g in grades] == [g.relevance for g in lexical]
    assert [g.grade for g in grades] == [g.grade for g in lexical]
    # an English question's weight holds the cosine: not the lexical relevance
    english = "Where does the feline nap?"
    assert [g.answer_weight for g in grader.grade(english, docs, Usage())] != [
        g.relevance for g in plain.grade(english, docs, Usage())
    ]


def test_extractive_answer_from_the_best_document_instead_of_a_refusal():
    scorer = LexicalScorer(TermWeights({}, 1), "cjk_ngram")
    context = [
        {"source": "internal", "text": "Opening hours vary. The shop opens at nine.", "relevance": 0.4},
        {"source": "web", "text": "Tickets cost five euros. Children enter free.", "relevance": 0.9},
    ]
    question = "What is the admission price?"  # no sentence shares a word with it
    assert ExtractiveGenerator(scorer, 2, 0.2, 0.5).generate(question, context, Usage()).text is None
    answer = ExtractiveGenerator(scorer, 2, 0.2, 0.5, answer_from_best_document=True).generate(
        question, context, Usage()
    )
    assert answer.cited == [1] and answer.text == "Tickets cost five euros. Children enter free."
    # a sentence that reaches the minimum still wins over the fallback
    matched = [*context, {"source": "internal", "text": "The admission price is ten euros.", "relevance": 0.3}]
    answer = ExtractiveGenerator(scorer, 2, 0.2, 0.5, answer_from_best_document=True).generate(
        question, matched, Usage()
    )
    assert answer.cited == [2]


def test_semantic_grader_config_overrides_one_language_and_keeps_the_other(tmp_path):
    from tests.support import LOCAL_CONF

    cfg = load_config(
        LOCAL_CONF,
        [
            "grader.backend=semantic",
            "grader.languages.en.lexical=1",
            "grader.languages.en.semantic=2",
            "grader.languages.en.bias=-3",
        ],
    )
    # a language given is its own whole: the model's question-level term, fitted around the model's
    # bias, is not left beside another
    assert cfg.grader.languages.en == LanguageCalibration(lexical=1, semantic=2, bias=-3)
    assert SemanticGraderConfig(backend="semantic", embedding=cfg.grader.embedding).languages.en.best_cosine > 0
    assert (
        cfg.grader.languages.ja == SemanticGraderConfig(backend="semantic", embedding=cfg.grader.embedding).languages.ja
    )
